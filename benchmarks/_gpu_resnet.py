"""Part (a) of `benchmarks/gpu.py`: the Flax ImageNet example's ResNet-50 train step.

Workers: ``resnet50.jax`` (`jax.jit` float32 and the example's ``dtype=bfloat16``,
interleaved), and one process per `tj.jit` variant, each with an empty tuning
cache, so that each first call is a new user's: ``resnet50.tj_all``
(``set_config(None)``), ``resnet50.tj_all_mp`` (``set_config(None)`` plus
mixed precision) and ``resnet50.tj_mp_layout`` (mixed precision and layout,
kernel selection off). The PyTorch rows are in `_gpu_torch`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import tunedjax as tj
from _gpu_measure import (Deadline, Runner, Sizes, anatomy, configure, first_call, guarded,
                          out_of_time, steady_state, timing_fields)
from _gpu_models import image_batch, resnet50, resnet_train_step
from _gpu_names import JIT_BF16, JIT_F32, TJ_ALL, TJ_ALL_MP, TJ_MP_LAYOUT
from harness.workers import emit, say

BASELINE = JIT_BF16  # the worker's baseline


def _config(worker: str) -> Any:
  """The `set_config` argument of a `tj.jit` worker."""
  if worker == "tj_all":
    return None
  if worker == "tj_all_mp":
    return tj.Config.from_dict({"mixed_precision": {"enable": True}},
                               base=tj.Config.all_tuners_on())
  return {"mixed_precision": {"enable": True}, "layout": {"enable": True}}


NAMES = {"tj_all": TJ_ALL, "tj_all_mp": TJ_ALL_MP, "tj_mp_layout": TJ_MP_LAYOUT}


def _runner(sizes: Sizes, dtype: Any, jit: Any) -> Runner:
  model = resnet50(stages=sizes.stages, width=sizes.width, dtype=dtype)
  init, step = resnet_train_step(model)
  x, y = image_batch(sizes.batch, sizes.image)
  return Runner(jit(step, donate_argnums=0), init(x), x, y, stateful=True)


def _row(name: str, sizes: Sizes, first_s: float, runner: Runner, timings, k: int) -> None:
  fields: dict = {"first_call_s": first_s}
  if timings is not None:
    fields.update(timing_fields(timings, k, name))
    fields["images_per_s"] = sizes.batch / (fields["ms"] / 1e3)
  emit("row", variant=name, **fields)
  say(f"  {name}: " + ", ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}"
                                for k_, v in fields.items()))


def worker_jax(sizes: Sizes, deadline: Deadline) -> None:
  """`jax.jit` in float32 and with the example's bfloat16 dtype, then both interleaved."""
  runners, firsts = {}, {}
  for name, dtype in ((JIT_F32, jnp.float32), (JIT_BF16, jnp.bfloat16)):
    if out_of_time(name, deadline):
      continue
    runner = guarded(name, lambda d=dtype: _runner(sizes, d, jax.jit))
    first = runner and guarded(name, lambda r=runner, n=name: first_call(n, r))
    if first is not None and runner is not None:
      runners[name], firsts[name] = runner, first
      emit("row", variant=name, first_call_s=first, first_loss=float(runner.out))
  if not runners:
    return
  base = BASELINE if BASELINE in runners else next(iter(runners))
  measured = steady_state(runners, base, deadline, sizes)
  for name, runner in runners.items():
    _row(name, sizes, firsts[name], runner, *(measured or (None, 0)))


def worker_tj(worker: str, sizes: Sizes, deadline: Deadline) -> None:
  """One `tj.jit` variant in a fresh process: first call, its anatomy, steady state."""
  name = NAMES[worker]
  configure(_config(worker), sizes)
  say(f"  {name}: config {tj.get_config().to_dict()}")

  def run() -> None:
    runner = _runner(sizes, jnp.float32, tj.jit)
    first = first_call(name, runner)
    emit("row", variant=name, first_call_s=first, first_loss=float(runner.out))
    anatomy(name, runner.fn)
    measured = steady_state({name: runner}, name, deadline, sizes)
    _row(name, sizes, first, runner, *(measured or (None, 0)))

  guarded(name, run)


WORKERS = {"jax": worker_jax,
           **{w: (lambda s, d, w=w: worker_tj(w, s, d)) for w in NAMES}}
