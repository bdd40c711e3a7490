// Skinny GEMM y[b, i] = <w[i], x[b]> over weight rows in any block format, for a few fp32 rows b.
//
// Include after one simd_*.h (it picks the ISA) and blocks.h; no torch here (bindings.h). One summation order for every
// output, whatever the ISA, n, the weight format or the thread split: two 16-lane accumulators
// over 32-element steps (acc0 += w[j..j+15] * x, acc1 += w[j+16..j+31] * x, fused), then for
// rows that end inside a step (elementwise types) masked 16-wide steps into acc0, then
// reduce(acc0 + acc1) with GCC's _mm512_reduce_add_ps tree. Each weight value is materialized
// exactly (the dequantized float) before its FMA, so a block format gives the same bits as the
// fp32 kernel on `dequantize(w)`. Each weight row streams from memory once per pass over up to
// kMaxBatch rows of x; rows_for(n) weight rows share a pass (independent chains), covered in
// parts_for(n, kPartsFrom) lane parts (AVX2 from four rows of x, three for Q5_0 lanes: lanes 0..7, then
// 8..15, the row then in L1).
#pragma once

#include <algorithm>
#include <cstdint>

#include "prefetch.h"

namespace {
namespace gemm {

using namespace simd;

// Fully unrolled small loops: GCC then keeps the accumulator arrays in registers.
#define SV_UNROLL _Pragma("GCC unroll 16")

template <class D>
inline void prefetch_block(const uint8_t* p) {
  for (int64_t off = 0; off < D::kBytes; off += 64) prefetch(p + off);
}

// The elements after the last whole 32-element step (elementwise types only): step(j, m) for the
// 16-wide steps [j, j + m), m <= 16, at most two; straight-line code keeps accumulators in registers.
template <class F>
inline void for_tail(int64_t cols, F&& step) {
  const int64_t j = cols / 32 * 32, rest = cols - j;
  if (rest > 0) step(j, std::min<int64_t>(16, rest));
  if (rest > 16) step(j + 16, rest - 16);
}

// The two accumulators of each (weight row r, x row b) pair of a rows_dot pass, per lane part
// (simd::parts_for: on AVX2 from four rows of x a pass covers its weight rows twice, 8 lanes at a
// time, so the accumulators fit in registers; each lane's chain of FMAs is the same either way).
// P parts: the decoder's (DecoderAccumulators); a D::Tail's blocks add into its parent's accumulators.
template <int R, int N, int P>
struct Accumulators {
  static constexpr int kParts = P;
  static_assert(kParts == 1 || kParts == 2, "a row is covered in one or two lane parts");
  using T = typename Part<kParts, 0>::T;  // (the same type for every part)
  struct Lanes { T v[R][N][2]; };
  Lanes part[kParts];
  void clear() {
    SV_UNROLL
    for (int h = 0; h < kParts; ++h) {
      SV_UNROLL
      for (int r = 0; r < R; ++r) {
        SV_UNROLL
        for (int b = 0; b < N; ++b) part[h].v[r][b][0] = part[h].v[r][b][1] = Part<kParts, 0>::zero();
      }
    }
  }
  // Accumulator q of pair (r, b), all 16 lanes.
  V joined(int r, int b, int q) const {
    V v;
    Part<kParts, 0>::put(v, part[0].v[r][b][q]);
    if constexpr (kParts > 1) Part<kParts, 1>::put(v, part[1].v[r][b][q]);
    return v;
  }
  // acc0 of pair (r, b) += w * x, lane by lane (the elementwise tail).
  void add_product(int r, int b, V w, V x) {
    using P0 = Part<kParts, 0>;
    part[0].v[r][b][0] = P0::fma(P0::get(w), P0::get(x), part[0].v[r][b][0]);
    if constexpr (kParts > 1) {
      using P1 = Part<kParts, 1>;
      part[1].v[r][b][0] = P1::fma(P1::get(w), P1::get(x), part[1].v[r][b][0]);
    }
  }
};

// The accumulators of decoder D's passes: its lane parts for N rows of x (blocks::kPartsFrom).
template <class D, int R, int N>
using DecoderAccumulators = Accumulators<R, N, parts_for(N, blocks::kPartsFrom<D>)>;

// rows_dot_blocks for lane part H: each weight value's part H is decoded (the compiler drops the
// other part's operations) and multiplied into part H of its accumulators.
template <class D, int R, int N, int Parts, int H>
inline void rows_dot_part(Accumulators<R, N, Parts>& acc, const uint8_t* w, int64_t rb, const float* x, int64_t cols, int64_t k0, int64_t k1,
                          int64_t ahead) {
  using P = Part<Parts, H>;
  auto a = acc.part[H];  // a local copy stays in registers (acc may alias x for the compiler)
  for (int64_t k = k0; k < k1; ++k) {
    const uint8_t* block = w + k * D::kBytes;
    typename D::State state[R];
    SV_UNROLL
    for (int r = 0; r < R; ++r) {
      if (ahead) prefetch_block<D>(block + (ahead + r) * rb);
      state[r] = D::prepare(block + r * rb);
    }
    SV_UNROLL
    for (int c = 0; c < D::kQK / 32; ++c) {
      const int64_t j = k * D::kQK + 32 * c;
      V w[R][2];
      SV_UNROLL
      for (int r = 0; r < R; ++r) D::chunk(state[r], block + r * rb, c, w[r][0], w[r][1]);
      if constexpr (Parts == 1) {
        SV_UNROLL
        for (int b = 0; b < N; ++b) {
          // Each x vector loaded once into a register for the R rows (GCC would fold it into every FMA).
          const auto x0 = P::load(x + b * cols + j), x1 = P::load(x + b * cols + j + 16);
          SV_UNROLL
          for (int r = 0; r < R; ++r) {
            a.v[r][b][0] = P::fma(P::get(w[r][0]), x0, a.v[r][b][0]);
            a.v[r][b][1] = P::fma(P::get(w[r][1]), x1, a.v[r][b][1]);
          }
        }
      } else {  // w[.][0] used up before w[.][1]: fewer live registers (in whole-vector passes this order ran
                // 12 % slower on AVX2, two rows of Q5_0)
        SV_UNROLL
        for (int half = 0; half < 2; ++half) {
          SV_UNROLL
          for (int b = 0; b < N; ++b) {
            const auto xh = P::load(x + b * cols + j + 16 * half);
            SV_UNROLL
            for (int r = 0; r < R; ++r) a.v[r][b][half] = P::fma(P::get(w[r][half]), xh, a.v[r][b][half]);
          }
        }
      }
    }
  }
  acc.part[H] = a;
}

// Blocks [k0, k1) of R consecutive weight rows (stride rb bytes) against N rows of x [N, cols],
// added to acc. Every (r, b) pair has its own two accumulators, so each output is summed in the
// order above whatever R and N are; R > 1 gives the core independent rows to decode while FMAs wait.
// With ahead > 0, each block of the rows `ahead` further on is prefetched as this one is read (in
// the first lane part: the second finds the rows in L1); 0: no prefetch.
template <class D, int R, int N, int P>
inline void rows_dot_blocks(Accumulators<R, N, P>& acc, const uint8_t* w, int64_t rb, const float* x, int64_t cols, int64_t k0, int64_t k1,
                            int64_t ahead) {
  rows_dot_part<D, R, N, P, 0>(acc, w, rb, x, cols, k0, k1, ahead);
  if constexpr (P > 1) rows_dot_part<D, R, N, P, 1>(acc, w, rb, x, cols, k0, k1, 0);
}

// After the last whole block: the elementwise types' tail, or the blocks of a D::Tail, then
// y[b * ys + r] = reduce(acc0 + acc1).
template <class D, int R, int N, int P>
inline void rows_dot_finish(Accumulators<R, N, P>& acc, const uint8_t* w, int64_t rb, const float* x, int64_t cols, float* y, int64_t ys) {
  if constexpr (blocks::kHasTail<D>) {
    using Tail = typename D::Tail;
    const int64_t whole = cols / D::kQK;
    if (cols % D::kQK) rows_dot_blocks<Tail, R, N>(acc, w + whole * D::kBytes, rb, x + whole * D::kQK, cols, 0, cols % D::kQK / Tail::kQK, 0);
  }
  if constexpr (D::kElementwise) {
    for_tail(cols, [&](int64_t j, int64_t m) {
      SV_UNROLL
      for (int r = 0; r < R; ++r) {
        const V w0 = D::partial(w + r * rb, j, m);
        SV_UNROLL
        for (int b = 0; b < N; ++b) acc.add_product(r, b, w0, load_partial(x + b * cols + j, m));
      }
    });
  }
  V sums[R * N];
  SV_UNROLL
  for (int r = 0; r < R; ++r) {
    SV_UNROLL
    for (int b = 0; b < N; ++b) sums[r * N + b] = add(acc.joined(r, b, 0), acc.joined(r, b, 1));
  }
  reduce_rows<R, N>(sums, y, ys);
}

// R consecutive weight rows against N rows of x [N, cols]: y[b * ys + r] = <row r, x[b]>.
// (decode_row walks the blocks the same way, one row, storing instead of multiplying.)
template <class D, int R, int N>
inline void rows_dot(const uint8_t* w, int64_t rb, const float* x, int64_t cols, int64_t ahead, float* y, int64_t ys) {
  DecoderAccumulators<D, R, N> acc;
  acc.clear();
  rows_dot_blocks<D, R, N>(acc, w, rb, x, cols, 0, cols / D::kQK, ahead);
  rows_dot_finish<D, R, N>(acc, w, rb, x, cols, y, ys);
}

// Weight rows [begin, end) against count (1..N) rows of x: rows_for(count) weight rows per pass,
// then the leftover rows, two at once where R is 3 (a chunk's 8 rows as 3 + 3 + 2, not 3 + 3 + 1 + 1:
// qwen2.5-coder's 3-row forward ~8 % faster, its full head's 3-row pass ~20 %, on the AMD EPYC Zen 5),
// then one at a time. Rows below prefetch_end (the matrix's end, past this chunk's: the next chunk
// streams on; 0: none) are prefetched prefetch_rows(rb, N) ahead.
template <class D, int N>
inline void rows_dot_range(int64_t count, const uint8_t* w, int64_t rb, int64_t begin, int64_t end, const float* x, int64_t cols,
                           int64_t prefetch_end, float* y, int64_t ys) {
  if constexpr (N > 1) {
    if (count < N) return rows_dot_range<D, N - 1>(count, w, rb, begin, end, x, cols, prefetch_end, y, ys);
  }
  constexpr int R = rows_for(N);
  const int64_t ahead = prefetch_rows(rb, N);
  int64_t i = begin;
  for (; i + R <= end; i += R) rows_dot<D, R, N>(w + i * rb, rb, x, cols, i + ahead + R <= prefetch_end ? ahead : 0, y + i, ys);
  if constexpr (R == 3) {
    if (i + 2 <= end) {
      rows_dot<D, 2, N>(w + i * rb, rb, x, cols, i + ahead + 2 <= prefetch_end ? ahead : 0, y + i, ys);
      i += 2;
    }
  }
  for (; i < end; ++i) rows_dot<D, 1, N>(w + i * rb, rb, x, cols, 0, y + i, ys);
}

// Rows of w decoded to float32: out[r, :] = dequantize(row r).
template <class D>
void decode_row(const uint8_t* w, int64_t cols, float* out) {
  const int64_t whole = cols / D::kQK;
  for (int64_t k = 0; k < whole; ++k) {
    const uint8_t* block = w + k * D::kBytes;
    const auto state = D::prepare(block);
    SV_UNROLL
    for (int c = 0; c < D::kQK / 32; ++c) {
      V w0, w1;
      D::chunk(state, block, c, w0, w1);
      store(out + k * D::kQK + 32 * c, w0);
      store(out + k * D::kQK + 32 * c + 16, w1);
    }
  }
  if constexpr (blocks::kHasTail<D>) {
    if (cols % D::kQK) decode_row<typename D::Tail>(w + whole * D::kBytes, cols % D::kQK, out + whole * D::kQK);
  }
  if constexpr (D::kElementwise) {
    for_tail(cols, [&](int64_t j, int64_t m) {
      float buf[16];
      store(buf, D::partial(w, j, m));
      std::copy(buf, buf + m, out + j);
    });
  }
}

}  // namespace gemm
}  // namespace
