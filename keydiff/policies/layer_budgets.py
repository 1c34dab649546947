"""How a budget N is split across layers: uniform (every layer N) or a PyramidKV schedule (Cai et al. 2024). Design:
docs/design/policies.md#layer-budgets-pyramidkv-layer_budgetspy"""

from __future__ import annotations

import math
from typing import Any

SCHEDULES = ("uniform", "pyramid")
PYRAMID_KEYS = ("schedule", "beta", "window", "arithmetic")
ARITHMETICS = ("exact", "kvcache_factory")


def check_layer_budgets(spec: dict[str, Any] | None) -> None:
    """Raise ValueError naming the key and the valid choices if `spec` is not a valid schedule."""
    if spec is None:
        return
    if not isinstance(spec, dict):
        raise ValueError(f"layer_budgets must be a mapping like {{schedule: pyramid, beta: 20}}, got {spec!r}")
    schedule = spec.get("schedule", "uniform")
    if schedule not in SCHEDULES:
        raise ValueError(f"layer_budgets.schedule {schedule!r} is not valid; valid: {', '.join(SCHEDULES)}")
    valid = PYRAMID_KEYS if schedule == "pyramid" else ("schedule",)
    unknown = sorted(set(spec) - set(valid))
    if unknown:
        raise ValueError(f"layer_budgets has no key(s) {', '.join(unknown)} for schedule {schedule!r}; valid: {', '.join(valid)}")
    if schedule == "pyramid":
        if not spec.get("beta", 20) >= 1:
            raise ValueError(f"layer_budgets.beta must be >= 1, got {spec.get('beta')}")
        if not isinstance(spec.get("window", 0), int) or spec.get("window", 0) < 0:
            raise ValueError(f"layer_budgets.window must be a non-negative integer, got {spec.get('window')}")
        if spec.get("arithmetic", "exact") not in ARITHMETICS:
            raise ValueError(
                f"layer_budgets.arithmetic {spec.get('arithmetic')!r} is not valid; valid: {', '.join(ARITHMETICS)}"
            )


def smallest_layer_budget(spec: dict[str, Any] | None, budget: int) -> int:
    """The smallest budget any layer can get (what policies validate before loading): at least w + floor((N - w) / beta)."""
    if spec is None or spec.get("schedule", "uniform") == "uniform":
        return budget
    window = spec.get("window", 0)
    return window + math.floor((budget - window) / spec.get("beta", 20))


def split_budget(spec: dict[str, Any] | None, budget: int, num_layers: int, prompt_length: int | None = None) -> list[int]:
    """Per-layer budgets [num_layers]: uniform or the pyramid (summing to num_layers x budget for `exact`)."""
    check_layer_budgets(spec)
    if spec is None or spec.get("schedule", "uniform") == "uniform" or num_layers == 1:
        return [budget] * num_layers
    beta, window = spec.get("beta", 20), spec.get("window", 0)
    if budget <= window:
        raise ValueError(f"layer_budgets.window ({window}) must be smaller than the budget ({budget})")
    if spec.get("arithmetic", "exact") == "kvcache_factory":
        return kvcache_factory_split(budget, window, beta, num_layers, prompt_length)
    share = budget - window
    low = share / beta  # top layer
    high = 2 * share - low  # bottom layer
    if prompt_length is not None and high >= prompt_length - window:
        high = prompt_length - window
        low = 2 * share - high
    if not (high >= low >= 0):
        return [budget] * num_layers  # not a pyramid any more: the uniform budget
    step = (high - low) / (num_layers - 1)
    exact = [window + high - layer * step for layer in range(num_layers)]
    return largest_remainder(exact, budget * num_layers)


def kvcache_factory_split(budget: int, window: int, beta: float, num_layers: int, prompt_length: int | None) -> list[int]:
    """KVCache-Factory's per-layer budgets (PyramidKVCluster.update_kv): floored top share and step. An unknown
    prompt length is taken as long; a prompt shorter than 2(N - w) gets N everywhere."""
    share = budget - window
    if prompt_length is not None and prompt_length < max(2 * share, budget):
        return [budget] * num_layers
    low = math.floor(share / beta)  # top layer, without the window
    high = 2 * share - low  # bottom layer
    if prompt_length is not None and high >= prompt_length - window:
        high = prompt_length - window
        low = 2 * share - high
    step = (high - low) // (num_layers - 1)
    return [window + high - layer * step for layer in range(num_layers)]


def largest_remainder(values: list[float], total: int) -> list[int]:
    """Round `values` to integers summing to `total` (which must be their rounded sum): floors, then +1 to the
    largest fractional parts (ties: lower layer first)."""
    floors = [math.floor(v) for v in values]
    missing = total - sum(floors)
    order = sorted(range(len(values)), key=lambda i: (-(values[i] - floors[i]), i))
    for i in order[:missing]:
        floors[i] += 1
    return floors
