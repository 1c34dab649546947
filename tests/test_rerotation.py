"""Key re-rotation (keydiff.policies.rerotation, done by keydiff.cache.evict.rerotate): every cached key is the
model's own key, recomputed from the pre-RoPE keys captured on k_proj, at the position the cache records for it
("absolute": ranks 0..n-1; "contiguous" = true, kvpress's pipeline: right below the next token)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from keydiff.cache import EvictingCache
from keydiff.engine import generate, prefill
from keydiff.policies import Rerotated, build_policy
from keydiff.policies.rerotation import STATE
from keydiff.testing import check_policy, variant
from tests.conftest import extended_unless, tiny_llama

pytestmark = pytest.mark.integration

BUDGET, BLOCK, LENGTH, NEW_TOKENS = 40, 16, 150, 6
ROPES = {
    "default": {},
    "llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64}},  # attention_scaling != 1
}


@contextmanager
def capturing(model):
    """Hooks on every layer's k_proj: the pre-RoPE keys of every pass, in order (one list per layer)."""
    captured = [[] for _ in model.model.layers]
    handles = [layer.self_attn.k_proj.register_forward_hook(lambda module, args, out, i=i: captured[i].append(
        out.detach().clone())) for i, layer in enumerate(model.model.layers)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def keys_at(model, pre_rope: torch.Tensor, layer_positions: torch.Tensor) -> torch.Tensor:
    """The model's own keys (its rotary embedding, scaling included) for `pre_rope` rotated for `layer_positions`."""
    batch, heads, n, dim = pre_rope.shape
    out = torch.empty_like(pre_rope)
    for b in range(batch):
        for h in range(heads):
            cos, sin = model.model.rotary_emb(pre_rope, position_ids=layer_positions[b, h][None])
            out[b, h] = apply_rotary_pos_emb(pre_rope[b, h][None, None], pre_rope[b, h][None, None], cos, sin)[1][0, 0]
    return out


def pre_rope_keys(model, captured: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """The pre-RoPE keys [batch, kv_heads, n, d] of one layer's tokens at absolute `positions` [batch, kv_heads, n]."""
    kv_heads, dim = model.config.num_key_value_heads, model.config.head_dim
    pre = torch.cat(captured, dim=1)  # [batch, tokens seen, kv_heads * dim]
    pre = pre.view(pre.shape[0], pre.shape[1], kv_heads, dim).transpose(1, 2)  # [batch, kv_heads, tokens, dim]
    return pre.gather(2, positions[..., None].expand(-1, -1, -1, dim))


def check_cache_keys(model, cache, captured, end: int | None = None) -> None:
    """Every layer's keys are the model's keys at their ranks (0..n-1, or end-n..end-1)."""
    for i, layer in enumerate(cache.layers):
        n = layer.num_entries
        positions = layer.positions[:, :, :n]
        ranks = positions.argsort(dim=-1).argsort(dim=-1) + (0 if end is None else end - n)
        if STATE in layer.state:
            assert torch.equal(layer.state[STATE][:, :, :n].long(), ranks)
        held = pre_rope_keys(model, captured[i], positions)
        torch.testing.assert_close(layer.keys[:, :, :n], keys_at(model, held, ranks), rtol=1e-4, atol=1e-4)


CASES = [(rope, name, mode, schedule) for rope in sorted(ROPES) for name, mode, schedule in [
    ("keydiff", "absolute", None), ("snapkv", "absolute", None),
    ("keydiff", True, None),  # kvpress's pipeline layout: kept keys at 0..N-1, the next token at N
    ("keydiff", "contiguous", {"schedule": "pyramid", "beta": 4, "window": 0})]]


@pytest.mark.parametrize("rope, name, mode, schedule", extended_unless(CASES, lambda case: case[3] is None))
def test_at_every_eviction_each_key_is_the_models_key_at_its_recorded_position(rope, name, mode, schedule):
    """Before each eviction (new keys absolute or after the kept ones), after prefill and after decoding."""
    model = tiny_llama(**ROPES[rope])
    prompt = torch.randint(0, 256, (1, LENGTH), generator=torch.Generator().manual_seed(5))
    seen = []

    def evict_indices(self, layer, budget):
        i = layer.layer_idx
        rotary = layer.state[STATE].long()
        held = pre_rope_keys(model, captured[i], layer.positions)
        torch.testing.assert_close(layer.keys, keys_at(model, held, rotary), rtol=1e-4, atol=1e-4)
        excess = layer.positions.shape[-1] - budget
        newest = layer.positions > int(layer.positions.max()) - excess  # entries of the last pass (it wrote >= excess)
        shift = rotary - layer.positions  # 0 under absolute; one constant per pass under contiguous
        seen.append((int(rotary.max()), shift[newest].unique().tolist()))
        return super(type(self), self).evict_indices(layer, budget)

    policy = build_policy(name, key_rerotation=mode, layer_budgets=schedule)
    if name != "snapkv":  # else stacked (every layer re-rotated in one call): only the end states are checked
        policy = variant(policy, evict_indices=evict_indices, needs=replace(policy.needs, rows_alike=False))
    with capturing(model) as captured:
        state = prefill(model, prompt, policy, budget=BUDGET, block_size=BLOCK)
        end = state.cache.next_position() if mode != "absolute" else None
        if mode != "absolute":
            assert end == max(state.cache.layer_budgets) == state.cache.get_seq_length()
        check_cache_keys(model, state.cache, captured, end=end)
        assert int(state.cache.layers[0].positions[:, :, :BUDGET].max()) >= BUDGET  # far keys moved: not a no-op
        generate(model, state, NEW_TOKENS)  # an eviction (and a re-rotation) after every token
        check_cache_keys(model, state.cache, captured, end=state.cache.next_position() if end else None)
    assert bool(seen) == (name != "snapkv")
    if seen and mode == "absolute":
        assert all(shifts == [0] for _, shifts in seen)
        assert max(top for top, _ in seen) == LENGTH + NEW_TOKENS - 2  # new tokens keep their absolute positions
    elif seen:
        assert max(top for top, _ in seen) < max(state.cache.layer_budgets) + BLOCK  # positions stay within N + B
        assert any(shifts != [0] for _, shifts in seen)


@pytest.mark.unit
def test_describe_only_when_set_and_round_trips():
    policy = build_policy("keydiff", key_rerotation=True, layer_budgets={"schedule": "pyramid", "beta": 4, "window": 0})
    described = policy.describe()
    assert described["key_rerotation"] == "contiguous" and list(described)[-2:] == ["key_rerotation", "layer_budgets"]
    assert build_policy(**described).describe() == described
    assert isinstance(build_policy("snapkv", key_rerotation="absolute"), Rerotated)
    assert build_policy("snapkv", key_rerotation="absolute").describe()["key_rerotation"] == "absolute"


@pytest.mark.unit
def test_a_cache_without_the_models_rope_or_with_a_dynamic_one_is_refused():
    with pytest.raises(ValueError, match="build the cache with config=model.config"):
        EvictingCache(build_policy("keydiff", key_rerotation=True), 8, 3, block_size=8)
    dynamic = tiny_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}).config
    with pytest.raises(ValueError, match="dynamic"):
        EvictingCache(build_policy("keydiff", key_rerotation=True), 8, 3, block_size=8, config=dynamic)


@pytest.mark.integration
@pytest.mark.parametrize("name, params", [("keydiff", {}), ("knorm", {"skip_layers": [0]})])
def test_check_policy_passes_with_re_rotated_keys(name, params):
    summary = check_policy(name, key_rerotation="contiguous", **params)
    assert summary["evictions"] > 0
