// 16-lane float / int32 vectors on AVX-512F (plus F16C for scalar halves): the AVX-512 path.
//
// Every path (this, simd_avx2.h, simd_portable.h) implements the same operations with the same
// rounding, so a kernel written once against them gives bit-identical results on all three.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {
namespace simd {

constexpr const char* kPath = "avx512";
constexpr int kMaxBatch = 8;  // activation rows per pass over a weight row: 16 accumulators
constexpr int kRows = 4;      // weight rows per block when n == 1: 8 independent accumulators

struct V { __m512 v; };   // 16 floats
struct I { __m512i v; };  // 16 int32

// Mask of the first min(remaining, 16) lanes: the tail of a loop over 16-wide steps.
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1u);
}

inline V zero() { return {_mm512_setzero_ps()}; }
inline V set1(float a) { return {_mm512_set1_ps(a)}; }
inline V load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V load_partial(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(tail_mask(n), p)}; }  // lanes >= n: +0
inline void store(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V add(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V sub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V mul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, one rounding
// GCC's tree (avx512fintrin.h __MM512_REDUCE_OP): lanes 8..15 + 0..7, then 4 + 4, then {2,3,0,1}, then [0] + [1].
inline float reduce(V a) { return _mm512_reduce_add_ps(a.v); }

inline V to_float(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I load_u8(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline I load_i8(const uint8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline I and_(I a, int m) { return {_mm512_and_si512(a.v, _mm512_set1_epi32(m))}; }
inline I or_(I a, I b) { return {_mm512_or_si512(a.v, b.v)}; }
inline I srl(I a, int s) { return {_mm512_srl_epi32(a.v, _mm_cvtsi32_si128(s))}; }
inline I shl(I a, int s) { return {_mm512_sll_epi32(a.v, _mm_cvtsi32_si128(s))}; }
inline I sub_(I a, int b) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(b))}; }

// Lanes [Base, Base + 16) as floats: the tables of nibble_float / five_bit_float.
template <int Base>
inline __m512 iota_ps() {
  return _mm512_setr_ps(Base + 0, Base + 1, Base + 2, Base + 3, Base + 4, Base + 5, Base + 6, Base + 7, Base + 8, Base + 9,
                        Base + 10, Base + 11, Base + 12, Base + 13, Base + 14, Base + 15);
}
// float((q & 15) - Offset) per lane: one permute of a 16-entry table (it reads the low 4 bits).
template <int Offset>
inline V nibble_float(I q) { return {_mm512_permutexvar_ps(q.v, iota_ps<-Offset>())}; }
// float(((q & 15) | 16 * bit i of `bits`) - Offset) per lane i: two table permutes.
template <int Offset>
inline V five_bit_float(I q, uint32_t bits) {
  return {_mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q.v, iota_ps<-Offset>()), static_cast<__mmask16>(bits), q.v, iota_ps<16 - Offset>())};
}

inline V load_f16(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline V load_bf16(const uint8_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }  // exact, like numpy's float16 -> float32

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

}  // namespace simd
}  // namespace
