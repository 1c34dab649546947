"""CUDA graph capture of the fixed-shape step (keydiff.decode.static, keydiff.decode.graphs) on a CPU, through
`stand_in_graphs()`: a stand-in that records what it was asked and captures, replays and fails as CUDA does."""

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
from tests.test_batched_runs import lengths_cfg, run_at, tiny  # noqa: F401 - tiny: the runner's model fixture

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 40, 16


@pytest.fixture(scope="module")
def model():
    return tiny_llama("sdpa")


def prompts(lengths=(90, 130, 75)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


def through_decoder(model, name: str) -> tuple[list, list, list, Decoder]:
    """Tokens, kept positions and kept entries' policy state of each prompt through one run's Decoder, and it."""
    decoder, tokens, kept, states = Decoder(model, 1), [], [], []
    for ids in prompts():
        state = prefill(model, ids, name, BUDGET, BLOCK, decoder=decoder)
        tokens.append(generate(model, state, 8, decoder=decoder).token_ids)
        kept.append([p.tolist() for p in state.cache.kept_positions()])
        stack = state.cache.stack
        states.append({k: v[..., :stack.num_entries].tolist() for k, v in stack.state.items()})
    return tokens, kept, states, decoder


@pytest.fixture
def eager(model, monkeypatch):
    """What a run gives with the CUDA layout (the arena) and no capture: the reference of every captured run."""
    def run(name: str):
        with monkeypatch.context() as patch:
            patch.setitem(step.FULL_WIDTH, "cpu", True)
            return list(through_decoder(model, name)[:3])
    return run


def test_a_run_whose_graphs_were_all_released_captures_into_a_new_pool(model):
    """After Decoder.reset() the next capture takes a new pool: one CUDA may still hold fails its capture."""
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
    """One warning, the reason recorded, no capture after it, nothing left behind, the eager run's results."""
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


@pytest.mark.unit
@pytest.mark.parametrize("read", ["item", "tolist", "numpy", "cpu", "bool"])
def test_every_host_read_is_refused_inside_a_stand_in_capture(read):
    """On CUDA each is a copy to the host that a capture refuses (a CPU tensor serves some without the dispatcher)."""
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
    """The warm-up captures the run's graphs; a sample that makes one of its own (47 tokens) says so in capture_s."""
    import keydiff.run.runner as runner

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
