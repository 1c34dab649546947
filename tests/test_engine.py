"""Engine invariants on a tiny random Llama: exactness of block prefill, the N + B bound, positions."""

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


def test_whole_prompt_block_is_one_forward_then_eviction(model, prompt):
    state = prefill(model, prompt, "keydiff", 100, None)
    assert state.max_cache_entries == prompt.shape[1]
    assert all(p.shape[-1] == 100 for p in state.kept_positions)
    assert torch.allclose(state.logits, reference_logits(model, prompt), atol=1e-5)  # eviction after the forward


@pytest.mark.extended
@pytest.mark.parametrize("name", ["keydiff", "h2o", "snapkv"])
def test_eager_and_sdpa_models_agree(prompt, name):
    a = prefill(tiny_llama("sdpa"), prompt, name, 80, 32)
    b = prefill(tiny_llama("eager"), prompt, name, 80, 32)
    assert torch.allclose(a.logits, b.logits, atol=1e-4)
    assert all(torch.equal(x, y) for x, y in zip(a.kept_positions, b.kept_positions))


@pytest.mark.extended
def test_greedy_full_generation_equals_transformers_generate(model, prompt):
    state = prefill(model, prompt, "full", None, 50)
    out = generate(model, state, 15)
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=15, do_sample=False, min_new_tokens=15)
    assert out.token_ids[0] == ref[0, prompt.shape[1] :].tolist()


@pytest.mark.extended
def test_stop_tokens_min_new_tokens_and_length(model, prompt):
    state = prefill(model, prompt, "full", None, 128)
    first = generate(model, prefill(model, prompt, "full", None, 128), 3).token_ids[0][0]
    stopped = generate(model, state, 10, eos_token_ids=[first])
    assert stopped.token_ids[0] == [first] and stopped.finish_reasons == ["stop"]
    forced = generate(model, prefill(model, prompt, "full", None, 128), 4, eos_token_ids=[first], min_new_tokens=2)
    assert forced.token_ids[0][0] != first and len(forced.token_ids[0]) >= 2


@pytest.mark.parametrize("name", ["keydiff", "tova", "snapkv"])
def test_batch_rows_are_independent(model, name):
    """Each row of a stacked batch-2 prefill keeps what it keeps alone (stacked row l * batch + b is layer l, row b)."""
    batch = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(4))
    joint = prefill(model, batch, name, 40, 32)
    assert joint.cache.stack is not None
    for row in range(2):
        single = prefill(model, batch[row : row + 1], name, 40, 32)
        assert torch.allclose(joint.logits[row], single.logits[0], atol=1e-4)
        assert all(torch.equal(a[row], b[0]) for a, b in zip(joint.kept_positions, single.kept_positions))


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


def test_options_objects_and_keywords_run_the_same(model, prompt):
    """PrefillOptions and Request are the keyword calls; explicit keywords replace their fields."""
    from keydiff import PrefillOptions, Request

    settings = dict(held_suffix=10, attention_statistics="materialized")
    by_keywords = prefill(model, prompt, "keydiff", 40, 16, **settings)
    by_options = prefill(model, prompt, "keydiff", 40, options=PrefillOptions(block_size=16, **settings))
    replaced = prefill(model, prompt, "keydiff", 40, 16, options=PrefillOptions(block_size=99, held_suffix=3),
                       held_suffix=10, attention_statistics="materialized")
    for state in (by_options, replaced):
        assert (state.block_size, state.held_suffix) == (16, 10)
        assert torch.equal(state.logits, by_keywords.logits)
        assert all(torch.equal(a, b) for a, b in zip(state.kept_positions, by_keywords.kept_positions))
    sampling = dict(do_sample=True, temperature=0.7, seed=3)
    expected = generate(model, by_keywords, 6, **sampling).token_ids
    assert generate(model, Request(by_options, 6, **sampling)).token_ids == expected
    assert generate(model, Request(replaced, 99, seed=0), max_new_tokens=6, do_sample=True, temperature=0.7,
                    seed=3).token_ids == expected


def tiny_qwen2(**overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, **overrides)).eval()


@pytest.mark.extended
def test_qwen2_sliding_window_layers_keep_their_window(prompt):
    """Qwen2 with use_sliding_window: its top layer slides (keydiff.cache.sliding), the other is evicted."""
    model = tiny_qwen2(use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert torch.allclose(prefill(model, prompt, "full", None, 32).logits, reference_logits(model, prompt), atol=1e-5)
    state = prefill(model, prompt, "keydiff", 64, 32)
    assert state.cache.layer_kinds == ["evicted", "sliding"] and state.cache.layer_max_entries == [96, 63 + 32]


@pytest.mark.unit
@pytest.mark.extended
def test_linear_attention_models_are_refused(prompt):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="linear_attention layers"):
        prefill(Qwen3NextForCausalLM(config).eval(), prompt, "keydiff", 64, 32)


def test_qwen2_full_attention_block_prefill_is_exact(prompt):
    model = tiny_qwen2()  # q/k/v biases, like Qwen2.5
    state = prefill(model, prompt, "full", None, 64)
    assert torch.allclose(state.logits, reference_logits(model, prompt), atol=1e-5)
    assert prefill(model, prompt, "tova", 50, 64).max_cache_entries == 114


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


def test_prefill_result_is_a_snapshot_and_decodes_once(model, prompt):
    state = prefill(model, prompt[:, :50], "recent", 100, 16)
    generate(model, state, 10)
    assert [p.shape[-1] for p in state.kept_positions] == [50, 50, 50]  # after prefill, not after decoding
    assert state.cache.layers[0].num_entries == 59 and state.cache.get_seq_length() == 59
    with pytest.raises(RuntimeError, match="already decoded"):
        generate(model, state, 3)


@pytest.mark.unit
def test_top_p_zero_keeps_the_most_likely_token():
    from keydiff.decode import next_token

    logits = torch.tensor([[0.1, 3.0, 0.2]])
    draws = {int(next_token(logits, True, 1.0, 0.0, torch.Generator().manual_seed(s))) for s in range(20)}
    assert draws == {1}


@pytest.mark.extended
def test_decoding_without_eviction_computes_no_statistics(model, prompt):
    state = prefill(model, prompt, "tova", 64, 32)
    before = state.cache.timings["statistics_s"]
    state.cache.profile = True
    generate(model, state, 5, evict=False)
    assert state.cache.timings["statistics_s"] == before
    assert all(layer.attention is None for layer in state.cache.layers)
