"""Expected Attention, LagKV and PyramidKV layer budgets against brute-force references (loops, explicit matrices).
Their choices in a real prefill, and the N_l + B bound, are checked by tests/test_policy_contract.py."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from keydiff import build_policy
from keydiff.policies import LayerView
from keydiff.policies.layer_budgets import smallest_layer_budget, split_budget
from keydiff.queries import QueryStatistics, rope_frequencies
from tests.conftest import tiny_llama

pytestmark = pytest.mark.unit

HEAD_DIM = 16


def rope_matrix(model, position: int) -> torch.Tensor:
    """The model's own RoPE at `position` as an explicit [d, d] matrix (applied to the identity basis)."""
    rotary = model.model.rotary_emb
    basis = torch.eye(HEAD_DIM, dtype=torch.float32)[None, None]  # [1, 1, d, d]: rows are basis vectors
    cos, sin = rotary(basis, torch.tensor([[position] * HEAD_DIM]))
    rotated, _ = apply_rotary_pos_emb(basis, basis, cos, sin)
    return rotated[0, 0].T.double()  # column j = R e_j


def view(keys, values, positions, queries=None):
    return LayerView(keys, values, positions, None, {}, 0, queries)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.integration
def test_query_statistics_undo_rope_and_match_brute_moments(model):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 40, HEAD_DIM, generator=generator, dtype=torch.float64) + 0.5  # pre-RoPE queries
    post = torch.stack([(rope_matrix(model, p) @ x[0, :, p].T).T for p in range(40)], dim=1)[None]  # [1, 4, 40, d]
    inv_freq, scaling = rope_frequencies(model.config, HEAD_DIM)
    stats = QueryStatistics(inv_freq, scaling, first_position=3)
    stats.update(post[:, :, :25].float(), 0)  # two passes, as two prefill blocks
    stats.update(post[:, :, 25:].float(), 25)
    kept = x[:, :, 3:]
    assert stats.count == 37 and stats.next_position == 40
    assert torch.allclose(stats.mean(), kept.mean(dim=2), atol=1e-5)
    centred = kept - kept.mean(dim=2, keepdim=True)
    brute_cov = torch.einsum("bhni,bhnj->bhij", centred, centred) / 37
    assert torch.allclose(stats.covariance(), brute_cov, atol=1e-5)


def expected_attention_reference(model, keys, values, positions, x, next_position, future, n_sink, epsilon=0.0):
    """Loop reference: Gaussian moments of the pre-RoPE queries x [b, H, m, d] (positions >= n_sink), averaged RoPE
    matrix from the model's rotary embedding, exp(mu·k/sqrt(d) + k'Σk/2d) normalised over non-sink entries, group
    mean, times (score + eps)·||v||. Returns per-entry scores [b, h_kv, n] (sinks: +inf)."""
    b, kv_heads, n, d = keys.shape
    heads = x.shape[1]
    groups = heads // kv_heads
    rotation = sum(rope_matrix(model, t) for t in range(next_position, next_position + future)) / future
    out = torch.zeros(b, kv_heads, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(kv_heads):
            per_head = []
            for g in range(groups):
                q = x[bi, h * groups + g]
                mu = q.mean(dim=0)
                cov = sum(torch.outer(r - mu, r - mu) for r in q) / len(q)
                mu, cov = rotation @ mu, rotation @ cov @ rotation.T
                raw = []
                for i in range(n):
                    k = keys[bi, h, i].double()
                    raw.append(math.exp(float(mu @ k) / math.sqrt(d) + float(k @ cov @ k) / (2 * d)))
                total = sum(r for i, r in enumerate(raw) if positions[bi, h, i] >= n_sink)
                per_head.append([r / total for r in raw])
            for i in range(n):
                if positions[bi, h, i] < n_sink:
                    out[bi, h, i] = math.inf
                else:
                    attention = sum(p[i] for p in per_head) / groups
                    out[bi, h, i] = (attention + epsilon) * float(values[bi, h, i].double().norm())
    return out


@pytest.mark.integration
@pytest.mark.parametrize("epsilon", [0.0, 0.05])
def test_expected_attention_matches_loop_reference(model, epsilon):
    generator = torch.Generator().manual_seed(1)
    n, budget, n_sink, future = 30, 12, 4, 64
    keys = torch.randn(1, 2, n, HEAD_DIM, generator=generator) * 0.7
    values = torch.randn(1, 2, n, HEAD_DIM, generator=generator)
    positions = torch.randperm(n, generator=generator).expand(1, 2, n).clone()  # buffer order is arbitrary
    x = torch.randn(1, 4, 50, HEAD_DIM, generator=generator, dtype=torch.float64) * 0.5 + 0.3
    post = torch.stack([(rope_matrix(model, p) @ x[0, :, p].T).T for p in range(50)], dim=1)[None].float()
    inv_freq, scaling = rope_frequencies(model.config, HEAD_DIM)
    stats = QueryStatistics(inv_freq, scaling, first_position=n_sink)
    stats.update(post, 0)
    policy = build_policy("expected_attention", n_future_positions=future, n_sink=n_sink, epsilon=epsilon)
    layer = view(keys, values, positions, stats)
    reference = expected_attention_reference(model, keys, values, positions, x[:, :, n_sink:], 50, future, n_sink,
                                             epsilon)
    finite = torch.isfinite(reference)
    assert torch.allclose(policy.score(layer).double().exp()[finite], reference[finite], rtol=1e-4)
    kept = policy.keep_indices(layer, budget)
    for h in range(2):
        order = sorted(range(n), key=lambda i: -float(reference[0, h, i]))
        assert kept[0, h].tolist() == sorted(order[:budget])


def lagkv_reference(keys, values, positions, n_sink, lag):
    """Loop reference on entries in position order: per partition p (not the last full one, nor the remainder),
    spread = std over channels of (x - min_ref)/(max_ref - min_ref) with ref = partition p+1, softmax over the
    partition, keys and values averaged, rank / lag. Unscored entries: 1 + recency; sinks: +inf."""
    b, h, n, d = keys.shape
    out = torch.zeros(b, h, n)
    for bi in range(b):
        for hi in range(h):
            order = sorted(range(n), key=lambda i: int(positions[bi, hi, i]))
            sinks = [i for i in order if positions[bi, hi, i] < n_sink]
            rest = [i for i in order if positions[bi, hi, i] >= n_sink]
            chunks = len(rest) // lag
            top = float(positions[bi, hi].max()) + 1  # this head's newest position
            for i in rest:
                out[bi, hi, i] = 1 + float(positions[bi, hi, i]) / top
            for i in sinks:
                out[bi, hi, i] = math.inf
            for p in range(chunks - 1):
                part, ref = rest[p * lag : (p + 1) * lag], rest[(p + 1) * lag : (p + 2) * lag]
                combined = [0.0] * lag
                for states in (keys, values):
                    low = torch.stack([states[bi, hi, j] for j in ref]).min(dim=0).values
                    high = torch.stack([states[bi, hi, j] for j in ref]).max(dim=0).values
                    spread = torch.tensor([float(((states[bi, hi, j] - low) / (high - low)).std()) for j in part])
                    for t, value in enumerate(torch.softmax(spread, dim=0)):
                        combined[t] += float(value) / 2
                ranks = sorted(range(lag), key=lambda t: combined[t])
                for rank, t in enumerate(ranks):
                    out[bi, hi, part[t]] = rank / lag
    return out


@pytest.mark.parametrize("n", [46, 40, 20])
def test_lagkv_matches_loop_reference_in_any_buffer_order(n):
    generator = torch.Generator().manual_seed(4)
    keys = torch.randn(1, 2, n, 8, generator=generator)
    values = torch.randn(1, 2, n, 8, generator=generator)
    positions = torch.randperm(n, generator=generator).expand(1, 2, n).clone() * 3  # gaps: earlier evictions
    policy = build_policy("lagkv", n_sink=2, lag_size=8, scoring="rescore")
    reference = lagkv_reference(keys, values, positions, 2, 8)
    score = policy.score(view(keys, values, positions))
    assert torch.allclose(score[torch.isfinite(reference)], reference[torch.isfinite(reference)], atol=1e-6)
    budget = 14
    kept = policy.keep_indices(view(keys, values, positions), budget)
    for h in range(2):
        order = sorted(range(n), key=lambda i: (-float(reference[0, h, i]), -int(positions[0, h, i])))
        assert kept[0, h].tolist() == sorted(order[:budget])


def lagkv_streaming_reference(keys, values, budget, block, n_sink, lag):
    """The authors' streaming LagKV (AI-Lab-China-Merchants-Bank/LagKV lag_kv.py, 5b4f452) under a budget, one
    head, as a loop: after each block, the raw entries (never scored, not sinks) in position order are cut into
    partitions from the oldest; each full partition but the last is scored once against the next (raw) one and
    its ranks are frozen; then the lowest (rank, else 1 + recency; older first on ties) go until `budget` remain."""
    entries = {}  # position -> frozen rank or None
    for start in range(0, keys.shape[0], block):
        for t in range(start, min(start + block, keys.shape[0])):
            entries[t] = None
        raw = sorted(t for t, r in entries.items() if r is None and t >= n_sink)
        full = len(raw) // lag
        for p in range(full - 1):
            part, ref = raw[p * lag : (p + 1) * lag], raw[(p + 1) * lag : (p + 2) * lag]
            combined = [0.0] * lag
            for states in (keys, values):
                low = states[ref].min(dim=0).values
                high = states[ref].max(dim=0).values
                spread = torch.stack([((states[t] - low) / (high - low)).std() for t in part])
                for i, value in enumerate(torch.softmax(spread, dim=0)):
                    combined[i] += float(value) / 2
            for rank, i in enumerate(sorted(range(lag), key=lambda i: combined[i])):
                entries[part[i]] = rank / lag
        newest = max(entries) + 1
        while len(entries) > budget:
            candidates = [t for t in entries if t >= n_sink]
            drop = min(candidates, key=lambda t: (entries[t] if entries[t] is not None else 1 + t / newest, t))
            del entries[drop]
    return sorted(entries)


def stream_through_cache(policy, keys, values, budget, block):
    """Feed [n, d] keys/values of one KV head through an EvictingCache block by block, evicting after each."""
    from keydiff.cache import EvictingCache

    cache = EvictingCache(policy, budget, 1, block_size=block, max_tokens=keys.shape[0])
    for start in range(0, keys.shape[0], block):
        cache.update(keys[None, None, start : start + block], values[None, None, start : start + block], 0)
        cache.evict()
    return cache.kept_positions()[0][0, 0].tolist(), cache


@pytest.mark.parametrize("budget, block, lag", [(30, 7, 8), (40, 16, 8), (25, 1, 6)])
def test_lagkv_frozen_matches_the_authors_streaming_method(budget, block, lag):
    generator = torch.Generator().manual_seed(budget + block)
    keys, values = torch.randn(120, 8, generator=generator), torch.randn(120, 8, generator=generator)
    kept, _ = stream_through_cache(build_policy("lagkv", n_sink=2, lag_size=lag), keys, values, budget, block)
    assert kept == lagkv_streaming_reference(keys, values, budget, block, 2, lag)


# By hand from PyramidKV's definition (top (N - w) / beta, bottom 2(N - w) - top, arithmetic between, + w), rounded
# by largest remainders (ties: the lower layer):
# N 100, 7 layers, beta 5: 180, 153.3, 126.7, 100, 73.3, 46.7, 20 -> the two .7 round up.
# N 64, 3 layers, beta 20: 124.8, 64, 3.2 -> 124.8 rounds up.
# N 60, 5 layers, beta 4, w 32: 32 + (49, 38.5, 28, 17.5, 7) -> the first .5 (layer 1) rounds up.
# N 60, 5 layers, beta 4: 105, 82.5, 60, 37.5, 15 -> layer 1 rounds up.
PYRAMIDS_BY_HAND = [
    (100, 7, 5, 0, [180, 153, 127, 100, 73, 47, 20]),
    (64, 3, 20, 0, [125, 64, 3]),
    (60, 5, 4, 32, [81, 71, 60, 49, 39]),
    (60, 5, 4, 0, [105, 83, 60, 37, 15]),
]


@pytest.mark.parametrize("budget, layers, beta, window, expected", PYRAMIDS_BY_HAND)
def test_pyramid_budgets_equal_the_hand_computed_ones(budget, layers, beta, window, expected):
    spec = {"schedule": "pyramid", "beta": beta, "window": window}
    assert split_budget(spec, budget, layers) == expected
    assert sum(expected) == budget * layers  # the uniform total
    assert split_budget(None, budget, layers) == [budget] * layers  # no schedule: uniform
    assert smallest_layer_budget(spec, budget) == window + math.floor((budget - window) / beta) <= expected[-1]


# Per-layer budgets transcribed from the reference code (worked out by hand from its arithmetic, not from
# keydiff's): KVCache-Factory c97f9d706d63d1b56e980f8b81b2a924c21162b3, pyramidkv/pyramidkv_utils.py,
# PyramidKVCluster.update_kv lines 356-368 (min_num = (M - w) // beta, max_num = 2(M - w) - min_num, capped
# at q_len - w, steps = (max_num - min_num) // (layers - 1), layer l keeps max_num - l * steps + w; q_len <
# 2(M - w) keeps M - w + w). M = N = 2048 (max_capacity_prompt includes the window), beta 20, 32 layers.
KVCF_2048_W0 = [3994 - 125 * layer for layer in range(32)]  # steps = (3994 - 102) // 31 = 125
KVCF_2048_W32 = [3964 - 123 * layer for layer in range(32)]  # min 100, max 3932, steps 3832 // 31 = 123, + 32
# N = 512, w = 32, q_len = 964: min 24, max 936 >= 964 - 32, so max = 932, min = 28, steps 904 // 31 = 29.
KVCF_512_W32_CAPPED = [964 - 29 * layer for layer in range(32)]
# kvpress 8bb29b9c3078452a86d692f29123fa6c793e2b05, kvpress/presses/pyramidkv_press.py, get_layer_budget
# (window_size 0, compression_ratio 1 - 2048 / q_len, round(max_num - layer * steps)): the capped pyramid.
KVPRESS_2048_LONG = [3994, 3868, 3743, 3617, 3492, 3366, 3240, 3115, 2989, 2864, 2738, 2613, 2487, 2362, 2236, 2111,
                     1985, 1860, 1734, 1609, 1483, 1358, 1232, 1107, 981, 856, 730, 604, 479, 353, 228, 102]
KVPRESS_2048_Q3000 = [3000, 2939, 2877, 2816, 2754, 2693, 2631, 2570, 2509, 2447, 2386, 2324, 2263, 2202, 2140, 2079,
                      2017, 1956, 1894, 1833, 1772, 1710, 1649, 1587, 1526, 1465, 1403, 1342, 1280, 1219, 1157, 1096]


@pytest.mark.parametrize("budget, window, prompt_length, expected", [
    (2048, 0, 10_000, KVCF_2048_W0), (2048, 0, None, KVCF_2048_W0), (2048, 32, 10_000, KVCF_2048_W32),
    (2048, 32, 3000, [2048] * 32),  # 3000 < 2(2048 - 32): KVCache-Factory's uniform fallback
    (2048, 0, 2048, [2048] * 32), (512, 32, 964, KVCF_512_W32_CAPPED),
])
def test_kvcache_factory_arithmetic_matches_the_reference_numbers(budget, window, prompt_length, expected):
    spec = {"schedule": "pyramid", "beta": 20, "window": window, "arithmetic": "kvcache_factory"}
    assert split_budget(spec, budget, 32, prompt_length) == expected
    assert min(expected) >= smallest_layer_budget(spec, budget)


@pytest.mark.parametrize("prompt_length, expected", [(10_000, KVPRESS_2048_LONG), (3000, KVPRESS_2048_Q3000)])
def test_exact_arithmetic_matches_kvpress_and_keeps_the_total(prompt_length, expected):
    split = split_budget({"schedule": "pyramid", "beta": 20, "window": 0}, 2048, 32, prompt_length)
    assert split == expected and sum(split) == 32 * 2048
