"""A train step's accuracy under kernel selection: each family pinned to each kernel.

The MobileNet-style step of `benchmarks/kernels.py` written in plain JAX
(depthwise and pointwise convolutions, batch norm in primitive ops: two-pass
mean and variance, `rsqrt`; found by the batch-norm family's pattern), one SGD
update. Each parameter's update error against the same step in float64
(``max |got - want| / max |want|``) is divided by `jax.jit`'s own error,
floored by how far `jax.jit`'s update moves when the images move by 1e-7 of
themselves (at float32's resolution the step is chaotic for some
parameters); a run's figure is the worst parameter's ratio. ``same_branches``
is the same figure against the float64 step taking the run's own ReLU branches
(a pre-activation within float32's noise of zero may take either, and the
update jumps there: a flip is not a kernel's error), ``flips`` how many ReLU
inputs took the other branch than in float64. Each run tunes
with a fresh cache (`tunedjax.jit`, ``kernel.enable``), with the hints given
(``measure(hints={"batch_norm": "native"})``) and the other families tuned;
``measure(sweep=True)``: every kernel of every family pinned in turn.

Run: ``python benchmarks/run.py step_accuracy [--quick]`` (a JSON line per run, printed).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import harness
from kernels import _conv, bn_plain as _bn
import tunedjax as tj
from tunedjax import autotune

PERTURBATION = 1e-7
FULL = {"batch": 32, "size": 64, "widths": (64, 128, 128, 256), "strides": (1, 2, 1, 2)}
QUICK = {"batch": 8, "size": 32, "widths": (32, 64), "strides": (1, 2)}


def network(rng: np.random.Generator, widths, c0: int = 32) -> dict[str, np.ndarray]:
  """The parameters (float64 draws): a 3x3 stem, then per block a depthwise 3x3, batch
  norm, ReLU, a pointwise 1x1, batch norm, ReLU; a linear head on the mean."""
  normal = lambda shape, s: s * rng.normal(size=shape)  # noqa: E731
  params = {"stem": normal((3, 3, 3, c0), 0.2), "head": normal((widths[-1], 10), 0.05)}
  cin = c0
  for i, cout in enumerate(widths):
    params[f"dw{i}"] = normal((3, 3, 1, cin), 0.3)
    params[f"g{i}a"], params[f"b{i}a"] = 1 + 0.1 * normal((cin,), 1), 0.1 * normal((cin,), 1)
    params[f"pw{i}"] = normal((1, 1, cin, cout), 0.1)
    params[f"g{i}b"], params[f"b{i}b"] = 1 + 0.1 * normal((cout,), 1), 0.1 * normal((cout,), 1)
    cin = cout
  return params


def update_fn(strides) -> Callable[..., Any]:
  """One SGD step's update (``-0.1 * gradient``) of the network's cross-entropy:
  ``update(params, x, y, masks=None) -> (updates, masks)``, `masks` the ReLUs'
  branches (``pre-activation > 0``, in order). Given `masks`, each ReLU takes
  that branch (``where(mask, h, 0)``: the same gradient as ReLU's there) whatever
  its input: the same branches as another run's, in another precision."""

  def loss(params, x, y, masks):
    seen = []

    def relu(h):
      if masks is None:
        seen.append(h > 0)
        return jax.nn.relu(h)
      seen.append(masks[len(seen)])
      return jnp.where(seen[-1], h, 0)

    h = relu(_conv(x, params["stem"], 2))
    for i, s in enumerate(strides):
      h = _conv(h, params[f"dw{i}"], s, groups=h.shape[-1])
      h = relu(_bn(h, params[f"g{i}a"], params[f"b{i}a"]))
      h = relu(_bn(_conv(h, params[f"pw{i}"]), params[f"g{i}b"], params[f"b{i}b"]))
    logits = h.mean(axis=(1, 2)) @ params["head"]
    value = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1).mean()
    return value, tuple(seen)

  def update(params, x, y, masks=None):
    grads, seen = jax.grad(loss, has_aux=True)(params, x, y, masks)
    return jax.tree.map(lambda g: -0.1 * g, grads), seen

  return update


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


class Problem:
  """The step's float32 arguments, its float64 updates and each parameter's floor.

  Two measures. *Own branches*: against the float64 step (its ReLUs on their
  own branches), floored by `jax.jit`'s error and its spread under a 1e-7 change
  of the images. *Same branches*: against the float64 step taking the float32
  run's ReLU branches (`same_branches`), floored likewise: a pre-activation
  within float32's noise of zero may take either branch, and the update is not
  continuous there, so the first measure counts such a flip as error.
  """

  def __init__(self, batch: int, size: int, widths, strides, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = network(rng, widths)
    x, y = rng.normal(size=(batch, size, size, 3)), rng.integers(0, 10, size=batch)
    self.update = update_fn(strides)
    self._p64 = (params, x, y)
    self.want, self.masks = self.reference(None)
    p32 = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    self.args = (p32, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32))
    jitted, jit_masks = jax.jit(self.update)(*self.args)
    moved_x = (x * (1 + PERTURBATION * rng.normal(size=x.shape))).astype(np.float32)
    moved, moved_masks = jax.jit(self.update)(p32, jnp.asarray(moved_x), self.args[2])
    self.floor = {k: max(rel(jitted[k], self.want[k]), rel(moved[k], jitted[k]))
                  for k in self.want}
    same, moved_same = self.reference(jit_masks)[0], self.reference(moved_masks)[0]
    self.same_floor = {k: max(rel(jitted[k], same[k]), rel(moved[k], moved_same[k]))
                       for k in self.want}

  def reference(self, masks):
    """The float64 step's updates (on `masks`' branches, or its own) and its branches."""
    params, x, y = self._p64
    with jax.enable_x64(True):
      masks = None if masks is None else tuple(jnp.asarray(np.asarray(m)) for m in masks)
      want, own = jax.jit(self.update)(jax.tree.map(jnp.asarray, params), jnp.asarray(x),
                                       jnp.asarray(y), masks)
      return {k: np.asarray(v) for k, v in want.items()}, [np.asarray(m) for m in own]

  def flips(self, masks) -> int:
    """How many ReLU inputs take another branch than in the float64 step."""
    return int(sum(np.sum(np.asarray(m) != w) for m, w in zip(masks, self.masks)))


def worst(got, want, floor) -> tuple[float, str]:
  """The worst parameter's update error over its floor, and its name."""
  ratios = {k: rel(got[k], want[k]) / floor[k] for k in want}
  name = max(ratios, key=ratios.get)
  return ratios[name], name


def tuned(update, args, hints: dict[str, str], cache_dir: str):
  """The update and its ReLU branches under `tj.jit` with kernel selection (a fresh
  session, `cache_dir`), and the kernels each family ran: ``{family: {kernel: sites}}``."""
  config = {"kernel": {"enable": True, "hints": hints}, "cache": {"dir": cache_dir}}
  with tj.config_context(config):
    f = tj.jit(update, session=autotune.TuningSession())
    got, masks = jax.block_until_ready(f(*args))
    report = f.report(memory=False).last.kernel_report
  kernels: dict[str, dict[str, int]] = {}
  for family in ("conv", "batch_norm"):
    for c in report.of(family):
      kernels.setdefault(family, {})
      kernels[family][c.kernel] = kernels[family].get(c.kernel, 0) + c.count
  return got, masks, kernels


def sweep_hints() -> list[dict[str, str]]:
  """Every kernel of every family the step has, pinned in turn (the others tuned)."""
  return [{family: k.name} for family in ("batch_norm", "conv")
          for k in autotune.kernels(family)]


def measure(quick: bool = False, *, runs: int = 3, hints: dict[str, str] | None = None,
            sweep: bool = False) -> harness.Result:
  """`runs` fresh-cache runs (1 with `quick`) per hint set: a row per run."""
  shape = QUICK if quick else FULL
  runs = 1 if quick else runs
  step = Problem(**shape)
  rows = []
  for pinned in sweep_hints() if sweep else [hints or {}]:
    for run in range(runs):
      with tempfile.TemporaryDirectory() as cache_dir:
        start = time.perf_counter()
        got, masks, kernels = tuned(step.update, step.args, pinned, cache_dir)
        seconds = time.perf_counter() - start
      ratio, name = worst(got, step.want, step.floor)
      same, same_name = worst(got, step.reference(masks)[0], step.same_floor)
      rows.append({"hints": pinned, "run": run, "worst": round(ratio, 2), "param": name,
                   "error": f"{rel(got[name], step.want[name]):.2e}",
                   "floor": f"{step.floor[name]:.2e}", "same_branches": round(same, 2),
                   "same_param": same_name, "flips": step.flips(masks),
                   "first_call_s": round(seconds, 1), "kernels": kernels})
  return harness.Result("step_accuracy", params={"quick": quick, "shape": shape, "runs": runs},
                        figures={"rows": rows})


def render(result: harness.Result) -> str:
  """A JSON line per run, after the step's shape, the machine and the load."""
  return "\n".join([f"# step {result.params['shape']}; {result.machine} {result.load_line()}",
                    *(json.dumps(row) for row in result.figures["rows"])])
