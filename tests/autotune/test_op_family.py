"""A new op family through the public extension API only: tuned, cached by device, hinted, reported.

The toy family is a running sum along the last axis, with a call-site
function (`autotune.dispatch`) instead of a jaxpr primitive. Its kernels:
``xla`` (`jnp.cumsum`, the reference), ``triangular`` (a matmul with an
upper-triangular matrix of ones) and ``wrong`` (off by a factor, which the
tuner must reject).
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj
from tunedjax import autotune

OP = "toy_cumsum"


@dataclasses.dataclass(frozen=True)
class CumsumSpec:
  shape: tuple[int, ...]
  dtype: str


def _key(spec: CumsumSpec, bucket: str) -> dict:
  return {"shape": list(spec.shape), "dtype": spec.dtype, "bucketing": bucket}


def _operands(spec: CumsumSpec, rng: np.random.Generator):
  return (rng.standard_normal(spec.shape).astype(spec.dtype),)


def _xla(x, spec):
  del spec
  return jnp.cumsum(x, axis=-1)


def _triangular(x, spec):
  n = spec.shape[-1]
  return x @ jnp.triu(jnp.ones((n, n), x.dtype))


def _wrong(x, spec):
  return 2.0 * _xla(x, spec)


def cumsum(x):
  """The family's call-site function: what a library function like tj.attention does."""
  return autotune.dispatch(OP, CumsumSpec(tuple(x.shape), jnp.dtype(x.dtype).name), x)


@pytest.fixture
def toy_family():
  family = autotune.OpFamily(name=OP, spec_type=CumsumSpec, key=_key, operands=_operands,
                             describe=lambda k: f"{OP} {'x'.join(map(str, k['shape']))}")
  autotune.register_op_family(family)
  autotune.register_kernel(OP, "xla", _xla, applicable=lambda s, p: True)
  autotune.register_kernel(OP, "triangular", _triangular,
                           applicable=lambda s, p: s.shape[-1] <= 512)
  autotune.register_kernel(OP, "wrong", _wrong, applicable=lambda s, p: True)
  try:
    yield family
  finally:
    autotune.unregister_op_family(OP)


def _config(tmp_path, **kernel):
  return {"kernel": {"enable": True, **kernel}, "cache": {"dir": str(tmp_path)}}


def _x(rng, shape=(64, 256)):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def test_outside_kernel_selection_the_reference_runs(toy_family, rng):
  x = _x(rng)
  np.testing.assert_array_equal(cumsum(x), jnp.cumsum(x, axis=-1))
  assert OP in [f.name for f in autotune.op_families()]


def test_tuned_checked_cached_by_device_and_reported(toy_family, rng, tmp_path):
  x = _x(rng)
  loss = lambda x: jnp.sum(jnp.tanh(cumsum(x)))
  with tj.config_context(_config(tmp_path)):
    f = tj.jit(jax.value_and_grad(loss), session=autotune.TuningSession())
    value, grad = f(x)
    report = f.report(memory=False).last.kernel_report
  (choice,) = report.of(OP)
  assert choice.why == "tuned" and choice.kernel in ("xla", "triangular")
  assert report.misses == 1 and report.tuning_s > 0
  want_value, want_grad = jax.value_and_grad(lambda x: jnp.sum(jnp.tanh(jnp.cumsum(x, -1))))(x)
  np.testing.assert_allclose(value, want_value, rtol=1e-4)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-5)
  # Stored under the family's namespace, in this device's file, with every timing.
  (path,) = tmp_path.glob("*.json")
  assert path.name == autotune.device_fingerprint().digest + ".json"
  (entry,) = [e for e in json.loads(path.read_text())["entries"] if e["namespace"] == OP]
  assert entry["key"]["op"] == OP and entry["key"]["shape"] == [64, 256]
  assert "wrong" in entry["value"]["rejected"]  # checked against the reference first
  assert entry["value"]["winner"] == choice.kernel
  # A new session (a restart) reads it back: a hit, nothing tuned.
  with tj.config_context(_config(tmp_path)):
    g = tj.jit(jax.value_and_grad(loss), session=autotune.TuningSession())
    g(x)
    again = g.report(memory=False).last.kernel_report
  assert [(c.kernel, c.why) for c in again.of(OP)] == [(choice.kernel, "hit")]
  assert again.tuning_s == 0.0
  # explain reads the same bucket, with its op.
  (row,) = autotune.explain(loss, x, cache=tmp_path)
  assert row.op == OP and row.kernel == choice.kernel and row.bucket == f"{OP} 64x256"


def test_a_hint_pins_the_kernel_and_a_bad_hint_lists_the_family(toy_family, rng, tmp_path):
  x = _x(rng, (4, 32))
  with tj.config_context(_config(tmp_path, hints={OP: "triangular"})):
    f = tj.jit(cumsum, session=autotune.TuningSession())
    np.testing.assert_allclose(f(x), jnp.cumsum(x, -1), rtol=1e-5, atol=1e-5)
    report = f.report(memory=False).last.kernel_report
  assert [(c.kernel, c.why) for c in report.of(OP)] == [("triangular", "hint")]
  with pytest.raises(tj.TunedJaxError, match=r"unknown toy_cumsum kernel 'triangle'"):
    with autotune.hint(toy_cumsum="triangle"):
      pass
  # A hint the bucket cannot take warns once and falls back to the selection.
  wide = _x(rng, (2, 600))
  with tj.config_context(_config(tmp_path, hints={OP: "triangular"})), \
      warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    f = tj.jit(cumsum, session=autotune.TuningSession())
    np.testing.assert_allclose(f(wide), jnp.cumsum(wide, -1), rtol=1e-4, atol=1e-4)
  assert any(issubclass(w.category, autotune.HintWarning) for w in seen)


def test_the_observe_phase_runs_the_reference(toy_family, rng, tmp_path):
  x = _x(rng, (4, 32))
  session = autotune.TuningSession()
  with tj.config_context(_config(tmp_path, tuning_range=[1, 2])):
    session.step()
    f = tj.jit(cumsum, session=session)
    f(x)
    assert [(c.kernel, c.why) for c in f.report(memory=False).last.kernel_report.of(OP)] == [
        ("xla", "observe")]


def test_a_kernel_for_an_unknown_family_is_refused():
  with pytest.raises(tj.TunedJaxError, match=r"Unknown op family 'no_such'.*'conv'"):
    autotune.register_kernel("no_such", "k", _xla, applicable=lambda s, p: True)
  with pytest.raises(tj.TunedJaxError, match="spec must be a ConvSpec"):
    autotune.dispatch("conv", CumsumSpec((2,), "float32"), jnp.ones(2))


@jax.custom_vjp
def _cumsum_bad_grad(x):
  return jnp.cumsum(x, axis=-1)


_cumsum_bad_grad.defvjp(lambda x: (jnp.cumsum(x, axis=-1), None),
                        lambda _, g: (2.0 * jnp.flip(jnp.cumsum(jnp.flip(g, -1), -1), -1),))


@pytest.mark.parametrize("timed", ["forward", "forward+backward"])
def test_a_family_timed_with_its_backward_checks_the_gradients(rng, tmp_path, timed):
  name = "toy_cumsum_fb"
  family = autotune.OpFamily(name=name, spec_type=CumsumSpec, key=_key, operands=_operands,
                             timed=timed)
  autotune.register_op_family(family)
  try:
    autotune.register_kernel(name, "xla", _xla, applicable=lambda s, p: True)
    autotune.register_kernel(name, "bad_grad", lambda x, s: _cumsum_bad_grad(x),
                             applicable=lambda s, p: True)
    x = _x(rng, (8, 64))
    with tj.config_context(_config(tmp_path)):
      f = tj.jit(lambda x: autotune.dispatch(name, CumsumSpec(tuple(x.shape), "float32"), x),
                 session=autotune.TuningSession())
      f(x)
    (path,) = tmp_path.glob("*.json")
    (entry,) = [e for e in json.loads(path.read_text())["entries"] if e["namespace"] == name]
    # Its forward is right, so only a check of the gradient can tell it is wrong.
    assert ("bad_grad" in entry["value"]["rejected"]) == (timed == "forward+backward")
    if timed == "forward+backward":
      assert entry["value"]["rejected"]["bad_grad"] == pytest.approx(1.0, rel=1e-3)
  finally:
    autotune.unregister_op_family(name)


def test_timed_must_be_a_known_choice():
  with pytest.raises(tj.AutotuneError, match=r"timed must be one of 'forward' or "
                                             r"'forward\+backward'.*'backward'"):
    autotune.OpFamily(name="x", spec_type=CumsumSpec, key=_key, operands=_operands,
                      timed="backward")

