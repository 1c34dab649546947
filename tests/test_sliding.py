"""Hybrid attention models (sliding-window layers beside full-attention ones) and gpt-oss's attention sinks, on tiny
random Gemma 2, Gemma 3 (text), gpt-oss and an every-layer-sliding Mistral (keydiff.testing.tiny_hybrid_model)."""

from __future__ import annotations

import logging

import pytest
import torch

from keydiff import build_policy, generate, prefill
from keydiff.cache import EvictingCache
from keydiff.testing import HYBRID_ARCHITECTURES, tiny_hybrid_model

pytestmark = pytest.mark.integration

WINDOW = 48


@pytest.fixture(scope="module")
def models():
    return {name: tiny_hybrid_model(name, window=WINDOW) for name in HYBRID_ARCHITECTURES}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(1))


def stock_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[:, -1].float()


def loop_tokens(model, state, steps):
    """A plain greedy loop of model(...), with the model's own attention, on the state's cache."""
    cache, logits, tokens = state.cache, state.logits, []
    with torch.no_grad():
        for _ in range(steps):
            token = logits.argmax(-1)
            tokens.append(int(token))
            logits = model(input_ids=token[:, None], cache=cache, use_cache=True).logits[:, -1].float()
    return tokens


def stock_tokens(model, ids, new_tokens):
    """Greedy decoding with transformers' own cache and attention."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("architecture, window, policy, budget, block_size, statistics", [
    ("gemma2", WINDOW, "keydiff", 200, 32, "fast"),  # soft cap; 32-token blocks cross the window's edge
    ("gemma3", WINDOW, "full", None, 200, "fast"),
    ("gemma3", WINDOW, "snapkv", 500, 32, "materialized"),
    ("gpt_oss", WINDOW, "adakv", 200, 32, "fast"),  # sinks, head-adaptive pools
    ("gpt_oss", WINDOW, "adakv", 200, 32, "materialized"),
    ("mistral_sliding", 300, "keydiff", 250, 32, "fast"),  # N < window: evicting layers masked by position
])
def test_budget_at_least_the_prompt_equals_the_stock_model(models, ids, architecture, window, policy, budget,
                                                           block_size, statistics):
    model = models[architecture] if window == WINDOW else tiny_hybrid_model(architecture, window=window)
    if policy == "adakv":
        policy = build_policy("snapkv", head_budgets="adakv")
    state = prefill(model, ids, policy, budget, block_size, attention_statistics=statistics)
    assert torch.allclose(state.logits, stock_logits(model, ids), atol=1e-5)
    assert generate(model, state, 6).token_ids[0] == stock_tokens(model, ids, 6)


def test_a_hybrid_model_bounds_each_layer_kind_and_a_plain_loop_decodes_as_generate(models, ids):
    """Gemma 3: sliding layers hold the window less one, evicted ones N; a model(...) loop decodes as generate."""
    model = models["gemma3"]
    state = prefill(model, ids, "keydiff", 64, 32)
    assert state.cache.layer_budgets == [WINDOW - 1, 64] * 2
    assert state.cache.layer_max_total_entries == [2 * (WINDOW - 1 + 32), 2 * (64 + 32)] * 2  # 2 KV heads
    expected = generate(model, prefill(model, ids, "keydiff", 64, 32), 6).token_ids[0]
    assert loop_tokens(model, state, 6) == expected


def test_all_sliding_model_evicts_only_below_the_window(models, ids, caplog):
    """N >= window: the window bounds the cache, nothing evicts; N < window < L: masked by position and window."""
    model = models["mistral_sliding"]
    with caplog.at_level(logging.WARNING, logger="keydiff.cache.cache"):
        bounded = prefill(model, ids, "keydiff", 64, 32)
    assert "already bounds" in caplog.text
    assert bounded.cache.layer_kinds == ["sliding"] * 4
    assert torch.allclose(bounded.logits, stock_logits(model, ids), atol=1e-5)
    short = prefill(model, ids[:, :150], "keydiff", 40, 16)
    assert short.cache.layer_kinds == ["evicted"] * 4
    assert short.max_cache_entries == 56
    for positions in short.kept_positions:
        assert positions.shape[-1] == 40


def test_gpt_oss_sinks_under_head_adaptive_budgets_keep_the_same_on_both_statistics(models, ids):
    assert any(float(layer.self_attn.sinks.detach().abs().max()) > 0.1 for layer in models["gpt_oss"].model.layers)
    kept = [prefill(models["gpt_oss"], ids, build_policy("snapkv", head_budgets="adakv"), 64, 32,
                    attention_statistics=mode).kept_positions for mode in ("fast", "materialized")]
    assert all(torch.equal(a, b) for a, b in zip(*kept))


def test_evicted_window_layers_refuse_stock_attention(models, ids):
    model = models["mistral_sliding"]
    cache = EvictingCache(build_policy("keydiff"), 40, 4, block_size=16, max_tokens=64, config=model.config)
    with pytest.raises(RuntimeError, match="sliding window"), torch.no_grad():
        model(input_ids=ids[:, :16], cache=cache)


def test_contiguous_rerotation_and_sliding_windows_are_refused(models):
    policy = build_policy("keydiff", key_rerotation="contiguous")
    with pytest.raises(ValueError, match="sliding-window"):
        EvictingCache(policy, 64, 4, block_size=32, config=models["gemma3"].config)


def test_head_adaptive_under_an_every_layer_window_is_refused(models, ids):
    with pytest.raises(ValueError, match="head-adaptive"):
        prefill(models["mistral_sliding"], ids, build_policy("snapkv", head_budgets="adakv"), 40, 16)


def test_scratch_passes_leave_sliding_layers_as_they_were(models, ids):
    """KVzip's reconstruction pass runs against the window and is forgotten afterwards."""
    model = models["gemma3"]
    state = prefill(model, ids, "kvzip", 64, 32)
    layer = state.cache.layers[0]
    assert layer.seen == ids.shape[1] and layer.num_entries == WINDOW - 1
    assert generate(model, state, 3).token_ids[0]


@pytest.mark.unit
@pytest.mark.parametrize("config_name, layers, window, full", [
    ("Gemma3TextConfig", 34, 1024, 5), ("Gemma3TextConfig", 48, 1024, 8), ("GptOssConfig", 24, 128, 12)])
def test_real_layer_patterns_behind_the_memory_rows(config_name, layers, window, full):
    """docs/gpu.md's hybrid rows count these full-attention layers (transformers' own layer patterns)."""
    import transformers

    from keydiff.cache.sliding import layer_windows

    windows = layer_windows(getattr(transformers, config_name)(num_hidden_layers=layers, sliding_window=window))
    assert windows.count(None) == full and set(windows) - {None} == {window}


@pytest.mark.extended
@pytest.mark.parametrize("architecture", ["gpt_oss", "gemma2"])
def test_fast_statistics_path_with_sinks_or_softcap_equals_the_materialised_one(ids, monkeypatch, architecture):
    """On FlashAttention, gpt-oss / Gemma 2's fast statistic (sinks, soft cap) keeps what the materialised one keeps."""
    import sys
    import types

    model = tiny_hybrid_model(architecture, window=WINDOW)
    materialised = prefill(model, ids, "snapkv", 64, 32)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=None, __version__="2.6.3"))
    model.config._attn_implementation = "flash_attention_2"  # as loaded with flash-attn installed
    monkeypatch.setattr(model, "set_attn_implementation",
                        lambda name: setattr(model.config, "_attn_implementation", name))
    fast = prefill(model, ids, "snapkv", 64, 32)
    assert all(torch.equal(a, b) for a, b in zip(fast.kept_positions, materialised.kept_positions))
    assert torch.allclose(fast.logits, materialised.logits, atol=1e-5)
    assert generate(model, fast, 4).token_ids == generate(model, materialised, 4).token_ids
