// CPU kernels of the KV-cache family: kv_cache_append_ and kv_cache_reorder_ (docs/DESIGN.md
// section 2). Both move whole [T, D] / [length, D] blocks with memcpy, parallel over the
// (batch, head) pairs; the dtype only matters through its element size.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "ops.h"

namespace transformer_ext {
namespace {

// Bytes below which a parallel_for chunk is not worth a thread.
constexpr int64_t kMinBytesPerTask = 64 * 1024;

// Copies a [rows, D] block between two row-strided layouts (strides in elements).
inline void copy_rows(char* dst, int64_t dst_row_stride, const char* src, int64_t src_row_stride,
                      int64_t rows, int64_t D, int64_t elem) {
  if (rows <= 0 || D <= 0) return;
  if ((dst_row_stride == D && src_row_stride == D) || rows == 1) {
    std::memcpy(dst, src, static_cast<size_t>(rows * D * elem));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * dst_row_stride * elem, src + r * src_row_stride * elem,
                static_cast<size_t>(D * elem));
  }
}

inline int64_t grain_for(int64_t bytes_per_task) {
  return std::max<int64_t>(1, kMinBytesPerTask / std::max<int64_t>(1, bytes_per_task));
}

}  // namespace

void kv_cache_append_(at::Tensor& cache,                             // [B, H, L, D]
                      const at::Tensor& update,                      // [B, H, T, D]
                      const at::Tensor& positions,                   // [B] int64
                      const std::optional<at::Tensor>& error_flag) {  // ignored on CPU
  check_kv_cache_append_args(cache, update, positions, error_flag);
  const int64_t B = cache.size(0), H = cache.size(1), L = cache.size(2), D = cache.size(3);
  const int64_t T = update.size(2);
  const at::Tensor pos = positions.contiguous();
  // On CPU reading positions is free: refuse before writing anything (error_flag unused).
  check_positions_in_range(pos, T, L);
  if (B == 0 || H == 0 || T == 0 || D == 0) return;

  const at::Tensor upd = update.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t elem = cache.element_size();
  char* cache_base = static_cast<char*>(cache.data_ptr());
  const char* upd_base = static_cast<const char*>(upd.data_ptr());
  const int64_t cs0 = cache.stride(0), cs1 = cache.stride(1), cs2 = cache.stride(2);

  at::parallel_for(0, B * H, grain_for(T * D * elem), [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      if (p[b] < 0) continue;  // finished or padding row
      char* dst = cache_base + (b * cs0 + h * cs1 + p[b] * cs2) * elem;
      const char* src = upd_base + bh * T * D * elem;
      copy_rows(dst, cs2, src, D, T, D, elem);
    }
  });
}

void kv_cache_reorder_(at::Tensor& cache,        // [B, H, L, D]
                       const at::Tensor& index,  // [B] int64
                       int64_t length) {
  check_kv_cache_reorder_args(cache, index, length);
  const int64_t B = cache.size(0), H = cache.size(1), D = cache.size(3);
  const at::Tensor idx_t = index.contiguous();
  check_index_in_range(idx_t, B);
  if (B == 0 || H == 0 || length == 0 || D == 0) return;

  // Only rows whose source differs from themselves move. All of them are gathered into a
  // temporary before any is written, so repeated indices and swaps read the old cache.
  const int64_t* idx = idx_t.data_ptr<int64_t>();
  std::vector<int64_t> moved;
  for (int64_t b = 0; b < B; ++b) {
    if (idx[b] != b) moved.push_back(b);
  }
  const int64_t M = static_cast<int64_t>(moved.size());
  if (M == 0) return;

  const at::Tensor tmp = at::empty({M, H, length, D}, cache.options());
  const int64_t elem = cache.element_size();
  const int64_t block = length * D;  // elements of one (row, head) block in tmp
  char* cache_base = static_cast<char*>(cache.data_ptr());
  char* tmp_base = static_cast<char*>(tmp.data_ptr());
  const int64_t cs0 = cache.stride(0), cs1 = cache.stride(1), cs2 = cache.stride(2);
  const int64_t grain = grain_for(block * elem);

  at::parallel_for(0, M * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t mh = begin; mh < end; ++mh) {
      const int64_t b = moved[mh / H], h = mh % H;
      const char* src = cache_base + (idx[b] * cs0 + h * cs1) * elem;
      copy_rows(tmp_base + mh * block * elem, D, src, cs2, length, D, elem);
    }
  });
  at::parallel_for(0, M * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t mh = begin; mh < end; ++mh) {
      const int64_t b = moved[mh / H], h = mh % H;
      char* dst = cache_base + (b * cs0 + h * cs1) * elem;
      copy_rows(dst, cs2, tmp_base + mh * block * elem, D, length, D, elem);
    }
  });
}

}  // namespace transformer_ext

TORCH_LIBRARY_IMPL(transformer_ext, CPU, m) {
  m.impl("kv_cache_append_", &transformer_ext::kv_cache_append_);
  m.impl("kv_cache_reorder_", &transformer_ext::kv_cache_reorder_);
}
