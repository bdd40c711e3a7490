// The AVX2 path (AVX2 + FMA + F16C): the exact skinny GEMM over fp32 and ggml block weights,
// bit-identical to the AVX-512 path (gemm.h).
#include "simd_avx2.h"
#include "blocks.h"
#include "gemm.h"
#include "bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { SPECVOCAB_DEFINE_GEMM(m); }
