"""Every kernel of every family, pinned, on ill-conditioned inputs, against float64.

The tuner's accuracy rule (`autotune._accuracy`) holds for each kernel by
itself: its output and its gradients for a random cotangent, against the
same call in float64, are at most `ERROR_RATIO_LIMIT` times as far off as
the default kernel's. The inputs are the hard cases: large means that
cancel (a convolution's zero-sum filters over offset inputs, batch-norm
channels with means of 1e3-1e4 or nearly constant), long reductions (a
3x3x512 window, a million batch-norm rows) and large attention logits.
Kernels that run only on an accelerator are checked where one is present
(the device scripts); `test_every_cpu_kernel_is_covered` keeps new kernels
from slipping past.
"""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from tunedjax import _native, autotune
from tunedjax.autotune import _accuracy, _registry, _tuner
from tunedjax.ops.attention import _family as _attn_family
from tunedjax.ops.attention._spec import AttentionSpec
from tunedjax.ops.batch_norm._spec import BatchNormSpec
from tunedjax.rewrite import iter_equations

LIMIT = _accuracy.ERROR_RATIO_LIMIT
# Kernels no CPU case can reach: they are lowered for their platform in
# tests/test_cross_lowering.py and run by the device scripts.
ACCELERATOR_ONLY = {("conv", "pallas"), ("attention", "cudnn"), ("attention", "pallas_gpu"),
                    ("attention", "pallas_tpu")}
DN = ("NHWC", "HWIO", "NHWC")


def error_ratios(op: str, spec, operands, rng) -> dict[str, float]:
  """Each applicable kernel's error ratio, forward and backward, against float64."""
  family = autotune.op_family(op)
  kernels = {k.name: k for k in _registry.applicable_kernels(spec, "cpu", op=op)}
  operands = [jnp.asarray(o) for o in operands]
  default = kernels[family.default]
  out = jax.eval_shape(lambda *o: default.fn(*o, spec), *operands)
  cotangent = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), out)
  args = [cotangent, *operands]
  outputs = {n: jax.jit(_tuner._timed_function(k, spec, "forward+backward"))(*args)
             for n, k in kernels.items()}
  precise = default if family.precise is None else types.SimpleNamespace(fn=family.precise)
  ref = _accuracy.reference(_tuner._timed_function(precise, spec, "forward+backward"), args,
                            outputs[family.default], platform="cpu")
  assert ref is not None and ref.dtype == "float64"
  return {n: ref.ratio(o) for n, o in outputs.items()}


def assert_accurate(ratios: dict[str, float], what: str) -> None:
  worse = {n: round(r, 2) for n, r in ratios.items() if not r <= LIMIT}
  assert not worse, f"{what}: error ratio over {LIMIT:g}x the default's: {worse}"


# -- convolutions -------------------------------------------------------------------------


CONV_CASES = {  # (lhs shape, rhs shape, stride, groups): forward, input and weight gradients
    "3x3": ((4, 10, 10, 64), (3, 3, 64, 48), 1, 1),
    "3x3x512 (long)": ((4, 8, 8, 512), (3, 3, 512, 64), 1, 1),
    "7x7": ((2, 12, 12, 16), (7, 7, 16, 16), 1, 1),
    "1x1": ((4, 8, 8, 256), (1, 1, 256, 128), 1, 1),
    "depthwise": ((4, 12, 12, 64), (3, 3, 1, 64), 1, 64),
}
# Cases whose hard part is the length of the sums: centred inputs, where rounding
# alone decides (offsets would add an error every kernel shares).
LONG = ("3x3x512 (long)",)


def conv_specs(case: str) -> list:
  """The forward convolution of `case` and the two of its gradient, as the tuner sees them."""
  lhs, rhs, stride, groups = CONV_CASES[case]
  conv = lambda x, w: lax.conv_general_dilated(  # pylint: disable=unnecessary-lambda-assignment
      x, w, (stride, stride), "SAME", dimension_numbers=DN, feature_group_count=groups)
  closed = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(conv(x, w) ** 2), argnums=(0, 1)))(
      jnp.ones(lhs, jnp.float32), jnp.ones(rhs, jnp.float32))
  family = autotune.op_family("conv")
  return [family.from_equation(e) for e in iter_equations(closed)
          if e.primitive.name == family.primitive]


def conv_operands(spec, rng, cancel: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """Offset inputs (mean 30) and filters whose taps sum to zero per output: the
  offset cancels, so the products are large and their sum small (`cancel`); else
  centred normal inputs."""
  lhs = rng.normal(size=spec.lhs_shape) + (30.0 if cancel else 0.0)
  rhs = rng.normal(size=spec.rhs_shape)
  if cancel:
    rhs -= rhs.mean(axis=tuple(range(rhs.ndim - 1)), keepdims=True)
  return lhs.astype(np.float32), rhs.astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_kernels_are_as_accurate_as_xla(case):
  rng = np.random.default_rng(0)
  for spec in conv_specs(case):
    operands = conv_operands(spec, rng, cancel=case not in LONG)
    assert_accurate(error_ratios("conv", spec, operands, rng),
                    f"{case}: {spec.lhs_shape} * {spec.rhs_shape}")


# -- batch norm ---------------------------------------------------------------------------


def bn_input(kind: str, shape: tuple[int, ...], rng) -> np.ndarray:
  c = shape[-1]
  if kind == "large means":
    return rng.normal(size=shape) * (0.1 + rng.random(c)) + 1e3 * (1 + 9 * rng.random(c))
  if kind == "near-constant":
    return 5.0 + 1e-3 * rng.normal(size=shape)
  return rng.normal(size=shape)


def bn_case(kind: str, shape: tuple[int, ...], seed: int):
  rng = np.random.default_rng(seed)
  x = bn_input(kind, shape, rng).astype(np.float32)
  c = shape[-1]
  operands = (x, (1 + rng.random(c)).astype(np.float32), rng.normal(size=c).astype(np.float32))
  return BatchNormSpec.from_arrays(x), operands, rng


@pytest.mark.slow
@settings(max_examples=6)
@given(kind=st.sampled_from(["large means", "near-constant", "centred"]),
       shape=st.tuples(st.integers(1, 16), st.integers(1, 9), st.integers(1, 9),
                       st.integers(1, 24)),
       seed=st.integers(0, 2**16))
def test_batch_norm_kernels_are_as_accurate_as_xla(kind, shape, seed):
  spec, operands, rng = bn_case(kind, shape, seed)
  assert_accurate(error_ratios("batch_norm", spec, operands, rng), f"{kind} {shape}")


@pytest.mark.slow
def test_batch_norm_kernels_over_a_million_rows():
  spec, operands, rng = bn_case("large means", (1 << 20, 2), 0)
  ratios = error_ratios("batch_norm", spec, operands, rng)
  assert "fused" in ratios
  assert_accurate(ratios, "2**20 rows")


# -- attention ----------------------------------------------------------------------------


ATTENTION_CASES = {  # AttentionSpec args and kwargs; logits scaled up by `qscale`
    "blocked": ((1, 64, 1024, 2, 2, 16), {}),
    "causal, grouped": ((1, 512, 512, 4, 2, 16), {"causal": True}),
    "query chunks, mask": ((1, 512, 256, 2, 2, 16), {"mask_shape": (1, 1, 512, 256)}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_kernels_are_as_accurate_as_xla(case):
  args, kwargs = ATTENTION_CASES[case]
  spec = AttentionSpec(*args, "float32", **kwargs)
  rng = np.random.default_rng(0)
  q, k, *rest = _attn_family.attention_operands(spec, rng)
  operands = (3.0 * q, 3.0 * k, *rest)  # logits of spread ~10: a peaked softmax
  assert_accurate(error_ratios("attention", spec, operands, rng), case)


# -- coverage -----------------------------------------------------------------------------


def _attention_specs():
  return [AttentionSpec(*a, "float32", **kw) for a, kw in ATTENTION_CASES.values()]


def _native_unbuilt(op: str, name: str) -> bool:
  kernel = autotune.get_kernel(op, name)
  sources = getattr(sys.modules[kernel.fn.__module__], "NATIVE_SOURCES", ())
  return bool(sources) and not all(_native.available(s) for s in sources)


def test_every_cpu_kernel_is_covered():
  specs = {"conv": [s for c in CONV_CASES for s in conv_specs(c)],
           "attention": _attention_specs(),
           "batch_norm": [BatchNormSpec((1 << 20, 2), "float32")]}
  covered = {(op, k.name) for op, ss in specs.items() for s in ss
             for k in _registry.applicable_kernels(s, "cpu", op=op)}
  everything = {(op, k.name) for op in specs for k in autotune.kernels(op)}
  missing = everything - covered - ACCELERATOR_ONLY
  # Native kernels apply only where the library builds (a C++ compiler).
  missing = {(op, n) for op, n in missing if not _native_unbuilt(op, n)}
  assert not missing, f"kernels no accuracy case reaches: {sorted(missing)}"
