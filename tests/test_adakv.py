"""Head-adaptive budgets (AdaKV): selection against plain loops (every eviction of a real prefill: the contract of
tests/test_policy_contract.py), exact attention over per-head segments, the pools, the safeguard, clear errors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import repeat_kv

from keydiff.attention import keydiff_attention
from keydiff.cache import EvictingCache
from keydiff.cache.adaptive import AdaptiveStorage
from keydiff.engine import generate, prefill
from keydiff.policies import HeadAdaptive, build_policy
from keydiff.policies.adakv import adakv_keep, relative_scores
from keydiff.policies.base import LayerView, Needs, Policy, score_then_position
from tests.conftest import tiny_llama
from tests.test_policy_contract import adakv_counts, choose

pytestmark = pytest.mark.integration

BUDGET, BLOCK, LENGTH = 48, 16, 150


def adaptive_policy(name, params, alpha=0.2):
    return HeadAdaptive(build_policy(name, **params), alpha_safeguard=alpha)


def head_counts(cache) -> list[list[list[int]]]:
    return [(p >= 0).sum(-1).tolist() for p in cache.kept_positions()]


def prompt_ids(batch=1, length=LENGTH, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- selection
@pytest.mark.unit
@pytest.mark.extended
def test_adakv_keep_equals_the_loops_with_ties_across_heads():
    """Random scores with many equal values (ties within and across heads) and protected entries."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        heads, budget = 3, 10
        counts = torch.randint(5, 30, (heads,), generator=g).tolist()
        positions = [torch.randperm(60, generator=g)[:n] for n in counts]
        scores = [torch.randint(0, 4, (n,), generator=g).float() for n in counts]
        protected = [torch.rand(n, generator=g) < 0.1 for n in counts]
        alpha = [0.0, 0.2, 0.5, 1.0][trial % 4]
        keys = [score_then_position(s.masked_fill(p, float("inf"))[None, None], pos[None, None])[0, 0]
                for s, p, pos in zip(scores, protected, positions)]
        masks = adakv_keep(keys, protected, budget, alpha)
        actual = [sorted(pos[m].tolist()) for pos, m in zip(positions, masks)]
        lists = [s.tolist() for s in scores], [p.tolist() for p in protected], [p.tolist() for p in positions]
        expected = choose(*lists, adakv_counts(*lists, budget, alpha))
        assert actual == expected
        assert sum(map(len, actual)) == min(sum(counts), heads * budget)


def test_the_heads_really_keep_different_counts(model):
    state = prefill(model, prompt_ids(), adaptive_policy("keydiff", {}), BUDGET, BLOCK)
    counts = [c for layer in head_counts(state.cache) for c in layer[0]]
    assert any(c != BUDGET for c in counts)
    assert all(sum(layer[0]) == 2 * BUDGET for layer in head_counts(state.cache))  # 2 KV heads: T = 2 N


# --------------------------------------------------------------------------- exact attention
HELD: dict = {}


def per_head_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention over all tokens so far, each KV head masked to the positions it held before this pass
    (HELD[layer][row][head]) plus the pass's own tokens, causally: what each head sees in its own segment."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    batch, heads, q, _ = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    first = length - q
    visible = torch.zeros(batch, heads, q, length, dtype=torch.bool)
    rows = torch.arange(q)[:, None] + first
    cols = torch.arange(length)[None, :]
    new = (cols >= first) & (cols <= rows)
    for b in range(batch):
        for h in range(kv_heads):
            held = torch.zeros(length, dtype=torch.bool)
            held[HELD[module.layer_idx][b][h]] = True
            visible[b, h * groups:(h + 1) * groups] = held[None, :] | new
    logits = (query @ repeat_kv(key, groups).transpose(-1, -2)) * scaling
    weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    return (weights @ repeat_kv(value, groups)).transpose(1, 2).contiguous(), None


AttentionInterface.register("adakv_reference", per_head_reference_attention)


@pytest.mark.extended
@pytest.mark.parametrize("batch,name,params,budget,sized", [
    (1, "keydiff", {}, BUDGET, True), (2, "snapkv", {"window": 8}, BUDGET, True),
    (1, "expected_attention", {"epsilon": 0.01}, BUDGET, True),
    # Built without block_size/max_tokens: the pool is sized from the first pass (kv_heads x 16 slots) and must
    # grow so that every head gets the next pass's 16 slots (kv_heads x 16 in all, beyond what it holds).
    (1, "keydiff", {}, 8, False), (2, "keydiff", {}, 8, False),
])
def test_logits_equal_a_per_head_masked_reference_in_prefill_and_decoding(batch, name, params, budget, sized):
    model = tiny_llama()
    reference = tiny_llama()
    reference.set_attn_implementation("adakv_reference")
    policy = adaptive_policy(name, params)
    ids = prompt_ids(batch, length=120)
    bounds = {"block_size": BLOCK, "max_tokens": ids.shape[1]} if sized else {}
    cache = EvictingCache(policy, budget, model.config.num_hidden_layers, **bounds)
    dense = DynamicCache()
    passes = [ids[:, s:s + BLOCK] for s in range(0, ids.shape[1], BLOCK)]
    adapted = False
    with torch.no_grad():
        step = 0
        while step < len(passes) + 6:  # the prompt's blocks, then 6 decoded tokens
            block = passes[step] if step < len(passes) else next_ids
            for layer, kept in enumerate(cache.kept_positions() if step else [None] * 3):
                HELD[layer] = [[[p for p in head.tolist() if p >= 0] for head in row] for row in kept] if step else \
                    [[[] for _ in range(2)] for _ in range(batch)]
            with keydiff_attention(model, cache):
                ours = model(input_ids=block, cache=cache, use_cache=True).logits
            cache.evict()
            expected = reference(input_ids=block, cache=dense, use_cache=True).logits
            torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-4)
            adapted |= any(c != budget for layer in head_counts(cache) for row in layer for c in row)
            next_ids = ours[:, -1:].argmax(-1)
            step += 1
    assert adapted  # the heads did hold different counts at some pass


# --------------------------------------------------------------------------- memory bound
@pytest.mark.extended
@pytest.mark.parametrize("batch", [1, 2])
def test_held_entries_never_exceed_the_layer_total_plus_the_block(model, batch):
    policy = adaptive_policy("keydiff", {"window_fraction": 0.1})
    totals = []

    def after_block(cache):
        for layer in cache.layers:
            storage = layer.storage
            assert isinstance(storage, AdaptiveStorage)
            assert max(storage.row_totals()) <= 2 * BUDGET  # T after eviction
            assert storage.max_total <= 2 * (BUDGET + BLOCK)  # T + kv_heads x B while the block was processed
            assert storage.pool == 2 * (BUDGET + BLOCK)  # the uniform buffers' size: nothing grew
        totals.append(cache.layer_max_total_entries)

    state = prefill(model, prompt_ids(batch), policy, BUDGET, BLOCK, on_block=after_block)
    out = generate(model, state, 12, seed=0, record_steps=True)
    assert len(out.token_ids[0]) == 12
    for layer in state.cache.layers:  # decoding: at most T + kv_heads, and still within the pool
        assert max(layer.storage.row_totals()) <= 2 * BUDGET and layer.storage.pool == 2 * (BUDGET + BLOCK)
    assert state.cache.max_entries <= BUDGET + BLOCK
    uniform = prefill(model, prompt_ids(batch), build_policy("keydiff", window_fraction=0.1), BUDGET, BLOCK)
    assert state.cache.kv_cache_bytes == uniform.cache.kv_cache_bytes
    assert state.cache.allocations == uniform.cache.allocations == len(state.cache.layers)  # one pool per layer


@pytest.mark.extended
def test_keeping_every_generated_token_grows_the_pool_once(model):
    state = prefill(model, prompt_ids(), adaptive_policy("keydiff", {}), BUDGET, BLOCK)
    before = head_counts(state.cache)
    out = generate(model, state, 40, seed=0, evict=False)
    after = head_counts(state.cache)
    steps = len(out.token_ids[0]) - 1
    assert all(a == b + steps for la, lb in zip(after, before) for ra, rb in zip(la, lb) for a, b in zip(ra, rb))
    assert state.cache.allocations == 2 * len(state.cache.layers)  # one growth per layer, in start_generation


# --------------------------------------------------------------------------- safeguard, uniform limit
def fewest_held(model, alpha: float) -> int:
    """The fewest entries any head held after any block, once its layer had more tokens than its total."""
    fewest = []

    def after_block(cache):
        if cache.get_seq_length() > 2 * BUDGET:
            fewest.append(min(c for layer in head_counts(cache) for c in layer[0]))

    prefill(model, prompt_ids(), adaptive_policy("keydiff", {}, alpha=alpha), BUDGET, BLOCK, on_block=after_block)
    return min(fewest)


@pytest.mark.extended
def test_every_head_keeps_at_least_its_safeguard(model):
    unguarded = fewest_held(model, 0.0)
    assert unguarded < BUDGET  # some head gave entries away
    alpha = (unguarded + 1) / BUDGET  # a safeguard above what that head kept
    assert fewest_held(model, alpha) >= math.floor(alpha * BUDGET + 1e-9) == unguarded + 1


@pytest.mark.extended
@pytest.mark.parametrize("name,params", [("keydiff", {}), ("keydiff", {"window_fraction": 0.25}), ("snapkv", {"window": 8}),
                                         ("sink", {"sinks": 4})])
def test_alpha_one_keeps_exactly_what_the_uniform_policy_keeps(model, name, params):
    ids = prompt_ids()
    adaptive = prefill(model, ids, adaptive_policy(name, params, alpha=1.0), BUDGET, BLOCK)
    uniform = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
    for ours, theirs in zip(adaptive.kept_positions, uniform.kept_positions):
        assert torch.equal(ours, theirs)


# --------------------------------------------------------------------------- configuration and errors
@pytest.mark.unit
def test_flat_parameters_compose_and_describe():
    policy = build_policy("snapkv", window=8, head_budgets="adakv", alpha_safeguard=0.3)
    assert policy.needs.head_adaptive and isinstance(policy, HeadAdaptive) and policy.alpha_safeguard == 0.3
    described = policy.describe()
    assert described["head_budgets"] == "adakv" and described["alpha_safeguard"] == 0.3
    assert build_policy(**described).describe() == described
    assert "head_budgets" not in build_policy("snapkv").describe()
    assert not build_policy("snapkv", head_budgets="uniform").needs.head_adaptive
    pyramid = build_policy("keydiff", head_budgets="adakv", layer_budgets={"schedule": "pyramid", "beta": 20})
    assert pyramid.needs.head_adaptive and pyramid.describe()["layer_budgets"] == {"schedule": "pyramid", "beta": 20}


@pytest.mark.parametrize("name, params, message", [
    ("keydiff", {"head_budgets": "adakv"}, "keydiff_attention"),  # per-head segments
    ("expected_attention", {}, "keydiff_attention"),  # the pre-RoPE queries
    ("knorm", {"critical": True}, "needs the layer's output projection"),  # o_proj: not a silent zero norm
])
def test_a_policy_that_needs_keydiff_attention_is_refused_without_it(model, name, params, message):
    """Without keydiff_attention bound nobody hands over what the policy reads: a clear error at the first pass or
    eviction that needs it (a plain loop: each pass evicts what the one before it left over the budget)."""
    cache = EvictingCache(build_policy(name, **params), 8, model.config.num_hidden_layers, block_size=8)
    with torch.no_grad(), pytest.raises(RuntimeError, match=message):
        for start in range(0, 24, 8):
            model(input_ids=prompt_ids()[:, start:start + 8], cache=cache, use_cache=True)


@pytest.mark.unit
def test_run_statistics_check_each_layer_total_against_kv_heads_times_its_bound():
    from keydiff.run.plan import RunPlan
    from keydiff.run.runner import run_statistics

    plan = RunPlan("keydiff", {"head_budgets": "adakv"}, 100, 10, "fast", True, None, None)
    row = {"prompt_tokens": 500, "compression_ratio": 0.2, "ttft_s": 1.0, "decode_s": 1.0, "new_tokens": 3,
           "max_cache_entries": 110, "kv_cache_peak_bytes": 1, "kv_cache_bytes": 1, "peak_memory_bytes": 1,
           "layer_budgets": [100, 100], "layer_max_cache_entries": [110, 110],
           "layer_max_total_entries": [220, 200], "layer_kv_heads": [2, 2]}
    stats = run_statistics([row], plan)
    assert stats["cache_bound_held"] is True
    assert stats["layer_total_bounds"] == [220, 220] and stats["layer_max_total_entries"] == [220, 200]
    broken = {**row, "layer_max_total_entries": [221, 200]}  # one entry over kv_heads x (N + B)
    assert run_statistics([broken], plan)["cache_bound_held"] is False


@pytest.mark.unit
@pytest.mark.parametrize("rows", [0, 8])
def test_decoding_attention_over_the_pool_equals_one_call_per_segment(rows):
    """The one-query path (per batch row and KV head, two products over that head's own segment) against
    SDPA per segment and the statistic. The pool's free slots hold NaN: reading anything outside a head's
    segment (a masked product over the whole pool, a segment shifted by one) makes the output NaN."""
    from keydiff.attention import attention_statistic, decoding_segment_attention, fused_attention

    g = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 90, 16, generator=g),
                         torch.randn(2, 90, 16, generator=g))
    segments = [[(0, 30), (41, 17)], [(5, 60), (70, 20)]]
    used = torch.zeros(2, 90, dtype=torch.bool)
    for row, spans in enumerate(segments):
        for start, count in spans:
            used[row, start:start + count] = True
    key[~used], value[~used] = float("nan"), float("nan")
    output, statistic = decoding_segment_attention(query, key, value, 0.25, segments, rows)
    assert torch.isfinite(output).all()
    for row, spans in enumerate(segments):
        for head, (start, count) in enumerate(spans):
            q, k, v = query[row:row + 1, 2 * head:2 * head + 2], key[row, start:start + count][None, None], \
                value[row, start:start + count][None, None]
            torch.testing.assert_close(output[row:row + 1, :, 2 * head:2 * head + 2], fused_attention("sdpa", None, q, k, v, 0.25))
            if rows:
                torch.testing.assert_close(statistic[row][head], attention_statistic(q, k, 0.25, rows)[0, 0])
    assert (statistic is None) == (rows == 0)


@pytest.mark.unit
@pytest.mark.extended
def test_bf16_decoding_of_head_adaptive_layers_is_as_precise_as_sdpa():
    """Against float64 on synthetic bf16 data (d = 128, n = 4,096 and 3,000 entries per head, q/k of std 3:
    logits ~100), the head-adaptive decoding path (keydiff.attention.decoding_segment_attention) and the uniform
    layers' path (SDPA, fused_attention) err alike. Products in bf16 (Q·Kᵀ and the softmax weights rounded to
    bf16) erred 3-10x more than SDPA here (0.02-0.06 vs 0.005-0.007)."""
    from keydiff.attention import decoding_segment_attention, fused_attention

    d, counts, scaling = 128, [4096, 3000], 128 ** -0.5
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        query = (torch.randn(1, 4, 1, d, generator=g, dtype=torch.float64) * 3).bfloat16()
        key = (torch.randn(1, sum(counts), d, generator=g, dtype=torch.float64) * 3).bfloat16()
        value = torch.randn(1, sum(counts), d, generator=g, dtype=torch.float64).bfloat16()
        segments = [[(0, counts[0]), (counts[0], counts[1])]]
        adaptive, _ = decoding_segment_attention(query, key, value, scaling, segments, 0)
        assert adaptive.dtype == torch.bfloat16
        errors = {"adaptive": 0.0, "sdpa": 0.0}
        for head, (start, count) in enumerate(segments[0]):
            q, k, v = query[:, 2 * head:2 * head + 2], key[:, None, start:start + count], value[:, None, start:start + count]
            exact = torch.softmax(q.double()[0, :, 0] @ k.double()[0, 0].T * scaling, dim=-1) @ v.double()[0, 0]
            sdpa = fused_attention("sdpa", None, q, k, v, scaling)[0, 0]
            errors["sdpa"] = max(errors["sdpa"], float((sdpa.double() - exact).abs().max()))
            ours = adaptive[0, 0, 2 * head:2 * head + 2]
            errors["adaptive"] = max(errors["adaptive"], float((ours.double() - exact).abs().max()))
        assert errors["sdpa"] < 0.02, errors  # the uniform path: bf16 output rounding, float32 inside
        assert errors["adaptive"] <= 1.5 * errors["sdpa"] + 1e-3, errors


# --------------------------------------------------------------------------- head_scores: relative
@dataclass
class AttentionShare(Policy):
    """Scores each entry by the attention statistic it received (what SnapKV / H2O / TOVA score, unpooled)."""

    needs: ClassVar[Needs] = Needs(attention_rows=None)

    def score(self, layer: LayerView) -> torch.Tensor:
        return layer.attention


def attention_head(shares: list[float], rows: int = 4) -> LayerView:
    """One head of one batch row whose entries received `shares` of each of `rows` query rows' attention."""
    n = len(shares)
    attention = torch.tensor(shares, dtype=torch.float32)[None, None] * rows / sum(shares)
    return LayerView(keys=torch.zeros(1, 1, n, 4), values=torch.zeros(1, 1, n, 4),
                     positions=torch.arange(n)[None, None], attention=attention, state={}, layers=(0,))


@pytest.mark.unit
@pytest.mark.parametrize("head_scores,same_share", [("raw", False), ("relative", True)])
def test_relative_head_scores_make_the_split_independent_of_the_heads_counts(head_scores, same_share):
    """Head B holds twice head A's entries with the same distribution (each of A's entries split in two):
    its entries receive half the attention each. Raw scores (AdaKV's, kvpress's) give A more than its share;
    relative scores (each over its head's mean) keep the same fraction of both heads."""
    weights = [8.0, 7, 6, 5, 4, 3, 2, 1]
    heads = [attention_head(weights), attention_head([w for w in weights for _ in range(2)])]
    policy = HeadAdaptive(AttentionShare(), alpha_safeguard=0.0, head_scores=head_scores)
    kept = [int(mask.sum()) for mask in policy.keep_heads(heads, budget=6)]  # T = 12 of 24
    assert sum(kept) == 12
    shares = [kept[0] / 8, kept[1] / 16]
    assert (shares[0] == shares[1]) == same_share
    if not same_share:
        assert shares[0] > shares[1]  # raw: the head that holds fewer entries scores higher per entry


@pytest.mark.unit
def test_relative_scores_score_uniform_attention_one_and_handle_log_scores():
    uniform = torch.full((1, 1, 5), 4 / 5)  # 4 rows spread evenly over 5 entries
    assert torch.allclose(relative_scores(uniform, log_scores=False), torch.ones(1, 1, 5))
    scores = torch.tensor([[[0.5, 0.25, 0.25, 1.0]]])
    assert torch.allclose(relative_scores(scores.log(), log_scores=True), relative_scores(scores, False).log())


@pytest.mark.unit
@pytest.mark.parametrize("log_scores", [False, True])
def test_relative_scores_do_not_depend_on_the_order_of_a_heads_entries(log_scores):
    """The cache holds a head's entries in no particular order, and machines add in different orders: the
    relative score of an entry must be the same bits whatever the order. In float32 it was not: permuted, 85 of
    these 200 heads (17 in log scores) changed some relative score by an ULP."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        scores = torch.rand(1, 1, 333, generator=generator) ** 4 * 0.3
        scores = scores.log() if log_scores else scores
        order = torch.randperm(333, generator=generator)
        assert torch.equal(relative_scores(scores[..., order], log_scores), relative_scores(scores, log_scores)[..., order])


@pytest.mark.extended
def test_head_scores_compose_describe_and_move_the_split(model):
    policy = build_policy("snapkv", window=8, head_budgets="adakv", head_scores="relative")
    assert policy.head_scores == "relative" and not policy.needs.chooses_pools
    assert build_policy(**policy.describe()).describe() == policy.describe()
    assert "head_scores" not in build_policy("snapkv", head_budgets="adakv").describe()  # the default: as before
    ids = prompt_ids()
    relative = prefill(model, ids, policy, BUDGET, BLOCK)
    raw = prefill(model, ids, build_policy("snapkv", window=8, head_budgets="adakv"), BUDGET, BLOCK)
    heads = model.config.num_key_value_heads
    assert all(sum(layer[0]) <= heads * BUDGET for layer in head_counts(relative.cache))
    assert head_counts(relative.cache) != head_counts(raw.cache)  # the split moves
