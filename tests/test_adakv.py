"""Head-adaptive budgets (AdaKV): selection against plain loops (ties, safeguards; every eviction of a real prefill is
the contract's), exact attention over per-head segments, the pools, relative head scores, clear errors."""

from __future__ import annotations

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
    # Unsized (no block_size/max_tokens): the pool, sized from the first pass, must grow to give every head 16 slots.
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


@pytest.mark.extended
@pytest.mark.parametrize("batch", [1, 2])
def test_each_layer_holds_one_pool_the_size_of_the_uniform_buffers(model, batch):
    """The N + B bound is the contract's; here the pool never grows and costs what uniform buffers cost."""
    state = prefill(model, prompt_ids(batch), adaptive_policy("keydiff", {"window_fraction": 0.1}), BUDGET, BLOCK)
    assert len(generate(model, state, 12, seed=0).token_ids[0]) == 12
    assert all(isinstance(layer.storage, AdaptiveStorage) for layer in state.cache.layers)
    assert all(layer.storage.cells == 2 * (BUDGET + BLOCK) for layer in state.cache.layers)
    assert state.cache.max_entries <= BUDGET + BLOCK
    uniform = prefill(model, prompt_ids(batch), build_policy("keydiff", window_fraction=0.1), BUDGET, BLOCK)
    assert state.cache.kv_cache_bytes == uniform.cache.kv_cache_bytes
    assert state.cache.allocations == uniform.cache.allocations == len(state.cache.layers)


@pytest.mark.extended
def test_keeping_every_generated_token_grows_each_pool_once_out_of_the_stack(model):
    state = prefill(model, prompt_ids(), adaptive_policy("keydiff", {}), BUDGET, BLOCK)
    before = head_counts(state.cache)
    steps = len(generate(model, state, 40, seed=0, evict=False).token_ids[0]) - 1
    after = head_counts(state.cache)
    assert all(a == b + steps for la, lb in zip(after, before) for ra, rb in zip(la, lb) for a, b in zip(ra, rb))
    assert state.cache.allocations == 2 * len(state.cache.layers)  # one growth per layer, in start_generation
    assert not any(layer.storage.in_stack for layer in state.cache.layers)  # grown: buffers of their own


@pytest.mark.unit
def test_head_budget_parameters_compose_and_describe():
    policy = build_policy("snapkv", window=8, head_budgets="adakv", alpha_safeguard=0.3, head_scores="relative")
    assert policy.needs.head_adaptive and isinstance(policy, HeadAdaptive) and policy.alpha_safeguard == 0.3
    assert policy.head_scores == "relative" and not policy.needs.chooses_segments
    described = policy.describe()
    assert described["head_budgets"] == "adakv" and described["alpha_safeguard"] == 0.3
    assert build_policy(**described).describe() == described
    assert "head_budgets" not in build_policy("snapkv").describe()
    assert "head_scores" not in build_policy("snapkv", head_budgets="adakv").describe()  # the default: raw
    assert not build_policy("snapkv", head_budgets="uniform").needs.head_adaptive
    pyramid = build_policy("keydiff", head_budgets="adakv", layer_budgets={"schedule": "pyramid", "beta": 20})
    assert pyramid.needs.head_adaptive and pyramid.describe()["layer_budgets"] == {"schedule": "pyramid", "beta": 20}


@pytest.mark.parametrize("name, params, message", [
    ("keydiff", {"head_budgets": "adakv"}, "keydiff_attention"),  # per-head segments
    ("expected_attention", {}, "keydiff_attention"),  # the pre-RoPE queries
    ("knorm", {"critical": True}, "needs the layer's output projection"),  # o_proj: not a silent zero norm
])
def test_a_policy_that_needs_keydiff_attention_is_refused_without_it(model, name, params, message):
    """Without keydiff_attention nothing hands over what the policy reads: an error where it is first needed."""
    cache = EvictingCache(build_policy(name, **params), 8, model.config.num_hidden_layers, block_size=8)
    with torch.no_grad(), pytest.raises(RuntimeError, match=message):
        for start in range(0, 24, 8):
            model(input_ids=prompt_ids()[:, start:start + 8], cache=cache, use_cache=True)


@pytest.mark.unit
@pytest.mark.parametrize("rows", [0, 8])
def test_decoding_attention_over_the_pool_equals_one_call_per_segment(rows):
    """Per-segment decoding attention equals SDPA on each segment; free slots hold NaN, so reading one shows."""
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
    """Against float64 (d = 128, logits ~100) it errs as SDPA does (products taken in bf16 erred 3-10x more)."""
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
    """Head B holds A's entries each split in two: raw scores favour A, relative ones keep the same share of both."""
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
    """An entry's relative score is the same bits whatever the order of its head's entries (float32 sums were not)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        scores = torch.rand(1, 1, 333, generator=generator) ** 4 * 0.3
        scores = scores.log() if log_scores else scores
        order = torch.randperm(333, generator=generator)
        assert torch.equal(relative_scores(scores[..., order], log_scores), relative_scores(scores, log_scores)[..., order])
