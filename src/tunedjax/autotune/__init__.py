"""Per-shape kernel selection and its persistent, device-keyed cache.

Today this holds the device fingerprint that keys the caches; the kernel
registry, the selector and the persistent cache arrive with the
kernel-selection work.

Example:
  >>> from tunedjax import autotune
  >>> len(autotune.device_fingerprint().digest)
  16
"""

from __future__ import annotations

from tunedjax.autotune._fingerprint import DeviceFingerprint as DeviceFingerprint
from tunedjax.autotune._fingerprint import device_fingerprint as device_fingerprint

__all__ = [
    "DeviceFingerprint",
    "device_fingerprint",
]
