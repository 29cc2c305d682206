"""tunedjax against PyTorch on CPU: the same CNN train steps, weights and batch.

Two networks, each as one SGD train step (forward, backward, update):

- the MobileNet-style step of `benchmarks/kernels.py` (3x3 stem, four
  depthwise 3x3 + BatchNorm + pointwise 1x1 + BatchNorm blocks, batch 32 at
  64x64), and
- the demo network (`tunedjax.demo.DemoNet`, width 32, batch 128 at 32x32),

in idiomatic PyTorch (`nn.Conv2d` with `groups` for the depthwise
convolutions, `nn.BatchNorm2d` on batch statistics, `torch.optim.SGD`; eager
NCHW, eager channels_last, `torch.compile` of both; and, for the diagnosis,
the same step with batch norm written out in primitive ops as JAX computes
it) against `jax.jit` and `tunedjax.jit` with kernel selection on. The
MobileNet-style step's batch norms call `tunedjax.ops.batch_norm._family.batch_norm`
(the batch-norm op family's call site: the reference under `jax.jit`, the
tuned kernel under `tj.jit`); DemoNet's are Flax's `nnx.BatchNorm`, routed to
the same family under `tj.jit` by `ops.batch_norm.route_batch_norm` (as the Trainer
does). `--bf16` also times tunedjax on the opt-in mixed-precision policy. The
strided 3x3 convolutions pad one pixel on every side on both sides (PyTorch's
``padding=1``; "SAME" would pad 0 before and 1 after), so one set of weights
gives the same step.

`--net mobilenet-plain` (or `all`) adds the same MobileNet-style step written
in plain JAX: batch norm in primitive ops (two-pass mean and variance,
`rsqrt`), no tunedjax call in the model; under `tj.jit` with kernel
selection on, the batch-norm family finds each one as a pattern (forward and
backward together: the step differentiates inside `tj.jit`).

The script first checks that one step agrees: the loss and every gradient
of each PyTorch variant and of tunedjax against `jax.jit` (relative error =
max |a - b| / max |b| per tensor, with 1e-3 of the largest gradient as the
least scale: see `agreement`; the largest reported, bound 2e-2). Then it
times the variants interleaved in rounds (`_harness.interleaved`: rotated
order, the baseline timed twice as an A/A control; in each round a variant
runs `--prime` untimed steps, 3, then `--steps` timed ones, 5, whose mean is
its time: a training loop's steady state, not the slow first calls of an
XLA program whose threads sat idle while the other variants ran, which
`after_idle.py` measures), quoting medians and the
median of per-round ratios against PyTorch eager channels_last. Then the
per-op breakdown: `torch.profiler` for PyTorch (self CPU time per aten op),
and for JAX the thunk times of the compiled program from `jax.profiler`
(each HLO instruction's time, grouped by what the instruction is:
convolutions, reductions, elementwise fusions, copies; the top ones traced
back to forward or backward, tunedjax kernel and model line through the
module's stack-frame tables) plus tunedjax's per-bucket kernel times from
`autotune.explain`.

torch is an optional extra, never a runtime dependency. Setup, once (the CPU
build; plain ``pip install torch`` gives a CUDA build that is 5x slower on
CPU):

  python3.11 -m venv .venv-torch
  .venv-torch/bin/pip install -e '.[bench-torch]' \\
      --extra-index-url https://download.pytorch.org/whl/cpu
  # or, offline, the wheel file: .venv-torch/bin/pip install -e . torch-2.13.0+cpu-*.whl

Run (`--quick`: tiny shapes, the smoke run; `--write`: rewrite this
benchmark's section of BENCHMARKS.md):

  .venv-torch/bin/python benchmarks/vs_pytorch.py [--quick] [--write] [--rounds N]

Run from any other interpreter without torch, the script re-runs itself with
``.venv-torch/bin/python`` when that exists, and otherwise times the JAX side
only and says so.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import pathlib
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

# First, before torch or JAX start threads: tunedjax's host-memory settings (glibc
# malloc) apply at import to the whole process, so both sides run with them when they
# do. The environment decides, as for a user: by default (`auto`) they apply from the
# run after one that measured them paying; `TUNEDJAX_HOST_MEMORY=retain` forces them.
import tunedjax as tj  # pylint: disable=wrong-import-position
from tunedjax import _host_memory  # pylint: disable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH_VENV = ROOT / ".venv-torch"
_REEXEC = "TUNEDJAX_VS_PYTORCH_REEXEC"


def _torch_or_reexec() -> Any:
  """torch, or None; without torch re-runs this script in .venv-torch if it exists."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
    return torch
  except ImportError:
    pass
  python = TORCH_VENV / "bin" / "python"
  if python.exists() and not os.environ.get(_REEXEC):
    env = dict(os.environ, **{_REEXEC: "1"})
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    print(f"torch is not installed here; re-running with {python}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(str(python), [str(python), *sys.argv], env)
  return None


torch = _torch_or_reexec()

import harness as _harness  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import kernels as kernels_bench  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import optax  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position
from jax import lax  # pylint: disable=wrong-import-position

from tunedjax import autotune, ops  # pylint: disable=wrong-import-position
from tunedjax.ops.batch_norm import _family as _bn_family  # pylint: disable=wrong-import-position
from tunedjax.demo import DemoNet  # pylint: disable=wrong-import-position

if torch is not None:
  from torch import nn  # pylint: disable=ungrouped-imports
  from torch.nn import functional as F

BASELINE = "PyTorch eager, channels_last"
AGREEMENT_BOUND = 2e-2
LR = 0.01
DN = ("NHWC", "HWIO", "NHWC")


# -- the JAX side -------------------------------------------------------------------------


def _conv(x, w, stride=1, groups=1):
  p = w.shape[0] // 2  # PyTorch's padding=k//2 on every side
  return lax.conv_general_dilated(x, w, (stride, stride), ((p, p), (p, p)),
                                  dimension_numbers=DN, feature_group_count=groups)


def _bn(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
  # kernels.py's `_bn` through the batch-norm family's call site: under jax.jit the
  # reference (the same mean, var and normalisation), under tj.jit the tuned kernel.
  return _bn_family.batch_norm(x, g, b, epsilon=1e-5)


def _bn_plain(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
  # Batch norm as plain JAX code writes it, in primitive ops (two passes, rsqrt): no
  # tunedjax call; under tj.jit the batch-norm family finds it as a pattern.
  mean = x.mean(axis=(0, 1, 2))
  var = ((x - mean) ** 2).mean(axis=(0, 1, 2))
  return (x - mean) * lax.rsqrt(var + 1e-5) * g + b


def mobilenet_jax(rng: np.random.Generator, widths=(64, 128, 128, 256), strides=(1, 2, 1, 2),
                  bn: Callable[..., Any] = _bn):
  """`benchmarks/kernels.py`'s MobileNet-style network: (params, loss(params, x, y), strides).

  The same parameters, initialisation and computation as `kernels.mobilenet`,
  with PyTorch's symmetric padding and batch norm through the family's call site
  (or `bn`: `_bn_plain` for the step written in plain JAX).
  """
  params, loss = kernels_bench.mobilenet(rng, widths, strides, conv=_conv, bn=bn)
  return params, loss, strides


def mobilenet_step(loss):
  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return value, grads, jax.tree.map(lambda p, g: p - LR * g, params, grads)
  return step


def demo_jax(width: int, classes: int = 10):
  """DemoNet split into (graphdef, params, batch stats) and its SGD step."""
  model = DemoNet(classes, width=width, seed=0)
  for block in model.separable:  # the strided depthwise convs: PyTorch's padding=1
    conv = block.depthwise.conv
    if conv.strides not in (1, (1, 1)):
      conv.padding = ((1, 1), (1, 1))
  graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

  # nnx.BatchNorm onto the batch-norm family under tj.jit (as the Trainer does); under
  # jax.jit, outside kernel selection, Flax's own code.
  @ops.batch_norm.route_batch_norm()
  def loss(params, stats, x, y):
    m = nnx.merge(graphdef, params, stats, copy=True)
    logits = m(x)
    value = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return value, nnx.state(m, nnx.BatchStat)

  def step(params, stats, x, y):
    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params, stats, x, y)
    return value, grads, jax.tree.map(lambda p, g: p - LR * g, params, grads), stats

  return params, stats, step


def flat_names(tree: Any) -> dict[str, np.ndarray]:
  """A pytree's leaves by dotted path ("blocks.0.dw", "stem.conv.kernel")."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    parts = []
    for k in path:
      for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
          parts.append(str(getattr(k, attr)))
          break
    name = ".".join(p for p in parts if p not in ("value", "raw_value"))
    out[name] = np.asarray(leaf)
  return out


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

    def __init__(self, widths=(64, 128, 128, 256), strides=(1, 2, 1, 2), c0=32,
                 primitive_bn=False):
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
    if name in ("stem", "head"):
      return f"{name}.weight"
    return f"{head}.{_MOBILE_NAMES[last]}"
  return (name.replace(".kernel", ".weight").replace(".scale", ".weight"))


def to_torch_layout(a: np.ndarray) -> np.ndarray:
  """HWIO -> OIHW for conv kernels, (in, out) -> (out, in) for dense ones."""
  if a.ndim == 4:
    return np.ascontiguousarray(a.transpose(3, 2, 0, 1))
  if a.ndim == 2:
    return np.ascontiguousarray(a.T)
  return a


def load_torch(model, net: str, params: Mapping[str, np.ndarray]) -> None:
  state = dict(model.named_parameters())
  with torch.no_grad():
    for name, value in params.items():
      target = state[torch_name(net, name)]
      target.copy_(torch.from_numpy(np.array(to_torch_layout(value))))


def torch_step(model, opt, x, y) -> Callable[[], Any]:
  def step():
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    opt.step()
    return loss
  return step


# -- agreement ---------------------------------------------------------------------------------


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


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
    if g.ndim == 4:
      g = g.transpose(2, 3, 1, 0)
    elif g.ndim == 2:
      g = g.T
    grads[name] = g
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
      continue
    if current is not None and line.startswith(" "):
      comps[current].append(line)
  kinds = {}
  for lines in comps.values():
    for line in lines:
      m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+(?: \S+)*? ([\w\-]+)\(", line)
      if not m:
        continue
      name, opcode = m.group(1), m.group(2)
      if opcode == "fusion" or "calls=" in line:
        called = re.search(r"calls=%?([\w.\-]+)", line)
        body = " ".join(comps.get(called.group(1), [])) if called else ""
        if " convolution(" in body:
          opcode = "convolution"
        elif " dot(" in body:
          opcode = "dot"
        elif " reduce(" in body or " reduce-window(" in body:
          opcode = "reduce"
        elif " transpose(" in body or " copy(" in body:
          opcode = "transpose" if " multiply(" not in body and " add(" not in body \
              else "elementwise"
        else:
          opcode = "elementwise"
      kinds[name] = opcode
  return kinds


_FRAME_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# Frames that say nothing about which kernel or layer an instruction belongs to.
_PLUMBING = ("/jax/", "/jaxlib/", "tunedjax/_jit/", "tunedjax/_pipeline.py",
             "autotune/_select.py", "autotune/_tuner.py", "autotune/_bn_family.py",
             "autotune/_bn_flax.py", "benchmarks/vs_pytorch.py")


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

  stacks = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*stack_frame_id=(\d+)", line)
    if m:
      stacks[m.group(1)] = stack(int(m.group(2)))
  return stacks


def where(name: str, hlo_text: str, stacks: Mapping[str, list[tuple[str, str, int]]]) -> str:
  """Where an instruction comes from: forward or backward, the tunedjax kernel
  (a conv kernel's scope, or the innermost kernel frame) and the innermost model
  frame ("bwd; loop; conv kernel depthwise; linear.py:889 Conv")."""
  m = re.search(r"%" + re.escape(name) + r" = [^\n]*?op_name=\"([^\"]*)\"", hlo_text)
  op = m.group(1) if m else ""
  parts = ["bwd" if "transpose(" in op else "fwd"] if op else []
  if op.endswith("/while") or "/while/" in op:
    parts.append("loop")
  frames = [f for f in stacks.get(name, []) if not any(p in f[0] for p in _PLUMBING)]
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


def jax_profile(fn: Callable[..., Any], args: tuple[Any, ...], hlo_text: str,
                steps: int) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
  """ms per step by group, and the top instructions (name, kind, ms per step)."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn(*args))
  folder = tempfile.mkdtemp(prefix="tunedjax-vs-pytorch-prof-")
  with jax.profiler.trace(folder):
    for _ in range(steps):
      jax.block_until_ready(fn(*args))
  (path,) = glob.glob(folder + "/**/*.xplane.pb", recursive=True)
  totals: collections.Counter[str] = collections.Counter()
  for plane in ProfileData.from_file(path).planes:
    for line in plane.lines:
      if line.name == "python":
        continue  # the Python tracer; thunks run on PjRt's and Eigen's threads
      for e in line.events:
        # "$file:line function": Python frames the tracer put on other
        # threads (a waiting thread's whole wait), not work of the step.
        if not e.name.startswith(_SKIP_EVENTS) and not e.name.startswith("$"):
          totals[e.name] += e.duration_ns / 1e6 / steps
  kinds = hlo_kinds(hlo_text)
  stacks = hlo_call_stacks(hlo_text)
  groups: collections.Counter[str] = collections.Counter()
  top = []
  for name, ms in totals.most_common():
    kind = kinds.get(name, "other")
    if kind != "while":  # a loop's time is its body's instructions', counted as they run
      groups[_JAX_GROUP.get(kind, "other")] += ms
    if len(top) < 12:
      source = where(name, hlo_text, stacks)
      top.append((name, f"{kind}; {source}" if source else kind, ms))
  return dict(groups), top


def _torch_group(key: str) -> str:
  k = key.lower()
  if "conv" in k:
    return "convolutions"
  if "batch_norm" in k:
    return "batch norm (fused aten kernels)"
  if any(s in k for s in ("addmm", "mm", "linear")):
    return "matmuls (dot)"
  if any(s in k for s in ("sum", "mean", "var")):
    return "reductions (batch-norm statistics and their gradients, pooling)"
  if any(s in k for s in ("relu", "threshold", "add", "mul", "sub", "div", "rsqrt", "pow",
                          "sgd", "foreach", "where", "sqrt")):
    return "elementwise fusions (normalise, ReLU, their gradients, SGD)"
  if any(s in k for s in ("copy", "contiguous", "clone", "permute", "to_dense",
                          "reorder")):
    return "copies and transposes"
  return "other"


def torch_profile(step: Callable[[], Any], steps: int
                  ) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
  """ms per step (self CPU time) by group, and the top aten ops."""
  from torch import profiler  # pylint: disable=import-outside-toplevel
  step()
  with profiler.profile(activities=[profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
      step()
  groups: collections.Counter[str] = collections.Counter()
  rows = []
  for item in prof.key_averages():
    ms = item.self_cpu_time_total / 1e3 / steps
    if ms <= 0 or item.key.startswith(("ProfilerStep", "Optimizer.step", "##")):
      continue
    groups[_torch_group(item.key)] += ms
    rows.append((item.key, _torch_group(item.key).split(" (")[0], ms))
  rows.sort(key=lambda r: -r[2])
  return dict(groups), rows[:10]


# -- one network -----------------------------------------------------------------------------


@dataclasses.dataclass
class NetResult:
  name: str
  shape: str
  timings: Any
  agreement: dict[str, float]
  profiles: dict[str, tuple[dict[str, float], list[tuple[str, str, float]]]]
  buckets: list[Any]
  tuning_s: float
  notes: dict[str, str]
  faults: dict[str, float]


def page_faults_per_step(step: Callable[[], Any], steps: int = 3) -> float:
  """Minor page faults of the process per call of `step` (after one untimed call).

  A step whose temporary buffers are mapped afresh each time faults every page
  of them in again (see `tunedjax._host_memory`).
  """
  step()
  before = _host_memory.minor_page_faults()
  for _ in range(steps):
    step()
  return (_host_memory.minor_page_faults() - before) / steps


def _block(fn, args):
  return lambda: jax.block_until_ready(fn(*args))


class NetProblem(NamedTuple):
  """One network's SGD train step with its arguments, as the benchmarks here time it."""

  step: Callable[..., Any]
  args: tuple[Any, ...]  # (params, [batch stats,] x, y)
  width: int | None  # DemoNet's width; None for the MobileNet-style network
  label: str


def net_problem(net: str, quick: bool = False) -> NetProblem:
  """The MobileNet-style (batch 32, 64x64) or demo (width 32, batch 128, 32x32) step
  on seeded random data; `quick`: the smoke run's small sizes."""
  rng = np.random.default_rng(0)
  width = None
  if net.startswith("mobilenet"):
    batch, size = (4, 32) if quick else (32, 64)
    plain = net == "mobilenet-plain"
    params, loss, _ = mobilenet_jax(rng, bn=_bn_plain if plain else _bn)
    step, state = mobilenet_step(loss), (params,)
    label = ("MobileNet-style step in plain JAX (batch norm in primitive ops: two-pass mean "
             "and variance, `rsqrt`)" if plain
             else "MobileNet-style step (`benchmarks/kernels.py`)")
  else:
    width, batch, size = (8, 8, 16) if quick else (32, 128, 32)
    params, stats, step = demo_jax(width)
    state = (params, stats)
    label = f"demo network (`DemoNet`, width {width})"
  x = jnp.asarray(rng.normal(size=(batch, size, size, 3)).astype(np.float32))
  y = jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)
  return NetProblem(step, (*state, x, y), width, label)


def run_net(net: str, args: argparse.Namespace, cache_dir: str) -> NetResult:
  step, full_args, width, label = net_problem(net, args.quick)
  params, x, y = full_args[0], full_args[-2], full_args[-1]
  batch, size = x.shape[0], x.shape[1]
  shape = f"batch {batch}, {size}x{size}"

  # JAX: jax.jit and tunedjax (kernel selection on, a fresh session: the first call tunes).
  xla_step = jax.jit(step)
  session = autotune.TuningSession()
  config = {"kernel": {"enable": True}, "cache": {"dir": cache_dir}}
  with tj.config_context(config):
    tj_step = tj.jit(step, session=session)
    start = time.perf_counter()
    jax.block_until_ready(tj_step(*full_args))
    first_call_s = time.perf_counter() - start
    signature = tj_step.report(memory=False).last
    tuning_s = signature.tuning_s
  print(f"{net}: tj.jit first call {first_call_s:.1f} s ({tuning_s:.1f} s tuning)",
        file=sys.stderr)
  matched = signature.kernel_report.matched if signature.kernel_report else ()
  if matched:
    print(f"{net}: {len(matched)} sites found written out: " + "; ".join(
        f"{m.op} {m.spelling}: {m.kernel}, {m.replaced}" for m in matched), file=sys.stderr)

  ref = xla_step(*full_args)
  ref_loss, ref_grads = float(ref[0]), flat_names(ref[1])
  with tj.config_context(config):
    got = tj_step(*full_args)
  agree = {"tunedjax (tj.jit, kernel selection)": agreement(
      float(got[0]), flat_names(got[1]), ref_loss, ref_grads)}

  variants: dict[str, Callable[[], Any]] = {}
  notes: dict[str, str] = {}
  profiles = {}
  if torch is not None:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    named = flat_names(params)
    xt = torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy())
    yt = torch.from_numpy(np.asarray(y).astype(np.int64))
    kinds = [("eager", "channels_last", False, False), ("eager", "NCHW", False, False),
             ("eager", "channels_last", True, False)]
    if not args.no_compile:
      kinds += [("compile", "channels_last", False, True), ("compile", "NCHW", False, True)]
    for how, layout, primitive, compiled in kinds:
      model = (TorchMobileNet(primitive_bn=primitive) if net.startswith("mobilenet")
               else TorchDemoNet(width=width, primitive_bn=primitive))
      load_torch(model, net, named)
      xin = xt
      if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        xin = xt.contiguous(memory_format=torch.channels_last)
      model.train()
      run = torch.compile(model) if compiled else model
      name = ("torch.compile" if compiled else "PyTorch eager") + f", {layout}"
      if primitive:
        name = "PyTorch eager, channels_last, batch norm in primitive ops"
      start = time.perf_counter()
      t_loss, t_grads = torch_grads(model, run, net, xin, yt, named)
      if compiled:
        notes[name] = f"compiled in {time.perf_counter() - start:.0f} s"
      agree[name] = agreement(t_loss, t_grads, ref_loss, ref_grads)
      opt = torch.optim.SGD(model.parameters(), lr=LR)
      variants[name] = torch_step(run, opt, xin, yt)
      if name == BASELINE:
        profiles["PyTorch eager, channels_last"] = torch_profile(variants[name],
                                                                 args.profile_steps)

  def tj_run():
    with tj.config_context(config):
      return jax.block_until_ready(tj_step(*full_args))

  variants["jax.jit"] = _block(xla_step, full_args)
  variants["tunedjax (tj.jit, kernel selection)"] = tj_run

  def tj_variant(name: str, variant_config: dict[str, Any]) -> None:
    """Another tj.jit of the step under `variant_config` (same session: tuned buckets reused)."""
    with tj.config_context(variant_config):
      fn = tj.jit(step, session=session)
      out = jax.block_until_ready(fn(*full_args))
    if not variant_config.get("mixed_precision", {}).get("enable"):
      agree[name] = agreement(float(out[0]), flat_names(out[1]), ref_loss, ref_grads)
    else:  # bfloat16 compute: reported, not held to the float32 bound
      notes[name] = (f"bf16 compute: one step vs jax.jit "
                     f"{agreement(float(out[0]), flat_names(out[1]), ref_loss, ref_grads):.1e}")

    def run():
      with tj.config_context(variant_config):
        return jax.block_until_ready(fn(*full_args))

    variants[name] = run

  cache = {"dir": cache_dir}
  # The batch-norm family's share: the same step, batch norm pinned to the reference.
  tj_variant("tunedjax, batch norm pinned to xla",
             {"kernel": {"enable": True, "hints": {"batch_norm": "xla"}}, "cache": cache})
  if args.bf16:  # the opt-in mixed-precision path (bfloat16 compute, float32 parameters)
    tj_variant("tunedjax, mixed precision (bf16 compute)",
               {"kernel": {"enable": True}, "mixed_precision": {"enable": True},
                "cache": cache})
  for name, err in agree.items():
    print(f"{net}: one step, {name} vs jax.jit: relative error {err:.1e}", file=sys.stderr)
  bad = {n: e for n, e in agree.items() if not e <= AGREEMENT_BOUND}
  if bad:
    raise SystemExit(f"{net}: one step disagrees with jax.jit beyond {AGREEMENT_BOUND}: {bad}")
  baseline = BASELINE if BASELINE in variants else "jax.jit"
  timings = _harness.interleaved(variants, baseline=baseline, rounds=args.rounds, warmup=1,
                                 prime=args.prime, burst=args.steps)
  faults = {name: page_faults_per_step(fn) for name, fn in variants.items()}

  with tj.config_context(config):
    hlo = tj_step.lower(*full_args).compile().as_text()
    profiles["tunedjax"] = jax_profile(tj_step, full_args, hlo, args.profile_steps)
  profiles["jax.jit"] = jax_profile(xla_step, full_args,
                                    xla_step.lower(*full_args).compile().as_text(),
                                    args.profile_steps)
  with tj.config_context(config):
    buckets = autotune.explain(step, *full_args, cache=cache_dir)
  return NetResult(label, shape, timings, agree, profiles, buckets, tuning_s, notes, faults)


# -- the report -----------------------------------------------------------------------------


def _host_memory_line() -> str:
  status = tj.host_memory_status()
  if status.applied:
    return "tunedjax's settings applied (" + ", ".join(
        f"{k}={v}" for k, v in status.settings.items()) + ")"
  return f"not applied: {status.reason}"


def report(results: list[NetResult], args: argparse.Namespace, load: tuple[float, float]
           ) -> str:
  torch_line = (f"PyTorch {torch.__version__} ({args.threads} threads)" if torch is not None
                else "PyTorch not installed: JAX side only")
  primed = ("" if not args.prime else
            f", each variant's {args.steps} timed step(s) (their mean) right after "
            f"{args.prime} untimed step(s) of the same variant (the steady state of a training "
            "loop: not charged for the previous variant's spinning threads, nor for the slow "
            "first calls of an XLA program whose threads sat idle while the other variants ran; "
            "see BENCHMARKS.md, after idle)")
  title = "## tunedjax against PyTorch on CPU"
  if args.net == "mobilenet-plain":
    title += (f": the step in plain JAX, host memory "
              f"`{tj.host_memory_status().mode}`")
  lines = [
      title,
      "",
      f"`benchmarks/vs_pytorch.py{' --quick' if args.quick else ''}`: one SGD train step "
      "(forward, backward, update), the same weights and batch on both sides; "
      f"{torch_line}; jax {jax.__version__}. Each variant timed in {args.rounds} interleaved "
      f"rounds after a warm-up{primed}; ratio = the variant's time over PyTorch eager "
      "channels_last "
      "(median of per-round ratios; under 1 is faster than PyTorch); A/A = that baseline "
      "timed twice. One step checked first: the loss and every gradient against `jax.jit` "
      f"(largest relative error, bound {AGREEMENT_BOUND:g}). Load average "
      f"{load[0]:.1f} before, {load[1]:.1f} after. " + _harness.machine_line(),
      "",
      (f"Host memory (`TUNEDJAX_HOST_MEMORY={tj.host_memory_status().mode}`; "
       "`tunedjax.host_memory_status()`, one process for both sides): "
       f"{_host_memory_line()}. Page faults per step: the process's minor page faults per "
       "call of the variant, over 3 calls after the timing."),
  ]
  for r in results:
    t = r.timings
    lines += ["", f"### {r.name}, {r.shape}", "",
              ("| variant | ms per step | ratio to baseline | per-round range | "
              "one step vs jax.jit | page faults per step | note |"),
              "|---|---:|---:|---:|---:|---:|---|"]
    for name in t.runs:
      lo, hi = t.spread(name)
      err = r.agreement.get(name)
      note = r.notes.get(name, "")
      if name == "tunedjax (tj.jit, kernel selection)":
        note = f"tuning {r.tuning_s:.0f} s on the first call"
      faults = r.faults.get(name)
      lines.append(f"| {name} | {1e3 * t.median(name):.1f} | {t.ratio(name):.2f} | "
                   f"{lo:.2f}-{hi:.2f} | {'' if err is None else f'{err:.1e}'} | "
                   f"{'' if faults is None else f'{faults:,.0f}'} | {note} |")
    groups = sorted({g for prof in r.profiles.values() for g in prof[0]},
                    key=lambda g: -max(p[0].get(g, 0.0) for p in r.profiles.values()))
    sides = list(r.profiles)
    lines += ["", (f"Where the time goes (ms per step, {args.profile_steps} profiled steps; "
              "PyTorch: `torch.profiler` self CPU time per aten op; JAX: `jax.profiler` "
              "thunk time per HLO instruction of the compiled step, summed over threads, grouped "
              "by what the instruction computes):"), "",
              "| group | " + " | ".join(sides) + " |",
              "|---|" + "---:|" * len(sides)]
    for g in groups:
      lines.append(f"| {g} | " + " | ".join(f"{r.profiles[s][0].get(g, 0.0):.1f}"
                                           for s in sides) + " |")
    lines.append("| total | " + " | ".join(f"{sum(r.profiles[s][0].values()):.1f}"
                                           for s in sides) + " |")
    for side in sides:
      top = r.profiles[side][1]
      lines += ["", f"Top ops, {side}: " + "; ".join(
          f"`{n}` ({k}) {ms:.1f}" for n, k, ms in top[:8]) + "."]
    shown = [b for b in r.buckets if b.op == "batch_norm" or b.kernel not in (None, "xla")]
    if r.buckets:
      lines += ["", (f"tunedjax's kernel buckets (`autotune.explain`; times from the tuner, "
                f"forward only): {len(r.buckets)} buckets, {len(r.buckets) - len(shown)} of "
                "them convolutions left on xla; the others:"),
                "", "| bucket | sites | kernel | xla (ms) | kernel (ms) | speedup |",
                "|---|---:|---|---:|---:|---:|"]
      for b in shown:
        lines.append(f"| {b.bucket} | {b.count} | {b.kernel} | "
                     f"{'' if b.xla_ms is None else f'{b.xla_ms:.2f}'} | "
                     f"{'' if b.kernel_ms is None else f'{b.kernel_ms:.2f}'} | "
                     f"{'' if b.speedup is None else f'{b.speedup:.2f}x'} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds (smoke)")
  parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                      help="PyTorch's intra-op threads (JAX uses every core)")
  parser.add_argument("--net", choices=("mobilenet", "mobilenet-plain", "demo", "both", "all"),
                      default="both",
                      help="both: mobilenet and demo; all: and mobilenet-plain (the step "
                           "written in plain JAX, its batch norms found as patterns)")
  parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
  parser.add_argument("--prime", type=int, default=3,
                      help="untimed steps of a variant right before its timed ones (1 and "
                           "--steps 1: the timing used 2026-11-24 to 26)")
  parser.add_argument("--steps", type=int, default=5,
                      help="consecutive steps timed per variant and round (their mean)")
  parser.add_argument("--no-prime", action="store_true",
                      help="one step timed right after the previous variant's (the timing used "
                           "before 2026-11-24: charges a JAX step for PyTorch's spinning "
                           "threads); same as --prime 0 --steps 1")
  parser.add_argument("--profile-steps", type=int, default=None)
  parser.add_argument("--bf16", action="store_true",
                      help="also time tunedjax with the mixed-precision policy (bf16 compute)")
  args = parser.parse_args(argv)
  args.rounds = args.rounds or (2 if args.quick else 9)
  if args.no_prime:
    args.prime, args.steps = 0, 1
  if args.prime < 0 or args.steps < 1:
    parser.error(f"--prime must be >= 0 and --steps >= 1, got {args.prime} and {args.steps}")
  args.profile_steps = args.profile_steps or (1 if args.quick else 3)
  if torch is None:
    print("torch is not installed: timing the JAX side only (see this script's docstring "
          "for the bench-torch extra)", file=sys.stderr)
  cache_dir = tempfile.mkdtemp(prefix="tunedjax-vs-pytorch-")
  load_before = os.getloadavg()[0]
  print(f"load average before: {load_before:.2f}", file=sys.stderr)
  nets = {"both": ("mobilenet", "demo"), "all": ("mobilenet", "mobilenet-plain", "demo")
          }.get(args.net, (args.net,))
  results = [run_net(n, args, cache_dir) for n in nets]
  body = report(results, args, (load_before, os.getloadavg()[0]))
  print(body)
  if args.write:  # the plain-JAX step alone: a section per host-memory mode
    section = ("vs_pytorch" if args.net != "mobilenet-plain"
               else f"vs_pytorch_plain_{tj.host_memory_status().mode}")
    _harness.write_section(section, body)
    print(f"\nwrote {_harness.BENCHMARKS_MD}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
