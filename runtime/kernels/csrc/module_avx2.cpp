// The AVX2 path (AVX2 + FMA + F16C): the exact skinny GEMM over fp32 and ggml block weights,
// bit-identical to the AVX-512 path (gemm.h), the int16-split int8 screen and the screen's candidate
// selection (screen_avx2.cpp), and the 4-bit screen (screen4_avx2.cpp).
#include "simd_avx2.h"
#include "blocks.h"
#include "gemm.h"
#include "bindings.h"

std::tuple<torch::Tensor, torch::Tensor> screen_gemv_int16(torch::Tensor q, torch::Tensor scales, torch::Tensor h, bool vnni);
torch::Tensor screen_select(torch::Tensor center, torch::Tensor coef, double hnorm, torch::Tensor qnorm, double rnorm,
                            double slack, double inv_t, torch::Tensor noise, int64_t k);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> screen4_gemv(torch::Tensor packed, int64_t V, int64_t n, torch::Tensor h,
                                                                     torch::Tensor coords, bool vnni);  // screen4_avx2.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  SPECVOCAB_DEFINE_GEMM(m);
  m.def("screen_gemv_int16", &screen_gemv_int16, "the int8 screen against int16-split activations, integer dots");
  m.def("screen_select", &screen_select, "candidate ids of one screened row");
  m.def("screen4_gemv", &screen4_gemv, "the 4-bit screen (in panels) with its low-rank correction against int16-split activations");
}
