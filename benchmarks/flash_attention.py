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
``torch.optim.AdamW``), interleaved with an A/A control: each round, each side
runs 2 steps and then 5 timed back to back (the Trainer's in one `fit`, timed
by a callback from the end of its second step to the end of its last, each
waited for), so neither is charged for a loop's start and end: a 3-step `fit`
took 360-470 ms a step where a 20-step one took 270-300.

Part 4, where the miniGPT step's time goes: the Trainer's compiled step (tuned,
as part 3 runs it) under `jax.profiler` and the PyTorch step under
`torch.profiler` (`vs_pytorch.jax_profile`, `vs_pytorch.torch_profile`), ms per
step by part: attention, matmuls (the qkv and output projections, the
feed-forward, the vocabulary projection), LayerNorm, softmax cross-entropy,
the optimizer (AdamW) and the rest. An HLO instruction's part comes from its
kind and what made it (its ``op_name`` and Python frames; a fusion's from its
dots, else its root); an aten op's from its name and the event it ran in (the
autograd function of a backward op, ``Optimizer.step`` for AdamW's ops). The
parts more than 10% behind PyTorch are named.

torch is optional (the ``bench-torch`` extra): without it the PyTorch rows are
left out and the JAX kernels are compared with each other.

Run: ``python benchmarks/run.py flash_attention [--quick] [--write]``
(``measure(parts=..., shapes=..., rounds=...)`` for fewer parts or other shapes).
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import _gpu_models
import harness
import jax
from harness import workers
import vs_pytorch
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
PARTS = ("attention", "accuracy", "lm", "profile")
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


def trainer_for(sizes: Mapping[str, int]) -> Any:
  """The miniGPT of `sizes` in ``Trainer(autotune=True)`` with AdamW, untrained."""
  model = nnx.jit(lambda: MiniGPT(**{k: v for k, v in sizes.items() if k != "batch"}))()
  return tj.Trainer(model, optax.adamw(3e-4, weight_decay=1e-4), lm_loss, autotune=True,
                    progress=False)


UNTIMED = 2  # steps of each round's run before its timed steps (the loop's ramp-up)


class StepClock(tj.callbacks.Callback):
  """Ends `fit` after `untimed` + `timed` steps; `seconds` per step of the timed ones,
  each end waited for (the steady state of a training loop, not `fit`'s start and end)."""

  def __init__(self, untimed: int, timed: int):
    self.untimed, self.timed, self.seen, self.marks = untimed, timed, 0, []

  def on_step_end(self, trainer: Any, step: int, logs: Any) -> None:
    self.seen += 1
    if self.seen in (self.untimed, self.untimed + self.timed):
      jax.block_until_ready(trainer.state)
      self.marks.append(time.perf_counter())
    if self.seen >= self.untimed + self.timed:
      trainer.stop_training = True

  @property
  def seconds(self) -> float:
    return (self.marks[1] - self.marks[0]) / self.timed


def trainer_steps(sizes: Mapping[str, int], steps: int) -> tuple[Callable[[], Any], dict]:
  """``run()``: `UNTIMED` + `steps` steps of ``Trainer(autotune=True)``'s `fit`, returning
  seconds per timed step, after a first fit that tunes; the tuning history's attention
  buckets."""
  trainer = trainer_for(sizes)
  batches = lm_batches(sizes)
  horizon = 10_000  # a long run: tuning pays back within it

  def run(k: int = steps) -> float:
    clock = StepClock(UNTIMED, k)
    trainer.fit(batches, steps=trainer.step + horizon, callbacks=[clock])
    jax.block_until_ready(trainer.state)
    return clock.seconds

  start = time.perf_counter()
  run(1)  # 3 steps
  first = time.perf_counter() - start
  return run, {"first_fit_s": first, "attention": trainer.history.tuning.get("attention"),
               "trainer": trainer}


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

  def run(count: int = steps) -> None:
    for i in range(count):
      batch = ids[i % len(ids)]
      logits = model(batch[:, :-1])
      loss = F.cross_entropy(logits.reshape(-1, sizes["vocab"]), batch[:, 1:].reshape(-1))
      opt.zero_grad(set_to_none=True)
      loss.backward()
      opt.step()

  run()
  return run


def time_lm(quick: bool, rounds: int, torch: Any, steps: int) -> tuple[harness.Timings, dict]:
  """Part 3: the Trainer's steady state (after it tuned) against PyTorch, interleaved:
  per round each side runs `UNTIMED` steps and then `steps` timed back to back."""
  sizes = lm_sizes(quick)
  run, info = trainer_steps(sizes, steps)
  variants = {}
  if torch is not None:
    torch_run = torch_lm_steps(torch, sizes, steps)

    def torch_steady() -> float:
      torch_run(UNTIMED)
      start = time.perf_counter()
      torch_run(steps)
      return (time.perf_counter() - start) / steps

    variants[TORCH] = torch_steady
  variants["tj.Trainer(autotune=True)"] = run
  return harness.interleaved(variants, baseline=next(iter(variants)), rounds=rounds,
                             self_timed=True), info


def later_run(quick: bool, rounds: int, steps: int, cache: str
              ) -> tuple[harness.Timings, dict[str, Any]]:
  """Part 3 again in a fresh process on the tuning cache the first run left (a user's
  later run of the workload: its buckets are read, not tuned)."""
  proc = workers.spawn(workers.command(__file__, quick=quick, rounds=rounds, steps=steps),
                       workers.user_env(TUNEDJAX_CACHE_DIR=cache), name="later run",
                       budget_s=1200)
  record = proc.reply()
  proc.close()
  return (harness.Timings(record["runs"], record["baseline"]),
          {"first_fit_s": record["first_fit_s"], "attention": record["attention"]})


def worker(quick: bool, rounds: int, steps: int) -> int:
  """`later_run`'s process: part 3 with the cache in ``$TUNEDJAX_CACHE_DIR``."""
  t, info = time_lm(quick, rounds, _torch(), steps)
  workers.emit("later", runs=t.runs, baseline=t.baseline, first_fit_s=info["first_fit_s"],
               attention=_buckets(info["attention"]))
  return 0


# -- part 4: where the miniGPT step's time goes -----------------------------------------

PROFILE_PARTS = ("attention", "matmuls", "LayerNorm", "softmax cross-entropy",
                 "optimizer (AdamW)", "other")
BEHIND = 1.1  # a part this much slower than PyTorch's is named
RUNTIME = "runtime"  # profile events that are no instruction of the step (thread-pool waits)


# What made an instruction, innermost Python frame first: (part, pattern on "file:function").
# The attention routing (`ops/attention/_flax.py`) and Flax's MultiHeadAttention call
# the projections too, so only the attention kernels' own files and functions say attention.
_FRAME_PARTS = (
    ("softmax cross-entropy", r"optax/losses/|cross_entropy|log_softmax"),
    ("optimizer (AdamW)", r"optax/|adam"),
    ("attention", r"ops/attention/_(?:native_flash|kernels|causal)\.py|dot_product_attention"),
    ("LayerNorm", r"nn/normalization\.py|layernorm|ops/layer_norm/"),
    ("matmuls", r"nn/linear\.py"),
)


def _part_of(frames: list[tuple[str, str, int]], op_name: str, kind: str) -> str:
  """The step's part of an instruction: its innermost frame that names one, else its kind."""
  for file, function, _ in frames:
    where = f"{file}:{function}".lower()
    for part, pattern in _FRAME_PARTS:
      if re.search(pattern, where):
        return part
  if kind == "custom-call" and "tunedjax_site" in op_name:
    return "attention"
  return "matmuls" if kind == "dot" else "other"


def hlo_parts(hlo_text: str) -> dict[str, str]:
  """Each entry instruction's part of the step (`PROFILE_PARTS`).

  From its kind (`vs_pytorch.hlo_kinds`) and what made it: the Python frames of
  its metadata (`vs_pytorch.hlo_call_stacks`; ``op_name`` holds JAX's function
  names only, no Flax module path, in an nnx model), innermost first. A fusion
  takes the part of its dots or custom calls if it has any, else of its root.
  """
  kinds = vs_pytorch.hlo_kinds(hlo_text)
  stacks = vs_pytorch.hlo_call_stacks(hlo_text)
  comps: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if m:
      current = comps.setdefault(m.group(1), [])
    elif current is not None and line.startswith(" "):
      current.append(line)

  def name_of(line: str) -> str:
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    return m.group(1) if m else ""

  def part(line: str, depth: int = 0) -> str:
    called = re.search(r"calls=%?([\w.\-]+)", line)
    body = comps.get(called.group(1), []) if called and depth < 4 else []
    dots = [b for b in body if re.search(r" (?:dot|convolution|custom-call)\(", b)]
    roots = [b for b in body if b.lstrip().startswith("ROOT ")]
    for inner in dots or roots:
      found = part(inner, depth + 1)
      if found != "other":
        return found
    op = re.search(r'op_name="([^"]*)"', line)
    kind = ("dot" if re.search(r" dot\(", line) else
            "custom-call" if re.search(r" custom-call\(", line) else kinds.get(name_of(line)))
    return _part_of(stacks.get(name_of(line), []), op.group(1) if op else "", kind or "")

  return {name_of(line): part(line) for line in comps.get(_entry(hlo_text), [])
          if name_of(line)}


def _entry(hlo_text: str) -> str:
  m = re.search(r"^ENTRY %?([\w.\-]+)", hlo_text, re.M)
  return m.group(1) if m else ""


def torch_part(op: str, scope: str) -> str:
  """The step's part of an aten op's self time, from its name and outermost event."""
  text = f"{op} {scope}".lower()
  if "optimizer" in text or "adam" in text:
    return "optimizer (AdamW)"
  if re.search(r"log_?softmax|nll_?loss|cross_entropy", text):
    return "softmax cross-entropy"
  if re.search(r"scaled_?dot_?product|flash_?attention|efficient_?attention", text):
    return "attention"
  if "layer_norm" in text or "layernorm" in text:
    return "LayerNorm"
  if re.search(r"addmm|\bmm\b|aten::mm|bmm|linear|matmul|mmbackward", text):
    return "matmuls"
  return "other"


def profile_lm(quick: bool, torch: Any, steps: int, trainer: Any = None
               ) -> dict[str, Any]:
  """The tuned Trainer's compiled step under `jax.profiler` and PyTorch's under
  `torch.profiler` (`vs_pytorch.jax_profile`, `vs_pytorch.torch_profile`), ms per
  step by part; the top instructions and ops."""
  sizes = lm_sizes(quick)
  if trainer is None:
    trainer = trainer_steps(sizes, 1)[1]["trainer"]
  batches = lm_batches(sizes)
  programs = trainer._programs  # pylint: disable=protected-access
  for _ in range(10):  # the Trainer's whole-program check of its tuned step, to its verdict
    if (programs.train_step.verification() or {}).get("outcome") != "checking":
      break
    trainer.fit(batches, steps=trainer.step + 10_000, callbacks=[StopAfter(2)])
  batch = trainer.placement.put(batches[0])

  def step() -> Any:
    trainer.state, out = programs.train_step(trainer.state, batch)
    return out

  # The program in use, its check paused: the profile's thunks are the compiled text's.
  with trainer._running(), programs.train_step.checks_paused():  # pylint: disable=protected-access
    hlo = programs.train_step.lower(trainer.state, batch).compile().as_text()
    parts = hlo_parts(hlo)
    jax_parts, jax_top = vs_pytorch.jax_profile(
        step, (), hlo, steps, group=lambda name, kind: parts.get(name, RUNTIME),
        shared_wall=True)
    thunk_parts, _ = vs_pytorch.jax_profile(
        step, (), hlo, steps, group=lambda name, kind: parts.get(name, RUNTIME))
  thunk_parts.pop(RUNTIME, 0.0)
  out = {"sizes": sizes, "steps": steps, "tunedjax_runtime": jax_parts.pop(RUNTIME, 0.0),
         "tunedjax": jax_parts, "tunedjax_thunks": thunk_parts,
         "tunedjax_top": [r for r in jax_top if r[0] in parts],
         "pytorch": None, "pytorch_top": None,
         "check": (programs.train_step.verification() or {}).get("outcome"), "threads": None}
  if torch is not None:
    out["threads"] = torch.get_num_threads()
    out["pytorch"], out["pytorch_top"] = vs_pytorch.torch_profile(
        torch_lm_steps(torch, sizes, 1), steps, group=torch_part)
  return out


def _shape_name(shape) -> str:
  return "attention " + "x".join(map(str, shape))


def measure(quick: bool = False, *, rounds: int = 5, parts: tuple[str, ...] = PARTS,
            shapes: tuple[tuple[int, int, int, int], ...] = SHAPES, lm_steps: int = 5
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
  cache = tempfile.mkdtemp(prefix="tj-flash-bench-")
  with tj.config_context({"cache": {"dir": cache}}):
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
      result.timings["lm_later"], result.figures["lm_later"] = later_run(
          quick, rounds, lm_steps, cache)
    if "profile" in parts:  # the Trainer of part 3 where it ran (tuned already)
      result.figures["profile"] = profile_lm(
          quick, torch, 2 if quick else 5, info["trainer"] if "lm" in parts else None)
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
              f"AdamW, float32), ms per step (each round, each side: {UNTIMED} steps, then "
              f"{steps} timed back to back, the last waited for; the Trainer's in one `fit`); "
              f"the Trainer's first fit (3 steps, tuning included) took "
              f"{info['first_fit_s']:.1f} s:", "",
              *_speed_table(result.timings["lm"]), "",
              f"Attention buckets the Trainer tuned: `{info['attention']}`.", ""]
  if "lm_later" in result.timings:
    later = result.figures["lm_later"]
    lines += ["**The same, a later run**: a fresh process on the tuning cache the run above "
              f"left (its first fit, reading the cache: {later['first_fit_s']:.1f} s):", "",
              *_speed_table(result.timings["lm_later"]), ""]
  if "profile" in result.figures:
    lines += _profile_lines(result.figures["profile"])
  return "\n".join(lines)


def _profile_lines(prof: Mapping[str, Any]) -> list[str]:
  """Part 4's table: ms per step by part, each side's sum, and the parts behind."""
  sizes, jax_ms, torch_ms = prof["sizes"], prof["tunedjax"], prof["pytorch"]
  lines = [f"**Where the miniGPT step's time goes** (the step of part 3 at {sizes['tokens']} "
           f"tokens, width {sizes['width']}, {sizes['layers']} blocks; {prof['steps']} "
           "steps profiled): ms per step by part, tunedjax's from `jax.profiler` (each "
           "instruction of the Trainer's compiled step by its kind, op name and Python "
           "frames; its share of the wall time: where XLA runs k instructions side by side, "
           "each is charged 1/k of that time; beside it the instructions' own durations, "
           "which add up to more than the step), PyTorch's from `torch.profiler` (self CPU "
           "time of each aten "
           "op, by its name and the autograd or optimizer event it ran in; the optimizer's "
           "Python time in `Optimizer.step` included); the Trainer's whole-program check: "
           f"{prof.get('check') or 'not started'}"
           + (f"; PyTorch on {prof['threads']} threads:" if prof.get("threads") else ":"), "",
           "| part | tunedjax ms per step (wall share) | tunedjax ms (own durations) | "
           "PyTorch ms per step | tunedjax / PyTorch |",
           "|---|---:|---:|---:|---:|"]
  behind = []
  thunks = prof.get("tunedjax_thunks") or {}
  for part in (*PROFILE_PARTS, "sum"):
    j = sum(jax_ms.values()) if part == "sum" else jax_ms.get(part, 0.0)
    own = sum(thunks.values()) if part == "sum" else thunks.get(part, 0.0)
    t = None if torch_ms is None else (sum(torch_ms.values()) if part == "sum"
                                       else torch_ms.get(part, 0.0))
    ratio = f"{j / t:.2f}x" if t else "n/a"
    if t is not None and part != "sum" and t > 0 and j > BEHIND * t:
      behind.append(f"{part} ({ratio})")
    name = f"**{part}**" if part == "sum" else part
    lines.append(f"| {name} | {j:.2f} | {own:.2f} | {'not run' if t is None else f'{t:.2f}'} "
                 f"| {ratio} |")
  lines.append("")
  if prof.get("tunedjax_runtime"):
    lines.append(f"Left out of tunedjax's side: {prof['tunedjax_runtime']:.2f} ms per step of "
                 "runtime events that are no instruction of the step (thread-pool waits).")
  if torch_ms is None:
    lines.append("No torch here: PyTorch's side not run.")
  else:
    lines.append("More than 10% behind PyTorch: " + (", ".join(behind) or "none") + ".")
  top = "; ".join(f"`{n}` ({kind.split(';')[0]}) {ms:.2f}" for n, kind, ms in
                  prof["tunedjax_top"][:5])
  lines += ["", f"tunedjax's top instructions, ms per step: {top or 'none profiled'}."]
  if prof["pytorch_top"]:
    lines.append("PyTorch's top ops, ms per step: " + "; ".join(
        f"`{n}` ({part}) {ms:.2f}" for n, part, ms in prof["pytorch_top"][:5]) + ".")
  return lines + [""]


def _buckets(attention: Any) -> str:
  if not isinstance(attention, Mapping):
    return str(attention)[:300]
  return "; ".join(f"{b.get('bucket')}: {b.get('kernel')}" for b in attention.get("buckets", []))


if __name__ == "__main__":
  workers.run_worker(worker)
