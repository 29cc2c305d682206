"""GPU benchmarks: what tunedjax's tuners are for, measured on a GPU.

Five tables, each timed in interleaved rounds against its baseline (median of
per-round ratios, with an A/A control; see `_harness`):

1. a ResNet-50 train step (NHWC, batch 128, 224x224, SGD), float32 against
   the same step under the ``mixed_bfloat16`` autocast pass (`tj.jit`);
2. ResNet-50's convolution buckets (forward), the ``pallas`` implicit-GEMM
   kernel against XLA's convolution (cuDNN), in float32 and bfloat16;
3. a float16 ResNet-50 train step written NCHW (as a PyTorch port), with and
   without the layout pass (`tj.jit`, ``layout.enable``; the GPU prefers NHWC
   for half precision);
4. the ``attention`` kernel candidates, when that op family is registered;
5. ``tunedjax demo`` at its default sizes (baseline against set_config(None)).

On a GPU machine: ``python benchmarks/gpu.py --write`` (BENCHMARKS.md, "GPU",
gives the device command). ``--smoke`` (or ``--quick``) runs every part at
tiny sizes on any backend, Pallas in interpret mode off the GPU; nothing it
measures is a figure.

Run: `.venv/bin/python benchmarks/gpu.py [--smoke] [--write] [--rounds N] [--only PART ...]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import _harness
import tunedjax as tj
from tunedjax.ops.conv import _pallas as _conv_pallas
from tunedjax.autotune import _registry as reg

PARTS = ("resnet50", "conv_buckets", "layout_f16", "attention", "demo")
OFF = {"mixed_precision": {"enable": False}, "layout": {"enable": False},
       "kernel": {"enable": False}, "dataloader": {"enable": False}}


@dataclasses.dataclass(frozen=True)
class Sizes:
  batch: int = 128
  image: int = 224
  stages: tuple[int, ...] = (3, 4, 6, 3)
  width: int = 64
  rounds: int = 10
  bucket_batch: int = 128
  bucket_scale: int = 1   # spatial size divided by this
  bucket_channels: int = 10**6  # channels capped at this


FULL = Sizes()
SMOKE = Sizes(batch=2, image=32, stages=(1, 1, 1, 1), width=8, rounds=2, bucket_batch=2,
              bucket_scale=8, bucket_channels=16)


# --- ResNet-50, functional, in either layout ----------------------------------------


def _dn(layout: str) -> tuple[str, str, str]:
  return ("NHWC", "HWIO", "NHWC") if layout == "NHWC" else ("NCHW", "OIHW", "NCHW")


def _weight(rng, k: int, cin: int, cout: int, layout: str, dtype) -> jax.Array:
  w = rng.normal(size=(k, k, cin, cout), scale=(2.0 / (k * k * cin)) ** 0.5)
  if layout == "NCHW":
    w = w.transpose(3, 2, 0, 1)
  return jnp.asarray(w, dtype)


def resnet50(sizes: Sizes, *, layout: str = "NHWC", dtype=jnp.float32, seed: int = 0):
  """(params, loss(params, x, y), x, y): a ResNet-50 (bottlenecks) and a batch."""
  rng = np.random.default_rng(seed)
  w0 = sizes.width
  params: dict[str, Any] = {"stem": _weight(rng, 7, 3, w0, layout, dtype), "blocks": []}
  cin = w0
  for i, n in enumerate(sizes.stages):
    mid = w0 * 2**i
    for j in range(n):
      stride = 2 if (j == 0 and i > 0) else 1
      block = {"c1": _weight(rng, 1, cin, mid, layout, dtype),
               "c2": _weight(rng, 3, mid, mid, layout, dtype),
               "c3": _weight(rng, 1, mid, 4 * mid, layout, dtype),
               "g": jnp.ones(4 * mid, dtype), "b": jnp.zeros(4 * mid, dtype),
               "stride": stride}
      if j == 0:
        block["proj"] = _weight(rng, 1, cin, 4 * mid, layout, dtype)
      params["blocks"].append(block)
      cin = 4 * mid
  params["head"] = jnp.asarray(rng.normal(size=(cin, 1000), scale=cin**-0.5), dtype)
  strides = [b.pop("stride") for b in params["blocks"]]
  channel = -1 if layout == "NHWC" else 1
  spatial = (1, 2) if layout == "NHWC" else (2, 3)
  dn = _dn(layout)

  def conv(x, w, stride=1):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=dn)

  def norm(x, g, b):
    axes = tuple(a for a in range(4) if a != channel % 4)
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    shape = [1, 1, 1, 1]
    shape[channel] = -1
    return (x - mean) * lax.rsqrt(var + 1e-5) * g.reshape(shape) + b.reshape(shape)

  def loss(params, x, y):
    h = jax.nn.relu(conv(x, params["stem"], 2))
    for blk, s in zip(params["blocks"], strides):
      r = h if "proj" not in blk else conv(h, blk["proj"], s)
      h = jax.nn.relu(conv(h, blk["c1"]))
      h = jax.nn.relu(conv(h, blk["c2"], s))
      h = jax.nn.relu(norm(conv(h, blk["c3"]), blk["g"], blk["b"]) + r)
    logits = (h.mean(axis=spatial) @ params["head"]).astype(jnp.float32)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 1000), axis=-1))

  shape = ((sizes.batch, sizes.image, sizes.image, 3) if layout == "NHWC"
           else (sizes.batch, 3, sizes.image, sizes.image))
  x = jnp.asarray(rng.normal(size=shape), dtype)
  y = jnp.asarray(rng.integers(0, 1000, size=sizes.batch), jnp.int32)
  return params, loss, x, y


def sgd_step(loss: Callable[..., Any]) -> Callable[..., Any]:
  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return value, jax.tree.map(lambda p, g: p - (0.01 * g).astype(p.dtype), params, grads)
  return step


def _blocked(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
  return lambda: jax.block_until_ready(fn(*args))


def _compiled_under(config: dict[str, Any], step: Callable[..., Any], *args: Any):
  """`tj.jit(step)` traced and compiled under `config`; (call, report)."""
  with tj.config_context(config):
    f = tj.jit(step)
    jax.block_until_ready(f(*args))  # traces, rewrites, compiles
    compiled = f.lower(*args).compile()
  return _blocked(compiled, *args), f.report(memory=False).last


# --- the parts ------------------------------------------------------------------------


def part_resnet50(sizes: Sizes, cache: str) -> str:
  params, loss, x, y = resnet50(sizes)
  step = sgd_step(loss)
  base = {**OFF, "cache": {"dir": cache}}
  f32, _ = _compiled_under(base, step, params, x, y)
  bf16, rep = _compiled_under(
      {**base, "mixed_precision": {"enable": True, "policy": "mixed_bfloat16"}}, step,
      params, x, y)
  t = _harness.interleaved({"float32": f32, "mixed_bfloat16 (autocast)": bf16},
                           baseline="float32", rounds=sizes.rounds)
  ips = {n: sizes.batch / t.median(n) for n in t.runs}
  notes = {n: f"{ips[n]:.0f} images/s" for n in t.runs}
  return "\n".join([
      f"### ResNet-50 train step: float32 against mixed_bfloat16",
      "",
      f"Batch {sizes.batch}, {sizes.image}x{sizes.image}, NHWC, SGD, `tj.jit` with every "
      "tuner off but mixed precision; the autocast pass: "
      f"{', '.join(f'{k}: {v}' for k, v in sorted(rep.casts.items())) or 'nothing'}.",
      "",
      _harness.ratio_table(t, notes=notes),
  ])


RESNET50_BUCKETS = (  # (spatial, cin, cout, kernel, stride): ResNet-50's forward convs
    (224, 3, 64, 7, 2), (56, 64, 64, 1, 1), (56, 64, 64, 3, 1), (56, 64, 256, 1, 1),
    (56, 256, 64, 1, 1), (56, 128, 128, 3, 2), (28, 128, 128, 3, 1), (28, 128, 512, 1, 1),
    (14, 256, 256, 3, 1), (14, 1024, 256, 1, 1), (7, 512, 512, 3, 1), (7, 512, 2048, 1, 1),
)


def part_conv_buckets(sizes: Sizes) -> str:
  rng = np.random.default_rng(0)
  rows = ["### Convolution buckets: `pallas` (Triton) against XLA (cuDNN)", "",
          f"ResNet-50's forward convolutions, NHWC, batch {sizes.bucket_batch}; ratio = "
          "pallas time / XLA time (median of per-round ratios; below 1: pallas faster); "
          "error = relative L2 error against XLA"
          + ("" if jax.default_backend() == "gpu" else "; not a GPU: Pallas in interpret mode")
          + ".", "",
          "| bucket | dtype | XLA (ms) | pallas (ms) | ratio | A/A | error |",
          "|---|---|---:|---:|---:|---:|---:|"]
  for hw, cin, cout, k, s in RESNET50_BUCKETS:
    hw = max(hw // sizes.bucket_scale, k)
    cin, cout = min(cin, sizes.bucket_channels), min(cout, sizes.bucket_channels)
    for dtype in (jnp.float32, jnp.bfloat16):
      x = jnp.asarray(rng.normal(size=(sizes.bucket_batch, hw, hw, cin)), dtype)
      w = jnp.asarray(rng.normal(size=(k, k, cin, cout), scale=(k * k * cin) ** -0.5), dtype)
      spec = reg.ConvSpec.from_arrays(x, w, window_strides=(s, s), padding="SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))
      name = f"{k}x{k}/{s}, {hw}x{hw}, {cin}->{cout}"
      if not _conv_pallas.supports(spec):
        rows.append(f"| {name} | {jnp.dtype(dtype).name} | | | not supported | | |")
        continue
      xla = jax.jit(lambda a, b, sp=spec: lax.conv_general_dilated_p.bind(a, b, **sp.params()))
      pallas = jax.jit(lambda a, b, sp=spec: _conv_pallas.conv_pallas(a, b, sp))
      want = np.asarray(xla(x, w), np.float32)
      got = np.asarray(pallas(x, w), np.float32)
      err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
      t = _harness.interleaved({"xla": _blocked(xla, x, w), "pallas": _blocked(pallas, x, w)},
                               baseline="xla", rounds=sizes.rounds)
      rows.append(f"| {name} | {jnp.dtype(dtype).name} | {1e3 * t.median('xla'):.3f} | "
                  f"{1e3 * t.median('pallas'):.3f} | {t.ratio('pallas'):.2f} | "
                  f"{t.ratio(_harness.CONTROL):.2f} | {err:.1e} |")
  return "\n".join(rows)


def part_layout_f16(sizes: Sizes, cache: str) -> str:
  params, loss, x, y = resnet50(sizes, layout="NCHW", dtype=jnp.float16)
  step = sgd_step(loss)
  base = {**OFF, "cache": {"dir": cache}}
  plain, _ = _compiled_under(base, step, params, x, y)
  relaid, rep = _compiled_under({**base, "layout": {"enable": True}}, step, params, x, y)
  t = _harness.interleaved({"NCHW as written": plain, "layout pass": relaid},
                           baseline="NCHW as written", rounds=sizes.rounds)
  lay = rep.layout
  return "\n".join([
      "### float16 ResNet-50 written NCHW: with and without the layout pass", "",
      f"Batch {sizes.batch}, {sizes.image}x{sizes.image}, float16 parameters and inputs, SGD "
      f"train step; `tj.jit` with only the layout pass: {lay.decision} -> {lay.target} "
      f"({lay.reason}), {lay.convolutions} convolutions.", "",
      _harness.ratio_table(t),
  ])


def part_attention(sizes: Sizes, cache: str) -> str:
  title = "### Attention candidates"
  try:
    candidates = reg.kernels("attention")
  except tj.TunedJaxError as e:
    return f"{title}\n\nNot run: no `attention` op family in this tree ({e})."
  attention = getattr(tj, "attention")
  rng = np.random.default_rng(0)
  b, t_, h, d = (2, 64, 2, 16) if sizes is SMOKE else (16, 2048, 16, 128)
  q, k, v = (jnp.asarray(rng.normal(size=(b, t_, h, d)), jnp.bfloat16) for _ in range(3))
  variants = {}
  for kernel in candidates:
    with tj.config_context({**OFF, "cache": {"dir": cache}, "kernel": {"enable": True}}), \
        tj.autotune.hint(attention=kernel.name):
      f = tj.jit(lambda q, k, v: attention(q, k, v, is_causal=True))
      try:
        jax.block_until_ready(f(q, k, v))
        variants[kernel.name] = _blocked(f.lower(q, k, v).compile(), q, k, v)
      except Exception as e:  # pylint: disable=broad-except  # one candidate failing is a row
        print(f"attention {kernel.name}: {type(e).__name__}: {e}", file=sys.stderr)
  if "xla" not in variants:
    return f"{title}\n\nNot run: the `xla` attention candidate did not run."
  t = _harness.interleaved(variants, baseline="xla", rounds=sizes.rounds)
  return "\n".join([title, "", f"Causal self-attention, bfloat16, [batch {b}, tokens {t_}, "
                    f"heads {h}, head_dim {d}], each candidate by hint.", "",
                    _harness.ratio_table(t)])


def part_demo(smoke: bool, out: str) -> str:
  from tunedjax import demo  # pylint: disable=import-outside-toplevel
  lines: list[str] = []
  options = demo.QUICK if smoke else demo.DEFAULT
  demo.run_demo(options, out=out, progress=False, echo=lines.append)
  return "\n".join(["### `tunedjax demo`" + (" --quick" if smoke else " (default sizes)"), "",
                    "```", *[str(l) for l in lines], "```"])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", "--quick", dest="smoke", action="store_true",
                      help="tiny sizes on any backend (a check that it runs, no figures)")
  parser.add_argument("--write", action="store_true",
                      help="update BENCHMARKS.md (one section per part)")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--only", nargs="+", choices=PARTS, default=PARTS)
  args = parser.parse_args(argv)
  sizes = SMOKE if args.smoke else FULL
  if args.rounds:
    sizes = dataclasses.replace(sizes, rounds=args.rounds)
  if jax.default_backend() != "gpu" and not args.smoke:
    print("gpu.py: no GPU here (backend %r); use --smoke for a check run." %
          jax.default_backend(), file=sys.stderr)
    return 2
  cache = tempfile.mkdtemp(prefix="tunedjax-bench-gpu-")
  device = jax.devices()[0]
  where = (f"`benchmarks/gpu.py{' --smoke' if args.smoke else ''}` on {device.device_kind} "
           f"({len(jax.devices())} device(s)). {_harness.machine_line()}")
  failed = []
  warnings.simplefilter("ignore", tj.autotune.HintWarning)
  for part in args.only:
    start = time.perf_counter()
    print(f"gpu.py: {part} ...", file=sys.stderr)
    try:
      body = {"resnet50": lambda: part_resnet50(sizes, cache),
              "conv_buckets": lambda: part_conv_buckets(sizes),
              "layout_f16": lambda: part_layout_f16(sizes, cache),
              "attention": lambda: part_attention(sizes, cache),
              "demo": lambda: part_demo(args.smoke, os.path.join(cache, "demo"))}[part]()
    except Exception:  # pylint: disable=broad-except  # the other parts still run
      traceback.print_exc()
      failed.append(part)
      body = f"### {part}\n\nFailed: see the run's log."
    seconds = time.perf_counter() - start
    # Each part has its own section, so that parts can run in separate commands.
    body = body.replace("\n", f"\n\n{where} This part took {seconds:.0f} s.\n", 1)
    print(body + "\n")
    print(f"gpu.py: {part} took {seconds:.1f} s", file=sys.stderr)
    if args.write and part not in failed:
      _harness.write_section(f"gpu_{part}", body)
      print(f"wrote the gpu_{part} section of {_harness.BENCHMARKS_MD}", file=sys.stderr)
  if failed:
    print(f"gpu.py: failed parts: {', '.join(failed)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
