// Flash attention on the CPU: XLA FFI handlers for the attention family's
// `native_flash` kernel (ops/attention/_native_flash.py).
//
// Layouts are jax.nn.dot_product_attention's: q [B, T, N, H], k and v
// [B, S, K, H] (query head n reads key/value head n / (N / K)), out like q.
// The logits are q . k with q scaled (the F32 handlers are given q scaled by
// the Python side; the BF16 ones take the scale as an attribute and multiply
// q by it in float32 as they read it), then masked as JAX masks them:
//
//   keep [B, S] (1.0 attends, 0.0 does not; a 0-element buffer: no mask) and,
//   with causal = 1, key j attended by query i only when j <= i;
//   a masked logit becomes NEG = -0.7 * FLT_MAX, so a row with every key it
//   may see masked attends all S keys evenly (JAX's rule). Such a row's
//   output is the mean of v, and its saved log-sum-exp is +inf, which the
//   backward reads as "probabilities 1/S, no logit gradient".
//
// Forward (TjFlashAttnFwd{F32,BF16}): q, k, v, keep -> out, lse [B, N, T].
// Queries in blocks of kBlock rows, keys in blocks of kBlock: each (b, n,
// query block) task runs the online softmax over the key blocks, skipping the key
// blocks wholly above the causal diagonal, so no [T, S] matrix exists.
//
// Backward (TjFlashAttnBwd{F32,BF16}): q, k, v, keep, out, lse, dout -> dq,
// dk, dv. The probabilities are recomputed from the saved lse. Each task owns one
// (b, key/value head, chunk of key blocks): for each key block it walks the
// query blocks that see it (all G query heads of the group), accumulating
// dK and dV in place and dQ into the chunk's own partial buffer; a second
// pass adds the chunks' partials in chunk order. The number of chunks
// depends on the shape alone, so the bits never depend on the thread count.
//
// Two dtypes: the F32 handlers (everything float32) and the BF16 ones (q, k,
// v, out, dout and the gradients bfloat16; keep and lse float32). The BF16
// handlers convert each element to float32 as they pack it, compute exactly
// as the F32 ones do (float32 products, sums and softmax), and round only the
// results to bfloat16 (to nearest even); the backward's delta = sum(out *
// dout) reads the rounded output, as it is all it has.
//
// The inner loops are GCC/clang vector extensions: 16 floats where
// -march=native has AVX-512 (register tiles of 4 rows x 4 vectors), 8 floats
// elsewhere (one AVX2 register, or two SSE ones; tiles of 4 x 2), on packed
// copies whose head dim is padded to a multiple of the vector width with
// zeros and whose token axes are padded to whole blocks. exp is a vector
// polynomial (Cephes' expf, ~1 ulp). No -ffast-math: sums are in a fixed
// order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "tj_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Vector arguments of inline functions: no ABI is exported.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace tunedjax {
namespace {

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;  // one zmm register: 32 of them
constexpr int kTileRows = 4, kTileVecs = 4;
#else
constexpr int64_t kLanes = 8;  // one ymm register (AVX2), or two SSE ones: 16 of them
constexpr int kTileRows = 4, kTileVecs = 2;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
constexpr int64_t kBlock = 64;  // queries and keys per block
constexpr int kVB = kBlock / kLanes;  // vectors per block row
constexpr float kNeg = -0.7f * std::numeric_limits<float>::max();
constexpr float kInf = std::numeric_limits<float>::infinity();
// dK/dV tasks wanted at least; fewer (b, kv head) pairs split their keys.
constexpr int64_t kMinBackwardTasks = 16;

inline int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

inline vf Splat(float x) { return vf{} + x; }
inline vf Load(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void Store(float* p, vf x) { *reinterpret_cast<vf*>(p) = x; }
inline vf Max(vf a, vf b) { return a > b ? a : b; }

// exp(x) lane by lane; 0 below -87.3 (and for -inf), x <= 0 in every use here.
inline vf Exp(vf x) {
  const vf lo = Splat(-87.3f);
  vi under = x < lo;
  x = Max(x, lo);
  x = x < Splat(88.0f) ? x : Splat(88.0f);
  const vf magic = Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf t = x * Splat(1.44269504088896341f) + magic;
  vf n = t - magic;
  vi ni = (vi)t - (vi)magic;
  vf r = x - n * Splat(0.693359375f) - n * Splat(-2.12194440e-4f);
  vf p = Splat(1.9875691500E-4f);
  p = p * r + Splat(1.3981999507E-3f);
  p = p * r + Splat(8.3334519073E-3f);
  p = p * r + Splat(4.1665795894E-2f);
  p = p * r + Splat(1.6666665459E-1f);
  p = p * r + Splat(5.0000001201E-1f);
  p = p * r * r + r + Splat(1.0f);
  vf out = (vf)((vi)p + (ni << 23));
  return under ? vf{} : out;
}

// bfloat16 (XLA FFI's BF16: the top 16 bits of a float32) to and from float32,
// rounding to nearest even as XLA's convert does (NaN stays a quiet NaN).
inline float ToF32(float x) { return x; }
inline float ToF32(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void FromF32(float x, float* dst) { *dst = x; }
inline void FromF32(float x, uint16_t* dst) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *dst = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  *dst = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float HMax(vf x) {
  float m = x[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, x[i]);
  return m;
}

inline float HSum(vf x) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += x[i];
  return s;
}

// A 64-byte aligned float buffer, zero-filled.
class Buf {
 public:
  explicit Buf(int64_t n) {
    size_t bytes = static_cast<size_t>(RoundUp(std::max<int64_t>(n, 1) * 4, 64));
    p_ = static_cast<float*>(std::aligned_alloc(64, bytes));
    std::memset(p_, 0, bytes);
  }
  ~Buf() { std::free(p_); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  float* get() const { return p_; }

 private:
  float* p_;
};

// C[M x 64] = A[M x Hp] . Bt[Hp x 64 (row stride ldb)]; M a multiple of kTileRows.
// Register tiles of kTileRows rows by kTileVecs vectors.
void ScoreBlock(const float* a, int64_t M, int64_t hp, const float* bt,
                int64_t ldb, float* c) {
  constexpr int R = kTileRows, V = kTileVecs;
  for (int64_t c0 = 0; c0 < kBlock; c0 += V * kLanes) {
    for (int64_t m = 0; m < M; m += R) {
      vf acc[R][V] = {};
      for (int64_t h = 0; h < hp; ++h) {
        const float* brow = bt + h * ldb + c0;
        vf bv[V];
        for (int v = 0; v < V; ++v) bv[v] = Load(brow + v * kLanes);
        for (int r = 0; r < R; ++r) {
          vf x = Splat(a[(m + r) * hp + h]);
          for (int v = 0; v < V; ++v) acc[r][v] += x * bv[v];
        }
      }
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) Store(c + (m + r) * kBlock + c0 + v * kLanes, acc[r][v]);
    }
  }
}

// C[m, h0:h0+kLanes*NV] += sum_n P(m, n) * B[n, h0:...], P(m, n) = p[m * sm + n * sn].
template <int MR, int NV>
void AccumTile(const float* p, int64_t sm, int64_t sn, int64_t M, int64_t Nn,
               const float* b, int64_t hp, int64_t h0, float* c) {
  for (int64_t m = 0; m < M; m += MR) {
    vf acc[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = Load(c + (m + r) * hp + h0 + v * kLanes);
    for (int64_t n = 0; n < Nn; ++n) {
      vf bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = Load(b + n * hp + h0 + v * kLanes);
      for (int r = 0; r < MR; ++r) {
        vf x = Splat(p[(m + r) * sm + n * sn]);
        for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) Store(c + (m + r) * hp + h0 + v * kLanes, acc[r][v]);
  }
}

// C[M x Hp] += P[M x Nn] . B[Nn x Hp]; M a multiple of 8, P strided as AccumTile.
void Accum(const float* p, int64_t sm, int64_t sn, int64_t M, int64_t Nn,
           const float* b, int64_t hp, float* c) {
  constexpr int64_t step = kTileVecs * kLanes;
  int64_t h0 = 0;
  for (; h0 + step <= hp; h0 += step)
    AccumTile<kTileRows, kTileVecs>(p, sm, sn, M, Nn, b, hp, h0, c);
  switch ((hp - h0) / kLanes) {
    case 3: AccumTile<4, 3>(p, sm, sn, M, Nn, b, hp, h0, c); break;
    case 2: AccumTile<4, 2>(p, sm, sn, M, Nn, b, hp, h0, c); break;
    case 1: AccumTile<8, 1>(p, sm, sn, M, Nn, b, hp, h0, c); break;
    default: break;
  }
}

struct Dims {
  int64_t B, T, N, S, K, H, G, Hp, Tp, Sp, nqb, nkb;
  bool causal, masked;
};

Dims MakeDims(int64_t B, int64_t T, int64_t N, int64_t S, int64_t K, int64_t H,
              bool causal, bool masked) {
  Dims d{B, T, N, S, K, H, N / K, RoundUp(H, kLanes), RoundUp(T, kBlock),
         RoundUp(S, kBlock), RoundUp(T, kBlock) / kBlock, RoundUp(S, kBlock) / kBlock,
         causal, masked};
  return d;
}

// Copies rows [r0, r0 + rows) of head `head` of x [B, L, heads, H] (batch b), as
// float32 times `scale`, into dst [rows][Hp] (rows past L zero), and, if dst_t,
// transposed by blocks of rows:
// dst_t [rows / 64][Hp][64], so that one block's [Hp][64] is contiguous (a row
// stride of a power of two, 4 KiB at 1,024 tokens, would put every row of a
// block in the same L1 cache set).
template <typename In>
void PackRows(const In* x, const Dims& d, int64_t L, int64_t heads, int64_t b,
              int64_t head, int64_t r0, int64_t rows, float* dst, float* dst_t,
              float scale = 1.0f) {
  for (int64_t r = 0; r < rows; ++r) {
    int64_t t = r0 + r;
    if (t >= L) continue;
    const In* src = x + ((b * L + t) * heads + head) * d.H;
    float* col = dst_t ? dst_t + (r / kBlock) * d.Hp * kBlock + r % kBlock : nullptr;
    if constexpr (std::is_same<In, float>::value) {
      if (scale == 1.0f) {  // a copy (one loop converting into both is slower)
        if (dst) std::memcpy(dst + r * d.Hp, src, d.H * sizeof(float));
        if (col)
          for (int64_t h = 0; h < d.H; ++h) col[h * kBlock] = src[h];
        continue;
      }
    }
    if (dst)
      for (int64_t h = 0; h < d.H; ++h) dst[r * d.Hp + h] = ToF32(src[h]) * scale;
    if (col)
      for (int64_t h = 0; h < d.H; ++h) col[h * kBlock] = ToF32(src[h]) * scale;
  }
}

// Masks block scores s[64 x 64] of query rows i0.. against keys j0..: keys past S
// -inf, masked keys (keep == 0) and keys above the diagonal NEG.
void MaskScores(const Dims& d, const float* keep_b, int64_t i0, int64_t j0, float* s) {
  const bool tail = j0 + kBlock > d.S, diag = d.causal && j0 + kBlock - 1 > i0;
  if (!tail && !diag && !d.masked) return;
  for (int64_t r = 0; r < kBlock; ++r) {
    float* row = s + r * kBlock;
    for (int64_t c = 0; c < kBlock; ++c) {
      int64_t j = j0 + c;
      if (j >= d.S) row[c] = -kInf;
      else if ((d.causal && j > i0 + r) || (d.masked && keep_b[j] == 0.0f)) row[c] = kNeg;
    }
  }
}

// In: float (F32 handlers) or uint16_t (BF16: read as float32, results rounded).
template <typename In>
struct Fwd {
  Dims d;
  const In* q;
  const float* keep;
  const float *kt, *vr, *vmean;  // packed: [B*K][Hp][Sp], [B*K][Sp][Hp], [B*K][Hp]
  In* out;
  float* lse;
  float scale;  // times q, as it is packed
};

// One online-softmax step over key block j0 for the query block in qs.
template <typename In>
void FwdKeyBlock(const Fwd<In>& f, int64_t bk, int64_t b, int64_t i0, int64_t j0,
                 const float* qs, float* s, float* m, float* l, float* o) {
  const Dims& d = f.d;
  ScoreBlock(qs, kBlock, d.Hp, f.kt + (bk * d.Sp + j0) * d.Hp, kBlock, s);
  MaskScores(d, d.masked ? f.keep + b * d.S : nullptr, i0, j0, s);
  for (int64_t r = 0; r < kBlock; ++r) {
    float* row = s + r * kBlock;
    vf mx = Load(row);
    for (int v = 1; v < kVB; ++v) mx = Max(mx, Load(row + v * kLanes));
    float m_new = std::max(m[r], HMax(mx));
    float alpha = std::exp(m[r] - m_new);
    vf mv = Splat(m_new), sum = vf{};
    for (int v = 0; v < kVB; ++v) {
      vf p = Exp(Load(row + v * kLanes) - mv);
      Store(row + v * kLanes, p);
      sum += p;
    }
    l[r] = l[r] * alpha + HSum(sum);
    m[r] = m_new;
    if (alpha != 1.0f) {
      vf av = Splat(alpha);
      for (int64_t h = 0; h < d.Hp; h += kLanes) Store(o + r * d.Hp + h, Load(o + r * d.Hp + h) * av);
    }
  }
  Accum(s, kBlock, 1, kBlock, kBlock, f.vr + bk * d.Sp * d.Hp + j0 * d.Hp, d.Hp, o);
}

// Task (b, n, query block qb): out and lse of its rows.
template <typename In>
void FwdTask(const Fwd<In>& f, int64_t b, int64_t n, int64_t qb) {
  const Dims& d = f.d;
  const int64_t kh = n / d.G, bk = b * d.K + kh, i0 = qb * kBlock;
  const int64_t rows = std::min(kBlock, d.T - i0);
  Buf qs(kBlock * d.Hp), s(kBlock * kBlock), o(kBlock * d.Hp);
  float m[kBlock], l[kBlock];
  std::fill(m, m + kBlock, -kInf);
  std::fill(l, l + kBlock, 0.0f);
  PackRows(f.q, d, d.T, d.N, b, n, i0, rows, qs.get(), nullptr, f.scale);
  const int64_t kend = d.causal ? std::min(d.S, i0 + rows) : d.S;
  for (int64_t j0 = 0; j0 < kend; j0 += kBlock)
    FwdKeyBlock(f, bk, b, i0, j0, qs.get(), s.get(), m, l, o.get());
  for (int64_t r = 0; r < rows; ++r) {
    In* dst = f.out + ((b * d.T + i0 + r) * d.N + n) * d.H;
    float* lse = f.lse + (b * d.N + n) * d.T + i0 + r;
    if (d.masked && m[r] <= kNeg) {  // every key it may see masked: all S evenly
      for (int64_t h = 0; h < d.H; ++h) FromF32(f.vmean[bk * d.Hp + h], dst + h);
      *lse = kInf;
      continue;
    }
    const float inv = 1.0f / l[r];
    for (int64_t h = 0; h < d.H; ++h) FromF32(o.get()[r * d.Hp + h] * inv, dst + h);
    *lse = m[r] + std::log(l[r]);
  }
}

// Packs k transposed and v per (b, kv head), and v's mean over the keys if masked.
template <typename In>
void PackKeys(ffi::ThreadPool& pool, const Dims& d, const In* k, const In* v,
              float* kt, float* vr, float* vmean) {
  parallel_for(pool, d.B * d.K, [&](int64_t bk) {
    const int64_t b = bk / d.K, kh = bk % d.K;
    PackRows(k, d, d.S, d.K, b, kh, 0, d.S, nullptr, kt + bk * d.Hp * d.Sp);
    float* vb = vr + bk * d.Sp * d.Hp;
    PackRows(v, d, d.S, d.K, b, kh, 0, d.S, vb, nullptr);
    if (!d.masked) return;
    for (int64_t h = 0; h < d.H; ++h) {
      double sum = 0.0;
      for (int64_t j = 0; j < d.S; ++j) sum += vb[j * d.Hp + h];
      vmean[bk * d.Hp + h] = static_cast<float>(sum / static_cast<double>(d.S));
    }
  });
}

// Checks the operands' shapes; fills dims.
template <ffi::DataType DT>
ffi::Error CheckShapes(const char* what, ffi::Buffer<DT>& q, ffi::Buffer<DT>& k,
                       ffi::Buffer<DT>& v, ffi::Buffer<ffi::F32>& keep,
                       int64_t causal, Dims* d) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || kd[0] != qd[0] ||
      kd[3] != qd[3] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] ||
      vd[3] != kd[3] || kd[2] < 1 || qd[2] % kd[2] != 0 || kd[1] < 1 || qd[3] < 1) {
    return ffi::Error::InvalidArgument(std::string(what) +
        ": expected q [B, T, N, H], k and v [B, S >= 1, K, H] with N a multiple of K");
  }
  const bool masked = keep.element_count() != 0;
  auto md = keep.dimensions();
  if (masked && (md.size() != 2 || md[0] != qd[0] || md[1] != kd[1])) {
    return ffi::Error::InvalidArgument(std::string(what) +
        ": expected keep [B, S] (or 0 elements: no mask)");
  }
  if (causal != 0 && causal != 1) {
    return ffi::Error::InvalidArgument(std::string(what) + ": causal must be 0 or 1");
  }
  *d = MakeDims(qd[0], qd[1], qd[2], kd[1], kd[2], qd[3], causal == 1, masked);
  return ffi::Error::Success();
}

// q, k, v and out of dtype DT (F32 or BF16); keep and lse float32. The BF16
// handler takes the logits' scale (times q as it is read, in float32; dq times
// it too); the F32 one is given q scaled.
template <ffi::DataType DT>
ffi::Error FlashFwd(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> k,
                    ffi::Buffer<DT> v, ffi::Buffer<ffi::F32> keep,
                    ffi::ResultBuffer<DT> out, ffi::ResultBuffer<ffi::F32> lse,
                    int64_t causal, float scale) {
  using In = ffi::NativeType<DT>;
  Dims d;
  ffi::Error err = CheckShapes("flash_attention_fwd", q, k, v, keep, causal, &d);
  if (err.failure()) return err;
  if (out->element_count() != q.element_count() ||
      lse->element_count() != static_cast<size_t>(d.B * d.N * d.T)) {
    return ffi::Error::InvalidArgument(
        "flash_attention_fwd: expected out like q and lse [B, N, T]");
  }
  if (d.B == 0 || d.T == 0) return ffi::Error::Success();
  Buf kt(d.B * d.K * d.Hp * d.Sp), vr(d.B * d.K * d.Sp * d.Hp), vmean(d.B * d.K * d.Hp);
  PackKeys(pool, d, k.typed_data(), v.typed_data(), kt.get(), vr.get(), vmean.get());
  Fwd<In> f{d, q.typed_data(), keep.typed_data(), kt.get(), vr.get(), vmean.get(),
            out->typed_data(), lse->typed_data(), scale};
  // The longest causal rows first: tasks are taken in order.
  parallel_for(pool, d.B * d.N * d.nqb, [&](int64_t i) {
    const int64_t qb = d.nqb - 1 - i / (d.B * d.N), bn = i % (d.B * d.N);
    FwdTask(f, bn / d.N, bn % d.N, qb);
  });
  return ffi::Error::Success();
}

// ------------------------------------------------------------------ backward --

template <typename In>
struct Bwd {
  Dims d;
  const In *q, *k, *v;
  const float* keep;
  const In* out;
  const float* lse;
  const In* dout;
  float* dq_part;  // [chunks][B*K][G][Tp][Hp]
  In *dk, *dv;
  int64_t chunks;
  float scale;  // times q, as it is packed
};

// The packed queries of one (b, kv head): per query head of the group, rows and
// transposed copies of q and dout, lse (+inf on padding rows) and delta.
struct GroupPack {
  Buf qr, qt, dor, dot, lse, delta, special;  // special: sum of dout over +inf rows / S
  GroupPack(const Dims& d)
      : qr(d.G * d.Tp * d.Hp), qt(d.G * d.Hp * d.Tp), dor(d.G * d.Tp * d.Hp),
        dot(d.G * d.Hp * d.Tp), lse(d.G * d.Tp), delta(d.G * d.Tp), special(d.Hp) {}
};

template <typename In>
void PackGroup(const Bwd<In>& w, int64_t b, int64_t kh, GroupPack& g) {
  const Dims& d = w.d;
  for (int64_t gi = 0; gi < d.G; ++gi) {
    const int64_t n = kh * d.G + gi;
    PackRows(w.q, d, d.T, d.N, b, n, 0, d.T, g.qr.get() + gi * d.Tp * d.Hp,
             g.qt.get() + gi * d.Hp * d.Tp, w.scale);
    PackRows(w.dout, d, d.T, d.N, b, n, 0, d.T, g.dor.get() + gi * d.Tp * d.Hp,
             g.dot.get() + gi * d.Hp * d.Tp);
    float* lse = g.lse.get() + gi * d.Tp;
    float* delta = g.delta.get() + gi * d.Tp;
    for (int64_t t = 0; t < d.Tp; ++t) {
      if (t >= d.T) {
        lse[t] = kInf;
        continue;
      }
      lse[t] = w.lse[(b * d.N + n) * d.T + t];
      const In* o = w.out + ((b * d.T + t) * d.N + n) * d.H;
      const float* dor = g.dor.get() + (gi * d.Tp + t) * d.Hp;
      float sum = 0.0f;
      for (int64_t h = 0; h < d.H; ++h) sum += ToF32(o[h]) * dor[h];
      delta[t] = sum;
      if (lse[t] == kInf)
        for (int64_t h = 0; h < d.H; ++h) g.special.get()[h] += dor[h];
    }
  }
  const float inv_s = 1.0f / static_cast<float>(d.S);
  for (int64_t h = 0; h < d.Hp; ++h) g.special.get()[h] *= inv_s;
}

// Turns the block's scores st [keys j][queries i] into probabilities: 0 where
// masked (causal, keep == 0, keys past S), exp(s - lse_i) elsewhere.
void Probabilities(const Dims& d, const float* keep_b, int64_t i0, int64_t j0,
                   const float* lse, float* st) {
  for (int64_t r = 0; r < kBlock; ++r) {
    float* row = st + r * kBlock;
    const int64_t j = j0 + r;
    if (j >= d.S || (d.masked && keep_b[j] == 0.0f)) {
      std::memset(row, 0, kBlock * sizeof(float));
      continue;
    }
    for (int v = 0; v < kVB; ++v)
      Store(row + v * kLanes, Exp(Load(row + v * kLanes) - Load(lse + i0 + v * kLanes)));
    if (d.causal && j > i0)
      for (int64_t c = 0; c < std::min<int64_t>(kBlock, j - i0); ++c) row[c] = 0.0f;
  }
}

struct Scratch {
  Buf kb, vb, st, dpt, dk, dv;
  explicit Scratch(const Dims& d)
      : kb(kBlock * d.Hp), vb(kBlock * d.Hp), st(kBlock * kBlock), dpt(kBlock * kBlock),
        dk(kBlock * d.Hp), dv(kBlock * d.Hp) {}
};

// One (key block, query block, query head) step: dV, dK and dQ's partial.
template <typename In>
void BwdPair(const Bwd<In>& w, const GroupPack& g, Scratch& x, int64_t b, int64_t gi,
             int64_t i0, int64_t j0, float* dq) {
  const Dims& d = w.d;
  const float* qt = g.qt.get() + (gi * d.Tp + i0) * d.Hp;  // block i0 / 64 of [Hp][64]
  const float* dot = g.dot.get() + (gi * d.Tp + i0) * d.Hp;
  const float* delta = g.delta.get() + gi * d.Tp + i0;
  float *st = x.st.get(), *dpt = x.dpt.get();
  ScoreBlock(x.kb.get(), kBlock, d.Hp, qt, kBlock, st);
  Probabilities(d, d.masked ? w.keep + b * d.S : nullptr, i0, j0, g.lse.get() + gi * d.Tp, st);
  Accum(st, kBlock, 1, kBlock, kBlock, g.dor.get() + (gi * d.Tp + i0) * d.Hp, d.Hp,
        x.dv.get());
  ScoreBlock(x.vb.get(), kBlock, d.Hp, dot, kBlock, dpt);
  for (int64_t r = 0; r < kBlock; ++r)
    for (int v = 0; v < kVB; ++v) {
      const int64_t o = r * kBlock + v * kLanes;
      Store(dpt + o, Load(st + o) * (Load(dpt + o) - Load(delta + v * kLanes)));
    }
  Accum(dpt, kBlock, 1, kBlock, kBlock, g.qr.get() + (gi * d.Tp + i0) * d.Hp, d.Hp,
        x.dk.get());
  Accum(dpt, 1, kBlock, kBlock, kBlock, x.kb.get(), d.Hp, dq + (gi * d.Tp + i0) * d.Hp);
}

// Task (b, kv head, chunk of key blocks): dK and dV of its keys, its dQ partial.
template <typename In>
void BwdTask(const Bwd<In>& w, int64_t b, int64_t kh, int64_t chunk) {
  const Dims& d = w.d;
  int64_t kb_lo, kb_hi;
  split_range(d.nkb, w.chunks, chunk, &kb_lo, &kb_hi);
  GroupPack g(d);
  PackGroup(w, b, kh, g);
  Scratch x(d);
  float* dq = w.dq_part + ((chunk * d.B + b) * d.K + kh) * d.G * d.Tp * d.Hp;
  for (int64_t kbi = kb_lo; kbi < kb_hi; ++kbi) {
    const int64_t j0 = kbi * kBlock, keys = std::min(kBlock, d.S - j0);
    std::memset(x.kb.get(), 0, kBlock * d.Hp * sizeof(float));
    std::memset(x.vb.get(), 0, kBlock * d.Hp * sizeof(float));
    std::memset(x.dk.get(), 0, kBlock * d.Hp * sizeof(float));
    std::memset(x.dv.get(), 0, kBlock * d.Hp * sizeof(float));
    PackRows(w.k, d, d.S, d.K, b, kh, j0, keys, x.kb.get(), nullptr);
    PackRows(w.v, d, d.S, d.K, b, kh, j0, keys, x.vb.get(), nullptr);
    const int64_t qb_lo = d.causal ? j0 / kBlock : 0;
    for (int64_t gi = 0; gi < d.G; ++gi)
      for (int64_t qb = qb_lo; qb < d.nqb; ++qb) BwdPair(w, g, x, b, gi, qb * kBlock, j0, dq);
    for (int64_t r = 0; r < keys; ++r) {
      const int64_t o = ((b * d.S + j0 + r) * d.K + kh) * d.H;
      for (int64_t h = 0; h < d.H; ++h) {
        FromF32(x.dk.get()[r * d.Hp + h], w.dk + o + h);
        FromF32(x.dv.get()[r * d.Hp + h] + g.special.get()[h], w.dv + o + h);
      }
    }
  }
}

template <ffi::DataType DT>
ffi::Error FlashBwd(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> k,
                    ffi::Buffer<DT> v, ffi::Buffer<ffi::F32> keep,
                    ffi::Buffer<DT> out, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<DT> dout, ffi::ResultBuffer<DT> dq,
                    ffi::ResultBuffer<DT> dk, ffi::ResultBuffer<DT> dv,
                    int64_t causal, float scale) {
  using In = ffi::NativeType<DT>;
  Dims d;
  ffi::Error err = CheckShapes("flash_attention_bwd", q, k, v, keep, causal, &d);
  if (err.failure()) return err;
  if (out.element_count() != q.element_count() || dout.element_count() != q.element_count() ||
      lse.element_count() != static_cast<size_t>(d.B * d.N * d.T) ||
      dq->element_count() != q.element_count() || dk->element_count() != k.element_count() ||
      dv->element_count() != v.element_count()) {
    return ffi::Error::InvalidArgument(
        "flash_attention_bwd: expected out, dout and dq like q, lse [B, N, T], dk and dv like k");
  }
  if (d.B == 0) return ffi::Error::Success();
  const int64_t pairs = d.B * d.K;
  const int64_t chunks = std::max<int64_t>(
      1, std::min(d.nkb, (kMinBackwardTasks + pairs - 1) / pairs));
  const int64_t part = pairs * d.G * d.Tp * d.Hp;
  Buf dq_part(chunks * part);
  Bwd<In> w{d, q.typed_data(), k.typed_data(), v.typed_data(), keep.typed_data(),
            out.typed_data(), lse.typed_data(), dout.typed_data(), dq_part.get(),
            dk->typed_data(), dv->typed_data(), chunks, scale};
  parallel_for(pool, pairs * chunks, [&](int64_t i) {
    BwdTask(w, (i % pairs) / d.K, i % d.K, i / pairs);
  });
  // dQ: the chunks' partials added in chunk order, one (b, query head) a task.
  In* dqp = dq->typed_data();
  parallel_for(pool, d.B * d.N, [&](int64_t bn) {
    const int64_t b = bn / d.N, n = bn % d.N;
    const int64_t base = ((b * d.K + n / d.G) * d.G + n % d.G) * d.Tp * d.Hp;
    for (int64_t t = 0; t < d.T; ++t) {
      In* dst = dqp + ((b * d.T + t) * d.N + n) * d.H;
      for (int64_t h = 0; h < d.H; ++h) {
        float sum = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) sum += dq_part.get()[c * part + base + t * d.Hp + h];
        FromF32(sum * scale, dst + h);  // scale: 1 for F32 (exact)
      }
    }
  });
  return ffi::Error::Success();
}

// The F32 handlers: q scaled already.
ffi::Error FlashFwdF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> keep,
                       ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                       int64_t causal) {
  return FlashFwd<ffi::F32>(pool, q, k, v, keep, out, lse, causal, 1.0f);
}

ffi::Error FlashBwdF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> keep,
                       ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse,
                       ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq,
                       ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv,
                       int64_t causal) {
  return FlashBwd<ffi::F32>(pool, q, k, v, keep, out, lse, dout, dq, dk, dv, causal, 1.0f);
}

}  // namespace
}  // namespace tunedjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjFlashAttnFwdF32, tunedjax::FlashFwdF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjFlashAttnBwdF32, tunedjax::FlashBwdF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal"));

// BF16: q, k, v, out, dout, dq, dk, dv bfloat16; keep and lse float32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(TjFlashAttnFwdBF16, tunedjax::FlashFwd<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjFlashAttnBwdBF16, tunedjax::FlashBwd<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("causal")
                                  .Attr<float>("scale"));
