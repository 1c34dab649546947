"""CUDA graph capture of the fixed-shape step (keydiff.decode.static, keydiff.decode.graphs), run on a CPU through
`stand_in_graphs()`: the same capture code as on CUDA against a stand-in that records what it was asked (devices,
streams, pools, the bytes a capture allocates, record_stream) and that captures, replays and fails as CUDA does (a
capture runs nothing; a replay runs what was recorded; a capture may fail at capture_end)."""

from __future__ import annotations

import logging

import pytest
import torch

import keydiff
from keydiff import Decoder, generate, prefill
from keydiff.decode import step
from keydiff.decode.static import stand_in_graphs
from keydiff.policies.base import LayerView
from keydiff.policies.keydiff import KeyDiff, cosine_to_mean, inverse_key_norms
from tests.conftest import tiny_llama
from tests.test_batched_runs import tiny  # noqa: F401 - the runner's model fixture

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 40, 16


@pytest.fixture(scope="module")
def model():
    return tiny_llama("sdpa")


def prompts(lengths=(90, 130, 75)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


def through_decoder(model, name: str, lengths=(90, 130, 75)) -> tuple[list, list, list, Decoder]:
    """Each prompt prefilled and decoded through one run's Decoder (its block and decode steps captured once):
    tokens, kept positions and policy state (the kept entries') of every prompt, and the decoder."""
    decoder, tokens, kept, states = Decoder(model, 1), [], [], []
    for ids in prompts(lengths):
        state = prefill(model, ids, name, BUDGET, BLOCK, decoder=decoder)
        tokens.append(generate(model, state, 8, decoder=decoder).token_ids)
        kept.append([p.tolist() for p in state.cache.kept_positions()])
        stack = state.cache.stack
        states.append({k: v[..., :stack.num_entries].tolist() for k, v in stack.state.items()})
    return tokens, kept, states, decoder


@pytest.fixture
def eager(model, monkeypatch):
    """What a run gives with the CUDA layout (the arena) and no capture: the reference of every captured run."""
    def run(name: str, lengths=(90, 130, 75)):
        with monkeypatch.context() as patch:
            patch.setitem(step.FULL_WIDTH, "cpu", True)
            return list(through_decoder(model, name, lengths)[:3])
    return run


@pytest.mark.extended
def test_a_run_captures_replays_and_gives_the_eager_tokens(model, eager):
    expected = eager("keydiff")
    with stand_in_graphs() as cuda:
        *got, decoder = through_decoder(model, "keydiff")
    assert got == expected
    record = decoder.stats.record()
    assert record["captured"] == 2 and record["failed"] == 0 and not record["stopped"]  # one decode, one block graph
    assert cuda.replays > 10 and cuda.clean()
    assert record["capture_s"] >= record["warm_up_s"] > 0


@pytest.mark.extended
def test_a_model_on_another_device_than_the_current_one_captures_on_its_own(model, eager):
    """A model on cuda:1 while the current device is cuda:0 (nothing calls set_device): the warm-up's side stream, the
    capture stream and the capture are all on cuda:1. A capture stream on the current device would capture nothing
    of the model's kernels, which would run at once (the stand-in does what CUDA does): the eager retry would apply
    their writes again, or the empty graph would replay stale logits."""
    expected = eager("keydiff")
    with stand_in_graphs(model_device="cuda:1", current_device="cuda:0") as cuda:
        *got, decoder = through_decoder(model, "keydiff")
    assert {device for device, _ in cuda.streams} == {"cuda:1"} and len(cuda.streams) >= 3, cuda.streams
    assert [capture["device"] for capture in cuda.captures] == ["cuda:1", "cuda:1"]
    assert got == expected and decoder.stats.captured == 2 and cuda.clean()


@pytest.mark.extended
def test_a_run_shares_one_capture_stream_and_one_pool_between_its_graphs(model):
    """The decode and the prefill-block graphs of a run go into one graph pool, on one capture stream (each graph's
    output is read right after its replay, so one pool serves both), and the run records the bytes they hold."""
    with stand_in_graphs() as cuda:
        decoder = through_decoder(model, "keydiff")[-1]
    assert len(cuda.captures) == 2
    assert len({capture["pool"] for capture in cuda.captures}) == 1 and cuda.captures[0]["pool"] is not None
    assert len({capture["stream"] for capture in cuda.captures}) == 1
    assert decoder.stats.pool_bytes == sum(capture["bytes"] for capture in cuda.captures) > 0


def test_a_run_whose_graphs_were_all_released_captures_into_a_new_pool(model):
    """After Decoder.reset() (a sample out of memory) or a back-off, every graph of the run's pool is released. CUDA's
    allocator may still hold that pool, with no user (until an empty_cache finds all of its blocks free, which a
    cuBLAS workspace made inside a capture prevents), and a capture that names it then fails an internal assert: the
    run would stop capturing for good. The next capture goes into a new pool; while a graph lives, its pool is
    shared."""
    import gc

    with stand_in_graphs() as cuda:
        decoder = Decoder(model, 1)
        for ids in prompts((90, 130)):
            generate(model, prefill(model, ids, "keydiff", BUDGET, BLOCK, decoder=decoder), 8, decoder=decoder)
        before = len(cuda.captures)
        decoder.reset()
        gc.collect()
        for ids in prompts((130, 90)):
            generate(model, prefill(model, ids, "keydiff", BUDGET, BLOCK, decoder=decoder), 8, decoder=decoder)
    record = decoder.stats.record()
    assert before == 2 and record["failed"] == 0 and record["captured"] == 4 and not record["stopped"], record
    pools = [capture["pool"] for capture in cuda.captures]
    assert pools[0] == pools[1] != pools[2] == pools[3], pools


@pytest.mark.extended
@pytest.mark.parametrize("fail", ["end", "inside"])
@pytest.mark.parametrize("name", ["keydiff", "h2o"])
def test_a_failed_capture_stops_the_runs_capturing_applies_each_write_once_and_leaves_the_process_clean(
        model, eager, caplog, fail, name):
    """A capture that fails at capture_end (CUDA refusing it at its end: the path that left the process on the
    capture stream) or inside it (a host read): one warning, the reason recorded, no capture tried after it for the
    rest of the run, nothing of the capture left behind (no capture underway, every device on its default stream,
    no pool the allocator still routes into, on a torch without the capture_end fix), and the tokens, kept
    positions and H2O's accumulated state of a run that never captured: the step the capture did not run runs
    eagerly, once."""
    expected = eager(name)
    with caplog.at_level(logging.WARNING, logger="keydiff.decode.static"), \
            stand_in_graphs(fail=fail, fixed_allocator=False) as cuda:
        *got, decoder = through_decoder(model, name)
    assert got == expected
    assert cuda.clean(), (cuda.capturing, cuda.current, cuda.routed)
    assert len(cuda.captures) == 1 and cuda.replays == 0
    record = decoder.stats.record()
    assert record["captured"] == 0 and record["failed"] == 1 and record["stopped"] and len(record["reasons"]) == 1
    warnings = [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(warnings) == 1


def test_the_warm_ups_logits_are_marked_used_on_the_stream_that_reads_them(model):
    """The warm-up runs on a side stream and its logits are read on the current one: record_stream on that stream,
    so that the allocator does not give their memory to the side stream's next work while they are read."""
    with stand_in_graphs() as cuda:
        through_decoder(model, "keydiff", lengths=(90,))
    default = cuda.default_stream("cuda:0")
    assert len(cuda.recorded_streams) == 2  # one warm-up per graph: the block step's and the decode step's
    assert all(stream == default.id for _, stream in cuda.recorded_streams)
    assert sorted(tuple(t.shape) for t, _ in cuda.recorded_streams) == [(1, 256), (1, 256)]


@pytest.mark.extended
def test_a_capture_of_a_half_precision_cache_holds_no_float32_copy_of_every_key(monkeypatch):
    """KeyDiff and K-norm score half-precision keys in float32. A float32 copy of every key made inside the
    capture stays in the graph's pool (about twice the half-precision keys): the capture's allocations hold none
    as large as half of them. The tiny cache stands for a large one: slices of at most 1 KiB of float32 keys."""
    import keydiff.policies.keydiff as keydiff_policy

    monkeypatch.setattr(keydiff_policy, "FLOAT_SLICE_BYTES", 1 << 10)
    model = tiny_llama("sdpa", dtype=torch.bfloat16)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    keys = config.num_hidden_layers * config.num_key_value_heads * (BUDGET + 1) * head_dim  # W = 1, N + 1 entries
    for name in ("keydiff", "knorm"):
        with stand_in_graphs() as cuda:
            through_decoder(model, name, lengths=(90,))
        decode = [c for c in cuda.captures if c["bytes"] and c is cuda.captures[-1]]
        assert decode, cuda.captures
        wide = [shape for shape, dtype in decode[0]["allocations"]
                if dtype == torch.float32 and torch.Size(shape).numel() * 2 >= keys]
        assert not wide, (name, wide)


@pytest.mark.unit
def test_half_precision_keys_are_sliced_only_where_their_float32_copy_is_large():
    """One score (a few kernels) while the float32 copy of the keys fits FLOAT_SLICE_BYTES; beyond it, slices
    that each fit, up to FLOAT_SLICES of at least two (row, head) pairs."""
    from keydiff.policies.keydiff import FLOAT_SLICE_BYTES, FLOAT_SLICES, float_slices

    def keys(rows, n=1025, heads=8, dim=128):  # Llama-3.2-3B's KV heads and head size, N = 1,024 plus one
        return torch.empty(rows, heads, n, dim, dtype=torch.bfloat16, device="meta")

    assert float_slices(keys(28)) == 2  # batch 1, 28 layers: 118 MB of float32 keys
    assert float_slices(keys(4)) == 1  # 17 MB
    wide = keys(16 * 28)  # batch 16: 1.9 GB
    assert float_slices(wide) == FLOAT_SLICES
    assert float_slices(keys(1, heads=2)) == 1  # one pair of two: never split
    for rows in (28, 64, 100):
        count = float_slices(keys(rows))
        assert count == FLOAT_SLICES or keys(rows).numel() * 4 / count <= FLOAT_SLICE_BYTES * (1 + 1 / rows)


@pytest.mark.unit
def test_half_precision_keys_are_scored_in_float32_slices_as_a_whole_copy_would_score_them(monkeypatch):
    import keydiff.policies.keydiff as keydiff_policy

    monkeypatch.setattr(keydiff_policy, "FLOAT_SLICE_BYTES", 1 << 10)  # the tiny keys in slices, as a large cache's
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(6, 2, 41, 16, generator=generator).to(torch.bfloat16)
    inv = inverse_key_norms(keys)
    assert torch.equal(inv, torch.linalg.vector_norm(keys.float(), dim=-1).clamp_min(1e-8).reciprocal())
    view = LayerView(keys=keys, values=keys, positions=torch.zeros(6, 2, 41, dtype=torch.long), attention=None,
                     state={"inv_norm": inv}, layers=(0,) * 6)
    assert torch.equal(KeyDiff().score(view), -cosine_to_mean(keys.float(), True, inv))
    for anchor, metric in (("median", "cosine"), ("mean", "dot"), ("normalized_mean", "euclidean")):
        policy = KeyDiff(anchor=anchor, metric=metric)
        assert torch.equal(policy.score(view), policy.score_to_anchor(keys.float())), (anchor, metric)


def test_a_stand_in_capture_refuses_a_host_read_as_cuda_does(model):
    """What makes the stand-in a check of capturability: reading a value on the host inside a capture raises."""
    from keydiff.decode import graphs

    with stand_in_graphs() as cuda:
        graph = cuda.graph()
        stream = cuda.stream(torch.device("cpu"))
        with cuda.use(stream):
            graph.capture_begin(pool=cuda.pool())
            with pytest.raises(RuntimeError, match=graphs.CAPTURING):
                torch.ones(2).sum().item()
            graph.capture_end()
        x = torch.zeros(3)
        with cuda.use(stream):
            graph = cuda.graph()
            graph.capture_begin(pool=cuda.pool())
            x.add_(1)  # recorded, not run
            graph.capture_end()
        assert x.tolist() == [0, 0, 0]
        graph.replay()
        graph.replay()
        assert x.tolist() == [2, 2, 2] and cuda.clean()


@pytest.mark.unit
@pytest.mark.parametrize("read", ["item", "tolist", "numpy", "cpu", "bool"])
def test_every_host_read_is_refused_inside_a_stand_in_capture(read):
    """A CPU tensor serves tolist, numpy and cpu without reaching the dispatcher; on CUDA each is a copy to the host
    that a capture refuses, so the stand-in refuses them too (else a step reading one passes on a CPU, then fails to
    capture on the first GPU)."""
    from keydiff.decode import graphs

    x = torch.arange(4.0)
    with stand_in_graphs() as cuda:
        graph = cuda.graph()
        with cuda.use(cuda.stream(torch.device("cpu"))):
            graph.capture_begin(pool=cuda.pool())
            with pytest.raises(RuntimeError, match=graphs.CAPTURING):
                bool(x[1]) if read == "bool" else x[1].item() if read == "item" else getattr(x, read)()
            graph.capture_end()
        assert cuda.clean()
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and x.cpu() is x  # outside a capture: read as usual


@pytest.mark.unit
def test_the_stand_in_options_are_checked():
    with pytest.raises(ValueError, match="valid: None, 'end', 'inside'"):
        with stand_in_graphs(fail="begin"):
            pass
    assert keydiff.decode.graphs.calls_for(torch.device("cpu")) is None  # none outside the context


@pytest.mark.extended
def test_a_runs_graphs_are_captured_in_its_warm_up_and_a_row_that_paid_for_one_says_so(tmp_path, tiny, monkeypatch):
    """A batch-1 run whose first prompt (30 tokens) is shorter than N + 3B: the warm-up still captures the run's
    block and decode graphs through the run's decoder (its prompt repeated), so the first sample's TTFT carries no
    capture. A later sample that makes a graph of its own (the 47-token prompt decodes in its own buffers, shaped
    unlike the arena's slots) carries that capture in its times, and its row says so (`capture_s`); summary.json's
    decode_graphs has every capture's cost, the warm-up's included."""
    import keydiff.run.runner as runner
    from tests.test_batched_runs import lengths_cfg, run_at

    started = []
    real = runner.process_sample

    def process_sample(ctx, sample):
        started.append(len(cuda.captures))
        return real(ctx, sample)

    monkeypatch.setattr(runner, "process_sample", process_sample)
    with stand_in_graphs() as cuda:
        summary, rows = run_at(lengths_cfg(tmp_path, "warm"))
    graphs = summary["invocations"][-1]["decode_graphs"]
    assert started[0] == 2 and graphs["captured"] == len(cuda.captures) == 3, (started, graphs)
    paid = {row["prompt_tokens"]: row["capture_s"] for row in rows.values() if "capture_s" in row}
    assert list(paid) == [47] and paid[47] > 0, paid
    assert 0 < paid[47] < graphs["capture_s"]  # the rest: the warm-up's, in no sample's times
