// The AVX2 path (AVX2 + FMA + F16C): the exact skinny GEMM over fp32 and ggml block weights,
// bit-identical to the AVX-512 path (gemm.h), the int16-split int8 screen and the screen's candidate
// selection (screen_avx2.cpp).
#include "simd_avx2.h"
#include "blocks.h"
#include "gemm.h"
#include "bindings.h"

std::tuple<torch::Tensor, torch::Tensor> screen_gemv_int16(torch::Tensor q, torch::Tensor scales, torch::Tensor h, bool vnni);
torch::Tensor screen_select(torch::Tensor center, torch::Tensor coef, double hnorm, torch::Tensor qnorm, double rnorm,
                            double slack, double inv_t, torch::Tensor noise, int64_t k);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  SPECVOCAB_DEFINE_GEMM(m);
  m.def("screen_gemv_int16", &screen_gemv_int16, "the int8 screen against int16-split activations, integer dots");
  m.def("screen_select", &screen_select, "candidate ids of one screened row");
}
