"""Hybrid attention models (sliding-window layers beside full-attention ones) and gpt-oss's attention sinks, on tiny
random Gemma 2, Gemma 3 (text), gpt-oss and an every-layer-sliding Mistral (keydiff.testing.tiny_hybrid_model)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from keydiff import build_policy, generate, keydiff_attention, prefill
from keydiff.cache import EvictingCache
from keydiff.testing import HYBRID_ARCHITECTURES, tiny_hybrid_model

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
