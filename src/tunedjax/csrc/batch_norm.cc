// Batch norm on batch statistics, channels last: XLA FFI handlers for
// tunedjax's `native` batch-norm kernel (autotune/_bn_native.py).
//
// x is seen as (R, C): R rows (every axis but the last, flattened) of C
// channels. With n = R, per channel c:
//
// batch_norm_fwd: x, scale, bias -> y (R, C), mean (C), var (C)
//   mean = sum(x) / n, var = sum((x - mean)^2) / n (biased),
//   inv = 1 / sqrt(var + epsilon), y = (x - mean) * (scale * inv) + bias.
// batch_norm_bwd: x, dy, mean, var, scale, dmean, dvar -> dx, dscale, dbias
//   sdy = sum(dy), sdyxhat = sum(dy * (x - mean)) * inv, k = scale * inv,
//   dx = k * dy - (k * sdy - dmean) / n - (x - mean) * (k * inv * sdyxhat - 2 * dvar) / n,
//   dscale = sdyxhat, dbias = sdy
//   (the `fused` kernel's formula, the statistics' cotangents included).
//
// Statistics in one pass, shifted: the sums of d = x - shift and of d * d,
// shift being the first row, so a large mean does not cancel the variance
// away (E[x^2] - E[x]^2 would lose every digit of a float32 variance whose
// mean is 1e4 times its spread; shifted, only the first row's distance from
// the mean enters). Every sum over rows, the backward's two included, is
// accumulated in double, whatever T: a channel's sum runs over up to
// millions of rows (128x32x32 = 131072 in the demo network), where float32
// lanes would lose about log2(rows) bits; double lanes cost little here,
// since the passes are bound by memory, not arithmetic. For float32 input,
// x - shift is exact in double. Per-channel coefficients are computed in
// double and rounded to T once; the elementwise passes run in T lanes.
//
// Each loop runs over the channels innermost (contiguous, vectorised with
// no reassociation: each lane is its own channel, so no -ffast-math is
// needed). Rows are split into a fixed number of chunks that depends only on
// the shape, never on the thread count; each chunk's partial sums are added
// in chunk order, so results are bitwise the same from run to run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tj_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tunedjax {
namespace {

// Elements per chunk, at least; and at most this many chunks.
constexpr int64_t kChunkElements = 1 << 15;
constexpr int64_t kMaxChunks = 64;

// The row chunks of an (R, C) pass: fixed by the shape alone.
inline int64_t RowChunks(int64_t rows, int64_t channels) {
  int64_t by_size = (rows * channels + kChunkElements - 1) / kChunkElements;
  return std::max<int64_t>(1, std::min({rows, kMaxChunks, by_size}));
}

// Adds chunk partials (chunks x width, in chunk order) into out (width).
inline void AddPartials(const std::vector<double>& partial, int64_t chunks,
                        int64_t width, double* out) {
  std::fill(out, out + width, 0.0);
  for (int64_t i = 0; i < chunks; ++i) {
    const double* p = partial.data() + i * width;
    for (int64_t k = 0; k < width; ++k) out[k] += p[k];
  }
}

// The forward's pass 1: per-channel sums of d = x - x[0] and d * d, in double
// (sums[0:C] and sums[C:2C]), over `chunks` fixed row chunks added in order.
template <typename T>
void ShiftedSums(ffi::ThreadPool& pool, const T* xp, int64_t R, int64_t C,
                 double* sums) {
  const int64_t chunks = RowChunks(R, C);
  std::vector<double> partial(chunks * 2 * C);
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(R, chunks, i, &lo, &hi);
    double* s1 = partial.data() + i * 2 * C;
    double* s2 = s1 + C;
    std::fill(s1, s1 + 2 * C, 0.0);
    for (int64_t r = lo; r < hi; ++r) {
      const T* row = xp + r * C;
      for (int64_t c = 0; c < C; ++c) {
        double d = static_cast<double>(row[c]) - static_cast<double>(xp[c]);
        s1[c] += d;
        s2[c] += d * d;
      }
    }
  });
  AddPartials(partial, chunks, 2 * C, sums);
}

// The backward's pass 1: per-channel sum(dy) and sum(dy * (x - mean)), in
// double (sums[0:C] and sums[C:2C]), over fixed row chunks added in order.
template <typename T>
void GradSums(ffi::ThreadPool& pool, const T* xp, const T* gp, const T* mp,
              int64_t R, int64_t C, double* sums) {
  const int64_t chunks = RowChunks(R, C);
  std::vector<double> partial(chunks * 2 * C);
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(R, chunks, i, &lo, &hi);
    double* s1 = partial.data() + i * 2 * C;
    double* s2 = s1 + C;
    std::fill(s1, s1 + 2 * C, 0.0);
    for (int64_t r = lo; r < hi; ++r) {
      const T* row = xp + r * C;
      const T* grow = gp + r * C;
      for (int64_t c = 0; c < C; ++c) {
        double g = static_cast<double>(grow[c]);
        s1[c] += g;
        s2[c] += g * (static_cast<double>(row[c]) - static_cast<double>(mp[c]));
      }
    }
  });
  AddPartials(partial, chunks, 2 * C, sums);
}

template <ffi::DataType DT>
ffi::Error BatchNormFwd(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                        ffi::Buffer<DT> scale, ffi::Buffer<DT> bias,
                        ffi::ResultBuffer<DT> y, ffi::ResultBuffer<DT> mean,
                        ffi::ResultBuffer<DT> var, double epsilon) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions();
  if (xd.size() != 2 || scale.element_count() != xd[1] ||
      bias.element_count() != xd[1] || xd[0] < 1) {
    return ffi::Error::InvalidArgument(
        "batch_norm_fwd: expected x (R >= 1, C), scale (C), bias (C)");
  }
  const int64_t R = xd[0], C = xd[1];
  const T* xp = x.typed_data();
  const T* sp = scale.typed_data();
  const T* bp = bias.typed_data();
  T* yp = y->typed_data();
  const int64_t chunks = RowChunks(R, C);

  // Pass 1: shifted sums, in double.
  std::vector<double> sums(2 * C);
  ShiftedSums<T>(pool, xp, R, C, sums.data());

  // Per-channel coefficients, in double, rounded to T once.
  std::vector<T> m(C), k(C), b(C);
  T* mp = mean->typed_data();
  T* vp = var->typed_data();
  const double n = static_cast<double>(R);
  for (int64_t c = 0; c < C; ++c) {
    double md = sums[c] / n;
    double v = std::max(sums[C + c] / n - md * md, 0.0);
    // The variance's T value is what inv is taken of, as the reference does.
    T vt = static_cast<T>(v);
    double inv = 1.0 / std::sqrt(static_cast<double>(vt) + epsilon);
    m[c] = static_cast<T>(static_cast<double>(xp[c]) + md);
    k[c] = static_cast<T>(static_cast<double>(sp[c]) * inv);
    b[c] = bp[c];
    mp[c] = m[c];
    vp[c] = vt;
  }

  // Pass 2: y = (x - mean) * k + bias, in T lanes.
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(R, chunks, i, &lo, &hi);
    const T* mm = m.data();
    const T* kk = k.data();
    const T* bb = b.data();
    for (int64_t r = lo; r < hi; ++r) {
      const T* row = xp + r * C;
      T* out = yp + r * C;
      for (int64_t c = 0; c < C; ++c) out[c] = (row[c] - mm[c]) * kk[c] + bb[c];
    }
  });
  return ffi::Error::Success();
}

template <ffi::DataType DT>
ffi::Error BatchNormBwd(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                        ffi::Buffer<DT> dy, ffi::Buffer<DT> mean,
                        ffi::Buffer<DT> var, ffi::Buffer<DT> scale,
                        ffi::Buffer<DT> dmean, ffi::Buffer<DT> dvar,
                        ffi::ResultBuffer<DT> dx, ffi::ResultBuffer<DT> dscale,
                        ffi::ResultBuffer<DT> dbias, double epsilon) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions(), gd = dy.dimensions();
  if (xd.size() != 2 || gd.size() != 2 || gd[0] != xd[0] || gd[1] != xd[1] ||
      mean.element_count() != xd[1] || var.element_count() != xd[1] ||
      scale.element_count() != xd[1] || dmean.element_count() != xd[1] ||
      dvar.element_count() != xd[1] || xd[0] < 1) {
    return ffi::Error::InvalidArgument(
        "batch_norm_bwd: expected x, dy (R >= 1, C) and mean, var, scale, "
        "dmean, dvar (C)");
  }
  const int64_t R = xd[0], C = xd[1];
  const T* xp = x.typed_data();
  const T* gp = dy.typed_data();
  const T* mp = mean.typed_data();
  T* dxp = dx->typed_data();
  const int64_t chunks = RowChunks(R, C);

  // Pass 1: sum(dy) and sum(dy * (x - mean)), in double.
  std::vector<double> sums(2 * C);
  GradSums<T>(pool, xp, gp, mp, R, C, sums.data());

  // Per-channel coefficients of dx = a * dy - b - (x - mean) * g.
  std::vector<T> a(C), b(C), g(C);
  const T* vp = var.typed_data();
  const T* sp = scale.typed_data();
  const T* dmp = dmean.typed_data();
  const T* dvp = dvar.typed_data();
  T* dsp = dscale->typed_data();
  T* dbp = dbias->typed_data();
  const double n = static_cast<double>(R);
  for (int64_t c = 0; c < C; ++c) {
    double inv = 1.0 / std::sqrt(static_cast<double>(vp[c]) + epsilon);
    double kc = static_cast<double>(sp[c]) * inv;
    double sdy = sums[c], sdyxhat = sums[C + c] * inv;
    a[c] = static_cast<T>(kc);
    b[c] = static_cast<T>((kc * sdy - static_cast<double>(dmp[c])) / n);
    g[c] = static_cast<T>((kc * inv * sdyxhat - 2.0 * static_cast<double>(dvp[c])) / n);
    dsp[c] = static_cast<T>(sdyxhat);
    dbp[c] = static_cast<T>(sdy);
  }

  // Pass 2: dx, in T lanes.
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(R, chunks, i, &lo, &hi);
    const T* aa = a.data();
    const T* bb = b.data();
    const T* gg = g.data();
    for (int64_t r = lo; r < hi; ++r) {
      const T* row = xp + r * C;
      const T* grow = gp + r * C;
      T* out = dxp + r * C;
      for (int64_t c = 0; c < C; ++c) {
        out[c] = aa[c] * grow[c] - bb[c] - (row[c] - mp[c]) * gg[c];
      }
    }
  });
  return ffi::Error::Success();
}

// The statistics alone (the `native_stats` kernel leaves the elementwise
// passes to XLA, which fuses them with their neighbours):
// x -> mean (C), var (C).
template <ffi::DataType DT>
ffi::Error BatchNormStats(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                          ffi::ResultBuffer<DT> mean, ffi::ResultBuffer<DT> var) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] < 1) {
    return ffi::Error::InvalidArgument("batch_norm_stats: expected x (R >= 1, C)");
  }
  const int64_t R = xd[0], C = xd[1];
  const T* xp = x.typed_data();
  std::vector<double> sums(2 * C);
  ShiftedSums<T>(pool, xp, R, C, sums.data());
  const double n = static_cast<double>(R);
  T* mp = mean->typed_data();
  T* vp = var->typed_data();
  for (int64_t c = 0; c < C; ++c) {
    double md = sums[c] / n;
    mp[c] = static_cast<T>(static_cast<double>(xp[c]) + md);
    vp[c] = static_cast<T>(std::max(sums[C + c] / n - md * md, 0.0));
  }
  return ffi::Error::Success();
}

// The backward's two sums alone: x, dy (R, C), mean (C) -> sum(dy) (C),
// sum(dy * (x - mean)) (C).
template <ffi::DataType DT>
ffi::Error BatchNormGradSums(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                             ffi::Buffer<DT> dy, ffi::Buffer<DT> mean,
                             ffi::ResultBuffer<DT> sdy, ffi::ResultBuffer<DT> sdyc) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions(), gd = dy.dimensions();
  if (xd.size() != 2 || gd.size() != 2 || gd[0] != xd[0] || gd[1] != xd[1] ||
      mean.element_count() != xd[1] || xd[0] < 1) {
    return ffi::Error::InvalidArgument(
        "batch_norm_grad_sums: expected x, dy (R >= 1, C) and mean (C)");
  }
  const int64_t R = xd[0], C = xd[1];
  std::vector<double> sums(2 * C);
  GradSums<T>(pool, x.typed_data(), dy.typed_data(), mean.typed_data(), R, C, sums.data());
  T* s1 = sdy->typed_data();
  T* s2 = sdyc->typed_data();
  for (int64_t c = 0; c < C; ++c) {
    s1[c] = static_cast<T>(sums[c]);
    s2[c] = static_cast<T>(sums[C + c]);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tunedjax

#define TJ_DEFINE_FWD(NAME, DT)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, tunedjax::BatchNormFwd<DT>,           \
                                ffi::Ffi::Bind()                            \
                                    .Ctx<ffi::ThreadPool>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Attr<double>("epsilon"));

#define TJ_DEFINE_BWD(NAME, DT)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, tunedjax::BatchNormBwd<DT>,           \
                                ffi::Ffi::Bind()                            \
                                    .Ctx<ffi::ThreadPool>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Attr<double>("epsilon"));

TJ_DEFINE_FWD(TjBatchNormFwdF32, ffi::F32)
TJ_DEFINE_FWD(TjBatchNormFwdF64, ffi::F64)
TJ_DEFINE_BWD(TjBatchNormBwdF32, ffi::F32)
TJ_DEFINE_BWD(TjBatchNormBwdF64, ffi::F64)

#define TJ_DEFINE_STATS(NAME, DT)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, tunedjax::BatchNormStats<DT>,         \
                                ffi::Ffi::Bind()                            \
                                    .Ctx<ffi::ThreadPool>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>());

#define TJ_DEFINE_GRAD_SUMS(NAME, DT)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, tunedjax::BatchNormGradSums<DT>,      \
                                ffi::Ffi::Bind()                            \
                                    .Ctx<ffi::ThreadPool>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>());

TJ_DEFINE_STATS(TjBatchNormStatsF32, ffi::F32)
TJ_DEFINE_STATS(TjBatchNormStatsF64, ffi::F64)
TJ_DEFINE_GRAD_SUMS(TjBatchNormGradSumsF32, ffi::F32)
TJ_DEFINE_GRAD_SUMS(TjBatchNormGradSumsF64, ffi::F64)
