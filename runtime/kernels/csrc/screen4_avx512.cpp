// The 4-bit screen of the certified head on the AVX-512 paths (screen4.h: the layout and the arithmetic).
#include <torch/extension.h>
#include <immintrin.h>

#include "simd_avx512.h"
#include "screen4.h"

#include <cstring>

namespace {

// acc += the u8 x s8 dot of each lane's 4 bytes of w with the 4 bytes at a (broadcast to every lane).
template <bool Vnni>
inline __m512i dot_bytes(__m512i acc, __m512i w, const int8_t* a) {
  if constexpr (Vnni) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(a)));  // AVX512-VNNI
    return acc;
  } else {
    int32_t word;
    std::memcpy(&word, a, 4);
    const __m512i pairs = _mm512_maddubs_epi16(w, _mm512_set1_epi32(word));  // |q hi + q hi| <= 3840: no saturation
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
}

// Panel `panel` against N prepared hidden rows: y[b * V + 16 panel + L] for the panel's real rows.
template <bool Vnni, int N>
inline void panel_dot(const Panels& p, int64_t panel, const Prepared* h, float* y) {
  const uint8_t* base = p.base + panel * p.panel_bytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[N];
  for (int b = 0; b < N; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    const uint8_t* group = base + g * p.group_bytes;
    prefetch_ahead(p, panel, g);
    const __m512 scale = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(group + 8 * p.n)));
    for (int64_t half = 0; half < p.n / 32; ++half) {
      // Two int32 chains per hidden row: the high and the low bytes of a.
      __m512i high[N], low[N];
      for (int b = 0; b < N; ++b) high[b] = low[b] = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        const __m512i z = _mm512_load_si512(group + (4 * half + v) * 64);
        const __m512i q0 = _mm512_and_si512(z, low4), q1 = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);
        const int64_t j = g * p.n + 32 * half + 8 * v;
        for (int b = 0; b < N; ++b) {
          high[b] = dot_bytes<Vnni>(high[b], q0, h[b].hi + j);
          low[b] = dot_bytes<Vnni>(low[b], q0, h[b].lo + j);
        }
        for (int b = 0; b < N; ++b) {
          high[b] = dot_bytes<Vnni>(high[b], q1, h[b].hi + j + 4);
          low[b] = dot_bytes<Vnni>(low[b], q1, h[b].lo + j + 4);
        }
      }
      for (int b = 0; b < N; ++b) {
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(high[b], 8), low[b]);
        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[b]);
      }
    }
    const __m512 mins = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(group + 8 * p.n + 32)));
    for (int b = 0; b < N; ++b) acc[b] = _mm512_fmadd_ps(mins, _mm512_set1_ps(h[b].sums[g]), acc[b]);
  }
  const uint8_t* corr = base + p.G * p.group_bytes;
  const __m512 corr_scale = _mm512_load_ps(reinterpret_cast<const float*>(corr + kLanes * p.k));
  for (int64_t j = 0; j < p.k; ++j) {  // the correction: fl(s_i p_ij) 2^-e c_j
    const __m128i raw = _mm_load_si128(reinterpret_cast<const __m128i*>(corr + kLanes * j));
    const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), corr_scale);
    for (int b = 0; b < N; ++b) acc[b] = _mm512_fmadd_ps(scaled, _mm512_set1_ps(h[b].coords[j]), acc[b]);
  }
  const int64_t row = panel * kLanes;
  for (int b = 0; b < N; ++b)  // the padded last panel: its real rows only
    simd::store_first(y + b * p.V + row, {_mm512_mul_ps(acc[b], _mm512_set1_ps(h[b].step))}, p.V - row);
}

// Panels begin .. end - 1 against `count` (<= N) prepared hidden rows in one pass.
template <bool Vnni, int N>
void panels_batch(int64_t count, const Panels& p, const Prepared* h, int64_t begin, int64_t end, float* y) {
  if constexpr (N > 1) {
    if (count < N) return panels_batch<Vnni, N - 1>(count, p, h, begin, end, y);
  }
  for (int64_t i = begin; i < end; ++i) panel_dot<Vnni, N>(p, i, h, y);
}

template <bool Vnni>
struct Avx512Panels {
  static constexpr int kBatch = 4;  // hidden rows per pass over the panels
  static void panels(int64_t count, const Panels& p, const Prepared* h, int64_t begin, int64_t end, float* y) {
    panels_batch<Vnni, kBatch>(count, p, h, begin, end, y);
  }
};

}  // namespace

// screen4.h's screen4_with, the dots by vpdpbusd when `vnni` (the CPU reports avx512_vnni).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> screen4_gemv(torch::Tensor packed, int64_t V, int64_t n, torch::Tensor h,
                                                                     torch::Tensor coords, bool vnni) {
  return vnni ? screen4_with<Avx512Panels<true>>(packed, V, n, h, coords) : screen4_with<Avx512Panels<false>>(packed, V, n, h, coords);
}
