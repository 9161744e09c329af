// CUDA kernels of transformer_ext::attention and its backward (docs/DESIGN.md section 2; the
// algorithm of csrc/cpu/attention.cpp, the oracle transformer_ext/reference.py).
//
// forward: one 256-thread block per (8 query rows, b, h); warp w owns query row i. The block
//   walks tiles of 32 keys up to the last key any of its rows may see (never past
//   key_lengths[b]); K and V tiles are staged in shared memory (rows padded by one element
//   against bank conflicts). Lane l scores key j0 + l against its warp's row, the warp keeps an
//   online softmax (running max, running sum, the output rescaled by exp(m_old - m_new)) with
//   dropout from the counter-based generator of the CPU kernel, and each lane accumulates
//   D / 32 output dimensions in float32 (float64 for float64 inputs). Saved: lse per row.
// backward: (1) the same layout over query rows recomputes P from lse, dP = dO V^T, applies the
//   dropout mask, and accumulates dq = scale * dS K; it also stores delta = rowsum(dO o O).
//   (2) one warp per key row over tiles of 32 query rows (q scaled, dO, lse, delta in shared
//   memory) accumulates dv = Pd^T dO and dk = dS^T (scale q). No atomics; every output element
//   is written by one warp.
// Position bias (attention_with_bias): added to each score in the math type; the dq kernel also
//   writes dS per (b, h, i, j), reduced to the bias's shape on the host.
// Head dims up to 128 (4 per lane); dtypes float32, float16, bfloat16, float64. Lengths are
// clamped to [0, K] / [0, Q] on the device (checking them on the host would force a sync).
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "ops.h"
#include "utils.cuh"

namespace transformer_ext {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 32;     // keys (forward, dq) or query rows (dk, dv) per shared-memory tile
constexpr int kMaxD = 128;
constexpr int kPerLane = kMaxD / 32;

// ---- the dropout generator (the function of csrc/cpu/attention.cpp) ---------------------

__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ void bh_keys(int64_t seed, int64_t b, int64_t h, uint32_t* k1,
                                        uint32_t* k2) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t xs[4] = {static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32),
                          static_cast<uint32_t>(b), static_cast<uint32_t>(h)};
  uint32_t a = 0x243f6a88u, c = 0x85a308d3u;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    a = mix32(a + xs[t]);
    c = mix32(c + xs[t]);
  }
  *k1 = a;
  *k2 = c;
}

__device__ __forceinline__ bool keep(uint32_t k1, uint32_t k2, int64_t i, int64_t j,
                                     uint32_t threshold) {
  const uint32_t r1 = mix32(k1 + static_cast<uint32_t>(i));
  const uint32_t r2 = mix32(k2 + static_cast<uint32_t>(i));
  return mix32(mix32(static_cast<uint32_t>(j) + r1) ^ r2) >= threshold;
}

__device__ __forceinline__ int64_t row_limit(int64_t i, int64_t klen, int64_t Q, int64_t K,
                                             bool causal) {
  if (!causal) return klen;
  const int64_t lim = i + (K - Q) + 1;
  return lim < 0 ? 0 : (lim > klen ? klen : lim);
}

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

// Kernels whose dynamic shared memory passes the default 48 KiB (float64 tiles) opt in once.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  }
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullWarpMask, v, o);
  return v;
}

// max that ignores NaN (NaN reaches the row through the exponentials and the sums).
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const T w = __shfl_xor_sync(kFullWarpMask, v, o);
    v = w > v ? w : v;
  }
  return v;
}

template <typename scalar_t>
struct Params {
  const scalar_t *q, *k, *v, *out, *dout;
  scalar_t *o, *dq, *dk, *dv;
  float* lse;          // forward: written; backward: read
  float* delta;        // backward: [B, H, Q]
  const int64_t *klen, *qlen, *seed;
  int64_t H, Q, K, D;
  int64_t qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2;
  int64_t os0, os1, os2;     // out / o
  int64_t gs0, gs1, gs2;     // dout
  int64_t dqs0, dqs1, dqs2, dks0, dks1, dks2, dvs0, dvs1, dvs2;
  float scale;
  bool causal;
  bool dropout;
  uint32_t threshold;
  float keep_scale;
  // Position bias or nullptr, in the math type: bias(b, h, i, j) at b * bs0 + h * bs1 + i * bs2 +
  // j * bs3 (strides 0 where it broadcasts). dbias: [B, H, Q, K] zero-filled, dS written by the
  // dq kernel (one lane per (i, j)), or nullptr.
  const at::opmath_type<scalar_t>* bias;
  int64_t bs0, bs1, bs2, bs3;
  at::opmath_type<scalar_t>* dbias;
};

template <typename scalar_t>
__device__ __forceinline__ at::opmath_type<scalar_t> bias_at(const Params<scalar_t>& p, int64_t b,
                                                            int64_t h, int64_t i, int64_t j) {
  return p.bias[b * p.bs0 + h * p.bs1 + i * p.bs2 + j * p.bs3];
}

// The lse a row's probabilities are recomputed from: +inf for a row without weight (lse = -inf,
// every allowed score -inf), so that exp(s - lse) is 0 there, not inf.
__device__ __forceinline__ float recompute_shift(float lse) {
  return lse == -INFINITY ? INFINITY : lse;
}

template <typename scalar_t>
__device__ __forceinline__ void lengths_of(const Params<scalar_t>& p, int64_t b, int64_t* klen,
                                           int64_t* qlen) {
  int64_t kl = p.klen != nullptr ? p.klen[b] : p.K;
  int64_t ql = p.qlen != nullptr ? p.qlen[b] : p.Q;
  *klen = kl < 0 ? 0 : (kl > p.K ? p.K : kl);
  *qlen = ql < 0 ? 0 : (ql > p.Q ? p.Q : ql);
}

// Stages rows [r0, r0 + kTile) (those below `rend`) of a [rows, D] matrix into shared memory
// as acc_t with row stride D + 1, multiplied by `mul`; rows at or past `rend` are zeros.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void stage_tile(const scalar_t* base, int64_t row_stride, int64_t r0,
                                           int64_t rend, int64_t D, acc_t mul, acc_t* dst) {
  for (int64_t idx = threadIdx.x; idx < kTile * D; idx += blockDim.x) {
    const int64_t c = idx / D, d = idx % D, r = r0 + c;
    dst[c * (D + 1) + d] = r < rend ? static_cast<acc_t>(base[r * row_stride + d]) * mul : acc_t(0);
  }
}

// ---- forward ---------------------------------------------------------------------------------

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) attention_fwd_kernel(const Params<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned char smem_raw[];
  acc_t* Ks = reinterpret_cast<acc_t*>(smem_raw);  // [kTile, D + 1]
  acc_t* Vs = Ks + kTile * (p.D + 1);               // [kTile, D + 1]
  acc_t* Qs = Vs + kTile * (p.D + 1);               // [kWarps, D]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bh = blockIdx.y, b = bh / p.H, h = bh % p.H, D = p.D;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  int64_t klen, qlen;
  lengths_of(p, b, &klen, &qlen);
  const int64_t lim = i < qlen ? row_limit(i, klen, p.Q, p.K, p.causal) : 0;
  const int64_t i_last = std::min<int64_t>(static_cast<int64_t>(blockIdx.x) * kWarps + kWarps, qlen) - 1;
  const int64_t kend = i_last >= static_cast<int64_t>(blockIdx.x) * kWarps
                           ? row_limit(i_last, klen, p.Q, p.K, p.causal) : 0;
  const scalar_t* qrow = p.q + b * p.qs0 + h * p.qs1 + i * p.qs2;
  for (int64_t d = lane; d < D; d += 32) {
    Qs[warp * D + d] = lim > 0 ? static_cast<acc_t>(qrow[d]) * static_cast<acc_t>(p.scale) : acc_t(0);
  }
  uint32_t k1 = 0, k2 = 0;
  if (p.dropout) bh_keys(p.seed[0], b, h, &k1, &k2);
  const scalar_t* kb = p.k + b * p.ks0 + h * p.ks1;
  const scalar_t* vb = p.v + b * p.vs0 + h * p.vs1;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  acc_t m = neg_inf, l = 0;
  acc_t acc[kPerLane];
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) acc[c] = 0;

  for (int64_t j0 = 0; j0 < kend; j0 += kTile) {
    __syncthreads();
    stage_tile(kb, p.ks2, j0, kend, D, acc_t(1), Ks);
    stage_tile(vb, p.vs2, j0, kend, D, acc_t(1), Vs);
    __syncthreads();
    if (lim <= j0) continue;  // warp-uniform: this row sees no key of the tile
    const int64_t j = j0 + lane;
    acc_t s = neg_inf;
    if (j < lim) {
      s = 0;
      for (int64_t d = 0; d < D; ++d) s += Qs[warp * D + d] * Ks[lane * (D + 1) + d];
      if (p.bias != nullptr) s += bias_at(p, b, h, i, j);
    }
    const acc_t mnew = std::max(m, warp_max(s));
    const acc_t alpha = m == neg_inf ? acc_t(0) : exp_acc(m - mnew);
    // scores all -inf so far (a -inf bias): shift by 0, exact zeros rather than NaN
    const acc_t shift = mnew == neg_inf ? acc_t(0) : mnew;
    acc_t pj = j < lim ? exp_acc(s - shift) : acc_t(0);
    l = l * alpha + warp_sum(pj);
    if (p.dropout && j < lim && !keep(k1, k2, i, j, p.threshold)) pj = 0;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) acc[c] *= alpha;
    const int64_t n = std::min<int64_t>(kTile, lim - j0);
    for (int jj = 0; jj < n; ++jj) {
      const acc_t w = __shfl_sync(kFullWarpMask, pj, jj);
#pragma unroll
      for (int c = 0; c < kPerLane; ++c) {
        const int64_t d = lane + 32 * c;
        if (d < D) acc[c] += w * Vs[jj * (D + 1) + d];
      }
    }
    m = mnew;
  }
  if (i >= p.Q) return;
  scalar_t* orow = p.o + b * p.os0 + h * p.os1 + i * p.os2;
  const bool empty = !(l != acc_t(0));  // no allowed key (NaN: a NaN score, kept)
  const acc_t inv = empty ? acc_t(0) : static_cast<acc_t>(p.keep_scale) / l;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int64_t d = lane + 32 * c;
    if (d < D) orow[d] = static_cast<scalar_t>(empty ? acc_t(0) : acc[c] * inv);
  }
  if (lane == 0) {
    p.lse[bh * p.Q + i] = empty ? -std::numeric_limits<float>::infinity()
                                : static_cast<float>(m + log_acc(l));
  }
}

// ---- backward (1): dq and delta ------------------------------------------------------------

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) attention_bwd_dq_kernel(const Params<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned char smem_raw[];
  acc_t* Ks = reinterpret_cast<acc_t*>(smem_raw);  // [kTile, D + 1]
  acc_t* Vs = Ks + kTile * (p.D + 1);
  acc_t* Qs = Vs + kTile * (p.D + 1);               // [kWarps, D] scale * q
  acc_t* Gs = Qs + kWarps * p.D;                    // [kWarps, D] dout
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bh = blockIdx.y, b = bh / p.H, h = bh % p.H, D = p.D;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  int64_t klen, qlen;
  lengths_of(p, b, &klen, &qlen);
  const int64_t lim = i < qlen ? row_limit(i, klen, p.Q, p.K, p.causal) : 0;
  const int64_t i_last = std::min<int64_t>(static_cast<int64_t>(blockIdx.x) * kWarps + kWarps, qlen) - 1;
  const int64_t kend = i_last >= static_cast<int64_t>(blockIdx.x) * kWarps
                           ? row_limit(i_last, klen, p.Q, p.K, p.causal) : 0;
  const scalar_t* qrow = p.q + b * p.qs0 + h * p.qs1 + i * p.qs2;
  const scalar_t* grow = p.dout + b * p.gs0 + h * p.gs1 + i * p.gs2;
  const scalar_t* orow = p.out + b * p.os0 + h * p.os1 + i * p.os2;
  acc_t dpart = 0;
  for (int64_t d = lane; d < D; d += 32) {
    const bool on = lim > 0;
    Qs[warp * D + d] = on ? static_cast<acc_t>(qrow[d]) * static_cast<acc_t>(p.scale) : acc_t(0);
    const acc_t g = on ? static_cast<acc_t>(grow[d]) : acc_t(0);
    Gs[warp * D + d] = g;
    if (on) dpart += g * static_cast<acc_t>(orow[d]);
  }
  const acc_t delta = warp_sum(dpart);
  const acc_t lse = lim > 0 ? static_cast<acc_t>(recompute_shift(p.lse[bh * p.Q + i])) : acc_t(0);
  uint32_t k1 = 0, k2 = 0;
  if (p.dropout) bh_keys(p.seed[0], b, h, &k1, &k2);
  const acc_t rp = static_cast<acc_t>(p.keep_scale);
  const scalar_t* kb = p.k + b * p.ks0 + h * p.ks1;
  const scalar_t* vb = p.v + b * p.vs0 + h * p.vs1;
  acc_t acc[kPerLane];
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) acc[c] = 0;
  for (int64_t j0 = 0; j0 < kend; j0 += kTile) {
    __syncthreads();
    stage_tile(kb, p.ks2, j0, kend, D, acc_t(1), Ks);
    stage_tile(vb, p.vs2, j0, kend, D, acc_t(1), Vs);
    __syncthreads();
    if (lim <= j0) continue;
    const int64_t j = j0 + lane;
    acc_t ds = 0;
    if (j < lim) {
      acc_t s = 0, dp = 0;
      for (int64_t d = 0; d < D; ++d) {
        s += Qs[warp * D + d] * Ks[lane * (D + 1) + d];
        dp += Gs[warp * D + d] * Vs[lane * (D + 1) + d];
      }
      if (p.bias != nullptr) s += bias_at(p, b, h, i, j);
      const acc_t pr = exp_acc(s - lse);
      if (p.dropout) dp = keep(k1, k2, i, j, p.threshold) ? dp * rp : acc_t(0);
      ds = pr * (dp - delta);
      if (p.dbias != nullptr) p.dbias[(bh * p.Q + i) * p.K + j] = ds;
    }
    const int64_t n = std::min<int64_t>(kTile, lim - j0);
    for (int jj = 0; jj < n; ++jj) {
      const acc_t w = __shfl_sync(kFullWarpMask, ds, jj);
#pragma unroll
      for (int c = 0; c < kPerLane; ++c) {
        const int64_t d = lane + 32 * c;
        if (d < D) acc[c] += w * Ks[jj * (D + 1) + d];
      }
    }
  }
  if (i >= p.Q) return;
  scalar_t* dqrow = p.dq + b * p.dqs0 + h * p.dqs1 + i * p.dqs2;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int64_t d = lane + 32 * c;
    if (d < D) dqrow[d] = static_cast<scalar_t>(acc[c] * static_cast<acc_t>(p.scale));
  }
  if (lane == 0) p.delta[bh * p.Q + i] = static_cast<float>(delta);
}

// ---- backward (2): dk and dv ----------------------------------------------------------------

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) attention_bwd_dkv_kernel(const Params<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned char smem_raw[];
  acc_t* Qs = reinterpret_cast<acc_t*>(smem_raw);  // [kTile, D + 1] scale * q
  acc_t* Gs = Qs + kTile * (p.D + 1);               // [kTile, D + 1] dout
  acc_t* Ks = Gs + kTile * (p.D + 1);               // [kWarps, D]
  acc_t* Vs = Ks + kWarps * p.D;                    // [kWarps, D]
  acc_t* Ls = Vs + kWarps * p.D;                    // [kTile] lse
  acc_t* Ds = Ls + kTile;                           // [kTile] delta
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bh = blockIdx.y, b = bh / p.H, h = bh % p.H, D = p.D;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  int64_t klen, qlen;
  lengths_of(p, b, &klen, &qlen);
  const bool live = j < klen;
  // The first query row that sees the block's first key (lim is non-decreasing in i).
  const int64_t j_first = static_cast<int64_t>(blockIdx.x) * kWarps;
  int64_t istart = p.causal ? j_first - (p.K - p.Q) : 0;
  istart = istart < 0 ? 0 : istart;
  const scalar_t* krow = p.k + b * p.ks0 + h * p.ks1 + j * p.ks2;
  const scalar_t* vrow = p.v + b * p.vs0 + h * p.vs1 + j * p.vs2;
  for (int64_t d = lane; d < D; d += 32) {
    Ks[warp * D + d] = live ? static_cast<acc_t>(krow[d]) : acc_t(0);
    Vs[warp * D + d] = live ? static_cast<acc_t>(vrow[d]) : acc_t(0);
  }
  uint32_t k1 = 0, k2 = 0;
  if (p.dropout) bh_keys(p.seed[0], b, h, &k1, &k2);
  const acc_t rp = static_cast<acc_t>(p.keep_scale);
  const scalar_t* qb = p.q + b * p.qs0 + h * p.qs1;
  const scalar_t* gb = p.dout + b * p.gs0 + h * p.gs1;
  acc_t dk[kPerLane], dv[kPerLane];
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) dk[c] = dv[c] = 0;
  const bool block_live = j_first < klen;
  for (int64_t i0 = block_live ? istart : qlen; i0 < qlen; i0 += kTile) {
    __syncthreads();
    stage_tile(qb, p.qs2, i0, qlen, D, static_cast<acc_t>(p.scale), Qs);
    stage_tile(gb, p.gs2, i0, qlen, D, acc_t(1), Gs);
    if (threadIdx.x < kTile) {
      const int64_t i = i0 + threadIdx.x;
      Ls[threadIdx.x] = i < qlen ? static_cast<acc_t>(recompute_shift(p.lse[bh * p.Q + i])) : acc_t(0);
      Ds[threadIdx.x] = i < qlen ? static_cast<acc_t>(p.delta[bh * p.Q + i]) : acc_t(0);
    }
    __syncthreads();
    if (!live) continue;
    const int64_t i = i0 + lane;
    const bool visible = i < qlen && j < row_limit(i, klen, p.Q, p.K, p.causal);
    acc_t pd = 0, ds = 0;
    if (visible) {
      acc_t s = 0, dp = 0;
      for (int64_t d = 0; d < D; ++d) {
        s += Qs[lane * (D + 1) + d] * Ks[warp * D + d];
        dp += Gs[lane * (D + 1) + d] * Vs[warp * D + d];
      }
      if (p.bias != nullptr) s += bias_at(p, b, h, i, j);
      const acc_t pr = exp_acc(s - Ls[lane]);
      const bool kept = !p.dropout || keep(k1, k2, i, j, p.threshold);
      pd = kept ? pr * rp : acc_t(0);
      ds = pr * ((kept ? dp * rp : acc_t(0)) - Ds[lane]);
    }
    for (int ii = 0; ii < kTile; ++ii) {
      const acc_t wv = __shfl_sync(kFullWarpMask, pd, ii);
      const acc_t wk = __shfl_sync(kFullWarpMask, ds, ii);
#pragma unroll
      for (int c = 0; c < kPerLane; ++c) {
        const int64_t d = lane + 32 * c;
        if (d < D) {
          dv[c] += wv * Gs[ii * (D + 1) + d];
          dk[c] += wk * Qs[ii * (D + 1) + d];
        }
      }
    }
  }
  if (j >= p.K) return;
  scalar_t* dkrow = p.dk + b * p.dks0 + h * p.dks1 + j * p.dks2;
  scalar_t* dvrow = p.dv + b * p.dvs0 + h * p.dvs1 + j * p.dvs2;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int64_t d = lane + 32 * c;
    if (d < D) {
      dkrow[d] = static_cast<scalar_t>(live ? dk[c] : acc_t(0));
      dvrow[d] = static_cast<scalar_t>(live ? dv[c] : acc_t(0));
    }
  }
}

at::Tensor dense_rows(const at::Tensor& t) {
  return t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous();
}

at::Tensor empty_bthd(int64_t B, int64_t H, int64_t T, int64_t D, const at::TensorOptions& opts) {
  return at::empty({B, T, H, D}, opts).transpose(1, 2);
}

uint32_t threshold_of(double p) {
  if (!(p > 0.0)) return 0;
  return static_cast<uint32_t>(std::min(std::floor(p * 4294967296.0), 4294967295.0));
}

template <typename scalar_t>
void fill_common(Params<scalar_t>& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& key_lengths,
                 const std::optional<at::Tensor>& query_lengths, const std::optional<at::Tensor>& seed,
                 double scale, bool causal, double dropout_p) {
  p.q = q.const_data_ptr<scalar_t>();
  p.k = k.const_data_ptr<scalar_t>();
  p.v = v.const_data_ptr<scalar_t>();
  p.H = q.size(1);
  p.Q = q.size(2);
  p.K = k.size(2);
  p.D = q.size(3);
  p.qs0 = q.stride(0); p.qs1 = q.stride(1); p.qs2 = q.stride(2);
  p.ks0 = k.stride(0); p.ks1 = k.stride(1); p.ks2 = k.stride(2);
  p.vs0 = v.stride(0); p.vs1 = v.stride(1); p.vs2 = v.stride(2);
  p.klen = key_lengths.has_value() && key_lengths->defined() ? key_lengths->const_data_ptr<int64_t>() : nullptr;
  p.qlen = query_lengths.has_value() && query_lengths->defined() ? query_lengths->const_data_ptr<int64_t>() : nullptr;
  p.seed = dropout_p > 0.0 ? seed->const_data_ptr<int64_t>() : nullptr;
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.dropout = dropout_p > 0.0;
  p.threshold = threshold_of(dropout_p);
  p.keep_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
}

std::optional<at::Tensor> contiguous_opt(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return t->contiguous();
}

// The bias in the math type, expanded to [B, H, Q, K] (a view: stride 0 where it broadcasts).
template <typename scalar_t>
at::Tensor fill_bias(Params<scalar_t>& p, const at::Tensor& bias, int64_t B, int64_t H, int64_t Q,
                     int64_t K) {
  if (!bias.defined()) return at::Tensor();
  const at::ScalarType acc = std::is_same_v<scalar_t, double> ? at::kDouble : at::kFloat;
  at::Tensor e = bias.to(acc).expand({B, H, Q, K});
  p.bias = e.const_data_ptr<at::opmath_type<scalar_t>>();
  p.bs0 = e.stride(0); p.bs1 = e.stride(1); p.bs2 = e.stride(2); p.bs3 = e.stride(3);
  return e;
}

void check_cuda_attention(const at::Tensor& q) {
  CHECK_CUDA(q);
  TORCH_CHECK(q.size(3) <= kMaxD, "q: the CUDA attention kernel supports head dims up to ", kMaxD,
              ", got ", q.size(3));
}

}  // namespace

namespace cuda_impl {

namespace {

std::tuple<at::Tensor, at::Tensor> attention_impl(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& bias,
                                                  const std::optional<at::Tensor>& key_lengths,
                                                  const std::optional<at::Tensor>& query_lengths,
                                                  double scale, bool causal, double dropout_p,
                                                  const std::optional<at::Tensor>& seed) {
  check_attention_args(q, k, v, key_lengths, query_lengths, scale, dropout_p, seed);
  check_cuda_attention(q);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), K = k.size(2), D = q.size(3);
  if (bias.defined()) check_position_bias(bias, q, B, H, Q, K);
  const at::Tensor qd = dense_rows(q), kd = dense_rows(k), vd = dense_rows(v);
  const auto kl = contiguous_opt(key_lengths), ql = contiguous_opt(query_lengths);
  at::Tensor out = empty_bthd(B, H, Q, D, q.options());
  at::Tensor lse = at::empty({B, H, Q}, q.options().dtype(at::kFloat));
  if (B * H * Q == 0) return {out, lse};
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  TE_DISPATCH_FLOATING(q.scalar_type(), "attention_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Params<scalar_t> p{};
    fill_common(p, qd, kd, vd, kl, ql, seed, scale, causal, dropout_p);
    const at::Tensor bias_e = fill_bias(p, bias, B, H, Q, K);
    p.o = out.data_ptr<scalar_t>();
    p.os0 = out.stride(0); p.os1 = out.stride(1); p.os2 = out.stride(2);
    p.lse = lse.data_ptr<float>();
    const size_t smem = sizeof(acc_t) * (2 * kTile * (D + 1) + kWarps * D);
    const dim3 grid(static_cast<unsigned>(ceil_div(Q, kWarps)), static_cast<unsigned>(B * H));
    allow_smem(attention_fwd_kernel<scalar_t>, smem);
    attention_fwd_kernel<scalar_t><<<grid, kThreads, smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& bias, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& query_lengths,
    double scale, bool causal, double dropout_p, const std::optional<at::Tensor>& seed,
    bool bias_grad) {
  check_attention_args(q, k, v, key_lengths, query_lengths, scale, dropout_p, seed);
  check_cuda_attention(q);
  for (const at::Tensor* t : {&grad_out, &out}) {
    const char* name = t == &grad_out ? "grad_out" : "out";
    TORCH_CHECK(t->sizes() == q.sizes(), name, " must have the shape of q ", q.sizes(), ", got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), name, " must have the dtype of q");
    TORCH_CHECK(t->device() == q.device(), name, " must be on ", q.device(), ", got ", t->device());
  }
  CHECK_DEVICE(lse, q);
  CHECK_DTYPE(lse, at::kFloat);
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), K = k.size(2), D = q.size(3);
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H && lse.size(2) == Q,
              "lse must have shape [", B, ", ", H, ", ", Q, "], got ", lse.sizes());
  if (bias.defined()) check_position_bias(bias, q, B, H, Q, K);
  const bool want_dbias = bias.defined() && bias_grad;
  const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const at::Tensor qd = dense_rows(q), kd = dense_rows(k), vd = dense_rows(v);
  const at::Tensor gd = dense_rows(grad_out), od = dense_rows(out), lc = lse.contiguous();
  const auto kl = contiguous_opt(key_lengths), ql = contiguous_opt(query_lengths);
  at::Tensor dq = empty_bthd(B, H, Q, D, q.options());
  at::Tensor dk = empty_bthd(B, H, K, D, q.options());
  at::Tensor dv = empty_bthd(B, H, K, D, q.options());
  // d(bias): dS of every (b, h, i, j), reduced to the bias's shape and dtype at the end.
  at::Tensor dbias_full = want_dbias ? at::zeros({B, H, Q, K}, q.options().dtype(acc)) : at::Tensor();
  auto finish_dbias = [&]() {
    if (!want_dbias) return at::empty({0}, q.options());
    return dbias_full.sum_to_size(bias.sizes()).to(bias.scalar_type());
  };
  if (B * H == 0) return {dq, dk, dv, finish_dbias()};
  at::Tensor delta = at::zeros({B, H, Q}, q.options().dtype(at::kFloat));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  TE_DISPATCH_FLOATING(q.scalar_type(), "attention_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Params<scalar_t> p{};
    fill_common(p, qd, kd, vd, kl, ql, seed, scale, causal, dropout_p);
    const at::Tensor bias_e = fill_bias(p, bias, B, H, Q, K);
    if (want_dbias) p.dbias = dbias_full.data_ptr<at::opmath_type<scalar_t>>();
    p.out = od.const_data_ptr<scalar_t>();
    p.os0 = od.stride(0); p.os1 = od.stride(1); p.os2 = od.stride(2);
    p.dout = gd.const_data_ptr<scalar_t>();
    p.gs0 = gd.stride(0); p.gs1 = gd.stride(1); p.gs2 = gd.stride(2);
    p.dq = dq.data_ptr<scalar_t>();
    p.dqs0 = dq.stride(0); p.dqs1 = dq.stride(1); p.dqs2 = dq.stride(2);
    p.dk = dk.data_ptr<scalar_t>();
    p.dks0 = dk.stride(0); p.dks1 = dk.stride(1); p.dks2 = dk.stride(2);
    p.dv = dv.data_ptr<scalar_t>();
    p.dvs0 = dv.stride(0); p.dvs1 = dv.stride(1); p.dvs2 = dv.stride(2);
    p.lse = lc.data_ptr<float>();
    p.delta = delta.data_ptr<float>();
    if (Q > 0) {
      const size_t smem = sizeof(acc_t) * (2 * kTile * (D + 1) + 2 * kWarps * D);
      const dim3 grid(static_cast<unsigned>(ceil_div(Q, kWarps)), static_cast<unsigned>(B * H));
      allow_smem(attention_bwd_dq_kernel<scalar_t>, smem);
      attention_bwd_dq_kernel<scalar_t><<<grid, kThreads, smem, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (K > 0) {
      const size_t smem = sizeof(acc_t) * (2 * kTile * (D + 1) + 2 * kWarps * D + 2 * kTile);
      const dim3 grid(static_cast<unsigned>(ceil_div(K, kWarps)), static_cast<unsigned>(B * H));
      allow_smem(attention_bwd_dkv_kernel<scalar_t>, smem);
      attention_bwd_dkv_kernel<scalar_t><<<grid, kThreads, smem, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {dq, dk, dv, finish_dbias()};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v,
                                             const std::optional<at::Tensor>& key_lengths,
                                             const std::optional<at::Tensor>& query_lengths,
                                             double scale, bool causal, double dropout_p,
                                             const std::optional<at::Tensor>& seed) {
  return attention_impl(q, k, v, at::Tensor(), key_lengths, query_lengths, scale, causal,
                        dropout_p, seed);
}

std::tuple<at::Tensor, at::Tensor> attention_with_bias(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& position_bias,
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& query_lengths,
    double scale, bool causal, double dropout_p, const std::optional<at::Tensor>& seed) {
  TORCH_CHECK(position_bias.defined(), "position_bias must be a tensor");
  return attention_impl(q, k, v, position_bias, key_lengths, query_lengths, scale, causal,
                        dropout_p, seed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& query_lengths, double scale, bool causal, double dropout_p,
    const std::optional<at::Tensor>& seed) {
  auto [dq, dk, dv, db] = attention_backward_impl(grad_out, q, k, v, at::Tensor(), out, lse,
                                                  key_lengths, query_lengths, scale, causal,
                                                  dropout_p, seed, false);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_with_bias_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& position_bias, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& query_lengths,
    double scale, bool causal, double dropout_p, const std::optional<at::Tensor>& seed,
    bool bias_grad) {
  TORCH_CHECK(position_bias.defined(), "position_bias must be a tensor");
  return attention_backward_impl(grad_out, q, k, v, position_bias, out, lse, key_lengths,
                                 query_lengths, scale, causal, dropout_p, seed, bias_grad);
}

at::Tensor attention_dropout_mask(const at::Tensor& seed, int64_t B, int64_t H, int64_t Q, int64_t K,
                                  double dropout_p) {
  return transformer_ext::attention_dropout_mask(seed.cpu(), B, H, Q, K, dropout_p).to(seed.device());
}

}  // namespace cuda_impl
}  // namespace transformer_ext

TORCH_LIBRARY_IMPL(transformer_ext, CUDA, m) {
  m.impl("attention", &transformer_ext::cuda_impl::attention);
  m.impl("attention_backward", &transformer_ext::cuda_impl::attention_backward);
  m.impl("attention_with_bias", &transformer_ext::cuda_impl::attention_with_bias);
  m.impl("attention_with_bias_backward", &transformer_ext::cuda_impl::attention_with_bias_backward);
  m.impl("attention_dropout_mask", &transformer_ext::cuda_impl::attention_dropout_mask);
}
