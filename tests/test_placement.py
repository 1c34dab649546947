"""Layers on other devices or dtypes (device_map="auto"): placements come from the attention modules, and a layer
that does not fit leaves the stack. On CPU: a tiny Llama whose middle layer runs in float64."""

from __future__ import annotations

import pytest
import torch

from keydiff import build_policy, keydiff_attention
from keydiff.cache import EvictingCache
from keydiff.cache.placement import layer_placements
from tests.conftest import tiny_llama

pytestmark = pytest.mark.integration


def mixed_dtype_llama():
    model = tiny_llama()
    middle = model.model.layers[1].to(torch.float64)

    def cast_in(module, args, kwargs):
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"].double()}
        return (args[0].double(), *args[1:]), kwargs

    def cast_out(module, args, kwargs, output):
        return output.float() if torch.is_tensor(output) else (output[0].float(), *output[1:])

    middle.register_forward_pre_hook(cast_in, with_kwargs=True)
    middle.register_forward_hook(cast_out, with_kwargs=True)
    return model


@pytest.fixture(scope="module")
def model():
    return mixed_dtype_llama()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1))


def slot_bytes(heads, entries, dim, itemsize):
    return 2 * heads * entries * dim * itemsize  # keys and values of one layer


def test_placements_are_read_from_the_attention_modules(model):
    cpu = torch.device("cpu")
    assert layer_placements(model, 3) == [(cpu, torch.float32), (cpu, torch.float64), (cpu, torch.float32)]
    assert layer_placements(model, 4) is None  # not every layer found: one placement, as before


def test_without_placements_the_stack_still_splits_for_a_layer_that_does_not_fit(model, ids):
    """A layer that does not fit leaves the stack, whose slot for it stays allocated."""
    cache = EvictingCache(build_policy("keydiff"), 64, 3, block_size=32, max_tokens=300)
    with torch.no_grad(), keydiff_attention(model, cache):
        model(input_ids=ids[:, :32], cache=cache)
    assert [s.keys.dtype for s in cache.storages] == [torch.float32, torch.float64, torch.float32]
    assert cache.kv_cache_bytes == 3 * slot_bytes(2, 96, 16, 4) + slot_bytes(2, 96, 16, 8)


@pytest.mark.unit
def test_wrong_number_of_placements_is_refused():
    with pytest.raises(ValueError, match="layer_placements has 2 entries for 3 layers"):
        EvictingCache(build_policy("keydiff"), 64, 3, layer_placements=[None, None])
