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
from _gpu_measure import Deadline, Runner, Sizes, compare, configure
from _gpu_models import image_batch, resnet50, resnet_train_step
from _gpu_names import JIT_BF16, JIT_F32, TJ_ALL, TJ_ALL_MP, TJ_MP_LAYOUT
from harness.workers import say

NAMES = {"tj_all": TJ_ALL, "tj_all_mp": TJ_ALL_MP, "tj_mp_layout": TJ_MP_LAYOUT}


def _config(worker: str) -> Any:
  """The `set_config` argument of a `tj.jit` worker."""
  if worker == "tj_all":
    return None
  if worker == "tj_all_mp":
    return tj.Config.from_dict({"mixed_precision": {"enable": True}},
                               base=tj.Config.all_tuners_on())
  return {"mixed_precision": {"enable": True}, "layout": {"enable": True}}


def _runner(sizes: Sizes, dtype: Any, jit: Any) -> Runner:
  model = resnet50(stages=sizes.stages, width=sizes.width, dtype=dtype)
  init, step = resnet_train_step(model)
  x, y = image_batch(sizes.batch, sizes.image)
  return Runner(jit(step, donate_argnums=0), init(x), x, y, stateful=True)


def worker(which: str, sizes: Sizes, deadline: Deadline) -> None:
  """``jax``: `jax.jit` in float32 and with the example's bfloat16 dtype (the baseline),
  interleaved; else one `tj.jit` variant in a fresh process, with its first-call anatomy."""
  if which == "jax":
    builds = {JIT_F32: lambda: _runner(sizes, jnp.float32, jax.jit),
              JIT_BF16: lambda: _runner(sizes, jnp.bfloat16, jax.jit)}
  else:
    configure(_config(which), sizes)
    say(f"  {NAMES[which]}: config {tj.get_config().to_dict()}")
    builds = {NAMES[which]: lambda: _runner(sizes, jnp.float32, tj.jit)}
  compare(builds, JIT_BF16, deadline, sizes, tuned=list(NAMES.values()),
          first=lambda name, runner: {"first_loss": float(runner.out)},
          rate=("images_per_s", sizes.batch))


WORKERS = {w: (lambda s, d, w=w: worker(w, s, d)) for w in ("jax", *NAMES)}
