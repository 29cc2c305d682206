"""Costs belong to a platform: a GPU's tuning is costed, predicted and cached by its
own numbers (or its rule until it has some), never by what the CPU measured.

These run on CPU. A "GPU" here is the CPU device standing in for one: its
fingerprint says ``gpu`` (so it has a cache file and machine class of its own),
and kernel selection is told it can time on it; the timings are faked.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj
from tunedjax import _tuning, autotune, layout
from tunedjax._errors import CacheWarning
from tunedjax._tuning import _cache
from tunedjax.autotune import _payback, _predict, _select, _tuner

OP = "toy_platform"


@dataclasses.dataclass(frozen=True)
class ToySpec:
  n: int


def _scale(x, spec):
  del spec
  return 3.0 * x


def _gpu_fingerprint():
  return dataclasses.replace(_tuning.device_fingerprint("cpu"), platform="gpu",
                             device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")


@pytest.fixture
def fake_gpu(monkeypatch):
  """This process has a "gpu": the CPU device, with a GPU's fingerprint."""
  real = _tuning.device_fingerprint

  def fingerprint(backend=None):
    if backend is not None and _tuning.canonical_platform(backend) == "gpu":
      return _gpu_fingerprint()
    return real(backend)

  monkeypatch.setattr(_cache, "device_fingerprint", fingerprint)
  monkeypatch.setattr(_tuning, "device_fingerprint", fingerprint)
  monkeypatch.setattr(_select, "_measurable", lambda platform: True)


@pytest.fixture
def toy(monkeypatch, tmp_path):
  """A family whose `fast` kernel takes 0.1x xla's time and `slow` 3x (faked
  timings, on every platform); its rule presumes both slower than xla on a GPU."""
  speed = {"xla": 1.0, "fast": 0.1, "slow": 3.0}
  compiled: list[list[str]] = []
  real = _tuner._compile_all

  def compile_all(functions, args, times=None):
    compiled.append(sorted(functions))
    return real(functions, args, times)

  monkeypatch.setattr(_tuner, "_compile_all", compile_all)
  monkeypatch.setattr(_tuning, "time_interleaved", lambda runners, rounds=5, **kw: {
      n: [1e-3 * speed[n]] * rounds for n in runners})

  def register(presumed=lambda key, platform: {"fast": 2.0, "slow": 2.0}
               if platform == "gpu" else {}):
    autotune.register_op_family(autotune.OpFamily(
        name=OP, spec_type=ToySpec, key=lambda s, b: {"n": s.n},
        operands=lambda s, rng: (rng.standard_normal((s.n,)).astype(np.float32),),
        features=lambda key: {"n": math.log2(key["n"])}, presumed=presumed), replace=True)
    for name in speed:
      autotune.register_kernel(OP, name, _scale, applicable=lambda s, p: True, replace=True)

  try:
    yield register, compiled
  finally:
    autotune.unregister_op_family(OP)


def _run(cache_dir, n, platform, session, **kernel):
  with tj.config_context({"kernel": {"enable": True, **kernel},
                          "cache": {"dir": str(cache_dir)}}):
    f = tj.jit(lambda x: autotune.dispatch(OP, ToySpec(x.shape[0]), x), platform=platform,
               session=session)
    np.testing.assert_allclose(f(jnp.ones(n)), 3.0 * np.ones(n))
    return f.report().last.kernel_report


# -- where measurements are kept -------------------------------------------------------


def test_a_platform_without_a_device_here_gets_no_cache(tmp_path):
  assert _tuning.resolve_cache(tmp_path, platform="gpu") is None
  assert _tuning.resolve_cache(autotune.Cache(tmp_path), platform="tpu") is None
  cpu = autotune.Cache(tmp_path)
  assert _tuning.resolve_cache(cpu, platform="cpu") is cpu
  assert _select.new_selection(platform="gpu", cache=cpu).cache is None


def test_a_gpus_measurements_live_in_the_gpus_file(fake_gpu, tmp_path):
  cpu = autotune.Cache(tmp_path)
  gpu = _tuning.resolve_cache(cpu, platform="gpu")
  assert gpu.fingerprint.platform == "gpu" and gpu.path != cpu.path
  assert gpu.dir == cpu.dir and gpu.readonly == cpu.readonly
  cpu.put(OP, {"n": 1}, {"winner": "fast"})
  assert gpu.get(OP, {"n": 1}) is None and not gpu.entries(OP)


def test_the_sessions_memory_keeps_platforms_apart():
  s = _tuning.TuningSession()
  s.store(None, OP, {"n": 1}, {"winner": "fast"}, platform="cpu")
  assert s.lookup(None, OP, {"n": 1}, platform="cpu") == {"winner": "fast"}
  assert s.lookup(None, OP, {"n": 1}, platform="gpu") is None


# -- what tuning costs ----------------------------------------------------------------


def test_tuning_costs_are_kept_per_platform_and_a_new_platform_gets_its_rule():
  s = _tuning.TuningSession()
  for est, took in ((1.0, 0.2), (1.0, 0.4), (1.0, 0.3)):
    s.record_tuning_cost(est, took, platform="cpu")
  assert s.tuning_costs("gpu") == () and s.tuning_cost_factor("cpu") == pytest.approx(0.3)
  cpu = _payback.for_platform(s, "cpu", horizon=10)
  gpu = _payback.for_platform(s, "gpu", horizon=10)
  assert cpu.cost_factor == pytest.approx(0.3) and cpu.basis == ""
  assert gpu.cost_factor == _payback.UNMEASURED_COST_FACTOR["gpu"] == 2.0
  assert "nothing tuned on gpu yet" in gpu.basis and "gpu's rule" in gpu.basis
  s.record_tuning_cost(1.0, 5.0, platform="gpu")
  s.record_tuning_cost(1.0, 7.0, platform="gpu")
  measured = _payback.for_platform(s, "gpu", horizon=10)
  assert measured.cost_factor == pytest.approx(6.0) and measured.basis == ""
  assert _payback.for_platform(s, "cpu", horizon=10).cost_factor == pytest.approx(0.3)


@pytest.fixture
def paybacks_seen(monkeypatch):
  """``(platform, payback)`` of every `tune_bucket` call, in order."""
  seen = []
  real = _tuner.tune_bucket

  def spy(*args, payback=None, platform="cpu", **kw):
    seen.append((platform, payback))
    return real(*args, payback=payback, platform=platform, **kw)

  monkeypatch.setattr(_tuner, "tune_bucket", spy)
  return seen


def test_cpu_tuning_costs_never_cost_a_gpu_bucket(toy, fake_gpu, paybacks_seen, tmp_path):
  """A session that tuned on the CPU, then a GPU bucket: the GPU's payback uses the
  GPU's rule (its reason says so), and its measured cost is kept for the GPU."""
  register, _ = toy
  register(presumed=lambda key, platform: {})  # no rule for the candidates: all compiled
  session = _tuning.TuningSession(horizon=10**6)
  for n in (16, 32, 64):
    _run(tmp_path, n, "cpu", session)
  assert len(session.tuning_costs("cpu")) == 3 and session.tuning_costs("gpu") == ()
  session.horizon = 1  # one run of a 1 ms kernel saves at most 1 ms: cannot pay back
  report = _run(tmp_path, 16, "gpu", session)
  platform, payback = paybacks_seen[-1]
  assert platform == "gpu" and payback.cost_factor == _payback.UNMEASURED_COST_FACTOR["gpu"]
  # The CPU's buckets: its own rule before two were measured, then its measurements.
  assert ["cpu's rule" in p.basis for _, p in paybacks_seen[:3]] == [True, True, False]
  assert paybacks_seen[2][1].cost_factor == pytest.approx(
      float(np.median(session.tuning_costs("cpu")[:2])))
  assert report.kept == 1
  gpu_cache = _tuning.resolve_cache(tmp_path, platform="gpu")
  (entry,) = gpu_cache.entries(OP)
  assert entry.value["reason"].startswith("cannot pay back")
  assert "nothing tuned on gpu yet" in entry.value["reason"]
  assert "(gpu's rule)" in entry.value["reason"]
  assert session.tuning_costs("gpu") == ()  # a kept bucket measured no tuning


def test_cpu_measurements_never_predict_a_gpu_bucket(toy, fake_gpu, tmp_path):
  """The CPU measured `fast` at 0.1x xla near this bucket; on the GPU the family's
  rule (xla first) decides, so nothing but xla is even compiled there."""
  register, compiled = toy
  register()
  session = _tuning.TuningSession()
  _run(tmp_path, 64, "cpu", session)
  compiled.clear()
  _run(tmp_path, 128, "cpu", session)  # the CPU's neighbour: predicted from 64
  assert compiled == [["fast", "xla"]]
  compiled.clear()
  report = _run(tmp_path, 128, "gpu", session)
  assert compiled == []  # the rule ruled out both; xla needs no tuning
  assert [(c.kernel, c.why) for c in report.choices] == [("xla", "tuned")]
  (entry,) = _tuning.resolve_cache(tmp_path, platform="gpu").entries(OP)
  assert entry.value["winner"] == "xla"
  assert set(entry.value["pruned"]) == {"fast", "slow"}
  assert all("presumed by the platform's rule" in r for r in entry.value["pruned"].values())
  assert {e.key["n"] for e in autotune.Cache(tmp_path).entries(OP)} == {64, 128}


def test_the_gpus_own_measurements_replace_its_rule(toy, fake_gpu, tmp_path):
  register, compiled = toy
  register()
  session = _tuning.TuningSession()
  _run(tmp_path, 64, "gpu", session, predict=False)  # measured on the GPU, exhaustively
  assert compiled == [["fast", "slow", "xla"]]
  compiled.clear()
  _run(tmp_path, 128, "gpu", session)  # its neighbour: the GPU's measurement predicts
  assert compiled == [["fast", "xla"]]
  family = autotune.op_family(OP)
  pred = _select.predict_bucket(family, {"n": 256}, autotune.kernels(OP),
                                _select.new_selection(platform="gpu", cache=tmp_path))
  assert pred.order()[0] == "fast" and pred.estimates["fast"].source == "measured"
  assert pred.estimates["slow"].source == "measured"


# -- priors ---------------------------------------------------------------------------


def _priors(folder, name, machine_class):
  data = {"format": _predict.PRIORS_FORMAT, "version": _predict.PRIORS_VERSION, "family": OP,
          "machine_class": machine_class, "provenance": {}, "buckets": [
              {"features": {"n": 6.0}, "ratios": {"fast": 0.1}}]}
  (folder / f"{name}.json").write_text(json.dumps(data))


def test_a_gpu_never_reads_a_cpus_priors(tmp_path):
  family = dataclasses.replace(autotune.OpFamily(
      name=OP, spec_type=ToySpec, key=lambda s, b: {}, operands=lambda s, r: ()),
      features=lambda key: {}, priors=tmp_path)
  for name in ("cpu", "cpu-avx2", "cpu-avx512"):
    _priors(tmp_path, name, name)
  _predict._load_priors.cache_clear()
  gpu = _gpu_fingerprint()
  assert _predict.machine_class(gpu) == ("gpu-sm90", "gpu")
  assert _predict.priors(family, gpu) == ()
  assert _predict.priors(family, ("cpu", "gpu"), "gpu") == ()  # a CPU class is never read
  assert len(_predict.priors(family, _tuning.device_fingerprint("cpu"))) == 1
  metal = dataclasses.replace(gpu, platform="METAL", compute_capability=None)
  assert _predict.machine_class(metal) == ("metal",)
  _priors(tmp_path, "gpu", "cpu-avx512")  # CPU measurements under a GPU's name
  _predict._load_priors.cache_clear()
  with pytest.warns(CacheWarning, match="machine class 'cpu-avx512', not 'gpu'"):
    assert _predict.priors(family, gpu) == ()
  _predict._load_priors.cache_clear()


# -- the predicted order on a GPU: the families' rules -----------------------------------


def _attention_row(dtype, platform, **kwargs):
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 128, 4, 64)), dtype) for _ in range(3))
  (row,) = autotune.explain(lambda q, k, v: tj.attention(q, k, v, **kwargs), q, k, v,
                            platform=platform, cache=False)
  return row


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("kwargs", [{"is_causal": True}, {}])
def test_on_a_gpu_cudnn_is_predicted_first_for_half_precision_attention(dtype, kwargs):
  row = _attention_row(dtype, "gpu", **kwargs)
  assert row.predicted[:2] == ("cudnn", "xla"), row.predicted
  assert set(row.predicted) == set(row.candidates)


def test_the_attention_rule_holds_only_where_it_was_measured():
  assert _attention_row(jnp.float32, "gpu", is_causal=True).predicted[0] == "xla"
  cpu = _attention_row(jnp.bfloat16, "cpu", is_causal=True)
  assert "cudnn" not in cpu.predicted and "cudnn" not in cpu.candidates


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_on_a_gpu_xla_is_predicted_first_for_convolutions(dtype):
  x, w = jnp.ones((8, 16, 16, 32), dtype), jnp.ones((3, 3, 32, 64), dtype)
  conv = lambda x, w: jax.lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  (row,) = autotune.explain(conv, x, w, platform="gpu", cache=False)
  assert len(row.candidates) > 1 and row.predicted[0] == "xla", row


# -- layout: timed on the platform's own device ---------------------------------------


def test_layout_measure_mode_never_times_another_platform():
  x = jnp.ones((2, 3, 8, 8), jnp.float16)
  w = jnp.ones((4, 3, 3, 3), jnp.float16)
  net = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")
  opt = layout.optimize(net, mode="measure", platform="tpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error", CacheWarning)
    jax.make_jaxpr(opt)(x, w)
  report = opt.report()
  assert report.seconds is None or not report.seconds
  assert "not measured: no tpu here to time it on" in report.reason
