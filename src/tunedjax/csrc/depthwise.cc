// Depthwise (one kernel per channel) 2-D convolution on channels-last data,
// and its weight gradient: XLA FFI handlers for tunedjax's `depthwise_native`
// conv kernel (autotune/_conv_native.py).
//
// Positions follow lax.conv_general_dilated: an output (or weight) index o
// and a window index k read the lhs-dilated, padded input at
//   o * stride + k * rhs_dilation - pad_lo,
// which is a real input row i only when it is >= 0, divisible by
// lhs_dilation, and i = that / lhs_dilation < size; elsewhere it reads zero.
//
// depthwise_conv:  x (N, H, W, C), w (KH, KW, C) -> y (N, OH, OW, C)
//   y[n, oh, ow, c] = sum_{kh, kw} x[n, ih(oh, kh), iw(ow, kw), c] * w[kh, kw, c]
// depthwise_wgrad: x (N, H, W, C), g (N, GH, GW, C) -> out (PH, PW, C)
//   out[ph, pw, c] = sum_{n, gh, gw} x[n, ih(ph, gh), iw(pw, gw), c] * g[n, gh, gw, c]
//   (the weight gradient of a depthwise conv, written as the conv whose
//   output positions are the kernel taps: XLA's batch_group_count form).
//
// Each sum runs in a fixed order whatever the thread count; the weight
// gradient's partial sums over batch chunks (a fixed number of them) are
// added in chunk order.
#include <cstdint>
#include <cstring>
#include <vector>

#include "tj_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tunedjax {
namespace {

struct Geometry {
  int64_t stride_h, stride_w, pad_h, pad_w, lhs_dil_h, lhs_dil_w, rhs_dil_h,
      rhs_dil_w;
};

// The input row read at output index o, window index k; -1 if a zero.
inline int64_t source(int64_t o, int64_t k, int64_t stride, int64_t rhs_dil,
                      int64_t pad, int64_t lhs_dil, int64_t size) {
  int64_t p = o * stride + k * rhs_dil - pad;
  if (p < 0 || p % lhs_dil != 0) return -1;
  p /= lhs_dil;
  return p < size ? p : -1;
}

template <typename T>
void ConvRows(const T* x, const T* w, T* y, int64_t H, int64_t W, int64_t C,
              int64_t KH, int64_t KW, int64_t OH, int64_t OW,
              const Geometry& g, int64_t row_lo, int64_t row_hi) {
  for (int64_t row = row_lo; row < row_hi; ++row) {  // row = n * OH + oh
    int64_t n = row / OH, oh = row % OH;
    T* yrow = y + row * OW * C;
    std::memset(yrow, 0, sizeof(T) * OW * C);
    for (int64_t kh = 0; kh < KH; ++kh) {
      int64_t ih = source(oh, kh, g.stride_h, g.rhs_dil_h, g.pad_h, g.lhs_dil_h, H);
      if (ih < 0) continue;
      const T* xrow = x + (n * H + ih) * W * C;
      for (int64_t kw = 0; kw < KW; ++kw) {
        const T* wk = w + (kh * KW + kw) * C;
        for (int64_t ow = 0; ow < OW; ++ow) {
          int64_t iw = source(ow, kw, g.stride_w, g.rhs_dil_w, g.pad_w, g.lhs_dil_w, W);
          if (iw < 0) continue;
          const T* xp = xrow + iw * C;
          T* yp = yrow + ow * C;
          for (int64_t c = 0; c < C; ++c) yp[c] += xp[c] * wk[c];
        }
      }
    }
  }
}

template <ffi::DataType DT>
ffi::Error DepthwiseConv(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                         ffi::Buffer<DT> w, ffi::ResultBuffer<DT> y,
                         int64_t stride_h, int64_t stride_w, int64_t pad_h,
                         int64_t pad_w, int64_t lhs_dil_h, int64_t lhs_dil_w,
                         int64_t rhs_dil_h, int64_t rhs_dil_w) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 4 || wd.size() != 3 || yd.size() != 4 || wd[2] != xd[3] ||
      yd[3] != xd[3] || yd[0] != xd[0]) {
    return ffi::Error::InvalidArgument(
        "depthwise_conv: expected x (N, H, W, C), w (KH, KW, C), y (N, OH, OW, C)");
  }
  Geometry g{stride_h, stride_w, pad_h, pad_w, lhs_dil_h, lhs_dil_w, rhs_dil_h, rhs_dil_w};
  int64_t N = xd[0], H = xd[1], W = xd[2], C = xd[3];
  int64_t KH = wd[0], KW = wd[1], OH = yd[1], OW = yd[2];
  const T* xp = x.typed_data();
  const T* wp = w.typed_data();
  T* yp = y->typed_data();
  int64_t rows = N * OH;
  int64_t chunks = std::min<int64_t>(rows, 64);
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(rows, chunks, i, &lo, &hi);
    ConvRows<T>(xp, wp, yp, H, W, C, KH, KW, OH, OW, g, lo, hi);
  });
  return ffi::Error::Success();
}

template <typename T>
void WgradBatches(const T* x, const T* gr, T* acc, int64_t H, int64_t W,
                  int64_t C, int64_t GH, int64_t GW, int64_t PH, int64_t PW,
                  const Geometry& g, int64_t n_lo, int64_t n_hi) {
  std::memset(acc, 0, sizeof(T) * PH * PW * C);
  for (int64_t n = n_lo; n < n_hi; ++n) {
    for (int64_t gh = 0; gh < GH; ++gh) {
      const T* grow = gr + (n * GH + gh) * GW * C;
      for (int64_t ph = 0; ph < PH; ++ph) {
        // Output (tap) index ph, window index gh.
        int64_t ih = source(ph, gh, g.stride_h, g.rhs_dil_h, g.pad_h, g.lhs_dil_h, H);
        if (ih < 0) continue;
        const T* xrow = x + (n * H + ih) * W * C;
        for (int64_t pw = 0; pw < PW; ++pw) {
          T* ap = acc + (ph * PW + pw) * C;
          for (int64_t gw = 0; gw < GW; ++gw) {
            int64_t iw = source(pw, gw, g.stride_w, g.rhs_dil_w, g.pad_w, g.lhs_dil_w, W);
            if (iw < 0) continue;
            const T* xp = xrow + iw * C;
            const T* gp = grow + gw * C;
            for (int64_t c = 0; c < C; ++c) ap[c] += xp[c] * gp[c];
          }
        }
      }
    }
  }
}

template <ffi::DataType DT>
ffi::Error DepthwiseWgrad(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                          ffi::Buffer<DT> gr, ffi::ResultBuffer<DT> out,
                          int64_t stride_h, int64_t stride_w, int64_t pad_h,
                          int64_t pad_w, int64_t lhs_dil_h, int64_t lhs_dil_w,
                          int64_t rhs_dil_h, int64_t rhs_dil_w) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions(), gd = gr.dimensions(), od = out->dimensions();
  if (xd.size() != 4 || gd.size() != 4 || od.size() != 3 || gd[0] != xd[0] ||
      gd[3] != xd[3] || od[2] != xd[3]) {
    return ffi::Error::InvalidArgument(
        "depthwise_wgrad: expected x (N, H, W, C), g (N, GH, GW, C), out (PH, PW, C)");
  }
  Geometry g{stride_h, stride_w, pad_h, pad_w, lhs_dil_h, lhs_dil_w, rhs_dil_h, rhs_dil_w};
  int64_t N = xd[0], H = xd[1], W = xd[2], C = xd[3];
  int64_t GH = gd[1], GW = gd[2], PH = od[0], PW = od[1];
  int64_t per = PH * PW * C;
  int64_t chunks = std::min<int64_t>(N, 8);
  std::vector<T> partial(chunks * per);
  const T* xp = x.typed_data();
  const T* gp = gr.typed_data();
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(N, chunks, i, &lo, &hi);
    WgradBatches<T>(xp, gp, partial.data() + i * per, H, W, C, GH, GW, PH, PW, g, lo, hi);
  });
  T* op = out->typed_data();
  std::memcpy(op, partial.data(), sizeof(T) * per);
  for (int64_t i = 1; i < chunks; ++i) {
    const T* pp = partial.data() + i * per;
    for (int64_t k = 0; k < per; ++k) op[k] += pp[k];
  }
  return ffi::Error::Success();
}

#define TJ_GEOMETRY_ATTRS                                                   \
  .Attr<int64_t>("stride_h").Attr<int64_t>("stride_w")                     \
      .Attr<int64_t>("pad_h").Attr<int64_t>("pad_w")                       \
      .Attr<int64_t>("lhs_dil_h").Attr<int64_t>("lhs_dil_w")               \
      .Attr<int64_t>("rhs_dil_h").Attr<int64_t>("rhs_dil_w")

}  // namespace
}  // namespace tunedjax

#define TJ_DEFINE(NAME, FN, DT)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, tunedjax::FN<DT>,                     \
                                ffi::Ffi::Bind()                            \
                                    .Ctx<ffi::ThreadPool>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    TJ_GEOMETRY_ATTRS);

TJ_DEFINE(TjDepthwiseConvF32, DepthwiseConv, ffi::F32)
TJ_DEFINE(TjDepthwiseConvF64, DepthwiseConv, ffi::F64)
TJ_DEFINE(TjDepthwiseWgradF32, DepthwiseWgrad, ffi::F32)
TJ_DEFINE(TjDepthwiseWgradF64, DepthwiseWgrad, ffi::F64)
