"""Head-adaptive budgets (AdaKV) with CriticalKV (its choices are checked at every eviction by
tests/test_policy_contract.py): ties across heads, the combinations refused in one line, check_policy."""

from __future__ import annotations

import math

import pytest
import torch

from keydiff.engine import prefill
from keydiff.policies import HeadAdaptive, build_policy
from keydiff.policies.base import LayerView
from keydiff.policies.criticalkv import STATE
from tests.test_adakv import prompt_ids
from tests.test_policy_contract import adakv_counts, critical_choice

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 48, 16


@pytest.mark.unit
@pytest.mark.extended
def test_scores_tied_across_heads_follow_the_adakv_tie_rule():
    """Exact ties within and across heads: AdaKV's counts (newer position, then lower head) in both forms, as loops."""
    # kvpress's two presses break such a tie differently (docs/peers.md); here one rule decides in both forms.
    g = torch.Generator().manual_seed(0)
    heads, budget, dim = 3, 10, 4
    for trial in range(40):
        alpha = [0.0, 0.2, 0.5, 1.0][trial % 4]
        recent = [0.0, 0.2][trial % 2]
        policy = build_policy("h2o", recent_fraction=recent, critical=True, head_budgets="adakv",
                              alpha_safeguard=alpha)
        plain = build_policy("h2o", recent_fraction=recent, head_budgets="adakv", alpha_safeguard=alpha)
        views = []
        for n in torch.randint(budget // 2, 3 * budget, (heads,), generator=g).tolist():
            views.append(LayerView(
                keys=torch.randn(1, 1, n, dim, generator=g), values=torch.randn(1, 1, n, dim, generator=g),
                positions=torch.randperm(4 * budget, generator=g)[:n][None, None], attention=None,
                state={"h2o": torch.randint(0, 4, (1, 1, n), generator=g).float(),
                       STATE: torch.randint(1, 4, (1, 1, n), generator=g).float()}, layers=(0,)))
        masks = policy.keep_heads(views, budget)
        actual = [sorted(view.positions[0, 0][mask].tolist()) for view, mask in zip(views, masks)]
        inner = policy.scorer.scorer
        protected = []
        for view in views:
            protect = inner.protected(view, budget)
            protected.append([False] * view.positions.shape[-1] if protect is None else protect[0, 0].tolist())
        raw, positions = [v.state["h2o"][0, 0].tolist() for v in views], [v.positions[0, 0].tolist() for v in views]
        safe, ratio = math.floor(alpha * budget + 1e-9), policy.scorer.first_stage_ratio
        expected = [critical_choice(*head, c, max(math.floor(ratio * c + 1e-9), safe), policy.scorer.epsilon, False)
                    for *head, c in zip(raw, protected, positions, [v.state[STATE][0, 0].tolist() for v in views],
                                        adakv_counts(raw, protected, positions, budget, alpha))]
        assert actual == expected
        assert [int(m.sum()) for m in masks] == [int(m.sum()) for m in plain.keep_heads(views, budget)]
        assert sum(map(len, actual)) == min(heads * budget, sum(v.positions.shape[-1] for v in views))


@pytest.mark.unit
@pytest.mark.parametrize("name, params, message", [
    ("keydiff", {"key_rerotation": True}, "key_rerotation with head_budgets=adakv"),
    ("keydiff", {"key_rerotation": "contiguous"}, "key_rerotation with head_budgets=adakv"),
    ("kvzip", {}, "kvzip with head_budgets=adakv"),
    ("snapkv", {"chunk_length": 20}, "chunk_length with head_budgets=adakv"),
])
def test_head_budgets_with_rerotation_kvzip_or_chunks_are_refused_in_one_line(name, params, message):
    with pytest.raises(ValueError, match=message) as error:
        build_policy(name, head_budgets="adakv", **params)
    assert "\n" not in str(error.value)
    build_policy(name, **params)  # each alone is fine


def test_rerotation_composed_by_hand_around_head_budgets_fails_clearly(model):
    """build_policy refuses it; a policy composed in Python reaches the cache, which refuses it at eviction."""
    from keydiff.policies import KeyDiff, Rerotated

    policy = Rerotated(HeadAdaptive(KeyDiff()), mode="absolute")
    with pytest.raises(RuntimeError, match="key re-rotation is not supported with head-adaptive budgets"):
        prefill(model, prompt_ids(), policy, BUDGET, BLOCK)


@pytest.mark.extended
@pytest.mark.parametrize("name,params", [("snapkv", {"window": 8, "critical": True}), ("keydiff", {})])
def test_check_policy_runs_head_adaptive_policies(name, params):
    from keydiff.testing import check_policy

    summary = check_policy(name, head_budgets="adakv", **params)
    assert summary["evictions"] > 0 and summary["layer_budgets"] == [48, 48, 48]
    assert summary["segments_checked"] == (name == "keydiff")  # chosen all layers at once: checked head by head
