// GGML block formats decoded to the exact float32 values gguf-py's `dequantize` gives.
//
// Include after one simd_*.h. Each decoder D describes one ggml type:
//   kType     the GGMLQuantizationType id;
//   kQK       elements per block (32 for the elementwise types: a "block" is then 32 elements);
//   kBytes    bytes per block;
//   kElementwise  whether a row may end inside a block (F32/F16/BF16: tail of 16-wide steps);
//   State, prepare(b)  what a block's chunks share (its scales), read once per block;
//   chunk(s, b, c, w0, w1)  for c in [0, kQK / 32): the block's elements [32c, 32c + 16) and
//                 [32c + 16, 32c + 32) as float32;
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
// Every fp16 value as float32 (256 KB, built when the module loads): a block's scale is then one
// load that the broadcast folds in, no vector-port work (the kernels are bound by those ports).
struct HalfTable {
  float value[1 << 16];
  HalfTable() {
    for (uint32_t h = 0; h < (1u << 16); ++h) value[h] = half_to_float(static_cast<uint16_t>(h));
  }
};
const HalfTable kHalf;
inline float f16(const uint8_t* p) { return kHalf.value[u16(p)]; }

struct NoState {};

struct F32 {
  static constexpr int kType = 0;
  static constexpr int64_t kQK = 32, kBytes = 128;
  static constexpr bool kElementwise = true;
  using State = NoState;
  static inline State prepare(const uint8_t*) { return {}; }
  static inline void chunk(State, const uint8_t* b, int, V& w0, V& w1) {
    w0 = load(reinterpret_cast<const float*>(b));
    w1 = load(reinterpret_cast<const float*>(b) + 16);
  }
  static inline V partial(const uint8_t* row, int64_t j, int64_t n) { return load_partial(reinterpret_cast<const float*>(row) + j, n); }
};

template <int Type, V (*Load)(const uint8_t*)>
struct Half16 {  // F16 and BF16: 2 bytes per element
  static constexpr int kType = Type;
  static constexpr int64_t kQK = 32, kBytes = 64;
  static constexpr bool kElementwise = true;
  using State = NoState;
  static inline State prepare(const uint8_t*) { return {}; }
  static inline void chunk(State, const uint8_t* b, int, V& w0, V& w1) { w0 = Load(b); w1 = Load(b + 32); }
  static inline V partial(const uint8_t* row, int64_t j, int64_t n) {
    uint8_t buf[32] = {};  // +0 in both formats
    std::memcpy(buf, row + 2 * j, static_cast<size_t>(n) * 2);
    return Load(buf);
  }
};
using F16 = Half16<1, load_f16>;
using BF16 = Half16<30, load_bf16>;

struct Scale { float d; };
struct ScaleMin { float d, m; };

struct Q8_0 {  // d (f16), 32 x int8: w = q * d
  static constexpr int kType = 8;
  static constexpr int64_t kQK = 32, kBytes = 34;
  static constexpr bool kElementwise = false;
  using State = Scale;
  static inline State prepare(const uint8_t* b) { return {f16(b)}; }
  static inline void chunk(State s, const uint8_t* b, int, V& w0, V& w1) {
    const V d = set1(s.d);
    w0 = mul(to_float(load_i8(b + 2)), d);
    w1 = mul(to_float(load_i8(b + 18)), d);
  }
};

struct Q4_0 {  // d, 16 bytes of nibbles (low: elements 0..15, high: 16..31): w = d * (q - 8)
  static constexpr int kType = 2;
  static constexpr int64_t kQK = 32, kBytes = 18;
  static constexpr bool kElementwise = false;
  using State = Scale;
  static inline State prepare(const uint8_t* b) { return {f16(b)}; }
  static inline void chunk(State s, const uint8_t* b, int, V& w0, V& w1) {
    const V d = set1(s.d);
    const I q = load_u8(b + 2);
    w0 = mul(d, nibble_float<8>(q));
    w1 = mul(d, nibble_float<8>(srl(q, 4)));
  }
};

struct Q4_1 {  // d, m, nibbles: w = d * q + m (two roundings)
  static constexpr int kType = 3;
  static constexpr int64_t kQK = 32, kBytes = 20;
  static constexpr bool kElementwise = false;
  using State = ScaleMin;
  static inline State prepare(const uint8_t* b) { return {f16(b), f16(b + 2)}; }
  static inline void chunk(State s, const uint8_t* b, int, V& w0, V& w1) {
    const V d = set1(s.d), m = set1(s.m);
    const I q = load_u8(b + 4);
    w0 = add(mul(d, nibble_float<0>(q)), m);
    w1 = add(mul(d, nibble_float<0>(srl(q, 4))), m);
  }
};

struct Q5_0 {  // d, qh, nibbles: w = d * (q - 16)
  static constexpr int kType = 6;
  static constexpr int64_t kQK = 32, kBytes = 22;
  static constexpr bool kElementwise = false;
  using State = Scale;
  static inline State prepare(const uint8_t* b) { return {f16(b)}; }
  static inline void chunk(State s, const uint8_t* b, int, V& w0, V& w1) {
    const V d = set1(s.d);
    const uint32_t h = u32(b + 2);  // bit i: bit 4 of element i
    const I q = load_u8(b + 6);
    w0 = mul(d, five_bit_float<16>(q, h & 0xFFFFu));
    w1 = mul(d, five_bit_float<16>(srl(q, 4), h >> 16));
  }
};

struct Q5_1 {  // d, m, qh, nibbles: w = d * q + m
  static constexpr int kType = 7;
  static constexpr int64_t kQK = 32, kBytes = 24;
  static constexpr bool kElementwise = false;
  using State = ScaleMin;
  static inline State prepare(const uint8_t* b) { return {f16(b), f16(b + 2)}; }
  static inline void chunk(State s, const uint8_t* b, int, V& w0, V& w1) {
    const V d = set1(s.d), m = set1(s.m);
    const uint32_t h = u32(b + 4);
    const I q = load_u8(b + 8);
    w0 = add(mul(d, five_bit_float<0>(q, h & 0xFFFFu)), m);
    w1 = add(mul(d, five_bit_float<0>(srl(q, 4), h >> 16)), m);
  }
};

// A Q4_K / Q5_K super-block's 8 sub-block scales fl(d * sc) and mins fl(dmin * m), from the
// 12 packed bytes of 6-bit values (gguf-py's Q4_K.get_scale_min).
struct ScalesK4 {
  float scale[8], min[8];
};
inline ScalesK4 scales_k4(const uint8_t* b) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* s = b + 4;
  ScalesK4 r;
  for (int i = 0; i < 4; ++i) {
    r.scale[i] = d * static_cast<float>(s[i] & 63);
    r.min[i] = dmin * static_cast<float>(s[4 + i] & 63);
    r.scale[4 + i] = d * static_cast<float>((s[8 + i] & 15) | ((s[i] >> 2) & 0x30));
    r.min[4 + i] = dmin * static_cast<float>((s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30));
  }
  return r;
}

// Sub-block c of a Q4_K / Q5_K super-block: 32 bytes of nibbles at qs + 32 * (c / 2), the low
// nibbles for even c, the high ones for odd c (in the low 4 bits of a and b; higher bits: garbage).
inline void nibbles_k(const uint8_t* qs, int c, I& a, I& b) {
  const I qa = load_u8(qs + 32 * (c >> 1)), qb = load_u8(qs + 32 * (c >> 1) + 16);
  a = c & 1 ? srl(qa, 4) : qa;
  b = c & 1 ? srl(qb, 4) : qb;
}

struct Q4_K {  // d, dmin, 12 bytes of scales, 128 bytes of nibbles; 8 sub-blocks of 32: w = fl(d*sc) * q - fl(dmin*m)
  static constexpr int kType = 12;
  static constexpr int64_t kQK = 256, kBytes = 144;
  static constexpr bool kElementwise = false;
  using State = ScalesK4;
  static inline State prepare(const uint8_t* b) { return scales_k4(b); }
  static inline void chunk(const State& s, const uint8_t* b, int c, V& w0, V& w1) {
    const V ds = set1(s.scale[c]), dm = set1(s.min[c]);
    I a, q;
    nibbles_k(b + 16, c, a, q);
    w0 = sub(mul(ds, nibble_float<0>(a)), dm);
    w1 = sub(mul(ds, nibble_float<0>(q)), dm);
  }
};

struct Q5_K {  // Q4_K plus 32 bytes qh at byte 16: bit c of qh[j] is bit 4 of element j of sub-block c
  static constexpr int kType = 13;
  static constexpr int64_t kQK = 256, kBytes = 176;
  static constexpr bool kElementwise = false;
  using State = ScalesK4;
  static inline State prepare(const uint8_t* b) { return scales_k4(b); }
  static inline void chunk(const State& s, const uint8_t* b, int c, V& w0, V& w1) {
    const V ds = set1(s.scale[c]), dm = set1(s.min[c]);
    I a, q;
    nibbles_k(b + 48, c, a, q);
    a = or_(and_(a, 15), shl(and_(srl(load_u8(b + 16), c), 1), 4));
    q = or_(and_(q, 15), shl(and_(srl(load_u8(b + 32), c), 1), 4));
    w0 = sub(mul(ds, to_float(a)), dm);
    w1 = sub(mul(ds, to_float(q)), dm);
  }
};

struct ScalesK6 {
  float scale[16];
};

struct Q6_K {  // 128 bytes ql, 64 bytes qh, 16 int8 scales, d; 16 groups of 16: w = fl(d * sc) * (q - 32)
  static constexpr int kType = 14;
  static constexpr int64_t kQK = 256, kBytes = 210;
  static constexpr bool kElementwise = false;
  using State = ScalesK6;
  static inline State prepare(const uint8_t* b) {
    const float d = f16(b + 208);
    State s;
    for (int i = 0; i < 16; ++i) s.scale[i] = d * static_cast<float>(static_cast<int8_t>(b[192 + i]));
    return s;
  }
  // Chunk c = 4h + k of half h (128 elements): low 4 bits from ql[64h + 32 (k & 1) + j], nibble
  // k >> 1; high 2 bits from qh[32h + j] >> 2k (gguf-py's Q6_K reshapes).
  static inline void chunk(const State& s, const uint8_t* b, int c, V& w0, V& w1) {
    const int h = c >> 2, k = c & 3;
    const uint8_t* ql = b + 64 * h + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    const I la = load_u8(ql), lb = load_u8(ql + 16);
    const I a = k >> 1 ? srl(la, 4) : and_(la, 15), q = k >> 1 ? srl(lb, 4) : and_(lb, 15);
    const I qa = sub_(or_(a, shl(and_(srl(load_u8(qh), 2 * k), 3), 4)), 32);
    const I qb = sub_(or_(q, shl(and_(srl(load_u8(qh + 16), 2 * k), 3), 4)), 32);
    w0 = mul(set1(s.scale[2 * c]), to_float(qa));
    w1 = mul(set1(s.scale[2 * c + 1]), to_float(qb));
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
