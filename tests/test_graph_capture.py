"""CUDA graph capture of the fixed-shape step (keydiff.decode.static, keydiff.decode.graphs) on a CPU, through
`stand_in_graphs()`: a stand-in that records what it was asked and captures, replays and fails as CUDA does."""

from __future__ import annotations

import pytest
import torch

import keydiff
from keydiff import Decoder, generate, prefill
from keydiff.decode.static import stand_in_graphs
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
