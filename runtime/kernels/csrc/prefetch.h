// How far ahead the weight-streaming kernels prefetch (simd::prefetch, into L2): kPrefetchRows rows for
// the int8 screens (screen_avx512.cpp, int16_screen.h) and the exact GEMM (gemm.h), which goes further
// for one or two rows of x (prefetch_rows).
#pragma once

#include <algorithm>
#include <cstdint>

namespace {
constexpr int64_t kPrefetchRows = 8;  // weight rows ahead of the ones being read
// Against one or two rows of x, which wait on the weights' stream, the exact GEMM's distance is also
// at least this many bytes: 8 of a short row (smollm2-135m's 576-column Q4_1 rows: 360 bytes) left the
// prefetch too little time. On the AMD EPYC Zen 5, one thread, a one-token forward took 8-13 % less
// time (docs/backends-and-kernels.md).
constexpr int64_t kPrefetchBytes = 8192;
// Weight rows ahead for rows of row_bytes (> 0) bytes.
inline int64_t prefetch_rows(int64_t row_bytes) { return std::max(kPrefetchRows, (kPrefetchBytes + row_bytes - 1) / row_bytes); }
}  // namespace
