// The 4-bit screen of the certified head: what every ISA's kernel shares (screen4_avx512.cpp,
// screen4_avx2.cpp; elsewhere runtime.kernels' torch fallback). Both compute the same integers and the
// same float32 operations per lane, so the same outputs.
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
// the CPU reports avx512_vnni, vpmaddubsw + vpmaddwd otherwise, on 512 or 256 bits: the same
// integers), |<q, a>| <= 32 * 15 * 32639 < 2^24, so its float32 is exact. The rest is float32, one
// lane per vocabulary row, in this order: per group, fma(<q, a> over each 32 columns, d) then
// fma(m, sum(a_g)); then per correction coordinate fma(fl(s p_j), 2^-e c_j); then times 2^e. So each
// row takes at most 2 d/32 + k + 1 roundings, which the caller bounds (Screen4Bound). The rows come in
// panels of 16 (runtime.kernels.screen4_panels: the layout), one byte stream, ~0.69 bytes per weight at n = 32.
#pragma once

#include <torch/extension.h>

#include "int16_screen.h"
#include "pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int kLanes = 16;           // vocabulary rows per panel
constexpr int kSplitLimit = 32639;   // |a| <= 32639: (a + 128) >> 8 fits int8

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
  int64_t count;  // panels in the matrix
};

constexpr int64_t kPrefetchPanels = 1;  // panels ahead of the one being read (2 measured the same)

// Prefetch (into L2) group g of the panel kPrefetchPanels after `panel`, and with the last group its
// corrections: the next panel's bytes, spread over this one's groups. With the hardware's prefetch
// alone a screen waited on its memory: on the Intel Xeon with AMX the group's scale load took half
// of a one-row screen's time, and the prefetch cut most screens there by 12-28 % (gemma3-270m's
// one-row AVX2 screen did not move; docs/certified-head.md).
inline void prefetch_ahead(const Panels& p, int64_t panel, int64_t g) {
  if (panel + kPrefetchPanels >= p.count) return;
  const uint8_t* group = p.base + (panel + kPrefetchPanels) * p.panel_bytes + g * p.group_bytes;
  const int64_t bytes = g + 1 < p.G ? p.group_bytes : p.panel_bytes - g * p.group_bytes;
  // asm volatile: GCC 12 deletes a loop of __builtin_prefetch (or _mm_prefetch) of unknown length as free of effects
  for (int64_t off = 0; off < bytes; off += 64) asm volatile("prefetcht1 %0" : : "m"(group[off]));
}

// packed [P, panel_bytes] uint8 (runtime.kernels.screen4_panels) of V rows, d columns in groups of n, k
// correction coordinates; h [B, d] float32, coords [B, k] float32 -> (y [B, V] float32, |r| [B] float64
// of the int16 split (inf: the split does not apply to that row, screen it elsewhere), c_eff [B, k] float32).
// Kernel::panels(count, p, prepared, begin, end, y) screens panels [begin, end) against count <=
// Kernel::kBatch prepared rows, writing y[b * V + 16 panel + L] for each panel's real rows.
template <class Kernel>
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> screen4_with(torch::Tensor packed, int64_t V, int64_t n, torch::Tensor h,
                                                                     torch::Tensor coords) {
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
  const Panels p{packed.data_ptr<uint8_t>(), panel_bytes, group_bytes, n, G, k, V, packed.size(0)};
  auto y = torch::empty({B, V}, h.options());
  float* yp = y.data_ptr<float>();
  sv_pool::parallel_for(packed.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = 0; b0 < B; b0 += Kernel::kBatch) {
      const int64_t count = std::min<int64_t>(Kernel::kBatch, B - b0);
      Kernel::panels(count, p, prepared.data() + b0, begin, end, yp + b0 * V);
    }
  });
  return {y, remainder, effective};
}

}  // namespace
