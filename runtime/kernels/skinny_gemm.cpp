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

namespace {

constexpr int kRows = 4;           // weight rows per block: independent accumulators hide FMA latency
constexpr int kPrefetchRows = 8;   // software prefetch this many rows ahead

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1u);
}

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

// One row of w against one x row, summed in the same order as block_dot.
inline float row_dot(const float* w, const float* x, int64_t d) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(x + j), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 16), _mm512_loadu_ps(x + j + 16), acc1);
  }
  for (; j < d; j += 16) {
    const __mmask16 m = tail_mask(d - j);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + j), _mm512_maskz_loadu_ps(m, x + j), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

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
  // Row blocks outer, batch inner: each weight row streams from memory once for all n rows of x.
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    float out[kRows];
    int64_t i = begin;
    for (; i + kRows <= end; i += kRows) {
      for (int64_t b = 0; b < n; ++b) {
        block_dot(wp + i * d, xp + b * d, d, b == 0 && i + kPrefetchRows + kRows <= end, out);
        for (int r = 0; r < kRows; ++r) yp[b * rows + i + r] = out[r];
      }
    }
    for (; i < end; ++i) {
      for (int64_t b = 0; b < n; ++b) yp[b * rows + i] = row_dot(wp + i * d, xp + b * d, d);
    }
  });
  return y;
}
