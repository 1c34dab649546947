"""Where each layer's keys will live, read from the model before any pass: (device, dtype) per attention layer.

A model placed across several GPUs (`device_map="auto"`, accelerate's big-model placement) or with layers of other
dtypes gives its layers' keys on their own devices and in their own dtypes; an `EvictingCache` told so
(`layer_placements`) stacks only the layers of one placement, so that no stack allocates a plane for a layer that
could not use it. A layer's keys come from its attention module's key projection (or its first parameter).
"""

from __future__ import annotations

from typing import Any

import torch


def layer_placements(model: torch.nn.Module, num_layers: int) -> list[tuple[Any, Any]] | None:
    """(device, dtype) of each attention layer's parameters, by `layer_idx`; None if the model's attention modules
    cannot all be found (the cache then plans one placement and splits a stack a layer does not fit)."""
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
