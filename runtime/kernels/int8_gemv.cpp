// Screening GEMV: y[i] = sum_g scales[i, g] * sum_{j in g} q[i, j] * h[j], fp32 activations.
// Weights are int8 (the screening copy of the LM head), activations stay fp32 so the only
// approximation is the weight quantization, which the caller bounds per row.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

namespace {

inline __m512 load_int8x16_as_ps(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
}

// Per-row scale: accumulate raw products, scale once at the end.
inline float dot_row_scaled_once(const int8_t* q, float s, const float* h, int64_t d) {
  __m512 acc0 = _mm512_setzero_ps();
  __m512 acc1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) {
    acc0 = _mm512_fmadd_ps(load_int8x16_as_ps(q + j), _mm512_loadu_ps(h + j), acc0);
    acc1 = _mm512_fmadd_ps(load_int8x16_as_ps(q + j + 16), _mm512_loadu_ps(h + j + 16), acc1);
  }
  for (; j < d; j += 16) {
    acc0 = _mm512_fmadd_ps(load_int8x16_as_ps(q + j), _mm512_loadu_ps(h + j), acc0);
  }
  return s * _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// Per-group scales: the scale multiplies each group's products before accumulation.
inline float dot_row_grouped(const int8_t* q, const float* s, const float* h, int64_t d, int64_t group) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < d; g0 += group) {
    const __m512 scale = _mm512_set1_ps(s[g0 / group]);
    for (int64_t j = g0; j < g0 + group; j += 16) {
      acc = _mm512_fmadd_ps(_mm512_mul_ps(load_int8x16_as_ps(q + j), scale), _mm512_loadu_ps(h + j), acc);
    }
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

// q: [V, d] int8, scales: [V, G] fp32 with G = d / group, h: [B, d] fp32 -> y: [B, V] fp32.
torch::Tensor screen_gemv(torch::Tensor q, torch::Tensor scales, torch::Tensor h) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous(), "q must be contiguous int8");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous(), "scales must be contiguous float32");
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2, "h must be [B, d] float32");
  h = h.contiguous();
  const int64_t V = q.size(0), d = q.size(1), B = h.size(0);
  const int64_t G = scales.size(1);
  TORCH_CHECK(h.size(1) == d && scales.size(0) == V && d % G == 0, "shape mismatch");
  const int64_t group = d / G;
  TORCH_CHECK(group % 16 == 0, "group size must be a multiple of 16");
  auto y = torch::empty({B, V}, h.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows outer, batch inner: each weight row is streamed from memory once for the whole batch.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < V; ++i) {
    for (int64_t b = 0; b < B; ++b) {
      yp[b * V + i] = G == 1 ? dot_row_scaled_once(qp + i * d, sp[i], hp + b * d, d)
                             : dot_row_grouped(qp + i * d, sp + i * G, hp + b * d, d, group);
    }
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("screen_gemv", &screen_gemv, "int8-weight x fp32-activation GEMV with per-group scales");
}
