"""On a GPU where nothing is measured, kernel selection changes nothing XLA
already does: batch norm and convolutions stay XLA's (the user's own Flax code
for a routed layer), and no candidate program is compiled. Runs on CPU: the
"GPU" is the CPU device with a GPU's fingerprint (as in test_platform_costs),
and the program is exported for CUDA."""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import tunedjax as tj
from tunedjax import _tuning
from tunedjax._tuning import _cache
from tunedjax.autotune import _select, _tuner
from tunedjax.ops.batch_norm import _family as bn_family


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9)(x))
    return nn.Dense(5)(x.mean(axis=(1, 2)))


def _step():
  model = _Net()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8, 8, 3)), jnp.float32)
  y = jnp.arange(4) % 5
  variables = model.init(jax.random.key(0), x)

  def step(variables, x, y):
    def loss(params):
      logits, updates = model.apply({**variables, "params": params}, x, mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates
    (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
    params = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads)
    return {"params": params, **updates}, value

  return step, variables, x, y


def _ops(text):
  return collections.Counter(m.group(1) for m in re.finditer(
      r"stablehlo\.(reduce|convolution|convert|transpose|custom_call)\b", text))


@pytest.fixture
def fake_gpu(monkeypatch):
  real = _tuning.device_fingerprint

  def fingerprint(backend=None):
    if backend is not None and _tuning.canonical_platform(backend) == "gpu":
      return dataclasses.replace(real("cpu"), platform="gpu", device_kind="NVIDIA H100",
                                 compute_capability="9.0")
    return real(backend)

  monkeypatch.setattr(_cache, "device_fingerprint", fingerprint)
  monkeypatch.setattr(_tuning, "device_fingerprint", fingerprint)
  monkeypatch.setattr(_select, "_measurable", lambda platform: True)
  compiled = []
  real_compile = _tuner._compile_all
  monkeypatch.setattr(_tuner, "_compile_all", lambda fns, *a, **k: (
      compiled.append(sorted(fns)), real_compile(fns, *a, **k))[1])
  return compiled


def _export(tmp_path):
  step, variables, x, y = _step()
  config = {"kernel": {"enable": True}, "cache": {"dir": str(tmp_path)},
            "layout": {"enable": False}, "mixed_precision": {"enable": False}}
  with tj.config_context(config):
    f = tj.jit(step, platform="gpu")
    text = f.export(variables, x, y).mlir_module()
  plain = jax.export.export(jax.jit(step), platforms=["cuda"])(variables, x, y).mlir_module()
  return f.report(memory=False).last.kernels, _ops(text), _ops(plain)


def test_an_unmeasured_gpu_keeps_xlas_program_and_compiles_nothing(fake_gpu, tmp_path):
  kernels, ops, plain = _export(tmp_path)
  assert kernels.get("batch_norm xla (xla first, as written)") == 1, kernels
  assert ops == plain  # the user's own batch norm, XLA's convolutions
  assert fake_gpu == []  # no candidate program compiled


def test_an_export_with_no_gpu_here_keeps_the_users_batch_norm(tmp_path):
  kernels, ops, plain = _export(tmp_path)
  assert kernels.get("batch_norm xla (no gpu here, as written)") == 1, kernels
  assert ops == plain


def test_a_gpu_measurement_that_says_fused_wins_routes_again(fake_gpu, tmp_path, monkeypatch):
  monkeypatch.setattr(_select, "_xla_first", lambda *a: False)
  spec = bn_family.BatchNormSpec((4, 8, 8, 8), "float32", 1e-5)
  selection = _select.new_selection(platform="gpu", cache=tmp_path)
  with _select.selecting(selection):
    assert not _select.leaves_as_written("batch_norm", spec)


def test_the_gpu_rule_presumes_fused_batch_norm_slower():
  assert bn_family.bn_presumed({"candidates": {"xla": "", "fused": ""}}, "gpu") == {"fused": 1.5}
  assert bn_family.bn_presumed({"candidates": {"xla": "", "fused": ""}}, "cpu") == {}
