"""Many sequences from bounded caches: forking a prefilled state, and batched continuous decoding
(keydiff.decode), each checked against separate batch-1 runs (same tokens, same kept positions)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import keydiff
from keydiff import available_policies, build_policy, generate, prefill
from tests.conftest import CORE_POLICIES, extended_unless

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 40, 16
# Every registered policy, plus the wrappers and cache layouts that change how a cache is built.
VARIANTS = [(name, {}) for name in available_policies()] + [
    ("keydiff", {"head_budgets": "adakv"}),
    ("snapkv", {"head_budgets": "adakv", "window": 8}),
    ("keydiff", {"key_rerotation": "contiguous"}),
    ("keydiff", {"key_rerotation": True}),
    ("keydiff", {"window_fraction": 0.25}),
    ("keydiff", {"layer_budgets": {"schedule": "pyramid", "beta": 20}}),
    ("keydiff", {"critical": True}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in params.items()) for name, params in VARIANTS]
CASES = extended_unless(VARIANTS, lambda case: case[0] in CORE_POLICIES and not case[1], IDS)  # test-quick: the core


def prompts(lengths=(90, 23, 130, 61)) -> list[torch.Tensor]:
    """Prompts of different lengths, one shorter than the budget N (23 < 40)."""
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


def kept(cache) -> list[torch.Tensor]:
    return [positions.clone() for positions in cache.kept_positions()]


def same_kept(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.extended
@pytest.mark.parametrize("name,params", CASES)
def test_fork_equals_separate_runs(model, name, params):
    ids = prompts()[0]
    state = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
    forks = state.fork(3)
    assert all(f.cache is not state.cache and f.cache.kv_cache_bytes == state.cache.kv_cache_bytes for f in forks)
    for seed, fork in zip((1, 2, 3), forks):
        alone = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
        expected = generate(model, alone, 12, do_sample=True, temperature=0.8, seed=seed)
        got = generate(model, fork, 12, do_sample=True, temperature=0.8, seed=seed)
        assert got.token_ids == expected.token_ids
        assert same_kept(kept(fork.cache), kept(alone.cache))
    # The forked-from state is untouched and still decodes like a fresh one.
    alone = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
    assert generate(model, state, 12).token_ids == generate(model, alone, 12).token_ids


def test_fork_refuses_a_decoded_state(model):
    state = prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK)
    generate(model, state, 2)
    with pytest.raises(RuntimeError, match="fork before generate"):
        state.fork(2)
    with pytest.raises(ValueError, match="positive integer"):
        prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK).fork(0)


def separate(model, name, params, ids, settings) -> tuple[list[int], list[torch.Tensor]]:
    state = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
    out = generate(model, state, **settings)
    return out.token_ids[0], kept(state.cache)


def batched(model, name, params, all_ids, settings_of, batch_size):
    """generate_batch over lazily prefilled requests; {key: (tokens, kept positions, result)}."""
    caches = {}

    def requests():
        for key, ids in enumerate(all_ids):
            state = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
            caches[key] = state.cache
            yield keydiff.Request(state, key=key, **settings_of(key))

    done = {}
    for key, out in keydiff.generate_batch(model, requests(), batch_size):
        done[key] = (out.token_ids[0], kept(caches[key]), out)
    return done


def settings_of(key: int) -> dict:
    """Different lengths, stop rules and sampling per sequence, so that they stop at different steps."""
    return {"max_new_tokens": (9, 14, 5, 11)[key % 4], "do_sample": key % 2 == 1, "temperature": 0.9,
            "seed": 100 + key, "eos_token_ids": (3, 17), "min_new_tokens": 2}


@pytest.mark.extended
@pytest.mark.parametrize("name,params", CASES)
def test_batch_of_four_equals_separate_runs(model, name, params):
    """Every policy at batch 1 and 4 keeps the positions and gives the tokens of separate runs, exactly. Exact here
    because these prompts hold no exactly tied scores: a batched matrix product may round a row's keys ~1e-7
    differently, which can flip an exact tie (K-norm over repeated tokens: RoPE keeps a key's norm), so in general
    a row matches its separate run up to float rounding, as keydiff.decode says."""
    all_ids = prompts() + prompts((45, 77))
    expected = {key: separate(model, name, params, ids, settings_of(key)) for key, ids in enumerate(all_ids)}
    for batch_size in (1, 4):
        got = batched(model, name, params, all_ids, settings_of, batch_size)
        assert sorted(got) == sorted(expected)
        for key, (tokens, positions) in expected.items():
            assert got[key][0] == tokens, (batch_size, key)
            assert same_kept(got[key][1], positions), (batch_size, key)
    assert max(max(out.batch_sizes, default=0) for _, _, out in got.values()) == 4


def logged(name: str, log: list):
    """Policy `name` whose every eviction logs the positions and attention statistic it scored."""
    policy = build_policy(name)
    cls = type(policy)

    def evict_indices(self, layer, budget):
        attention = None if layer.attention is None else layer.attention.clone()
        log.append((layer.positions.clone(), attention))
        return cls.evict_indices(self, layer, budget)

    return type(f"Logged{cls.__name__}", (cls,), {"evict_indices": evict_indices})(
        **{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init})


@pytest.mark.extended
@pytest.mark.parametrize("name", ["h2o", "keydiff"])
def test_no_row_ever_scores_an_entry_of_another_row_or_padding(model, name):
    """Each sequence's evictions see exactly the entries a batch-1 run sees: its own positions, once each, all
    below the tokens it has seen, with the same attention. Padding a short row (23 tokens) to the others'
    length, or letting it read a neighbour's entries, would change what it scores here."""
    all_ids = prompts()
    settings = {"max_new_tokens": 30, "eos_token_ids": ()}  # 23 + 30 > N: the short row evicts while decoding
    alone_logs, batch_logs = [], []
    for ids in all_ids:
        log = []
        generate(model, prefill(model, ids, logged(name, log), BUDGET, BLOCK), **settings)
        alone_logs.append(log)

    def requests():
        for key, ids in enumerate(all_ids):
            batch_logs.append([])
            yield keydiff.Request(prefill(model, ids, logged(name, batch_logs[-1]), BUDGET, BLOCK), key=key, **settings)

    list(keydiff.generate_batch(model, requests(), 4))
    for ids, alone, batch in zip(all_ids, alone_logs, batch_logs):
        assert len(batch) == len(alone) > 0
        for (positions, attention), (expected, expected_attention) in zip(batch, alone):
            assert torch.equal(positions, expected)
            assert int(positions.min()) >= 0 and int(positions.max()) < ids.shape[1] + settings["max_new_tokens"]
            assert all(len(set(head.tolist())) == len(head) for head in positions.reshape(-1, positions.shape[-1]))
            if expected_attention is not None:
                torch.testing.assert_close(attention, expected_attention, rtol=1e-5, atol=1e-6)


def test_batch_cache_refuses_the_models_own_attention(model):
    batch = keydiff.BatchCache(3)
    batch.bind([prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK).cache], [1])
    with pytest.raises(RuntimeError, match="keydiff_attention"):
        model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[90]]), cache=batch)


@pytest.mark.extended
def test_a_multi_row_prefill_decodes_as_one_sequence_beside_others(model):
    """A request whose state holds several rows (one prefill of a [2, L] batch) decodes its rows together, as one
    sequence, beside a one-row request: each gets what it gets decoded alone (keydiff.generate)."""
    two = torch.cat([prompts()[0], prompts((90,))[0].flip(-1)])
    settings = {"max_new_tokens": 7, "eos_token_ids": (3,)}
    alone_two = generate(model, prefill(model, two, "keydiff", BUDGET, BLOCK), **settings)
    alone_one = generate(model, prefill(model, prompts()[2], "keydiff", BUDGET, BLOCK), **settings)
    states = [prefill(model, two, "keydiff", BUDGET, BLOCK), prefill(model, prompts()[2], "keydiff", BUDGET, BLOCK)]
    got = dict(keydiff.generate_batch(model, [keydiff.Request(s, key=i, **settings) for i, s in enumerate(states)], 2))
    assert got[0].token_ids == alone_two.token_ids and len(got[0].token_ids) == 2
    assert got[1].token_ids == alone_one.token_ids
    assert got[1].batch_sizes[0] == 3  # three rows in the first pass: the two-row sequence and the other


def test_bad_batches_are_refused(model):
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        list(keydiff.generate_batch(model, [], 0))


@pytest.mark.extended
@pytest.mark.parametrize("attn, statistics", [("eager", "materialized"), ("sdpa", "materialized"), ("eager", "fast")])
@pytest.mark.parametrize("name", extended_unless(["h2o", "snapkv", "keydiff"], lambda name: name == "h2o"))
def test_statistics_modes_kernels_and_no_decode_eviction_batch_like_separate_runs(attn, statistics, name):
    """Rows that keep every generated token (evict=False) sit beside rows that evict, under each attention
    kernel and statistics mode: every row still decodes as it does alone."""
    from tests.conftest import tiny_llama

    model = tiny_llama(attn)
    all_ids = prompts()

    def state(ids):
        return prefill(model, ids, build_policy(name) if name != "snapkv" else build_policy(name, window=8), BUDGET,
                       BLOCK, attention_statistics=statistics)

    settings = [{"max_new_tokens": 9, "evict": key % 2 == 0, "eos_token_ids": ()} for key in range(len(all_ids))]
    expected = []
    for ids, setting in zip(all_ids, settings):
        alone = state(ids)
        expected.append((generate(model, alone, **setting).token_ids[0], kept(alone.cache)))
    states = [state(ids) for ids in all_ids]
    requests = [keydiff.Request(s, key=key, **setting) for key, (s, setting) in enumerate(zip(states, settings))]
    got = dict(keydiff.generate_batch(model, requests, 4))
    for key, (tokens, positions) in enumerate(expected):
        assert got[key].token_ids[0] == tokens
        assert same_kept(kept(states[key].cache), positions)


# --- rows side by side (keydiff.decode.blocks): forks of one prefill decode as one group -----------------------
# Groups are what the ordinary step runs (fixed_shapes=False where a test counts them): where every going row is
# full and alike, the step runs in fixed shapes instead (tests/test_fixed_shapes.py).


def decoded(model, requests, width: int, **options) -> tuple[dict, "keydiff.Decoder"]:
    """generate_batch's results through a Decoder of its own, and the decoder: its `stats.group_sizes` count the
    groups of rows that attended as one in its ordinary passes (rows -> groups)."""
    decoder = keydiff.Decoder(model, width, **options)
    return dict(decoder.generate(requests)), decoder


def sampled(seed: int, new_tokens: int = 12) -> dict:
    return {"max_new_tokens": new_tokens, "do_sample": True, "temperature": 0.9, "seed": seed, "eos_token_ids": ()}


@pytest.mark.extended
@pytest.mark.parametrize("name", ["keydiff", "knorm", "sink"])
def test_forks_lie_side_by_side_and_decode_as_one_group_like_separate_runs(model, name):
    """Forks of one prefill share one arena, each its own slot (same bytes as a copy each); decoded together they
    attend and evict as one group and give the tokens and kept positions of per-row decoding and of each decoded
    alone (rows diverge: each samples with its own seed)."""
    from keydiff.decode.blocks import poolable

    state = prefill(model, prompts()[2], build_policy(name), BUDGET, BLOCK)
    assert poolable(state.cache) and not state.cache.stack.handle.shared
    expected = []
    for seed, fork in enumerate(state.fork(4)):
        expected.append((generate(model, fork, **sampled(seed)).token_ids[0], kept(fork.cache)))
    for group_rows in (True, False):
        forks = state.fork(4)
        handles = [fork.cache.stack.handle for fork in forks]
        assert all(h.arena is handles[0].arena and h.shared for h in handles)
        assert [h.slot for h in handles] == [0, 1, 2, 3]
        assert all(f.cache.kv_cache_bytes == state.cache.kv_cache_bytes for f in forks)
        requests = [keydiff.Request(fork, key=seed, **sampled(seed)) for seed, fork in enumerate(forks)]
        got, decoder = decoded(model, requests, 4, group_rows=group_rows, fixed_shapes=False)
        for seed, (tokens, positions) in enumerate(expected):
            assert got[seed].token_ids[0] == tokens, (group_rows, seed)
            assert same_kept(kept(forks[seed].cache), positions), (group_rows, seed)
        sizes = decoder.stats.group_sizes  # one group of four at every pass (11)
        assert sizes == ({4: 11} if group_rows else {}), group_rows


@pytest.mark.extended
def test_forks_in_any_batch_order_are_written_and_chosen_as_alone(model):
    """Forks whose batch rows are not in their slots' order (rows 0, 1, 3, 4 hold slots 2, 0, 3, 1) beside a prompt
    prefilled on its own (row 2): each pass's keys and values of the group go to the block in one copy taken in
    slot order (blocks.write_groups), and the greedy rows are chosen by one argmax (step.choose_greedy)
    beside a row whose stop token is still masked (min_new_tokens) and a sampled one; every row gives the
    tokens and kept positions it gets decoded alone."""
    state = prefill(model, prompts()[2], build_policy("keydiff"), BUDGET, BLOCK)
    stop = int(state.logits.argmax())  # the first greedy token: a stop token that min_new_tokens must mask
    settings = [{"max_new_tokens": 10}, {"max_new_tokens": 12, "eos_token_ids": (stop,), "min_new_tokens": 6},
                {"max_new_tokens": 13}, sampled(3, 9), {"max_new_tokens": 11}]

    def rows():
        forks = state.fork(4)
        return [forks[2], forks[0], prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK), forks[3], forks[1]]

    expected = [(generate(model, s, **setting).token_ids[0], kept(s.cache)) for s, setting in zip(rows(), settings)]
    assert expected[0][0] != expected[2][0]  # the greedy rows differ: a mix-up of their tokens would show
    batch = rows()
    decoder = keydiff.Decoder(model, 5)
    decoder.stats.groups = []  # keep every ordinary pass's groups
    got = dict(decoder.generate([keydiff.Request(s, key=r, **setting)
                                 for r, (s, setting) in enumerate(zip(batch, settings))]))
    for r, (tokens, positions) in enumerate(expected):
        assert got[r].token_ids[0] == tokens, r
        assert same_kept(kept(batch[r].cache), positions), r
    first = decoder.stats.groups[0]
    assert [1, 4, 0, 3] in first, first  # slots 0..3 are rows 1, 4, 0, 3: one group, out of batch order


@pytest.mark.extended
def test_a_mixed_batch_groups_only_the_rows_alike(model):
    """Two forks of one prompt beside prompts prefilled on their own (one shorter than N) and a policy that needs
    attention statistics: only the forks group (while their counts are equal), every row decodes as it does
    alone, and refilled slots keep working."""
    short, other = prompts((23, 61))
    base = prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK)

    def states():
        forks = base.fork(3)
        return [forks[0], prefill(model, short, "keydiff", BUDGET, BLOCK), forks[1],
                prefill(model, other, "h2o", BUDGET, BLOCK), forks[2]]

    settings = [sampled(1, 9), sampled(2, 14), sampled(3, 30), sampled(4, 6), sampled(5, 11)]
    expected = [(generate(model, s, **setting).token_ids[0], kept(s.cache)) for s, setting in zip(states(), settings)]
    batch = states()
    requests = [keydiff.Request(s, key=i, **setting) for i, (s, setting) in enumerate(zip(batch, settings))]
    got, decoder = decoded(model, requests, 3)
    for key, (tokens, positions) in enumerate(expected):
        assert got[key].token_ids[0] == tokens, key
        assert same_kept(kept(batch[key].cache), positions), key
    sizes = decoder.stats.group_sizes
    assert sizes and set(sizes) == {2}, sizes  # forks 0 and 1 share slots 0-1 of their block; fork 2 (slot 2) joins later


@pytest.mark.extended
def test_a_group_scores_each_row_over_its_own_entries_only(model):
    """The grouped eviction's one call sees, row for row, exactly what each sequence's own eviction sees alone:
    its positions are the sequences' own, concatenated in slot order (nothing padded, nothing of a neighbour's)."""
    log: list = []
    state = prefill(model, prompts()[2], logged("keydiff", log), BUDGET, BLOCK)
    alone = []
    for seed, fork in enumerate(state.fork(3)):
        log.clear()
        generate(model, fork, **sampled(seed, 8), fixed_shapes=False)  # the ordinary step: one sequence's rows
        alone.append([positions for positions, _ in log])
    log.clear()
    forks = state.fork(3)
    list(keydiff.generate_batch(model, [keydiff.Request(f, key=s, **sampled(s, 8)) for s, f in enumerate(forks)], 3,
                                fixed_shapes=False))
    assert len(log) == len(alone[0]) > 0
    for step, (positions, attention) in enumerate(log):
        assert attention is None
        assert torch.equal(positions, torch.cat([own[step] for own in alone]))


@pytest.mark.extended
def test_a_fork_that_grows_out_of_its_slot_still_counts_the_slot(model):
    """A placed fork that outgrows its slot (decoding without eviction) gets an arena of its own, but the shared
    arena keeps its slot allocated until every fork is gone: the forks' kv_cache_bytes must add up to the shared
    arena plus the new buffers, never less (the review's reproducer: 4 forks, fork 0 decoded 30 tokens with evict=False)."""
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(7))
    forks = prefill(model, ids, "keydiff", 40, 16).fork(4)
    arena = forks[0].cache.stack.handle.arena
    requests = [keydiff.Request(state, key=i, max_new_tokens=30 if i == 0 else 5, evict=i != 0)
                for i, state in enumerate(forks)]
    results = dict(keydiff.generate_batch(model, requests, 4))
    grown = forks[0].cache.stack
    assert not arena.holds(0, grown) and arena.occupant[0] is grown  # it did grow out of its slot, still kept
    held = arena.keys.nbytes + arena.values.nbytes + grown.keys.nbytes + grown.values.nbytes
    assert sum(result.kv_cache_bytes for result in results.values()) == held


def test_between_results_the_model_runs_as_it_was(model):
    """generate_batch switches the attention function once per run of steps, not per step, and never across a
    yield: while the caller holds a result, the model has its own implementation and runs with any cache."""
    original = model.config._attn_implementation
    state = prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK)
    requests = [keydiff.Request(fork, max_new_tokens=3 + 2 * i, key=i) for i, fork in enumerate(state.fork(3))]
    seen = []
    for key, _ in keydiff.generate_batch(model, requests, 3):
        assert model.config._attn_implementation == original, key
        with torch.inference_mode():
            model(input_ids=prompts()[1])  # a plain forward with a fresh cache of its own
        seen.append(key)
    assert seen == [0, 1, 2]


@pytest.mark.extended
def test_pooled_rows_prefilled_on_their_own_group_and_decode_as_alone(model):
    """pool_rows=True moves each joining sequence prefilled on its own into a slot of one arena (blocks.JoinPool):
    rows holding N entries then attend and evict as one group. Five prompts (one shorter than N, one under h2o,
    which never pools) through two and then three slots, so slots are reused: every sequence gives the tokens
    and kept positions it gets alone, also read after the loop (a stopped sequence's entries are copied out
    before its slot is reused); pool_rows=False groups nothing (no two of them lie side by side)."""
    lengths = (90, 130, 23, 61, 75)
    policies = ["keydiff", "keydiff", "keydiff", "h2o", "keydiff"]
    settings = [sampled(1, 9), sampled(2, 14), sampled(3, 12), sampled(4, 6), sampled(5, 11)]

    def states():
        return [prefill(model, ids, policy, BUDGET, BLOCK) for ids, policy in zip(prompts(lengths), policies)]

    expected = [(generate(model, s, **setting).token_ids[0], kept(s.cache)) for s, setting in zip(states(), settings)]
    for batch_size, pool_rows in ((2, True), (3, True), (3, False)):
        batch = states()
        requests = [keydiff.Request(s, key=i, **setting) for i, (s, setting) in enumerate(zip(batch, settings))]
        got, decoder = decoded(model, requests, batch_size, pool_rows=pool_rows, fixed_shapes=False)
        for key, (tokens, positions) in enumerate(expected):
            assert got[key].token_ids[0] == tokens, (batch_size, key)
            assert same_kept(kept(batch[key].cache), positions), (batch_size, key)
        sizes = decoder.stats.group_sizes
        if pool_rows:
            assert sizes and max(sizes) >= 2, batch_size  # separately prefilled rows did group
        else:
            assert not sizes, sizes  # not pooled: nothing lies side by side


def test_join_pool_takes_its_slot_shape_from_a_prompt_of_n_plus_b(model):
    """A prompt shorter than N + B has a smaller capacity: it neither shapes the pool's slots (later prompts of the
    usual N + B could then never join) nor joins. The arena is allocated only when a second sequence like the
    first joins while the first decodes (a lone one allocates nothing); both move in. Forks never move."""
    from keydiff.decode.blocks import JoinPool

    short, long, other, third = (prefill(model, ids, "keydiff", BUDGET, BLOCK) for ids in prompts((23, 90, 130, 61)))
    pool = JoinPool(3)
    assert not pool.place(short.cache) and pool.arena is None
    assert not pool.place(long.cache) and pool.arena is None  # the first like it: waits for a second
    assert pool.place(other.cache) and pool.arena is not None
    assert [(s.cache.stack.handle.arena, s.cache.stack.handle.slot) for s in (long, other)] == [
        (pool.arena, 0), (pool.arena, 1)]
    assert pool.place(third.cache) and third.cache.stack.handle.slot == 2
    fork = long.fork(2)[0]
    assert not pool.place(fork.cache) and fork.cache.stack.handle.arena is not pool.arena
    lone, alone = JoinPool(3), prefill(model, prompts((90,))[0], "keydiff", BUDGET, BLOCK)
    assert not lone.place(alone.cache)
    lone.leave(alone.cache)  # it stopped before any other joined: a later one waits for a second in turn
    assert not lone.place(fork_free(long)) and lone.arena is None


def fork_free(state):
    """A copy of a prefilled state's cache in buffers of its own (as a prompt prefilled alone has)."""
    return state.fork(1)[0].cache


@pytest.mark.extended
def test_neighbours_with_other_policies_never_group(model):
    """KeyDiff beside KeyDiff with a recent window (the same buffers and policy state, so they share the arena):
    rows of different policies lie side by side but never attend or evict as one; each gives what it gets alone.
    At batch 1 nothing is pooled (nothing could group)."""
    policies = [build_policy("keydiff"), build_policy("keydiff", window_fraction=0.25), build_policy("keydiff")]

    def states():
        return [prefill(model, ids, policy, BUDGET, BLOCK) for ids, policy in zip(prompts((90, 130, 75)), policies)]

    expected = [(generate(model, s, max_new_tokens=10).token_ids[0], kept(s.cache)) for s in states()]
    batch = states()
    got, decoder = decoded(model, [keydiff.Request(s, max_new_tokens=10, key=i) for i, s in enumerate(batch)], 3)
    assert all(s.cache.stack.handle.shared and s.cache.stack.handle.slot == i for i, s in enumerate(batch))
    assert not decoder.stats.group_sizes, decoder.stats.group_sizes
    for key, (tokens, positions) in enumerate(expected):
        assert got[key].token_ids[0] == tokens and same_kept(kept(batch[key].cache), positions), key
    alone = states()[0]
    dict(keydiff.generate_batch(model, [keydiff.Request(alone, max_new_tokens=3)], 1))
    assert not alone.cache.stack.handle.shared
