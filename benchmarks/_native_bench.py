"""What the native-kernel benchmarks share (`bn_native`, `depthwise_native`,
`direct_native`, `pointwise_native`): a kernel timed alone per bucket (`time_kernels`), and
the whole train step tuned (`tune`, `tuner_rows`), then compiled from edited copies of its
tuning cache (`cache_variants`) or with hints, checked against `jax.jit` (`compile_steps`)
and timed in interleaved rounds (`time_steps`); their Markdown (`tuner_table`,
`checks_lines`).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import harness
import jax
import jax.numpy as jnp
import numpy as np

import tunedjax as tj
from tunedjax import autotune
from tunedjax.autotune import _registry, _tuner
from tunedjax.autotune._hints import HintWarning
from tunedjax.ops.conv._spec import ConvSpec

NETS = ("mobilenet", "demo")


def _vs_pytorch() -> Any:
  """benchmarks/vs_pytorch.py (imported when a step is needed: it is slow to import)."""
  import vs_pytorch  # pylint: disable=import-outside-toplevel
  return vs_pytorch


def net_step(net: str, quick: bool) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """`vs_pytorch.py`'s train step of `net` and its arguments."""
  return _vs_pytorch().net_problem(net, quick)[:2]


def conv_spec(key: Mapping[str, Any]) -> ConvSpec:
  """The `ConvSpec` of a conv cache entry's key."""
  return ConvSpec.from_dict({k: key[k] for k in ConvSpec.__dataclass_fields__})


# Per bucket: each kernel alone.

def time_kernels(spec: Any, kernels: Sequence[str], *, baseline: str, rounds: int,
                 rng: np.random.Generator, op: str = "conv", burst: int = 1
                 ) -> tuple[harness.Timings, dict[str, float]]:
  """Each kernel of `op` jitted alone on random float32 operands of `spec`'s shapes,
  timed in interleaved rounds (`baseline` again as the A/A control).

  Returns the timings and each kernel's largest error against ``xla``'s output,
  relative to its largest value.
  """
  lhs = jnp.asarray(rng.normal(size=spec.lhs_shape), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=spec.rhs_shape), jnp.float32)
  variants, outs = {}, {}
  for name in kernels:
    fn = jax.jit(lambda a, b, f=_registry.get_kernel(op, name).fn: f(a, b, spec))
    outs[name] = np.asarray(fn(lhs, rhs), np.float64)
    variants[name] = lambda fn=fn: jax.block_until_ready(fn(lhs, rhs))
  want = outs["xla"]
  scale = float(np.max(np.abs(want)))
  errors = {n: float(np.max(np.abs(o - want))) / scale for n, o in outs.items()}
  t = harness.interleaved(variants, baseline=baseline, rounds=rounds, warmup=1, burst=burst)
  return t, errors


# The whole step: tuned, then compiled from edited caches.

def tune(step: Callable[..., Any], args: tuple[Any, ...], config: Mapping[str, Any],
         session: Any = None) -> tuple[Any, float]:
  """The step under `tj.jit` and the seconds of its first call (tuning into the cache
  `config` names)."""
  with tj.config_context(config):
    fn = tj.jit(step, session=session or autotune.TuningSession())
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
  return fn, time.perf_counter() - start


def without(value: Mapping[str, Any], new: Collection[str]) -> str:
  """The winner the tuner would have chosen from a cache entry's timings without the
  kernels `new` (its own rule, `_tuner.choose`, on the others' ratios to ``xla``)."""
  out = set(new) | set(value.get("rejected", {}))
  if value.get("ratios"):
    ratios = {k: r for k, r in value["ratios"].items() if k not in out}
  else:  # the medians of the tuner's rounds
    med = {k: statistics.median(v) for k, v in value["timings"].items() if k not in out and v}
    ratios = {k: m / med["xla"] for k, m in med.items()}
  return _tuner.choose(ratios, margin=_tuner.DEFAULT_MARGIN)[0]


def tuner_rows(cache_dir: str, op: str, new: Collection[str],
               keep: Callable[[autotune.CacheEntry], bool] = lambda entry: True) -> list[dict]:
  """Each bucket of `op` in the cache: ``{key, ms: {kernel: median ms of the tuner's
  rounds}, chosen, current}`` (``current``: `without` the `new` kernels)."""
  rows = []
  for entry in autotune.Cache(cache_dir).entries(op):
    if keep(entry):
      ms = {k: statistics.median(v) * 1e3 for k, v in entry.value["timings"].items() if v}
      rows.append({"key": entry.key, "ms": ms, "chosen": entry.value["winner"],
                   "current": without(entry.value, new)})
  return rows


def cache_variants(tuned: str, root: str, op: str,
                   winners: Mapping[str, Callable[[autotune.CacheEntry], str | None]],
                   config: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
  """Copies of the tuned cache folder, one per variant, with each of `op`'s entries'
  winner set to ``winners[variant](entry)`` (None: kept). Returns each variant's
  configuration: `config` (default: kernel selection on) with its cache."""
  config = dict(config or {"kernel": {"enable": True}})
  configs = {}
  for variant, winner_of in winners.items():
    folder = os.path.join(root, "variant_" + variant.replace(" ", "_"))
    shutil.copytree(tuned, folder, ignore=shutil.ignore_patterns("native"))
    cache = autotune.Cache(folder)
    for entry in cache.entries(op):
      winner = winner_of(entry)
      if winner is not None and winner != entry.value["winner"]:
        cache.put(op, entry.key, {**entry.value, "winner": winner})
    configs[variant] = {**config, "cache": {"dir": folder}}
  return configs


class Step(NamedTuple):
  """One compiled variant of the step."""

  fn: Any  # the `tj.jit` function
  config: dict[str, Any]  # the configuration it runs under
  error: float  # largest relative error against `jax.jit` (loss and every gradient)
  kernels: dict[str, int]  # "op kernel (how)": sites, for the op of `compile_steps`


def in_config(config: Mapping[str, Any], fn: Callable[[], Any]) -> Any:
  """`fn()` under `config`, hint warnings (a hint a bucket cannot take) silenced."""
  with tj.config_context(config), warnings.catch_warnings():
    warnings.simplefilter("ignore", HintWarning)
    return fn()


def compile_steps(step: Callable[..., Any], args: tuple[Any, ...],
                  configs: Mapping[str, Mapping[str, Any]], *, op: str,
                  session: Any = None) -> dict[str, Step]:
  """The step under `tj.jit` in each configuration (a fresh tuning session each, or
  `session`), its first call checked against `jax.jit`'s (`vs_pytorch.agreement`)."""
  vs_pytorch = _vs_pytorch()
  ref = jax.jit(step)(*args)
  ref_grads = vs_pytorch.flat_names(ref[1])
  out = {}
  for name, config in configs.items():
    fn = tj.jit(step, session=session or autotune.TuningSession())
    got = in_config(config, lambda fn=fn: jax.block_until_ready(fn(*args)))
    kernels = fn.report(memory=False).last.kernels
    error = vs_pytorch.agreement(float(got[0]), vs_pytorch.flat_names(got[1]), float(ref[0]),
                                 ref_grads)
    out[name] = Step(fn, dict(config), error,
                     {k: n for k, n in sorted(kernels.items()) if k.startswith(op + " ")})
  return out


def time_steps(steps: Mapping[str, Step], args: tuple[Any, ...], *, baseline: str,
               rounds: int, burst: int = 1, cpu_time: bool = False) -> harness.Timings:
  """The compiled steps in interleaved rounds, each under its configuration."""
  def call(s: Step) -> Callable[[], Any]:
    return lambda: in_config(s.config, lambda: jax.block_until_ready(s.fn(*args)))

  return harness.interleaved({name: call(s) for name, s in steps.items()}, baseline=baseline,
                             rounds=rounds, warmup=1, burst=burst, cpu_time=cpu_time)


def checks(steps: Mapping[str, Step]) -> dict[str, dict[str, Any]]:
  """What `checks_lines` shows, JSON-ready."""
  return {name: {"error": s.error, "kernels": s.kernels} for name, s in steps.items()}


# Markdown.

def checks_lines(net: str, found: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """One line per variant: its error against `jax.jit` and its sites' kernels."""
  return [f"- {net}, {name}: one step vs `jax.jit` {c['error']:.1e}; sites: "
          + ", ".join(f"{k} x{n}" for k, n in c["kernels"].items()) for name, c in found.items()]


def tuner_table(rows: Sequence[Mapping[str, Any]], kernels: Sequence[str], new: Sequence[str],
                label: Callable[[Mapping[str, Any]], str]) -> str:
  """`tuner_rows` as a table: each kernel's ms, the chosen kernel, the winner without
  the new kernels, and each new kernel's time over that winner's."""
  lines = ["| bucket | " + " | ".join(f"{k} (ms)" for k in kernels) + " | chosen | "
           "current winner | " + " | ".join(f"{k} / current" for k in new) + " |",
           "|---|" + "---:|" * len(kernels) + "---|---|" + "---:|" * len(new)]
  for row in rows:
    ms = row["ms"]
    cells = " | ".join(f"{ms[k]:.2f}" if k in ms else "-" for k in kernels)
    ratios = " | ".join(f"{ms.get(k, float('nan')) / ms[row['current']]:.2f}" for k in new)
    lines.append(f"| {label(row['key'])} | {cells} | {row['chosen']} | {row['current']} | "
                 f"{ratios} |")
  return "\n".join(lines)

