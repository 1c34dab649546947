"""Hybrid attention models (sliding-window layers beside full-attention ones) and gpt-oss's attention sinks, on tiny
random Gemma 2, Gemma 3 (text), gpt-oss and an every-layer-sliding Mistral (keydiff.testing.tiny_hybrid_model)."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from keydiff import build_policy, generate, keydiff_attention, prefill
from keydiff.attention import LogitRules, attention_statistic, eager_attention, statistic_from_weights
from keydiff.cache import EvictingCache
from keydiff.testing import HYBRID_ARCHITECTURES, check_policy, tiny_hybrid_model

pytestmark = pytest.mark.integration

WINDOW = 48
HYBRID = ("gemma2", "gemma3", "gpt_oss")


@pytest.fixture(scope="module")
def models():
    return {name: tiny_hybrid_model(name, window=WINDOW) for name in HYBRID_ARCHITECTURES}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(1))


def stock_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[:, -1].float()


def loop_tokens(model, state, steps, bound=True):
    """A plain greedy loop through model(...) on the state's cache, with keydiff's attention or the model's own."""
    cache, logits, tokens = state.cache, state.logits, []
    with torch.no_grad(), (keydiff_attention(model, cache) if bound else contextlib.nullcontext()):
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


@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
@pytest.mark.parametrize("policy, budget", [("full", None), ("keydiff", 200), ("snapkv", 500)])
@pytest.mark.parametrize("block_size", [32, 200])
def test_full_and_budget_at_least_prompt_equal_the_stock_forward_pass(models, ids, architecture, policy, budget,
                                                                       block_size):
    model = models[architecture]
    state = prefill(model, ids, policy, budget, block_size)  # 32: blocks cross the 48-token window's edge
    assert torch.allclose(state.logits, stock_logits(model, ids), atol=1e-5)
    assert generate(model, state, 6).token_ids[0] == stock_tokens(model, ids, 6)


@pytest.mark.parametrize("architecture", HYBRID)
@pytest.mark.parametrize("policy", ["keydiff", "snapkv", "h2o"])
def test_bound_holds_per_layer_kind(models, ids, architecture, policy):
    budget, block = 64, 32
    peaks = []

    def check(cache):
        for kind, layer in zip(cache.layer_kinds, cache.layers):
            limit = WINDOW - 1 if kind == "sliding" else budget
            assert layer.num_entries <= limit  # after each block: the window (less one), or N
        peaks.append(cache.layer_max_entries)

    state = prefill(models[architecture], ids, policy, budget, block, on_block=check)
    cache = state.cache
    assert cache.layer_kinds == ["sliding", "evicted"] * 2
    assert cache.layer_budgets == [WINDOW - 1, budget] * 2
    # Peaks: the window less one plus a block (as transformers' sliding layer returns), N + B.
    assert cache.layer_max_entries == [WINDOW - 1 + block, budget + block] * 2
    generate(models[architecture], state, 5)
    assert cache.layer_max_entries == [WINDOW - 1 + block, budget + block] * 2
    assert [layer.num_entries for layer in cache.layers] == [WINDOW - 1, budget] * 2
    # Memory counts both kinds: every layer's keys and values.
    assert cache.kv_cache_bytes > 0 and cache.entries_peak_sum == 2 * (WINDOW - 1 + block) + 2 * (budget + block)
    sliding = cache.kept_positions()[0]
    assert torch.equal(sliding[0, 0], torch.arange(ids.shape[1] + 4 - (WINDOW - 1), ids.shape[1] + 4))


@pytest.mark.extended
@pytest.mark.parametrize("architecture", HYBRID)
@pytest.mark.parametrize("policy, bound", [("keydiff", True), ("snapkv", True), ("keydiff", False)])
def test_plain_decoding_loop_equals_generate(models, ids, architecture, policy, bound):
    """A plain greedy loop gives generate's tokens, with keydiff's attention or (attention-free policy) without it."""
    model = models[architecture]
    expected = generate(model, prefill(model, ids, policy, 64, 32), 6).token_ids[0]
    assert loop_tokens(model, prefill(model, ids, policy, 64, 32), 6, bound=bound) == expected


@pytest.mark.extended
@pytest.mark.parametrize("statistics", ["fast", "materialized"])
def test_gpt_oss_sinks_and_head_adaptive_layers(models, ids, statistics):
    """gpt-oss sinks with AdaKV pools, both statistics: N >= L is the stock model; under a budget both paths agree."""
    model = models["gpt_oss"]
    assert any(float(layer.self_attn.sinks.detach().abs().max()) > 0.1 for layer in model.model.layers)
    adaptive = build_policy("snapkv", head_budgets="adakv")
    state = prefill(model, ids, adaptive, 200, 32, attention_statistics=statistics)
    assert torch.allclose(state.logits, stock_logits(model, ids), atol=1e-5)
    assert generate(model, state, 5).token_ids[0] == stock_tokens(model, ids, 5)
    kept = [prefill(model, ids, policy, 64, 32, attention_statistics=mode).kept_positions
            for mode in ("fast", "materialized") for policy in [build_policy("snapkv", head_budgets="adakv")]]
    assert all(torch.equal(a, b) for a, b in zip(*kept))
    assert generate(model, prefill(model, ids, adaptive, 64, 32, attention_statistics=statistics), 3).token_ids[0]


@pytest.mark.unit
def test_sink_statistic_matches_the_materialised_weights():
    torch.manual_seed(0)
    query, key = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 9, 8)
    rules = LogitRules(sinks=torch.randn(4), softcap=3.0)
    _, weights = eager_attention(torch.nn.Module(), query, key, torch.randn(1, 2, 9, 8), 0.3, rules)
    assert float(weights.sum(-1).max()) < 1.0  # the sinks take their share of every row
    fast = attention_statistic(query, key, 0.3, None, rules=rules)
    assert torch.allclose(fast, statistic_from_weights(weights, 2, None), atol=1e-6)
    assert not torch.allclose(fast, attention_statistic(query, key, 0.3, None), atol=1e-3)


@pytest.mark.extended
def test_all_sliding_model_evicts_on_top_of_the_window_below_it(models, ids, caplog):
    model = models["mistral_sliding"]
    with caplog.at_level(logging.WARNING, logger="keydiff.cache.cache"):
        bounded = prefill(model, ids, "keydiff", 64, 32)
    assert "already bounds" in caplog.text  # N >= window: the window bounds it, no eviction
    assert bounded.cache.layer_kinds == ["sliding"] * 4
    assert torch.allclose(bounded.logits, stock_logits(model, ids), atol=1e-5)
    # N >= L and N < window: every key within the window is kept, so the window mask by position is exact.
    long_window = tiny_hybrid_model("mistral_sliding", window=300)
    state = prefill(long_window, ids, "keydiff", 250, 32)
    assert state.cache.layer_kinds == ["evicted"] * 4
    assert torch.allclose(state.logits, stock_logits(long_window, ids), atol=1e-5)
    # N < window < L: entries chosen by the policy, each masked by its position and the window.
    short = prefill(model, ids[:, :150], "keydiff", 40, 16)
    assert short.cache.layer_kinds == ["evicted"] * 4 and short.max_cache_entries == 56
    for positions in short.kept_positions:
        assert positions.shape[-1] == 40
    loop_state = prefill(model, ids[:, :150], "keydiff", 40, 16)
    assert loop_tokens(model, loop_state, 4) == generate(model, short, 4).token_ids[0]


def test_window_mask_by_position_equals_the_stock_mask_for_keys_in_order(models, ids):
    """An evicting layer under a window, given every token (N >= L, block crossing the edge), equals transformers'."""
    model = models["mistral_sliding"]
    cache = EvictingCache(build_policy("keydiff"), 40, 4, block_size=16, max_tokens=30, config=model.config)
    assert cache.layer_kinds == ["evicted"] * 4
    with torch.no_grad(), keydiff_attention(model, cache):
        for start in range(0, 30, 16):
            logits = model(input_ids=ids[:, start:start + 16][:, :30 - start], cache=cache).logits
    assert torch.allclose(logits[:, -1], stock_logits(model, ids[:, :30]), atol=1e-5)


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


@pytest.mark.extended
@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_check_policy_runs_on_hybrid_models(models, architecture):
    summary = check_policy("keydiff", model=models[architecture], budget=40, prompt_tokens=160, block_size=16)
    assert summary["evictions"] > 0 or architecture == "mistral_sliding"


def test_scratch_passes_leave_sliding_layers_as_they_were(models, ids):
    """KVzip's reconstruction pass runs against the window and is forgotten afterwards."""
    model = models["gemma3"]
    state = prefill(model, ids, "kvzip", 64, 32)
    layer = state.cache.layers[0]
    assert layer.seen == ids.shape[1] and layer.num_entries == WINDOW - 1
    assert generate(model, state, 3).token_ids[0]


@pytest.mark.extended
def test_run_py_on_a_saved_random_gemma3(tmp_path, monkeypatch):
    """run.py on a saved tiny Gemma 3: the summary records each layer's bound (window less one, or N), held."""
    import json
    import runpy
    import sys
    from pathlib import Path

    from keydiff.run import runner
    from tests.conftest import char_tokenizer

    model_dir = tmp_path / "tiny-gemma3"
    tiny_hybrid_model("gemma3", window=WINDOW).save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    monkeypatch.setattr(runner, "_LOADED", {})
    arguments = ["model=custom", f"model.path={model_dir}", "model.dtype=float32", "model.device=cpu",
                 "model.max_length=4096", "policy=keydiff", "budget=r0.25", "block_size=32", "task=niah_small",
                 "task.context_lengths=[300]", "task.depths=[50]", f"results_root={tmp_path / 'runs'}",
                 "hydra/hydra_logging=none", "hydra/job_logging=none"]
    monkeypatch.setattr(sys, "argv", ["run.py", *arguments])
    runpy.run_path(str(Path(__file__).parents[1] / "run.py"), run_name="__main__")
    summaries = list((tmp_path / "runs").rglob("summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    statistics = summary.get("statistics", summary)
    budget = statistics["layer_budgets"][1]
    assert budget == -(-statistics["max_prompt_tokens"] // 4)  # r0.25
    assert statistics["layer_budgets"] == [WINDOW - 1, budget] * 2 and statistics["cache_bound_held"] is True
    assert statistics["layer_cache_bounds"] == [WINDOW - 1 + 32, budget + 32] * 2
    assert statistics["layer_max_cache_entries"] == statistics["layer_cache_bounds"]
    rows = [json.loads(line) for line in (summaries[0].parent / "predictions.jsonl").read_text().splitlines()]
    assert [row["kept_tokens"] for row in rows] == [budget]  # the full-attention layers' entries, not the window's


@pytest.mark.extended
def test_multimodal_gemma3_checkpoint_runs_text_prompts(ids):
    """Gemma3ForConditionalGeneration (text + SigLIP) serves its text layers by the text config's layer kinds."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"] * 2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                          boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    assert torch.allclose(prefill(model, ids, "full", None, 32).logits, stock_logits(model, ids), atol=1e-5)
    state = prefill(model, ids, "keydiff", 64, 32)
    assert state.cache.layer_kinds == ["sliding", "evicted"] * 2
    assert state.cache.layer_max_entries == [WINDOW - 1 + 32, 96] * 2


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
