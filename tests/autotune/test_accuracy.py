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
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _agreeing(x, spec):
  """The column sums in another order of float32 additions: a few ulps from xla's."""
  del spec
  return jnp.sum(x[::-1], axis=0)


def test_a_candidate_agreeing_with_the_default_needs_no_reference(toy_family, monkeypatch):
  autotune.register_kernel(OP, "agreeing", _agreeing, applicable=lambda s, p: True)
  runs = []
  real_run = _accuracy._run
  monkeypatch.setattr(_accuracy, "_run", lambda *a: (runs.append(1), real_run(*a))[-1])
  spec = ColsumSpec((256, 8), "float32")
  kernels = [k for k in autotune.kernels(OP) if k.name in ("xla", "agreeing")]
  result = _tuner.tune_bucket(spec, kernels, options=_tuner.TuneOptions(rounds=1))
  assert runs == [] and "agreeing" not in result.rejected
  assert 1.0 <= result.error_ratios["agreeing"] <= _accuracy.ERROR_RATIO_LIMIT  # the bound
  # One candidate too far from the default for the bound: the reference judges them all.
  result = _tuner.tune_bucket(spec, [*kernels, *[k for k in autotune.kernels(OP)
                                                 if k.name == "bf16_sums"]],
                              options=_tuner.TuneOptions(rounds=1))
  assert runs and "bf16_sums" in result.rejected and "agreeing" not in result.rejected
  assert result.error_ratios["agreeing"] <= _accuracy.ERROR_RATIO_LIMIT


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 0.5, 1.0, 30.0, 1e4]),
       default_noise=st.sampled_from([0.0, 1e-8, 1e-7, 1e-6, 1e-4, 1e-2]),
       candidate_ulps=st.floats(0.0, 12.0), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_the_agreement_bound_never_understates_the_error_ratio(
    seed, scale, default_noise, candidate_ulps, dtype):
  rng = np.random.default_rng(seed)
  exact = rng.standard_normal((64, 3)) * scale
  exact[rng.random(exact.shape) < 0.3] *= 1e-3  # leaves with small entries, too
  default = (exact * (1 + default_noise * rng.standard_normal(exact.shape))).astype(dtype)
  step = candidate_ulps * float(jnp.finfo(dtype).eps) * max(np.max(np.abs(exact)), 1.0)
  candidate = (default.astype(np.float64) + step * rng.uniform(-1, 1, exact.shape)).astype(dtype)
  leaves = (np.asarray(exact, np.float64),)
  reference = _accuracy.Reference(leaves, "float64", (_accuracy.leaf_error(default, leaves[0]),))
  bound = _accuracy.agreement_bound(candidate, default)
  assert reference.ratio(candidate) <= bound * (1 + 1e-9)


def test_the_agreement_bound_refuses_what_it_cannot_prove():
  d = np.linspace(-2, 2, 64, dtype=np.float32)
  assert _accuracy.agreement_bound(d, (d, d)) == float("inf")  # structures differ
  assert _accuracy.agreement_bound(d[:8], d[:9]) == float("inf")  # shapes differ
  assert _accuracy.agreement_bound(np.full(4, np.nan, np.float32), d[:4]) == float("inf")
  e4m3 = jnp.asarray(d).astype(jnp.float8_e4m3fn)
  assert _accuracy.agreement_bound(e4m3, e4m3) == float("inf")  # too coarse to prove
