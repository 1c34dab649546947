"""Key re-rotation (as kvpress's `KeyRerotationPress`): after every eviction the kept keys are re-rotated to contiguous
positions. `Rerotated(policy, mode)` only asks the cache, which owns the tensors (`needs.key_rerotation`).
Design: docs/design/policies.md#key-re-rotation-rerotationpy"""

from __future__ import annotations

from dataclasses import dataclass, replace

from keydiff.policies.base import Needs
from keydiff.policies.wrappers import PolicyWrapper

STATE = "rotary_position"  # the position each cached key is currently rotated for
MODES = ("contiguous", "absolute")
RENAMED = ("key_rerotation 'kvpress' was withdrawn: kvpress's pipeline continues after the kept keys, which is "
           "'contiguous' (= true); the layout it used to name is 'absolute'")


def rerotation_mode(value) -> str | None:
    """The flat parameter `key_rerotation` as a mode: False/None: off; True or "contiguous": the next tokens
    follow the kept keys (kvpress's pipeline); "absolute": they keep their absolute positions."""
    if value is None or value is False:
        return None
    if value is True:
        return "contiguous"
    if value == "kvpress":
        raise ValueError(RENAMED)
    if value in MODES:
        return value
    raise ValueError(f"key_rerotation must be true, false or one of {', '.join(MODES)}, got {value!r}")


@dataclass
class Rerotated(PolicyWrapper):
    """The wrapped policy, with the kept keys re-rotated to contiguous positions after every eviction (see the module)."""

    mode: str = "contiguous"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_parameters()

    def check_parameters(self, budget: int | None = None) -> None:
        if self.mode == "kvpress":
            raise ValueError(RENAMED)
        if self.mode not in MODES:
            raise ValueError(f"key_rerotation must be true, false or one of {', '.join(MODES)}, got {self.mode!r}")

    @property
    def needs(self) -> Needs:
        """The re-rotation mode, and the position each kept key is rotated for (state STATE)."""
        inner = super().needs
        return replace(inner, key_rerotation=self.mode, state=(*inner.state, STATE))

    def describe(self) -> dict:
        described = self.scorer.describe()
        schedule = described.pop("layer_budgets", None)
        return {**described, "key_rerotation": self.mode, "layer_budgets": schedule}


__all__ = ["MODES", "Rerotated", "STATE", "rerotation_mode"]
