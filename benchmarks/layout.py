"""Layout pass: a ResNet-18 written in NCHW, re-laid to NHWC, against hand-written NHWC.

A ResNet-18 as a PyTorch port would be written (NCHW activations, OIHW kernels, lax ops;
batch-stat BatchNorm, 1x1/2 projection shortcuts), batch 8, forward and SGD train step,
checked to agree, then interleaved: NCHW under jax.jit (the baseline) and under
`layout.optimize`; the same network hand-written NHWC (same weights), fed HWIO or the OIHW
kernels transposed inside the step (what any NHWC execution of the port must pay: the
function's inputs keep their layout); `layout.optimize` on the NHWC network (should change
nothing). Target (issue #4): optimized NCHW within 5% of hand-written NHWC and faster than
plain NCHW.

Then both networks as Flax nnx modules trained by `tunedjax.Trainer` (layout pass on, kernel
selection off, SGD with momentum), per step (`fit`) and per `predict`: the NHWC model (the
baseline), the NCHW model (the Trainer keeps its kernels and their momentum stored HWIO
between steps), and the NCHW model with that storage off (each step transposes the
kernels). Target (issue #18): the NCHW model within 5% of the NHWC model.

Run: `.venv/bin/python benchmarks/run.py layout [--quick] [--write]` (112x112 images,
9 rounds; `measure(image=224, dtype="bfloat16", ...)` for other sizes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

import harness
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


BASE, OPT, HAND = "NCHW, jax.jit", "NCHW, layout.optimize", "NHWC, hand-written"
OPT_NHWC = "NHWC, layout.optimize"


def _check_same(outs: dict, what: str, tol: float) -> None:
  """Every variant's outputs match the baseline's, relative to the largest of them."""
  base = [a.astype(jnp.float32) for a in jax.tree_util.tree_leaves(outs[BASE])]
  scale = max(float(jnp.abs(a).max()) for a in base)
  for name, out in outs.items():
    if name.startswith("NHWC") and name != OIHW:  # HWIO kernels back to OIHW before comparing
      out = jax.tree_util.tree_map(lambda p: p.transpose(3, 2, 0, 1) if p.ndim == 4 else p, out)
    for a, b in zip(base, jax.tree_util.tree_leaves(out)):
      err = float(jnp.abs(a - b.astype(jnp.float32)).max()) / scale
      if err > tol:
        raise SystemExit(f"{what}: {name} differs from the baseline (rel err {err:.2e})")


def bench(title: str, fns: dict, args_for: dict, rounds: int) -> harness.Timings:
  """Checks that the variants agree, then times them interleaved."""
  outs = {name: fn(*args_for[name]) for name, fn in fns.items()}  # compile + check
  dtype = jax.tree_util.tree_leaves(outs[BASE])[0].dtype
  _check_same(outs, title, 1e-3 if dtype == jnp.float32 else 5e-2)
  variants = {name: (lambda fn=fn, a=args_for[name]: jax.block_until_ready(fn(*a)))
              for name, fn in fns.items()}
  return harness.interleaved(variants, baseline=BASE, rounds=rounds, warmup=1)


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


def trainer_timings(p_nchw: dict, x_nchw: jax.Array, y: jax.Array, *, rounds: int,
                    steps: int) -> tuple[harness.Timings, harness.Timings, dict]:
  """Per-step and per-predict times of the Trainer on the NCHW and NHWC models, and the
  Trainer's record of the re-laid storage."""
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

  train_t = harness.interleaved({n: (lambda n=n: fit(n)) for n in made}, baseline=TR_NHWC,
                                rounds=rounds, warmup=1)
  fwd_t = harness.interleaved({n: (lambda n=n: predict(n)) for n in made}, baseline=TR_NHWC,
                              rounds=rounds, warmup=1)
  per_step = harness.Timings({n: [v / steps for v in r] for n, r in train_t.runs.items()}, TR_NHWC)
  return per_step, fwd_t, dict(made[TR_NCHW][0].history.tuning.get(_relayout.KEY, {}))


def measure(quick: bool = False, *, image: int = 112, rounds: int = 9, batch: int = 8,
            dtype: str = "float32", trainer_steps: int = 3, trainer: bool = True
            ) -> harness.Result:
  """The forward and the train step of every variant, then the Trainer's tables."""
  if quick:
    image, rounds, trainer_steps = 32, 2, 1
  rng = np.random.default_rng(0)
  p_nchw = jax.tree_util.tree_map(lambda a: a.astype(jnp.dtype(dtype)), init_params(rng))
  p_nhwc = to_nhwc_params(p_nchw)
  x_nchw = jnp.asarray(rng.normal(size=(batch, 3, image, image)), jnp.dtype(dtype))
  x_nhwc = x_nchw.transpose(0, 2, 3, 1)
  y = jnp.asarray(rng.integers(0, 1000, size=batch), jnp.int32)

  fwd_nchw = lambda p, x: resnet18(p, x, channels_last=False)  # noqa: E731
  fwd_nhwc = lambda p, x: resnet18(p, x, channels_last=True)  # noqa: E731
  fwd_oihw = lambda p, x: fwd_nhwc(to_nhwc_params(p), x.transpose(0, 2, 3, 1))  # noqa: E731
  step_nchw, step_nhwc = make_train_step(False), make_train_step(True)

  def step_oihw(p, x, y):
    new, loss = step_nhwc(to_nhwc_params(p), x.transpose(0, 2, 3, 1), y)
    return jax.tree_util.tree_map(lambda q: q.transpose(3, 2, 0, 1) if q.ndim == 4 else q,
                                  new), loss

  def variants(nchw, nhwc, oihw):
    return {BASE: jax.jit(nchw), OPT: jax.jit(layout.optimize(nchw)), HAND: jax.jit(nhwc),
            OIHW: jax.jit(oihw), OPT_NHWC: jax.jit(layout.optimize(nhwc))}

  fwd_args = {k: ((p_nhwc, x_nhwc) if k.startswith("NHWC") and k != OIHW else (p_nchw, x_nchw))
              for k in (BASE, OPT, HAND, OIHW, OPT_NHWC)}
  result = harness.Result("layout", params={
      "quick": quick, "image": image, "rounds": rounds, "batch": batch, "dtype": dtype,
      "trainer_steps": trainer_steps, "backend": jax.default_backend()})
  result.timings["forward"] = bench("forward", variants(fwd_nchw, fwd_nhwc, fwd_oihw),
                                    fwd_args, rounds)
  result.timings["train step"] = bench("train step", variants(step_nchw, step_nhwc, step_oihw),
                                       {k: (*a, y) for k, a in fwd_args.items()}, rounds)
  if trainer:
    (result.timings["trainer step"], result.timings["trainer forward"],
     result.figures["trainer storage"]) = trainer_timings(p_nchw, x_nchw, y, rounds=rounds,
                                                          steps=trainer_steps)
  explained = {"forward NCHW": layout.explain(fwd_nchw, p_nchw, x_nchw),
               "forward NHWC": layout.explain(fwd_nhwc, p_nhwc, x_nhwc),
               "train step NCHW": layout.explain(step_nchw, p_nchw, x_nchw, y)}
  result.figures["explain"] = {
      k: {"summary": r.summary(), "before": r.transposes_before, "after": r.transposes_after,
          "re-laid": r.counts.get("convolutions re-laid", 0), "convolutions": r.convolutions}
      for k, r in explained.items()}
  result.figures["kernel weights"] = sum(a.size for a in jax.tree_util.tree_leaves(p_nchw)
                                         if a.ndim == 4)
  return result


def _table(t: harness.Timings) -> str:
  return harness.ratio_table(t, notes={
      OPT: f"{t.ratio_to(OPT, HAND):.3f}x hand-written NHWC, {t.ratio_to(OPT, OIHW):.3f}x NHWC "
           "with OIHW params",
      OIHW: f"{t.ratio_to(OIHW, HAND):.3f}x hand-written NHWC",
      OPT_NHWC: f"{t.ratio_to(OPT_NHWC, HAND):.3f}x hand-written NHWC"})


def _verdict(t: harness.Timings) -> str:
  opt, fair = t.ratio_to(OPT, HAND), t.ratio_to(OPT, OIHW)
  within = "met" if opt <= 1.05 else "NOT met"
  faster = "met" if t.ratio(OPT) < 1.0 else "NOT met"
  return (f"Target: optimized NCHW / hand-written NHWC = {opt:.3f} (within 5%: {within}; "
          f"{fair:.3f} against NHWC fed the same OIHW params); optimized NCHW / plain NCHW "
          f"= {t.ratio(OPT):.3f} (faster: {faster}).")


def _trainer_verdict(t: harness.Timings, what: str) -> str:
  r = t.ratio(TR_NCHW)
  return (f"Target ({what}): NCHW model / NHWC model = {r:.3f} (within 5%: "
          f"{'met' if r <= 1.05 else 'NOT met'}); without the re-laid storage "
          f"{t.ratio(TR_PLAIN):.3f}.")


def render(result: harness.Result) -> dict[str, str]:
  """The section `layout_<backend>` (`_<dtype>` beside it for other than float32)."""
  p, t, e = result.params, result.timings, result.figures["explain"]
  nchw, step, nhwc = e["forward NCHW"], e["train step NCHW"], e["forward NHWC"]
  lines = [
      "## Layout pass: ResNet-18 NCHW vs NHWC", "",
      f"`benchmarks/run.py layout{' --quick' if p['quick'] else ''}`: ResNet-18 written in NCHW "
      f"with lax ops (as a PyTorch port), batch {p['batch']}, {p['image']}x{p['image']} images, "
      f"{p['dtype']}. {p['rounds']} interleaved rounds after a warm-up; ratios are medians of "
      "per-round ratios to plain `jax.jit` on the NCHW model. "
      f"{result.machine} {result.load_line()}",
      "", "Forward:", "", _table(t["forward"]), "", _verdict(t["forward"]), "",
      "Train step (loss, gradients and SGD update inside `layout.optimize`):", "",
      _table(t["train step"]), "", _verdict(t["train step"]), "",
      f"What the pass did (`layout.explain`): forward NCHW: {nchw['summary']}, transposes "
      f"{nchw['before']} -> {nchw['after']} (activations: 1 in; the rest are kernels); train "
      f"step NCHW: {step['re-laid']} of {step['convolutions']} convolutions re-laid, "
      f"transposes {step['before']} -> {step['after']}; forward NHWC: {nhwc['summary']}, "
      f"transposes {nhwc['before']} -> {nhwc['after']}.", "",
      f"Reading: the port's OIHW kernels ({result.figures['kernel weights'] / 1e6:.1f}M weights) "
      "are inputs of the function, and the pass keeps inputs in their layout, so every call "
      "transposes them to HWIO (as XLA:CPU does itself for plain NCHW). 'NHWC, hand-written, "
      "OIHW params' is the NHWC network paying that same cost: the bound for a pass that "
      "keeps the function's signature. Hand-written NHWC with HWIO-stored kernels avoids it.",
  ]
  if "trainer step" in t:
    storage = result.figures["trainer storage"]
    lines += [
        "", "### The Trainer: NCHW model against the same model written NHWC", "",
        "Both as Flax nnx modules trained by `tunedjax.Trainer` (layout pass on, kernel "
        "selection off, SGD with momentum, the same batch); ratios to the NHWC model. "
        f"Train step: `fit` over {p['trainer_steps']} steps per timed run, divided per step. "
        f"The Trainer's record of the storage: {storage.get('weights', 0)} kernels and "
        f"{storage.get('optimizer_leaves', 0)} momentum leaves kept for "
        f"{storage.get('target', '-')}.", ""]
    for what, key, table in (("Train step:", "trainer step", "train step"),
                             ("Forward (`Trainer.predict` on one batch):", "trainer forward",
                              "forward")):
      lines += [what, "", harness.ratio_table(t[key]), "", _trainer_verdict(t[key], table)]
      lines += [""] if key == "trainer step" else []
  suffix = "" if p["dtype"] == "float32" else f"_{p['dtype']}"
  return {f"layout_{p['backend']}{suffix}": "\n".join(lines)}
