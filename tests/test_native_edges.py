"""Every native FFI handler at its edges, on guarded buffers, against float64 references.

Each handler is called through ``tests/native_harness.py`` (the call frame
XLA:CPU builds, around canary-guarded outputs: nothing may be written outside
an output, nothing left unwritten inside) and compared element by element
with a NumPy float64 reference, within a few roundings of its sum's length.
The shapes sweep each handler's register tiles at every remainder, 1 to tile
size + 1 in each blocked dimension, as the .cc files block them:

* depthwise.cc, conv: 4 output columns x 32 float32 / 16 float64 channels;
  weight gradient: 64 / 32 channels, up to 16 image chunks.
* direct_conv.cc (16 float32 / 8 float64 lanes L), conv: 12 pixels x L,
  8 x 2L or 6 x 4L output channels by width; weight gradient: 4-24
  (tap column, input channel) pairs x L or 2L output channels, image chunks.
* pointwise.cc, matmul: 16 rows x L, 12 x 2L or 6 x 4L output channels,
  row blocks of 64, row chunks of 256; weight gradient: 12 input channels x
  L or 8 x 2L, row blocks of 128, up to 64 row chunks.
* batch_norm.cc: up to 64 row chunks of at least 32768 elements; channels
  not a multiple of any vector width.

Then strides, dilations and padding (negative too) in every combination the
forms allow, batch 1, the largest windows, float32 and float64; operands of
the demo network (its weights and activations) besides random normals; the
same edges through XLA (`jax.ffi.ffi_call`, where AddressSanitizer watches
XLA's own buffers in ``make test-native-sanitize``); errors that write
nothing; and bitwise-equal results whatever the thread count.
"""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np
import pytest

from tests import native_harness as nh
from tunedjax import _native

pytestmark = pytest.mark.skipif(
    not all(_native.available(s) for s in ("depthwise", "direct_conv", "pointwise", "batch_norm")),
    reason="native kernels unavailable (no C++ compiler?)")

DTYPES = (np.float32, np.float64)
IDS = ("float32", "float64")
SUFFIX = {np.float32: "F32", np.float64: "F64"}
LANES = {np.float32: 16, np.float64: 8}
"""64-byte vectors (direct_conv.cc, pointwise.cc)."""

# kind: (source, handler stem, reference, output shape, number of terms per sum)
KINDS = {
    "depthwise_conv": ("depthwise", "TjDepthwiseConv", nh.depthwise_conv,
                       lambda a, b, hw: (a[0], *hw, a[3]), lambda a, b: b[0] * b[1]),
    "depthwise_wgrad": ("depthwise", "TjDepthwiseWgrad", nh.depthwise_wgrad,
                        lambda a, b, hw: (*hw, a[3]), lambda a, b: b[0] * b[1] * b[2]),
    "direct_conv": ("direct_conv", "TjDirectConv", nh.direct_conv,
                    lambda a, b, hw: (a[0], *hw, b[3]), lambda a, b: b[0] * b[1] * b[2]),
    "direct_wgrad": ("direct_conv", "TjDirectWgrad", nh.direct_wgrad,
                     lambda a, b, hw: (*hw, a[3], b[3]), lambda a, b: b[0] * b[1] * b[2]),
}


def normal(rng, shape, dtype):
  return rng.standard_normal(shape).astype(dtype)


def conv_geometry(h, w, kh, kw, *, stride=(1, 1), pad=((0, 0), (0, 0)), lhs_dil=(1, 1),
                  rhs_dil=(1, 1)):
  """The attributes and the (out_h, out_w) of a conv of an (h, w) input with a (kh, kw) window."""
  geo = nh.geometry(stride, (pad[0][0], pad[1][0]), lhs_dil, rhs_dil)
  out_hw = tuple(nh.out_size(n, k, s, lo, hi, ld, rd) for n, k, s, (lo, hi), ld, rd
                 in zip((h, w), (kh, kw), stride, pad, lhs_dil, rhs_dil))
  return geo, out_hw


def check_conv(kind, a, b, geo, out_hw, *, threads=3, label=""):
  """Runs a conv handler on a, b (one dtype) and compares it with its reference."""
  source, stem, reference, out_shape, terms = KINDS[kind]
  symbol = stem + SUFFIX[a.dtype.type]
  name = f"{symbol}{label} x{a.shape} {b.shape} {geo}"
  got, = nh.call(source, symbol, [a, b], [out_shape(a.shape, b.shape, out_hw)], geo,
                 threads=threads)
  want, scale = reference(a, b, geo, out_hw)
  nh.assert_close(name, got, want, scale, terms(a.shape, b.shape))
  return got


def check_pointwise(kind, x, b, *, threads=3):
  r, i = x.shape
  matmul = kind == "matmul"
  symbol = ("TjPointwiseMatmul" if matmul else "TjPointwiseWgrad") + SUFFIX[x.dtype.type]
  shape = (r, b.shape[1]) if matmul else (i, b.shape[1])
  got, = nh.call("pointwise", symbol, [x, b], [shape], threads=threads)
  want, scale = (nh.pointwise_matmul if matmul else nh.pointwise_wgrad)(x, b)
  nh.assert_close(f"{symbol} x{x.shape} {b.shape}", got, want, scale, i if matmul else r)
  return got


def check_batch_norm(x, dy, *, threads=3):
  """Both batch-norm handlers on x, dy (R, C); the mean the second gets is the reference's."""
  s = SUFFIX[x.dtype.type]
  rows, c = x.shape
  terms = rows if x.dtype == np.float64 else 1  # sums in double, then rounded once
  got = nh.call("batch_norm", f"TjBatchNormStats{s}", [x], [(c,), (c,)], threads=threads)
  (mean, var), _ = nh.batch_norm_stats(x)
  x64 = x.astype(np.float64)
  var_scale = ((x64 - x64[0]) ** 2).mean(0) + var  # the shifted sums' magnitude
  nh.assert_close(f"stats mean {x.shape}", got[0], mean, np.abs(x64).mean(0), terms)
  nh.assert_close(f"stats var {x.shape}", got[1], var, var_scale, terms)
  m = mean.astype(x.dtype)
  got = nh.call("batch_norm", f"TjBatchNormGradSums{s}", [x, dy, m], [(c,), (c,)],
                threads=threads)
  want, scale = nh.batch_norm_grad_sums(x, dy, m)
  for g, w_, sc, what in zip(got, want, scale, ("sum(dy)", "sum(dy*(x-mean))")):
    nh.assert_close(f"grad sums {what} {x.shape}", g, w_, sc, terms)


# --------------------------------------------------------------- references --


@pytest.mark.parametrize("case", [
    ((2, 7, 6, 3), (3, 2), dict(stride=(2, 1), pad=((1, 2), (-1, 1)))),
    ((1, 5, 9, 2), (2, 4), dict(lhs_dil=(2, 3), rhs_dil=(2, 1), pad=((2, -1), (0, 3)))),
    ((3, 4, 4, 4), (4, 4), dict(stride=(3, 2), pad=((3, 3), (-2, 2)))),
])
def test_the_references_match_lax(case):
  """The NumPy references against `lax.conv_general_dilated` (depthwise and dense, float64)."""
  from jax import lax
  x_shape, (kh, kw), kw_args = case
  rng = np.random.default_rng(0)
  x = rng.standard_normal(x_shape)
  c = x_shape[3]
  dn = ("NHWC", "HWIO", "NHWC")
  geo, out_hw = conv_geometry(*x_shape[1:3], kh, kw, **kw_args)
  lax_args = dict(window_strides=kw_args.get("stride", (1, 1)), padding=kw_args["pad"],
                  lhs_dilation=kw_args.get("lhs_dil"), rhs_dilation=kw_args.get("rhs_dil"),
                  dimension_numbers=dn)
  wd = rng.standard_normal((kh, kw, c))
  wf = rng.standard_normal((kh, kw, c, 5))
  with jax.enable_x64():
    dw = lax.conv_general_dilated(x, wd[:, :, None, :], feature_group_count=c, **lax_args)
    dense = lax.conv_general_dilated(x, wf, **lax_args)
  np.testing.assert_allclose(nh.depthwise_conv(x, wd, geo, out_hw)[0], dw, rtol=1e-12,
                             atol=1e-12)
  np.testing.assert_allclose(nh.direct_conv(x, wf, geo, out_hw)[0], dense, rtol=1e-12,
                             atol=1e-12)


# ------------------------------------------------------------ tile remainders --


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_depthwise_conv_every_tile_remainder(dtype):
  """Segments of 1 to 5 columns (tiles of 4) x 1 to CB + 1 channels, unpadded and padded."""
  cb = 32 if dtype == np.float32 else 16
  rng = np.random.default_rng(1)
  for ow, c in itertools.product(range(1, 6), range(1, cb + 2)):
    n = 1 + (c % 2)
    for pad in (((0, 0), (0, 0)), ((1, 1), (1, 1))):
      w_in = ow + 2 - 2 * pad[1][0]
      if w_in < 1:
        continue
      geo, out_hw = conv_geometry(3, w_in, 3, 3, pad=pad)
      check_conv("depthwise_conv", normal(rng, (n, 3, w_in, c), dtype),
                 normal(rng, (3, 3, c), dtype), geo, out_hw, threads=c % 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_depthwise_wgrad_every_tile_remainder(dtype):
  """1 to CB + 1 channels (blocks of 64 / 32) with 1, 3 and 17 images (16 image chunks);
  channel parts (up to 16, uneven) where the images are few."""
  cb = 64 if dtype == np.float32 else 32
  rng = np.random.default_rng(2)
  shapes = itertools.product([*range(1, cb + 2), 5 * cb + 7, 16 * cb + 1], (1, 3, 17))
  for c, n in shapes:
    geo, out_hw = conv_geometry(5, 6, 5, 4, pad=((1, 1), (1, 0)))  # 3x4 taps
    check_conv("depthwise_wgrad", normal(rng, (n, 5, 6, c), dtype),
               normal(rng, (n, 5, 4, c), dtype), geo, out_hw, threads=n % 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_direct_conv_every_tile_remainder(dtype):
  """1 to 6L + 1 output channels (each tile shape's blocks) x 1 to P + 1 pixels of a row."""
  lanes = LANES[dtype]
  rng = np.random.default_rng(3)
  for co in range(1, 6 * lanes + 2):
    pixels = 12 if co <= lanes else 8 if co <= 2 * lanes else 6
    for ow in range(1, pixels + 2):
      n, ci = 1 + (ow % 2), 1 + (co % 3)
      geo, out_hw = conv_geometry(2, ow + 1, 2, 2)
      check_conv("direct_conv", normal(rng, (n, 2, ow + 1, ci), dtype),
                 normal(rng, (2, 2, ci, co), dtype), geo, out_hw, threads=co % 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_direct_wgrad_every_tile_remainder(dtype):
  """1 to 25 (tap column, input channel) pairs (tiles of 4-24) x 1 to 3L + 1 output channels."""
  lanes = LANES[dtype]
  rng = np.random.default_rng(4)
  shapes = [(b, 1) for b in range(1, 26)] + [(b, pw) for b in (1, 3) for pw in range(2, 8)]
  for (b, pw), f in itertools.product(shapes, range(1, 3 * lanes + 2)):
    if (b + pw + f) % 3:  # a third of the product: every b, pw and f still appears
      continue
    c = 1 + (f % 3)
    gw = 9
    geo, out_hw = conv_geometry(2, gw + pw - 1, 2, gw)
    check_conv("direct_wgrad", normal(rng, (c, 2, gw + pw - 1, b), dtype),
               normal(rng, (c, 2, gw, f), dtype), geo, out_hw, threads=f % 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_direct_wgrad_image_chunks(dtype):
  """1 to 17 images: up to 16 chunks of partial sums, added in order."""
  rng = np.random.default_rng(5)
  for c in range(1, 18):
    geo, out_hw = conv_geometry(9, 9, 8, 8, pad=((1, 1), (1, 1)))
    check_conv("direct_wgrad", normal(rng, (c, 9, 9, 3), dtype),
               normal(rng, (c, 8, 8, 5), dtype), geo, out_hw)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_pointwise_matmul_every_tile_remainder(dtype):
  """1 to 17 rows (tiles of 16/12/6) x 1 to 6L + 1 columns; row blocks and chunks; empty."""
  lanes = LANES[dtype]
  rng = np.random.default_rng(6)
  for r, o in itertools.product(range(1, 18), range(1, 6 * lanes + 2)):
    check_pointwise("matmul", normal(rng, (r, 3), dtype), normal(rng, (3, o), dtype),
                    threads=o % 3)
  widths = (1, lanes, lanes + 1, 2 * lanes + 1, 4 * lanes + 1, 6 * lanes)
  for r, o, i in itertools.product((63, 64, 65, 255, 256, 257, 600, 64 * 256 + 300), widths,
                                   (1, 5)):
    check_pointwise("matmul", normal(rng, (r, i), dtype), normal(rng, (i, o), dtype))
  for r, i, o in ((4, 0, 3), (0, 3, 4), (3, 2, 0)):  # empty: zeros, or nothing to write
    check_pointwise("matmul", normal(rng, (r, i), dtype), normal(rng, (i, o), dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_pointwise_wgrad_every_tile_remainder(dtype):
  """1 to 13 input channels (tiles of 12/8) x 1 to 3L + 1 outputs; row blocks, chunks; empty."""
  lanes = LANES[dtype]
  rng = np.random.default_rng(7)
  for i, o, r in itertools.product(range(1, 14), range(1, 3 * lanes + 2), (1, 3)):
    check_pointwise("wgrad", normal(rng, (r, i), dtype), normal(rng, (r, o), dtype),
                    threads=i % 3)
  for r, (i, o) in itertools.product((127, 128, 129, 255, 256, 257, 513, 64 * 256 + 3),
                                     ((1, 1), (13, lanes + 1), (9, 2 * lanes + 3))):
    check_pointwise("wgrad", normal(rng, (r, i), dtype), normal(rng, (r, o), dtype))
  for r, i, o in ((0, 3, 4), (4, 0, 3), (4, 3, 0)):
    check_pointwise("wgrad", normal(rng, (r, i), dtype), normal(rng, (r, o), dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_batch_norm_every_remainder(dtype):
  """1 to 17 channels x 1 to 5 rows; row chunks from 2 to the most (64); a large mean."""
  rng = np.random.default_rng(8)
  for c, r in itertools.product(range(1, 18), range(1, 6)):
    check_batch_norm(normal(rng, (r, c), dtype), normal(rng, (r, c), dtype), threads=c % 3)
  for r, c in ((4096, 9), (32768 // 3 + 1, 3), (70, 32768 // 8), (100_000, 1)):
    x = (normal(rng, (r, c), dtype) + 1e3).astype(dtype)
    check_batch_norm(x, normal(rng, (r, c), dtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_pointwise_wgrad_partials_bounded_by_size(dtype):
  """Wide enough (I*O > 2^22/64) that the chunk count is capped by the partials' size."""
  rng = np.random.default_rng(9)
  check_pointwise("wgrad", normal(rng, (4096, 300), dtype), normal(rng, (4096, 300), dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_an_empty_batch(dtype):
  """No images: the convolutions write nothing, the weight gradients zeros."""
  rng = np.random.default_rng(16)
  geo, out_hw = conv_geometry(4, 5, 3, 3, pad=((1, 1), (1, 1)))
  check_conv("depthwise_conv", normal(rng, (0, 4, 5, 3), dtype), normal(rng, (3, 3, 3), dtype),
             geo, out_hw)
  check_conv("direct_conv", normal(rng, (0, 4, 5, 3), dtype), normal(rng, (3, 3, 3, 2), dtype),
             geo, out_hw)
  geo, out_hw = conv_geometry(4, 5, 4, 5, pad=((1, 1), (1, 1)))
  assert check_conv("depthwise_wgrad", normal(rng, (0, 4, 5, 3), dtype),
                    normal(rng, (0, 4, 5, 3), dtype), geo, out_hw).tolist() == np.zeros(
                        (3, 3, 3)).tolist()
  check_conv("direct_wgrad", normal(rng, (0, 4, 5, 3), dtype), normal(rng, (0, 4, 5, 2), dtype),
             geo, out_hw)


# ------------------------------------------------------------------ geometry --

AXES = list(itertools.product(
    (1, 2, 3),          # stride
    (1, 2, 3, 5),       # window (the gradient's size, in the weight-gradient forms)
    (-2, -1, 0, 1, 3),  # padding before
    (-1, 0, 2),         # padding after
    (1, 2),             # lhs (input) dilation
    (1, 2)))            # rhs (window) dilation
"""Every combination along the width; the height takes another, so both axes see all."""


def axis_pairs():
  """(height, width) geometry pairs: the width runs through `AXES`, the height through a shuffle."""
  order = np.random.default_rng(10).permutation(len(AXES))
  for i, width in enumerate(AXES):
    yield AXES[order[i]], width


def swept(h_axis, w_axis, size_hw):
  """conv_geometry's attributes and output size for one `axis_pairs` pair."""
  (sh, kh, loh, hih, ldh, rdh), (sw, kw, low, hiw, ldw, rdw) = h_axis, w_axis
  geo, out_hw = conv_geometry(*size_hw, kh, kw, stride=(sh, sw), pad=((loh, hih), (low, hiw)),
                              lhs_dil=(ldh, ldw), rhs_dil=(rdh, rdw))
  return (kh, kw), geo, out_hw


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("kind", ["depthwise_conv", "depthwise_wgrad", "direct_conv",
                                  "direct_wgrad"])
def test_every_stride_dilation_and_padding(kind, dtype):
  """720 geometries each (strides 1-3, dilations 1-2, padding -2..3), empty outputs included."""
  rng = np.random.default_rng(11)
  lanes = LANES[dtype]
  for i, (h_axis, w_axis) in enumerate(axis_pairs()):
    n, wide = 1 + i % 2, i % 3 == 0
    (kh, kw), geo, out_hw = swept(h_axis, w_axis, (4, 6))
    if kind == "depthwise_conv":
      c = 2 * lanes + 3 if wide else 3
      a, b = normal(rng, (n, 4, 6, c), dtype), normal(rng, (kh, kw, c), dtype)
    elif kind == "depthwise_wgrad":
      c = 4 * lanes + 3 if wide else 3
      a, b = normal(rng, (n, 4, 6, c), dtype), normal(rng, (n, kh, kw, c), dtype)
    elif kind == "direct_conv":
      a, b = normal(rng, (n, 4, 6, 2), dtype), normal(rng, (kh, kw, 2, 4 * lanes + 1 if wide
                                                                  else 5), dtype)
    else:
      a, b = normal(rng, (n, 4, 6, 3), dtype), normal(rng, (n, kh, kw, 2 * lanes + 1 if wide
                                                                  else 5), dtype)
    check_conv(kind, a, b, geo, out_hw, threads=i % 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_the_largest_windows(dtype):
  """Windows as large as each form takes: 7x7 dilated (direct's limit), global, 1x31; 7x7 taps."""
  rng = np.random.default_rng(12)
  cases = [
      ("direct_conv", (1, 9, 11, 3), (7, 7, 3, 17), dict(pad=((6, 6), (6, 6)), rhs_dil=(2, 2))),
      ("direct_conv", (2, 7, 7, 5), (7, 7, 5, 4), dict(pad=((3, 3), (3, 3)))),
      ("depthwise_conv", (1, 9, 9, 33), (9, 9, 33), dict(pad=((4, 4), (4, 4)))),
      ("depthwise_conv", (2, 1, 40, 7), (1, 31, 7), dict(pad=((0, 0), (15, 15)))),
      ("depthwise_conv", (1, 14, 14, 17), (7, 7, 17), dict(stride=(2, 2), pad=((3, 3), (3, 3)))),
      ("direct_wgrad", (2, 22, 22, 3), (2, 16, 16, 9), dict()),  # 7x7 outputs, 16x16 window
      ("direct_wgrad", (3, 14, 14, 2), (3, 7, 7, 33), dict(pad=((3, 3), (3, 3)),
                                                           rhs_dil=(2, 2))),
      ("depthwise_wgrad", (2, 22, 22, 5), (2, 16, 16, 5), dict()),
      ("depthwise_wgrad", (1, 14, 14, 65), (1, 7, 7, 65), dict(pad=((3, 3), (3, 3)),
                                                               rhs_dil=(2, 2))),
  ]
  for kind, a_shape, b_shape, geometry_kw in cases:
    window = b_shape[:2] if kind.endswith("conv") else b_shape[1:3]
    geo, out_hw = conv_geometry(*a_shape[1:3], *window, **geometry_kw)
    check_conv(kind, normal(rng, a_shape, dtype), normal(rng, b_shape, dtype), geo, out_hw)


# ------------------------------------------------------- a real network's operands --


@functools.cache
def demo_operands() -> dict[str, tuple]:
  """The demo network's (`tunedjax.demo`, width 32) weights and activations on two images.

  Each entry: (kind, a, b, conv_geometry keyword arguments or None); the
  cotangents are random normals (float32).
  """
  from flax import nnx

  from tunedjax.demo import _data, _model
  model = _model.DemoNet(10, width=32)
  x = _data.decoded(_data.shapes_dataset(2, image_size=32), 32)["image"]
  rng = np.random.default_rng(13)
  block = model.separable[1]  # stride 2, 32 -> 64 channels

  @nnx.jit
  def activations(model, x):
    h = h0 = model.stem(x)
    for b in model.separable:
      h = b(h)
    return h0, model.separable[1].depthwise(h0), model.bottleneck.reduce(h)

  h0, h1, reduced = activations(model, x)
  arr = lambda a: np.asarray(a, np.float32)  # noqa: E731
  g = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  same = dict(pad=((1, 1), (1, 1)))
  return {
      "stem": ("direct_conv", x, arr(model.stem.conv.kernel), same),
      "stem wgrad": ("direct_wgrad", x, g(2, 32, 32, 32), same),
      "depthwise s2": ("depthwise_conv", arr(h0), arr(block.depthwise.conv.kernel)[:, :, 0],
                       dict(stride=(2, 2), pad=((0, 1), (0, 1)))),
      "depthwise s2 wgrad": ("depthwise_wgrad", arr(h0), g(2, 16, 16, 32),
                             dict(pad=((0, 1), (0, 1)), rhs_dil=(2, 2))),
      "depthwise s2 dgrad": ("depthwise_conv", g(2, 16, 16, 32),
                             arr(block.depthwise.conv.kernel)[::-1, ::-1, 0],
                             dict(pad=((2, 1), (2, 1)), lhs_dil=(2, 2))),
      "pointwise": ("matmul", arr(h1).reshape(-1, 32),
                    arr(block.pointwise.conv.kernel).reshape(32, 64), None),
      "pointwise wgrad": ("wgrad", arr(h1).reshape(-1, 32), g(512, 64), None),
      "bottleneck 3x3": ("direct_conv", arr(reduced), arr(model.bottleneck.conv.conv.kernel),
                         same),
      "bottleneck 3x3 wgrad": ("direct_wgrad", arr(reduced), g(2, 8, 8, 32), same),
      "batch norm": ("batch_norm", arr(model.stem.conv(x)).reshape(-1, 32), g(2048, 32), None),
  }


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", ["stem", "stem wgrad", "depthwise s2", "depthwise s2 wgrad",
                                  "depthwise s2 dgrad", "pointwise", "pointwise wgrad",
                                  "bottleneck 3x3", "bottleneck 3x3 wgrad", "batch norm"])
def test_demo_network_operands(name, dtype):
  kind, a, b, geometry_kw = demo_operands()[name]
  a, b = a.astype(dtype), b.astype(dtype)
  if kind in ("matmul", "wgrad"):
    check_pointwise(kind, a, b)
  elif kind == "batch_norm":
    check_batch_norm(a, b)
  else:
    if kind.endswith("wgrad"):  # the layer's input as (batch, H, W, channels) = (C, H, W, B)
      window = b.shape[1:3]
    else:
      window = b.shape[:2]
    geo, out_hw = conv_geometry(*a.shape[1:3], *window, **geometry_kw)
    check_conv(kind, a, b, geo, out_hw, label=f" ({name})")


# ------------------------------------------------------------- through XLA --


def xla_edge_cases(dtype):
  """(name, source, symbol stem, operands, output shapes, attributes, reference outputs, terms)."""
  rng = np.random.default_rng(14)
  lanes = LANES[dtype]
  cases = []
  convs = [
      ("depthwise_conv", (1, 3, 5, 2 * lanes + 1), (3, 3, 2 * lanes + 1),
       dict(pad=((1, 1), (1, 1)))),
      ("depthwise_conv", (1, 6, 7, 5), (3, 3, 5), dict(stride=(2, 2), pad=((-1, 1), (1, -1)))),
      ("depthwise_wgrad", (1, 5, 6, 8 * lanes // 2 + 1), (1, 5, 4, 8 * lanes // 2 + 1),
       dict(pad=((1, 1), (1, 0)))),
      ("direct_conv", (1, 2, 8, 3), (2, 2, 3, 6 * lanes + 1), dict()),
      ("direct_conv", (1, 5, 14, 2), (3, 3, 2, 1), dict(pad=((-1, 2), (1, 1)), lhs_dil=(1, 2))),
      ("direct_wgrad", (1, 2, 9, 25), (1, 2, 9, 3 * lanes + 1), dict()),
  ]
  for kind, a_shape, b_shape, geometry_kw in convs:
    source, stem, reference, out_shape, terms = KINDS[kind]
    a, b = normal(rng, a_shape, dtype), normal(rng, b_shape, dtype)
    window = b_shape[:2] if kind.endswith("conv") else b_shape[1:3]
    geo, out_hw = conv_geometry(*a_shape[1:3], *window, **geometry_kw)
    want, scale = reference(a, b, geo, out_hw)
    cases.append((kind, source, stem, (a, b), [out_shape(a_shape, b_shape, out_hw)], geo,
                  [(want, scale)], terms(a_shape, b_shape)))
  x, w = normal(rng, (17, 3), dtype), normal(rng, (3, 6 * lanes + 1), dtype)
  cases.append(("matmul", "pointwise", "TjPointwiseMatmul", (x, w), [(17, w.shape[1])], {},
                [nh.pointwise_matmul(x, w)], 3))
  x, g = normal(rng, (257, 13), dtype), normal(rng, (257, 3 * lanes + 1), dtype)
  cases.append(("wgrad", "pointwise", "TjPointwiseWgrad", (x, g), [(13, g.shape[1])], {},
                [nh.pointwise_wgrad(x, g)], 257))
  x = normal(rng, (4096, 9), dtype)
  (mean, var), (mscale, _) = nh.batch_norm_stats(x)
  cases.append(("stats", "batch_norm", "TjBatchNormStats", (x,), [(9,), (9,)], {},
                [(mean, mscale), (var, var + ((x - x[0]) ** 2).mean(0))], 4096))
  return cases


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_edges_through_xla(dtype):
  """Edge shapes as XLA runs them: `jax.ffi.ffi_call` in one jitted function, XLA's buffers."""
  cases = xla_edge_cases(dtype)

  def run(*operands):
    outs, k = [], 0
    for _, source, stem, ops, shapes, geo, _, _ in cases:
      target = _native.ffi_target(source, stem + SUFFIX[dtype])
      results = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
      call = jax.ffi.ffi_call(target, results if len(results) > 1 else results[0])
      got = call(*operands[k:k + len(ops)], **{n: np.int64(v) for n, v in geo.items()})
      outs += list(got) if len(results) > 1 else [got]
      k += len(ops)
    return outs

  with jax.enable_x64(dtype == np.float64):
    got = jax.jit(run)(*[op for case in cases for op in case[3]])
  got = iter(got)
  for kind, _, _, _, _, geo, wants, terms in cases:
    for want, scale in wants:
      nh.assert_close(f"{kind} through XLA {geo}", np.asarray(next(got)), want, scale, terms)


# -------------------------------------------------------- errors and threads --


def test_bad_shapes_are_errors_that_write_nothing():
  """Each handler rejects operands that do not fit, before writing any output."""
  z = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
  geo = nh.geometry()
  bad = [
      ("depthwise", "TjDepthwiseConvF32", [z(1, 4, 4, 3), z(3, 3, 2)], [(1, 2, 2, 3)], geo),
      ("depthwise", "TjDepthwiseConvF32", [z(1, 4, 4, 3), z(3, 3, 3)], [(1, 2, 2, 3)],
       dict(geo, stride_w=0)),
      ("depthwise", "TjDepthwiseWgradF32", [z(2, 4, 4, 3), z(1, 2, 2, 3)], [(3, 3, 3)], geo),
      ("direct_conv", "TjDirectConvF32", [z(1, 4, 4, 3), z(3, 3, 2, 5)], [(1, 2, 2, 5)], geo),
      ("direct_conv", "TjDirectWgradF32", [z(2, 4, 4, 3), z(2, 2, 2, 5)], [(3, 3, 3, 4)], geo),
      ("pointwise", "TjPointwiseMatmulF32", [z(4, 3), z(2, 5)], [(4, 5)], {}),
      ("pointwise", "TjPointwiseWgradF32", [z(4, 3), z(5, 5)], [(3, 5)], {}),
      ("batch_norm", "TjBatchNormStatsF32", [z(0, 3)], [(3,), (3,)], {}),
      ("batch_norm", "TjBatchNormGradSumsF32", [z(4, 3), z(4, 3), z(2)], [(3,), (3,)], {}),
  ]
  for source, symbol, args, shapes, attrs in bad:
    with pytest.raises(nh.HandlerError, match=r"expected|must be"):
      nh.call(source, symbol, args, shapes, attrs)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_bitwise_the_same_whatever_the_threads(dtype):
  """No pool, 1, 2 or 5 threads: the same bits (the work split depends on shapes alone)."""
  rng = np.random.default_rng(15)
  for kind, source, stem, ops, shapes, geo, _, _ in xla_edge_cases(dtype):
    del kind
    runs = [nh.call(source, stem + SUFFIX[dtype], ops, shapes, geo, threads=t)
            for t in (0, 1, 2, 5)]
    for other in runs[1:]:
      for a, b in zip(runs[0], other):
        assert a.tobytes() == b.tobytes(), f"{stem}: results differ with the thread count"
  x, g = normal(rng, (64 * 256 + 5, 7), dtype), normal(rng, (64 * 256 + 5, 9), dtype)
  runs = [check_pointwise("wgrad", x, g, threads=t).tobytes() for t in (0, 3)]
  assert runs[0] == runs[1]
