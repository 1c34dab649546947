"""The preallocated cache as a library object: plain decoding loops, model.generate, buffers allocated once."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import keydiff
from keydiff import generate, prefill
from tests.conftest import tiny_llama

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", ["tova", "h2o"])
def test_attention_policy_loop_without_keydiff_attention_says_what_to_do(model, prompt, name):
    state = prefill(model, prompt, name, 64, 32)
    token = state.logits.argmax(-1)
    with torch.no_grad(), pytest.raises(RuntimeError, match="needs attention statistics but none .*keydiff_attention"):
        for _ in range(3):  # what a user writes: the argmax fed back through model(...) with the cache
            token = model(input_ids=token[:, None], cache=state.cache, use_cache=True).logits[:, -1].argmax(-1)


@pytest.mark.parametrize("end, beams, message", [(None, 1, r"prompt\[:, :-1\]"), (-1, 2, "beam search")],
                         ids=["whole_prompt_cached", "beam_search"])
def test_transformers_generate_refusals_say_why(model, prompt, end, beams, message):
    state = prefill(model, prompt[:, :end], "keydiff", 64, 32)
    with torch.no_grad(), pytest.raises(RuntimeError, match=message):
        model.generate(prompt, cache=state.cache, max_new_tokens=3, num_beams=beams, do_sample=False)


@pytest.mark.parametrize("name", ["keydiff", "sink", "tova", "snapkv", "h2o"])
def test_buffers_are_allocated_once_and_reused_through_prefill_and_decoding(model, prompt, name):
    storages = []

    def record(cache):
        storages.append([(layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr())
                         for layer in cache.layers])

    state = prefill(model, prompt, name, 64, 32, on_block=record)
    generate(model, state, 10)
    record(state.cache)
    assert all(snapshot == storages[0] for snapshot in storages)  # same storage after every block and token
    assert [layer.allocations for layer in state.cache.layers] == [1, 1, 1]
    assert [layer.capacity for layer in state.cache.layers] == [64 + 32] * 3
    assert state.cache.kv_cache_bytes == 2 * 3 * 2 * (64 + 32) * 16 * 4


@pytest.mark.unit
def test_old_flash_attn_is_refused_before_running(monkeypatch, prompt):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=None, __version__="2.0.4"))
    model = tiny_llama("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(RuntimeError, match="flash-attn 2.0.4 is too old"):
        prefill(model, prompt, "keydiff", 64, 32)


def brute_force_keep(name: str, held: dict[int, list], budget: int) -> set[int]:
    """What `name` keeps of one head's {position: [key, value, attention sum]}, by the papers' definitions."""
    positions = sorted(held)
    if name == "keydiff":
        keys = torch.stack([held[p][0] for p in positions]).double()
        unit = keys / keys.norm(dim=-1, keepdim=True)
        similarity = (unit @ unit.T).sum(dim=-1).tolist()
        ranked = [p for _, p in sorted(zip(similarity, positions))]  # least similar first
    elif name == "sink":
        ranked = [p for p in positions if p < 4] + sorted((p for p in positions if p >= 4), reverse=True)
    else:  # h2o
        ranked = [p for _, p in sorted(((-held[p][2], p) for p in positions))]  # most attention first
    return set(ranked[:budget])


@pytest.mark.unit
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "layer_by_layer"])
@pytest.mark.parametrize("name", ["keydiff", "h2o", "sink"])
@pytest.mark.parametrize("excess", [1, 5])
def test_in_place_eviction_keeps_exactly_the_policys_choice_with_its_rows(name, excess, stacked):
    """Both eviction paths keep the brute-forced set, each row with its own key, value and state."""
    from keydiff.cache import EvictingCache

    budget, layers, heads, dim = 20, 2, 2, 8
    generator = torch.Generator().manual_seed(excess)
    policy = keydiff.build_policy(name)
    cache = EvictingCache(policy if stacked else layer_by_layer(name), budget, layers, block_size=excess)
    held = [[{} for _ in range(heads)] for _ in range(layers)]  # [layer][head] {position: [key, value, attention]}
    seen = 0
    for new in (budget + excess, excess, excess, excess):  # several rounds: entries end up out of buffer order
        for layer_idx in range(layers):
            keys, values = torch.randn(2, 1, heads, new, dim, generator=generator)
            cache.update(keys, values, layer_idx)
            for head in range(heads):
                for i in range(new):
                    held[layer_idx][head][seen + i] = [keys[0, head, i], values[0, head, i], 0.0]
        if policy.needs.attention_rows != 0:  # H2O: the attention the pass "gave" every held entry
            for layer_idx in range(layers):
                positions = cache.layers[layer_idx].view(layer_idx).positions
                attention = torch.rand(positions.shape, generator=generator)
                cache.sink.write(layer_idx, attention)
                for head in range(heads):
                    for slot, position in enumerate(positions[0, head].tolist()):
                        held[layer_idx][head][position][2] += float(attention[0, head, slot])
        seen += new
        assert (cache.stack is not None) == stacked  # which eviction path runs
        cache.evict()
        for layer_idx in range(layers):
            view = cache.layers[layer_idx].view(layer_idx)
            for head in range(heads):
                kept = brute_force_keep(name, held[layer_idx][head], budget)
                positions = view.positions[0, head].tolist()
                assert set(positions) == kept, f"layer {layer_idx} head {head}: kept {sorted(positions)}"
                held[layer_idx][head] = {p: held[layer_idx][head][p] for p in kept}
                for slot, position in enumerate(positions):  # each row still holds what was written for it
                    key, value, attention = held[layer_idx][head][position]
                    assert torch.equal(view.keys[0, head, slot], key) and torch.equal(view.values[0, head, slot], value)
                    if name == "h2o":
                        assert view.state["h2o"][0, head, slot].item() == pytest.approx(attention, rel=1e-5)
                    if name == "keydiff":
                        inverse_norm = 1.0 / key.double().norm().item()
                        assert view.state["inv_norm"][0, head, slot].item() == pytest.approx(inverse_norm, rel=1e-6)


def layer_by_layer(name: str) -> keydiff.Policy:
    """The same policy, forbidden to evict its layers together: the reference for the stacked path."""
    policy = keydiff.policies.layer_by_layer(keydiff.build_policy(name))
    assert not policy.needs.rows_alike and policy.name == name
    return policy


@pytest.mark.parametrize("name", ["tova", layer_by_layer("tova")], ids=["stacked", "layer_by_layer"])
def test_attention_recognises_only_the_layer_whose_slots_it_reads(model, prompt, name):
    """for_layer accepts only the keys update returned for that layer; a model on another cache records nothing."""
    cache = keydiff.EvictingCache(keydiff.build_policy(name) if isinstance(name, str) else name, 16, 3,
                                  block_size=20, max_tokens=40)
    generator = torch.Generator().manual_seed(0)
    handed = [cache.update(*torch.randn(2, 1, 2, 20, 16, generator=generator), layer_idx)[0] for layer_idx in range(3)]
    assert (cache.stack is not None) == isinstance(name, str)
    for layer_idx, keys in enumerate(handed):
        assert cache.for_layer(layer_idx, keys) is not None, f"layer {layer_idx} does not recognise its own keys"
        assert cache.for_layer(layer_idx, keys.clone()) is None
        # The same slots seen through another tensor (what a pointer comparison accepts) are not what it was handed.
        assert cache.for_layer(layer_idx, cache.layers[layer_idx].keys[:, :, : keys.shape[2]]) is None
        for other in set(range(3)) - {layer_idx}:
            assert cache.for_layer(other, keys) is None, f"layer {other} claims layer {layer_idx}'s keys"
    bound = keydiff.EvictingCache(keydiff.build_policy("tova"), 16, 3, block_size=20, max_tokens=40)
    other = keydiff.EvictingCache(keydiff.build_policy("tova"), 16, 3, block_size=20, max_tokens=40)
    with torch.no_grad(), keydiff.keydiff_attention(model, bound):
        model(prompt[:, :20], cache=other, use_cache=True)
        assert all(layer.attention is None for layer in bound.layers + other.layers)
        model(prompt[:, :20], cache=bound, use_cache=True)  # 20 entries > 16: TOVA needs its last row
    assert [tuple(layer.attention.shape) for layer in bound.layers] == [(1, 2, 20)] * 3

