"""The native flash-attention kernel against PyTorch's SDPA on CPU: alone, and in a miniGPT step.

Part 1, attention alone: causal self-attention, float32, forward and backward
(the gradients of query, key and value of ``sum(out * g)``): PyTorch's
``F.scaled_dot_product_attention(is_causal=True)`` (the baseline), the
attention family's ``native_flash`` kernel (C++, `ops/attention/_native_flash.py`)
and the best of the earlier CPU candidates, ``blocked_causal_128`` and
``blocked_causal_256`` (plain JAX), each kernel under `jax.jit`; interleaved in
rounds with an A/A control (`harness.interleaved`). Shapes [batch 2, tokens,
8 heads, head_dim]: 1,024 tokens at head dims 32, 64 and 128, and 256 and
4,096 tokens at 32.

Part 2, accuracy on ill-conditioned inputs: each kernel's largest relative
error (max |a - b| / max |b|) over the output and the three gradients against
the family's float64 reference (the formula written out, `_kernels.einsum`),
beside XLA's own (``xla``): large logits, long rows, fully masked padding rows.

Part 3, the miniGPT step: the model of issue 47 (4 post-LayerNorm blocks of
``nnx.MultiHeadAttention`` called with ``mask=jnp.tril(jnp.ones((T, T)))``,
width 256, 8 heads, feed-forward 256, vocabulary 512, 1,024 tokens, batch 2,
AdamW) through ``tj.Trainer(autotune=True)`` (its first `fit` tunes; then timed
in its steady state), against the same model in PyTorch as its users write it
(one qkv ``Linear``, ``F.scaled_dot_product_attention(is_causal=True)``,
``torch.optim.AdamW``), interleaved with an A/A control: each round runs a few
steps of each.

torch is optional (the ``bench-torch`` extra): without it the PyTorch rows are
left out and the JAX kernels are compared with each other.

Run: ``python benchmarks/run.py flash_attention [--quick] [--write]``
(``measure(parts=..., shapes=..., rounds=...)`` for fewer parts or other shapes).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import _gpu_models
import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from _gpu_lm import StopAfter
from _gpu_models import MiniGPT, lm_loss

import tunedjax as tj
from tunedjax import _native
from tunedjax.ops.attention import _kernels as K
from tunedjax.ops.attention import _native_flash as NF
from tunedjax.ops.attention._spec import AttentionSpec

TORCH = "PyTorch SDPA"
NATIVE = "native_flash"
PREVIOUS = ("blocked_causal_128", "blocked_causal_256")
PARTS = ("attention", "accuracy", "lm")
SHAPES = ((2, 1024, 8, 32), (2, 256, 8, 32), (2, 1024, 8, 64), (2, 1024, 8, 128),
          (2, 4096, 8, 32))


def _torch() -> Any:
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return torch


# -- part 1: attention alone ---------------------------------------------------


def attention_problem(batch: int, tokens: int, heads: int, head_dim: int, seed: int = 0):
  """Random q, k, v and cotangent g ``[batch, tokens, heads, head_dim]`` (float32)."""
  rng = np.random.default_rng(seed)
  return tuple(rng.normal(size=(batch, tokens, heads, head_dim)).astype(np.float32)
               for _ in range(4))


def jax_attention_step(fn: Callable[..., Any], q, k, v, g) -> Callable[[], Any]:
  """A zero-argument call of `fn`'s forward and backward under `jax.jit` (compiled once)."""
  spec = AttentionSpec.from_arrays(q, k, is_causal=True)
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, spec) * g), argnums=(0, 1, 2)))
  args = tuple(jnp.asarray(x) for x in (q, k, v))
  jax.block_until_ready(grad(*args))
  return lambda: jax.block_until_ready(grad(*args))


def torch_attention_step(torch: Any, q, k, v, g) -> Callable[[], Any]:
  """PyTorch's SDPA forward and backward, in its ``[batch, heads, tokens, dim]`` layout."""
  f = torch.nn.functional.scaled_dot_product_attention
  tq, tk, tv = (torch.tensor(x).transpose(1, 2).contiguous().requires_grad_()
                for x in (q, k, v))
  tg = torch.tensor(g).transpose(1, 2).contiguous()

  def step():
    out = f(tq, tk, tv, is_causal=True)
    return torch.autograd.grad((out * tg).sum(), (tq, tk, tv))

  return step


def time_attention(shape: tuple[int, int, int, int], rounds: int, torch: Any
                   ) -> harness.Timings:
  """Part 1 at one shape: the variants interleaved (the first is the baseline)."""
  q, k, v, g = attention_problem(*shape)
  variants = {}
  if torch is not None:
    variants[TORCH] = torch_attention_step(torch, q, k, v, g)
  if NF.native_flash_applicable(AttentionSpec.from_arrays(q, k, is_causal=True), "cpu"):
    variants[NATIVE] = jax_attention_step(NF.native_flash, q, k, v, g)
  for block in (128, 256):
    if shape[1] >= 2 * block:
      variants[f"blocked_causal_{block}"] = jax_attention_step(K.blocked_causal(block), q, k,
                                                               v, g)
  return harness.interleaved(variants, baseline=next(iter(variants)), rounds=rounds, prime=1)


# -- part 2: accuracy ----------------------------------------------------------


def _outputs(fn, ops, spec, g):
  def loss(q, k, v, *rest):
    return jnp.sum(fn(q, k, v, *rest, spec) * g)
  got = jax.jit(lambda *o: (fn(*o, spec), *jax.grad(loss, argnums=(0, 1, 2))(*o)))(*ops)
  return [np.asarray(x, np.float64) for x in got]


def accuracy_cases(quick: bool) -> dict[str, tuple[tuple[np.ndarray, ...], bool]]:
  """Ill-conditioned operands by name: ``(q, k, v, g[, mask]), causal``."""
  rng = np.random.default_rng(1)
  normal = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
  t, long = (64, 512) if quick else (256, 4096)
  mask = rng.random((2, 1, 1, t)) < 0.8
  mask[0, ..., : t // 4] = False  # causal rows 0..t/4 of batch 0 see no key
  mask[1] = False  # every row of batch 1
  return {
      f"large logits (q x 30), causal, {t} tokens": (
          (30 * normal(2, t, 4, 32), normal(2, t, 4, 32), normal(2, t, 4, 32),
           normal(2, t, 4, 32)), True),
      f"long rows: 64 queries, {long} keys": (
          (normal(1, 64, 4, 32), normal(1, long, 4, 32), normal(1, long, 4, 32),
           normal(1, 64, 4, 32)), False),
      f"padding mask, fully masked rows, causal, {t} tokens": (
          (normal(2, t, 4, 32), normal(2, t, 4, 32), normal(2, t, 4, 32),
           normal(2, t, 4, 32), mask), True),
  }


def accuracy(quick: bool) -> list[tuple[str, dict[str, float]]]:
  """Each case's largest relative error per kernel, against float64 (`_kernels.einsum`)."""
  rows = []
  for name, (ops, causal) in accuracy_cases(quick).items():
    q, k, v, g, *mask = ops
    spec = AttentionSpec.from_arrays(q, k, mask=mask[0] if mask else None, is_causal=causal)
    with jax.enable_x64(True):
      ops64 = [x.astype(np.float64) if x.dtype == np.float32 else x for x in (q, k, v, *mask)]
      want = _outputs(K.einsum, ops64, spec, g.astype(np.float64))
    errors = {}
    kernels = {"xla": K.xla, NATIVE: NF.native_flash,
               "blocked_causal_128": K.blocked_causal(128)}
    for kname, fn in kernels.items():
      applicable = (NF.native_flash_applicable(spec, "cpu") if kname == NATIVE else
                    kname == "xla" or K.blocked_causal_applicable(128)(spec, "cpu"))
      if applicable:
        got = _outputs(fn, (q, k, v, *mask), spec, g)
        errors[kname] = max(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
                            for a, b in zip(got, want))
    rows.append((name, errors))
  return rows


# -- part 3: the miniGPT step ------------------------------------------------------


def lm_sizes(quick: bool) -> dict[str, int]:
  if quick:
    return {"vocab": 32, "tokens": 128, "width": 32, "heads": 2, "hidden": 32, "layers": 1,
            "batch": 1}
  return {"vocab": 512, "tokens": 1024, "width": 256, "heads": 8, "hidden": 256, "layers": 4,
          "batch": 2}


def lm_batches(sizes: Mapping[str, int], count: int = 4) -> list[dict[str, np.ndarray]]:
  return _gpu_models.lm_batches(count, sizes["batch"], sizes["tokens"], sizes["vocab"])


def trainer_steps(sizes: Mapping[str, int], steps: int) -> tuple[Callable[[], Any], dict]:
  """``Trainer(autotune=True)``'s `fit` of `steps` steps, after a first fit that tunes;
  the tuning history's attention buckets."""
  model = nnx.jit(lambda: MiniGPT(**{k: v for k, v in sizes.items() if k != "batch"}))()
  trainer = tj.Trainer(model, optax.adamw(3e-4, weight_decay=1e-4), lm_loss, autotune=True,
                       progress=False)
  batches = lm_batches(sizes)
  horizon = 10_000  # a long run: tuning pays back within it

  def run(k: int = steps) -> None:
    trainer.fit(batches, steps=trainer.step + horizon, callbacks=[StopAfter(k)])
    jax.block_until_ready(trainer.state)

  start = time.perf_counter()
  run(3)
  first = time.perf_counter() - start
  return run, {"first_fit_s": first, "attention": trainer.history.tuning.get("attention")}


def torch_lm_steps(torch: Any, sizes: Mapping[str, int], steps: int) -> Callable[[], Any]:
  """The same model in PyTorch (qkv Linear, SDPA is_causal, post-LayerNorm), AdamW."""
  nn, F = torch.nn, torch.nn.functional
  width, heads = sizes["width"], sizes["heads"]

  class TorchBlock(nn.Module):
    def __init__(self):
      super().__init__()
      self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
      self.norm1, self.norm2 = nn.LayerNorm(width, eps=1e-6), nn.LayerNorm(width, eps=1e-6)
      self.up, self.down = nn.Linear(width, sizes["hidden"]), nn.Linear(sizes["hidden"], width)

    def forward(self, x):
      b, t, _ = x.shape
      q, k, v = self.qkv(x).view(b, t, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
      a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = self.norm1(x + self.out(a.transpose(1, 2).reshape(b, t, width)))
      return self.norm2(x + self.down(F.gelu(self.up(x), approximate="tanh")))

  class TorchGPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(sizes["vocab"], width)
      self.position = nn.Embedding(sizes["tokens"], width)
      self.blocks = nn.ModuleList([TorchBlock() for _ in range(sizes["layers"])])
      self.head = nn.Linear(width, sizes["vocab"])

    def forward(self, ids):
      x = self.embed(ids) + self.position(torch.arange(ids.shape[1]))[None]
      for block in self.blocks:
        x = block(x)
      return self.head(x)

  model = TorchGPT()
  opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=1e-4)
  ids = [torch.tensor(b["ids"]).long() for b in lm_batches(sizes)]

  def run() -> None:
    for i in range(steps):
      batch = ids[i % len(ids)]
      logits = model(batch[:, :-1])
      loss = F.cross_entropy(logits.reshape(-1, sizes["vocab"]), batch[:, 1:].reshape(-1))
      opt.zero_grad(set_to_none=True)
      loss.backward()
      opt.step()

  run()
  return run


def time_lm(quick: bool, rounds: int, torch: Any, steps: int) -> tuple[harness.Timings, dict]:
  """Part 3: the Trainer's steady state (after it tuned) against PyTorch, interleaved."""
  sizes = lm_sizes(quick)
  run, info = trainer_steps(sizes, steps)
  variants = {}
  if torch is not None:
    variants[TORCH] = torch_lm_steps(torch, sizes, steps)
  variants["tj.Trainer(autotune=True)"] = run
  return harness.interleaved(variants, baseline=next(iter(variants)), rounds=rounds), info


def _shape_name(shape) -> str:
  return "attention " + "x".join(map(str, shape))


def measure(quick: bool = False, *, rounds: int = 5, parts: tuple[str, ...] = PARTS,
            shapes: tuple[tuple[int, int, int, int], ...] = SHAPES, lm_steps: int = 3
            ) -> harness.Result:
  """The parts asked for, in a fresh tuning cache; without torch, no PyTorch rows."""
  if quick:
    rounds, shapes, lm_steps = 2, ((1, 128, 2, 32),), 2
  torch = _torch()
  if not _native.available(NF.SOURCE):
    print(f"note: {NATIVE} is unavailable here (no C++ compiler?)", file=sys.stderr)
  result = harness.Result("flash_attention", params={
      "quick": quick, "rounds": rounds, "parts": list(parts), "shapes": [list(s) for s in shapes],
      "lm_steps": lm_steps, "torch": torch.__version__ if torch else None})
  with tj.config_context({"cache": {"dir": tempfile.mkdtemp(prefix="tj-flash-bench-")}}):
    if "attention" in parts:
      for shape in shapes:  # 4,096 tokens: half the rounds
        result.timings[_shape_name(shape)] = time_attention(
            shape, max(2, rounds // 2) if shape[1] >= 4096 else rounds, torch)
    if "accuracy" in parts:
      result.figures["accuracy"] = accuracy(quick)
    if "lm" in parts:
      result.timings["lm"], info = time_lm(quick, rounds, torch, lm_steps)
      result.figures["lm"] = {"first_fit_s": info["first_fit_s"], "sizes": lm_sizes(quick),
                              "attention": _buckets(info["attention"])}
  return result


# -- report --------------------------------------------------------------------


def _speed_table(t: harness.Timings, per: int = 1) -> list[str]:
  lines = [f"| variant | median ms | time vs {t.baseline} | per-round range |",
           "|---|---:|---:|---:|"]
  for name in t.runs:
    lo, hi = t.spread(name)
    lines.append(f"| {name} | {t.median(name) * 1e3 / per:.1f} | {t.ratio(name):.2f}x | "
                 f"{lo:.2f}-{hi:.2f} |")
  return lines


def render(result: harness.Result) -> str:
  p = result.params
  versions = f"torch {p['torch']}." if p["torch"] else "No torch here."
  lines = ["## Native flash attention against PyTorch (`benchmarks/flash_attention.py`)", "",
           f"{result.machine} {versions} {result.load_line()} Command: "
           f"`benchmarks/run.py flash_attention{' --quick' if p['quick'] else ''}` "
           f"({p['rounds']} rounds; parts {', '.join(p['parts'])}). Ratios: the median over "
           "rounds of each variant's time over the baseline's in the same round (below 1: "
           f"faster); `{harness.CONTROL}` is the baseline timed twice.", ""]
  for b, tokens, heads, dim in p["shapes"] if "attention" in p["parts"] else ():
    t = result.timings[_shape_name((b, tokens, heads, dim))]
    lines += [f"**Causal attention, forward + backward**, [batch {b}, {tokens} tokens, "
              f"{heads} heads, head_dim {dim}], float32:", "", *_speed_table(t), ""]
  if "accuracy" in result.figures:
    lines += ["**Accuracy against float64** (largest relative error over the output and the "
              "three gradients; the family's float32 bound is 1e-4):", "",
              "| operands | " + " | ".join(("xla", NATIVE, "blocked_causal_128")) + " |",
              "|---|---:|---:|---:|"]
    for name, errors in result.figures["accuracy"]:
      cells = [f"{errors[k]:.1e}" if k in errors else "n/a"
               for k in ("xla", NATIVE, "blocked_causal_128")]
      lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
  if "lm" in result.figures:
    info, steps = result.figures["lm"], p["lm_steps"]
    sizes = info["sizes"]
    lines += [f"**miniGPT train step** ({sizes['layers']} post-LayerNorm blocks, width "
              f"{sizes['width']}, {sizes['heads']} heads, feed-forward {sizes['hidden']}, "
              f"vocabulary {sizes['vocab']}, {sizes['tokens']} tokens, batch {sizes['batch']}, "
              f"AdamW, float32), ms per step (rounds of {steps} steps); the Trainer's first "
              f"fit (3 steps, tuning included) took {info['first_fit_s']:.1f} s:", "",
              *_speed_table(result.timings["lm"], per=steps), "",
              f"Attention buckets the Trainer tuned: `{info['attention']}`.", ""]
  return "\n".join(lines)


def _buckets(attention: Any) -> str:
  if not isinstance(attention, Mapping):
    return str(attention)[:300]
  return "; ".join(f"{b.get('bucket')}: {b.get('kernel')}" for b in attention.get("buckets", []))
