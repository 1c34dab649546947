"""The engine on a tiny random Llama: the N + B bound, low-precision scoring, its refusals, the flash-attention path."""

from __future__ import annotations

import math

import pytest
import torch

import keydiff
from keydiff import available_policies, build_policy, generate, prefill
from keydiff.testing import variant
from tests.conftest import CORE_POLICIES, extended_unless, tiny_llama

pytestmark = pytest.mark.integration

EVICTING = [name for name in available_policies() if name != "full"]


def reference_logits(model, prompt):
    with torch.no_grad():
        return model(prompt).logits[:, -1].float()


# Every policy at three (N, B): blocks smaller than N, one block larger than N, and B = 1 (an eviction after every
# prompt token: 300 forward passes). make test-quick keeps the core policies at the first two and KeyDiff at B = 1.
BOUND_CASES = [(budget, block_size, name) for name in EVICTING for budget, block_size in [(64, 32), (50, 128), (100, 1)]]


@pytest.mark.parametrize("budget, block_size, name", extended_unless(
    BOUND_CASES, lambda case: case[2] in CORE_POLICIES and (case[1] > 1 or case[2] == "keydiff"),
    ids=[f"{budget}-{block_size}-{name}" for budget, block_size, name in BOUND_CASES]))
@pytest.mark.device
def test_bound_n_plus_b_holds_at_every_step(device_model, prompt, device, name, budget, block_size):
    model, prompt = device_model, prompt.to(device)
    seen = []

    def check(cache):
        sizes = [layer.num_entries for layer in cache.layers]
        assert all(size <= budget for size in sizes)  # after each block's eviction
        seen.append(cache.max_entries)

    state = prefill(model, prompt, name, budget, block_size, on_block=check)
    assert max(seen) <= budget + block_size
    assert state.max_cache_entries == min(prompt.shape[1], budget + block_size)
    for positions in state.kept_positions:
        assert positions.shape == (1, 2, budget)
        assert torch.all(positions[..., 1:] > positions[..., :-1])  # unique, position-ordered
        assert positions.min() >= 0 and positions.max() < prompt.shape[1]
    out = generate(model, state, 12, record_steps=True)
    assert len(out.token_ids[0]) == 12
    assert all(size <= budget for size in out.step_entries)
    assert out.max_cache_entries <= budget + block_size


def logging_policy(name: str) -> keydiff.Policy:
    """The built-in policy `name` (defaults) that also logs what it observes and every eviction it decides."""
    policy = build_policy(name)
    cls = type(policy)

    def observe(self, layer):
        self.log.append(("observe", layer.positions.clone(), layer.attention.clone()))
        cls.observe(self, layer)

    def evict_indices(self, layer, budget):
        dropped = cls.evict_indices(self, layer, budget)
        attention = None if layer.attention is None else layer.attention.clone()
        self.log.append(("evict", layer.keys.clone(), layer.positions.clone(), attention, dropped.clone()))
        return dropped

    logged = variant(policy, observe=observe, evict_indices=evict_indices)
    logged.log = []
    return logged


def float64_scores(name: str, keys, positions, attention, accumulated) -> torch.Tensor:
    """The policy's score of every entry in float64, written from its definition (higher = keep)."""
    if name == "keydiff":  # Eq. 8: -cos(k_i, mean of the unit keys)
        keys = keys.double()
        anchor = (keys / keys.norm(dim=-1, keepdim=True)).mean(dim=2, keepdim=True)
        return -(keys * anchor).sum(-1) / (keys.norm(dim=-1) * anchor.norm(dim=-1))
    if name == "h2o":  # all the attention each position has received so far
        return accumulated.gather(-1, positions)
    # snapkv (window 32, kernel 7, avg): the prefix's attention in position order, summed over the 7
    # neighbours inside the prefix, / 7; the window is always kept
    window, half = 32, 3
    order = positions.argsort(dim=-1)
    ordered = attention.double().gather(-1, order)
    prefix = ordered.shape[-1] - window
    pooled = torch.full_like(ordered, math.inf)
    for i in range(prefix):
        pooled[..., i] = ordered[..., max(i - half, 0) : min(i + half + 1, prefix)].sum(-1) / (2 * half + 1)
    return torch.empty_like(pooled).scatter_(-1, order, pooled)


@pytest.mark.extended
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["keydiff", "snapkv", "h2o"])
def test_low_precision_runs_within_bound_and_scores_in_float32(prompt, dtype, name):
    """bf16/fp16 within N + B; no dropped entry's float64 score (from what the policy was handed) beats a kept one's."""
    model = tiny_llama("sdpa", dtype=dtype)
    policy = logging_policy(name)
    budget, block = 64, 32
    state = prefill(model, prompt, policy, budget, block)
    assert state.max_cache_entries == budget + block and torch.isfinite(state.logits).all()
    assert all(positions.shape == (1, 2, budget) for positions in state.kept_positions)
    assert state.cache.layers[0].view(0).keys.dtype == dtype
    accumulated = torch.zeros(3, 2, prompt.shape[1], dtype=torch.float64)  # H2O: [stacked rows, heads, position]
    evictions = 0
    for entry in policy.log:
        if entry[0] == "observe":
            _, positions, attention = entry
            accumulated.scatter_add_(-1, positions, attention.double())
            continue
        _, keys, positions, attention, dropped = entry
        assert keys.shape[0] == 3  # the three layers stacked: rows line up with `accumulated`
        scores = float64_scores(name, keys, positions, attention, accumulated)
        is_dropped = torch.zeros_like(positions, dtype=torch.bool).scatter_(-1, dropped, True)
        highest_dropped = scores.masked_fill(~is_dropped, -math.inf).amax(dim=-1)
        lowest_kept = scores.masked_fill(is_dropped, math.inf).amin(dim=-1)
        tolerance = 1e-5 * scores[torch.isfinite(scores)].abs().max()
        assert (highest_dropped <= lowest_kept + tolerance).all(), (
            f"eviction {evictions}: dropped a score of {highest_dropped.max():.6f}, kept {lowest_kept.min():.6f}")
        evictions += 1
    assert evictions == -(-(prompt.shape[1] - budget) // block)  # one per block once the budget is exceeded


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget": 0}, "budget must be a positive integer"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"block_size": 2.5}, "block_size must be a positive integer"),
        ({"attention_statistics": "weights"}, "valid: fast, materialized"),
    ],
)
def test_bad_engine_arguments(model, prompt, kwargs, message):
    args = {"budget": 10, "block_size": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        prefill(model, prompt, "keydiff", **args)


@pytest.mark.unit
def test_an_unknown_setting_is_refused_in_one_line_naming_the_valid_ones():
    """A misspelt keyword, options of another type, no max_new_tokens: refused before anything runs."""
    settings = "block_size, attention_statistics, profile, on_block, tokenizer, held_suffix, fixed_shapes, decoder"
    with pytest.raises(TypeError) as error:
        prefill(None, None, "keydiff", 10, blok_size=8)
    assert str(error.value) == f"prefill() got unknown setting 'blok_size'; valid: {settings}"
    with pytest.raises(TypeError, match=r"^generate\(\) got unknown settings 'temprature', 'eos_token_id'; valid: "
                                        r"max_new_tokens, eos_token_ids, do_sample, temperature, top_p, "
                                        r"min_new_tokens, seed, evict, record_steps, fixed_shapes, batch_invariant, "
                                        r"decoder$"):
        generate(None, None, 4, temprature=0.5, eos_token_id=2)
    with pytest.raises(TypeError, match="^options must be a keydiff.PrefillOptions, got dict$"):
        prefill(None, None, "keydiff", 10, options={"block_size": 8})
    with pytest.raises(TypeError, match="needs max_new_tokens"):
        generate(None, None, eos_token_ids=[2])


@pytest.mark.unit
@pytest.mark.extended
def test_linear_attention_models_are_refused(prompt):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="linear_attention layers"):
        prefill(Qwen3NextForCausalLM(config).eval(), prompt, "keydiff", 64, 32)


def fake_flash_attn_func(q, k, v, softmax_scale, causal):
    """Stand-in for flash_attn.flash_attn_func ([b, seq, heads, dim], GQA, bottom-right causal) on CPU."""
    from keydiff.attention import eager_attention

    module = torch.nn.Module()
    out, _ = eager_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale)
    return out


@pytest.mark.extended
def test_flash_attention_2_path_runs_through_flash_attn_func(monkeypatch, prompt):
    import sys
    import types

    fake = types.SimpleNamespace(flash_attn_func=fake_flash_attn_func, __version__="2.6.3")
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    model = tiny_llama("sdpa")
    reference = reference_logits(model, prompt)
    model.config._attn_implementation = "flash_attention_2"  # as loaded with flash-attn installed
    # Without flash-attn installed transformers cannot switch back to flash_attention_2; record the switch instead.
    switched = []
    monkeypatch.setattr(model, "set_attn_implementation",
                        lambda name: switched.append(name) or setattr(model.config, "_attn_implementation", name))
    state = prefill(model, prompt, "full", None, 64)
    assert switched == ["keydiff_fa2", "flash_attention_2"]  # no "flash" in our name: transformers loads no kernel
    assert torch.allclose(state.logits, reference, atol=1e-5)
    evicted = prefill(model, prompt, "snapkv", 64, 32)
    assert evicted.max_cache_entries == 96 and generate(model, evicted, 3).token_ids[0]


def test_prefill_options_equal_the_keywords_and_explicit_keywords_replace_their_fields(model, prompt):
    settings = dict(held_suffix=10, attention_statistics="materialized")
    by_keywords = prefill(model, prompt, "keydiff", 40, 16, **settings)
    by_options = prefill(model, prompt, "keydiff", 40, options=keydiff.PrefillOptions(block_size=16, **settings))
    replaced = prefill(model, prompt, "keydiff", 40, 16, options=keydiff.PrefillOptions(block_size=99, held_suffix=3),
                       **settings)
    for state in (by_options, replaced):
        assert (state.block_size, state.held_suffix) == (16, 10)
        assert torch.equal(state.logits, by_keywords.logits)
        assert all(torch.equal(a, b) for a, b in zip(state.kept_positions, by_keywords.kept_positions))


def test_generate_takes_a_request_whose_fields_keywords_replace_and_decodes_a_state_once(model, prompt):
    expected = generate(model, prefill(model, prompt, "keydiff", 40, 16), 6, do_sample=True, seed=3).token_ids
    state = prefill(model, prompt, "keydiff", 40, 16)
    request = keydiff.Request(state, 99, seed=0)
    assert generate(model, request, max_new_tokens=6, do_sample=True, seed=3).token_ids == expected
    with pytest.raises(RuntimeError, match="already decoded"):
        generate(model, state, 3)
