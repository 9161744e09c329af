// CUDA registration of transformer_ext::linear: cuBLAS through at::linear after the shared
// argument checks. The CPU kernel exists because a BLAS call's fixed cost dominates one-row
// products there; on the GPU a batch-1 decoder step is launch-bound instead, which a kernel
// of our own would not change.
#include <optional>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"

namespace transformer_ext {
namespace cuda_impl {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_linear_args(x, weight, bias);
  return at::linear(x, weight, bias);
}

}  // namespace cuda_impl
}  // namespace transformer_ext

TORCH_LIBRARY_IMPL(transformer_ext, CUDA, m) {
  m.impl("linear", &transformer_ext::cuda_impl::linear);
}
