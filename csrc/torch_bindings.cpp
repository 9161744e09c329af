// Every schema of the transformer_ext library. Kernels register themselves in
// csrc/cpu/*.cpp and csrc/cuda/*.cu with TORCH_LIBRARY_IMPL.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

extern "C" {
// Importing transformer_ext._C runs the static registrations below; no pybind11 module needed.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(transformer_ext, m) {
  // softmax(scale * scores) over allowed keys (bool mask and/or causal), float32 math, zeros for empty rows
  m.def("masked_softmax(Tensor scores, Tensor? mask, float scale, bool causal) -> Tensor");
  // d(scores) from d(probs) and the forward output: scale * p * (g - sum(g * p))
  m.def("masked_softmax_backward(Tensor grad_probs, Tensor probs, float scale) -> Tensor");
  // fused one-query attention over cache[:, :, :lengths[b]] plus an optional new key/value
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, float scale, "
      "Tensor? k_new=None, Tensor? v_new=None) -> Tensor");
  // cache[b, :, positions[b]:positions[b]+T] = update[b] in place; negative positions skip the row
  m.def(
      "kv_cache_append_(Tensor(a!) cache, Tensor update, Tensor positions, "
      "Tensor(b!)? error_flag=None) -> ()");
  // cache[b, :, :length] = cache[index[b], :, :length] in place (beam search)
  m.def("kv_cache_reorder_(Tensor(a!) cache, Tensor index, int length) -> ()");
  // x @ weight^T + bias; a matrix-vector kernel for the few rows of a decoder step on the CPU
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  // fused attention over lengths / causal with dropout inside -> (out, log-sum-exp per row)
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, Tensor? query_lengths, "
      "float scale, bool causal, float dropout_p, Tensor? seed) -> (Tensor, Tensor)");
  // (dq, dk, dv) of attention, probabilities and dropout mask recomputed from lse and seed
  m.def(
      "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? key_lengths, Tensor? query_lengths, float scale, bool causal, float dropout_p, "
      "Tensor? seed) -> (Tensor, Tensor, Tensor)");
  // attention with an additive position bias (broadcastable to [B, H, Q, K]) of the scaled scores
  m.def(
      "attention_with_bias(Tensor q, Tensor k, Tensor v, Tensor position_bias, Tensor? key_lengths, "
      "Tensor? query_lengths, float scale, bool causal, float dropout_p, Tensor? seed) -> (Tensor, Tensor)");
  // (dq, dk, dv, d position_bias summed to its shape; empty unless bias_grad)
  m.def(
      "attention_with_bias_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
      "Tensor position_bias, Tensor out, Tensor lse, Tensor? key_lengths, Tensor? query_lengths, "
      "float scale, bool causal, float dropout_p, Tensor? seed, bool bias_grad) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // decode_attention with an additive position bias [B?, H?, 1, L (+1 for k_new)] of the scaled scores
  m.def(
      "decode_attention_with_bias(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, "
      "float scale, Tensor position_bias, Tensor? k_new=None, Tensor? v_new=None) -> Tensor");
  // debug: attention's dropout keep mask [B, H, Q, K] for a seed
  m.def("attention_dropout_mask(Tensor seed, int B, int H, int Q, int K, float dropout_p) -> Tensor");
}
