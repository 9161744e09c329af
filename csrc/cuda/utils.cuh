// Small device helpers shared by the CUDA kernels of transformer_ext: argument checks for
// CUDA tensors, launch-size helpers and warp/block reductions in float32.
//
// Reduction contract: every lane of the warp (every thread of the block for the block
// versions) must call the helper, and blockDim.x must be a multiple of 32 (at most 1024).
// The xor butterfly leaves the bitwise-identical result in every lane (float + and fmaxf
// are commutative, and each level combines the same pair of values on both sides).
#pragma once

#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#define CHECK_CUDA(x) \
  TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got a tensor on ", (x).device())

namespace transformer_ext {

constexpr unsigned kFullWarpMask = 0xffffffffu;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Number of blocks for a grid-stride loop over `work_items` items of `items_per_block`
// each: enough to fill the device several times over, never more than needed, and always
// within the 1-D grid limit (the kernels loop over whatever is left).
// Streaming multiprocessors of the current device (the properties are cached by ATen).
inline int64_t num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

inline unsigned grid_size_for(int64_t work_items, int64_t items_per_block, int64_t blocks_per_sm) {
  const int64_t sms = num_sms();
  int64_t blocks = ceil_div(work_items, items_per_block);
  blocks = std::min<int64_t>(blocks, std::max<int64_t>(1, sms * blocks_per_sm));
  blocks = std::min<int64_t>(blocks, int64_t{1} << 30);
  return static_cast<unsigned>(std::max<int64_t>(blocks, 1));
}

__device__ __forceinline__ float warp_allreduce_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(kFullWarpMask, v, offset);
  }
  return v;
}

// fmaxf ignores a NaN operand; callers that must propagate NaN get it through the sums
// (see softmax_normalize).
__device__ __forceinline__ float warp_allreduce_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullWarpMask, v, offset));
  }
  return v;
}

// Block-wide sum, returned to every thread. `s_red` is a __shared__ float[32] owned by the
// caller; the leading __syncthreads makes back-to-back calls with the same buffer safe.
__device__ __forceinline__ float block_allreduce_sum(float v, float* s_red) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = static_cast<int>(blockDim.x >> 5);
  v = warp_allreduce_sum(v);
  __syncthreads();  // earlier readers of s_red are done
  if (lane == 0) s_red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? s_red[lane] : 0.f;
  return warp_allreduce_sum(v);  // every warp reduces the same partials in the same order
}

__device__ __forceinline__ float block_allreduce_max(float v, float* s_red) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = static_cast<int>(blockDim.x >> 5);
  v = warp_allreduce_max(v);
  __syncthreads();
  if (lane == 0) s_red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? s_red[lane] : -INFINITY;
  return warp_allreduce_max(v);
}

// The softmax shift: the row maximum, or 0 when it is -inf (a row without an allowed finite
// score), exactly as reference.masked_softmax does, so exp(-inf - shift) is 0, not NaN. A +inf
// maximum stays: exp(inf - inf) is NaN, which makes the sum and so the whole row NaN, as in
// torch.softmax (the NaN rule of docs/DESIGN.md section 2).
__device__ __forceinline__ float softmax_shift(float row_max) {
  return row_max == -INFINITY ? 0.f : row_max;
}

// p = e / sum for a softmax weight: zeros for a row without an allowed key (sum == 0), NaN
// for every entry of a row whose sum is NaN (a NaN or +inf allowed score: NaN propagates
// through expf and the sums even though fmaxf drops it from the maximum).
__device__ __forceinline__ float softmax_normalize(float e, float sum) {
  return sum == 0.f ? 0.f : e / sum;
}

}  // namespace transformer_ext
