"""Part (c) of `benchmarks/gpu.py`: `tj.Trainer` on a miniGPT, autotune off against on.

Workers ``lm.float32`` and ``lm.mixed`` (``precision="mixed_bfloat16"``), each
with an empty tuning cache: a Trainer with ``autotune=False`` warms up (its
first `fit` compiles the step), then one with ``autotune=True`` (its first
`fit` also tunes and checks), then both are timed in interleaved rounds of a
few steps. Every `fit` asks for a long run (`Sizes.lm_horizon` steps: kernel
tuning must pay back within the fit's horizon, as in a real training run)
and a callback stops it after the steps wanted.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import tunedjax as tj
from _gpu_measure import (Deadline, Sizes, configure, emit_first_call, guarded, out_of_time,
                          report, steady_state, step_of)
from _gpu_models import MiniGPT, lm_batches, lm_loss
from _gpu_names import OFF, ON
from harness.workers import emit, say

PRECISIONS = {"mixed": "mixed_bfloat16", "float32": None}


class StopAfter(tj.callbacks.Callback):
  """Ends `fit` after `steps` reported steps (the step in flight still runs)."""

  def __init__(self, steps: int):
    self.steps, self.seen = steps, 0

  def on_step_end(self, trainer: Any, step: int, logs: Any) -> None:
    self.seen += 1
    if self.seen >= self.steps:
      trainer.stop_training = True


class _Fits:
  """A Trainer and what its `fit` calls take: ``run(k)`` trains about `k` steps."""

  def __init__(self, trainer: Any, batches: list[Any], horizon: int):
    self.trainer, self.batches, self.horizon = trainer, batches, horizon
    self.steps = 0

  def run(self, k: int = 1) -> None:
    before = self.trainer.step
    self.trainer.fit(self.batches, steps=before + self.horizon, callbacks=[StopAfter(k)])
    jax.block_until_ready(self.trainer.state)
    self.steps = self.trainer.step - before


def _trainer(sizes: Sizes, precision: str | None, autotune: bool) -> Any:
  # Initialised as one compiled program (eagerly, each initialiser would compile on its own).
  model = nnx.jit(lambda: MiniGPT(vocab=sizes.lm_vocab, tokens=sizes.lm_tokens,
                                  width=sizes.lm_width, heads=sizes.lm_heads,
                                  layers=sizes.lm_layers))()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  return tj.Trainer(model, optax.adamw(3e-4), lm_loss, precision=precision, autotune=autotune,
                    progress=False, mesh=mesh)


def _first_call_of(trainer: Any, history: Any) -> Any:
  """The step's first call: ``History.tuning["first_call"]`` (``{"total_s", "stages"}``),
  else its program's report."""
  if history.tuning.get("first_call"):
    return history.tuning["first_call"]
  step = getattr(trainer, "_train_step", None)
  try:
    return getattr(step.report(memory=False).last, "first_call", None)
  except Exception:  # pylint: disable=broad-except  # no report: no anatomy
    return None


def _buckets(attention: Any) -> list[str] | None:
  """``history.tuning["attention"]``'s buckets, each with its kernel and why."""
  if not isinstance(attention, Mapping):
    return None if attention is None else [str(attention)[:300]]
  return [f"{b.get('bucket')}: {b.get('kernel')} ({b.get('reason') or 'tuned'})"
          for b in attention.get("buckets", [])]


def _warm(name: str, sizes: Sizes, which: str, autotune: bool, batches: list[Any]) -> _Fits:
  fits = _Fits(_trainer(sizes, PRECISIONS[which], autotune), batches, sizes.lm_horizon)
  with step_of(f"{name}: first fit ({sizes.lm_warm_steps} steps)"):
    start = time.perf_counter()
    fits.run(sizes.lm_warm_steps)
    seconds = time.perf_counter() - start
  tuning = fits.trainer.history.tuning
  attention = tuning.get("attention")
  emit("row", variant=name, precision=which, warm_fit_s=seconds, warm_steps=fits.steps,
       attention=_buckets(attention))
  say(f"  {name}: first fit of {fits.steps} steps {seconds:.2f} s; attention: {attention}")
  emit_first_call(f"{which}, {name}", _first_call_of(fits.trainer, fits.trainer.history),
                  summary=str({k: v for k, v in tuning.items()
                               if k not in ("attention", "first_call", "first_calls")})[:2000])
  for other in tuning.get("first_calls", [])[:-1]:  # programs compiled before the last one
    say(f"  {which}, {name}: an earlier program's first call: {other}")
  return fits


def worker(which: str, sizes: Sizes, deadline: Deadline) -> None:
  """autotune off, then on, at one precision; then both interleaved."""
  configure({}, sizes)
  batches = lm_batches(4, sizes.lm_batch, sizes.lm_tokens, sizes.lm_vocab)
  fits = {}
  for name, autotune in ((OFF, False), (ON, True)):
    if out_of_time(f"{which}, {name}", deadline):
      continue
    got = guarded(name, lambda n=name, a=autotune: _warm(n, sizes, which, a, batches),
                  precision=which)
    if got is not None:
      fits[name] = got
  if OFF not in fits:
    return
  measured = steady_state(fits, OFF, deadline, sizes, round_s=sizes.lm_round_s, calls=(2, 100))
  for name, f in fits.items() if measured is not None else ():
    # ms per step: each timed run is one fit of about k steps; f.steps is the last one's count
    report(name, (measured[0], f.steps or measured[1]), precision=which)


WORKERS = {w: (lambda s, d, w=w: worker(w, s, d)) for w in PRECISIONS}
