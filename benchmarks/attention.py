"""Attention kernels per bucket, and a Transformer LM's train step tuned vs plain `jax.jit`.

Part 1, per bucket (batch 1, 8 heads, head dim 64, float32, not causal and causal, 1,024 /
2,048 / 4,096 tokens): every applicable ``"attention"`` kernel pinned with
``kernel.hints`` through `tunedjax.jit`, timed interleaved against ``xla``
(``jax.nn.dot_product_attention``), forward and forward + backward, with an A/A control;
and each candidate's compiled temporaries (forward + backward, XLA's memory analysis).

Part 2: the 4-layer Transformer LM of `tunedjax.demo` (width 256, 8 heads, causal, 2,048
tokens, batch 1, Adam), its attention swapped by `tunedjax.use_tuned_attention` and
compiled by `tunedjax.jit` with every tuner on (``set_config(None)``, as
``Trainer(autotune=True)``), against the unswapped model under plain `jax.jit`.

Part 3, its own section: causal attention written by hand (``einsum``, a ``jnp.tril``
mask by ``where``, ``jax.nn.softmax``, ``einsum``), forward and backward, plain `jax.jit`
against `tunedjax.jit` with kernel selection (which finds the attention in the jaxpr,
recognises the mask as causal and tunes the site), at 1,024 and 2,048 tokens.

Run: `.venv/bin/python benchmarks/run.py attention [--quick] [--write]` (every part;
`measure(parts=("hand-written",))` for part 3 alone).
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import time
import warnings
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import tunedjax as tj
from tunedjax.ops.attention._spec import AttentionSpec
from tunedjax.demo import TransformerLM, lm_data, lm_loss

HEADS, HEAD_DIM = 8, 64
ROOT = str(pathlib.Path(__file__).resolve().parents[1]) + os.sep  # out of reports
TUNED = "tunedjax (tuned attention)"
PARTS = ("buckets", "hand-written")


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
                ) -> tuple[list[dict[str, Any]], dict[str, harness.Timings]]:
  """Every applicable kernel pinned, forward and forward+backward against `xla`: a row
  per kernel (speedups, medians, temporaries) and the two timings."""
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
    timings[what] = harness.interleaved(calls, baseline="xla", rounds=rounds)
  fwd, both = timings["forward"], timings["forward+backward"]
  rows = [{"tokens": tokens, "causal": causal, "kernel": name,
           "forward": 1 / fwd.ratio(name), "forward_ms": 1e3 * fwd.median(name),
           "backward": 1 / both.ratio(name), "backward_ms": 1e3 * both.median(name),
           "temp_mib": temps.get(name, float("nan"))}
          for name in fwd.runs if name in both.runs]  # the A/A control last
  return rows, timings


def _train_step(graphdef, optimizer):
  def step(state, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda s: lm_loss(nnx.merge(graphdef, s), batch))(state)
    updates, opt_state = optimizer.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss
  return step


def lm_step(tokens: int, width: int, layers: int, rounds: int, cache: str
            ) -> tuple[harness.Timings, dict[str, Any]]:
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

  timings = harness.interleaved(
      {"jax.jit": lambda: jax.block_until_ready(plain(state, opt_state, batch)),
       TUNED: run_tuned}, baseline="jax.jit", rounds=rounds)
  report = tuned.report(memory=False).last
  return timings, {
      "buckets": [{"bucket": str(b.bucket), "kernel": b.kernel, "speedup": b.speedup,
                   "reason": b.reason} for b in buckets],
      "first_call_s": first_call_s, "kernels": dict(report.kernels), "loss_rel": loss_rel,
      "temp_mib": (plain_memory.temp_size_in_bytes / 2**20,
                   tuned_memory.temp_bytes / 2**20 if tuned_memory else float("nan"))}


def hand_written_attention(q, k, v):
  """Causal attention as tutorials write it: the causal mask is a `jnp.tril` of ones."""
  t = q.shape[1]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def hand_written_rows(tokens: int, rounds: int, cache: str
                      ) -> tuple[harness.Timings, dict[str, Any]]:
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

  timings = harness.interleaved(
      {"jax.jit": lambda: jax.block_until_ready(plain(*args)), "tunedjax.jit": run_tuned},
      baseline="jax.jit", rounds=rounds)
  return timings, {"tokens": tokens, "first_call_s": first_call_s, "rel": rel,
                   "matched": [str(m).replace(ROOT, "") for m in report.matched],
                   "kernels": dict(report.counts())}


def measure(quick: bool = False, *, rounds: int = 5, parts: tuple[str, ...] = PARTS
            ) -> harness.Result:
  """Parts 1 and 2 (``"buckets"``: the LM step first, then the buckets) and part 3
  (``"hand-written"``), each in a fresh tuning cache."""
  rounds = 2 if quick else rounds
  lengths, lm = (((128, 256), {"tokens": 256, "width": 64, "layers": 2}) if quick else
                 ((1024, 2048, 4096), {"tokens": 2048, "width": 256, "layers": 4}))
  hand_lengths = (256,) if quick else (1024, 2048)
  result = harness.Result("attention", params={"quick": quick, "rounds": rounds, "parts": parts,
                                               "lengths": lengths, "lm": lm,
                                               "hand_lengths": hand_lengths})
  if "buckets" in parts:
    with tempfile.TemporaryDirectory(prefix="tunedjax-bench-attn-") as cache:
      result.timings["lm step"], result.figures["lm step"] = lm_step(**lm, rounds=rounds + 2,
                                                                     cache=cache)
    result.figures["rows"] = []
    for tokens in lengths:
      for causal in (False, True):
        rows, timings = bucket_rows(tokens, rounds, causal)
        result.figures["rows"] += rows
        for what, t in timings.items():
          result.timings[f"{tokens} tokens{', causal' if causal else ''}, {what}"] = t
  if "hand-written" in parts:
    result.figures["hand-written"] = []
    with tempfile.TemporaryDirectory(prefix="tunedjax-bench-attn-hw-") as cache:
      for tokens in hand_lengths:
        t, figures = hand_written_rows(tokens, rounds, cache)
        result.timings[f"hand-written, {tokens} tokens"] = t
        result.figures["hand-written"].append(figures)
  return result


def _section(result: harness.Result) -> str:
  """Parts 1 and 2's section."""
  p, rows, step = result.params, result.figures["rows"], result.figures["lm step"]
  t, lm = result.timings["lm step"], p["lm"]
  speedup = 1 / t.ratio(TUNED)
  control = 1 / t.ratio(harness.CONTROL)
  longest = max(p["lengths"])
  ref_temp = next(r["temp_mib"] for r in rows
                  if r["tokens"] == longest and r["kernel"] == "xla" and not r["causal"])
  blocked = [r for r in rows if r["tokens"] == longest and not r["causal"]
             and r["kernel"].startswith("blocked")]
  how = (f"Per bucket: batch 1, {HEADS} heads, head dim {HEAD_DIM}, float32, not causal "
         "and causal (the `blocked_causal_*` kernels apply to causal buckets only, and "
         "there the kernels that compute every block, `blocked_*` and `query_chunked`, "
         "do not); "
         "each kernel pinned by `kernel.hints` through `tj.jit`, timed interleaved against "
         f"the reference `xla` (`jax.nn.dot_product_attention`), {p['rounds']} rounds, medians "
         "of per-round ratios (speedup = xla time / kernel time); temporaries of the "
         "compiled forward+backward from XLA's memory analysis.")
  lines = ["## Attention kernels and a Transformer LM step (`benchmarks/attention.py`)", "",
           f"{result.machine} {result.load_line()} Run: `benchmarks/run.py attention"
           f"{' --quick' if p['quick'] else ''}` (the LM step first, then the buckets).", "",
           how, "",
           ("| tokens | causal | kernel | forward speedup | forward (ms) | fwd+bwd speedup "
           "| fwd+bwd (ms) | temporaries fwd+bwd (MiB) |"),
           "|---:|---|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    temp = "" if r["kernel"] == harness.CONTROL else f"{r['temp_mib']:.0f}"
    lines.append(f"| {r['tokens']} | {'yes' if r['causal'] else 'no'} | {r['kernel']} | "
                 f"{r['forward']:.2f}x | {r['forward_ms']:.1f} | {r['backward']:.2f}x | "
                 f"{r['backward_ms']:.1f} | {temp} |")
  whole = (f"Whole train step: `tunedjax.demo.TransformerLM` ({lm['layers']} layers, width "
           f"{lm['width']}, {HEADS} heads, causal, {lm['tokens']} tokens, batch 1, Adam), "
           "attention swapped by `tj.use_tuned_attention` and compiled by `tj.jit` under "
           "`set_config(None)` (as `Trainer(autotune=True)`), against the unswapped model "
           f"under plain `jax.jit`; {p['rounds'] + 2} interleaved rounds.")
  chosen = "; ".join(f"`{b['bucket']}` -> **{b['kernel']}**"
                     + (f" ({b['speedup']:.2f}x when tuned)" if b["speedup"] else "")
                     for b in step["buckets"])
  met = "met" if speedup >= 1.3 else "not met"
  lines += ["", whole, "", harness.ratio_table(t), "",
            (f"- Train step speedup: **{speedup:.2f}x** (A/A control {control:.2f}x); "
            f"target >= 1.3x: {met}."),
            f"- Attention bucket(s) chosen: {chosen}.",
            (f"- Tuning on the first call: {step['first_call_s']:.0f} s (compile included); "
            f"the losses of the two steps differ by {step['loss_rel']:.1e} (relative)."),
            (f"- Temporaries of the whole step: {step['temp_mib'][0]:.0f} MiB (jax.jit) -> "
            f"{step['temp_mib'][1]:.0f} MiB (tuned).")]
  if blocked:
    best = max(blocked, key=lambda r: ref_temp / r["temp_mib"])
    ratio = ref_temp / best["temp_mib"]
    lines.append(f"- Temporaries at {longest} tokens (forward+backward): xla {ref_temp:.0f} "
                 f"MiB, {best['kernel']} {best['temp_mib']:.0f} MiB: **{ratio:.1f}x smaller**; "
                 f"target >= 4x: {'met' if ratio >= 4 else 'not met'}.")
  return "\n".join(lines)


def _hand_written_section(result: harness.Result) -> str:
  """Part 3's section."""
  p = result.params
  lines = ["## Hand-written causal attention found in the jaxpr (`benchmarks/attention.py`, "
           "part 3)", "",
           f"{result.machine} {result.load_line()} Command: `benchmarks/run.py attention"
           f"{' --quick' if p['quick'] else ''}`.", "",
           ("`hand_written_attention` (einsum, `jnp.where(jnp.tril(ones), s, -1e9)`, "
            "`jax.nn.softmax`, einsum; batch 1, "
            f"{HEADS} heads, head dim {HEAD_DIM}, float32), `jax.grad` of it inside the "
            "step, compiled by plain `jax.jit` (XLA) and by `tunedjax.jit` with "
            "`kernel.enable` (the attention found as a pattern, its mask recognised as "
            "causal, the site tuned on the first call in a fresh cache); "
            f"{p['rounds']} interleaved rounds after one warm-up, medians of per-round ratios, "
            "the baseline timed twice (A/A control).")]
  for r in result.figures["hand-written"]:
    t = result.timings[f"hand-written, {r['tokens']} tokens"]
    lines += ["", f"**{r['tokens']} tokens**: tunedjax.jit {1 / t.ratio('tunedjax.jit'):.2f}x "
              f"the speed of jax.jit (A/A control {1 / t.ratio(harness.CONTROL):.2f}x); "
              f"site: {'; '.join(r['matched'])}; first call (tuning and compiling) "
              f"{r['first_call_s']:.0f} s; gradients differ by {r['rel']:.1e} (relative).",
              "", harness.ratio_table(t)]
  return "\n".join(lines)


def render(result: harness.Result) -> dict[str, str]:
  """The sections of the parts measured: ``attention``, ``attention_hand_written``."""
  out = {}
  if "rows" in result.figures:
    out["attention"] = _section(result)
  if "hand-written" in result.figures:
    out["attention_hand_written"] = _hand_written_section(result)
  return out
