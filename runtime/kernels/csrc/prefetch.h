// How far ahead the weight-streaming kernels prefetch (simd::prefetch, into L2): one distance for
// the exact GEMM (gemm.h) and the int8 screens (screen_avx512.cpp, int16_screen.h).
#pragma once

#include <cstdint>

namespace {
constexpr int64_t kPrefetchRows = 8;  // weight rows ahead of the ones being read
}  // namespace
