// Autograd and ADInplaceOrView kernels of the in-place ops kv_cache_append_ and
// kv_cache_reorder_, for every backend (CPU, CUDA, Meta / fake tensors): what the kernels ATen
// generates for its own in-place ops do, so that autograd sees every write (docs/DESIGN.md
// section 2).
//
// Autograd key. The ops have no derivative. While grad mode is on, a written tensor that
// requires grad is refused (autograd refuses an in-place op on a leaf that requires grad, and
// could not record this one for a non-leaf); under torch.no_grad() and torch.inference_mode()
// it is allowed, as for ATen's in-place ops. Read arguments may require grad: like the other
// ops of the library without an autograd formula (decode_attention, linear), no gradient flows
// back to them.
//
// ADInplaceOrView key. An inference tensor (created under torch.inference_mode()) is refused
// outside inference mode before anything is written (ATen raises the same, after writing);
// then the kernel runs and the version counter of every written tensor is bumped, so that a
// backward pass that saved one of them raises instead of using the new values.
#include <optional>

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

namespace transformer_ext {
namespace {

using AppendSig = void(at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const std::optional<at::Tensor>&);
using ReorderSig = void(at::Tensor&, const at::Tensor&, int64_t);

const c10::TypedOperatorHandle<AppendSig>& append_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("transformer_ext::kv_cache_append_", "")
                             .typed<AppendSig>();
  return op;
}

const c10::TypedOperatorHandle<ReorderSig>& reorder_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("transformer_ext::kv_cache_reorder_", "")
                             .typed<ReorderSig>();
  return op;
}

// ---- Autograd ------------------------------------------------------------------------------

void check_written_not_tracked(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(!(c10::GradMode::is_enabled() && t.requires_grad()), op, " writes ", name,
              " in place and has no derivative, but ", name, " requires grad (autograd "
              "refuses such an in-place write); call it under torch.no_grad() or "
              "torch.inference_mode()");
}

void kv_cache_append_autograd(at::Tensor& cache,                             // [B, H, L, D]
                              const at::Tensor& update,                      // [B, H, T, D]
                              const at::Tensor& positions,                   // [B] int64
                              const std::optional<at::Tensor>& error_flag) {  // [1] int32
  check_written_not_tracked("kv_cache_append_", cache, "cache");
  const at::AutoDispatchBelowAutograd guard;
  append_op().call(cache, update, positions, error_flag);
}

void kv_cache_reorder_autograd(at::Tensor& cache,        // [B, H, L, D]
                               const at::Tensor& index,  // [B] int64
                               int64_t length) {
  check_written_not_tracked("kv_cache_reorder_", cache, "cache");
  const at::AutoDispatchBelowAutograd guard;
  reorder_op().call(cache, index, length);
}

// ---- ADInplaceOrView -----------------------------------------------------------------------

void check_not_inference(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), op, ": ", name,
              " is an inference tensor (created under torch.inference_mode()) and cannot be "
              "written in place outside inference mode; call it under torch.inference_mode(), "
              "or pass a normal tensor (", name, ".clone() outside inference mode)");
}

void bump_version(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

void kv_cache_append_inplace_or_view(
    at::Tensor& cache,                             // [B, H, L, D]
    const at::Tensor& update,                      // [B, H, T, D]
    const at::Tensor& positions,                   // [B] int64
    const std::optional<at::Tensor>& error_flag) {  // [1] int32
  const bool has_flag = error_flag.has_value() && error_flag->defined();
  check_not_inference("kv_cache_append_", cache, "cache");
  if (has_flag) check_not_inference("kv_cache_append_", *error_flag, "error_flag");
  {
    const at::AutoDispatchBelowADInplaceOrView guard;
    append_op().call(cache, update, positions, error_flag);
  }
  bump_version(cache);
  if (has_flag) bump_version(*error_flag);
}

void kv_cache_reorder_inplace_or_view(at::Tensor& cache,        // [B, H, L, D]
                                      const at::Tensor& index,  // [B] int64
                                      int64_t length) {
  check_not_inference("kv_cache_reorder_", cache, "cache");
  {
    const at::AutoDispatchBelowADInplaceOrView guard;
    reorder_op().call(cache, index, length);
  }
  bump_version(cache);
}

}  // namespace
}  // namespace transformer_ext

TORCH_LIBRARY_IMPL(transformer_ext, Autograd, m) {
  m.impl("kv_cache_append_", &transformer_ext::kv_cache_append_autograd);
  m.impl("kv_cache_reorder_", &transformer_ext::kv_cache_reorder_autograd);
}

TORCH_LIBRARY_IMPL(transformer_ext, ADInplaceOrView, m) {
  m.impl("kv_cache_append_", &transformer_ext::kv_cache_append_inplace_or_view);
  m.impl("kv_cache_reorder_", &transformer_ext::kv_cache_reorder_inplace_or_view);
}
