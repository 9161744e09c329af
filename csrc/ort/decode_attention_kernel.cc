// decode_attention (decode_attention_kernel.h): every row and head in one loop nest, the
// products as register-blocked loops. Compiled with -mavx2 -mfma (csrc/ort/build.sh), where
// the products and the exponential are AVX2 intrinsics; without those flags the same loops
// run as plain C++ (the library's registration refuses a CPU without AVX2 + FMA when the
// kernel was built for them).
#include "decode_attention_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TE_ORT_AVX2 1
#else
#define TE_ORT_AVX2 0
#endif

namespace transformer_ext_ort {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if TE_ORT_AVX2

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane i of the result is the sum of a[i]'s eight lanes.
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // a0..a3 partial sums: low half, high half
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// e^x for x <= 0 (a score minus its row's maximum): 2^n * e^r with n = round(x / ln 2) and a
// degree-6 polynomial on |r| <= ln(2) / 2 (relative error about 1e-7). Below -87 (where 2^n
// would leave the normal range), -inf included, the result is 0; NaN stays NaN.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 hi = _mm256_set1_ps(88.0f);
  // max/min return their second operand when either is NaN: x stays NaN.
  const __m256 xc = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), e);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float s = hsum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Asks for rows j of ahead (row length D) to be brought into L1 (one request per cache line).
inline void prefetch_row(const float* ahead, int64_t j, int64_t D) {
  if (!ahead) return;
  const char* p = reinterpret_cast<const char*>(ahead + j * D);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(float)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// s[j] = scale * (q . keys[j]) + bias[j] for j < n: eight keys at a time, each read once. With
// ahead, row j of ahead (the values read next) is prefetched as key j is read.
void scores(const float* q, const float* keys, int64_t n, int64_t D, float scale, const float* bias,
            float* s, const float* ahead) {
  const int64_t nv = D / 8 * 8;
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* k = keys + j * D;
    for (int t = 0; t < 8; ++t) prefetch_row(ahead, j + t, D);
    __m256 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < nv; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + t * D + d), acc[t]);
    }
    __m256 sum = hsum8(acc);
    if (nv < D) {
      float tail[8];
      for (int t = 0; t < 8; ++t) {
        float x = 0.0f;
        for (int64_t d = nv; d < D; ++d) x += q[d] * k[t * D + d];
        tail[t] = x;
      }
      sum = _mm256_add_ps(sum, _mm256_loadu_ps(tail));
    }
    sum = _mm256_mul_ps(sum, vscale);
    if (bias) sum = _mm256_add_ps(sum, _mm256_loadu_ps(bias + j));
    _mm256_storeu_ps(s + j, sum);
  }
  for (; j < n; ++j) {
    prefetch_row(ahead, j, D);
    s[j] = scale * dot(q, keys + j * D, D) + (bias ? bias[j] : 0.0f);
  }
}

// In place: s[j] = e^(s[j] - max) over j < n; returns their sum.
float exp_shifted(float* s, int64_t n) {
  __m256 vm = _mm256_set1_ps(kNegInf);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
  float m = kNegInf;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float x : lanes) m = std::max(m, x);
  for (; j < n; ++j) m = std::max(m, s[j]);
  // A NaN score is skipped by the maximum but makes its e^ and so the sum NaN: the row is NaN.
  const __m256 shift = _mm256_set1_ps(m);
  __m256 vs = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
    _mm256_storeu_ps(s + j, e);
    vs = _mm256_add_ps(vs, e);
  }
  float sum = hsum(vs);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// out[c0 .. c0 + 8 NC) = inv * (sum_j p[j] values[j] + p_new v_new), NC vectors of 8 columns.
template <int NC>
inline void weighted_block(const float* p, int64_t n, const float* values, int64_t D, int64_t c0,
                           const float* v_new, float p_new, float inv, float* out, const float* ahead) {
  __m256 acc[NC];
  for (int i = 0; i < NC; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (c0 == 0) prefetch_row(ahead, j, D);
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* row = values + j * D + c0;
    for (int i = 0; i < NC; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(row + 8 * i), acc[i]);
  }
  if (v_new) {
    const __m256 pn = _mm256_set1_ps(p_new);
    for (int i = 0; i < NC; ++i) acc[i] = _mm256_fmadd_ps(pn, _mm256_loadu_ps(v_new + c0 + 8 * i), acc[i]);
  }
  const __m256 vi = _mm256_set1_ps(inv);
  for (int i = 0; i < NC; ++i) _mm256_storeu_ps(out + c0 + 8 * i, _mm256_mul_ps(acc[i], vi));
}

// With ahead, row j of ahead (the next head's keys) is prefetched as value j is read.
void weighted(const float* p, int64_t n, const float* values, int64_t D, const float* v_new, float p_new,
              float inv, float* out, const float* ahead) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) weighted_block<8>(p, n, values, D, c, v_new, p_new, inv, out, c == 0 ? ahead : nullptr);
  for (; c + 32 <= D; c += 32) weighted_block<4>(p, n, values, D, c, v_new, p_new, inv, out, c == 0 ? ahead : nullptr);
  for (; c + 8 <= D; c += 8) weighted_block<1>(p, n, values, D, c, v_new, p_new, inv, out, c == 0 ? ahead : nullptr);
  for (; c < D; ++c) {
    float x = 0.0f;
    for (int64_t j = 0; j < n; ++j) x += p[j] * values[j * D + c];
    if (v_new) x += p_new * v_new[c];
    out[c] = x * inv;
  }
}

#else  // plain C++

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void scores(const float* q, const float* keys, int64_t n, int64_t D, float scale, const float* bias,
            float* s, const float*) {
  for (int64_t j = 0; j < n; ++j) s[j] = scale * dot(q, keys + j * D, D) + (bias ? bias[j] : 0.0f);
}

float exp_shifted(float* s, int64_t n) {
  float m = kNegInf;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

void weighted(const float* p, int64_t n, const float* values, int64_t D, const float* v_new, float p_new,
              float inv, float* out, const float*) {
  for (int64_t c = 0; c < D; ++c) out[c] = 0.0f;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < D; ++c) out[c] += p[j] * values[j * D + c];
  for (int64_t c = 0; c < D; ++c) out[c] = (out[c] + (v_new ? p_new * v_new[c] : 0.0f)) * inv;
}

#endif

}  // namespace

bool decode_attention_uses_avx2() { return TE_ORT_AVX2 != 0; }

void decode_attention(const DecodeAttentionArgs& a) { decode_attention_cache_rows(a, 0, a.B); }

void decode_attention_cache_rows(const DecodeAttentionArgs& a, int64_t b_begin, int64_t b_end) {
  if (a.R == 0 || a.H == 0 || a.D == 0 || b_begin >= b_end) return;
  const int64_t K = a.R / a.B;  // rows per cache row (the caller checks R % B == 0)
  const bool with_new = a.k_new != nullptr;
  const int64_t T = a.L + (with_new ? 1 : 0);
  thread_local std::vector<float> s;  // the scores of one row and head
  s.resize(static_cast<size_t>(T) + 1);
  for (int64_t b = b_begin; b < b_end; ++b) {
    const int64_t len = a.lengths[b];
    for (int64_t h = 0; h < a.H; ++h) {
      const float* keys = a.k_cache + (b * a.H + h) * a.L * a.D;
      const float* values = a.v_cache + (b * a.H + h) * a.L * a.D;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = b * K + k;
        const int64_t off = (r * a.H + h) * a.D;
        const float* q = a.q + off;
        float* out = a.out + off;
        const float* bias = a.bias ? a.bias + r * a.bias_row_stride + h * T : nullptr;
        // The first query of a cache row and head prefetches its values while reading the keys,
        // and the next head's keys while reading the values (the blocks are consecutive).
        const bool first = k == 0;
        const bool last_block = b == a.B - 1 && h == a.H - 1;  // no block after it in the buffer
        scores(q, keys, len, a.D, a.scale, bias, s.data(), first ? values : nullptr);
        if (with_new) s[len] = a.scale * dot(q, a.k_new + off, a.D) + (bias ? bias[a.L] : 0.0f);
        const int64_t n = len + (with_new ? 1 : 0);
        if (n == 0) {
          std::memset(out, 0, sizeof(float) * static_cast<size_t>(a.D));
          continue;
        }
        const float inv = 1.0f / exp_shifted(s.data(), n);
        weighted(s.data(), len, values, a.D, with_new ? a.v_new + off : nullptr, with_new ? s[len] : 0.0f, inv,
                 out, first && !last_block ? keys + a.L * a.D : nullptr);
      }
    }
  }
}

}  // namespace transformer_ext_ort
