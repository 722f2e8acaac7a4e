"""transformers integration: :class:`OscarCache` (the only place that subclasses cache classes)."""

from .absorb import absorb_value_rotation
from .cache import OscarCache, OscarCacheLayer

__all__ = ["OscarCache", "OscarCacheLayer", "absorb_value_rotation"]
