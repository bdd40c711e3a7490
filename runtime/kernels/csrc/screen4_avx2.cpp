// The 4-bit screen of the certified head on the AVX2 path (screen4.h: the layout and the arithmetic):
// each panel of 16 rows as two halves of 8, the dots by vpmaddubsw + vpmaddwd on 256 bits. Every row
// gets the AVX-512 path's integers and float32 operations, so its outputs.
#include <torch/extension.h>
#include <immintrin.h>

#include "simd_avx2.h"
#include "screen4.h"

#include <cstring>

namespace {

// The u8 x s8 products of each lane's 4 bytes of w with the 4 bytes at a (broadcast to every lane), summed
// in pairs: 16-bit lanes of at most 2 * 15 * 128 = 3840 in magnitude, so eight of them add without overflow.
inline __m256i byte_pairs(__m256i w, const int8_t* a) {
  int32_t word;
  std::memcpy(&word, a, 4);
  return _mm256_maddubs_epi16(w, _mm256_set1_epi32(word));
}

// Rows 8 Half .. 8 Half + 7 of panel `panel` against N prepared hidden rows: y[b * V + 16 panel + 8 Half + L]
// for the real rows. Each 64-byte vector, scale and min row of the panel holds lanes 0..15; this half reads 8 of them.
template <int Half, int N>
inline void half_panel(const Panels& p, int64_t panel, const Prepared* h, float* y) {
  const uint8_t* base = p.base + panel * p.panel_bytes;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[N];
  for (int b = 0; b < N; ++b) acc[b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    const uint8_t* group = base + g * p.group_bytes;
    if constexpr (Half == 0) prefetch_ahead(p, panel, g);  // the second half reads the same lines
    const __m256 scale = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(group + 8 * p.n + 16 * Half)));
    for (int64_t half = 0; half < p.n / 32; ++half) {
      // Two 16-bit chains per hidden row, the high and the low bytes of a: eight pair sums each over the
      // 32 columns, then one vpmaddwd each into int32 (the same integers as the AVX-512 path's order).
      __m256i high[N], low[N];
      for (int b = 0; b < N; ++b) high[b] = low[b] = _mm256_setzero_si256();
      for (int v = 0; v < 4; ++v) {
        const __m256i z = _mm256_load_si256(reinterpret_cast<const __m256i*>(group + (4 * half + v) * 64 + 32 * Half));
        const __m256i q0 = _mm256_and_si256(z, low4), q1 = _mm256_and_si256(_mm256_srli_epi16(z, 4), low4);
        const int64_t j = g * p.n + 32 * half + 8 * v;
        for (int b = 0; b < N; ++b) {
          high[b] = _mm256_add_epi16(high[b], _mm256_add_epi16(byte_pairs(q0, h[b].hi + j), byte_pairs(q1, h[b].hi + j + 4)));
          low[b] = _mm256_add_epi16(low[b], _mm256_add_epi16(byte_pairs(q0, h[b].lo + j), byte_pairs(q1, h[b].lo + j + 4)));
        }
      }
      const __m256i ones = _mm256_set1_epi16(1);
      for (int b = 0; b < N; ++b) {
        const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(high[b], ones), 8), _mm256_madd_epi16(low[b], ones));
        acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[b]);
      }
    }
    const __m256 mins = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(group + 8 * p.n + 32 + 16 * Half)));
    for (int b = 0; b < N; ++b) acc[b] = _mm256_fmadd_ps(mins, _mm256_set1_ps(h[b].sums[g]), acc[b]);
  }
  const uint8_t* corr = base + p.G * p.group_bytes;
  const __m256 corr_scale = _mm256_load_ps(reinterpret_cast<const float*>(corr + kLanes * p.k) + 8 * Half);
  for (int64_t j = 0; j < p.k; ++j) {  // the correction: fl(s_i p_ij) 2^-e c_j
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(corr + kLanes * j + 8 * Half));
    const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), corr_scale);
    for (int b = 0; b < N; ++b) acc[b] = _mm256_fmadd_ps(scaled, _mm256_set1_ps(h[b].coords[j]), acc[b]);
  }
  const int64_t row = panel * kLanes + 8 * Half, real = std::min<int64_t>(8, p.V - row);  // the padded last panel
  for (int b = 0; b < N && real > 0; ++b) {
    alignas(32) float out[8];
    _mm256_store_ps(out, _mm256_mul_ps(acc[b], _mm256_set1_ps(h[b].step)));
    std::memcpy(y + b * p.V + row, out, static_cast<size_t>(real) * sizeof(float));
  }
}

// Panels begin .. end - 1 against `count` (<= N) prepared hidden rows in one pass.
template <int N>
void panels_batch(int64_t count, const Panels& p, const Prepared* h, int64_t begin, int64_t end, float* y) {
  if constexpr (N > 1) {
    if (count < N) return panels_batch<N - 1>(count, p, h, begin, end, y);
  }
  for (int64_t i = begin; i < end; ++i) {
    half_panel<0, N>(p, i, h, y);
    half_panel<1, N>(p, i, h, y);  // the panel's bytes are in L1 from the first half
  }
}

struct Avx2Panels {
  static constexpr int kBatch = 3;  // hidden rows per pass: 3 N accumulators and 6 operands in the 16 ymm
  static void panels(int64_t count, const Panels& p, const Prepared* h, int64_t begin, int64_t end, float* y) {
    panels_batch<kBatch>(count, p, h, begin, end, y);
  }
};

}  // namespace

// screen4.h's screen4_with; `vnni` must be false (no VNNI path here).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> screen4_gemv(torch::Tensor packed, int64_t V, int64_t n, torch::Tensor h,
                                                                     torch::Tensor coords, bool vnni) {
  TORCH_CHECK(!vnni, "the AVX2 4-bit screen has no VNNI path; pass vnni=False");
  return screen4_with<Avx2Panels>(packed, V, n, h, coords);
}
