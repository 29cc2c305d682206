"""Cross-lowering: what tunedjax builds for a GPU or a TPU lowers there.

On a CPU machine, `jax.export` lowers a program for CUDA (a `pallas_call`
through Triton included) or for TPU. These tests export, for
``platforms=["cuda"]`` and ``["tpu"]``:

- every conv kernel the registry marks applicable on "gpu" / "tpu", forward
  and gradient, on the convolutions of a small network's train step (every
  kind the kernels handle: 1x1, strided, dilated, depthwise, large windows,
  1-D, and the backward convolutions), in float32, bfloat16 and float16;
- the output of every pass rewritten for that platform by
  ``tj.jit(..., platform=...)``: autocast with bfloat16 and float16 policies,
  the layout pass with the platform's preferences, kernel selection with a
  hint for each kernel;
- the Trainer's train step.

Exporting proves lowering, not compiling or speed.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import tunedjax as tj
from tunedjax import layout
from tunedjax.autotune import _registry as reg
from tunedjax.ops.conv._spec import ConvSpec
from tunedjax.ops.conv import _pallas as _conv_pallas
from tunedjax.autotune._hints import HintWarning
from tunedjax.rewrite import _compat
from tunedjax.trainer import Trainer

# tunedjax platform -> jax.export platform
TARGETS = {"gpu": "cuda", "tpu": "tpu"}
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
TRITON = "__gpu$xla.gpu.triton"
NHWC = ("NHWC", "HWIO", "NHWC")


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _export(fn, platform, *args):
  """Exports `jax.jit(fn)` for `platform` (a jax.export name)."""
  checks = _compat.tunedjax_custom_call_checks([platform])
  with _compat.lowering_for([platform]):
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)


# --- the convolutions: every kind the kernels handle, forward and backward ------------


def _net(x, ws):
  """2-D convolutions of every kind the conv kernels handle."""
  y = lax.conv_general_dilated(x, ws[0], (2, 2), "SAME", dimension_numbers=NHWC)  # 7x7 /2
  y = lax.conv_general_dilated(y, ws[1], (1, 1), "SAME", dimension_numbers=NHWC,
                               rhs_dilation=(2, 2))                                # dilated
  y = lax.conv_general_dilated(y, ws[2], (1, 1), "SAME", dimension_numbers=NHWC,
                               feature_group_count=ws[2].shape[-1])                # depthwise
  y = lax.conv_general_dilated(y, ws[3], (1, 1), "SAME", dimension_numbers=NHWC)  # 5x5 (fft)
  y = lax.conv_general_dilated(y, ws[4], (1, 1), "VALID", dimension_numbers=NHWC)  # 1x1
  z = lax.conv_general_dilated(y, ws[5], (1, 1), "VALID", dimension_numbers=NHWC)  # 9x9 window
  return y.astype(jnp.float32).mean() + z.astype(jnp.float32).mean()


def _net_args(dtype):
  c = 8
  shapes = [(7, 7, 3, c), (3, 3, c, c), (3, 3, 1, c), (5, 5, c, c), (1, 1, c, c), (9, 9, c, 4)]
  return _sds((2, 18, 18, 3), dtype), [_sds(s, dtype) for s in shapes]


def _conv1d(x, w):
  return lax.conv_general_dilated(x, w, (1,), "SAME").astype(jnp.float32).mean()


@functools.lru_cache(maxsize=None)
def conv_specs() -> tuple[ConvSpec, ...]:
  """The ConvSpecs of `_net`'s and a 1-D conv's train step, in every dtype."""
  specs: dict[ConvSpec, None] = {}
  for dtype in DTYPES:
    programs = [(_net, _net_args(dtype)),
                (_conv1d, (_sds((2, 4, 20), dtype), _sds((8, 4, 5), dtype)))]
    for fn, args in programs:
      closed = jax.make_jaxpr(jax.value_and_grad(fn, argnums=(0, 1)))(*args)
      for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
          specs[ConvSpec.from_equation(eqn)] = None
  return tuple(specs)


def lowering_failures(platform: str, specs=None) -> tuple[list[str], set[str]]:
  """Exports every kernel applicable on `platform` for each spec, value and gradient.

  Returns:
    ``(failures, kernel names exported)``; a failure names the kernel, the
    spec and the error.
  """
  failures, seen = [], set()
  for spec in conv_specs() if specs is None else specs:
    args = (_sds(spec.lhs_shape, spec.lhs_dtype), _sds(spec.rhs_shape, spec.rhs_dtype))
    for kernel in reg.applicable_kernels(spec, platform):
      if kernel.name == "xla" and ("xla", spec.lhs_dtype) in seen:
        continue  # the equation as written: once per dtype (every program below has more)
      seen.add(("xla", spec.lhs_dtype))
      fwd = functools.partial(lambda l, r, fn, s: fn(l, r, s), fn=kernel.fn, s=spec)
      # One export for both: the output (forward) and the gradient.
      both = jax.value_and_grad(lambda l, r, f=fwd: (f(l, r).astype(jnp.float32) ** 2).sum(),
                                argnums=(0, 1))
      try:
        module = _export(both, TARGETS[platform], *args).mlir_module()
        if kernel.name == "pallas" and TRITON not in module:
          raise AssertionError("no Triton call: the kernel was lowered in interpret mode")
      except Exception as e:  # pylint: disable=broad-except  # the test reports them all
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        failures.append(f"{kernel.name} for {TARGETS[platform]} on lhs "
                        f"{spec.lhs_dtype}{list(spec.lhs_shape)} rhs {list(spec.rhs_shape)} "
                        f"strides {spec.window_strides}: {type(e).__name__}: {first}")
      seen.add(kernel.name)
  return failures, {n for n in seen if isinstance(n, str)}


@pytest.mark.slow
@pytest.mark.parametrize("platform", sorted(TARGETS))
def test_every_kernel_marked_applicable_lowers(platform):
  failures, seen = lowering_failures(platform)
  assert not failures, "\n".join(failures)
  # The specs reach every kernel that claims the platform for any of them.
  claims = {k.name for k in reg.kernels("conv")
            if any(k.applicable(s, platform) for s in conv_specs())}
  assert seen == claims
  expected = {"xla", "matmul_1x1", "im2col", "window_matmul", "fft", "depthwise"}
  assert expected <= seen
  assert ("pallas" in seen) == (platform == "gpu")


def _unlowerable_on_gpu(lhs, rhs, spec):
  """A kernel whose `pallas_call` asks for the TPU compiler: no GPU lowering."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel

  def add(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  out = reg.get_kernel("conv", "xla").fn(lhs, rhs, spec)
  return pl.pallas_call(add, out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
                        compiler_params=pltpu.CompilerParams())(out)


def test_a_kernel_marked_applicable_that_cannot_lower_fails_the_check():
  spec = conv_specs()[0]
  reg.register_kernel("conv", "tpu_only_pallas", _unlowerable_on_gpu,
                      applicable=lambda s, p: p == "gpu", replace=True)
  try:
    failures, seen = lowering_failures("gpu", [spec])
  finally:
    reg.unregister_kernel("conv", "tpu_only_pallas")
  assert "tpu_only_pallas" in seen
  assert len(failures) == 1 and failures[0].startswith("tpu_only_pallas for cuda")


# --- the Pallas kernel: Triton for a GPU, interpret mode elsewhere --------------------


def _pallas_spec(dtype=jnp.float32):
  return ConvSpec.from_arrays(_sds((2, 9, 9, 8), dtype), _sds((3, 3, 8, 16), dtype),
                                  window_strides=(2, 2), padding="SAME",
                                  dimension_numbers=NHWC)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_pallas_conv_lowers_to_triton_for_cuda(dtype):
  spec = _pallas_spec(dtype)
  args = (_sds(spec.lhs_shape, dtype), _sds(spec.rhs_shape, dtype))
  fn = lambda l, r: _conv_pallas.conv_pallas(l, r, spec)  # noqa: E731
  assert TRITON in _export(fn, "cuda", *args).mlir_module()
  assert TRITON not in _export(fn, "cpu", *args).mlir_module()  # interpret mode


def test_pallas_conv_by_default_runs_in_interpret_mode_on_cpu(rng):
  spec = _pallas_spec()
  x = jnp.asarray(rng.normal(size=spec.lhs_shape), jnp.float32)
  w = jnp.asarray(rng.normal(size=spec.rhs_shape), jnp.float32)
  ref = lambda l, r: lax.conv_general_dilated_p.bind(l, r, **spec.params())  # noqa: E731
  loss = lambda conv: lambda l, r: (conv(l, r) ** 2).sum()  # noqa: E731
  mine = lambda l, r: _conv_pallas.conv_pallas(l, r, spec)  # noqa: E731
  want, got = ref(x, w), jax.jit(mine)(x, w)
  assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5
  want_g = jax.grad(loss(ref), argnums=(0, 1))(x, w)
  got_g = jax.jit(jax.grad(loss(mine), argnums=(0, 1)))(x, w)
  for g, h in zip(got_g, want_g):
    assert float(jnp.linalg.norm(g - h) / jnp.linalg.norm(h)) < 1e-5


# --- each pass, rewritten for the target platform by tj.jit(platform=...) -------------


def _cnn_step():
  """An SGD step of a small NCHW CNN (a PyTorch port), and its abstract arguments."""

  def conv(x, w, stride=1):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME")

  def loss_fn(params, batch):
    h = jax.nn.relu(conv(batch["x"], params["w1"]))
    h = jax.nn.relu(conv(h, params["w2"], stride=2))
    h = conv(h, params["w3"]) + h
    logits = h.mean(axis=(2, 3)) @ params["fc"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  def step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  params = {"w1": _sds((8, 3, 3, 3), jnp.float32), "w2": _sds((16, 8, 3, 3), jnp.float32),
            "w3": _sds((16, 16, 1, 1), jnp.float32), "fc": _sds((16, 10), jnp.float32)}
  batch = {"x": _sds((4, 3, 12, 12), jnp.float32), "y": _sds((4,), jnp.int32)}
  return step, params, batch


OFF = {"mixed_precision": {"enable": False}, "layout": {"enable": False},
       "kernel": {"enable": False}, "dataloader": {"enable": False}}


def _config(tmp_path, **sections):
  return {**OFF, "cache": {"dir": str(tmp_path / "cache")}, **sections}


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_autocast_for_the_platform_exports(platform, policy, tmp_path):
  step, params, batch = _cnn_step()
  half = tj.mixed_precision.get_policy(policy).compute_dtype
  config = _config(tmp_path, mixed_precision={"enable": True, "policy": policy})
  with tj.config_context(config):
    f = tj.jit(step, platform=platform)
    exported = f.export(params, batch)
  assert exported.platforms == (TARGETS[platform],)
  report = f.report(memory=False).last
  assert report.passes[0] == "mixed_precision" and report.casts
  short = {"bfloat16": "bf16", "float16": "f16"}[jnp.dtype(half).name]
  assert f"x{short}>" in exported.mlir_module()  # the convolutions run in half precision


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["float32", "float16"])
def test_layout_pass_for_the_platform_exports(platform, dtype, tmp_path):
  step, params, batch = _cnn_step()
  cast = lambda t: jax.tree.map(  # noqa: E731
      lambda s: _sds(s.shape, dtype) if s.dtype == jnp.float32 else s, t)
  params, batch = cast(params), cast(batch)
  with tj.config_context(_config(tmp_path, layout={"enable": True})):
    f = tj.jit(step, platform=platform)
    exported = f.export(params, batch)
  assert exported.platforms == (TARGETS[platform],)
  rep = f.report(memory=False).last.layout
  if platform == "gpu":  # XLA:GPU assigns layouts; unmeasured, the user's NCHW stays
    assert rep.target == "NCHW" and rep.decision == "unchanged", rep
    assert "XLA:GPU assigns" in rep.reason
    return
  want = layout.preferred(dtype, platform)
  assert rep.target == want and platform in rep.reason
  # The model is NCHW: relaid exactly where the platform prefers NHWC.
  assert rep.decision == ("relaid" if want == "NHWC" else "unchanged")


def test_layout_preferences_differ_by_target_platform(tmp_path):
  """The same float32 NCHW step is relaid for TPU and for CPU, not for GPU."""
  step, params, batch = _cnn_step()
  decisions = {}
  with tj.config_context(_config(tmp_path, layout={"enable": True})):
    for platform in ("cpu", "gpu", "tpu"):
      f = tj.jit(step, platform=platform)
      f.export(params, batch)
      decisions[platform] = f.report(memory=False).last.layout.decision
  assert decisions == {"cpu": "relaid", "gpu": "unchanged", "tpu": "relaid"}


@pytest.mark.slow
@pytest.mark.parametrize("platform", sorted(TARGETS))
def test_kernel_selection_with_each_hint_exports(platform, tmp_path):
  step, params, batch = _cnn_step()
  cache = tmp_path / "cache"
  specs = [ConvSpec.from_equation(e)
           for e in jax.make_jaxpr(step)(params, batch).jaxpr.eqns
           if e.primitive.name == "conv_general_dilated"]
  for kernel in reg.kernels("conv"):
    config = _config(tmp_path, kernel={"enable": True, "hints": {"conv": kernel.name}})
    with tj.config_context(config), warnings.catch_warnings():
      warnings.simplefilter("ignore", HintWarning)  # where the hinted kernel does not apply
      f = tj.jit(step, platform=platform)
      exported = f.export(params, batch)
    kernels = f.report(memory=False).last.kernels
    used = sum(n for k, n in kernels.items() if k == f"conv {kernel.name} (hint)")
    applies = sum(kernel.applicable(s, platform) for s in specs)
    assert used == applies, (kernel.name, kernels)
    # Elsewhere: xla, never tuned (no device of the platform here to time on).
    assert all(k.endswith("(hint)") or k == f"conv xla (no {platform} here)"
               for k in kernels), kernels
    if kernel.name == "pallas" and platform == "gpu":
      assert used and TRITON in exported.mlir_module()
  assert not list(cache.glob("**/*.json"))  # nothing was tuned or stored


def test_kernel_selection_for_another_platform_does_not_tune(tmp_path):
  step, params, batch = _cnn_step()
  with tj.config_context(_config(tmp_path, kernel={"enable": True})):
    f = tj.jit(step, platform="gpu")
    f.export(params, batch)
  report = f.report(memory=False).last
  assert set(report.kernels) == {"conv xla (no gpu here)"}
  assert report.tuning_s == 0 and report.cache_misses == 0
  assert not list((tmp_path / "cache").glob("**/*.json"))


def test_export_defaults_to_the_jit_platform():
  f = tj.jit(lambda x: jnp.tanh(x) * 2, platform="gpu")
  assert f.export(_sds((3,), jnp.float32)).platforms == ("cuda",)
  assert f.export(_sds((3,), jnp.float32), platforms=["tpu"]).platforms == ("tpu",)
  g = tj.jit(lambda x: jnp.tanh(x) * 2)
  assert g.export(_sds((3,), jnp.float32)).platforms == (jax.default_backend(),)


# --- the Trainer's compiled train step -------------------------------------------------


class _NnxCNN(nnx.Module):

  def __init__(self, *, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 16, (3, 3), strides=(2, 2), rngs=rngs)
    self.head = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.norm(self.conv1(x)))
    return self.head(nnx.relu(self.conv2(h)).mean(axis=(1, 2)))


def _cnn_loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.mark.slow
@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_trainer_train_step_exports(platform, precision, tmp_path):
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(8, 12, 12, 3)).astype(np.float32),
           "y": rng.integers(0, 10, size=8).astype(np.int32)}
  autotune = {"cache": {"dir": str(tmp_path / "cache")}, "layout": {"enable": True},
              "kernel": {"enable": True}, "dataloader": {"enable": False}}
  trainer = Trainer(_NnxCNN(), optax.sgd(0.1), _cnn_loss, precision=precision,
                    autotune=autotune, progress=False)
  hints = {"gpu": {"conv": "pallas"}, "tpu": {}}[platform]
  with (tj.config_context(trainer.config), tj.autotune.hint(**hints),
        warnings.catch_warnings()):
    warnings.simplefilter("ignore", HintWarning)  # Pallas does not take every conv
    # The Trainer's own step function, compiled for the target platform.
    step = tj.jit(trainer._programs.train_step.__wrapped__, platform=platform, donate_argnums=0)
    exported = step.export(trainer.state, batch)
  assert exported.platforms == (TARGETS[platform],)
  report = step.report(memory=False).last
  assert report.passes == ("mixed_precision", "layout", "kernel_selection", "cleanup")
  assert report.policy == str(tj.mixed_precision.get_policy(precision))
  half = tj.mixed_precision.get_policy(precision).compute_dtype  # what the convs run in
  assert report.layout.target == layout.preferred(half, platform)  # NHWC, the model's own
  assert ("XLA:GPU assigns" if platform == "gpu" else platform) in report.layout.reason
  if platform == "gpu":
    assert any(k.startswith("conv pallas (hint)") for k in report.kernels), report.kernels
    assert TRITON in exported.mlir_module()


# --- the attention family's GPU and TPU kernels -----------------------------------------


def attention_specs():
  """Attention buckets the accelerator kernels claim: every dtype, causal or not, GQA."""
  from tunedjax.ops.attention._spec import AttentionSpec  # pylint: disable=import-outside-toplevel
  return tuple(AttentionSpec(1, 256, 256, heads, kv_heads, h, jnp.dtype(dtype).name,
                             causal=causal, scale=0.125)
               for dtype in DTYPES for causal in (False, True)
               for heads, kv_heads, h in ((4, 4, 64), (4, 2, 128)))


def attention_lowering_failures(platform: str) -> tuple[list[str], set[str], set[str]]:
  """Exports every attention kernel but the CPU ones applicable on `platform`, value and
  gradient. Returns ``(failures, kernel names exported, kernels skipped for want of
  cuDNN)``: cuDNN's attention asks the local cuDNN for its version while it is traced,
  so it lowers only on a machine with one."""
  failures, seen, no_cudnn = [], set(), set()
  for spec in attention_specs():
    args = (_sds(spec.q_shape, spec.dtype), _sds(spec.kv_shape, spec.dtype),
            _sds(spec.kv_shape, spec.dtype))
    for kernel in reg.applicable_kernels(spec, platform, op="attention"):
      if kernel.applicable(spec, "cpu"):
        continue  # plain JAX: lowered with every program
      fwd = functools.partial(lambda q, k, v, fn, s: fn(q, k, v, s), fn=kernel.fn, s=spec)
      both = jax.value_and_grad(
          lambda q, k, v, f=fwd: (f(q, k, v).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2))
      try:
        module = _export(both, TARGETS[platform], *args).mlir_module()
        if kernel.name == "pallas_gpu" and TRITON not in module:
          raise AssertionError("no Triton call: the kernel was lowered in interpret mode")
      except Exception as e:  # pylint: disable=broad-except  # the test reports them all
        if kernel.name == "cudnn" and "cuDNN is not detected" in str(e):
          no_cudnn.add(kernel.name)
          continue
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        failures.append(f"{kernel.name} for {TARGETS[platform]} on {spec}: "
                        f"{type(e).__name__}: {first}")
      seen.add(kernel.name)
  return failures, seen, no_cudnn


@pytest.mark.slow
@pytest.mark.parametrize("platform", sorted(TARGETS))
def test_every_attention_kernel_marked_applicable_lowers(platform):
  failures, seen, no_cudnn = attention_lowering_failures(platform)
  assert not failures, "\n".join(failures)
  claims = {k.name for k in reg.kernels("attention")
            if any(k.applicable(s, platform) and not k.applicable(s, "cpu")
                   for s in attention_specs())}
  assert seen | no_cudnn == claims
  pallas_gpu = {"pallas_gpu"} if _compat.pallas_gpu_attention() is not None else set()
  assert claims == ({"cudnn", *pallas_gpu} if platform == "gpu" else {"pallas_tpu"})
  if jax.default_backend() == "gpu":
    assert not no_cudnn  # with a GPU (and cuDNN), cudnn must lower too
