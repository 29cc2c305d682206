"""Attention kernels per bucket, and a Transformer LM's train step tuned vs plain `jax.jit`.

Part 1, per bucket (batch 1, 8 heads, head dim 64, float32, not causal and
causal, at 1,024 / 2,048 / 4,096 tokens): every applicable ``"attention"`` kernel, pinned
with ``kernel.hints``, through `tunedjax.jit`, timed interleaved against the
reference (``xla``: ``jax.nn.dot_product_attention``) forward and forward +
backward (the gradients of query, key and value for a random cotangent), with
an A/A control; and each candidate's compiled temporaries (forward +
backward), from XLA's memory analysis.

Part 2, the whole step users feel: the 4-layer Transformer LM of
`tunedjax.demo` (width 256, 8 heads, causal, 2,048 tokens, batch 1, Adam),
its attention swapped by `tunedjax.use_tuned_attention` and compiled by
`tunedjax.jit` with every tuner on (``set_config(None)``, as
``Trainer(autotune=True)``; its first call tunes the attention bucket), against
the unswapped model under plain `jax.jit`, interleaved with an A/A control.

Part 3 (``--hand-written``, on its own): causal attention written by hand
(``einsum``, a ``jnp.tril`` mask by ``where``, ``jax.nn.softmax``, ``einsum``),
its forward and backward (`jax.grad` inside the step) compiled by plain
`jax.jit` against `tunedjax.jit` with kernel selection on, which finds the
attention in the jaxpr, recognises the mask as causal and tunes the site (a
fresh cache: the first call tunes), at 1,024 and 2,048 tokens, interleaved
with an A/A control.

Run: `.venv/bin/python benchmarks/attention.py [--quick|--smoke] [--write] [--rounds N]
[--hand-written]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import warnings
from typing import Any

import harness as _harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import tunedjax as tj
from tunedjax.ops.attention._spec import AttentionSpec
from tunedjax.demo import TransformerLM, lm_data, lm_loss

HEADS, HEAD_DIM = 8, 64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # out of reports


@dataclasses.dataclass
class Row:
  tokens: int
  causal: bool
  kernel: str
  forward: float
  forward_ms: float
  backward: float
  backward_ms: float
  temp_mib: float


def _hinted(kernel: str):
  return tj.config_context({"kernel": {"enable": True, "hints": {"attention": kernel}},
                            "cache": {"dir": None}})


def _operands(tokens: int, seed: int = 0) -> tuple[jax.Array, ...]:
  rng = np.random.default_rng(seed)
  shape = (1, tokens, HEADS, HEAD_DIM)
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(4))


def _forward(causal: bool):
  def fn(q, k, v, ct):
    del ct
    return tj.attention(q, k, v, is_causal=causal)
  return fn


def _forward_backward(causal: bool):
  def fn(q, k, v, ct):
    return jax.grad(lambda q, k, v: (tj.attention(q, k, v, is_causal=causal) * ct).sum(),
                    argnums=(0, 1, 2))(q, k, v)
  return fn


def _compiled(fn, kernel: str, args) -> Any | None:
  """`fn` through tunedjax.jit with `kernel` pinned; None where it does not apply."""
  jitted = tj.jit(fn)
  with _hinted(kernel), warnings.catch_warnings():
    warnings.simplefilter("ignore", tj.autotune.HintWarning)  # a GPU kernel, here: skipped
    jax.block_until_ready(jitted(*args))
  (choice,) = jitted.report(memory=False).last.kernel_report.of("attention")
  if choice.kernel != kernel:
    return None

  def call():
    with _hinted(kernel):
      jax.block_until_ready(jitted(*args))
  call.jitted = jitted  # type: ignore[attr-defined]
  return call


def bucket_rows(tokens: int, rounds: int, causal: bool = False
                ) -> tuple[list[Row], dict[str, _harness.Timings]]:
  args = _operands(tokens)
  spec = AttentionSpec.from_arrays(args[0], args[1], is_causal=causal)
  kernels = [k.name for k in tj.autotune.kernels("attention")
             if k.applicable(spec, jax.default_backend())]  # no hint that does not apply
  timings, temps = {}, {}
  for what, fn in (("forward", _forward(causal)),
                   ("forward+backward", _forward_backward(causal))):
    calls = {}
    for name in kernels:
      call = _compiled(fn, name, args)
      if call is not None:
        calls[name] = call
        if what == "forward+backward":
          with _hinted(name):
            figures = call.jitted.memory_analysis(*args)
          temps[name] = figures.temp_bytes / 2**20 if figures else float("nan")
    timings[what] = _harness.interleaved(calls, baseline="xla", rounds=rounds)
  fwd, both = timings["forward"], timings["forward+backward"]
  rows = [Row(tokens, causal, name, 1 / fwd.ratio(name), 1e3 * fwd.median(name),
              1 / both.ratio(name), 1e3 * both.median(name), temps.get(name, float("nan")))
          for name in fwd.runs if name in both.runs and name != _harness.CONTROL]
  rows.append(Row(tokens, causal, _harness.CONTROL, 1 / fwd.ratio(_harness.CONTROL),
                  1e3 * fwd.median(_harness.CONTROL), 1 / both.ratio(_harness.CONTROL),
                  1e3 * both.median(_harness.CONTROL), float("nan")))
  return rows, timings


def _train_step(graphdef, optimizer):
  def step(state, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda s: lm_loss(nnx.merge(graphdef, s), batch))(state)
    updates, opt_state = optimizer.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss
  return step


def lm_step(tokens: int, width: int, layers: int, rounds: int, cache: str) -> dict[str, Any]:
  """The LM train step: tunedjax.jit with the swap and every tuner on vs plain jax.jit."""
  optimizer = optax.adam(1e-3)
  batch = {k: jnp.asarray(v) for k, v in lm_data(1, 1, tokens, seed=1).items()}
  plain_model = TransformerLM(tokens=tokens, width=width, layers=layers, heads=HEADS)
  tuned_model = TransformerLM(tokens=tokens, width=width, layers=layers, heads=HEADS)
  swap = tj.use_tuned_attention(tuned_model)
  plain_gd, state = nnx.split(plain_model)
  tuned_gd, _ = nnx.split(tuned_model)
  opt_state = optimizer.init(state)
  plain = jax.jit(_train_step(plain_gd, optimizer))
  tuned = tj.jit(_train_step(tuned_gd, optimizer), session=tj.autotune.TuningSession("bench"))
  def everything_on():  # set_config(None) on the benchmark's cache, as Trainer(autotune=True)
    return tj.config_context({"cache": {"dir": cache}})

  with everything_on(), tj.config_context(None):
    start = time.perf_counter()
    out_tuned = jax.block_until_ready(tuned(state, opt_state, batch))
    first_call_s = time.perf_counter() - start
    tuned_memory = tuned.memory_analysis(state, opt_state, batch)
    buckets = swap.buckets(cache=cache)
  out_plain = jax.block_until_ready(plain(state, opt_state, batch))
  plain_memory = plain.lower(state, opt_state, batch).compile().memory_analysis()
  loss_rel = abs(float(out_tuned[2]) - float(out_plain[2])) / abs(float(out_plain[2]))

  def run_tuned():
    with everything_on(), tj.config_context(None):
      jax.block_until_ready(tuned(state, opt_state, batch))

  timings = _harness.interleaved(
      {"jax.jit": lambda: jax.block_until_ready(plain(state, opt_state, batch)),
       "tunedjax (tuned attention)": run_tuned}, baseline="jax.jit", rounds=rounds)
  report = tuned.report(memory=False).last
  return {"timings": timings, "buckets": buckets, "first_call_s": first_call_s,
          "kernels": dict(report.kernels), "loss_rel": loss_rel,
          "temp_mib": (plain_memory.temp_size_in_bytes / 2**20,
                       tuned_memory.temp_bytes / 2**20 if tuned_memory else float("nan"))}


def section(rows: list[Row], step: dict[str, Any], lm: dict[str, int], rounds: int,
            lengths: tuple[int, ...], load: tuple[float, float]) -> str:
  """The BENCHMARKS.md section."""
  t = step["timings"]
  speedup = 1 / t.ratio("tunedjax (tuned attention)")
  control = 1 / t.ratio(_harness.CONTROL)
  longest = max(lengths)
  ref_temp = next(r.temp_mib for r in rows
                  if r.tokens == longest and r.kernel == "xla" and not r.causal)
  blocked = [r for r in rows if r.tokens == longest and not r.causal
             and r.kernel.startswith("blocked")]
  head = (f"{_harness.machine_line()} Load average {load[0]:.1f} before, {load[1]:.1f} "
          "after (the machine is shared: ratios move by +-15%).")
  how = (f"Per bucket: batch 1, {HEADS} heads, head dim {HEAD_DIM}, float32, not causal "
         "and causal (the `blocked_causal_*` kernels apply to causal buckets only, and "
         "there the kernels that compute every block, `blocked_*` and `query_chunked`, "
         "do not); "
         "each kernel pinned by `kernel.hints` through `tj.jit`, timed interleaved against "
         f"the reference `xla` (`jax.nn.dot_product_attention`), {rounds} rounds, medians "
         "of per-round ratios (speedup = xla time / kernel time); temporaries of the "
         "compiled forward+backward from XLA's memory analysis.")
  lines = ["## Attention kernels and a Transformer LM step (`benchmarks/attention.py`)", "",
           head, "", how, "",
           ("| tokens | causal | kernel | forward speedup | forward (ms) | fwd+bwd speedup "
           "| fwd+bwd (ms) | temporaries fwd+bwd (MiB) |"),
           "|---:|---|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    temp = "" if r.kernel == _harness.CONTROL else f"{r.temp_mib:.0f}"
    lines.append(f"| {r.tokens} | {'yes' if r.causal else 'no'} | {r.kernel} | {r.forward:.2f}x | {r.forward_ms:.1f} | "
                 f"{r.backward:.2f}x | {r.backward_ms:.1f} | {temp} |")
  whole = (f"Whole train step: `tunedjax.demo.TransformerLM` ({lm['layers']} layers, width "
           f"{lm['width']}, {HEADS} heads, causal, {lm['tokens']} tokens, batch 1, Adam), "
           "attention swapped by `tj.use_tuned_attention` and compiled by `tj.jit` under "
           "`set_config(None)` (as `Trainer(autotune=True)`), against the unswapped model "
           f"under plain `jax.jit`; {rounds + 2} interleaved rounds.")
  chosen = "; ".join(f"`{b.bucket}` -> **{b.kernel}**"
                     + (f" ({b.speedup:.2f}x when tuned)" if b.speedup else "")
                     for b in step["buckets"])
  met = "met" if speedup >= 1.3 else "not met"
  lines += ["", whole, "", _harness.ratio_table(t), "",
            (f"- Train step speedup: **{speedup:.2f}x** (A/A control {control:.2f}x); "
            f"target >= 1.3x: {met}."),
            f"- Attention bucket(s) chosen: {chosen}.",
            (f"- Tuning on the first call: {step['first_call_s']:.0f} s (compile included); "
            f"the losses of the two steps differ by {step['loss_rel']:.1e} (relative)."),
            (f"- Temporaries of the whole step: {step['temp_mib'][0]:.0f} MiB (jax.jit) -> "
            f"{step['temp_mib'][1]:.0f} MiB (tuned).")]
  if blocked:
    best = max(blocked, key=lambda r: ref_temp / r.temp_mib)
    ratio = ref_temp / best.temp_mib
    lines.append(f"- Temporaries at {longest} tokens (forward+backward): xla {ref_temp:.0f} "
                 f"MiB, {best.kernel} {best.temp_mib:.0f} MiB: **{ratio:.1f}x smaller**; "
                 f"target >= 4x: {'met' if ratio >= 4 else 'not met'}.")
  return "\n".join(lines)


def hand_written_attention(q, k, v):
  """Causal attention as tutorials write it: the causal mask is a `jnp.tril` of ones."""
  t = q.shape[1]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def hand_written_rows(tokens: int, rounds: int, cache: str) -> dict[str, Any]:
  """jax.jit vs tunedjax.jit (kernel selection on) on the hand-written causal attention's
  forward + backward, interleaved; what tunedjax chose and how long its first call took."""
  def step(q, k, v, ct):
    return jax.grad(lambda q, k, v: (hand_written_attention(q, k, v) * ct).sum(),
                    argnums=(0, 1, 2))(q, k, v)

  args = _operands(tokens)
  plain = jax.jit(step)
  tuned = tj.jit(step, session=tj.autotune.TuningSession(f"hand-written-{tokens}"))
  config = {"kernel": {"enable": True}, "cache": {"dir": cache}}
  with tj.config_context(config):
    start = time.perf_counter()
    got = jax.block_until_ready(tuned(*args))
    first_call_s = time.perf_counter() - start
  want = jax.block_until_ready(plain(*args))
  rel = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want))
  report = tuned.report(memory=False).last.kernel_report

  def run_tuned():
    with tj.config_context(config):
      jax.block_until_ready(tuned(*args))

  timings = _harness.interleaved(
      {"jax.jit": lambda: jax.block_until_ready(plain(*args)), "tunedjax.jit": run_tuned},
      baseline="jax.jit", rounds=rounds)
  return {"tokens": tokens, "timings": timings, "first_call_s": first_call_s, "rel": rel,
          "matched": [str(m).replace(ROOT, "") for m in report.matched],
          "kernels": dict(report.counts())}


def hand_written_section(results: list[dict[str, Any]], rounds: int,
                         load: tuple[float, float], command: str) -> str:
  """The BENCHMARKS.md section of part 3."""
  lines = ["## Hand-written causal attention found in the jaxpr (`benchmarks/attention.py "
           "--hand-written`)", "",
           f"{_harness.machine_line()} Load average {load[0]:.1f} before, {load[1]:.1f} "
           f"after (a shared machine). Command: `{command}`.", "",
           ("`hand_written_attention` (einsum, `jnp.where(jnp.tril(ones), s, -1e9)`, "
            "`jax.nn.softmax`, einsum; batch 1, "
            f"{HEADS} heads, head dim {HEAD_DIM}, float32), `jax.grad` of it inside the "
            "step, compiled by plain `jax.jit` (XLA) and by `tunedjax.jit` with "
            "`kernel.enable` (the attention found as a pattern, its mask recognised as "
            "causal, the site tuned on the first call in a fresh cache); "
            f"{rounds} interleaved rounds after one warm-up, medians of per-round ratios, "
            "the baseline timed twice (A/A control).")]
  for r in results:
    t = r["timings"]
    lines += ["", f"**{r['tokens']} tokens**: tunedjax.jit {1 / t.ratio('tunedjax.jit'):.2f}x "
              f"the speed of jax.jit (A/A control {1 / t.ratio(_harness.CONTROL):.2f}x); "
              f"site: {'; '.join(r['matched'])}; first call (tuning and compiling) "
              f"{r['first_call_s']:.0f} s; gradients differ by {r['rel']:.1e} (relative).",
              "", _harness.ratio_table(t)]
  return "\n".join(lines)


def main_hand_written(args: argparse.Namespace) -> int:
  lengths = (256,) if args.quick else (1024, 2048)
  rounds = args.rounds or (2 if args.quick else 5)
  load_before = os.getloadavg()[0]
  results = []
  with tempfile.TemporaryDirectory(prefix="tunedjax-bench-attn-hw-") as cache:
    for tokens in lengths:
      r = hand_written_rows(tokens, rounds, cache)
      results.append(r)
      print(f"{tokens} tokens: {r['matched']}, first call {r['first_call_s']:.1f} s, "
            f"rel {r['rel']:.1e}\n{_harness.ratio_table(r['timings'])}", flush=True)
  load = (load_before, os.getloadavg()[0])
  command = ("python benchmarks/attention.py --hand-written"
             + (f" --rounds {args.rounds}" if args.rounds else "")
             + (" --write" if args.write else ""))
  body = hand_written_section(results, rounds, load, command)
  print(f"load average {load[0]:.1f} before, {load[1]:.1f} after")
  if args.write and not args.quick:
    _harness.write_section("attention_hand_written", body)
    print("BENCHMARKS.md updated (attention_hand_written section)")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", "--smoke", dest="quick", action="store_true",
                      help="short sequences, a small LM, 2 rounds (smoke run)")
  parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--hand-written", action="store_true",
                      help="only part 3: hand-written causal attention, jax.jit vs tj.jit")
  args = parser.parse_args(argv)
  if args.hand_written:
    return main_hand_written(args)
  if args.quick:
    lengths, rounds = (128, 256), args.rounds or 2
    lm = {"tokens": 256, "width": 64, "layers": 2}
  else:
    lengths, rounds = (1024, 2048, 4096), args.rounds or 5
    lm = {"tokens": 2048, "width": 256, "layers": 4}
  load_before = os.getloadavg()[0]
  started = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="tunedjax-bench-attn-") as cache:
    step = lm_step(**lm, rounds=rounds + 2, cache=cache)
  print(_harness.ratio_table(step["timings"]), f"\nkernels {step['kernels']}; first call "
        f"{step['first_call_s']:.0f} s; load {os.getloadavg()[0]:.1f}", flush=True)
  rows = []
  for tokens in lengths:
    for causal in (False, True):
      got, _ = bucket_rows(tokens, rounds, causal)
      rows += got
      for r in got:
        print(f"{tokens:5d} tokens{' causal' if causal else ''}  {r.kernel:18s} forward "
              f"{r.forward:5.2f}x ({r.forward_ms:8.1f} ms)  fwd+bwd {r.backward:5.2f}x "
              f"({r.backward_ms:8.1f} ms)  temporaries "
              f"{r.temp_mib:8.1f} MiB", flush=True)
  load_after = os.getloadavg()[0]
  t = step["timings"]
  speedup = 1 / t.ratio("tunedjax (tuned attention)")
  control = 1 / t.ratio(_harness.CONTROL)
  print(_harness.ratio_table(t))
  print(f"LM step speedup {speedup:.2f}x (A/A {control:.2f}x); first call (tuning) "
        f"{step['first_call_s']:.1f} s; kernels {step['kernels']}; loss rel. diff "
        f"{step['loss_rel']:.1e}; temporaries {step['temp_mib'][0]:.0f} -> "
        f"{step['temp_mib'][1]:.0f} MiB")
  for b in step["buckets"]:
    print(f"  bucket {b.bucket}: {b.kernel} ({b.speedup and f'{b.speedup:.2f}x'}, {b.reason})")
  print(f"load average {load_before:.1f} before, {load_after:.1f} after; "
        f"{time.perf_counter() - started:.0f} s")

  body = section(rows, step, lm, rounds, lengths, (load_before, load_after))
  if args.write and not args.quick:
    _harness.write_section("attention", body)
    print("BENCHMARKS.md updated (attention section)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
