"""The preallocated cache as a library object: plain decoding loops, model.generate, buffers allocated once."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import keydiff
from keydiff import generate, prefill
from keydiff.attention import check_flash_attn_version
from tests.conftest import tiny_llama

pytestmark = pytest.mark.integration


def test_stock_attention_block_after_eviction_is_causal_bottom_right(prompt):
    """A multi-token pass against an evicted cache: transformers' mask must equal our bottom-right one."""
    model = tiny_llama("eager")
    chunk = prompt[:, 200:215]
    ours = prefill(model, prompt[:, :200], "keydiff", 50, 32)
    with torch.no_grad(), keydiff.keydiff_attention(model, ours.cache):
        expected = model(input_ids=chunk, cache=ours.cache, use_cache=True).logits
    stock = prefill(model, prompt[:, :200], "keydiff", 50, 32)
    with torch.no_grad():
        got = model(input_ids=chunk, cache=stock.cache, use_cache=True).logits
    assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("name", ["tova", "h2o"])
def test_attention_policy_loop_without_keydiff_attention_says_what_to_do(model, prompt, name):
    state = prefill(model, prompt, name, 64, 32)
    token = state.logits.argmax(-1)
    with torch.no_grad(), pytest.raises(RuntimeError, match="needs attention statistics but none .*keydiff_attention"):
        for _ in range(3):  # what a user writes: the argmax fed back through model(...) with the cache
            token = model(input_ids=token[:, None], cache=state.cache, use_cache=True).logits[:, -1].argmax(-1)


@pytest.mark.extended
@pytest.mark.parametrize("name", ["keydiff", "tova", "full"])
def test_transformers_generate_continues_a_cache_that_holds_all_but_the_last_token(model, prompt, name):
    state = prefill(model, prompt[:, :-1], name, 64, 32)
    with torch.no_grad(), keydiff.keydiff_attention(model, state.cache):
        out = model.generate(prompt, cache=state.cache, max_new_tokens=8, do_sample=False)
    reference = prefill(model, prompt[:, :-1], name, 64, 32)
    with torch.no_grad(), keydiff.keydiff_attention(model, reference.cache):
        logits = model(input_ids=prompt[:, -1:], cache=reference.cache, use_cache=True).logits[:, -1]
        reference.cache.evict()
    reference.logits, reference.prompt_length = logits, prompt.shape[1]
    expected = generate(model, reference, 8).token_ids[0]
    assert out[0, prompt.shape[1] :].tolist() == expected


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


@pytest.mark.parametrize("name, budget, block, length, capacity, grown", [
    ("keydiff", 64, 32, 40, 65, 65),  # never evicts in prefill; decoding reaches N + 1
    ("keydiff", 64, None, 300, 300, 300),  # one block of L, then N + 1 while decoding
    ("full", None, 64, 300, 300, 306),  # sized from the prompt, grown once before decoding
])
def test_capacity_is_only_what_the_sequence_can_need(model, prompt, name, budget, block, length, capacity, grown):
    state = prefill(model, prompt[:, :length], name, budget, block)
    assert [layer.capacity for layer in state.cache.layers] == [capacity] * 3 and state.cache.allocations == 3
    generate(model, state, 6)
    assert state.cache.layers[0].capacity == grown and state.cache.allocations == (3 if grown == capacity else 6)


def test_cache_counts_positions_itself(model, prompt):
    state = prefill(model, prompt, "keydiff", 64, 32)
    assert state.cache.get_seq_length() == 300 and state.cache.layers[2].num_entries == 64
    generate(model, state, 4)  # 3 tokens fed back
    assert state.cache.get_seq_length() == 303
    assert sorted(state.cache.layers[1].view(1).positions[0, 0].tolist())[-3:] == [300, 301, 302]


@pytest.mark.unit
@pytest.mark.parametrize("version, ok", [("2.0.9", False), ("2.1.0", True), ("2.7.4.post1", True), ("3.0.0b1", True)])
def test_flash_attn_version_check(version, ok):
    if ok:
        check_flash_attn_version(version)
    else:
        with pytest.raises(RuntimeError, match=">= 2.1"):
            check_flash_attn_version(version)


@pytest.mark.unit
def test_old_flash_attn_is_refused_before_running(monkeypatch, prompt):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=None, __version__="2.0.4"))
    model = tiny_llama("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(RuntimeError, match="flash-attn 2.0.4 is too old"):
        prefill(model, prompt, "keydiff", 64, 32)


def brute_force_keep(name: str, held: dict[int, list], budget: int) -> set[int]:
    """Positions the default `name` policy keeps from one head's `held` {position: [key, value, attention sum]},
    from the papers' definitions (KeyDiff Eq. 7, StreamingLLM's sinks + recent, H2O's received attention)."""
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


@pytest.mark.extended
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_keydiff_caches_each_entrys_inverse_key_norm_when_it_is_written(prompt, dtype):
    """Every held entry's cached `inv_norm` is 1 / ||its key|| (float64 from the cached key) after evictions."""
    model = tiny_llama("sdpa", dtype=dtype)
    state = prefill(model, prompt, "keydiff", 40, 16)
    generate(model, state, 6)
    for layer_idx, layer in enumerate(state.cache.layers):
        view = layer.view(layer_idx)
        expected = 1.0 / view.keys.double().square().sum(dim=-1).sqrt()
        assert torch.allclose(view.state["inv_norm"].double(), expected, rtol=1e-6, atol=0), f"layer {layer_idx}"


# --- the stack: all layers in one allocation, evicted in one call --------------------------------------

def layer_by_layer(name: str) -> keydiff.Policy:
    """The same policy, forbidden to evict its layers together: the reference for the stacked path."""
    policy = keydiff.policies.layer_by_layer(keydiff.build_policy(name))
    assert not policy.needs.rows_alike and policy.name == name
    return policy


class CountingKeyDiff(keydiff.policies.KeyDiff):
    calls: int = 0

    def score(self, layer):
        type(self).calls += 1
        return super().score(layer)


def test_stacked_cache_scores_every_layer_in_one_call_per_step(model, prompt):
    CountingKeyDiff.calls = 0
    state = prefill(model, prompt, CountingKeyDiff(), 64, 32)
    blocks = -(-prompt.shape[1] // 32)
    evicting_blocks = sum(1 for end in range(32, prompt.shape[1] + 32, 32) if min(end, prompt.shape[1]) > 64)
    assert CountingKeyDiff.calls == evicting_blocks < blocks * 3  # not once per layer
    generate(model, state, 5)  # 4 forward passes, one eviction each
    assert CountingKeyDiff.calls == evicting_blocks + 4
    # The layers' buffers are slices of one allocation.
    first = state.cache.layers[0].keys
    assert all(layer.storage.count > 1 and layer.keys.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for layer in state.cache.layers)


@pytest.mark.extended
def test_policies_that_are_not_batchable_keep_a_buffer_per_layer(model, prompt):
    for policy in ("random", keydiff.build_policy("keydiff", layer_budgets={"schedule": "pyramid", "beta": 2}),
                   keydiff.build_policy("knorm", skip_layers=[0, 1, 2])):
        state = prefill(model, prompt, policy, 64, 32)
        assert state.cache.stack is None and not any(layer.storage.count > 1 for layer in state.cache.layers)


@pytest.mark.unit
def test_a_layer_unlike_the_first_leaves_the_stack_and_eviction_goes_layer_by_layer():
    from keydiff.cache import EvictingCache

    torch.manual_seed(0)
    cache = EvictingCache(keydiff.build_policy("keydiff"), 8, 2, block_size=4, max_tokens=40)
    for start in range(0, 20, 4):
        cache.update(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), 0)
        cache.update(torch.randn(1, 3, 4, 16), torch.randn(1, 3, 4, 16), 1)  # other heads and head_dim
        cache.evict()
    first, second = cache.layers
    assert cache.stack is None and first.storage.count == second.storage.count == 1
    assert first.allocations == 1 and second.allocations == 2  # the stack's slot, then buffers of its own
    assert first.keys.untyped_storage().data_ptr() != second.keys.untyped_storage().data_ptr()
    assert first.num_entries == second.num_entries == 8 and second.keys.shape[1:] == (3, 12, 16)
    assert cache.get_seq_length() == 20 and first.max_entries == second.max_entries == 12


def test_layers_a_policy_never_evicts_keep_everything(model, prompt):
    state = prefill(model, prompt, keydiff.build_policy("knorm", skip_layers=[0]), 50, 64)
    assert [positions.shape[-1] for positions in state.kept_positions] == [prompt.shape[1], 50, 50]


@pytest.mark.extended
def test_decoding_without_eviction_grows_the_whole_stack_and_releases_the_old_one(model, prompt):
    state = prefill(model, prompt, "keydiff", 64, 32)
    old_storage = state.cache.layers[0].keys.untyped_storage().data_ptr()
    generate(model, state, 60, evict=False)  # 59 kept tokens: more than the N + B slots
    cache = state.cache
    assert cache.stack is not None and all(layer.storage.count > 1 for layer in cache.layers)
    assert [layer.num_entries for layer in cache.layers] == [64 + 59] * 3
    assert cache.layers[0].keys.untyped_storage().data_ptr() != old_storage
    assert cache.allocations == 6  # the first stack, then one grown stack (3 layers each)
    assert cache.kv_cache_bytes == 2 * 3 * 2 * (64 + 60) * 16 * 4


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["keydiff", "tova"])
def test_a_follow_on_chunk_as_long_as_the_prompt_is_not_mistaken_for_the_prompt_fed_again(prompt, name, dtype):
    """100 tokens after a 100-token prefill continue it (as one 200-token prefill); the same 100 again are refused."""
    model = tiny_llama("sdpa", dtype=dtype)
    state = prefill(model, prompt[:, :100], name, 64, 100)
    with torch.no_grad(), keydiff.keydiff_attention(model, state.cache):
        logits = model(input_ids=prompt[:, 100:200], cache=state.cache, use_cache=True).logits[:, -1]
    state.cache.evict()
    reference = prefill(model, prompt[:, :200], name, 64, 100)
    assert torch.allclose(logits.float(), reference.logits, atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert all(torch.equal(a, b) for a, b in zip(state.cache.kept_positions(), reference.kept_positions))
    again = prefill(model, prompt[:, :100], name, 64, 100)
    with torch.no_grad(), keydiff.keydiff_attention(model, again.cache), pytest.raises(RuntimeError, match="fed again"):
        model(input_ids=prompt[:, :100], cache=again.cache, use_cache=True)


def test_the_engine_sets_no_attribute_on_the_cache(model, prompt, monkeypatch):
    from keydiff.cache import EvictingCache

    written = []
    original = EvictingCache.__setattr__

    def spy(self, name, value):
        if "_mode" in vars(self):  # built (the constructor sets it last)
            written.append(name)
        original(self, name, value)

    monkeypatch.setattr(EvictingCache, "__setattr__", spy)
    for name in ("keydiff", "h2o"):
        state = prefill(model, prompt, name, 64, 32)
        generate(model, state, 4, evict=False)
    written_outside = [name for name in written if not name.startswith("_")]
    assert written_outside == [], written_outside

