"""Eviction policies, built by name: `build_policy("keydiff", window_fraction=0.2)`.

Each policy is one small dataclass in its own module; `POLICIES` maps the config name to the class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from keydiff.policies.base import LayerView, Policy
from keydiff.policies.full import Full
from keydiff.policies.h2o import H2O
from keydiff.policies.keydiff import KeyDiff, KeyDiffPairwise
from keydiff.policies.knorm import KNorm
from keydiff.policies.random import Random
from keydiff.policies.recent import Recent
from keydiff.policies.sink import Sink
from keydiff.policies.snapkv import SnapKV
from keydiff.policies.tova import TOVA

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Full, KeyDiff, KeyDiffPairwise, Sink, H2O, TOVA, SnapKV, KNorm, Random, Recent)
}


def available_policies() -> list[str]:
    return sorted(POLICIES)


def build_policy(name: str, **params: Any) -> Policy:
    """Instantiate the policy called `name` with hyper-parameters `params`.

    Raises ValueError naming the valid policies or the valid parameters of this policy.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(available_policies())}")
    cls = POLICIES[name]
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(
            f"policy {name!r} has no parameter(s) {', '.join(unknown)}; valid: {', '.join(valid) or '(none)'}"
        )
    return cls(**params)


__all__ = ["POLICIES", "LayerView", "Policy", "available_policies", "build_policy"] + [c.__name__ for c in POLICIES.values()]
