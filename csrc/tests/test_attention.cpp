// C++ test of transformer_ext::attention and attention_backward (CPU), called through the
// dispatcher and compared with naive loops in double written here (an oracle independent of
// transformer_ext/reference.py and of the kernels' tiling). Run by ctest: `bash scripts/ctest.sh`
// (twice: the AVX2/AVX-512 kernels and, with TRANSFORMER_EXT_CPU_FALLBACK=1, the ATen
// composites). Exit status 0 when every check passes.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace {

int g_failures = 0;

#define EXPECT(cond, what)                                                                  \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      ++g_failures;                                                                         \
      std::fprintf(stderr, "%s:%d: FAILED %s  (%s)\n", __FILE__, __LINE__, #cond, (what)); \
    }                                                                                       \
  } while (0)

using OptTensor = std::optional<at::Tensor>;
using Fwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const OptTensor&,
                                               const OptTensor&, double, bool, double,
                                               const OptTensor&);
using Bwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const OptTensor&, const OptTensor&, double, bool, double, const OptTensor&);
using Mask = at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, double);

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return 0.0;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

struct Case {
  int64_t B, H, Q, K, D;
  std::vector<int64_t> klen, qlen;  // empty: full length
  bool causal;
  double dropout_p;
};

// The oracle: out, lse, dq, dk, dv in double, by loops over (b, h, i, j, d). `keep` is the
// dropout keep mask [B, H, Q, K] (all true without dropout).
struct Oracle {
  at::Tensor out, lse, dq, dk, dv;
};

Oracle oracle(const Case& c, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& g, const at::Tensor& keep, double scale) {
  const int64_t B = c.B, H = c.H, Q = c.Q, K = c.K, D = c.D;
  const at::Tensor qd = q.to(at::kDouble).contiguous(), kd = k.to(at::kDouble).contiguous();
  const at::Tensor vd = v.to(at::kDouble).contiguous(), gd = g.to(at::kDouble).contiguous();
  auto qa = qd.accessor<double, 4>(), ka = kd.accessor<double, 4>();
  auto va = vd.accessor<double, 4>(), ga = gd.accessor<double, 4>();
  auto keepa = keep.accessor<bool, 4>();
  Oracle o{at::zeros({B, H, Q, D}, at::kDouble), at::full({B, H, Q}, -INFINITY, at::kDouble),
           at::zeros({B, H, Q, D}, at::kDouble), at::zeros({B, H, K, D}, at::kDouble),
           at::zeros({B, H, K, D}, at::kDouble)};
  auto oa = o.out.accessor<double, 4>();
  auto la = o.lse.accessor<double, 3>();
  auto dqa = o.dq.accessor<double, 4>(), dka = o.dk.accessor<double, 4>();
  auto dva = o.dv.accessor<double, 4>();
  const double rp = 1.0 / (1.0 - c.dropout_p);
  std::vector<double> s(K), p(K), dp(K);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t kl = c.klen.empty() ? K : c.klen[b], ql = c.qlen.empty() ? Q : c.qlen[b];
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < ql; ++i) {
        auto allowed = [&](int64_t j) { return j < kl && (!c.causal || j <= i + (K - Q)); };
        double mx = -INFINITY;
        for (int64_t j = 0; j < K; ++j) {
          if (!allowed(j)) continue;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qa[b][h][i][d] * ka[b][h][j][d];
          s[j] = scale * dot;
          mx = std::max(mx, s[j]);
        }
        if (mx == -INFINITY) continue;  // no allowed key: zeros, zero gradients
        double sum = 0;
        for (int64_t j = 0; j < K; ++j) sum += (p[j] = allowed(j) ? std::exp(s[j] - mx) : 0.0);
        la[b][h][i] = mx + std::log(sum);
        for (int64_t j = 0; j < K; ++j) p[j] /= sum;
        // out = sum_j p_j m_j / (1 - p) v_j; delta = dO . out = sum_j p_j dP'_j
        double delta = 0;
        for (int64_t j = 0; j < K; ++j) {
          if (!allowed(j)) continue;
          const double w = keepa[b][h][i][j] ? p[j] * rp : 0.0;
          double gv = 0;
          for (int64_t d = 0; d < D; ++d) {
            oa[b][h][i][d] += w * va[b][h][j][d];
            gv += ga[b][h][i][d] * va[b][h][j][d];
            dva[b][h][j][d] += w * ga[b][h][i][d];
          }
          dp[j] = keepa[b][h][i][j] ? gv * rp : 0.0;
          delta += p[j] * dp[j];
        }
        for (int64_t j = 0; j < K; ++j) {
          if (!allowed(j)) continue;
          const double ds = p[j] * (dp[j] - delta) * scale;
          for (int64_t d = 0; d < D; ++d) {
            dqa[b][h][i][d] += ds * ka[b][h][j][d];
            dka[b][h][j][d] += ds * qa[b][h][i][d];
          }
        }
      }
  }
  return o;
}

OptTensor lengths_arg(const std::vector<int64_t>& len) {
  if (len.empty()) return std::nullopt;
  return at::tensor(len);
}

// q, k, v as head views of [B, T, H, D] buffers (strided B/H/T, dense D), as in the model;
// entries past the key lengths poisoned with NaN (they must never be read).
void run_case(const Case& c, const char* name) {
  const int64_t B = c.B, H = c.H, Q = c.Q, K = c.K, D = c.D;
  const at::Tensor q = at::randn({B, Q, H, D}).transpose(1, 2);
  at::Tensor k = at::randn({B, K, H, D}).transpose(1, 2);
  at::Tensor v = at::randn({B, K, H, D}).transpose(1, 2);
  const at::Tensor g = at::randn({B, H, Q, D});
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor k_clean = k.clone(), v_clean = v.clone();
  if (!c.klen.empty()) {
    for (int64_t b = 0; b < B; ++b) {
      k[b].narrow(1, c.klen[b], K - c.klen[b]).fill_(NAN);
      v[b].narrow(1, c.klen[b], K - c.klen[b]).fill_(NAN);
    }
  }
  const OptTensor seed =
      c.dropout_p > 0 ? OptTensor(at::tensor(std::vector<int64_t>{1234567})) : std::nullopt;
  const at::Tensor keep =
      c.dropout_p > 0
          ? op<Mask>("transformer_ext::attention_dropout_mask").call(*seed, B, H, Q, K, c.dropout_p)
          : at::ones({B, H, Q, K}, at::kBool);
  const OptTensor kl = lengths_arg(c.klen), ql = lengths_arg(c.qlen);
  const auto [out, lse] = op<Fwd>("transformer_ext::attention")
                              .call(q, k, v, kl, ql, scale, c.causal, c.dropout_p, seed);
  const auto [dq, dk, dv] = op<Bwd>("transformer_ext::attention_backward")
                                .call(g, q, k, v, out, lse, kl, ql, scale, c.causal, c.dropout_p,
                                      seed);
  const Oracle ref = oracle(c, q, k_clean, v_clean, g, keep, scale);
  EXPECT(out.sizes() == q.sizes() && lse.sizes() == at::IntArrayRef({B, H, Q}), name);
  EXPECT(max_diff(out, ref.out) <= 2e-5, name);
  // lse: -inf exactly where a row has no key, within float32 rounding elsewhere
  const at::Tensor finite = ref.lse.isfinite();
  EXPECT(at::equal(lse.isfinite(), finite), name);
  EXPECT(max_diff(lse.masked_fill(finite.logical_not(), 0), ref.lse.masked_fill(finite.logical_not(), 0)) <= 2e-5,
         name);
  EXPECT(max_diff(dq, ref.dq) <= 5e-5, name);
  EXPECT(max_diff(dk, ref.dk) <= 5e-5, name);
  EXPECT(max_diff(dv, ref.dv) <= 5e-5, name);
  EXPECT(!out.isnan().any().item<bool>() && !dk.isnan().any().item<bool>() &&
             !dv.isnan().any().item<bool>() && !dq.isnan().any().item<bool>(),
         "no NaN from the poisoned keys past the lengths");
}

void test_attention_full_and_ragged() {
  // Tiles of 64 crossed (Q, K > 64), Q != K both ways, D not a multiple of the vector width.
  run_case({2, 3, 70, 130, 40, {}, {}, false, 0.0}, "full rows, Q < K");
  run_case({3, 2, 130, 67, 64, {67, 30, 0}, {}, false, 0.0}, "key lengths (one row without keys)");
  run_case({3, 2, 90, 90, 17, {90, 45, 1}, {90, 12, 0}, false, 0.0}, "key and query lengths");
}

void test_attention_causal() {
  run_case({2, 2, 100, 100, 32, {}, {}, true, 0.0}, "causal, Q == K");
  run_case({2, 2, 30, 100, 24, {100, 80}, {}, true, 0.0}, "causal bottom-right, Q < K");
  run_case({2, 2, 100, 30, 24, {}, {100, 70}, true, 0.0}, "causal, Q > K (first rows empty)");
  run_case({2, 2, 1, 65, 64, {65, 3}, {}, true, 0.0}, "Q = 1");
}

void test_attention_dropout() {
  run_case({2, 2, 70, 70, 32, {70, 40}, {}, false, 0.1}, "dropout 0.1 with key lengths");
  run_case({2, 2, 80, 80, 16, {}, {80, 50}, true, 0.3}, "dropout 0.3, causal, query lengths");
  // The debug mask: a kept fraction near 1 - p (10^6 draws: 6 standard deviations is 0.0018).
  const at::Tensor seed = at::tensor(std::vector<int64_t>{42});
  const at::Tensor m = op<Mask>("transformer_ext::attention_dropout_mask").call(seed, 4, 4, 250, 250, 0.25);
  const double kept = m.to(at::kDouble).mean().item<double>();
  EXPECT(std::abs(kept - 0.75) < 0.0018, "kept fraction within 6 sigma of 1 - p");
}

void test_attention_thread_count_independent() {
  const Case c{3, 2, 150, 150, 64, {150, 100, 77}, {}, true, 0.2};
  const at::Tensor q = at::randn({c.B, c.H, c.Q, c.D}), k = at::randn({c.B, c.H, c.K, c.D});
  const at::Tensor v = at::randn({c.B, c.H, c.K, c.D}), g = at::randn({c.B, c.H, c.Q, c.D});
  const OptTensor seed = at::tensor(std::vector<int64_t>{7}), kl = lengths_arg(c.klen);
  std::vector<at::Tensor> results[2];
  const int threads = at::get_num_threads();
  for (int r = 0; r < 2; ++r) {
    at::set_num_threads(r == 0 ? 1 : 2);
    const auto [out, lse] = op<Fwd>("transformer_ext::attention")
                                .call(q, k, v, kl, std::nullopt, 0.125, c.causal, c.dropout_p, seed);
    const auto [dq, dk, dv] = op<Bwd>("transformer_ext::attention_backward")
                                  .call(g, q, k, v, out, lse, kl, std::nullopt, 0.125, c.causal,
                                        c.dropout_p, seed);
    results[r] = {out, lse, dq, dk, dv};
  }
  at::set_num_threads(threads);
  // The tile kernels promise bitwise equality; the ATen composite (fallback) runs BLAS, whose
  // sums may be split differently at another thread count.
  const char* env = std::getenv("TRANSFORMER_EXT_CPU_FALLBACK");
  const bool fallback = env != nullptr && std::strcmp(env, "1") == 0;
  for (size_t t = 0; t < results[0].size(); ++t) {
    const bool same = fallback ? max_diff(results[0][t].nan_to_num(0, 0, 0), results[1][t].nan_to_num(0, 0, 0)) <= 1e-5
                               : at::equal(results[0][t], results[1][t]);
    EXPECT(same, "the same at 1 and 2 threads");
  }
}

void test_attention_bad_input() {
  const auto fwd = op<Fwd>("transformer_ext::attention");
  const at::Tensor q = at::randn({2, 2, 4, 8}), k = at::randn({2, 2, 5, 8});
  auto raises = [&](auto&& fn) {
    try {
      fn();
    } catch (const c10::Error&) {
      return true;
    }
    return false;
  };
  EXPECT(raises([&] { fwd.call(q, k, k, at::tensor(std::vector<int64_t>{5, 6}), std::nullopt, 1.0, false, 0.0, std::nullopt); }),
         "key_lengths past K raise");
  EXPECT(raises([&] { fwd.call(q, k, k, std::nullopt, at::tensor(std::vector<int64_t>{-1, 2}), 1.0, false, 0.0, std::nullopt); }),
         "negative query_lengths raise");
  EXPECT(raises([&] { fwd.call(q, k, k, std::nullopt, std::nullopt, 1.0, false, 1.0, std::nullopt); }),
         "dropout_p = 1 raises");
  EXPECT(raises([&] { fwd.call(q, k, at::randn({2, 2, 5, 7}), std::nullopt, std::nullopt, 1.0, false, 0.0, std::nullopt); }),
         "v of another shape raises");
}

}  // namespace

int main() {
  at::manual_seed(0);
  const std::vector<std::pair<const char*, void (*)()>> tests = {
      {"attention_full_and_ragged", test_attention_full_and_ragged},
      {"attention_causal", test_attention_causal},
      {"attention_dropout", test_attention_dropout},
      {"attention_thread_count", test_attention_thread_count_independent},
      {"attention_bad_input", test_attention_bad_input},
  };
  for (const auto& [name, fn] : tests) {
    const int before = g_failures;
    try {
      fn();
    } catch (const std::exception& e) {
      ++g_failures;
      std::fprintf(stderr, "%s: unexpected exception: %s\n", name, e.what());
    }
    std::printf("%-30s %s\n", name, g_failures == before ? "ok" : "FAILED");
  }
  return g_failures == 0 ? 0 : 1;
}
