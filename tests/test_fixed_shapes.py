"""The fixed-shape step (keydiff.decode.static) against the ordinary one: same results for every policy it takes,
idle rows inert, one graph that never recompiles; and which passes the scheduler plans in fixed shapes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import keydiff
from keydiff import build_policy, generate, prefill
from keydiff.attention import keydiff_attention
from keydiff.decode.scheduler import read_cache
from keydiff.decode.static import StaticStep
from tests.conftest import CORE_POLICIES, extended_unless

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 40, 16
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
    """The kept entries' policy state (H2O's sums, KeyDiff's inverse norms) in position order."""
    stack = cache.stack
    n = stack.num_entries
    order = stack.positions[..., :n].argsort(dim=-1)
    return {name: state[..., :n].gather(-1, order).clone() for name, state in stack.state.items()}


def same_states(a: dict, b: dict, exact: bool = True) -> bool:
    if a.keys() != b.keys() or any(a[key].keys() != b[key].keys() for key in a):
        return False
    if exact:
        return all(torch.equal(a[key][name], b[key][name]) for key in a for name in a[key])
    return all(torch.allclose(a[key][name], b[key][name], rtol=1e-6, atol=0) for key in a for name in a[key])


def ready(cache, q: int = 1) -> bool:
    return read_cache(cache, q).ready


def decoded(model, requests, width: int, **options) -> tuple[dict, keydiff.Decoder]:
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
    """Prefill, forks, prompts apart and one alone: the ordinary step's results, and the fixed step did run."""
    from keydiff.decode import step

    ids = prompts()[1]
    prefills = keydiff.Decoder(model, 1)  # made before FULL_WIDTH changes: it prefills over the prompt's stack
    on = prefill(model, ids, policy(name), BUDGET, BLOCK, decoder=prefills)
    off = prefill(model, ids, policy(name), BUDGET, BLOCK, fixed_shapes=False)
    runs = prefills.stats.runs
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
    if name in STATISTIC:  # never placed in a block: fixed only where one sequence goes alone
        assert widths == {1}
    else:
        assert widths == ({1, 3} if full_width else {1, 2, 3})  # a block of three slots; one sequence alone
    runs.clear()
    ordinary, ordinary_states = decode(False)
    assert with_fixed == ordinary and not runs
    # At full width KeyDiff's inverse norms are computed over all W rows: the CPU may round the last bit otherwise.
    assert same_states(fixed_states, ordinary_states, exact=not (full_width and name not in STATISTIC))


@pytest.mark.extended
def test_rows_still_filling_materialized_statistics_and_lagkv_run_the_ordinary_step(model, monkeypatch):
    decoder = keydiff.Decoder(model, 1)
    short = prefill(model, prompts((23,))[0], "keydiff", BUDGET, BLOCK, decoder=decoder)  # holds 23 < N: filling
    assert not ready(short.cache)
    generate(model, short, 30, decoder=decoder)  # 29 passes; the cache holds N after the 17th: the last 12 fixed
    assert decoder.stats.runs == {(1, 1): 12} and decoder.stats.built == [(1, 1)]
    assert decoder.stats.arenas == [] and decoder.stats.slot_copies_in == 0  # on the CPU: over its own stack
    made = []  # keydiff.generate without a decoder makes one with the device's default (CPU: fixed)

    class Kept(keydiff.Decoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(keydiff.engine, "Decoder", Kept)
    generate(model, prefill(model, prompts((23,))[0], "keydiff", BUDGET, BLOCK), 30)
    assert [d.stats.runs for d in made] == [{(1, 1): 12}]
    for name, statistics in (("snapkv", "materialized"), ("h2o", "materialized"), ("lagkv", "fast")):
        decoder = keydiff.Decoder(model, 1)
        state = prefill(model, prompts()[0], name, BUDGET, BLOCK, attention_statistics=statistics, decoder=decoder)
        assert not ready(state.cache) and not decoder.stats.runs, name
        generate(model, state, 5, decoder=decoder)
        assert not decoder.stats.runs and not decoder.stats.built, name
    state = prefill(model, prompts()[0], "snapkv", BUDGET, BLOCK)  # the same policy with "fast" statistics
    assert ready(state.cache)


def test_a_statistic_policy_runs_in_fixed_shapes_only_where_every_layer_writes_its_statistic(model, monkeypatch):
    """Without keydiff's attention, or with layer 1's write lost, the step is refused before it evicts anything."""
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
    """`width` forks of one prefill in one arena (moved there by hand where the policy is never placed)."""
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
    """Zeros, NaN or huge values in two idle slots: the same active rows, and the idle slots left untouched."""
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
    """fullgraph refuses a graph break; the backend refuses a host read (a symbolic scalar or size); one graph."""
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
    width = 1 if q > 1 else 3  # a prefill block: one sequence alone in its own stack
    if q > 1:
        caches, eager_caches = ([prefill(model, prompts()[1], policy(name), BUDGET, BLOCK).cache] for _ in range(2))
    else:
        caches, eager_caches = (block_of(model, name, 3)[1] for _ in range(2))
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
@pytest.mark.parametrize("full_width", [False, True], ids=["span", "full-width"])
def test_an_idle_slot_holding_more_than_n_entries_is_left_as_it_is(model, full_width, monkeypatch):
    """Entries beyond N in an idle slot (a held suffix, forks waiting, an early stop) are left as they are."""
    from keydiff.decode import step

    def entries(cache) -> tuple[list, list, list]:
        stack = cache.stack
        positions = stack.positions[..., :stack.num_entries]
        order = positions.argsort(dim=-1)
        along = order[..., None].expand(*order.shape, stack.keys.shape[-1])
        return (positions.gather(-1, order).tolist(), stack.keys[..., :stack.num_entries, :].gather(-2, along).tolist(),
                stack.values[..., :stack.num_entries, :].gather(-2, along).tolist())

    monkeypatch.setitem(step.FULL_WIDTH, "cpu", full_width)
    ids = prompts((130, 90, 100))

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
def test_a_sequence_that_moves_into_a_block_leaves_its_own_buffers_free(model):
    import gc
    import weakref

    ids = prompts((90, 75, 130))
    a, left = prefill(model, ids[0], "keydiff", BUDGET, BLOCK), []

    def requests():
        yield keydiff.Request(a, 8, key="a")
        # h2o never pools and stops at once: `a` decodes alone, in fixed shapes over its own stack
        yield keydiff.Request(prefill(model, ids[1], "h2o", BUDGET, BLOCK), 1, key="h2o")
        left.append(weakref.ref(a.cache.stack.handle.arena.keys))  # what `a` decoded in alone, before `c` joins
        yield keydiff.Request(prefill(model, ids[2], "keydiff", BUDGET, BLOCK), 8, key="c")

    for key, _ in keydiff.generate_batch(model, requests(), 2):
        if key != "h2o":  # `a` and `c` share the pool's block by now
            assert a.cache.stack.handle.shared
            gc.collect()
            assert left[0]() is None, key


def test_a_profiled_run_times_every_eviction_in_the_ordinary_step(model):
    """profile=True times evictions apart, which the fixed step cannot: it never runs, in prefill or decoding."""
    decoder = keydiff.Decoder(model, 1)
    state = prefill(model, prompts()[1], "keydiff", BUDGET, BLOCK, profile=True, decoder=decoder)
    generate(model, state, 5, decoder=decoder)
    assert not decoder.stats.runs and not decoder.stats.built and state.cache.timings["eviction_s"] > 0
