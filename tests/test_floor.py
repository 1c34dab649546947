"""keydiff.bench.floor: what a decoding step must read and compute, against independent counts."""

import pytest
import torch

from tests.conftest import tiny_llama
from keydiff.bench import floor


pytestmark = pytest.mark.integration


def counted_step_flops(model, entries: int, rows: int) -> int:
    """FLOPs torch's counter sees in one eager decoding step of `rows` sequences over `entries` entries."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (rows, entries))
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :-1], cache=cache, use_cache=True)
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("rows", [1, 3])
def test_step_flops_match_torch_flop_counter(tied, rows):
    """Within RoPE's frequency product (a few FLOPs) of what torch counts; an untied input embedding is no matmul."""
    model = tiny_llama("eager", tie_word_embeddings=tied)
    entries = 40
    counted = counted_step_flops(model, entries, rows)
    assert floor.step_flops(model, rows, entries) == pytest.approx(counted, rel=1e-3)
    assert floor.step_flops(model, rows, entries) != pytest.approx(floor.step_flops(model, rows, 2 * entries), rel=1e-3)


@pytest.mark.unit
def test_step_bytes_are_the_weights_once_and_each_rows_entries():
    model = tiny_llama()
    weights = sum(p.numel() * 4 for p in model.parameters())
    per_entry = 2 * 3 * 2 * 16 * 4  # K and V, layers, KV heads, head_dim, float32
    assert floor.step_bytes(model, 1, 100) == weights + 100 * per_entry
    assert floor.step_bytes(model, 8, 100) == weights + 8 * 100 * per_entry


@pytest.mark.unit
def test_the_floor_is_the_larger_bound_and_names_an_unknown_rate():
    model = tiny_llama()
    slow_memory = floor.DeviceRates(1e6, "test", 1e15, "float32")
    bounds = floor.floor_ms(model, 2, 64, slow_memory)
    assert bounds["floor_ms"] == bounds["bandwidth_floor_ms"] > bounds["compute_floor_ms"]
    slow_compute = floor.DeviceRates(1e15, "test", 1e6, "float32")
    bounds = floor.floor_ms(model, 2, 64, slow_compute)
    assert bounds["floor_ms"] == bounds["compute_floor_ms"] > bounds["bandwidth_floor_ms"]
    unknown = floor.floor_ms(model, 2, 64, floor.DeviceRates(None, "unknown GPU", 1e12, "bfloat16"))
    assert unknown["bandwidth_floor_ms"] is None and unknown["floor_ms"] == unknown["compute_floor_ms"]


@pytest.mark.unit
def test_a_cpu_measures_its_own_rates():
    rates = floor.measure("cpu", torch.float32, read_mib=16, matmul_size=128, repeats=2)
    assert rates.bandwidth > 0 and rates.matmul_flops > 0 and rates.bandwidth_source.startswith("measured")
    assert rates.record()["dtype"] == "float32"
