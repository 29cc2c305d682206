"""BENCHMARKS.md's GPU sections, made from `benchmarks/gpu.py`'s records (its JSON file).

Everything here reads the JSON alone (no JAX), so that the sections of a run
on another machine can be made again here (`harness.saved`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


def merged_rows(part: Mapping[str, Any], *keys: str) -> dict[tuple, dict[str, Any]]:
  """The part's row records merged per (variant, *keys), in the order first seen."""
  out: dict[tuple, dict[str, Any]] = {}
  for worker in part.get("workers", []):
    for record in worker.get("records", []):
      if record.get("kind") != "row":
        continue
      key = (record.get("variant"), *(record.get(k) for k in keys))
      out.setdefault(key, {"worker": worker["name"]}).update(
          {k: v for k, v in record.items() if k != "kind"})
  return out


def _records(part: Mapping[str, Any], kind: str) -> Iterable[dict[str, Any]]:
  for worker in part.get("workers", []):
    for record in worker.get("records", []):
      if record.get("kind") == kind:
        yield record


def anatomy_lines(part: Mapping[str, Any]) -> list[str]:
  """One line per tunedjax variant: where its first call's time went."""
  lines = []
  for r in _records(part, "anatomy"):
    if r.get("unavailable"):
      lines.append(f"- {r['variant']}: first-call anatomy unavailable ({r['unavailable']}).")
      continue
    stages = ", ".join(f"{k} {v:.2f} s" for k, v in (r.get("stages") or {}).items())
    lines.append(f"- {r['variant']}: first call {_num(r.get('total_s'), '.1f')} s = {stages}.")
  return ["", "First-call anatomy (`f.report().last.first_call`):", "", *lines] if lines else []


def status_lines(part: Mapping[str, Any]) -> list[str]:
  """What did not run to its end: budgets spent, failures, skipped PyTorch rows."""
  lines = []
  for w in part.get("workers", []):
    if w["status"] == "budget":
      doing = w.get("in_progress") or "its last step"
      lines.append(f"- `{w['name']}` stopped at its {w['budget_s']:.0f} s time limit, "
                   f"during: {doing}.")
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


def header(name: str, results: Mapping[str, Any], part: Mapping[str, Any]) -> list[str]:
  env = results.get("env", {})
  torch = f", torch {env['torch']}" if env.get("torch") else ""
  took = part.get("seconds")
  budgets = ", ".join(f"{w['name']} {w['budget_s']:.0f} s" for w in part.get("workers", []))
  return [f"### {TITLES[name]}", "",
          f"`{results.get('command', 'benchmarks/gpu.py')}` on {env.get('device', '?')} "
          f"({env.get('backend', '?')}), {results.get('date', '?')}: jax {env.get('jax', '?')}"
          f"{torch}. This part took {_num(took, '.0f')} s (time limits: {budgets})."
          + (" A smoke run (tiny sizes): no figure here is a measurement."
             if results.get("smoke") else "")]


def _ratio(a: Any, b: Any) -> float | None:
  return None if a is None or b is None or b == 0 else a / b


def _sizes(results: Mapping[str, Any]) -> dict[str, Any]:
  return results.get("env", {}).get("sizes") or {}


def resnet(results: Mapping[str, Any], part: Mapping[str, Any]) -> str:
  rows = {k[0]: v for k, v in merged_rows(part).items()}
  base = rows.get(JIT_BF16, {})
  s = _sizes(results)
  lines = header("resnet50", results, part) + [
      "", f"Batch {s.get('batch', '?')} of random {s.get('image', '?')}x{s.get('image', '?')} "
      f"images, stages {s.get('stages', '?')}, width {s.get('width', '?')}; SGD with Nesterov "
      "momentum 0.9 and the example's weight decay; `donate_argnums=0`; each `tj.jit` variant "
      "in a fresh process with an empty tuning cache. " + CROSS, "",
      "| variant | first call (s) | / jax.jit f32 | / jax.jit bf16 | images/s | "
      "/ jax.jit bf16 | range | A/A | first loss |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  f32_first, bf16_first = rows.get(JIT_F32, {}).get("first_call_s"), base.get("first_call_s")
  for name in RESNET_ORDER:
    r = rows.get(name)
    if r is None:
      continue
    lo_hi = r.get("range")
    lines.append(
        f"| {name} | {_num(r.get('first_call_s'), '.1f')} | "
        f"{_num(_ratio(r.get('first_call_s'), f32_first), '.2f', 'x')} | "
        f"{_num(_ratio(r.get('first_call_s'), bf16_first), '.2f', 'x')} | "
        f"{_num(r.get('images_per_s'), '.0f')} | "
        f"{_num(_ratio(r.get('images_per_s'), base.get('images_per_s')), '.3f')} | "
        f"{'' if not lo_hi else f'{lo_hi[0]:.2f}-{lo_hi[1]:.2f}'} | {_num(r.get('aa'), '.3f')} | "
        f"{_num(r.get('first_loss'), '.4f')} |")
  return "\n".join(lines + resnet_targets(rows) + anatomy_lines(part) + status_lines(part))


def _verdict(ok: bool | None) -> str:
  return "not measured" if ok is None else ("met" if ok else "**not met**")


def _at_most(a: Any, b: Any, limit: float) -> tuple[bool | None, str]:
  ratio = _ratio(a, b)
  return (None, "") if ratio is None else (ratio <= limit, f" ({ratio:.2f}x)")


def resnet_targets(rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """The issue's ResNet-50 targets, judged on this run."""
  first = {n: r.get("first_call_s") for n, r in rows.items()}
  ips = {n: r.get("images_per_s") for n, r in rows.items()}
  off_ok, off_x = _at_most(first.get(TJ_MP_LAYOUT), first.get(JIT_BF16), 1.5)
  all_ok, all_x = _at_most(first.get(TJ_ALL_MP), first.get(JIT_BF16), 3.0)
  vs_torch = _ratio(ips.get(TJ_ALL_MP), ips.get(TORCH_AMP))
  vs_bf16 = _ratio(ips.get(TJ_ALL_MP), ips.get(JIT_BF16))
  return ["", "Targets (first calls against `jax.jit` with the example's bfloat16 dtype):", "",
          f"- first call, mixed precision + layout, kernel selection off, at most 1.5x: "
          f"{_verdict(off_ok)}{off_x}",
          f"- first call, set_config(None) + mixed precision, at most 3x: "
          f"{_verdict(all_ok)}{all_x}",
          f"- images/s, set_config(None) + mixed precision, at least PyTorch AMP's: "
          f"{_verdict(None if vs_torch is None else vs_torch >= 1)}"
          f"{'' if vs_torch is None else f' ({vs_torch:.3f}x)'}",
          f"- images/s, set_config(None) + mixed precision, at least jax.jit bfloat16's: "
          f"{_verdict(None if vs_bf16 is None else vs_bf16 >= 1)}"
          f"{'' if vs_bf16 is None else f' ({vs_bf16:.3f}x)'}"]


def attention(results: Mapping[str, Any], part: Mapping[str, Any]) -> str:
  rows = merged_rows(part, "tokens")
  lengths = sorted({k[1] for k in rows if k[1] is not None})
  s = _sizes(results)
  lines = header("attention", results, part) + [
      "", f"bfloat16 [{s.get('attn_batch', '?')}, T, {s.get('attn_heads', '?')}, "
      f"{s.get('attn_head_dim', '?')}] ([batch, tokens, heads, head_dim]), `value_and_grad` of "
      "`sum(out * g)` with respect to q, k and v; "
      "TFLOP/s counts 3.5x the causal forward's 2·B·N·T²·D (FlashAttention's convention). "
      "The `tj.jit` workers run `set_config(None)` with an empty tuning cache. " + CROSS]
  targets = []
  for tokens in lengths:
    hand = rows.get((HAND, tokens), {})
    lines += ["", f"**{tokens} tokens**", "",
              "| variant | ms | vs hand-written | TFLOP/s | first call (s) | range | A/A | "
              "note |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name in ATTENTION_ORDER:
      r = rows.get((name, tokens)) or rows.get((name, None))
      if r is None:
        continue
      speed = (1 / r["in_worker_ratio"] if r.get("worker") == hand.get("worker")
               and r.get("in_worker_ratio") else _ratio(hand.get("ms"), r.get("ms")))
      lo_hi = r.get("range")
      lines.append(f"| {name} | {_num(r.get('ms'), '.3f')} | {_num(speed, '.2f', 'x')} | "
                   f"{_num(r.get('tflops'), '.0f')} | {_num(r.get('first_call_s'), '.1f')} | "
                   f"{'' if not lo_hi else f'{lo_hi[0]:.2f}-{lo_hi[1]:.2f}'} | "
                   f"{_num(r.get('aa'), '.3f')} | {r.get('note') or r.get('error') or ''} |")
    targets += attention_targets(rows, tokens)
  return "\n".join(lines + ["", "Targets:", "", *targets] + anatomy_lines(part)
                   + status_lines(part))


def attention_targets(rows: Mapping[tuple, Mapping[str, Any]], tokens: int) -> list[str]:
  """The issue's targets for the hand-written attention under `tj.jit`, at one length."""
  hand, tuned = rows.get((HAND, tokens), {}), rows.get((TJ_HAND, tokens), {})
  cudnn = rows.get((CUDNN, tokens), {})
  speed = _ratio(hand.get("ms"), tuned.get("ms"))
  to_cudnn = _ratio(tuned.get("ms"), cudnn.get("ms"))
  extra = (None if tuned.get("first_call_s") is None or hand.get("first_call_s") is None
           else tuned["first_call_s"] - hand["first_call_s"])
  return [f"- {tokens} tokens, `tj.jit` over the hand-written attention at least 3.5x "
          f"`jax.jit`'s speed: {_verdict(None if speed is None else speed >= 3.5)}"
          f"{'' if speed is None else f' ({speed:.2f}x)'}; within 5% of cuDNN's time: "
          f"{_verdict(None if to_cudnn is None else to_cudnn <= 1.05)}"
          f"{'' if to_cudnn is None else f' ({to_cudnn:.3f}x)'}; first call at most 10 s "
          f"longer: {_verdict(None if extra is None else extra <= 10)}"
          f"{'' if extra is None else f' ({extra:+.1f} s)'}"]


def lm(results: Mapping[str, Any], part: Mapping[str, Any]) -> str:
  rows = merged_rows(part, "precision")
  s = _sizes(results)
  lines = header("lm", results, part) + [
      "", f"miniGPT: {s.get('lm_layers', '?')} blocks, width {s.get('lm_width', '?')}, "
      f"{s.get('lm_heads', '?')} heads, {s.get('lm_tokens', '?')} tokens, batch "
      f"{s.get('lm_batch', '?')}, vocabulary {s.get('lm_vocab', '?')}; "
      "`nnx.MultiHeadAttention` with `mask=jnp.tril(jnp.ones((T, T)))`; AdamW; "
      "`tj.Trainer(progress=False)`; each `fit` asks for a "
      f"{s.get('lm_horizon', '?')}-step run and a callback stops it (kernel tuning pays back "
      f"within the fit's horizon); the first fit runs {s.get('lm_warm_steps', '?')} steps; "
      "each precision in its own process with an empty tuning cache. "
      "Speedup: `autotune=False`'s time over `autotune=True`'s (median of per-round ratios).",
      "", "| precision | autotune=False ms/step | autotune=True ms/step | speedup | A/A | "
      "first fit off / on (s) | attention (autotune=True) |", "|---|---:|---:|---:|---:|---:|---|"]
  speedups = {}
  for precision in ("float32", "mixed"):
    off, on = rows.get((OFF, precision)), rows.get((ON, precision))
    if off is None and on is None:
      continue
    off, on = off or {}, on or {}
    speedups[precision] = _ratio(1.0, on.get("in_worker_ratio"))
    lines.append(
        f"| {precision} | {_num(off.get('ms'), '.2f')} | {_num(on.get('ms'), '.2f')} | "
        f"{_num(speedups[precision], '.3f', 'x')} | {_num(off.get('aa'), '.3f')} | "
        f"{_num(off.get('warm_fit_s'), '.1f')} / {_num(on.get('warm_fit_s'), '.1f')} | "
        f"{'; '.join(on.get('attention') or []).replace('|', '/')} |")
  mixed = speedups.get("mixed")
  lines += ["", f"Target: with mixed precision, `autotune=True` at least 1.3x "
            f"`autotune=False`: {_verdict(None if mixed is None else mixed >= 1.3)}"
            f"{'' if mixed is None else f' ({mixed:.3f}x)'}."]
  return "\n".join(lines + anatomy_lines(part) + status_lines(part))


def conv_buckets(results: Mapping[str, Any], part: Mapping[str, Any]) -> str:
  lines = header("conv_buckets", results, part) + [
      "", f"ResNet-50's forward convolutions, NHWC, batch {_sizes(results).get('bucket_batch')}; "
      "ratio = pallas time / XLA time (median of "
      "per-round ratios; below 1: pallas faster); error = relative L2 error against XLA.", "",
      "| bucket | dtype | XLA (ms) | pallas (ms) | ratio | A/A | error |",
      "|---|---|---:|---:|---:|---:|---:|"]
  for r in merged_rows(part, "bucket", "dtype").values():
    if r.get("error"):
      continue
    lines.append(f"| {r.get('bucket')} | {r.get('dtype')} | {_num(r.get('xla_ms'), '.3f')} | "
                 f"{_num(r.get('pallas_ms'), '.3f')} | {_num(r.get('ratio'), '.2f')} | "
                 f"{_num(r.get('aa'), '.2f')} | {_num(r.get('rel_error'), '.1e')} "
                 f"{r.get('note') or ''}|")
  return "\n".join(lines + status_lines(part))


def layout_f16(results: Mapping[str, Any], part: Mapping[str, Any]) -> str:
  rows = {k[0]: v for k, v in merged_rows(part).items()}
  layout = rows.get(LAYOUT_PASS, {}).get("layout")
  lines = header("layout_f16", results, part) + [
      "", f"Batch {_sizes(results).get('layout_batch')}, float16 parameters and inputs, SGD "
      f"train step, both in one process; the pass: "
      f"{layout or 'not reported'}.", "",
      "| variant | first call (s) | ms | ratio | range | A/A |", "|---|---:|---:|---:|---:|---:|"]
  for name in (LAYOUT_PLAIN, LAYOUT_PASS):
    r = rows.get(name)
    if r is None:
      continue
    lo_hi = r.get("range")
    lines.append(f"| {name} | {_num(r.get('first_call_s'), '.1f')} | {_num(r.get('ms'), '.2f')}"
                 f" | {_num(r.get('in_worker_ratio'), '.3f')} | "
                 f"{'' if not lo_hi else f'{lo_hi[0]:.2f}-{lo_hi[1]:.2f}'} | "
                 f"{_num(r.get('aa'), '.3f')} |")
  return "\n".join(lines + anatomy_lines(part) + status_lines(part))


RENDER = {"resnet50": resnet, "attention": attention, "lm": lm, "conv_buckets": conv_buckets,
          "layout_f16": layout_f16}


def sections(results: Mapping[str, Any]) -> dict[str, str]:
  """``{"gpu_<part>": markdown}`` for every part in `results`."""
  return {f"gpu_{name}": RENDER[name](results, part)
          for name, part in results.get("parts", {}).items()}
