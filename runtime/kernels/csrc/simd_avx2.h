// 16-lane float / int32 vectors as pairs of 8-lane AVX2 registers (plus FMA, F16C): the AVX2 path.
//
// Same operations and rounding as simd_avx512.h, including its horizontal-sum tree, so results
// are bit-identical to the AVX-512 path.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {
namespace simd {

constexpr const char* kPath = "avx2";
constexpr int kAccumulators = 6;  // accumulator vectors a kernel may keep in registers (12 of 16 ymm)
constexpr int kMaxBatch = 6;  // activation rows per pass (above 3 in two lane parts: 12 of the 16 ymm registers accumulate)
constexpr int rows_for(int n) { return n == 1 ? 2 : 1; }  // weight rows per pass for n rows of x
// Lane parts per pass for n rows of x: one (all 16 lanes, 4 ymm per row of x) below `from` rows, then
// two passes of 8 lanes over each weight row (2 ymm per row of x), the second from L1: 4-6 rows then
// stream and decode the weights once instead of twice (3 + n - 3 rows), e.g. qwen2.5-coder's verify
// of 4 rows 2.10x -> 1.64x the time of one. `from` is the decoder's (blocks::kPartsFrom): 4, or 3
// where a three-row whole-vector pass spills its registers.
constexpr int parts_for(int n, int from) { return n < from ? 1 : 2; }
// More rows of x than this take the tiled path (bindings.h: run_tall, the same bits). On the AMD EPYC
// Zen 3 the skinny passes cost ~25 ms a row of qwen2.5-coder's forward past two rows, the tiles ~19:
// tiles from 8 rows ran 0.96x / 0.88x / 0.72-0.85x the time at 8 / 12 / 16 rows on one and two threads,
// and 1.06x at 6 rows on two (docs/backends-and-kernels.md).
constexpr int64_t kTallMinRows = 7;

struct V { __m256 lo, hi; };   // lanes 0..7, 8..15
struct I { __m256i lo, hi; };

inline V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V bcast(const float* p) { return set1(*p); }  // set1(*p)
inline V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V in_register(V a) { return a; }  // (AVX-512 pins loads in registers; here the compiler chooses)
inline V load_partial(const float* p, int64_t n) {  // lanes >= n: +0
  alignas(32) float buf[16] = {};
  std::memcpy(buf, p, static_cast<size_t>(n < 16 ? n : 16) * sizeof(float));
  return load(buf);
}
inline void store(float* p, V a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V sub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V max(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }  // a > b ? a : b (b when either is NaN)
inline V keep_first(V a, int64_t n) {  // lanes >= n: +0
  alignas(32) float buf[16];
  store(buf, a);
  for (int64_t l = n < 0 ? 0 : n; l < 16; ++l) buf[l] = 0.0f;
  return load(buf);
}
inline void store_first(float* p, V a, int64_t n) {  // lanes < min(n, 16)
  alignas(32) float buf[16];
  store(buf, a);
  std::memcpy(p, buf, static_cast<size_t>(n < 16 ? n : 16) * sizeof(float));
}
// The AVX-512 path's tree (GCC's _mm512_reduce_add_ps): 8..15 + 0..7, 4 + 4, {2,3,0,1}, [0] + [1].
inline float reduce(V a) {
  const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1)));
}
// y[b * ys + r] = reduce(v[r * Cols + b]) (the AVX-512 path transposes the trees; here one at a time).
template <int Rows, int Cols>
inline void reduce_rows(const V* v, float* y, int64_t ys) {
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Cols; ++b) y[b * ys + r] = reduce(v[r * Cols + b]);
}

inline V to_float(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I as_int(V a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }  // the same bits
inline V as_float(I a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
// Two widening loads from memory (vpmovzxbd / vpmovsxbd ymm, m64): no byte shift between them.
inline I load_u8(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline I load_i8(const uint8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline I load_u32(const uint8_t* p) {  // 16 little-endian 32-bit lanes
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline I and_(I a, int m) { const __m256i v = _mm256_set1_epi32(m); return {_mm256_and_si256(a.lo, v), _mm256_and_si256(a.hi, v)}; }
inline I or_(I a, I b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline I xor_(I a, int m) { const __m256i v = _mm256_set1_epi32(m); return {_mm256_xor_si256(a.lo, v), _mm256_xor_si256(a.hi, v)}; }
inline I srl(I a, int s) { const __m128i c = _mm_cvtsi32_si128(s); return {_mm256_srl_epi32(a.lo, c), _mm256_srl_epi32(a.hi, c)}; }
inline I shl(I a, int s) { const __m128i c = _mm_cvtsi32_si128(s); return {_mm256_sll_epi32(a.lo, c), _mm256_sll_epi32(a.hi, c)}; }
inline I sub_(I a, int b) { const __m256i v = _mm256_set1_epi32(b); return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)}; }
// The bits of a where m has ones, of b elsewhere.
inline I merge_bits(I a, I b, int m) {
  const __m256i v = _mm256_set1_epi32(m);
  return {_mm256_or_si256(_mm256_and_si256(a.lo, v), _mm256_andnot_si256(v, b.lo)), _mm256_or_si256(_mm256_and_si256(a.hi, v), _mm256_andnot_si256(v, b.hi))};
}

#include "affine_per_element.h"  // Affine, affine, lookup: the values computed per element
// Lane i of entry v is 16 * bit i of v (8 KB, built when the module loads).
struct BitTable {
  alignas(32) int32_t lane[256][8];
  BitTable() {
    for (int v = 0; v < 256; ++v)
      for (int i = 0; i < 8; ++i) lane[v][i] = (v >> i) & 1 ? 16 : 0;
  }
};
const BitTable kBit16;
// Elements 0..15 and 16..31 of a 5-bit block (simd_avx512.h's lookup_halves): the values at
// (q & 15) | 16 * bit i and ((q >> 4) & 15) | 16 * bit (16 + i) of the little-endian bits at
// `bits`, per lane i; a table load per 8 lanes gives the 16s.
template <int Offset, int Min>
inline void lookup_halves(const Affine<5, Offset, Min>& a, I q, const uint8_t* bits, V& w0, V& w1) {
  const auto sixteens = [](const uint8_t* p) {
    return I{_mm256_load_si256(reinterpret_cast<const __m256i*>(kBit16.lane[p[0]])),
             _mm256_load_si256(reinterpret_cast<const __m256i*>(kBit16.lane[p[1]]))};
  };
  w0 = affine_at<Offset, Min>(a.d, a.m, or_(and_(q, 15), sixteens(bits)));
  w1 = affine_at<Offset, Min>(a.d, a.m, or_(srl(q, 4), sixteens(bits + 2)));  // q's lanes are bytes
}

inline V load_f16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline V load_bf16(const uint8_t* p) {
  const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }  // exact, like numpy's float16 -> float32

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }  // into L2, as on AVX-512

#include "parts.h"
// Lanes 8H..8H+7 of a 16-lane vector (a weight row's two passes above three rows of x).
template <int H>
struct Part<2, H> {
  using T = __m256;
  static T get(V a) { return H ? a.hi : a.lo; }
  static T load(const float* p) { return _mm256_loadu_ps(p + 8 * H); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T zero() { return _mm256_setzero_ps(); }
  static void put(V& a, T t) { (H ? a.hi : a.lo) = t; }
};

}  // namespace simd
}  // namespace
