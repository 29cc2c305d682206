"""The layer_norm family against PyTorch on CPU: alone, and in the miniGPT step.

Part 1, layer norm alone: forward and backward (the gradients of input, scale and bias
of ``sum(y * g)``) at the miniGPT's shape [2, 1,024, 256] and a wider [2, 512, 1,024],
float32: PyTorch's ``F.layer_norm`` (the baseline, 2 threads), Flax's ``nnx.LayerNorm``
under `jax.jit` (as users run it) and each kernel of the family (``xla``, ``fused``,
``native``) under `jax.jit`; interleaved with an A/A control.

Part 2, the miniGPT step (`flash_attention`'s part 3: 4 post-LayerNorm blocks, width
256, 1,024 tokens, batch 2, AdamW) through ``Trainer(autotune=True)`` with the layer-norm
family pinned to ``xla`` (what the step ran before the family had kernels) against the
tuner's choice, each in its steady state (`flash_attention.trainer_steps`), interleaved
with an A/A control; and the kernel the tuner chose.

``--quick``: small shapes and model, 2 rounds.

Run: ``python benchmarks/run.py layer_norm [--quick] [--write]``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import flash_attention as fa
import harness
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import tunedjax as tj
from tunedjax import autotune
from tunedjax.ops.layer_norm import _family as ln_family
from tunedjax.ops.layer_norm._spec import LayerNormSpec

TORCH = "PyTorch F.layer_norm"
FLAX = "nnx.LayerNorm (jax.jit)"
SHAPES = ((2, 1024, 256), (2, 512, 1024))
EPSILON = 1e-6
BURST = 20  # calls per round: one call is well under a millisecond


def _grad_step(fn: Callable[..., Any], x, scale, bias, g) -> Callable[[], Any]:
  step = jax.jit(jax.grad(lambda x, s, b: jnp.sum(fn(x, s, b) * g), argnums=(0, 1, 2)))
  args = tuple(jnp.asarray(a) for a in (x, scale, bias))
  return lambda: jax.block_until_ready(step(*args))


def _torch_step(torch: Any, x, scale, bias, g) -> Callable[[], Any]:
  tx, ts, tb = (torch.tensor(a, requires_grad=True) for a in (x, scale, bias))
  tg = torch.tensor(g)

  def run():
    y = torch.nn.functional.layer_norm(tx, (tx.shape[-1],), ts, tb, EPSILON)
    return torch.autograd.grad(y, (tx, ts, tb), tg)

  return run


def _flax_fn(features: int) -> Callable[..., Any]:
  def fn(x, scale, bias):
    layer = nnx.LayerNorm(features, epsilon=EPSILON, rngs=nnx.Rngs(0))
    layer.scale[...], layer.bias[...] = scale, bias
    return layer(x)

  return fn


def _torch() -> Any:
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return torch


def time_alone(shape: tuple[int, ...], rounds: int, torch: Any) -> harness.Timings:
  """Part 1 at one shape: every variant's forward and backward, interleaved."""
  spec = LayerNormSpec(shape, "float32", EPSILON)
  x, scale, bias = ln_family.ln_operands(spec, np.random.default_rng(0))
  g = np.random.default_rng(1).normal(size=shape).astype(np.float32)
  variants = {}
  if torch is not None:
    variants[TORCH] = _torch_step(torch, x, scale, bias, g)
  variants[FLAX] = _grad_step(_flax_fn(shape[-1]), x, scale, bias, g)
  for kernel in autotune.kernels("layer_norm"):
    if kernel.applicable(spec, "cpu"):
      variants[kernel.name] = _grad_step(
          lambda x, s, b, fn=kernel.fn: fn(x, s, b, spec), x, scale, bias, g)
  return harness.interleaved(variants, baseline=next(iter(variants)), rounds=rounds,
                             prime=3, burst=BURST)


def time_step(quick: bool, rounds: int) -> tuple[harness.Timings, dict[str, Any]]:
  """Part 2: the miniGPT Trainer with layer norm pinned to ``xla`` against it tuned."""
  sizes = fa.lm_sizes(quick)
  chosen = {}
  with tempfile.TemporaryDirectory(prefix="tunedjax-layer-norm-") as cache:
    runs = {}
    for name, hints in (("layer_norm xla (pinned)", {"layer_norm": "xla"}),
                        ("layer_norm tuned", {})):
      with tj.config_context({"kernel": {"hints": hints}, "cache": {"dir": cache}}):
        runs[name], info = fa.trainer_steps(sizes, 5)
      kernels = info["trainer"].history.tuning.get("kernels", {})
      chosen[name] = sorted(k for k in kernels if k.startswith("layer_norm"))
  pinned, tuned = runs.values()
  timings = harness.interleaved({"layer_norm xla (pinned)": pinned,
                                 "layer_norm tuned": tuned},
                                baseline="layer_norm xla (pinned)", rounds=rounds,
                                self_timed=True)
  return timings, {"chosen": chosen["layer_norm tuned"], "pinned": chosen[
      "layer_norm xla (pinned)"]}


def measure(quick: bool = False) -> harness.Result:
  rounds = 2 if quick else 7
  torch = _torch()
  result = harness.Result("layer_norm", params={"quick": quick, "rounds": rounds,
                                                "torch": None if torch is None
                                                else torch.__version__})
  for shape in ((2, 64, 32),) if quick else SHAPES:
    result.timings["x".join(map(str, shape))] = time_alone(shape, rounds, torch)
  result.timings["step"], result.figures["step"] = time_step(quick, rounds)
  return result.done()


def render(result: harness.Result) -> str:
  p = result.params
  lines = ["## Layer norm against PyTorch (`benchmarks/layer_norm.py`)", "",
           f"`benchmarks/run.py layer_norm{' --quick' * p['quick']}` ({p['rounds']} "
           f"rounds). {result.machine} torch {p['torch'] or 'not installed'}. "
           f"{result.load_line()}"]
  for name, t in result.timings.items():
    if name == "step":
      continue
    lines += ["", f"**Layer norm alone, forward + backward**, [{name.replace('x', ', ')}], "
              f"float32, µs per call ({BURST} calls per round):", "",
              harness.ratio_table(t, unit="µs", scale=1e6)]
  chosen = ", ".join(result.figures["step"]["chosen"]) or "none"
  lines += ["", "**miniGPT step** through `Trainer(autotune=True)` (flash_attention's part 3, "
            "steady state), layer norm pinned to `xla` against the tuner's choice "
            f"({chosen}), ms per step:", "", harness.ratio_table(result.timings["step"])]
  return "\n".join(lines)
