"""keydiff.testing.check_policy: every built-in passes it, and each kind of broken policy fails it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from keydiff import build_policy, prefill
from keydiff.policies import POLICIES, LayerView, Policy
from keydiff.policies.knorm import KNorm
from keydiff.testing import PolicyCheckError, check_policy
from tests.conftest import tiny_llama

PYRAMID = {"schedule": "pyramid", "beta": 4, "window": 0}

# Non-default settings worth checking on their own: LagKV with partitions that fit the check's budget (both
# scorings), PyramidKV budgets (both arithmetics; uniform budgets only can be stacked), the original H2O,
# TOVA per layer, SnapKV max-pooled, L2-norm skipping layers (those layers are never evicted).
VARIANTS = [
    ("lagkv", {"lag_size": 8}),
    ("lagkv", {"lag_size": 8, "scoring": "rescore"}),
    ("keydiff", {"layer_budgets": PYRAMID}),
    ("keydiff", {"layer_budgets": {**PYRAMID, "arithmetic": "kvcache_factory"}}),
    ("snapkv", {"window": 8, "layer_budgets": {**PYRAMID, "window": 8}}),
    ("h2o", {"recent_fraction": 0.5}),
    ("tova", {"heads": "layer"}),
    ("snapkv", {"pooling": "max"}),
    ("knorm", {"skip_layers": [0]}),
    ("expected_attention", {"use_covariance": False, "epsilon": 0.01}),
]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_builtin_policy_passes_check_policy(name):
    summary = check_policy(POLICIES[name])
    assert summary["policy"] == name
    assert summary["evictions"] > 0 or not POLICIES[name].evicts
    # A policy that claims layers_batchable was really run stacked (and compared with layer-by-layer).
    assert summary["stacked"] == summary["batchable_checked"] == POLICIES[name].layers_batchable


@pytest.mark.parametrize("name, params", VARIANTS, ids=[f"{n}-{'-'.join(map(str, p))}" for n, p in VARIANTS])
def test_builtin_variants_pass_check_policy(name, params):
    summary = check_policy(name, **params)
    assert summary["evictions"] > 0
    # pyramid budgets never stack; the layers_batchable comparison then runs stacked with uniform budgets
    never_stacks = name == "knorm" and params.get("skip_layers")  # a layer never evicted: no stack at all
    assert summary["batchable_checked"] == (POLICIES[name].layers_batchable and not never_stacks)


# --------------------------------------------------------------------------- broken policies


@dataclass
class CrossLayer(Policy):
    """Claims layers_batchable but reduces over the batch rows (= over layers when the cache stacks them)."""

    layers_batchable: ClassVar[bool] = True

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
class WrongShape(Policy):
    """One score per position, not per KV head: [batch, n]."""

    def score(self, layer: LayerView) -> torch.Tensor:
        return layer.keys.float().norm(dim=-1).mean(dim=1)


@dataclass
class Unseeded(Policy):
    def score(self, layer: LayerView) -> torch.Tensor:
        return torch.rand(layer.positions.shape)


@dataclass
class ProtectedInfinity(KNorm):
    """-inf only for protected entries (as Expected Attention's sinks): allowed, they are kept anyway."""

    def score(self, layer: LayerView) -> torch.Tensor:
        return super().score(layer).masked_fill(layer.positions < 2, float("-inf"))

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        return layer.positions < 2


@pytest.mark.parametrize("policy, message", [
    (CrossLayer, r"layer-by-layer eviction \(it claims layers_batchable\) kept other positions"),
    (NaNScores, r"NaN/inf value\(s\) for entries that are not protected"),
    (InfiniteScores, r"'tests.test_check_policy.InfiniteScores \(knorm subclass\)': score\(\) returned 6 NaN/inf"),
    (WrongShape, r"returned shape \[1, \d+\]; expected \[batch, kv_heads, n\]"),
    (Unseeded, "a second run with a fresh policy object kept other positions"),
])
def test_broken_policies_fail_check_policy_saying_why(policy, message):
    with pytest.raises(PolicyCheckError, match=message):
        check_policy(policy)


def test_cross_layer_policy_fails_under_pyramid_budgets_too():
    """Pyramid budgets keep the cache from stacking; the batchable comparison must still run stacked."""
    with pytest.raises(PolicyCheckError, match=r"layer-by-layer eviction \(it claims layers_batchable\)"):
        check_policy(CrossLayer, layer_budgets=PYRAMID)


class Undecorated(KNorm):  # no @dataclass of its own: its field is no parameter
    alpha: float = 0.5


@pytest.mark.parametrize("params", [{}, {"alpha": 0.3}])
def test_undecorated_class_is_refused_as_run_py_refuses_it(params):
    with pytest.raises(ValueError, match=r"policy class tests.test_check_policy.Undecorated: Undecorated must be "
                                         r"decorated with @dataclass"):
        check_policy(Undecorated, **params)


def test_infinite_scores_of_protected_entries_pass():
    assert check_policy(ProtectedInfinity)["evictions"] > 0


def test_unseeded_policy_passes_when_it_does_not_claim_determinism():
    assert check_policy(Unseeded, deterministic=False)["evictions"] > 0


def test_bad_scores_fail_on_first_use_naming_the_policy(model):
    """Outside check_policy too: the first eviction checks the scores (a run fails instead of ordering NaN)."""
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(0))
    nan = r"policy 'tests.test_check_policy.NaNScores \(knorm subclass\)': score\(\) returned \d+ NaN"
    with pytest.raises(RuntimeError, match=nan):
        prefill(model, ids, NaNScores(), budget=40, block_size=20)
    with pytest.raises(RuntimeError, match=r"policy 'tests.test_check_policy.WrongShape': score\(\) returned shape"):
        prefill(model, ids, WrongShape(), budget=40, block_size=20)
    assert prefill(model, ids, build_policy("knorm"), budget=40, block_size=20).max_cache_entries == 60


def test_check_policy_rejects_a_budget_that_never_evicts():
    with pytest.raises(ValueError, match="must be smaller than prompt_tokens"):
        check_policy("keydiff", budget=200, prompt_tokens=100)
    with pytest.raises(ValueError, match="lagkv scoring 'x' is not valid"):
        check_policy("lagkv", scoring="x")
