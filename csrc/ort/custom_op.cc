// ONNX Runtime custom-operator library: transformer_ext.DecodeAttention (CPU, float32).
//
//   inputs   q        float [R, H, D] or [R, H, 1, D]   the step's queries (scale applied by `scale`)
//            k_cache  float [B, H, L, D]                 row r reads cache row r / (R / B)
//            v_cache  float [B, H, L, D]
//            lengths  int64 [B]                           cached positions attended, each in [0, L]
//            k_new    float [R, H, D] or [R, H, 1, D]    optional: the new token's key, attended last
//            v_new    float, as k_new                     optional, given exactly when k_new is
//            bias     float [R or 1, H, T] or [R or 1, H, 1, T], T = L (+ 1 with k_new)
//                                                         optional additive bias on the scaled scores
//   outputs  out         float [R, H * D]
//            present_k   float [B, H, L, D]   optional (self-attention, B = R): k_cache with
//            present_v   float [B, H, L, D]   k_new / v_new written at position lengths[r]
//   attribute scale   float, default 1
//
// present_k / present_v bound to the buffers of k_cache / v_cache (IO binding, as for
// GroupQueryAttention) make the cache update in place: only the new rows are written. Otherwise
// the cache is copied into them first.
//
// The cache rows run over the session's intra-op threads (KernelContext_ParallelFor).
//
// Self-attention: B = R (a cache per row) with k_new / v_new. Cross-attention: K/V once per
// source (B sources, R / B beams each, a source's beams consecutive), no k_new. The library
// links no ONNX Runtime: every call goes through the OrtApi table handed to RegisterCustomOps
// (ORT_API_MANUAL_INIT), requested at the headers' ORT_API_VERSION, which newer runtimes serve.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "decode_attention_kernel.h"

namespace transformer_ext_ort {
namespace {

constexpr const char* kDomain = "transformer_ext";
constexpr const char* kOpName = "DecodeAttention";
constexpr size_t kInputs = 7;

// An error for a bad input: ORT reports it as the node's failure.
struct BadInput : std::exception {
  std::string message;
  explicit BadInput(std::string m) : message(std::string(kDomain) + "." + kOpName + ": " + std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

// The [R, H, D] view of a [R, H, D] or [R, H, 1, D] tensor.
std::vector<int64_t> rows_heads_dims(const std::vector<int64_t>& shape, const char* name) {
  if (shape.size() == 3) return shape;
  if (shape.size() == 4 && shape[2] == 1) return {shape[0], shape[1], shape[3]};
  throw BadInput(std::string(name) + ": expected [rows, heads, head_size] or [rows, heads, 1, head_size], got " +
                 shape_text(shape));
}

struct Tensor {
  const OrtValue* value = nullptr;
  std::vector<int64_t> shape;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
};

Tensor input(Ort::KernelContext& ctx, size_t i, const char* name, bool optional) {
  Tensor t;
  if (i < ctx.GetInputCount()) {
    Ort::ConstValue v = ctx.GetInput(i);
    t.value = static_cast<const OrtValue*>(v);
  }
  if (t.value == nullptr) {
    if (!optional) throw BadInput(std::string(name) + ": required input missing");
    return t;
  }
  Ort::ConstValue v{t.value};
  auto info = v.GetTensorTypeAndShapeInfo();
  t.shape = info.GetShape();
  t.type = info.GetElementType();
  return t;
}

template <typename T>
const T* data(const Tensor& t) {
  return t.value ? Ort::ConstValue{t.value}.GetTensorData<T>() : nullptr;
}

struct DecodeAttentionKernel {
  float scale = 1.0f;

  explicit DecodeAttentionKernel(const OrtKernelInfo* info) {
    float value = 1.0f;
    OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_float(info, "scale", &value);
    if (status == nullptr) {
      scale = value;
    } else {
      Ort::GetApi().ReleaseStatus(status);  // attribute absent: the default
    }
  }

  // The status-returning entry point: a bad input becomes the node's error, never an exception
  // across the C boundary.
  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      Compute(context);
      return nullptr;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, e.what());
    }
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Tensor q = input(ctx, 0, "q", false), kc = input(ctx, 1, "k_cache", false);
    const Tensor vc = input(ctx, 2, "v_cache", false), lengths = input(ctx, 3, "lengths", false);
    const Tensor kn = input(ctx, 4, "k_new", true), vn = input(ctx, 5, "v_new", true);
    const Tensor bias = input(ctx, 6, "bias", true);

    const auto qs = rows_heads_dims(q.shape, "q");
    const int64_t R = qs[0], H = qs[1], D = qs[2];
    if (kc.shape.size() != 4)
      throw BadInput("k_cache: expected [cache_rows, heads, cache_len, head_size], got " + shape_text(kc.shape));
    if (vc.shape != kc.shape)
      throw BadInput("v_cache: expected the shape of k_cache " + shape_text(kc.shape) + ", got " +
                     shape_text(vc.shape));
    const int64_t B = kc.shape[0], L = kc.shape[2];
    if (kc.shape[1] != H || kc.shape[3] != D)
      throw BadInput("k_cache: heads and head_size must be q's (" + std::to_string(H) + ", " + std::to_string(D) +
                     "), got " + shape_text(kc.shape));
    if ((B == 0 && R != 0) || (B != 0 && R % B != 0))
      throw BadInput("q's rows (" + std::to_string(R) + ") must be a multiple of the cache rows (" +
                     std::to_string(B) + "): each cache row serves R / B consecutive rows");
    if (lengths.shape != std::vector<int64_t>{B})
      throw BadInput("lengths: expected int64 [" + std::to_string(B) + "] (one per cache row), got " +
                     shape_text(lengths.shape));
    const int64_t* len = data<int64_t>(lengths);
    for (int64_t b = 0; b < B; ++b)
      if (len[b] < 0 || len[b] > L)
        throw BadInput("lengths[" + std::to_string(b) + "] = " + std::to_string(len[b]) + " is outside [0, " +
                       std::to_string(L) + "] (the cache length)");
    if ((kn.value == nullptr) != (vn.value == nullptr))
      throw BadInput("k_new and v_new: give both (self-attention's new token) or neither");
    const bool with_new = kn.value != nullptr;
    if (with_new) {
      for (const Tensor* t : {&kn, &vn}) {
        const char* name = t == &kn ? "k_new" : "v_new";
        if (rows_heads_dims(t->shape, name) != qs)
          throw BadInput(std::string(name) + ": expected q's " + shape_text(qs) + ", got " + shape_text(t->shape));
      }
    }
    const int64_t T = L + (with_new ? 1 : 0);
    int64_t bias_stride = 0;
    if (bias.value != nullptr) {
      std::vector<int64_t> bs = bias.shape;
      if (bs.size() == 4 && bs[2] == 1) bs = {bs[0], bs[1], bs[3]};
      if (bs.size() != 3 || (bs[0] != R && bs[0] != 1) || bs[1] != H || bs[2] != T)
        throw BadInput("bias: expected [" + std::to_string(R) + " or 1, " + std::to_string(H) + ", " +
                       std::to_string(T) + "] (cache_len" + (with_new ? " + 1" : "") + " scores), got " +
                       shape_text(bias.shape));
      bias_stride = bs[0] == 1 ? 0 : H * T;
    }

    const bool with_present = ctx.GetOutputCount() > 1;
    if (with_present) {
      if (!with_new) throw BadInput("present_k / present_v need k_new and v_new (the rows they write)");
      if (B != R)
        throw BadInput("present_k / present_v need a cache row per row (" + std::to_string(R) + "), got " +
                       std::to_string(B));
      for (int64_t b = 0; b < B; ++b)
        if (len[b] >= L)
          throw BadInput("lengths[" + std::to_string(b) + "] = " + std::to_string(len[b]) +
                         " leaves no position for the new token in present_k (cache length " + std::to_string(L) + ")");
    }

    const std::vector<int64_t> out_shape{R, H * D};
    Ort::UnownedValue out = ctx.GetOutput(0, out_shape.data(), out_shape.size());
    DecodeAttentionArgs a;
    a.q = data<float>(q);
    a.k_cache = data<float>(kc);
    a.v_cache = data<float>(vc);
    a.lengths = len;
    a.k_new = data<float>(kn);
    a.v_new = data<float>(vn);
    a.bias = data<float>(bias);
    a.bias_row_stride = bias_stride;
    a.out = out.GetTensorMutableData<float>();
    a.R = R;
    a.B = B;
    a.H = H;
    a.L = L;
    a.D = D;
    a.scale = scale;
    // The cache rows (sources) over the session's intra-op threads; on the calling thread when
    // it has one.
    if (B > 1) {
      ctx.ParallelFor(
          [](void* args, size_t b) {
            const auto* p = static_cast<const DecodeAttentionArgs*>(args);
            decode_attention_cache_rows(*p, static_cast<int64_t>(b), static_cast<int64_t>(b) + 1);
          },
          static_cast<size_t>(B), 0, &a);
    } else {
      decode_attention(a);
    }
    if (with_present) {
      // After the attention, which reads positions below lengths[r] and the new token apart.
      const size_t row = sizeof(float) * static_cast<size_t>(D);
      const Tensor* caches[2] = {&kc, &vc};
      const float* news[2] = {a.k_new, a.v_new};
      for (size_t i = 0; i < 2; ++i) {
        Ort::UnownedValue present = ctx.GetOutput(1 + i, kc.shape.data(), kc.shape.size());
        float* dst = present.GetTensorMutableData<float>();
        const float* src = data<float>(*caches[i]);
        if (dst != src) std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(B * H * L * D));
        for (int64_t r = 0; r < R; ++r)
          for (int64_t h = 0; h < H; ++h)
            std::memcpy(dst + ((r * H + h) * L + len[r]) * D, news[i] + (r * H + h) * D, row);
      }
    }
  }
};

struct DecodeAttentionOp : Ort::CustomOpBase<DecodeAttentionOp, DecodeAttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new DecodeAttentionKernel(info);
      return nullptr;
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_FAIL, e.what());
    }
  }
  const char* GetName() const { return kOpName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kInputs; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 4 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i >= 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
};

bool cpu_supports_kernel() {
  if (!decode_attention_uses_avx2()) return true;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return true;
#endif
}

}  // namespace
}  // namespace transformer_ext_ort

// The library is built with -fvisibility=hidden: this entry point is its one exported symbol.
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  using namespace transformer_ext_ort;
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {  // a runtime older than the headers: report with the oldest table
    const OrtApi* oldest = api_base->GetApi(1);
    std::string message = std::string("libtransformer_ext_ort needs ONNX Runtime with C API version ") +
                          std::to_string(ORT_API_VERSION) + " or newer; this one is " + api_base->GetVersionString();
    return oldest ? oldest->CreateStatus(ORT_FAIL, message.c_str()) : nullptr;
  }
  if (!cpu_supports_kernel())
    return api->CreateStatus(ORT_FAIL,
                             "libtransformer_ext_ort was built for AVX2 + FMA, which this CPU lacks; rebuild it "
                             "without -mavx2 -mfma (csrc/ort/build.sh --portable)");
  Ort::InitApi(api);
  try {
    // One domain and op for the process, never freed: sessions keep pointers to them.
    static std::once_flag once;
    static Ort::CustomOpDomain* domain = nullptr;
    static DecodeAttentionOp* op = nullptr;
    std::call_once(once, [] {
      op = new DecodeAttentionOp();
      domain = new Ort::CustomOpDomain(kDomain);
      domain->Add(op);
    });
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
