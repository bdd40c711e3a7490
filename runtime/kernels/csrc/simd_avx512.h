// 16-lane float / int32 vectors on AVX-512F (plus F16C for scalar halves): the avx512 and avx512vbmi paths.
//
// Every path (this, simd_avx2.h, simd_portable.h) implements the same operations with the same
// rounding, so a kernel written once against them gives bit-identical results on all three.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {
namespace simd {

#ifdef __AVX512VBMI__
constexpr const char* kPath = "avx512vbmi";  // the same module built with -mavx512vbmi (lookup_halves)
#else
constexpr const char* kPath = "avx512";
#endif
constexpr int kAccumulators = 16;  // accumulator vectors a kernel may keep in registers (of 32 zmm)
// Activation rows per pass over a weight row. More rows go in further passes (8 = 6 + 2): a pass of
// 7 or 8 rows decodes one weight row at a time and ran 1.3-1.6x slower on the AMD EPYC Zen 4 than
// 6 + 2 (a 640 x 2048 Q6_K matrix, 8 rows: 491 against 307 us), which doubles the decoding instead.
constexpr int kMaxBatch = 6;
// Weight rows R per pass for n (<= kMaxBatch) rows of x: independent rows to decode while FMAs
// wait, R * n * 2 accumulators (at most 24 of the 32 zmm registers).
constexpr int rows_for(int n) { return n <= 2 ? 4 : n == 3 ? 3 : 2; }
constexpr int parts_for(int, int) { return 1; }  // lane parts per pass (parts.h): always the whole vector
// More rows of x than this take the tiled path (bindings.h: run_tall, the same bits). On the AMD EPYC
// Zen 5 the skinny passes stayed ahead of the tiles to about 32 rows: tiles / skinny at 17-32 rows
// 1.02-1.21x the time on qwen2.5-coder, 0.96-1.10x on gemma3-270m, 0.99-1.23x on smollm2-135m (one
// and two threads), 0.85-0.93x from 40-64 rows (docs/backends-and-kernels.md).
constexpr int64_t kTallMinRows = 32;

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
// a > b ? a : b per lane (vmaxps: b when either is NaN).
inline V max(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V keep_first(V a, int64_t n) { return {_mm512_maskz_mov_ps(tail_mask(n), a.v)}; }  // lanes >= n: +0
inline void store_first(float* p, V a, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), a.v); }  // lanes < min(n, 16)
// GCC's tree (avx512fintrin.h __MM512_REDUCE_OP): lanes 8..15 + 0..7, then 4 + 4, then {2,3,0,1}, then [0] + [1].
inline float reduce(V a) { return _mm512_reduce_add_ps(a.v); }

// y[b * ys + r] = reduce(v[r * Cols + b]) for r < Rows, b < Cols (Rows * Cols <= 16), every sum in
// reduce's pairing (lanes i + (i + 8), then + 4, then + 2, then + 1; IEEE addition commutes). The 16
// trees run transposed, each step adding two inputs' worth of lanes at once (4 shuffles and 2 adds per
// pair instead of ~9 uops per input); one permute orders the results by b, and one masked store per b
// writes its Rows outputs (no scalar reloads of a vector store, which would stall store forwarding).
template <int Rows, int Cols>
__attribute__((always_inline)) inline void reduce_rows(const V* v, float* y, int64_t ys) {
  constexpr int kCount = Rows * Cols;
  static_assert(kCount <= 16, "reduce_rows takes at most 16 vectors");
  if constexpr (kCount < 4) {  // too few to share the tree's shuffles
    for (int r = 0; r < Rows; ++r)
      for (int b = 0; b < Cols; ++b) y[b * ys + r] = reduce(v[r * Cols + b]);
    return;
  } else {
    // Steps over the inputs that exist (the rest are +0 and feed nothing that is kept).
    constexpr int k3 = (kCount + 1) / 2, k6 = (kCount + 3) / 4, k8 = (kCount + 7) / 8;
    const __m512 zero = _mm512_setzero_ps();
    const auto in = [&](int i) { return i < kCount ? v[i].v : zero; };
    __m512 t3[8], t6[4], t8[2];
    for (int i = 0; i < k3; ++i)  // [a[2i] lanes j + (j + 8), a[2i + 1] lanes j + (j + 8)], j < 8
      t3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(in(2 * i), in(2 * i + 1), 0x44), _mm512_shuffle_f32x4(in(2 * i), in(2 * i + 1), 0xEE));
    for (int i = k3; i < 8; ++i) t3[i] = zero;
    for (int i = 0; i < k6; ++i)  // one 128-bit lane per input a[4i..4i+3]: its j + (j + 4), j < 4
      t6[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t3[2 * i], t3[2 * i + 1], 0x88), _mm512_shuffle_f32x4(t3[2 * i], t3[2 * i + 1], 0xDD));
    for (int i = k6; i < 4; ++i) t6[i] = zero;
    for (int i = 0; i < k8; ++i)  // 128-bit lane l: inputs 8i + l and 8i + 4 + l, each its 0 + 2 and 1 + 3
      t8[i] = _mm512_add_ps(_mm512_shuffle_ps(t6[2 * i], t6[2 * i + 1], 0x44), _mm512_shuffle_ps(t6[2 * i], t6[2 * i + 1], 0xEE));
    for (int i = k8; i < 2; ++i) t8[i] = zero;
    // Lane 4l + m: input 4m + l, its 0 + 1.
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(t8[0], t8[1], 0x88), _mm512_shuffle_ps(t8[0], t8[1], 0xDD));
    alignas(64) static constexpr struct Order {
      int32_t lane[16];
      constexpr Order() : lane() {
        for (int b = 0; b < Cols; ++b)
          for (int q = 0; q < Rows; ++q) lane[b * Rows + q] = 4 * ((q * Cols + b) % 4) + (q * Cols + b) / 4;  // lane b * Rows + q <- input q * Cols + b
      }
    } kOrder{};
    const __m512 ordered = _mm512_permutexvar_ps(_mm512_load_si512(kOrder.lane), r);
    for (int b = 0; b < Cols; ++b)  // lanes [b * Rows, (b + 1) * Rows) land at y + b * ys
      _mm512_mask_storeu_ps(y + b * ys - b * Rows, static_cast<__mmask16>(((1u << Rows) - 1u) << (b * Rows)), ordered);
  }
}

inline V to_float(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I as_int(V a) { return {_mm512_castps_si512(a.v)}; }  // the same bits
inline V as_float(I a) { return {_mm512_castsi512_ps(a.v)}; }
inline I load_u8(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline I load_i8(const uint8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline I load_u32(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }  // 16 little-endian 32-bit lanes
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
// The value at q per lane, q already in [0, 16): the same vpermps.
template <int Offset, int Min>
inline V lookup_nibble(const Affine<4, Offset, Min>& a, I q) { return lookup(a, q); }
// The value at q & 31 per lane: one two-table vpermt2ps (index bits 0..4).
template <int Offset, int Min>
inline V lookup(const Affine<5, Offset, Min>& a, I q) { return {_mm512_permutex2var_ps(a.lo.v, q.v, a.hi.v)}; }
// The value at (q & 15) | (h & 16) per lane: one vpternlogd and one two-table vpermt2ps (index bits 0..4).
template <int Offset, int Min>
inline V lookup(const Affine<5, Offset, Min>& a, I q, I h) { return {_mm512_permutex2var_ps(a.lo.v, merge_bits(q, h, 15).v, a.hi.v)}; }
// Elements 0..15 and 16..31 of a 5-bit block, from its 16 nibble bytes q (byte i in lane i) and
// the little-endian 32 high bits at `bits`: the values at (q & 15) | 16 * bit i and
// ((q >> 4) & 15) | 16 * bit (16 + i) per lane i.
#ifdef __AVX512VBMI__
// The avx512vbmi path: one vpmultishiftqb over the 8 bytes at `bits` (the high bits and 4 bytes
// after them, inside the block) takes, per lane i, the byte whose bit 4 is bit i and the byte whose
// bit 0 is bit 16 + i (byte windows may start anywhere in a qword, wrapping); the high half's index
// then shifts down with its nibble. Measured against the rotates below (standalone rows_dot, Q5_0,
// Ice Lake Xeon): 14.0 -> 16.3 G weights/s at one row of x, 12.5 -> 13.9 at two.
struct HighBitWindows {
  __m512i offsets;  // byte 4i: window at bit i - 4 (mod 64), byte 4i + 1: at bit 16 + i
  HighBitWindows() {
    alignas(64) uint8_t byte[64] = {};
    for (int i = 0; i < 16; ++i) {
      byte[4 * i] = static_cast<uint8_t>((i - 4) & 63);
      byte[4 * i + 1] = static_cast<uint8_t>(16 + i);
    }
    offsets = _mm512_load_si512(byte);
  }
};
const HighBitWindows kHighBitWindows;
template <int Offset, int Min>
inline void lookup_halves(const Affine<5, Offset, Min>& a, I q, const uint8_t* bits, V& w0, V& w1) {
  uint64_t word;
  std::memcpy(&word, bits, sizeof(word));
  const I h = {_mm512_multishift_epi64_epi8(kHighBitWindows.offsets, _mm512_set1_epi64(static_cast<long long>(word)))};
  w0 = lookup(a, q, h);
  w1 = {_mm512_permutex2var_ps(a.lo.v, srl(merge_bits(q, h, 0xFF), 4).v, a.hi.v)};  // bits 4..7 of q, bit 8 of h
}
#else
// The avx512 path: the bits broadcast from memory (4 bytes per half) and rotated to bit 4 (measured
// faster than a mask register loaded from memory and a masked permute).
template <int Offset, int Min>
inline void lookup_halves(const Affine<5, Offset, Min>& a, I q, const uint8_t* bits, V& w0, V& w1) {
  const __m512i to_bit4 = _mm512_setr_epi32(4, 3, 2, 1, 0, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21);  // rotate bit i to bit 4
  const auto rotated = [&](const uint8_t* p) {
    uint32_t w;
    std::memcpy(&w, p, sizeof(w));
    return I{_mm512_rolv_epi32(_mm512_set1_epi32(static_cast<int>(w)), to_bit4)};
  };
  w0 = lookup(a, q, rotated(bits));
  w1 = lookup(a, srl(q, 4), rotated(bits + 2));
}
#endif

inline V load_f16(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline V load_bf16(const uint8_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }  // exact, like numpy's float16 -> float32

// Into L2 (T1), not L1: prefetches into L1 wait on its few miss buffers, which held a streamed
// matrix to ~10 GB/s on the Zen 4 EPYC (a Q8_0 head at one row: 8 -> 17 G weights/s with T1).
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

#include "parts.h"

}  // namespace simd
}  // namespace
