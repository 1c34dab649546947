"""Where each layer's keys will live, read from the model before any pass: (device, dtype) per attention layer, so an
`EvictingCache` stacks only layers of one placement. Design: docs/design/cache.md#storages-and-the-stack"""

from __future__ import annotations

from typing import Any

import torch


def layer_placements(model: torch.nn.Module, num_layers: int) -> list[tuple[Any, Any]] | None:
    """(device, dtype) of each attention layer's parameters, by `layer_idx`; None if not all can be found."""
    found: dict[int, tuple[Any, Any]] = {}
    fallback: dict[int, tuple[Any, Any]] = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int):
            continue
        weight = getattr(getattr(module, "k_proj", None), "weight", None)
        if weight is not None:
            found[index] = (weight.device, weight.dtype)
        elif (first := next(module.parameters(), None)) is not None:
            fallback.setdefault(index, (first.device, first.dtype))
    found = {**fallback, **found}
    if sorted(found) != list(range(num_layers)):
        return None
    return [found[i] for i in range(num_layers)]
