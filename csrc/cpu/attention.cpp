// CPU kernels of transformer_ext::attention, its backward and the dropout-mask debug op
// (docs/DESIGN.md section 2; the oracle is transformer_ext/reference.py).
//
// The tile kernels live in attention_kernels.h and are compiled twice here, for
// AVX-512 (F, BW, VL, DQ) and for AVX2 + FMA + F16C, in target regions of their own (every
// header they use is included before the regions, so no inline function shared with other
// translation units is compiled for a wider ISA). The host functions pick one at run time;
// bfloat16 on CPUs where ATen's brgemm ukernel runs (AMX BF16: at::native::cpublas::could_pack)
// takes the kernels whose products are brgemm calls (forward_block_mm, backward_head_mm, float32
// softmax and accumulators; TRANSFORMER_EXT_CPU_AMX=0 turns them off, for tests and comparison);
// float64 (accepted so that gradcheck can run on the op), CPUs without AVX2 and
// TRANSFORMER_EXT_CPU_FALLBACK=1 run an ATen composite with the same semantics, the same
// dropout generator included; TRANSFORMER_EXT_CPU_ISA=avx2 runs the AVX2 kernels on an AVX-512
// CPU (for tests). Both switches are read once per process.
//
// attention_with_bias (an additive position bias, T5's relative bias) runs the same tile kernels
// with the bias added to every score tile (bfloat16 included: the brgemm kernels take no bias);
// the forward kernel reads a float32 bias laid out keys x query rows in place (T5's relative
// bias as transformer_ext.model.RelativePositionBias lays it out), any other layout through a
// transposed float32 copy. The backward also returns d(bias): for a per-head bias shared by
// the batch, with at least as many heads as threads, one task per head runs all of its batch
// rows and writes that head's d(bias) itself (nothing left to reduce); otherwise d(bias) is
// accumulated per batch row, or per worker thread when the batch shares the bias, and summed
// to the bias's shape at the end.
//
// Work distribution: the forward pass splits into (b, h, block of 64 query rows) tasks, the
// backward pass into (b, h) tasks (each owns dq of its rows and dk, dv of its keys, so nothing
// is shared and nothing is reduced across threads). Tasks are ordered by their cost (the number
// of (query, key) pairs they visit, which varies with the lengths and the causal diagonal) and
// handed out through an atomic counter, so ragged batches balance across the threads. Results
// do not depend on the thread count: every task computes the same numbers wherever it runs.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define TE_FA_X86 1
#endif

#include "checks.h"
#include "ops.h"

namespace transformer_ext {
namespace {

constexpr int64_t kBlockM = 64;  // query rows per forward task / backward block
constexpr int64_t kBlockN = 64;  // keys per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Keys row i may see: [0, lim). Lengths mask, they do not move the causal diagonal.
inline int64_t row_key_limit(int64_t i, int64_t klen, int64_t Q, int64_t K, bool causal) {
  if (!causal) return klen;
  return std::clamp<int64_t>(i + (K - Q) + 1, 0, klen);
}

// ---- the dropout generator ----------------------------------------------------------------
// A keep decision for (seed, b, h, i, j), with 32-bit integer mixing only (so the same
// function runs in SIMD lanes, in CUDA threads and in the reference's int64 tensor ops):
//   per (b, h): two chains s = mix(s + x) over (seed_lo, seed_hi, b, h) from two constants;
//   per row i:  r1 = mix(s1 + i), r2 = mix(s2 + i);
//   per key j:  u = mix(mix(j + r1) ^ r2); kept iff u >= threshold = floor(p * 2^32).
// mix is a bijective xor-shift-multiply finalizer, so distinct (row, j) pairs collide only
// when both 32-bit row keys do.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

inline void dropout_bh_keys(int64_t seed, int64_t b, int64_t h, uint32_t* k1, uint32_t* k2) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t lo = static_cast<uint32_t>(s), hi = static_cast<uint32_t>(s >> 32);
  uint32_t a = 0x243f6a88u, c = 0x85a308d3u;
  for (uint32_t x : {lo, hi, static_cast<uint32_t>(b), static_cast<uint32_t>(h)}) {
    a = mix32(a + x);
    c = mix32(c + x);
  }
  *k1 = a;
  *k2 = c;
}

inline void dropout_row_keys(uint32_t k1, uint32_t k2, int64_t i, uint32_t* r1, uint32_t* r2) {
  *r1 = mix32(k1 + static_cast<uint32_t>(i));
  *r2 = mix32(k2 + static_cast<uint32_t>(i));
}

inline bool dropout_keep(uint32_t r1, uint32_t r2, int64_t j, uint32_t threshold) {
  return mix32(mix32(static_cast<uint32_t>(j) + r1) ^ r2) >= threshold;
}

inline uint32_t dropout_threshold(double p) {
  if (!(p > 0.0)) return 0;
  return static_cast<uint32_t>(std::min(std::floor(p * 4294967296.0), 4294967295.0));
}

// ---- kernel arguments ---------------------------------------------------------------------

template <typename T>
struct FwdArgs {
  const T *q, *k, *v;
  T* out;
  float* lse;                       // [B, H, Q] contiguous
  int64_t H, Q, K, D;
  int64_t qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2;
  const int64_t* klen;              // [B]
  float scale;
  bool causal;
  bool dropout;
  uint32_t threshold;
  float keep_scale;                 // 1 / (1 - p)
  const uint32_t *bh_key1, *bh_key2;  // [B * H] dropout chains
  // Position bias or nullptr: bias(b, h, i, j) at bias[b * bs0 + h * bs1 + j * bld + i]
  // (keys x query rows, rows padded to a multiple of 16; strides 0 where the bias broadcasts).
  const float* bias = nullptr;
  int64_t bs0 = 0, bs1 = 0, bld = 0;
};

template <typename T>
struct BwdArgs {
  const T *q, *k, *v, *out, *dout;
  T *dq, *dk, *dv;
  const float* lse;
  int64_t H, Q, K, D;
  int64_t qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2, gs0, gs1, gs2;
  int64_t dqs0, dqs1, dqs2, dks0, dks1, dks2, dvs0, dvs1, dvs2;
  const int64_t *klen, *qlen;       // [B]
  float scale;
  bool causal;
  bool dropout;
  uint32_t threshold;
  float keep_scale;
  const uint32_t *bh_key1, *bh_key2;
  // Position bias or nullptr: bias(b, h, i, j) at bias[b * bs0 + h * bs1 + i * bs2 + j].
  const float* bias = nullptr;
  int64_t bs0 = 0, bs1 = 0, bs2 = 0;
  // d(bias) accumulators or nullptr: [slots, H, Q, K] float32, zero-filled; a task adds dS of
  // its (b, h) into the slot it is given.
  float* dbias = nullptr;
};

inline int64_t forward_workspace_floats(int64_t D, int64_t W) {
  const int64_t Dp = round_up(D, W);
  return D * kBlockM + kBlockN * D + kBlockN * Dp + kBlockN * kBlockM + kBlockM * Dp +
         3 * kBlockM + Dp + 64;
}

inline int64_t backward_workspace_floats(int64_t Q, int64_t D, int64_t W) {
  const int64_t Dp = round_up(D, W);
  return 3 * Q * Dp + 2 * D * kBlockN + 3 * kBlockN * Dp + 2 * kBlockM * kBlockN + 2 * Q + Dp + 64;
}

}  // namespace
}  // namespace transformer_ext

// ============================ kernel sections, one per ISA ============================
#ifdef TE_FA_X86
#pragma GCC push_options
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace transformer_ext {
namespace {
#define TE_FA_NS fa_avx512
#define TE_FA_W 16
#include "attention_kernels.h"
#undef TE_FA_NS
#undef TE_FA_W
}  // namespace
}  // namespace transformer_ext
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace transformer_ext {
namespace {
#define TE_FA_NS fa_avx2
#define TE_FA_W 8
#include "attention_kernels.h"
#undef TE_FA_NS
#undef TE_FA_W
}  // namespace
}  // namespace transformer_ext
#pragma GCC pop_options
#pragma GCC diagnostic pop
#endif
// ===================================== end of kernels =====================================

namespace transformer_ext {
namespace {

enum class Isa { kNone, kAvx2, kAvx512 };

Isa detect_isa() {
  static const Isa isa = [] {
    const char* env = std::getenv("TRANSFORMER_EXT_CPU_FALLBACK");
    if (env != nullptr && std::strcmp(env, "1") == 0) return Isa::kNone;
#ifdef TE_FA_X86
    __builtin_cpu_init();
    const char* cap = std::getenv("TRANSFORMER_EXT_CPU_ISA");  // "avx2": no AVX-512 kernels
    const bool allow_avx512 = cap == nullptr || std::strcmp(cap, "avx2") != 0;
    if (allow_avx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      return Isa::kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      return Isa::kAvx2;
    }
#endif
    return Isa::kNone;
  }();
  return isa;
}

// bfloat16 products on brgemm (AMX): where ATen's ukernel runs, unless TRANSFORMER_EXT_CPU_AMX=0
// (read at every call).
bool use_brgemm_bf16() {
  const char* env = std::getenv("TRANSFORMER_EXT_CPU_AMX");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  static const bool ok = at::native::cpublas::could_pack(at::kBFloat16);
  return ok;
}

// Runs fn(task, thread_workspace, thread_ints, worker) for every task, most expensive first,
// handing tasks out through an atomic counter (dynamic balance); `ws_floats` floats of workspace
// per thread; `worker` in [0, task_workers(n)) is unique among the threads running at once.
template <typename F>
void run_tasks(const std::vector<int64_t>& cost, int64_t ws_floats, int64_t ws_ints, const F& fn) {
  const int64_t n = static_cast<int64_t>(cost.size());
  if (n == 0) return;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t worker, int64_t) {
    std::vector<float> ws(ws_floats);
    std::vector<int64_t> wi(ws_ints);
    for (;;) {
      const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= n) break;
      fn(order[t], ws.data(), wi.data(), worker);
    }
  });
}

// The number of workers run_tasks uses for n tasks (one accumulator slot each).
int64_t task_workers(int64_t n) { return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n)); }

// ---- argument checks ------------------------------------------------------------------------

void check_lengths_arg(const std::optional<at::Tensor>& len, const char* name, const at::Tensor& q,
                       int64_t B) {
  if (!len.has_value() || !len->defined()) return;
  const at::Tensor& t = *len;
  TORCH_CHECK(t.device() == q.device(), name, " must be on ", q.device(), " (the device of q), got ",
              t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == B, name, " must have shape [", B,
              "] (one length per batch row of q), got ", t.sizes());
}

void check_lengths_range(const at::Tensor& len_cpu, const char* name, int64_t limit,
                         const char* what) {
  const int64_t* p = len_cpu.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < len_cpu.numel(); ++b) {
    TORCH_CHECK(p[b] >= 0 && p[b] <= limit, name, "[", b, "] = ", p[b], " is out of range [0, ",
                limit, "] (", what, ")");
  }
}

}  // namespace

// Checks attention's arguments (shared with the CUDA host function through ops.h).
void check_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& key_lengths,
                          const std::optional<at::Tensor>& query_lengths, double scale,
                          double dropout_p, const std::optional<at::Tensor>& seed) {
  TORCH_CHECK(q.dim() == 4, "q must have 4 dimensions [B, H, Q, D], got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "k must have 4 dimensions [B, H, K, D], got shape ", k.sizes());
  TORCH_CHECK(v.dim() == 4, "v must have 4 dimensions [B, H, K, D], got shape ", v.sizes());
  CHECK_FLOATING(q);
  CHECK_DEVICE(k, q);
  CHECK_DEVICE(v, q);
  CHECK_SAME_DTYPE(k, q);
  CHECK_SAME_DTYPE(v, q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  TORCH_CHECK(D >= 1, "q must have a head dimension of at least 1, got shape ", q.sizes());
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D, "k must have shape [", B, ", ",
              H, ", K, ", D, "] to match q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "v must have the shape of k ", k.sizes(), ", got ",
              v.sizes());
  check_lengths_arg(key_lengths, "key_lengths", q, B);
  check_lengths_arg(query_lengths, "query_lengths", q, B);
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must be in [0, 1), got ", dropout_p);
  const bool has_seed = seed.has_value() && seed->defined();
  if (has_seed) {
    TORCH_CHECK(seed->device() == q.device(), "seed must be on ", q.device(),
                " (the device of q), got ", seed->device());
    TORCH_CHECK(seed->scalar_type() == at::kLong && seed->numel() == 1,
                "seed must be an int64 tensor with one element, got ", seed->scalar_type(),
                " of shape ", seed->sizes());
  }
  TORCH_CHECK(dropout_p == 0.0 || has_seed, "seed is required when dropout_p > 0 (got dropout_p = ",
              dropout_p, " and no seed)");
}

namespace {

// The last dimension dense (any other strides are fine).
at::Tensor dense_rows(const at::Tensor& t) {
  return t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous();
}

// [B, H, T, D] with the memory layout of [B, T, H, D]: what merge_heads views without a copy.
at::Tensor empty_bthd(int64_t B, int64_t H, int64_t T, int64_t D, const at::TensorOptions& opts) {
  return at::empty({B, T, H, D}, opts).transpose(1, 2);
}

at::Tensor lengths_or_full(const std::optional<at::Tensor>& len, int64_t B, int64_t full) {
  if (len.has_value() && len->defined()) return len->to(at::kCPU).contiguous();
  return at::full({B}, full, at::TensorOptions().dtype(at::kLong));
}

int64_t seed_value(const std::optional<at::Tensor>& seed) {
  if (!seed.has_value() || !seed->defined()) return 0;
  return seed->to(at::kCPU).reshape({-1}).const_data_ptr<int64_t>()[0];
}

void bh_keys(int64_t seed, int64_t B, int64_t H, std::vector<uint32_t>& k1,
             std::vector<uint32_t>& k2) {
  k1.resize(B * H);
  k2.resize(B * H);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) dropout_bh_keys(seed, b, h, &k1[b * H + h], &k2[b * H + h]);
}

// Bool [B, H, Q, K], true where the generator keeps (seed, b, h, i, j).
at::Tensor dropout_keep_mask(int64_t seed, int64_t B, int64_t H, int64_t Q, int64_t K, double p) {
  at::Tensor mask = at::empty({B, H, Q, K}, at::TensorOptions().dtype(at::kBool));
  bool* m = mask.data_ptr<bool>();
  const uint32_t thr = dropout_threshold(p);
  at::parallel_for(0, B * H * Q, 1024 / std::max<int64_t>(1, K) + 1, [&](int64_t r0, int64_t r1e) {
    for (int64_t r = r0; r < r1e; ++r) {
      const int64_t i = r % Q, bh = r / Q, h = bh % H, b = bh / H;
      uint32_t k1, k2, a1, a2;
      dropout_bh_keys(seed, b, h, &k1, &k2);
      dropout_row_keys(k1, k2, i, &a1, &a2);
      for (int64_t j = 0; j < K; ++j) m[r * K + j] = dropout_keep(a1, a2, j, thr);
    }
  });
  return mask;
}

// ---- ATen composites (float64, CPUs without AVX2) ---------------------------------------------

struct Probs {
  at::Tensor p;        // [B, H, Q, K] softmax over allowed keys, zeros elsewhere
  at::Tensor allowed;  // [B, H?, Q, K] bool
  at::Tensor lse;      // [B, H, Q]
};

// bias: undefined, or the position bias in the math dtype, broadcastable to [B, H, Q, K].
Probs composite_probs(const at::Tensor& qf, const at::Tensor& kf, const at::Tensor& klen,
                      const at::Tensor& qlen, double scale, bool causal, const at::Tensor& bias) {
  const int64_t Q = qf.size(2), K = kf.size(2);
  const auto lo = at::TensorOptions().dtype(at::kLong);
  const at::Tensor j = at::arange(K, lo).view({1, 1, 1, K});
  const at::Tensor i = at::arange(Q, lo).view({1, 1, Q, 1});
  at::Tensor allowed = (j < klen.view({-1, 1, 1, 1})).logical_and(i < qlen.view({-1, 1, 1, 1}));
  if (causal) allowed = allowed.logical_and(j <= i + (K - Q));
  at::Tensor x = at::matmul(qf, kf.transpose(-2, -1)).mul(scale);
  if (bias.defined()) x = x + bias;
  x = x.masked_fill(allowed.logical_not(), -INFINITY);
  // A row whose allowed scores are all -inf (no key, or a -inf bias) shifts by 0 and sums to 0:
  // zeros and lse = -inf, never NaN; a NaN score keeps its row NaN.
  at::Tensor mx = std::get<0>(x.max(-1, true));
  mx = mx.masked_fill(mx == -INFINITY, 0.0);
  const at::Tensor e = at::exp(x - mx).masked_fill(allowed.logical_not(), 0.0);
  const at::Tensor l = e.sum(-1, true);
  const at::Tensor zero = l == 0;
  const at::Tensor p = (e / l.masked_fill(zero, 1.0)).masked_fill(zero, 0.0);
  const at::Tensor lse = (mx + at::log(l)).masked_fill(zero, -INFINITY).squeeze(-1);
  return {p, allowed, lse};
}

std::tuple<at::Tensor, at::Tensor> attention_composite(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& klen,
    const at::Tensor& qlen, double scale, bool causal, double dropout_p, int64_t seed,
    const at::Tensor& bias) {
  const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), K = k.size(2), D = q.size(3);
  if (B * H * Q == 0 || K == 0) {  // no key or no query at all: zeros
    at::Tensor out = empty_bthd(B, H, Q, D, q.options());
    out.zero_();
    return {out, at::full({B, H, Q}, -INFINITY, q.options().dtype(at::kFloat))};
  }
  const at::Tensor qf = q.to(acc), kf = k.to(acc);
  // Values past the key lengths are never used: zeroed so that a NaN there cannot leak.
  const at::Tensor keys = at::arange(K, at::TensorOptions().dtype(at::kLong)).view({1, 1, K, 1});
  const at::Tensor vf = v.to(acc).masked_fill((keys >= klen.view({-1, 1, 1, 1})), 0.0);
  Probs pr = composite_probs(qf, kf, klen, qlen, scale, causal,
                             bias.defined() ? bias.to(acc) : at::Tensor());
  at::Tensor p = pr.p;
  if (dropout_p > 0.0) {
    p = p * dropout_keep_mask(seed, B, H, Q, K, dropout_p).to(acc) / (1.0 - dropout_p);
  }
  at::Tensor out = empty_bthd(B, H, Q, D, q.options());
  out.copy_(at::matmul(p, vf));
  return {out, pr.lse.to(at::kFloat).contiguous()};
}

// (dq, dk, dv, dS): dS [B, H, Q, K] in the math dtype, the gradient of the scores after the
// scale (that of a position bias), defined only when `want_ds`.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_composite(
    const at::Tensor& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& klen, const at::Tensor& qlen, double scale,
    bool causal, double dropout_p, int64_t seed, const at::Tensor& bias, bool want_ds) {
  const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), K = k.size(2), D = q.size(3);
  if (B * H * Q == 0 || K == 0) {
    at::Tensor dq = empty_bthd(B, H, Q, D, q.options()), dk = empty_bthd(B, H, K, D, q.options());
    at::Tensor dv = empty_bthd(B, H, K, D, q.options());
    dq.zero_();
    dk.zero_();
    dv.zero_();
    at::Tensor ds = want_ds ? at::zeros({B, H, Q, K}, q.options().dtype(acc)) : at::Tensor();
    return {dq, dk, dv, ds};
  }
  // Rows past the lengths are never used: zeroed so that a NaN there cannot leak through a
  // zero probability (0 * NaN) into the products below.
  const auto lo = at::TensorOptions().dtype(at::kLong);
  const at::Tensor past_k = at::arange(K, lo).view({1, 1, K, 1}) >= klen.view({-1, 1, 1, 1});
  const at::Tensor past_q = at::arange(Q, lo).view({1, 1, Q, 1}) >= qlen.view({-1, 1, 1, 1});
  const at::Tensor qf = q.to(acc).masked_fill(past_q, 0.0), gf = g.to(acc).masked_fill(past_q, 0.0);
  const at::Tensor kf = k.to(acc).masked_fill(past_k, 0.0), vf = v.to(acc).masked_fill(past_k, 0.0);
  Probs pr = composite_probs(qf, kf, klen, qlen, scale, causal,
                             bias.defined() ? bias.to(acc) : at::Tensor());
  at::Tensor keep_scaled;
  at::Tensor pd = pr.p;
  at::Tensor dp = at::matmul(gf, vf.transpose(-2, -1));
  if (dropout_p > 0.0) {
    keep_scaled = dropout_keep_mask(seed, B, H, Q, K, dropout_p).to(acc) / (1.0 - dropout_p);
    pd = pd * keep_scaled;
    dp = dp * keep_scaled;
  }
  const at::Tensor delta = (gf * out.to(acc).masked_fill(past_q, 0.0)).sum(-1, true);
  const at::Tensor ds = (pr.p * (dp - delta)).masked_fill(pr.allowed.logical_not(), 0.0);
  at::Tensor dq = empty_bthd(B, H, Q, D, q.options());
  at::Tensor dk = empty_bthd(B, H, K, D, q.options());
  at::Tensor dv = empty_bthd(B, H, K, D, q.options());
  dq.copy_(at::matmul(ds, kf) * scale);
  dk.copy_(at::matmul(ds.transpose(-2, -1), qf) * scale);
  dv.copy_(at::matmul(pd.transpose(-2, -1), gf));
  return {dq, dk, dv, want_ds ? ds : at::Tensor()};
}

// ---- kernel launches ----------------------------------------------------------------------

// Where the kernels find the position bias (FwdArgs / BwdArgs) and put its gradient.
struct BiasLayout {
  const float* p = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  float* grad = nullptr;         // [slots, H, Q, K] float32 (zero-filled unless grad_per_head)
  bool grad_per_worker = false;  // slot = the worker (a bias shared by the batch), else b
  // A bias [1, H, Q, K] shared by the batch, with at least as many heads as workers: one task
  // per head runs every batch row of it and owns d(bias) of that head (slot 0, [1, H, Q, K]),
  // zeroed by the task itself, so the kernel's sum is the gradient (no slots to reduce).
  bool grad_per_head = false;
};

template <typename T, typename Fwd>
void launch_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    at::Tensor& out, at::Tensor& lse, const at::Tensor& klen,
                    const at::Tensor& qlen, double scale, bool causal, double dropout_p,
                    int64_t seed, int64_t W, const Fwd& block_fn, int64_t ws_floats = -1,
                    const BiasLayout& bias = BiasLayout{}) {
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), K = k.size(2), D = q.size(3);
  FwdArgs<T> a;
  a.bias = bias.p;
  a.bs0 = bias.s0;
  a.bs1 = bias.s1;
  a.bld = bias.s2;
  a.q = q.const_data_ptr<T>();
  a.k = k.const_data_ptr<T>();
  a.v = v.const_data_ptr<T>();
  a.out = out.data_ptr<T>();
  a.lse = lse.data_ptr<float>();
  a.H = H;
  a.Q = Q;
  a.K = K;
  a.D = D;
  a.qs0 = q.stride(0); a.qs1 = q.stride(1); a.qs2 = q.stride(2);
  a.ks0 = k.stride(0); a.ks1 = k.stride(1); a.ks2 = k.stride(2);
  a.vs0 = v.stride(0); a.vs1 = v.stride(1); a.vs2 = v.stride(2);
  a.os0 = out.stride(0); a.os1 = out.stride(1); a.os2 = out.stride(2);
  a.klen = klen.const_data_ptr<int64_t>();
  a.scale = static_cast<float>(scale);
  a.causal = causal;
  a.dropout = dropout_p > 0.0;
  a.threshold = dropout_threshold(dropout_p);
  a.keep_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  std::vector<uint32_t> k1, k2;
  if (a.dropout) bh_keys(seed, B, H, k1, k2);
  a.bh_key1 = k1.data();
  a.bh_key2 = k2.data();
  const int64_t* ql = qlen.const_data_ptr<int64_t>();

  const int64_t blocks = (Q + kBlockM - 1) / kBlockM;
  std::vector<int64_t> cost(B * H * blocks);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t i0 = blk * kBlockM, i1 = std::min(std::min(Q, i0 + kBlockM), ql[b]);
      int64_t c = 1;
      for (int64_t i = i0; i < i1; ++i) c += row_key_limit(i, a.klen[b], Q, K, causal) + 1;
      for (int64_t h = 0; h < H; ++h) cost[(b * H + h) * blocks + blk] = c;
    }
  }
  if (ws_floats < 0) ws_floats = forward_workspace_floats(D, W);
  run_tasks(cost, ws_floats, 0, [&](int64_t t, float* ws, int64_t*, int64_t) {
    const int64_t blk = t % blocks, bh = t / blocks, h = bh % H, b = bh / H;
    const int64_t i0 = blk * kBlockM, iend = std::min(Q, i0 + kBlockM);
    const int64_t i1 = std::clamp<int64_t>(ql[b], i0, iend);  // rows [i1, iend) are padding
    if (i1 > i0) block_fn(a, b, h, i0, i1, ws);
    T* ob = a.out + b * a.os0 + h * a.os1;
    float* lrow = a.lse + (b * H + h) * Q;
    for (int64_t i = i1; i < iend; ++i) {
      std::fill(ob + i * a.os2, ob + i * a.os2 + D, T(0));
      lrow[i] = -std::numeric_limits<float>::infinity();
    }
  });
}

template <typename T, typename Bwd>
void launch_backward(const at::Tensor& g, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                     at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, const at::Tensor& klen,
                     const at::Tensor& qlen, double scale, bool causal, double dropout_p,
                     int64_t seed, int64_t W, const Bwd& head_fn, int64_t ws_floats = -1,
                     const BiasLayout& bias = BiasLayout{}) {
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), K = k.size(2), D = q.size(3);
  BwdArgs<T> a;
  a.bias = bias.p;
  a.bs0 = bias.s0;
  a.bs1 = bias.s1;
  a.bs2 = bias.s2;
  a.dbias = bias.grad;
  a.q = q.const_data_ptr<T>();
  a.k = k.const_data_ptr<T>();
  a.v = v.const_data_ptr<T>();
  a.out = out.const_data_ptr<T>();
  a.dout = g.const_data_ptr<T>();
  a.dq = dq.data_ptr<T>();
  a.dk = dk.data_ptr<T>();
  a.dv = dv.data_ptr<T>();
  a.lse = lse.const_data_ptr<float>();
  a.H = H;
  a.Q = Q;
  a.K = K;
  a.D = D;
  a.qs0 = q.stride(0); a.qs1 = q.stride(1); a.qs2 = q.stride(2);
  a.ks0 = k.stride(0); a.ks1 = k.stride(1); a.ks2 = k.stride(2);
  a.vs0 = v.stride(0); a.vs1 = v.stride(1); a.vs2 = v.stride(2);
  a.os0 = out.stride(0); a.os1 = out.stride(1); a.os2 = out.stride(2);
  a.gs0 = g.stride(0); a.gs1 = g.stride(1); a.gs2 = g.stride(2);
  a.dqs0 = dq.stride(0); a.dqs1 = dq.stride(1); a.dqs2 = dq.stride(2);
  a.dks0 = dk.stride(0); a.dks1 = dk.stride(1); a.dks2 = dk.stride(2);
  a.dvs0 = dv.stride(0); a.dvs1 = dv.stride(1); a.dvs2 = dv.stride(2);
  a.klen = klen.const_data_ptr<int64_t>();
  a.qlen = qlen.const_data_ptr<int64_t>();
  a.scale = static_cast<float>(scale);
  a.causal = causal;
  a.dropout = dropout_p > 0.0;
  a.threshold = dropout_threshold(dropout_p);
  a.keep_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  std::vector<uint32_t> k1, k2;
  if (a.dropout) bh_keys(seed, B, H, k1, k2);
  a.bh_key1 = k1.data();
  a.bh_key2 = k2.data();

  std::vector<int64_t> cost(B * H);
  for (int64_t b = 0; b < B; ++b) {
    int64_t c = 1;
    for (int64_t i = 0; i < a.qlen[b]; ++i) c += row_key_limit(i, a.klen[b], Q, K, causal) + 1;
    for (int64_t h = 0; h < H; ++h) cost[b * H + h] = c;
  }
  if (ws_floats < 0) ws_floats = backward_workspace_floats(Q, D, W);
  if (bias.grad_per_head) {
    std::vector<int64_t> head_cost(H, 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) head_cost[h] += cost[b * H + h];
    run_tasks(head_cost, ws_floats, Q, [&](int64_t h, float* ws, int64_t* wi, int64_t) {
      std::fill(a.dbias + h * Q * K, a.dbias + (h + 1) * Q * K, 0.f);
      for (int64_t b = 0; b < B; ++b) head_fn(a, b, h, ws, wi, 0);
    });
    return;
  }
  run_tasks(cost, ws_floats, Q, [&](int64_t t, float* ws, int64_t* wi, int64_t worker) {
    head_fn(a, t / H, t % H, ws, wi, bias.grad_per_worker ? worker : t / H);
  });
}

}  // namespace

// The position bias's argument check (shared with the CUDA host functions through ops.h).
void check_position_bias(const at::Tensor& bias, const at::Tensor& q, int64_t B, int64_t H,
                         int64_t Q, int64_t K) {
  TORCH_CHECK(bias.defined(), "position_bias must be a tensor");
  TORCH_CHECK(bias.device() == q.device(), "position_bias must be on ", q.device(),
              " (the device of q), got ", bias.device());
  TORCH_CHECK(at::isFloatingType(bias.scalar_type()),
              "position_bias must be a floating-point tensor, got ", bias.scalar_type());
  const int64_t want[4] = {B, H, Q, K};
  bool ok = bias.dim() == 4;
  for (int64_t d = 0; ok && d < 4; ++d) ok = bias.size(d) == 1 || bias.size(d) == want[d];
  TORCH_CHECK(ok, "position_bias must be broadcastable to [", B, ", ", H, ", ", Q, ", ", K,
              "] (each dimension 1 or that size), got shape ", bias.sizes());
}

namespace {

// Checks the backward's own tensors (grad_out, out, lse) against q.
void check_backward_tensors(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                            const at::Tensor& q) {
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2);
  for (const at::Tensor* t : {&grad_out, &out}) {
    const char* name = t == &grad_out ? "grad_out" : "out";
    TORCH_CHECK(t->sizes() == q.sizes(), name, " must have the shape of q ", q.sizes(), ", got ",
                t->sizes());
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), name, " must have the dtype of q (",
                q.scalar_type(), "), got ", t->scalar_type());
    TORCH_CHECK(t->device() == q.device(), name, " must be on ", q.device(), ", got ", t->device());
  }
  CHECK_DEVICE(lse, q);
  CHECK_DTYPE(lse, at::kFloat);
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H && lse.size(2) == Q,
              "lse must have shape [", B, ", ", H, ", ", Q, "], got ", lse.sizes());
}

// The bias, expanded over its broadcast dimensions of Q and K, in float32: transposed
// (keys x query rows, rows padded to a multiple of 16 with zeros) for the forward kernel, in
// row order for the backward kernel. The batch and head dimensions keep size 1 where the bias
// broadcasts (stride 0 in the layout).
at::Tensor bias_for_kernels(const at::Tensor& bias, int64_t Q, int64_t K, bool transposed,
                            BiasLayout& layout) {
  const int64_t Bb = bias.size(0), Hb = bias.size(1);
  const at::Tensor scaled = bias.to(at::kFloat).expand({Bb, Hb, Q, K});
  at::Tensor t;
  if (transposed && bias.scalar_type() == at::kFloat && Q % 16 == 0 && Q > 0 && K > 0 &&
      bias.size(2) == Q && bias.size(3) == K && bias.stride(2) == 1 && bias.stride(3) >= Q &&
      bias.stride(0) >= 0 && bias.stride(1) >= 0) {
    // Already keys x query rows with whole vectors of rows (a bias laid out [.., K, Q]): read
    // in place, no copy.
    layout.p = bias.const_data_ptr<float>();
    layout.s0 = Bb == 1 ? 0 : bias.stride(0);
    layout.s1 = Hb == 1 ? 0 : bias.stride(1);
    layout.s2 = bias.stride(3);
    return bias;
  }
  if (transposed) {
    const int64_t Qp = round_up(std::max<int64_t>(Q, 1), 16);
    t = at::empty({Bb, Hb, K, Qp}, bias.options().dtype(at::kFloat));
    t.narrow(3, 0, Q).copy_(scaled.transpose(2, 3));
    if (Qp > Q) t.narrow(3, Q, Qp - Q).zero_();
    layout.s2 = Qp;
  } else {
    t = scaled.contiguous();
    layout.s2 = K;
  }
  layout.p = t.const_data_ptr<float>();
  layout.s0 = Bb == 1 ? 0 : t.stride(0);
  layout.s1 = Hb == 1 ? 0 : t.stride(1);
  return t;
}

std::tuple<at::Tensor, at::Tensor> attention_impl(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& bias,
                                                  const std::optional<at::Tensor>& key_lengths,
                                                  const std::optional<at::Tensor>& query_lengths,
                                                  double scale, bool causal, double dropout_p,
                                                  const std::optional<at::Tensor>& seed) {
  check_attention_args(q, k, v, key_lengths, query_lengths, scale, dropout_p, seed);
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), K = k.size(2), D = q.size(3);
  if (bias.defined()) check_position_bias(bias, q, B, H, Q, K);
  const at::Tensor klen = lengths_or_full(key_lengths, B, K);
  const at::Tensor qlen = lengths_or_full(query_lengths, B, Q);
  check_lengths_range(klen, "key_lengths", K, "the key length K of k");
  check_lengths_range(qlen, "query_lengths", Q, "the query length Q of q");
  const int64_t s = dropout_p > 0.0 ? seed_value(seed) : 0;
  const at::Tensor qd = dense_rows(q), kd = dense_rows(k), vd = dense_rows(v);
  const Isa isa = detect_isa();
  if (isa == Isa::kNone || q.scalar_type() == at::kDouble) {
    return attention_composite(qd, kd, vd, klen, qlen, scale, causal, dropout_p, s, bias);
  }
  at::Tensor out = empty_bthd(B, H, Q, D, q.options());
  at::Tensor lse = at::empty({B, H, Q}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) {
    lse.fill_(-INFINITY);
    return {out, lse};
  }
  BiasLayout layout;
  at::Tensor bias_buf;
  if (bias.defined()) bias_buf = bias_for_kernels(bias, Q, K, /*transposed=*/true, layout);
#ifdef TE_FA_X86
  // With a bias, bfloat16 runs the tile kernels (the brgemm kernels take no bias).
  if (!bias.defined() && q.scalar_type() == at::kBFloat16 && isa == Isa::kAvx512 &&
      use_brgemm_bf16()) {
    launch_forward<c10::BFloat16>(
        qd, kd, vd, out, lse, klen, qlen, scale, causal, dropout_p, s, 16,
        [](const FwdArgs<c10::BFloat16>& a, int64_t b, int64_t h, int64_t i0, int64_t i1, float* ws) {
          fa_avx512::forward_block_mm(a, b, h, i0, i1, ws);
          at::native::cpublas::brgemm_release(true);
        },
        fa_avx512::mm_forward_workspace_floats(K, D));
    return {out, lse};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attention_cpu", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (isa == Isa::kAvx512) {
        launch_forward<scalar_t>(qd, kd, vd, out, lse, klen, qlen, scale, causal, dropout_p, s, 16,
                                 fa_avx512::forward_block<scalar_t>, -1, layout);
      } else {
        launch_forward<scalar_t>(qd, kd, vd, out, lse, klen, qlen, scale, causal, dropout_p, s, 8,
                                 fa_avx2::forward_block<scalar_t>, -1, layout);
      }
    }
  });
#endif
  return {out, lse};
}

// (dq, dk, dv, dbias); dbias has the shape and dtype of the bias, summed over the dimensions
// it broadcasts, when `bias_grad`, else it is an empty tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& bias, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& query_lengths,
    double scale, bool causal, double dropout_p, const std::optional<at::Tensor>& seed,
    bool bias_grad) {
  check_attention_args(q, k, v, key_lengths, query_lengths, scale, dropout_p, seed);
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), K = k.size(2), D = q.size(3);
  check_backward_tensors(grad_out, out, lse, q);
  const bool has_bias = bias.defined();
  if (has_bias) check_position_bias(bias, q, B, H, Q, K);
  const bool want_dbias = has_bias && bias_grad;
  const at::Tensor klen = lengths_or_full(key_lengths, B, K);
  const at::Tensor qlen = lengths_or_full(query_lengths, B, Q);
  check_lengths_range(klen, "key_lengths", K, "the key length K of k");
  check_lengths_range(qlen, "query_lengths", Q, "the query length Q of q");
  const int64_t s = dropout_p > 0.0 ? seed_value(seed) : 0;
  const at::Tensor qd = dense_rows(q), kd = dense_rows(k), vd = dense_rows(v);
  const at::Tensor gd = dense_rows(grad_out), od = dense_rows(out);
  // d(bias): the per-slot sums reduced to the bias's shape, in its dtype.
  auto finish_dbias = [&](const at::Tensor& full) {
    if (!want_dbias) return at::empty({0}, q.options());
    return full.sum_to_size(bias.sizes()).to(bias.scalar_type());
  };
  const Isa isa = detect_isa();
  if (isa == Isa::kNone || q.scalar_type() == at::kDouble) {
    auto [dq, dk, dv, ds] = attention_backward_composite(gd, qd, kd, vd, od, klen, qlen, scale,
                                                         causal, dropout_p, s, bias, want_dbias);
    return {dq, dk, dv, finish_dbias(ds)};
  }
  at::Tensor dq = empty_bthd(B, H, Q, D, q.options());
  at::Tensor dk = empty_bthd(B, H, K, D, q.options());
  at::Tensor dv = empty_bthd(B, H, K, D, q.options());
  if (B * H == 0) {
    return {dq, dk, dv, finish_dbias(at::zeros({B, H, Q, K}, q.options().dtype(at::kFloat)))};
  }
  const at::Tensor lc = lse.contiguous();
  BiasLayout layout;
  at::Tensor bias_buf, dbias_full;
  if (has_bias) {
    bias_buf = bias_for_kernels(bias, Q, K, /*transposed=*/false, layout);
    if (want_dbias) {
      // One accumulator per worker when the batch shares the bias (tasks of different rows run
      // at once), one per batch row otherwise (each (b, h) task owns its slot).
      // One task per head when the batch shares a per-head bias and the heads keep every
      // worker busy (each task then owns its head's d(bias)); else one accumulator per worker
      // when the batch shares the bias (tasks of different rows run at once), one per batch
      // row otherwise (each (b, h) task owns its slot).
      const bool shared = bias.size(0) == 1 && B > 1;
      layout.grad_per_head = shared && bias.size(1) == H && H >= task_workers(B * H);
      layout.grad_per_worker = shared && !layout.grad_per_head;
      if (layout.grad_per_head) {
        dbias_full = at::empty({1, H, Q, K}, q.options().dtype(at::kFloat));
      } else {
        const int64_t slots = layout.grad_per_worker ? task_workers(B * H) : B;
        dbias_full = at::zeros({slots, H, Q, K}, q.options().dtype(at::kFloat));
      }
      layout.grad = dbias_full.data_ptr<float>();
    }
  }
#ifdef TE_FA_X86
  if (!has_bias && q.scalar_type() == at::kBFloat16 && isa == Isa::kAvx512 && use_brgemm_bf16()) {
    launch_backward<c10::BFloat16>(
        gd, qd, kd, vd, od, lc, dq, dk, dv, klen, qlen, scale, causal, dropout_p, s, 16,
        [](const BwdArgs<c10::BFloat16>& a, int64_t b, int64_t h, float* ws, int64_t* wi, int64_t) {
          fa_avx512::backward_head_mm(a, b, h, ws, wi);
          at::native::cpublas::brgemm_release(true);
        },
        fa_avx512::mm_backward_workspace_floats(K, D));
    return {dq, dk, dv, finish_dbias(dbias_full)};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attention_backward_cpu", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (isa == Isa::kAvx512) {
        launch_backward<scalar_t>(gd, qd, kd, vd, od, lc, dq, dk, dv, klen, qlen, scale, causal,
                                  dropout_p, s, 16, fa_avx512::backward_head<scalar_t>, -1, layout);
      } else {
        launch_backward<scalar_t>(gd, qd, kd, vd, od, lc, dq, dk, dv, klen, qlen, scale, causal,
                                  dropout_p, s, 8, fa_avx2::backward_head<scalar_t>, -1, layout);
      }
    }
  });
#endif
  return {dq, dk, dv, finish_dbias(dbias_full)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q,  // [B, H, Q, D]
                                             const at::Tensor& k,  // [B, H, K, D]
                                             const at::Tensor& v,  // [B, H, K, D]
                                             const std::optional<at::Tensor>& key_lengths,
                                             const std::optional<at::Tensor>& query_lengths,
                                             double scale, bool causal, double dropout_p,
                                             const std::optional<at::Tensor>& seed) {
  return attention_impl(q, k, v, at::Tensor(), key_lengths, query_lengths, scale, causal,
                        dropout_p, seed);
}

std::tuple<at::Tensor, at::Tensor> attention_with_bias(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& position_bias,
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& query_lengths,
    double scale, bool causal, double dropout_p, const std::optional<at::Tensor>& seed) {
  TORCH_CHECK(position_bias.defined(), "position_bias must be a tensor");
  return attention_impl(q, k, v, position_bias, key_lengths, query_lengths, scale, causal,
                        dropout_p, seed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out,  // [B, H, Q, D]
    const at::Tensor& q,         // [B, H, Q, D]
    const at::Tensor& k,         // [B, H, K, D]
    const at::Tensor& v,         // [B, H, K, D]
    const at::Tensor& out,       // [B, H, Q, D] the forward output
    const at::Tensor& lse,       // [B, H, Q] float32, from the forward pass
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& query_lengths,
    double scale, bool causal, double dropout_p, const std::optional<at::Tensor>& seed) {
  auto [dq, dk, dv, db] = attention_backward_impl(grad_out, q, k, v, at::Tensor(), out, lse,
                                                  key_lengths, query_lengths, scale, causal,
                                                  dropout_p, seed, false);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_with_bias_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& position_bias, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& query_lengths,
    double scale, bool causal, double dropout_p, const std::optional<at::Tensor>& seed,
    bool bias_grad) {
  TORCH_CHECK(position_bias.defined(), "position_bias must be a tensor");
  return attention_backward_impl(grad_out, q, k, v, position_bias, out, lse, key_lengths,
                                 query_lengths, scale, causal, dropout_p, seed, bias_grad);
}

at::Tensor attention_dropout_mask(const at::Tensor& seed, int64_t B, int64_t H, int64_t Q,
                                  int64_t K, double dropout_p) {
  TORCH_CHECK(seed.scalar_type() == at::kLong && seed.numel() == 1,
              "seed must be an int64 tensor with one element, got ", seed.scalar_type(),
              " of shape ", seed.sizes());
  TORCH_CHECK(B >= 0 && H >= 0 && Q >= 0 && K >= 0, "B, H, Q, K must be >= 0, got ", B, ", ", H,
              ", ", Q, ", ", K);
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must be in [0, 1), got ", dropout_p);
  return dropout_keep_mask(seed_value(seed), B, H, Q, K, dropout_p).to(seed.device());
}

}  // namespace transformer_ext

TORCH_LIBRARY_IMPL(transformer_ext, CPU, m) {
  m.impl("attention", &transformer_ext::attention);
  m.impl("attention_backward", &transformer_ext::attention_backward);
  m.impl("attention_with_bias", &transformer_ext::attention_with_bias);
  m.impl("attention_with_bias_backward", &transformer_ext::attention_with_bias_backward);
  m.impl("attention_dropout_mask", &transformer_ext::attention_dropout_mask);
}
