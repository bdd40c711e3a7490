// The integer screens' shared parts: the exact int16 split of a hidden row, the int16 pair dot
// products of AVX-512, and the int8 screen against int16 rows that each ISA instantiates with its
// own dot products (screen_avx512.cpp, screen_avx2.cpp).
//
// Each hidden row h is split exactly as h = 2^e * a + r with a int16 (|a| <= 32767, e the smallest
// exponent that fits max |h|) and r the rounding remainder, |r_j| <= 2^(e - 1). Then
// <s q, h> = s 2^e <q, a> + s <q, r>: the first term is an exact integer dot product, the second is
// bounded by |s q| |r|, which the caller adds to the radius. The dot's int8 x int16 pairs are summed
// in int32 lanes, each lane at most d / 32 pair sums of <= 2 * 128 * 32767 < 2^23 (no overflow while
// d <= kMaxIntCols), and the lanes in int64: a whole row's dot reaches d * 128 * 32767, past int32
// from d = 512 on.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include "pool.h"
#include "prefetch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kMaxIntCols = 8192;

// Row h [d] -> a [d] int16 with h = 2^e a + r, |a| <= limit (<= 32767); returns 2^e and writes |r|
// (float64, rounded up).
// A row with a non-finite value, or with max |h| outside [2^-60, 2^60] (where the float32 products
// after the integer dot could underflow or overflow), gets a = 0 and |r| = inf: the caller then
// screens it with float32 activations.
inline float split_int16(const float* h, int64_t d, int16_t* a, double* remainder_norm, int limit = 32767) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t j = 0; j < d; ++j) {
    finite = finite && std::isfinite(h[j]);
    amax = std::max(amax, std::fabs(h[j]));
  }
  if (!finite || amax < 0x1p-60f || amax > 0x1p60f) {  // (amax == 0 included: a = 0, |r| = 0)
    std::fill(a, a + d, int16_t{0});
    *remainder_norm = amax == 0.f && finite ? 0.0 : INFINITY;
    return 1.f;
  }
  int e;
  const double top = limit;
  std::frexp(static_cast<double>(amax) / top, &e);  // 2^(e-1) <= amax / limit < 2^e
  while (std::ldexp(static_cast<double>(amax), -e) > top) ++e;  // t was rounded: make sure it fits
  while (std::ldexp(static_cast<double>(amax), -(e - 1)) <= top) --e;  // the smallest e that fits (amax > 0)
  double sum = 0.0;
  for (int64_t j = 0; j < d; ++j) {
    const double v = std::nearbyint(std::ldexp(static_cast<double>(h[j]), -e));  // |v| <= limit
    a[j] = static_cast<int16_t>(v);
    const double r = static_cast<double>(h[j]) - std::ldexp(v, e);  // exact: both are multiples of h's ulp
    sum += r * r;
  }
  *remainder_norm = std::sqrt(sum) * (1.0 + 1e-12);  // d <= 8192 roundings of 2^-53 each, relative
  return static_cast<float>(std::ldexp(1.0, e));
}

#if defined(__AVX512F__)
// acc += pairwise w * a (int16 -> int32): vpdpwssd (AVX512-VNNI, chosen at run time) or vpmaddwd + vpaddd,
// the same integers.
template <bool Vnni>
inline __m512i dot_pairs(__m512i acc, __m512i w, __m512i a) {
  if constexpr (Vnni) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));  // AVX512-VNNI, chosen at run time
    return acc;
  } else {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, a));
  }
}
#endif

// Weight rows [begin, end) against N hidden rows: y[b * V + i] = float(dot) * scale[i] * step[b].
// Dot::rows<R, N>(q, a, d, prefetch, out) writes the R x N exact dots of R int8 rows (stride d) and N
// int16 rows (stride d) to out[r * N + b]; Dot::rows_for(N) is R, Dot::kBatch the most rows of x per pass.
template <class Dot, int N>
void int_rows_range(const int8_t* q, const float* scale, const int16_t* a, const float* step, int64_t d, int64_t V,
                    int64_t begin, int64_t end, float* y) {
  constexpr int R = Dot::rows_for(N);
  int64_t dots[R * N];
  int64_t i = begin;
  for (; i + R <= end; i += R) {
    Dot::template rows<R, N>(q + i * d, a, d, i + kPrefetchRows + R <= V, dots);  // V: on into the next chunk
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < N; ++b) y[b * V + i + r] = static_cast<float>(dots[r * N + b]) * scale[i + r] * step[b];
  }
  for (; i < end; ++i) {
    Dot::template rows<1, N>(q + i * d, a, d, false, dots);
    for (int b = 0; b < N; ++b) y[b * V + i] = static_cast<float>(dots[b]) * scale[i] * step[b];
  }
}

// count (1..N) hidden rows: the largest instantiation that fits.
template <class Dot, int N>
void int_rows_batch(int64_t count, const int8_t* q, const float* scale, const int16_t* a, const float* step, int64_t d,
                    int64_t V, int64_t begin, int64_t end, float* y) {
  if constexpr (N > 1) {
    if (count < N) return int_rows_batch<Dot, N - 1>(count, q, scale, a, step, d, V, begin, end, y);
  }
  int_rows_range<Dot, N>(q, scale, a, step, d, V, begin, end, y);
}

// q: [V, d] int8 (d % 32 == 0, d <= kMaxIntCols), scales: [V, 1] fp32, h: [B, d] fp32 ->
// (y [B, V] fp32 = scale_i 2^e_b <q_i, a_b>, remainder_norm [B] float64 = |h_b - 2^e_b a_b|).
template <class Dot>
std::tuple<torch::Tensor, torch::Tensor> int16_screen(torch::Tensor q, torch::Tensor scales, torch::Tensor h) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous() && q.dim() == 2, "q must be contiguous [V, d] int8");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == q.size(0), "scales must be [V, 1] float32");
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2 && h.size(1) == q.size(1), "h must be [B, d] float32");
  const int64_t V = q.size(0), d = q.size(1), B = h.size(0);
  TORCH_CHECK(d % 32 == 0 && d <= kMaxIntCols, "the int16 screen needs d % 32 == 0 and d <= ", kMaxIntCols);
  h = h.contiguous();
  std::vector<int16_t> a(static_cast<size_t>(B * d));
  std::vector<float> step(static_cast<size_t>(B));
  auto remainder = torch::empty({B}, torch::kFloat64);
  for (int64_t b = 0; b < B; ++b)
    step[b] = split_int16(h.data_ptr<float>() + b * d, d, a.data() + b * d, remainder.data_ptr<double>() + b);
  auto y = torch::empty({B, V}, h.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  sv_pool::parallel_for(V, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = 0; b0 < B; b0 += Dot::kBatch) {
      const int64_t count = std::min<int64_t>(Dot::kBatch, B - b0);
      int_rows_batch<Dot, Dot::kBatch>(count, qp, sp, a.data() + b0 * d, step.data() + b0, d, V, begin, end, yp + b0 * V);
    }
  });
  return {y, remainder};
}

}  // namespace
