"""Careless input at every public entry point: refused clearly, or accepted correctly.

Hypothesis draws wrong types, shapes and dtypes, None, NaN and inf, empty
containers and out-of-range values for one argument of an entry point at a
time (the others valid). What may escape is a `TunedJaxError`, or a
`TypeError`/`ValueError` raised by tunedjax's own code, and its message must
name the argument; an exception from deep inside JAX, grain or orbax fails
the test. A value that is accepted must give a correct result (each test
checks one), never a silently wrong one.

The example counts are bounded (`EXAMPLES`), so that the file runs in
seconds; ``TUNEDJAX_HYPOTHESIS_EXAMPLES`` raises them to explore more.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pathlib
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tunedjax as tj
from tunedjax import cli
from tunedjax import input_pipeline as ip
from tunedjax import layout
from tunedjax import mixed_precision as mp
from tunedjax._errors import TunedJaxError
from tunedjax._policy import canonical_dtype
from tests.trainer import models as m

SRC = pathlib.Path(tj.__file__).resolve().parent
EXAMPLES = int(os.environ.get("TUNEDJAX_HYPOTHESIS_EXAMPLES", "25"))


class _Thing:
  """An object of no type any argument takes."""

  def __repr__(self) -> str:
    return "<thing>"


# Wrong values of every kind; an entry point's own valid values may be drawn too.
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([-(2**40), 2**64]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.5, 0.0]),
    st.text(max_size=8),
    st.sampled_from(["", " ", "\x00", "auto", "O3", "bf17", "float32", "NHWC", "nope"]),
    st.sampled_from([[], {}, (), set(), b"", frozenset()]),
    st.builds(_Thing),
    st.tuples(st.integers(0, 3), st.integers(0, 2)).map(lambda s: np.zeros(s, np.float32)),
    st.sampled_from([np.float32(np.nan), np.array([1.0, 2.0]), np.array("x"), np.int8(3),
                     np.array([True, False]), np.ones((2, 2), np.int32)]),
    st.sampled_from([[1, 2], (1,), {"a": 1}, [None], ["x", "y"], (0, -1)]),
)


def _origin(err: BaseException) -> str:
  """Who raised `err`: "tunedjax", "user" (the test's own model or loss function,
  called by tunedjax: the user's error to read), or "library" (JAX, grain, ...)."""
  frames = traceback.extract_tb(err.__traceback__)
  if frames and pathlib.Path(frames[-1].filename).resolve().is_relative_to(SRC):
    return "tunedjax"
  user = str(pathlib.Path(m.__file__).resolve())
  for frame in reversed(frames):
    path = pathlib.Path(frame.filename).resolve()
    if str(path) == user:
      return "user"
    if path.is_relative_to(SRC):
      return "library"
  return "library"


def attempt(call, *names: str):
  """Runs `call()`: returns ``(True, result)``, or ``(False, error)`` for a refusal
  that is a tunedjax error naming one of `names`; fails the test otherwise."""
  try:
    return True, call()
  except TunedJaxError as err:
    error = err
  except Exception as err:  # pylint: disable=broad-except
    origin = _origin(err)
    if origin == "user":
      return False, err
    where = "".join(traceback.format_exception(err)[-6:])
    assert origin == "tunedjax" and isinstance(err, (TypeError, ValueError)), (
        f"{type(err).__name__} escaped from {origin}: {err}\n{where}")
    error = err
  message = str(error)
  assert any(n in message for n in names), (
      f"the message does not name {' or '.join(map(repr, names))}: {message}")
  return False, error


# Where the message names the value by another name than the argument's.
ALIASES = {"precision": ("policy",), "source": ("records",), "autotune": ("configuration",)}


def _argument(options):
  """(name, junk value) for one of the entry point's arguments."""
  return st.tuples(st.sampled_from(sorted(options)), JUNK)


# --- configuration ------------------------------------------------------------------------------

CONFIG_KEYS = {
    "kernel": ("enable", "tuning_range", "bucket", "hints"),
    "layout": ("enable", "mode"),
    "dataloader": ("enable", "tuning_steps", "max_workers"),
    "mixed_precision": ("enable", "policy", "loss_scale"),
    "cache": ("dir", "readonly"),
}
CONFIG_ARGS = [(s, k) for s, keys in CONFIG_KEYS.items() for k in keys] + [("level", None)]


@settings(max_examples=4 * EXAMPLES)
@given(st.sampled_from(CONFIG_ARGS), JUNK)
def test_config_values(where, value):
  section, key = where
  config = {section: value} if key is None else {section: {key: value}}
  dotted = section if key is None else f"{section}.{key}"

  def enter():
    with tj.config_context(config) as chosen:
      return chosen.to_dict()
  ok, got = attempt(enter, dotted)
  if ok:  # accepted: it must read back as given (tuples as lists)
    section_value = got[section] if key is None else got[section][key]
    expected = list(value) if isinstance(value, tuple) else value
    assert section_value == expected, (dotted, value, section_value)


@settings(max_examples=EXAMPLES)
@given(JUNK)
def test_set_config_sources(value):
  if isinstance(value, dict) and not value:
    return  # {} is the documented "defaults"
  try:
    ok, _ = attempt(lambda: tj.set_config(value), "set_config", "configuration", "config")
    if ok:
      assert value is None  # None: every tuner on
  finally:
    tj.set_config({})


# --- mixed precision: policies and loss scales ------------------------------------------------


@settings(max_examples=2 * EXAMPLES)
@given(_argument(("param_dtype", "compute_dtype", "output_dtype")))
def test_policy_fields(arg):
  name, value = arg
  ok, policy = attempt(lambda: mp.Policy(**{name: value}), name)
  if ok:
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      assert jnp.issubdtype(getattr(policy, field), jnp.floating)
    if value is not None:
      assert getattr(policy, name) == canonical_dtype(value)
    assert mp.Policy.parse(str(policy)) == policy


@settings(max_examples=2 * EXAMPLES)
@given(st.one_of(JUNK, st.text(alphabet="pco=,f36b12 ", max_size=14)))
def test_policy_strings(value):
  ok, policy = attempt(lambda: mp.Policy.parse(value), "policy", "Policy")
  if ok:
    assert mp.Policy.parse(str(policy)) == policy
  ok, policy = attempt(lambda: mp.get_policy(value), "policy", "Policy")
  if ok:
    assert isinstance(policy, mp.Policy)


DYNAMIC_ARGS = ("initial_scale", "growth_interval", "growth_factor", "backoff_factor",
                "min_scale", "counter")


@settings(max_examples=2 * EXAMPLES)
@given(_argument(DYNAMIC_ARGS))
def test_dynamic_loss_scale_arguments(arg):
  name, value = arg
  ok, ls = attempt(lambda: mp.DynamicLossScale(**{name: value}), name)
  if ok:
    scale = float(ls.loss_scale)
    assert ls.loss_scale.shape == () and math.isfinite(scale) and scale > 0
    after = ls.adjust(jnp.bool_(False))
    assert after.loss_scale.shape == () and 0 < float(after.loss_scale) <= scale


@settings(max_examples=EXAMPLES)
@given(JUNK)
def test_static_loss_scale_and_adjust(value):
  ok, ls = attempt(lambda: mp.StaticLossScale(value), "value")
  if ok:
    assert ls.loss_scale.shape == () and float(ls.loss_scale) > 0
  ok, adjusted = attempt(lambda: mp.DynamicLossScale(8.0).adjust(value), "grads_finite")
  if ok:
    assert adjusted.loss_scale.shape == ()
    assert float(adjusted.loss_scale) == (8.0 if bool(value) else 4.0)


@settings(max_examples=EXAMPLES)
@given(_argument(("policy", "config_value")))
def test_loss_scale_for(arg):
  name, value = arg
  kwargs = {"policy": "mixed_float16", "config_value": "auto", name: value}
  if value is None:
    return  # None reads the config: a valid call
  ok, ls = attempt(lambda: mp.loss_scale_for(**kwargs), name, "policy", "loss_scale")
  if ok:
    assert isinstance(ls, (mp.DynamicLossScale, mp.StaticLossScale, mp.NoOpLossScale))


# --- tj.jit, layout.optimize, autotune.hint -----------------------------------------------------


def _f(x, y):
  return x * 2.0 + y


JIT_ARGS = ("level", "static_argnums", "static_argnames", "donate_argnums", "donate_argnames",
            "platform")


@settings(max_examples=2 * EXAMPLES)
@given(_argument(JIT_ARGS))
def test_jit_options(arg):
  name, value = arg
  ok, out = attempt(lambda: tj.jit(_f, **{name: value})(2.0, 3.0), name)
  if ok:
    assert float(out) == 7.0


@settings(max_examples=EXAMPLES)
@given(_argument(("target", "mode", "platform")))
def test_layout_optimize(arg):
  name, value = arg
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 6, 6)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3, 3, 3)), jnp.float32)
  conv = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")  # noqa: E731
  ok, out = attempt(lambda: layout.optimize(conv, **{name: value})(x, w), name)
  if ok:
    np.testing.assert_allclose(out, conv(x, w), rtol=1e-5, atol=1e-5)


@settings(max_examples=EXAMPLES)
@given(st.one_of(JUNK, st.sampled_from(["xla", "im2col", "fft"])),
       st.sampled_from(["conv", "attention", "cnov", "Conv"]))
def test_autotune_hint(value, op):
  def enter():
    with tj.autotune.hint(**{op: value}) as hints:
      return dict(hints)
  ok, hints = attempt(enter, op, "hint")
  if ok:
    assert hints.get(op) == value


# --- the input pipeline ---------------------------------------------------------------------

LOADER_ARGS = ("source", "batch_size", "transforms", "shuffle", "seed", "num_epochs",
               "drop_remainder", "worker_count", "read_threads", "tuning_steps",
               "max_workers", "tuning_budget_s")
_LOADER_BASE = dict(batch_size=4, worker_count=0, read_threads=0, tuning_budget_s=0)


# Escapes found here once (`examples` run every time); read_threads=2**64, which
# hung the first batch, is `test_loader_huge_read_threads_does_not_hang`.
@settings(max_examples=2 * EXAMPLES)
@given(_argument(LOADER_ARGS))
@example(("shuffle", np.zeros(2)))
@example(("drop_remainder", np.zeros((0, 0))))
@example(("worker_count", np.zeros((0, 0))))
@example(("read_threads", np.zeros(2)))
@example(("transforms", None))
@example(("num_epochs", 2**64))
def test_loader_arguments(arg):
  name, value = arg
  if name in ("worker_count", "max_workers") and isinstance(value, int) and value > 0:
    value = -value  # worker processes are slow to start; their number is tested elsewhere
  if name == "tuning_budget_s" and isinstance(value, float) and value == math.inf:
    value = -math.inf  # valid (tune without a time limit), but slow
  source = np.arange(24.0).reshape(12, 2)
  kwargs = {"source": source, **_LOADER_BASE, name: value}
  ok, loader = attempt(lambda: ip.Loader(**kwargs), name, *ALIASES.get(name, ()))
  if ok:
    try:
      ok, batch = attempt(lambda: next(iter(loader)), name)
      if ok and name != "source":
        assert np.shape(batch)[1:] == (2,) and np.isin(batch, source).all()
    finally:
      loader.close()


@pytest.mark.parametrize("name", ["read_threads", "worker_count", "prefetch_buffer",
                                  "max_workers", "num_epochs"])
@pytest.mark.parametrize("value", [2**64, 2**63 - 1, 10**6])
def test_loader_huge_counts(name, value):
  """A count far beyond any machine is refused up front, naming the valid range."""
  if name == "num_epochs" and value == 10**6:
    return  # a million epochs is a valid (long) stream
  try:
    loader = ip.Loader(np.arange(8.0), **{**_LOADER_BASE, name: value})
  except TunedJaxError as err:
    assert f"{name}=" in str(err) and " <= " in str(err), str(err)
  else:
    loader.close()  # never iterated: it could start 10**6 processes
    pytest.fail(f"Loader({name}={value}) was accepted")


HANG = """
import numpy as np
from tunedjax import input_pipeline as ip
from tunedjax._errors import TunedJaxError
try:
  print(next(ip.Loader(np.arange(8.0), batch_size=4, worker_count=0, read_threads=2**64,
                       tuning_budget_s=0)))
except TunedJaxError as err:
  print("refused:", err)
"""


def test_loader_huge_read_threads_does_not_hang():
  """Once, read_threads=2**64 was accepted and the first batch hung (grain
  prefetched 2**65 batches on threads that keep the interpreter alive): run in
  a child process with a time limit, so that a hang fails instead."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(SRC.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
  try:
    done = subprocess.run([sys.executable, "-c", HANG], capture_output=True, text=True,
                          timeout=60, env=env, check=False)
  except subprocess.TimeoutExpired:
    pytest.fail("Loader(read_threads=2**64) hung on the first batch")
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith("refused: Loader(read_threads=...) must be an int >= 0 and <= "), (
      done.stdout)


# --- the Trainer --------------------------------------------------------------------------------

TRAINER_ARGS = ("metrics", "precision", "autotune", "checkpoint_dir", "checkpoint_every",
                "max_checkpoints", "mesh", "data_axis", "steps_per_execution", "seed",
                "progress", "rng_streams", "allreduce_dtype", "optimizer", "loss_fn",
                "schedule")


@settings(max_examples=3 * EXAMPLES)
@given(arg=_argument(TRAINER_ARGS))
@example(arg=("metrics", True))
@example(arg=("seed", 2**64))
@example(arg=("allreduce_dtype", np.array([1.0, 2.0])))
@example(arg=("progress", np.zeros((0, 0))))
def test_trainer_arguments(arg, tmp_path_factory):
  name, value = arg
  if name == "checkpoint_dir" and isinstance(value, str) and value.strip():
    value = str(tmp_path_factory.mktemp("ckpt") / value.replace("/", "_"))
  kwargs = {"progress": False, "autotune": False, name: value}
  optimizer = kwargs.pop("optimizer", m.optimizer())
  loss_fn = kwargs.pop("loss_fn", m.nnx_loss)
  with tj.config_context({"cache": {"dir": str(tmp_path_factory.mktemp("cache"))}}):
    attempt(lambda: tj.Trainer(m.NnxMLP(), optimizer, loss_fn, **kwargs), name,
            *ALIASES.get(name, ()))


@pytest.fixture(scope="module")
def trainer():
  return tj.Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, progress=False, autotune=False)


DATA = m.regression_data(16)
SMALL_INTS = st.one_of(JUNK, st.integers(-2, 2))


@settings(max_examples=3 * EXAMPLES)
@given(st.sampled_from(["train_data", "epochs", "steps", "batch_size", "eval_data",
                        "eval_every", "callbacks", "resume"]), SMALL_INTS)
@example(name="resume", value=np.zeros(2))
def test_fit_arguments(trainer, name, value):
  if name in ("steps", "epochs") and isinstance(value, int) and value > 2:
    value = -value  # a huge count is valid: it would train for ever
  kwargs = {"train_data": DATA, "batch_size": 8, "steps": trainer.step + 1, name: value}
  if name == "steps" and isinstance(value, int) and not isinstance(value, bool):
    kwargs["steps"] = trainer.step + value  # at most two steps more
  if name == "epochs":
    kwargs.pop("steps")
    if isinstance(value, int) and value > 0:
      kwargs["epochs"] = trainer.step // 2 + value  # 2 steps an epoch: a few more
  train_data = kwargs.pop("train_data")
  before = trainer.step
  ok, history = attempt(lambda: trainer.fit(train_data, **kwargs), name)
  if ok:
    assert all(math.isfinite(loss) for loss in history.losses)
    assert trainer.step >= before


@settings(max_examples=2 * EXAMPLES)
@given(st.sampled_from(["data", "batch_size"]), SMALL_INTS)
def test_evaluate_arguments(trainer, name, value):
  kwargs = {"data": DATA, "batch_size": 8, name: value}
  ok, result = attempt(lambda: trainer.evaluate(kwargs.pop("data"), **kwargs), name)
  if ok:
    assert all(math.isfinite(v) for v in result.values())


ARRAYS = st.one_of(
    st.tuples(st.integers(0, 5), st.integers(0, 9)).map(lambda s: np.ones(s, np.float32)),
    st.sampled_from([np.ones((3, 8), np.int32), np.full((2, 8), np.nan, np.float32),
                     np.ones((2, 8), np.float16), np.ones((4, 8, 1), np.float32)]))


@settings(max_examples=2 * EXAMPLES)
@given(ARRAYS, st.integers(1, 9))
def test_predict_arguments(trainer, x, batch_size):
  """Records of the wrong shape or dtype."""
  ok, out = attempt(lambda: trainer.predict(x, batch_size=batch_size), "x_or_data",
                    "predict", "inputs")
  if ok:
    assert np.shape(out)[0] == len(x)
    if np.isfinite(x).all():
      assert np.all(np.isfinite(np.asarray(out)))


@settings(max_examples=2 * EXAMPLES)
@given(_argument(("x_or_data", "batch_size")))
@example(arg=("x_or_data", None))
@example(arg=("x_or_data", "0"))
@example(arg=("batch_size", _Thing()))
def test_predict_junk(trainer, arg):
  """Anything for one argument (None, strings, dicts, lists of numbers ...)."""
  name, value = arg
  kwargs = {"x_or_data": DATA["x"], "batch_size": 8, name: value}
  ok, out = attempt(lambda: trainer.predict(kwargs.pop("x_or_data"), **kwargs), name,
                    "predict", "inputs")
  if ok:
    rows = len(DATA["x"]) if name == "batch_size" else len(value)
    assert np.shape(out)[0] == rows
    if name == "batch_size":  # split or not, the same outputs
      np.testing.assert_allclose(out, trainer.predict(DATA["x"]), rtol=1e-5, atol=1e-6)


# --- the command line ---------------------------------------------------------------------------

WORDS = ["cache", "show", "clear", "export", "import", "info", "--json", "--namespace",
         "--dir", "--backend", "--all", "--version", "-h", "conv", "layout", "cpu", "gpu",
         "nope", "", "0", "-1", "\x00", "{dir}/file", "{dir}/file/x", "{dir}/out.json",
         "demo", "--epochs", "--quick"]


@settings(max_examples=3 * EXAMPLES)
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=5))
def test_cli_arguments(words, tmp_path_factory):
  folder = tmp_path_factory.mktemp("cli")
  (folder / "file").write_text("not a folder")
  argv = [w.format(dir=folder) for w in words]
  if "demo" in argv:  # the demo trains for real: only its refused options
    argv = ["demo", "--epochs", next((w for w in argv if w not in ("demo", "--epochs",
                                                                   "--quick")), "0")]
    if argv[2].isdigit() and int(argv[2]) > 0:
      argv[2] = "0"
  out, err = io.StringIO(), io.StringIO()
  with tj.config_context({"cache": {"dir": str(folder / "cache")}}), \
      contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = cli.main(argv)
    except BaseException as e:  # pylint: disable=broad-except
      pytest.fail(f"tunedjax {' '.join(map(repr, argv))} raised {type(e).__name__}: {e}")
  assert code in (0, 1, 2), (argv, code)
  if code:
    assert err.getvalue().strip(), argv  # says why
