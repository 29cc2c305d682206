"""No module-level mutable tuning state outside the default session.

Every module of tunedjax is imported and its module-level mutable containers
(dicts, sets, lists, ...) listed; then every tuner runs (kernel selection
with a tuned bucket and a hint that warns, the layout pass in measure mode,
two Trainers), and no listed container may have changed, except the
registries below, which hold code (what can be tuned) or file handles, not
what was measured or where a run stands. Constant tables stay constant.
"""

from __future__ import annotations

import collections
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import tunedjax as tj
from tunedjax import _tuning

# (module, name): why it may be module-level.
ALLOWED = {
    ("tunedjax.autotune._registry", "_FAMILIES"): "the op-family registry (code, not results)",
    ("tunedjax.autotune._registry", "_REGISTRY"): "the kernel registry (code, not results)",
    ("tunedjax._tuning._cache", "_VALIDATORS"): "each namespace's value check (code)",
    ("tunedjax._tuning._cache", "_DEFAULTS"): "one Cache handle per folder: the file, shared",
    ("tunedjax._tuning._cache", "_WARNED"): "unusable folders already reported (a log line, "
                                            "once per process, not a measurement)",
    ("tunedjax._tuning._session", "_DEFAULT"): "the default session itself",
    ("tunedjax.autotune._registry", "_PLUGINS"): "which op-family packages were loaded (code)",
    ("tunedjax._native", "_SOURCES"): "where each family's C++ sources are (code)",
    ("tunedjax._native", "_REGISTERED"): "the native kernels registered (code)",
    ("tunedjax._native", "_LIBRARIES"): "the compiled libraries loaded (code, by source digest)",
    ("tunedjax._native", "_PREBUILD_TRIED"): "the sources a build was started for, once per "
                                             "process (code, not a measurement)",
    ("tunedjax.autotune._routes", "_ROUTES"): "the families' routes, registered as they "
                                              "load (code)",
    ("tunedjax.autotune._tuner", "_WARM"): "the families that made a timed call in this "
                                           "process: whether its one-time costs are paid (a "
                                           "fact about the process, which a new session shares)",
}
_MUTABLE = (dict, set, list, bytearray, collections.deque, _tuning.TuningSession)


def _modules():
  for info in pkgutil.walk_packages(tj.__path__, "tunedjax."):
    yield importlib.import_module(info.name)


def _snapshot() -> dict[str, str]:
  out = {}
  for module in _modules():
    for name, value in vars(module).items():
      if name.startswith("__") or isinstance(value, type) or not isinstance(value, _MUTABLE):
        continue
      if (module.__name__, name) not in ALLOWED:
        out[f"{module.__name__}.{name}"] = repr(value)
  return out


def test_no_module_holds_mutable_tuning_state(tmp_path, rng):
  before = _snapshot()
  assert before, "found no module-level containers at all: the listing is broken"
  conv = lambda x, w: jax.nn.relu(jax.lax.conv_general_dilated(
      x, w, (1, 1), "SAME", feature_group_count=x.shape[1])).sum()
  x = jnp.asarray(rng.normal(size=(2, 8, 9, 9)).astype("float32"))
  w = jnp.asarray(rng.normal(size=(8, 1, 3, 3)).astype("float32"))
  with tj.config_context({"kernel": {"enable": True, "hints": {"conv": "matmul_1x1"}},
                          "layout": {"enable": True, "mode": "measure"},
                          "cache": {"dir": str(tmp_path)}}):
    with pytest.warns(tj.autotune.HintWarning):  # the hint cannot apply: a warning, then tuning
      tj.jit(jax.grad(conv))(x, w)
  _two_trainers(tmp_path, rng)
  after = _snapshot()
  changed = sorted(k for k in before if before[k] != after.get(k))
  assert not changed, f"module-level state changed by tuning: {changed}"


class _Net(nnx.Module):

  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)

  def __call__(self, x):
    return self.conv(x).mean((1, 2, 3))


def _trainer(tmp_path):
  return tj.Trainer(_Net(nnx.Rngs(0)), optax.sgd(0.1), lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                    autotune={"kernel": {"enable": True, "tuning_range": [1, 3]},
                              "cache": {"dir": str(tmp_path)}},
                    progress=False)


def _two_trainers(tmp_path, rng):
  data = {"x": rng.normal(size=(16, 8, 8, 3)).astype("float32"),
          "y": rng.normal(size=(16,)).astype("float32")}
  a, b = _trainer(tmp_path / "a"), _trainer(tmp_path / "b")
  a.fit(data, steps=5, batch_size=8)
  assert a.session.phase(a.config) == "apply" and b.session.current_step() is None
  b.fit(data, steps=2, batch_size=8)
  assert b.session.phase(b.config) == "tune" and a.session.phase(a.config) == "apply"
  assert a.session is not b.session and a.session.stats().per_step != b.session.stats().per_step


def test_two_trainers_keep_separate_phases_and_tj_jit_still_tunes_after_them(tmp_path, rng):
  _two_trainers(tmp_path, rng)
  # An unrelated tj.jit afterwards is not stuck in a Trainer's apply phase: it tunes.
  _tuning.default_session().reset()  # whatever earlier tests of this process did
  conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                  feature_group_count=x.shape[1])
  with tj.config_context({"kernel": {"enable": True, "tuning_range": [1, 3]},
                          "cache": {"dir": str(tmp_path / "c")}}):
    f = tj.jit(conv)
    f(jnp.ones((2, 8, 9, 9)), jnp.ones((8, 1, 3, 3)))
    report = f.report(memory=False).last.kernel_report
  assert [c.why for c in report.choices] == ["tuned"]
