"""The program audit (benchmarks/program_audit.py): what tunedjax hands XLA:GPU,
by export on CPU, against the expert's program.

For CUDA under mixed precision: every convolution takes and returns bfloat16,
no more than 1.1x the converts of the Flax ``dtype=bfloat16`` program, no more
transposes than `jax.jit`'s program, and causal bfloat16 attention a cuDNN
custom call where the GPU rule chooses it. Small models: this is the program,
not its speed."""

from __future__ import annotations

import functools
import sys
import tempfile

import pytest

from tests.processes import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import program_audit as audit  # noqa: E402  pylint: disable=wrong-import-position

SIZES = audit.Sizes(resnet={"stages": (1, 1), "width": 8, "batch": 2, "image": 16},
                    lm={"vocab": 64, "tokens": 16, "width": 32, "heads": 2, "layers": 1,
                        "batch": 2})


@functools.cache
def _rows(model, variants):
  rows = audit.audit(SIZES, platforms=("cuda",), variants=variants, models=(model,),
                     cache_dir=tempfile.mkdtemp(prefix="tj-audit-test-"))
  return {r.program: r for r in rows}


RESNETS = ["ResNet (Flax example)", "ResNet written NCHW"]


@pytest.mark.parametrize("model", RESNETS)
def test_mixed_precision_convolutions_are_bf16_to_bf16(model):
  rows = _rows(model, ("tj mixed precision",))
  convs = rows["tj mixed precision"].counts.convolutions
  assert set(convs) == {"bf16 x bf16 -> bf16"}, convs
  assert convs["bf16 x bf16 -> bf16"] == sum(rows[audit.JIT_F32].counts.convolutions.values())


def test_no_more_converts_than_the_flax_bf16_program():
  rows = _rows("ResNet (Flax example)", ("tj mixed precision",))
  flax = rows[audit.JIT_BF16].counts.converts
  assert rows["tj mixed precision"].counts.converts <= 1.1 * flax, (
      rows["tj mixed precision"].counts, flax)


@pytest.mark.parametrize("model", RESNETS)
def test_no_more_transposes_than_jax_jit(model):
  rows = _rows(model, ("tj mixed precision",))
  plain = rows[audit.JIT_F32].counts.transposes
  assert rows["tj mixed precision"].counts.transposes <= plain


@pytest.mark.parametrize("model", ["miniGPT, nnx.MultiHeadAttention",
                                   "miniGPT, hand-written attention"])
def test_attention_is_cudnn_where_the_gpu_rule_chooses_it(model):
  """Mixed precision makes it bfloat16 and causal: the GPU rule puts cuDNN first;
  the hand-written one is found by the pattern (forward and backward replaced)."""
  row = _rows(model, ("tj all on",))["tj all on"]
  assert row.counts.custom_calls.get("__cudnn$fmhaSoftmax") == 1, row.counts.custom_calls
  assert row.counts.custom_calls.get("__cudnn$fmhaSoftmaxBackward") == 1
  assert any(k.startswith("attention cudnn (by the platform's rule") for k in row.kernels), \
      row.kernels


def test_count_ops_reads_dtypes_and_targets():
  text = "\n".join([
      "%0 = stablehlo.convolution(%a, %b) dim_numbers = [b, 0, 1, f] : "
      "(tensor<2x8x8x3xbf16>, tensor<3x3x3x4xbf16>) -> tensor<2x8x8x4xf32>",
      "%1 = stablehlo.convert %0 : (tensor<2x8x8x4xf32>) -> tensor<2x8x8x4xbf16>",
      "%2 = stablehlo.transpose %1, dims = [0, 3, 1, 2] : (tensor<2x8x8x4xbf16>) -> "
      "tensor<2x4x8x8xbf16>",
      '%3:2 = stablehlo.custom_call @__cudnn$fmhaSoftmax(%x) : (tensor<1xbf16>) -> tensor<1xbf16>'])
  c = audit.count_ops(text)
  assert c.convolutions == {"bf16 x bf16 -> f32": 1}
  assert (c.converts, c.transposes, c.ops) == (1, 1, 4)
  assert c.custom_calls == {"__cudnn$fmhaSoftmax": 1}
