"""The public names of tunedjax.mixed_precision (DESIGN.md's API contract)."""

from __future__ import annotations

import types

from tunedjax import mixed_precision as mp

DESIGN_NAMES = {"Policy", "get_policy", "autocast", "wrap", "DynamicLossScale",
                "StaticLossScale", "NoOpLossScale", "scaled_value_and_grad", "all_finite",
                "skip_nonfinite", "select_tree"}


def test_design_names_are_exported_and_nothing_else_leaks():
  assert DESIGN_NAMES <= set(mp.__all__)
  for name in mp.__all__:
    assert getattr(mp, name) is not None
    assert not name.startswith("_")
  exported = {n for n, v in vars(mp).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
  assert exported <= set(mp.__all__), exported - set(mp.__all__)


def test_errors_are_tunedjax_errors():
  import tunedjax as tj
  assert issubclass(mp.PolicyError, tj.TunedJaxError) and issubclass(mp.PolicyError, ValueError)
