"""The whole program is the judge: a kernel faster alone that loses in the Trainer's step.

Deterministic by construction: the tuner's timer is faked (the test kernels
are 10x faster than xla alone, so they win their buckets), and the clock
the whole-program check reads is a fake one that only the program moves, by
`jax.debug.callback`s inside it: every step costs `BASE_S`; a kernel of
`SLOW` costs `SLOW_S` more per run (as a kernel that forces a layout change
around itself would), one of `FAST` saves `FAST_S`. Nothing real is timed.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tunedjax import _tuning
from tunedjax.autotune import _registry, _verdict, _verify
from tunedjax.trainer import Trainer
from tests.autotune.selection_helpers import StepClock

BASE_S, SLOW_S, FAST_S = 0.100, 0.030, 0.010
SLOW, FAST = "t_slow_in_program", "t_fast_in_program"
STEPS = 150




CLOCK = StepClock()


def _xla(lhs, rhs, spec):
  return _registry.get_kernel("conv", "xla").fn(lhs, rhs, spec)


def _costing(seconds):
  def kernel(lhs, rhs, spec):
    out = _xla(lhs, rhs, spec)
    jax.debug.callback(lambda: CLOCK.advance(seconds))
    return out
  return kernel


def _is_forward_of(out_channels):
  """Applicable to the forward convolution with `out_channels` outputs only."""
  def applicable(spec, platform):
    del platform
    lhs, rhs, out = spec.dimension_numbers
    return spec.rhs_shape[rhs[0]] == out_channels and spec.lhs_shape[lhs[1]] in (3, 4)
  return applicable


@pytest.fixture
def kernels(monkeypatch):
  """`SLOW` for the first conv (4 outputs), `FAST` for the second (6 outputs):
  both 10x faster than xla alone, as the fake tuning timer says."""
  _registry.register_kernel("conv", SLOW, _costing(SLOW_S), applicable=_is_forward_of(4),
                            replace=True)
  _registry.register_kernel("conv", FAST, _costing(-FAST_S), applicable=_is_forward_of(6),
                            replace=True)
  monkeypatch.setattr(_tuning, "time_interleaved", lambda runners, rounds=5, **kw: {
      n: [0.001 if n in (SLOW, FAST) else 0.010] * max(rounds, 1) for n in runners})
  monkeypatch.setattr(_verify, "_clock", CLOCK)
  yield
  _registry.unregister_kernel("conv", SLOW)
  _registry.unregister_kernel("conv", FAST)


class _Net(nnx.Module):
  def __init__(self):
    self.a = nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0))
    self.b = nnx.Conv(4, 6, (3, 3), rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.b(nnx.relu(self.a(x)))


def _loss(model, batch):
  jax.debug.callback(lambda: CLOCK.advance(BASE_S))
  return ((model(batch["x"]).mean(axis=(1, 2, 3)) - batch["y"]) ** 2).mean()


def _data(steps):
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(8 * steps, 6, 6, 3)).astype(np.float32),
          "y": rng.normal(size=(8 * steps,)).astype(np.float32)}


def _trainer(cache_dir):
  # payback off: whether tuning pays back depends on real compile times.
  config = {"kernel": {"enable": True, "tuning_range": [1, 10], "payback": False},
            "cache": {"dir": str(cache_dir)}, "dataloader": {"enable": False},
            "layout": {"enable": False}, "mixed_precision": {"enable": False}}
  return Trainer(_Net(), optax.sgd(0.01), _loss, autotune=config, progress=False,
                 mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))


def _kernel_counts(trainer):
  return trainer.history.tuning["kernels"]


def test_a_kernel_faster_alone_that_loses_in_the_program_is_undone_and_cached(
    kernels, tmp_path, caplog):
  caplog.set_level(logging.INFO, "tunedjax.jit")
  first = _trainer(tmp_path)
  history = first.fit(_data(STEPS), batch_size=8, steps=STEPS)
  check = history.tuning["verification"]
  # Alone, both kernels won their buckets; in the program, SLOW made the step
  # slower (tuned/untuned = (0.1 + 0.03 - 0.01) / 0.1).
  assert any(SLOW in k and "tuned" in k for k in _kernel_counts(first))
  assert check["outcome"] == _verify.FOUND_LOSERS
  assert check["tuned_over_untuned"] == pytest.approx(1.2)
  assert [(d["kernel"], d["how"]) for d in check["lost"]] == [(SLOW, "alone")]
  assert check["vetoed"] == 1 and check["decisions"] == 2
  # The untuned program is the observe phase's (no compile); at most the two
  # variants of the bisection are (which first depends on the buckets' ids).
  assert check["compiles"] in (1, 2)
  # The best program it saw runs from then on: FAST kept, SLOW undone.
  last = [CLOCK.now]
  batch = {"x": _data(1)["x"], "y": _data(1)["y"]}
  with first._running():  # the trainer's config: the program it trains with
    first.state, out = first._programs.train_step(first.state, first.placement.put(batch))
    jax.block_until_ready(out)
  assert CLOCK.now - last[0] == pytest.approx(BASE_S - FAST_S)
  # The verdict is cached under the program's context, for SLOW's bucket.
  entries = _tuning.Cache(tmp_path).entries(_verdict.NAMESPACE)
  assert len(entries) == 1
  (lost,) = entries[0].value["lost"].values()
  assert lost["kernel"] == SLOW and lost["how"] == "alone"
  assert list(entries[0].value["kept"].values()) == [FAST]

  # A second Trainer with the same cache gives SLOW's bucket its default
  # (reason "loses in context"), keeps FAST, and does not check again.
  second = _trainer(tmp_path)
  start = CLOCK.now
  history = second.fit(_data(20), batch_size=8, steps=20)
  assert history.tuning["verification"]["outcome"] == "verified earlier (cached)"
  counts = _kernel_counts(second)
  assert counts.get("conv xla (loses in context)") == 1
  assert any(FAST in k for k in counts) and not any(SLOW in k for k in counts)
  # A warm cache: the observe phase's step 0 runs the kept program too, compiled
  # once for both phases.
  assert CLOCK.now - start == pytest.approx(20 * (BASE_S - FAST_S))
  assert len(second._programs.train_step.report(memory=False)) == 1


def test_with_k_steps_per_call_the_k_steps_program_is_checked(kernels, tmp_path):
  config = {"kernel": {"enable": True, "tuning_range": [1, 10], "payback": False},
            "cache": {"dir": str(tmp_path)}, "dataloader": {"enable": False},
            "layout": {"enable": False}, "mixed_precision": {"enable": False}}
  trainer = Trainer(_Net(), optax.sgd(0.01), _loss, autotune=config, progress=False,
                    steps_per_execution=4,
                    mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))
  history = trainer.fit(_data(400), batch_size=8, steps=400)
  check = history.tuning["verification"]
  assert check["outcome"] == _verify.FOUND_LOSERS
  assert [(d["kernel"], d["how"]) for d in check["lost"]] == [(SLOW, "alone")]
  assert trainer._programs.train_step.verification() is None  # the one-step program: not checked
  assert np.isfinite(history.losses).all()


def test_the_attention_summary_is_worked_out_again_only_after_a_new_trace(tmp_path):
  from tunedjax.demo import TransformerLM, lm_data, lm_loss
  config = {"kernel": {"enable": True, "tuning_range": [1, 10]},
            "cache": {"dir": str(tmp_path)}, "dataloader": {"enable": False},
            "layout": {"enable": False}}
  trainer = Trainer(TransformerLM(vocab=32, tokens=8, width=16, layers=1, heads=2),
                    optax.sgd(0.05), lm_loss, autotune=config, progress=False,
                    mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))
  calls = []
  summary = trainer.attention.summary
  trainer.attention.summary = lambda **kw: calls.append(1) or summary(**kw)
  data = [{"ids": r} for r in lm_data(1, 2 * 12, 8, vocab=32)["ids"].reshape(12, 2, 9)]
  first = trainer.fit(data, steps=4).tuning["attention"]
  assert calls == [1] and first["modules"]
  for steps in (6, 8):  # no new trace: the summary (an explain, a trace) is reused
    assert trainer.fit(data, steps=steps).tuning["attention"] == first
  assert calls == [1]
