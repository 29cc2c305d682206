"""Per-shape kernel selection for op families, and its persistent, device-keyed cache.

This package is the tuning core, and names no op family. An **op family**
(`OpFamily`) is a kind of operation with several implementations; the
built-in ones (convolution, batch norm, attention: `tunedjax.ops`) and a
plug-in package's are found through the ``tunedjax.op_families`` entry points
the first time the registry is asked about families, and each registers
itself with `register_op_family` and `register_kernel`, as a user's family
would. Sites are found in the jaxpr (a primitive) or call `dispatch`. The selector times a site's applicable kernels
once per shape bucket, checks each against the family's reference on the
tuning inputs, and keeps the winner in the tuning `Cache`: one JSON file per
device fingerprint, shared by every tuner, reused across restarts and,
through ``tunedjax cache export|import``, across a cluster.
A `hint` pins a kernel per family and beats the tuner; a `TuningSession`
holds the observe/tune/apply phases of ``kernel.tuning_range`` (`step` and
`stats` drive and report the default one); `explain` says which kernel each
bucket of a function gets, and the speedup measured.

Example:
  >>> import tempfile
  >>> import jax, jax.numpy as jnp
  >>> from tunedjax import autotune
  >>> cache = autotune.Cache(tempfile.mkdtemp())
  >>> cache.path.name == autotune.device_fingerprint().digest + ".json"
  True
  >>> [k.name for k in autotune.kernels("conv")]  # doctest: +NORMALIZE_WHITESPACE
  ['xla', 'matmul_1x1', 'im2col', 'window_matmul', 'fft', 'depthwise',
   'depthwise_native', 'pallas', 'direct_native', 'matmul_1x1_native']
  >>> conv = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")
  >>> with autotune.hint(conv="im2col"):
  ...   y = autotune.select_kernels(conv, cache=cache)(jnp.ones((1, 2, 5, 5)),
  ...                                                 jnp.ones((3, 2, 3, 3)))
  >>> y.shape
  (1, 3, 5, 5)
"""

from __future__ import annotations

from tunedjax._tuning import Cache as Cache
from tunedjax._tuning import CacheEntry as CacheEntry
from tunedjax._tuning import DeviceFingerprint as DeviceFingerprint
from tunedjax._tuning import Stats as Stats
from tunedjax._tuning import TuningSession as TuningSession
from tunedjax._tuning import default_session as default_session
from tunedjax._tuning import device_fingerprint as device_fingerprint
from tunedjax.autotune._explain import BucketChoice as BucketChoice
from tunedjax.autotune._explain import explain as explain
from tunedjax.autotune._hints import HintWarning as HintWarning
from tunedjax.autotune._hints import hint as hint
from tunedjax.autotune._phases import stats as stats
from tunedjax.autotune._phases import step as step
from tunedjax.autotune._registry import Kernel as Kernel
from tunedjax.autotune._registry import OpFamily as OpFamily
from tunedjax.autotune._registry import kernels as kernels
from tunedjax.autotune._registry import op_families as op_families
from tunedjax.autotune._registry import op_family as op_family
from tunedjax.autotune._registry import register_kernel as register_kernel
from tunedjax.autotune._registry import register_op_family as register_op_family
from tunedjax.autotune._registry import unregister_kernel as unregister_kernel
from tunedjax.autotune._registry import unregister_op_family as unregister_op_family
from tunedjax.autotune._report import BucketDecision as BucketDecision
from tunedjax.autotune._report import BucketTemporaries as BucketTemporaries
from tunedjax.autotune._report import KernelChoice as KernelChoice
from tunedjax.autotune._report import KernelReport as KernelReport
from tunedjax.autotune._report import MatchedSite as MatchedSite
from tunedjax.autotune._select import dispatch as dispatch
from tunedjax.autotune._sites import PatternSite as PatternSite
from tunedjax.autotune._select import select_kernels as select_kernels

__all__ = [
    "BucketChoice",
    "BucketDecision",
    "BucketTemporaries",
    "Cache",
    "CacheEntry",
    "DeviceFingerprint",
    "HintWarning",
    "Kernel",
    "KernelChoice",
    "KernelReport",
    "MatchedSite",
    "OpFamily",
    "PatternSite",
    "Stats",
    "TuningSession",
    "default_session",
    "device_fingerprint",
    "dispatch",
    "explain",
    "hint",
    "kernels",
    "op_families",
    "op_family",
    "register_kernel",
    "register_op_family",
    "select_kernels",
    "stats",
    "step",
    "unregister_kernel",
    "unregister_op_family",
]
