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
// Weight rows per pass for n rows of x: independent rows to decode while FMAs wait, with at most
// 16 accumulators (of 32 zmm registers).
constexpr int rows_for(int n) { return n <= 2 ? 4 : n == 3 ? 3 : n <= 6 ? 2 : 1; }

struct V { __m512 v; };   // 16 floats
struct I { __m512i v; };  // 16 int32

// Mask of the first min(remaining, 16) lanes: the tail of a loop over 16-wide steps.
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1u);
}

inline V zero() { return {_mm512_setzero_ps()}; }
inline V set1(float a) { return {_mm512_set1_ps(a)}; }
// set1(*p) as a broadcast load (no vector-port work): GCC would otherwise keep an array of scales
// in registers and broadcast each lane with a permute.
inline V bcast(const float* p) { __m512 r; asm("vbroadcastss %1, %0" : "=v"(r) : "m"(*p)); return {r}; }
inline V load(const float* p) { return {_mm512_loadu_ps(p)}; }
// a, kept in a register: the compiler cannot fold its load into each use as a memory operand.
inline V in_register(V a) { asm("" : "+v"(a.v)); return a; }
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
inline I xor_(I a, int m) { return {_mm512_xor_si512(a.v, _mm512_set1_epi32(m))}; }
inline I srl(I a, int s) { return {_mm512_srl_epi32(a.v, _mm_cvtsi32_si128(s))}; }
inline I shl(I a, int s) { return {_mm512_sll_epi32(a.v, _mm_cvtsi32_si128(s))}; }
inline I sub_(I a, int b) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(b))}; }
// The bits of a where m has ones, of b elsewhere: one vpternlogd.
inline I merge_bits(I a, I b, int m) { return {_mm512_ternarylogic_epi32(a.v, b.v, _mm512_set1_epi32(m), 0xE4)}; }

// Lanes [Base, Base + 16) as floats.
template <int Base>
inline V iota() {
  return {_mm512_setr_ps(Base + 0, Base + 1, Base + 2, Base + 3, Base + 4, Base + 5, Base + 6, Base + 7, Base + 8, Base + 9,
                         Base + 10, Base + 11, Base + 12, Base + 13, Base + 14, Base + 15)};
}
// A block's values fl(fl(d * (q - Offset)) + m) (Min = 1), fl(fl(d * (q - Offset)) - m) (Min = -1) or
// fl(d * (q - Offset)) (Min = 0) at its 2^Bits quants q (Bits 4 or 5), then looked up per element.
// Here: a 16- or 32-entry table built once per block (per sub-block for K-quants), one permute per
// lookup, instead of the multiply (and add) per element; the table holds the same float products,
// so the values are the same bits.
template <int Bits, int Offset, int Min>
struct Affine { V lo, hi; };  // the values at q = 0..15 and (Bits == 5) q = 16..31
template <int Bits, int Offset, int Min>
inline Affine<Bits, Offset, Min> affine(V d, V m = zero()) {
  const auto at = [&](V q) { const V w = mul(d, q); return Min > 0 ? add(w, m) : Min < 0 ? sub(w, m) : w; };
  if constexpr (Bits == 4) return {at(iota<-Offset>()), zero()};
  else return {at(iota<-Offset>()), at(iota<16 - Offset>())};
}
// The value at q & 15 per lane: one vpermps (it reads the low 4 bits of each index).
template <int Offset, int Min>
inline V lookup(const Affine<4, Offset, Min>& a, I q) { return {_mm512_permutexvar_ps(q.v, a.lo.v)}; }
// The value at (q & 15) | (h & 16) per lane: one vpternlogd and one two-table vpermt2ps (index bits 0..4).
template <int Offset, int Min>
inline V lookup(const Affine<5, Offset, Min>& a, I q, I h) { return {_mm512_permutex2var_ps(a.lo.v, merge_bits(q, h, 15).v, a.hi.v)}; }
// The value at (q & 15) | 16 * (bit i of the little-endian bits at `bits`) per lane i (reads 4
// bytes): the bits broadcast from memory and rotated to bit 4, then the lookup above (measured
// faster than a mask register loaded from memory and a masked permute).
template <int Offset, int Min>
inline V lookup(const Affine<5, Offset, Min>& a, I q, const uint8_t* bits) {
  uint32_t w;
  std::memcpy(&w, bits, sizeof(w));
  const __m512i to_bit4 = _mm512_setr_epi32(4, 3, 2, 1, 0, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21);  // rotate bit i to bit 4
  return lookup(a, q, I{_mm512_rolv_epi32(_mm512_set1_epi32(static_cast<int>(w)), to_bit4)});
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
