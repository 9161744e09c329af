// CPU kernel of transformer_ext::linear: y = x @ weight^T + bias for the few rows of a
// decoder step (batch 1 greedy decoding has one row per projection).
//
// A BLAS GEMM call has a fixed cost that dominates matrices of a few MB with one input row
// (measured on the base decoder's 37 projections per step: MKL 4.15 ms, this kernel 3.27 ms,
// float32, 2 threads). Here every thread takes a contiguous range of output features and
// walks it in blocks of 8 weight rows: 8 independent FMA chains over the shared input row,
// each weight row streamed once from memory and applied to all (at most kLinearMaxRows) rows
// of x. AVX-512F or AVX2+FMA, chosen at run time; anything else (more rows, other dtypes,
// non-contiguous weights, TRANSFORMER_EXT_CPU_FALLBACK=1) is at::linear.
//
// bfloat16 (x, weight and bias all bfloat16): the same blocks over weight rows read as
// bfloat16 (half the bytes of float32; a one-row product is bound by reading the weights) and
// widened to float32 by a shift, the x rows widened to float32 once, float32 accumulation, the
// output rounded to bfloat16 (nearest even) as at::linear's is; where the CPU has AVX-512 BF16,
// its dot-product instruction on the bfloat16 rows of x instead. oneDNN's bfloat16 GEMM at one
// row costs more than the float32 kernel above (a weight reorder per call), so this one is what
// makes bfloat16 decoding read half the bytes.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TE_LINEAR_X86 1
#endif

#include "checks.h"
#include "ops.h"

namespace transformer_ext {
namespace {

constexpr int64_t kLinearMaxRows = 4;
constexpr int64_t kBlock = 8;  // weight rows per block

enum class Isa { kNone, kAvx2, kAvx512 };

// AVX-512 BF16's dot-product instruction (bfloat16 pairs into float32), for bfloat16 weights.
bool has_avx512_bf16() {
#ifdef TE_LINEAR_X86
  static const bool yes = [] {
    const char* env = std::getenv("TRANSFORMER_EXT_CPU_BF16_DOT");  // "0": the widening kernels
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  }();
  return yes;
#else
  return false;
#endif
}

Isa detect_isa() {
  static const Isa isa = [] {
    const char* env = std::getenv("TRANSFORMER_EXT_CPU_FALLBACK");
    if (env != nullptr && std::strcmp(env, "1") == 0) return Isa::kNone;
#ifdef TE_LINEAR_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
    return Isa::kNone;
  }();
  return isa;
}

#ifdef TE_LINEAR_X86
// y[m, n0:n1] for m < M. x: [M, K], w: [N, K], y: [M, N] row-major; bias may be null.
template <int R>
__attribute__((target("avx512f"))) inline void block_avx512(const float* x, const float* w, const float* bias,
                                                            float* y, int64_t M, int64_t K, int64_t N,
                                                            int64_t n) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 xv = _mm512_loadu_ps(xm + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + (n + r) * K + k), xv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float t = _mm512_reduce_add_ps(acc[r]);
      const float* wr = w + (n + r) * K;
      for (int64_t kk = k; kk < K; ++kk) t += wr[kk] * xm[kk];
      y[m * N + n + r] = t + (bias != nullptr ? bias[n + r] : 0.0f);
    }
  }
}

__attribute__((target("avx512f"))) void rows_avx512(const float* x, const float* w, const float* bias, float* y,
                                                    int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kBlock <= n1; n += kBlock) block_avx512<kBlock>(x, w, bias, y, M, K, N, n);
  for (; n < n1; ++n) block_avx512<1>(x, w, bias, y, M, K, N, n);
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

template <int R>
__attribute__((target("avx2,fma"))) inline void block_avx2(const float* x, const float* w, const float* bias,
                                                           float* y, int64_t M, int64_t K, int64_t N, int64_t n) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 xv = _mm256_loadu_ps(xm + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + (n + r) * K + k), xv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float t = hsum256(acc[r]);
      const float* wr = w + (n + r) * K;
      for (int64_t kk = k; kk < K; ++kk) t += wr[kk] * xm[kk];
      y[m * N + n + r] = t + (bias != nullptr ? bias[n + r] : 0.0f);
    }
  }
}

__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, const float* w, const float* bias, float* y,
                                                   int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kBlock <= n1; n += kBlock) block_avx2<kBlock>(x, w, bias, y, M, K, N, n);
  for (; n < n1; ++n) block_avx2<1>(x, w, bias, y, M, K, N, n);
}

// bfloat16 -> float32 is the 16 bits shifted into the high half of a 32-bit word.
__attribute__((target("avx512f"))) inline __m512 load16_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// y[m, n:n+R] for m < M. xf: the M rows of x as float32 [M, K]; w: bfloat16 [N, K]; bias:
// bfloat16 [N] or null; y: bfloat16 [M, N].
template <int R>
__attribute__((target("avx512f"))) inline void block_bf16_avx512(const float* xf, const uint16_t* w,
                                                                 const uint16_t* bias, c10::BFloat16* y,
                                                                 int64_t M, int64_t K, int64_t N, int64_t n) {
  for (int64_t m = 0; m < M; ++m) {  // rows after the first read the block's weights from cache
    const float* xm = xf + m * K;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 xv = _mm512_loadu_ps(xm + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(load16_bf16(w + (n + r) * K + k), xv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float t = _mm512_reduce_add_ps(acc[r]);
      const uint16_t* wr = w + (n + r) * K;
      for (int64_t kk = k; kk < K; ++kk) t += bf16_to_float(wr[kk]) * xm[kk];
      y[m * N + n + r] = c10::BFloat16(t + (bias != nullptr ? bf16_to_float(bias[n + r]) : 0.0f));
    }
  }
}

__attribute__((target("avx512f"))) void rows_bf16_avx512(const float* xf, const uint16_t* w, const uint16_t* bias,
                                                         c10::BFloat16* y, int64_t M, int64_t K, int64_t N,
                                                         int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kBlock <= n1; n += kBlock) block_bf16_avx512<kBlock>(xf, w, bias, y, M, K, N, n);
  for (; n < n1; ++n) block_bf16_avx512<1>(xf, w, bias, y, M, K, N, n);
}

__attribute__((target("avx2,fma"))) inline __m256 load8_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int R>
__attribute__((target("avx2,fma"))) inline void block_bf16_avx2(const float* xf, const uint16_t* w,
                                                                const uint16_t* bias, c10::BFloat16* y,
                                                                int64_t M, int64_t K, int64_t N, int64_t n) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = xf + m * K;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 xv = _mm256_loadu_ps(xm + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(load8_bf16(w + (n + r) * K + k), xv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float t = hsum256(acc[r]);
      const uint16_t* wr = w + (n + r) * K;
      for (int64_t kk = k; kk < K; ++kk) t += bf16_to_float(wr[kk]) * xm[kk];
      y[m * N + n + r] = c10::BFloat16(t + (bias != nullptr ? bf16_to_float(bias[n + r]) : 0.0f));
    }
  }
}

__attribute__((target("avx2,fma"))) void rows_bf16_avx2(const float* xf, const uint16_t* w, const uint16_t* bias,
                                                        c10::BFloat16* y, int64_t M, int64_t K, int64_t N,
                                                        int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kBlock <= n1; n += kBlock) block_bf16_avx2<kBlock>(xf, w, bias, y, M, K, N, n);
  for (; n < n1; ++n) block_bf16_avx2<1>(xf, w, bias, y, M, K, N, n);
}
// AVX-512 BF16: y[m, n:n+R] with x bfloat16 [M, K] (not widened): vdpbf16ps multiplies 32
// bfloat16 pairs and adds them to 16 float32 accumulators, one instruction per 32 weights
// (the widening kernels above spend three). The tail is a masked load of zeros, which adds
// nothing. Inputs and outputs below the smallest normal number count as zero (DAZ/FTZ).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void block_dpbf16(const uint16_t* x, const uint16_t* w,
                                                                              const uint16_t* bias,
                                                                              c10::BFloat16* y, int64_t M,
                                                                              int64_t K, int64_t N, int64_t n) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xm = x + m * K;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xm + k);
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n + r) * K + k);
        acc[r] = _mm512_dpbf16_ps(acc[r], wv, xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float t = _mm512_reduce_add_ps(acc[r]);
      y[m * N + n + r] = c10::BFloat16(t + (bias != nullptr ? bf16_to_float(bias[n + r]) : 0.0f));
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void rows_dpbf16(const uint16_t* x, const uint16_t* w,
                                                                     const uint16_t* bias, c10::BFloat16* y,
                                                                     int64_t M, int64_t K, int64_t N, int64_t n0,
                                                                     int64_t n1) {
  int64_t n = n0;
  for (; n + kBlock <= n1; n += kBlock) block_dpbf16<kBlock>(x, w, bias, y, M, K, N, n);
  for (; n < n1; ++n) block_dpbf16<1>(x, w, bias, y, M, K, N, n);
}
#endif  // TE_LINEAR_X86

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_linear_args(x, weight, bias);
  const int64_t K = weight.size(1), N = weight.size(0);
  const int64_t M = K > 0 ? x.numel() / K : 0;
  const Isa isa = detect_isa();
  const bool bias_ok = !bias.has_value() || bias->is_contiguous();
  const at::ScalarType dtype = x.scalar_type();
  if (isa == Isa::kNone || (dtype != at::kFloat && dtype != at::kBFloat16) || M < 1 || M > kLinearMaxRows ||
      N == 0 || K == 0 || !weight.is_contiguous() || !bias_ok) {
    return at::linear(x, weight, bias);
  }
#ifdef TE_LINEAR_X86
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());
  // Whole 8-row blocks per task; a task of fewer than ~32 KB of weights is not worth a thread.
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  if (dtype == at::kBFloat16) {
    const auto* wp = reinterpret_cast<const uint16_t*>(weight.const_data_ptr<c10::BFloat16>());
    const auto* bp =
        bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->const_data_ptr<c10::BFloat16>()) : nullptr;
    c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
    const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, kBlock * K * 2));
    const bool dp = isa == Isa::kAvx512 && has_avx512_bf16();
    // x as the kernel reads it: bfloat16 rows for vdpbf16ps, float32 rows for the widening kernels.
    const at::Tensor xr = dp ? x.reshape({M, K}).contiguous() : x.reshape({M, K}).contiguous().to(at::kFloat);
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      const int64_t n0 = b0 * kBlock, n1 = std::min(N, b1 * kBlock);
      if (dp) {
        rows_dpbf16(reinterpret_cast<const uint16_t*>(xr.const_data_ptr<c10::BFloat16>()), wp, bp, yp, M, K, N,
                    n0, n1);
      } else if (isa == Isa::kAvx512) {
        rows_bf16_avx512(xr.const_data_ptr<float>(), wp, bp, yp, M, K, N, n0, n1);
      } else {
        rows_bf16_avx2(xr.const_data_ptr<float>(), wp, bp, yp, M, K, N, n0, n1);
      }
    });
    return y;
  }
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  const float* bp = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, kBlock * K * 4));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kBlock, n1 = std::min(N, b1 * kBlock);
    if (isa == Isa::kAvx512) {
      rows_avx512(xp, wp, bp, yp, M, K, N, n0, n1);
    } else {
      rows_avx2(xp, wp, bp, yp, M, K, N, n0, n1);
    }
  });
  return y;
#else
  return at::linear(x, weight, bias);
#endif
}

}  // namespace transformer_ext

TORCH_LIBRARY_IMPL(transformer_ext, CPU, m) {
  m.impl("linear", &transformer_ext::linear);
}
