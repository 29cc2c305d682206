"""tunedjax against PyTorch on CPU: the same CNN train steps, weights and batch.

One SGD train step (forward, backward, update) of the MobileNet-style network of
`benchmarks/kernels.py` (batch 32, 64x64; batch norm through the batch-norm family's call
site: the reference under `jax.jit`, the tuned kernel under `tj.jit`) and of the demo
network (`tunedjax.demo.DemoNet`, width 32, batch 128, 32x32; `nnx.BatchNorm` routed to the
family under `tj.jit` by `ops.batch_norm.route_batch_norm`, as the Trainer does), in
idiomatic PyTorch (eager NCHW and channels_last, `torch.compile` of both, eager with batch
norm in primitive ops as JAX computes it) against `jax.jit` and `tj.jit` with kernel
selection. Strided convolutions pad one pixel on every side on both sides, so one set of
weights gives the same step. Section ``vs_pytorch_plain_auto``: the MobileNet-style step in
plain JAX (batch norm in primitive ops; `tj.jit` finds each as a pattern), host memory
``auto``.

Each section runs in a worker process (`harness.workers`). One step is checked first (loss
and every gradient against `jax.jit`, `agreement`, bound 2e-2); then the variants are timed
interleaved (baseline PyTorch eager channels_last, A/A control; each round a variant runs
`prime` untimed steps, then `steps` timed ones: a training loop's steady state, not the
first calls after idle of `after_idle.py`). Then where the time goes: `torch.profiler`
(self CPU time per aten op) and `jax.profiler`'s thunk time per HLO instruction, grouped by
kind, the top ones traced to forward or backward, kernel and model line; and tunedjax's
kernel buckets (`autotune.explain`).

torch is optional: the workers run on this interpreter when it has torch, else on
``.venv-torch/bin/python`` where that exists, else JAX only. The CPU build (plain ``pip
install torch`` gives a CUDA build, 5x slower here):

  python3.11 -m venv .venv-torch
  .venv-torch/bin/pip install -e '.[bench-torch]' \\
      --extra-index-url https://download.pytorch.org/whl/cpu

Run: ``.venv/bin/python benchmarks/run.py vs_pytorch [--quick] [--write]``; from
Python, `measure`'s options: ``bf16=True`` (tunedjax on the mixed-precision
policy too), ``compile=False``, ``prime=0, steps=1`` (the timing before
2026-11-24), ``rounds``, ``threads`` (PyTorch's), ``profile_steps``.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import importlib.util
import os
import pathlib
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

# First, before torch or JAX start threads: tunedjax's host-memory settings (glibc
# malloc) apply at import to the whole process, as the environment decides for a user.
import tunedjax as tj
from tunedjax import _host_memory

try:
  import torch
  from torch import nn
  from torch.nn import functional as F
except ImportError:  # the JAX side only
  torch = None

import jax
import numpy as np
from jax import lax

import harness
import kernels as kernels_bench
from harness import workers
from tunedjax import autotune

TORCH_PYTHON = pathlib.Path(__file__).resolve().parent.parent / ".venv-torch" / "bin" / "python"
BASELINE = "PyTorch eager, channels_last"
TUNED = "tunedjax (tj.jit, kernel selection)"
BF16 = "tunedjax, mixed precision (bf16 compute)"
AGREEMENT_BOUND = 2e-2
LR = 0.01
DN = ("NHWC", "HWIO", "NHWC")
# section: (its networks, the worker's TUNEDJAX_HOST_MEMORY; None: this process's)
SECTIONS = {"vs_pytorch": (("mobilenet", "demo"), None),
            "vs_pytorch_plain_auto": (("mobilenet-plain",), "auto")}
OPTIONS = {"rounds": 9, "prime": 3, "steps": 5, "profile_steps": 3, "bf16": False,
           "compile": True, "threads": os.cpu_count() or 1}


# -- the JAX side -------------------------------------------------------------------------


def _conv(x, w, stride=1, groups=1):
  p = w.shape[0] // 2  # PyTorch's padding=k//2 on every side
  return lax.conv_general_dilated(x, w, (stride, stride), ((p, p), (p, p)),
                                  dimension_numbers=DN, feature_group_count=groups)


def flat_names(tree: Any) -> dict[str, np.ndarray]:
  """A pytree's leaves by dotted path ("blocks.0.dw", "stem.conv.kernel")."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    parts = [str(getattr(k, next(a for a in ("key", "idx", "name") if hasattr(k, a))))
             for k in path if any(hasattr(k, a) for a in ("key", "idx", "name"))]
    out[".".join(p for p in parts if p not in ("value", "raw_value"))] = np.asarray(leaf)
  return out


class NetProblem(NamedTuple):
  """One network's SGD train step with its arguments, as the benchmarks here time it."""

  step: Callable[..., Any]
  args: tuple[Any, ...]  # (params, [batch stats,] x, y)
  width: int | None  # DemoNet's width; None for the MobileNet-style network
  label: str


def net_problem(net: str, quick: bool = False) -> NetProblem:
  """The MobileNet-style (batch 32, 64x64; ``mobilenet-plain``: batch norm in plain JAX)
  or demo (width 32, batch 128, 32x32) step on seeded random data; `quick`: small sizes."""
  rng = np.random.default_rng(0)
  width = None
  if net.startswith("mobilenet"):
    batch, size = (4, 32) if quick else (32, 64)
    plain = net == "mobilenet-plain"
    # kernels.py's network with PyTorch's padding and batch norm through the family's call
    # site, or in plain JAX
    params, loss = kernels_bench.mobilenet(
        rng, conv=_conv, bn=kernels_bench.bn_plain if plain else kernels_bench.bn_family)
    state = (params,)

    def step(params, x, y):
      value, grads = jax.value_and_grad(loss)(params, x, y)
      return value, grads, jax.tree.map(lambda p, g: p - LR * g, params, grads)
    label = ("MobileNet-style step in plain JAX (batch norm in primitive ops: two-pass mean "
             "and variance, `rsqrt`)" if plain
             else "MobileNet-style step (`benchmarks/kernels.py`)")
  else:
    width, batch, size = (8, 8, 16) if quick else (32, 128, 32)
    params, stats, step = kernels_bench.demo_step(width, torch_padding=True, grads=True)
    state = (params, stats)
    label = f"demo network (`DemoNet`, width {width})"
  return NetProblem(step, (*state, *kernels_bench.images(rng, batch, size)), width, label)


# -- the PyTorch side -------------------------------------------------------------------------


def _bn_primitive(x, bn):
  """Batch norm in primitive ops, as JAX computes it (no fused aten kernel)."""
  mean = x.mean(dim=(0, 2, 3), keepdim=True)
  var = ((x - mean) ** 2).mean(dim=(0, 2, 3), keepdim=True)
  return (x - mean) * torch.rsqrt(var + bn.eps) * bn.weight.view(1, -1, 1, 1) \
      + bn.bias.view(1, -1, 1, 1)


if torch is not None:

  class TorchMobileNet(nn.Module):
    """The MobileNet-style network in PyTorch, names as the JAX params'."""

    def __init__(self, widths=(64, 128, 128, 256), strides=(1, 2, 1, 2), c0=32, primitive_bn=False):
      super().__init__()
      self.primitive_bn = primitive_bn
      self.stem = nn.Conv2d(3, c0, 3, 2, 1, bias=False)
      blocks = []
      cin = c0
      for cout, s in zip(widths, strides):
        blk = nn.Module()
        blk.dw = nn.Conv2d(cin, cin, 3, s, 1, groups=cin, bias=False)
        blk.bn1 = nn.BatchNorm2d(cin, eps=1e-5)
        blk.pw = nn.Conv2d(cin, cout, 1, bias=False)
        blk.bn2 = nn.BatchNorm2d(cout, eps=1e-5)
        blocks.append(blk)
        cin = cout
      self.blocks = nn.ModuleList(blocks)
      self.head = nn.Linear(cin, 10, bias=False)

    def _bn(self, x, bn):
      return _bn_primitive(x, bn) if self.primitive_bn else bn(x)

    def forward(self, x, y):
      h = F.relu(self.stem(x))
      for blk in self.blocks:
        h = F.relu(self._bn(blk.dw(h), blk.bn1))
        h = F.relu(self._bn(blk.pw(h), blk.bn2))
      return F.cross_entropy(self.head(h.mean(dim=(2, 3))), y)

  class TorchConvBN(nn.Module):
    def __init__(self, cin, cout, k, stride=1, groups=1, relu=True, primitive_bn=False):
      super().__init__()
      self.conv = nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False)
      self.norm = nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1)  # flax's momentum 0.9
      self.relu, self.primitive_bn = relu, primitive_bn

    def forward(self, x):
      h = self.conv(x)
      y = _bn_primitive(h, self.norm) if self.primitive_bn else self.norm(h)
      return F.relu(y) if self.relu else y

  class TorchSeparable(nn.Module):
    def __init__(self, cin, cout, stride=1, **kw):
      super().__init__()
      self.depthwise = TorchConvBN(cin, cin, 3, stride, groups=cin, **kw)
      self.pointwise = TorchConvBN(cin, cout, 1, relu=False, **kw)
      self.residual = stride == 1 and cin == cout

    def forward(self, x):
      y = self.pointwise(self.depthwise(x))
      return F.relu(x + y if self.residual else y)

  class TorchBottleneck(nn.Module):
    def __init__(self, channels, reduced, **kw):
      super().__init__()
      self.reduce = TorchConvBN(channels, reduced, 1, **kw)
      self.conv = TorchConvBN(reduced, reduced, 3, **kw)
      self.expand = TorchConvBN(reduced, channels, 1, relu=False, **kw)

    def forward(self, x):
      return F.relu(x + self.expand(self.conv(self.reduce(x))))

  class TorchDemoNet(nn.Module):
    """`tunedjax.demo.DemoNet` in PyTorch, names as the nnx module's."""

    def __init__(self, classes=10, width=32, primitive_bn=False):
      super().__init__()
      w, kw = width, {"primitive_bn": primitive_bn}
      self.stem = TorchConvBN(3, w, 3, **kw)
      self.separable = nn.ModuleList([
          TorchSeparable(w, w, **kw), TorchSeparable(w, 2 * w, 2, **kw),
          TorchSeparable(2 * w, 2 * w, **kw), TorchSeparable(2 * w, 4 * w, 2, **kw)])
      self.bottleneck = TorchBottleneck(4 * w, w, **kw)
      self.head = nn.Linear(4 * w, classes)

    def forward(self, x, y):
      h = self.stem(x)
      for block in self.separable:
        h = block(h)
      return F.cross_entropy(self.head(self.bottleneck(h).mean(dim=(2, 3))), y)


_MOBILE_NAMES = {"g1": "bn1.weight", "b1": "bn1.bias", "g2": "bn2.weight",
                 "b2": "bn2.bias", "dw": "dw.weight", "pw": "pw.weight"}


def torch_name(net: str, name: str) -> str:
  """The PyTorch parameter a JAX parameter's dotted name stands for."""
  if net.startswith("mobilenet"):
    head, _, last = name.rpartition(".")
    return f"{name}.weight" if name in ("stem", "head") else f"{head}.{_MOBILE_NAMES[last]}"
  return name.replace(".kernel", ".weight").replace(".scale", ".weight")


def to_torch_layout(a: np.ndarray) -> np.ndarray:
  """HWIO -> OIHW for conv kernels, (in, out) -> (out, in) for dense ones."""
  axes = {4: (3, 2, 0, 1), 2: (1, 0)}.get(a.ndim)
  return a if axes is None else np.ascontiguousarray(a.transpose(axes))


def load_torch(model, net: str, params: Mapping[str, np.ndarray]) -> None:
  state = dict(model.named_parameters())
  with torch.no_grad():
    for name, value in params.items():
      state[torch_name(net, name)].copy_(torch.from_numpy(np.array(to_torch_layout(value))))


def torch_step(model, opt, x, y) -> Callable[[], Any]:
  def step():
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    opt.step()
    return loss
  return step


# -- agreement ---------------------------------------------------------------------------------


def torch_grads(model, run, net: str, x, y, names) -> tuple[float, dict[str, np.ndarray]]:
  """One forward and backward of `run` (`model`, or it compiled): (loss, JAX-layout
  gradients by JAX name)."""
  model.zero_grad(set_to_none=True)
  loss = run(x, y)
  loss.backward()
  state = dict(model.named_parameters())
  grads = {}
  for name in names:
    g = state[torch_name(net, name)].grad.detach().cpu().numpy()
    grads[name] = g.transpose(2, 3, 1, 0) if g.ndim == 4 else g.T if g.ndim == 2 else g
  return float(loss.detach()), grads


def agreement(loss_a: float, grads_a: Mapping[str, np.ndarray], loss_b: float,
              grads_b: Mapping[str, np.ndarray]) -> float:
  """The largest relative error of the loss and each gradient (b the reference).

  A gradient's error is taken relative to its own largest value, or to 1e-3
  of the largest gradient of any tensor where that is more: the scale of a
  batch norm followed (through a ReLU and a convolution) by another batch norm
  has a gradient that is zero in exact arithmetic (the second one normalises
  the scale away), so its float32 values (~1e-7) are rounding noise on every
  side, `jax.jit`'s included.
  """
  floor = 1e-3 * max(float(np.max(np.abs(g))) for g in grads_b.values())
  errs = [abs(loss_a - loss_b) / abs(loss_b)]
  for n, b in grads_b.items():
    a, b = np.asarray(grads_a[n], np.float64), np.asarray(b, np.float64)
    errs.append(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor)))
  return max(errs)


# -- breakdowns --------------------------------------------------------------------------------

_SKIP_EVENTS = ("ThreadpoolListener", "ThunkExecutor", "end: ")


def hlo_kinds(hlo_text: str) -> dict[str, str]:
  """Each entry instruction's name to what it is (for grouping profile events)."""
  comps: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if m and not line.startswith(" "):
      current = m.group(1)
      comps[current] = []
    elif current is not None and line.startswith(" "):
      comps[current].append(line)
  kinds = {}
  for line in (line for lines in comps.values() for line in lines):
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+(?: \S+)*? ([\w\-]+)\(", line)
    if not m:
      continue
    name, opcode = m.group(1), m.group(2)
    if opcode == "fusion" or "calls=" in line:
      called = re.search(r"calls=%?([\w.\-]+)", line)
      body = " ".join(comps.get(called.group(1), [])) if called else ""
      opcode = ("convolution" if " convolution(" in body else "dot" if " dot(" in body
                else "reduce" if " reduce(" in body or " reduce-window(" in body
                else "elementwise" if " multiply(" in body or " add(" in body
                or (" transpose(" not in body and " copy(" not in body) else "transpose")
    kinds[name] = opcode
  return kinds


_FRAME_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# Frames that say nothing about which kernel or layer an instruction belongs to.
_PLUMBING = ("/jax/", "/jaxlib/", "tunedjax/_jit/", "tunedjax/_pipeline.py",
             "autotune/_select.py", "autotune/_tuner.py", "autotune/_bn_family.py",
             "autotune/_bn_flax.py", "benchmarks/vs_pytorch.py",
             "benchmarks/kernels.py:bn_family", "benchmarks/kernels.py:bn_plain",
             "benchmarks/kernels.py:demo_step")


def hlo_call_stacks(hlo_text: str) -> dict[str, list[tuple[str, str, int]]]:
  """Each instruction's Python call stack, innermost first: ``[(file, function, line)]``.

  From the stack-frame tables at the head of a compiled module's text
  (``stack_frame_id`` in each instruction's metadata). An instruction that a
  jaxpr rewrite put in place of a convolution keeps the convolution's stack
  (Flax's `Conv`), so `where` also reads the op name.
  """
  tables: dict[str, dict[int, str]] = {t: {} for t in _FRAME_TABLES}
  section = None
  for line in hlo_text.splitlines():
    if line in _FRAME_TABLES:
      section = line
      continue
    m = re.match(r"^(\d+) (.*)$", line) if section else None
    if m:
      tables[section][int(m.group(1))] = m.group(2)
    elif section and line.strip():
      section = None
  fields = {k: {i: {a: int(b) for a, b in re.findall(r"(\w+)=(\d+)", v)}
                for i, v in tables[k].items()} for k in ("FileLocations", "StackFrames")}

  def stack(frame: int) -> list[tuple[str, str, int]]:
    out, seen = [], set()
    while frame in fields["StackFrames"] and frame not in seen:
      seen.add(frame)
      f = fields["StackFrames"][frame]
      loc = fields["FileLocations"].get(f["file_location_id"], {})
      out.append((tables["FileNames"].get(loc.get("file_name_id"), "?").strip('"'),
                  tables["FunctionNames"].get(loc.get("function_name_id"), "?").strip('"'),
                  loc.get("line", 0)))
      frame = f["parent_frame_id"] - 1  # 1-based; 0: none
    return out

  matches = (re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*stack_frame_id=(\d+)", line)
             for line in hlo_text.splitlines())
  return {m.group(1): stack(int(m.group(2))) for m in matches if m}


def where(name: str, hlo_text: str, stacks: Mapping[str, list[tuple[str, str, int]]]) -> str:
  """Where an instruction comes from: forward or backward, the tunedjax kernel
  (a conv kernel's scope, or the innermost kernel frame) and the innermost model
  frame ("bwd; loop; conv kernel depthwise; linear.py:889 Conv")."""
  m = re.search(r"%" + re.escape(name) + r" = [^\n]*?op_name=\"([^\"]*)\"", hlo_text)
  op = m.group(1) if m else ""
  parts = ["bwd" if "transpose(" in op else "fwd"] if op else []
  if op.endswith("/while") or "/while/" in op:
    parts.append("loop")
  frames = [f for f in stacks.get(name, []) if not any(p in f"{f[0]}:{f[1]}" for p in _PLUMBING)]
  kernel = [f for f in frames if "/autotune/_" in f[0]]
  model = [f for f in frames if "/autotune/_" not in f[0]]
  model = [f for f in model if "site-packages" not in f[0]] or model  # the user's layer
  scope = re.search(r"tj_conv_(\w+)", op)  # `_conv_layout.kernel_scope`
  if scope:
    parts.append(f"conv kernel {scope.group(1)}")
  elif kernel:
    parts.append(f"{os.path.basename(kernel[0][0])} {kernel[0][1].split('.')[0]}")
  if model:
    parts.append(f"{os.path.basename(model[0][0])}:{model[0][2]} {model[0][1].split('.')[0]}")
  return "; ".join(parts)


_JAX_GROUP = {"convolution": "convolutions", "dot": "matmuls (dot)",
              "reduce": "reductions (batch-norm statistics and their gradients, pooling)",
              "elementwise": "elementwise fusions (normalise, ReLU, their gradients, SGD)",
              "transpose": "copies and transposes", "copy": "copies and transposes",
              "custom-call": "tunedjax's native kernels (C++: convolutions, batch-norm sums)"}


def wall_shares(spans: list[tuple[int, int, str]]) -> dict[str, float]:
  """Each name's share of the wall time, in the spans' unit: where k spans overlap,
  each is charged 1/k of that time (XLA:CPU runs independent instructions side by
  side, so their own durations add up to more than the step took).

  Example:
    >>> wall_shares([(0, 4, "a"), (2, 6, "b")])
    {'a': 3.0, 'b': 3.0}
  """
  edges = sorted({t for start, end, _ in spans for t in (start, end)})
  shares: collections.Counter[str] = collections.Counter()
  starts = sorted(spans)
  active: list[tuple[int, int, str]] = []
  i = 0
  for lo, hi in zip(edges, edges[1:]):
    while i < len(starts) and starts[i][0] <= lo:
      active.append(starts[i])
      i += 1
    active = [s for s in active if s[1] > lo]
    for _, _, name in active:
      shares[name] += (hi - lo) / len(active)
  return dict(shares)


def jax_profile(fn: Callable[..., Any], args: tuple[Any, ...], hlo_text: str,
                steps: int, group: Callable[[str, str], str] | None = None,
                shared_wall: bool = False
                ) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
  """ms per step by group, and the top instructions (name, kind, ms per step).

  `group(name, kind)`: the group of an entry instruction (`hlo_kinds`' kind);
  by default its kind's (`_JAX_GROUP`). With `shared_wall`, an instruction's
  ms are its share of the wall time (`wall_shares`) rather than its duration.
  """
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn(*args))
  folder = tempfile.mkdtemp(prefix="tunedjax-vs-pytorch-prof-")
  with jax.profiler.trace(folder):
    for _ in range(steps):
      jax.block_until_ready(fn(*args))
  (path,) = glob.glob(folder + "/**/*.xplane.pb", recursive=True)
  spans = []
  for plane in ProfileData.from_file(path).planes:
    for line in plane.lines:
      if line.name == "python":
        continue  # the Python tracer; thunks run on PjRt's and Eigen's threads
      for e in line.events:
        # "$file:line function": Python frames the tracer put on other
        # threads (a waiting thread's whole wait), not work of the step.
        if not e.name.startswith(_SKIP_EVENTS) and not e.name.startswith("$"):
          spans.append((e.start_ns, e.start_ns + e.duration_ns, e.name))
  totals: collections.Counter[str] = collections.Counter()
  if shared_wall:
    totals.update({n: ns / 1e6 / steps for n, ns in wall_shares(spans).items()})
  else:
    for start, end, name in spans:
      totals[name] += (end - start) / 1e6 / steps
  kinds = hlo_kinds(hlo_text)
  stacks = hlo_call_stacks(hlo_text)
  groups: collections.Counter[str] = collections.Counter()
  top = []
  for name, ms in totals.most_common():
    kind = kinds.get(name, "other")
    if kind != "while":  # a loop's time is its body's instructions', counted as they run
      groups[group(name, kind) if group else _JAX_GROUP.get(kind, "other")] += ms
    if len(top) < 12:
      source = where(name, hlo_text, stacks)
      top.append((name, f"{kind}; {source}" if source else kind, ms))
  return dict(groups), top


_TORCH_GROUPS = (  # (group, substrings of an aten op's name), the first that matches
    ("convolutions", ("conv",)), ("batch norm (fused aten kernels)", ("batch_norm",)),
    (_JAX_GROUP["dot"], ("addmm", "mm", "linear")),
    (_JAX_GROUP["reduce"], ("sum", "mean", "var")),
    (_JAX_GROUP["elementwise"], ("relu", "threshold", "add", "mul", "sub", "div", "rsqrt",
                                 "pow", "sgd", "foreach", "where", "sqrt")),
    (_JAX_GROUP["copy"], ("copy", "contiguous", "clone", "permute", "to_dense", "reorder")))


def _torch_group(key: str) -> str:
  return next((g for g, subs in _TORCH_GROUPS if any(s in key.lower() for s in subs)), "other")


def torch_profile(step: Callable[[], Any], steps: int,
                  group: Callable[[str, str], str] | None = None
                  ) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
  """ms per step (self CPU time) by group, and the top aten ops.

  `group(op, scope)`: the group of an op's self time, `scope` the name of the
  outermost event it ran in (itself at the top; ``Optimizer.step#AdamW.step``,
  ``autograd::engine::evaluate_function: NativeLayerNormBackward0``, ...);
  by default the op name's (`_TORCH_GROUPS`).
  """
  from torch import profiler  # pylint: disable=import-outside-toplevel
  step()
  with profiler.profile(activities=[profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
      step()
  groups: collections.Counter[str] = collections.Counter()
  if group is not None:  # per event: its scope
    ops: collections.Counter[tuple[str, str]] = collections.Counter()
    for e in prof.events():
      top = e
      while top.cpu_parent is not None:
        top = top.cpu_parent
      ms = e.self_cpu_time_total / 1e3 / steps
      if ms > 0 and not e.name.startswith(("ProfilerStep", "##")):
        part = group(e.name, top.name)
        groups[part] += ms
        ops[e.name, part] += ms
    return dict(groups), [(k, part, ms) for (k, part), ms in ops.most_common(10)]
  rows = []
  for item in prof.key_averages():
    ms = item.self_cpu_time_total / 1e3 / steps
    if ms <= 0 or item.key.startswith(("ProfilerStep", "Optimizer.step", "##")):
      continue
    groups[_torch_group(item.key)] += ms
    rows.append((item.key, _torch_group(item.key).split(" (")[0], ms))
  rows.sort(key=lambda r: -r[2])
  return dict(groups), rows[:10]


# -- one network, in the worker ---------------------------------------------------------------


def page_faults_per_step(step: Callable[[], Any], steps: int = 3) -> float:
  """Minor page faults of the process per call of `step` (after one untimed call): a step
  whose temporaries are mapped afresh faults them in again each time (`_host_memory`)."""
  step()
  before = _host_memory.minor_page_faults()
  for _ in range(steps):
    step()
  return (_host_memory.minor_page_faults() - before) / steps


def _torch_variants(net: str, problem: NetProblem, o: dict[str, Any], check: Callable,
                    notes: dict[str, str], profiles: dict) -> dict[str, Callable[[], Any]]:
  """PyTorch's variants of the step (each checked against jax.jit first)."""
  torch.manual_seed(0)
  torch.set_num_threads(o["threads"])
  params, x, y = problem.args[0], problem.args[-2], problem.args[-1]
  named = flat_names(params)
  xt = torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy())
  yt = torch.from_numpy(np.asarray(y).astype(np.int64))
  kinds = [("channels_last", False, False), ("NCHW", False, False), ("channels_last", True, False)]
  if o["compile"]:
    kinds += [("channels_last", False, True), ("NCHW", False, True)]
  variants = {}
  for layout, primitive, compiled in kinds:
    model = (TorchMobileNet(primitive_bn=primitive) if net.startswith("mobilenet")
             else TorchDemoNet(width=problem.width, primitive_bn=primitive))
    load_torch(model, net, named)
    xin = xt
    if layout == "channels_last":
      model = model.to(memory_format=torch.channels_last)
      xin = xt.contiguous(memory_format=torch.channels_last)
    model.train()
    run = torch.compile(model) if compiled else model
    name = (("torch.compile" if compiled else "PyTorch eager") + f", {layout}"
            + (", batch norm in primitive ops" if primitive else ""))
    start = time.perf_counter()
    check(name, *torch_grads(model, run, net, xin, yt, named))
    if compiled:
      notes[name] = f"compiled in {time.perf_counter() - start:.0f} s"
    variants[name] = torch_step(run, torch.optim.SGD(model.parameters(), lr=LR), xin, yt)
    if name == BASELINE:
      profiles[BASELINE] = torch_profile(variants[name], o["profile_steps"])
  return variants


def run_net(net: str, o: dict[str, Any], cache_dir: str) -> dict[str, Any]:
  """One network's agreement, timings, page faults, profiles and kernel buckets (JSON)."""
  problem = net_problem(net, o["quick"])
  step, args = problem.step, problem.args
  session = autotune.TuningSession()  # a fresh one: the first call tunes
  config = {"kernel": {"enable": True}, "cache": {"dir": cache_dir}}
  tuned, outs, agree, notes, profiles = {}, {}, {}, {}, {}

  def tj_variant(name: str, variant_config: dict[str, Any]) -> Any:
    """`step` under tj.jit and `variant_config` (one session: tuned buckets reused)."""
    with tj.config_context(variant_config):
      fn = tj.jit(step, session=session)
      outs[name] = jax.block_until_ready(fn(*args))

    def run():
      with tj.config_context(variant_config):
        return jax.block_until_ready(fn(*args))

    tuned[name] = run
    return fn

  start = time.perf_counter()
  tj_step = tj_variant(TUNED, config)
  signature = tj_step.report(memory=False).last
  print(f"{net}: tj.jit first call {time.perf_counter() - start:.1f} s "
        f"({signature.tuning_s:.1f} s tuning)", file=sys.stderr)
  for m in signature.kernel_report.matched if signature.kernel_report else ():
    print(f"{net}: site found written out: {m.op} {m.spelling}: {m.kernel}, {m.replaced}",
          file=sys.stderr)
  notes[TUNED] = f"tuning {signature.tuning_s:.0f} s on the first call"
  outs[TUNED] = tuned[TUNED]()  # checked after its first call (which tunes)
  xla_step = jax.jit(step)
  ref = xla_step(*args)
  ref_loss, ref_grads = float(ref[0]), flat_names(ref[1])

  def check(name: str, loss: float, grads: dict[str, np.ndarray]) -> None:
    agree[name] = agreement(loss, grads, ref_loss, ref_grads)

  variants = {} if torch is None else _torch_variants(net, problem, o, check, notes, profiles)
  variants["jax.jit"] = lambda: jax.block_until_ready(xla_step(*args))
  # The batch-norm family's share: the same step, batch norm pinned to the reference.
  tj_variant("tunedjax, batch norm pinned to xla",
             {**config, "kernel": {"enable": True, "hints": {"batch_norm": "xla"}}})
  if o["bf16"]:  # the opt-in mixed-precision path (bfloat16 compute, float32 parameters)
    tj_variant(BF16, {**config, "mixed_precision": {"enable": True}})
  for name, out in outs.items():
    check(name, float(out[0]), flat_names(out[1]))
  if BF16 in agree:  # bfloat16 compute: reported, not held to the float32 bound
    notes[BF16] = f"bf16 compute: one step vs jax.jit {agree.pop(BF16):.1e}"
  for name, err in agree.items():
    print(f"{net}: one step, {name} vs jax.jit: relative error {err:.1e}", file=sys.stderr)
  bad = {n: e for n, e in agree.items() if not e <= AGREEMENT_BOUND}
  if bad:
    raise SystemExit(f"{net}: one step disagrees with jax.jit beyond {AGREEMENT_BOUND}: {bad}")
  variants.update(tuned)
  t = harness.interleaved(variants, baseline=BASELINE if BASELINE in variants else "jax.jit",
                          rounds=o["rounds"], warmup=1, prime=o["prime"], burst=o["steps"])
  faults = {name: page_faults_per_step(fn) for name, fn in variants.items()}
  with tj.config_context(config):
    profiles["tunedjax"] = jax_profile(tj_step, args, tj_step.lower(*args).compile().as_text(),
                                       o["profile_steps"])
    buckets = autotune.explain(step, *args, cache=cache_dir)
  profiles["jax.jit"] = jax_profile(xla_step, args, xla_step.lower(*args).compile().as_text(),
                                    o["profile_steps"])
  x = args[-2]
  return {"label": problem.label, "shape": f"batch {x.shape[0]}, {x.shape[1]}x{x.shape[1]}",
          "runs": t.runs, "baseline": t.baseline, "agreement": agree, "notes": notes,
          "faults": faults, "profiles": profiles,
          "buckets": [{k: getattr(b, k) for k in ("op", "bucket", "count", "kernel", "xla_ms",
                                                  "kernel_ms", "speedup")} for b in buckets]}


def worker(nets: list[str], options: dict[str, Any]) -> None:
  """Runs `nets` when asked; replies with their figures and this process's settings."""

  def run():
    cache_dir = tempfile.mkdtemp(prefix="tunedjax-vs-pytorch-")
    with contextlib.redirect_stdout(sys.stderr):  # stdout: the protocol's replies only
      nets_out = [run_net(n, options, cache_dir) for n in nets]
    return {"nets": nets_out, "torch": torch and torch.__version__,
            "host_memory": tj.host_memory_status().to_dict()}

  workers.serve(run)


# -- the driver and the report ----------------------------------------------------------------


def _python() -> str:
  """An interpreter with PyTorch: this one, else .venv-torch's, else this one (JAX only)."""
  if importlib.util.find_spec("torch") is None and TORCH_PYTHON.exists():
    return str(TORCH_PYTHON)
  return sys.executable


def measure(quick: bool = False, **options: Any) -> harness.Result:
  """Each section's networks in a worker of its own; `options` override `OPTIONS`."""
  if set(options) - set(OPTIONS):
    raise TypeError(f"unknown options {sorted(set(options) - set(OPTIONS))}; valid: {OPTIONS}")
  o = {**OPTIONS, **({"rounds": 2, "profile_steps": 1} if quick else {}), **options,
       "quick": quick}
  if o["prime"] < 0 or o["steps"] < 1:
    raise ValueError(f"prime must be >= 0 and steps >= 1, got {o['prime']} and {o['steps']}")
  python = _python()
  tunedjax_env = {k: v for k, v in os.environ.items() if k.startswith("TUNEDJAX_")}
  result = harness.Result("vs_pytorch", params=o)
  for section, (nets, host_memory) in SECTIONS.items():
    env = {**tunedjax_env, **({"TUNEDJAX_HOST_MEMORY": host_memory} if host_memory else {})}
    proc = workers.spawn(workers.command(__file__, python, nets=nets, options=o),
                         workers.user_env(**env))
    proc.reply()
    result.figures[section] = workers.run_rounds({section: proc}, 1)[section][0]
    for net, got in zip(nets, result.figures[section]["nets"]):
      result.timings[net] = harness.Timings(got.pop("runs"), got.pop("baseline"))
  return result


def _num(value: float | None, unit: str = "") -> str:
  return "" if value is None else f"{value:.2f}{unit}"


def _net_lines(net: str, r: dict[str, Any], t: harness.Timings, profile_steps: int
               ) -> list[str]:
  """One network's tables: the variants, where the time goes, the kernel buckets."""
  lines = ["", f"### {r['label']}, {r['shape']}", "",
           ("| variant | ms per step | ratio to baseline | per-round range | "
            "one step vs jax.jit | page faults per step | note |"),
           "|---|---:|---:|---:|---:|---:|---|"]
  for name in t.runs:
    lo, hi = t.spread(name)
    err, faults = r["agreement"].get(name), r["faults"].get(name)
    lines.append(f"| {name} | {1e3 * t.median(name):.1f} | {t.ratio(name):.2f} | "
                 f"{lo:.2f}-{hi:.2f} | {'' if err is None else f'{err:.1e}'} | "
                 f"{'' if faults is None else f'{faults:,.0f}'} | {r['notes'].get(name, '')} |")
  profiles = r["profiles"]
  sides = list(profiles)
  groups = sorted({g for prof in profiles.values() for g in prof[0]},
                  key=lambda g: -max(p[0].get(g, 0.0) for p in profiles.values()))
  lines += ["", (f"Where the time goes (ms per step, {profile_steps} profiled steps; "
                 "PyTorch: `torch.profiler` self CPU time per aten op; JAX: `jax.profiler` "
                 "thunk time per HLO instruction of the compiled step, summed over threads, "
                 "grouped by what the instruction computes):"), "",
            "| group | " + " | ".join(sides) + " |", "|---|" + "---:|" * len(sides)]
  lines += [f"| {g} | " + " | ".join(f"{profiles[s][0].get(g, 0.0):.1f}" for s in sides) + " |"
            for g in groups]
  lines.append("| total | " + " | ".join(f"{sum(profiles[s][0].values()):.1f}"
                                         for s in sides) + " |")
  for side in sides:
    lines += ["", f"Top ops, {side}: " + "; ".join(
        f"`{n}` ({k}) {ms:.1f}" for n, k, ms in profiles[side][1][:8]) + "."]
  buckets = r["buckets"]
  shown = [b for b in buckets if b["op"] == "batch_norm" or b["kernel"] not in (None, "xla")]
  if buckets:
    lines += ["", (f"tunedjax's kernel buckets (`autotune.explain`; times from the tuner, "
                   f"forward only): {len(buckets)} buckets, {len(buckets) - len(shown)} of "
                   "them convolutions left on xla; the others:"),
              "", "| bucket | sites | kernel | xla (ms) | kernel (ms) | speedup |",
              "|---|---:|---|---:|---:|---:|"]
    lines += [f"| {b['bucket']} | {b['count']} | {b['kernel']} | {_num(b['xla_ms'])} | "
              f"{_num(b['kernel_ms'])} | {_num(b['speedup'], 'x')} |" for b in shown]
  return lines


def _section(section: str, result: harness.Result) -> str:
  o, f = result.params, result.figures[section]
  status = f["host_memory"]
  torch_line = (f"PyTorch {f['torch']} ({o['threads']} threads)" if f["torch"]
                else "PyTorch not installed: JAX side only")
  primed = ("" if not o["prime"] else
            f", each variant's {o['steps']} timed step(s) (their mean) right after "
            f"{o['prime']} untimed step(s) of the same variant (the steady state of a training "
            "loop: not charged for the previous variant's spinning threads, nor for the slow "
            "first calls of an XLA program whose threads sat idle while the other variants ran; "
            "see BENCHMARKS.md, after idle)")
  applied = ("tunedjax's settings applied (" + ", ".join(
      f"{k}={v}" for k, v in status["settings"].items()) + ")" if status["applied"]
      else f"not applied: {status['reason']}")
  title = "## tunedjax against PyTorch on CPU"
  if section != "vs_pytorch":
    title += f": the step in plain JAX, host memory `{status['mode']}`"
  lines = [
      title, "",
      f"`benchmarks/run.py vs_pytorch{' --quick' if o['quick'] else ''}`: one SGD train step "
      "(forward, backward, update), the same weights and batch on both sides; "
      f"{torch_line}; jax {jax.__version__}. Each variant timed in {o['rounds']} interleaved "
      f"rounds after a warm-up{primed}; ratio = the variant's time over PyTorch eager "
      "channels_last (median of per-round ratios; under 1 is faster than PyTorch); A/A = that "
      "baseline timed twice. One step checked first: the loss and every gradient against "
      f"`jax.jit` (largest relative error, bound {AGREEMENT_BOUND:g}). {result.load_line()} "
      + result.machine, "",
      (f"Host memory (`TUNEDJAX_HOST_MEMORY={status['mode']}`; "
       "`tunedjax.host_memory_status()`, one process for both sides): "
       f"{applied}. Page faults per step: the process's minor page faults per "
       "call of the variant, over 3 calls after the timing.")]
  for net, r in zip(SECTIONS[section][0], f["nets"]):
    lines += _net_lines(net, r, result.timings[net], o["profile_steps"])
  return "\n".join(lines)


def render(result: harness.Result) -> dict[str, str]:
  return {section: _section(section, result) for section in SECTIONS}


if __name__ == "__main__":
  workers.run_worker(worker)
