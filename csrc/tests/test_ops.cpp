// C++ test of the CPU kernels, called through the dispatcher and compared with scalar loops
// written here (an oracle independent of transformer_ext/reference.py). Run by ctest:
// `bash scripts/ctest.sh`. Exit status 0 when every check passes.
#include <cmath>
#include <cstdio>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
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

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// softmax(scale * x) over keys j with mask[b,h,i,j] && (!causal || j <= i + K - Q), in double.
at::Tensor softmax_oracle(const at::Tensor& scores, const OptTensor& mask, double scale,
                          bool causal) {
  const at::Tensor x = scores.to(at::kDouble);
  const at::Tensor m = mask ? mask->expand(x.sizes()) : at::ones(x.sizes(), at::kBool);
  at::Tensor out = at::zeros(x.sizes(), at::kDouble);
  auto xa = x.accessor<double, 4>();
  auto ma = m.accessor<bool, 4>();
  auto oa = out.accessor<double, 4>();
  const int64_t Q = x.size(2), K = x.size(3);
  for (int64_t b = 0; b < x.size(0); ++b)
    for (int64_t h = 0; h < x.size(1); ++h)
      for (int64_t i = 0; i < Q; ++i) {
        auto ok = [&](int64_t j) { return ma[b][h][i][j] && (!causal || j <= i + K - Q); };
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < K; ++j)
          if (ok(j)) mx = std::max(mx, scale * xa[b][h][i][j]);
        if (mx == -INFINITY) continue;  // no key: zeros
        for (int64_t j = 0; j < K; ++j)
          if (ok(j)) sum += (oa[b][h][i][j] = std::exp(scale * xa[b][h][i][j] - mx));
        for (int64_t j = 0; j < K; ++j) oa[b][h][i][j] /= sum;
      }
  return out;
}

// [B, 1, 1, K] bool: key j of batch b is allowed iff j < lengths[b].
at::Tensor padding_mask(int64_t K, const std::vector<int64_t>& lengths) {
  const int64_t B = static_cast<int64_t>(lengths.size());
  return at::arange(K).view({1, 1, 1, K}) < at::tensor(lengths).view({B, 1, 1, 1});
}

void test_masked_softmax() {
  const auto softmax = op<at::Tensor(const at::Tensor&, const OptTensor&, double, bool)>(
      "transformer_ext::masked_softmax");
  const int64_t B = 2, H = 3, Q = 4, K = 37;  // K not a multiple of the vector width
  const at::Tensor scores = at::randn({B, H, Q, K}) * 3;
  const at::Tensor pad = padding_mask(K, {0, 20});  // batch 0 has no key at all
  const at::Tensor full = at::rand({B, H, Q, K}) < 0.6;
  for (const OptTensor& mask : {OptTensor(), OptTensor(pad), OptTensor(full)}) {
    for (bool causal : {false, true}) {
      const at::Tensor out = softmax.call(scores, mask, 0.125, causal);
      const at::Tensor ref = softmax_oracle(scores, mask, 0.125, causal);
      EXPECT(max_diff(out, ref) <= 2e-6, "masked_softmax float32 vs oracle");
      EXPECT(at::equal(out.eq(0), ref.eq(0)), "masked keys get exactly zero");
    }
  }
  const at::Tensor masked = softmax.call(scores, pad, 1.0, false);
  EXPECT(masked[0].eq(0).all().item<bool>(), "fully masked rows are zeros, not NaN");

  // Causal alignment is bottom-right: query i sees keys 0 .. i + K - Q.
  const at::Tensor c = softmax.call(at::zeros({1, 1, 3, 5}), std::nullopt, 1.0, true);
  for (int64_t i = 0; i < 3; ++i) {
    const int64_t seen = i + 5 - 3 + 1;
    for (int64_t j = 0; j < 5; ++j) {
      const double want = j < seen ? 1.0 / seen : 0.0;
      EXPECT(std::abs(c[0][0][i][j].item<double>() - want) < 1e-6, "causal Q < K");
    }
  }
  // Q > K: the first Q - K queries see no key.
  const at::Tensor c2 = softmax.call(at::zeros({1, 1, 5, 2}), std::nullopt, 1.0, true);
  EXPECT(c2[0][0].slice(0, 0, 3).eq(0).all().item<bool>(), "causal Q > K: empty rows");
  EXPECT(std::abs(c2[0][0][4][1].item<double>() - 0.5) < 1e-6, "causal Q > K: last row");

  // float16 scores of magnitude 1e4 with a large scale stay finite (row max subtracted).
  const at::Tensor big = (at::randn({2, 2, 3, 70}) * 1e4).to(at::kHalf);
  const at::Tensor pad70 = padding_mask(70, {45, 70});
  for (double scale : {1.0, 8.0}) {
    const at::Tensor out = softmax.call(big, pad70, scale, true);
    EXPECT(at::isfinite(out).all().item<bool>(), "float16 large scores: finite");
    EXPECT(max_diff(out, softmax_oracle(big, pad70, scale, true)) <= 1e-3, "float16 vs oracle");
  }
}

void test_masked_softmax_backward() {
  const auto backward = op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(
      "transformer_ext::masked_softmax_backward");
  const at::Tensor p = at::softmax(at::randn({2, 2, 3, 19}), -1);
  const at::Tensor g = at::randn({2, 2, 3, 19});
  const at::Tensor out = backward.call(g, p, 0.5);
  at::Tensor ref = at::empty({2, 2, 3, 19}, at::kDouble);
  auto pa = p.accessor<float, 4>();
  auto ga = g.accessor<float, 4>();
  auto ra = ref.accessor<double, 4>();
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 3; ++i) {
        double dot = 0;
        for (int64_t j = 0; j < 19; ++j) dot += double(ga[b][h][i][j]) * pa[b][h][i][j];
        for (int64_t j = 0; j < 19; ++j) ra[b][h][i][j] = 0.5 * pa[b][h][i][j] * (ga[b][h][i][j] - dot);
      }
  EXPECT(max_diff(out, ref) <= 1e-6, "masked_softmax_backward vs oracle");
}

void test_decode_attention() {
  const auto decode = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, double, const OptTensor&,
                                    const OptTensor&)>("transformer_ext::decode_attention");
  const int64_t B = 3, H = 2, L = 9, D = 19;
  const std::vector<int64_t> len = {0, 4, 9};
  const at::Tensor q = at::randn({B, H, 1, D});
  // Caches as [B, L, H, D] buffers seen through transpose: strided B/H/L, dense D.
  at::Tensor k = at::randn({B, L, H, D}).transpose(1, 2);
  at::Tensor v = at::randn({B, L, H, D}).transpose(1, 2);
  for (int64_t b = 0; b < B; ++b) {  // never read: poison the entries past lengths[b]
    k[b].narrow(1, len[b], L - len[b]).fill_(NAN);
    v[b].narrow(1, len[b], L - len[b]).fill_(NAN);
  }
  const at::Tensor k_new = at::randn({B, H, 1, D}), v_new = at::randn({B, H, 1, D});
  const double scale = 0.25;
  for (bool with_new : {false, true}) {
    const at::Tensor out = decode.call(q, k, v, at::tensor(len), scale,
                                       with_new ? OptTensor(k_new) : std::nullopt,
                                       with_new ? OptTensor(v_new) : std::nullopt);
    EXPECT(out.is_contiguous() && out.sizes() == q.sizes(), "decode_attention output layout");
    at::Tensor ref = at::zeros({B, H, 1, D}, at::kDouble);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        std::vector<at::Tensor> keys, vals;  // [D] rows that row b may attend
        for (int64_t j = 0; j < len[b]; ++j) keys.push_back(k[b][h][j]), vals.push_back(v[b][h][j]);
        if (with_new) keys.push_back(k_new[b][h][0]), vals.push_back(v_new[b][h][0]);
        std::vector<double> s;
        double mx = -INFINITY, sum = 0;
        for (const auto& kj : keys) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[b][h][0][d].item<double>() * kj[d].item<double>();
          s.push_back(scale * dot);
          mx = std::max(mx, s.back());
        }
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (size_t j = 0; j < s.size(); ++j)
          ref[b][h][0] += vals[j].to(at::kDouble) * (s[j] / sum);
      }
    EXPECT(max_diff(out, ref) <= 2e-6, "decode_attention vs oracle (row 0 without keys: zeros)");
  }
}

void test_kv_cache_append() {
  const auto append = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const OptTensor&)>("transformer_ext::kv_cache_append_");
  at::Tensor cache = at::zeros({3, 2, 8, 4});
  const at::Tensor update = at::randn({3, 2, 2, 4});
  const std::vector<int64_t> pos = {0, -1, 6};  // row 1 is skipped
  append.call(cache, update, at::tensor(pos), std::nullopt);
  at::Tensor ref = at::zeros({3, 2, 8, 4});
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t t = 0; pos[b] >= 0 && t < 2; ++t) ref.select(0, b).select(1, pos[b] + t).copy_(update[b].select(1, t));
  EXPECT(at::equal(cache, ref), "kv_cache_append_ vs oracle");

  // Row 1 would run past L = 8: the op raises before writing any row (row 0 included).
  const at::Tensor before = cache.clone();
  bool raised = false;
  try {
    append.call(cache, update, at::tensor(std::vector<int64_t>{2, 7, 0}), std::nullopt);
  } catch (const c10::Error&) {
    raised = true;
  }
  EXPECT(raised, "out-of-range position raises");
  EXPECT(at::equal(cache, before), "nothing written when a position is out of range");
}

void test_kv_cache_reorder() {
  const auto reorder = op<void(at::Tensor&, const at::Tensor&, int64_t)>(
      "transformer_ext::kv_cache_reorder_");
  at::Tensor cache = at::randn({4, 2, 6, 3});
  const at::Tensor old = cache.clone();
  const std::vector<int64_t> index = {2, 2, 0, 3};  // repeated source, a move and a fixed row
  reorder.call(cache, at::tensor(index), 4);
  bool ok = true;
  for (int64_t b = 0; b < 4; ++b) {
    ok = ok && at::equal(cache[b].narrow(1, 0, 4), old[index[b]].narrow(1, 0, 4));
    ok = ok && at::equal(cache[b].narrow(1, 4, 2), old[b].narrow(1, 4, 2));  // past length
  }
  EXPECT(ok, "kv_cache_reorder_ vs oracle");
  bool raised = false;
  try {
    reorder.call(cache, at::tensor(std::vector<int64_t>{0, 1, 4, 0}), 2);
  } catch (const c10::Error&) {
    raised = true;
  }
  EXPECT(raised, "index out of range raises");
}

void test_linear() {
  const auto linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(
      "transformer_ext::linear");
  // Rows 1..4 take the matrix-vector kernel, 5 the at::linear path; K and N with tails.
  for (int64_t M : {1, 2, 4, 5}) {
    for (int64_t K : {1, 17, 512}) {
      for (int64_t N : {1, 9, 70}) {
        const at::Tensor x = at::randn({M, K}), w = at::randn({N, K}), b = at::randn({N});
        const at::Tensor y = linear.call(x, w, b);
        // Oracle: scalar loops in double.
        const at::Tensor xd = x.to(at::kDouble), wd = w.to(at::kDouble), bd = b.to(at::kDouble);
        auto xa = xd.accessor<double, 2>();
        auto wa = wd.accessor<double, 2>();
        auto ba = bd.accessor<double, 1>();
        at::Tensor want = at::empty({M, N}, at::kDouble);
        auto ya = want.accessor<double, 2>();
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            double t = ba[n];
            for (int64_t k = 0; k < K; ++k) t += xa[m][k] * wa[n][k];
            ya[m][n] = t;
          }
        const double tol = 1e-5 * std::max(1.0, want.abs().max().item<double>());
        EXPECT(y.sizes() == want.sizes() && max_diff(y, want) <= tol, "linear vs oracle");
        EXPECT(max_diff(linear.call(x, w, std::nullopt), want - bd) <= tol, "linear without bias");
      }
    }
  }
  bool raised = false;
  try {
    linear.call(at::randn({1, 8}), at::randn({4, 7}), std::nullopt);
  } catch (const c10::Error&) {
    raised = true;
  }
  EXPECT(raised, "in_features mismatch raises");
}


// The NaN rule of docs/DESIGN.md section 2, on the kernels and (under ctest's fallback run) the
// composites: a NaN allowed score makes its row NaN; a NaN in a masked position changes nothing.
void test_nan_rule() {
  const auto softmax = op<at::Tensor(const at::Tensor&, const OptTensor&, double, bool)>(
      "transformer_ext::masked_softmax");
  const auto decode = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, double, const OptTensor&,
                                    const OptTensor&)>("transformer_ext::decode_attention");
  const int64_t K = 21;  // two vectors and a tail of 5
  const at::Tensor scores = at::randn({1, 1, 4, K});
  at::Tensor mask = at::ones({1, 1, 4, K}, at::kBool);
  mask[0][0][3][9] = false;
  const at::Tensor clean = softmax.call(scores, mask, 1.0, false);
  at::Tensor poisoned = scores.clone();
  poisoned[0][0][0][3] = NAN;       // allowed, in a full vector
  poisoned[0][0][1][K - 1] = NAN;   // allowed, in the tail
  poisoned[0][0][3][9] = NAN;       // masked
  const at::Tensor out = softmax.call(poisoned, mask, 1.0, false);
  EXPECT(at::isnan(out[0][0][0]).all().item<bool>(), "NaN in a full vector: row NaN");
  EXPECT(at::isnan(out[0][0][1]).all().item<bool>(), "NaN in the tail: row NaN");
  EXPECT(at::equal(out[0][0].slice(0, 2, 4), clean[0][0].slice(0, 2, 4)),
         "NaN in a masked position changes nothing");

  const int64_t B = 2, H = 1, L = 11, D = 9;
  const at::Tensor q = at::randn({B, H, 1, D});
  at::Tensor k = at::randn({B, H, L, D});
  const at::Tensor v = at::randn({B, H, L, D});
  const at::Tensor len = at::tensor(std::vector<int64_t>{L, 3});
  const at::Tensor base = decode.call(q, k, v, len, 0.5, std::nullopt, std::nullopt);
  k[0][0][L - 1][0] = NAN;  // attended
  k[1][0][5][0] = NAN;      // past lengths[1] = 3
  const at::Tensor got = decode.call(q, k, v, len, 0.5, std::nullopt, std::nullopt);
  EXPECT(at::isnan(got[0]).all().item<bool>(), "decode: NaN attended key makes the row NaN");
  EXPECT(at::equal(got[1], base[1]), "decode: NaN past the length changes nothing");
}

// Through the dispatcher the in-place ops bump the version of what they write and refuse an
// update that shares the cache's memory.
void test_in_place_contract() {
  const auto append = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const OptTensor&)>("transformer_ext::kv_cache_append_");
  const auto reorder = op<void(at::Tensor&, const at::Tensor&, int64_t)>(
      "transformer_ext::kv_cache_reorder_");
  at::Tensor cache = at::zeros({2, 1, 6, 4});
  const int64_t v0 = cache._version();
  append.call(cache, at::ones({2, 1, 1, 4}), at::tensor(std::vector<int64_t>{0, 2}),
              std::nullopt);
  EXPECT(cache._version() > v0, "kv_cache_append_ bumps the version");
  const int64_t v1 = cache._version();
  reorder.call(cache, at::tensor(std::vector<int64_t>{1, 0}), 3);
  EXPECT(cache._version() > v1, "kv_cache_reorder_ bumps the version");
  bool raised = false;
  try {
    append.call(cache, cache.narrow(2, 1, 2), at::tensor(std::vector<int64_t>{0, 0}),
                std::nullopt);
  } catch (const c10::Error&) {
    raised = true;
  }
  EXPECT(raised, "an update overlapping the cache raises");
}

}  // namespace

int main() {
  at::manual_seed(0);
  const std::vector<std::pair<const char*, void (*)()>> tests = {
      {"masked_softmax", test_masked_softmax},
      {"masked_softmax_backward", test_masked_softmax_backward},
      {"decode_attention", test_decode_attention},
      {"kv_cache_append_", test_kv_cache_append},
      {"kv_cache_reorder_", test_kv_cache_reorder},
      {"linear", test_linear},
      {"nan_rule", test_nan_rule},
      {"in_place_contract", test_in_place_contract},
  };
  for (const auto& [name, fn] : tests) {
    const int before = g_failures;
    try {
      fn();
    } catch (const std::exception& e) {
      ++g_failures;
      std::fprintf(stderr, "%s: unexpected exception: %s\n", name, e.what());
    }
    std::printf("%-26s %s\n", name, g_failures == before ? "ok" : "FAILED");
  }
  return g_failures == 0 ? 0 : 1;
}
