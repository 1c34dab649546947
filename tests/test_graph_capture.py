"""CUDA graph capture of the fixed-shape step (keydiff.decode.static, keydiff.decode.graphs) on a CPU, through
`stand_in_graphs()`: a stand-in that records what it was asked and captures, replays and fails as CUDA does."""

from __future__ import annotations

import pytest
import torch

import keydiff
from keydiff import Decoder, generate, prefill
from keydiff.decode.static import stand_in_graphs
from keydiff.policies.base import LayerView
from keydiff.policies.keydiff import KeyDiff, cosine_to_mean, inverse_key_norms
from tests.conftest import tiny_llama

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 40, 16


def prompts(lengths) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


def test_a_run_whose_graphs_were_all_released_captures_into_a_new_pool():
    """After Decoder.reset() the next capture takes a new pool: one CUDA may still hold fails its capture."""
    import gc

    model = tiny_llama("sdpa")
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


@pytest.mark.unit
def test_half_precision_keys_are_scored_in_float32_slices_as_a_whole_copy_would_score_them(monkeypatch):
    """Keys in slices no larger than FLOAT_SLICE_BYTES (no float32 copy of a large cache in a graph's pool)."""
    import keydiff.policies.keydiff as keydiff_policy

    monkeypatch.setattr(keydiff_policy, "FLOAT_SLICE_BYTES", 1 << 10)  # the tiny keys in slices, as a large cache's
    keys = torch.randn(6, 2, 41, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    inv = inverse_key_norms(keys)
    assert torch.equal(inv, torch.linalg.vector_norm(keys.float(), dim=-1).clamp_min(1e-8).reciprocal())
    view = LayerView(keys=keys, values=keys, positions=torch.zeros(6, 2, 41, dtype=torch.long), attention=None,
                     state={"inv_norm": inv}, layers=(0,) * 6)
    assert torch.equal(KeyDiff().score(view), -cosine_to_mean(keys.float(), True, inv))


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
