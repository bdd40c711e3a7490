// Screening kernels for the certified LM head (CPU, AVX-512 only; other paths use the torch fallback).
//
// screen_gemv:   y[b, i] = sum_g scales[i, g] * <q[i, g-th group], h[b, g-th group]>, fp32 activations.
//                Weights are the int8 screening copy of the head; activations stay fp32 so the only
//                approximation is the weight quantization, which the caller bounds per row.
// screen_gemv_int16: the same screen with h split exactly into int16 values plus a remainder whose
//                norm it returns (the caller bounds that term too): integer dot products, several
//                times less arithmetic per weight, for verify rounds of several rows.
// screen_select: the candidates of one row: every i whose upper bound reaches the k-th best lower bound.
// Built into the AVX-512 module, whose flags turn off FMA contraction for the exact GEMM; this file
// keeps GCC's default contraction so its results stay what they were before the per-ISA split.
#pragma GCC optimize("fp-contract=fast")

#include <torch/extension.h>
#include <immintrin.h>

#include "int16_screen.h"
#include "pool.h"
#include "prefetch.h"
#include "screen_select.h"
#include "simd_avx512.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

namespace {

using simd::tail_mask;

constexpr int kRows = 4;  // rows per block: independent accumulators hide FMA latency

inline void prefetch_rows(const int8_t* q, int64_t d, int64_t j) {
  for (int r = 0; r < kRows; ++r) simd::prefetch(reinterpret_cast<const uint8_t*>(q + (kPrefetchRows + r) * d + j));
}

inline __m512 load_int8x16_as_ps(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

// Rows [i, i + kRows) against one hidden state; per-row scale applied once at the end.
inline void block_per_row(const int8_t* q, const float* s, const float* h, int64_t d, float* out) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) {
    const __m512 h0 = _mm512_loadu_ps(h + j), h1 = _mm512_loadu_ps(h + j + 16);
    prefetch_rows(q, d, j);
    for (int r = 0; r < kRows; ++r) {
      acc[r][0] = _mm512_fmadd_ps(load_int8x16_as_ps(q + r * d + j), h0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(load_int8x16_as_ps(q + r * d + j + 16), h1, acc[r][1]);
    }
  }
  for (; j < d; j += 16) {
    const __m512 h0 = _mm512_loadu_ps(h + j);
    for (int r = 0; r < kRows; ++r) acc[r][0] = _mm512_fmadd_ps(load_int8x16_as_ps(q + r * d + j), h0, acc[r][0]);
  }
  for (int r = 0; r < kRows; ++r) out[r] = s[r] * _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// Two rows (per-row scales) against N hidden states: each int8 chunk is converted once for all N
// and each loaded activation feeds two FMAs.
template <int N>
inline void rows2_per_row_many(const int8_t* q, const float* scale, const float* h, int64_t d, bool prefetch, float* out, int64_t out_stride) {
  __m512 acc[2][N][2];
  for (int r = 0; r < 2; ++r)
    for (int b = 0; b < N; ++b) acc[r][b][0] = acc[r][b][1] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) {
    if (prefetch) {
      simd::prefetch(reinterpret_cast<const uint8_t*>(q + kPrefetchRows * d + j));
      simd::prefetch(reinterpret_cast<const uint8_t*>(q + (kPrefetchRows + 1) * d + j));
    }
    const __m512 a0 = load_int8x16_as_ps(q + j), a1 = load_int8x16_as_ps(q + j + 16);
    const __m512 b0 = load_int8x16_as_ps(q + d + j), b1 = load_int8x16_as_ps(q + d + j + 16);
    for (int b = 0; b < N; ++b) {
      const __m512 x0 = _mm512_loadu_ps(h + b * d + j), x1 = _mm512_loadu_ps(h + b * d + j + 16);
      acc[0][b][0] = _mm512_fmadd_ps(a0, x0, acc[0][b][0]);
      acc[0][b][1] = _mm512_fmadd_ps(a1, x1, acc[0][b][1]);
      acc[1][b][0] = _mm512_fmadd_ps(b0, x0, acc[1][b][0]);
      acc[1][b][1] = _mm512_fmadd_ps(b1, x1, acc[1][b][1]);
    }
  }
  for (; j < d; j += 16) {
    const __m512 a0 = load_int8x16_as_ps(q + j), b0 = load_int8x16_as_ps(q + d + j);
    for (int b = 0; b < N; ++b) {
      const __m512 x0 = _mm512_loadu_ps(h + b * d + j);
      acc[0][b][0] = _mm512_fmadd_ps(a0, x0, acc[0][b][0]);
      acc[1][b][0] = _mm512_fmadd_ps(b0, x0, acc[1][b][0]);
    }
  }
  for (int r = 0; r < 2; ++r)
    for (int b = 0; b < N; ++b) out[b * out_stride + r] = scale[r] * _mm512_reduce_add_ps(_mm512_add_ps(acc[r][b][0], acc[r][b][1]));
}

constexpr int64_t kMaxBatch = 4;  // hidden states per pass: 2 rows x 4 x 2 = 16 accumulators

// Rows i, i + 1 against hidden states [0, count), count <= kMaxBatch, written with stride V.
inline void rows2_per_row_batch(const int8_t* q, const float* scale, const float* h, int64_t d, int64_t count, bool prefetch, float* y, int64_t V) {
  switch (count) {
    case 1: rows2_per_row_many<1>(q, scale, h, d, prefetch, y, V); break;
    case 2: rows2_per_row_many<2>(q, scale, h, d, prefetch, y, V); break;
    case 3: rows2_per_row_many<3>(q, scale, h, d, prefetch, y, V); break;
    default: rows2_per_row_many<4>(q, scale, h, d, prefetch, y, V); break;
  }
}

// Rows [i, i + kRows) with G scales per row: each group's partial dot is scaled, then accumulated.
inline void block_grouped(const int8_t* q, const float* s, const float* h, int64_t d, int64_t group, float* out) {
  const int64_t G = d / group;
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if ((g * group) % 64 == 0) prefetch_rows(q, d, g * group);  // one 64-byte cache line at a time
    for (int r = 0; r < kRows; ++r) {
      const int8_t* qg = q + r * d + g * group;
      const float* hg = h + g * group;
      __m512 part = _mm512_mul_ps(load_int8x16_as_ps(qg), _mm512_loadu_ps(hg));
      for (int64_t j = 16; j < group; j += 16) {
        part = _mm512_fmadd_ps(load_int8x16_as_ps(qg + j), _mm512_loadu_ps(hg + j), part);
      }
      acc[r] = _mm512_fmadd_ps(part, _mm512_set1_ps(s[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

float dot_row_reference(const int8_t* q, const float* s, const float* h, int64_t d, int64_t group) {
  float total = 0.f;
  for (int64_t g0 = 0; g0 < d; g0 += group) {
    float part = 0.f;
    for (int64_t j = g0; j < g0 + group; ++j) part += static_cast<float>(q[j]) * h[j];
    total += s[g0 / group] * part;
  }
  return total;
}

}  // namespace

// q: [V, d] int8, scales: [V, G] fp32 with G = d / group, h: [B, d] fp32 -> y: [B, V] fp32.
torch::Tensor screen_gemv(torch::Tensor q, torch::Tensor scales, torch::Tensor h) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous(), "q must be contiguous int8");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous(), "scales must be contiguous float32");
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2, "h must be [B, d] float32");
  h = h.contiguous();
  const int64_t V = q.size(0), d = q.size(1), B = h.size(0), G = scales.size(1);
  TORCH_CHECK(h.size(1) == d && scales.size(0) == V && d % G == 0, "shape mismatch");
  const int64_t group = d / G;
  TORCH_CHECK(group % 16 == 0, "group size must be a multiple of 16");
  auto y = torch::empty({B, V}, h.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Blocks of rows outer, batch inner: each weight row streams from memory once for the whole batch.
  // 256-row chunks: whole kRows and row-pair steps, so no row takes the one-row path a chunk's end would give.
  sv_pool::parallel_for(V, 256, [&](int64_t begin, int64_t end) {
    if (G == 1 && B > 1) {  // several hidden states: convert each int8 row pair once per pass
      int64_t i = begin;
      for (; i + 2 <= end; i += 2) {
        for (int64_t b0 = 0; b0 < B; b0 += kMaxBatch) {
          const int64_t count = std::min(kMaxBatch, B - b0);
          rows2_per_row_batch(qp + i * d, sp + i, hp + b0 * d, d, count, b0 == 0 && i + kPrefetchRows + 2 <= V, yp + b0 * V + i, V);
        }
      }
      for (; i < end; ++i) {
        for (int64_t b = 0; b < B; ++b) yp[b * V + i] = dot_row_reference(qp + i * d, sp + i, hp + b * d, d, d);
      }
      return;
    }
    float out[kRows];
    int64_t i = begin;
    for (; i + kRows <= end; i += kRows) {
      for (int64_t b = 0; b < B; ++b) {
        if (G == 1) {
          block_per_row(qp + i * d, sp + i, hp + b * d, d, out);
        } else {
          block_grouped(qp + i * d, sp + i * G, hp + b * d, d, group, out);
        }
        for (int r = 0; r < kRows; ++r) yp[b * V + i + r] = out[r];
      }
    }
    for (; i < end; ++i) {
      for (int64_t b = 0; b < B; ++b) yp[b * V + i] = dot_row_reference(qp + i * d, sp + i * G, hp + b * d, d, group);
    }
  });
  return y;
}

namespace {

// --- int16 activations: the screen in integer arithmetic (int16_screen.h) ----------------------------
//
// Two dot products give the same integers: vpdpwssd (AVX512-VNNI) where /proc/cpuinfo reports it,
// vpmaddwd + vpaddd (AVX512BW) elsewhere.

template <bool Vnni>
struct Avx512Dot {
  static constexpr int kBatch = 8;  // hidden rows per pass
  static constexpr int kRegisters = 30;  // of the 32 zmm: two left for the compiler's temporaries
  // Weight rows per pass for n hidden rows: the most (up to 4) whose R n accumulators, n activation
  // vectors and R weight vectors fit in kRegisters (4 up to n = 5, 3 at 6, 2 beyond). Capping the
  // accumulators at 16 instead (2 rows per pass from n = 5 on) made a 5-row verify round's head
  // cost 1.56x a 4-row one on gemma3 (Zen 4, 1 thread; 1.19x with this choice).
  static constexpr int rows_for(int n) {
    int r = 4;
    while (r > 1 && r * n + n + r > kRegisters) --r;
    return r;
  }

  // R int8 weight rows (stride d) against N int16 rows (stride d): exact dots out[r * N + b].
  template <int R, int N>
  static inline void rows(const int8_t* q, const int16_t* a, int64_t d, bool prefetch, int64_t* out) {
    static_assert(R * N + N + R <= kRegisters, "accumulators, activations and weights must stay in registers");
    __m512i acc[R][N];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < N; ++b) acc[r][b] = _mm512_setzero_si512();
    for (int64_t j = 0; j < d; j += 32) {
      if (prefetch && j % 64 == 0)
        for (int r = 0; r < R; ++r) simd::prefetch(reinterpret_cast<const uint8_t*>(q + (kPrefetchRows + r) * d + j));
      __m512i x[N];  // each activation vector loaded once per step, for the R rows
      for (int b = 0; b < N; ++b) x[b] = _mm512_loadu_si512(a + b * d + j);
      for (int r = 0; r < R; ++r) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * d + j)));
        for (int b = 0; b < N; ++b) acc[r][b] = dot_pairs<Vnni>(acc[r][b], w, x[b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < N; ++b) {  // the lanes summed in int64
        const __m512i wide = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[r][b])),
                                              _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[r][b], 1)));
        out[r * N + b] = _mm512_reduce_add_epi64(wide);
      }
  }
};

}  // namespace

// The int8 screen against int16-split rows (int16_screen.h), with vpdpwssd when `vnni`.
std::tuple<torch::Tensor, torch::Tensor> screen_gemv_int16(torch::Tensor q, torch::Tensor scales, torch::Tensor h, bool vnni) {
  return vnni ? int16_screen<Avx512Dot<true>>(q, scales, h) : int16_screen<Avx512Dot<false>>(q, scales, h);
}

namespace {

// Bounds of tokens [i, i + 16) (lanes outside m are garbage): base = c_i |h| + n_i |r| (the second
// term only with n), radius = base + slack (|center| + base).
struct ScreenBounds {
  SelectInputs in;
  __m512 hn, rn, sl, it;

  inline void at(int64_t i, __mmask16 m, __m512& lo, __m512& up) const {
    const __m512 ci = _mm512_maskz_loadu_ps(m, in.center + i);
    __m512 base = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, in.coef + i), hn);
    if (in.qnorm) base = _mm512_add_ps(base, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, in.qnorm + i), rn));
    const __m512 radius = _mm512_add_ps(base, _mm512_mul_ps(sl, _mm512_add_ps(_mm512_abs_ps(ci), base)));
    lo = _mm512_mul_ps(_mm512_sub_ps(ci, radius), it);
    up = _mm512_mul_ps(_mm512_add_ps(ci, radius), it);
    if (in.noise) {
      const __m512 gi = _mm512_maskz_loadu_ps(m, in.noise + i);
      lo = _mm512_add_ps(lo, gi);
      up = _mm512_add_ps(up, gi);
    }
  }
};

}  // namespace

// One row: lower_i = (center_i - radius_i) * inv_t + noise_i, upper_i likewise with +radius_i, where
// radius_i = base_i + slack * (|center_i| + base_i), base_i = coef_i * hnorm + qnorm_i * rnorm (the
// second term only when qnorm is not empty). Returns ids with upper_i >= the k-th largest lower_i.
// noise may be empty (no noise). Two vectorized passes, no [V] temporaries. Each bound is sound on
// its own (slack covers float32 rounding), so the passes need not round alike.
torch::Tensor screen_select(torch::Tensor center, torch::Tensor coef, double hnorm, torch::Tensor qnorm, double rnorm,
                            double slack, double inv_t, torch::Tensor noise, int64_t k) {
  const SelectInputs in = select_inputs(center, coef, qnorm, noise, k);
  const int64_t V = in.V;
  const ScreenBounds bounds{in, _mm512_set1_ps(static_cast<float>(hnorm)),
                            _mm512_set1_ps(static_cast<float>(rnorm)), _mm512_set1_ps(static_cast<float>(slack)),
                            _mm512_set1_ps(static_cast<float>(inv_t))};
  __m512 lo, up;
  float threshold;
  if (k == 1) {  // greedy and Gumbel-max: the largest lower bound
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < V; i += 16) {
      const __mmask16 m = tail_mask(V - i);
      bounds.at(i, m, lo, up);
      best = _mm512_mask_max_ps(best, m, best, lo);
    }
    threshold = _mm512_reduce_max_ps(best);
  } else {  // the k-th largest lower bound
    KthLargest kth(k);
    alignas(64) float block[16];
    for (int64_t i = 0; i < V; i += 16) {
      const __mmask16 m = tail_mask(V - i);
      bounds.at(i, m, lo, up);
      _mm512_store_ps(block, lo);
      for (int64_t r = 0; r < std::min<int64_t>(16, V - i); ++r) {
        kth.offer(block[r]);
      }
    }
    threshold = kth.value();
  }
  const __m512 limit = _mm512_set1_ps(threshold);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  std::unique_ptr<int32_t[]> ids(new int32_t[V]);  // uninitialized: only the first `count` are written
  int64_t count = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = tail_mask(V - i);
    bounds.at(i, m, lo, up);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, up, limit, _CMP_GE_OQ);
    if (hit) {
      _mm512_mask_compressstoreu_epi32(ids.get() + count, hit, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i))));
      count += __builtin_popcount(static_cast<unsigned>(hit));
    }
  }
  auto out = torch::empty({count}, torch::kLong);
  std::copy(ids.get(), ids.get() + count, out.data_ptr<int64_t>());
  return out;
}
