"""Head-adaptive budgets (AdaKV; every eviction of a real prefill is the contract's): exact attention over per-head
segments against references, relative head scores by hand, the refusal without keydiff_attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import repeat_kv

from keydiff.attention import keydiff_attention
from keydiff.cache import EvictingCache
from keydiff.policies import HeadAdaptive, build_policy
from keydiff.policies.adakv import relative_scores
from tests.conftest import tiny_llama

pytestmark = pytest.mark.integration

BUDGET, BLOCK, LENGTH = 48, 16, 150


def adaptive_policy(name, params, alpha=0.2):
    return HeadAdaptive(build_policy(name, **params), alpha_safeguard=alpha)


def head_counts(cache) -> list[list[list[int]]]:
    return [(p >= 0).sum(-1).tolist() for p in cache.kept_positions()]


def prompt_ids(batch=1, length=LENGTH, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


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
    (2, "keydiff", {}, 8, False),
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
            expected = fused_attention("sdpa", None, q, k, v, 0.25)
            torch.testing.assert_close(output[row:row + 1, :, 2 * head:2 * head + 2], expected)
            if rows:
                torch.testing.assert_close(statistic[row][head], attention_statistic(q, k, 0.25, rows)[0, 0])
    assert (statistic is None) == (rows == 0)


@pytest.mark.unit
def test_relative_scores_score_uniform_attention_one_and_handle_log_scores():
    uniform = torch.full((1, 1, 5), 4 / 5)  # 4 rows spread evenly over 5 entries
    assert torch.allclose(relative_scores(uniform, log_scores=False), torch.ones(1, 1, 5))
    scores = torch.tensor([[[0.5, 0.25, 0.25, 1.0]]])
    assert torch.allclose(relative_scores(scores.log(), log_scores=True), relative_scores(scores, False).log())
