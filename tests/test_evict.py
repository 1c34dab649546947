"""keydiff.cache.evict, the one place that asks a policy what to drop (dense rows and head-adaptive pools): with
`active` given, idle rows keep their entries and state while active rows evict as they do unmasked."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from keydiff.cache.evict import Rows, evict
from keydiff.policies.h2o import H2O

pytestmark = pytest.mark.unit

KEYDIFF = Path(__file__).resolve().parents[1] / "keydiff"
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
    """`evict` for dense rows, `drop_segments` for head-adaptive pools (outside policies and tools that wrap them)."""
    calls = choice_calls(("evict_indices", "keep_heads", "drop_segments"))
    assert [call.split(":")[0] for call in calls] == ["cache/evict.py"] * 2, calls
    assert sorted(call.split()[-1] for call in calls) == ["drop_segments", "evict_indices"], calls


def block(slots: int, layers: int, heads: int, capacity: int, dim: int) -> SimpleNamespace:
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
