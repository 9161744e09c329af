// Argument checks shared by the CPU and CUDA host functions. Each message names the
// argument and what was expected, so a caller's mistake surfaces as a Python
// RuntimeError with a readable text instead of a crash.
#pragma once

#include <optional>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#define CHECK_DEVICE(x, ref)                                                        \
  TORCH_CHECK((x).device() == (ref).device(), #x " must be on ", (ref).device(),    \
              " (the device of " #ref "), got ", (x).device())
#define CHECK_DIM(x, n) \
  TORCH_CHECK((x).dim() == (n), #x " must have ", (n), " dimensions, got shape ", (x).sizes())
#define CHECK_DTYPE(x, t) \
  TORCH_CHECK((x).scalar_type() == (t), #x " must be ", (t), ", got ", (x).scalar_type())
#define CHECK_SAME_DTYPE(x, ref)                                                      \
  TORCH_CHECK((x).scalar_type() == (ref).scalar_type(), #x " must have the dtype of " \
              #ref " (", (ref).scalar_type(), "), got ", (x).scalar_type())
#define CHECK_SIZE(x, d, n)                                                                   \
  TORCH_CHECK((x).size(d) == (n), #x ".size(", (d), ") must be ", (n), ", got shape ", \
              (x).sizes())
// float64 is accepted too (with float64 math) so that gradcheck can run on the kernels.
#define CHECK_FLOATING(x)                                                             \
  TORCH_CHECK((x).scalar_type() == at::kFloat || (x).scalar_type() == at::kHalf ||    \
                  (x).scalar_type() == at::kBFloat16 || (x).scalar_type() == at::kDouble, \
              #x " must be float32, float16, bfloat16 or float64, got ", (x).scalar_type())

// One switch over the supported dtypes; `scalar_t` is the storage type inside. Accumulate
// in at::opmath_type<scalar_t> (float for the 16-bit types and float, double for double).
#define TE_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

namespace transformer_ext {

// Checks masked_softmax's arguments and returns the mask expanded to scores' shape
// (a stride-0 view, no copy), or an undefined tensor when there is no mask.
inline at::Tensor check_masked_softmax_args(const at::Tensor& scores,
                                            const std::optional<at::Tensor>& mask) {
  CHECK_DIM(scores, 4);
  CHECK_FLOATING(scores);
  TORCH_CHECK(scores.size(2) >= 1 && scores.size(3) >= 1,
              "scores must have at least one query and one key, got shape ", scores.sizes());
  if (!mask.has_value() || !mask->defined()) return at::Tensor();
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.scalar_type() == at::kBool, "mask must be Bool (True = may attend), got ",
              m.scalar_type());
  TORCH_CHECK(m.device() == scores.device(), "mask must be on ", scores.device(),
              " (the device of scores), got ", m.device());
  TORCH_CHECK(m.dim() <= 4, "mask must have at most 4 dimensions, got shape ", m.sizes());
  for (int64_t i = 0; i < m.dim(); ++i) {
    const int64_t s = m.size(m.dim() - 1 - i);
    const int64_t t = scores.size(3 - i);
    TORCH_CHECK(s == 1 || s == t, "mask of shape ", m.sizes(),
                " is not broadcastable to scores of shape ", scores.sizes());
  }
  return m.expand(scores.sizes());
}

inline void check_masked_softmax_backward_args(const at::Tensor& grad_probs,
                                               const at::Tensor& probs) {
  CHECK_DIM(probs, 4);
  CHECK_FLOATING(probs);
  CHECK_DEVICE(grad_probs, probs);
  CHECK_SAME_DTYPE(grad_probs, probs);
  TORCH_CHECK(grad_probs.sizes() == probs.sizes(), "grad_probs must have the shape of probs ",
              probs.sizes(), ", got ", grad_probs.sizes());
}

inline void check_decode_attention_args(const at::Tensor& q, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const at::Tensor& lengths,
                                        const std::optional<at::Tensor>& k_new,
                                        const std::optional<at::Tensor>& v_new) {
  CHECK_DIM(q, 4);
  CHECK_FLOATING(q);
  CHECK_SIZE(q, 2, 1);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  TORCH_CHECK(D >= 1, "q must have a head dimension of at least 1, got shape ", q.sizes());
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    const char* name = c == &k_cache ? "k_cache" : "v_cache";
    TORCH_CHECK(c->dim() == 4, name, " must have 4 dimensions [B, H, L, D], got shape ",
                c->sizes());
    TORCH_CHECK(c->size(0) == B && c->size(1) == H && c->size(3) == D, name,
                " must have shape [", B, ", ", H, ", L, ", D, "] to match q ", q.sizes(),
                ", got ", c->sizes());
    TORCH_CHECK(c->scalar_type() == q.scalar_type(), name, " must have the dtype of q (",
                q.scalar_type(), "), got ", c->scalar_type());
    TORCH_CHECK(c->device() == q.device(), name, " must be on ", q.device(),
                " (the device of q), got ", c->device());
  }
  TORCH_CHECK(k_cache.size(2) == v_cache.size(2), "k_cache and v_cache must have the same "
              "capacity L, got ", k_cache.size(2), " and ", v_cache.size(2));
  CHECK_DIM(lengths, 1);
  CHECK_DTYPE(lengths, at::kLong);
  CHECK_DEVICE(lengths, q);
  CHECK_SIZE(lengths, 0, B);
  const bool has_k = k_new.has_value() && k_new->defined();
  const bool has_v = v_new.has_value() && v_new->defined();
  TORCH_CHECK(has_k == has_v, "k_new and v_new must be given together (got ",
              has_k ? "k_new only" : "v_new only", ")");
  if (has_k) {
    for (const at::Tensor* t : {&*k_new, &*v_new}) {
      const char* name = t == &*k_new ? "k_new" : "v_new";
      TORCH_CHECK(t->sizes() == q.sizes(), name, " must have the shape of q ", q.sizes(),
                  ", got ", t->sizes());
      TORCH_CHECK(t->scalar_type() == q.scalar_type(), name, " must have the dtype of q (",
                  q.scalar_type(), "), got ", t->scalar_type());
      TORCH_CHECK(t->device() == q.device(), name, " must be on ", q.device(), ", got ",
                  t->device());
    }
  }
}

inline void check_kv_cache_append_args(const at::Tensor& cache, const at::Tensor& update,
                                       const at::Tensor& positions,
                                       const std::optional<at::Tensor>& error_flag) {
  CHECK_DIM(cache, 4);
  CHECK_FLOATING(cache);
  CHECK_DIM(update, 4);
  CHECK_SAME_DTYPE(update, cache);
  CHECK_DEVICE(update, cache);
  TORCH_CHECK(update.size(0) == cache.size(0) && update.size(1) == cache.size(1) &&
                  update.size(3) == cache.size(3),
              "update must have shape [", cache.size(0), ", ", cache.size(1), ", T, ",
              cache.size(3), "] to match cache ", cache.sizes(), ", got ", update.sizes());
  CHECK_DIM(positions, 1);
  CHECK_DTYPE(positions, at::kLong);
  CHECK_DEVICE(positions, cache);
  CHECK_SIZE(positions, 0, cache.size(0));
  if (error_flag.has_value() && error_flag->defined()) {
    const at::Tensor& f = *error_flag;
    CHECK_DTYPE(f, at::kInt);
    CHECK_DEVICE(f, cache);
    TORCH_CHECK(f.numel() == 1, "error_flag must hold exactly one int32, got shape ", f.sizes());
  }
}

inline void check_kv_cache_reorder_args(const at::Tensor& cache, const at::Tensor& index,
                                        int64_t length) {
  CHECK_DIM(cache, 4);
  CHECK_FLOATING(cache);
  CHECK_DIM(index, 1);
  CHECK_DTYPE(index, at::kLong);
  CHECK_DEVICE(index, cache);
  CHECK_SIZE(index, 0, cache.size(0));
  TORCH_CHECK(length >= 0 && length <= cache.size(2), "length must be in [0, ", cache.size(2),
              "] (the cache capacity), got ", length);
}

inline void check_linear_args(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias_opt) {
  TORCH_CHECK(x.dim() >= 1, "x must have at least 1 dimension (..., in_features), got a scalar");
  CHECK_DIM(weight, 2);
  CHECK_FLOATING(x);
  CHECK_SAME_DTYPE(weight, x);
  CHECK_DEVICE(weight, x);
  TORCH_CHECK(x.size(-1) == weight.size(1), "x.size(-1) must be weight.size(1) = ", weight.size(1),
              " (in_features of weight [out_features, in_features]), got x of shape ", x.sizes());
  if (bias_opt.has_value()) {
    const at::Tensor& bias = *bias_opt;
    CHECK_DIM(bias, 1);
    CHECK_SAME_DTYPE(bias, x);
    CHECK_DEVICE(bias, x);
    CHECK_SIZE(bias, 0, weight.size(0));
  }
}

// Host-side range checks, used where reading the values is free (CPU) or explicitly
// requested (CUDA without an error flag).
inline void check_positions_in_range(const at::Tensor& positions_cpu, int64_t T, int64_t L) {
  const int64_t* p = positions_cpu.data_ptr<int64_t>();
  for (int64_t b = 0; b < positions_cpu.numel(); ++b) {
    // Written as p <= L - T so that a huge position cannot overflow past the check.
    TORCH_CHECK(p[b] < 0 || (T <= L && p[b] <= L - T), "positions[", b, "] = ", p[b],
                " writes tokens up to ", p[b] + T, " but the cache holds only L = ", L,
                " (need positions[b] + T <= L, or a negative position to skip the row)");
  }
}

inline void check_index_in_range(const at::Tensor& index_cpu, int64_t B) {
  const int64_t* p = index_cpu.data_ptr<int64_t>();
  for (int64_t b = 0; b < index_cpu.numel(); ++b) {
    TORCH_CHECK(p[b] >= 0 && p[b] < B, "index[", b, "] = ", p[b], " is out of range [0, ", B,
                ")");
  }
}

inline void check_lengths_in_range(const at::Tensor& lengths_cpu, int64_t L) {
  const int64_t* p = lengths_cpu.data_ptr<int64_t>();
  for (int64_t b = 0; b < lengths_cpu.numel(); ++b) {
    TORCH_CHECK(p[b] >= 0 && p[b] <= L, "lengths[", b, "] = ", p[b], " is out of range [0, ",
                L, "] (the cache capacity)");
  }
}

}  // namespace transformer_ext
