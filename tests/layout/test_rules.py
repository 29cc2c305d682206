"""The layout pass computes the same function, with transposes only at region edges."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

from tests.layout import nets
from tests.rewrite import cases
from tunedjax import layout, rewrite


def rel_err(a, b) -> float:
  """max |a - b| over every leaf, relative to the largest |a| of any leaf.

  Relative to the whole tree, not per leaf: the gradient of a bias feeding a
  batch norm is zero up to rounding, so its own relative error is noise.
  """
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert [x.shape for x in a] == [y.shape for y in b]
  scale = max(float(jnp.abs(x.astype(jnp.float32)).max()) for x in a)
  diff = max(float(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).max())
             for x, y in zip(a, b))
  return diff / scale


def loss_of(fn, ct):
  return lambda x, p: jnp.sum(fn(x, p).astype(jnp.float32) * ct)


def activation_transposes(closed) -> int:
  """Transposes of rank-4 activations ((0,2,3,1) in or (0,3,1,2) out), not of kernels."""
  return sum(e.primitive.name == "transpose"
             and e.params["permutation"] in ((0, 2, 3, 1), (0, 3, 1, 2))
             for e in rewrite.iter_equations(closed))


@pytest.mark.slow
@settings(max_examples=6)
@given(seed=st.integers(0, 10_000))
def test_random_nets_match_forward_and_gradient_f32(seed):
  net = nets.random_net(seed)
  opt = layout.optimize(net.fn, target="NHWC")
  ct = jnp.asarray(np.random.default_rng(seed).normal(size=(2, 3)), jnp.float32)
  want, want_g = jax.jit(jax.value_and_grad(loss_of(net.fn, ct), argnums=(0, 1)))(net.x, net.params)
  got, got_g = jax.jit(jax.value_and_grad(loss_of(opt, ct), argnums=(0, 1)))(net.x, net.params)
  out_want = jax.jit(net.fn)(net.x, net.params)
  out_got = jax.jit(opt)(net.x, net.params)
  assert rel_err(out_want, out_got) < 1e-5, net.layers
  assert rel_err(want_g, got_g) < 1e-3, net.layers
  assert opt.report().counts["convolutions re-laid"] >= 1


@settings(max_examples=3)
@given(seed=st.integers(0, 10_000))
def test_random_nets_match_in_bfloat16(seed):
  net = nets.random_net(seed, depth=3, dtype=jnp.bfloat16)
  opt = layout.optimize(net.fn, target="NHWC")
  want = jax.jit(net.fn)(net.x, net.params)
  got = jax.jit(opt)(net.x, net.params)
  assert got.dtype == jnp.bfloat16
  assert rel_err(want, got) < 1e-2, net.layers


def test_train_step_with_gradients_inside_the_jaxpr(rng):
  """The backward convolutions, select_and_scatter_add and pad of a train step."""
  net = nets.random_net(3, depth=5, head="flatten")
  ct = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)

  def step(x, params):
    grads = jax.grad(loss_of(lambda x, p: nets.max_pool(net.fn(x, p)[:, :, None, None]
                                                        * jnp.ones((1, 1, 4, 4)), k=2, s=2)
                             .mean((2, 3)), ct), argnums=1)(x, params)
    return [p - 0.1 * g for p, g in zip(params, grads)]

  opt = layout.optimize(step, target="NHWC")
  want = jax.jit(step)(net.x, net.params)
  got = jax.jit(opt)(net.x, net.params)
  assert rel_err(want, got) < 1e-5
  assert opt.report().counts["convolutions re-laid"] >= 3  # forward, input and weight gradients


@pytest.mark.parametrize("n", [2, 5])
def test_chain_of_convs_has_two_activation_transposes(rng, n):
  ws = [jnp.asarray(rng.normal(size=(4, 4, 3, 3)) / 6, jnp.float32) for _ in range(n)]
  b = jnp.asarray(rng.normal(size=4), jnp.float32)

  def chain(x, ws):
    for w in ws:
      x = lax.conv(x, w, (1, 1), "SAME") + b[None, :, None, None]
      x = jnp.tanh(jax.nn.relu(x) * 1.5 - 0.1)
    return x

  x = jnp.asarray(rng.normal(size=(2, 4, 8, 8)), jnp.float32)
  opt = layout.optimize(chain, target="NHWC")
  closed = jax.make_jaxpr(opt)(x, ws)
  assert activation_transposes(closed) == 2          # not 2 * n
  assert rewrite.count_primitives(closed)["conv_general_dilated"] == n
  assert rel_err(chain(x, ws), opt(x, ws)) < 1e-5
  # the same chain transposed around every conv, as XLA:CPU does for NCHW, would have 2n
  report = layout.explain(chain, x, ws, target="NHWC")
  assert report.transposes_before == 0
  assert report.transposes_after == 2 + n            # 2 activations + n kernels


@pytest.mark.parametrize("dims", [1, 3])
def test_1d_and_3d_convolutions_and_pooling(rng, dims):
  spatial = (6,) * dims
  x = jnp.asarray(rng.normal(size=(2, 3, *spatial)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 3, *(2,) * dims)), jnp.float32)

  def f(x, w):
    y = lax.conv_general_dilated(x, w, (2,) * dims, "SAME", rhs_dilation=(1,) * dims)
    y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, *(2,) * dims), (1, 1, *(1,) * dims),
                          ((0, 0), (0, 0), *((1, 0),) * dims))
    return jnp.sum(y ** 2)

  opt = layout.optimize(f, target="NHWC")
  assert rel_err(jax.grad(f, argnums=(0, 1))(x, w), jax.grad(opt, argnums=(0, 1))(x, w)) < 1e-5
  assert opt.report().counts["convolutions re-laid"] == 1


def test_axis_ops_are_remapped_not_transposed(rng):
  """cumsum, slice, rev, pad, squeeze, dynamic_slice, argmax over re-laid activations."""
  x = jnp.asarray(rng.normal(size=(2, 3, 8, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 3, 3, 3)), jnp.float32)

  def f(x, w):
    y = lax.conv(x, w, (1, 1), "SAME")
    y = jnp.cumsum(y, axis=2)[:, :, 1:7:2, ::-1]
    y = jnp.pad(y, ((0, 0), (1, 0), (2, 1), (0, 0)))
    y = lax.dynamic_slice(y, (0, 1, 1, 0), (2, 4, 3, 8))
    s = jnp.argmax(y, axis=1).astype(jnp.float32)
    z = y[:, :, :1, :].squeeze(2)
    return jnp.sum(y, axis=(1,)) + s, z

  opt = layout.optimize(f, target="NHWC")
  assert rel_err(f(x, w), opt(x, w)) < 1e-5
  report = layout.explain(f, x, w, target="NHWC")
  assert report.counts["axis ops remapped"] >= 3
  assert report.transposes_after <= 4


def test_user_transposes_are_absorbed(rng):
  """An NHWC conv on a transposed NCHW input: the user's transposes cancel."""
  x = jnp.asarray(rng.normal(size=(2, 3, 8, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 3, 3, 4)), jnp.float32)

  def f(x, w):
    y = lax.conv_general_dilated(x.transpose(0, 2, 3, 1), w, (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.tanh(y).transpose(0, 3, 1, 2)

  report = layout.explain(f, x, w, target="NHWC")
  assert report.transposes_before == 2
  assert report.transposes_after == 2
  assert report.counts["transposes absorbed"] == 2
  assert rel_err(f(x, w), layout.optimize(f)(x, w)) < 1e-6


def test_nhwc_model_is_unchanged_by_nhwc_target(rng):
  x = jnp.asarray(rng.normal(size=(2, 8, 8, 3)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 3, 3, 4)), jnp.float32)

  def f(x, w):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return lax.reduce_window(jax.nn.relu(y), 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

  report = layout.explain(f, x, w, target="NHWC")
  assert report.decision == "unchanged"
  assert report.transposes_after == 0
  opt = layout.optimize(f, target="NHWC")
  assert rewrite.count_primitives(jax.make_jaxpr(opt)(x, w))["transpose"] == 0
  # ... and an NCHW target moves it to NCHW and back, still the same function
  assert rel_err(f(x, w), layout.optimize(f, target="NCHW")(x, w)) < 1e-5
  assert layout.explain(f, x, w, target="NCHW").decision == "relaid"


def test_nhwc_train_step_with_depthwise_convs_is_unchanged(rng):
  """The backward convolutions of an NHWC model (weight gradients read the
  activations with batch and feature roles swapped) are left as written too."""
  nhwc = ("NHWC", "HWIO", "NHWC")
  params = {"dw": jnp.asarray(rng.normal(size=(3, 3, 1, 4)), jnp.float32),
            "pw": jnp.asarray(rng.normal(size=(1, 1, 4, 8)), jnp.float32)}
  x = jnp.asarray(rng.normal(size=(2, 8, 8, 4)), jnp.float32)

  def loss(params, x):
    h = lax.conv_general_dilated(x, params["dw"], (2, 2), "SAME", dimension_numbers=nhwc,
                                 feature_group_count=4)
    h = lax.conv_general_dilated(jax.nn.relu(h), params["pw"], (1, 1), "SAME",
                                 dimension_numbers=nhwc)
    return jnp.mean(h ** 2)

  step = jax.grad(loss)
  report = layout.explain(step, params, x)
  assert report.decision == "unchanged", report
  assert report.counts.get("convolutions re-laid", 0) == 0
  opt = jax.make_jaxpr(layout.optimize(step))(params, x)
  assert rewrite.count_primitives(opt)["transpose"] == rewrite.count_primitives(
      jax.make_jaxpr(step)(params, x))["transpose"]
  assert rel_err(layout.optimize(step)(params, x)["dw"], step(params, x)["dw"]) < 1e-6


def test_function_without_convolutions_is_unchanged(rng):
  x = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
  f = lambda x: jnp.tanh(x.T @ x).sum(0) + jnp.cumsum(x, 1)[0]
  opt = layout.optimize(f)
  assert str(jax.make_jaxpr(opt)(x)) == str(jax.make_jaxpr(f)(x))
  assert opt.report().decision == "unchanged"
  assert opt.report().reason == "no convolutions"


@pytest.mark.parametrize("make", [cases.linen_transformer, cases.scan_rnn, cases.cond_while],
                         ids=lambda m: m.__name__)
def test_realistic_programs_without_convolutions_are_unchanged(rng, make):
  case = make(rng)
  opt = layout.optimize(case.fn)
  assert str(jax.make_jaxpr(opt)(case.params, case.batch)) == str(
      jax.make_jaxpr(case.fn)(case.params, case.batch))


@pytest.mark.slow  # building the nnx model eagerly takes most of it
def test_nnx_cnn_with_batchnorm_and_dropout(rng):
  """A Flax nnx CNN (NHWC convs inside nested jits): same loss and gradients."""
  case = cases.nnx_cnn(rng)
  report = layout.explain(case.fn, case.params, case.batch, target="NHWC")
  assert report.decision == "unchanged" and report.transposes_after == 0  # already NHWC
  opt = layout.optimize(case.fn, target="NCHW")
  want = jax.jit(jax.value_and_grad(case.fn))(case.params, case.batch)
  got = jax.jit(jax.value_and_grad(opt))(case.params, case.batch)
  assert rel_err(want, got) < 1e-4
  assert opt.report().counts["convolutions re-laid"] == 2


def test_composes_with_jit_grad_vmap(rng):
  net = nets.random_net(7, depth=3, head="global")
  opt = layout.optimize(net.fn, target="NHWC")
  xs = jnp.stack([net.x, net.x * 0.5 + 0.1])                        # a vmapped batch of batches
  want = jax.jit(jax.vmap(net.fn, in_axes=(0, None)))(xs, net.params)
  got = jax.jit(jax.vmap(opt, in_axes=(0, None)))(xs, net.params)
  assert rel_err(want, got) < 1e-5
  g = lambda fn: jax.jit(jax.grad(lambda p: jnp.sum(fn(net.x, p) ** 2)))(net.params)
  assert rel_err(g(net.fn), g(opt)) < 1e-3
  per_example = jax.jit(jax.vmap(jax.grad(lambda x, p: jnp.sum(opt(x[None], p) ** 2)),
                                 in_axes=(0, None)))
  want_pe = jax.jit(jax.vmap(jax.grad(lambda x, p: jnp.sum(net.fn(x[None], p) ** 2)),
                             in_axes=(0, None)))
  assert rel_err(want_pe(net.x, net.params), per_example(net.x, net.params)) < 1e-3


def test_sharded_batch_on_8_devices(mesh8, rng):
  x = jnp.asarray(rng.normal(size=(16, 3, 8, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 3, 3, 3)), jnp.float32)
  f = lambda x, w: jnp.mean(jax.nn.relu(nets.conv(x, w)) ** 2, axis=(1, 2, 3))
  sharding = jax.sharding.NamedSharding(mesh8, jax.sharding.PartitionSpec("data"))
  xs = jax.device_put(x, sharding)
  opt = jax.jit(layout.optimize(f, target="NHWC"))
  got = opt(xs, w)
  assert rel_err(f(x, w), got) < 1e-5
  assert got.sharding.is_equivalent_to(
      jax.sharding.NamedSharding(mesh8, jax.sharding.PartitionSpec("data")), 1)
  # Gradients: jax.make_mesh gives Explicit axes, where even the original
  # function's weight gradient needs an out_sharding; use Auto axes for it.
  auto = jax.sharding.Mesh(mesh8.devices, mesh8.axis_names,
                           axis_types=(jax.sharding.AxisType.Auto,))
  xs = jax.device_put(x, jax.sharding.NamedSharding(auto, jax.sharding.PartitionSpec("data")))
  g = jax.jit(jax.grad(lambda x, w: layout.optimize(f)(x, w).sum(), argnums=(0, 1)))(xs, w)
  assert rel_err(jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))(x, w), g) < 1e-4
  assert g[0].sharding.is_equivalent_to(xs.sharding, 4)


def test_checkpointed_block_and_partial(rng):
  """Convolutions inside jax.checkpoint and a static option closed over with partial."""
  x = jnp.asarray(rng.normal(size=(2, 3, 8, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 3, 3, 3)), jnp.float32)

  def f(x, w, *, scale):
    block = jax.checkpoint(lambda y: jax.nn.relu(nets.conv(y, w)) * scale)
    return jnp.sum(block(block(x)) ** 2)  # the output is a scalar: 1 transpose, in

  g = functools.partial(f, scale=0.5)
  opt = layout.optimize(g, target="NHWC")
  assert rel_err(jax.grad(g, argnums=(0, 1))(x, w), jax.grad(opt, argnums=(0, 1))(x, w)) < 1e-4
  # the checkpointed blocks are rebuilt in NHWC: no transposes between them
  assert activation_transposes(jax.make_jaxpr(opt)(x, w)) == 1
