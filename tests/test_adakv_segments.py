"""Head-adaptive eviction over whole pools (AdaKV's `adakv_drop_segments`): the refusal no policy run reaches; every
pooled choice is checked against plain loops by tests/test_policy_contract.py."""

from __future__ import annotations

import pytest
import torch

from keydiff.policies.adakv import FORCED, adakv_drop_segments
from keydiff.policies.base import SegmentView

pytestmark = pytest.mark.unit


def test_the_selection_refuses_to_drop_forced_entries():
    """Every entry forced but fewer than the excess droppable: impossible for AdaKV's own choices, refused."""
    owner = torch.tensor([[0] * 5 + [1] * 5])
    pool = SegmentView(keys=torch.zeros(1, 10, 4), positions=torch.arange(10)[None], state={},
                       member=torch.stack([owner == 0, owner == 1], dim=1), owner=owner, counts=torch.tensor([[5, 5]]))
    with pytest.raises(RuntimeError, match="fewer droppable entries"):
        adakv_drop_segments(torch.full((1, 10), FORCED), pool, budget=2, alpha=0.0)
