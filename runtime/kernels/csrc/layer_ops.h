// The decoder ladder's row-wise ops in one fixed order: RMSNorm, q/k preparation (norm, rotary, K/V
// write) and attention of single queries.
//
// Included by bindings.h (after one simd_*.h, blocks.h and gemm.h), which registers them. Every output row
// depends only on its own input row (and, for attention, on the keys it reads, in the order it
// reads them), so a forward over n tokens gives each token the bits a one-token step gives it,
// and a token-tree node the bits a chain step over its path gives it. Sums use the skinny
// kernel's order (two 16-lane accumulators over 32-element steps, masked 16-wide tail steps into
// the first, GCC's reduce tree), so the three ISA paths agree bit for bit; so does exp, ours in simd
// ops (exp_nonpositive), not the C library's.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "pool.h"

namespace {
namespace ops {

using namespace simd;

constexpr int kMaxHeadsPerPass = std::min(4, kAccumulators);  // query heads of one attention item (their value chains: one 16-lane step each at least)
static_assert(kMaxHeadsPerPass <= kMaxBatch, "an attention item's queries are scored in one rows_dot pass");

// <a, b> over n floats: the skinny kernel's own order (gemm.h, an F32 row against one row of x).
inline float dot(const float* a, const float* b, int64_t n) {
  float out;
  gemm::rows_dot<blocks::F32, 1, 1>(reinterpret_cast<const uint8_t*>(a), 0, b, n, 0, &out, 1);
  return out;
}

void check_float(const torch::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.dim() == dim && t.is_contiguous(), what, " must be a contiguous ", dim, "-d float32 tensor");
}

// rms_norm of one row of d floats (x and y may be the same row).
inline void norm_row(const float* x, const float* factor, int64_t d, float eps, float* y) {
  const float scale = 1.0f / std::sqrt(dot(x, x, d) / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) y[j] = (x[j] * scale) * factor[j];
}

// Readies a fused projection's output qkv [T, H + 2 KV, hd] for attention, in place: the
// per-head RMSNorm of q and k (gemma3; skipped when q_factor is empty), the rotary embedding of
// q and k at `positions` [T] (rotate-half layout: x * cos + rotate_half(x) * sin, tables cos,
// sin [P, hd]), then k and v written to the cache buffers keys, values [KV, capacity, hd] at
// slots start .. start + T - 1.
void prepare_qkv(torch::Tensor qkv, int64_t heads, torch::Tensor q_factor, torch::Tensor k_factor, double eps, torch::Tensor cos,
                 torch::Tensor sin, torch::Tensor positions, torch::Tensor keys, torch::Tensor values, int64_t start) {
  for (auto* t : {&qkv, &keys, &values}) check_float(*t, 3, "qkv and the cache buffers");
  check_float(cos, 2, "cos");
  check_float(sin, 2, "sin");
  TORCH_CHECK(positions.dtype() == torch::kLong && positions.dim() == 1 && positions.is_contiguous(), "positions must be [T] int64");
  const int64_t count = qkv.size(0), hd = qkv.size(2), kv = keys.size(0), capacity = keys.size(1);
  TORCH_CHECK(hd % 2 == 0 && qkv.size(1) == heads + 2 * kv && positions.size(0) == count, "qkv must be [T, H + 2 KV, hd] with positions [T]");
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(2) == hd && start >= 0 && start + count <= capacity,
              "the cache buffers [KV, capacity, hd] cannot take ", count, " tokens at ", start);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == hd, "cos and sin must be [P, hd]");
  const bool normed = q_factor.numel() > 0;
  if (normed) {
    check_float(q_factor, 1, "q_factor");
    check_float(k_factor, 1, "k_factor");
    TORCH_CHECK(q_factor.size(0) == hd && k_factor.size(0) == hd, "q/k norm factors must be [hd]");
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is outside the rotary tables");
  const int64_t half = hd / 2, width = heads + 2 * kv;
  const float epsf = static_cast<float>(eps);
  std::vector<float> row(hd);
  float* base = qkv.data_ptr<float>();
  for (int64_t t = 0; t < count; ++t) {
    const float* c = cos.data_ptr<float>() + pos[t] * hd;
    const float* s = sin.data_ptr<float>() + pos[t] * hd;
    for (int64_t h = 0; h < heads + kv; ++h) {
      float* x = base + (t * width + h) * hd;
      if (normed) norm_row(x, (h < heads ? q_factor : k_factor).data_ptr<float>(), hd, epsf, x);
      std::copy(x, x + hd, row.begin());
      for (int64_t i = 0; i < half; ++i) x[i] = row[i] * c[i] + (-row[i + half]) * s[i];
      for (int64_t i = half; i < hd; ++i) x[i] = row[i] * c[i] + row[i - half] * s[i];
    }
    for (int64_t g = 0; g < kv; ++g) {
      const float* k = base + (t * width + heads + g) * hd;
      std::copy(k, k + hd, keys.data_ptr<float>() + (g * capacity + start + t) * hd);
      std::copy(k + kv * hd, k + (kv + 1) * hd, values.data_ptr<float>() + (g * capacity + start + t) * hd);
    }
  }
}

// y[r] = (x[r] * rsqrt(mean(x[r]^2) + eps)) * factor for x [rows, d]: transformers' RMSNorm with
// factor = weight (llama, qwen2) or 1 + weight (gemma3); the mean's sum in the fixed order.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor factor, double eps) {
  check_float(x, 2, "x");
  check_float(factor, 1, "factor");
  const int64_t rows = x.size(0), d = x.size(1);
  TORCH_CHECK(factor.size(0) == d, "factor has ", factor.size(0), " entries for rows of ", d);
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* fp = factor.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  sv_pool::parallel_for(rows, std::max<int64_t>(1, 16384 / d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(xp + r * d, fp, d, epsf, yp + r * d);
    }
  });
  return y;
}

// Value sums of H query heads over S 16-lane steps from lane i0, each (head, lane) its own chain over
// the keys in order, as one head at a time sums it: o[h * hd + i0 + lane] = sum_j p[h * most + j] v_j[i0 + lane].
// The heads share each value vector's load; H * S chains keep both FMA ports busy where one head's
// few chains wait on FMA latency. The slices of the values 8 KB ahead are prefetched (the cache of a
// layer is read from memory once per token, as its weights are).
template <int H, int S>
inline void value_sums(const float* p, int64_t most, const float* vh, const std::vector<int64_t>& seen, int64_t hd, int64_t i0, float* o) {
  V acc[H][S];
  SV_UNROLL
  for (int h = 0; h < H; ++h) {
    SV_UNROLL
    for (int s = 0; s < S; ++s) acc[h][s] = zero();
  }
  const int64_t n = static_cast<int64_t>(seen.size());
  constexpr int64_t kAhead = std::max<int64_t>(8, kPrefetchBytes / (64 * S));  // keys ahead: 8 KB of their slices
  for (int64_t j = 0; j < n; ++j) {
    if (j + kAhead < n) {
      const float* later = vh + seen[j + kAhead] * hd + i0;
      SV_UNROLL
      for (int s = 0; s < S; ++s) prefetch(reinterpret_cast<const uint8_t*>(later + 16 * s));
    }
    const float* value = vh + seen[j] * hd + i0;
    V v[S];
    SV_UNROLL
    for (int s = 0; s < S; ++s) v[s] = load_partial(value + 16 * s, std::min<int64_t>(16, hd - i0 - 16 * s));
    SV_UNROLL
    for (int h = 0; h < H; ++h) {
      const V weight = bcast(p + h * most + j);
      SV_UNROLL
      for (int s = 0; s < S; ++s) acc[h][s] = fma(weight, v[s], acc[h][s]);
    }
  }
  SV_UNROLL
  for (int h = 0; h < H; ++h) {
    SV_UNROLL
    for (int s = 0; s < S; ++s) store_first(o + h * hd + i0 + 16 * s, acc[h][s], std::min<int64_t>(16, hd - i0 - 16 * s));
  }
}

// value_sums of H heads over all hd lanes (a multiple of 64) in slices of 16 S lanes: S the most steps,
// from 16 down by halves, whose chains for the heads fit kAccumulators and that divide hd / 16. On
// AVX-512 one head of 256 lanes takes one pass, four heads four 64-lane passes that share each value
// slice's load; on AVX2 four heads take 16-lane slices.
template <int H, int S = 16>
inline void value_slices(const float* p, int64_t most, const float* vh, const std::vector<int64_t>& seen, int64_t hd, float* o) {
  if constexpr (S > 1 && H * S > kAccumulators) {
    return value_slices<H, S / 2>(p, most, vh, seen, hd, o);
  } else {
    if constexpr (S > 1) {
      if (hd % (16 * S) != 0) return value_slices<H, S / 2>(p, most, vh, seen, hd, o);
    }
    for (int64_t i0 = 0; i0 < hd; i0 += 16 * S) value_sums<H, S>(p, most, vh, seen, hd, i0, o);
  }
}

// value_slices of `heads` (1..H) heads.
template <int H>
inline void value_heads(int64_t heads, const float* p, int64_t most, const float* vh, const std::vector<int64_t>& seen, int64_t hd, float* o) {
  if constexpr (H > 1) {
    if (heads < H) return value_heads<H - 1>(heads, p, most, vh, seen, hd, o);
  }
  value_slices<H>(p, most, vh, seen, hd, o);
}

// Query heads per attention item for head size hd: a multiple of 64 takes up to kMaxHeadsPerPass
// heads at once (their scores share the keys' loads, their value sums each value slice's); any other
// size one head at a time.
inline int64_t heads_per_pass(int64_t hd) { return hd % 64 == 0 ? kMaxHeadsPerPass : 1; }

// The value sums of `heads` consecutive query heads (heads <= heads_per_pass(hd)) into o [heads, hd].
inline void value_pass(int64_t heads, const float* p, int64_t most, const float* vh, const std::vector<int64_t>& seen, int64_t hd, float* o) {
  if (hd % 64 == 0) return value_heads<kMaxHeadsPerPass>(heads, p, most, vh, seen, hd, o);
  for (int64_t h = 0; h < heads; ++h) {  // any other head size: one head, four steps (then one) per pass
    int64_t i0 = 0;
    for (; i0 + 64 <= hd; i0 += 64) value_sums<1, 4>(p + h * most, most, vh, seen, hd, i0, o + h * hd);
    for (; i0 < hd; i0 += 16) value_sums<1, 1>(p + h * most, most, vh, seen, hd, i0, o + h * hd);
  }
}

// exp(x) for x <= 0 (NaN stays NaN), within 1 ulp (tested): Cephes' expf (Cody-Waite reduction by ln 2, a
// degree-7 polynomial) in simd ops only, so every path gives the same bits. Below -87 (where exp
// leaves float's normal range) it gives exp(-87), ~1.6e-38: attention weights that small change no sum.
inline V exp_nonpositive(V x) {
  x = max(set1(-87.0f), x);                                              // NaN: vmaxps returns x
  const V shifted = add(mul(x, set1(1.44269504088896341f)), set1(0x1.8p23f));  // 1.5 * 2^23 + k, k = round(x / ln 2)
  const V k = sub(shifted, set1(0x1.8p23f));                             // k in [-126, 0], exact
  V r = fma(k, set1(-0.693359375f), x);                                  // x - k ln 2 (ln 2 in two parts)
  r = fma(k, set1(2.12194440e-4f), r);
  V y = fma(set1(1.9875691500e-4f), r, set1(1.3981999507e-3f));
  y = fma(y, r, set1(8.3334519073e-3f));
  y = fma(y, r, set1(4.1665795894e-2f));
  y = fma(y, r, set1(1.6666665459e-1f));
  y = fma(y, r, set1(5.0000001201e-1f));
  y = add(fma(y, mul(r, r), r), set1(1.0f));                             // exp(r), |r| <= ln 2 / 2
  const V two_k = as_float(shl(sub_(as_int(shifted), 0x4B400000 - 127), 23));  // 2^k: k + 127 in the exponent bits
  return mul(y, two_k);
}

// The attention weights of one query head in place: s_j <- exp(s_j * scale - max) over its n
// scores; returns their sum (16-lane partial sums, then reduce's tree).
inline float softmax_weights(float* s, int64_t n, float scale) {
  const V factor = set1(scale);
  V tops = set1(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const V v = mul(load(s + j), factor);
    store(s + j, v);
    tops = max(tops, v);
  }
  alignas(64) float lanes[16];
  store(lanes, tops);
  float top = lanes[0];
  for (int l = 1; l < 16; ++l) top = std::max(top, lanes[l]);
  for (int64_t t = j; t < n; ++t) top = std::max(top, s[t] *= scale);  // the tail, after the full steps
  const V shift = set1(top);
  V sums = zero();
  for (j = 0; j + 16 <= n; j += 16) {
    const V w = exp_nonpositive(sub(load(s + j), shift));
    store(s + j, w);
    sums = add(sums, w);
  }
  if (j < n) {
    const V w = exp_nonpositive(sub(load_partial(s + j, n - j), shift));
    store_first(s + j, w, n - j);
    sums = add(sums, keep_first(w, n - j));
  }
  return reduce(sums);
}

// softmax_weights of each row of a copy of scores [R, n]: (the weights [R, n], their sums [R]).
std::tuple<torch::Tensor, torch::Tensor> softmax(torch::Tensor scores, double scale) {
  check_float(scores, 2, "scores");
  auto weights = scores.clone();
  auto sums = torch::empty({scores.size(0)}, scores.options());
  for (int64_t r = 0; r < scores.size(0); ++r)
    sums.data_ptr<float>()[r] = softmax_weights(weights.data_ptr<float>() + r * scores.size(1), scores.size(1), static_cast<float>(scale));
  return {weights, sums};
}

// Attention of each query q[t] [H, hd] (the first H heads of qkv [T, H + 2 KV, hd]) over the cached keys it sees: slots first[t] .. end[t] - 1,
// then extra[t][0..] up to the first -1 (a tree node's path), in that order. keys, values
// [KV, capacity, hd]; head h reads kv head h / (H / KV). Per (t, h): scores <q, k_j> * scale,
// p_j = exp(score_j - max) (exp_nonpositive), out = (sum_j p_j v_j, in key order) / (sum_j p_j). -> [T, H * hd]
// The query heads that share a kv head go through the keys together (rows_dot passes score them all,
// prefetching the keys ahead as a weight stream is; value_pass sums them in slices of the lanes that
// all their chains fit), each (t, h) in the same order as alone.
torch::Tensor attend(torch::Tensor qkv, int64_t heads, torch::Tensor keys, torch::Tensor values, torch::Tensor first, torch::Tensor end,
                     torch::Tensor extra, double scale) {
  check_float(qkv, 3, "qkv");
  check_float(keys, 3, "keys");
  check_float(values, 3, "values");
  for (auto* t : {&first, &end, &extra}) TORCH_CHECK(t->dtype() == torch::kLong && t->is_contiguous(), "first, end and extra must be int64");
  const int64_t count = qkv.size(0), hd = qkv.size(2), kv = keys.size(0), capacity = keys.size(1), width = qkv.size(1);
  TORCH_CHECK(keys.size(2) == hd && values.sizes() == keys.sizes() && heads % kv == 0 && width == heads + 2 * kv,
              "qkv [T, H + 2 KV, hd] and keys [KV, capacity, hd] disagree");
  TORCH_CHECK(first.dim() == 1 && end.dim() == 1 && first.size(0) == count && end.size(0) == count && extra.dim() == 2 && extra.size(0) == count,
              "first, end [T] and extra [T, E] must match qkv's T");
  const int64_t* fp = first.data_ptr<int64_t>();
  const int64_t* ep = end.data_ptr<int64_t>();
  const int64_t* xp = extra.data_ptr<int64_t>();
  const int64_t path_width = extra.size(1);
  std::vector<std::vector<int64_t>> slots(count);
  int64_t most = 1;
  for (int64_t t = 0; t < count; ++t) {
    TORCH_CHECK(0 <= fp[t] && fp[t] <= ep[t] && ep[t] <= capacity, "key range ", fp[t], "..", ep[t], " is outside the cache");
    for (int64_t j = fp[t]; j < ep[t]; ++j) slots[t].push_back(j);
    for (int64_t e = 0; e < path_width && xp[t * path_width + e] >= 0; ++e) {
      TORCH_CHECK(xp[t * path_width + e] < capacity, "key slot ", xp[t * path_width + e], " is outside the cache");
      slots[t].push_back(xp[t * path_width + e]);
    }
    TORCH_CHECK(!slots[t].empty(), "query ", t, " sees no keys");
    most = std::max<int64_t>(most, static_cast<int64_t>(slots[t].size()));
  }
  auto out = torch::empty({count, heads * hd}, qkv.options());
  const float* qp = qkv.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scalef = static_cast<float>(scale);
  const int64_t group = heads / kv;
  // Work items: (query t, kv head, a chunk of its query heads); with several threads, chunks small enough
  // that every thread gets two items or more.
  int64_t chunk = std::min(group, heads_per_pass(hd));
  const int64_t threads = sv_pool::instance()->threads();
  while (threads > 1 && chunk > 1 && count * kv * ((group + chunk - 1) / chunk) < 2 * threads) chunk = (chunk + 1) / 2;
  const int64_t chunks = (group + chunk - 1) / chunk;
  sv_pool::parallel_for(count * kv * chunks, std::max<int64_t>(1, 32768 / (most * hd * chunk)), [&](int64_t begin, int64_t stop) {
    std::vector<float> p(chunk * most);  // scores, then weights, of the chunk's heads: [chunk, most]
    for (int64_t item = begin; item < stop; ++item) {
      const int64_t t = item / (kv * chunks), g = item / chunks % kv, h0 = g * group + item % chunks * chunk;
      const int64_t nh = std::min(chunk, (g + 1) * group - h0);  // query heads h0 .. h0 + nh - 1
      const float* qr = qp + (t * width + h0) * hd;  // [nh, hd]
      const float* kh = kp + g * capacity * hd;
      const float* vh = vp + g * capacity * hd;
      const auto& seen = slots[t];
      const int64_t n = static_cast<int64_t>(seen.size());
      // Scores: the keys of each run of consecutive slots in rows_dot passes against the chunk's queries
      // (each score is dot's value: the skinny kernel's order; the run's later keys prefetched), then the scale.
      for (int64_t j = 0; j < n;) {
        int64_t run = 1;
        while (j + run < n && seen[j + run] == seen[j] + run) ++run;
        gemm::rows_dot_range<blocks::F32, kMaxHeadsPerPass>(nh, reinterpret_cast<const uint8_t*>(kh + seen[j] * hd),
                                                            hd * static_cast<int64_t>(sizeof(float)), 0, run, qr, hd, run,
                                                            p.data() + j, most);
        j += run;
      }
      float total[kMaxHeadsPerPass];
      for (int64_t b = 0; b < nh; ++b) total[b] = softmax_weights(p.data() + b * most, n, scalef);
      float* o = op + (t * heads + h0) * hd;  // [nh, hd]
      value_pass(nh, p.data(), most, vh, seen, hd, o);
      for (int64_t b = 0; b < nh; ++b)
        for (int64_t i = 0; i < hd; ++i) o[b * hd + i] /= total[b];
    }
  });
  return out;
}

}  // namespace ops
}  // namespace
