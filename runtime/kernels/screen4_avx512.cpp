// The 4-bit screen of the certified head (AVX-512 paths; elsewhere runtime.kernels' torch fallback).
//
// Row i of the screen is Q_ij = d_ig * q_ij + m_ig over groups g of n = 32 or 64 columns (q in 0..15, d
// and m float16), plus a low-rank correction: k int8 values p_i with a float32 scale s_i, the row's
// quantization error W_i - Q_i projected on a basis U of the hidden states (runtime.heads.
// screen4_bound says how the bound uses it). Per hidden row h, split exactly as h = 2^e a + r
// (int16_screen.h), and its basis coordinates c [k]:
//
//   y_i = 2^e (sum_g d_ig <q_ig, a_g> + m_ig sum(a_g)) + s_i <p_i, c_eff>,   c_eff = 2^e fl(2^-e c)
//
// <q_ig, a_g> is an exact integer dot (int4 x int16 pairs, vpdpwssd where the CPU reports
// avx512_vnni, vpmaddwd otherwise: the same integers); the rest is float32, whose rounding the
// caller bounds. Streams ~0.6 bytes per weight against the int8 screen's 1.
//
// Layout: codes [V, d / 2] bytes, group g at bytes g n/2 .. (g + 1) n/2 - 1, byte j = q[g n + j] |
// q[g n + n/2 + j] << 4 (ggml's Q4_1 order at n = 32); d % 64 == 0. A step reads 32 bytes, 64 columns,
// whose low nibbles zero-extended to words go against one vector of a and the high nibbles against
// the next. n = 64: one group, a in its own order. n = 32: the groups 2t and 2t + 1 (low nibbles:
// elements 0..15 of both, high: 16..31), a reordered once per call to match, so dword lanes 0..7 of
// the step sum group 2t and 8..15 group 2t + 1.
#pragma GCC optimize("fp-contract=fast")

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "int16_screen.h"
#include "prefetch.h"
#include "simd_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxCols4 = 8192;   // int16 split and stack buffers: d <= 8192 (256 groups)
constexpr int kMaxGroups = kMaxCols4 / 32;
constexpr int64_t kAhead4 = 8;  // rows ahead to prefetch (a row is half the int8 screen's)
constexpr int kBatch4 = 4;            // hidden rows per pass
constexpr int rows4_for(int n) { return n <= 2 ? 4 : 2; }  // vocab rows per pass

// G float16 values -> float32, padded with zeros to a multiple of 16 (masked loads: no read past the row).
inline void halves_to_float(const uint16_t* src, int64_t G, float* dst) {
  for (int64_t g = 0; g < G; g += 16) {
    const int64_t n = std::min<int64_t>(16, G - g);
    const __m512i raw = _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << n) - 1), src + g);
    _mm512_storeu_ps(dst + g, _mm512_cvtph_ps(_mm512_castsi512_si256(raw)));
  }
}

// One hidden row, prepared once per call: a in the kernel's order, its group sums, c scaled by 2^-e.
struct Prepared {
  const int16_t* a;     // [d] reordered
  const float* sums;    // [G padded to 16] float(sum of a over group g), exact (|sum| < 2^21)
  const float* coords;  // [k] fl(2^-e c)
  float step;           // 2^e
};

struct Screen4 {
  const uint8_t* codes;
  const uint16_t* scales;  // [V, G] float16 bits
  const uint16_t* mins;    // [V, G]
  const int8_t* corr;      // [V, k]
  const float* corr_scale; // [V]
  int64_t d, G, k;  // G = d / n
};

// R vocab rows from `row` against N prepared hidden rows: y[b * V + row + r].
template <bool Vnni, int R, int N>
inline void rows4_dot(const Screen4& s, int64_t row, const Prepared* h, bool prefetch, float* y, int64_t V) {
  const int64_t rb = s.d / 2, G = s.G, Gp = (G + 15) / 16 * 16;
  if (prefetch) {  // the rows' scales, minimums and correction, one row group ahead
    for (int64_t off = 0; off < 2 * G * R; off += 64) {
      simd::prefetch(reinterpret_cast<const uint8_t*>(s.scales + (row + kAhead4) * G) + off);
      simd::prefetch(reinterpret_cast<const uint8_t*>(s.mins + (row + kAhead4) * G) + off);
    }
    for (int64_t off = 0; off < s.k * R; off += 64) simd::prefetch(reinterpret_cast<const uint8_t*>(s.corr + (row + kAhead4) * s.k) + off);
  }
  alignas(64) float sc[R][kMaxGroups], mn[R][kMaxGroups];
  for (int r = 0; r < R; ++r) {
    halves_to_float(s.scales + (row + r) * G, G, sc[r]);
    halves_to_float(s.mins + (row + r) * G, G, mn[r]);
  }
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < N; ++b) acc[r][b] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  for (int64_t t = 0; t < s.d / 64; ++t) {
    if (prefetch && t % 2 == 0)
      for (int r = 0; r < R; ++r) simd::prefetch(s.codes + (row + kAhead4 + r) * rb + 32 * t);
    __m512i lo[R], hi[R];
    __m512 scale[R];
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.codes + (row + r) * rb + 32 * t)));
      lo[r] = _mm512_and_si512(w, low4);
      hi[r] = _mm512_srli_epi16(w, 4);
      scale[r] = G * 64 == s.d ? _mm512_set1_ps(sc[r][t])  // n = 64
                               : _mm512_mask_mov_ps(_mm512_set1_ps(sc[r][2 * t]), 0xFF00, _mm512_set1_ps(sc[r][2 * t + 1]));
    }
    for (int b = 0; b < N; ++b) {
      const __m512i alo = _mm512_loadu_si512(h[b].a + 64 * t), ahi = _mm512_loadu_si512(h[b].a + 64 * t + 32);
      for (int r = 0; r < R; ++r) {
        const __m512i dots = dot_pairs<Vnni>(dot_pairs<Vnni>(_mm512_setzero_si512(), lo[r], alo), hi[r], ahi);
        acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale[r], acc[r][b]);
      }
    }
  }
  for (int64_t g = 0; g < Gp; g += 16) {  // the minimums: m_g * sum(a_g) (padding lanes are 0 * 0)
    for (int r = 0; r < R; ++r) {
      const __m512 m = _mm512_load_ps(mn[r] + g);
      for (int b = 0; b < N; ++b) acc[r][b] = _mm512_fmadd_ps(m, _mm512_loadu_ps(h[b].sums + g), acc[r][b]);
    }
  }
  for (int64_t j = 0; j < s.k; j += 16) {  // the correction: s_i p_i . 2^-e c
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.corr + (row + r) * s.k + j))));
      const __m512 ps = _mm512_mul_ps(p, _mm512_set1_ps(s.corr_scale[row + r]));
      for (int b = 0; b < N; ++b) acc[r][b] = _mm512_fmadd_ps(ps, _mm512_loadu_ps(h[b].coords + j), acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < N; ++b) y[b * V + row + r] = _mm512_reduce_add_ps(acc[r][b]) * h[b].step;
}

template <bool Vnni, int N>
void rows4_range(const Screen4& s, const Prepared* h, int64_t begin, int64_t end, float* y, int64_t V) {
  constexpr int R = rows4_for(N);
  int64_t i = begin;
  for (; i + R <= end; i += R) rows4_dot<Vnni, R, N>(s, i, h, i + kAhead4 + R <= end, y, V);
  for (; i < end; ++i) rows4_dot<Vnni, 1, N>(s, i, h, false, y, V);
}

template <bool Vnni, int N>
void rows4_batch(int64_t count, const Screen4& s, const Prepared* h, int64_t begin, int64_t end, float* y, int64_t V) {
  if constexpr (N > 1) {
    if (count < N) return rows4_batch<Vnni, N - 1>(count, s, h, begin, end, y, V);
  }
  rows4_range<Vnni, N>(s, h, begin, end, y, V);
}

}  // namespace

// codes [V, d/2] uint8, scales / mins [V, G] float16 (G = d/32 or d/64), corr [V, k] int8 (k % 16 == 0), corr_scale [V] float32,
// h [B, d] float32, coords [B, k] float32 -> (y [B, V] float32, |r| [B] float64 of the int16 split (inf: the
// split does not apply to that row, screen it elsewhere), c_eff [B, k] float32).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> screen4_gemv(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                                                                     torch::Tensor corr, torch::Tensor corr_scale, torch::Tensor h,
                                                                     torch::Tensor coords, bool vnni) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2, "codes: contiguous [V, d/2] uint8");
  const int64_t V = codes.size(0), d = codes.size(1) * 2, G = scales.dim() == 2 ? scales.size(1) : 0;
  TORCH_CHECK(d % 64 == 0 && d <= kMaxCols4, "the 4-bit screen needs d % 64 == 0 and d <= ", kMaxCols4);
  TORCH_CHECK(G == d / 32 || G == d / 64, "groups of 32 or 64 columns");
  const int64_t group = d / G;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.is_contiguous() && scales.size(0) == V && scales.size(1) == G, "scales: [V, G] float16");
  TORCH_CHECK(mins.scalar_type() == torch::kFloat16 && mins.is_contiguous() && mins.size(0) == V && mins.size(1) == G, "mins: [V, G] float16");
  TORCH_CHECK(corr.dtype() == torch::kInt8 && corr.is_contiguous() && corr.size(0) == V && corr.size(1) % 16 == 0, "corr: [V, k] int8, k % 16 == 0");
  TORCH_CHECK(corr_scale.dtype() == torch::kFloat32 && corr_scale.is_contiguous() && corr_scale.numel() == V, "corr_scale: [V] float32");
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2 && h.size(1) == d, "h: [B, d] float32");
  const int64_t B = h.size(0), k = corr.size(1);
  TORCH_CHECK(coords.dtype() == torch::kFloat32 && coords.dim() == 2 && coords.size(0) == B && coords.size(1) == k, "coords: [B, k] float32");
  h = h.contiguous();
  coords = coords.contiguous();
  const int64_t Gp = (G + 15) / 16 * 16;
  std::vector<int16_t> natural(static_cast<size_t>(d)), reordered(static_cast<size_t>(B * d));
  std::vector<float> sums(static_cast<size_t>(B * Gp), 0.f), scaled(static_cast<size_t>(B * k));
  std::vector<Prepared> prepared(static_cast<size_t>(B));
  auto remainder = torch::empty({B}, torch::kFloat64);
  auto effective = torch::empty({B, k}, torch::kFloat32);
  for (int64_t b = 0; b < B; ++b) {
    const float step = split_int16(h.data_ptr<float>() + b * d, d, natural.data(), remainder.data_ptr<double>() + b);
    int16_t* a = reordered.data() + b * d;
    for (int64_t t = 0; t < d / 64; ++t) {  // n = 32: [lo of 2t, lo of 2t+1, hi of 2t, hi of 2t+1], 16 words each
      const int16_t* src = natural.data() + 64 * t;
      const int order[4] = {0, group == 32 ? 32 : 16, group == 32 ? 16 : 32, 48};
      for (int part = 0; part < 4; ++part) std::copy(src + order[part], src + order[part] + 16, a + 64 * t + 16 * part);
    }
    for (int64_t g = 0; g < G; ++g) {
      int32_t total = 0;
      for (int64_t j = 0; j < group; ++j) total += natural[group * g + j];
      sums[b * Gp + g] = static_cast<float>(total);
    }
    const int e = std::ilogb(step);
    for (int64_t j = 0; j < k; ++j) {
      scaled[b * k + j] = std::ldexp(coords.data_ptr<float>()[b * k + j], -e);
      effective.data_ptr<float>()[b * k + j] = std::ldexp(scaled[b * k + j], e);  // what y uses (equal unless 2^-e c underflows)
    }
    prepared[b] = {a, sums.data() + b * Gp, scaled.data() + b * k, step};
  }
  const Screen4 s{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                  reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), corr.data_ptr<int8_t>(),
                  corr_scale.data_ptr<float>(), d, G, k};
  auto y = torch::empty({B, V}, h.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, V, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = 0; b0 < B; b0 += kBatch4) {
      const int64_t count = std::min<int64_t>(kBatch4, B - b0);
      if (vnni) rows4_batch<true, kBatch4>(count, s, prepared.data() + b0, begin, end, yp + b0 * V, V);
      else rows4_batch<false, kBatch4>(count, s, prepared.data() + b0, begin, end, yp + b0 * V, V);
    }
  });
  return {y, remainder, effective};
}
