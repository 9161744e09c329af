// Host entry points of every transformer_ext op.
//
// Shapes: B batch, H heads, Q query length, K key length, L cache capacity, D head dim.
// Semantics are fixed by docs/DESIGN.md section 2; transformer_ext/reference.py is the
// pure-PyTorch twin of each function below.
#pragma once

#include <optional>
#include <tuple>

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

// Fused full-sequence attention for training and encoding -> (out, lse). Keys at or past
// key_lengths[b] and query rows at or past query_lengths[b] cost no work (such rows are zeros);
// causal: query i sees key j iff j <= i + (K - Q); a row with no allowed key is zeros. Dropout on
// the probabilities from a counter-based generator keyed by (seed, b, h, i, j). `out` has the
// memory layout of [B, Q, H, D] (so merging the heads is a view); lse = log-sum-exp of the
// scaled scores over the allowed keys (-inf for an empty row), float32.
std::tuple<at::Tensor, at::Tensor> attention(
    const at::Tensor& q,                              // [B, H, Q, D], last dim dense
    const at::Tensor& k,                              // [B, H, K, D]
    const at::Tensor& v,                              // [B, H, K, D]
    const std::optional<at::Tensor>& key_lengths,     // [B] int64, 0 <= . <= K
    const std::optional<at::Tensor>& query_lengths,   // [B] int64, 0 <= . <= Q
    double scale,
    bool causal,
    double dropout_p,                                 // [0, 1)
    const std::optional<at::Tensor>& seed);           // int64, one element; needed when p > 0

// (dq, dk, dv) of attention from grad_out and the forward's out and lse (probabilities and
// the dropout mask are recomputed tile by tile).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out,                       // [B, H, Q, D]
    const at::Tensor& q,                              // [B, H, Q, D]
    const at::Tensor& k,                              // [B, H, K, D]
    const at::Tensor& v,                              // [B, H, K, D]
    const at::Tensor& out,                            // [B, H, Q, D]
    const at::Tensor& lse,                            // [B, H, Q] float32
    const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& query_lengths,
    double scale,
    bool causal,
    double dropout_p,
    const std::optional<at::Tensor>& seed);

// Debug view of attention's dropout generator: bool [B, H, Q, K], true where (seed, b, h, i, j)
// is kept at rate dropout_p.
at::Tensor attention_dropout_mask(const at::Tensor& seed, int64_t B, int64_t H, int64_t Q,
                                  int64_t K, double dropout_p);

// attention's argument checks (shapes, dtypes, devices, dropout_p, seed), shared by the
// CPU and CUDA host functions; the length values are range-checked by each backend.
void check_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& key_lengths,
                          const std::optional<at::Tensor>& query_lengths, double scale,
                          double dropout_p, const std::optional<at::Tensor>& seed);

}  // namespace transformer_ext
