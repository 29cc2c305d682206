"""The op families tunedjax ships, one package each: `conv`, `batch_norm`, `layer_norm`, `attention`.

A family package holds everything of one kind of operation: its spec and
bucket key, its kernels (with their C++ sources in ``csrc/``), its Flax
adapter and its public function. Importing it registers the family with
`tunedjax.autotune` through the public extension API (`register_op_family`,
`register_kernel`), as a user's own family would; the tuning core finds the
packages through the ``tunedjax.op_families`` entry points that
``tunedjax/entry_points.txt`` declares (installed or not), so nothing needs
to import them by hand. Subpackages are imported when first used.

Example:
  >>> from tunedjax import ops
  >>> ops.conv.ConvSpec.__name__
  'ConvSpec'
"""

import importlib as _importlib

_FAMILIES = ("attention", "batch_norm", "conv", "layer_norm")


def __getattr__(name: str):
  if name in _FAMILIES:
    return _importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}; its families: "
                       f"{', '.join(_FAMILIES)}")


def __dir__():
  return sorted([*globals(), *_FAMILIES])


__all__ = ["attention", "batch_norm", "conv", "layer_norm"]
