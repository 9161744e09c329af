// Host entry points of every transformer_ext op.
//
// Shapes: B batch, H heads, Q query length, K key length, L cache capacity, D head dim.
// Semantics are fixed by DESIGN.md section 2; transformer_ext/reference.py is the
// pure-PyTorch twin of each function below.
#pragma once

#include <optional>

#include <ATen/ATen.h>

namespace transformer_ext {

// Softmax of scale * scores over the keys a query may see, computed in float32 and
// returned in the input dtype. A row with no allowed key is all zeros.
at::Tensor masked_softmax(
    const at::Tensor& scores,             // [B, H, Q, K] float32 / float16 / bfloat16
    const std::optional<at::Tensor>& mask,  // bool, broadcastable to [B, H, Q, K]; true = attend
    double scale,
    bool causal);                         // query i sees key j iff j <= i + (K - Q)

// Gradient of masked_softmax with respect to its scores.
at::Tensor masked_softmax_backward(
    const at::Tensor& grad_probs,  // [B, H, Q, K]
    const at::Tensor& probs,       // [B, H, Q, K] the forward output
    double scale);

// One-query attention over a cache prefix (plus optionally one extra key/value).
at::Tensor decode_attention(
    const at::Tensor& q,                     // [B, H, 1, D]
    const at::Tensor& k_cache,               // [B, H, L, D]
    const at::Tensor& v_cache,               // [B, H, L, D]
    const at::Tensor& lengths,               // [B] int64, 0 <= lengths[b] <= L
    double scale,
    const std::optional<at::Tensor>& k_new,  // [B, H, 1, D]
    const std::optional<at::Tensor>& v_new); // [B, H, 1, D]

// cache[b, :, p_b : p_b + T] = update[b] in place; rows with p_b < 0 are skipped.
void kv_cache_append_(
    at::Tensor& cache,                            // [B, H, L, D] written in place
    const at::Tensor& update,                     // [B, H, T, D]
    const at::Tensor& positions,                  // [B] int64
    const std::optional<at::Tensor>& error_flag); // [1] int32 on the cache's device, or none

// cache[b, :, :length] = old_cache[index[b], :, :length] in place.
void kv_cache_reorder_(
    at::Tensor& cache,         // [B, H, L, D] written in place
    const at::Tensor& index,   // [B] int64, 0 <= index[b] < B
    int64_t length);           // 0 <= length <= L

// y = x @ weight^T + bias (torch.nn.functional.linear), for the projections of a decoder step.
// CPU: a matrix-vector kernel for float32 with at most kLinearMaxRows rows of x (every
// 8-row block of the weight is read once from memory and applied to all rows); larger inputs,
// other dtypes and other devices use at::linear.
at::Tensor linear(
    const at::Tensor& x,                    // [..., in_features]
    const at::Tensor& weight,               // [out_features, in_features]
    const std::optional<at::Tensor>& bias); // [out_features]

}  // namespace transformer_ext
