"""What the rewrite engine adds to tracing time.

Times `jax.make_jaxpr` of a Flax nnx train step (a CNN with BatchNorm, Dropout
and optax Adam; about 1,000 equations counting sub-jaxprs) against tracing
the same step through `tunedjax.rewrite.transform`:

- identity: no rule fires, so higher-order equations are bound as written
  (what a pass costs on a program it has nothing to do for);
- identity, rebuild all: every sub-jaxpr is re-traced (the engine's full
  path, what a pass that touches every region costs);
- one rule on `add`: a real rule that fires on a common primitive everywhere.

Each variant traces a fresh function object, so jit's trace cache never
returns the outer jaxpr for free. Target (issue #2): the rewrite adds under
50% to tracing time.

Run: `.venv/bin/python benchmarks/run.py rewrite_overhead [--quick] [--write]`.
"""

from __future__ import annotations

import functools

import jax
import optax
from flax import nnx

import harness
from tunedjax import rewrite


class Net(nnx.Module):

  def __init__(self, depth: int, rngs: nnx.Rngs):
    self.stem = nnx.Conv(3, 16, (3, 3), rngs=rngs)
    self.blocks = nnx.List([
        nnx.Sequential(nnx.Conv(16, 16, (3, 3), rngs=rngs), nnx.BatchNorm(16, rngs=rngs))
        for _ in range(depth)])
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.head = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    for block in self.blocks:
      x = x + nnx.relu(block(x))
    return self.head(self.drop(x).mean((1, 2)))


def make_train_step(depth: int):
  model = Net(depth, nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))

  def step(state, x, y):
    model, opt = nnx.merge(graphdef, state, copy=True)

    def loss(m):
      return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    value, grads = nnx.value_and_grad(loss)(model)
    opt.update(model, grads)
    return nnx.state((model, opt)), value

  x = jax.random.normal(jax.random.key(1), (8, 16, 16, 3))
  y = jax.random.randint(jax.random.key(2), (8,), 0, 10)
  return step, (state, x, y)


def _add_rule(ctx, eqn, invals):
  return ctx.bind(eqn, invals)


def measure(quick: bool = False, depth: int = 6, rounds: int = 9) -> harness.Result:
  """Times tracing the step plain and through each pass, interleaved."""
  depth, rounds = (2, 2) if quick else (depth, rounds)
  step, inputs = make_train_step(depth)
  counts = rewrite.count_primitives(jax.make_jaxpr(step)(*inputs))
  passes = {
      "identity": rewrite.Pass("identity"),
      "identity, rebuild all": rewrite.Pass("identity_rebuild", skip_untouched=False),
      "one rule on `add`": rewrite.Pass("add_rule", {"add": _add_rule}),
  }

  def trace_with(pass_):
    return lambda: jax.make_jaxpr(rewrite.transform(functools.partial(step), pass_))(*inputs)

  variants = {"jax.make_jaxpr": lambda: jax.make_jaxpr(functools.partial(step))(*inputs)}
  variants.update({f"make_jaxpr + rewrite ({name})": trace_with(p) for name, p in passes.items()})
  t = harness.interleaved(variants, baseline="jax.make_jaxpr", rounds=rounds, warmup=2)
  return harness.Result("rewrite_overhead", timings={"trace": t}, params={
      "depth": depth, "rounds": rounds, "equations": sum(counts.values()), "adds": counts["add"]})


def render(result: harness.Result) -> str:
  """The section: the ratio table and the verdict against the target."""
  p, t = result.params, result.timings["trace"]
  table = harness.ratio_table(t, notes={
      "make_jaxpr + rewrite (one rule on `add`)": f"rule fires on {p['adds']} `add` equations"})
  worst = max(t.ratio(k) for k in t.runs if k != "jax.make_jaxpr")
  return "\n".join([
      "## Rewrite engine: tracing overhead", "",
      f"`benchmarks/run.py rewrite_overhead`: trace a Flax nnx train step (CNN, depth "
      f"{p['depth']}, BatchNorm, Dropout, optax Adam; {p['equations']} equations counting "
      f"sub-jaxprs) with `jax.make_jaxpr`, against tracing it through "
      f"`tunedjax.rewrite.transform`. {p['rounds']} interleaved rounds after 2 warm-up "
      "rounds; ratios are medians of per-round ratios. " + result.machine + " "
      + result.load_line(), "",
      table, "",
      f"Target: the rewrite adds under 50% to tracing time (ratio < 1.5): "
      f"{'met' if worst < 1.5 else 'NOT met'} (worst variant {worst:.2f}).",
  ])
