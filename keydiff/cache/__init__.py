"""The evicting KV cache: `Storage` owns the tensors and the entry count (of one layer, or of every layer
stacked), `EvictingLayer` is one layer's view of it as transformers sees a layer, `EvictingCache` the
transformers Cache that plans the storages and evicts. See keydiff.cache.cache for the design."""

from keydiff.cache.cache import EvictingCache
from keydiff.cache.layer import EvictingLayer
from keydiff.cache.storage import Storage, empty_buffers
from keydiff.config import STATISTICS_MODES

__all__ = ["EvictingCache", "EvictingLayer", "STATISTICS_MODES", "Storage", "empty_buffers"]
