"""Guards against plausible engine and runner regressions, through the public API only: each block's kept set is
checked against scores recomputed by stock transformers (eager attention weights, a DynamicCache holding the
engine's kept entries), which then adopts the engine's choice so a float near-tie cannot make later blocks diverge."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from omegaconf import OmegaConf, open_dict
from transformers import DynamicCache

from keydiff import build_policy, generate, prefill
from keydiff.decode import next_token
from keydiff.policies import LayerView
from keydiff.policies.h2o import H2O
from tests.conftest import char_tokenizer, tiny_llama

pytestmark = pytest.mark.integration

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 16  # tests/conftest.py tiny_llama (checked by the engine_model fixture)


def random_prompt(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def sorted_positions(positions: torch.Tensor) -> torch.Tensor:
    return positions.sort(dim=-1).values


def engine_positions(cache) -> list[torch.Tensor]:
    """Sorted absolute positions held by every layer of a live cache (public view API only)."""
    return [sorted_positions(cache.layers[i].view(i).positions) for i in range(LAYERS)]


class StockReference:
    """Block-wise processing by stock transformers over a chosen set of cached entries per layer and KV head."""

    def __init__(self, model):
        self.model = model
        self.entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None  # keys, values, positions

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Run `input_ids` at absolute positions start.. against the entries; returns (last logits, attentions)."""
        batch, q = input_ids.shape
        cache = DynamicCache()
        if self.entries is not None:
            for layer_idx, (keys, values, _) in enumerate(self.entries):
                cache.update(keys, values, layer_idx)
        position_ids = torch.arange(start, start + q).expand(batch, q)
        out = self.model(input_ids, cache=cache, position_ids=position_ids, use_cache=True,
                         output_attentions=True)
        new_positions = torch.arange(start, start + q).expand(batch, KV_HEADS, q)
        entries = []
        for layer_idx, layer in enumerate(cache.layers):
            old = None if self.entries is None else self.entries[layer_idx][2]
            positions = new_positions if old is None else torch.cat([old, new_positions], dim=-1)
            entries.append((layer.keys, layer.values, positions))
        self.entries = entries
        return out.logits[:, -1].float(), out.attentions

    def positions(self, layer_idx: int) -> torch.Tensor:
        return self.entries[layer_idx][2]

    def keep(self, layer_idx: int, kept: torch.Tensor) -> None:
        """Keep the entries whose positions are `kept` [batch, kv_heads, k] (each must be held exactly once)."""
        keys, values, positions = self.entries[layer_idx]
        match = positions[..., :, None] == kept[..., None, :]  # [b, h, n, k]
        assert torch.all(match.sum(dim=-2) == 1), "the engine kept a position the reference does not hold"
        index = match.int().argmax(dim=-2)  # [b, h, k]
        gather = index[..., None].expand(-1, -1, -1, keys.shape[-1])
        self.entries[layer_idx] = (keys.gather(2, gather), values.gather(2, gather), positions.gather(2, index))


def group_mean(summed: torch.Tensor) -> torch.Tensor:
    """[b, H, n] per query head -> [b, KV_HEADS, n] averaged over each KV head's query group (repeat_kv order)."""
    b, heads, n = summed.shape
    return summed.float().view(b, KV_HEADS, heads // KV_HEADS, n).mean(dim=2)


def tova_scores():
    def score(layer_idx, attention, positions):
        return group_mean(attention[:, :, -1, :])  # the last query row only

    return score


def snapkv_scores(window: int, kernel: int, pooling: str):
    def score(layer_idx, attention, positions):
        stat = group_mean(attention[:, :, -window:, :].sum(dim=2))  # last `window` rows (fewer if shorter)
        n = stat.shape[-1]
        prefix = max(n - window, 0)
        out = torch.full_like(stat, math.inf)  # the window itself is always kept
        half = kernel // 2
        for i in range(prefix):  # neighbours inside the prefix only (pooling over position order)
            neighbours = stat[..., max(i - half, 0) : min(i + half + 1, prefix)]
            out[..., i] = neighbours.amax(dim=-1) if pooling == "max" else neighbours.sum(dim=-1) / kernel
        return out

    return score


def h2o_scores(length: int):
    accumulated = [torch.zeros(1, KV_HEADS, length) for _ in range(LAYERS)]  # by absolute position

    def score(layer_idx, attention, positions):
        column_sums = group_mean(attention.sum(dim=2))  # every query row of this pass
        accumulated[layer_idx] = accumulated[layer_idx].scatter_add(2, positions, column_sums)
        return accumulated[layer_idx].gather(2, positions)

    return score


def assert_top_budget(scores: torch.Tensor, positions: torch.Tensor, kept: torch.Tensor, budget: int, where: str):
    """`kept` (positions) must be `budget` entries whose reference scores are all >= every evicted one's."""
    assert kept.shape[-1] == budget, where
    in_kept = (positions[..., :, None] == kept[..., None, :]).any(dim=-1)
    finite = scores[torch.isfinite(scores)]
    # Engine (SDPA + its own statistic) vs stock eager differ by ~1e-7 relative; exact ties (max pooling
    # plateaus) may be broken either way.
    tolerance = 1e-5 * (1.0 + (finite.abs().max().item() if finite.numel() else 0.0))
    lowest_kept = scores.masked_fill(~in_kept, math.inf).amin(dim=-1)
    highest_evicted = scores.masked_fill(in_kept, -math.inf).amax(dim=-1)
    bad = lowest_kept < highest_evicted - tolerance
    assert not bad.any(), (
        f"{where}: kept set is not the top-{budget} of the reference scores "
        f"(lowest kept {lowest_kept.tolist()}, highest evicted {highest_evicted.tolist()})"
    )


def check_prefill_against_reference(engine_model, reference_model, prompt, policy, budget, block, scorer,
                                     statistics="fast"):
    """Run the engine's prefill and replay it block by block in the stock reference; returns (state, ref, evictions)."""
    per_block: list[list[torch.Tensor]] = []
    state = prefill(engine_model, prompt, policy, budget, block, attention_statistics=statistics,
                    on_block=lambda cache: per_block.append(engine_positions(cache)))
    length = prompt.shape[1]
    starts = list(range(0, length, block))
    assert len(per_block) == len(starts)
    reference = StockReference(reference_model)
    evictions = 0
    for index, start in enumerate(starts):
        logits, attentions = reference.forward(prompt[:, start : start + block], start)
        for layer_idx in range(LAYERS):
            positions = reference.positions(layer_idx)
            scores = scorer(layer_idx, attentions[layer_idx], positions)
            kept = per_block[index][layer_idx]
            if positions.shape[-1] <= budget:
                assert torch.equal(kept, positions), f"block {index} layer {layer_idx}: evicted while under budget"
            else:
                evictions += 1
                assert_top_budget(scores, positions, kept, budget, f"block {index} layer {layer_idx}")
                reference.keep(layer_idx, kept)
    assert torch.allclose(state.logits, logits, atol=1e-4), (state.logits - logits).abs().max()
    for final, kept in zip(state.kept_positions, per_block[-1]):
        assert torch.equal(sorted_positions(final), kept)
    return state, reference, evictions


@pytest.fixture(scope="module")
def engine_model():
    model = tiny_llama("sdpa")
    config = model.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
    return model


@pytest.fixture(scope="module")
def reference_model():
    return tiny_llama("eager")


# Hand-computed, kernel 3, window = the last 2 entries, budget 5 (the window + 3 of the prefix); entry i sits at
# position 100 + i in a shuffled buffer (pooling follows positions). max: the peak at 2 makes 1, 2, 3 score 0.9.
# avg (avg_pool1d, zero padding, / 3; the window is no neighbour): pooled .333 .333 .233 .200 .467 .367 .433 .367
# .500 .367 keeps 8, 4, 6; max pooling would keep {4, 5, 6}, no pooling {0, 5, 8}, count_include_pad=False
# {0, 8, 9}, the window as a neighbour {4, 8, 9}.
@pytest.mark.unit
@pytest.mark.parametrize("pooling, attention, kept", [
    ("max", [0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.1, 0.1], [101, 102, 103, 110, 111]),
    ("avg", [0.7, 0.3, 0.0, 0.4, 0.2, 0.8, 0.1, 0.4, 0.6, 0.5, 0.9, 0.9], [104, 106, 108, 110, 111]),
])
def test_snapkv_pooling_keeps_the_hand_computed_entries(pooling, attention, kept):
    n = len(attention)
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(5))  # slot s holds entry slots[s]
    view = LayerView(torch.randn(1, 1, n, 4), torch.randn(1, 1, n, 4), (100 + slots).view(1, 1, n),
                     torch.tensor(attention)[slots].view(1, 1, n), {}, 0)
    policy = build_policy("snapkv", window=2, kernel_size=3, pooling=pooling)
    assert sorted_positions(view.positions.gather(-1, policy.keep_indices(view, 5)))[0, 0].tolist() == kept


@pytest.mark.extended
@pytest.mark.parametrize("statistics", ["fast", "materialized"])
@pytest.mark.parametrize("name, params, scorer", [
    ("tova", {}, lambda length: tova_scores()),
    ("snapkv", {"window": 6, "kernel_size": 5, "pooling": "max"}, lambda length: snapkv_scores(6, 5, "max")),
    ("h2o", {"recent_fraction": 0.0}, lambda length: h2o_scores(length)),
], ids=["tova", "snapkv_max", "h2o"])
def test_attention_policies_match_stock_transformers_blockwise(engine_model, reference_model, statistics, name,
                                                               params, scorer):
    """Budget 80, blocks of 20: four passes stay under budget (H2O must still accumulate them), then six evict."""
    prompt = random_prompt(200, seed=11)
    policy = build_policy(name, **params)
    _, _, evictions = check_prefill_against_reference(engine_model, reference_model, prompt, policy, 80, 20,
                                                      scorer(200), statistics)
    assert evictions == 6 * LAYERS


@pytest.mark.extended
def test_greedy_decoding_after_eviction_matches_stock_transformers(engine_model, reference_model):
    """Sink policy (kept set known by rule), eviction after every decoded token; keys compared by position."""
    length, budget, block, sinks, new_tokens = 120, 40, 32, 4, 8
    prompt = random_prompt(length, seed=3)
    policy = build_policy("sink", sinks=sinks)

    def sink_rule(layer_idx, attention, positions):
        return torch.where(positions < sinks, math.inf, positions.float())

    state, reference, _ = check_prefill_against_reference(engine_model, reference_model, prompt, policy, budget, block,
                                                          sink_rule)
    logits = state.logits.clone()  # after the prompt
    tokens = generate(engine_model, state, new_tokens).token_ids[0]
    assert len(tokens) == new_tokens
    for step, token in enumerate(tokens):
        # Greedy: the engine's token must maximise the reference logits (up to float noise).
        assert logits[0, token] >= logits[0].max() - 1e-4, f"step {step}"
        if step == new_tokens - 1:
            break  # the last token is never fed back
        logits, _ = reference.forward(torch.tensor([[token]]), length + step)
        for layer_idx in range(LAYERS):
            positions = reference.positions(layer_idx)
            if positions.shape[-1] > budget:
                keep = (positions < sinks) | (positions > positions.max() - (budget - sinks))
                reference.keep(layer_idx, positions[keep].view(1, KV_HEADS, budget))
    for layer_idx in range(LAYERS):
        view = state.cache.layers[layer_idx].view(layer_idx)
        order = view.positions.argsort(dim=-1)
        positions = view.positions.gather(-1, order)
        keys, values, expected_positions = reference.entries[layer_idx]
        assert torch.equal(positions, expected_positions), f"layer {layer_idx}: {positions[0, 0].tolist()}"
        gather = order[..., None].expand(-1, -1, -1, HEAD_DIM)
        # Keys are cached after RoPE: a token fed at the wrong position has a differently rotated key.
        assert torch.allclose(view.keys.gather(2, gather), keys, atol=1e-4), f"layer {layer_idx} keys"
        assert torch.allclose(view.values.gather(2, gather), values, atol=1e-4), f"layer {layer_idx} values"
        # The fed-back tokens sit at the absolute positions after the prompt, whatever the cache size.
        fed_back = list(range(length, length + new_tokens - 1))
        assert positions[0, 0, -len(fed_back):].tolist() == fed_back


@pytest.mark.unit
@pytest.mark.parametrize("top_p, nucleus", [(0.7, {0, 1}), (0.85, {0, 1, 2}), (0.97, {0, 1, 2, 3}), (0.4, {0})])
def test_top_p_samples_exactly_the_nucleus(top_p, nucleus):
    """probs [0.5, 0.3, 0.15, 0.05]: the nucleus is the smallest prefix whose mass reaches top_p (crossing token in)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # Row r holds the same distribution with its tokens permuted, so a wrong scatter back shows as well.
    perms = [torch.tensor(p) for p in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1], [1, 3, 0, 2])]
    logits = torch.stack([torch.log(probs)[p.argsort()] for p in perms])  # token perm[r][k] has probs[k]
    counts = [dict() for _ in perms]
    for seed in range(150):
        drawn = next_token(logits, True, 1.0, top_p, torch.Generator().manual_seed(seed))
        for row, token in enumerate(drawn.tolist()):
            rank = int((perms[row] == token).nonzero())  # back to the rank in probs
            counts[row][rank] = counts[row].get(rank, 0) + 1
    for row in range(len(perms)):
        assert set(counts[row]) == nucleus, (row, counts[row])
    # Within the nucleus the draw follows the renormalised probabilities (loose: 600 draws).
    total = sum(sum(c.values()) for c in counts)
    mass = float(probs[sorted(nucleus)].sum())
    for rank in nucleus:
        frequency = sum(c.get(rank, 0) for c in counts) / total
        assert abs(frequency - float(probs[rank]) / mass) < 0.07, (rank, frequency)


def runner_cfg(model_dir, *overrides: str, task: dict | None = None):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=custom", f"model.path={model_dir}", "model.dtype=float32",
                                           "model.device=cpu", "model.max_length=4096",
                                           f"results_root={model_dir.parent / 'runs'}", *overrides])
    with open_dict(cfg):
        cfg.task = OmegaConf.create({"_target_": "tests.conftest.LengthsTask", "name": "guard_lengths",
                                     "lengths": [30, 100], "max_new_tokens": 4, "limit": None, **(task or {})})
    return cfg


@pytest.fixture
def tiny_runner(tmp_path, monkeypatch):
    """runner.run with the tiny model and char tokenizer; (runner, model folder, model loads so far)."""
    from keydiff.run import runner

    model = tiny_llama("sdpa")
    model_dir = tmp_path / "tiny-model"
    model.config.save_pretrained(model_dir)  # model=custom validates a local folder with a config.json
    calls = {"load": 0}

    def load(cfg):
        calls["load"] += 1
        return model, char_tokenizer()

    monkeypatch.setattr(runner, "load_model", load)
    monkeypatch.setattr(runner, "_LOADED", {})
    return runner, model_dir, calls


def read_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]


def stock_kv_bytes_per_token(model) -> int:
    """Bytes transformers' own DynamicCache spends on one prompt token over all layers: measured, not computed."""
    tokens = 10
    with torch.no_grad():
        cache = model(torch.zeros(1, tokens, dtype=torch.long), use_cache=True).cache
    total = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert total % tokens == 0
    return total // tokens


def hand_peak_entries(length: int, budget: int, block: int, fed_back: int) -> int:
    """Peak entries per layer: blocks append, each pass evicts back to the budget, decoding feeds tokens back."""
    size = peak = 0
    for start in range(0, length, block):
        size += min(block, length - start)
        peak, size = max(peak, size), min(size, budget)
    for _ in range(fed_back):
        size += 1
        peak, size = max(peak, size), min(size, budget)
    return peak


@pytest.mark.extended
def test_runner_rows_cap_compression_and_count_keys_and_values(tmp_path, tiny_runner):
    runner, model_dir, _ = tiny_runner
    budget, block, new_tokens = 48, 16, 4
    summary = runner.run(runner_cfg(model_dir, "policy=keydiff", f"budget.tokens={budget}", f"block_size={block}"),
                         tmp_path / "run")
    rows = {row["sample_id"]: row for row in read_rows(tmp_path / "run")}
    assert set(rows) == {"len30", "len100"}
    per_layer_entry = stock_kv_bytes_per_token(tiny_llama("sdpa")) // LAYERS  # keys + values, one layer
    for length in (30, 100):
        row = rows[f"len{length}"]
        assert row["prompt_tokens"] == length and row["new_tokens"] == new_tokens
        assert row["kept_tokens"] == min(length, budget)
        assert row["kept_ratio"] == pytest.approx(min(budget / length, 1.0))  # a short prompt is not "compressed" > 1
        peak = hand_peak_entries(length, budget, block, new_tokens - 1)
        assert row["max_cache_entries"] == peak
        assert row["kv_cache_held_peak_bytes"] == LAYERS * peak * per_layer_entry
    stats = summary["statistics"]
    assert stats["mean_kept_ratio"] == pytest.approx((1.0 + budget / 100) / 2)


@pytest.mark.parametrize("dtype, shape", [(torch.float32, {}), (torch.bfloat16, {"num_key_value_heads": 1,
                                                                                 "head_dim": 24})])
def test_kv_bytes_per_layer_entry_counts_keys_and_values(dtype, shape):
    """Bytes per cached token and layer equal a stock DynamicCache's (keys and values, KV heads, head_dim 24, dtype)."""
    from keydiff.run.samples import kv_bytes_per_layer_entry

    model = tiny_llama("sdpa", **shape).to(dtype)
    assert kv_bytes_per_layer_entry(model) * LAYERS == stock_kv_bytes_per_token(model)


@dataclass
class ObservedH2O(H2O):
    """H2O that keeps a copy of every statistic it adds up, by layer (so it evicts layer by layer)."""

    needs: ClassVar[Needs] = replace(H2O.needs, rows_alike=False)
    observed: list = field(default_factory=list, kw_only=True, repr=False)

    def observe(self, layer: LayerView) -> None:
        self.observed.append((layer.layer_idx, layer.positions.clone(), layer.attention.clone()))
        super().observe(layer)


@pytest.mark.extended
@pytest.mark.parametrize("dtype, statistics", [(torch.bfloat16, "fast"), (torch.float16, "materialized")],
                         ids=["bf16_fast", "fp16_materialized"])
def test_h2o_accumulates_in_float32_in_low_precision_models(dtype, statistics):
    """Every held entry's H2O score is the float32 sum (recomputed in float64) of the attention it was handed."""
    # Decoding adds ~1/100 to sums of 1.4-6.7, below half a bf16 ulp. Measured worst relative error: <= 6e-7 when
    # correct; 9.5e-2 / 1.5e-2 (bf16 / fp16) with the state in the model's dtype; 2.7e-3 / 3.2e-4 rounding each add.
    budget, block, length, batch, new = 100, 80, 240, 4, 40  # two evictions per layer
    model, policy = tiny_llama("sdpa").to(dtype), ObservedH2O()
    state = prefill(model, random_prompt(length, 21, batch), policy, budget, block, attention_statistics=statistics)
    generate(model, state, new)
    sums = [torch.zeros(batch, KV_HEADS, length + new, dtype=torch.float64) for _ in range(LAYERS)]
    for layer_idx, positions, attention in policy.observed:
        assert attention.dtype == torch.float32
        sums[layer_idx].scatter_add_(2, positions, attention.double())
    assert {layer_idx for layer_idx, _, _ in policy.observed} == set(range(LAYERS))
    for layer_idx, layer in enumerate(state.cache.layers):
        view = layer.view(layer_idx)
        expected = sums[layer_idx].gather(2, view.positions)
        assert view.state["h2o"].dtype == torch.float32
        error = ((view.state["h2o"].double() - expected).abs() / expected).max().item()
        assert error <= 1e-5, f"layer {layer_idx}: accumulated attention off by {error:.2e} (relative)"
