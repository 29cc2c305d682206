"""Per-shape kernel selection: speedups over XLA per bucket and on whole train steps.

Each convolution bucket of issue 6 (NHWC, float32), forward and forward + backward
(the gradient convolutions are buckets of their own), tuned by the selection pass and
timed against plain `jax.jit` in interleaved rounds (A/A control): kernels chosen,
speedups, tuning seconds. Then a whole MobileNet-style train step (depthwise 3x3 +
BatchNorm + 1x1 blocks, 64x64, batch 32, SGD) and a ResNet-style control step; last, a
warm-cache re-run (a fresh cache object on the same folder) must tune nothing.

Run: `.venv/bin/python benchmarks/run.py kernels [--quick] [--write]`.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

import harness
from tunedjax import _tuning, ops
from tunedjax.autotune import _select
from tunedjax.demo import DemoNet
from tunedjax.ops.batch_norm import _family as _bn_family

DN = ("NHWC", "HWIO", "NHWC")


@dataclasses.dataclass(frozen=True)
class Bucket:
  kind: str
  hw: int
  cin: int
  cout: int
  k: int
  stride: int = 1
  depthwise: bool = False
  control: bool = False
  target: str = ""

  @property
  def name(self) -> str:
    kernel = f"{self.k}x{self.k}" + (" depthwise" if self.depthwise else "")
    kernel += f" s{self.stride}" if self.stride > 1 else ""
    prefix = "control: " if self.control else ""
    return f"{prefix}{kernel}, {self.hw}x{self.hw}, {self.cin}->{self.cout}"


BUCKETS = (
    Bucket("depthwise", 56, 128, 128, 3, depthwise=True, target=">= 2x"),
    Bucket("1x1", 56, 64, 256, 1, target=">= 2x"),
    Bucket("large", 64, 4, 4, 15, target=">= 2x"),
    Bucket("large", 64, 4, 4, 31, target=">= 2x"),
    Bucket("small spatial", 7, 512, 512, 3, target="faster"),
    Bucket("resnet", 56, 64, 64, 3, control=True, target=">= 0.9x"),
    Bucket("resnet", 28, 128, 128, 3, control=True, target=">= 0.9x"),
    Bucket("stem", 112, 3, 64, 7, stride=2, control=True, target=">= 0.9x"),
)


def _quick(b: Bucket) -> Bucket:
  return dataclasses.replace(b, hw=max(min(b.hw // 4, 16), b.k), cin=min(b.cin, 16),
                             cout=min(b.cout, 16) if not b.depthwise else min(b.cin, 16))


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
  return jnp.asarray((scale * rng.normal(size=shape)).astype(np.float32))


def bucket_problem(b: Bucket, batch: int, rng: np.random.Generator
                   ) -> tuple[Callable[..., Any], Callable[..., Any], tuple[Any, ...],
                              tuple[Any, ...]]:
  """(forward fn, forward+backward fn, forward args, forward+backward args)."""
  groups = b.cin if b.depthwise else 1
  x = _normal(rng, (batch, b.hw, b.hw, b.cin))
  w = _normal(rng, (b.k, b.k, b.cin // groups, b.cout), scale=0.1)

  def fwd(x, w):
    return lax.conv_general_dilated(x, w, (b.stride, b.stride), "SAME",
                                    dimension_numbers=DN, feature_group_count=groups)

  ct = _normal(rng, jax.eval_shape(fwd, x, w).shape)

  def fwd_bwd(x, w, ct):
    y, vjp = jax.vjp(fwd, x, w)
    return y, vjp(ct)

  return fwd, fwd_bwd, (x, w), (x, w, ct)


# -- whole train steps ---------------------------------------------------------------


def _bn(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
  mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))
  return (x - mean) * lax.rsqrt(var + 1e-5) * g + b


def _conv(x, w, stride=1, groups=1):
  return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=DN,
                                  feature_group_count=groups)


def mobilenet(rng: np.random.Generator, widths=(64, 128, 128, 256), strides=(1, 2, 1, 2), *,
              conv: Callable[..., Any] = _conv, bn: Callable[..., Any] = _bn):
  """A MobileNet-style network: `(params, loss(params, x, y))`.

  `conv(x, w, stride=1, groups=1)` and `bn(x, g, b)` may be swapped (`vs_pytorch.py`
  gives PyTorch's symmetric padding and the batch-norm family's call site).
  """
  c0 = 32
  params = {"stem": _normal(rng, (3, 3, 3, c0), 0.2), "blocks": [],
            "head": _normal(rng, (widths[-1], 10), 0.05)}
  cin = c0
  for cout in widths:
    params["blocks"].append({
        "dw": _normal(rng, (3, 3, 1, cin), 0.3), "g1": jnp.ones(cin), "b1": jnp.zeros(cin),
        "pw": _normal(rng, (1, 1, cin, cout), 0.1), "g2": jnp.ones(cout),
        "b2": jnp.zeros(cout)})
    cin = cout

  def loss(params, x, y):
    h = jax.nn.relu(conv(x, params["stem"], 2))
    for blk, s in zip(params["blocks"], strides):
      h = jax.nn.relu(bn(conv(h, blk["dw"], s, groups=h.shape[-1]), blk["g1"], blk["b1"]))
      h = jax.nn.relu(bn(conv(h, blk["pw"]), blk["g2"], blk["b2"]))
    logits = h.mean(axis=(1, 2)) @ params["head"]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1).mean()

  return params, loss


def resnet(rng: np.random.Generator, widths=(32, 32, 64, 64), strides=(1, 1, 2, 1)):
  c0 = 32
  params = {"stem": _normal(rng, (3, 3, 3, c0), 0.2), "blocks": [],
            "head": _normal(rng, (widths[-1], 10), 0.05)}
  cin = c0
  for cout in widths:
    params["blocks"].append({"w": _normal(rng, (3, 3, cin, cout), 0.05),
                             "g": jnp.ones(cout), "b": jnp.zeros(cout)})
    cin = cout

  def loss(params, x, y):
    h = jax.nn.relu(_conv(x, params["stem"], 2))
    for blk, s in zip(params["blocks"], strides):
      h = jax.nn.relu(_bn(_conv(h, blk["w"], s), blk["g"], blk["b"]))
    logits = h.mean(axis=(1, 2)) @ params["head"]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1).mean()

  return params, loss


def sgd_step(loss: Callable[..., Any]) -> Callable[..., Any]:
  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return value, jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
  return step


def images(rng: np.random.Generator, batch: int, size: int, *, nchw: bool = False
           ) -> tuple[jax.Array, jax.Array]:
  """A batch of random float32 images (NHWC, or NCHW) and int32 labels of 10 classes."""
  shape = (batch, 3, size, size) if nchw else (batch, size, size, 3)
  return _normal(rng, shape), jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)


def bn_plain(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
  # Batch norm as plain JAX code writes it, in primitive ops (two passes, rsqrt): no
  # tunedjax call; under tj.jit the batch-norm family finds it as a pattern.
  mean = x.mean(axis=(0, 1, 2))
  var = ((x - mean) ** 2).mean(axis=(0, 1, 2))
  return (x - mean) * lax.rsqrt(var + 1e-5) * g + b


def bn_family(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
  """`_bn` through the batch-norm family's call site: under jax.jit the reference (the
  same mean, var and normalisation), under tj.jit the tuned kernel."""
  return _bn_family.batch_norm(x, g, b, epsilon=1e-5)


def demo_step(width: int, *, torch_padding: bool = False, grads: bool = False):
  """`DemoNet` (10 classes, seed 0) as (params, batch stats, its SGD step): the step
  returns (loss, [gradients,] new params, new stats). `torch_padding`: the strided
  depthwise convs pad one pixel on every side (PyTorch's padding=1)."""
  model = DemoNet(10, width=width, seed=0)
  for block in model.separable if torch_padding else ():
    conv = block.depthwise.conv
    if conv.strides not in (1, (1, 1)):
      conv.padding = ((1, 1), (1, 1))
  graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

  # nnx.BatchNorm onto the batch-norm family under tj.jit (as the Trainer does); under
  # jax.jit, outside kernel selection, Flax's own code.
  @ops.batch_norm.route_batch_norm()
  def loss(params, stats, x, y):
    m = nnx.merge(graphdef, params, stats, copy=True)
    value = optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    return value, nnx.state(m, nnx.BatchStat)

  def step(params, stats, x, y):
    (value, stats), g = jax.value_and_grad(loss, has_aux=True)(params, stats, x, y)
    new = jax.tree.map(lambda p, g: p - 0.01 * g, params, g)
    return (value, g, new, stats) if grads else (value, new, stats)

  return params, stats, step


# -- measuring -----------------------------------------------------------------------


def _block(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[], Any]:
  return lambda: jax.block_until_ready(fn(*args))

def _chosen(counts: dict[str, int]) -> str:
  names: dict[str, int] = {}
  for key, n in counts.items():
    name = key.split(" ")[1]
    names[name] = names.get(name, 0) + n
  return ", ".join(f"{k}" + (f" x{n}" if n > 1 else "") for k, n in sorted(names.items()))


def tune_and_time(fn: Callable[..., Any], args: tuple[Any, ...], *, cache_dir: str,
                  rounds: int, tune_rounds: int, budget_s: float
                  ) -> tuple[harness.Timings, dict[str, Any]]:
  """Tunes `fn`'s buckets, then times it selected against jax.jit: the timings, the
  kernels chosen and the seconds spent tuning."""
  reports: list[Any] = []
  selected = jax.jit(_select.select_kernels(
      fn, cache=cache_dir, rounds=tune_rounds, budget_s=budget_s, on_report=reports.append))
  first_call_s = harness.first_call(lambda: jax.block_until_ready(selected(*args)))  # tunes
  counts = {k: n for r in reports for k, n in r.counts().items()}
  t = harness.interleaved({"xla": _block(jax.jit(fn), args), "selected": _block(selected, args)},
                          baseline="xla", rounds=rounds, warmup=1)
  return t, {"chosen": _chosen(counts), "tuning_s": sum(r.tuning_s for r in reports),
             "first_call_s": first_call_s}


def warm_rerun(problems: list[tuple[Callable[..., Any], tuple[Any, ...]]],
               cache_dir: str) -> tuple[float, int, int]:
  """Re-traces every problem against the written cache: (tuning s, hits, misses)."""
  session = _tuning.TuningSession("warm rerun")  # remembers nothing: reads the file
  cache = _tuning.Cache(cache_dir)  # a fresh object: reads the file
  for fn, args in problems:
    jax.block_until_ready(jax.jit(_select.select_kernels(fn, cache=cache, session=session))(*args))
  s = session.stats()
  return s.tuning_s, s.hits, s.misses


STEPS = (("MobileNet-style train step", mobilenet, ">= 3x"),
         ("control: ResNet-style train step", resnet, ">= 0.95x"))


def measure(quick: bool = False, *, rounds: int = 9, batch: int = 8, budget: float = 20.0,
            steps: bool = True) -> harness.Result:
  """Every bucket forward and forward+backward, then the whole train steps (`steps`),
  then a warm-cache re-run of all of them."""
  if quick:
    rounds, batch, budget = 2, 2, 3.0
  tune = {"rounds": rounds, "tune_rounds": 2 if quick else 5, "budget_s": budget,
          "cache_dir": tempfile.mkdtemp(prefix="tunedjax-bench-kernels-")}
  rng = np.random.default_rng(0)
  result = harness.Result("kernels", params={
      "quick": quick, "rounds": rounds, "batch": batch, "budget": budget,
      "tune_rounds": tune["tune_rounds"]}, figures={"buckets": [], "steps": []})
  problems = []
  for b in BUCKETS:
    b = _quick(b) if quick else b
    fwd, fwd_bwd, fargs, bargs = bucket_problem(b, batch, rng)
    row = {"bucket": b.name, "target": b.target}
    for what, fn, args in (("fwd", fwd, fargs), ("fwd+bwd", fwd_bwd, bargs)):
      result.timings[f"{b.name}, {what}"], row[what] = tune_and_time(fn, args, **tune)
      problems.append((fn, args))
    result.figures["buckets"].append(row)
  if steps:
    step_batch, size = (4, 32) if quick else (32, 64)
    result.params.update(step_batch=step_batch, size=size)
    x, y = images(rng, step_batch, size)
    for name, network, target in STEPS:
      params, loss = network(rng)
      result.timings[name], info = tune_and_time(sgd_step(loss), (params, x, y), **tune)
      problems.append((sgd_step(loss), (params, x, y)))
      result.figures["steps"].append({"step": name, "target": target, **info})
  warm_s, hits, misses = warm_rerun(problems, tune["cache_dir"])
  result.figures["warm rerun"] = {"tuning_s": warm_s, "hits": hits, "misses": misses}
  return result


def _speedup(t: harness.Timings) -> float:
  return 1.0 / t.ratio("selected")


def render(result: harness.Result) -> str:
  p, t = result.params, result.timings
  lines = [
      "## Kernel selection: speedup over XLA per bucket", "",
      f"`benchmarks/run.py kernels{' --quick' if p['quick'] else ''}`: NHWC float32, batch "
      f"{p['batch']}; each bucket tuned by `autotune.select_kernels` (tuner: "
      f"{p['tune_rounds']} rounds, {p['budget']:.0f} s budget per bucket, 10% margin), then "
      f"timed against `jax.jit` in {p['rounds']} interleaved rounds after 1 warm-up; speedup = "
      "xla time / selected time (median of per-round ratios), A/A = the xla baseline timed "
      f"twice (1.00 is noise-free). {result.load_line()} {result.machine}", "",
      "| bucket | fwd: kernel | fwd speedup | fwd+bwd: kernels (fwd, dx, dw convs) | "
      "fwd+bwd speedup | xla fwd+bwd (ms) | tuning, 3 buckets (s) | A/A fwd / fwd+bwd | target |",
      "|---|---|---:|---|---:|---:|---:|---:|---|",
  ]
  for row in result.figures["buckets"]:
    f, fb = row["fwd"], row["fwd+bwd"]
    tf, tb = t[f"{row['bucket']}, fwd"], t[f"{row['bucket']}, fwd+bwd"]
    lines.append(
        f"| {row['bucket']} | {f['chosen']} | {_speedup(tf):.2f}x | {fb['chosen']} | "
        f"{_speedup(tb):.2f}x | {1e3 * tb.median('xla'):.1f} | "
        f"{f['tuning_s'] + fb['tuning_s']:.1f} | {tf.ratio(harness.CONTROL):.2f} / "
        f"{tb.ratio(harness.CONTROL):.2f} | {row['target']} |")
  if result.figures["steps"]:
    lines += [
        "", f"Whole train steps (batch {p['step_batch']}, {p['size']}x{p['size']} images, "
        "value_and_grad + SGD) through `select_kernels` against plain `jax.jit`:", "",
        "| train step | kernels chosen (all convs, forward and backward) | speedup | "
        "jax.jit (ms) | selected (ms) | tuning (s) | A/A | target |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result.figures["steps"]:
      ts = t[r["step"]]
      lines.append(f"| {r['step']} | {r['chosen']} | {_speedup(ts):.2f}x | "
                   f"{1e3 * ts.median('xla'):.1f} | {1e3 * ts.median('selected'):.1f} | "
                   f"{r['tuning_s']:.1f} | {ts.ratio(harness.CONTROL):.2f} | {r['target']} |")
  w = result.figures["warm rerun"]
  lines += ["", f"Warm-cache re-run (same cache folder, a fresh `Cache` object, nothing tuned "
            f"in memory): {w['tuning_s']:.1f} s tuning, {w['hits']} hits, {w['misses']} "
            f"misses (hit rate {w['hits'] / max(w['hits'] + w['misses'], 1):.0%})."]
  return "\n".join(lines)
