// CPU kernels of masked_softmax, masked_softmax_backward and decode_attention (the one-query
// attention over a cache; docs/DESIGN.md section 2). Math in float32, rows in parallel with
// at::parallel_for, inner loops vectorized with at::vec::Vectorized<float>.
//
// ISA. torch compiles its own CPU kernels once per capability (AVX2, AVX512) and picks one at
// run time; an extension is compiled once, for baseline x86-64, where Vectorized<float> falls
// back to scalar loops and a scalar exp (2-3x slower here). So on x86-64 with GCC the kernel
// section below is compiled for AVX2+FMA+F16C by a target pragma: the at::vec headers are
// included inside it with CPU_CAPABILITY=AVX2, which puts them in their own inline namespace
// (at::vec::AVX2), and every other header they need is included before the pragma, so no
// inline function shared with another translation unit is compiled for AVX2. The host
// functions run these kernels only on a CPU with AVX2, FMA and F16C, and otherwise (or when
// TRANSFORMER_EXT_CPU_FALLBACK=1) an ATen composite with the same semantics. Other
// architectures and compilers build the same kernels for their baseline.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/NumericUtils.h>
#include <ATen/Parallel.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <ATen/native/quantized/AffineQuantizerBase.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/copysign.h>
#include <torch/library.h>

#include "checks.h"
#include "ops.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(CPU_CAPABILITY)
#define TE_CPU_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // lambdas in vec256_bfloat16.h, not called here
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
// In C++ the pragma does not define __AVX__/__AVX2__, and sleef.h declares its 256-bit
// functions (which Vectorized<float> wraps) only under them.
#define __AVX__ 1
#define __AVX2__ 1
#include <sleef.h>
#undef __AVX__
#undef __AVX2__
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

// ======================= kernel section (AVX2 on x86-64, see above) =======================
namespace transformer_ext {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}

// max(a, b), NaN when either is NaN (as at::vec::maximum; std::max drops a NaN b).
inline float max_nan(float a, float b) { return std::isnan(b) ? b : std::max(a, b); }

// The NaN rule of docs/DESIGN.md section 2: a row whose max over its allowed scores is NaN (some
// score is NaN) or +inf (inf - inf is NaN in the softmax) is NaN as a whole, as in
// torch.softmax. One test per row on the max, which propagates NaN.
inline bool row_is_nan(float row_max) { return !(row_max < kPosInf) && row_max != kNegInf; }

// Lane maxima reduced with at::vec::maximum, which propagates NaN.
inline float hmax(const Vec& v) {
  return at::vec::vec_reduce_all<float>(
      [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, v);
}

// kVec elements of a float32 / float16 / bfloat16 row as float32.
template <typename T>
inline Vec load_vec(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (c10::is_reduced_floating_point_v<T>) {
      Vec out;
      at::vec::load_to_float(p, out);
      return out;
    }
#endif
    float tmp[kVec];  // float64 is instantiated by the dispatch macro but runs the composites
    for (int64_t k = 0; k < kVec; ++k) tmp[k] = static_cast<float>(p[k]);
    return Vec::loadu(tmp);
  }
}

// ---- row primitives ------------------------------------------------------------------------

// dst[j] = scale * src[j] for j < n.
template <typename T>
inline void scale_row(const T* src, float* dst, int64_t n, float scale) {
  const Vec vscale(scale);
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) (load_vec(src + j) * vscale).store(dst + j);
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]) * scale;
}

// max over x[0, n); -inf for n == 0, NaN when some x[j] is NaN.
inline float max_row(const float* x, int64_t n) {
  Vec vmax(kNegInf);
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) vmax = at::vec::maximum(vmax, Vec::loadu(x + j));
  float m = hmax(vmax);
  for (; j < n; ++j) m = max_nan(m, x[j]);
  return m;
}

// kVec mask flags (one byte each) as a blend mask: all bits set where the flag is true.
inline Vec load_mask(const bool* m) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m));
  const __m256i ints = _mm256_cvtepu8_epi32(bytes);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(ints, _mm256_setzero_si256()));
#else
  int32_t bits[kVec];
  for (int64_t k = 0; k < kVec; ++k) bits[k] = m[k] ? -1 : 0;
  Vec out;
  std::memcpy(&out, bits, sizeof(bits));
  return out;
#endif
}

// dst[j] = scale * src[j] for j < n, or -inf where the key is masked (mask[j * mstride] is
// false; mask == nullptr: none is); returns the max (-inf when no key is allowed, NaN when an
// allowed score is NaN). Masked scores are loaded in whole vectors but never used.
template <typename T>
inline float scale_mask_row_max(const T* src, float* dst, int64_t n, float scale,
                                const bool* mask, int64_t mstride) {
  const Vec vscale(scale), vneg(kNegInf);
  Vec vmax(kNegInf);
  int64_t j = 0;
  if (mask == nullptr) {
    for (; j + kVec <= n; j += kVec) {
      const Vec x = load_vec(src + j) * vscale;
      x.store(dst + j);
      vmax = at::vec::maximum(vmax, x);
    }
  } else if (mstride == 1) {
    for (; j + kVec <= n; j += kVec) {
      const Vec x = Vec::blendv(vneg, load_vec(src + j) * vscale, load_mask(mask + j));
      x.store(dst + j);
      vmax = at::vec::maximum(vmax, x);
    }
  }
  float m = hmax(vmax);
  for (; j < n; ++j) {  // tail, and masks with a key stride other than 0 or 1
    const bool allowed = mask == nullptr || mask[j * mstride];
    dst[j] = allowed ? static_cast<float>(src[j]) * scale : kNegInf;
    m = max_nan(m, dst[j]);
  }
  return m;
}

// x[j] = exp(x[j] - max) in place for j < n (masked -inf entries become 0); returns the sum.
inline float exp_row_sum(float* x, int64_t n, float max) {
  const Vec vmax(max);
  Vec vsum(0.f);
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) {
    const Vec e = (Vec::loadu(x + j) - vmax).exp_u20();
    e.store(x + j);
    vsum = vsum + e;
  }
  if (j < n) {
    const int64_t rest = n - j;
    const Vec e = Vec::set(Vec(0.f), (Vec::loadu(x + j, rest) - vmax).exp_u20(), rest);
    e.store(x + j, rest);
    vsum = vsum + e;
  }
  return hsum(vsum);
}

// dst[j] = f * x[j], converted to the storage type.
template <typename T>
inline void store_scaled_row(float* x, T* dst, int64_t n, float f) {
  const Vec vf(f);
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; j + kVec <= n; j += kVec) (Vec::loadu(x + j) * vf).store(dst + j);
    for (; j < n; ++j) dst[j] = x[j] * f;
  } else {
    for (; j + kVec <= n; j += kVec) (Vec::loadu(x + j) * vf).store(x + j);
    for (; j < n; ++j) x[j] *= f;
    at::vec::convert(x, dst, n);
  }
}

// ---- masked_softmax ------------------------------------------------------------------------

struct SoftmaxParams {
  int64_t H, Q, K;
  const bool* mask;                // expanded [B, H, Q, K] view, or nullptr
  int64_t ms0, ms1, ms2, ms3;      // its strides (elements)
  bool causal;
  float scale;
};

// One row (query q of batch b, head h) of length K. `buf` holds K floats: the float32 working
// row for float16/bfloat16 (float32 works in the output row itself).
template <typename T>
inline void masked_softmax_row(const T* src, T* dst, const SoftmaxParams& s, int64_t b,
                               int64_t h, int64_t q, float* buf) {
  const int64_t K = s.K;
  // Causal: query q sees keys j <= q + (K - Q); nothing past kend is read.
  const int64_t kend = s.causal ? std::clamp<int64_t>(q + (K - s.Q) + 1, 0, K) : K;
  const bool* mrow = nullptr;
  int64_t mstride = 0;
  bool visible = kend > 0;
  if (s.mask != nullptr) {
    mrow = s.mask + b * s.ms0 + h * s.ms1 + q * s.ms2;
    mstride = s.ms3;
    if (mstride == 0) {  // the mask is broadcast over keys: one flag for the row
      visible = visible && mrow[0];
      mrow = nullptr;
    }
  }
  float* x = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    x = dst;
  } else {
    x = buf;
  }
  const float m = visible ? scale_mask_row_max(src, x, kend, s.scale, mrow, mstride) : kNegInf;
  if (m == kNegInf) {  // no allowed key (or only -inf scores): zeros, never NaN
    std::fill(dst, dst + K, T(0));
    return;
  }
  if (row_is_nan(m)) {  // a NaN (or +inf) allowed score: the whole row is NaN
    std::fill(dst, dst + K, static_cast<T>(kNaN));
    return;
  }
  // Allowed scaled scores minus their max are <= 0: exp cannot overflow, even for fp16 1e4.
  const float sum = exp_row_sum(x, kend, m);
  store_scaled_row(x, dst, kend, 1.f / sum);
  std::fill(dst + kend, dst + K, T(0));
}

// Rows [begin, end) of a contiguous [B*H*Q, K] matrix.
template <typename T>
void masked_softmax_rows(const T* scores, T* out, const SoftmaxParams& s, int64_t begin,
                         int64_t end, float* buf) {
  // (b, h, q) of row `begin`, then stepped without divisions.
  int64_t q = begin % s.Q, h = (begin / s.Q) % s.H, b = begin / (s.Q * s.H);
  for (int64_t r = begin; r < end; ++r) {
    masked_softmax_row(scores + r * s.K, out + r * s.K, s, b, h, q, buf);
    if (++q == s.Q) {
      q = 0;
      if (++h == s.H) {
        h = 0;
        ++b;
      }
    }
  }
}

// ---- masked_softmax_backward ---------------------------------------------------------------

// grad_scores = scale * p * (g - sum(g * p)) for rows [begin, end) of [rows, K] matrices.
// `obuf` holds K floats (float16/bfloat16 only).
template <typename T>
void masked_softmax_backward_rows(const T* grad, const T* probs, T* out, int64_t K, float scale,
                                  int64_t begin, int64_t end, float* obuf) {
  for (int64_t r = begin; r < end; ++r) {
    const T* g = grad + r * K;
    const T* p = probs + r * K;
    Vec vacc(0.f);
    int64_t j = 0;
    for (; j + kVec <= K; j += kVec) vacc = at::vec::fmadd(load_vec(g + j), load_vec(p + j), vacc);
    float dot = hsum(vacc);
    for (; j < K; ++j) dot += static_cast<float>(g[j]) * static_cast<float>(p[j]);

    float* o = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      o = out + r * K;
    } else {
      o = obuf;
    }
    const Vec vdot(dot), vscale(scale);
    j = 0;
    for (; j + kVec <= K; j += kVec) {
      (vscale * load_vec(p + j) * (load_vec(g + j) - vdot)).store(o + j);
    }
    for (; j < K; ++j) {
      o[j] = scale * static_cast<float>(p[j]) * (static_cast<float>(g[j]) - dot);
    }
    if constexpr (!std::is_same_v<T, float>) at::vec::convert(obuf, out + r * K, K);
  }
}

// ---- decode_attention ----------------------------------------------------------------------

struct DecodeParams {
  int64_t H, D;
  int64_t ks0, ks1, ks2;  // k_cache strides (elements); stride(3) == 1
  int64_t vs0, vs1, vs2;  // v_cache strides
  const int64_t* lengths;
  float scale;
  // Position bias or nullptr: float32, bias(b, h, j) at bias[b * bs0 + h * bs1 + j * bs3] for
  // cache key j < L, and at j = L for the new key.
  const float* bias = nullptr;
  int64_t bs0 = 0, bs1 = 0, bs3 = 0, L = 0;
};

// scores[i] = qf . k_i for four keys at once (qf is float32, D elements).
template <typename T>
inline void dot4(const float* qf, const T* k0, const T* k1, const T* k2, const T* k3, int64_t D,
                 float* out) {
  Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
  int64_t d = 0;
  for (; d + kVec <= D; d += kVec) {
    const Vec qv = Vec::loadu(qf + d);
    a0 = at::vec::fmadd(qv, load_vec(k0 + d), a0);
    a1 = at::vec::fmadd(qv, load_vec(k1 + d), a1);
    a2 = at::vec::fmadd(qv, load_vec(k2 + d), a2);
    a3 = at::vec::fmadd(qv, load_vec(k3 + d), a3);
  }
  float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
  for (; d < D; ++d) {
    s0 += qf[d] * static_cast<float>(k0[d]);
    s1 += qf[d] * static_cast<float>(k1[d]);
    s2 += qf[d] * static_cast<float>(k2[d]);
    s3 += qf[d] * static_cast<float>(k3[d]);
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

template <typename T>
inline float dot1(const float* qf, const T* k, int64_t D) {
  Vec a(0.f);
  int64_t d = 0;
  for (; d + kVec <= D; d += kVec) a = at::vec::fmadd(Vec::loadu(qf + d), load_vec(k + d), a);
  float s = hsum(a);
  for (; d < D; ++d) s += qf[d] * static_cast<float>(k[d]);
  return s;
}

// acc += w0 * v0 + w1 * v1 + w2 * v2 + w3 * v3 (acc is float32, D elements).
template <typename T>
inline void axpy4(float* acc, const float* w, const T* v0, const T* v1, const T* v2,
                  const T* v3, int64_t D) {
  const Vec w0(w[0]), w1(w[1]), w2(w[2]), w3(w[3]);
  int64_t d = 0;
  for (; d + kVec <= D; d += kVec) {
    Vec a = Vec::loadu(acc + d);
    a = at::vec::fmadd(w0, load_vec(v0 + d), a);
    a = at::vec::fmadd(w1, load_vec(v1 + d), a);
    a = at::vec::fmadd(w2, load_vec(v2 + d), a);
    a = at::vec::fmadd(w3, load_vec(v3 + d), a);
    a.store(acc + d);
  }
  for (; d < D; ++d) {
    acc[d] += w[0] * static_cast<float>(v0[d]) + w[1] * static_cast<float>(v1[d]) +
              w[2] * static_cast<float>(v2[d]) + w[3] * static_cast<float>(v3[d]);
  }
}

template <typename T>
inline void axpy1(float* acc, float w, const T* v, int64_t D) {
  const Vec vw(w);
  int64_t d = 0;
  for (; d + kVec <= D; d += kVec) {
    at::vec::fmadd(vw, load_vec(v + d), Vec::loadu(acc + d)).store(acc + d);
  }
  for (; d < D; ++d) acc[d] += w * static_cast<float>(v[d]);
}

// One fused pass per (b, h) pair in [begin, end): scores over the cache prefix (and the new
// key), softmax, weighted sum of the values. q, k_new, v_new, out are contiguous [B*H, D].
// Buffers: scores >= max(lengths) + 1 floats, qf and acc D floats each.
template <typename T>
void decode_attention_rows(const T* q, const T* k, const T* v, const T* k_new, const T* v_new,
                           T* out, const DecodeParams& s, int64_t begin, int64_t end,
                           float* scores, float* qf, float* acc) {
  const int64_t D = s.D;
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / s.H, h = bh % s.H;
    const int64_t n_cache = s.lengths[b];
    const int64_t n = n_cache + (k_new != nullptr ? 1 : 0);
    T* o = out + bh * D;
    if (n == 0) {  // no key at all
      std::fill(o, o + D, T(0));
      continue;
    }
    scale_row(q + bh * D, qf, D, s.scale);  // scores = (scale * q) . k
    const T* kb = k + b * s.ks0 + h * s.ks1;
    const T* vb = v + b * s.vs0 + h * s.vs1;
    const int64_t ks = s.ks2, vs = s.vs2;

    // 1. scores of keys 0 .. lengths[b]-1 (never past) and of the new key
    int64_t j = 0;
    for (; j + 4 <= n_cache; j += 4) {
      const T* kj = kb + j * ks;
      dot4(qf, kj, kj + ks, kj + 2 * ks, kj + 3 * ks, D, scores + j);
    }
    for (; j < n_cache; ++j) scores[j] = dot1(qf, kb + j * ks, D);
    if (k_new != nullptr) scores[n_cache] = dot1(qf, k_new + bh * D, D);
    if (s.bias != nullptr) {  // scores += bias of (b, h): cache keys, then the new key's (at L)
      const float* br = s.bias + b * s.bs0 + h * s.bs1;
      if (s.bs3 == 1) {
        for (j = 0; j + kVec <= n_cache; j += kVec) {
          (Vec::loadu(scores + j) + Vec::loadu(br + j)).store(scores + j);
        }
      } else {
        j = 0;
      }
      for (; j < n_cache; ++j) scores[j] += br[j * s.bs3];
      if (k_new != nullptr) scores[n_cache] += br[s.L * s.bs3];
    }

    // 2. softmax weights (normalised at the end); the same rules as masked_softmax for a
    // row whose scores are all -inf (zeros) or include a NaN or +inf (NaN)
    const float m = max_row(scores, n);
    if (m == kNegInf || row_is_nan(m)) {
      std::fill(o, o + D, m == kNegInf ? T(0) : static_cast<T>(kNaN));
      continue;
    }
    const float sum = exp_row_sum(scores, n, m);

    // 3. weighted sum of the values
    std::fill(acc, acc + D, 0.f);
    j = 0;
    for (; j + 4 <= n_cache; j += 4) {
      const T* vj = vb + j * vs;
      axpy4(acc, scores + j, vj, vj + vs, vj + 2 * vs, vj + 3 * vs, D);
    }
    for (; j < n_cache; ++j) axpy1(acc, scores[j], vb + j * vs, D);
    if (v_new != nullptr) axpy1(acc, scores[n_cache], v_new + bh * D, D);
    store_scaled_row(acc, o, D, sum > 0.f ? 1.f / sum : 0.f);
  }
}

}  // namespace
}  // namespace transformer_ext

#ifdef TE_CPU_AVX2
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
// ===================================== end of kernels =====================================

namespace transformer_ext {
namespace {

// Elements of work below which a parallel_for chunk is not worth a thread.
constexpr int64_t kMinElemsPerTask = 32 * 1024;

inline int64_t grain_for(int64_t elems_per_item) {
  return std::max<int64_t>(1, kMinElemsPerTask / std::max<int64_t>(1, elems_per_item));
}

// True when the vectorized kernels above may run on this CPU (decided once).
bool cpu_kernels_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("TRANSFORMER_EXT_CPU_FALLBACK");
    if (env != nullptr && std::strcmp(env, "1") == 0) return false;
#ifdef TE_CPU_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return true;
#endif
  }();
  return enabled;
}

// float32 / float16 / bfloat16 run the kernels; float64 (accepted so that gradcheck can run
// on the ops) and CPUs without the kernels' instructions run the composites below.
bool use_kernels(const at::Tensor& t) {
  return t.scalar_type() != at::kDouble && cpu_kernels_enabled();
}

// The math dtype: float32, or float64 for float64 inputs.
at::ScalarType math_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// ---- ATen composites with the semantics of transformer_ext/reference.py.

at::Tensor masked_softmax_composite(const at::Tensor& scores, const at::Tensor& mask_e,
                                    double scale, bool causal) {
  const int64_t Q = scores.size(2), K = scores.size(3);
  const at::ScalarType acc = math_type(scores);
  at::Tensor x = scores.to(acc) * scale;
  at::Tensor allowed = mask_e;
  if (causal) {
    const auto opts = scores.options().dtype(at::kLong);
    const at::Tensor c =
        at::arange(K, opts).unsqueeze(0) <= at::arange(Q, opts).unsqueeze(1) + (K - Q);
    allowed = allowed.defined() ? at::logical_and(allowed, c) : c;
  }
  if (allowed.defined()) x = x.masked_fill(at::logical_not(allowed), -INFINITY);
  // The max propagates NaN. A row without an allowed finite score (max -inf) is shifted by 0,
  // so exp gives exact zeros; a NaN or +inf max makes every exp, the sum and so the whole
  // row NaN (docs/DESIGN.md section 2).
  at::Tensor row_max = std::get<0>(x.max(-1, /*keepdim=*/true));
  row_max = at::where(row_max == -INFINITY, at::zeros_like(row_max), row_max);
  const at::Tensor e = at::exp(x - row_max);
  const at::Tensor denom = e.sum(-1, /*keepdim=*/true);
  const double tiny = acc == at::kDouble ? DBL_MIN : FLT_MIN;
  return at::where(denom == 0, at::zeros_like(e), e / denom.clamp_min(tiny))
      .to(scores.scalar_type());
}

at::Tensor masked_softmax_backward_composite(const at::Tensor& grad, const at::Tensor& probs,
                                             double scale) {
  const at::ScalarType acc = math_type(probs);
  const at::Tensor g = grad.to(acc), p = probs.to(acc);
  const at::Tensor dot = (g * p).sum(-1, /*keepdim=*/true);
  return (p * (g - dot) * scale).to(probs.scalar_type());
}

// bias: undefined, or [B?, H?, 1, L (+ 1 with k_new)] added to the scaled scores.
at::Tensor decode_attention_composite(const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& lengths,
                                      double scale, const at::Tensor& k_new,
                                      const at::Tensor& v_new, const at::Tensor& bias) {
  const int64_t L = k_cache.size(2);
  const at::ScalarType acc = math_type(q);
  const at::Tensor qf = q.to(acc);
  at::Tensor scores = at::matmul(qf, k_cache.to(acc).transpose(-2, -1));  // [B,H,1,L]
  at::Tensor allowed =
      (at::arange(L, lengths.options()).view({1, 1, 1, L}) < lengths.view({-1, 1, 1, 1}))
          .expand(scores.sizes());
  at::Tensor vf = v_cache.to(acc);
  if (k_new.defined()) {
    scores = at::cat({scores, at::matmul(qf, k_new.to(acc).transpose(-2, -1))}, -1);
    allowed = at::cat({allowed, at::ones({q.size(0), q.size(1), 1, 1}, allowed.options())}, -1);
    vf = at::cat({vf, v_new.to(acc)}, 2);
  }
  if (scores.size(-1) == 0) return at::zeros_like(q, at::MemoryFormat::Contiguous);  // L = 0
  if (bias.defined()) {
    scores = scores * scale + bias.to(acc);
    scale = 1.0;
  }
  const at::Tensor probs = masked_softmax_composite(scores, allowed, scale, false);
  vf = vf.masked_fill(at::logical_not(allowed.transpose(-2, -1)), 0.0);  // no NaN past lengths
  return at::matmul(probs, vf).to(q.scalar_type()).contiguous();
}

}  // namespace

at::Tensor masked_softmax(const at::Tensor& scores,               // [B, H, Q, K]
                          const std::optional<at::Tensor>& mask,  // bool, broadcastable
                          double scale, bool causal) {
  const at::Tensor mask_e = check_masked_softmax_args(scores, mask);  // [B, H, Q, K] view
  const at::Tensor x = scores.contiguous();
  if (!use_kernels(x)) return masked_softmax_composite(x, mask_e, scale, causal);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t B = x.size(0), H = x.size(1), Q = x.size(2), K = x.size(3);
  const int64_t rows = B * H * Q;
  if (rows == 0) return out;

  SoftmaxParams s{H, Q, K, nullptr, 0, 0, 0, 0, causal, static_cast<float>(scale)};
  if (mask_e.defined()) {
    s.mask = mask_e.const_data_ptr<bool>();
    s.ms0 = mask_e.stride(0);
    s.ms1 = mask_e.stride(1);
    s.ms2 = mask_e.stride(2);
    s.ms3 = mask_e.stride(3);
  }
  TE_DISPATCH_FLOATING(x.scalar_type(), "masked_softmax_cpu", [&] {
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(K), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same_v<scalar_t, float> ? 0 : K);
      masked_softmax_rows<scalar_t>(in, o, s, begin, end, buf.data());
    });
  });
  return out;
}

at::Tensor masked_softmax_backward(const at::Tensor& grad_probs,  // [B, H, Q, K]
                                   const at::Tensor& probs,       // [B, H, Q, K]
                                   double scale) {
  check_masked_softmax_backward_args(grad_probs, probs);
  const at::Tensor g = grad_probs.contiguous();
  const at::Tensor p = probs.contiguous();
  if (!use_kernels(p)) return masked_softmax_backward_composite(g, p, scale);
  at::Tensor out = at::empty(p.sizes(), p.options());
  const int64_t K = p.size(3);
  const int64_t rows = K == 0 ? 0 : p.numel() / K;
  if (rows == 0) return out;
  TE_DISPATCH_FLOATING(p.scalar_type(), "masked_softmax_backward_cpu", [&] {
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* pp = p.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(K), [&](int64_t begin, int64_t end) {
      std::vector<float> obuf(std::is_same_v<scalar_t, float> ? 0 : K);
      masked_softmax_backward_rows<scalar_t>(gp, pp, o, K, static_cast<float>(scale), begin, end,
                                             obuf.data());
    });
  });
  return out;
}

namespace {

at::Tensor decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& lengths, double scale,
                                 const std::optional<at::Tensor>& k_new,
                                 const std::optional<at::Tensor>& v_new, const at::Tensor& bias) {
  check_decode_attention_args(q, k_cache, v_cache, lengths, k_new, v_new);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), L = k_cache.size(2);
  const bool has_new = k_new.has_value() && k_new->defined();
  if (bias.defined()) check_decode_position_bias(bias, q, L + (has_new ? 1 : 0));
  const at::Tensor len = lengths.contiguous();
  check_lengths_in_range(len, L);
  const at::Tensor kn = has_new ? k_new->contiguous() : at::Tensor();
  const at::Tensor vn = has_new ? v_new->contiguous() : at::Tensor();
  if (!use_kernels(q)) {
    return decode_attention_composite(q, k_cache, v_cache, len, scale, kn, vn, bias);
  }

  const at::Tensor qc = q.contiguous();
  // Any strides in B, H, L are fine; only the head dim must be dense.
  const at::Tensor kc = k_cache.stride(3) == 1 ? k_cache : k_cache.contiguous();
  const at::Tensor vc = v_cache.stride(3) == 1 ? v_cache : v_cache.contiguous();
  at::Tensor out = at::empty({B, H, 1, D}, qc.options());
  if (B * H == 0) return out;

  const int64_t* lp = len.const_data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lp[b]);
  DecodeParams s{H, D,
                 kc.stride(0), kc.stride(1), kc.stride(2),
                 vc.stride(0), vc.stride(1), vc.stride(2),
                 lp, static_cast<float>(scale)};
  at::Tensor bias_f;  // float32 [B, H, 1, n] view (stride 0 where the bias broadcasts)
  if (bias.defined()) {
    bias_f = bias.to(at::kFloat).expand({B, H, 1, bias.size(3)});
    s.bias = bias_f.const_data_ptr<float>();
    s.bs0 = bias_f.stride(0);
    s.bs1 = bias_f.stride(1);
    s.bs3 = bias_f.stride(3);
    s.L = L;
  }

  TE_DISPATCH_FLOATING(qc.scalar_type(), "decode_attention_cpu", [&] {
    const scalar_t* qp = qc.const_data_ptr<scalar_t>();
    const scalar_t* kp = kc.const_data_ptr<scalar_t>();
    const scalar_t* vp = vc.const_data_ptr<scalar_t>();
    const scalar_t* knp = has_new ? kn.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* vnp = has_new ? vn.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * H, grain_for(2 * (max_len + 1) * D), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(max_len + 1 + 2 * D);  // scores, scaled q, accumulator
      float* scores = buf.data();
      float* qf = scores + max_len + 1;
      decode_attention_rows<scalar_t>(qp, kp, vp, knp, vnp, o, s, begin, end, scores, qf,
                                      qf + D);
    });
  });
  return out;
}

}  // namespace

// The decode position bias's argument check (shared with the CUDA host function through ops.h).
void check_decode_position_bias(const at::Tensor& bias, const at::Tensor& q, int64_t n_keys) {
  const int64_t B = q.size(0), H = q.size(1);
  TORCH_CHECK(bias.defined(), "position_bias must be a tensor");
  TORCH_CHECK(bias.device() == q.device(), "position_bias must be on ", q.device(),
              " (the device of q), got ", bias.device());
  TORCH_CHECK(at::isFloatingType(bias.scalar_type()),
              "position_bias must be a floating-point tensor, got ", bias.scalar_type());
  const bool ok = bias.dim() == 4 && (bias.size(0) == 1 || bias.size(0) == B) &&
                  (bias.size(1) == 1 || bias.size(1) == H) && bias.size(2) == 1 &&
                  bias.size(3) == n_keys;
  TORCH_CHECK(ok, "position_bias must have shape [", B, " or 1, ", H, " or 1, 1, ", n_keys,
              "] (one entry per cache position, the new key's last), got ", bias.sizes());
}

at::Tensor decode_attention(const at::Tensor& q,                     // [B, H, 1, D]
                            const at::Tensor& k_cache,               // [B, H, L, D]
                            const at::Tensor& v_cache,               // [B, H, L, D]
                            const at::Tensor& lengths,               // [B] int64
                            double scale,
                            const std::optional<at::Tensor>& k_new,  // [B, H, 1, D]
                            const std::optional<at::Tensor>& v_new) {
  return decode_attention_impl(q, k_cache, v_cache, lengths, scale, k_new, v_new, at::Tensor());
}

at::Tensor decode_attention_with_bias(const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& lengths,
                                      double scale, const at::Tensor& position_bias,
                                      const std::optional<at::Tensor>& k_new,
                                      const std::optional<at::Tensor>& v_new) {
  TORCH_CHECK(position_bias.defined(), "position_bias must be a tensor");
  return decode_attention_impl(q, k_cache, v_cache, lengths, scale, k_new, v_new, position_bias);
}

}  // namespace transformer_ext

TORCH_LIBRARY_IMPL(transformer_ext, CPU, m) {
  m.impl("masked_softmax", &transformer_ext::masked_softmax);
  m.impl("masked_softmax_backward", &transformer_ext::masked_softmax_backward);
  m.impl("decode_attention", &transformer_ext::decode_attention);
  m.impl("decode_attention_with_bias", &transformer_ext::decode_attention_with_bias);
}
