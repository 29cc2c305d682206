"""Tests of the reduced-precision gradient all-reduce on 8 host CPU devices."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tunedjax import mixed_precision as mp


def _problem(rng):
  params = {"w1": jnp.asarray(rng.normal(size=(12, 32)) / 4, jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(32, 3)) / 6, jnp.float32)}
  batch = {"x": jnp.asarray(rng.normal(size=(64, 12)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(64, 3)), jnp.float32)}

  def loss_fn(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

  return params, batch, loss_fn


def _lowered_all_reduce_types(text):
  """The operand element types of each all_reduce in lowered StableHLO."""
  found = []
  for m in re.finditer(r'stablehlo\.all_reduce"', text):
    signature = re.search(r"\}\) : \(([^)]*)\) ->", text[m.end():]).group(1)
    found.append(set(re.findall(r"[x<](bf16|f16|f32|f64)>", signature)))
  return found


def _compiled_gradient_all_reduce_types(hlo_text):
  """Element types of the gradient-shaped ([12,32], [32,3]) all-reduce results
  in compiled HLO (XLA combines all-reduces into tuples)."""
  found = set()
  for line in hlo_text.splitlines():
    if re.search(r"\ball-reduce(-start)?\(", line):
      lhs = line.split("=", 1)[1].split("all-reduce", 1)[0]
      found |= set(re.findall(r"\b(bf16|f16|f32|f64)\[(?:12,32|32,3)\]", lhs))
  return found


@pytest.mark.parametrize("reduce_dtype, wire", [(jnp.bfloat16, "bf16"), ("float16", "f16"),
                                                (None, "f32")])
def test_gradients_match_and_the_all_reduce_is_in_the_wire_dtype(rng, mesh8, reduce_dtype, wire):
  params, batch, loss_fn = _problem(rng)
  want_loss, want = jax.value_and_grad(loss_fn)(params, batch)
  fn = jax.jit(mp.data_parallel_value_and_grad(loss_fn, mesh8, reduce_dtype=reduce_dtype))
  params = jax.device_put(params, NamedSharding(mesh8, P()))
  batch = jax.device_put(batch, NamedSharding(mesh8, P("data")))
  loss, grads = fn(params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for k in want:
    assert grads[k].dtype == jnp.float32
    err = np.linalg.norm(grads[k] - want[k]) / np.linalg.norm(want[k])
    assert err < (1e-2 if wire != "f32" else 1e-5), (k, err)
  lowered = fn.lower(params, batch)
  # The program all-reduces the two gradients in the wire dtype, the loss in f32.
  types = _lowered_all_reduce_types(lowered.as_text())
  assert sorted(map(sorted, types)) == sorted([[wire], [wire], ["f32"]]), types
  compiled = _compiled_gradient_all_reduce_types(lowered.compile().as_text())
  if wire == "bf16" and jax.default_backend() == "cpu":
    # XLA:CPU promotes bfloat16 all-reduces to float32 (no bf16 reduction on
    # host); float16 ones it keeps. On GPU/TPU bf16 stays bf16.
    assert compiled == {"f32"}, compiled
  else:
    assert compiled == {wire}, compiled


def test_allreduce_gradients_keeps_integers_and_narrow_leaves(mesh8):
  def f(g):
    return mp.allreduce_gradients(g, "data", op="sum")

  tree = {"f": jnp.ones((8, 2), jnp.float32), "i": jnp.ones((8,), jnp.int32),
          "h": jnp.ones((8, 2), jnp.float16)}
  tree = jax.device_put(tree, NamedSharding(mesh8, P("data")))
  out = jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P("data"), out_specs=P("data")))(tree)
  assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in tree.items()}
  out = jax.tree_util.tree_map(np.asarray, out)
  # Non-floating leaves (no gradient) pass through unreduced.
  assert (out["f"] == 8).all() and (out["i"] == 1).all() and (out["h"] == 8).all()
  with pytest.raises(mp.PolicyError, match="'mean' or 'sum'"):
    mp.allreduce_gradients(tree, "data", op="max")
