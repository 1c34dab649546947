"""Behaviour any policy can be given from outside, as a wrapper around it (as kvpress composes presses).

    LayerBudgets(RecentWindow(KeyDiff(), fraction=0.2), schedule={"schedule": "pyramid", "beta": 20})

Design: docs/design/policies.md#building-and-composing-__init__py-wrapperspy"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from keydiff.policies.base import (LayerView, Needs, Policy, SegmentView, check_fraction, chooses_whole_segments,
                                   most_recent, window_size)
from keydiff.policies.layer_budgets import check_layer_budgets, smallest_layer_budget, split_budget


@dataclass
class PolicyWrapper(Policy):
    """A policy around another one: everything is the wrapped policy's unless a subclass adds to it."""

    scorer: Policy

    def __post_init__(self) -> None:
        inner = self.scorer.unwrapped()
        if type(inner).evict_indices is not Policy.evict_indices:
            raise TypeError(
                f"{type(self).__name__} cannot wrap {type(inner).__qualname__}: it overrides evict_indices, which the "
                "wrapper would go round (wrappers compose score and protected; implement those instead)"
            )

    @property
    def name(self) -> str:
        return self.scorer.name

    @property
    def needs(self) -> Needs:
        """The wrapped policy's needs, less two it cannot vouch for: a wrapper may change the scores, so it reads them
        on the host and scores no segments. A subclass adds its own with `replace(super().needs, ...)`."""
        inner = self.scorer.needs
        return replace(inner, host_reads=True, segment_scores=inner.segment_scores and inner.head_adaptive)

    def reconstruction_input(self, block: torch.Tensor, previous: torch.Tensor, tokenizer) -> torch.Tensor:
        return self.scorer.reconstruction_input(block, previous, tokenizer)

    def reconstruction_keys(self, positions: torch.Tensor, chunk_start: int | None) -> torch.Tensor | None:
        return self.scorer.reconstruction_keys(positions, chunk_start)

    def keep_heads(self, heads: list[LayerView], budget: int) -> list[torch.Tensor]:
        return self.scorer.keep_heads(heads, budget)

    def drop_segments(self, segments: SegmentView, budget: int) -> torch.Tensor:
        if not chooses_whole_segments(self):
            return Policy.drop_segments(self, segments, budget)  # head by head, through this object's `keep_heads`
        return self.scorer.drop_segments(segments, budget)

    def unwrapped(self) -> Policy:
        return self.scorer.unwrapped()

    def check_parameters(self, budget: int) -> None:
        """Raise ValueError if this wrapper's own parameters cannot work with `budget` (default: nothing to check)."""

    def validate(self, budget: int) -> None:
        self.check_parameters(budget)
        self.scorer.validate(budget)

    def check(self, budget: int) -> None:
        self.check_parameters(budget)
        self.scorer.check(budget)

    def compresses_layer(self, layer_idx: int) -> bool:
        return self.scorer.compresses_layer(layer_idx)

    def budgets(self, budget: int, num_layers: int, prompt_length: int | None = None) -> list[int | None]:
        return self.scorer.budgets(budget, num_layers, prompt_length)

    def initial_state(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.scorer.initial_state(keys)

    def entry_state(self, entries: LayerView) -> dict[str, torch.Tensor]:
        return self.scorer.entry_state(entries)

    def observe(self, layer: LayerView) -> None:
        self.scorer.observe(layer)

    def score(self, layer: LayerView) -> torch.Tensor:
        return self.scorer.score(layer)

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        return self.scorer.protected(layer, budget)

    def describe(self) -> dict:
        return self.scorer.describe()


@dataclass
class RecentWindow(PolicyWrapper):
    """Always keep the `fraction` x budget (floor) most recent entries of each KV head; `scorer` chooses the rest."""

    fraction: float = 0.0

    @property
    def needs(self) -> Needs:
        """The wrapped policy's, capturable too (the window is a k-th value of the positions: tensors alone); with no
        window (fraction 0, the presets' default) nothing is protected, so it scores segments as the wrapped policy
        does."""
        inner = self.scorer.needs
        return replace(super().needs, host_reads=inner.host_reads,
                       segment_scores=self.fraction == 0 and inner.segment_scores)

    @property
    def parameter(self) -> str:
        """The fraction's name in configs and results: the wrapped policy's own word for it, else recent_fraction."""
        return self.scorer.unwrapped().recent_window_parameter or "recent_fraction"

    def check_parameters(self, budget: int) -> None:
        check_fraction(f"{self.name} {self.parameter}", self.fraction, budget)

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        inner = self.scorer.protected(layer, budget)
        count = window_size(self.fraction, budget)
        if not count:
            return inner
        recent = most_recent(layer, count)
        return recent if inner is None else recent | inner

    def score_segments(self, segments: SegmentView) -> torch.Tensor:
        return self.scorer.score_segments(segments)

    def describe(self) -> dict:
        """The wrapped policy's description with the fraction added before `layer_budgets`."""
        described = self.scorer.describe()
        schedule = described.pop("layer_budgets", None)
        return {**described, self.parameter: self.fraction, "layer_budgets": schedule}


@dataclass
class LayerBudgets(PolicyWrapper):
    """Split the budget across layers by `schedule` (keydiff.policies.layer_budgets); each layer is bounded by its N_l."""

    schedule: dict[str, Any] | None = None

    def check(self, budget: int) -> None:
        """Validate the schedule, then the wrapped policy against the smallest budget any layer gets."""
        check_layer_budgets(self.schedule)
        smallest = smallest_layer_budget(self.schedule, budget)
        if smallest < 1:
            raise ValueError(f"layer_budgets gives the top layer {smallest} entries of a {budget}-token budget; raise the budget or lower beta")
        self.scorer.check(smallest)

    def budgets(self, budget: int, num_layers: int, prompt_length: int | None = None) -> list[int | None]:
        """The schedule's budgets (same total as uniform); None for a layer the wrapped policy never compresses."""
        split = split_budget(self.schedule, budget, num_layers, prompt_length)
        inner = self.scorer.budgets(budget, num_layers, prompt_length)
        return [split[i] if inner[i] is not None else None for i in range(num_layers)]

    def describe(self) -> dict:
        return {**self.scorer.describe(), "layer_budgets": self.schedule}


__all__ = ["LayerBudgets", "PolicyWrapper", "RecentWindow"]
