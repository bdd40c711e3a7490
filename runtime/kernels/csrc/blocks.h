// GGML block formats decoded to the exact float32 values gguf-py's `dequantize` gives.
//
// Include after one simd_*.h. Each decoder D describes one ggml type:
//   kType     the GGMLQuantizationType id;
//   kQK       elements per block (32 for the elementwise types: a "block" is then 32 elements);
//   kBytes    bytes per block;
//   kElementwise  whether a row may end inside a block (F32/F16/BF16: tail of 16-wide steps);
//   Tail      (only where declared: Q5_0Lanes) the decoder of a row's last cols % kQK elements,
//             stored after its whole blocks as whole blocks of that format;
//   State, prepare(b)  what a block's chunks share (its scales; for the 4- and 5-bit formats its
//                 values as simd::Affine, a table on AVX-512), made once per block;
//   chunk(s, b, c, w0, w1)  for c in [0, kQK / 32): the block's elements [32c, 32c + 16) and
//                 [32c + 16, 32c + 32) as float32;
//   partial(row, j, n)  (elementwise types) elements [j, j + n) of a row, n <= 16, +0 beyond.
// Every value is computed in gguf-py's float32 operation order (e.g. Q4_K: fl(fl(d * sc) * q) -
// fl(dmin * m)), never fused: build with -ffp-contract=off.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

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

// Q8_0's scale, broadcast once per block: prepare's broadcast reads memory (kHalf), which costs
// no vector-port work.
struct Scale { V d; };

struct Q8_0 {  // d (f16), 32 x int8: w = q * d
  static constexpr int kType = 8;
  static constexpr int64_t kQK = 32, kBytes = 34;
  static constexpr bool kElementwise = false;
  using State = Scale;
  static inline State prepare(const uint8_t* b) { return {set1(f16(b))}; }
  static inline void chunk(State s, const uint8_t* b, int, V& w0, V& w1) {
    w0 = mul(to_float(load_i8(b + 2)), s.d);
    w1 = mul(to_float(load_i8(b + 18)), s.d);
  }
};

// The 4- and 5-bit formats: a block's values as simd::Affine (a table on AVX-512), built in prepare.
// Q4_0, Q4_1, Q5_0, Q5_1: d (f16), then m (f16; the _1 types), then qh (4 bytes; the 5-bit types:
// bit i of the 32 bits is bit 4 of element i), then 16 bytes of nibbles (low: elements 0..15,
// high: 16..31). _0: w = d * (q - 2^(bits - 1)); _1: w = d * q + m (two roundings).
template <int kBits, bool kMin, int kTypeId>
struct Legacy {
  static constexpr int kType = kTypeId;
  static constexpr int kHigh = kMin ? 4 : 2;                      // byte offset of qh
  static constexpr int kNibbles = kHigh + (kBits == 5 ? 4 : 0);  // byte offset of the nibbles
  static constexpr int kOffset = kMin ? 0 : 1 << (kBits - 1);
  static constexpr int64_t kQK = 32, kBytes = kNibbles + 16;
  static constexpr bool kElementwise = false;
  using State = Affine<kBits, kOffset, kMin ? 1 : 0>;
  static inline State prepare(const uint8_t* b) {
    if constexpr (kMin) return affine<kBits, 0, 1>(set1(f16(b)), set1(f16(b + 2)));
    else return affine<kBits, kOffset, 0>(set1(f16(b)));
  }
  static inline void chunk(const State& s, const uint8_t* b, int, V& w0, V& w1) {
    const I q = load_u8(b + kNibbles);
    if constexpr (kBits == 4) {
      w0 = lookup(s, q);
      w1 = lookup_nibble(s, srl(q, 4));  // q's lanes are bytes
    } else {
      lookup_halves(s, q, b + kHigh, w0, w1);
    }
  }
};
using Q4_0 = Legacy<4, false, 2>;
using Q4_1 = Legacy<4, true, 3>;
using Q5_0 = Legacy<5, false, 6>;
using Q5_1 = Legacy<5, true, 7>;

// a shifted so that its bit `from` lands at bit `to` (the other bits move with it).
inline I move_bit(I a, int from, int to) { return from > to ? srl(a, from - to) : from < to ? shl(a, to - from) : a; }

// A Q4_K / Q5_K super-block's 8 sub-block scales fl(d * sc) and mins fl(dmin * m) (gguf-py's
// Q4_K.get_scale_min): the 12 packed bytes of 6-bit values unpacked four at a time in general
// registers to the bytes sc0..3, m0..3, sc4..7, m4..7, then converted and scaled 16 lanes at once.
// scale[] holds the scales at lanes 0..3 and 8..11, min[] the mins at lanes 4..7 and 12..15 (the
// other lanes are unused); chunks read them back with a broadcast from memory.
struct ScalesK4 {
  float scale[16], min[16];
  V sc(int c) const { return bcast(scale + (c < 4 ? c : c + 4)); }
  V mn(int c) const { return bcast(min + (c < 4 ? c + 4 : c + 8)); }
};
inline ScalesK4 scales_k4(const uint8_t* b) {
  const uint32_t s = u32(b + 4), m = u32(b + 8), h = u32(b + 12);
  uint32_t packed[4] = {s & 0x3F3F3F3Fu, m & 0x3F3F3F3Fu, (h & 0x0F0F0F0Fu) | ((s >> 2) & 0x30303030u),
                        ((h >> 4) & 0x0F0F0F0Fu) | ((m >> 2) & 0x30303030u)};
  asm("" : "+m"(packed));  // keep the bytes in memory: GCC would gather them into a vector with port-5 inserts
  const V q = to_float(load_u8(reinterpret_cast<const uint8_t*>(packed)));
  ScalesK4 r;
  store(r.scale, mul(set1(f16(b)), q));
  store(r.min, mul(set1(f16(b + 2)), q));
  return r;
}

// Sub-block c of a Q4_K / Q5_K super-block: 32 bytes of nibbles at qs + 32 * (c / 2), the low
// nibbles for even c, the high ones for odd c (in the low 4 bits of a and b; higher bits: garbage).
inline void nibbles_k(const uint8_t* qs, int c, I& a, I& b) {
  const I qa = load_u8(qs + 32 * (c >> 1)), qb = load_u8(qs + 32 * (c >> 1) + 16);
  a = c & 1 ? srl(qa, 4) : qa;
  b = c & 1 ? srl(qb, 4) : qb;
}

// Q4_K: d, dmin, 12 bytes of scales, 128 bytes of nibbles; 8 sub-blocks of 32: w = fl(d*sc) * q - fl(dmin*m).
// Q5_K: the same plus 32 bytes qh at byte 16 (bit c of qh[j] is bit 4 of element j of sub-block c).
template <int kBits, int kTypeId>
struct SuperK {
  static constexpr int kType = kTypeId;
  static constexpr int kNibbles = kBits == 4 ? 16 : 48;  // byte offset of the nibbles
  static constexpr int64_t kQK = 256, kBytes = kNibbles + 128;
  static constexpr bool kElementwise = false;
  using State = ScalesK4;
  static inline State prepare(const uint8_t* b) { return scales_k4(b); }
  static inline void chunk(const State& s, const uint8_t* b, int c, V& w0, V& w1) {
    const auto t = affine<kBits, 0, -1>(s.sc(c), s.mn(c));
    I a, q;
    nibbles_k(b + kNibbles, c, a, q);
    if constexpr (kBits == 4) {
      w0 = lookup(t, a);
      w1 = lookup(t, q);
    } else {
      w0 = lookup(t, a, move_bit(load_u8(b + 16), c, 4));
      w1 = lookup(t, q, move_bit(load_u8(b + 32), c, 4));
    }
  }
};
using Q4_K = SuperK<4, 12>;
using Q5_K = SuperK<5, 13>;

// Q6_K's 16 group scales fl(d * sc) times 2^-26 (exact: a power of two, and fl(d * sc) is 0 or
// at least 2^-24 in magnitude): chunks multiply them by (q - 32) * 2^26, the quant in the top 6
// bits of an int32, which converts exactly and gives the same real product, so the same float.
struct ScalesK6 {
  float scale[16];
};

struct Q6_K {  // 128 bytes ql, 64 bytes qh, 16 int8 scales, d; 16 groups of 16: w = fl(d * sc) * (q - 32)
  static constexpr int kType = 14;
  static constexpr int64_t kQK = 256, kBytes = 210;
  static constexpr bool kElementwise = false;
  using State = ScalesK6;
  static inline State prepare(const uint8_t* b) {
    State s;
    store(s.scale, mul(mul(set1(f16(b + 208)), to_float(load_i8(b + 192))), set1(0x1p-26f)));
    return s;
  }
  // Chunk c = 4h + k of half h (128 elements): low 4 bits from ql[64h + 32 (k & 1) + j], nibble
  // k >> 1; high 2 bits from qh[32h + j] >> 2k (gguf-py's Q6_K reshapes). The quant q sits in
  // bits 0..5 with bit 5 flipped (qh ^ 0xAA): shifted to bits 26..31, that int32 is (q - 32) * 2^26.
  static inline void chunk(const State& s, const uint8_t* b, int c, V& w0, V& w1) {
    const int h = c >> 2, k = c & 3;
    const uint8_t* ql = b + 64 * h + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    const I la = load_u8(ql), lb = load_u8(ql + 16);
    const I a = k >> 1 ? srl(la, 4) : la, q = k >> 1 ? srl(lb, 4) : lb;
    const I ha = move_bit(xor_(load_u8(qh), 0xAA), 2 * k, 4), hb = move_bit(xor_(load_u8(qh + 16), 0xAA), 2 * k, 4);
    w0 = mul(bcast(s.scale + 2 * c), to_float(shl(merge_bits(a, ha, 15), 26)));
    w1 = mul(bcast(s.scale + 2 * c + 1), to_float(shl(merge_bits(q, hb, 15), 26)));
  }
};

// The lanes layouts (runtime/kernels/lanes.py): not GGML types, what the native backend repacks Q5_0,
// Q4_K and Q6_K matrices to where the AVX-512 or AVX2 kernels run. Element 16f + i of a 64-byte vector's
// span sits in bits [width f, width (f + 1)) of its little-endian uint32 lane i, so a half-chunk's
// quants are one shift of one load away; the file's formats widen bytes (and gather high bits)
// first, on the port the table lookups need. Each decoder computes its source type's values in the
// same operations, so the same bits.
//
// Field f of Width bits at `lanes` (element 16f + i at bits [Width f, Width (f + 1)) of lane i's
// value, whose 32-bit words are consecutive 64-byte vectors), in bits 0..Width-1 of each lane
// (higher bits: garbage). f is a constant after unrolling, so the branches fold.
template <int Width>
inline I lane_field(const uint8_t* lanes, int f) {
  const int bit = Width * f, word = bit / 32, off = bit % 32;
  const I v = load_u32(lanes + 64 * word);
  const I low = off ? srl(v, off) : v;
  if (off + Width <= 32) return low;
  return merge_bits(low, shl(load_u32(lanes + 64 * (word + 1)), 32 - off), (1 << (32 - off)) - 1);  // a straddling field
}

// Q5_0 in lanes: three blocks per 70-byte group, 64 bytes of 5-bit fields (f = 2 * block + half),
// then the three blocks' d; a row's last cols % 96 elements stay Q5_0 blocks. Per half-block one
// shift and one permute (Q5_0: a widening load, a multishift, two merges and a shift per block
// besides its two permutes).
struct Q5_0Lanes {
  static constexpr int kType = 1006;  // 1000 + Q5_0's GGML id (lanes.py: LANES_TYPES)
  static constexpr int64_t kQK = 96, kBytes = 70;
  static constexpr bool kElementwise = false;
  // AVX2: lane parts from three rows of x (simd::parts_for). Its whole-vector three-row pass spills
  // and ran about as long as four rows in two parts (qwen2.5-coder's ffn_gate, ~1.4 ms); in parts,
  // 8-15 % faster. The K-quants' lanes (0-7 %) and Q8_0 (12-18 %) ran slower in parts at three rows: they keep 4.
  static constexpr int kPartsFrom = 3;
  using Tail = Q5_0;
  struct State { I q; };
  static inline State prepare(const uint8_t* b) { return {load_u32(b)}; }
  static inline void chunk(const State& s, const uint8_t* b, int c, V& w0, V& w1) {
    const auto t = affine<5, 16, 0>(bcast(&kHalf.value[u16(b + 64 + 2 * c)]));
    w0 = lookup(t, c == 0 ? s.q : srl(s.q, 10 * c));  // the index: bits 0..4 of the shifted lanes
    w1 = lookup(t, srl(s.q, 10 * c + 5));
  }
};

// Q4_K in lanes: a super-block's 128 bytes of 4-bit fields, then its 16-byte header (d, dmin, scales).
struct Q4_KLanes {
  static constexpr int kType = 1012;
  static constexpr int64_t kQK = 256, kBytes = 144;
  static constexpr bool kElementwise = false;
  using State = ScalesK4;
  static inline State prepare(const uint8_t* b) { return scales_k4(b + 128); }
  static inline void chunk(const State& s, const uint8_t* b, int c, V& w0, V& w1) {
    const auto t = affine<4, 0, -1>(s.sc(c), s.mn(c));
    w0 = lookup(t, lane_field<4>(b, 2 * c));
    w1 = lookup(t, lane_field<4>(b, 2 * c + 1));
  }
};

// Q6_K in lanes: 192 bytes of 6-bit quants, then Q6_K's 16 scales and d at its offsets (192, 208).
// A quant needs no conversion: its 6 bits under 2^23's exponent bits are the float 2^23 + q, and
// subtracting 2^23 + 32 leaves q - 32 exactly; times fl(d * sc): gguf-py's value. (On Ice Lake the
// file's layout spent four port-0 operations per half-chunk: two shifts, the shift to bits 26..31
// and the conversion; this spends one.)
struct Q6_KLanes {
  static constexpr int kType = 1014;
  static constexpr int64_t kQK = 256, kBytes = 210;
  static constexpr bool kElementwise = false;
  struct State { float scale[16]; };  // fl(d * sc) per group of 16
  static inline State prepare(const uint8_t* b) {
    State s;
    store(s.scale, mul(set1(f16(b + 208)), to_float(load_i8(b + 192))));
    return s;
  }
  static inline V value(const State& s, const uint8_t* b, int f) {
    const V biased = as_float(merge_bits(lane_field<6>(b, f), as_int(set1(0x1p23f)), 63));  // 2^23 + q
    return mul(bcast(s.scale + f), sub(biased, set1(0x1p23f + 32)));
  }
  static inline void chunk(const State& s, const uint8_t* b, int c, V& w0, V& w1) {
    w0 = value(s, b, 2 * c);
    w1 = value(s, b, 2 * c + 1);
  }
};

// Whether decoder D stores a row's last cols % kQK elements in another format (D::Tail).
template <class D, class = void>
struct HasTail : std::false_type {};
template <class D>
struct HasTail<D, std::void_t<typename D::Tail>> : std::true_type {};
template <class D>
constexpr bool kHasTail = HasTail<D>::value;

// The rows of x from which decoder D's passes take two lane parts on AVX2 (simd::parts_for):
// D::kPartsFrom, else 4.
template <class D, class = void>
struct PartsFrom : std::integral_constant<int, 4> {};
template <class D>
struct PartsFrom<D, std::void_t<decltype(D::kPartsFrom)>> : std::integral_constant<int, D::kPartsFrom> {};
template <class D>
constexpr int kPartsFrom = PartsFrom<D>::value;

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
    case Q5_0Lanes::kType: fn(Q5_0Lanes{}); return true;
    case Q4_KLanes::kType: fn(Q4_KLanes{}); return true;
    case Q6_KLanes::kType: fn(Q6_KLanes{}); return true;
    case Q4_K::kType: fn(Q4_K{}); return true;
    case Q5_K::kType: fn(Q5_K{}); return true;
    case Q6_K::kType: fn(Q6_K{}); return true;
    default: return false;
  }
}

}  // namespace blocks
}  // namespace
