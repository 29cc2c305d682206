"""The accuracy rule every family shares: no candidate less accurate than the default.

A toy family (a column sum, through the public extension API) with a loose
tolerance, so that only the rule can reject: its ``bf16_sums`` kernel adds in
bfloat16 and must be rejected with a reason naming its error ratio; its
``blocked`` kernel adds in float32 in another order and must pass.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj
from tunedjax import autotune
from tunedjax.autotune import _accuracy, _result, _tuner

OP = "toy_colsum"


@dataclasses.dataclass(frozen=True)
class ColsumSpec:
  shape: tuple[int, ...]
  dtype: str


def _operands(spec, rng):
  # A large common offset: the sums are long and ill-conditioned for a narrow type.
  return ((rng.standard_normal(spec.shape) + 3.0).astype(spec.dtype),)


def _xla(x, spec):
  del spec
  return jnp.sum(x, axis=0)


def _blocked(x, spec):
  del spec
  return jnp.sum(jnp.sum(x.reshape(-1, 16, x.shape[-1]), axis=1), axis=0)


def _bf16_sums(x, spec):
  del spec
  return jnp.sum(x.astype(jnp.bfloat16), axis=0, dtype=jnp.bfloat16).astype(x.dtype)


def colsum(x):
  return autotune.dispatch(OP, ColsumSpec(tuple(x.shape), jnp.dtype(x.dtype).name), x)


@pytest.fixture
def toy_family():
  family = autotune.OpFamily(
      name=OP, spec_type=ColsumSpec, operands=_operands,
      key=lambda spec, bucket: {"shape": list(spec.shape), "dtype": spec.dtype},
      tolerance=lambda dtype, platform: 0.5, timed="forward+backward")  # loose on purpose
  autotune.register_op_family(family)
  autotune.register_kernel(OP, "xla", _xla, applicable=lambda s, p: True)
  autotune.register_kernel(OP, "blocked", _blocked, applicable=lambda s, p: True)
  autotune.register_kernel(OP, "bf16_sums", _bf16_sums, applicable=lambda s, p: True)
  try:
    yield family
  finally:
    autotune.unregister_op_family(OP)


def test_an_inaccurate_kernel_is_rejected_naming_its_error_ratio(toy_family, caplog):
  spec = ColsumSpec((4096, 8), "float32")
  with caplog.at_level(logging.WARNING, logger="tunedjax.autotune"):
    result = _tuner.tune_bucket(spec, autotune.kernels(OP), options=_tuner.TuneOptions(rounds=1),
                                label="toy")
  assert "bf16_sums" in result.rejected and result.winner != "bf16_sums"
  assert result.error_ratios["bf16_sums"] > 10 * _accuracy.ERROR_RATIO_LIMIT
  assert result.error_ratios["blocked"] <= _accuracy.ERROR_RATIO_LIMIT
  assert "blocked" not in result.rejected
  (line,) = [r.getMessage() for r in caplog.records if "bf16_sums" in r.getMessage()]
  assert "less accurate than xla (error ratio" in line and "float64 reference" in line
  # Kept in the cache value and read back.
  assert _result.TuneResult.from_value(result.to_value()).error_ratios == result.error_ratios


def test_when_none_passes_the_reason_names_the_error_ratios(toy_family):
  spec = ColsumSpec((4096, 8), "float32")
  bad_only = [k for k in autotune.kernels(OP) if k.name != "blocked"]
  result = _tuner.tune_bucket(spec, bad_only, options=_tuner.TuneOptions(rounds=1))
  assert result.winner == "xla"
  assert "error ratio" in result.reason and "bf16_sums" in result.reason


def test_explain_shows_each_candidates_error_ratio(toy_family, tmp_path, rng):
  x = jnp.asarray(rng.standard_normal((2048, 4)).astype(np.float32) + 3.0)
  loss = lambda x: jnp.sum(jnp.tanh(colsum(x)))
  with tj.config_context({"kernel": {"enable": True}, "cache": {"dir": str(tmp_path)}}):
    f = tj.jit(jax.grad(loss), session=autotune.TuningSession())
    f(x)
  (row,) = autotune.explain(loss, x, cache=tmp_path)
  assert set(row.error_ratios) == {"blocked", "bf16_sums"}
  assert row.error_ratios["bf16_sums"] > _accuracy.ERROR_RATIO_LIMIT >= row.error_ratios["blocked"]
  assert row.kernel != "bf16_sums"


def test_the_reference_is_float64_and_scoped():
  x = np.random.default_rng(0).normal(size=(512, 4)).astype(np.float32)
  total = lambda x: jnp.sum(x, 0)
  ref = _accuracy.reference(total, [jnp.asarray(x)], total(x), platform="cpu")
  assert ref.dtype == "float64" and ref.leaves[0].dtype == np.float64
  np.testing.assert_allclose(ref.leaves[0], x.astype(np.float64).sum(0), rtol=1e-12)
  assert not jax.config.jax_enable_x64  # the float64 scope ended with the call
  assert jnp.asarray(1.0).dtype == jnp.float32


def test_without_float64_the_reference_is_float32_at_highest():
  # A platform without float64 (a TPU): the default kernel in float32, products at HIGHEST.
  a = np.random.default_rng(1).normal(size=(64, 64)).astype(np.float32)
  seen = []

  def matmul(a):
    seen.append(jax.config.jax_default_matmul_precision)
    return a @ a

  ref = _accuracy.reference(matmul, [jnp.asarray(a)], a @ a, platform="tpu")
  assert ref.dtype == "float32" and seen == ["highest"]


def test_a_reference_that_cannot_run_in_float64_falls_back(caplog):
  def float32_only(x):
    if x.dtype != jnp.float32:
      raise TypeError("float32 only")
    return x * 2

  x = jnp.ones((4,), jnp.float32)
  assert _accuracy.reference(float32_only, [x], x * 2, platform="cpu").dtype == "float32"

  def never(x):
    raise TypeError("no reference")

  with caplog.at_level(logging.WARNING, logger="tunedjax.autotune"):
    assert _accuracy.reference(never, [x], x * 2, platform="cpu", label="b") is None
  assert "no high-precision reference" in caplog.text
  # float64 outputs: there is no higher precision to compare with.
  x64 = np.ones(3, np.float64)
  assert _accuracy.reference(lambda x: x, [x64], x64, platform="cpu") is None


def test_errors_are_floored_and_absolute_near_zero():
  ref = np.array([1e-3, -2e-3])  # a leaf near zero: judged on the data's scale (1)
  assert _accuracy.leaf_error(ref + 1e-7, ref) == pytest.approx(1e-7)
  exact = _accuracy.Reference((np.array([10.0, 20.0]),), "float64", (0.0,))
  one_ulp = np.array([10.0, 20.0], np.float32) + np.float32(20.0) * np.finfo(np.float32).eps
  # The default was exact: one rounding of the candidate is not a failure.
  assert exact.ratio(one_ulp) <= 1.0
  assert exact.ratio(np.array([10.0, 21.0], np.float32)) > 1e4
  assert exact.ratio((one_ulp, one_ulp)) == float("inf")  # a structure mismatch


def test_old_cache_values_without_error_ratios_still_load():
  old = {"winner": "im2col", "reason": "r", "timings": {"xla": [1.0], "im2col": [0.5]},
         "ratios": {"im2col": 0.5}, "errors": {}, "rejected": {}, "skipped": [],
         "measured_at": "", "tuning_s": 0.1}
  _result.validate_value(old, "conv", known={"xla", "im2col"})
  assert _result.TuneResult.from_value(old).error_ratios == {}
  with pytest.raises(TypeError, match="error_ratios"):
    _result.validate_value({**old, "error_ratios": {"im2col": "fine"}}, "conv",
                           known={"xla", "im2col"})


def test_a_family_gives_its_own_precise_reference():
  with pytest.raises(tj.TunedJaxError, match=r"precise must be callable or None"):
    autotune.OpFamily(name="bad_precise", spec_type=ColsumSpec, key=lambda s, b: {},
                      operands=lambda s, r: (), precise="float64")
  attention, conv = autotune.op_family("attention"), autotune.op_family("conv")
  # jax.nn's attention takes its softmax in float32 whatever the inputs; conv fixes
  # its precision; batch norm's default computes in its operands' dtype already.
  assert attention.precise is not None and conv.precise is not None
  assert autotune.op_family("batch_norm").precise is None
