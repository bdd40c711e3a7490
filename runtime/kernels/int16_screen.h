// The integer screens' shared parts: the exact int16 split of a hidden row, and int16 pair dot products.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <immintrin.h>

namespace {

// Row h [d] -> a [d] int16 with h = 2^e a + r; returns 2^e and writes |r| (float64, rounded up).
// A row with a non-finite value, or with max |h| outside [2^-60, 2^60] (where the float32 products
// after the integer dot could underflow or overflow), gets a = 0 and |r| = inf: the caller then
// screens it with float32 activations.
inline float split_int16(const float* h, int64_t d, int16_t* a, double* remainder_norm) {
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
  std::frexp(static_cast<double>(amax) / 32767.0, &e);  // 2^(e-1) <= amax / 32767 < 2^e
  while (std::ldexp(static_cast<double>(amax), -e) > 32767.0) ++e;  // t was rounded: make sure it fits
  while (std::ldexp(static_cast<double>(amax), -(e - 1)) <= 32767.0) --e;  // the smallest e that fits (amax > 0)
  double sum = 0.0;
  for (int64_t j = 0; j < d; ++j) {
    const double v = std::nearbyint(std::ldexp(static_cast<double>(h[j]), -e));  // |v| <= 32767
    a[j] = static_cast<int16_t>(v);
    const double r = static_cast<double>(h[j]) - std::ldexp(v, e);  // exact: both are multiples of h's ulp
    sum += r * r;
  }
  *remainder_norm = std::sqrt(sum) * (1.0 + 1e-12);  // d <= 8192 roundings of 2^-53 each, relative
  return static_cast<float>(std::ldexp(1.0, e));
}

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

}  // namespace
