// The certified head's screen on the AVX2 path: the int16-split int8 screen of int16_screen.h with
// 256-bit vpmaddwd + vpaddd, the same integers as the AVX-512 path's, so the same outputs; and
// screen_select, one row's candidates. The float32-activation screen stays in runtime.kernels' torch code here.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "int16_screen.h"
#include "prefetch.h"
#include "screen_select.h"
#include "simd_avx2.h"

namespace {

struct Avx2Dot {
  static constexpr int kBatch = 4;  // hidden rows per pass
  static constexpr int rows_for(int n) { return n == 1 ? 4 : n == 2 ? 2 : 1; }  // at most 8 of the 16 ymm accumulate

  // R int8 weight rows (stride d) against N int16 rows (stride d): exact dots out[r * N + b]. Two
  // accumulators per pair (columns j..j+15 and j+16..j+31 of each 32) keep each int32 lane at d / 32
  // pair sums, as on AVX-512.
  template <int R, int N>
  static inline void rows(const int8_t* q, const int16_t* a, int64_t d, bool prefetch, int64_t* out) {
    __m256i acc[R][N][2];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < N; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_si256();
    for (int64_t j = 0; j < d; j += 32) {
      if (prefetch && j % 64 == 0)
        for (int r = 0; r < R; ++r) simd::prefetch(reinterpret_cast<const uint8_t*>(q + (kPrefetchRows + r) * d + j));
      for (int r = 0; r < R; ++r) {
        const __m128i* row = reinterpret_cast<const __m128i*>(q + r * d + j);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(row)), w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(row + 1));
        for (int b = 0; b < N; ++b) {
          const __m256i* x = reinterpret_cast<const __m256i*>(a + b * d + j);
          acc[r][b][0] = _mm256_add_epi32(acc[r][b][0], _mm256_madd_epi16(w0, _mm256_loadu_si256(x)));
          acc[r][b][1] = _mm256_add_epi32(acc[r][b][1], _mm256_madd_epi16(w1, _mm256_loadu_si256(x + 1)));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < N; ++b) {  // the lanes summed in int64
        alignas(32) int64_t lanes[4];
        __m256i wide = _mm256_setzero_si256();
        for (const __m256i& part : acc[r][b])
          wide = _mm256_add_epi64(wide, _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(part)),
                                                         _mm256_cvtepi32_epi64(_mm256_extracti128_si256(part, 1))));
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), wide);
        out[r * N + b] = lanes[0] + lanes[1] + lanes[2] + lanes[3];
      }
  }
};

}  // namespace

// The int8 screen against int16-split rows (int16_screen.h); `vnni` must be false (no VNNI path here).
std::tuple<torch::Tensor, torch::Tensor> screen_gemv_int16(torch::Tensor q, torch::Tensor scales, torch::Tensor h, bool vnni) {
  TORCH_CHECK(!vnni, "the AVX2 int16 screen has no VNNI path; pass vnni=False");
  return int16_screen<Avx2Dot>(q, scales, h);
}

namespace {

// Bounds of tokens [i, i + 8): base = c_i |h| + n_i |r| (the second term only with n), radius = base +
// slack (|center| + base), lower / upper = (center -/+ radius) inv_t (+ noise): runtime.kernels'
// screen_radius and screen_select in the same float32 operations (this module builds with
// -ffp-contract=off), so the bounds are torch's bits. at() takes 8 tokens (__m256) or one (float).
struct ScreenBounds {
  SelectInputs in;
  float hn, rn, sl, it;

  inline void at(int64_t i, __m256& lo, __m256& up) const {
    const __m256 ci = _mm256_loadu_ps(in.center + i), sign = _mm256_set1_ps(-0.0f);
    __m256 base = _mm256_mul_ps(_mm256_loadu_ps(in.coef + i), _mm256_set1_ps(hn));
    if (in.qnorm) base = _mm256_add_ps(base, _mm256_mul_ps(_mm256_loadu_ps(in.qnorm + i), _mm256_set1_ps(rn)));
    const __m256 radius = _mm256_add_ps(base, _mm256_mul_ps(_mm256_set1_ps(sl), _mm256_add_ps(_mm256_andnot_ps(sign, ci), base)));
    lo = _mm256_mul_ps(_mm256_sub_ps(ci, radius), _mm256_set1_ps(it));
    up = _mm256_mul_ps(_mm256_add_ps(ci, radius), _mm256_set1_ps(it));
    if (in.noise) {
      const __m256 gi = _mm256_loadu_ps(in.noise + i);
      lo = _mm256_add_ps(lo, gi);
      up = _mm256_add_ps(up, gi);
    }
  }
  inline void at(int64_t i, float& lo, float& up) const {
    float base = in.coef[i] * hn;
    if (in.qnorm) base = base + in.qnorm[i] * rn;
    const float radius = base + sl * (std::fabs(in.center[i]) + base);
    lo = (in.center[i] - radius) * it;
    up = (in.center[i] + radius) * it;
    if (in.noise) {
      lo = lo + in.noise[i];
      up = up + in.noise[i];
    }
  }
};

// f(i, lo, up) for every token: 8 at a time, then the last V % 8 one at a time.
template <class F>
inline void for_bounds(const ScreenBounds& bounds, int64_t V, F&& f) {
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    __m256 lo, up;
    bounds.at(i, lo, up);
    f(i, lo, up);
  }
  for (; i < V; ++i) {
    float lo, up;
    bounds.at(i, lo, up);
    f(i, _mm256_set1_ps(lo), _mm256_set1_ps(up), 1);
  }
}

}  // namespace

// One row's candidates (screen_avx512.cpp's screen_select, in 8-wide vectors): lower_i = (center_i -
// radius_i) * inv_t + noise_i, upper_i likewise with +radius_i, radius_i = base_i + slack * (|center_i| +
// base_i), base_i = coef_i * hnorm + qnorm_i * rnorm (the second term only when qnorm is not empty);
// returns the ids with upper_i >= the k-th largest lower_i. noise may be empty. Two passes, no [V] temporaries.
torch::Tensor screen_select(torch::Tensor center, torch::Tensor coef, double hnorm, torch::Tensor qnorm, double rnorm,
                            double slack, double inv_t, torch::Tensor noise, int64_t k) {
  const SelectInputs in = select_inputs(center, coef, qnorm, noise, k);
  const int64_t V = in.V;
  const ScreenBounds bounds{in, static_cast<float>(hnorm), static_cast<float>(rnorm), static_cast<float>(slack),
                            static_cast<float>(inv_t)};
  float threshold;
  if (k == 1) {  // greedy and Gumbel-max: the largest lower bound
    __m256 best = _mm256_set1_ps(-INFINITY);
    for_bounds(bounds, V, [&](int64_t, __m256 lo, __m256, int = 8) { best = _mm256_max_ps(lo, best); });
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, best);
    threshold = *std::max_element(lanes, lanes + 8);
  } else {  // the k-th largest lower bound
    KthLargest kth(k);
    alignas(32) float block[8];
    for_bounds(bounds, V, [&](int64_t, __m256 lo, __m256, int lanes = 8) {
      _mm256_store_ps(block, lo);
      for (int r = 0; r < lanes; ++r) kth.offer(block[r]);
    });
    threshold = kth.value();
  }
  const __m256 limit = _mm256_set1_ps(threshold);
  std::unique_ptr<int64_t[]> ids(new int64_t[V]);  // uninitialized: only the first `count` are written
  int64_t count = 0;
  for_bounds(bounds, V, [&](int64_t i, __m256, __m256 up, int lanes = 8) {
    unsigned hit = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(up, limit, _CMP_GE_OQ))) & ((1u << lanes) - 1);
    while (hit) {
      ids[count++] = i + __builtin_ctz(hit);
      hit &= hit - 1;
    }
  });
  auto out = torch::empty({count}, torch::kLong);
  std::copy(ids.get(), ids.get() + count, out.data_ptr<int64_t>());
  return out;
}
