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

# Names are imported when first used (PEP 562), so that importing one part
# (a data-loader worker process unpickling its pipeline imports
# `tunedjax.input_pipeline`) does not import them all: jax, Flax, optax and
# orbax take seconds. `name: (module, attribute or None for the module)`.
_LAZY = {
    "autotune": ("tunedjax.autotune", None),
    "input_pipeline": ("tunedjax.input_pipeline", None),
    "layout": ("tunedjax.layout", None),
    "mixed_precision": ("tunedjax.mixed_precision", None),
    "rewrite": ("tunedjax.rewrite", None),
    "trainer": ("tunedjax.trainer", None),
    "Config": ("tunedjax._config", "Config"),
    "config_context": ("tunedjax._config", "config_context"),
    "get_config": ("tunedjax._config", "get_config"),
    "set_config": ("tunedjax._config", "set_config"),
    "AutotuneError": ("tunedjax._errors", "AutotuneError"),
    "CacheWarning": ("tunedjax._errors", "CacheWarning"),
    "ConfigError": ("tunedjax._errors", "ConfigError"),
    "LayoutError": ("tunedjax._errors", "LayoutError"),
    "RewriteError": ("tunedjax._errors", "RewriteError"),
    "TunedJaxError": ("tunedjax._errors", "TunedJaxError"),
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


__all__ = [
    "AutotuneError",
    "CacheWarning",
    "Config",
    "ConfigError",
    "History",
    "JitReport",
    "Jitted",
    "LayoutError",
    "RewriteError",
    "Trainer",
    "TunedJaxError",
    "__version__",
    "autotune",
    "config_context",
    "get_config",
    "input_pipeline",
    "jit",
    "layout",
    "mixed_precision",
    "rewrite",
    "set_config",
    "trainer",
]
