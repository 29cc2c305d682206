"""What the autocast pass tells the function it traces: `trace_compute_dtype` and
`as_traced` (the call sites' side of mixed precision)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tunedjax as tj
from tunedjax import mixed_precision as mp
from tunedjax import rewrite
from tunedjax.mixed_precision._autocast import AS_TRACED


def _seen(run):
  """What `trace_compute_dtype` said inside the function `run` traces."""
  seen = []

  def f(x):
    seen.append(mp.trace_compute_dtype())
    return x * 2

  run(f)
  return [None if d is None else np.dtype(d).name for d in seen]


X = jnp.arange(4.0)


@pytest.mark.parametrize("run,want", [
    (lambda f: f(X), [None]),
    (lambda f: jax.jit(f)(X), [None]),
    (lambda f: mp.autocast(f)(X), ["bfloat16"]),
    (lambda f: mp.autocast(f, "mixed_float16")(X), ["float16"]),
    (lambda f: mp.autocast(f, "float32")(X), ["float32"]),
    (lambda f: mp.autocast(f, deny=["dot_general"])(X), [None]),
    (lambda f: mp.autocast(lambda x: mp.autocast(f, "mixed_float16")(x))(X), ["float16"]),
], ids=["eager", "jax.jit", "bf16", "f16", "f32", "denied", "innermost"])
def test_trace_compute_dtype(run, want):
  assert _seen(run) == want
  assert mp.trace_compute_dtype() is None  # nothing left behind


def test_trace_compute_dtype_in_regions():
  def in_region(region):
    def run(f):
      def g(x):
        with region:
          return f(x)
      return mp.autocast(g)(X)
    return run

  assert _seen(in_region(mp.precision_region("float32"))) == ["float32"]
  assert _seen(in_region(mp.as_traced())) == [None]


@pytest.mark.parametrize("config,want", [
    ({"mixed_precision": {"enable": True}}, ["bfloat16"]),
    ({"mixed_precision": {"enable": True, "policy": "mixed_float16"},
      "kernel": {"enable": True}, "cache": {"dir": None}}, ["float16"]),
    ({"mixed_precision": {"enable": False}}, [None])])
def test_trace_compute_dtype_under_tj_jit(config, want):
  with tj.config_context(config):
    assert _seen(lambda f: tj.jit(f)(X)) == want


def test_trace_compute_dtype_in_a_wrapped_model():
  seen = []

  class Model(nnx.Module):
    def __init__(self):
      self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
      seen.append(mp.trace_compute_dtype())
      return self.linear(x)

  mp.wrap(Model())(jnp.ones((2, 4)))
  assert seen == [jnp.bfloat16]


def _dtypes(closed, primitive):
  """The dtype of each `primitive` equation's first operand."""
  return [e.invars[0].aval.dtype.name for e in rewrite.iter_equations(closed)
          if e.primitive.name == primitive]


def test_as_traced_leaves_its_ops_alone_forward_and_backward():
  """Inside `as_traced` matmuls, exp and sums keep their traced dtypes (through a scan
  and the gradient); outside, the pass casts as usual; the values inside are float32's."""
  rng = np.random.default_rng(0)
  w, x = (jnp.asarray(rng.normal(size=(4, 4)), jnp.float32) for _ in range(2))

  def inside(w, x):
    def step(h, _):
      return jnp.tanh(h @ w), jnp.sum(jnp.exp(h))
    h, sums = jax.lax.scan(step, x, None, length=3)
    return jnp.sum(h) + jnp.sum(sums)

  def f(w, x):
    with mp.as_traced():
      kept = inside(w, x)
    return kept, jnp.sum(x @ w)

  counts = {}
  grad = jax.grad(lambda w, x: sum(f(w, x)))
  cast = mp.autocast(grad, on_trace=lambda ctx: counts.update(ctx.counts))
  closed = jax.make_jaxpr(cast)(w, x)
  assert counts[AS_TRACED] > 0
  dots = _dtypes(closed, "dot_general")
  assert dots.count("float32") >= 3 and dots.count("bfloat16") >= 2, dots  # forward + backward
  assert set(_dtypes(closed, "exp")) == {"float32"}
  kept = mp.autocast(lambda w, x: f(w, x)[0])(w, x)
  np.testing.assert_allclose(kept, inside(w, x), rtol=1e-6)
  np.testing.assert_allclose(mp.autocast(jax.grad(lambda w, x: f(w, x)[0]))(w, x),
                             jax.grad(inside)(w, x), rtol=1e-6)


def test_nested_bodies_are_traced_again_under_another_policy():
  """JAX's trace caches are keyed by the policy: a jitted helper traced inside the pass
  is traced again outside it (and for another policy), never reused across them."""
  traces = []

  @jax.jit
  def helper(x):
    traces.append(mp.trace_compute_dtype())
    return x * 2

  outer = lambda x: helper(x) + 1  # noqa: E731
  jax.make_jaxpr(mp.autocast(outer))(X)
  jax.make_jaxpr(mp.autocast(outer))(X)
  jax.make_jaxpr(outer)(X)
  jax.make_jaxpr(mp.autocast(outer, "mixed_float16"))(X)
  assert [None if d is None else np.dtype(d).name for d in traces] == [
      "bfloat16", None, "float16"]
