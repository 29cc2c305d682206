"""Per-shape kernel selection and its persistent, device-keyed cache.

The device fingerprint keys the persistent tuning `Cache`, one JSON file per
device that every tuner (kernels, layout, input pipeline) shares.

Example:
  >>> import tempfile
  >>> from tunedjax import autotune
  >>> cache = autotune.Cache(tempfile.mkdtemp())
  >>> cache.path.name == autotune.device_fingerprint().digest + ".json"
  True
"""

from __future__ import annotations

from tunedjax.autotune._cache import Cache as Cache
from tunedjax.autotune._cache import CacheEntry as CacheEntry
from tunedjax.autotune._fingerprint import DeviceFingerprint as DeviceFingerprint
from tunedjax.autotune._fingerprint import device_fingerprint as device_fingerprint

__all__ = [
    "Cache",
    "CacheEntry",
    "DeviceFingerprint",
    "device_fingerprint",
]
