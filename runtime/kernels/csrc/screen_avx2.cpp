// The int8 screen of the certified head on the AVX2 path: the int16-split screen of int16_screen.h
// with 256-bit vpmaddwd + vpaddd, the same integers as the AVX-512 path's, so the same outputs. The
// float32-activation screen and the candidate selection stay in runtime.kernels' torch code here.
#include <torch/extension.h>
#include <immintrin.h>

#include "int16_screen.h"
#include "prefetch.h"
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
