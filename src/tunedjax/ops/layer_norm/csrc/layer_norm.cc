// Layer norm over the last axis: XLA FFI handlers for tunedjax's `native`
// layer-norm kernel (ops/layer_norm/_native_kernel.py). x is seen as (R, C):
// R rows (every axis but the last, flattened) of C features, each row
// normalised by its own mean and variance over its C features.
//
// layer_norm_forward:  x (R, C), scale (C), bias (C), attr epsilon
//                      -> y (R, C), mean (R), rstd (R)
//   rstd = 1 / sqrt(var + epsilon) (biased variance),
//   y = (x - mean) * rstd * scale + bias
// layer_norm_backward: x, dy (R, C), scale (C), mean, rstd (R)
//                      -> dx (R, C), dscale (C), dbias (C)
//   with xhat = (x - mean) * rstd and g = dy * scale,
//   dx = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat)),
//   dscale = sum_rows(dy * xhat), dbias = sum_rows(dy).
//
// Unlike batch norm's handlers (which leave the elementwise passes to XLA,
// where they fuse with a ReLU or a padded copy), these do the whole op: a
// row is short (hundreds to a few thousand features), so the passes over it
// find it in cache, and each operand is read from memory once, each result
// written once. Rows go in blocks of kRowBlock (2), a pass at a time over the
// block's rows, so that one row's reductions and the scalar work between
// passes (tree sums, division, square root) overlap with the next row's.
//
// Statistics: the corrected two-pass algorithm, per row. Pass 1 sums x,
// giving a rough mean m0 (rounded to T); pass 2 sums d = x - m0 and d * d.
// Then mean = m0 + sum(d) / C and var = sum(d * d) / C - (sum(d) / C)^2 in
// double: sum(d) / C is only m0's rounding error, so nothing cancels, and a
// large mean (1e3 times the spread) costs the variance no digits, as it does
// a one-pass E[x^2] - E[x]^2. The row sums are kept in T, in 64 (float) or
// 32 (double) independent lanes added as a tree at the end: each lane adds a
// few terms, so the sums are as accurate as XLA's blocked reductions without
// halving the vector width. The mean is returned rounded to T (mh); y is
// formed from xhat = (x - mh) * rstd - ml * rstd, ml being what mh lacks of
// m0 + sum(d) / C (for double, TwoSum's error term), so that rounding does
// not reach y. The backward finds ml again as sum(x - mh) / C in its first
// pass (the values are small, so the sum is accurate) and corrects for it,
// so its xhat does not carry the saved mean's rounding either.
//
// Backward: per row, pass A sums d = x - mh, g and g * d (T lanes); pass B
// forms dx and adds dy * xhat and dy into per-chunk column partials in
// double, row after row. dscale and dbias sum over every row (possibly
// millions), so rows are split into a fixed number of chunks that depends
// only on the shape, never on the thread count; each chunk's partials are
// added in chunk order, so results are bitwise the same from run to run and
// whatever the thread count (as in batch_norm.cc). The forward's rows are
// independent: its bits never depend on the split.
//
// The row reductions use GCC/clang vector extensions (64-byte vectors: 16
// floats or 8 doubles, one AVX-512 register or two AVX2 ones), four of them
// per sum; the elementwise passes are plain loops over the contiguous
// features that the compiler vectorises. No -ffast-math: every sum is in a
// fixed order. Tails (C not a multiple of the vector width) are summed one
// value at a time into a separate lane.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "tj_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Vector arguments of inline functions: no ABI is exported.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace tunedjax {
namespace {

template <typename T>
struct Vec;
template <>
struct Vec<float> {
  typedef float V __attribute__((vector_size(64)));
  static constexpr int L = 16;
};
template <>
struct Vec<double> {
  typedef double V __attribute__((vector_size(64)));
  static constexpr int L = 8;
};

template <typename T>
inline typename Vec<T>::V Load(const T* p) {
  typename Vec<T>::V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T>
inline typename Vec<T>::V Splat(T x) {
  return typename Vec<T>::V{} + x;
}

// A vector of Bytes / sizeof(T) lanes of T.
template <typename T, int Bytes>
struct Lanes {
  typedef T V __attribute__((vector_size(Bytes)));
};

// The low or high half of v's lanes, as a vector of half the size: a shuffle
// (clang, GCC 12+), else a copy through memory.
template <typename T, int Bytes, size_t... I>
inline typename Lanes<T, Bytes / 2>::V Half(typename Lanes<T, Bytes>::V v, bool high,
                                           std::index_sequence<I...>) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
  constexpr size_t n = sizeof...(I);
  return high ? __builtin_shufflevector(v, v, (I + n)...) : __builtin_shufflevector(v, v, I...);
#else
  typename Lanes<T, Bytes / 2>::V h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + (high ? Bytes / 2 : 0), Bytes / 2);
  return h;
#endif
}

// The lanes of v added as a tree, halving the vector each step (high half onto
// low half: a fixed order, in registers).
template <typename T, int Bytes>
inline T TreeSum(typename Lanes<T, Bytes>::V v) {
  if constexpr (Bytes == 2 * sizeof(T)) {
    return v[0] + v[1];
  } else {
    constexpr auto half = std::make_index_sequence<Bytes / sizeof(T) / 2>{};
    return TreeSum<T, Bytes / 2>(Half<T, Bytes>(v, false, half) + Half<T, Bytes>(v, true, half));
  }
}

template <typename T>
inline T LaneSum(typename Vec<T>::V v) {
  return TreeSum<T, sizeof(v)>(v);
}

// What a + b lost when rounded to s = a + b (Knuth's TwoSum: exact, whatever
// the magnitudes; no product, so no FMA contraction changes it).
inline double TwoSumError(double a, double b, double s) {
  const double bb = s - a;
  return (a - (s - bb)) + (b - bb);
}

// Independent vector accumulators per sum.
constexpr int kAcc = 4;

// K sums over a row of C values: vec(c, acc) adds the K quantities of the L
// values at c into acc[0..K); one(c, s) adds those of value c into s[0..K).
// Whole blocks of kAcc vectors, then single vectors, then the tail values one
// at a time; out[k] = the accumulators' lanes and the tail, added in a fixed order.
template <typename T, int K, typename VecFn, typename OneFn>
inline void RowSums(int64_t C, VecFn vec, OneFn one, T* out) {
  using V = typename Vec<T>::V;
  constexpr int64_t L = Vec<T>::L;
  V acc[kAcc][K];
  for (int u = 0; u < kAcc; ++u) {
    for (int k = 0; k < K; ++k) acc[u][k] = V{};
  }
  int64_t c = 0;
  for (; c + kAcc * L <= C; c += kAcc * L) {
    for (int u = 0; u < kAcc; ++u) vec(c + u * L, acc[u]);
  }
  for (int u = 0; c + L <= C; c += L, ++u) vec(c, acc[u]);  // u < kAcc
  T tail[K] = {};
  for (; c < C; ++c) one(c, tail);
  for (int k = 0; k < K; ++k) {
    V v = (acc[0][k] + acc[1][k]) + (acc[2][k] + acc[3][k]);
    out[k] = LaneSum<T>(v) + tail[k];
  }
}

// Elements per chunk, at least; and at most this many chunks.
constexpr int64_t kChunkElements = 1 << 15;
constexpr int64_t kMaxChunks = 64;
// The backward's chunks have at least this many rows, so that their column
// partials (2 C doubles each) stay small next to x.
constexpr int64_t kMinChunkRows = 8;

// The row chunks of an (R, C) pass: fixed by the shape alone.
inline int64_t RowChunks(int64_t rows, int64_t cols, int64_t min_rows) {
  int64_t by_size = (rows * cols + kChunkElements - 1) / kChunkElements;
  int64_t by_rows = (rows + min_rows - 1) / min_rows;
  return std::max<int64_t>(1, std::min({by_rows, kMaxChunks, by_size}));
}

// Rows handled a pass at a time: each pass runs over the block's rows before
// the next pass starts, so the rows' reductions (and the scalar work between
// passes: tree sums, division, square root) overlap instead of waiting on
// one another, and each column partial is read and written once per block in
// the backward. Two rows: at [2048, 256] float32 on one core (AMD EPYC), the
// forward took about as long with blocks of 2, 4 or 8 rows and the backward
// 0.9x the time of 4 rows (whose pass B spills registers; 8 rows: 2.5x).
constexpr int64_t kRowBlock = 2;

// Rows [lo, hi) of the forward.
template <typename T>
void ForwardRows(const T* x, const T* scale, const T* bias, double eps, int64_t lo,
                 int64_t hi, int64_t C, T* y, T* mean, T* rstd) {
  using V = typename Vec<T>::V;
  const double inv_n = 1.0 / static_cast<double>(C);
  for (int64_t r0 = lo; r0 < hi; r0 += kRowBlock) {
    const int64_t nb = std::min(kRowBlock, hi - r0);
    T m0[kRowBlock], mh[kRowBlock], off[kRowBlock], rs[kRowBlock];
    for (int64_t i = 0; i < nb; ++i) {  // pass 1: a rough mean
      const T* xr = x + (r0 + i) * C;
      T s1;
      RowSums<T, 1>(
          C, [&](int64_t c, V* a) { a[0] += Load<T>(xr + c); },
          [&](int64_t c, T* a) { a[0] += xr[c]; }, &s1);
      m0[i] = static_cast<T>(static_cast<double>(s1) * inv_n);
    }
    for (int64_t i = 0; i < nb; ++i) {  // pass 2: the sums of d = x - m0 and d * d
      const T* xr = x + (r0 + i) * C;
      const T m = m0[i];
      const V mv = Splat<T>(m);
      T s2[2];
      RowSums<T, 2>(
          C,
          [&](int64_t c, V* a) {
            V d = Load<T>(xr + c) - mv;
            a[0] += d;
            a[1] += d * d;
          },
          [&](int64_t c, T* a) {
            T d = xr[c] - m;
            a[0] += d;
            a[1] += d * d;
          },
          s2);
      const double shift = static_cast<double>(s2[0]) * inv_n;
      const double var = std::max(static_cast<double>(s2[1]) * inv_n - shift * shift, 0.0);
      rs[i] = static_cast<T>(1.0 / std::sqrt(var + eps));
      // mean = m0 + shift as mh + ml: mh rounded to T, ml what mh lacks (T = float:
      // mu_hi - mh is exact in double; T = double: mh = mu_hi, ml = TwoSum's error).
      const double mu_hi = static_cast<double>(m) + shift;
      const double mu_lo = TwoSumError(static_cast<double>(m), shift, mu_hi);
      mh[i] = static_cast<T>(mu_hi);
      const double ml = (mu_hi - static_cast<double>(mh[i])) + mu_lo;
      off[i] = static_cast<T>(-ml * static_cast<double>(rs[i]));  // xhat = (x - mh) * rs + off
      mean[r0 + i] = mh[i];
      rstd[r0 + i] = rs[i];
    }
    for (int64_t i = 0; i < nb; ++i) {  // pass 3: y
      const T* __restrict xr = x + (r0 + i) * C;
      T* __restrict yr = y + (r0 + i) * C;
      const T a = mh[i], b = off[i], k = rs[i];
      for (int64_t c = 0; c < C; ++c) yr[c] = ((xr[c] - a) * k + b) * scale[c] + bias[c];
    }
  }
}

// The backward's per-row terms: dx = k * ((g - mg) - xhat * mgx), xhat = (x -
// mh) * rs + off (off = -ml * rs).
template <typename T>
struct RowTerms {
  T mh, off, rs, k, mg, mgx;
};

// Pass B over NB consecutive rows at once (x, dy and dx at their first row):
// dx, and dy * xhat and dy added into the column partials ps, pb row after row
// (the same sums whatever NB; each partial is read and written once per NB rows).
template <typename T, int NB>
void BackwardPassB(const RowTerms<T>* t, const T* __restrict x, const T* __restrict dy,
                   const T* __restrict scale, int64_t C, T* __restrict dx,
                   double* __restrict ps, double* __restrict pb) {
  T mh[NB], off[NB], rs[NB], k[NB], mg[NB], mgx[NB];
  for (int i = 0; i < NB; ++i) {
    mh[i] = t[i].mh, off[i] = t[i].off, rs[i] = t[i].rs;
    k[i] = t[i].k, mg[i] = t[i].mg, mgx[i] = t[i].mgx;
  }
  for (int64_t c = 0; c < C; ++c) {
    double s = ps[c], b = pb[c];
    for (int i = 0; i < NB; ++i) {
      const T xh = (x[i * C + c] - mh[i]) * rs[i] + off[i];
      const T gy = dy[i * C + c];
      const T g = gy * scale[c];
      dx[i * C + c] = k[i] * ((g - mg[i]) - xh * mgx[i]);
      s += static_cast<double>(gy * xh);
      b += static_cast<double>(gy);
    }
    ps[c] = s;
    pb[c] = b;
  }
}

// Rows [lo, hi) of the backward: dx, and dy * xhat and dy added into the
// chunk's column partials ps, pb (C doubles each), in row order.
template <typename T>
void BackwardRows(const T* x, const T* dy, const T* scale, const T* mean, const T* rstd,
                  int64_t lo, int64_t hi, int64_t C, T* dx, double* ps, double* pb) {
  using V = typename Vec<T>::V;
  const double inv_n = 1.0 / static_cast<double>(C);
  for (int64_t r0 = lo; r0 < hi; r0 += kRowBlock) {
    const int64_t nb = std::min(kRowBlock, hi - r0);
    RowTerms<T> t[kRowBlock];
    for (int64_t i = 0; i < nb; ++i) {  // pass A: sums of d = x - mh, g, g * d
      const int64_t r = r0 + i;
      const T* xr = x + r * C;
      const T* gr = dy + r * C;
      const T mh = mean[r], rs = rstd[r];
      const V mhv = Splat<T>(mh);
      T s[3];
      RowSums<T, 3>(
          C,
          [&](int64_t c, V* a) {
            V d = Load<T>(xr + c) - mhv;
            V g = Load<T>(gr + c) * Load<T>(scale + c);
            a[0] += d;
            a[1] += g;
            a[2] += g * d;
          },
          [&](int64_t c, T* a) {
            T d = xr[c] - mh;
            T g = gr[c] * scale[c];
            a[0] += d;
            a[1] += g;
            a[2] += g * d;
          },
          s);
      // The saved mean's low part, ml = sum(x - mh) / C; then sum(g * xhat) =
      // rs * sum(g * (d - ml)) = rs * (sum(g d) - ml sum(g)).
      const double ml = static_cast<double>(s[0]) * inv_n;
      const double sg = static_cast<double>(s[1]);
      // One feature: y = bias whatever x, so dx = 0 exactly (computed, it would be
      // the rounding of dy * scale, if contracted into an FMA, times 1/sqrt(eps)).
      t[i] = {mh, static_cast<T>(-ml * static_cast<double>(rs)), rs, C == 1 ? T(0) : rs,
              static_cast<T>(sg * inv_n),
              static_cast<T>(static_cast<double>(rs) * (static_cast<double>(s[2]) - ml * sg) *
                             inv_n)};
    }
    const int64_t at = r0 * C;
    if (nb == kRowBlock) {
      BackwardPassB<T, kRowBlock>(t, x + at, dy + at, scale, C, dx + at, ps, pb);
    } else {
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t ai = at + i * C;
        BackwardPassB<T, 1>(t + i, x + ai, dy + ai, scale, C, dx + ai, ps, pb);
      }
    }
  }
}

ffi::Error CheckRows(const char* name, ffi::Span<const int64_t> xd) {
  if (xd.size() != 2 || xd[0] < 1 || xd[1] < 1) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": expected x of shape (R >= 1, C >= 1)");
  }
  return ffi::Error::Success();
}

// x (R, C), scale, bias (C) -> y (R, C), mean, rstd (R).
template <ffi::DataType DT>
ffi::Error LayerNormForward(ffi::ThreadPool pool, ffi::Buffer<DT> x, ffi::Buffer<DT> scale,
                            ffi::Buffer<DT> bias, ffi::ResultBuffer<DT> y,
                            ffi::ResultBuffer<DT> mean, ffi::ResultBuffer<DT> rstd,
                            double epsilon) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions();
  if (ffi::Error e = CheckRows("layer_norm_forward", xd); e.failure()) return e;
  const int64_t R = xd[0], C = xd[1];
  if (static_cast<int64_t>(scale.element_count()) != C ||
      static_cast<int64_t>(bias.element_count()) != C) {
    return ffi::Error::InvalidArgument(
        "layer_norm_forward: expected scale and bias of C elements (x's last axis)");
  }
  const T* xp = x.typed_data();
  const T* sp = scale.typed_data();
  const T* bp = bias.typed_data();
  T* yp = y->typed_data();
  T* mp = mean->typed_data();
  T* rp = rstd->typed_data();
  const int64_t chunks = RowChunks(R, C, 1);
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(R, chunks, i, &lo, &hi);
    ForwardRows<T>(xp, sp, bp, epsilon, lo, hi, C, yp, mp, rp);
  });
  return ffi::Error::Success();
}

// x, dy (R, C), scale (C), mean, rstd (R) -> dx (R, C), dscale, dbias (C).
template <ffi::DataType DT>
ffi::Error LayerNormBackward(ffi::ThreadPool pool, ffi::Buffer<DT> x, ffi::Buffer<DT> dy,
                             ffi::Buffer<DT> scale, ffi::Buffer<DT> mean,
                             ffi::Buffer<DT> rstd, ffi::ResultBuffer<DT> dx,
                             ffi::ResultBuffer<DT> dscale, ffi::ResultBuffer<DT> dbias) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions(), gd = dy.dimensions();
  if (ffi::Error e = CheckRows("layer_norm_backward", xd); e.failure()) return e;
  const int64_t R = xd[0], C = xd[1];
  if (gd.size() != 2 || gd[0] != R || gd[1] != C ||
      static_cast<int64_t>(scale.element_count()) != C ||
      static_cast<int64_t>(mean.element_count()) != R ||
      static_cast<int64_t>(rstd.element_count()) != R) {
    return ffi::Error::InvalidArgument(
        "layer_norm_backward: expected dy of x's shape (R, C), scale of C elements and "
        "mean, rstd of R elements");
  }
  const T* xp = x.typed_data();
  const T* gp = dy.typed_data();
  const T* sp = scale.typed_data();
  const T* mp = mean.typed_data();
  const T* rp = rstd.typed_data();
  T* dxp = dx->typed_data();
  const int64_t chunks = RowChunks(R, C, kMinChunkRows);
  std::vector<double> partial(chunks * 2 * C, 0.0);
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(R, chunks, i, &lo, &hi);
    double* ps = partial.data() + i * 2 * C;
    BackwardRows<T>(xp, gp, sp, mp, rp, lo, hi, C, dxp, ps, ps + C);
  });
  T* dsp = dscale->typed_data();
  T* dbp = dbias->typed_data();
  for (int64_t c = 0; c < C; ++c) {
    double s = 0.0, b = 0.0;
    for (int64_t i = 0; i < chunks; ++i) {
      s += partial[i * 2 * C + c];
      b += partial[i * 2 * C + C + c];
    }
    dsp[c] = static_cast<T>(s);
    dbp[c] = static_cast<T>(b);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tunedjax

#define TJ_DEFINE_LN_FORWARD(NAME, DT)                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, tunedjax::LayerNormForward<DT>,       \
                                ffi::Ffi::Bind()                            \
                                    .Ctx<ffi::ThreadPool>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Attr<double>("epsilon"));

#define TJ_DEFINE_LN_BACKWARD(NAME, DT)                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, tunedjax::LayerNormBackward<DT>,      \
                                ffi::Ffi::Bind()                            \
                                    .Ctx<ffi::ThreadPool>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>());

TJ_DEFINE_LN_FORWARD(TjLayerNormForwardF32, ffi::F32)
TJ_DEFINE_LN_FORWARD(TjLayerNormForwardF64, ffi::F64)
TJ_DEFINE_LN_BACKWARD(TjLayerNormBackwardF32, ffi::F32)
TJ_DEFINE_LN_BACKWARD(TjLayerNormBackwardF64, ffi::F64)
