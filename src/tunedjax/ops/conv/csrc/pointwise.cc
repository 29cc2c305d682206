// Pointwise (1x1) convolutions on channels-last data as row-major matrix
// products: XLA FFI handlers for tunedjax's `matmul_1x1_native` conv kernel
// (autotune/_conv_native_1x1.py). Rows are the N*H*W positions.
//
// pointwise_matmul: x (R, I), w (I, O) -> y (R, O)
//   y[r, o] = sum_i x[r, i] * w[i, o]
//   (a 1x1 conv's forward, and its input gradient with w transposed)
// pointwise_wgrad:  x (R, I), g (R, O) -> out (I, O)
//   out[i, o] = sum_r x[r, i] * g[r, o]
//   (a 1x1 conv's weight gradient: both operands read row by row, as they lie
//   in memory, so nothing is transposed to (C, N*H*W) first)
//
// Both vectorise over the output channels o with GCC vector extensions
// (64-byte vectors: 16 floats or 8 doubles, which clang accepts too), and keep
// a tile of rows (matmul) or input channels (wgrad) times 2-4 vectors of
// output channels in registers. No fast-math: each output is one sum in a
// fixed order (matmul: over i in order; wgrad: over the rows of each chunk in
// order, then the chunks' partial sums in chunk order), so results are
// bitwise the same from run to run whatever the thread count.
//
// Accumulation is in the operands' dtype. For float32 the matmul's sums run
// over the input channels (at most a few thousand terms), as XLA's dot does.
// The weight gradient's sums run over every row (N*H*W, 131072 for a batch of
// 128 at 32x32), so they are split into a fixed number of chunks of rows
// (up to 64, about R/64 rows each, see WgradChunks): each float32 lane adds at
// most a few thousand products, then the chunks' partials are added in chunk
// order. That bounds the rounding like a blocked float32 dot (XLA's) without
// halving the vector width that double accumulators would cost.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tj_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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
inline void Store(T* p, typename Vec<T>::V v) {
  std::memcpy(p, &v, sizeof(v));
}

// Loads n < L values and zeros for the rest.
template <typename T>
inline typename Vec<T>::V LoadPart(const T* p, int64_t n) {
  typename Vec<T>::V v = {};
  std::memcpy(&v, p, sizeof(T) * n);
  return v;
}

// ---------------------------------------------------------------------------
// pointwise_matmul

// Rows of a parallel chunk handled together, so that their inputs stay in
// cache while every block of output channels is computed.
constexpr int64_t kRowBlock = 64;

// w (I, O) packed into blocks of NB = NV * L output channels, zero-padded:
// packed[(b * I + i) * NB + j] = w[i, b * NB + j].
template <typename T>
std::vector<T> PackW(const T* w, int64_t I, int64_t O, int64_t NB) {
  int64_t blocks = (O + NB - 1) / NB;
  std::vector<T> packed(blocks * I * NB, T(0));
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t o0 = b * NB, n = std::min(NB, O - o0);
    for (int64_t i = 0; i < I; ++i) {
      std::memcpy(&packed[(b * I + i) * NB], w + i * O + o0, sizeof(T) * n);
    }
  }
  return packed;
}

// y[r, o0:o0+ncols] for MR rows from x (ldx = I) and one packed block of w.
template <typename T, int MR, int NV>
inline void MatmulTile(const T* x, int64_t I, const T* wb, T* y, int64_t O,
                       int64_t ncols) {
  using V = typename Vec<T>::V;
  constexpr int L = Vec<T>::L;
  V acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = V{};
  for (int64_t i = 0; i < I; ++i) {
    V wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = Load<T>(wb + i * NV * L + v * L);
    for (int m = 0; m < MR; ++m) {
      T a = x[m * I + i];
      for (int v = 0; v < NV; ++v) acc[m][v] += a * wv[v];
    }
  }
  for (int m = 0; m < MR; ++m) {
    T* yr = y + m * O;
    if (ncols == NV * L) {
      for (int v = 0; v < NV; ++v) Store<T>(yr + v * L, acc[m][v]);
    } else {
      T tmp[NV * L];
      for (int v = 0; v < NV; ++v) Store<T>(tmp + v * L, acc[m][v]);
      std::memcpy(yr, tmp, sizeof(T) * ncols);
    }
  }
}

template <typename T, int MR, int NV>
void MatmulRows(const T* x, const T* packed, T* y, int64_t I, int64_t O,
                int64_t lo, int64_t hi) {
  constexpr int64_t NB = NV * Vec<T>::L;
  int64_t blocks = (O + NB - 1) / NB;
  for (int64_t r0 = lo; r0 < hi; r0 += kRowBlock) {
    int64_t r1 = std::min(hi, r0 + kRowBlock);
    for (int64_t b = 0; b < blocks; ++b) {
      const T* wb = packed + b * I * NB;
      int64_t o0 = b * NB, ncols = std::min(NB, O - o0);
      int64_t r = r0;
      for (; r + MR <= r1; r += MR)
        MatmulTile<T, MR, NV>(x + r * I, I, wb, y + r * O + o0, O, ncols);
      for (; r < r1; ++r)
        MatmulTile<T, 1, NV>(x + r * I, I, wb, y + r * O + o0, O, ncols);
    }
  }
}

template <typename T, int MR, int NV>
void MatmulAll(ffi::ThreadPool& pool, const T* x, const T* w, T* y, int64_t R,
               int64_t I, int64_t O) {
  std::vector<T> packed = PackW<T>(w, I, O, NV * Vec<T>::L);
  // Each output is computed by one chunk, so the chunk count only balances
  // the work: about 256 rows per chunk, at most 64 chunks.
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(64, R / 256));
  const T* pp = packed.data();
  parallel_for(pool, chunks, [&](int64_t c) {
    int64_t lo, hi;
    split_range(R, chunks, c, &lo, &hi);
    MatmulRows<T, MR, NV>(x, pp, y, I, O, lo, hi);
  });
}

template <ffi::DataType DT>
ffi::Error PointwiseMatmul(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                           ffi::Buffer<DT> w, ffi::ResultBuffer<DT> y) {
  using T = ffi::NativeType<DT>;
  constexpr int L = Vec<T>::L;
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || wd[0] != xd[1] ||
      yd[0] != xd[0] || yd[1] != wd[1]) {
    return ffi::Error::InvalidArgument(
        "pointwise_matmul: expected x (R, I), w (I, O), y (R, O)");
  }
  int64_t R = xd[0], I = xd[1], O = wd[1];
  const T* xp = x.typed_data();
  const T* wp = w.typed_data();
  T* yp = y->typed_data();
  if (R == 0 || O == 0) return ffi::Error::Success();
  if (I == 0) {
    std::memset(yp, 0, sizeof(T) * R * O);
    return ffi::Error::Success();
  }
  // Register tiles: MR rows x NV vectors, about 24 accumulators.
  if (O > 2 * L) {
    MatmulAll<T, 6, 4>(pool, xp, wp, yp, R, I, O);
  } else if (O > L) {
    MatmulAll<T, 12, 2>(pool, xp, wp, yp, R, I, O);
  } else {
    MatmulAll<T, 16, 1>(pool, xp, wp, yp, R, I, O);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// pointwise_wgrad

constexpr int64_t kWgradRowBlock = 128;
constexpr int64_t kWgradMaxChunks = 64;
constexpr int64_t kWgradMinRows = 256;
constexpr int64_t kWgradMaxPartial = int64_t{1} << 22;  // elements, all chunks

// The number of row chunks: it depends on the shapes only (never on threads),
// so the order of every sum is fixed.
inline int64_t WgradChunks(int64_t R, int64_t I, int64_t O) {
  int64_t chunks = std::min(kWgradMaxChunks, R / kWgradMinRows);
  chunks = std::min(chunks, kWgradMaxPartial / std::max<int64_t>(1, I * O));
  return std::max<int64_t>(1, chunks);
}

// acc[m, o0:o0+ncols] += sum over rows [r0, r1) of x[r, i0 + m] * g[r, o0:...]
// for MI input channels; acc rows have stride O.
template <typename T, int MI, int NV>
inline void WgradTile(const T* x, int64_t I, const T* g, int64_t O,
                      int64_t r0, int64_t r1, T* acc, int64_t ncols) {
  using V = typename Vec<T>::V;
  constexpr int L = Vec<T>::L;
  V a[MI][NV];
  bool full = ncols == NV * L;
  for (int m = 0; m < MI; ++m) {
    for (int v = 0; v < NV; ++v) {
      int64_t n = std::min<int64_t>(L, ncols - v * L);
      a[m][v] = full ? Load<T>(acc + m * O + v * L)
                     : (n > 0 ? LoadPart<T>(acc + m * O + v * L, n) : V{});
    }
  }
  if (full) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * I;
      const T* gr = g + r * O;
      V gv[NV];
      for (int v = 0; v < NV; ++v) gv[v] = Load<T>(gr + v * L);
      for (int m = 0; m < MI; ++m) {
        T s = xr[m];
        for (int v = 0; v < NV; ++v) a[m][v] += s * gv[v];
      }
    }
  } else {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * I;
      const T* gr = g + r * O;
      V gv[NV];
      for (int v = 0; v < NV; ++v) {
        int64_t n = std::min<int64_t>(L, ncols - v * L);
        gv[v] = n >= L ? Load<T>(gr + v * L) : (n > 0 ? LoadPart<T>(gr + v * L, n) : V{});
      }
      for (int m = 0; m < MI; ++m) {
        T s = xr[m];
        for (int v = 0; v < NV; ++v) a[m][v] += s * gv[v];
      }
    }
  }
  for (int m = 0; m < MI; ++m) {
    T tmp[NV * L];
    for (int v = 0; v < NV; ++v) Store<T>(tmp + v * L, a[m][v]);
    std::memcpy(acc + m * O, tmp, sizeof(T) * ncols);
  }
}

// partial (I, O) = sum over rows [lo, hi) of x[r, :]^T g[r, :], rows in order.
template <typename T, int MI, int NV>
void WgradRows(const T* x, const T* g, T* partial, int64_t I, int64_t O,
               int64_t lo, int64_t hi) {
  constexpr int64_t NB = NV * Vec<T>::L;
  std::memset(partial, 0, sizeof(T) * I * O);
  for (int64_t r0 = lo; r0 < hi; r0 += kWgradRowBlock) {
    int64_t r1 = std::min(hi, r0 + kWgradRowBlock);
    for (int64_t o0 = 0; o0 < O; o0 += NB) {
      int64_t ncols = std::min(NB, O - o0);
      int64_t i = 0;
      for (; i + MI <= I; i += MI)
        WgradTile<T, MI, NV>(x + i, I, g + o0, O, r0, r1, partial + i * O + o0, ncols);
      for (; i < I; ++i)
        WgradTile<T, 1, NV>(x + i, I, g + o0, O, r0, r1, partial + i * O + o0, ncols);
    }
  }
}

template <typename T, int MI, int NV>
void WgradAll(ffi::ThreadPool& pool, const T* x, const T* g, T* out, int64_t R,
              int64_t I, int64_t O) {
  int64_t per = I * O;
  int64_t chunks = WgradChunks(R, I, O);
  if (chunks == 1) {
    WgradRows<T, MI, NV>(x, g, out, I, O, 0, R);
    return;
  }
  std::vector<T> partial(chunks * per);
  T* pp = partial.data();
  parallel_for(pool, chunks, [&](int64_t c) {
    int64_t lo, hi;
    split_range(R, chunks, c, &lo, &hi);
    WgradRows<T, MI, NV>(x, g, pp + c * per, I, O, lo, hi);
  });
  // The chunks' partial sums, added in chunk order; split over threads by
  // output element (each element's sum is still in chunk order).
  int64_t parts = std::max<int64_t>(1, std::min<int64_t>(16, per / 4096));
  parallel_for(pool, parts, [&](int64_t p) {
    int64_t lo, hi;
    split_range(per, parts, p, &lo, &hi);
    std::memcpy(out + lo, pp + lo, sizeof(T) * (hi - lo));
    for (int64_t c = 1; c < chunks; ++c) {
      const T* src = pp + c * per;
      for (int64_t k = lo; k < hi; ++k) out[k] += src[k];
    }
  });
}

template <ffi::DataType DT>
ffi::Error PointwiseWgrad(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                          ffi::Buffer<DT> g, ffi::ResultBuffer<DT> out) {
  using T = ffi::NativeType<DT>;
  constexpr int L = Vec<T>::L;
  auto xd = x.dimensions(), gd = g.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || gd.size() != 2 || od.size() != 2 || gd[0] != xd[0] ||
      od[0] != xd[1] || od[1] != gd[1]) {
    return ffi::Error::InvalidArgument(
        "pointwise_wgrad: expected x (R, I), g (R, O), out (I, O)");
  }
  int64_t R = xd[0], I = xd[1], O = gd[1];
  T* op = out->typed_data();
  if (I == 0 || O == 0) return ffi::Error::Success();
  if (R == 0) {
    std::memset(op, 0, sizeof(T) * I * O);
    return ffi::Error::Success();
  }
  // Register tiles: MI input channels x NV vectors of output channels.
  if (O > L) {
    WgradAll<T, 8, 2>(pool, x.typed_data(), g.typed_data(), op, R, I, O);
  } else {
    WgradAll<T, 12, 1>(pool, x.typed_data(), g.typed_data(), op, R, I, O);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tunedjax

TJ_DEFINE_BINARY(TjPointwiseMatmulF32, PointwiseMatmul, ffi::F32, )
TJ_DEFINE_BINARY(TjPointwiseMatmulF64, PointwiseMatmul, ffi::F64, )
TJ_DEFINE_BINARY(TjPointwiseWgradF32, PointwiseWgrad, ffi::F32, )
TJ_DEFINE_BINARY(TjPointwiseWgradF64, PointwiseWgrad, ffi::F64, )
