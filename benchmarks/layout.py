"""Layout pass: a ResNet-18 written in NCHW, re-laid to NHWC, against hand-written NHWC.

A ResNet-18 as a PyTorch port would be written (NCHW activations, OIHW
kernels, lax ops: 7x7/2 stem, 3x3/2 max pool, 8 basic blocks with batch-stat
BatchNorm and 1x1/2 projection shortcuts, global average pool, dense head),
batch 8, forward and SGD train step. Variants, interleaved in one run:

- NCHW, jax.jit: the port as written (the baseline);
- NCHW, layout.optimize: `jax.jit(layout.optimize(f))`, target auto;
- NHWC, hand-written: the same network written channels-last (same weights);
- NHWC, hand-written, OIHW params: the NHWC network fed the PyTorch (OIHW)
  kernels, transposed inside the step: what any NHWC execution of the port
  must pay, since the function's inputs keep their layout;
- NHWC, layout.optimize: the pass on the NHWC network (should change nothing
  and cost nothing);
- A/A control: the baseline timed twice.

Target (issue #4): optimized NCHW within 5% of hand-written NHWC and faster
than plain NCHW. Checks that every variant computes the same outputs first.

Then the same two networks as Flax nnx modules trained by `tunedjax.Trainer`
(layout pass on, kernel selection off, SGD with momentum), timed per step
(`fit` over pre-made batches) and per `predict` call:

- NHWC model: the hand-written channels-last network, HWIO parameters (the baseline);
- NCHW model: the PyTorch port, OIHW parameters; the Trainer keeps its
  kernels (and their momentum) stored HWIO between steps, so no step
  transposes them;
- NCHW model, kernels not re-laid: the same with that storage switched off
  (each step transposes the OIHW kernels, as `layout.optimize` alone does).

Target (issue #18): the NCHW model within 5% of the NHWC model, train step
and forward.

Run: `.venv/bin/python benchmarks/layout.py [--quick] [--write] [--image N] [--rounds N]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

import harness as _harness
from tunedjax import layout
from tunedjax.trainer import Trainer
from tunedjax.trainer import _relayout

STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))
NCHW = ("NCHW", "OIHW", "NCHW")
NHWC = ("NHWC", "HWIO", "NHWC")
OIHW = "NHWC, hand-written, OIHW params"


def init_params(rng: np.random.Generator, classes: int = 1000) -> dict:
  """ResNet-18 parameters in PyTorch's layout (OIHW kernels)."""

  def conv(o, i, k):
    return jnp.asarray(rng.normal(size=(o, i, k, k)) * np.sqrt(2.0 / (i * k * k)), jnp.float32)

  def bn(c):
    return {"scale": jnp.ones(c, jnp.float32), "bias": jnp.zeros(c, jnp.float32)}

  params = {"stem": conv(64, 3, 7), "stem_bn": bn(64), "blocks": []}
  cin = 64
  for cout, stride in STAGES:
    for b in range(2):
      s = stride if b == 0 else 1
      block = {"conv1": conv(cout, cin, 3), "bn1": bn(cout), "conv2": conv(cout, cout, 3),
               "bn2": bn(cout)}
      if s != 1 or cin != cout:
        block["down"] = conv(cout, cin, 1)
        block["down_bn"] = bn(cout)
      params["blocks"].append(block)
      cin = cout
  params["fc_w"] = jnp.asarray(rng.normal(size=(512, classes)) * 0.01, jnp.float32)
  params["fc_b"] = jnp.zeros(classes, jnp.float32)
  return params


def to_nhwc_params(params: dict) -> dict:
  """The same parameters with HWIO kernels, for the hand-written NHWC network."""
  return jax.tree_util.tree_map(lambda p: p.transpose(2, 3, 1, 0) if p.ndim == 4 else p, params)


def resnet18(params: dict, x: jax.Array, *, channels_last: bool) -> jax.Array:
  """The forward pass; `channels_last` picks the hand-written NHWC version."""
  dn = NHWC if channels_last else NCHW
  c_axis, sp = (3, (1, 2)) if channels_last else (1, (2, 3))
  stats_axes = (0, *sp)

  def conv(x, w, stride, pad):
    return lax.conv_general_dilated(x, w, (stride, stride), ((pad, pad), (pad, pad)),
                                    dimension_numbers=dn)

  def bcast(v):
    shape = [1, 1, 1, 1]
    shape[c_axis] = -1
    return v.reshape(shape)

  def bn(x, p):
    mean = x.mean(stats_axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), stats_axes, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5) * bcast(p["scale"]) + bcast(p["bias"])

  def window(k):
    w = [1, 1, 1, 1]
    for a in sp:
      w[a] = k
    return tuple(w)

  x = jnp.maximum(bn(conv(x, params["stem"], 2, 3), params["stem_bn"]), 0.0)
  pad = [(0, 0)] * 4
  for a in sp:
    pad[a] = (1, 1)
  x = lax.reduce_window(x, -jnp.inf, lax.max, window(3), window(2), pad)
  for block in params["blocks"]:
    stride = 2 if "down" in block else 1  # projection shortcuts open stages 2-4
    y = jnp.maximum(bn(conv(x, block["conv1"], stride, 1), block["bn1"]), 0.0)
    y = bn(conv(y, block["conv2"], 1, 1), block["bn2"])
    shortcut = bn(conv(x, block["down"], stride, 0), block["down_bn"]) if "down" in block else x
    x = jnp.maximum(y + shortcut, 0.0)
  x = x.mean(sp)
  return x @ params["fc_w"] + params["fc_b"]


def make_train_step(channels_last: bool):
  def loss(params, x, y):
    logits = resnet18(params, x, channels_last=channels_last)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), value

  return step


def _check_same(outs: dict, what: str, tol: float) -> None:
  """Every variant's outputs match the baseline's, relative to the largest of them."""
  base = [a.astype(jnp.float32) for a in jax.tree_util.tree_leaves(outs["NCHW, jax.jit"])]
  scale = max(float(jnp.abs(a).max()) for a in base)
  for name, out in outs.items():
    if name.startswith("NHWC") and name != OIHW:  # HWIO kernels back to OIHW before comparing
      out = jax.tree_util.tree_map(lambda p: p.transpose(3, 2, 0, 1) if p.ndim == 4 else p, out)
    for a, b in zip(base, jax.tree_util.tree_leaves(out)):
      err = float(jnp.abs(a - b.astype(jnp.float32)).max()) / scale
      if err > tol:
        raise SystemExit(f"{what}: {name} differs from the baseline (rel err {err:.2e})")


def bench(title: str, fns: dict, args_for: dict, rounds: int) -> tuple[str, _harness.Timings]:
  outs = {name: fn(*args_for[name]) for name, fn in fns.items()}  # compile + check
  dtype = jax.tree_util.tree_leaves(outs["NCHW, jax.jit"])[0].dtype
  _check_same(outs, title, 1e-3 if dtype == jnp.float32 else 5e-2)
  variants = {name: (lambda fn=fn, a=args_for[name]: jax.block_until_ready(fn(*a)))
              for name, fn in fns.items()}
  t = _harness.interleaved(variants, baseline="NCHW, jax.jit", rounds=rounds, warmup=1)
  def vs(a, b):
    return statistics.median(x / y for x, y in zip(t.runs[a], t.runs[b]))

  notes = {"NCHW, layout.optimize":
               f"{vs('NCHW, layout.optimize', 'NHWC, hand-written'):.3f}x hand-written NHWC, "
               f"{vs('NCHW, layout.optimize', OIHW):.3f}x NHWC with OIHW params",
           OIHW: f"{vs(OIHW, 'NHWC, hand-written'):.3f}x hand-written NHWC",
           "NHWC, layout.optimize":
               f"{vs('NHWC, layout.optimize', 'NHWC, hand-written'):.3f}x hand-written NHWC"}
  return _harness.ratio_table(t, notes=notes), t


class Ported(nnx.Module):
  """`resnet18` as an nnx module over a parameter tree (OIHW or HWIO kernels)."""

  def __init__(self, params: dict, *, channels_last: bool):
    self.channels_last = channels_last
    self.p = nnx.data(jax.tree_util.tree_map(nnx.Param, params))

  def __call__(self, x):
    params = jax.tree_util.tree_map(lambda v: v[...], self.p,
                                    is_leaf=lambda v: isinstance(v, nnx.Variable))
    return resnet18(params, x, channels_last=self.channels_last)


def _xent(model, batch):
  logits = model(batch["x"])
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1))


TR_NHWC, TR_NCHW, TR_PLAIN = ("NHWC model, Trainer", "NCHW model, Trainer",
                              "NCHW model, Trainer, kernels not re-laid")


def trainer_tables(p_nchw: dict, x_nchw: jax.Array, y: jax.Array, *, rounds: int,
                   steps: int) -> tuple[str, _harness.Timings, str, _harness.Timings, dict]:
  """Per-step and per-predict times of the Trainer on the NCHW and NHWC models."""
  batch_nchw = {"x": np.asarray(x_nchw), "y": np.asarray(y)}
  batch_nhwc = {"x": np.asarray(x_nchw.transpose(0, 2, 3, 1)), "y": np.asarray(y)}
  made = {}
  real_plan = _relayout.plan
  for name, params, last, batch in ((TR_NHWC, to_nhwc_params(p_nchw), True, batch_nhwc),
                                    (TR_NCHW, p_nchw, False, batch_nchw),
                                    (TR_PLAIN, p_nchw, False, batch_nchw)):
    _relayout.plan = real_plan if name != TR_PLAIN else (lambda *a, **k: None)
    try:
      params = jax.tree_util.tree_map(jnp.copy, params)  # each trainer donates its own
      trainer = Trainer(Ported(params, channels_last=last), optax.sgd(0.01, momentum=0.9),
                        _xent, autotune={"layout": {"enable": True}}, progress=False)
      trainer.fit([batch], steps=1)  # plans the storage, compiles
      trainer.predict(batch["x"])
    finally:
      _relayout.plan = real_plan
    made[name] = (trainer, batch)
  losses = {name: t.history.losses[0] for name, (t, _) in made.items()}
  if max(losses.values()) - min(losses.values()) > 1e-3 * abs(losses[TR_NHWC]):
    raise SystemExit(f"Trainer: the first losses differ: {losses}")

  def fit(name):
    trainer, batch = made[name]
    trainer.fit([batch] * steps, steps=trainer.step + steps)
    jax.block_until_ready(trainer.state)

  def predict(name):
    trainer, batch = made[name]
    trainer.predict(batch["x"])

  train_t = _harness.interleaved({n: (lambda n=n: fit(n)) for n in made}, baseline=TR_NHWC,
                                 rounds=rounds, warmup=1)
  fwd_t = _harness.interleaved({n: (lambda n=n: predict(n)) for n in made}, baseline=TR_NHWC,
                               rounds=rounds, warmup=1)
  per_step = _harness.Timings({n: [v / steps for v in r] for n, r in train_t.runs.items()},
                              TR_NHWC)
  tuning = made[TR_NCHW][0].history.tuning.get(_relayout.KEY, {})
  return (_harness.ratio_table(per_step), per_step, _harness.ratio_table(fwd_t), fwd_t,
          tuning)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="32x32 images, 3 rounds (smoke test)")
  parser.add_argument("--image", type=int, default=None, help="image size (default 224)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--rounds", type=int, default=None, help="default 5 (3 with --quick)")
  parser.add_argument("--trainer-steps", type=int, default=None,
                      help="Trainer steps per timed run (default 3, 1 with --quick)")
  parser.add_argument("--no-trainer", action="store_true", help="skip the Trainer tables")
  parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
  args = parser.parse_args(argv)
  image = args.image or (32 if args.quick else 224)
  rounds = args.rounds or (3 if args.quick else 5)

  rng = np.random.default_rng(0)
  dtype = jnp.dtype(args.dtype)
  p_nchw = jax.tree_util.tree_map(lambda a: a.astype(dtype), init_params(rng))
  p_nhwc = to_nhwc_params(p_nchw)
  x_nchw = jnp.asarray(rng.normal(size=(args.batch, 3, image, image)), dtype)
  x_nhwc = x_nchw.transpose(0, 2, 3, 1)
  y = jnp.asarray(rng.integers(0, 1000, size=args.batch), jnp.int32)

  fwd_nchw = lambda p, x: resnet18(p, x, channels_last=False)
  fwd_nhwc = lambda p, x: resnet18(p, x, channels_last=True)
  fwd_oihw = lambda p, x: fwd_nhwc(to_nhwc_params(p), x.transpose(0, 2, 3, 1))
  fwd = {"NCHW, jax.jit": jax.jit(fwd_nchw),
         "NCHW, layout.optimize": jax.jit(layout.optimize(fwd_nchw)),
         "NHWC, hand-written": jax.jit(fwd_nhwc),
         OIHW: jax.jit(fwd_oihw),
         "NHWC, layout.optimize": jax.jit(layout.optimize(fwd_nhwc))}
  fwd_args = {k: ((p_nhwc, x_nhwc) if k.startswith("NHWC") and k != OIHW else (p_nchw, x_nchw))
              for k in fwd}

  step_nchw, step_nhwc = make_train_step(False), make_train_step(True)

  def step_oihw(p, x, y):
    new, loss = step_nhwc(to_nhwc_params(p), x.transpose(0, 2, 3, 1), y)
    return jax.tree_util.tree_map(lambda q: q.transpose(3, 2, 0, 1) if q.ndim == 4 else q,
                                  new), loss

  train = {"NCHW, jax.jit": jax.jit(step_nchw),
           "NCHW, layout.optimize": jax.jit(layout.optimize(step_nchw)),
           "NHWC, hand-written": jax.jit(step_nhwc),
           OIHW: jax.jit(step_oihw),
           "NHWC, layout.optimize": jax.jit(layout.optimize(step_nhwc))}
  train_args = {k: (*a, y) for k, a in fwd_args.items()}

  fwd_table, fwd_t = bench("forward", fwd, fwd_args, rounds)
  train_table, train_t = bench("train step", train, train_args, rounds)

  if not args.no_trainer:
    tr_step, tr_step_t, tr_fwd, tr_fwd_t, tr_tuning = trainer_tables(
        p_nchw, x_nchw, y, rounds=rounds, steps=args.trainer_steps or (1 if args.quick else 3))

  n_params = sum(a.size for a in jax.tree_util.tree_leaves(p_nchw) if a.ndim == 4)
  r_nchw = layout.explain(fwd_nchw, p_nchw, x_nchw)
  r_nhwc = layout.explain(fwd_nhwc, p_nhwc, x_nhwc)
  r_train = layout.explain(step_nchw, p_nchw, x_nchw, y)
  load = os.getloadavg()

  def verdict(t):
    def vs(b):
      return statistics.median(x / y for x, y in zip(t.runs["NCHW, layout.optimize"], t.runs[b]))

    opt, fair = vs("NHWC, hand-written"), vs(OIHW)
    within = "met" if opt <= 1.05 else "NOT met"
    faster = "met" if t.ratio("NCHW, layout.optimize") < 1.0 else "NOT met"
    return (f"Target: optimized NCHW / hand-written NHWC = {opt:.3f} (within 5%: {within}; "
            f"{fair:.3f} against NHWC fed the same OIHW params); optimized NCHW / plain NCHW "
            f"= {t.ratio('NCHW, layout.optimize'):.3f} (faster: {faster}).")

  body = "\n".join([
      "## Layout pass: ResNet-18 NCHW vs NHWC",
      "",
      f"`benchmarks/layout.py{' --quick' if args.quick else ''}`: ResNet-18 written in NCHW "
      f"with lax ops (as a PyTorch port), batch {args.batch}, {image}x{image} images, {args.dtype}. "
      f"{rounds} interleaved rounds after a warm-up; ratios are medians of per-round ratios "
      f"to plain `jax.jit` on the NCHW model. " + _harness.machine_line()
      + f" Load average while measuring: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}.",
      "",
      "Forward:",
      "",
      fwd_table,
      "",
      verdict(fwd_t),
      "",
      "Train step (loss, gradients and SGD update inside `layout.optimize`):",
      "",
      train_table,
      "",
      verdict(train_t),
      "",
      f"What the pass did (`layout.explain`): forward NCHW: {r_nchw.summary()}, transposes "
      f"{r_nchw.transposes_before} -> {r_nchw.transposes_after} (activations: 1 in; the rest "
      f"are kernels); train step NCHW: {r_train.counts.get('convolutions re-laid', 0)} of "
      f"{r_train.convolutions} convolutions re-laid, transposes {r_train.transposes_before} -> "
      f"{r_train.transposes_after}; forward NHWC: {r_nhwc.summary()}, transposes "
      f"{r_nhwc.transposes_before} -> {r_nhwc.transposes_after}.",
      "",
      f"Reading: the port's OIHW kernels ({n_params / 1e6:.1f}M weights) are inputs of the "
      "function, and the pass keeps inputs in their layout, so every call transposes them "
      "to HWIO (as XLA:CPU does itself for plain NCHW). 'NHWC, hand-written, OIHW params' "
      "is the NHWC network paying that same cost: the bound for a pass that keeps the "
      "function's signature. Hand-written NHWC with HWIO-stored kernels avoids it.",
  ])
  if not args.no_trainer:
    def trainer_verdict(t, what):
      r = t.ratio(TR_NCHW)
      return (f"Target ({what}): NCHW model / NHWC model = {r:.3f} (within 5%: "
              f"{'met' if r <= 1.05 else 'NOT met'}); without the re-laid storage "
              f"{t.ratio(TR_PLAIN):.3f}.")

    body += "\n".join([
        "", "",
        "### The Trainer: NCHW model against the same model written NHWC",
        "",
        (f"Both as Flax nnx modules trained by `tunedjax.Trainer` (layout pass on, kernel "
        f"selection off, SGD with momentum, the same batch); ratios to the NHWC model. "
        f"Train step: `fit` over {args.trainer_steps or (1 if args.quick else 3)} steps per "
        "timed run, divided per step. The Trainer's record of the storage: "
        f"{tr_tuning.get('weights', 0)} kernels and {tr_tuning.get('optimizer_leaves', 0)} "
        f"momentum leaves kept for {tr_tuning.get('target', '-')}."),
        "",
        "Train step:",
        "",
        tr_step,
        "",
        trainer_verdict(tr_step_t, "train step"),
        "",
        "Forward (`Trainer.predict` on one batch):",
        "",
        tr_fwd,
        "",
        trainer_verdict(tr_fwd_t, "forward"),
    ])
  print(body)
  if args.write:
    suffix = ("_quick" if args.quick else "") + ("" if args.dtype == "float32" else f"_{args.dtype}")
    _harness.write_section(f"layout_{jax.default_backend()}{suffix}", body)
    print(f"\nwrote {_harness.BENCHMARKS_MD}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
