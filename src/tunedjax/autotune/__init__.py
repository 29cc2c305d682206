"""Per-shape kernel selection and its persistent, device-keyed cache.

Each convolution can run on one of several registered kernels (``xla``,
``matmul_1x1``, ``im2col``, ``window_matmul``, ``fft``, ``depthwise``, ``pallas``, or one you
register). The selection pass times the applicable kernels once per shape
bucket, checks each against the reference on the tuning inputs, and keeps the
winner in the tuning `Cache`: one JSON file per device fingerprint, shared by
every tuner, reused across restarts and, through ``tunedjax cache
export|import``, across a cluster.
A `hint` pins a kernel and beats the tuner; `step` and `stats` drive and report
the observe/tune/apply phases of ``kernel.tuning_range``; `explain` says which
kernel each convolution bucket of a function gets, and the speedup measured.

Example:
  >>> import tempfile
  >>> import jax, jax.numpy as jnp
  >>> from tunedjax import autotune
  >>> cache = autotune.Cache(tempfile.mkdtemp())
  >>> cache.path.name == autotune.device_fingerprint().digest + ".json"
  True
  >>> [k.name for k in autotune.kernels("conv")]
  ['xla', 'matmul_1x1', 'im2col', 'window_matmul', 'fft', 'depthwise', 'pallas']
  >>> conv = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")
  >>> with autotune.hint(conv="im2col"):
  ...   y = autotune.select_kernels(conv, cache=cache)(jnp.ones((1, 2, 5, 5)),
  ...                                                 jnp.ones((3, 2, 3, 3)))
  >>> y.shape
  (1, 3, 5, 5)
"""

from __future__ import annotations

from tunedjax.autotune._cache import Cache as Cache
from tunedjax.autotune._cache import CacheEntry as CacheEntry
from tunedjax.autotune._explain import BucketChoice as BucketChoice
from tunedjax.autotune._explain import explain as explain
from tunedjax.autotune._fingerprint import DeviceFingerprint as DeviceFingerprint
from tunedjax.autotune._fingerprint import device_fingerprint as device_fingerprint
from tunedjax.autotune._hints import HintWarning as HintWarning
from tunedjax.autotune._hints import active_hints as active_hints
from tunedjax.autotune._hints import hint as hint
from tunedjax.autotune._phases import Stats as Stats
from tunedjax.autotune._phases import StepStats as StepStats
from tunedjax.autotune._phases import current_phase as current_phase
from tunedjax.autotune._phases import phase_key as phase_key
from tunedjax.autotune._phases import reset as reset_stats
from tunedjax.autotune._phases import stats as stats
from tunedjax.autotune._phases import step as step
from tunedjax.autotune._registry import ConvSpec as ConvSpec
from tunedjax.autotune._registry import Kernel as Kernel
from tunedjax.autotune._registry import get_kernel as get_kernel
from tunedjax.autotune._registry import kernels as kernels
from tunedjax.autotune._registry import register_kernel as register_kernel
from tunedjax.autotune._registry import unregister_kernel as unregister_kernel
from tunedjax.autotune._select import kernel_pass as kernel_pass
from tunedjax.autotune._select import select_kernels as select_kernels
from tunedjax.autotune._tuner import TuneOptions as TuneOptions
from tunedjax.autotune._tuner import TuneResult as TuneResult

__all__ = [
    "BucketChoice",
    "Cache",
    "CacheEntry",
    "ConvSpec",
    "DeviceFingerprint",
    "HintWarning",
    "Kernel",
    "Stats",
    "StepStats",
    "TuneOptions",
    "TuneResult",
    "active_hints",
    "current_phase",
    "device_fingerprint",
    "explain",
    "get_kernel",
    "hint",
    "kernel_pass",
    "kernels",
    "phase_key",
    "register_kernel",
    "reset_stats",
    "select_kernels",
    "stats",
    "step",
    "unregister_kernel",
]
