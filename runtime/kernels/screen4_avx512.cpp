// The 4-bit screen of the certified head (AVX-512 with AVX512-VNNI; elsewhere runtime.kernels' torch reference).
//
// Row i of the screen is Q_ij = D_i s_ig q_ij + m_ig over groups g of n = 32 or 64 columns (q and the
// group's multiple s of the row step D in 0..15, D float32, m float16), plus B_i ~ U^T W_i (float16), the
// row's projection on a basis U of the hidden states (runtime.heads.screen4_bound says how the bound
// uses them). A hidden row enters as its basis coordinates c [k] and its residual h - U c rounded to
// int8 values a times a power of two u:
//
//   y_i = u (D_i sum_g s_ig <q_ig, a_g> + sum_g m_ig sum(a_g)) + <B_i, c>
//
// The double sum is one exact integer dot per row: bytes s q (<= 225, made 64 at a time by one byte
// shuffle through the table of multiples of s) against a, four products per int32 lane (vpdpbusd).
// The rest is float32, whose rounding the caller bounds. Streams ~0.55 (n = 64) or ~0.6 (n = 32)
// bytes per weight against the int8 screen's 1, and its integer work per hidden row is a quarter of
// the int8 screen's, so several hidden rows cost little more than one.
//
// Layout: codes [V, d / 2] bytes, group g at bytes g n/2 .. (g + 1) n/2 - 1, byte j = q[g n + j] |
// q[g n + n/2 + j] << 4 (ggml's Q4_1 order at n = 32); d % 64 == 0. A step reads 32 bytes (64 columns),
// widens them to words and puts each word's two nibbles in its two bytes: byte 2j is the low nibble of
// code byte j, byte 2j + 1 its high nibble; a is reordered once per call to match. The step's 128-bit
// lane l holds code bytes 8l .. 8l + 7: one group at n = 64; at n = 32 groups 2t (lanes 0, 1) and 2t + 1
// (lanes 2, 3), so the shuffle's table is one broadcast, or two.
#pragma GCC optimize("fp-contract=fast")

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "prefetch.h"
#include "simd_avx512.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxCols4 = 8192;  // every int32 lane then stays below 2^24 (exact as float32)
constexpr int64_t kAhead4 = 8;  // rows ahead to prefetch
constexpr int kBatch4 = 8;      // hidden rows per pass
constexpr int rows4_for(int n) { return n <= 2 ? 4 : 2; }  // vocab rows per pass (R n <= 16 accumulators)

// of[s] = the 16 bytes s q for q = 0..15: the shuffle table of a group with multiple s.
struct Multiples {
  alignas(16) uint8_t of[16][16];
  Multiples() {
    for (int s = 0; s < 16; ++s)
      for (int q = 0; q < 16; ++q) of[s][q] = static_cast<uint8_t>(s * q);
  }
};
const Multiples kMultiples;

inline __m512i table_of(uint8_t multiple) {
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kMultiples.of[multiple & 15])));
}

// acc += per int32 lane the four products of unsigned bytes w and signed bytes a (AVX512-VNNI).
inline __m512i dot_bytes(__m512i acc, __m512i w, __m512i a) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));  // the module is not built with -mavx512vnni
  return acc;
}

// min(n, 16) float16 values as float32 lanes, the rest +0 (a masked load: no read past the row).
inline __m512 half_lanes(const uint16_t* src, int64_t n) {
  const __mmask32 mask = n >= 16 ? static_cast<__mmask32>(0xFFFF) : static_cast<__mmask32>((1u << n) - 1);
  return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(mask, src)));
}

// One hidden row, prepared once per call.
struct Prepared {
  const int8_t* a;      // [d] in the kernel's order
  const float* sums;    // [G padded to 16] sum of a over group g (exact: |sum| <= 64 * 127)
  const float* coords;  // [k] c
  float unit;           // u, a power of two
};

struct Screen4 {
  const uint8_t* codes;        // [V, d/2]
  const uint8_t* multiples;    // [V, G]
  const float* row_step;       // [V] D
  const uint16_t* mins;        // [V, G] float16 bits
  const uint16_t* projection;  // [V, k] float16 bits
  int64_t d, G, k;
};

// R vocab rows from `row` against N prepared hidden rows: y[b * V + row + r].
template <int R, int N>
inline void rows4_dot(const Screen4& s, int64_t row, const Prepared* h, bool prefetch, float* y, int64_t V) {
  const int64_t rb = s.d / 2, G = s.G;
  const bool two_groups = G * 64 != s.d;  // n = 32: two groups per step
  if (prefetch) {  // the rows' multiples, minimums and projections, one row group ahead
    for (int64_t off = 0; off < G * R; off += 64) simd::prefetch(s.multiples + (row + kAhead4) * G + off);
    for (int64_t off = 0; off < 2 * G * R; off += 64) simd::prefetch(reinterpret_cast<const uint8_t*>(s.mins + (row + kAhead4) * G) + off);
    for (int64_t off = 0; off < 2 * s.k * R; off += 64) simd::prefetch(reinterpret_cast<const uint8_t*>(s.projection + (row + kAhead4) * s.k) + off);
  }
  __m512i acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < N; ++b) acc[r][b] = _mm512_setzero_si512();
  const __m512i nibbles = _mm512_set1_epi16(0x0F0F);
  for (int64_t t = 0; t < s.d / 64; ++t) {
    if (prefetch && t % 2 == 0)
      for (int r = 0; r < R; ++r) simd::prefetch(s.codes + (row + kAhead4 + r) * rb + 32 * t);
    __m512i w[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* multiple = s.multiples + (row + r) * G;
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.codes + (row + r) * rb + 32 * t)));
      // (word | word << 4) & 0x0F0F: the low nibble in the low byte, the high nibble in the high byte
      const __m512i q = _mm512_ternarylogic_epi32(bytes, _mm512_slli_epi16(bytes, 4), nibbles, 0xA8);
      const __m512i table = two_groups ? _mm512_mask_broadcast_i32x4(table_of(multiple[2 * t]), 0xFF00,
                                                                     _mm_load_si128(reinterpret_cast<const __m128i*>(kMultiples.of[multiple[2 * t + 1] & 15])))
                                       : table_of(multiple[t]);
      w[r] = _mm512_shuffle_epi8(table, q);
    }
    for (int b = 0; b < N; ++b) {
      const __m512i a = _mm512_loadu_si512(h[b].a + 64 * t);
      for (int r = 0; r < R; ++r) acc[r][b] = dot_bytes(acc[r][b], w[r], a);
    }
  }
  simd::V out[R * N];
  for (int r = 0; r < R; ++r) {
    __m512 x[N];
    const __m512 step = _mm512_set1_ps(s.row_step[row + r]);
    for (int b = 0; b < N; ++b) x[b] = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][b]), step);  // |lane| < 2^24: exact conversion
    for (int64_t g = 0; g < G; g += 16) {  // the minimums: m_g sum(a_g) (lanes past G: 0 * 0)
      const __m512 m = half_lanes(s.mins + (row + r) * G + g, G - g);
      for (int b = 0; b < N; ++b) x[b] = _mm512_fmadd_ps(m, _mm512_loadu_ps(h[b].sums + g), x[b]);
    }
    for (int b = 0; b < N; ++b) x[b] = _mm512_mul_ps(x[b], _mm512_set1_ps(h[b].unit));  // a power of two: exact
    for (int64_t j = 0; j < s.k; j += 16) {  // the projection: <B_i, c>
      const __m512 p = half_lanes(s.projection + (row + r) * s.k + j, 16);
      for (int b = 0; b < N; ++b) x[b] = _mm512_fmadd_ps(p, _mm512_loadu_ps(h[b].coords + j), x[b]);
    }
    for (int b = 0; b < N; ++b) out[r * N + b] = {x[b]};
  }
  simd::reduce_rows<R, N>(out, y + row, V);
}

template <int N>
void rows4_range(const Screen4& s, const Prepared* h, int64_t begin, int64_t end, float* y, int64_t V) {
  constexpr int R = rows4_for(N);
  int64_t i = begin;
  for (; i + R <= end; i += R) rows4_dot<R, N>(s, i, h, i + kAhead4 + R <= end, y, V);
  for (; i < end; ++i) rows4_dot<1, N>(s, i, h, false, y, V);
}

template <int N>
void rows4_batch(int64_t count, const Screen4& s, const Prepared* h, int64_t begin, int64_t end, float* y, int64_t V) {
  if constexpr (N > 1) {
    if (count < N) return rows4_batch<N - 1>(count, s, h, begin, end, y, V);
  }
  rows4_range<N>(s, h, begin, end, y, V);
}

}  // namespace

// codes [V, d/2] uint8, multiples [V, G] uint8 (G = d/32 or d/64), row_step [V] float32, mins [V, G] float16,
// projection [V, k] float16 (k % 16 == 0), residual [B, d] int8 (|a| <= 127), unit [B] float32 (powers of two),
// coords [B, k] float32 -> y [B, V] float32.
torch::Tensor screen4_gemv(torch::Tensor codes, torch::Tensor multiples, torch::Tensor row_step, torch::Tensor mins,
                           torch::Tensor projection, torch::Tensor residual, torch::Tensor unit, torch::Tensor coords) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2, "codes: contiguous [V, d/2] uint8");
  const int64_t V = codes.size(0), d = codes.size(1) * 2, G = multiples.dim() == 2 ? multiples.size(1) : 0;
  TORCH_CHECK(d % 64 == 0 && d <= kMaxCols4, "the 4-bit screen needs d % 64 == 0 and d <= ", kMaxCols4);
  TORCH_CHECK(G == d / 32 || G == d / 64, "groups of 32 or 64 columns");
  const int64_t group = d / G;
  TORCH_CHECK(multiples.dtype() == torch::kUInt8 && multiples.is_contiguous() && multiples.size(0) == V, "multiples: [V, G] uint8");
  TORCH_CHECK(row_step.dtype() == torch::kFloat32 && row_step.is_contiguous() && row_step.numel() == V, "row_step: [V] float32");
  TORCH_CHECK(mins.scalar_type() == torch::kFloat16 && mins.is_contiguous() && mins.size(0) == V && mins.size(1) == G, "mins: [V, G] float16");
  TORCH_CHECK(projection.scalar_type() == torch::kFloat16 && projection.is_contiguous() && projection.size(0) == V &&
              projection.size(1) % 16 == 0 && projection.size(1) <= kMaxCols4 / 4, "projection: [V, k] float16, k % 16 == 0");
  TORCH_CHECK(residual.dtype() == torch::kInt8 && residual.dim() == 2 && residual.size(1) == d, "residual: [B, d] int8");
  const int64_t B = residual.size(0), k = projection.size(1);
  TORCH_CHECK(unit.dtype() == torch::kFloat32 && unit.numel() == B, "unit: [B] float32");
  TORCH_CHECK(coords.dtype() == torch::kFloat32 && coords.dim() == 2 && coords.size(0) == B && coords.size(1) == k, "coords: [B, k] float32");
  residual = residual.contiguous();
  unit = unit.contiguous();
  coords = coords.contiguous();
  const int64_t Gp = (G + 15) / 16 * 16;
  std::vector<int8_t> reordered(static_cast<size_t>(B * d));
  std::vector<float> sums(static_cast<size_t>(B * Gp), 0.f);
  std::vector<Prepared> prepared(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int8_t* natural = residual.data_ptr<int8_t>() + b * d;
    int8_t* a = reordered.data() + b * d;
    for (int64_t t = 0; t < d / 64; ++t)
      for (int64_t j = 0; j < 32; ++j) {  // code byte j of the step: group j / (n/2), its columns jj and jj + n/2
        const int64_t local = j / (group / 2), jj = j % (group / 2), column = 64 * t + local * group + jj;
        a[64 * t + 2 * j] = natural[column];
        a[64 * t + 2 * j + 1] = natural[column + group / 2];
      }
    for (int64_t g = 0; g < G; ++g) {
      int32_t total = 0;
      for (int64_t j = 0; j < group; ++j) total += natural[group * g + j];
      sums[b * Gp + g] = static_cast<float>(total);
    }
    prepared[b] = {a, sums.data() + b * Gp, coords.data_ptr<float>() + b * k, unit.data_ptr<float>()[b]};
  }
  const Screen4 s{codes.data_ptr<uint8_t>(), multiples.data_ptr<uint8_t>(), row_step.data_ptr<float>(),
                  reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()),
                  reinterpret_cast<const uint16_t*>(projection.data_ptr<at::Half>()), d, G, k};
  auto y = torch::empty({B, V}, coords.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, V, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = 0; b0 < B; b0 += kBatch4)
      rows4_batch<kBatch4>(std::min<int64_t>(kBatch4, B - b0), s, prepared.data() + b0, begin, end, yp + b0 * V, V);
  });
  return y;
}
