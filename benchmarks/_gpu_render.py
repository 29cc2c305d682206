"""BENCHMARKS.md's GPU sections, made from `benchmarks/gpu.py`'s records (its JSON file).

Everything here reads the JSON alone (no JAX), so that the sections of a run
on another machine can be made again here (`harness.saved`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from _gpu_names import (ATTENTION_ORDER, CUDNN, HAND, JIT_BF16, JIT_F32, LAYOUT_PASS,
                        LAYOUT_PLAIN, OFF, ON, RESNET_ORDER, TJ_ALL_MP, TJ_HAND, TJ_MP_LAYOUT,
                        TORCH_AMP)

TITLES = {
    "resnet50": "ResNet-50 train step (the Flax ImageNet example)",
    "attention": "Causal self-attention, forward and backward",
    "lm": "The Trainer on a miniGPT: autotune off against on",
    "conv_buckets": "Convolution buckets: `pallas` (Triton) against XLA (cuDNN)",
    "layout_f16": "float16 ResNet-50 written NCHW: with and without the layout pass",
}
KEYS = ("tokens", "precision", "bucket", "dtype")  # what tells a variant's rows apart
CROSS = ("Ratios between workers are ratios of medians (separate processes, run one after "
         "another); within a worker they are medians of per-round ratios, and the A/A "
         "column is the worker's baseline timed twice.")


def _num(value: Any, fmt: str = ".2f", suffix: str = "") -> str:
  return "" if value is None else f"{value:{fmt}}{suffix}"


def _row(*cells: Any) -> str:
  return "| " + " | ".join(str(c) for c in cells) + " |"


def _range(lo_hi: Any) -> str:
  return "" if not lo_hi else f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}"


def _judged(value: float | None, ok: Callable[[float], bool], fmt: str = ".3f",
            suffix: str = "x") -> str:
  """Met, not met or not measured, and the figure a target was judged on."""
  if value is None:
    return "not measured"
  return f"{'met' if ok(value) else '**not met**'} ({value:{fmt}}{suffix})"


def where_hung(stack: list[str]) -> str:
  """The innermost frame of the main thread in a faulthandler dump."""
  blocks, frames = [], []
  for line in stack:
    if line.startswith(("Thread ", "Current thread ")):
      frames = []
      blocks.append(frames)
    elif line.strip().startswith("File "):
      frames.append(line.strip())
  main = [b for b in blocks if b and b[-1].endswith("<module>")] or blocks
  return main[0][0] if main and main[0] else ""


def merged_rows(part: Mapping[str, Any], *keys: str) -> dict[tuple, dict[str, Any]]:
  """The part's row records merged per (variant, *keys), in the order first seen."""
  out: dict[tuple, dict[str, Any]] = {}
  for worker, record in _records(part, "row"):
    key = (record.get("variant"), *(record.get(k) for k in keys))
    out.setdefault(key, {"worker": worker}).update(
        {k: v for k, v in record.items() if k != "kind"})
  return out


def _records(part: Mapping[str, Any], kind: str) -> Iterable[tuple[str, dict[str, Any]]]:
  """``(worker name, record)`` for each record of `kind`."""
  for worker in part.get("workers", []):
    yield from ((worker["name"], r) for r in worker.get("records", []) if r.get("kind") == kind)


def anatomy_lines(part: Mapping[str, Any]) -> list[str]:
  """One line per tunedjax variant: where its first call's time went."""
  lines = []
  for _, r in _records(part, "anatomy"):
    if r.get("unavailable"):
      lines.append(f"- {r['variant']}: first-call anatomy unavailable ({r['unavailable']}).")
      continue
    stages = ", ".join(f"{k} {v:.2f} s" for k, v in (r.get("stages") or {}).items())
    lines.append(f"- {r['variant']}: first call {_num(r.get('total_s'), '.1f')} s = {stages}.")
  return ["", "First-call anatomy (`f.report().last.first_call`):", "", *lines] if lines else []


def status_lines(part: Mapping[str, Any]) -> list[str]:
  """What did not run to its end: budgets spent (and where), failures, skipped rows."""
  lines = []
  for w in part.get("workers", []):
    if w["status"] == "budget":
      hung = where_hung(w.get("stack") or [])
      lines.append(f"- `{w['name']}` stopped at its {w['budget_s']:.0f} s time limit, during: "
                   f"{w.get('in_progress') or 'its last step'}."
                   + (f" Its stack: `{hung}`." if hung else ""))
    elif w["status"] == "failed":
      lines.append(f"- `{w['name']}` failed (exit status {w.get('returncode')}): see the log.")
    for r in w.get("records", []):
      if r.get("kind") == "skip":
        lines.append(f"- `{w['name']}`: {r['reason']}")
      elif r.get("kind") == "not_run":
        lines.append(f"- `{w['name']}`: {r['what']}: not run, {r['left_s']:.0f} s of its time "
                     "left.")
  for key, row in merged_rows(part, *KEYS).items():
    if row.get("error"):
      where = ", ".join(str(k) for k in key if k is not None)
      lines.append(f"- {where}: failed: `{row['error']}`")
  return ["", *lines] if lines else []


def header(name: str, results: Mapping[str, Any], part: Mapping[str, Any], text: str
           ) -> list[str]:
  """The section's title, what ran where, and `text` (what it measures)."""
  env = results.get("env", {})
  torch = f", torch {env['torch']}" if env.get("torch") else ""
  budgets = ", ".join(f"{w['name']} {w['budget_s']:.0f} s" for w in part.get("workers", []))
  return [f"### {TITLES[name]}", "",
          f"`{results.get('command', 'benchmarks/run.py gpu')}` on {env.get('device', '?')} "
          f"({env.get('backend', '?')}), {results.get('date', '?')}: jax {env.get('jax', '?')}"
          f"{torch}. This part took {_num(part.get('seconds'), '.0f')} s (time limits: "
          f"{budgets})." + (" A smoke run (tiny sizes): no figure here is a measurement."
                            if results.get("smoke") else ""), "", text]


def _ratio(a: Any, b: Any) -> float | None:
  return None if a is None or b is None or b == 0 else a / b


def _sizes(results: Mapping[str, Any]) -> dict[str, Any]:
  return results.get("env", {}).get("sizes") or {}


def resnet(results: Mapping[str, Any], part: Mapping[str, Any]) -> str:
  rows = {k[0]: v for k, v in merged_rows(part).items()}
  first = {n: r.get("first_call_s") for n, r in rows.items()}
  ips = {n: r.get("images_per_s") for n, r in rows.items()}
  s = _sizes(results)
  lines = header("resnet50", results, part,
                 f"Batch {s.get('batch', '?')} of random {s.get('image', '?')}x"
                 f"{s.get('image', '?')} images, stages {s.get('stages', '?')}, width "
                 f"{s.get('width', '?')}; SGD with Nesterov momentum 0.9 and the example's "
                 "weight decay; `donate_argnums=0`; each `tj.jit` variant in a fresh process "
                 "with an empty tuning cache. " + CROSS) + [
      "", "| variant | first call (s) | / jax.jit f32 | / jax.jit bf16 | images/s | "
      "/ jax.jit bf16 | range | A/A | first loss |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  lines += [_row(n, _num(first[n], ".1f"), _num(_ratio(first[n], first.get(JIT_F32)), ".2f", "x"),
                 _num(_ratio(first[n], first.get(JIT_BF16)), ".2f", "x"), _num(ips[n], ".0f"),
                 _num(_ratio(ips[n], ips.get(JIT_BF16)), ".3f"), _range(rows[n].get("range")),
                 _num(rows[n].get("aa"), ".3f"), _num(rows[n].get("first_loss"), ".4f"))
            for n in RESNET_ORDER if n in rows]
  mp = "set_config(None) + mixed precision"
  lines += ["", "Targets (first calls against `jax.jit` with the example's bfloat16 dtype):", "",
            "- first call, mixed precision + layout, kernel selection off, at most 1.5x: "
            + _judged(_ratio(first.get(TJ_MP_LAYOUT), first.get(JIT_BF16)), lambda x: x <= 1.5,
                      ".2f"),
            f"- first call, {mp}, at most 3x: "
            + _judged(_ratio(first.get(TJ_ALL_MP), first.get(JIT_BF16)), lambda x: x <= 3, ".2f"),
            f"- images/s, {mp}, at least PyTorch AMP's: "
            + _judged(_ratio(ips.get(TJ_ALL_MP), ips.get(TORCH_AMP)), lambda x: x >= 1),
            f"- images/s, {mp}, at least jax.jit bfloat16's: "
            + _judged(_ratio(ips.get(TJ_ALL_MP), ips.get(JIT_BF16)), lambda x: x >= 1)]
  return "\n".join(lines + anatomy_lines(part) + status_lines(part))


def attention(results: Mapping[str, Any], part: Mapping[str, Any]) -> str:
  rows = merged_rows(part, "tokens")
  s = _sizes(results)
  lines = header("attention", results, part,
                 f"bfloat16 [{s.get('attn_batch', '?')}, T, {s.get('attn_heads', '?')}, "
                 f"{s.get('attn_head_dim', '?')}] ([batch, tokens, heads, head_dim]), "
                 "`value_and_grad` of `sum(out * g)` with respect to q, k and v; TFLOP/s counts "
                 "3.5x the causal forward's 2·B·N·T²·D (FlashAttention's convention). The "
                 "`tj.jit` workers run `set_config(None)` with an empty tuning cache. " + CROSS)
  targets = []
  for tokens in sorted({k[1] for k in rows if k[1] is not None}):
    hand, tuned = rows.get((HAND, tokens), {}), rows.get((TJ_HAND, tokens), {})
    lines += ["", f"**{tokens} tokens**", "", "| variant | ms | vs hand-written | TFLOP/s | "
              "first call (s) | range | A/A | note |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name in ATTENTION_ORDER:
      r = rows.get((name, tokens)) or rows.get((name, None))
      if r is None:
        continue
      speed = (1 / r["in_worker_ratio"] if r.get("worker") == hand.get("worker")
               and r.get("in_worker_ratio") else _ratio(hand.get("ms"), r.get("ms")))
      lines.append(_row(name, _num(r.get("ms"), ".3f"), _num(speed, ".2f", "x"),
                        _num(r.get("tflops"), ".0f"), _num(r.get("first_call_s"), ".1f"),
                        _range(r.get("range")), _num(r.get("aa"), ".3f"),
                        r.get("note") or r.get("error") or ""))
    extra = (None if tuned.get("first_call_s") is None or hand.get("first_call_s") is None
             else tuned["first_call_s"] - hand["first_call_s"])
    targets.append(
        f"- {tokens} tokens, `tj.jit` over the hand-written attention at least 3.5x `jax.jit`'s "
        f"speed: {_judged(_ratio(hand.get('ms'), tuned.get('ms')), lambda x: x >= 3.5, '.2f')}; "
        "within 5% of cuDNN's time: " + _judged(
            _ratio(tuned.get("ms"), rows.get((CUDNN, tokens), {}).get("ms")),
            lambda x: x <= 1.05) + "; first call at most 10 s longer: "
        + _judged(extra, lambda x: x <= 10, "+.1f", " s"))
  return "\n".join(lines + ["", "Targets:", "", *targets] + anatomy_lines(part)
                   + status_lines(part))


def lm(results: Mapping[str, Any], part: Mapping[str, Any]) -> str:
  rows = merged_rows(part, "precision")
  s = _sizes(results)
  lines = header("lm", results, part,
                 f"miniGPT: {s.get('lm_layers', '?')} blocks, width {s.get('lm_width', '?')}, "
                 f"{s.get('lm_heads', '?')} heads, {s.get('lm_tokens', '?')} tokens, batch "
                 f"{s.get('lm_batch', '?')}, vocabulary {s.get('lm_vocab', '?')}; "
                 "`nnx.MultiHeadAttention` with `mask=jnp.tril(jnp.ones((T, T)))`; AdamW; "
                 "`tj.Trainer(progress=False)`; each `fit` asks for a "
                 f"{s.get('lm_horizon', '?')}-step run and a callback stops it (kernel tuning "
                 "pays back within the fit's horizon); the first fit runs "
                 f"{s.get('lm_warm_steps', '?')} steps; each precision in its own process with "
                 "an empty tuning cache. Speedup: `autotune=False`'s time over "
                 "`autotune=True`'s (median of per-round ratios).") + [
      "", "| precision | autotune=False ms/step | autotune=True ms/step | speedup | A/A | "
      "first fit off / on (s) | attention (autotune=True) |", "|---|---:|---:|---:|---:|---:|---|"]
  speedups = {}
  for precision in ("float32", "mixed"):
    if (OFF, precision) not in rows and (ON, precision) not in rows:
      continue
    off, on = rows.get((OFF, precision), {}), rows.get((ON, precision), {})
    speedups[precision] = _ratio(1.0, on.get("in_worker_ratio"))
    lines.append(_row(precision, _num(off.get("ms")), _num(on.get("ms")),
                      _num(speedups[precision], ".3f", "x"), _num(off.get("aa"), ".3f"),
                      f"{_num(off.get('warm_fit_s'), '.1f')} / {_num(on.get('warm_fit_s'), '.1f')}",
                      "; ".join(on.get("attention") or []).replace("|", "/")))
  lines += ["", "Target: with mixed precision, `autotune=True` at least 1.3x `autotune=False`: "
            + _judged(speedups.get("mixed"), lambda x: x >= 1.3) + "."]
  return "\n".join(lines + anatomy_lines(part) + status_lines(part))


def conv_buckets(results: Mapping[str, Any], part: Mapping[str, Any]) -> str:
  lines = header("conv_buckets", results, part,
                 "ResNet-50's forward convolutions, NHWC, batch "
                 f"{_sizes(results).get('bucket_batch')}; ratio = pallas time / XLA time (median "
                 "of per-round ratios; below 1: pallas faster); error = relative L2 error "
                 "against XLA.") + [
      "", "| bucket | dtype | XLA (ms) | pallas (ms) | ratio | A/A | error |",
      "|---|---|---:|---:|---:|---:|---:|"]
  lines += [_row(r.get("bucket"), r.get("dtype"), _num(r.get("xla_ms"), ".3f"),
                 _num(r.get("pallas_ms"), ".3f"), _num(r.get("ratio")), _num(r.get("aa")),
                 f"{_num(r.get('rel_error'), '.1e')} {r.get('note') or ''}".strip())
            for r in merged_rows(part, "bucket", "dtype").values() if not r.get("error")]
  return "\n".join(lines + status_lines(part))


def layout_f16(results: Mapping[str, Any], part: Mapping[str, Any]) -> str:
  rows = {k[0]: v for k, v in merged_rows(part).items()}
  lines = header("layout_f16", results, part,
                 f"Batch {_sizes(results).get('layout_batch')}, float16 parameters and inputs, "
                 "SGD train step, both in one process; the pass: "
                 f"{rows.get(LAYOUT_PASS, {}).get('layout') or 'not reported'}.") + [
      "", "| variant | first call (s) | ms | ratio | range | A/A |",
      "|---|---:|---:|---:|---:|---:|"]
  lines += [_row(n, _num(r.get("first_call_s"), ".1f"), _num(r.get("ms")),
                 _num(r.get("in_worker_ratio"), ".3f"), _range(r.get("range")),
                 _num(r.get("aa"), ".3f"))
            for n, r in ((n, rows.get(n)) for n in (LAYOUT_PLAIN, LAYOUT_PASS)) if r is not None]
  return "\n".join(lines + anatomy_lines(part) + status_lines(part))


RENDER = {"resnet50": resnet, "attention": attention, "lm": lm, "conv_buckets": conv_buckets,
          "layout_f16": layout_f16}


def sections(results: Mapping[str, Any]) -> dict[str, str]:
  """``{"gpu_<part>": markdown}`` for every part in `results`."""
  return {f"gpu_{name}": RENDER[name](results, part)
          for name, part in results.get("parts", {}).items()}
