// AVX-512 helpers shared by the kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace specvocab {

// Mask of the first min(remaining, 16) lanes of a 16-float vector: the tail of a loop over 16-wide blocks.
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1u);
}

}  // namespace specvocab
