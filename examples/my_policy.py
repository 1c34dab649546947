"""A complete eviction policy written outside keydiff-bench (docs/policies.md, "Your own policy").

    PYTHONPATH=examples python run.py policy=custom policy.target=my_policy.MyPolicy +policy.params.alpha=0.3

Check it against the policy contract first (a few seconds on a tiny random model, no download):

    PYTHONPATH=examples python -c "from keydiff.testing import check_policy; from my_policy import MyPolicy; print(check_policy(MyPolicy, alpha=0.3))"

A recent window and per-layer budgets are not written here: they are wrappers around any policy,

    from keydiff.policies import LayerBudgets, RecentWindow
    policy = LayerBudgets(RecentWindow(MyPolicy(alpha=0.3), fraction=0.2), schedule={"schedule": "pyramid", "beta": 20})

and check_policy takes the composed object too (`check_policy(policy)`); from the command line,
`+policy.params.layer_budgets={schedule:pyramid,beta:20}` adds the schedule.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies import LayerView, Needs, Policy


@dataclass
class MyPolicy(Policy):
    """Keep the entries with the largest values, nudged towards recent ones; never evict the first `sinks`."""

    # What it needs from the cache and the engine, in one place (every default is the safe answer; check_policy
    # checks both claims): each batch row is scored from its own entries alone (so the cache may evict all layers in
    # one call, their rows stacked), with tensors alone (no host read: the fixed-shape step may capture it).
    needs: ClassVar[Needs] = Needs(rows_alike=True, host_reads=False)
    alpha: float = 0.3  # weight of recency against the value norm
    sinks: int = 4

    def validate(self, budget: int) -> None:  # runs before the model is loaded
        if not 0 <= self.sinks < budget:
            raise ValueError(f"sinks ({self.sinks}) must be in [0, budget={budget})")

    def score(self, layer: LayerView) -> torch.Tensor:  # [batch, kv_heads, n]; the highest budget are kept
        recency = layer.positions.float() / (layer.positions.amax(dim=(1, 2), keepdim=True) + 1)  # per row
        return layer.values.float().norm(dim=-1) + self.alpha * recency

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:  # always kept
        return layer.positions < self.sinks
