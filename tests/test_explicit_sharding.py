"""Inputs sharded over Explicit mesh axes: tunedjax takes them wherever `jax.jit` does.

`jax.make_mesh` makes Explicit axes (jax 0.10 to 0.12): an array's type then
says how it is sharded, and every operation must be able to say how its
output is sharded. A kernel that replaces a convolution with reshapes and
matmuls (a weight gradient contracts over the sharded batch) runs on Auto
axes (`rewrite._compat.on_auto_axes`) and hands back the sharding the
convolution's output has.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tunedjax as tj
from tests.rewrite import cases
from tunedjax import rewrite
from tunedjax.rewrite import _compat
from tunedjax.autotune import _registry as reg
from tunedjax.ops.conv._spec import ConvSpec
from tunedjax.autotune._hints import HintWarning

CASES = {c.__name__: c for c in cases.ALL_CASES}
IDENTITY_REBUILD = rewrite.Pass("identity_rebuild", skip_untouched=False)


def _outputs_and_grads(fn, params, batch, differentiable):
  out = jax.jit(fn)(params, batch)
  grads = jax.jit(jax.grad(fn))(params, batch) if differentiable else None
  return out, grads


def _assert_same(want, got, *, rtol=0.0):
  lw, tw = jax.tree_util.tree_flatten(want)
  lg, tg = jax.tree_util.tree_flatten(got)
  assert tw == tg
  for w, g in zip(lw, lg):
    assert w.dtype == g.dtype and w.shape == g.shape
    assert g.sharding.is_equivalent_to(w.sharding, w.ndim), (g.sharding, w.sharding)
    w, g = np.asarray(w, np.float32), np.asarray(g, np.float32)
    if rtol == 0.0:
      np.testing.assert_array_equal(g, w)
    else:
      assert np.linalg.norm(g - w) <= rtol * max(np.linalg.norm(w), 1e-30)


@pytest.mark.parametrize("case_name", CASES)
def test_identity_pass_on_explicit_axes_as_jax_jit(case_name, mesh8_explicit):
  case = CASES[case_name](np.random.default_rng(0))
  params = jax.device_put(case.params, NamedSharding(mesh8_explicit, P()))
  batch = jax.device_put(case.batch, NamedSharding(mesh8_explicit, P("data")))
  rewritten = rewrite.transform(case.fn, IDENTITY_REBUILD)
  try:
    want = _outputs_and_grads(case.fn, params, batch, case.differentiable)
  except _compat.ShardingTypeError:  # plain jax.jit rejects it (jax 0.11+): so may we
    with pytest.raises(_compat.ShardingTypeError):
      _outputs_and_grads(rewritten, params, batch, case.differentiable)
    return
  _assert_same(want, _outputs_and_grads(rewritten, params, batch, case.differentiable))


# --- tj.jit with every pass and every kernel on an explicitly sharded batch ------------

BATCH = 16


def _cnn_problem():
  """An SGD step of a small NCHW CNN with a depthwise layer, one-hot cross-entropy
  (which plain `jax.jit` takes on Explicit axes), and its params and batch."""
  rng = np.random.default_rng(0)
  normal = lambda *s: jnp.asarray(rng.normal(size=s, scale=0.3), jnp.float32)  # noqa: E731
  params = {"w1": normal(8, 3, 3, 3), "dw": normal(8, 1, 3, 3), "w2": normal(16, 8, 3, 3),
            "w3": normal(16, 16, 1, 1), "fc": normal(16, 10)}
  batch = {"x": normal(BATCH, 3, 12, 12),
           "y": jnp.asarray(rng.integers(0, 10, size=BATCH), jnp.int32)}

  def conv(x, w, stride=1, groups=1):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                    feature_group_count=groups)

  def loss_fn(params, batch):
    h = jax.nn.relu(conv(batch["x"], params["w1"]))
    h = jax.nn.relu(conv(h, params["dw"], groups=8))
    h = jax.nn.relu(conv(h, params["w2"], stride=2))
    h = conv(h, params["w3"]) + h
    logits = h.mean(axis=(2, 3)) @ params["fc"]
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["y"], 10)).mean()

  def step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  return step, params, batch


OFF = {"mixed_precision": {"enable": False}, "layout": {"enable": False},
       "kernel": {"enable": False}, "dataloader": {"enable": False}}
CPU_KERNELS = ("xla", "matmul_1x1", "im2col", "window_matmul", "fft", "depthwise")
CONFIGS = {
    "mixed_precision": ({"mixed_precision": {"enable": True}}, 2e-2),
    "layout": ({"layout": {"enable": True}}, 1e-5),
    **{f"kernel={k}": ({"kernel": {"enable": True, "hints": {"conv": k}}}, 1e-4)
       for k in CPU_KERNELS},
    "all": ({"mixed_precision": {"enable": True}, "layout": {"enable": True},
             "kernel": {"enable": True}}, 2e-2),
}


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))  # each bucket is tuned once for the module


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_tj_jit_on_explicit_axes_as_jax_jit(name, mesh8_explicit, shared_cache):
  step, params, batch = _cnn_problem()
  params = jax.device_put(params, NamedSharding(mesh8_explicit, P()))
  batch = jax.device_put(batch, NamedSharding(mesh8_explicit, P("data")))
  want = jax.jit(step)(params, batch)
  sections, rtol = CONFIGS[name]
  with tj.config_context({**OFF, "cache": {"dir": shared_cache}, **sections}), \
      warnings.catch_warnings():
    warnings.simplefilter("ignore", HintWarning)  # a hinted kernel does not take every conv
    f = tj.jit(step)
    got = f(params, batch)
  _assert_same(want, got, rtol=rtol)
  kernels = f.report(memory=False).last.kernels
  assert not [k for k in kernels if "failed" in k], kernels  # no kernel fell back to xla
  hint = sections.get("kernel", {}).get("hints", {}).get("conv")
  if hint is not None:
    specs = [ConvSpec.from_equation(e) for e in jax.make_jaxpr(step)(params, batch).eqns
             if e.primitive.name == "conv_general_dilated"]
    if any(reg.get_kernel("conv", hint).applicable(s, "cpu") for s in specs):
      assert kernels.get(f"conv {hint} (hint)"), kernels
