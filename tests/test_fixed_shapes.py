"""The one decoding step and its fixed-shape form (keydiff.decode.step, keydiff.decode.static), and which
passes the scheduler plans in fixed shapes (keydiff.decode.scheduler).

What must hold on any machine, GPU or not:
  * `keydiff.generate` and `keydiff.generate_batch` run the same step function;
  * the fixed-shape step (decoding, and prefill blocks once the cache is full) gives exactly the tokens, logits,
    kept positions and bookkeeping of the ordinary step, for every policy it takes;
  * rows with no running sequence (idle slots of a block) can hold anything: no active row's result changes, and
    their own kept entries are left as they were;
  * the step compiles as ONE graph with `fullgraph=True` and is never recompiled across steps: no graph break
    (no branch on a tensor's value), no value read out of a tensor (.item(), int(), float(): a host
    synchronisation, which fullgraph captures rather than refuses) and no shape that changes.
  * a sequence moved from its own stack into a block leaves nothing holding the buffers it left, and a profiled
    cache (timing statistics and evictions apart) never takes the fixed step.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import keydiff
from keydiff import build_policy, generate, prefill
from keydiff.attention import keydiff_attention
from keydiff.decode import static
from keydiff.decode.scheduler import read_cache
from keydiff.decode.static import StaticStep
from tests.conftest import CORE_POLICIES, extended_unless

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 40, 16
# Every policy the fixed step takes (Needs.capturable), and KeyDiff and H2O inside a recent window.
FIXED = ["keydiff", "keydiff_pairwise", "knorm", "sink", "recent", "keydiff-window", "h2o", "tova", "snapkv",
         "h2o-window"]
# Those that score from an attention statistic: never placed in a block, so in fixed shapes only as one sequence alone.
STATISTIC = ("h2o", "tova", "snapkv", "h2o-window")


def policy(name: str):
    if name == "keydiff-window":
        return build_policy("keydiff", window_fraction=0.25)
    if name == "h2o-window":
        return build_policy("h2o", recent_fraction=0.5)
    return build_policy(name)


def prompts(lengths=(90, 130, 61, 75)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


def kept(cache) -> list[list]:
    return [positions.tolist() for positions in cache.kept_positions()]


def kept_state(cache) -> dict[str, torch.Tensor]:
    """The policy state of the kept entries (H2O's accumulated attention, KeyDiff's inverse norms), in position
    order: what the next evictions score, so equal kept positions alone would not show a statistic gone wrong."""
    stack = cache.stack
    n = stack.num_entries
    order = stack.positions[..., :n].argsort(dim=-1)
    return {name: state[..., :n].gather(-1, order).clone() for name, state in stack.state.items()}


def same_states(a: dict, b: dict, exact: bool = True) -> bool:
    """Equal `kept_state`s (bit for bit, or else to float32 rounding), for every key of two {key: kept_state}."""
    if a.keys() != b.keys() or any(a[key].keys() != b[key].keys() for key in a):
        return False
    if exact:
        return all(torch.equal(a[key][name], b[key][name]) for key in a for name in a[key])
    return all(torch.allclose(a[key][name], b[key][name], rtol=1e-6, atol=0) for key in a for name in a[key])


def ready(cache, q: int = 1) -> bool:
    """Whether the scheduler would run the cache's next pass of q tokens in fixed shapes (its record at admission)."""
    return read_cache(cache, q).ready


def decoded(model, requests, width: int, **options) -> tuple[dict, keydiff.Decoder]:
    """generate_batch's results through a Decoder of its own, and the decoder: `stats.runs` counts its fixed-shape
    steps run, per (width, tokens per row)."""
    decoder = keydiff.Decoder(model, width, **options)
    return dict(decoder.generate(requests)), decoder


@pytest.mark.extended
def test_generate_and_generate_batch_run_the_one_step(model, monkeypatch):
    import keydiff.decode.scheduler as scheduler

    calls, original = [], scheduler.decode_step

    def step(scheduler, active):
        calls.append(len(active))
        return original(scheduler, active)

    monkeypatch.setattr(scheduler, "decode_step", step)
    generate(model, prefill(model, prompts()[0], "snapkv", BUDGET, BLOCK), 5)
    assert calls == [1] * 5
    calls.clear()
    states = [prefill(model, ids, "snapkv", BUDGET, BLOCK) for ids in prompts()[:2]]
    dict(keydiff.generate_batch(model, [keydiff.Request(s, 5, key=i) for i, s in enumerate(states)], 2))
    assert calls == [2] * 5


@pytest.mark.extended
@pytest.mark.parametrize("full_width", [False, True], ids=["span", "full-width"])
@pytest.mark.parametrize("name", extended_unless(FIXED, lambda name: name in CORE_POLICIES or name == "keydiff-window"))
def test_fixed_shapes_give_what_the_ordinary_step_gives(model, name, full_width, monkeypatch):
    """Prefill (blocks once the cache is full) and decoding of forks (one block), prompts prefilled apart (pooled
    as they join) and one sequence alone, greedy and sampled: identical tokens, logits, kept positions, peaks and
    bytes with fixed shapes on and off, and the fixed step did run. full-width: every slot of the block runs at
    every step, idle ones included (what a GPU replays as one CUDA graph), here on the CPU's eager step. A policy
    that scores from attention is never placed in a block: its sequences run in fixed shapes only when one goes alone
    (the batch's last, and the sequence alone), with the statistic computed inside the step."""
    from keydiff.decode import step

    ids = prompts()[1]
    prefills = keydiff.Decoder(model, 1)  # made before the arrangement changes: it prefills over the prompt's stack
    on = prefill(model, ids, policy(name), BUDGET, BLOCK, decoder=prefills)
    off = prefill(model, ids, policy(name), BUDGET, BLOCK, fixed_shapes=False)
    runs = prefills.stats.runs  # the prefill's full blocks ran in fixed shapes
    assert runs and all(q == BLOCK for _, q in runs) and prefills.stats.arenas == [], runs
    monkeypatch.setitem(step.FULL_WIDTH, "cpu", full_width)
    assert torch.equal(on.logits, off.logits) and kept(on.cache) == kept(off.cache)
    assert same_states({0: kept_state(on.cache)}, {0: kept_state(off.cache)})
    assert on.max_cache_entries == off.max_cache_entries

    runs = Counter()

    def decode(fixed: bool) -> tuple[dict, dict]:
        forks = prefill(model, ids, policy(name), BUDGET, BLOCK).fork(3)
        apart = [prefill(model, p, policy(name), BUDGET, BLOCK) for p in prompts()[2:]]
        states = forks + apart
        settings = [{"max_new_tokens": 6 + 2 * i, "do_sample": i % 2 == 1, "seed": i, "eos_token_ids": (3,)}
                    for i in range(len(states))]
        requests = [keydiff.Request(s, key=i, **kw) for i, (s, kw) in enumerate(zip(states, settings))]
        out, batch = decoded(model, requests, 3, fixed_shapes=fixed)
        alone = prefill(model, ids, policy(name), BUDGET, BLOCK)
        single, one = decoded(model, [keydiff.Request(alone, 9, key="alone")], 1, fixed_shapes=fixed)
        out.update(single)
        runs.update(batch.stats.runs + one.stats.runs)
        caches = {**{i: s.cache for i, s in enumerate(states)}, "alone": alone.cache}
        return ({key: (r.token_ids, r.finish_reasons, r.batch_sizes, r.max_cache_entries, r.kv_cache_bytes,
                       kept(caches[key]), caches[key].get_seq_length()) for key, r in out.items()},
                {key: kept_state(cache) for key, cache in caches.items()})

    with_fixed, fixed_states = decode(True)
    widths = {width for width, q in runs if q == 1}
    if name in STATISTIC:
        assert widths == {1}  # one sequence alone, over its own stack
    else:
        assert widths == ({1, 3} if full_width else {1, 2, 3})  # a block of three slots; one sequence alone
    runs.clear()
    ordinary, ordinary_states = decode(False)
    assert with_fixed == ordinary and not runs
    # At full width a new entry's state (KeyDiff's inverse key norm) is computed over all W rows of the block, idle
    # ones included, where the ordinary step computes it over its group's rows: the CPU's norm may round the last
    # bit otherwise (seen: 1 ulp; the choices and tokens above are still the same). Everywhere else, bit for bit.
    assert same_states(fixed_states, ordinary_states, exact=not (full_width and name not in STATISTIC))


@pytest.mark.extended
@pytest.mark.parametrize("name", extended_unless(["h2o", "snapkv"], lambda name: name == "h2o"))
def test_an_eager_model_takes_the_statistic_from_its_weights_in_fixed_shapes_too(name):
    """With attn_implementation=eager the ordinary step reads the statistic from the materialised weights; the fixed
    step does the same: prefill blocks and decoding alone give the same logits, kept entries, state and tokens."""
    from tests.conftest import tiny_llama

    model = tiny_llama("eager")
    decoder = keydiff.Decoder(model, 1)
    on = prefill(model, prompts()[1], name, BUDGET, BLOCK, decoder=decoder)
    off = prefill(model, prompts()[1], name, BUDGET, BLOCK, fixed_shapes=False)
    tokens = [generate(model, on, 8, decoder=decoder).token_ids, generate(model, off, 8, fixed_shapes=False).token_ids]
    assert {q for _, q in decoder.stats.runs} == {1, BLOCK} and tokens[0] == tokens[1]
    assert torch.equal(on.logits, off.logits) and kept(on.cache) == kept(off.cache)
    assert same_states({0: kept_state(on.cache)}, {0: kept_state(off.cache)})


@pytest.mark.extended
def test_rows_still_filling_materialized_statistics_and_lagkv_run_the_ordinary_step(model, monkeypatch):
    decoder = keydiff.Decoder(model, 1)
    short = prefill(model, prompts((23,))[0], "keydiff", BUDGET, BLOCK, decoder=decoder)  # holds 23 < N: filling
    assert not ready(short.cache)
    generate(model, short, 30, decoder=decoder)  # 29 passes; the cache holds N after the 17th: the last 12 fixed
    assert decoder.stats.runs == {(1, 1): 12} and decoder.stats.built == [(1, 1)]
    # keydiff.generate with no decoder makes its own with the device's default (fixed_shapes=None; CPU: fixed)
    made = []

    class Kept(keydiff.Decoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(keydiff.engine, "Decoder", Kept)
    generate(model, prefill(model, prompts((23,))[0], "keydiff", BUDGET, BLOCK), 30)
    assert [d.stats.runs for d in made] == [{(1, 1): 12}]
    # materialised attention weights (the eager path, the paper's latency setting); partitions counted on the host
    for name, statistics in (("snapkv", "materialized"), ("h2o", "materialized"), ("lagkv", "fast")):
        decoder = keydiff.Decoder(model, 1)
        state = prefill(model, prompts()[0], name, BUDGET, BLOCK, attention_statistics=statistics, decoder=decoder)
        assert not ready(state.cache) and not decoder.stats.runs, name
        generate(model, state, 5, decoder=decoder)
        assert not decoder.stats.runs and not decoder.stats.built, name
    state = prefill(model, prompts()[0], "snapkv", BUDGET, BLOCK)  # the same policy with "fast" statistics
    assert ready(state.cache)


def test_a_statistic_policy_runs_in_fixed_shapes_only_where_every_layer_writes_its_statistic(model, monkeypatch):
    """The statistic is written by keydiff's attention function: a step run with another attention implementation,
    or on a model whose forward does not hand keyword arguments on to its attention function (here: layer 1's
    write lost), would evict on a stale buffer, so it is refused instead, before anything is evicted."""
    from keydiff.attention import StatisticBuffer

    state = prefill(model, prompts()[1], "tova", BUDGET, BLOCK)
    before = kept(state.cache)
    step = StaticStep(model, state.cache.stack.handle.arena.rows(), state.cache.policy, BUDGET)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="keydiff_attention"):
        step.run(torch.tensor([[5]]), torch.tensor([[130]]), torch.tensor([True]))
    write = StatisticBuffer.write
    monkeypatch.setattr(StatisticBuffer, "write", lambda self, layer, s: None if layer == 1 else write(self, layer, s))
    step = StaticStep(model, state.cache.stack.handle.arena.rows(), state.cache.policy, BUDGET)
    with torch.inference_mode(), keydiff_attention(model, None), pytest.raises(RuntimeError, match=r"layers \[1\]"):
        step.run(torch.tensor([[5]]), torch.tensor([[130]]), torch.tensor([True]))
    assert kept(state.cache) == before


def block_of(model, name: str, width: int):
    """`width` forks of one prefill in one shared arena, and their caches. The forks of a policy that scores from attention
    are never placed (keydiff.decode.blocks.poolable): here they are moved into an arena by hand, to check the
    step itself on W rows, idle ones included."""
    from keydiff.cache.arena import Arena

    forks = prefill(model, prompts()[1], policy(name), BUDGET, BLOCK).fork(width)
    caches = [f.cache for f in forks]
    if not caches[0].stack.handle.shared:
        arena = Arena.like(caches[0].stack, width)
        assert all(arena.take(slot, cache.stack) for slot, cache in enumerate(caches))
    return caches[0].stack.handle.arena, caches


@pytest.mark.extended
@pytest.mark.parametrize("name", ["keydiff", "h2o"])
def test_junk_in_idle_rows_changes_no_active_row(model, name):
    """Two of four slots active: whatever the idle slots hold (zeros, or NaN and huge values), the active rows'
    logits and entries come out bit for bit the same, and the idle slots' kept entries are left untouched, policy
    state included (H2O accumulates every row's statistic into it: an idle row's observation is discarded)."""
    results = []
    for junk in (0.0, float("nan"), 3e38):
        block, caches = block_of(model, name, 4)
        for buffer in (block.keys, block.values):
            buffer[2:].fill_(junk)
        buffers = (block.keys, block.values, block.positions, *block.state.values())
        idle_before = [buffer[2:, :, :, :, :BUDGET].clone() for buffer in buffers]
        step = StaticStep(model, block.rows(), caches[0].policy, BUDGET)
        with torch.inference_mode(), keydiff_attention(model, None):
            logits = step.run(torch.tensor([[5], [9], [0], [0]]), torch.full((4, 1), 130),
                              torch.tensor([True, True, False, False]))
        for before, buffer in zip(idle_before, buffers):
            assert torch.equal(before.nan_to_num(), buffer[2:, :, :, :, :BUDGET].nan_to_num())
            assert torch.equal(before.isnan(), buffer[2:, :, :, :, :BUDGET].isnan())
        results.append((logits[:2].clone(), *(buffer[:2, :, :, :, :BUDGET].clone() for buffer in buffers)))
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))


@pytest.mark.extended
@pytest.mark.parametrize("name", extended_unless(FIXED, lambda name: name in ("keydiff", "h2o")))
@pytest.mark.parametrize("q", [1, BLOCK])
def test_the_step_compiles_as_one_graph_and_never_recompiles(model, name, q):
    """torch.compile(fullgraph=True) fails on any graph break (a Python branch on a tensor's value: what a CUDA graph
    cannot hold). A value read out of a tensor (.item(), int(t), float(t): a host synchronisation, which a CUDA graph
    cannot hold either) is no graph break there: under fullgraph dynamo captures it as a symbolic scalar (torch 2.13:
    capture_scalar_outputs is on with fullgraph), so the backend refuses any symbolic scalar or size in the graph
    (with dynamic=False every real size is a constant). A CompileCounter counts the graphs: one, for steps at other
    positions, tokens and active rows (the shapes and guards never change). The compiled step also computes what
    the eager one does."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter, reads = CompileCounter(), []

    def backend(graph, example_inputs):
        for node in graph.graph.nodes:
            value = node.meta.get("example_value")
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) or (
                        isinstance(v, torch.Tensor) and not all(isinstance(size, int) for size in v.shape)):
                    reads.append(node.format_node())
        return counter(graph, example_inputs)
    width = 1 if q > 1 else 3
    _, caches = block_of(model, name, 3)
    eager_block, eager_caches = block_of(model, name, 3)
    if q > 1:  # a prefill block: one sequence alone in its own stack
        caches = [prefill(model, prompts()[1], policy(name), BUDGET, BLOCK).cache]
        eager_caches = [prefill(model, prompts()[1], policy(name), BUDGET, BLOCK).cache]
    assert all(ready(cache, q) for cache in caches)

    def rows(cs):
        return cs[0].stack.handle.arena.rows()

    compiled = StaticStep(model, rows(caches), caches[0].policy, BUDGET, q)
    compiled.step = torch.compile(compiled.eager, fullgraph=True, dynamic=False, backend=backend)
    eager = StaticStep(model, rows(eager_caches), eager_caches[0].policy, BUDGET, q)
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode(), keydiff_attention(model, None):
        for step in range(3):
            ids = torch.randint(0, 256, (width, q), generator=generator)
            positions = (130 + step * q + torch.arange(q)).expand(width, q)
            active = torch.tensor([True, step != 1, True][:width])
            a, b = compiled.run(ids, positions, active), eager.run(ids, positions, active)
            torch.testing.assert_close(a, b)
    assert counter.frame_count == 1, counter.frame_count
    assert reads == [], reads  # a value read on the host inside the step


@pytest.mark.extended
def test_a_block_whose_going_rows_change_policy_gets_a_step_of_that_policy(model):
    """Two plain KeyDiff sequences fill a block of two slots and decode in fixed shapes; both stop, and two KeyDiff
    sequences in a recent window take the same slots (same buffers, same rows): they must be evicted by their own
    policy, not by the step built for the plain rows (which keeps no window). Each gives what it gives alone."""
    window = build_policy("keydiff", window_fraction=0.75)
    policies = [build_policy("keydiff"), build_policy("keydiff"), window, window]
    lengths = [3, 3, 20, 20]

    def states():
        return [prefill(model, ids, p, BUDGET, BLOCK) for ids, p in zip(prompts((90, 75, 130, 61)), policies)]

    expected = [(generate(model, s, n).token_ids[0], kept(s.cache)) for s, n in zip(states(), lengths)]
    batch = states()
    got, decoder = decoded(model, [keydiff.Request(s, n, key=i) for i, (s, n) in enumerate(zip(batch, lengths))], 2)
    assert [batch[i].cache.stack.handle.slot for i in (2, 3)] == [0, 1]  # the stopped ones' slots
    assert decoder.stats.runs[2, 1] >= 2 + 19  # plain rows, then the windowed rows, in fixed shapes
    assert decoder.stats.built == [(2, 1), (2, 1)]  # a step for the plain rows, then one of the windowed rows' policy
    for key, (tokens, positions) in enumerate(expected):
        assert got[key].token_ids[0] == tokens and kept(batch[key].cache) == positions, key


def test_rows_of_two_policies_in_one_block_never_share_a_fixed_step(model):
    """A plain KeyDiff sequence and one in a recent window, side by side in one block and going together: the
    scheduler plans no fixed step for both (one step evicts with one policy); each gives what it gives alone."""
    policies = [build_policy("keydiff"), build_policy("keydiff", window_fraction=0.75)]

    def states():
        return [prefill(model, ids, p, BUDGET, BLOCK) for ids, p in zip(prompts((90, 130)), policies)]

    expected = [(generate(model, s, 8).token_ids[0], kept(s.cache)) for s in states()]
    batch = states()
    got, decoder = decoded(model, [keydiff.Request(s, 8, key=i) for i, s in enumerate(batch)], 2)
    assert [s.cache.stack.handle.slot for s in batch] == [0, 1] and batch[0].cache.stack.handle.shared  # one arena
    assert (2, 1) not in decoder.stats.runs and decoder.stats.arenas == [2], decoder.stats.runs
    for key, (tokens, positions) in enumerate(expected):
        assert got[key].token_ids[0] == tokens and kept(batch[key].cache) == positions, key


@pytest.mark.extended
@pytest.mark.parametrize("full_width", [False, True], ids=["span", "full-width"])
def test_an_idle_slot_holding_more_than_n_entries_is_left_as_it_is(model, full_width, monkeypatch):
    """Idle slots may hold a sequence's entries beyond N: a held question (held_suffix) not yet decoded, forks of
    it waiting for a place, a sequence that stopped before its first pass. The fixed step of their neighbours
    writes only its active rows, so those entries (positions, keys and values, the ones beyond N included: the
    step writes its new entry at index N of every row it runs), and every token, are what the ordinary step leaves."""
    from keydiff.decode import step

    def entries(cache) -> tuple[list, list, list]:
        """Every entry the cache's stack holds, in position order: positions, keys, values (bit for bit)."""
        stack = cache.stack
        positions = stack.positions[..., :stack.num_entries]
        order = positions.argsort(dim=-1)
        along = order[..., None].expand(*order.shape, stack.keys.shape[-1])
        return (positions.gather(-1, order).tolist(), stack.keys[..., :stack.num_entries, :].gather(-2, along).tolist(),
                stack.values[..., :stack.num_entries, :].gather(-2, along).tolist())

    monkeypatch.setitem(step.FULL_WIDTH, "cpu", full_width)
    generator = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, 256, (1, n), generator=generator) for n in (130, 90, 100)]

    def stopped_in_the_middle(fixed: bool):
        a, c = (prefill(model, p, "keydiff", BUDGET, BLOCK) for p in (ids[0], ids[2]))
        b = prefill(model, ids[1], "keydiff", BUDGET, BLOCK, held_suffix=5)  # holds N + 5 at its first token
        requests = [keydiff.Request(a, 12, key="a"), keydiff.Request(b, 1, key="b"), keydiff.Request(c, 12, key="c")]
        out = dict(keydiff.generate_batch(model, requests, 3, fixed_shapes=fixed))
        assert b.cache.stack.handle.slot == 1 and b.cache.stack.num_entries == BUDGET + 5  # between a and c
        return entries(b.cache), {key: r.token_ids for key, r in out.items()}

    def held_forks_waiting(fixed: bool):
        forks = prefill(model, ids[0], "keydiff", BUDGET, BLOCK, held_suffix=6).fork(4)
        drawn = {}

        def requests():
            for i, fork in enumerate(forks):
                drawn[i] = entries(fork.cache)  # what the fork holds when the scheduler draws it
                yield keydiff.Request(fork, (3, 3, 8, 8)[i], key=i)

        out = dict(keydiff.generate_batch(model, requests(), 2, fixed_shapes=fixed))
        return drawn, {key: r.token_ids for key, r in out.items()}

    for scenario in (stopped_in_the_middle, held_forks_waiting):
        assert scenario(True) == scenario(False), scenario.__name__


@pytest.mark.extended
def test_group_rows_false_runs_every_sequence_on_its_own(model):
    """generate_batch(group_rows=False) is the per-sequence reference: no fixed step spans two sequences (one going
    alone still runs in fixed shapes, over its own rows)."""
    forks = prefill(model, prompts()[1], "keydiff", BUDGET, BLOCK).fork(3)
    requests = [keydiff.Request(f, 4 + 3 * i, key=i) for i, f in enumerate(forks)]
    _, decoder = decoded(model, requests, 3, group_rows=False)
    runs = decoder.stats.runs
    assert runs and {width for width, _ in runs} == {1}, runs


@pytest.mark.unit
def test_a_device_with_no_default_runs_the_ordinary_step():
    """Only the device types FIXED_SHAPES_DEFAULT lists run the fixed step by default (mps, or anything else:
    the ordinary step, never a KeyError)."""
    from keydiff.decode.step import FULL_WIDTH, ModelRunner, fixed_shapes_default

    assert fixed_shapes_default(torch.device("cpu")) and not fixed_shapes_default(torch.device("mps"))
    with torch.device("meta"):
        from tests.conftest import tiny_llama
        model = tiny_llama()
    runner = ModelRunner(model)
    assert runner.fixed_shapes is False and runner.full_width is False and "meta" not in FULL_WIDTH


@pytest.mark.extended
def test_a_sequence_that_moves_into_a_block_leaves_its_own_buffers_free(model):
    """A sequence alone in its own stack runs fixed-shape steps over its own buffers; when a second sequence joins
    and the pool moves both into one block, nothing may keep the buffers it left alive (the step built on them
    must go), else a pooled sequence holds its memory twice for the rest of the batch."""
    import gc
    import weakref

    generator = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, 256, (1, n), generator=generator) for n in (90, 75, 130)]
    a, left = prefill(model, ids[0], "keydiff", BUDGET, BLOCK), []

    def requests():
        yield keydiff.Request(a, 8, key="a")
        # h2o never pools and stops at its first token: `a` then decodes alone, in fixed shapes over its own stack
        yield keydiff.Request(prefill(model, ids[1], "h2o", BUDGET, BLOCK), 1, key="h2o")
        left.append(weakref.ref(a.cache.stack.handle.arena.keys))  # what `a` decoded in alone, before `c` joins
        yield keydiff.Request(prefill(model, ids[2], "keydiff", BUDGET, BLOCK), 8, key="c")

    for key, _ in keydiff.generate_batch(model, requests(), 2):
        if key != "h2o":  # `a` and `c` share the pool's block by now
            assert a.cache.stack.handle.shared
            gc.collect()
            assert left[0]() is None, key


def test_a_profiled_run_times_every_eviction_in_the_ordinary_step(model):
    """profile=True times statistics and evictions apart (synchronised around each), which the fixed-shape step
    does inside one call: a profiled cache never takes it, in prefill or decoding."""
    decoder = keydiff.Decoder(model, 1)
    state = prefill(model, prompts()[1], "keydiff", BUDGET, BLOCK, profile=True, decoder=decoder)
    generate(model, state, 5, decoder=decoder)
    assert not decoder.stats.runs and not decoder.stats.built and state.cache.timings["eviction_s"] > 0
