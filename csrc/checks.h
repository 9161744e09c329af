// Argument checks shared by the CPU and CUDA host functions. Each message names the
// argument and what was expected, so a caller's mistake surfaces as a Python
// RuntimeError with a readable text instead of a crash.
//
// For a new op: check every tensor argument's device against one reference argument with
// CHECK_DEVICE / CHECK_OPTIONAL_DEVICE (the fake kernels in transformer_ext/ops.py do the
// same through _check_same_device, which is what runs when one argument is on "meta"), and
// every in-place op refuses read arguments that share memory with what it writes
// (check_no_overlap) and written tensors whose elements share memory (check_writable).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

namespace transformer_ext {

// "Long (torch.int64)": ATen's name of a dtype followed by the name a Python caller knows.
inline std::string dtype_name(at::ScalarType t) {
  const char* py = nullptr;
  switch (t) {
    case at::kFloat: py = "torch.float32"; break;
    case at::kHalf: py = "torch.float16"; break;
    case at::kBFloat16: py = "torch.bfloat16"; break;
    case at::kDouble: py = "torch.float64"; break;
    case at::kLong: py = "torch.int64"; break;
    case at::kInt: py = "torch.int32"; break;
    case at::kShort: py = "torch.int16"; break;
    case at::kChar: py = "torch.int8"; break;
    case at::kByte: py = "torch.uint8"; break;
    case at::kBool: py = "torch.bool"; break;
    default: return c10::toString(t);
  }
  return std::string(c10::toString(t)) + " (" + py + ")";
}

}  // namespace transformer_ext

// The _NAMED forms take the argument's name as a string, for tensors reached through an
// optional or a pointer; the short forms name the expression itself.
#define CHECK_DEVICE_NAMED(x, name, ref, ref_name)                                       \
  TORCH_CHECK((x).device() == (ref).device(), name, " must be on ", (ref).device(),      \
              " (the device of ", ref_name, "), got ", (x).device())
#define CHECK_DEVICE(x, ref) CHECK_DEVICE_NAMED(x, #x, ref, #ref)
// An optional tensor argument (Tensor? in the schema): checked when given.
#define CHECK_OPTIONAL_DEVICE(opt, ref)                                                  \
  do {                                                                                   \
    if ((opt).has_value() && (opt)->defined()) CHECK_DEVICE_NAMED(*(opt), #opt, ref, #ref); \
  } while (0)
#define CHECK_DIM(x, n) \
  TORCH_CHECK((x).dim() == (n), #x " must have ", (n), " dimensions, got shape ", (x).sizes())
#define CHECK_DTYPE_NAMED(x, name, t)                                                     \
  TORCH_CHECK((x).scalar_type() == (t), name, " must be ", ::transformer_ext::dtype_name(t), \
              ", got ", ::transformer_ext::dtype_name((x).scalar_type()))
#define CHECK_DTYPE(x, t) CHECK_DTYPE_NAMED(x, #x, t)
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

// ---- memory overlap of the in-place ops -----------------------------------------------------

// [first, last) byte range that a strided tensor's elements span (empty for numel() == 0).
inline std::pair<uintptr_t, uintptr_t> byte_extent(const at::Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t lo = 0, hi = 0;  // element offsets from data_ptr() of the first and the last element
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t span = (t.size(d) - 1) * t.stride(d);
    (span < 0 ? lo : hi) += span;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const int64_t elem = t.element_size();
  return {base + lo * elem, base + (hi + 1) * elem};
}

// Refuses `other` (read or written by an op) when it shares memory with `written`, which the
// op writes in place: the result would depend on the order of the writes (on the thread count
// on CPU, on scheduling on CUDA). Dense layouts are decided exactly by ATen's overlap helper;
// for other strided views of the same memory, intersecting byte ranges count as overlap.
inline void check_no_overlap(const at::Tensor& written, const char* written_name,
                             const at::Tensor& other, const char* other_name) {
  const at::MemOverlapStatus status = at::get_overlap_status(written, other);
  bool overlap = status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial;
  if (status == at::MemOverlapStatus::TooHard && written.storage().is_alias_of(other.storage())) {
    const auto a = byte_extent(written), b = byte_extent(other);
    overlap = a.first < b.second && b.first < a.second;
  }
  TORCH_CHECK(!overlap, other_name, " shares memory with ", written_name,
              ", which the op writes in place, so the result would depend on the order of the "
              "writes; pass a copy (", other_name, ".clone())");
}

// A tensor written in place: its elements must not share memory with each other (an expanded
// or otherwise self-overlapping view would receive several writes per element).
inline void check_writable(const at::Tensor& t, const char* name) {
  TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, name,
              " has elements that share memory (an expanded or self-overlapping view, strides ",
              t.strides(), " for shape ", t.sizes(), ") and cannot be written in place; pass a "
              "tensor with its own memory (", name, ".clone())");
}

// ---- per-op argument checks -----------------------------------------------------------------

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
  TORCH_CHECK(m.scalar_type() == at::kBool, "mask must be Bool (torch.bool, True = may attend), "
              "got ", dtype_name(m.scalar_type()));
  CHECK_DEVICE_NAMED(m, "mask", scores, "scores");
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
  CHECK_DEVICE(k_cache, q);
  CHECK_DEVICE(v_cache, q);
  CHECK_DEVICE(lengths, q);
  CHECK_OPTIONAL_DEVICE(k_new, q);
  CHECK_OPTIONAL_DEVICE(v_new, q);
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    const char* name = c == &k_cache ? "k_cache" : "v_cache";
    TORCH_CHECK(c->dim() == 4, name, " must have 4 dimensions [B, H, L, D], got shape ",
                c->sizes());
    TORCH_CHECK(c->size(0) == B && c->size(1) == H && c->size(3) == D, name,
                " must have shape [", B, ", ", H, ", L, ", D, "] to match q ", q.sizes(),
                ", got ", c->sizes());
    TORCH_CHECK(c->scalar_type() == q.scalar_type(), name, " must have the dtype of q (",
                q.scalar_type(), "), got ", c->scalar_type());
  }
  TORCH_CHECK(k_cache.size(2) == v_cache.size(2), "k_cache and v_cache must have the same "
              "capacity L, got ", k_cache.size(2), " and ", v_cache.size(2));
  CHECK_DIM(lengths, 1);
  CHECK_DTYPE(lengths, at::kLong);
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
    }
  }
}

// The cache kernels write rows of D elements with unit-stride copies, so the last dimension
// of a cache must be dense. A strided last dim cannot be fixed with .contiguous(): the ops
// write in place. Any strides in B, H, L are fine.
inline void check_cache_rows_dense(const at::Tensor& cache) {
  TORCH_CHECK(cache.size(3) <= 1 || cache.stride(3) == 1,
              "cache must have a dense last dimension (stride(3) == 1) to be written in place, "
              "got strides ", cache.strides(), " for shape ", cache.sizes(),
              "; allocate the cache with the head dimension last");
}

// Also refuses a cache with self-overlapping elements and any argument that shares memory
// with the cache or the error flag (both written).
inline void check_kv_cache_append_args(const at::Tensor& cache, const at::Tensor& update,
                                       const at::Tensor& positions,
                                       const std::optional<at::Tensor>& error_flag) {
  CHECK_DEVICE(update, cache);
  CHECK_DEVICE(positions, cache);
  CHECK_OPTIONAL_DEVICE(error_flag, cache);
  CHECK_DIM(cache, 4);
  CHECK_FLOATING(cache);
  CHECK_DIM(update, 4);
  CHECK_SAME_DTYPE(update, cache);
  TORCH_CHECK(update.size(0) == cache.size(0) && update.size(1) == cache.size(1) &&
                  update.size(3) == cache.size(3),
              "update must have shape [", cache.size(0), ", ", cache.size(1), ", T, ",
              cache.size(3), "] to match cache ", cache.sizes(), ", got ", update.sizes());
  CHECK_DIM(positions, 1);
  CHECK_DTYPE(positions, at::kLong);
  CHECK_SIZE(positions, 0, cache.size(0));
  check_cache_rows_dense(cache);
  check_writable(cache, "cache");
  check_no_overlap(cache, "cache", update, "update");
  check_no_overlap(cache, "cache", positions, "positions");
  if (error_flag.has_value() && error_flag->defined()) {
    const at::Tensor& flag = *error_flag;
    CHECK_DTYPE_NAMED(flag, "error_flag", at::kInt);
    TORCH_CHECK(flag.numel() == 1, "error_flag must hold exactly one int32, got shape ",
                flag.sizes());
    check_no_overlap(cache, "cache", flag, "error_flag");
    check_no_overlap(flag, "error_flag", update, "update");
    check_no_overlap(flag, "error_flag", positions, "positions");
  }
}

// Also refuses a cache with self-overlapping elements and an index that shares its memory.
inline void check_kv_cache_reorder_args(const at::Tensor& cache, const at::Tensor& index,
                                        int64_t length) {
  CHECK_DEVICE(index, cache);
  CHECK_DIM(cache, 4);
  CHECK_FLOATING(cache);
  CHECK_DIM(index, 1);
  CHECK_DTYPE(index, at::kLong);
  CHECK_SIZE(index, 0, cache.size(0));
  TORCH_CHECK(length >= 0 && length <= cache.size(2), "length must be in [0, ", cache.size(2),
              "] (the cache capacity), got ", length);
  check_cache_rows_dense(cache);
  check_writable(cache, "cache");
  check_no_overlap(cache, "cache", index, "index");
}

inline void check_linear_args(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  CHECK_DEVICE(weight, x);
  CHECK_OPTIONAL_DEVICE(bias, x);
  TORCH_CHECK(x.dim() >= 1, "x must have at least 1 dimension (..., in_features), got a scalar");
  CHECK_DIM(weight, 2);
  CHECK_FLOATING(x);
  CHECK_SAME_DTYPE(weight, x);
  TORCH_CHECK(x.size(-1) == weight.size(1), "x.size(-1) must be weight.size(1) = ", weight.size(1),
              " (in_features of weight [out_features, in_features]), got x of shape ", x.sizes());
  if (bias.has_value() && bias->defined()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 1, "bias must have 1 dimension [out_features], got shape ", b.sizes());
    TORCH_CHECK(b.scalar_type() == x.scalar_type(), "bias must have the dtype of x (",
                x.scalar_type(), "), got ", b.scalar_type());
    TORCH_CHECK(b.size(0) == weight.size(0), "bias.size(0) must be ", weight.size(0),
                " (out_features of weight), got shape ", b.sizes());
  }
}

// Host-side range checks, used where reading the values is free (CPU) or explicitly
// requested (CUDA without an error flag).
inline void check_positions_in_range(const at::Tensor& positions_cpu, int64_t T, int64_t L) {
  const int64_t* p = positions_cpu.data_ptr<int64_t>();
  for (int64_t b = 0; b < positions_cpu.numel(); ++b) {
    if (p[b] < 0) continue;  // the row is skipped
    // Compared as p <= L - T (never p + T, which can overflow for a huge position).
    TORCH_CHECK(T <= L, "positions[", b, "] = ", p[b], " cannot be written: update holds T = ",
                T, " tokens per row, more than the cache capacity L = ", L,
                " (a negative position skips the row)");
    TORCH_CHECK(p[b] <= L - T, "positions[", b, "] = ", p[b], " leaves no room for T = ", T,
                " new token", T == 1 ? "" : "s", " in a cache of capacity L = ", L,
                " (need positions[b] <= L - T = ", L - T,
                ", or a negative position to skip the row)");
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
