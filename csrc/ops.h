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

// decode_attention with an additive position bias of the scaled scores (T5's relative bias):
// score_j = scale * q.k_j + position_bias[b, h, 0, j] for cache key j, and
// scale * q.k_new + position_bias[b, h, 0, L] for the new key.
at::Tensor decode_attention_with_bias(
    const at::Tensor& q,                     // [B, H, 1, D]
    const at::Tensor& k_cache,               // [B, H, L, D]
    const at::Tensor& v_cache,               // [B, H, L, D]
    const at::Tensor& lengths,               // [B] int64
    double scale,
    const at::Tensor& position_bias,         // [B or 1, H or 1, 1, L (+ 1 with k_new)], floating
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

// attention with an additive position bias of the scaled scores (T5's relative bias):
// softmax over allowed keys of scale * q.k + position_bias. A -inf bias entry is a masked key; a
// row whose allowed keys all have a -inf bias is zeros (lse -inf), as a row with no key.
std::tuple<at::Tensor, at::Tensor> attention_with_bias(
    const at::Tensor& q,                              // [B, H, Q, D]
    const at::Tensor& k,                              // [B, H, K, D]
    const at::Tensor& v,                              // [B, H, K, D]
    const at::Tensor& position_bias,                  // broadcastable to [B, H, Q, K], floating
    const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& query_lengths,
    double scale,
    bool causal,
    double dropout_p,
    const std::optional<at::Tensor>& seed);

// (dq, dk, dv, dbias) of attention_with_bias; dbias = d(scores) summed over the dimensions the
// bias broadcasts, in its shape and dtype, when bias_grad (else an empty tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_with_bias_backward(
    const at::Tensor& grad_out,
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& position_bias,
    const at::Tensor& out,
    const at::Tensor& lse,
    const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& query_lengths,
    double scale,
    bool causal,
    double dropout_p,
    const std::optional<at::Tensor>& seed,
    bool bias_grad);

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

// The position bias of attention_with_bias: on q's device, floating, 4-D, each dimension 1 or
// that of [B, H, Q, K].
void check_position_bias(const at::Tensor& bias, const at::Tensor& q, int64_t B, int64_t H,
                         int64_t Q, int64_t K);

// The position bias of decode_attention_with_bias: [B or 1, H or 1, 1, n_keys] on q's device.
void check_decode_position_bias(const at::Tensor& bias, const at::Tensor& q, int64_t n_keys);

}  // namespace transformer_ext
