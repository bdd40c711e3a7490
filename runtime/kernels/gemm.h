// Skinny GEMM y[b, i] = <w[i], x[b]> over weight rows in any block format, for a few fp32 rows b.
//
// Include after one simd_*.h (it picks the ISA) and blocks.h; no torch here (bindings.h). One summation order for every
// output, whatever the ISA, n, the weight format or the thread split: two 16-lane accumulators
// over 32-element steps (acc0 += w[j..j+15] * x, acc1 += w[j+16..j+31] * x, fused), then for
// rows that end inside a step (elementwise types) masked 16-wide steps into acc0, then
// reduce(acc0 + acc1) with GCC's _mm512_reduce_add_ps tree. Each weight value is materialized
// exactly (the dequantized float) before its FMA, so a block format gives the same bits as the
// fp32 kernel on `dequantize(w)`. Each weight row streams from memory once per pass over up to
// kMaxBatch rows of x; with one row of x, kRows weight rows share the pass (independent chains).
#pragma once

#include <algorithm>
#include <cstdint>

namespace {
namespace gemm {

using namespace simd;

// Fully unrolled small loops: GCC then keeps the accumulator arrays in registers.
#define SV_UNROLL _Pragma("GCC unroll 16")

constexpr int64_t kPrefetchRows = 8;  // software prefetch this many weight rows ahead

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

// Every whole 32-element step of one weight row, decoded in registers: on_block(k) before block k,
// then on_chunk(j, w0, w1) with the weights of elements [j, j + 16) and [j + 16, j + 32).
template <class D, class OnBlock, class OnChunk>
__attribute__((always_inline)) inline void for_each_chunk(const uint8_t* w, int64_t cols, OnBlock&& on_block, OnChunk&& on_chunk) {
  const int64_t blocks = cols / D::kQK;
  for (int64_t k = 0; k < blocks; ++k) {
    on_block(k);
    const uint8_t* block = w + k * D::kBytes;
    const auto state = D::prepare(block);
    SV_UNROLL
    for (int c = 0; c < D::kQK / 32; ++c) {
      V w0, w1;
      D::chunk(state, block, c, w0, w1);
      on_chunk(k * D::kQK + 32 * c, w0, w1);
    }
  }
}

// One weight row against N rows of x (stride xs); out[b * os] = the dot with row b.
template <class D, int N>
inline void row_dot_many(const uint8_t* w, const float* x, int64_t cols, int64_t xs, const uint8_t* pf, float* out, int64_t os) {
  V acc[N][2];
  SV_UNROLL
  for (int b = 0; b < N; ++b) acc[b][0] = acc[b][1] = zero();
  for_each_chunk<D>(w, cols, [&](int64_t k) __attribute__((always_inline)) { if (pf) prefetch_block<D>(pf + k * D::kBytes); },
                    [&](int64_t j, V w0, V w1) __attribute__((always_inline)) {
                      SV_UNROLL
                      for (int b = 0; b < N; ++b) {
                        acc[b][0] = fma(w0, load(x + b * xs + j), acc[b][0]);
                        acc[b][1] = fma(w1, load(x + b * xs + j + 16), acc[b][1]);
                      }
                    });
  if constexpr (D::kElementwise) {
    for_tail(cols, [&](int64_t j, int64_t m) {
      const V w0 = D::partial(w, j, m);
      SV_UNROLL
      for (int b = 0; b < N; ++b) acc[b][0] = fma(w0, load_partial(x + b * xs + j, m), acc[b][0]);
    });
  }
  SV_UNROLL
  for (int b = 0; b < N; ++b) out[b * os] = reduce(add(acc[b][0], acc[b][1]));
}

// count (1..N) rows of x: the largest instantiation that fits.
template <class D, int N>
inline void row_dot_batch(int64_t count, const uint8_t* w, const float* x, int64_t cols, const uint8_t* pf, float* out, int64_t os) {
  if constexpr (N > 1) {
    if (count < N) return row_dot_batch<D, N - 1>(count, w, x, cols, pf, out, os);
  }
  row_dot_many<D, N>(w, x, cols, cols, pf, out, os);
}

// kRows consecutive weight rows (stride rb bytes) against one row of x, summed as row_dot_many sums.
template <class D>
inline void rows_dot_one(const uint8_t* w, int64_t rb, const float* x, int64_t cols, bool prefetch_ahead, float* out) {
  V acc[kRows][2];
  SV_UNROLL
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = zero();
  const int64_t blocks = cols / D::kQK;
  for (int64_t k = 0; k < blocks; ++k) {
    const uint8_t* block = w + k * D::kBytes;
    typename D::State state[kRows];
    SV_UNROLL
    for (int r = 0; r < kRows; ++r) {
      if (prefetch_ahead) prefetch_block<D>(block + (kPrefetchRows + r) * rb);
      state[r] = D::prepare(block + r * rb);
    }
    SV_UNROLL
    for (int c = 0; c < D::kQK / 32; ++c) {  // each x chunk loaded once for the kRows rows
      const V x0 = load(x + k * D::kQK + 32 * c), x1 = load(x + k * D::kQK + 32 * c + 16);
      SV_UNROLL
      for (int r = 0; r < kRows; ++r) {
        V w0, w1;
        D::chunk(state[r], block + r * rb, c, w0, w1);
        acc[r][0] = fma(w0, x0, acc[r][0]);
        acc[r][1] = fma(w1, x1, acc[r][1]);
      }
    }
  }
  if constexpr (D::kElementwise) {
    for_tail(cols, [&](int64_t j, int64_t m) {
      const V x0 = load_partial(x + j, m);
      SV_UNROLL
      for (int r = 0; r < kRows; ++r) acc[r][0] = fma(D::partial(w + r * rb, j, m), x0, acc[r][0]);
    });
  }
  SV_UNROLL
  for (int r = 0; r < kRows; ++r) out[r] = reduce(add(acc[r][0], acc[r][1]));
}

// Rows of w decoded to float32: out[r, :] = dequantize(row r).
template <class D>
void decode_row(const uint8_t* w, int64_t cols, float* out) {
  for_each_chunk<D>(w, cols, [](int64_t) {}, [&](int64_t j, V w0, V w1) __attribute__((always_inline)) {
    store(out + j, w0);
    store(out + j + 16, w1);
  });
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
