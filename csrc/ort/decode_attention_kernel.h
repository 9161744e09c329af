// The one-query attention of a decoder step over a cache, as one loop nest over every row and
// head (no ONNX Runtime types here: csrc/ort/custom_op.cc validates the tensors and calls it).
//
// Row r (of R = B * K rows) reads cache row b = r / K: K = 1 for self-attention (a cache per
// row) and K = beams for cross-attention with the keys and values once per source (a source's
// beams are consecutive rows). Per cache row and head the keys and values are read from memory
// once: the K queries of its rows are served while they are in L1.
#pragma once

#include <cstdint>

namespace transformer_ext_ort {

struct DecodeAttentionArgs {
  const float* q = nullptr;          // [R, H, D]
  const float* k_cache = nullptr;    // [B, H, L, D]
  const float* v_cache = nullptr;    // [B, H, L, D]
  const int64_t* lengths = nullptr;  // [B]: positions 0 .. lengths[b]-1 are attended, each in [0, L]
  const float* k_new = nullptr;      // [R, H, D] or null: the new token's key, attended last
  const float* v_new = nullptr;      // [R, H, D] or null (null exactly when k_new is)
  const float* bias = nullptr;       // [R or 1, H, T] or null, T = L + (k_new ? 1 : 0): added to
                                     // the scaled scores, the new token's at index L
  int64_t bias_row_stride = 0;       // H * T, or 0 when one bias serves every row
  float* out = nullptr;              // [R, H, D]
  int64_t R = 0, B = 0, H = 0, L = 0, D = 0;
  float scale = 1.0f;
};

// out = softmax(scale * q . keys + bias) . values over the attended positions (the cache's
// first lengths[b] and the new token). A row with no position (lengths[b] == 0, no new token)
// is all zeros. A NaN score makes its row NaN, as a softmax does. Runs on the calling thread.
void decode_attention(const DecodeAttentionArgs& a);

// The same for cache rows [b_begin, b_end) only (their rows of out): disjoint ranges may run on
// different threads.
void decode_attention_cache_rows(const DecodeAttentionArgs& a, int64_t b_begin, int64_t b_end);

// Whether decode_attention was compiled with AVX2 + FMA (the library then needs them at run time).
bool decode_attention_uses_avx2();

}  // namespace transformer_ext_ort
