// Skinny GEMM y[b, i] = <w[i], x[b]> over weight rows in any block format, for a few fp32 rows b.
//
// Include after one simd_*.h (it picks the ISA) and blocks.h. One summation order for every
// output, whatever the ISA, n, the weight format or the thread split: two 16-lane accumulators
// over 32-element steps (acc0 += w[j..j+15] * x, acc1 += w[j+16..j+31] * x, fused), then for
// rows that end inside a step (elementwise types) masked 16-wide steps into acc0, then
// reduce(acc0 + acc1) with GCC's _mm512_reduce_add_ps tree. Each weight value is materialized
// exactly (the dequantized float) before its FMA, so a block format gives the same bits as the
// fp32 kernel on `dequantize(w)`. Each weight row streams from memory once per pass over up to
// kMaxBatch rows of x; with one row of x, kRows weight rows share the pass (independent chains).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace {
namespace gemm {

using namespace simd;

constexpr int64_t kPrefetchRows = 8;  // software prefetch this many weight rows ahead
constexpr int64_t kGrain = 256;       // weight rows per parallel task

template <class D>
inline void prefetch_block(const uint8_t* p) {
  for (int64_t off = 0; off < D::kBytes; off += 64) prefetch(p + off);
}

// One weight row against N rows of x (stride xs); out[b * os] = the dot with row b.
template <class D, int N>
inline void row_dot_many(const uint8_t* w, const float* x, int64_t cols, int64_t xs, const uint8_t* pf, float* out, int64_t os) {
  V acc[N][2];
  for (int b = 0; b < N; ++b) acc[b][0] = acc[b][1] = zero();
  const int64_t blocks = cols / D::kQK;
  for (int64_t k = 0; k < blocks; ++k) {
    if (pf) prefetch_block<D>(pf + k * D::kBytes);
    const float* xk = x + k * D::kQK;
    D::block(w + k * D::kBytes, [&](int c, V w0, V w1) {
      for (int b = 0; b < N; ++b) {
        acc[b][0] = fma(w0, load(xk + b * xs + 32 * c), acc[b][0]);
        acc[b][1] = fma(w1, load(xk + b * xs + 32 * c + 16), acc[b][1]);
      }
    });
  }
  if constexpr (D::kElementwise) {
    for (int64_t j = blocks * D::kQK; j < cols; j += 16) {
      const int64_t m = std::min<int64_t>(16, cols - j);
      const V w0 = D::partial(w, j, m);
      for (int b = 0; b < N; ++b) acc[b][0] = fma(w0, load_partial(x + b * xs + j, m), acc[b][0]);
    }
  }
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
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = zero();
  const int64_t blocks = cols / D::kQK;
  for (int64_t k = 0; k < blocks; ++k) {
    const float* xk = x + k * D::kQK;
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* block = w + r * rb + k * D::kBytes;
      if (prefetch_ahead) prefetch_block<D>(block + kPrefetchRows * rb);
      D::block(block, [&](int c, V w0, V w1) {
        acc[r][0] = fma(w0, load(xk + 32 * c), acc[r][0]);
        acc[r][1] = fma(w1, load(xk + 32 * c + 16), acc[r][1]);
      });
    }
  }
  if constexpr (D::kElementwise) {
    for (int64_t j = blocks * D::kQK; j < cols; j += 16) {
      const int64_t m = std::min<int64_t>(16, cols - j);
      const V x0 = load_partial(x + j, m);
      for (int r = 0; r < kRows; ++r) acc[r][0] = fma(D::partial(w + r * rb, j, m), x0, acc[r][0]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = reduce(add(acc[r][0], acc[r][1]));
}

// y [n, rows] = x [n, cols] . w^T, w given as rows of rb bytes in format D.
template <class D>
void run(const uint8_t* w, int64_t rows, int64_t rb, int64_t cols, const float* x, int64_t n, float* y) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    if (n == 1) {
      float out[kRows];
      int64_t i = begin;
      for (; i + kRows <= end; i += kRows) {
        rows_dot_one<D>(w + i * rb, rb, x, cols, i + kPrefetchRows + kRows <= end, out);
        for (int r = 0; r < kRows; ++r) y[i + r] = out[r];
      }
      for (; i < end; ++i) row_dot_many<D, 1>(w + i * rb, x, cols, cols, nullptr, y + i, rows);
      return;
    }
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* pf = i + kPrefetchRows < end ? w + (i + kPrefetchRows) * rb : nullptr;
      for (int64_t b0 = 0; b0 < n; b0 += kMaxBatch) {
        const int64_t count = std::min<int64_t>(kMaxBatch, n - b0);
        row_dot_batch<D, kMaxBatch>(count, w + i * rb, x + b0 * cols, cols, b0 == 0 ? pf : nullptr, y + b0 * rows + i, rows);
      }
    }
  });
}

// Rows of w decoded to float32: out[r, :] = dequantize(row r).
template <class D>
void decode_row(const uint8_t* w, int64_t cols, float* out) {
  const int64_t blocks = cols / D::kQK;
  for (int64_t k = 0; k < blocks; ++k) {
    float* ok = out + k * D::kQK;
    D::block(w + k * D::kBytes, [&](int c, V w0, V w1) {
      store(ok + 32 * c, w0);
      store(ok + 32 * c + 16, w1);
    });
  }
  if constexpr (D::kElementwise) {
    for (int64_t j = blocks * D::kQK; j < cols; j += 16) {
      const int64_t m = std::min<int64_t>(16, cols - j);
      float buf[16];
      store(buf, D::partial(w, j, m));
      std::copy(buf, buf + m, out + j);
    }
  }
}

template <class D>
int64_t row_bytes(int64_t cols) {
  return D::kElementwise ? cols * (D::kBytes / D::kQK) : cols / D::kQK * D::kBytes;
}

// Checks and the decoder of `type`, then fn(D{}) for a [rows, row_bytes] uint8 tensor of `cols` columns.
template <class Fn>
void dispatch(const torch::Tensor& data, int64_t type, int64_t cols, Fn&& fn) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.dim() == 2 && data.is_contiguous(), "weight data must be contiguous [rows, row_bytes] uint8");
  const bool known = blocks::with_decoder(type, [&](auto d) {
    using D = decltype(d);
    TORCH_CHECK(cols > 0 && (D::kElementwise || cols % D::kQK == 0), "cols must be a multiple of ", D::kQK, " for ggml type ", type);
    TORCH_CHECK(data.size(1) == row_bytes<D>(cols), "row_bytes ", data.size(1), " does not match ", cols, " columns of ggml type ", type);
    fn(d);
  });
  TORCH_CHECK(known, "unsupported ggml type ", type);
}

// x [n, cols] float32, data [rows, row_bytes] uint8 in ggml `type` -> y [n, rows] float32.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, int64_t type, int64_t cols) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == cols, "x must be [n, cols] float32");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), data.size(0)}, x.options());
  dispatch(data, type, cols, [&](auto d) {
    run<decltype(d)>(data.data_ptr<uint8_t>(), data.size(0), data.size(1), cols, x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
  });
  return y;
}

// x [n, d] float32, w [out, d] float32 (contiguous) -> y [n, out] float32.
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 2 && w.is_contiguous(), "w must be contiguous [out, d] float32");
  const int64_t cols = w.size(1);
  return quant_linear(x, w.view(torch::kUInt8).view({w.size(0), cols * 4}), blocks::F32::kType, cols);
}

// data [rows, row_bytes] uint8 in ggml `type`, ids [k] int64 -> [k, cols] float32, the exact dequantized rows.
torch::Tensor take_rows(torch::Tensor data, int64_t type, int64_t cols, torch::Tensor ids) {
  TORCH_CHECK(ids.dtype() == torch::kLong && ids.dim() == 1, "ids must be [k] int64");
  ids = ids.contiguous();
  const int64_t k = ids.size(0), rows = data.size(0);
  auto out = torch::empty({k, cols}, torch::kFloat32);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < k; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < rows, "row id ", ip[r], " out of range [0, ", rows, ")");
  dispatch(data, type, cols, [&](auto d) {
    using D = decltype(d);
    const uint8_t* w = data.data_ptr<uint8_t>();
    const int64_t rb = data.size(1);
    float* op = out.data_ptr<float>();
    at::parallel_for(0, k, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) decode_row<D>(w + ip[r] * rb, cols, op + r * cols);
    });
  });
  return out;
}

}  // namespace gemm
}  // namespace

// The functions every path's module defines.
#define SPECVOCAB_DEFINE_GEMM(m)                                                                              \
  m.attr("path") = simd::kPath;                                                                               \
  m.def("skinny_linear", &gemm::skinny_linear, "fp32 x @ w.T for a few rows of x, weights streamed once");    \
  m.def("quant_linear", &gemm::quant_linear, "x @ dequantize(w).T over ggml blocks, in the skinny order");    \
  m.def("take_rows", &gemm::take_rows, "exact dequantized rows of a ggml-format matrix")
