// Block values computed per element: the Affine vocabulary of the AVX2 and portable paths.
//
// Included inside namespace simd by simd_avx2.h and simd_portable.h, after the ops it uses (mul,
// to_float, sub_, add, sub, and_, merge_bits). Both keep a block's d and m and compute each value
// in gguf-py's order; the AVX-512 path (simd_avx512.h) tables the same products per block instead
// (a permute table measured slower on AVX2), so all three give the same bits.
#pragma once

// A block's values fl(fl(d * (q - Offset)) + m) (Min = 1), fl(fl(d * (q - Offset)) - m) (Min = -1) or
// fl(d * (q - Offset)) (Min = 0) at its 2^Bits quants q (Bits 4 or 5), looked up per element.
template <int Bits, int Offset, int Min>
struct Affine { V d, m; };
template <int Bits, int Offset, int Min>
inline Affine<Bits, Offset, Min> affine(V d, V m = zero()) { return {d, m}; }
// Min = 1 is only the _1 formats' fp16 d and m (blocks.h's Legacy): there d * (q - Offset) is exact in
// float32 (at most 11 + 5 significant bits), so one FMA rounds d * q + m exactly as the product
// then the sum do, in one vector operation instead of two.
template <int Offset, int Min>
inline V affine_at(V d, V m, I q) {  // the value at the quant q (in range)
  if constexpr (Min > 0) return fma(to_float(sub_(q, Offset)), d, m);
  const V w = mul(d, to_float(sub_(q, Offset)));
  return Min < 0 ? sub(w, m) : w;
}
// The value at q & 15 per lane.
template <int Offset, int Min>
inline V lookup(const Affine<4, Offset, Min>& a, I q) { return affine_at<Offset, Min>(a.d, a.m, and_(q, 15)); }
// The value at q per lane, q already in [0, 16) (a byte's high nibble): no mask.
template <int Offset, int Min>
inline V lookup_nibble(const Affine<4, Offset, Min>& a, I q) { return affine_at<Offset, Min>(a.d, a.m, q); }
// The value at q & 31 per lane.
template <int Offset, int Min>
inline V lookup(const Affine<5, Offset, Min>& a, I q) { return affine_at<Offset, Min>(a.d, a.m, and_(q, 31)); }
// The value at (q & 15) | (h & 16) per lane.
template <int Offset, int Min>
inline V lookup(const Affine<5, Offset, Min>& a, I q, I h) { return affine_at<Offset, Min>(a.d, a.m, and_(merge_bits(q, h, 15), 31)); }
