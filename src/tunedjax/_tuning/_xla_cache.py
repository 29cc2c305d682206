"""XLA's own caches kept with the tuning cache: one compile, then a warm restart.

On a GPU or a TPU, `tunedjax.jit` points JAX's persistent compilation cache
at ``<cache dir>/xla`` by default (at every level but O0; O2 also keeps
executables that compiled fast, `tunedjax._jit.enable_compilation_cache`).
JAX then keeps there, with each executable, XLA's per-fusion GPU autotuning
results (``jax_persistent_cache_enable_xla_caches``, by default
``xla_gpu_per_fusion_autotune_cache_dir``), so a restarted job skips both
tunedjax's tuning (the tuning cache) and XLA's (cuDNN and GEMM algorithm
choice, Triton tiling). JAX's own thresholds apply (an executable that took
under ``jax_persistent_cache_min_compile_time_secs``, 1 s, is not kept). A
directory the user set (``jax_compilation_cache_dir``) is left alone, as is a
read-only tuning cache; on a CPU the compilation cache stays opt-in (level O2):
its compiles are seconds, and the CPU's measured behaviour is kept.

Example:
  >>> import jax, tunedjax as tj
  >>> before = jax.config.jax_compilation_cache_dir
  >>> _ = persist_xla(tj.get_config(), backend="cpu")  # CPU: level O2 only
  >>> jax.config.jax_compilation_cache_dir == before
  True
"""

from __future__ import annotations

import logging

import jax

from tunedjax._tuning._cache import usable_folder
from tunedjax._tuning._platform import canonical_platform

logger = logging.getLogger("tunedjax")

SUBDIR = "xla"  # the same folder level O2 uses (`tunedjax._jit.XLA_CACHE_SUBDIR`)
BY_DEFAULT = ("gpu", "tpu")


def persist_xla(config: object, backend: str | None = None) -> str | None:
  """Points JAX's persistent compilation cache at the tuning cache's ``xla`` folder
  where `backend` (default: JAX's) is a GPU or TPU.

  Args:
    config: the active `tunedjax.Config` (its ``cache`` section).
    backend: the backend that compiles; None for `jax.default_backend()`.

  Returns:
    The compilation cache directory in use, or None where none is.
  """
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  if canonical_platform(backend or jax.default_backend()) not in BY_DEFAULT:
    return None
  cache = config.cache  # type: ignore[attr-defined]
  if cache.readonly:
    return None
  directory = usable_folder(cache.resolved_dir / SUBDIR, what="compilation cache",
                            consequence="executables are compiled for this process only")
  if directory is None:
    return None
  jax.config.update("jax_compilation_cache_dir", str(directory))
  logger.info("JAX's persistent compilation cache (with XLA's autotuning results) is %s",
              directory)
  return str(directory)
