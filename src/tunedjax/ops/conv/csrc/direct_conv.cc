// Dense (one group) 2-D convolutions with a small window, channels last:
// XLA FFI handlers for tunedjax's `direct_native` conv kernel
// (autotune/_conv_native_direct.py).
//
// Positions follow lax.conv_general_dilated: output index o and window index
// k read the lhs-dilated, padded input at p = o * stride + k * rhs_dilation
// (padded coordinates); that is input row i = (p - pad_lo) / lhs_dilation
// when p - pad_lo is >= 0, divisible by lhs_dilation and i < size, and a
// zero elsewhere. Both handlers first copy the input into that padded,
// lhs-dilated coordinate system (one zero-filled copy, in parallel), so the
// inner loops read without bounds checks; rows that are all zeros (padding,
// lhs dilation) are flagged and skipped.
//
// direct_conv:  x (N, H, W, CI), w (KH, KW, CI, CO) -> y (N, OH, OW, CO)
//   y[n, oh, ow, co] = sum_{kh, kw, ci} xp[n, oh*s + kh*rd, ow*s + kw*rd, ci]
//                                       * w[kh, kw, ci, co]
//   A register tile of P output pixels x CB output channels (GCC vector
//   extensions, 64-byte vectors), broadcast-FMA over (kh, kw, ci), the
//   weights packed per CB-channel block (zero-padded past CO). The sum runs
//   in the dtype (float32 lanes per output channel), in a fixed order: a
//   partial sum per tap (or per few taps, at least kFlushProducts products),
//   the partials added in tap order, as XLA's own convolution blocks its sum.
//
// direct_wgrad: x (C, H, W, B), g (C, GH, GW, F) -> out (PH, PW, B, F)
//   out[ph, pw, b, f] = sum_{c, gh, gw} xp[c, ph*s + gh*rd, pw*s + gw*rd, b]
//                                       * g[c, gh, gw, f]
//   The weight gradient of a dense conv (x the input with C = batch, B = in
//   channels; g the output gradient with F = out channels; the output
//   positions are the kernel taps), or any conv with few output positions
//   and a large window. A register tile of MB (tap-column, b) pairs x FB
//   output channels accumulates one image's GH*GW products in the dtype;
//   each image's tile is then added into a double accumulator, and the
//   fixed image chunks' double partials are added in chunk order, then
//   rounded once: the reduction runs over N*GH*GW products (131072 for a
//   batch of 128 at 32x32), too long for float32 alone.
//
// No fast-math: vectorised over the output channel dimension only, so no sum
// is reassociated. Work is split into a fixed number of chunks whatever the
// thread count, so results are bitwise reproducible.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "tj_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tunedjax {
namespace {

constexpr int kVectorBytes = 64;
// The forward adds its products in partial sums of at least this many (whole
// taps), then adds the partials: one float sequence over all KH*KW*CI
// products lost up to 6x more digits than XLA's blocked sum against float64
// at 3x3x512 (the tuner's accuracy rule allows 3x).
constexpr int64_t kFlushProducts = 64;

template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(kVectorBytes)));
  static constexpr int kLanes = kVectorBytes / sizeof(T);
};

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
inline void store(void* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}

struct Axis {
  int64_t size, stride, pad, lhs_dil, rhs_dil;
};

// Input index of padded coordinate p, or -1 for a zero.
inline int64_t source(int64_t p, const Axis& a) {
  int64_t v = p - a.pad;
  if (v < 0 || v % a.lhs_dil != 0) return -1;
  v /= a.lhs_dil;
  return v < a.size ? v : -1;
}

// xp[n, hp, wp, :] = x at (source(hp), source(wp)) or zero, hp < HP, wp < WP.
// zero_row[n * HP + hp] = 1 where the whole row is zero.
template <typename T>
void PadCopy(ffi::ThreadPool& pool, const T* x, int64_t N, const Axis& ah,
             const Axis& aw, int64_t C, int64_t HP, int64_t WP, T* xp,
             uint8_t* zero_row) {
  int64_t rows = N * HP;
  int64_t chunks = std::min<int64_t>(rows, 64);
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(rows, chunks, i, &lo, &hi);
    for (int64_t r = lo; r < hi; ++r) {
      int64_t n = r / HP, hp = r % HP;
      T* out = xp + r * WP * C;
      int64_t ih = source(hp, ah);
      zero_row[r] = ih < 0;
      if (ih < 0) {
        std::memset(out, 0, sizeof(T) * WP * C);
        continue;
      }
      const T* in = x + (n * ah.size + ih) * aw.size * C;
      for (int64_t wp = 0; wp < WP; ++wp) {
        int64_t iw = source(wp, aw);
        if (iw < 0) {
          std::memset(out + wp * C, 0, sizeof(T) * C);
        } else {
          std::memcpy(out + wp * C, in + iw * C, sizeof(T) * C);
        }
      }
    }
  });
}

// ---------------------------------------------------------------- forward --

template <typename T, int P, int NV>
struct ConvTile {
  using V = typename Vec<T>::type;
  static constexpr int kLanes = Vec<T>::kLanes;
  static constexpr int CB = NV * kLanes;

  // One tile: output pixels ow0 .. ow0+P-1 of row (n, oh), channel block cob.
  static void Run(const T* xp, const uint8_t* zero_row, const T* wpack,
                  T* y, int64_t n, int64_t oh, int64_t ow0, int64_t cob,
                  int64_t HP, int64_t WP, int64_t CI, int64_t CO, int64_t KH,
                  int64_t KW, int64_t OW, int64_t sh, int64_t sw, int64_t rh,
                  int64_t rw) {
    V acc[P][NV], total[P][NV];
    for (int j = 0; j < P; ++j)
      for (int v = 0; v < NV; ++v) acc[j][v] = total[j][v] = V{};
    const int64_t xstep = sw * CI;  // from one output pixel's input to the next
    int64_t pending = 0;  // products in acc since it was last added to total
    for (int64_t kh = 0; kh < KH; ++kh) {
      int64_t hp = oh * sh + kh * rh;
      if (zero_row[n * HP + hp]) continue;
      const T* xr = xp + ((n * HP + hp) * WP + ow0 * sw) * CI;
      for (int64_t kw = 0; kw < KW; ++kw) {
        const T* xk = xr + kw * rw * CI;
        const T* wk = wpack + ((cob * KH + kh) * KW + kw) * CI * CB;
        for (int64_t ci = 0; ci < CI; ++ci) {
          V w[NV];
          for (int v = 0; v < NV; ++v) w[v] = load<V>(wk + ci * CB + v * kLanes);
          for (int j = 0; j < P; ++j) {
            T xv = xk[j * xstep + ci];
            for (int v = 0; v < NV; ++v) acc[j][v] += xv * w[v];
          }
        }
        pending += CI;
        if (pending >= kFlushProducts) {  // a partial sum per tap or taps
          for (int j = 0; j < P; ++j)
            for (int v = 0; v < NV; ++v) {
              total[j][v] += acc[j][v];
              acc[j][v] = V{};
            }
          pending = 0;
        }
      }
    }
    for (int j = 0; j < P; ++j)
      for (int v = 0; v < NV; ++v) acc[j][v] += total[j][v];
    int64_t co0 = cob * CB;
    int64_t ncols = std::min<int64_t>(CB, CO - co0);
    int64_t npix = std::min<int64_t>(P, OW - ow0);
    for (int j = 0; j < npix; ++j) {
      T* yp = y + (ow0 + j) * CO + co0;
      if (ncols == CB) {
        for (int v = 0; v < NV; ++v) store(yp + v * kLanes, acc[j][v]);
      } else {
        T tmp[CB];
        for (int v = 0; v < NV; ++v) store(tmp + v * kLanes, acc[j][v]);
        std::memcpy(yp, tmp, sizeof(T) * ncols);
      }
    }
  }
};

template <typename T, int P, int NV>
void ConvAll(ffi::ThreadPool& pool, const T* x, const T* w, T* y, int64_t N,
             const Axis& ah, const Axis& aw, int64_t CI, int64_t KH,
             int64_t KW, int64_t CO, int64_t OH, int64_t OW) {
  using Tile = ConvTile<T, P, NV>;
  constexpr int CB = Tile::CB;
  int64_t cobs = (CO + CB - 1) / CB;
  // Weights packed as (cob, KH, KW, CI, CB), zero past CO.
  std::vector<T> wpack(cobs * KH * KW * CI * CB, T(0));
  for (int64_t cob = 0; cob < cobs; ++cob)
    for (int64_t t = 0; t < KH * KW * CI; ++t) {
      int64_t n = std::min<int64_t>(CB, CO - cob * CB);
      std::memcpy(&wpack[(cob * KH * KW * CI + t) * CB], w + t * CO + cob * CB,
                  sizeof(T) * n);
    }
  // The padded input covers whole tiles: OW rounded up to P pixels.
  int64_t tiles = (OW + P - 1) / P;
  int64_t HP = (OH - 1) * ah.stride + (KH - 1) * ah.rhs_dil + 1;
  int64_t WP = (tiles * P - 1) * aw.stride + (KW - 1) * aw.rhs_dil + 1;
  std::vector<T> xp(N * HP * WP * CI);
  std::vector<uint8_t> zero_row(N * HP);
  PadCopy<T>(pool, x, N, ah, aw, CI, HP, WP, xp.data(), zero_row.data());
  int64_t rows = N * OH;
  int64_t chunks = std::min<int64_t>(rows, 64);
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(rows, chunks, i, &lo, &hi);
    for (int64_t r = lo; r < hi; ++r) {
      int64_t n = r / OH, oh = r % OH;
      T* yr = y + r * OW * CO;
      for (int64_t cob = 0; cob < cobs; ++cob)
        for (int64_t t = 0; t < tiles; ++t)
          Tile::Run(xp.data(), zero_row.data(), wpack.data(), yr, n, oh, t * P,
                    cob, HP, WP, CI, CO, KH, KW, OW, ah.stride, aw.stride,
                    ah.rhs_dil, aw.rhs_dil);
    }
  });
}

template <ffi::DataType DT>
ffi::Error DirectConv(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                      ffi::Buffer<DT> w, ffi::ResultBuffer<DT> y,
                      int64_t stride_h, int64_t stride_w, int64_t pad_h,
                      int64_t pad_w, int64_t lhs_dil_h, int64_t lhs_dil_w,
                      int64_t rhs_dil_h, int64_t rhs_dil_w) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 4 || wd.size() != 4 || yd.size() != 4 || wd[2] != xd[3] ||
      yd[3] != wd[3] || yd[0] != xd[0]) {
    return ffi::Error::InvalidArgument(
        "direct_conv: expected x (N, H, W, CI), w (KH, KW, CI, CO), "
        "y (N, OH, OW, CO)");
  }
  Axis ah{xd[1], stride_h, pad_h, lhs_dil_h, rhs_dil_h};
  Axis aw{xd[2], stride_w, pad_w, lhs_dil_w, rhs_dil_w};
  int64_t N = xd[0], CI = xd[3], KH = wd[0], KW = wd[1], CO = wd[3];
  int64_t OH = yd[1], OW = yd[2];
  if (N * OH * OW * CO == 0) return ffi::Error::Success();
  constexpr int L = Vec<T>::kLanes;
  const T* xp = x.typed_data();
  const T* wp = w.typed_data();
  T* yp = y->typed_data();
  if (CO > 2 * L) {  // wide: 6 pixels x 4 vectors (24 accumulators)
    ConvAll<T, 6, 4>(pool, xp, wp, yp, N, ah, aw, CI, KH, KW, CO, OH, OW);
  } else if (CO > L) {  // 8 pixels x 2 vectors
    ConvAll<T, 8, 2>(pool, xp, wp, yp, N, ah, aw, CI, KH, KW, CO, OH, OW);
  } else {  // narrow: 12 pixels x 1 vector
    ConvAll<T, 12, 1>(pool, xp, wp, yp, N, ah, aw, CI, KH, KW, CO, OH, OW);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------- weight grad --

template <typename T, int MB, int NV>
struct WgradTile {
  using V = typename Vec<T>::type;
  static constexpr int kLanes = Vec<T>::kLanes;
  static constexpr int FB = NV * kLanes;

  // Adds one image's products for output row ph, the MB (pw, b) pairs whose
  // offsets into a padded input row are off[m], channel block f0, into
  // dacc[m][FB] (double).
  static void Run(const T* xc, const uint8_t* zero_c, const T* gc,
                  const int64_t* off, int64_t ph, int64_t WP, int64_t B,
                  int64_t GH, int64_t GW, int64_t FG, int64_t sh, int64_t rh,
                  int64_t rw, double* dacc) {
    V acc[MB][NV];
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = V{};
    const int64_t xstep = rw * B;
    for (int64_t gh = 0; gh < GH; ++gh) {
      int64_t hp = ph * sh + gh * rh;
      if (zero_c[hp]) continue;
      const T* xr = xc + hp * WP * B;
      const T* gr = gc + gh * GW * FG;
      for (int64_t gw = 0; gw < GW; ++gw) {
        V g[NV];
        for (int v = 0; v < NV; ++v) g[v] = load<V>(gr + gw * FG + v * kLanes);
        const T* xw = xr + gw * xstep;
        for (int m = 0; m < MB; ++m) {
          T xv = xw[off[m]];
          for (int v = 0; v < NV; ++v) acc[m][v] += xv * g[v];
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      T tmp[FB];
      for (int v = 0; v < NV; ++v) store(tmp + v * kLanes, acc[m][v]);
      for (int k = 0; k < FB; ++k) dacc[m * FB + k] += static_cast<double>(tmp[k]);
    }
  }
};

template <typename T, int MB, int NV>
void WgradAll(ffi::ThreadPool& pool, const T* x, const T* g, T* out, int64_t C,
              const Axis& ah, const Axis& aw, int64_t B, int64_t GH,
              int64_t GW, int64_t F, int64_t PH, int64_t PW) {
  using Tile = WgradTile<T, MB, NV>;
  constexpr int FB = Tile::FB;
  int64_t HP = (PH - 1) * ah.stride + (GH - 1) * ah.rhs_dil + 1;
  int64_t WP = (PW - 1) * aw.stride + (GW - 1) * aw.rhs_dil + 1;
  std::vector<T> xp(C * HP * WP * B);
  std::vector<uint8_t> zero_row(C * HP);
  PadCopy<T>(pool, x, C, ah, aw, B, HP, WP, xp.data(), zero_row.data());
  // The (pw, b) pairs, in groups of MB (the last group repeats its first
  // pair; the repeats are computed and dropped).
  int64_t pairs = PW * B;
  int64_t groups = (pairs + MB - 1) / MB;
  std::vector<int64_t> off(groups * MB), pw_of(groups * MB), b_of(groups * MB);
  for (int64_t k = 0; k < groups * MB; ++k) {
    int64_t q = k < pairs ? k : (k / MB) * MB;
    pw_of[k] = q / B;
    b_of[k] = q % B;
    off[k] = pw_of[k] * aw.stride * B + b_of[k];
  }
  int64_t fbs = (F + FB - 1) / FB, FG = fbs * FB;
  bool pad_f = FG != F;
  // Partials per fixed image chunk, in double: (PH, groups, fbs, MB, FB).
  int64_t per = PH * groups * fbs * MB * FB;
  const int64_t budget = int64_t(64) << 20;  // bytes of partials at most
  int64_t chunks = std::max<int64_t>(
      1, std::min<int64_t>({C, 16, budget / (per * int64_t(sizeof(double)))}));
  std::vector<double> partial(chunks * per, 0.0);
  parallel_for(pool, chunks, [&](int64_t i) {
    int64_t lo, hi;
    split_range(C, chunks, i, &lo, &hi);
    double* dp = partial.data() + i * per;
    std::vector<T> gpad(pad_f ? GH * GW * FG : 0, T(0));
    for (int64_t c = lo; c < hi; ++c) {
      const T* gc = g + c * GH * GW * F;
      if (pad_f) {  // output channels zero-padded to whole blocks
        for (int64_t r = 0; r < GH * GW; ++r)
          std::memcpy(&gpad[r * FG], gc + r * F, sizeof(T) * F);
        gc = gpad.data();
      }
      const T* xc = xp.data() + c * HP * WP * B;
      const uint8_t* zc = zero_row.data() + c * HP;
      for (int64_t ph = 0; ph < PH; ++ph)
        for (int64_t grp = 0; grp < groups; ++grp)
          for (int64_t fb = 0; fb < fbs; ++fb)
            Tile::Run(xc, zc, gc + fb * FB, off.data() + grp * MB, ph, WP, B,
                      GH, GW, FG, ah.stride, ah.rhs_dil, aw.rhs_dil,
                      dp + ((ph * groups + grp) * fbs + fb) * MB * FB);
    }
  });
  // Chunks added in order, rounded once into (PH, PW, B, F).
  for (int64_t i = 1; i < chunks; ++i) {
    const double* pp = partial.data() + i * per;
    for (int64_t k = 0; k < per; ++k) partial[k] += pp[k];
  }
  for (int64_t ph = 0; ph < PH; ++ph)
    for (int64_t grp = 0; grp < groups; ++grp)
      for (int64_t fb = 0; fb < fbs; ++fb)
        for (int m = 0; m < MB; ++m) {
          int64_t k = grp * MB + m;
          if (k >= pairs) break;
          const double* src =
              partial.data() + (((ph * groups + grp) * fbs + fb) * MB + m) * FB;
          T* dst = out + ((ph * PW + pw_of[k]) * B + b_of[k]) * F + fb * FB;
          int64_t n = std::min<int64_t>(FB, F - fb * FB);
          for (int64_t f = 0; f < n; ++f) dst[f] = static_cast<T>(src[f]);
        }
}

template <ffi::DataType DT>
ffi::Error DirectWgrad(ffi::ThreadPool pool, ffi::Buffer<DT> x,
                       ffi::Buffer<DT> g, ffi::ResultBuffer<DT> out,
                       int64_t stride_h, int64_t stride_w, int64_t pad_h,
                       int64_t pad_w, int64_t lhs_dil_h, int64_t lhs_dil_w,
                       int64_t rhs_dil_h, int64_t rhs_dil_w) {
  using T = ffi::NativeType<DT>;
  auto xd = x.dimensions(), gd = g.dimensions(), od = out->dimensions();
  if (xd.size() != 4 || gd.size() != 4 || od.size() != 4 || gd[0] != xd[0] ||
      od[2] != xd[3] || od[3] != gd[3]) {
    return ffi::Error::InvalidArgument(
        "direct_wgrad: expected x (C, H, W, B), g (C, GH, GW, F), "
        "out (PH, PW, B, F)");
  }
  Axis ah{xd[1], stride_h, pad_h, lhs_dil_h, rhs_dil_h};
  Axis aw{xd[2], stride_w, pad_w, lhs_dil_w, rhs_dil_w};
  int64_t C = xd[0], B = xd[3], GH = gd[1], GW = gd[2], F = gd[3];
  int64_t PH = od[0], PW = od[1];
  T* op = out->typed_data();
  if (PH * PW * B * F == 0) return ffi::Error::Success();
  if (C * GH * GW == 0) {
    std::fill(op, op + PH * PW * B * F, T(0));
    return ffi::Error::Success();
  }
  constexpr int L = Vec<T>::kLanes;
  const T* xp = x.typed_data();
  const T* gp = g.typed_data();
  // The tile height MB (pairs of tap column and input channel) that wastes
  // the fewest rows on the last group; ties go to the taller tile.
  int64_t pairs = PW * B;
  auto pick = [pairs](std::initializer_list<int> sizes) {
    int best = 0;
    int64_t best_slots = 0;
    for (int mb : sizes) {
      int64_t slots = (pairs + mb - 1) / mb * mb;
      if (best == 0 || slots <= best_slots) best = mb, best_slots = slots;
    }
    return best;
  };
#define TJ_WGRAD(MB, NV) \
  case MB:               \
    WgradAll<T, MB, NV>(pool, xp, gp, op, C, ah, aw, B, GH, GW, F, PH, PW); \
    break;
  if (F > L) {  // 2 vectors of output channels: up to 14 x 2 accumulators
    switch (pick({4, 6, 8, 10, 12, 14})) {
      TJ_WGRAD(4, 2) TJ_WGRAD(6, 2) TJ_WGRAD(8, 2) TJ_WGRAD(10, 2) TJ_WGRAD(12, 2)
      TJ_WGRAD(14, 2)
    }
  } else {  // narrow: 1 vector, up to 24 accumulators
    switch (pick({8, 12, 16, 20, 24})) {
      TJ_WGRAD(8, 1) TJ_WGRAD(12, 1) TJ_WGRAD(16, 1) TJ_WGRAD(20, 1) TJ_WGRAD(24, 1)
    }
  }
#undef TJ_WGRAD
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tunedjax

TJ_DEFINE(TjDirectConvF32, DirectConv, ffi::F32)
TJ_DEFINE(TjDirectConvF64, DirectConv, ffi::F64)
TJ_DEFINE(TjDirectWgradF32, DirectWgrad, ffi::F32)
TJ_DEFINE(TjDirectWgradF64, DirectWgrad, ffi::F64)
