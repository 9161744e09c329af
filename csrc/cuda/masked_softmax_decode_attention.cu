// CUDA kernels of masked_softmax, masked_softmax_backward and decode_attention (the one-query
// attention over a cache; docs/DESIGN.md section 2). transformer_ext/reference.py is the oracle of each.
//
// masked_softmax / masked_softmax_backward, rows of K scores ([B, H, Q, K] contiguous):
//   K <= 1024  one warp per row, each lane holds its K/32 elements in registers
//              (8 rows per 256-thread block, grid-stride loop over rows);
//   K >  1024  one 512-thread block per row (grid-stride loop over rows); the forward pass
//              keeps the row's scaled scores in shared memory up to K = 8192 and re-reads
//              global memory beyond that, so any K works.
// decode_attention: one 256-thread block per (b, h) pair (grid-stride loop). Each of the 8
//   warps takes a strided share of the keys, computes q.k with lane-strided loads and a warp
//   reduction, and keeps its own online softmax (running max, running sum, weighted V sum in
//   registers); the 8 partial states are merged through shared memory at the end. Nothing
//   grows with L, so any cache length works. The head dim is processed in tiles of 32 * R
//   (R in {1, 2, 4, 8} chosen from D), so any D >= 1 works; for D > 256 the scores are
//   recomputed once per 256-wide tile of the output.
//   When B * H is below the SM count and the cache holds >= 512 keys, each row's keys are
//   split into ranges of >= 256 keys handled by separate blocks (flash-decoding), whose
//   float32 softmax states a second small kernel merges; otherwise it is one launch.
//   decode_attention_with_bias adds a float32 position bias to each scaled score.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "ops.h"
#include "utils.cuh"

namespace transformer_ext {
namespace {

constexpr int kSoftmaxWarpThreads = 256;     // warp-per-row kernels: 8 rows per block
constexpr int64_t kSoftmaxWarpMaxK = 1024;   // longest row kept in registers (32 per lane)
constexpr int kSoftmaxBlockThreads = 512;    // block-per-row kernels
constexpr int64_t kSoftmaxSmemMaxK = 8192;   // block forward caches rows this long (32 KiB)
constexpr int kDecodeWarps = 8;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodeCombineThreads = 128;
constexpr int64_t kDecodeMinKeysPerSplit = 256;  // split a row only into ranges this long
constexpr int64_t kDecodeMaxSplits = 64;

// ---------------------------------------------------------------------------------------
// masked_softmax
// ---------------------------------------------------------------------------------------

// The bool mask expanded to [B, H, Q, K] (stride 0 on broadcast dims), read as bytes.
struct MaskView {
  const uint8_t* ptr;  // nullptr: no mask
  int64_t s0, s1, s2, s3;
};

template <typename scalar_t>
struct SoftmaxForwardParams {
  const scalar_t* scores;  // [rows, K] contiguous, rows = B * H * Q
  scalar_t* probs;         // [rows, K] contiguous
  MaskView mask;
  int64_t rows, H, Q, K;
  float scale;
  bool causal;
};

// Per-row constants of the forward pass: where the row's mask starts and the last key it
// may see (the causal limit folded with K - 1; negative when the row sees no key at all).
struct RowInfo {
  const uint8_t* mask_row;  // nullptr: no mask
  int64_t last_key;
};

template <typename scalar_t>
__device__ __forceinline__ RowInfo row_info(const SoftmaxForwardParams<scalar_t>& p, int64_t row) {
  const int64_t i = row % p.Q;
  const int64_t bh = row / p.Q;
  const int64_t h = bh % p.H;
  const int64_t b = bh / p.H;
  RowInfo info;
  info.mask_row =
      p.mask.ptr != nullptr ? p.mask.ptr + b * p.mask.s0 + h * p.mask.s1 + i * p.mask.s2 : nullptr;
  // causal: query i sees key j iff j <= i + (K - Q), aligned bottom-right.
  const int64_t causal_last = i + (p.K - p.Q);
  info.last_key = (p.causal && causal_last < p.K - 1) ? causal_last : p.K - 1;
  return info;
}

// scale * score in float32 for an allowed key, -inf otherwise (k >= K included, since
// last_key <= K - 1), so nothing past the row is ever read.
template <typename scalar_t>
__device__ __forceinline__ float scaled_score(const scalar_t* row, const RowInfo& info,
                                              int64_t mask_s3, int64_t k, float scale) {
  if (k > info.last_key) return -INFINITY;
  if (info.mask_row != nullptr && info.mask_row[k * mask_s3] == 0) return -INFINITY;
  return static_cast<float>(row[k]) * scale;
}

// One warp per row; lane l holds keys l, l + 32, ..., l + 32 * (kElems - 1).
template <typename scalar_t, int kElems>
__global__ void __launch_bounds__(kSoftmaxWarpThreads)
    masked_softmax_warp_kernel(const SoftmaxForwardParams<scalar_t> p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps_per_block = blockDim.x >> 5;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * warps_per_block + (threadIdx.x >> 5);
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * warps_per_block;
  // The row loop is uniform within a warp, so every lane reaches every shuffle.
  for (int64_t row = first_row; row < p.rows; row += row_step) {
    const RowInfo info = row_info(p, row);
    const scalar_t* in = p.scores + row * p.K;
    float x[kElems];
    float row_max = -INFINITY;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      x[e] = scaled_score(in, info, p.mask.s3, lane + 32 * e, p.scale);
      row_max = fmaxf(row_max, x[e]);
    }
    const float shift = softmax_shift(warp_allreduce_max(row_max));
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      x[e] = expf(x[e] - shift);  // masked: exp(-inf) = 0
      sum += x[e];
    }
    sum = warp_allreduce_sum(sum);
    scalar_t* out = p.probs + row * p.K;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      const int64_t k = lane + 32 * e;
      if (k < p.K) out[k] = static_cast<scalar_t>(softmax_normalize(x[e], sum));
    }
  }
}

// One block per row, any K. With kCacheRow the scaled scores, then their exponentials, live
// in dynamic shared memory (K floats); otherwise each pass re-reads global memory. Thread t
// only ever touches keys t, t + blockDim.x, ... of s_row, so s_row needs no barrier; s_red
// is protected by the barriers inside the block reductions.
template <typename scalar_t, bool kCacheRow>
__global__ void __launch_bounds__(kSoftmaxBlockThreads)
    masked_softmax_block_kernel(const SoftmaxForwardParams<scalar_t> p) {
  extern __shared__ float s_row[];
  __shared__ float s_red[32];
  const int64_t tid = threadIdx.x;
  const int64_t nthreads = blockDim.x;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {  // uniform in the block
    const RowInfo info = row_info(p, row);
    const scalar_t* in = p.scores + row * p.K;
    float row_max = -INFINITY;
    for (int64_t k = tid; k < p.K; k += nthreads) {
      const float x = scaled_score(in, info, p.mask.s3, k, p.scale);
      if constexpr (kCacheRow) s_row[k] = x;
      row_max = fmaxf(row_max, x);
    }
    const float shift = softmax_shift(block_allreduce_max(row_max, s_red));
    float sum = 0.f;
    for (int64_t k = tid; k < p.K; k += nthreads) {
      float x;
      if constexpr (kCacheRow) {
        x = s_row[k];
      } else {
        x = scaled_score(in, info, p.mask.s3, k, p.scale);
      }
      const float e = expf(x - shift);
      if constexpr (kCacheRow) s_row[k] = e;
      sum += e;
    }
    sum = block_allreduce_sum(sum, s_red);
    scalar_t* out = p.probs + row * p.K;
    for (int64_t k = tid; k < p.K; k += nthreads) {
      float e;
      if constexpr (kCacheRow) {
        e = s_row[k];
      } else {
        e = expf(scaled_score(in, info, p.mask.s3, k, p.scale) - shift);
      }
      out[k] = static_cast<scalar_t>(softmax_normalize(e, sum));
    }
  }
}

template <typename scalar_t, int kElems>
void launch_softmax_warp(const SoftmaxForwardParams<scalar_t>& p, cudaStream_t stream) {
  const unsigned grid = grid_size_for(p.rows, kSoftmaxWarpThreads / 32, 32);
  masked_softmax_warp_kernel<scalar_t, kElems><<<grid, kSoftmaxWarpThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_masked_softmax(const SoftmaxForwardParams<scalar_t>& p, cudaStream_t stream) {
  if (p.K <= 32) {
    launch_softmax_warp<scalar_t, 1>(p, stream);
  } else if (p.K <= 64) {
    launch_softmax_warp<scalar_t, 2>(p, stream);
  } else if (p.K <= 128) {
    launch_softmax_warp<scalar_t, 4>(p, stream);
  } else if (p.K <= 256) {
    launch_softmax_warp<scalar_t, 8>(p, stream);
  } else if (p.K <= 512) {
    launch_softmax_warp<scalar_t, 16>(p, stream);
  } else if (p.K <= kSoftmaxWarpMaxK) {
    launch_softmax_warp<scalar_t, 32>(p, stream);
  } else if (p.K <= kSoftmaxSmemMaxK) {
    const unsigned grid = grid_size_for(p.rows, 1, 8);
    const size_t smem = static_cast<size_t>(p.K) * sizeof(float);  // <= 32 KiB
    masked_softmax_block_kernel<scalar_t, true><<<grid, kSoftmaxBlockThreads, smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    const unsigned grid = grid_size_for(p.rows, 1, 8);
    masked_softmax_block_kernel<scalar_t, false><<<grid, kSoftmaxBlockThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// ---------------------------------------------------------------------------------------
// masked_softmax_backward: d scores = scale * p * (g - sum_k g * p)
// ---------------------------------------------------------------------------------------

template <typename scalar_t>
struct SoftmaxBackwardParams {
  const scalar_t* grad_probs;  // [rows, K] contiguous
  const scalar_t* probs;       // [rows, K] contiguous
  scalar_t* grad_scores;       // [rows, K] contiguous
  int64_t rows, K;
  float scale;
};

template <typename scalar_t, int kElems>
__global__ void __launch_bounds__(kSoftmaxWarpThreads)
    masked_softmax_backward_warp_kernel(const SoftmaxBackwardParams<scalar_t> p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps_per_block = blockDim.x >> 5;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * warps_per_block + (threadIdx.x >> 5);
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * warps_per_block;
  for (int64_t row = first_row; row < p.rows; row += row_step) {  // uniform within a warp
    const scalar_t* g_row = p.grad_probs + row * p.K;
    const scalar_t* p_row = p.probs + row * p.K;
    float g[kElems], pr[kElems];
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      const int64_t k = lane + 32 * e;
      g[e] = 0.f;
      pr[e] = 0.f;
      if (k < p.K) {
        g[e] = static_cast<float>(g_row[k]);
        pr[e] = static_cast<float>(p_row[k]);
      }
      dot += g[e] * pr[e];
    }
    dot = warp_allreduce_sum(dot);
    scalar_t* out = p.grad_scores + row * p.K;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      const int64_t k = lane + 32 * e;
      if (k < p.K) out[k] = static_cast<scalar_t>(p.scale * pr[e] * (g[e] - dot));
    }
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kSoftmaxBlockThreads)
    masked_softmax_backward_block_kernel(const SoftmaxBackwardParams<scalar_t> p) {
  __shared__ float s_red[32];
  const int64_t tid = threadIdx.x;
  const int64_t nthreads = blockDim.x;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {  // uniform in the block
    const scalar_t* g_row = p.grad_probs + row * p.K;
    const scalar_t* p_row = p.probs + row * p.K;
    float dot = 0.f;
    for (int64_t k = tid; k < p.K; k += nthreads) {
      dot += static_cast<float>(g_row[k]) * static_cast<float>(p_row[k]);
    }
    dot = block_allreduce_sum(dot, s_red);
    scalar_t* out = p.grad_scores + row * p.K;
    for (int64_t k = tid; k < p.K; k += nthreads) {
      const float g = static_cast<float>(g_row[k]);
      const float pr = static_cast<float>(p_row[k]);
      out[k] = static_cast<scalar_t>(p.scale * pr * (g - dot));
    }
  }
}

template <typename scalar_t, int kElems>
void launch_softmax_backward_warp(const SoftmaxBackwardParams<scalar_t>& p, cudaStream_t stream) {
  const unsigned grid = grid_size_for(p.rows, kSoftmaxWarpThreads / 32, 32);
  masked_softmax_backward_warp_kernel<scalar_t, kElems>
      <<<grid, kSoftmaxWarpThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_masked_softmax_backward(const SoftmaxBackwardParams<scalar_t>& p,
                                    cudaStream_t stream) {
  if (p.K <= 32) {
    launch_softmax_backward_warp<scalar_t, 1>(p, stream);
  } else if (p.K <= 64) {
    launch_softmax_backward_warp<scalar_t, 2>(p, stream);
  } else if (p.K <= 128) {
    launch_softmax_backward_warp<scalar_t, 4>(p, stream);
  } else if (p.K <= 256) {
    launch_softmax_backward_warp<scalar_t, 8>(p, stream);
  } else if (p.K <= 512) {
    launch_softmax_backward_warp<scalar_t, 16>(p, stream);
  } else if (p.K <= kSoftmaxWarpMaxK) {
    launch_softmax_backward_warp<scalar_t, 32>(p, stream);
  } else {
    const unsigned grid = grid_size_for(p.rows, 1, 8);
    masked_softmax_backward_block_kernel<scalar_t><<<grid, kSoftmaxBlockThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// ---------------------------------------------------------------------------------------
// decode_attention
// ---------------------------------------------------------------------------------------

template <typename scalar_t>
struct DecodeParams {
  const scalar_t* q;        // [B, H, 1, D] contiguous
  const scalar_t* k_cache;  // [B, H, L, D], strides k_sb, k_sh, k_sl, unit stride over D
  const scalar_t* v_cache;  // [B, H, L, D], strides v_sb, v_sh, v_sl, unit stride over D
  const int64_t* lengths;   // [B] contiguous
  const scalar_t* k_new;    // [B, H, 1, D] contiguous, or nullptr
  const scalar_t* v_new;    // [B, H, 1, D] contiguous, or nullptr (given with k_new)
  scalar_t* out;            // [B, H, 1, D] contiguous; written when splits == 1
  float* partial;           // [B * H, splits, 2 + D] float32 when splits > 1, else nullptr
  int64_t BH, H, L, D;
  int64_t k_sb, k_sh, k_sl;
  int64_t v_sb, v_sh, v_sl;
  int64_t splits;           // key ranges per (b, h); 1 = one block does the whole row
  int64_t keys_per_split;   // split s covers keys [s * keys_per_split, (s + 1) * keys_per_split)
  float scale;
  // Position bias or nullptr (float32): bias(b, h, j) at b * bias_sb + h * bias_sh + j * bias_sl
  // for cache key j, and at j = L for the new key.
  const float* bias;
  int64_t bias_sb, bias_sh, bias_sl;
};

// One block per work item (b, h, split) (grid-stride loop). kR head-dim elements per lane
// per tile (tile = 32 * kR dims of the output); each warp step handles kKeys = 16 / kR keys,
// i.e. 16 K loads and 16 V loads in flight per lane.
//
// The softmax state of a key range is (m, l, acc[d]): m the largest score (-inf if none),
// l = sum_j exp(s_j - shift), acc[d] = sum_j exp(s_j - shift) v_j[d], shift = softmax_shift(m).
// A range without keys is (-inf, 0, 0), and merging with factors exp(m - shift') gives it
// weight exp(-inf) = 0, never NaN.
template <typename scalar_t, int kR>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_kernel(const DecodeParams<scalar_t> p) {
  constexpr int kTile = 32 * kR;
  constexpr int kKeys = 16 / kR;
  // Only the widest variant is launched with D > kTile (launch_decode_attention).
  constexpr bool kMultiTile = kR == 8;
  static_assert(kKeys >= 1 && kTile <= kDecodeThreads, "one thread per output dim of a tile");
  __shared__ float s_max[kDecodeWarps];
  __shared__ float s_sum[kDecodeWarps];
  __shared__ float s_acc[kDecodeWarps][kTile];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  constexpr int64_t kWarpStride = static_cast<int64_t>(kDecodeWarps) * kKeys;
  const int64_t items = p.BH * p.splits;

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {  // uniform in the block
    const int64_t bh = item / p.splits;
    const int64_t split = item % p.splits;
    const int64_t b = bh / p.H;
    const int64_t h = bh % p.H;
    // Clamp on the device: checking on the host would cost a sync per step (ops.py says so).
    int64_t len = p.lengths[b];
    len = len < 0 ? 0 : (len > p.L ? p.L : len);
    const int64_t n = len + (p.k_new != nullptr ? 1 : 0);  // keys: cache[0, len) + new
    // This block's keys [j_begin, j_end); empty when the row is shorter than the split start.
    const int64_t j_begin = split * p.keys_per_split;
    const int64_t j_end = n < j_begin + p.keys_per_split ? n : j_begin + p.keys_per_split;
    const scalar_t* q_row = p.q + bh * p.D;
    const scalar_t* k_base = p.k_cache + b * p.k_sb + h * p.k_sh;
    const scalar_t* v_base = p.v_cache + b * p.v_sb + h * p.v_sh;
    const scalar_t* k_extra = p.k_new != nullptr ? p.k_new + bh * p.D : nullptr;
    const scalar_t* v_extra = p.v_new != nullptr ? p.v_new + bh * p.D : nullptr;

    // q dims lane + 32 i of the first tile in registers; dims past it (D > 256) re-read q.
    float q_reg[kR];
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const int64_t d = lane + 32 * i;
      q_reg[i] = d < p.D ? static_cast<float>(q_row[d]) : 0.f;
    }

    for (int64_t d0 = 0; d0 < p.D; d0 += kTile) {  // one pass for D <= 256
      // This warp's state; acc[i] is output dim d0 + lane + 32 i.
      float run_max = -INFINITY;
      float run_sum = 0.f;
      float acc[kR];
#pragma unroll
      for (int i = 0; i < kR; ++i) acc[i] = 0.f;

      // The key loop is uniform within a warp (j0 depends on the warp only): every lane
      // reaches every shuffle. Key j < len is cache row j, key j == len the new key.
      for (int64_t j0 = j_begin + static_cast<int64_t>(warp) * kKeys; j0 < j_end;
           j0 += kWarpStride) {
        float score[kKeys];
        float val[kKeys][kR];
#pragma unroll
        for (int u = 0; u < kKeys; ++u) {
          const int64_t j = j0 + u;
          score[u] = 0.f;
#pragma unroll
          for (int i = 0; i < kR; ++i) val[u][i] = 0.f;
          if (j < j_end) {
            const scalar_t* k_row = j < len ? k_base + j * p.k_sl : k_extra;
            const scalar_t* v_row = j < len ? v_base + j * p.v_sl : v_extra;
#pragma unroll
            for (int i = 0; i < kR; ++i) {
              const int64_t d = lane + 32 * i;
              if (d < p.D) score[u] += q_reg[i] * static_cast<float>(k_row[d]);
            }
            if constexpr (kMultiTile) {
              for (int64_t d = kTile + lane; d < p.D; d += 32) {
                score[u] += static_cast<float>(q_row[d]) * static_cast<float>(k_row[d]);
              }
            }
#pragma unroll
            for (int i = 0; i < kR; ++i) {
              const int64_t d = d0 + lane + 32 * i;
              if (d < p.D) val[u][i] = static_cast<float>(v_row[d]);
            }
          }
        }
        float step_max = run_max;
#pragma unroll
        for (int u = 0; u < kKeys; ++u) {
          const float dot = warp_allreduce_sum(score[u]);
          score[u] = j0 + u < j_end ? dot * p.scale : -INFINITY;  // reference: scale * (q.k)
          if (p.bias != nullptr && j0 + u < j_end) {  // + bias; the new key's entry is at L
            const int64_t jb = j0 + u < len ? j0 + u : p.L;
            score[u] += p.bias[b * p.bias_sb + h * p.bias_sh + jb * p.bias_sl];
          }
          step_max = fmaxf(step_max, score[u]);
        }
        const float shift = softmax_shift(step_max);
        const float alpha = expf(run_max - shift);  // 0 while run_max is -inf
        run_sum *= alpha;
#pragma unroll
        for (int i = 0; i < kR; ++i) acc[i] *= alpha;
#pragma unroll
        for (int u = 0; u < kKeys; ++u) {
          const float w = expf(score[u] - shift);  // 0 for keys past j_end
          run_sum += w;
#pragma unroll
          for (int i = 0; i < kR; ++i) acc[i] += w * val[u][i];
        }
        run_max = step_max;
      }

      // Merge the warps' states: num = sum_w acc_w e^(m_w - shift), den likewise with l_w.
      if (lane == 0) {
        s_max[warp] = run_max;
        s_sum[warp] = run_sum;
      }
#pragma unroll
      for (int i = 0; i < kR; ++i) s_acc[warp][lane + 32 * i] = acc[i];
      __syncthreads();
      const int64_t d = d0 + threadIdx.x;
      if (threadIdx.x < kTile && d < p.D) {
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w) m = fmaxf(m, s_max[w]);
        const float shift = softmax_shift(m);
        float num = 0.f;
        float den = 0.f;
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w) {
          const float f = expf(s_max[w] - shift);  // 0 for a warp without keys
          den += s_sum[w] * f;
          num += s_acc[w][threadIdx.x] * f;
        }
        if (p.splits == 1) {
          p.out[bh * p.D + d] = static_cast<scalar_t>(softmax_normalize(num, den));
        } else {
          // This split's merged state, relative to softmax_shift(m); combined by
          // decode_attention_combine_kernel.
          float* state = p.partial + item * (p.D + 2);
          if (d == 0) {
            state[0] = m;
            state[1] = den;
          }
          state[2 + d] = num;
        }
      }
      __syncthreads();  // s_max / s_sum / s_acc are rewritten by the next tile or item
    }
  }
}

// Merges the split states of each (b, h): out[d] = sum_s acc_s[d] e^(m_s - shift) /
// sum_s l_s e^(m_s - shift), shift = softmax_shift(max_s m_s); zeros when no split had a key.
template <typename scalar_t>
__global__ void __launch_bounds__(kDecodeCombineThreads)
    decode_attention_combine_kernel(const float* __restrict__ partial,  // [BH, splits, 2 + D]
                                    scalar_t* __restrict__ out,         // [BH, D]
                                    int64_t BH, int64_t splits, int64_t D) {
  for (int64_t bh = blockIdx.x; bh < BH; bh += gridDim.x) {
    const float* states = partial + bh * splits * (D + 2);
    float m = -INFINITY;
    for (int64_t s = 0; s < splits; ++s) m = fmaxf(m, states[s * (D + 2)]);
    const float shift = softmax_shift(m);
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      float num = 0.f;
      float den = 0.f;
      for (int64_t s = 0; s < splits; ++s) {
        const float* state = states + s * (D + 2);
        const float f = expf(state[0] - shift);  // 0 for a split without keys
        den += state[1] * f;
        num += state[2 + d] * f;
      }
      out[bh * D + d] = static_cast<scalar_t>(softmax_normalize(num, den));
    }
  }
}

template <typename scalar_t, int kR>
void launch_decode(const DecodeParams<scalar_t>& p, cudaStream_t stream) {
  const unsigned grid = grid_size_for(p.BH * p.splits, 1, 16);
  decode_attention_kernel<scalar_t, kR><<<grid, kDecodeThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// kR = 1, 2, 4 cover D <= 32 kR in one tile; kR = 8 tiles any larger D.
template <typename scalar_t>
void launch_decode_attention(const DecodeParams<scalar_t>& p, cudaStream_t stream) {
  if (p.D <= 32) {
    launch_decode<scalar_t, 1>(p, stream);
  } else if (p.D <= 64) {
    launch_decode<scalar_t, 2>(p, stream);
  } else if (p.D <= 128) {
    launch_decode<scalar_t, 4>(p, stream);
  } else {
    launch_decode<scalar_t, 8>(p, stream);
  }
  if (p.splits > 1) {
    const unsigned grid = grid_size_for(p.BH, 1, 16);
    decode_attention_combine_kernel<scalar_t>
        <<<grid, kDecodeCombineThreads, 0, stream>>>(p.partial, p.out, p.BH, p.splits, p.D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// How many blocks share one (b, h) row: 1 unless B * H blocks would leave most of the GPU
// idle and the cache is long, then enough splits of >= kDecodeMinKeysPerSplit keys to give
// every SM about two blocks. Returns {splits, keys_per_split}; keys_per_split >= 1.
std::pair<int64_t, int64_t> decode_splits(int64_t BH, int64_t max_keys) {
  const int64_t sms = num_sms();
  int64_t splits = 1;
  if (BH < sms && max_keys >= 2 * kDecodeMinKeysPerSplit) {
    splits = std::min({ceil_div(2 * sms, BH), max_keys / kDecodeMinKeysPerSplit,
                       kDecodeMaxSplits});
  }
  if (splits <= 1) return {1, std::max<int64_t>(max_keys, 1)};
  const int64_t keys_per_split = ceil_div(max_keys, splits);
  return {ceil_div(max_keys, keys_per_split), keys_per_split};  // no empty trailing split
}

// Rows of D elements must be dense for the kernel's unit-stride loads; a cache whose last
// dim is strided is copied (it is only read here).
at::Tensor with_dense_rows(const at::Tensor& t) {
  return t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous();
}

}  // namespace

namespace cuda_impl {

// The CUDA implementations are registered under the schemas of torch_bindings.cpp; they live
// in their own namespace so that they do not collide with the CPU host functions of ops.h.

at::Tensor masked_softmax(const at::Tensor& scores,               // [B, H, Q, K]
                          const std::optional<at::Tensor>& mask,  // bool, broadcastable
                          double scale, bool causal) {
  const at::Tensor mask_view = check_masked_softmax_args(scores, mask);  // expanded, no copy
  CHECK_CUDA(scores);
  const c10::cuda::OptionalCUDAGuard device_guard(scores.device());
  const at::Tensor x = scores.contiguous();
  at::Tensor probs = at::empty(x.sizes(), x.options());  // contiguous, input dtype
  if (probs.numel() == 0) return probs;

  MaskView mv{nullptr, 0, 0, 0, 0};
  if (mask_view.defined()) {
    mv.ptr = reinterpret_cast<const uint8_t*>(mask_view.const_data_ptr<bool>());
    mv.s0 = mask_view.stride(0);
    mv.s1 = mask_view.stride(1);
    mv.s2 = mask_view.stride(2);
    mv.s3 = mask_view.stride(3);
  }
  const int64_t B = x.size(0), H = x.size(1), Q = x.size(2), K = x.size(3);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  TE_DISPATCH_FLOATING(x.scalar_type(), "masked_softmax_cuda", [&] {
    SoftmaxForwardParams<scalar_t> p;
    p.scores = x.const_data_ptr<scalar_t>();
    p.probs = probs.data_ptr<scalar_t>();
    p.mask = mv;
    p.rows = B * H * Q;
    p.H = H;
    p.Q = Q;
    p.K = K;
    p.scale = static_cast<float>(scale);
    p.causal = causal;
    launch_masked_softmax<scalar_t>(p, stream);
  });
  return probs;
}

at::Tensor masked_softmax_backward(const at::Tensor& grad_probs,  // [B, H, Q, K]
                                   const at::Tensor& probs,       // [B, H, Q, K]
                                   double scale) {
  check_masked_softmax_backward_args(grad_probs, probs);
  CHECK_CUDA(probs);
  const c10::cuda::OptionalCUDAGuard device_guard(probs.device());
  const at::Tensor g = grad_probs.contiguous();
  const at::Tensor pr = probs.contiguous();
  at::Tensor grad_scores = at::empty(pr.sizes(), pr.options());
  if (grad_scores.numel() == 0) return grad_scores;

  const int64_t K = pr.size(3);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  TE_DISPATCH_FLOATING(pr.scalar_type(), "masked_softmax_backward_cuda", [&] {
    SoftmaxBackwardParams<scalar_t> p;
    p.grad_probs = g.const_data_ptr<scalar_t>();
    p.probs = pr.const_data_ptr<scalar_t>();
    p.grad_scores = grad_scores.data_ptr<scalar_t>();
    p.rows = pr.numel() / K;
    p.K = K;
    p.scale = static_cast<float>(scale);
    launch_masked_softmax_backward<scalar_t>(p, stream);
  });
  return grad_scores;
}

namespace {

at::Tensor decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& lengths, double scale,
                                 const std::optional<at::Tensor>& k_new,
                                 const std::optional<at::Tensor>& v_new, const at::Tensor& bias) {
  check_decode_attention_args(q, k_cache, v_cache, lengths, k_new, v_new);
  CHECK_CUDA(q);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), L = k_cache.size(2), D = q.size(3);
  const bool with_new = k_new.has_value() && k_new->defined();
  if (bias.defined()) check_decode_position_bias(bias, q, L + (with_new ? 1 : 0));
  at::Tensor out = at::empty({B, H, 1, D}, q.options());  // contiguous
  if (out.numel() == 0) return out;

  const at::Tensor qc = q.contiguous();
  const at::Tensor kc = with_dense_rows(k_cache);
  const at::Tensor vc = with_dense_rows(v_cache);
  const at::Tensor len = lengths.contiguous();
  const bool has_new = k_new.has_value() && k_new->defined();  // v_new too (checked)
  const at::Tensor kn = has_new ? k_new->contiguous() : at::Tensor();
  const at::Tensor vn = has_new ? v_new->contiguous() : at::Tensor();

  const int64_t BH = B * H;
  const std::pair<int64_t, int64_t> plan = decode_splits(BH, L + (has_new ? 1 : 0));
  const int64_t splits = plan.first, keys_per_split = plan.second;
  at::Tensor partial;  // per-split softmax states, only when rows are split
  if (splits > 1) partial = at::empty({BH, splits, D + 2}, q.options().dtype(at::kFloat));

  // float32 [B, H, 1, n] view of the bias (stride 0 where it broadcasts)
  const at::Tensor bias_f =
      bias.defined() ? bias.to(at::kFloat).expand({B, H, 1, bias.size(3)}) : at::Tensor();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  TE_DISPATCH_FLOATING(q.scalar_type(), "decode_attention_cuda", [&] {
    DecodeParams<scalar_t> p;
    p.bias = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
    p.bias_sb = bias_f.defined() ? bias_f.stride(0) : 0;
    p.bias_sh = bias_f.defined() ? bias_f.stride(1) : 0;
    p.bias_sl = bias_f.defined() ? bias_f.stride(3) : 0;
    p.q = qc.const_data_ptr<scalar_t>();
    p.k_cache = kc.const_data_ptr<scalar_t>();  // may be null when L == 0; never read then
    p.v_cache = vc.const_data_ptr<scalar_t>();
    p.lengths = len.const_data_ptr<int64_t>();
    p.k_new = has_new ? kn.const_data_ptr<scalar_t>() : nullptr;
    p.v_new = has_new ? vn.const_data_ptr<scalar_t>() : nullptr;
    p.out = out.data_ptr<scalar_t>();
    p.partial = splits > 1 ? partial.data_ptr<float>() : nullptr;
    p.BH = BH;
    p.H = H;
    p.L = L;
    p.D = D;
    p.k_sb = kc.stride(0);
    p.k_sh = kc.stride(1);
    p.k_sl = kc.stride(2);
    p.v_sb = vc.stride(0);
    p.v_sh = vc.stride(1);
    p.v_sl = vc.stride(2);
    p.splits = splits;
    p.keys_per_split = keys_per_split;
    p.scale = static_cast<float>(scale);
    launch_decode_attention<scalar_t>(p, stream);
  });
  return out;
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q,                     // [B, H, 1, D]
                            const at::Tensor& k_cache,               // [B, H, L, D]
                            const at::Tensor& v_cache,               // [B, H, L, D]
                            const at::Tensor& lengths,               // [B] int64
                            double scale,
                            const std::optional<at::Tensor>& k_new,  // [B, H, 1, D]
                            const std::optional<at::Tensor>& v_new) {
  return decode_attention_impl(q, k_cache, v_cache, lengths, scale, k_new, v_new, at::Tensor());
}

at::Tensor decode_attention_with_bias(const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& lengths,
                                      double scale, const at::Tensor& position_bias,
                                      const std::optional<at::Tensor>& k_new,
                                      const std::optional<at::Tensor>& v_new) {
  TORCH_CHECK(position_bias.defined(), "position_bias must be a tensor");
  return decode_attention_impl(q, k_cache, v_cache, lengths, scale, k_new, v_new, position_bias);
}

}  // namespace cuda_impl
}  // namespace transformer_ext

TORCH_LIBRARY_IMPL(transformer_ext, CUDA, m) {
  m.impl("masked_softmax", &transformer_ext::cuda_impl::masked_softmax);
  m.impl("masked_softmax_backward", &transformer_ext::cuda_impl::masked_softmax_backward);
  m.impl("decode_attention", &transformer_ext::cuda_impl::decode_attention);
  m.impl("decode_attention_with_bias", &transformer_ext::cuda_impl::decode_attention_with_bias);
}
