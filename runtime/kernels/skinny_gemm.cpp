// Skinny fp32 GEMM for decoding (CPU, AVX-512): y[b, i] = <w[i], x[b]> for a few rows b.
//
// A decode or verify step multiplies n <= 16 hidden states by each weight matrix. General GEMM
// libraries pack the weights for large n and lose the streaming rate of their n = 1 GEMV on the
// way (MKL: a 4-row product costs ~2x a 1-row one here). This kernel streams each weight row from
// memory once and reuses it from L1 for every b, so its cost stays close to one weight read for
// n = 1..16, and every y[b, i] is summed in the same order whatever n is (batch invariant).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>

namespace {

using specvocab::tail_mask;

constexpr int kRows = 4;           // weight rows per block: independent accumulators hide FMA latency
constexpr int kPrefetchRows = 8;   // software prefetch this many rows ahead

// Rows [i, i + kRows) of w against one x row; `prefetch` streams the rows kPrefetchRows ahead.
inline void block_dot(const float* w, const float* x, int64_t d, bool prefetch, float* out) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + j), x1 = _mm512_loadu_ps(x + j + 16);
    for (int r = 0; r < kRows; ++r) {
      const float* row = w + r * d + j;
      if (prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * d), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * d + 16), _MM_HINT_T0);
      }
      acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(row), x0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16), x1, acc[r][1]);
    }
  }
  for (; j < d; j += 16) {
    const __mmask16 m = tail_mask(d - j);
    const __m512 x0 = _mm512_maskz_loadu_ps(m, x + j);
    for (int r = 0; r < kRows; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + r * d + j), x0, acc[r][0]);
  }
  for (int r = 0; r < kRows; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// One row of w against N rows of x: the weight chunk is loaded once for all N. Every output is
// summed exactly as block_dot sums it (two accumulators over 32-float steps, masked tail into the
// first), so results do not depend on N.
template <int N>
inline void row_dot_many(const float* w, const float* x, int64_t d, int64_t x_stride, bool prefetch, float* out, int64_t out_stride) {
  __m512 acc[N][2];
  for (int b = 0; b < N; ++b) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * d + j), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * d + j + 16), _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_loadu_ps(w + j), w1 = _mm512_loadu_ps(w + j + 16);
    for (int b = 0; b < N; ++b) {
      acc[b][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + b * x_stride + j), acc[b][0]);
      acc[b][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + b * x_stride + j + 16), acc[b][1]);
    }
  }
  for (; j < d; j += 16) {
    const __mmask16 m = tail_mask(d - j);
    const __m512 w0 = _mm512_maskz_loadu_ps(m, w + j);
    for (int b = 0; b < N; ++b) acc[b][0] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m, x + b * x_stride + j), acc[b][0]);
  }
  for (int b = 0; b < N; ++b) out[b * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]));
}

// Row i of w against rows [b0, b0 + count) of x, count <= kMaxBatch, written to y[b, i].
inline void row_dot_batch(const float* w, const float* x, int64_t d, int64_t count, bool prefetch, float* y, int64_t rows) {
  switch (count) {
    case 1: row_dot_many<1>(w, x, d, d, prefetch, y, rows); break;
    case 2: row_dot_many<2>(w, x, d, d, prefetch, y, rows); break;
    case 3: row_dot_many<3>(w, x, d, d, prefetch, y, rows); break;
    case 4: row_dot_many<4>(w, x, d, d, prefetch, y, rows); break;
    case 5: row_dot_many<5>(w, x, d, d, prefetch, y, rows); break;
    case 6: row_dot_many<6>(w, x, d, d, prefetch, y, rows); break;
    case 7: row_dot_many<7>(w, x, d, d, prefetch, y, rows); break;
    default: row_dot_many<8>(w, x, d, d, prefetch, y, rows); break;
  }
}

constexpr int64_t kMaxBatch = 8;  // x rows per pass: 16 accumulators, half the vector registers

}  // namespace

// x: [n, d] fp32, w: [out, d] fp32 (contiguous) -> y: [n, out] fp32.
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 2 && w.is_contiguous(), "w must be contiguous [out, d] float32");
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == w.size(1), "x must be [n, d] float32");
  x = x.contiguous();
  const int64_t n = x.size(0), d = x.size(1), rows = w.size(0);
  auto y = torch::empty({n, rows}, x.options());
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // One row: blocks of kRows weight rows (most independent accumulators). Several rows: each weight
  // row is loaded once per pass over up to kMaxBatch rows of x. Both sum in the same order.
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    if (n == 1) {
      float out[kRows];
      int64_t i = begin;
      for (; i + kRows <= end; i += kRows) {
        block_dot(wp + i * d, xp, d, i + kPrefetchRows + kRows <= end, out);
        for (int r = 0; r < kRows; ++r) yp[i + r] = out[r];
      }
      for (; i < end; ++i) row_dot_batch(wp + i * d, xp, d, 1, false, yp + i, rows);
      return;
    }
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t b0 = 0; b0 < n; b0 += kMaxBatch) {
        const int64_t count = std::min(kMaxBatch, n - b0);
        row_dot_batch(wp + i * d, xp + b0 * d, d, count, b0 == 0 && i + kPrefetchRows < end, yp + b0 * rows + i, rows);
      }
    }
  });
  return y;
}
