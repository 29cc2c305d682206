"""What each program hands XLA, by export, on CPU: convolutions, converts, transposes, custom calls.

No GPU or TPU is needed: each train step is exported with `jax.export` for CUDA and for
TPU and its StableHLO ops counted: the Flax ImageNet example's ResNet-50 step
(`_gpu_models.resnet50`) under `jax.jit` in float32 and with the example's
``dtype=jnp.bfloat16``; a miniGPT LM step (``nnx.MultiHeadAttention`` with a ``jnp.tril``
mask), and the same with its attention written by hand; a ResNet written NCHW in lax ops
(`_gpu_models.functional_resnet`); each also under `tj.jit` with each tuner alone and
all of them on. Convolutions by operand and result dtype, custom calls by target.

Run: ``python benchmarks/run.py program_audit [--quick] [--write]``: small models,
every variant (``--quick``: CUDA only, mixed precision alone and everything on);
``measure(full_size=True)`` for the full sizes (ResNet-50 at 224). The tests call
`audit` and `count_ops` directly.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import harness
import tunedjax as tj
from _gpu_models import (MiniGPT, functional_resnet, image_batch, lm_batches, lm_loss,
                         resnet50, resnet_train_step)

PLATFORMS = {"cuda": "gpu", "tpu": "tpu"}  # jax.export platform -> tunedjax platform
_OFF = {"mixed_precision": {"enable": False}, "layout": {"enable": False},
        "kernel": {"enable": False}, "dataloader": {"enable": False}}
# tj.jit variants: the config sections each turns on.
TJ_VARIANTS = {
    "tj mixed precision": {"mixed_precision": {"enable": True}},
    "tj layout": {"layout": {"enable": True}},
    "tj kernel selection": {"kernel": {"enable": True}},
    "tj all on": {"mixed_precision": {"enable": True}, "layout": {"enable": True},
                  "kernel": {"enable": True}},
}
JIT_F32, JIT_BF16 = "jax.jit f32", "jax.jit bf16 (Flax dtype=)"
_SHORT = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "float64": "f64"}


@dataclasses.dataclass(frozen=True)
class Counts:
  """The ops of one exported module that matter to XLA's choices: convolutions by operand
  and result dtype (``{"bf16 x bf16 -> bf16": n}``), converts, transposes, custom calls by
  target, and every op."""

  convolutions: dict[str, int]
  converts: int
  transposes: int
  custom_calls: dict[str, int]
  ops: int


_OP = re.compile(r"=\s*(?:\"?)(stablehlo|chlo|mhlo)\.([a-z_]+)")


def count_ops(text: str) -> Counts:
  """Counts a StableHLO module's convolutions (by dtype), converts, transposes, custom calls.

  Example:
    >>> line = ('%0 = stablehlo.convolution(%a, %b) ... : (tensor<1x4x4x3xbf16>, '
    ...         'tensor<3x3x3x8xbf16>) -> tensor<1x4x4x8xbf16>')
    >>> count_ops(line).convolutions
    {'bf16 x bf16 -> bf16': 1}
  """
  convs: collections.Counter[str] = collections.Counter()
  calls: collections.Counter[str] = collections.Counter()
  kinds: collections.Counter[str] = collections.Counter()
  for line in text.splitlines():
    m = _OP.search(line)
    if m is None:
      continue
    kind = m.group(2)
    kinds[kind] += 1
    if kind == "convolution":
      types = re.findall(r"tensor<(?:[0-9]+x)*([a-z]+[0-9]+)>", line.rsplit(":", 1)[-1])
      *ins, out = [_SHORT.get(t, t) for t in types] or ["?"]
      convs[f"{' x '.join(ins)} -> {out}"] += 1
    elif kind == "custom_call":
      target = re.search(r"custom_call\s*@([\w$.\-]+)", line)
      calls[target.group(1) if target else "?"] += 1
  return Counts(dict(convs), kinds["convert"], kinds["transpose"], dict(calls), sum(kinds.values()))


# -- the programs: (step, args), built once per size ----------------------------------------


def resnet_program(*, stages: Sequence[int], width: int, batch: int, image: int,
                   dtype: Any = jnp.float32) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """The Flax ImageNet example's train step and its arguments (``dtype``: the model's)."""
  model = resnet50(stages=stages, width=width, dtype=dtype)
  init, step = resnet_train_step(model)
  x, y = image_batch(batch, image)
  return step, (init(x), x, y)


class HandAttention(nnx.Module):
  """Causal self-attention written by hand: q, k, v projections, einsum, tril, softmax."""

  def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
    self.heads = heads
    self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
    self.out = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array | None = None, decode: bool = False):
    del decode
    b, t, w = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.heads, w // self.heads), 3, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(w // self.heads).astype(np.float32)
    s = jnp.where(mask.astype(bool), s, -1e9)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return self.out(o.reshape(b, t, w))


def lm_program(*, hand_written: bool, vocab: int, tokens: int, width: int, heads: int,
               layers: int, batch: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A miniGPT LM train step (SGD) and its arguments; ``hand_written`` swaps each
  block's ``nnx.MultiHeadAttention`` for `HandAttention`."""
  model = MiniGPT(vocab=vocab, tokens=tokens, width=width, heads=heads, layers=layers)
  if hand_written:
    rngs = nnx.Rngs(1)
    for block in model.blocks:
      block.attention = HandAttention(width, heads, rngs=rngs)
  graphdef, params = nnx.split(model)

  def step(params, batch):
    loss, grads = jax.value_and_grad(lambda p: lm_loss(nnx.merge(graphdef, p), batch))(params)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss

  (data,) = lm_batches(1, batch, tokens, vocab)
  return step, (params, {"ids": jnp.asarray(data["ids"])})


def nchw_program(*, stages: Sequence[int], width: int, batch: int, image: int
                 ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A ResNet of bottlenecks written NCHW in lax ops, and its arguments."""
  params, step, x, y = functional_resnet(batch=batch, image=image, stages=stages, width=width,
                                         layout="NCHW")
  return step, (params, x, y)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The models' sizes: full (the issue's) or quick (a smoke run, the tests)."""

  resnet: dict[str, Any]
  lm: dict[str, Any]


FULL = Sizes(resnet={"stages": (3, 4, 6, 3), "width": 64, "batch": 8, "image": 224},
             lm={"vocab": 50257, "tokens": 256, "width": 512, "heads": 8, "layers": 6,
                 "batch": 4})
QUICK = Sizes(resnet={"stages": (1, 1), "width": 8, "batch": 2, "image": 32},
              lm={"vocab": 128, "tokens": 32, "width": 64, "heads": 4, "layers": 1,
                  "batch": 2})


def programs(sizes: Sizes) -> dict[str, dict[str, Callable[[], tuple[Callable, tuple]]]]:
  """``{model: {"f32": build, "bf16": build}}``: each model's program builders
  (``"bf16"``: the expert's, where the model has a ``dtype``)."""
  r, lm = sizes.resnet, sizes.lm
  nchw = {k: r[k] for k in ("stages", "width", "batch", "image")}
  return {
      "ResNet (Flax example)": {"f32": lambda: resnet_program(**r),
                                "bf16": lambda: resnet_program(**r, dtype=jnp.bfloat16)},
      "miniGPT, nnx.MultiHeadAttention": {"f32": lambda: lm_program(hand_written=False, **lm)},
      "miniGPT, hand-written attention": {"f32": lambda: lm_program(hand_written=True, **lm)},
      "ResNet written NCHW": {"f32": lambda: nchw_program(**nchw)},
  }


# -- exporting -------------------------------------------------------------------------------


def export_jit(step: Callable[..., Any], args: tuple[Any, ...], platform: str) -> Counts:
  """`jax.jit(step)` exported for `platform` (``"cuda"``, ``"tpu"``), counted."""
  exported = jax.export.export(jax.jit(step), platforms=[platform])(*args)
  return count_ops(exported.mlir_module())


def export_tj(step: Callable[..., Any], args: tuple[Any, ...], platform: str,
              sections: dict[str, Any], cache_dir: str) -> tuple[Counts, Any]:
  """`tj.jit(step, platform=...)` with `sections` on (the rest off), exported and counted;
  also its last report."""
  config = {**_OFF, **sections, "cache": {"dir": cache_dir}}
  with tj.config_context(config):
    f = tj.jit(step, platform=PLATFORMS[platform])
    text = f.export(*args, platforms=[platform]).mlir_module()
  return count_ops(text), f.report(memory=False).last


@dataclasses.dataclass(frozen=True)
class Row:
  """One exported program's counts."""

  model: str
  program: str
  platform: str
  counts: Counts
  kernels: dict[str, int] = dataclasses.field(default_factory=dict)


def audit(sizes: Sizes, platforms: Sequence[str] = ("cuda", "tpu"),
          variants: Sequence[str] = tuple(TJ_VARIANTS),
          models: Sequence[str] | None = None, cache_dir: str | None = None) -> list[Row]:
  """Exports every model under `jax.jit` (f32, and bf16 where it has one) and each
  `tj.jit` variant, for each platform; returns the rows."""
  rows: list[Row] = []
  cache_dir = cache_dir or tempfile.mkdtemp(prefix="tj-audit-")
  for model, builds in programs(sizes).items():
    if models is not None and model not in models:
      continue
    built = {k: b() for k, b in builds.items()}
    for platform in platforms:
      step, args = built["f32"]
      rows.append(Row(model, JIT_F32, platform, export_jit(step, args, platform)))
      if "bf16" in built:
        rows.append(Row(model, JIT_BF16, platform, export_jit(*built["bf16"], platform)))
      for name in variants:
        counts, report = export_tj(step, args, platform, TJ_VARIANTS[name], cache_dir)
        rows.append(Row(model, name, platform, counts, dict(report.kernels)))
  return rows


def _cell(d: dict[str, int]) -> str:
  return "; ".join(f"{k}: {v}" for k, v in sorted(d.items())) or "none"


def table(rows: Sequence[Row]) -> str:
  """The rows as a Markdown table."""
  lines = ["| model | program | platform | convolutions (operands -> result) | converts | "
           "transposes | custom calls | ops |", "|---|---|---|---|---:|---:|---|---:|"]
  for r in rows:
    c = r.counts
    lines.append(f"| {r.model} | {r.program} | {r.platform} | {_cell(c.convolutions)} | "
                 f"{c.converts} | {c.transposes} | {_cell(c.custom_calls)} | {c.ops} |")
  return "\n".join(lines)


def measure(quick: bool = False, *, full_size: bool = False) -> harness.Result:
  """Small models (`QUICK`; `FULL` with `full_size`), every variant on CUDA and TPU; with
  `quick` CUDA only, mixed precision alone and everything on."""
  sizes = FULL if full_size and not quick else QUICK
  start = time.perf_counter()
  rows = (audit(sizes, platforms=("cuda",), variants=("tj mixed precision", "tj all on"))
          if quick else audit(sizes))
  return harness.Result("program_audit", params={
      "quick": quick, "full_size": sizes is FULL, "resnet": sizes.resnet, "lm": sizes.lm},
      figures={"rows": [dataclasses.asdict(r) for r in rows],
               "seconds": time.perf_counter() - start})


def render(result: harness.Result) -> str:
  p = result.params
  rows = [Row(**{**r, "counts": Counts(**r["counts"])}) for r in result.figures["rows"]]
  return "\n".join([
      "## What tunedjax hands XLA (program audit, by export)", "",
      f"`benchmarks/run.py program_audit{' --quick' if p['quick'] else ''}`"
      f"{' (full sizes)' if p['full_size'] else ''}: each step "
      "exported with `jax.export` on CPU for CUDA and TPU, its StableHLO ops counted. "
      "`tj` rows: `tj.jit(platform=...)` with the named tuners on and the others off "
      "(mixed precision's policy `mixed_bfloat16`). No GPU or TPU ran: this is the program, "
      "not its speed.", "",
      f"{result.machine} {result.load_line()} {result.figures['seconds']:.0f} s. Sizes: "
      f"ResNet {p['resnet']}, miniGPT {p['lm']}.",
      "", table(rows)])
