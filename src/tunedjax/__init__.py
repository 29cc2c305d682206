"""tunedjax: make JAX/Flax training fast without expert tuning.

One switch (`set_config`) turns on the tuners; each keeps what it learned in a
cache that survives restarts. This namespace holds the public names only.

Example:
  >>> import tunedjax as tj
  >>> with tj.config_context({"layout": {"enable": True}}):
  ...   tj.get_config().layout.enable
  True
"""

import importlib as _importlib
import typing as _typing

from tunedjax import _host_memory

# Before JAX starts XLA's threads: where a recorded measurement says it pays for this
# machine and workload (or TUNEDJAX_HOST_MEMORY=retain), a CPU step reuses the previous
# step's memory instead of faulting it in again (see `_host_memory`; imports no JAX).
_host_memory.configure()

# Names are imported when first used (PEP 562), so that importing one part
# (a data-loader worker process unpickling its pipeline imports
# `tunedjax.input_pipeline`) does not import them all: jax, Flax, optax and
# orbax take seconds. `name: (module, attribute or None for the module)`.
_LAZY = {
    "autotune": ("tunedjax.autotune", None),
    "callbacks": ("tunedjax.callbacks", None),
    "input_pipeline": ("tunedjax.input_pipeline", None),
    "layout": ("tunedjax.layout", None),
    "mixed_precision": ("tunedjax.mixed_precision", None),
    "ops": ("tunedjax.ops", None),
    "rewrite": ("tunedjax.rewrite", None),
    "trainer": ("tunedjax.trainer", None),
    "attention": ("tunedjax.ops.attention", "attention"),
    "AttentionSwap": ("tunedjax.ops.attention", "AttentionSwap"),
    "use_tuned_attention": ("tunedjax.ops.attention", "use_tuned_attention"),
    "Config": ("tunedjax._config", "Config"),
    "config_context": ("tunedjax._config", "config_context"),
    "get_config": ("tunedjax._config", "get_config"),
    "set_config": ("tunedjax._config", "set_config"),
    "AutotuneError": ("tunedjax._errors", "AutotuneError"),
    "CacheWarning": ("tunedjax._errors", "CacheWarning"),
    "ConfigError": ("tunedjax._errors", "ConfigError"),
    "HostMemoryWarning": ("tunedjax._errors", "HostMemoryWarning"),
    "HostMemoryStatus": ("tunedjax._host_memory", "HostMemoryStatus"),
    "host_memory_status": ("tunedjax._host_memory", "host_memory_status"),
    "release_host_memory": ("tunedjax._host_memory", "release_host_memory"),
    "LayoutError": ("tunedjax._errors", "LayoutError"),
    "RewriteError": ("tunedjax._errors", "RewriteError"),
    "ShapeError": ("tunedjax._errors", "ShapeError"),
    "TunedJaxError": ("tunedjax._errors", "TunedJaxError"),
    "FirstCall": ("tunedjax._tuning._anatomy", "FirstCall"),
    "Jitted": ("tunedjax._jit", "Jitted"),
    "JitReport": ("tunedjax._jit", "JitReport"),
    "jit": ("tunedjax._jit", "jit"),
    "__version__": ("tunedjax._version", "__version__"),
    "History": ("tunedjax.trainer", "History"),
    "Trainer": ("tunedjax.trainer", "Trainer"),
}


def __getattr__(name: str):
  try:
    module, attribute = _LAZY[name]
  except KeyError:
    raise AttributeError(f"module 'tunedjax' has no attribute {name!r}") from None
  value = _importlib.import_module(module)
  if attribute is not None:
    value = getattr(value, attribute)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))


# For type checkers and IDEs, which do not run `__getattr__`.
if _typing.TYPE_CHECKING:
  from tunedjax import autotune as autotune
  from tunedjax import callbacks as callbacks
  from tunedjax import input_pipeline as input_pipeline
  from tunedjax import layout as layout
  from tunedjax import mixed_precision as mixed_precision
  from tunedjax import ops as ops
  from tunedjax import rewrite as rewrite
  from tunedjax import trainer as trainer
  from tunedjax.ops.attention import attention as attention
  from tunedjax.ops.attention import AttentionSwap as AttentionSwap
  from tunedjax.ops.attention import use_tuned_attention as use_tuned_attention
  from tunedjax._config import Config as Config
  from tunedjax._config import config_context as config_context
  from tunedjax._config import get_config as get_config
  from tunedjax._config import set_config as set_config
  from tunedjax._errors import AutotuneError as AutotuneError
  from tunedjax._errors import CacheWarning as CacheWarning
  from tunedjax._errors import ConfigError as ConfigError
  from tunedjax._errors import HostMemoryWarning as HostMemoryWarning
  from tunedjax._errors import LayoutError as LayoutError
  from tunedjax._errors import RewriteError as RewriteError
  from tunedjax._errors import ShapeError as ShapeError
  from tunedjax._errors import TunedJaxError as TunedJaxError
  from tunedjax._host_memory import HostMemoryStatus as HostMemoryStatus
  from tunedjax._host_memory import host_memory_status as host_memory_status
  from tunedjax._host_memory import release_host_memory as release_host_memory
  from tunedjax._tuning._anatomy import FirstCall as FirstCall
  from tunedjax._jit import JitReport as JitReport
  from tunedjax._jit import Jitted as Jitted
  from tunedjax._jit import jit as jit
  from tunedjax._version import __version__ as __version__
  from tunedjax.trainer import History as History
  from tunedjax.trainer import Trainer as Trainer


__all__ = [
    "AttentionSwap",
    "AutotuneError",
    "CacheWarning",
    "Config",
    "ConfigError",
    "FirstCall",
    "History",
    "HostMemoryStatus",
    "HostMemoryWarning",
    "JitReport",
    "Jitted",
    "LayoutError",
    "RewriteError",
    "ShapeError",
    "Trainer",
    "TunedJaxError",
    "__version__",
    "attention",
    "autotune",
    "callbacks",
    "config_context",
    "get_config",
    "host_memory_status",
    "input_pipeline",
    "jit",
    "layout",
    "mixed_precision",
    "ops",
    "release_host_memory",
    "rewrite",
    "set_config",
    "trainer",
    "use_tuned_attention",
]
