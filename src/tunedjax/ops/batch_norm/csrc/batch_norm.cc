// Batch norm's sums on channels-last data: XLA FFI handlers for tunedjax's
// `native` batch-norm kernel (autotune/_bn_native.py). x is seen as (R, C):
// R rows (every axis but the last, flattened) of C channels.
//
// batch_norm_stats:     x -> mean (C), var (C)
//   mean = sum(x) / R, var = sum((x - mean)^2) / R (biased)
// batch_norm_grad_sums: x, dy, mean -> sum(dy) (C), sum(dy * (x - mean)) (C)
//   (the two reductions of batch norm's backward).
//
// Only the reductions are here. The elementwise passes (the normalisation,
// dx) stay in XLA, which fuses them with their neighbours (the ReLU after
// each batch norm, its gradient, the padded copy a depthwise convolution
// makes); handlers that also normalised and formed dx were faster timed
// alone but level in the whole train steps, because their outputs must be
// materialised (BENCHMARKS.md, "Native batch norm").
//
// The statistics take one pass, shifted: the sums of d = x - shift and of
// d * d, shift being the first row, so a large mean does not cancel the
// variance away (E[x^2] - E[x]^2 would lose every digit of a float32
// variance whose mean is 1e4 times its spread; shifted, only the first row's
// distance from the mean enters). Every sum is accumulated in double,
// whatever T: a channel's sum runs over up to millions of rows (128x32x32 =
// 131072 in the demo network), where float32 lanes would lose about
// log2(rows) bits; double lanes cost little, since the passes are bound by
// memory, not arithmetic. For float32 input, x - shift is exact in double.
//
// Each loop runs over the channels innermost (contiguous, vectorised with no
// reassociation: each lane is its own channel, so no -ffast-math is needed).
// Rows are split into a fixed number of chunks that depends only on the
// shape, never on the thread count; each chunk's partial sums are added in
// chunk order, so results are bitwise the same from run to run.
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

// The statistics' one pass: per-channel sums of d = x - x[0] and d * d, in double
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

// The backward's one pass: per-channel sum(dy) and sum(dy * (x - mean)), in
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

// x (R, C) -> mean (C), var (C).
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

// x, dy (R, C), mean (C) -> sum(dy) (C), sum(dy * (x - mean)) (C).
template <ffi::DataType DT>
ffi::Error BatchNormGradSums(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                             ffi::Buffer<DT> dy, ffi::Buffer<DT> mean,
                             ffi::ResultBuffer<DT> sdy, ffi::ResultBuffer<DT> sdyc) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions(), gd = dy.dimensions();
  if (xd.size() != 2 || gd.size() != 2 || gd[0] != xd[0] || gd[1] != xd[1] ||
      static_cast<int64_t>(mean.element_count()) != xd[1] || xd[0] < 1) {
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
