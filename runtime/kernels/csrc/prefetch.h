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
// The exact GEMM's weight rows ahead, for rows of row_bytes (> 0) bytes against x_rows rows of x (more than
// two are bound by the FMAs, not the stream: there 8 KB ran 1-2 % slower than 8 rows).
inline int64_t prefetch_rows(int64_t row_bytes, int x_rows) {
  return x_rows > 2 ? kPrefetchRows : std::max(kPrefetchRows, (kPrefetchBytes + row_bytes - 1) / row_bytes);
}
}  // namespace
