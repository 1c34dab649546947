"""Many sequences from bounded caches: forks of a prefilled state and batched continuous decoding (keydiff.decode),
each sequence checked against decoding it alone (same tokens, same kept positions)."""

from __future__ import annotations

import pytest
import torch

import keydiff
from keydiff import available_policies, build_policy, generate, prefill
from keydiff.testing import variant
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
CASES = extended_unless(VARIANTS, lambda case: case[0] in CORE_POLICIES and not case[1], IDS)


def prompts(lengths=(90, 23, 130, 61), seed: int = 7) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


def kept(cache) -> list[torch.Tensor]:
    return [positions.clone() for positions in cache.kept_positions()]


def same_kept(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def sampled(seed: int, new_tokens: int = 12) -> dict:
    return {"max_new_tokens": new_tokens, "do_sample": True, "temperature": 0.9, "seed": seed, "eos_token_ids": ()}


def settings_of(key: int) -> dict:
    """Different lengths, stop rules and sampling per sequence, so that they stop at different steps."""
    return {"max_new_tokens": (9, 14, 5, 11)[key % 4], "do_sample": key % 2 == 1, "temperature": 0.9,
            "seed": 100 + key, "eos_token_ids": (3, 17), "min_new_tokens": 2}


def alone(model, states, settings) -> list[tuple]:
    """Each of `states()` decoded on its own: its tokens and kept positions."""
    return [(generate(model, s, **kw).token_ids[0], kept(s.cache)) for s, kw in zip(states(), settings)]


def together(model, expected, states, settings, width: int, decoder=None, **options):
    """Fresh `states()` decoded together through a Decoder of `width`, each as `expected`: (states, decoder)."""
    batch = states()
    decoder = keydiff.Decoder(model, width, **options) if decoder is None else decoder
    got = dict(decoder.generate([keydiff.Request(s, key=i, **kw) for i, (s, kw) in enumerate(zip(batch, settings))]))
    for key, (tokens, positions) in enumerate(expected):
        assert got[key].token_ids[0] == tokens, (width, options, key)
        assert same_kept(kept(batch[key].cache), positions), (width, options, key)
    return batch, decoder


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
        assert generate(model, fork, 12, do_sample=True, temperature=0.8, seed=seed).token_ids == expected.token_ids
        assert same_kept(kept(fork.cache), kept(alone.cache))
    alone = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)  # the forked-from state is untouched
    assert generate(model, state, 12).token_ids == generate(model, alone, 12).token_ids


def test_fork_refuses_a_decoded_state(model):
    state = prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK)
    generate(model, state, 2)
    with pytest.raises(RuntimeError, match="fork before generate"):
        state.fork(2)
    with pytest.raises(ValueError, match="positive integer"):
        prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK).fork(0)


@pytest.mark.extended
@pytest.mark.parametrize("name,params", CASES)
def test_batch_of_four_equals_separate_runs(model, name, params):
    """Exact because these prompts hold no exactly tied scores (a batched product may round a key ~1e-7 otherwise)."""
    all_ids = prompts() + prompts((45, 77))
    expected = {}
    for key, ids in enumerate(all_ids):
        state = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
        expected[key] = (generate(model, state, **settings_of(key)).token_ids[0], kept(state.cache))
    for batch_size in (1, 4):
        caches, got = {}, {}

        def requests():
            for key, ids in enumerate(all_ids):
                state = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
                caches[key] = state.cache
                yield keydiff.Request(state, key=key, **settings_of(key))

        for key, out in keydiff.generate_batch(model, requests(), batch_size):
            got[key] = (out.token_ids[0], kept(caches[key]), out)
        assert sorted(got) == sorted(expected)
        for key, (tokens, positions) in expected.items():
            assert got[key][0] == tokens and same_kept(got[key][1], positions), (batch_size, key)
    assert max(max(out.batch_sizes, default=0) for _, _, out in got.values()) == 4


def logged(name: str, log: list):
    """Policy `name` whose every eviction logs the positions and attention statistic it scored."""
    policy = build_policy(name)

    def evict_indices(self, layer, budget):
        log.append((layer.positions.clone(), None if layer.attention is None else layer.attention.clone()))
        return type(policy).evict_indices(self, layer, budget)

    return variant(policy, evict_indices=evict_indices)


@pytest.mark.extended
@pytest.mark.parametrize("name", ["h2o", "keydiff"])
def test_no_row_ever_scores_an_entry_of_another_row_or_padding(model, name):
    """Each eviction in a batch sees what it sees alone: its own positions, once each, and the same attention."""
    all_ids = prompts()
    settings = {"max_new_tokens": 30, "eos_token_ids": ()}  # 23 + 30 > N: the short row evicts while decoding
    alone_logs, batch_logs = [], []
    for ids in all_ids:
        alone_logs.append([])
        generate(model, prefill(model, ids, logged(name, alone_logs[-1]), BUDGET, BLOCK), **settings)

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
    """A two-row state decodes its rows together, as one sequence, beside a one-row one: each as alone."""
    two = torch.cat([prompts()[0], prompts((90,))[0].flip(-1)])
    settings = {"max_new_tokens": 7, "eos_token_ids": (3,)}
    alone_two = generate(model, prefill(model, two, "keydiff", BUDGET, BLOCK), **settings)
    alone_one = generate(model, prefill(model, prompts()[2], "keydiff", BUDGET, BLOCK), **settings)
    states = [prefill(model, two, "keydiff", BUDGET, BLOCK), prefill(model, prompts()[2], "keydiff", BUDGET, BLOCK)]
    got = dict(keydiff.generate_batch(model, [keydiff.Request(s, key=i, **settings) for i, s in enumerate(states)], 2))
    assert got[0].token_ids == alone_two.token_ids and len(got[0].token_ids) == 2
    assert got[1].token_ids == alone_one.token_ids
    assert got[1].batch_sizes[0] == 3  # three rows in the first pass: the two-row sequence and the other


@pytest.mark.extended
@pytest.mark.parametrize("attn, statistics", [("eager", "materialized"), ("sdpa", "materialized"), ("eager", "fast")])
@pytest.mark.parametrize("name", extended_unless(["h2o", "snapkv", "keydiff"], lambda name: name == "h2o"))
def test_statistics_modes_kernels_and_no_decode_eviction_batch_like_separate_runs(attn, statistics, name):
    """Rows that keep every token (evict=False) beside rows that evict, under each kernel and statistics mode."""
    from tests.conftest import tiny_llama

    model = tiny_llama(attn)
    params = {"window": 8} if name == "snapkv" else {}
    settings = [{"max_new_tokens": 9, "evict": key % 2 == 0, "eos_token_ids": ()} for key in range(4)]

    def states():
        return [prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK, attention_statistics=statistics)
                for ids in prompts()]

    together(model, alone(model, states, settings), states, settings, 4)


# --- rows side by side (keydiff.decode.blocks): forks of one prefill, and prompts pooled as they join, decode as one
# group in the ordinary step (fixed_shapes=False where a test counts groups; else full rows run in fixed shapes).


@pytest.mark.extended
@pytest.mark.parametrize("name", ["keydiff", "knorm", "sink"])
def test_forks_lie_side_by_side_and_decode_as_one_group_like_separate_runs(model, name):
    """Forks share one arena, a slot each (the bytes of a copy each), and decode as one group like each alone."""
    from keydiff.decode.blocks import poolable

    state = prefill(model, prompts()[2], build_policy(name), BUDGET, BLOCK)
    assert poolable(state.cache) and not state.cache.stack.handle.shared
    settings = [sampled(seed) for seed in range(4)]  # rows diverge: each samples with its own seed

    def forks():
        forks = state.fork(4)
        handles = [fork.cache.stack.handle for fork in forks]
        assert all(h.arena is handles[0].arena and h.shared for h in handles)
        assert [h.slot for h in handles] == [0, 1, 2, 3]
        assert all(fork.cache.kv_cache_bytes == state.cache.kv_cache_bytes for fork in forks)
        return forks

    expected = alone(model, forks, settings)
    for group_rows in (True, False):
        _, decoder = together(model, expected, forks, settings, 4, group_rows=group_rows, fixed_shapes=False)
        assert decoder.stats.group_sizes == ({4: 11} if group_rows else {}), group_rows  # a group of four per pass


@pytest.mark.extended
def test_forks_in_any_batch_order_are_written_and_chosen_as_alone(model):
    """Forks in rows 0, 1, 3, 4 hold slots 2, 0, 3, 1 (write_groups, choose_greedy), beside a masked stop token."""
    state = prefill(model, prompts()[2], build_policy("keydiff"), BUDGET, BLOCK)
    stop = int(state.logits.argmax())  # the first greedy token: a stop token that min_new_tokens must mask
    settings = [{"max_new_tokens": 10}, {"max_new_tokens": 12, "eos_token_ids": (stop,), "min_new_tokens": 6},
                {"max_new_tokens": 13}, sampled(3, 9), {"max_new_tokens": 11}]

    def rows():
        forks = state.fork(4)
        return [forks[2], forks[0], prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK), forks[3], forks[1]]

    expected = alone(model, rows, settings)
    assert expected[0][0] != expected[2][0]  # the greedy rows differ: a mix-up of their tokens would show
    decoder = keydiff.Decoder(model, 5)
    decoder.stats.groups = []  # keep every ordinary pass's groups
    together(model, expected, rows, settings, 5, decoder=decoder)
    assert [1, 4, 0, 3] in decoder.stats.groups[0]  # slots 0..3 are rows 1, 4, 0, 3: one group, out of batch order


@pytest.mark.extended
def test_pooled_rows_prefilled_on_their_own_group_and_decode_as_alone(model):
    """Joining sequences pool into reused slots (copied out when they stop); h2o and short prompts never pool."""
    policies = ["keydiff", "keydiff", "keydiff", "h2o", "keydiff"]
    settings = [sampled(1, 9), sampled(2, 14), sampled(3, 12), sampled(4, 6), sampled(5, 11)]

    def states():
        return [prefill(model, ids, p, BUDGET, BLOCK) for ids, p in zip(prompts((90, 130, 23, 61, 75)), policies)]

    expected = alone(model, states, settings)
    for batch_size, pool_rows in ((2, True), (3, True), (3, False)):
        _, decoder = together(model, expected, states, settings, batch_size, pool_rows=pool_rows, fixed_shapes=False)
        sizes = decoder.stats.group_sizes
        assert (sizes and max(sizes) >= 2) if pool_rows else not sizes, (batch_size, sizes)

