"""CriticalKV (keydiff.policies.criticalkv.Critical): its formula against hand computations and kvpress's; every
eviction of a real prefill and decoding is checked against plain loops by tests/test_policy_contract.py."""

from __future__ import annotations

import pytest
import torch

from keydiff.policies import build_policy
from keydiff.policies.base import LayerView
from keydiff.policies.criticalkv import STATE, critical_scores, output_norms
from tests.test_policy_contract import loop_norms

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("chunk_elements", [1 << 24, 2 * 6 * 20 * 3])  # one product, or chunks of 3 entries
def test_output_norms_against_loops_with_grouped_heads(chunk_elements, monkeypatch):
    import keydiff.policies.criticalkv as criticalkv

    monkeypatch.setattr(criticalkv, "NORM_CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2, 3, 7, 8, generator=g)
    weight = torch.randn(20, 6 * 8, generator=g)  # 6 query heads over 3 KV heads
    loops = torch.stack([torch.stack([loop_norms(values[b, j], weight, 2, j) for j in range(3)]) for b in range(2)])
    torch.testing.assert_close(output_norms(values, weight).double(), loops, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="does not match values"):
        output_norms(values, torch.randn(20, 5 * 8))


def test_epsilon_is_added_per_query_row_as_in_kvpress():
    """kvpress adds eps to one query's attention (a window's mean): our sums must score (sum + rows x eps) x norm."""
    g = torch.Generator().manual_seed(0)
    rows, n, kv_heads, dim = 4, 12, 2, 8
    weights = torch.softmax(torch.randn(1, kv_heads, rows, n, generator=g), dim=-1)  # each row sums to 1
    values = torch.randn(1, kv_heads, n, dim, generator=g)
    projection = torch.randn(16, 2 * kv_heads * dim, generator=g)  # 2 query heads per KV head
    norms = output_norms(values, projection)
    view = LayerView(keys=torch.randn(1, kv_heads, n, dim, generator=g), values=values,
                     positions=torch.arange(n).expand(1, kv_heads, n), attention=weights.sum(dim=2),
                     state={STATE: norms}, layers=0, output_projection=projection)
    policy = build_policy("snapkv", window=rows, kernel_size=1, critical=True, critical_epsilon=0.05)
    mean = weights.mean(dim=2)  # SnapKVPress's score with kernel 1
    prefix = n - rows  # the window's own entries are protected, not ranked
    got = policy.score(view)[..., :prefix]
    torch.testing.assert_close(got, rows * (mean[..., :prefix] + 0.05) * norms[..., :prefix])
    assert torch.equal(got.argsort(dim=-1), ((mean + 0.05) * norms)[..., :prefix].argsort(dim=-1))
    # One row (TOVA, or SnapKV while decoding): epsilon as it is.
    one = LayerView(keys=view.keys, values=values, positions=view.positions, attention=weights[:, :, 0],
                    state={STATE: norms}, layers=0, output_projection=projection)
    expected = (weights[:, :, 0, :prefix] + 0.05) * norms[..., :prefix]
    torch.testing.assert_close(policy.score(one)[..., :prefix], expected)


def test_negative_scores_are_shifted_so_a_larger_norm_never_lowers_an_entry():
    scores = torch.tensor([[[-0.9, -0.2, 0.3]]])
    low, high = (critical_scores(scores, torch.full((1, 1, 3), norm), 1e-4, False) for norm in (1.0, 2.0))
    assert bool((high >= low).all())  # without the shift (-0.9 + eps) x 2 < (-0.9 + eps) x 1
    torch.testing.assert_close(low, torch.tensor([[[1e-4, 0.7 + 1e-4, 1.2 + 1e-4]]]))
    # Non-negative scores are kvpress's formula as it is.
    plain = torch.tensor([[[0.1, 0.5]]])
    expected = torch.tensor([[[0.33, 0.51]]])
    torch.testing.assert_close(critical_scores(plain, torch.tensor([[[3.0, 1.0]]]), 0.01, False), expected)
    # Log scores: log((exp(s) + eps) x norm).
    logs = torch.tensor([[[-5.0, -1.0]]])
    expected = torch.log((logs.exp() + 0.01) * torch.tensor([[[2.0, 0.5]]]))
    torch.testing.assert_close(critical_scores(logs, torch.tensor([[[2.0, 0.5]]]), 0.01, True), expected)


def test_stage_one_with_per_head_counts_for_head_budgets():
    """The AdaKV form picks stage 1 per KV head with that head's count."""
    from keydiff.policies.criticalkv import first_stage

    scores = torch.tensor([[[0.1, 0.9, 0.5, 0.3], [0.4, 0.2, 0.8, 0.6]]])
    positions = torch.arange(4).expand(1, 2, 4)
    chosen = first_stage(scores, positions, None, torch.tensor([[1, 3]]))
    assert chosen.tolist() == [[[False, True, False, False], [True, False, True, True]]]
    uniform = first_stage(scores, positions, torch.tensor([[[True, False, False, False], [False] * 4]]), 2)
    assert uniform.tolist() == [[[True, True, False, False], [False, False, True, True]]]  # protected ranks first
