// Lane parts of a 16-lane vector: the unit a gemm.h pass multiplies and accumulates in.
//
// Included inside namespace simd by every simd_*.h, after its ops. Part<1, 0> is the whole vector
// (every path); simd_avx2.h adds Part<2, H>, lanes 8H..8H+7, and parts_for picks per rows of x and decoder.
#pragma once

template <int Parts, int H>
struct Part;

template <>
struct Part<1, 0> {
  using T = V;
  static T get(V a) { return a; }
  static T load(const float* p) { return in_register(simd::load(p)); }
  static T fma(T a, T b, T c) { return simd::fma(a, b, c); }
  static T zero() { return simd::zero(); }
  static void put(V& a, T t) { a = t; }
};
