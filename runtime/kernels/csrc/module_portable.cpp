// The portable path (plain C++, std::fmaf): the exact skinny GEMM over fp32 and ggml block
// weights, bit-identical to the vector paths (gemm.h); slow, for CPUs without AVX2.
#include "simd_portable.h"
#include "blocks.h"
#include "gemm.h"
#include "bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { SPECVOCAB_DEFINE_GEMM(m); }
