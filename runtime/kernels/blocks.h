// GGML block formats decoded to the exact float32 values gguf-py's `dequantize` gives.
//
// Include after one simd_*.h. Each decoder D describes one ggml type:
//   kType     the GGMLQuantizationType id;
//   kQK       elements per block (32 for the elementwise types: a "block" is then 32 elements);
//   kBytes    bytes per block;
//   kElementwise  whether a row may end inside a block (F32/F16/BF16: tail of 16-wide steps);
//   block(b, f)   calls f(c, w0, w1) for c = 0, 1, ... in order, with w0, w1 the block's elements
//                 [32c, 32c + 16) and [32c + 16, 32c + 32) as float32;
//   partial(row, j, n)  (elementwise types) elements [j, j + n) of a row, n <= 16, +0 beyond.
// Every value is computed in gguf-py's float32 operation order (e.g. Q4_K: fl(fl(d * sc) * q) -
// fl(dmin * m)), never fused: build with -ffp-contract=off.
#pragma once

#include <cstdint>
#include <cstring>

namespace {
namespace blocks {

using namespace simd;

inline uint16_t u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline float f16(const uint8_t* p) { return half_to_float(u16(p)); }

struct F32 {
  static constexpr int kType = 0;
  static constexpr int64_t kQK = 32, kBytes = 128;
  static constexpr bool kElementwise = true;
  template <class F> static inline void block(const uint8_t* b, F&& f) {
    f(0, load(reinterpret_cast<const float*>(b)), load(reinterpret_cast<const float*>(b) + 16));
  }
  static inline V partial(const uint8_t* row, int64_t j, int64_t n) { return load_partial(reinterpret_cast<const float*>(row) + j, n); }
};

template <int Type, V (*Load)(const uint8_t*)>
struct Half16 {  // F16 and BF16: 2 bytes per element
  static constexpr int kType = Type;
  static constexpr int64_t kQK = 32, kBytes = 64;
  static constexpr bool kElementwise = true;
  template <class F> static inline void block(const uint8_t* b, F&& f) { f(0, Load(b), Load(b + 32)); }
  static inline V partial(const uint8_t* row, int64_t j, int64_t n) {
    uint8_t buf[32] = {};  // +0 in both formats
    std::memcpy(buf, row + 2 * j, static_cast<size_t>(n) * 2);
    return Load(buf);
  }
};
using F16 = Half16<1, load_f16>;
using BF16 = Half16<30, load_bf16>;

struct Q8_0 {  // d (f16), 32 x int8: w = q * d
  static constexpr int kType = 8;
  static constexpr int64_t kQK = 32, kBytes = 34;
  static constexpr bool kElementwise = false;
  template <class F> static inline void block(const uint8_t* b, F&& f) {
    const V d = set1(f16(b));
    f(0, mul(to_float(load_i8(b + 2)), d), mul(to_float(load_i8(b + 18)), d));
  }
};

struct Q4_0 {  // d, 16 bytes of nibbles (low: elements 0..15, high: 16..31): w = d * (q - 8)
  static constexpr int kType = 2;
  static constexpr int64_t kQK = 32, kBytes = 18;
  static constexpr bool kElementwise = false;
  template <class F> static inline void block(const uint8_t* b, F&& f) {
    const V d = set1(f16(b));
    const I q = load_u8(b + 2);
    f(0, mul(d, to_float(sub_(and_(q, 15), 8))), mul(d, to_float(sub_(srl(q, 4), 8))));
  }
};

struct Q4_1 {  // d, m, nibbles: w = d * q + m (two roundings)
  static constexpr int kType = 3;
  static constexpr int64_t kQK = 32, kBytes = 20;
  static constexpr bool kElementwise = false;
  template <class F> static inline void block(const uint8_t* b, F&& f) {
    const V d = set1(f16(b)), m = set1(f16(b + 2));
    const I q = load_u8(b + 4);
    f(0, add(mul(d, to_float(and_(q, 15))), m), add(mul(d, to_float(srl(q, 4))), m));
  }
};

// The 5-bit values of a Q5_0 / Q5_1 block: nibbles plus bit i of the 32-bit qh for element i.
inline void five_bits(const uint8_t* qh, const uint8_t* qs, I& lo, I& hi) {
  const uint32_t h = u32(qh);
  const I q = load_u8(qs);
  lo = or_(and_(q, 15), bits16(h & 0xFFFFu, 16));
  hi = or_(srl(q, 4), bits16(h >> 16, 16));
}

struct Q5_0 {  // d, qh, nibbles: w = d * (q - 16)
  static constexpr int kType = 6;
  static constexpr int64_t kQK = 32, kBytes = 22;
  static constexpr bool kElementwise = false;
  template <class F> static inline void block(const uint8_t* b, F&& f) {
    const V d = set1(f16(b));
    I lo, hi;
    five_bits(b + 2, b + 6, lo, hi);
    f(0, mul(d, to_float(sub_(lo, 16))), mul(d, to_float(sub_(hi, 16))));
  }
};

struct Q5_1 {  // d, m, qh, nibbles: w = d * q + m
  static constexpr int kType = 7;
  static constexpr int64_t kQK = 32, kBytes = 24;
  static constexpr bool kElementwise = false;
  template <class F> static inline void block(const uint8_t* b, F&& f) {
    const V d = set1(f16(b)), m = set1(f16(b + 2));
    I lo, hi;
    five_bits(b + 4, b + 8, lo, hi);
    f(0, add(mul(d, to_float(lo)), m), add(mul(d, to_float(hi)), m));
  }
};

// The 6-bit scales and mins of a Q4_K / Q5_K super-block (gguf-py's Q4_K.get_scale_min).
inline void scale_min_k4(const uint8_t* s, float d, float dmin, float* scale, float* min) {
  for (int i = 0; i < 4; ++i) {
    scale[i] = d * static_cast<float>(s[i] & 63);
    min[i] = dmin * static_cast<float>(s[4 + i] & 63);
    scale[4 + i] = d * static_cast<float>((s[8 + i] & 15) | ((s[i] >> 2) & 0x30));
    min[4 + i] = dmin * static_cast<float>((s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30));
  }
}

struct Q4_K {  // d, dmin, 12 bytes of scales, 128 bytes of nibbles; 8 sub-blocks of 32: w = fl(d*sc) * q - fl(dmin*m)
  static constexpr int kType = 12;
  static constexpr int64_t kQK = 256, kBytes = 144;
  static constexpr bool kElementwise = false;
  template <class F> static inline void block(const uint8_t* b, F&& f) {
    float scale[8], min[8];
    scale_min_k4(b + 4, f16(b), f16(b + 2), scale, min);
    const uint8_t* qs = b + 16;
    for (int c = 0; c < 4; ++c) {  // bytes [32c, 32c + 32): sub-block 2c in the low nibbles, 2c + 1 in the high
      const I qa = load_u8(qs + 32 * c), qb = load_u8(qs + 32 * c + 16);
      for (int nib = 0; nib < 2; ++nib) {
        const int s = 2 * c + nib;
        const V ds = set1(scale[s]), dm = set1(min[s]);
        const I la = nib ? srl(qa, 4) : and_(qa, 15), lb = nib ? srl(qb, 4) : and_(qb, 15);
        f(s, sub(mul(ds, to_float(la)), dm), sub(mul(ds, to_float(lb)), dm));
      }
    }
  }
};

struct Q5_K {  // Q4_K plus 32 bytes qh: bit s of qh[j] is bit 4 of element j of sub-block s
  static constexpr int kType = 13;
  static constexpr int64_t kQK = 256, kBytes = 176;
  static constexpr bool kElementwise = false;
  template <class F> static inline void block(const uint8_t* b, F&& f) {
    float scale[8], min[8];
    scale_min_k4(b + 4, f16(b), f16(b + 2), scale, min);
    const I ha = load_u8(b + 16), hb = load_u8(b + 32);
    const uint8_t* qs = b + 48;
    for (int c = 0; c < 4; ++c) {
      const I qa = load_u8(qs + 32 * c), qb = load_u8(qs + 32 * c + 16);
      for (int nib = 0; nib < 2; ++nib) {
        const int s = 2 * c + nib;
        const V ds = set1(scale[s]), dm = set1(min[s]);
        const I la = or_(nib ? srl(qa, 4) : and_(qa, 15), shl(and_(srl(ha, s), 1), 4));
        const I lb = or_(nib ? srl(qb, 4) : and_(qb, 15), shl(and_(srl(hb, s), 1), 4));
        f(s, sub(mul(ds, to_float(la)), dm), sub(mul(ds, to_float(lb)), dm));
      }
    }
  }
};

struct Q6_K {  // 128 bytes ql, 64 bytes qh, 16 int8 scales, d; 16 groups of 16: w = fl(d * sc) * (q - 32)
  static constexpr int kType = 14;
  static constexpr int64_t kQK = 256, kBytes = 210;
  static constexpr bool kElementwise = false;
  template <class F> static inline void block(const uint8_t* b, F&& f) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int h = 0; h < 2; ++h) {  // 128 elements: chunk 4h + k, k = 2 * nibble + half
      I lq[4];
      for (int t = 0; t < 4; ++t) lq[t] = load_u8(ql + 64 * h + 16 * t);
      const I ha = load_u8(qh + 32 * h), hb = load_u8(qh + 32 * h + 16);
      for (int k = 0; k < 4; ++k) {
        const int nib = k >> 1, half = k & 1, g = 4 * h + k;
        const I a = nib ? srl(lq[2 * half], 4) : and_(lq[2 * half], 15);
        const I c = nib ? srl(lq[2 * half + 1], 4) : and_(lq[2 * half + 1], 15);
        const I qa = sub_(or_(a, shl(and_(srl(ha, 2 * k), 3), 4)), 32);
        const I qb = sub_(or_(c, shl(and_(srl(hb, 2 * k), 3), 4)), 32);
        const V da = set1(d * static_cast<float>(sc[2 * g])), db = set1(d * static_cast<float>(sc[2 * g + 1]));
        f(g, mul(da, to_float(qa)), mul(db, to_float(qb)));
      }
    }
  }
};

// Calls fn(D{}) with the decoder of ggml type `type`; false when the type is not supported.
template <class Fn>
inline bool with_decoder(int64_t type, Fn&& fn) {
  switch (type) {
    case F32::kType: fn(F32{}); return true;
    case F16::kType: fn(F16{}); return true;
    case BF16::kType: fn(BF16{}); return true;
    case Q8_0::kType: fn(Q8_0{}); return true;
    case Q4_0::kType: fn(Q4_0{}); return true;
    case Q4_1::kType: fn(Q4_1{}); return true;
    case Q5_0::kType: fn(Q5_0{}); return true;
    case Q5_1::kType: fn(Q5_1{}); return true;
    case Q4_K::kType: fn(Q4_K{}); return true;
    case Q5_K::kType: fn(Q5_K{}); return true;
    case Q6_K::kType: fn(Q6_K{}); return true;
    default: return false;
  }
}

}  // namespace blocks
}  // namespace
