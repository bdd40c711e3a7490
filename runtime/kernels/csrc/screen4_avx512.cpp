// The 4-bit screen of the certified head (AVX-512 paths; elsewhere runtime.kernels' torch fallback).
//
// Row i of the screen is Q_ij = d_ig * q_ij + m_ig over groups g of n = 32 or 64 columns (q in 0..15, d
// and m float16), plus a low-rank correction: k int8 values p_i with a float32 scale s_i, the row's
// quantization error W_i - Q_i projected on a basis U of the hidden states (runtime.heads.
// screen4_bound says how the bound uses it). Per hidden row h, split exactly as h = 2^e a + r
// (int16_screen.h, |a| <= 32639), and its basis coordinates c [k]:
//
//   y_i = 2^e (sum_g d_ig <q_ig, a_g> + m_ig sum(a_g) + fl(s_i p_i) . 2^-e c),   c_eff = 2^e fl(2^-e c)
//
// Each a_j is split again into bytes, a = 256 hi + lo with hi, lo in [-128, 127] (why the split stops
// at 32639), so <q, a> over 32 columns is 256 <q, hi> + <q, lo>: exact u8 x s8 dots (vpdpbusd where
// the CPU reports avx512_vnni, vpmaddubsw + vpmaddwd otherwise: the same integers), |<q, a>| <=
// 32 * 15 * 32639 < 2^24, so its float32 is exact. The rest is float32, one lane per vocabulary row,
// in this order: per group, fma(<q, a> over each 32 columns, d) then fma(m, sum(a_g)); then per
// correction coordinate fma(fl(s p_j), 2^-e c_j); then times 2^e. So each row takes at most
// 2 d/32 + k + 1 roundings, which the caller bounds (Screen4Bound). The rows come in panels of 16
// (runtime.kernels.screen4_panels: the layout), one byte stream, ~0.69 bytes per weight at n = 32.
#include <torch/extension.h>
#include <immintrin.h>

#include "int16_screen.h"
#include "pool.h"
#include "simd_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;           // vocabulary rows per panel
constexpr int kSplitLimit = 32639;   // |a| <= 32639: (a + 128) >> 8 fits int8
constexpr int kBatch4 = 4;           // hidden rows per pass over the panels (no software prefetch: the
                                     // hardware's follows the one stream, and measured faster without)

// One hidden row, prepared once per call: a's high and low bytes, its group sums, c scaled by 2^-e.
struct Prepared {
  const int8_t* hi;     // [d]
  const int8_t* lo;     // [d]
  const float* sums;    // [G] float(sum of a over group g), exact (|sum| < 2^21)
  const float* coords;  // [k] fl(2^-e c)
  float step;           // 2^e
};

struct Panels {
  const uint8_t* base;
  int64_t panel_bytes, group_bytes, n, G, k, V;
};

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

}  // namespace

// packed [P, panel_bytes] uint8 (runtime.kernels.screen4_panels) of V rows, d columns in groups of n, k
// correction coordinates; h [B, d] float32, coords [B, k] float32 -> (y [B, V] float32, |r| [B] float64
// of the int16 split (inf: the split does not apply to that row, screen it elsewhere), c_eff [B, k] float32).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> screen4_gemv(torch::Tensor packed, int64_t V, int64_t n, torch::Tensor h,
                                                                     torch::Tensor coords, bool vnni) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2, "packed: contiguous [P, panel_bytes] uint8");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0, "packed: 64-byte aligned");
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2, "h: [B, d] float32");
  TORCH_CHECK(coords.dtype() == torch::kFloat32 && coords.dim() == 2 && coords.size(0) == h.size(0), "coords: [B, k] float32");
  const int64_t B = h.size(0), d = h.size(1), k = coords.size(1), G = d / std::max<int64_t>(n, 1);
  TORCH_CHECK((n == 32 || n == 64) && d % n == 0 && d <= kMaxIntCols && k % 16 == 0, "the 4-bit screen needs groups of 32 or 64 columns, d <= ",
              kMaxIntCols, " and k % 16 == 0");
  const int64_t group_bytes = 8 * n + 64, panel_bytes = G * group_bytes + kLanes * k + 64;
  TORCH_CHECK(packed.size(1) == panel_bytes && packed.size(0) * kLanes >= V && (packed.size(0) - 1) * kLanes < V,
              "packed: ", (V + kLanes - 1) / kLanes, " panels of ", panel_bytes, " bytes");
  h = h.contiguous();
  coords = coords.contiguous();
  std::vector<int16_t> a(static_cast<size_t>(d));
  std::vector<int8_t> hi(static_cast<size_t>(B * d)), lo(static_cast<size_t>(B * d));
  std::vector<float> sums(static_cast<size_t>(B * G)), scaled(static_cast<size_t>(B * k));
  std::vector<Prepared> prepared(static_cast<size_t>(B));
  auto remainder = torch::empty({B}, torch::kFloat64);
  auto effective = torch::empty({B, k}, torch::kFloat32);
  for (int64_t b = 0; b < B; ++b) {
    const float step = split_int16(h.data_ptr<float>() + b * d, d, a.data(), remainder.data_ptr<double>() + b, kSplitLimit);
    for (int64_t j = 0; j < d; ++j) {
      const int high = (a[j] + 128) >> 8;  // floor: a = 256 high + low, both in [-128, 127]
      hi[b * d + j] = static_cast<int8_t>(high);
      lo[b * d + j] = static_cast<int8_t>(a[j] - 256 * high);
    }
    for (int64_t g = 0; g < G; ++g) {
      int32_t total = 0;
      for (int64_t j = 0; j < n; ++j) total += a[n * g + j];
      sums[b * G + g] = static_cast<float>(total);
    }
    const int e = std::ilogb(step);
    for (int64_t j = 0; j < k; ++j) {
      scaled[b * k + j] = std::ldexp(coords.data_ptr<float>()[b * k + j], -e);
      effective.data_ptr<float>()[b * k + j] = std::ldexp(scaled[b * k + j], e);  // what y uses (equal unless 2^-e c underflows)
    }
    prepared[b] = {hi.data() + b * d, lo.data() + b * d, sums.data() + b * G, scaled.data() + b * k, step};
  }
  const Panels p{packed.data_ptr<uint8_t>(), panel_bytes, group_bytes, n, G, k, V};
  auto y = torch::empty({B, V}, h.options());
  float* yp = y.data_ptr<float>();
  sv_pool::parallel_for(packed.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = 0; b0 < B; b0 += kBatch4) {
      const int64_t count = std::min<int64_t>(kBatch4, B - b0);
      if (vnni) panels_batch<true, kBatch4>(count, p, prepared.data() + b0, begin, end, yp + b0 * V);
      else panels_batch<false, kBatch4>(count, p, prepared.data() + b0, begin, end, yp + b0 * V);
    }
  });
  return {y, remainder, effective};
}
