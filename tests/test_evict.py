"""keydiff.cache.evict, the eviction of dense rows (a storage's, a block group's, the fixed-shape step's) and of
head-adaptive pools.

What is checked: nothing else in keydiff/ asks a policy what to drop (`evict_indices`, `keep_heads`,
`drop_pool`), outside the policies themselves and the tools that wrap them; with `active` given, idle rows keep
their entries and their state (H2O observes on a copy, written back to active rows only) while active rows evict
exactly as they do without a mask. Whole runs through each caller are compared in test_fixed_shapes.py and
test_batching.py; the head-adaptive eviction in test_adakv.py and test_adakv_pools.py.
"""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from keydiff.cache.evict import Rows, evict
from keydiff.policies.h2o import H2O

pytestmark = pytest.mark.unit

KEYDIFF = Path(__file__).resolve().parents[1] / "keydiff"
# A policy composing its own choice, check_policy's spies, the recording policy and the scoring benchmark.
WRAPPERS = ("policies", "testing.py", "capture.py", "bench")


def choice_calls(names: tuple[str, ...]) -> list[str]:
    calls = []
    for path in sorted(KEYDIFF.rglob("*.py")):
        relative = path.relative_to(KEYDIFF)
        if relative.parts[0] in WRAPPERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
                calls.append(f"{relative.as_posix()}:{node.lineno} {node.func.attr}")
    return calls


def test_the_eviction_asks_a_policy_what_to_drop_in_two_places_only():
    """`evict` for dense rows, `drop_segments` for head-adaptive pools (head by head: the policy's own `drop_pool`)."""
    calls = choice_calls(("evict_indices", "keep_heads", "drop_pool"))
    assert [call.split(":")[0] for call in calls] == ["cache/evict.py"] * 2, calls
    assert sorted(call.split()[-1] for call in calls) == ["drop_pool", "evict_indices"], calls


def block(slots: int, layers: int, heads: int, capacity: int, dim: int) -> SimpleNamespace:
    """A shared arena's buffers [slots, layers, 1, kv_heads, capacity(, dim)] with random entries and H2O state."""
    generator = torch.Generator().manual_seed(0)
    shape = (slots, layers, 1, heads, capacity)
    return SimpleNamespace(keys=torch.randn(*shape, dim, generator=generator),
                           values=torch.randn(*shape, dim, generator=generator),
                           positions=torch.randperm(slots * layers * heads * capacity, generator=generator).view(shape),
                           state={"h2o": torch.rand(shape, generator=generator)})


def buffers(of: SimpleNamespace) -> list[torch.Tensor]:
    return [of.keys, of.values, of.positions, of.state["h2o"]]


@pytest.mark.parametrize("q, active_slots", [(1, [True, False, True]), (3, [True, True, True])],
                         ids=["decoding", "block"])
def test_idle_rows_keep_entries_and_state_active_rows_evict_as_unmasked(q, active_slots):
    """A decoding step masks idle rows; a block step (q > 1) runs one sequence, every row active."""
    slots, layers, heads, budget = 3, 2, 2, 5
    original = block(slots, layers, heads, budget + q, 4)
    masked, plain = (SimpleNamespace(keys=original.keys.clone(), values=original.values.clone(),
                                     positions=original.positions.clone(),
                                     state={"h2o": original.state["h2o"].clone()}) for _ in range(2))
    attention = torch.rand(slots * layers, heads, budget + q, generator=torch.Generator().manual_seed(1))
    active_slots = torch.tensor(active_slots)
    active = active_slots.repeat_interleave(layers)  # slot-major rows
    for target, mask in ((masked, active), (plain, None)):
        evict(Rows.of(vars(target), tuple(range(layers)), 0, slots), budget + q, budget, H2O(), {"attention": attention},
              fresh=budget, active=mask)
    for name, out, alone, before in zip(("keys", "values", "positions", "state"), buffers(masked), buffers(plain),
                                        buffers(original)):
        assert torch.equal(out[~active_slots], before[~active_slots]), f"an idle slot's {name} changed"
        assert torch.equal(out[active_slots], alone[active_slots]), f"an active slot's {name} differs"
        assert not torch.equal(alone, before), f"the eviction left every {name} as it was"
