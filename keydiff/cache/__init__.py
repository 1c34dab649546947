"""The evicting KV cache (design: docs/design/cache.md).

    cache.py      EvictingCache: the transformers Cache over the planned layers; evicts, tells attention what to record
    plan.py       plan_memory: each layer's budget, capacity and kind, and which layers share a storage (pure)
    layer.py      EvictingLayer: one layer as transformers sees it, a view of its plane in a Storage
    arena.py      Arena: the one owner of dense KV memory, every buffer and count of one or several sequences' stacks
    storage.py    Storage: one sequence's stack of layers, written and evicted in its slot of an arena
    evict.py      the eviction: of dense rows (a storage's, a block group's, the fixed step's) and of AdaKV's segments
    adaptive.py   head-adaptive budgets (AdaKV): per-head segments in one buffer
    sliding.py    sliding-window layers of hybrid models: bounded by their window, never evicted
    placement.py  where each layer's keys will live (device, dtype)
"""

from keydiff.cache.cache import EvictingCache
from keydiff.cache.layer import EvictingLayer
from keydiff.cache.storage import Storage, empty_buffers
from keydiff.config import STATISTICS_MODES

__all__ = ["EvictingCache", "EvictingLayer", "STATISTICS_MODES", "Storage", "empty_buffers"]
