"""keydiff.testing.check_policy: every built-in passes it, and each kind of broken policy fails it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from keydiff.policies import POLICIES, LayerBudgets, LayerView, Needs, Policy, RecentWindow
from keydiff.policies.knorm import KNorm
from keydiff.testing import PolicyCheckError, check_policy

pytestmark = pytest.mark.integration

PYRAMID = {"schedule": "pyramid", "beta": 4, "window": 0}

# Parameters that fit each built-in into the smallest layer budget of PYRAMID in the check (48 tokens: 12).
FITS_A_PYRAMID = {"snapkv": {"window": 8}, "lagkv": {"lag_size": 4}}
PYRAMID_BUDGETS = [84, 48, 12]  # by hand: top 48 / 4 = 12, bottom 2 x 48 - 12 = 84, the middle halfway


@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_builtin_policy_passes_check_policy_with_pyramid_layer_budgets(name):
    policy = LayerBudgets(RecentWindow(POLICIES[name](**FITS_A_PYRAMID.get(name, {})), fraction=0.25), schedule=PYRAMID)
    summary = check_policy(policy)
    assert summary["layer_budgets"] == ([None] * 3 if name == "full" else PYRAMID_BUDGETS)
    assert not summary["stacked"]  # layers with budgets of their own are never stacked


@dataclass
class CrossLayer(Policy):
    """Claims needs.rows_alike but reduces over the batch rows (= over layers when the cache stacks them)."""

    needs: ClassVar[Needs] = Needs(rows_alike=True)

    def score(self, layer: LayerView) -> torch.Tensor:
        first = layer.keys[..., 0].float()
        return first * first.mean(dim=0, keepdim=True).sign()


@dataclass
class NaNScores(KNorm):
    """L2-norm whose scores turn NaN for entries at odd positions."""

    def score(self, layer: LayerView) -> torch.Tensor:
        return super().score(layer).masked_fill(layer.positions % 2 == 1, float("nan"))


@dataclass
class InfiniteScores(KNorm):
    def score(self, layer: LayerView) -> torch.Tensor:
        return super().score(layer).masked_fill(layer.positions == 20, float("-inf"))


@dataclass
class HostRead(KNorm):
    """Claims needs.capturable (KNorm's) but reads a value on the host at every eviction."""

    def score(self, layer: LayerView) -> torch.Tensor:
        return super().score(layer) / float(layer.keys.abs().max())


@dataclass
class WrongShape(Policy):
    """One score per position, not per KV head: [batch, n]."""

    def score(self, layer: LayerView) -> torch.Tensor:
        return layer.keys.float().norm(dim=-1).mean(dim=1)


@dataclass
class Unseeded(Policy):
    def score(self, layer: LayerView) -> torch.Tensor:
        return torch.rand(layer.positions.shape)


ROWS_ALIKE_BROKEN = r"layer-by-layer eviction \(it claims needs.rows_alike\) kept other positions"


@pytest.mark.parametrize("policy, params, message", [
    (CrossLayer, {}, ROWS_ALIKE_BROKEN),
    pytest.param(CrossLayer, {"layer_budgets": PYRAMID}, ROWS_ALIKE_BROKEN, marks=pytest.mark.extended),  # unstacked
    pytest.param(LayerBudgets(RecentWindow(CrossLayer(), fraction=0.25), schedule={"schedule": "uniform"}), {},
                 ROWS_ALIKE_BROKEN, marks=pytest.mark.extended),  # a wrapper forwards the false claim
    (NaNScores, {}, r"NaN/inf value\(s\) for entries that are not protected"),
    (HostRead, {}, r"claims needs.capturable but its eviction could not be captured in a CUDA graph \(stood in for on "
               r"the CPU\): .*set host_reads=True"),
    (InfiniteScores, {}, r"'tests.test_check_policy.InfiniteScores \(knorm subclass\)': score\(\) returned 6 NaN/inf"),
    (WrongShape, {}, r"returned shape \[1, \d+\]; expected \[batch, kv_heads, n\]"),
    (Unseeded, {}, "a second run with a fresh policy object kept other positions"),
])
def test_broken_policies_fail_check_policy_saying_why(policy, params, message):
    with pytest.raises(PolicyCheckError, match=message):
        check_policy(policy, **params)


@dataclass
class OwnEviction(KNorm):
    """Chooses in evict_indices itself: a wrapper composing score and protected would go round it."""

    def evict_indices(self, layer: LayerView, budget: int) -> torch.Tensor:
        return super().evict_indices(layer, budget)


@pytest.mark.unit
def test_a_policy_with_its_own_evict_indices_cannot_be_wrapped():
    with pytest.raises(TypeError, match="RecentWindow cannot wrap OwnEviction: it overrides evict_indices"):
        RecentWindow(OwnEviction(), fraction=0.2)
    with pytest.raises(TypeError, match="LayerBudgets cannot wrap OwnEviction"):
        LayerBudgets(OwnEviction(), schedule=None)


class Undecorated(KNorm):  # no @dataclass of its own: its field is no parameter
    alpha: float = 0.5


@pytest.mark.unit
def test_undecorated_class_is_refused_as_run_py_refuses_it():
    with pytest.raises(ValueError, match=r"policy class tests.test_check_policy.Undecorated: Undecorated must be "
                                         r"decorated with @dataclass"):
        check_policy(Undecorated)


@pytest.mark.unit
def test_check_policy_rejects_a_budget_that_never_evicts():
    with pytest.raises(ValueError, match="must be smaller than prompt_tokens"):
        check_policy("keydiff", budget=200, prompt_tokens=100)
    with pytest.raises(ValueError, match="lagkv scoring 'x' is not valid"):
        check_policy("lagkv", scoring="x")
    with pytest.raises(TypeError, match="parameters with a class or a name, not with a policy object"):
        check_policy(RecentWindow(KNorm()), fraction=0.2)
