"""Policy maths against brute-force references written with plain loops."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from keydiff import build_policy
from keydiff.attention import attention_statistic
from keydiff.policies import LayerView


pytestmark = pytest.mark.unit


def make_view(keys, attention=None, positions=None):
    b, h, n, _ = keys.shape
    if positions is None:
        positions = torch.arange(n).expand(b, h, n).clone()
    state = {"h2o": torch.zeros(b, h, n)}  # the cache allocates one zeroed buffer per name in state_names
    return LayerView(keys, keys, positions, attention, state, 0)


def brute_topk(scores_per_entry, budget):
    """Indices of the `budget` largest scores (python sort), ascending."""
    order = sorted(range(len(scores_per_entry)), key=lambda i: -scores_per_entry[i])
    return sorted(order[:budget])


def cos(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


@pytest.fixture
def keys():
    return torch.randn(2, 3, 40, 8, generator=torch.Generator().manual_seed(0))


def test_pairwise_matches_loop_reference(keys):
    ks = keys[0, 0]
    scores = [-sum(cos(ki, kj) for kj in ks) for ki in ks]
    got = build_policy("keydiff_pairwise").score(make_view(keys))[0, 0]
    assert torch.allclose(got, torch.tensor(scores), atol=1e-4)


@pytest.mark.parametrize("anchor", ["mean", "median", "normalized_mean"])
@pytest.mark.parametrize("metric", ["cosine", "dot", "euclidean"])
def test_anchor_and_metric_variants_match_loop_reference(keys, anchor, metric):
    budget = 12
    kept = build_policy("keydiff", anchor=anchor, metric=metric).keep_indices(make_view(keys), budget)
    for b in range(2):
        for h in range(3):
            ks = keys[b, h]
            units = torch.stack([k / k.norm() for k in ks])
            if anchor == "mean":
                a = torch.stack(list(ks)).mean(0)
            elif anchor == "median":
                a = torch.tensor([sorted(units[:, d].tolist())[(len(ks) - 1) // 2] for d in range(ks.shape[1])])
            else:
                a = units.mean(0)
            if metric == "cosine":
                scores = [-cos(k, a) for k in ks]
            elif metric == "dot":
                scores = [-float(torch.dot(k, a)) for k in ks]
            else:
                scores = [float((k - a).norm()) for k in ks]
            assert kept[b, h].tolist() == brute_topk(scores, budget)


def norm_keys(norms: list[float]) -> torch.Tensor:
    """One head of keys whose L2 norms are `norms`."""
    keys = torch.zeros(1, 1, len(norms), 2)
    keys[0, 0, :, 0] = torch.tensor(norms)
    return keys


# sink: the first four prompt tokens survive from earlier evictions, then the newest
@pytest.mark.parametrize("name, keys, positions, budget, expected", [
    ("sink", torch.randn(1, 2, 50, 4), torch.tensor([0, 1, 2, 3, *range(104, 150)]).expand(1, 2, 50).clone(), 10,
     [0, 1, 2, 3, 44, 45, 46, 47, 48, 49]),
    ("recent", torch.randn(1, 1, 30, 4), None, 5, [25, 26, 27, 28, 29]),
    ("knorm", norm_keys([5.0, 1.0, 4.0, 2.0, 6.0, 3.0]), None, 3, [1, 3, 5]),
])
def test_position_and_norm_policies_keep_the_hand_computed_entries(name, keys, positions, budget, expected):
    assert build_policy(name).keep_indices(make_view(keys, positions=positions), budget)[0, 0].tolist() == expected


def test_h2o_accumulates_and_keeps_recent_share():
    policy = build_policy("h2o", recent_fraction=0.5)
    keys = torch.randn(1, 1, 8, 4)
    first = torch.tensor([[[0.5, 0.0, 0.1, 0.0, 0.3, 0.0, 0.0, 0.1]]])
    second = torch.tensor([[[0.0, 0.4, 0.0, 0.0, 0.3, 0.1, 0.1, 0.1]]])
    view = make_view(keys, attention=first)
    policy.observe(view)
    view.attention = second
    policy.observe(view)
    assert torch.allclose(view.state["h2o"], first + second)
    # budget 4: recent 2 = entries 6, 7; heavy hitters among 0..5 by 0.5, 0.4, 0.1, 0, 0.6, 0.1 -> 4, 0
    assert policy.keep_indices(view, 4)[0, 0].tolist() == [0, 4, 6, 7]


def test_tova_layer_mode_shares_one_set_per_layer():
    attention = torch.rand(1, 2, 12, generator=torch.Generator().manual_seed(3))
    view = make_view(torch.randn(1, 2, 12, 4), attention=attention)
    kept = build_policy("tova", heads="layer").keep_indices(view, 4)
    assert torch.equal(kept[0, 0], kept[0, 1])
    assert kept[0, 0].tolist() == brute_topk(attention[0].mean(0).tolist(), 4)
    grouped = build_policy("tova").keep_indices(view, 4)
    assert grouped[0, 1].tolist() == brute_topk(attention[0, 1].tolist(), 4)


@pytest.mark.parametrize("rows", [1, 4, None])
@pytest.mark.parametrize("q_len", [1, 6, 20])
def test_gqa_statistic_matches_per_head_loop(rows, q_len):
    g = torch.Generator().manual_seed(5)
    query = torch.randn(1, 4, q_len, 8, generator=g)
    key = torch.randn(1, 2, 20, 8, generator=g)
    got = attention_statistic(query, key, 8**-0.5, rows)
    kv_len = 20
    first = 0 if rows is None else max(q_len - rows, 0)
    for kv_head in range(2):
        for j in range(kv_len):
            total = 0.0
            for head in (2 * kv_head, 2 * kv_head + 1):  # the two query heads of this KV group
                for i in range(first, q_len):
                    visible = kv_len - q_len + i  # last key this row may see
                    logits = [float(query[0, head, i] @ key[0, kv_head, t]) * 8**-0.5 for t in range(visible + 1)]
                    m = max(logits)
                    denom = sum(math.exp(x - m) for x in logits)
                    total += math.exp(logits[j] - m) / denom if j <= visible else 0.0
            assert abs(got[0, kv_head, j].item() - total / 2) < 1e-5


# Every refused parameter value, one row each: (policy, parameters, budget, message). Budget None: refused when
# the policy is built; otherwise by check(budget), before any model loads. Each error is one line.
REFUSED = [
    ("keydif", {}, None, "valid policies: expected_attention, full, h2o, keydiff, keydiff_pairwise, .*dotted path"),
    ("keydiff", {"windw": 0.1}, None, "valid: anchor, metric, window_fraction"),
    ("keydiff", {"window_fraction": 1.0}, 100, r"window_fraction must be in \[0, 1\)"),
    ("keydiff", {"anchor": "mode"}, 100, "valid: normalized_mean, mean, median"),
    ("keydiff", {"metric": "l1"}, 100, "valid: cosine, dot, euclidean"),
    ("sink", {"sinks": 8}, 8, "must be smaller than the budget"),
    ("snapkv", {"window": 64}, 64, "smaller than the budget"),
    ("snapkv", {"kernel_size": 4}, 64, "positive odd"),
    ("h2o", {"recent_fraction": 1.5}, 64, "recent_fraction"),
    ("tova", {"heads": "all"}, 64, "valid: group, layer"),
    ("keydiff", {"head_budgets": "adakv", "alpha_safeguard": 1.5}, None,
     r"alpha_safeguard must be a number in \[0, 1\]"),
    ("keydiff", {"head_budgets": "per_head"}, None, r"unknown head_budgets 'per_head'; valid: uniform, adakv"),
    ("keydiff", {"alpha_safeguard": 0.2}, None, r"alpha_safeguard applies only to head-adaptive budgets"),
    ("keydiff", {"head_budgets": "adakv", "head_scores": "relative"}, None,
     "head_scores=relative applies to scorers whose scores are attention"),
    ("snapkv", {"head_budgets": "adakv", "head_scores": "mean"}, None,
     "unknown head_scores 'mean'; valid: raw, relative"),
    ("snapkv", {"head_scores": "relative"}, None, "head_scores applies only to head-adaptive budgets"),
    ("snapkv", {"critical": True, "first_stage_ratio": 1.5}, None, r"first_stage_ratio must be in \[0, 1\], got 1.5"),
    ("snapkv", {"critical": True, "critical_epsilon": -1e-3}, None, "critical_epsilon must be >= 0"),
    ("snapkv", {"critical": True, "critical_epsilon": "small"}, None, "critical_epsilon must be a finite number"),
    ("snapkv", {"critical": "yes"}, None, "critical must be true or false"),
    ("snapkv", {"first_stage_ratio": 0.3}, None, "first_stage_ratio given without critical: true"),
    ("snapkv", {"critical_eps": 0.1}, None,
     r"no parameter\(s\) critical_eps; valid: .*critical, critical_epsilon, first_stage_ratio"),
    *[("knorm", {"chunk_length": bad}, 64, "chunk_length must be a positive integer") for bad in (0, 2.5, True)],
    ("knorm", {"chunk_length": 20, "chunk_scope": "batch"}, 64, "chunk_scope must be one of layer, head"),
    ("keydiff", {"layer_budgets": {"schedule": "pyramidal"}}, 256, "valid: uniform, pyramid"),
    ("keydiff", {"layer_budgets": {"schedule": "pyramid", "alpha": 1}}, 256,
     "valid: schedule, beta, window, arithmetic"),
    ("keydiff", {"layer_budgets": {"schedule": "pyramid", "arithmetic": "floor"}}, 256,
     "valid: exact, kvcache_factory"),
    # SnapKV's window against the top layer's budget
    ("snapkv", {"layer_budgets": {"schedule": "pyramid", "beta": 20}}, 256, "smaller than the budget"),
    ("lagkv", {"scoring": "stream"}, 256, "valid: frozen, rescore"),
    ("kvzip", {"n_sink": 8}, 8, "n_sink"),
    ("kvzip", {"context_overlap": -1}, 32, "context_overlap"),
    ("kvzip", {"scoring_keys": "block"}, 32, "valid: cache, chunk"),
    ("keydiff", {"key_rerotation": "sideways"}, None,
     "key_rerotation must be true, false or one of contiguous, absolute, got 'sideways'"),
    ("keydiff", {"key_rerotation": "kvpress"}, None,
     "'kvpress' was withdrawn: kvpress's pipeline continues after the kept keys"),
]


@pytest.mark.parametrize("name, params, budget, message", REFUSED)
def test_a_refused_parameter_is_one_line_naming_what_is_valid(name, params, budget, message):
    with pytest.raises(ValueError, match=message) as error:
        policy = build_policy(name, **params)
        if budget is not None:
            policy.check(budget)
    assert "\n" not in str(error.value)


def test_window_size_floor_is_robust_to_float_noise(caplog):
    from keydiff.policies.base import window_size

    assert window_size(0.57, 100) == 57 and window_size(0.29, 100) == 29 and window_size(0.2, 2048) == 409
    build_policy("keydiff", window_fraction=0.2).validate(4)  # 0.8 entries -> empty window, with a warning
    assert "reserves no entry" in caplog.text


def test_recent_window_adds_to_what_the_policy_protects():
    """A window around a policy that protects entries 0, 1 keeps both: those, the 3 newest, then the lowest norms."""
    from dataclasses import dataclass

    from keydiff.policies import KNorm, RecentWindow

    @dataclass
    class FirstTwo(KNorm):
        def protected(self, layer, budget):
            return layer.positions < 2

    keys = norm_keys([9.0, 8, 1, 7, 2, 6, 3, 5, 4, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9])
    kept = RecentWindow(FirstTwo(), fraction=0.3).keep_indices(make_view(keys), 10)
    assert kept[0, 0].tolist() == [0, 1, 2, 4, 6, 7, 8, 17, 18, 19]  # norms 1, 2, 3, 4, 5 at 2, 4, 6, 8, 7


def test_most_recent_reads_positions_not_buffer_order():
    from keydiff.policies.base import most_recent

    positions = torch.tensor([[[7, 2, 9, 0, 5, 8]]])
    view = LayerView(torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2), positions, None, {}, 0)
    assert most_recent(view, 3)[0, 0].tolist() == [True, False, True, False, False, True]
    assert not most_recent(view, 0).any() and most_recent(view, 6).all()


def test_score_then_position_orders_by_score_then_position():
    from keydiff.policies.base import score_then_position

    scores = torch.tensor([-2.5, -0.0, 0.0, 1e-30, -1e-30, float("inf"), float("-inf"), 3.0, 3.0, -2.5])
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9, 8, 7])
    order = score_then_position(scores, positions).argsort().tolist()
    expected = sorted(range(10), key=lambda i: (float(scores[i]) + 0.0, int(positions[i])))
    assert order == expected


CONF = Path(__file__).resolve().parents[1] / "conf"
CONF_POLICIES = sorted(p.stem for p in (CONF / "policy").glob("*.yaml") if p.stem != "custom")
