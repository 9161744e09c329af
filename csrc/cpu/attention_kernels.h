// Tile kernels of transformer_ext::attention (forward and backward), written once with GCC
// vector extensions and compiled once per instruction set: csrc/cpu/attention.cpp
// includes this file inside `#pragma GCC target(...)` regions with TE_FA_NS (the namespace)
// and TE_FA_W (floats per vector: 16 for AVX-512, 8 for AVX2) defined. Every function here
// gets the target of its region, so one source gives an AVX-512 and an AVX2 kernel, chosen at
// run time by the host function.
//
// Algorithm (one (b, h) pair, scores in natural units: q is pre-multiplied by scale; exponentials
// are 2^((s - shift) * log2(e)), the difference taken first):
//   forward, per block of kBlockM query rows: for every tile of kBlockN keys that a row of the
//     block may see, S = Q K^T (register-blocked, K transposed into the tile buffer), an online
//     softmax per row (running max m, running sum l, the accumulator rescaled by
//     2^(m_old - m_new)), dropout on the probabilities, O += P V. Keys at or past key_lengths[b]
//     are never loaded; tiles above the causal diagonal are never visited; inside the diagonal
//     tile each row uses only its own keys (values of masked keys never enter the sums).
//     Saved: lse = ln(sum_j exp(scale * q.k_j)), or -inf for a row with no key.
//   backward, per (b, h): for every key tile, for every query block that sees it: P recomputed
//     from lse, dP = dO V^T, dropout applied to both, dS = P (dP - rowsum(dO o O)),
//     dV += Pd^T dO, dK += dS^T Q (kept per key tile), dQ += dS K (kept for the whole head).
// Position bias (optional): forward adds the bias to each score tile (the host passes the
// bias transposed, keys x query rows, so W rows are one vector); backward adds it to the
// recomputed scores and accumulates d(bias) = dS.
// No include here: the including file provides everything, outside the target region.

namespace TE_FA_NS {

constexpr int W = TE_FA_W;
typedef float vf __attribute__((vector_size(W * 4)));
typedef float vfu __attribute__((vector_size(W * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef int32_t viu __attribute__((vector_size(W * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint32_t vuu __attribute__((vector_size(W * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(W * 2), aligned(2)));

constexpr int kRows = 4;                     // rows of a register block
constexpr int kCols = TE_FA_W == 16 ? 4 : 2;  // vectors of columns of a register block

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
inline vf splat(float x) {  // a broadcast (vf{} + x would add 0 to x first, for -0.0)
#if TE_FA_W == 16
  return _mm512_set1_ps(x);
#else
  return _mm256_set1_ps(x);
#endif
}
inline vu splat_u(uint32_t x) {
#if TE_FA_W == 16
  return reinterpret_cast<vu>(_mm512_set1_epi32(static_cast<int>(x)));
#else
  return reinterpret_cast<vu>(_mm256_set1_epi32(static_cast<int>(x)));
#endif
}
inline vi iota() {
  vi r;
  for (int k = 0; k < W; ++k) r[k] = k;
  return r;
}

inline vf fmadd(vf a, vf b, vf c) {
#if TE_FA_W == 16
  return _mm512_fmadd_ps(a, b, c);
#else
  return _mm256_fmadd_ps(a, b, c);
#endif
}

inline float hsum(vf v) {
#if TE_FA_W == 16
  return _mm512_reduce_add_ps(v);
#else
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 0x55));
  return _mm_cvtss_f32(x);
#endif
}

// max that keeps the accumulator where x is NaN (NaN propagates through the exponentials).
inline vf vmax(vf acc, vf x) { return x > acc ? x : acc; }

inline float hmax(vf v) {
  float m = v[0];
  for (int k = 1; k < W; ++k) m = v[k] > m ? v[k] : m;
  return m;
}

// 2^x per lane: x = n + f with n = round(x), |f| <= 1/2, 2^f by its degree-7 Taylor
// polynomial (relative error below 1e-8), 2^n through the exponent bits. Below -126 (and for
// -inf) the result is exactly 0; NaN stays NaN.
inline vf exp2v(vf x) {
  vf xc = x < -126.f ? splat(-126.f) : x;
  xc = xc > 127.f ? splat(127.f) : xc;
  const vf n = (xc + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23)
  const vf f = xc - n;
  vf p = splat(1.525273380405984e-05f);
  p = fmadd(p, f, splat(1.5403530393381606e-04f));
  p = fmadd(p, f, splat(1.3333558146428443e-03f));
  p = fmadd(p, f, splat(9.618129107628477e-03f));
  p = fmadd(p, f, splat(5.550410866482158e-02f));
  p = fmadd(p, f, splat(2.402265069591007e-01f));
  p = fmadd(p, f, splat(6.931471805599453e-01f));
  p = fmadd(p, f, splat(1.f));
  const vi bits = reinterpret_cast<vi>(p) + (__builtin_convertvector(n, vi) << 23);
  vf r = reinterpret_cast<vf>(bits);
  r = x < -126.f ? splat(0.f) : r;
  return x != x ? x : r;
}

// ---- the dropout generator, W lanes at a time (same function as dropout_hash in the .cpp)

inline vu mix32v(vu x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// p[c] = 0 where key j0 + c of the row with keys (r1, r2) is dropped, for c < n (n rounded up
// to whole vectors; the buffer holds them).
inline void apply_dropout_row(float* p, int64_t n, uint32_t r1, uint32_t r2, int64_t j0,
                              uint32_t threshold) {
  const vu lane = reinterpret_cast<vu>(iota());
  for (int64_t c = 0; c < n; c += W) {
    const vu j = lane + static_cast<uint32_t>(j0 + c);
    const vu u = mix32v(mix32v(j + r1) ^ r2);
    const vf x = load(p + c);
    store(p + c, u >= threshold ? x : splat(0.f));
  }
}

// ---- prefetch ----------------------------------------------------------------------------

// Asks for `n` rows of `row_bytes` bytes, `stride` elements apart, to be brought into the cache.
// The rows of one head in a [B, T, H, D] buffer (what the model's projections give) lie H * D
// elements apart, a stride the hardware prefetchers follow poorly; asking for every line of a
// task up front overlaps their memory latencies instead of meeting them one row at a time.
template <typename T>
inline void prefetch_rows(const T* p, int64_t n, int64_t stride, int64_t row_bytes) {
  for (int64_t r = 0; r < n; ++r) {
    const char* row = reinterpret_cast<const char*>(p + r * stride);
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + o, 0, 3);
  }
}

// ---- conversions -------------------------------------------------------------------------

// dst[d] = mul * src[d] for d < n, dst[n .. pad) = 0.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n, int64_t pad, float mul) {
  int64_t d = 0;
  const vf vm = splat(mul);
  if constexpr (std::is_same_v<T, float>) {
    for (; d + W <= n; d += W) store(dst + d, load(src + d) * vm);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; d + W <= n; d += W) {
      const vh raw = *reinterpret_cast<const vh*>(src + d);
      const vu bits = __builtin_convertvector(raw, vu) << 16;
      store(dst + d, reinterpret_cast<vf>(bits) * vm);
    }
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    for (; d + W <= n; d += W) {
#if TE_FA_W == 16
      const vf x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d)));
#else
      const vf x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)));
#endif
      store(dst + d, x * vm);
    }
  }
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]) * mul;
  for (; d < pad; ++d) dst[d] = 0.f;
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n, float mul) {
  if constexpr (std::is_same_v<T, float>) {
    int64_t d = 0;
    const vf vm = splat(mul);
    for (; d + W <= n; d += W) store(dst + d, load(src + d) * vm);
    for (; d < n; ++d) dst[d] = src[d] * mul;
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<T>(src[d] * mul);
  }
}

// ---- register-blocked products -----------------------------------------------------------

// C[r][cv*W + :W] = sum_d A[r * lda + d] * BT[d * ldb + cv*W + :W] for r < R, cv < NV.
template <int R, int NV>
inline void nt_micro(const float* A, int64_t lda, const float* BT, int64_t ldb, int64_t D,
                     float* C, int64_t ldc) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = splat(0.f);
  for (int64_t d = 0; d < D; ++d) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(BT + d * ldb + v * W);
    for (int r = 0; r < R; ++r) {
      const vf a = splat(A[r * lda + d]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * W, acc[r][v]);
}

template <int R>
inline void nt_row_block(const float* A, int64_t lda, const float* BT, int64_t ldb, int64_t D,
                         float* C, int64_t ldc, int64_t ncols) {
  int64_t c = 0;
  for (; c + kCols * W <= ncols; c += kCols * W) nt_micro<R, kCols>(A, lda, BT + c, ldb, D, C + c, ldc);
  // The rest in one block as wide as it is (a narrow tile, e.g. 32 columns of a short sequence,
  // would otherwise run one vector per pass: a broadcast per FMA).
  const int64_t rest = (ncols - c) / W;
  if constexpr (kCols > 3) {
    if (rest == 3) return nt_micro<R, 3>(A, lda, BT + c, ldb, D, C + c, ldc);
  }
  if constexpr (kCols > 2) {
    if (rest == 2) return nt_micro<R, 2>(A, lda, BT + c, ldb, D, C + c, ldc);
  }
  if (rest == 1) nt_micro<R, 1>(A, lda, BT + c, ldb, D, C + c, ldc);
}

// C [M, ncols] = A [M, D] . BT [D, ncols]; ncols a multiple of W.
inline void nt_product(const float* A, int64_t lda, const float* BT, int64_t ldb, int64_t D,
                       float* C, int64_t ldc, int64_t M, int64_t ncols) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) nt_row_block<kRows>(A + r * lda, lda, BT, ldb, D, C + r * ldc, ldc, ncols);
  for (; r < M; ++r) nt_row_block<1>(A + r * lda, lda, BT, ldb, D, C + r * ldc, ldc, ncols);
}

// C[r][cv*W + :W] += sum_{k in [k0, k1)} A[r * ars + k * aks] * B[k * ldb + cv*W + :W].
template <int R, int NV>
inline void acc_micro(const float* A, int64_t ars, int64_t aks, int64_t k0, int64_t k1,
                      const float* B, int64_t ldb, float* C, int64_t ldc) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = load(C + r * ldc + v * W);
  for (int64_t k = k0; k < k1; ++k) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(B + k * ldb + v * W);
    for (int r = 0; r < R; ++r) {
      const vf a = splat(A[r * ars + k * aks]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * W, acc[r][v]);
}

constexpr int kAccCols = 4;  // vectors of the accumulated row per pass

template <int R>
inline void acc_row_block(const float* A, int64_t ars, int64_t aks, int64_t k0, int64_t k1,
                          const float* B, int64_t ldb, float* C, int64_t ldc, int64_t Dp) {
  if (k1 <= k0) return;
  int64_t d = 0;
  for (; d + kAccCols * W <= Dp; d += kAccCols * W) acc_micro<R, kAccCols>(A, ars, aks, k0, k1, B + d, ldb, C + d, ldc);
  switch ((Dp - d) / W) {
    case 3: acc_micro<R, 3>(A, ars, aks, k0, k1, B + d, ldb, C + d, ldc); break;
    case 2: acc_micro<R, 2>(A, ars, aks, k0, k1, B + d, ldb, C + d, ldc); break;
    case 1: acc_micro<R, 1>(A, ars, aks, k0, k1, B + d, ldb, C + d, ldc); break;
    default: break;
  }
}

// C[r, :Dp] += sum_{k < n[r]} A(r, k) B[k, :Dp] for r < M, where A(r, k) = A[r * ars + k * aks]
// and n is non-decreasing or arbitrary; B rows at or past n[r] never enter row r.
inline void acc_rows_limited(const float* A, int64_t ars, int64_t aks, const int64_t* n, int64_t M,
                             const float* B, int64_t ldb, float* C, int64_t ldc, int64_t Dp) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) {
    int64_t lo = n[r], hi = n[r];
    for (int k = 1; k < kRows; ++k) {
      lo = std::min(lo, n[r + k]);
      hi = std::max(hi, n[r + k]);
    }
    acc_row_block<kRows>(A + r * ars, ars, aks, 0, lo, B, ldb, C + r * ldc, ldc, Dp);
    if (hi > lo) {
      for (int k = 0; k < kRows; ++k) {
        acc_row_block<1>(A + (r + k) * ars, ars, aks, lo, n[r + k], B, ldb, C + (r + k) * ldc, ldc, Dp);
      }
    }
  }
  for (; r < M; ++r) acc_row_block<1>(A + r * ars, ars, aks, 0, n[r], B, ldb, C + r * ldc, ldc, Dp);
}

// C[r, :Dp] += sum_{k < K} A(r, k) B[k, :Dp] for r < M (no per-row limits).
inline void acc_rows(const float* A, int64_t ars, int64_t aks, int64_t K, int64_t M,
                     const float* B, int64_t ldb, float* C, int64_t ldc, int64_t Dp) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) acc_row_block<kRows>(A + r * ars, ars, aks, 0, K, B, ldb, C + r * ldc, ldc, Dp);
  for (; r < M; ++r) acc_row_block<1>(A + r * ars, ars, aks, 0, K, B, ldb, C + r * ldc, ldc, Dp);
}

// p[c] = 2^((s[c] - shift) * log2(e)) = e^(s[c] - shift) for c < n, 0 for c in [n, npad) (npad a
// multiple of W); returns the sum. The difference is taken first, in natural units, so that the
// largest terms (s close to shift) carry the rounding of a small number.
inline float exp2_row(const float* s, float* p, int64_t n, int64_t npad, float shift) {
  const vf vs = splat(shift), vl = splat(kLog2e);
  vf sum = splat(0.f);
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    const vf e = exp2v((load(s + c) - vs) * vl);
    store(p + c, e);
    sum += e;
  }
  if (c < n) {
    const vi keep = iota() < static_cast<int32_t>(n - c);
    const vf e = keep ? exp2v((load(s + c) - vs) * vl) : splat(0.f);
    store(p + c, e);
    sum += e;
    c += W;
  }
  for (; c < npad; c += W) store(p + c, splat(0.f));
  return hsum(sum);
}

inline float max_row(const float* s, int64_t n) {
  vf m = splat(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + W <= n; c += W) m = vmax(m, load(s + c));
  float r = hmax(m);
  for (; c < n; ++c) r = s[c] > r ? s[c] : r;
  return r;
}

inline void scale_row(float* x, int64_t n, float f) {
  const vf vf_ = splat(f);
  for (int64_t d = 0; d < n; d += W) store(x + d, load(x + d) * vf_);
}

// x[c] += y[c] for c < n (any n; unaligned).
inline void add_row(float* x, const float* y, int64_t n) {
  int64_t c = 0;
  for (; c + W <= n; c += W) store(x + c, load(x + c) + load(y + c));
  for (; c < n; ++c) x[c] += y[c];
}

// ---- forward -----------------------------------------------------------------------------

// One block of query rows [i0, i1) of one (b, h) pair; rows at or past query_lengths[b] are
// written by the caller. `ws` holds forward_workspace_floats(D) floats.
//
// The scores are kept transposed, keys x query rows (S^T = K Q^T with Q transposed once per
// block): the softmax statistics of W query rows then live in one vector and the max, exp and
// sum over the keys of a tile are plain vertical operations, with no horizontal reductions and
// no per-tile transpose of K.
template <typename T>
void forward_block(const FwdArgs<T>& a, int64_t b, int64_t h, int64_t i0, int64_t i1, float* ws) {
  const int64_t D = a.D, Dp = round_up(D, W), BN = kBlockN, BM = kBlockM;
  const int64_t M = i1 - i0, Mp = round_up(M, W);
  float* QT = ws;                 // [D, BM]   q * scale * log2(e), transposed
  float* Kf = QT + D * BM;        // [BN, D]
  float* Vf = Kf + BN * D;        // [BN, Dp]
  float* ST = Vf + BN * Dp;       // [BN, BM]  scores, then probabilities (keys x rows)
  float* O = ST + BN * BM;        // [BM, Dp]
  float* m = O + BM * Dp;         // [BM] running max (log2 units)
  float* l = m + BM;              // [BM] running sum
  float* alpha = l + BM;          // [BM] rescale factor of the current tile
  float* qrow = alpha + BM;       // [Dp]
  int32_t lim[kBlockM];           // keys row i may see: [0, lim)
  int64_t n[kBlockM];             // of them in the current tile
  uint32_t r1[kBlockM], r2[kBlockM];  // dropout row keys

  const int64_t klen = a.klen[b];
  const T* qb = a.q + b * a.qs0 + h * a.qs1;
  const T* kb = a.k + b * a.ks0 + h * a.ks1;
  const T* vb = a.v + b * a.vs0 + h * a.vs1;
  const float qmul = a.scale;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const vf vlog2e = splat(kLog2e);
  int64_t kend = 0;
  for (int64_t r = 0; r < Mp; ++r) {
    m[r] = neg_inf;
    l[r] = 0.f;
    r1[r] = r2[r] = 0;
    if (r >= M) {  // padding lanes of the last vector: no key, zero q
      lim[r] = 0;
      for (int64_t d = 0; d < D; ++d) QT[d * BM + r] = 0.f;
      continue;
    }
    lim[r] = static_cast<int32_t>(row_key_limit(i0 + r, klen, a.Q, a.K, a.causal));
    kend = std::max<int64_t>(kend, lim[r]);
    load_row(qb + (i0 + r) * a.qs2, qrow, D, D, qmul);
    for (int64_t d = 0; d < D; ++d) QT[d * BM + r] = qrow[d];
    std::fill(O + r * Dp, O + (r + 1) * Dp, 0.f);
    if (a.dropout) dropout_row_keys(a.bh_key1[b * a.H + h], a.bh_key2[b * a.H + h], i0 + r, &r1[r], &r2[r]);
  }
  // float32 K and V tiles are read in place (rows of keys, any row stride); other dtypes, and
  // V rows that are not whole vectors, are converted into Kf / Vf first.
  constexpr bool kF32 = std::is_same_v<T, float>;
  const bool v_direct = kF32 && D == Dp;
  for (int64_t j0 = 0; j0 < kend; j0 += BN) {
    const int64_t jn = std::min(BN, kend - j0);
    // Rows that see no key of this tile are the first ones of the block (causal): skip them.
    int64_t rfirst = 0;
    while (rfirst < M && lim[rfirst] <= j0) ++rfirst;
    if (rfirst >= M) continue;
    const float* Kt = Kf;
    const float* Vt = Vf;
    int64_t ldk = D, ldv = Dp;
    if constexpr (kF32) {
      Kt = reinterpret_cast<const float*>(kb) + j0 * a.ks2;
      ldk = a.ks2;
    }
    if (v_direct) {
      Vt = reinterpret_cast<const float*>(vb) + j0 * a.vs2;
      ldv = a.vs2;
    }
    for (int64_t c = 0; c < jn; ++c) {  // nothing past kend (<= key_lengths[b]) is read
      if constexpr (!kF32) load_row(kb + (j0 + c) * a.ks2, Kf + c * D, D, D, 1.f);
      if (!v_direct) load_row(vb + (j0 + c) * a.vs2, Vf + c * Dp, D, Dp, 1.f);
    }
    const int64_t v0 = rfirst / W * W;
    nt_product(Kt, ldk, QT + v0, BM, D, ST + v0, BM, jn, Mp - v0);
    if (a.bias != nullptr) {  // S^T += log2(e) * bias^T, W query rows per vector
      const float* bt = a.bias + b * a.bs0 + h * a.bs1 + j0 * a.bld + i0;
      for (int64_t c = 0; c < jn; ++c) {
        for (int64_t rv = v0; rv < Mp; rv += W) {
          store(ST + c * BM + rv, load(ST + c * BM + rv) + load(bt + c * a.bld + rv));
        }
      }
    }
    // kMasked: some lane of the vector has keys of this tile outside its limit (causal diagonal,
    // key lengths, padding lanes); without, the compare-and-select per score is left out.
    auto softmax_tile = [&](auto masked_tag, auto dropout_tag, int64_t rv) {
      constexpr bool kMasked = decltype(masked_tag)::value;
      constexpr bool kDropout = decltype(dropout_tag)::value;
      const vi vlim = *reinterpret_cast<const viu*>(lim + rv);
      vf tmax = splat(neg_inf);
      for (int64_t c = 0; c < jn; ++c) {
        const vf x = load(ST + c * BM + rv);
        if constexpr (kMasked) {
          tmax = vmax(tmax, vlim > static_cast<int32_t>(j0 + c) ? x : splat(neg_inf));
        } else {
          tmax = vmax(tmax, x);
        }
      }
      const vf mold = load(m + rv);
      const vf mnew = vmax(mold, tmax);
      const vf al = mold == mnew ? splat(1.f) : exp2v((mold - mnew) * vlog2e);
      // A row whose scores so far are all -inf (a -inf bias) shifts by 0: exact zeros, not NaN.
      const vf shift = mnew == neg_inf ? splat(0.f) : mnew;
      vf sum = splat(0.f);
      [[maybe_unused]] const vu k1 = *reinterpret_cast<const vuu*>(r1 + rv);
      [[maybe_unused]] const vu k2 = *reinterpret_cast<const vuu*>(r2 + rv);
      for (int64_t c = 0; c < jn; ++c) {
        const int32_t j = static_cast<int32_t>(j0 + c);
        vf e = exp2v((load(ST + c * BM + rv) - shift) * vlog2e);
        if constexpr (kMasked) e = vlim > j ? e : splat(0.f);
        sum += e;
        if constexpr (kDropout) {
          const vu u = mix32v(mix32v(splat_u(static_cast<uint32_t>(j)) + k1) ^ k2);
          e = u >= a.threshold ? e : splat(0.f);
        }
        store(ST + c * BM + rv, e);
      }
      store(l + rv, load(l + rv) * al + sum);
      store(m + rv, mnew);
      store(alpha + rv, al);
    };
    for (int64_t rv = v0; rv < Mp; rv += W) {
      bool masked = false;
      for (int k = 0; k < W; ++k) masked |= lim[rv + k] < j0 + jn;
      if (masked) {
        if (a.dropout) softmax_tile(std::true_type{}, std::true_type{}, rv);
        else softmax_tile(std::true_type{}, std::false_type{}, rv);
      } else {
        if (a.dropout) softmax_tile(std::false_type{}, std::true_type{}, rv);
        else softmax_tile(std::false_type{}, std::false_type{}, rv);
      }
    }
    for (int64_t r = rfirst; r < M; ++r) {
      n[r] = std::clamp<int64_t>(lim[r] - j0, 0, jn);
      if (alpha[r] != 1.f) scale_row(O + r * Dp, Dp, alpha[r]);
    }
    acc_rows_limited(ST + rfirst, 1, BM, n + rfirst, M - rfirst, Vt, ldv, O + rfirst * Dp, Dp, Dp);
  }
  T* ob = a.out + b * a.os0 + h * a.os1;
  float* lse = a.lse + (b * a.H + h) * a.Q;
  for (int64_t r = 0; r < M; ++r) {
    T* orow = ob + (i0 + r) * a.os2;
    if (!(l[r] != 0.f)) {  // l == 0: no allowed key (l is NaN when a score was NaN)
      std::fill(orow, orow + D, T(0));
      lse[i0 + r] = neg_inf;
      continue;
    }
    store_row(O + r * Dp, orow, D, a.keep_scale / l[r]);
    lse[i0 + r] = m[r] + std::log(l[r]);
  }
}

// ---- backward ----------------------------------------------------------------------------

// dq, dk, dv of one (b, h) pair. `ws` holds backward_workspace_floats(Q, D) floats, `lim` Q.
//
// With a bias: P is recomputed from the biased scores, and dS (the gradient of the bias) is
// added into a.dbias at slot `slot` (its batch row, or the worker's own accumulator).
template <typename T>
void backward_head(const BwdArgs<T>& a, int64_t b, int64_t h, float* ws, int64_t* lim,
                   int64_t slot) {
  const int64_t D = a.D, Dp = round_up(D, W), BN = kBlockN, BM = kBlockM;
  const int64_t Q = a.Q;
  const int64_t klen = a.klen[b], qlen = a.qlen[b];
  float* Qf = ws;                 // [Q, Dp] q * scale * log2(e)
  float* dOf = Qf + Q * Dp;       // [Q, Dp]
  float* dQ = dOf + Q * Dp;       // [Q, Dp]
  float* KT = dQ + Q * Dp;        // [D, BN]
  float* VT = KT + D * BN;        // [D, BN]
  float* Kf = VT + D * BN;        // [BN, Dp]
  float* dK = Kf + BN * Dp;       // [BN, Dp]
  float* dV = dK + BN * Dp;       // [BN, Dp]
  float* P = dV + BN * Dp;        // [BM, BN] probabilities, then dropped probabilities
  float* dP = P + BM * BN;        // [BM, BN] dP, then dS
  float* lse2 = dP + BM * BN;     // [Q]
  float* delta = lse2 + Q;        // [Q]
  float* orow = delta + Q;        // [Dp]
  int64_t n[kBlockM];
  uint32_t r1[kBlockM], r2[kBlockM];

  const T* qb = a.q + b * a.qs0 + h * a.qs1;
  const T* kb = a.k + b * a.ks0 + h * a.ks1;
  const T* vb = a.v + b * a.vs0 + h * a.vs1;
  const T* ob = a.out + b * a.os0 + h * a.os1;
  const T* gb = a.dout + b * a.gs0 + h * a.gs1;
  const float* lseb = a.lse + (b * a.H + h) * Q;
  const float qmul = a.scale;

  // Rows that attend to at least one key: [0, qend) minus the rows with lim == 0 (causal, first).
  int64_t kend = 0, qstart = 0;
  for (int64_t i = 0; i < qlen; ++i) {
    lim[i] = row_key_limit(i, klen, a.Q, a.K, a.causal);
    kend = std::max(kend, lim[i]);
    if (lim[i] == 0) qstart = i + 1;  // lim is non-decreasing in i
  }
  {
    const int64_t rb = D * static_cast<int64_t>(sizeof(T)), nq = qlen - qstart;
    prefetch_rows(qb + qstart * a.qs2, nq, a.qs2, rb);
    prefetch_rows(gb + qstart * a.gs2, nq, a.gs2, rb);
    prefetch_rows(ob + qstart * a.os2, nq, a.os2, rb);
    prefetch_rows(kb, kend, a.ks2, rb);
    prefetch_rows(vb, kend, a.vs2, rb);
  }
  for (int64_t i = qstart; i < qlen; ++i) {
    load_row(qb + i * a.qs2, Qf + i * Dp, D, Dp, qmul);
    load_row(gb + i * a.gs2, dOf + i * Dp, D, Dp, 1.f);
    load_row(ob + i * a.os2, orow, D, Dp, 1.f);
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += dOf[i * Dp + d] * orow[d];
    delta[i] = dot;
    // A row without weight (lse = -inf: every allowed score -inf) recomputes P = e^(s - inf) = 0.
    lse2[i] = lseb[i] == -std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::infinity()
                                                                 : lseb[i];
    std::fill(dQ + i * Dp, dQ + (i + 1) * Dp, 0.f);
  }
  const float rp = a.keep_scale;
  T* dkb = a.dk + b * a.dks0 + h * a.dks1;
  T* dvb = a.dv + b * a.dvs0 + h * a.dvs1;
  for (int64_t j0 = 0; j0 < kend; j0 += BN) {
    const int64_t jn = std::min(BN, kend - j0), jnp = round_up(jn, W);
    for (int64_t c = 0; c < jn; ++c) {
      const T* kr = kb + (j0 + c) * a.ks2;
      const T* vr = vb + (j0 + c) * a.vs2;
      load_row(kr, Kf + c * Dp, D, Dp, 1.f);
      for (int64_t d = 0; d < D; ++d) {
        KT[d * BN + c] = Kf[c * Dp + d];
        VT[d * BN + c] = static_cast<float>(vr[d]);
      }
    }
    for (int64_t d = 0; d < D; ++d) {
      std::fill(KT + d * BN + jn, KT + d * BN + jnp, 0.f);
      std::fill(VT + d * BN + jn, VT + d * BN + jnp, 0.f);
    }
    std::fill(dK, dK + jn * Dp, 0.f);
    std::fill(dV, dV + jn * Dp, 0.f);
    // The first row that sees key j0.
    int64_t ifirst = qstart;
    while (ifirst < qlen && lim[ifirst] <= j0) ++ifirst;
    for (int64_t i0 = ifirst; i0 < qlen; i0 += BM) {
      const int64_t M = std::min(BM, qlen - i0);
      nt_product(Qf + i0 * Dp, Dp, KT, BN, D, P, BN, M, jnp);
      nt_product(dOf + i0 * Dp, Dp, VT, BN, D, dP, BN, M, jnp);
      for (int64_t r = 0; r < M; ++r) {
        const int64_t i = i0 + r;
        n[r] = std::clamp<int64_t>(lim[i] - j0, 0, jn);
        float* p = P + r * BN;
        float* dp = dP + r * BN;
        if (a.bias != nullptr) add_row(p, a.bias + b * a.bs0 + h * a.bs1 + i * a.bs2 + j0, n[r]);
        exp2_row(p, p, n[r], jnp, lse2[i]);
        const vf vdelta = splat(delta[i]);
        if (a.dropout) {
          dropout_row_keys(a.bh_key1[b * a.H + h], a.bh_key2[b * a.H + h], i, &r1[r], &r2[r]);
          // dS = P (M dP' / (1-p) - delta); dP then holds dS, P the dropped probabilities.
          const vu lane = reinterpret_cast<vu>(iota());
          const vf vrp = splat(rp);
          for (int64_t c = 0; c < jnp; c += W) {
            const vu j = lane + static_cast<uint32_t>(j0 + c);
            const vi keep = reinterpret_cast<vi>(mix32v(mix32v(j + r1[r]) ^ r2[r]) >= a.threshold);
            const vf pv = load(p + c);
            const vf dpk = keep ? load(dp + c) * vrp : splat(0.f);
            vf ds = pv * (dpk - vdelta);
            ds = pv == 0.f ? splat(0.f) : ds;
            store(dp + c, ds);
            store(p + c, keep ? pv * vrp : splat(0.f));
          }
        } else {
          for (int64_t c = 0; c < jnp; c += W) {
            const vf pv = load(p + c);
            const vf ds = pv * (load(dp + c) - vdelta);
            store(dp + c, pv == 0.f ? splat(0.f) : ds);
          }
        }
        // masked keys: exactly zero (P is 0 there; dP may hold anything)
        for (int64_t c = n[r]; c < jnp; ++c) dp[c] = 0.f;
        if (a.dbias != nullptr) {
          add_row(a.dbias + ((slot * a.H + h) * a.Q + i) * a.K + j0, dp, n[r]);
        }
      }
      // dV[c] += sum_r Pd[r, c] dO[r];  dK[c] += sum_r dS[r, c] Qf[r];  dQ[r] += sum_c dS[r, c] K[c]
      acc_rows(P, 1, BN, M, jn, dOf + i0 * Dp, Dp, dV, Dp, Dp);
      acc_rows(dP, 1, BN, M, jn, Qf + i0 * Dp, Dp, dK, Dp, Dp);
      acc_rows_limited(dP, BN, 1, n, M, Kf, Dp, dQ + i0 * Dp, Dp, Dp);
    }
    for (int64_t c = 0; c < jn; ++c) {
      store_row(dK + c * Dp, dkb + (j0 + c) * a.dks2, D, 1.f);
      store_row(dV + c * Dp, dvb + (j0 + c) * a.dvs2, D, 1.f);
    }
  }
  for (int64_t j = kend; j < a.K; ++j) {  // keys no query sees (and keys past the length)
    std::fill(dkb + j * a.dks2, dkb + j * a.dks2 + D, T(0));
    std::fill(dvb + j * a.dvs2, dvb + j * a.dvs2 + D, T(0));
  }
  T* dqb = a.dq + b * a.dqs0 + h * a.dqs1;
  for (int64_t i = 0; i < Q; ++i) {
    T* row = dqb + i * a.dqs2;
    if (i < qstart || i >= qlen) {
      std::fill(row, row + D, T(0));
    } else {
      store_row(dQ + i * Dp, row, D, a.scale);
    }
  }
}

// ---- bfloat16 with the products on oneDNN's brgemm (AMX) ---------------------------------
//
// For bfloat16 on CPUs where ATen's brgemm ukernel runs (at::native::cpublas::could_pack, AMX
// BF16): the same semantics as forward_block / backward_head, with every matrix product a
// bfloat16 x bfloat16 -> float32 brgemm call and the softmax, the masks, dropout and every
// accumulator in float32. The probabilities (forward) and P, dS (backward) are rounded to
// bfloat16 for the products that take them, as in every bfloat16 flash-attention kernel.
// A block's scores are materialised whole ([rows, keys] float32), so the softmax is not online.
// brgemm's B operand is "VNNI" packed: element (k, n) of a [K, N] matrix at (k / 2) * 2N +
// 2n + k % 2, K rounded up to even with a zero row. Keys at or past key_lengths[b] and rows at
// or past query_lengths[b] are never read; a masked key enters a row's products with an exact 0
// probability (so a NaN in the value of a key that a row may not see reaches it, unlike the
// float32 kernels; past the lengths nothing is read at all).

typedef uint16_t bf16_t;

inline int64_t even(int64_t x) { return (x + 1) / 2 * 2; }

inline vh to_bf16(vf x) {  // round to nearest even, NaN kept
  const vu bits = reinterpret_cast<vu>(x);
  vu r = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  r = x != x ? splat_u(0x7fc0u) : r;
  return __builtin_convertvector(r, vh);
}

// dst[c] = bfloat16(mul * src[c]) for c < n (round to nearest even, NaN kept), zeros [n, npad).
inline void store_bf16_row(const float* src, bf16_t* dst, int64_t n, int64_t npad, float mul) {
  const vf vm = splat(mul);
  int64_t c = 0;
  for (; c + W <= n; c += W) *reinterpret_cast<vh*>(dst + c) = to_bf16(load(src + c) * vm);
  for (; c < n; ++c) dst[c] = c10::BFloat16(src[c] * mul).x;
  for (; c < npad; ++c) dst[c] = 0;
}

// out = VNNI packing of X [R, N] (row r at X + r * ldx), R rounded up to Rp (even) with zeros.
inline void pack_rows(const bf16_t* X, int64_t ldx, int64_t R, int64_t Rp, int64_t N, bf16_t* out) {
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  for (int64_t k = 0; k < Rp; k += 2) {
    uint32_t* ok = o + k / 2 * N;
    const bf16_t* x0 = X + k * ldx;
    if (k + 1 < R) {
      const bf16_t* x1 = x0 + ldx;
      for (int64_t n = 0; n < N; ++n) ok[n] = x0[n] | (static_cast<uint32_t>(x1[n]) << 16);
    } else if (k < R) {
      for (int64_t n = 0; n < N; ++n) ok[n] = x0[n];
    } else {
      std::fill(ok, ok + N, 0u);
    }
  }
}

// out = VNNI packing of X^T [C, Np], X [N, C] (row n at X + n * ldx), columns [N, Np) zero.
inline void pack_transposed(const bf16_t* X, int64_t ldx, int64_t N, int64_t Np, int64_t C,
                            bf16_t* out) {
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  const int64_t C2 = C / 2;
  for (int64_t n = 0; n < N; ++n) {
    const bf16_t* x = X + n * ldx;
    for (int64_t k = 0; k < C2; ++k) o[k * Np + n] = x[2 * k] | (static_cast<uint32_t>(x[2 * k + 1]) << 16);
    if (C2 * 2 < C) o[C2 * Np + n] = x[C - 1];
  }
  for (int64_t k = 0; k < (C + 1) / 2; ++k) std::fill(o + k * Np + N, o + k * Np + Np, 0u);
}

// dst[:n] = src[:n], dst[n:npad) = 0 (bfloat16 rows; an inline copy, rows are short).
inline void copy_bf16_row(const bf16_t* src, bf16_t* dst, int64_t n, int64_t npad) {
  int64_t c = 0;
  for (; c + W <= n; c += W) *reinterpret_cast<vh*>(dst + c) = *reinterpret_cast<const vh*>(src + c);
  for (; c < n; ++c) dst[c] = src[c];
  for (; c < npad; ++c) dst[c] = 0;
}

// brgemm C [M, N] (ldc) = (add ? C : 0) + A [M, K] (lda) . B (VNNI packed [K, N]); K even.
inline void mm_bf16(int64_t M, int64_t N, int64_t K, const bf16_t* A, int64_t lda, const bf16_t* B,
                    float* C, int64_t ldc, bool add) {
  at::native::cpublas::brgemm(M, N, K, lda, N, ldc, add, reinterpret_cast<const at::BFloat16*>(A),
                              reinterpret_cast<const at::BFloat16*>(B), C, true);
}

// A 64-byte aligned carve-out of `n` elements of type U from a float workspace.
template <typename U>
inline U* carve(float*& p, int64_t n) {
  U* r = reinterpret_cast<U*>(p);
  p += round_up((n * static_cast<int64_t>(sizeof(U)) + 3) / 4, 16);
  return r;
}

// Keys are padded to multiples of kKeyPad (zero keys, masked) and query blocks to kBlockM rows
// (zero rows, no key), so brgemm sees few distinct shapes (each is compiled once, then cached).
constexpr int64_t kKeyPad = 32;

inline int64_t mm_forward_workspace_floats(int64_t K, int64_t D) {
  const int64_t Dp = even(D), Np = round_up(K, kKeyPad), BM = kBlockM;
  return (BM * Dp + Dp * Np + Np * D + BM * Np) / 2 + BM * Np + BM * D + 8 * 16;
}

// forward_block for bfloat16 with brgemm products (one block of query rows [i0, i1)).
inline void forward_block_mm(const FwdArgs<c10::BFloat16>& a, int64_t b, int64_t h, int64_t i0,
                             int64_t i1, float* ws) {
  const int64_t D = a.D, Dp = even(D), BM = kBlockM, M = i1 - i0;
  const int64_t klen = a.klen[b];
  int64_t lim[kBlockM];
  int64_t kend = 0;
  for (int64_t r = 0; r < M; ++r) {
    lim[r] = row_key_limit(i0 + r, klen, a.Q, a.K, a.causal);
    kend = std::max(kend, lim[r]);
  }
  bf16_t* ob = reinterpret_cast<bf16_t*>(a.out + b * a.os0 + h * a.os1);
  float* lse = a.lse + (b * a.H + h) * a.Q;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (kend == 0) {
    for (int64_t r = 0; r < M; ++r) {
      std::fill(ob + (i0 + r) * a.os2, ob + (i0 + r) * a.os2 + D, bf16_t(0));
      lse[i0 + r] = neg_inf;
    }
    return;
  }
  const int64_t Np = round_up(kend, kKeyPad);
  float* w = ws;
  bf16_t* Qb = carve<bf16_t>(w, BM * Dp);    // [BM, Dp] q rows, zero rows past M
  bf16_t* KT = carve<bf16_t>(w, Dp * Np);    // K^T [Dp, Np], packed
  bf16_t* Vv = carve<bf16_t>(w, Np * D);     // V [Np, D], packed
  bf16_t* Pb = carve<bf16_t>(w, BM * Np);    // [BM, Np] unnormalised probabilities
  float* S = carve<float>(w, BM * Np);       // [BM, Np] scores
  float* O = carve<float>(w, BM * D);        // [BM, D]
  const bf16_t* qb = reinterpret_cast<const bf16_t*>(a.q + b * a.qs0 + h * a.qs1);
  const bf16_t* kb = reinterpret_cast<const bf16_t*>(a.k + b * a.ks0 + h * a.ks1);
  const bf16_t* vb = reinterpret_cast<const bf16_t*>(a.v + b * a.vs0 + h * a.vs1);
  for (int64_t r = 0; r < M; ++r) {
    copy_bf16_row(qb + (i0 + r) * a.qs2, Qb + r * Dp, D, Dp);
  }
  std::fill(Qb + M * Dp, Qb + BM * Dp, bf16_t(0));
  pack_transposed(kb, a.ks2, kend, Np, D, KT);
  pack_rows(vb, a.vs2, kend, Np, D, Vv);
  mm_bf16(BM, Np, Dp, Qb, Dp, KT, S, Np, false);
  const float qmul = a.scale * kLog2e;
  const vf vq = splat(qmul);
  float l[kBlockM];
  for (int64_t r = 0; r < BM; ++r) {
    bf16_t* pr = Pb + r * Np;
    const int64_t n = r < M ? lim[r] : 0;
    if (n == 0) {
      std::fill(pr, pr + Np, bf16_t(0));
      l[r] = 0.f;
      continue;
    }
    const float* s = S + r * Np;
    const vi lane = iota();
    vf vmx = splat(neg_inf);
    for (int64_t c = 0; c < n; c += W) {
      const vf x = load(s + c) * vq;
      vmx = vmax(vmx, lane < static_cast<int32_t>(n - c) ? x : splat(neg_inf));
    }
    const float mx = hmax(vmx);
    const vf vm = splat(mx);
    uint32_t r1 = 0, r2 = 0;
    if (a.dropout) dropout_row_keys(a.bh_key1[b * a.H + h], a.bh_key2[b * a.H + h], i0 + r, &r1, &r2);
    vf sum = splat(0.f);
    for (int64_t c = 0; c < Np; c += W) {
      vf e = splat(0.f);
      if (c < n) {
        e = exp2v(fmadd(load(s + c), vq, -vm));
        e = lane < static_cast<int32_t>(n - c) ? e : splat(0.f);
        sum += e;
        if (a.dropout) {
          const vu j = reinterpret_cast<vu>(lane) + static_cast<uint32_t>(c);
          e = mix32v(mix32v(j + r1) ^ r2) >= a.threshold ? e : splat(0.f);
        }
      }
      *reinterpret_cast<vh*>(pr + c) = to_bf16(e);
    }
    l[r] = hsum(sum);
    // l >= 1 for finite scores (the max term is 1); NaN when a score was NaN (the row is NaN).
    lse[i0 + r] = (mx + std::log2(l[r])) * kLn2;
  }
  mm_bf16(BM, D, Np, Pb, Np, Vv, O, D, false);
  for (int64_t r = 0; r < M; ++r) {
    bf16_t* orow = ob + (i0 + r) * a.os2;
    if (lim[r] == 0) {
      std::fill(orow, orow + D, bf16_t(0));
      lse[i0 + r] = neg_inf;
    } else {
      store_bf16_row(O + r * D, orow, D, D, a.keep_scale / l[r]);
    }
  }
}

inline int64_t mm_backward_workspace_floats(int64_t K, int64_t D) {
  const int64_t Dp = even(D), Np = round_up(K, kKeyPad), BM = kBlockM;
  return (2 * Np * Dp + D * Np + 2 * Dp * BM + 2 * BM * D + 3 * Np * BM) / 2 + 2 * Np * BM +
         2 * Np * D + D * BM + D + 2 * BM + 32 * 16;
}

// backward_head for bfloat16 with brgemm products: dq, dk, dv of one (b, h) pair. Scores are
// computed transposed (keys x query rows, S^T = K Q^T) so that dS^T and Pd^T, the A operands of
// dK and dV, come out in row order, and dQ^T = K^T dS^T.
inline void backward_head_mm(const BwdArgs<c10::BFloat16>& a, int64_t b, int64_t h, float* ws,
                             int64_t* lim) {
  const int64_t D = a.D, Dp = even(D), BM = kBlockM, Q = a.Q;
  const int64_t klen = a.klen[b], qlen = a.qlen[b];
  int64_t kend = 0, qstart = 0;
  for (int64_t i = 0; i < qlen; ++i) {
    lim[i] = row_key_limit(i, klen, a.Q, a.K, a.causal);
    kend = std::max(kend, lim[i]);
    if (lim[i] == 0) qstart = i + 1;
  }
  bf16_t* dkb = reinterpret_cast<bf16_t*>(a.dk + b * a.dks0 + h * a.dks1);
  bf16_t* dvb = reinterpret_cast<bf16_t*>(a.dv + b * a.dvs0 + h * a.dvs1);
  bf16_t* dqb = reinterpret_cast<bf16_t*>(a.dq + b * a.dqs0 + h * a.dqs1);
  const bool none = kend == 0 || qstart >= qlen;
  for (int64_t j = none ? 0 : kend; j < a.K; ++j) {  // keys no query sees (and past the length)
    std::fill(dkb + j * a.dks2, dkb + j * a.dks2 + D, bf16_t(0));
    std::fill(dvb + j * a.dvs2, dvb + j * a.dvs2 + D, bf16_t(0));
  }
  for (int64_t i = 0; i < Q; ++i) {
    if (none || i < qstart || i >= qlen) std::fill(dqb + i * a.dqs2, dqb + i * a.dqs2 + D, bf16_t(0));
  }
  if (none) return;
  const int64_t Np = round_up(kend, kKeyPad);
  float* w = ws;
  bf16_t* Kb = carve<bf16_t>(w, Np * Dp);    // K [Np, Dp]
  bf16_t* Vb = carve<bf16_t>(w, Np * Dp);    // V [Np, Dp]
  bf16_t* KTr = carve<bf16_t>(w, D * Np);    // K^T [D, Np] (A of dQ^T)
  bf16_t* QT = carve<bf16_t>(w, Dp * BM);    // the block's q^T [Dp, BM], packed
  bf16_t* GT = carve<bf16_t>(w, Dp * BM);    // the block's grad_out^T, packed
  bf16_t* Qv = carve<bf16_t>(w, BM * D);     // the block's q [BM, D], packed
  bf16_t* Gv = carve<bf16_t>(w, BM * D);     // the block's grad_out [BM, D], packed
  bf16_t* dST = carve<bf16_t>(w, Np * BM);   // dS^T [Np, BM]
  bf16_t* PdT = carve<bf16_t>(w, Np * BM);   // dropped P^T [Np, BM]
  bf16_t* dSv = carve<bf16_t>(w, Np * BM);   // dS^T packed (B of dQ^T)
  float* ST = carve<float>(w, Np * BM);      // S^T
  float* dPT = carve<float>(w, Np * BM);     // dP^T
  float* dK = carve<float>(w, Np * D);
  float* dV = carve<float>(w, Np * D);
  float* dQT = carve<float>(w, D * BM + D);
  float* delta = carve<float>(w, BM);
  float* lse2 = carve<float>(w, BM);
  alignas(64) int32_t limr[kBlockM];
  alignas(64) uint32_t r1[kBlockM], r2[kBlockM];

  const bf16_t* qb = reinterpret_cast<const bf16_t*>(a.q + b * a.qs0 + h * a.qs1);
  const bf16_t* kb = reinterpret_cast<const bf16_t*>(a.k + b * a.ks0 + h * a.ks1);
  const bf16_t* vb = reinterpret_cast<const bf16_t*>(a.v + b * a.vs0 + h * a.vs1);
  const c10::BFloat16* ob = a.out + b * a.os0 + h * a.os1;
  const bf16_t* gb = reinterpret_cast<const bf16_t*>(a.dout + b * a.gs0 + h * a.gs1);
  const float* lseb = a.lse + (b * a.H + h) * Q;
  const float qmul = a.scale * kLog2e;
  for (int64_t j = 0; j < Np; ++j) {
    bf16_t* kr = Kb + j * Dp;
    bf16_t* vr = Vb + j * Dp;
    if (j < kend) {
      copy_bf16_row(kb + j * a.ks2, kr, D, Dp);
      copy_bf16_row(vb + j * a.vs2, vr, D, Dp);
      for (int64_t d = 0; d < D; ++d) KTr[d * Np + j] = kr[d];
    } else {
      std::fill(kr, kr + Dp, bf16_t(0));
      std::fill(vr, vr + Dp, bf16_t(0));
      for (int64_t d = 0; d < D; ++d) KTr[d * Np + j] = 0;
    }
  }
  std::fill(dK, dK + Np * D, 0.f);
  std::fill(dV, dV + Np * D, 0.f);
  const vf vq = splat(qmul), vrp = splat(a.keep_scale);
  for (int64_t i0 = qstart; i0 < qlen; i0 += BM) {
    const int64_t M = std::min(BM, qlen - i0);
    const bf16_t* qr = qb + i0 * a.qs2;
    const bf16_t* gr = gb + i0 * a.gs2;
    pack_transposed(qr, a.qs2, M, BM, D, QT);
    pack_transposed(gr, a.gs2, M, BM, D, GT);
    pack_rows(qr, a.qs2, M, BM, D, Qv);
    pack_rows(gr, a.gs2, M, BM, D, Gv);
    int64_t kmax = 0;
    for (int64_t r = 0; r < BM; ++r) {
      if (r >= M) {
        limr[r] = 0;
        lse2[r] = delta[r] = 0.f;
        r1[r] = r2[r] = 0;
        continue;
      }
      const int64_t i = i0 + r;
      limr[r] = static_cast<int32_t>(lim[i]);
      kmax = std::max(kmax, lim[i]);
      float dot = 0.f;
      const c10::BFloat16* orow = ob + i * a.os2;
      for (int64_t d = 0; d < D; ++d) {
        dot += static_cast<float>(c10::BFloat16(gr[r * a.gs2 + d], c10::BFloat16::from_bits())) *
               static_cast<float>(orow[d]);
      }
      delta[r] = dot;
      lse2[r] = lseb[i] * kLog2e;
      r1[r] = r2[r] = 0;
      if (a.dropout) dropout_row_keys(a.bh_key1[b * a.H + h], a.bh_key2[b * a.H + h], i, &r1[r], &r2[r]);
    }
    const int64_t nk = round_up(kmax, kKeyPad);  // keys this block sees, padded (<= Np)
    mm_bf16(nk, BM, Dp, Kb, Dp, QT, ST, BM, false);
    mm_bf16(nk, BM, Dp, Vb, Dp, GT, dPT, BM, false);
    for (int64_t rv = 0; rv < BM; rv += W) {
      const vi vlim = *reinterpret_cast<const viu*>(limr + rv);
      const vf vl2 = load(lse2 + rv), vd = load(delta + rv);
      const vu k1 = *reinterpret_cast<const vuu*>(r1 + rv);
      const vu k2 = *reinterpret_cast<const vuu*>(r2 + rv);
      for (int64_t c = 0; c < nk; ++c) {
        const int64_t o = c * BM + rv;
        vf p = exp2v(fmadd(load(ST + o), vq, -vl2));
        p = vlim > static_cast<int32_t>(c) ? p : splat(0.f);
        const vf dp = load(dPT + o);
        vf pd = p, dpk = dp;
        if (a.dropout) {
          const vi keep = reinterpret_cast<vi>(
              mix32v(mix32v(splat_u(static_cast<uint32_t>(c)) + k1) ^ k2) >= a.threshold);
          dpk = keep ? dp * vrp : splat(0.f);
          pd = keep ? p * vrp : splat(0.f);
        }
        vf ds = p * (dpk - vd);
        ds = p == 0.f ? splat(0.f) : ds;  // masked keys: exactly zero
        *reinterpret_cast<vh*>(dST + o) = to_bf16(ds);
        *reinterpret_cast<vh*>(PdT + o) = to_bf16(pd);
      }
    }
    // dV += Pd^T dO;  dK += dS^T Q;  dQ^T = K^T dS^T
    mm_bf16(nk, D, BM, PdT, BM, Gv, dV, D, true);
    mm_bf16(nk, D, BM, dST, BM, Qv, dK, D, true);
    pack_rows(dST, BM, nk, nk, BM, dSv);
    mm_bf16(D, BM, nk, KTr, Np, dSv, dQT, BM, false);
    for (int64_t r = 0; r < M; ++r) {
      float* t = dQT + D * BM;  // one row of dQ (the workspace holds D more floats)
      for (int64_t d = 0; d < D; ++d) t[d] = dQT[d * BM + r];
      store_bf16_row(t, dqb + (i0 + r) * a.dqs2, D, D, a.scale);
    }
  }
  for (int64_t j = 0; j < kend; ++j) {
    store_bf16_row(dK + j * D, dkb + j * a.dks2, D, D, a.scale);
    store_bf16_row(dV + j * D, dvb + j * a.dvs2, D, D, 1.f);
  }
}

}  // namespace TE_FA_NS
