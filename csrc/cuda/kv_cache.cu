// CUDA kernels of the KV-cache family (docs/DESIGN.md section 2): kv_cache_append_ and
// kv_cache_reorder_. transformer_ext/reference.py is the oracle of each.
//
// kv_cache_append_ is one grid-stride copy over the B * H * T * D elements of the update,
// moved in 16-byte units when every row start and stride of the cache and the update is
// 16-byte aligned (the common case: D * element size a multiple of 16), element by element
// otherwise. Rows out of range are refused on the host before any launch (one sync to read
// positions) or, with an error flag, skipped on the device and reported through the flag.
// kv_cache_reorder_ gathers the valid prefix with ATen ops on the current stream after a
// host range check of the index (beam search synchronises at every step anyway).
#include <cstdint>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "utils.cuh"

namespace transformer_ext {
namespace {

constexpr int kCopyThreads = 256;

// unit_t is what one thread moves: uint4 (16 bytes) or one element. The copy only moves
// bytes, so the dtype matters only through the unit's size; Du and the strides count units.
template <typename unit_t>
struct AppendParams {
  unit_t* cache;             // [B, H, L, Du], strides cs0, cs1, cs2, unit stride over Du
  const unit_t* update;      // [B, H, T, Du] contiguous
  const int64_t* positions;  // [B] contiguous
  int* error_flag;           // one int32, or nullptr
  int64_t H, T, L, Du;
  int64_t cs0, cs1, cs2;
  int64_t total;             // B * H * T * Du > 0
};

template <typename unit_t>
__global__ void __launch_bounds__(kCopyThreads)
    kv_cache_append_kernel(const AppendParams<unit_t> p) {
  const int64_t per_batch = p.H * p.T * p.Du;  // units of update[b]
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < p.total;
       idx += step) {
    const int64_t du = idx % p.Du;
    const int64_t t = (idx / p.Du) % p.T;
    const int64_t h = (idx / (p.Du * p.T)) % p.H;
    const int64_t b = idx / per_batch;
    const int64_t pos = p.positions[b];
    if (pos < 0) continue;  // finished or padding row: skipped by design
    if (pos > p.L - p.T) {  // pos + T > L, written so that it cannot overflow
      // Exactly one thread (the row's first unit) reports the row.
      if (p.error_flag != nullptr && idx % per_batch == 0) atomicExch(p.error_flag, 1);
      continue;
    }
    p.cache[b * p.cs0 + h * p.cs1 + (pos + t) * p.cs2 + du] = p.update[idx];
  }
}

// With nothing to copy (H, T or D is 0) the flag must still report out-of-range rows.
__global__ void kv_cache_flag_kernel(const int64_t* __restrict__ positions,  // [B]
                                     int* __restrict__ error_flag, int64_t B, int64_t T,
                                     int64_t L) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < B; b += step) {
    const int64_t pos = positions[b];
    if (pos >= 0 && pos > L - T) atomicExch(error_flag, 1);
  }
}

template <typename unit_t>
void launch_append(const at::Tensor& cache, const at::Tensor& upd, const at::Tensor& pos,
                   int* flag, cudaStream_t stream) {
  constexpr int64_t kUnitBytes = sizeof(unit_t);
  const int64_t elem = cache.element_size();
  AppendParams<unit_t> p;
  p.cache = reinterpret_cast<unit_t*>(cache.data_ptr());
  p.update = reinterpret_cast<const unit_t*>(upd.const_data_ptr());
  p.positions = pos.const_data_ptr<int64_t>();
  p.error_flag = flag;
  p.H = cache.size(1);
  p.T = upd.size(2);
  p.L = cache.size(2);
  p.Du = cache.size(3) * elem / kUnitBytes;  // exact: checked by the caller
  p.cs0 = cache.stride(0) * elem / kUnitBytes;
  p.cs1 = cache.stride(1) * elem / kUnitBytes;
  p.cs2 = cache.stride(2) * elem / kUnitBytes;
  p.total = cache.size(0) * p.H * p.T * p.Du;
  const unsigned grid = grid_size_for(p.total, kCopyThreads, 8);
  kv_cache_append_kernel<unit_t><<<grid, kCopyThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool is_aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

namespace cuda_impl {

// CUDA implementations, in their own namespace so that they do not collide with the CPU
// host functions declared in ops.h.

void kv_cache_append_(at::Tensor& cache,                             // [B, H, L, D] in place
                      const at::Tensor& update,                      // [B, H, T, D]
                      const at::Tensor& positions,                   // [B] int64
                      const std::optional<at::Tensor>& error_flag) {  // [1] int32 or none
  check_kv_cache_append_args(cache, update, positions, error_flag);
  CHECK_CUDA(cache);
  const c10::cuda::OptionalCUDAGuard device_guard(cache.device());
  const int64_t B = cache.size(0), H = cache.size(1), L = cache.size(2), D = cache.size(3);
  const int64_t T = update.size(2);
  const at::Tensor pos = positions.contiguous();
  const bool has_flag = error_flag.has_value() && error_flag->defined();
  if (!has_flag) {
    // No flag: refuse before writing anything, as on CPU. Reading positions is one sync.
    check_positions_in_range(pos.to(at::kCPU), T, L);
  }
  if (B == 0) return;
  int* flag = has_flag ? error_flag->data_ptr<int>() : nullptr;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (H == 0 || T == 0 || D == 0) {
    if (has_flag) {  // nothing to copy, but out-of-range rows are still reported
      const unsigned grid = grid_size_for(B, kCopyThreads, 1);
      kv_cache_flag_kernel<<<grid, kCopyThreads, 0, stream>>>(pos.const_data_ptr<int64_t>(),
                                                              flag, B, T, L);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return;
  }

  const at::Tensor upd = update.contiguous();
  const int64_t elem = cache.element_size();
  const bool vec16 = (D * elem) % 16 == 0 && (cache.stride(0) * elem) % 16 == 0 &&
                     (cache.stride(1) * elem) % 16 == 0 && (cache.stride(2) * elem) % 16 == 0 &&
                     is_aligned16(cache.data_ptr()) && is_aligned16(upd.const_data_ptr());
  if (vec16) {
    launch_append<uint4>(cache, upd, pos, flag, stream);
  } else {
    TE_DISPATCH_FLOATING(cache.scalar_type(), "kv_cache_append_cuda", [&] {
      launch_append<scalar_t>(cache, upd, pos, flag, stream);
    });
  }
}

void kv_cache_reorder_(at::Tensor& cache,        // [B, H, L, D] in place
                       const at::Tensor& index,  // [B] int64
                       int64_t length) {
  check_kv_cache_reorder_args(cache, index, length);
  CHECK_CUDA(cache);
  const c10::cuda::OptionalCUDAGuard device_guard(cache.device());
  const int64_t B = cache.size(0);
  const at::Tensor index_cpu = index.to(at::kCPU).contiguous();  // one sync
  check_index_in_range(index_cpu, B);
  if (cache.numel() == 0 || length == 0) return;
  const int64_t* idx = index_cpu.const_data_ptr<int64_t>();
  bool identity = true;
  for (int64_t b = 0; b < B && identity; ++b) identity = idx[b] == b;
  if (identity) return;

  // index_select writes a new tensor, so swaps and repeated indices read the old cache;
  // both ops run on the current stream of the cache's device (set by the guard above).
  at::Tensor prefix = cache.narrow(2, 0, length);
  const at::Tensor gathered = prefix.index_select(0, index);
  prefix.copy_(gathered);
}

}  // namespace cuda_impl
}  // namespace transformer_ext

TORCH_LIBRARY_IMPL(transformer_ext, CUDA, m) {
  m.impl("kv_cache_append_", &transformer_ext::cuda_impl::kv_cache_append_);
  m.impl("kv_cache_reorder_", &transformer_ext::cuda_impl::kv_cache_reorder_);
}
