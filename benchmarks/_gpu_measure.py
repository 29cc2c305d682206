"""What every `benchmarks/gpu.py` worker measures with: sizes, its time left, runners,
first calls, steady-state rounds within the worker's time, and the first-call anatomy."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

import harness as _harness
from harness.workers import emit, say, seconds_left


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The sizes of every part; `FULL` on a GPU, `SMOKE` for a check run anywhere."""

  smoke: bool = False
  rounds: int = 7
  round_s: float = 0.25  # steps per timed run: about this many seconds
  # (a) ResNet-50
  batch: int = 128
  image: int = 224
  stages: tuple[int, ...] = (3, 4, 6, 3)
  width: int = 64
  # (b) attention [batch, tokens, heads, head_dim]
  attn_batch: int = 8
  attn_tokens: tuple[int, ...] = (2048, 8192)
  attn_heads: int = 16
  attn_head_dim: int = 128
  # (c) the Trainer's miniGPT
  lm_layers: int = 6
  lm_width: int = 512
  lm_heads: int = 8
  lm_tokens: int = 1024
  lm_batch: int = 16
  lm_vocab: int = 50257
  lm_warm_steps: int = 24  # past kernel.tuning_range's (1, 10) and the check after it
  lm_round_s: float = 1.0  # steps per timed fit: about this many seconds
  lm_horizon: int = 10_000
  # (d) convolution buckets and the layout pass
  bucket_batch: int = 128
  bucket_scale: int = 1  # spatial size divided by this
  bucket_channels: int = 10**6  # channels capped at this
  bucket_count: int = 12  # the first this many of ResNet-50's buckets
  layout_batch: int = 64


FULL = Sizes()
SMOKE = Sizes(smoke=True, rounds=2, round_s=0.0, batch=2, image=16, stages=(1,), width=4,
              attn_batch=1, attn_tokens=(16, 32), attn_heads=2, attn_head_dim=8,
              lm_layers=1, lm_width=16, lm_heads=2, lm_tokens=8, lm_batch=2, lm_vocab=32,
              lm_warm_steps=3, lm_round_s=0.0, lm_horizon=1000, bucket_batch=1, bucket_scale=16,
              bucket_channels=8, bucket_count=2, layout_batch=2)
# A smoke run pins every family's reference kernel: it checks the script, and kernel
# tuning on a CPU would be most of its time (the library's tests cover tuning).
SMOKE_HINTS = {"conv": "xla", "batch_norm": "xla", "attention": "xla"}


class Deadline:
  """The worker's time limit, less a reserve for its last records."""

  def __init__(self, reserve_s: float = 2.0):
    self.end = time.monotonic() + seconds_left() - reserve_s

  def left(self) -> float:
    return self.end - time.monotonic()

  def allows(self, seconds: float) -> bool:
    """Whether `seconds` of work still fit."""
    return self.left() >= seconds


def fit_rounds(per_round_s: float, left_s: float, wanted: int, minimum: int = 2) -> int:
  """Rounds of `per_round_s` (plus one warm-up round) that fit in `left_s`, at most
  `wanted`; 0 when not even `minimum` fit."""
  if per_round_s <= 0:
    return wanted
  fit = int(left_s / per_round_s) - 1
  return 0 if fit < minimum else min(wanted, fit)


def part_worker(part: str, which: str) -> Callable[[Sizes, Deadline], None]:
  """The function of worker ``part.which`` (each worker imports only what it runs)."""
  # pylint: disable=import-outside-toplevel
  if which == "torch":
    import _gpu_torch
    return {"resnet50": _gpu_torch.worker_resnet, "attention": _gpu_torch.worker_attention}[part]
  module = {"attention": "_gpu_attention", "lm": "_gpu_lm"}.get(part, "_gpu_resnet")
  return __import__(module).WORKERS[which or part]


def configure(config: Any, sizes: Sizes) -> None:
  """`tj.set_config(config)`; in a smoke run, with `SMOKE_HINTS` on top."""
  import tunedjax as tj  # pylint: disable=import-outside-toplevel
  tj.set_config(config)
  if sizes.smoke:
    tj.set_config(tj.Config.from_dict({"kernel": {"hints": SMOKE_HINTS}}, base=tj.get_config()))


def env_record() -> None:
  """The machine this worker runs on, as a record and a line."""
  device = jax.devices()[0]
  fields = {"device": device.device_kind, "backend": jax.default_backend(),
            "devices": len(jax.devices()), "jax": jax.__version__,
            "machine": _harness.machine_line()}
  emit("env", **fields)
  say(f"  on {fields['device']} ({fields['backend']}), jax {fields['jax']}")


class Runner:
  """Runs a compiled step `k` times and waits for the result.

  With ``stateful``, ``fn(state, *batch) -> (state, aux)`` and each call
  feeds the state back (a train loop); else ``fn(*args)`` is called again.
  """

  def __init__(self, fn: Callable[..., Any], *args: Any, stateful: bool = False):
    self.fn, self.stateful = fn, stateful
    self.state, self.args = (args[0], args[1:]) if stateful else (None, args)
    self.out: Any = None

  def run(self, k: int = 1) -> Any:
    for _ in range(k):
      if self.stateful:
        self.state, self.out = self.fn(self.state, *self.args)
      else:
        self.out = self.fn(*self.args)
    return jax.block_until_ready(self.out)


@contextlib.contextmanager
def step_of(what: str) -> Iterator[None]:
  """Marks what the worker is doing (the driver names it if the budget ends it)."""
  emit("start", what=what)
  yield
  emit("end", what=what)


def out_of_time(name: str, deadline: Deadline, needed_s: float = 5.0) -> bool:
  """Whether `name` must be left out: less than `needed_s` left (said and recorded)."""
  if deadline.allows(needed_s):
    return False
  say(f"  {name}: not run ({deadline.left():.0f} s left)")
  emit("not_run", what=name, left_s=deadline.left())
  return True


def first_call(name: str, runner: Runner) -> float:
  """Seconds of the runner's first call (trace, passes, tuning, compile, first run)."""
  with step_of(f"{name}: first call"):
    start = time.perf_counter()
    runner.run(1)
    seconds = time.perf_counter() - start
  say(f"  {name}: first call {seconds:.2f} s")
  return seconds


def guarded(name: str, body: Callable[[], Any], **fields: Any) -> Any:
  """Runs one variant's `body`; an exception becomes that variant's row, not the worker's end."""
  try:
    return body()
  except Exception as e:  # pylint: disable=broad-except  # one variant failing is a row
    say(f"  {name}: FAILED: {type(e).__name__}: {e}".splitlines()[0][:400])
    traceback.print_exc(limit=4)
    emit("row", variant=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
         **fields)
    return None


def freeze_heap() -> None:
  """Moves every object alive now out of the garbage collector's reach (`gc.freeze`), so
  that the collection `_harness.interleaved` runs before each timed call costs
  milliseconds, not the 0.4 s a full heap of JAX, Flax and traces takes."""
  gc.collect()
  gc.freeze()


def steady_state(runners: Mapping[str, Any], baseline: str, deadline: Deadline, sizes: Sizes,
                 *, round_s: float | None = None, calls: tuple[int, int] = (1, 50)
                 ) -> tuple[_harness.Timings, int] | None:
  """Interleaved rounds (the baseline timed twice: A/A), as many as fit the worker's time.

  Each timed run is `k` calls (``runner.run(k)``), `k` within `calls`, about
  `round_s` seconds (default ``sizes.round_s``).

  Returns:
    The timings of `k` calls per timed run, and `k`; None when no two rounds fit.
  """
  freeze_heap()
  one = {}
  for name, runner in runners.items():
    start = time.perf_counter()
    runner.run(calls[0])
    one[name] = (time.perf_counter() - start) / calls[0]
  wanted = sizes.round_s if round_s is None else round_s
  k = max(calls[0], min(calls[1], round(wanted / max(max(one.values()), 1e-6))))
  per_round = k * (sum(one.values()) + one[baseline])
  rounds = fit_rounds(per_round, deadline.left(), sizes.rounds)
  if rounds == 0:
    say(f"  steady state: not timed, {deadline.left():.0f} s left, a round takes "
        f"{per_round:.1f} s")
    return None
  with step_of(f"steady state of {', '.join(runners)} ({rounds} rounds)"):
    timings = _harness.interleaved({n: (lambda r=r: r.run(k)) for n, r in runners.items()},
                                   baseline=baseline, rounds=rounds)
  return timings, k


def timing_fields(timings: _harness.Timings, k: int, name: str) -> dict[str, Any]:
  """A variant's steady-state figures: ms per call, spread, ratio to the worker's baseline."""
  # the baseline's own per-round ratios are all 1: its spread is the A/A control's
  lo, hi = timings.spread(_harness.CONTROL if name == timings.baseline else name)
  return {"ms": 1e3 * timings.median(name) / k, "rounds": len(timings.runs[name]),
          "calls_per_run": k, "in_worker_ratio": timings.ratio(name),
          "aa": timings.ratio(_harness.CONTROL), "range": [lo, hi],
          "worker_baseline": timings.baseline}


def report(name: str, measured: tuple[_harness.Timings, int] | None = None, *,
           rate: tuple[str, float] | None = None, **fields: Any) -> dict[str, Any]:
  """Records a variant's row (with `measured`'s steady-state figures) and says it.

  Args:
    rate: ``(field, n)``: that field is n per second of a call (images/s, TFLOP/s).
  """
  if measured is not None:
    fields.update(timing_fields(*measured, name))
    if rate:
      fields[rate[0]] = rate[1] / (fields["ms"] / 1e3)
  emit("row", variant=name, **fields)
  say(f"  {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in fields.items()))
  return fields


def compare(builds: Mapping[str, Callable[[], Any]], baseline: str, deadline: Deadline,
            sizes: Sizes, *, tuned: Sequence[str] = (),
            first: Callable[[str, Any], dict] = lambda name, runner: {},
            last: Callable[[str, Any], dict] = lambda name, runner: {},
            rate: tuple[str, float] | None = None, **fields: Any) -> None:
  """Each variant's runner (`builds`) and first call, then all of them interleaved.

  Records a row per variant after its first call (with `first`'s fields; the
  first-call anatomy of those in `tuned`) and one after the steady state (with
  `last`'s fields and `rate`, as `report`); `fields` go in every row.
  """
  runners, firsts = {}, {}
  for name, build in builds.items():
    label = ", ".join([name, *(f"{v} {k}" for k, v in fields.items())])
    if out_of_time(label, deadline):
      continue

    def start(name=name, build=build, label=label):
      runner = build()
      seconds = first_call(label, runner)
      emit("row", variant=name, first_call_s=seconds, **fields, **first(name, runner))
      if name in tuned:
        anatomy(label, runner.fn)
      return runner, seconds

    got = guarded(name, start, **fields)
    if got is not None:
      runners[name], firsts[name] = got
  if runners:
    measured = guarded(", ".join(runners), lambda: steady_state(
        runners, baseline if baseline in runners else next(iter(runners)), deadline, sizes),
        **fields)
    for name, runner in runners.items():
      report(name, measured, rate=rate, first_call_s=firsts[name], **fields,
             **last(name, runner))


def anatomy(name: str, jitted: Any) -> None:
  """Prints and records `jitted.report().last.first_call` (where the first call's time
  went), or that this tunedjax does not record it."""
  try:
    last = jitted.report(memory=False).last
  except Exception as e:  # pylint: disable=broad-except  # a report failing is a line
    say(f"  {name}: no report ({type(e).__name__}: {e})")
    emit("anatomy", variant=name, unavailable=f"report() failed: {type(e).__name__}")
    return
  say(f"  {name}: report:\n" + "\n".join("    " + l for l in str(last).splitlines()))
  emit_first_call(name, getattr(last, "first_call", None), summary=str(last))


def emit_first_call(name: str, first: Any, summary: str = "") -> None:
  """Prints and records a `FirstCall` (``.stages``: name -> seconds, ``.total_s``)."""
  if first is None:
    reason = "this tunedjax's report has no first_call (first-call anatomy not recorded)"
    say(f"  {name}: first-call anatomy unavailable: {reason}")
    emit("anatomy", variant=name, unavailable=reason, summary=summary)
    return
  get = first.get if isinstance(first, Mapping) else lambda k, d=None: getattr(first, k, d)
  stages = {str(k): float(v) for k, v in dict(get("stages", {}) or {}).items()}
  total = get("total_s", None)
  say(f"  {name}: first-call anatomy:\n" + "\n".join("    " + l for l in str(first).splitlines()))
  emit("anatomy", variant=name, stages=stages,
       total_s=None if total is None else float(total), text=str(first), summary=summary)
