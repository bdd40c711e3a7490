// 16-lane float / int32 "vectors" as plain arrays, std::fmaf for the fused multiply-add: the
// portable path for CPUs without AVX2. Same operations, rounding and horizontal-sum tree as
// simd_avx512.h, so results are bit-identical to the vector paths (build with -ffp-contract=off).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {
namespace simd {

constexpr const char* kPath = "portable";
constexpr int kAccumulators = 8;  // accumulator vectors per pass (no registers to fit: any count works)
constexpr int kMaxBatch = 4;
constexpr int parts_for(int, int) { return 1; }  // lane parts per pass (parts.h): always the whole vector
constexpr int64_t kTallMinRows = 16;  // more rows of x than this take the tiled path (bindings.h: run_tall)
constexpr int rows_for(int n) { return n == 1 ? 2 : 1; }  // weight rows per pass for n rows of x

struct V { float v[16]; };
struct I { int32_t v[16]; };

#define SV_LANES for (int l = 0; l < 16; ++l)

inline V zero() { V r; SV_LANES r.v[l] = 0.0f; return r; }
inline V set1(float a) { V r; SV_LANES r.v[l] = a; return r; }
inline V bcast(const float* p) { return set1(*p); }  // set1(*p)
inline V load(const float* p) { V r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
inline V in_register(V a) { return a; }  // (AVX-512 pins loads in registers; here the compiler chooses)
inline V load_partial(const float* p, int64_t n) {  // lanes >= n: +0
  V r = zero();
  std::memcpy(r.v, p, static_cast<size_t>(n < 16 ? n : 16) * sizeof(float));
  return r;
}
inline void store(float* p, V a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline V add(V a, V b) { SV_LANES a.v[l] = a.v[l] + b.v[l]; return a; }
inline V sub(V a, V b) { SV_LANES a.v[l] = a.v[l] - b.v[l]; return a; }
inline V mul(V a, V b) { SV_LANES a.v[l] = a.v[l] * b.v[l]; return a; }
inline V fma(V a, V b, V c) { SV_LANES c.v[l] = std::fmaf(a.v[l], b.v[l], c.v[l]); return c; }
inline V max(V a, V b) { SV_LANES a.v[l] = a.v[l] > b.v[l] ? a.v[l] : b.v[l]; return a; }  // b when either is NaN, as vmaxps
inline V keep_first(V a, int64_t n) { for (int64_t l = n < 0 ? 0 : n; l < 16; ++l) a.v[l] = 0.0f; return a; }  // lanes >= n: +0
inline void store_first(float* p, V a, int64_t n) { std::memcpy(p, a.v, static_cast<size_t>(n < 16 ? n : 16) * sizeof(float)); }
// GCC's _mm512_reduce_add_ps tree: lanes 8..15 + 0..7, then 4 + 4, then {2,3,0,1}, then [0] + [1].
inline float reduce(V a) {
  float t3[8], t6[4];
  for (int l = 0; l < 8; ++l) t3[l] = a.v[l + 8] + a.v[l];
  for (int l = 0; l < 4; ++l) t6[l] = t3[l + 4] + t3[l];
  return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}
// y[b * ys + r] = reduce(v[r * Cols + b]) (the AVX-512 path transposes the trees; here one at a time).
template <int Rows, int Cols>
inline void reduce_rows(const V* v, float* y, int64_t ys) {
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Cols; ++b) y[b * ys + r] = reduce(v[r * Cols + b]);
}

inline V to_float(I a) { V r; SV_LANES r.v[l] = static_cast<float>(a.v[l]); return r; }
inline I as_int(V a) { I r; std::memcpy(r.v, a.v, sizeof(r.v)); return r; }  // the same bits
inline V as_float(I a) { V r; std::memcpy(r.v, a.v, sizeof(r.v)); return r; }
inline I load_u8(const uint8_t* p) { I r; SV_LANES r.v[l] = p[l]; return r; }
inline I load_i8(const uint8_t* p) { I r; SV_LANES r.v[l] = static_cast<int8_t>(p[l]); return r; }
inline I load_u32(const uint8_t* p) { I r; std::memcpy(r.v, p, sizeof(r.v)); return r; }  // 16 little-endian 32-bit lanes
inline I and_(I a, int m) { SV_LANES a.v[l] &= m; return a; }
inline I or_(I a, I b) { SV_LANES a.v[l] |= b.v[l]; return a; }
inline I xor_(I a, int m) { SV_LANES a.v[l] ^= m; return a; }
inline I srl(I a, int s) { SV_LANES a.v[l] = static_cast<int32_t>(static_cast<uint32_t>(a.v[l]) >> s); return a; }
inline I shl(I a, int s) { SV_LANES a.v[l] = static_cast<int32_t>(static_cast<uint32_t>(a.v[l]) << s); return a; }
inline I sub_(I a, int b) { SV_LANES a.v[l] -= b; return a; }
inline I merge_bits(I a, I b, int m) { SV_LANES a.v[l] = (a.v[l] & m) | (b.v[l] & ~m); return a; }  // a where m has ones, b elsewhere

#include "affine_per_element.h"  // Affine, affine, lookup: the values computed per element
// Elements 0..15 and 16..31 of a 5-bit block (simd_avx512.h's lookup_halves): the values at
// (q & 15) | 16 * bit i and ((q >> 4) & 15) | 16 * bit (16 + i) of the little-endian bits at
// `bits`, per lane i.
template <int Offset, int Min>
inline void lookup_halves(const Affine<5, Offset, Min>& a, I q, const uint8_t* bits, V& w0, V& w1) {
  I low, high;
  SV_LANES low.v[l] = ((bits[l >> 3] >> (l & 7)) & 1) << 4;
  SV_LANES high.v[l] = ((bits[2 + (l >> 3)] >> (l & 7)) & 1) << 4;
  w0 = affine_at<Offset, Min>(a.d, a.m, or_(and_(q, 15), low));
  w1 = affine_at<Offset, Min>(a.d, a.m, or_(and_(srl(q, 4), 15), high));
}

// Exact IEEE half -> float (normals, subnormals, infinities; NaNs keep their payload).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24 with its top bit at position p
    const int p = 31 - __builtin_clz(man);
    bits = sign | (static_cast<uint32_t>(p + 103) << 23) | ((man << (23 - p)) & 0x7FFFFFu);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline V load_f16(const uint8_t* p) {
  V r;
  SV_LANES { uint16_t h; std::memcpy(&h, p + 2 * l, 2); r.v[l] = half_to_float(h); }
  return r;
}
inline V load_bf16(const uint8_t* p) {
  V r;
  SV_LANES { uint16_t h; std::memcpy(&h, p + 2 * l, 2); const uint32_t bits = static_cast<uint32_t>(h) << 16; std::memcpy(&r.v[l], &bits, 4); }
  return r;
}

inline void prefetch(const uint8_t* p) { __builtin_prefetch(p, 0, 2); }  // into L2 (locality 2 is T1), as on AVX-512

#undef SV_LANES

#include "parts.h"

}  // namespace simd
}  // namespace
