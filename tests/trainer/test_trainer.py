"""tunedjax.Trainer: training nnx and linen models, determinism, data kinds, sharding,
steps_per_execution, loss scaling, evaluate/predict, progress, callbacks, bad input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import tunedjax as tj
from tests.trainer import models as m
from tunedjax.trainer import Callback, Trainer, TrainerError

QUIET = {"autotune": False, "progress": False}


def _nnx_trainer(**kwargs):
  options = {**QUIET, **kwargs}
  return Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, **options)


def _linen_trainer(data, **kwargs):
  options = {**QUIET, **kwargs}
  example = {k: v[:16] for k, v in data.items()}
  return Trainer(m.LinenMLP(), m.optimizer(), m.linen_loss, example_batch=example, **options)


# --- training ----------------------------------------------------------------------


def test_nnx_model_trains_and_the_same_seed_gives_the_same_history():
  data = m.regression_data()
  first = _nnx_trainer().fit(data, batch_size=16, epochs=3)
  again = _nnx_trainer().fit(data, batch_size=16, epochs=3)
  assert len(first.losses) == 3 * 16 and first.steps == list(range(48))
  assert np.mean(first.losses[-5:]) < 0.3 * np.mean(first.losses[:5])
  assert first.losses == again.losses  # bitwise: same seed, same data order
  assert [e["epoch"] for e in first.epochs] == [0, 1, 2]
  assert all(set(mm) == {"mae"} for mm in first.metrics)


def test_linen_model_trains_with_dropout_and_batch_stats():
  data = m.regression_data()
  trainer = _linen_trainer(data)
  before = trainer.evaluate(data)["loss"]
  history = trainer.fit(data, batch_size=16, epochs=3)
  assert trainer.evaluate(data)["loss"] < 0.3 * before
  assert np.mean(history.losses[-5:]) < 0.3 * np.mean(history.losses[:5])
  stats = trainer.variables["batch_stats"]
  assert float(jnp.abs(jax.tree_util.tree_leaves(stats)[0]).sum()) > 0  # updated


def test_trained_nnx_model_object_holds_the_trained_parameters():
  data = m.regression_data()
  model = m.NnxMLP()
  before = np.asarray(model.fc1.kernel.get_value()).copy()
  trainer = Trainer(model, m.optimizer(), m.nnx_loss, **QUIET)
  trainer.fit(data, batch_size=16, steps=5)
  after = np.asarray(model.fc1.kernel.get_value())
  assert not np.array_equal(before, after)
  np.testing.assert_array_equal(after, np.asarray(trainer.state.params["fc1"]["kernel"]))


def test_iterable_of_batches_and_a_loader_give_epochs_and_steps():
  data = m.regression_data(n=128)
  trainer = _nnx_trainer()
  history = trainer.fit(m.batches(data, 16), epochs=2)
  assert len(history.losses) == 16 and len(history.epochs) == 2
  loader = tj.input_pipeline.Loader(data, batch_size=16, shuffle=True, seed=1,
                                    worker_count=0, read_threads=0, tuning_budget_s=0)
  history = _nnx_trainer().fit(loader, steps=12)
  assert len(history.losses) == 12 and len(history.epochs) == 1  # 8 batches per epoch
  assert loader.position == 12


def test_fit_counts_steps_and_epochs_from_the_start_of_training():
  data = m.regression_data(n=128)
  trainer = _nnx_trainer()
  trainer.fit(data, batch_size=16, steps=5)
  history = trainer.fit(data, batch_size=16, steps=12)
  assert history.steps == list(range(12)) and trainer.step == 12
  trainer.fit(data, batch_size=16, steps=12)  # already there: nothing to do
  assert trainer.step == 12


def test_steps_per_execution_runs_the_same_steps_in_one_scan():
  data = m.regression_data(n=160)
  one = _nnx_trainer().fit(data, batch_size=16, epochs=2)
  trainer = _nnx_trainer(steps_per_execution=4)
  sunk = trainer.fit(data, batch_size=16, epochs=2)
  assert sunk.steps == one.steps  # 20 steps: 5 calls of 4
  np.testing.assert_allclose(sunk.losses, one.losses, rtol=1e-5)
  assert len(trainer._programs.multi_step.report()) == 1


def test_data_parallel_over_8_devices_matches_one_device(mesh8):
  data = m.regression_data()
  one = _nnx_trainer(mesh=Mesh(np.array(jax.devices()[:1]), ("data",)))
  eight = _nnx_trainer()  # default: every device on the "data" axis
  assert eight.placement.shards == 8
  h1 = one.fit(data, batch_size=16, epochs=2)
  h8 = eight.fit(data, batch_size=16, epochs=2)
  np.testing.assert_allclose(h8.losses, h1.losses, rtol=2e-4, atol=1e-6)
  params = jax.tree_util.tree_leaves(eight.state.params)[0]
  assert params.sharding.is_fully_replicated


# --- evaluation and prediction -----------------------------------------------------


def test_evaluate_weights_batches_and_predict_compiles_once_per_shape():
  data = m.regression_data(n=100)
  trainer = _nnx_trainer(metrics={"max_err": lambda model, b: jnp.abs(
      model(b["x"]) - b["y"]).max()})
  whole = trainer.evaluate(data)
  batched = trainer.evaluate(data, batch_size=16)  # 6 batches of 16 and one of 4
  assert set(whole) == {"loss", "mae", "max_err"}
  assert math.isclose(whole["loss"], batched["loss"], rel_tol=1e-5)
  out = trainer.predict(data["x"], batch_size=32)
  assert out.shape == (100,)
  trainer.predict(data["x"][:32])
  assert len(trainer._programs.predictors[None].report()) == 2  # 32 and the short 4
  np.testing.assert_allclose(out, trainer.predict(data["x"]), rtol=1e-5, atol=1e-6)


# --- loss scaling and non-finite steps ---------------------------------------------


def _with_bad_step(data, bad_batch: int, batch_size: int = 16):
  out = m.batches(data, batch_size)
  out[bad_batch] = {**out[bad_batch], "x": np.full_like(out[bad_batch]["x"], np.inf)}
  return out


def test_mixed_float16_skips_a_non_finite_step_and_counts_it():
  data = m.regression_data(n=128)
  trainer = _nnx_trainer(precision="mixed_float16")
  assert type(trainer.loss_scale).__name__ == "DynamicLossScale"
  history = trainer.fit(_with_bad_step(data, 3), epochs=1)
  assert 3 in history.skipped and history.skipped_steps >= 1
  leaves = jax.tree_util.tree_leaves(trainer.state.params)
  assert all(bool(jnp.isfinite(p).all()) for p in leaves)  # no NaN reached the params
  assert trainer.state.loss_scale.loss_scale < 2.0**15  # it backed off


def test_a_non_finite_loss_without_loss_scaling_is_an_error_naming_the_step():
  data = m.regression_data(n=128)
  with pytest.raises(TrainerError, match=r"not finite at step 2 .*loss scaling is off"):
    _nnx_trainer().fit(_with_bad_step(data, 2), epochs=1)


def test_bfloat16_precision_runs_the_autocast_pass():
  data = m.regression_data(n=128)
  trainer = _nnx_trainer(precision="mixed_bfloat16")
  assert trainer.config.mixed_precision.enable
  assert type(trainer.loss_scale).__name__ == "NoOpLossScale"
  history = trainer.fit(data, batch_size=16, epochs=2)
  assert history.tuning["precision"] == "params=float32,compute=bfloat16,output=float32"
  assert "mixed_precision" in history.tuning["passes"]
  assert np.mean(history.losses[-4:]) < 0.5 * np.mean(history.losses[:4])


# --- progress, callbacks, tuning report -------------------------------------------


def test_plain_log_lines_when_output_is_not_a_terminal(capsys):
  data = m.regression_data(n=64)
  Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, autotune=False).fit(
      data, batch_size=16, epochs=1)
  err = capsys.readouterr().err
  assert "train step 1/4" in err and "train step 4/4 (100%)" in err and "\r" not in err
  Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, **QUIET).fit(data, batch_size=16, epochs=1)
  assert capsys.readouterr().err == ""


def test_callbacks_see_steps_and_epochs_and_can_stop_training():
  seen = []

  class Recorder(Callback):

    def on_step_end(self, trainer, step, logs):
      seen.append(("step", step, round(logs["loss"], 6)))
      if step == 5:
        trainer.stop_training = True

    def on_epoch_end(self, trainer, epoch, logs):
      seen.append(("epoch", epoch))

  data = m.regression_data(n=64)
  history = _nnx_trainer().fit(data, batch_size=16, epochs=3, callbacks=[Recorder()])
  steps = [s for kind, s, *_ in seen if kind == "step"]
  assert ("epoch", 0) in seen and steps[:6] == list(range(6))
  assert len(history.losses) <= 7  # stops after the step in flight


def test_history_says_what_the_tuners_chose():
  data = m.regression_data(n=64)
  with tj.config_context({"cache": {"dir": None}}):
    trainer = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, autotune=True, progress=False)
  assert trainer.config.kernel.enable and trainer.config.layout.enable
  history = trainer.fit(data, batch_size=16, epochs=1)
  assert history.tuning["level"] == "O1"
  assert history.tuning["passes"][:1] == ["layout"]
  assert history.tuning["precision"] == "float32"


# --- bad input ---------------------------------------------------------------------


def test_bad_batches_and_losses_are_clear_errors():
  data = m.regression_data(n=64)
  good = m.batches(data, 16)
  wrong = good[:2] + [{"x": good[2]["x"][:, :4], "y": good[2]["y"]}]
  with pytest.raises(TrainerError, match=r"Batch 2 of train_data does not match the first"):
    _nnx_trainer().fit(wrong, epochs=1)
  renamed = good[:1] + [{"inputs": good[1]["x"], "y": good[1]["y"]}]
  with pytest.raises(TrainerError, match=r"Batch 1 .*does not match"):
    _nnx_trainer().fit(renamed, epochs=1)
  vector_loss = lambda model, b: (model(b["x"]) - b["y"]) ** 2  # noqa: E731
  with pytest.raises(TrainerError, match=r"scalar floating loss.*float32\[16\]"):
    Trainer(m.NnxMLP(), m.optimizer(), vector_loss, **QUIET).fit(good, epochs=1)
  with pytest.raises(TrainerError, match=r"batch of 12 records cannot be split evenly"):
    _nnx_trainer().fit(data, batch_size=12, epochs=1)
  with pytest.raises(TrainerError, match=r"pass batch_size="):
    _nnx_trainer().fit(data, epochs=1)


def test_bad_options_are_clear_errors():
  with pytest.raises(TrainerError, match=r"optax GradientTransformation"):
    Trainer(m.NnxMLP(), "adam", m.nnx_loss)
  with pytest.raises(TrainerError, match=r"linen module .*needs example_batch="):
    Trainer(m.LinenMLP(), m.optimizer(), m.linen_loss)
  with pytest.raises(TrainerError, match=r"flax nnx.Module or linen.Module"):
    Trainer(lambda x: x, m.optimizer(), m.nnx_loss)
  with pytest.raises(TrainerError, match=r"steps_per_execution must be an int >= 1, got 0"):
    _nnx_trainer(steps_per_execution=0)
  with pytest.raises(TrainerError, match=r"progress must be True, False"):
    _nnx_trainer(progress="fancy")
  with pytest.raises(TrainerError, match=r"data_axis='model' is not an axis"):
    _nnx_trainer(data_axis="model")
  with pytest.raises(tj.mixed_precision.PolicyError):
    _nnx_trainer(precision="float17")
  with pytest.raises(TrainerError, match=r"autotune must be True, False"):
    _nnx_trainer(autotune=3)


@pytest.mark.slow
def test_a_loader_is_tuned_with_the_step_before_the_first_step_and_data_is_unchanged(tmp_path):
  data = m.regression_data(n=128)

  def loader(**knobs):
    return tj.input_pipeline.Loader(data, batch_size=16, seed=3, tuning_steps=3,
                                    max_workers=1, tuning_budget_s=20, **knobs)

  fixed = _nnx_trainer().fit(loader(worker_count=0, read_threads=0), steps=10)
  with tj.config_context({"cache": {"dir": str(tmp_path)}}):
    trainer = _nnx_trainer()
    tuned = trainer.fit(loader(worker_count="auto", read_threads=0), steps=10)
  choice = tuned.tuning["dataloader"]
  assert choice["worker_count"] in (0, 1) and not choice["from_cache"]
  # 10 steps: no worker start pays (nor, with a light pipeline, any trial: "no payback")
  assert all(t["worker_count"] == 0 for t in choice["trials"])
  assert choice["trials"] or choice["stopped"] in ("no payback", "consumer-bound")
  assert tuned.losses == fixed.losses  # tuning read its own batches and ran a copy of the step


def test_gradients_all_reduced_in_bfloat16_halve_the_wire_and_train_alike(mesh8):
  from flax import nnx
  data = m.regression_data()

  def plain_mlp():  # no batch statistics: per-shard and global steps compute the same loss
    return nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), nnx.relu,
                          nnx.Linear(32, 1, rngs=nnx.Rngs(1)))

  loss = lambda model, b: ((model(b["x"])[:, 0] - b["y"]) ** 2).mean()  # noqa: E731
  h_plain = Trainer(plain_mlp(), m.optimizer(), loss, **QUIET).fit(data, batch_size=16, epochs=2)
  narrow = Trainer(plain_mlp(), m.optimizer(), loss, allreduce_dtype="bfloat16", **QUIET)
  h_narrow = narrow.fit(data, batch_size=16, epochs=2)
  np.testing.assert_allclose(h_narrow.losses, h_plain.losses, rtol=0.02, atol=1e-3)
  assert h_narrow.losses[0] == pytest.approx(h_plain.losses[0], rel=1e-5)  # before any update
  batch = narrow.placement.put(m.batches(data, 16)[0])
  # The program reduces in bfloat16 (XLA:CPU then promotes a bf16 all-reduce to float32 on
  # the host, as tests/mixed_precision/test_allreduce.py shows; GPUs keep it).
  from tests.mixed_precision.test_allreduce import _lowered_all_reduce_types
  types = _lowered_all_reduce_types(narrow._programs.train_step.lower(narrow.state, batch).as_text())
  assert {"bf16"} in types, types  # the gradients' reduction
  # BatchNorm, dropout and loss scaling work per shard too.
  bn = _nnx_trainer(allreduce_dtype="bfloat16", precision="mixed_float16").fit(
      data, batch_size=64, epochs=4)  # 8 records per device for its BatchNorm
  assert np.isfinite(bn.losses).all() and np.mean(bn.losses[-4:]) < np.mean(bn.losses[:4])
  with pytest.raises(TrainerError, match=r"allreduce_dtype must be None, 'compute' or a floating"):
    _nnx_trainer(allreduce_dtype="int8")
  with pytest.raises(TrainerError, match=r"'compute' needs precision="):
    _nnx_trainer(allreduce_dtype="compute")


def test_kernels_are_tuned_even_when_an_earlier_run_left_the_step_counter_in_apply(
    tmp_path, request):
  # The loader tuner's consumer compiles the step before the first step: it must
  # do so in step 0's phase, or the apply-phase program (misses use xla) would be
  # reused by the tune phase and no kernel would ever be tuned.
  # The default session is the process's: the tests run after this one in the same
  # process must not find its step counter in apply (they would tune nothing).
  request.addfinalizer(tj.autotune.default_session().reset)
  rng = np.random.default_rng(0)
  data = {"x": rng.normal(size=(48, 8, 8, 3)).astype(np.float32),
          "y": rng.normal(size=(48,)).astype(np.float32)}
  model = nnx.Sequential(nnx.Conv(3, 4, (3, 3), feature_group_count=1, rngs=nnx.Rngs(0)),
                         nnx.relu, nnx.Conv(4, 4, (3, 3), feature_group_count=4,
                                            rngs=nnx.Rngs(1)))
  loss = lambda model, b: ((model(b["x"]).mean(axis=(1, 2, 3)) - b["y"]) ** 2).mean()  # noqa: E731
  # payback off: 3 steps of these tiny convolutions could not pay back their tuning.
  config = {"kernel": {"enable": True, "tuning_range": [1, 10], "payback": False},
            "cache": {"dir": str(tmp_path)},
            "dataloader": {"enable": True, "max_workers": 0, "tuning_steps": 3}}
  tj.autotune.step(index=50)  # as a finished run would leave it
  trainer = Trainer(model, m.optimizer(), loss, autotune=config, progress=False)
  loader = tj.input_pipeline.Loader(data, batch_size=16, seed=0, worker_count=0, read_threads=0,
                                    tuning_budget_s=5)
  history = trainer.fit(loader, steps=3)
  assert "dataloader" in history.tuning
  kernels = history.tuning["kernels"]
  assert any(k.endswith("(tuned)") for k in kernels), kernels
  assert not any(k.endswith("(miss)") for k in kernels), kernels
  # Tuned before step 0, so no step runs (or compiles) the observe phase's all-xla program.
  reports = trainer._programs.train_step.report(memory=False)
  assert len(reports) == 1 and not any("(observe)" in k for r in reports for k in r.kernels)
  # And traced once: the loader's scratch copy of the state (its PRNG key
  # included) has the state's shardings, so the real steps reuse its program.
  assert trainer._programs.train_step.trace_count == 1


def test_the_scratch_copy_of_a_state_compiles_nothing_and_keeps_its_shardings():
  from tunedjax.trainer import _trainer  # pylint: disable=import-outside-toplevel
  trainer = _nnx_trainer()
  state = trainer.state
  compiles = []
  listener = lambda event, duration, **kw: compiles.append(event) if (  # noqa: E731
      event.endswith("backend_compile_duration")) else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    copy = _trainer._copied(state)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []  # jnp.copy per leaf compiled a program per leaf shape
  for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(copy)):
    assert a.sharding == b.sharding and a.committed == b.committed
    assert jax.typeof(a) == jax.typeof(b)
    a_data = jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a
    b_data = jax.random.key_data(b) if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key) else b
    np.testing.assert_array_equal(np.asarray(a_data), np.asarray(b_data))
  jax.tree_util.tree_map(lambda x: x.delete(), copy)  # new buffers: the state's stay
  assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(state))


def test_training_does_not_delete_the_arrays_the_model_was_built_with():
  # The train step donates its state; on one device a plain device_put would
  # hand the step the model's own buffers, and the first step would delete them.
  model = m.NnxMLP()
  before = [np.array(x) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))]
  held = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))  # the user's references
  data = m.regression_data()
  Trainer(model, m.optimizer(), m.nnx_loss, **QUIET).fit(data, batch_size=16, steps=2)
  for array, value in zip(held, before):
    assert not array.is_deleted()
    np.testing.assert_array_equal(np.asarray(array), value)
  # A second trainer built from arrays the first has trained from works.
  twin = m.NnxMLP()
  nnx.update(twin, nnx.state(model))
  Trainer(twin, m.optimizer(), m.nnx_loss, **QUIET).fit(data, batch_size=16, steps=1)
