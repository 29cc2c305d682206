"""Parts (a) and (d) of `benchmarks/gpu.py`: ResNet-50, its convolutions, the layout pass.

* ``resnet50.jax``: the Flax ImageNet example's train step under `jax.jit`,
  float32 and the example's ``dtype=bfloat16``, interleaved; one process per
  `tj.jit` variant, each with an empty tuning cache, so that each first call
  is a new user's: ``resnet50.tj_all`` (``set_config(None)``),
  ``resnet50.tj_all_mp`` (``set_config(None)`` plus mixed precision) and
  ``resnet50.tj_mp_layout`` (mixed precision and layout, kernel selection
  off). The PyTorch rows are in `_gpu_torch`.
* ``conv_buckets``: ResNet-50's forward convolutions, NHWC, the ``pallas``
  implicit-GEMM kernel (Triton on a GPU, interpret mode elsewhere) against
  XLA's convolution (cuDNN on a GPU), float32 and bfloat16, one row per bucket
  as it is measured.
* ``layout_f16``: a float16 ResNet-50 written NCHW (as a PyTorch port), its
  SGD train step under `jax.jit` against `tj.jit` with only the layout pass
  (the GPU prefers NHWC for half precision), interleaved.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import harness as _harness
import tunedjax as tj
from _gpu_measure import (Deadline, Runner, Sizes, compare, configure, guarded, out_of_time,
                          report, steady_state, step_of)
from _gpu_models import functional_resnet, image_batch, resnet50, resnet_train_step
from _gpu_names import JIT_BF16, JIT_F32, LAYOUT_PASS, LAYOUT_PLAIN, TJ_ALL, TJ_ALL_MP, TJ_MP_LAYOUT
from harness.workers import emit, say
from tunedjax.ops.conv import ConvSpec
from tunedjax.ops.conv import _pallas as conv_pallas

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


RESNET50_BUCKETS = (  # (spatial, cin, cout, kernel, stride): ResNet-50's forward convs
    (224, 3, 64, 7, 2), (56, 64, 64, 1, 1), (56, 64, 64, 3, 1), (56, 64, 256, 1, 1),
    (56, 256, 64, 1, 1), (56, 128, 128, 3, 2), (28, 128, 128, 3, 1), (28, 128, 512, 1, 1),
    (14, 256, 256, 3, 1), (14, 1024, 256, 1, 1), (7, 512, 512, 3, 1), (7, 512, 2048, 1, 1),
)


def _bucket(sizes: Sizes, rng, bucket, dtype, deadline: Deadline) -> None:
  hw, cin, cout, k, s = bucket
  hw = max(hw // sizes.bucket_scale, k)
  cin, cout = min(cin, sizes.bucket_channels), min(cout, sizes.bucket_channels)
  name = f"{k}x{k}/{s}, {hw}x{hw}, {cin}->{cout}"
  fields = {"bucket": name, "dtype": jnp.dtype(dtype).name}
  x = jnp.asarray(rng.normal(size=(sizes.bucket_batch, hw, hw, cin)), dtype)
  w = jnp.asarray(rng.normal(size=(k, k, cin, cout), scale=(k * k * cin) ** -0.5), dtype)
  spec = ConvSpec.from_arrays(x, w, window_strides=(s, s), padding="SAME",
                              dimension_numbers=("NHWC", "HWIO", "NHWC"))
  if not conv_pallas.supports(spec):
    emit("row", variant="pallas", note="not supported", **fields)
    return
  xla = jax.jit(lambda a, b: lax.conv_general_dilated_p.bind(a, b, **spec.params()))
  pallas = jax.jit(lambda a, b: conv_pallas.conv_pallas(a, b, spec))
  with step_of(f"bucket {name} {fields['dtype']}"):
    want = np.asarray(xla(x, w), np.float32)
    got = np.asarray(pallas(x, w), np.float32)
  err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
  measured = steady_state({"xla": Runner(xla, x, w), "pallas": Runner(pallas, x, w)}, "xla",
                          deadline, sizes)
  if measured is not None:
    t, n = measured
    fields.update(xla_ms=1e3 * t.median("xla") / n, pallas_ms=1e3 * t.median("pallas") / n,
                  ratio=t.ratio("pallas"), aa=t.ratio(_harness.CONTROL))
  report("pallas", rel_error=err, **fields)


def worker_conv_buckets(sizes: Sizes, deadline: Deadline) -> None:
  """Each bucket in bfloat16, then float32, as long as the time lasts."""
  rng = np.random.default_rng(0)
  for dtype in (jnp.bfloat16, jnp.float32):
    for bucket in RESNET50_BUCKETS[:sizes.bucket_count]:
      if out_of_time(f"bucket {bucket} {jnp.dtype(dtype).name}", deadline, 3):
        continue
      guarded(f"bucket {bucket}", lambda b=bucket, d=dtype: _bucket(sizes, rng, b, d, deadline),
              bucket=str(bucket), dtype=jnp.dtype(dtype).name)


def _layout(name: str, runner: Runner) -> dict:
  """What the layout pass decided, for `tj.jit`'s row."""
  if name != LAYOUT_PASS:
    return {}
  layout = runner.fn.report(memory=False).last.layout
  return {"layout": None if layout is None else (
      f"{layout.decision} -> {layout.target} ({layout.reason}), "
      f"{layout.convolutions} convolutions")}


def worker_layout_f16(sizes: Sizes, deadline: Deadline) -> None:
  """A float16 NCHW ResNet-50 step: as written, and with the layout pass."""
  configure({"layout": {"enable": True}}, sizes)
  params, step, x, y = functional_resnet(batch=sizes.layout_batch, image=sizes.image,
                                         stages=sizes.stages, width=sizes.width,
                                         layout="NCHW", dtype=jnp.float16)
  compare({n: (lambda j=j: Runner(j(step), jax.tree.map(jnp.copy, params), x, y, stateful=True))
           for n, j in ((LAYOUT_PLAIN, jax.jit), (LAYOUT_PASS, tj.jit))},
          LAYOUT_PLAIN, deadline, sizes, tuned=(LAYOUT_PASS,), first=_layout)


WORKERS = {**{w: (lambda s, d, w=w: worker(w, s, d)) for w in ("jax", *NAMES)},
           "conv_buckets": worker_conv_buckets, "layout_f16": worker_layout_f16}
