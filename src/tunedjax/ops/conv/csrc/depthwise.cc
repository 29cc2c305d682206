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
// No per-element branching for padding or dilation: the valid taps of each
// output column are worked out once per call (a "column plan"), and columns
// that meet the same taps at a fixed input step are grouped into segments;
// each segment runs a branch-free, register-blocked tile (several output
// columns times a block of channels, whose accumulators stay in registers).
// Every inner loop runs over channels, which are independent lanes, so GCC
// vectorises them without reassociating any sum (no -ffast-math needed).
// Multiply-adds may be contracted into FMA instructions (fp-contract=fast
// below): one rounding instead of two, the same on every run.
//
// Sums and their precision:
// * the convolution sums KH * KW terms per output in T (float32 lanes for
//   float32): a short sum, in a fixed tap order (kh, then kw).
// * the weight gradient sums N * GH * GW terms per output (131072 for a
//   128x32x32 batch), too long for one float32 accumulator: each image's
//   sum is accumulated in T (at most GH * GW terms, one output row of taps
//   at a time in registers), and the images' sums are added in double.
//   Images are split over a fixed number of chunks (by shape, never by
//   thread count) and the chunks' double sums are added in chunk order, so
//   the result is bitwise the same from run to run.
#if defined(__clang__)
#pragma clang fp contract(fast)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=fast")
#endif

#include <algorithm>
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

// Output columns ow = ow0 + j * ostep (j < count) that all meet the same
// window taps k[t], reading input column i0[t] + j * istep.
struct Segment {
  int64_t ow0, ostep, count, istep;
  std::vector<int64_t> k, i0;
};

// Groups the output columns [0, OW) into segments (see Segment). Columns in
// one lhs-dilation phase (ow mod period) with the same valid taps join one
// segment while each tap's input column advances by the same step.
std::vector<Segment> PlanColumns(int64_t OW, int64_t KW, int64_t W,
                                 int64_t stride, int64_t rhs_dil, int64_t pad,
                                 int64_t lhs_dil) {
  int64_t a = stride, b = lhs_dil;
  while (b != 0) {
    int64_t t = a % b;
    a = b;
    b = t;
  }
  int64_t period = lhs_dil / a;  // ow -> ow + period keeps the phase
  std::vector<Segment> segs;
  for (int64_t phase = 0; phase < std::min(period, OW); ++phase) {
    Segment cur;
    bool open = false;
    for (int64_t ow = phase; ow < OW; ow += period) {
      std::vector<int64_t> k, i;
      for (int64_t kw = 0; kw < KW; ++kw) {
        int64_t iw = source(ow, kw, stride, rhs_dil, pad, lhs_dil, W);
        if (iw >= 0) {
          k.push_back(kw);
          i.push_back(iw);
        }
      }
      bool joins = open && k == cur.k;
      if (joins) {
        int64_t step = cur.count == 1 ? (i.empty() ? 0 : i[0] - cur.i0[0])
                                      : cur.istep;
        for (size_t t = 0; t < k.size() && joins; ++t) {
          joins = i[t] == cur.i0[t] + cur.count * step;
        }
        if (joins) {
          cur.istep = step;
          ++cur.count;
          continue;
        }
      }
      if (open) segs.push_back(cur);
      cur = Segment{ow, period, 1, 0, std::move(k), std::move(i)};
      open = true;
    }
    if (open) segs.push_back(cur);
  }
  return segs;
}

// One tile: B output columns (b * yb apart) times CB channels; tap t reads
// x + xoff[t] (columns b * xb apart) and weights w + woff[t]. The
// accumulators are a fixed-size array the compiler keeps in registers.
template <typename T, int B, int CB>
inline void ConvTile(const T* x, const int64_t* xoff, const T* w,
                     const int64_t* woff, int64_t taps, int64_t xb, T* y,
                     int64_t yb) {
  T acc[B][CB];
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < CB; ++c) acc[b][c] = T(0);
  for (int64_t t = 0; t < taps; ++t) {
    const T* xp = x + xoff[t];
    const T* wp = w + woff[t];
    for (int b = 0; b < B; ++b)
      for (int c = 0; c < CB; ++c) acc[b][c] += xp[b * xb + c] * wp[c];
  }
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < CB; ++c) y[b * yb + c] = acc[b][c];
}

// A tile of one column and `cw` (< CB) channels: the channel tail.
template <typename T, int CB>
inline void ConvTail(const T* x, const int64_t* xoff, const T* w,
                     const int64_t* woff, int64_t taps, T* y, int64_t cw) {
  T acc[CB];
  for (int64_t c = 0; c < cw; ++c) acc[c] = T(0);
  for (int64_t t = 0; t < taps; ++t) {
    const T* xp = x + xoff[t];
    const T* wp = w + woff[t];
    for (int64_t c = 0; c < cw; ++c) acc[c] += xp[c] * wp[c];
  }
  for (int64_t c = 0; c < cw; ++c) y[c] = acc[c];
}

#ifndef TJ_CONV_B
#define TJ_CONV_B 4
#endif
#ifndef TJ_CONV_CB
#define TJ_CONV_CB 32
#endif

template <typename T>
struct ConvBlocking;
template <>
struct ConvBlocking<float> {
  static constexpr int B = TJ_CONV_B, CB = TJ_CONV_CB;
};
template <>
struct ConvBlocking<double> {
  static constexpr int B = TJ_CONV_B, CB = TJ_CONV_CB / 2;
};

template <typename T>
void ConvRows(const T* x, const T* w, T* y, int64_t H, int64_t W, int64_t C,
              int64_t KH, int64_t KW, int64_t OH, int64_t OW,
              const Geometry& g, const std::vector<Segment>& segs,
              int64_t row_lo, int64_t row_hi) {
  constexpr int B = ConvBlocking<T>::B, CB = ConvBlocking<T>::CB;
  std::vector<int64_t> xoff, woff;
  std::vector<int64_t> kh_valid, ih_valid;
  for (int64_t row = row_lo; row < row_hi; ++row) {  // row = n * OH + oh
    int64_t n = row / OH, oh = row % OH;
    T* yrow = y + row * OW * C;
    kh_valid.clear();
    ih_valid.clear();
    for (int64_t kh = 0; kh < KH; ++kh) {
      int64_t ih = source(oh, kh, g.stride_h, g.rhs_dil_h, g.pad_h, g.lhs_dil_h, H);
      if (ih >= 0) {
        kh_valid.push_back(kh);
        ih_valid.push_back(ih);
      }
    }
    for (const Segment& s : segs) {
      // The taps in (kh, kw) order: input offsets of the segment's first
      // column, and weight offsets.
      xoff.clear();
      woff.clear();
      for (size_t r = 0; r < kh_valid.size(); ++r) {
        for (size_t t = 0; t < s.k.size(); ++t) {
          xoff.push_back(((n * H + ih_valid[r]) * W + s.i0[t]) * C);
          woff.push_back((kh_valid[r] * KW + s.k[t]) * C);
        }
      }
      int64_t taps = static_cast<int64_t>(xoff.size());
      int64_t xb = s.istep * C, yb = s.ostep * C;
      int64_t j = 0;
      for (; j + B <= s.count; j += B) {
        T* yp = yrow + (s.ow0 + j * s.ostep) * C;
        const T* xj = x + j * xb;
        int64_t c = 0;
        for (; c + CB <= C; c += CB)
          ConvTile<T, B, CB>(xj + c, xoff.data(), w + c, woff.data(), taps, xb,
                             yp + c, yb);
        for (int b = 0; b < B && c < C; ++b)
          ConvTail<T, CB>(xj + b * xb + c, xoff.data(), w + c, woff.data(),
                          taps, yp + b * yb + c, C - c);
      }
      for (; j < s.count; ++j) {
        T* yp = yrow + (s.ow0 + j * s.ostep) * C;
        const T* xj = x + j * xb;
        int64_t c = 0;
        for (; c + CB <= C; c += CB)
          ConvTile<T, 1, CB>(xj + c, xoff.data(), w + c, woff.data(), taps, 0,
                             yp + c, 0);
        if (c < C)
          ConvTail<T, CB>(xj + c, xoff.data(), w + c, woff.data(), taps,
                          yp + c, C - c);
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
  if (stride_h < 1 || stride_w < 1 || lhs_dil_h < 1 || lhs_dil_w < 1 ||
      rhs_dil_h < 1 || rhs_dil_w < 1) {
    return ffi::Error::InvalidArgument(
        "depthwise_conv: strides and dilations must be >= 1");
  }
  Geometry g{stride_h, stride_w, pad_h, pad_w, lhs_dil_h, lhs_dil_w, rhs_dil_h, rhs_dil_w};
  int64_t N = xd[0], H = xd[1], W = xd[2], C = xd[3];
  int64_t KH = wd[0], KW = wd[1], OH = yd[1], OW = yd[2];
  std::vector<Segment> segs =
      PlanColumns(OW, KW, W, stride_w, rhs_dil_w, pad_w, lhs_dil_w);
  const T* xp = x.typed_data();
  const T* wp = w.typed_data();
  T* yp = y->typed_data();
  int64_t rows = N * OH;
  int64_t chunks = std::min<int64_t>(rows, 64);
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(rows, chunks, i, &lo, &hi);
    ConvRows<T>(xp, wp, yp, H, W, C, KH, KW, OH, OW, g, segs, lo, hi);
  });
  return ffi::Error::Success();
}

// One weight-gradient output column: acc[c] (CB channels, in registers) +=
// sum over the segment's window positions of x * g. `xb` and `gb` are the
// element steps between consecutive positions.
template <typename T, int CB>
inline void WgradDot(const T* x, const T* g, int64_t count, int64_t xb,
                     int64_t gb, T* out) {
  T acc[CB];
  for (int c = 0; c < CB; ++c) acc[c] = T(0);
  for (int64_t j = 0; j < count; ++j)
    for (int c = 0; c < CB; ++c) acc[c] += x[j * xb + c] * g[j * gb + c];
  for (int c = 0; c < CB; ++c) out[c] += acc[c];
}

template <typename T, int CB>
inline void WgradDotTail(const T* x, const T* g, int64_t count, int64_t xb,
                         int64_t gb, T* out, int64_t cw) {
  T acc[CB];
  for (int64_t c = 0; c < cw; ++c) acc[c] = T(0);
  for (int64_t j = 0; j < count; ++j)
    for (int64_t c = 0; c < cw; ++c) acc[c] += x[j * xb + c] * g[j * gb + c];
  for (int64_t c = 0; c < cw; ++c) out[c] += acc[c];
}

// For each weight column pw, the window columns gw that read a real input
// column, as a progression: gw = gw0 + j * gstep, iw = iw0 + j * istep.
struct Progression {
  int64_t gw0 = 0, gstep = 1, iw0 = 0, istep = 0, count = 0;
};

std::vector<Progression> PlanWgradColumns(int64_t PW, int64_t GW, int64_t W,
                                          int64_t stride, int64_t rhs_dil,
                                          int64_t pad, int64_t lhs_dil) {
  std::vector<Progression> plan(PW);
  for (int64_t pw = 0; pw < PW; ++pw) {
    std::vector<int64_t> gws, iws;
    for (int64_t gw = 0; gw < GW; ++gw) {
      int64_t iw = source(pw, gw, stride, rhs_dil, pad, lhs_dil, W);
      if (iw >= 0) {
        gws.push_back(gw);
        iws.push_back(iw);
      }
    }
    Progression& p = plan[pw];
    p.count = static_cast<int64_t>(gws.size());
    if (p.count == 0) continue;
    p.gw0 = gws[0];
    p.iw0 = iws[0];
    if (p.count > 1) {
      p.gstep = gws[1] - gws[0];
      p.istep = iws[1] - iws[0];
    }
  }
  return plan;
}

template <typename T>
struct WgradBlocking;
template <>
struct WgradBlocking<float> {
  static constexpr int CB = 64;
};
template <>
struct WgradBlocking<double> {
  static constexpr int CB = 32;
};

// Adds the weight gradient of images [n_lo, n_hi), channels [c_lo, c_hi),
// into `dacc` (PH, PW, C) doubles; `img` is a (PH, PW, C) scratch of T.
template <typename T>
void WgradImages(const T* x, const T* gr, double* dacc, T* img, int64_t H,
                 int64_t W, int64_t C, int64_t GH, int64_t GW, int64_t PH,
                 int64_t PW, const Geometry& g,
                 const std::vector<Progression>& cols, int64_t n_lo,
                 int64_t n_hi, int64_t c_lo, int64_t c_hi) {
  constexpr int CB = WgradBlocking<T>::CB;
  for (int64_t n = n_lo; n < n_hi; ++n) {
    for (int64_t k = 0; k < PH * PW; ++k)
      std::fill(img + k * C + c_lo, img + k * C + c_hi, T(0));
    for (int64_t gh = 0; gh < GH; ++gh) {
      const T* grow = gr + (n * GH + gh) * GW * C;
      for (int64_t ph = 0; ph < PH; ++ph) {
        int64_t ih = source(ph, gh, g.stride_h, g.rhs_dil_h, g.pad_h, g.lhs_dil_h, H);
        if (ih < 0) continue;
        const T* xrow = x + (n * H + ih) * W * C;
        for (int64_t pw = 0; pw < PW; ++pw) {
          const Progression& p = cols[pw];
          if (p.count == 0) continue;
          const T* xp = xrow + p.iw0 * C;
          const T* gp = grow + p.gw0 * C;
          T* op = img + (ph * PW + pw) * C;
          int64_t xb = p.istep * C, gb = p.gstep * C;
          int64_t c = c_lo;
          for (; c + CB <= c_hi; c += CB)
            WgradDot<T, CB>(xp + c, gp + c, p.count, xb, gb, op + c);
          if (c < c_hi)
            WgradDotTail<T, CB>(xp + c, gp + c, p.count, xb, gb, op + c, c_hi - c);
        }
      }
    }
    for (int64_t k = 0; k < PH * PW; ++k)
      for (int64_t c = c_lo; c < c_hi; ++c) dacc[k * C + c] += img[k * C + c];
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
  if (stride_h < 1 || stride_w < 1 || lhs_dil_h < 1 || lhs_dil_w < 1 ||
      rhs_dil_h < 1 || rhs_dil_w < 1) {
    return ffi::Error::InvalidArgument(
        "depthwise_wgrad: strides and dilations must be >= 1");
  }
  Geometry g{stride_h, stride_w, pad_h, pad_w, lhs_dil_h, lhs_dil_w, rhs_dil_h, rhs_dil_w};
  int64_t N = xd[0], H = xd[1], W = xd[2], C = xd[3];
  int64_t GH = gd[1], GW = gd[2], PH = od[0], PW = od[1];
  std::vector<Progression> cols =
      PlanWgradColumns(PW, GW, W, stride_w, rhs_dil_w, pad_w, lhs_dil_w);
  int64_t per = PH * PW * C;
  // A fixed split (by shape only): up to 16 image chunks, and channel parts
  // when there are few images.
  constexpr int CB = WgradBlocking<T>::CB;
  int64_t n_parts = std::max<int64_t>(1, std::min<int64_t>(N, 16));
  int64_t c_blocks = (C + CB - 1) / CB;
  int64_t c_parts = std::max<int64_t>(
      1, std::min<int64_t>(c_blocks, (16 + n_parts - 1) / n_parts));
  std::vector<double> partial(n_parts * per, 0.0);
  const T* xp = x.typed_data();
  const T* gp = gr.typed_data();
  parallel_for(pool, n_parts * c_parts, [&](int64_t i) {
    int64_t ni = i / c_parts, ci = i % c_parts;
    int64_t n_lo, n_hi, b_lo, b_hi;
    split_range(N, n_parts, ni, &n_lo, &n_hi);
    split_range(c_blocks, c_parts, ci, &b_lo, &b_hi);
    int64_t c_lo = b_lo * CB, c_hi = std::min(C, b_hi * CB);
    std::vector<T> img(per);
    WgradImages<T>(xp, gp, partial.data() + ni * per, img.data(), H, W, C, GH,
                   GW, PH, PW, g, cols, n_lo, n_hi, c_lo, c_hi);
  });
  T* op = out->typed_data();
  for (int64_t k = 0; k < per; ++k) {
    double s = partial[k];
    for (int64_t i = 1; i < n_parts; ++i) s += partial[i * per + k];
    op[k] = static_cast<T>(s);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tunedjax

TJ_DEFINE(TjDepthwiseConvF32, DepthwiseConv, ffi::F32)
TJ_DEFINE(TjDepthwiseConvF64, DepthwiseConv, ffi::F64)
TJ_DEFINE(TjDepthwiseWgradF32, DepthwiseWgrad, ffi::F32)
TJ_DEFINE(TjDepthwiseWgradF64, DepthwiseWgrad, ffi::F64)
