"""tunedjax.jit: levels, passes, config changes, jit's options, errors, reports."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.extend import core as jex_core

import tunedjax as tj
from tunedjax import rewrite
from tunedjax._jit import XLA_CACHE_SUBDIR

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = 16
ALL_BUT_PRECISION = {"layout": {"enable": True}, "kernel": {"enable": True}}


# --- models: a CNN train step (nnx, NCHW as a port would be) and a Transformer one (linen)


class _CNN(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 16, (3, 3), strides=(2, 2), rngs=rngs)
    self.fc = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.norm(self.conv1(x)))
    x = nnx.relu(self.conv2(x))
    return self.fc(x.mean(axis=(1, 2)))


def _nchw_conv(x, w, stride=1):
  return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                      dimension_numbers=("NCHW", "OIHW", "NCHW"))


def cnn_problem(seed: int = 0):
  """An SGD train step of a small NCHW CNN (a PyTorch port), and its state and batch."""
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.normal(size=s, scale=0.3), jnp.float32)  # noqa: E731
  params = {"w1": normal(8, 3, 3, 3), "b1": normal(8), "w2": normal(16, 8, 3, 3),
            "w3": normal(16, 16, 1, 1), "fc": normal(16, 10)}
  batch = {"x": normal(BATCH, 3, 12, 12),
           "y": jnp.asarray(rng.integers(0, 10, size=BATCH), jnp.int32)}

  def loss_fn(params, batch):
    h = jax.nn.relu(_nchw_conv(batch["x"], params["w1"]) + params["b1"][None, :, None, None])
    h = jax.nn.relu(_nchw_conv(h, params["w2"], stride=2))
    h = _nchw_conv(h, params["w3"]) + h
    logits = h.mean(axis=(2, 3)) @ params["fc"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  def step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  return step, loss_fn, params, batch


class _Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(h, h)
    return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))


def transformer_problem(seed: int = 0):
  rng = np.random.default_rng(seed)
  block = _Block()
  x = jnp.asarray(rng.normal(size=(BATCH, 6, 16)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(BATCH, 6, 16)), jnp.float32)
  params = block.init(jax.random.key(seed), x)

  def loss_fn(params, batch):
    return jnp.mean((block.apply(params, batch["x"]) - batch["y"]) ** 2)

  def step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  return step, loss_fn, params, {"x": x, "y": y}


def relative_error(got, want) -> float:
  """‖got - want‖ / ‖want‖ over the whole pytree."""
  diff = sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
  norm = sum(float(np.sum(np.asarray(b, np.float64) ** 2)) for b in jax.tree.leaves(want))
  return (diff / norm) ** 0.5


def assert_bitwise(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def _module_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tuning-cache"))


@pytest.fixture(autouse=True)
def _own_cache(_module_cache):
  """One tuning cache for this module: each conv bucket is tuned once."""
  with tj.config_context({"cache": {"dir": _module_cache}}):
    yield


def conv_count(fn, *args) -> int:
  return rewrite.count_primitives(jax.make_jaxpr(fn)(*args))["conv_general_dilated"]


# --- levels ---------------------------------------------------------------------


@pytest.mark.parametrize("problem", [cnn_problem, transformer_problem])
def test_o0_is_plain_jax_jit_bitwise(problem):
  step, _, params, batch = problem()
  with tj.config_context({**ALL_BUT_PRECISION, "mixed_precision": {"enable": True}}):
    f = tj.jit(step, level="O0")
    assert_bitwise(f(params, batch), jax.jit(step)(params, batch))
  assert len(f.report()) == 0  # nothing was rewritten


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_layout_and_kernels_match_jax_jit(level):
  step, _, params, batch = cnn_problem()
  want = jax.jit(step)(params, batch)
  with tj.config_context(ALL_BUT_PRECISION):
    f = tj.jit(step, level=level)
    got = f(params, batch)
  assert relative_error(got, want) < 1e-4
  rep = f.report().last
  assert rep.passes == ("layout", "kernel_selection", "cleanup")
  convs = conv_count(step, params, batch)
  assert rep.layout.decision == "relaid" and rep.layout.counts["convolutions re-laid"] == convs
  assert sum(rep.kernels.values()) == convs


def test_mixed_precision_transformer_matches_within_bfloat16_tolerance():
  step, _, params, batch = transformer_problem()
  want = jax.jit(step)(params, batch)
  with tj.config_context({"mixed_precision": {"enable": True}}):
    f = tj.jit(step)
    got = f(params, batch)
    jaxpr = f.jaxpr(params, batch)
  assert relative_error(got, want) < 1e-2
  dots = [e for e in rewrite.iter_equations(jaxpr) if e.primitive.name == "dot_general"]
  assert dots and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)
  assert all(e.outvars[0].aval.dtype == jnp.float32 for e in dots)  # float32 accumulation
  rep = f.report().last
  assert rep.policy == "params=float32,compute=bfloat16,output=float32"
  assert rep.casts["dot_general in bfloat16"] == len(dots)


def test_every_pass_at_once_on_the_cnn():
  step, _, params, batch = cnn_problem()
  want = jax.jit(step)(params, batch)
  with tj.config_context({**ALL_BUT_PRECISION, "mixed_precision": {"enable": True}}):
    got = tj.jit(step)(params, batch)
  assert relative_error(got, want) < 2e-2


# --- composition with JAX's transformations -------------------------------------------


def test_grad_and_vmap_around_tj_jit():
  _, loss_fn, params, batch = cnn_problem()
  with tj.config_context(ALL_BUT_PRECISION):
    f = tj.jit(loss_fn)
    grads = jax.grad(f)(params, batch)
    per_example = jax.vmap(f, in_axes=(None, 0))(
        params, jax.tree.map(lambda a: a[:, None], batch))
  assert relative_error(grads, jax.grad(loss_fn)(params, batch)) < 1e-3
  want = jax.vmap(loss_fn, in_axes=(None, 0))(params, jax.tree.map(lambda a: a[:, None], batch))
  assert relative_error(per_example, want) < 1e-4


def test_sharded_batch_on_8_devices(mesh8_auto):
  mesh8 = mesh8_auto  # take_along_axis: see tests/test_explicit_sharding.py for Explicit axes
  step, _, params, batch = cnn_problem()
  sharding = jax.sharding.NamedSharding(mesh8, jax.sharding.PartitionSpec("data"))
  sharded = jax.device_put(batch, sharding)
  replicated = jax.device_put(params, jax.sharding.NamedSharding(mesh8, jax.sharding.PartitionSpec()))
  want = jax.jit(step)(replicated, sharded)
  with tj.config_context(ALL_BUT_PRECISION):
    got = tj.jit(step)(replicated, sharded)
  assert relative_error(got, want) < 1e-4
  assert len(got[0]["w1"].sharding.device_set) == 8


# --- config, static arguments, donation ----------------------------------------------


def test_a_config_change_takes_effect_on_the_next_call():
  step, _, params, batch = cnn_problem()
  f = tj.jit(step)
  f(params, batch)
  with tj.config_context({"layout": {"enable": True}}):
    f(params, batch)
  f(params, batch)
  reports = f.report()
  assert [r.passes for r in reports] == [(), ("layout", "cleanup")]
  # Back outside the context: the first program is reused, not traced again.
  assert len(reports) == 2


def test_each_call_runs_the_program_of_its_own_scope_also_across_threads(rng):
  """The per-call fast path (the last state's program while nothing it depends on
  moved) never hands one scope's program to another: calls alternate between
  float32 and a bfloat16 policy, in this thread and in two others at once."""
  import threading
  x = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
  f = tj.jit(lambda a, b: jnp.tanh(a @ b))
  half = {"mixed_precision": {"enable": True, "policy": "mixed_bfloat16"}}
  want32 = np.tanh(np.asarray(x, np.float64) @ np.asarray(w, np.float64))

  def check(scope_is_half: bool) -> None:
    with tj.config_context(half if scope_is_half else {}):
      got = np.asarray(f(x, w), np.float64)
    error = np.abs(got - want32).max()
    assert (error > 1e-3) if scope_is_half else (error < 1e-5), (scope_is_half, error)

  for scope in (False, True, True, False, True, False, False):
    check(scope)
  assert len(f.report(memory=False)) == 2  # one program per scope, each traced once
  errors = []

  def worker(scope_is_half: bool) -> None:
    try:
      for _ in range(50):
        check(scope_is_half)
    except AssertionError as err:
      errors.append(err)

  threads = [threading.Thread(target=worker, args=(s,)) for s in (False, True)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors[0]


def test_static_and_donated_arguments():
  traces = []

  def scale(x, n, *, mode):
    traces.append((n, mode))
    return x * n if mode == "mul" else x + n

  f = tj.jit(scale, static_argnums=1, static_argnames="mode")
  x = jnp.arange(4.0)
  assert f(x, 3, mode="mul").tolist() == [0.0, 3.0, 6.0, 9.0]
  assert f(x, 3, mode="mul").tolist() == [0.0, 3.0, 6.0, 9.0]
  assert f(x, 2, mode="add").tolist() == [2.0, 3.0, 4.0, 5.0]
  assert traces == [(3, "mul"), (2, "add")]
  assert "n=3" not in f.report()[0].signature and "1=3" in f.report()[0].signature

  g = tj.jit(lambda state, x: (state + x, x.sum()), donate_argnums=0)
  state = jnp.ones(8)
  new_state, _ = g(state, jnp.arange(8.0))
  assert new_state.tolist() == [float(i + 1) for i in range(8)]
  assert g.report().last.memory.alias_bytes == 8 * 4  # the output reuses the donated input


def test_static_name_passed_by_position_is_static():
  f = tj.jit(lambda x, n: x * n, static_argnames="n")
  assert f(jnp.ones(2), 4).tolist() == [4.0, 4.0]
  assert f.report().last.signature.endswith("1=4")


def test_bad_input_errors():
  with pytest.raises(tj.ConfigError, match=r"one of 'O0', 'O1' or 'O2'.*got 'O3'"):
    tj.jit(lambda x: x, level="O3")
  with pytest.raises(tj.ConfigError, match=r"both static and donated"):
    tj.jit(lambda x, n: x, static_argnums=1, donate_argnums=(0, 1))
  with pytest.raises(tj.ConfigError, match=r"both static and donated"):
    tj.jit(lambda x, n: x, static_argnames="n", donate_argnums=1)
  with pytest.raises(TypeError, match=r"static_argnums.*'1'"):
    tj.jit(lambda x, n: x, static_argnums="1")
  f = tj.jit(lambda x, n: x, static_argnums=1)
  with pytest.raises(ValueError, match=r"[Nn]on-hashable static"):
    f(jnp.ones(2), [1, 2])
  with pytest.raises(TypeError, match="expects a function"):
    tj.jit(3)


# --- introspection and cleanup ----------------------------------------------------------


def _producers(closed):
  """(consumer primitive, producer primitive) for each equation input, sub-jaxprs included."""
  pairs = []

  def walk(jaxpr):
    made = {}
    for eqn in jaxpr.eqns:
      for v in eqn.invars:
        if isinstance(v, jex_core.Var) and v in made:
          pairs.append((eqn, made[v]))
      for v in eqn.outvars:
        made[v] = eqn
      for sub in jex_core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(closed.jaxpr)
  return pairs


@pytest.mark.parametrize("kernel", [None, "im2col", "matmul_1x1"])
def test_passes_leave_no_redundant_casts_or_transposes(kernel):
  # The tuner's winners depend on timing; the hints pin kernels that transpose
  # into their own layout, so the kernels' equations are checked every run.
  step, _, params, batch = cnn_problem()
  hints = {"hints": {"conv": kernel}} if kernel else {}
  config = {"layout": {"enable": True}, "kernel": {"enable": True, **hints},
            "mixed_precision": {"enable": True}}
  with tj.config_context(config):
    f = tj.jit(step)
    jaxpr = f.jaxpr(params, batch)
  from tunedjax.rewrite._cleanup import exact_cast
  for eqn, producer in _producers(jaxpr):
    name, made_by = eqn.primitive.name, producer.primitive.name
    if name == "transpose":
      assert made_by != "transpose", (producer, eqn)
    if name == "convert_element_type" and made_by == "convert_element_type":
      assert not exact_cast(producer.invars[0].aval.dtype, producer.outvars[0].aval.dtype), (
          producer, eqn)
  for eqn in rewrite.iter_equations(jaxpr):
    if eqn.primitive.name == "convert_element_type":
      a, b = eqn.invars[0].aval, eqn.outvars[0].aval
      assert (a.dtype, a.weak_type) != (b.dtype, b.weak_type), eqn
  assert rewrite.count_primitives(jaxpr)["convert_element_type"] > 0  # autocast did cast


def test_report_says_what_each_pass_did():
  step, _, params, batch = cnn_problem()
  with tj.config_context({**ALL_BUT_PRECISION, "mixed_precision": {"enable": True}}):
    f = tj.jit(step)
    f(params, batch)
  report = f.report()
  rep = report.last
  assert rep.level == "O1" and rep.policy.startswith("params=float32")
  assert rep.casts["conv_general_dilated in bfloat16"] == conv_count(step, params, batch)
  assert rep.layout.decision == "relaid"
  assert rep.memory.argument_bytes > 0 and rep.memory.temp_bytes > 0
  text = str(report)
  for words in ("1 signature(s)", "mixed precision", "layout: relaid -> NHWC",
                "kernels: conv ", "cache hits", "memory: arguments"):
    assert words in text, text
  lowered = f.lower(params, batch)
  assert "stablehlo" in lowered.as_text() or "module" in lowered.as_text()


def test_without_enabled_passes_o1_is_jax_jit_bitwise():
  step, _, params, batch = transformer_problem()
  f = tj.jit(step)
  assert_bitwise(f(params, batch), jax.jit(step)(params, batch))
  assert f.report().last.passes == ()


# --- restart: a second process reuses what the first measured and compiled ------------------

_RESTART_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import jax
    sys.path.insert(0, {tests!r})
    import tunedjax as tj
    from test_jit import cnn_problem
    from tunedjax import autotune
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if "cache_hits" in event else None)
    step, _, params, batch = cnn_problem()
    tj.set_config({{"kernel": {{"enable": True}}, "layout": {{"enable": True}},
                   "cache": {{"dir": {cache!r}}}, "level": "O2"}})
    f = tj.jit(step)
    start = time.perf_counter()
    jax.block_until_ready(f(params, batch))
    first_call_s = time.perf_counter() - start
    rep = f.report(memory=False).last
    print(json.dumps({{"first_call_s": first_call_s, "tuning_s": rep.tuning_s,
                      "hits": rep.cache_hits, "misses": rep.cache_misses,
                      "hit_rate": rep.hit_rate, "xla_cache_hits": len(hits),
                      "layout_cached": rep.layout.cached}}))
""")


@pytest.mark.slow
def test_a_restarted_process_tunes_nothing_and_compiles_from_disk(tmp_path):
  script = _RESTART_SCRIPT.format(tests=str(ROOT / "tests"), cache=str(tmp_path / "shared"))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
  runs = []
  for _ in range(2):
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
  first, second = runs
  print(f"first call: {first['first_call_s']:.2f} s cold (tuning {first['tuning_s']:.2f} s), "
        f"{second['first_call_s']:.2f} s after a restart")
  assert first["misses"] > 0 and first["tuning_s"] > 0
  assert second["tuning_s"] == 0.0 and second["misses"] == 0
  assert second["hits"] == first["misses"] and second["hit_rate"] == 1.0
  assert second["xla_cache_hits"] > 0 and first["xla_cache_hits"] == 0
  assert list((tmp_path / "shared" / XLA_CACHE_SUBDIR).iterdir())


def test_a_first_call_writes_what_it_tuned_to_the_cache_file_once(tmp_path, monkeypatch, rng):
  from tunedjax._tuning import _cache  # pylint: disable=import-outside-toplevel
  writes = []
  real_write = _cache.Cache._write
  monkeypatch.setattr(_cache.Cache, "_write", lambda self, entries: (
      writes.append(sorted(e.namespace for e in entries.values())), real_write(self, entries)))
  x = jnp.asarray(rng.normal(size=(2, 6, 6, 3)).astype(np.float32))
  ws = [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in ((3, 3, 3, 4), (1, 1, 4, 5))]

  def f(x, ws):
    for w in ws:
      x = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return x

  jitted = tj.jit(f, session=tj.autotune.TuningSession())  # no step yet: tunes at once
  with tj.config_context({"kernel": {"enable": True}, "cache": {"dir": str(tmp_path)}}):
    out = jitted(x, ws)
    report = jitted.report(memory=False).last
  tuned = report.cache_misses
  assert tuned >= 2 and report.cache_hits == 0
  # One read-merge-write (and one fsync) at the end of the trace, for every bucket.
  assert writes == [["conv"] * tuned]
  assert len(tj.autotune.Cache(tmp_path).entries("conv")) == tuned
  np.testing.assert_allclose(np.asarray(out), np.asarray(f(x, ws)), rtol=1e-5, atol=1e-5)


def test_the_kernel_phase_retraces_only_when_kernel_selection_is_on():
  f = tj.jit(lambda x: x * 2)
  try:
    with tj.config_context({"kernel": {"enable": False}}):
      for index in (0, 5):  # observe, then tune: nothing to select
        tj.autotune.step(index=index)
        f(jnp.ones(2))
    assert len(f.report(memory=False)) == 1
    with tj.config_context({"kernel": {"enable": True}}):
      for index in (0, 5):
        tj.autotune.step(index=index)
        f(jnp.ones(2))
    # x * 2 has no kernel site: the program traced in the observe phase serves
    # the tune phase too (tests/test_jit_verification.py: a program with sites
    # is traced once per phase).
    assert len(f.report(memory=False)) == 2
  finally:
    tj.autotune.default_session().reset()


def test_platform_and_session_are_checked_up_front():
  with pytest.raises(tj.ConfigError, match=r"Unknown platform 'gpx'.*'cpu'"):
    tj.jit(lambda x: x, platform="gpx")
  with pytest.raises(TypeError, match="session=.*TuningSession"):
    tj.jit(lambda x: x, session="mine")


def test_runs_per_call_and_trace_count_are_public_and_checked():
  f = tj.jit(lambda x: x * 2)
  assert f.runs_per_call == 1 and f.trace_count == 0 and f.level is None
  f.runs_per_call = 3
  assert f.runs_per_call == 3
  for bad in (0, -1, 2.0, True):
    with pytest.raises(tj.ConfigError, match=r"runs_per_call must be a positive int.*got"):
      f.runs_per_call = bad
  with tj.config_context({"kernel": {"enable": True}}):
    f(jnp.ones(2))
  assert f.trace_count == 1  # a trace with kernel selection on
