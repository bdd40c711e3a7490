// The torch entry points of one path's module: checks, ggml-type dispatch, threads (gemm.h does the math).
//
// Include after simd_*.h, blocks.h and gemm.h (it brings in lanes_pack.h, layer_ops.h and layer_plan.h).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "pool.h"
#include "layer_ops.h"

namespace {
namespace gemm {

// Weight rows per chunk of a skinny region: about kChunkBytes of weights, a few microseconds of work,
// so a thread that loses its core holds up little; whole multiples of 8 rows (rows_for's passes of 2 and
// 4 rows divide it; 3-row passes end in one of 2: gemm.h's rows_dot_range).
constexpr int64_t kChunkBytes = 32768;
constexpr int64_t kMaxChunkRows = 256;
inline int64_t chunk_rows(int64_t rb) { return std::clamp<int64_t>(kChunkBytes / rb / 8 * 8, 8, kMaxChunkRows); }

// Weight rows [begin, end) of w ([rows] rows of rb bytes in format D) against x [n, cols]: y[b * ys + i].
template <class D>
void run(const uint8_t* w, int64_t rows, int64_t rb, int64_t begin, int64_t end, int64_t cols, const float* x, int64_t n, float* y,
         int64_t ys) {
  for (int64_t b0 = 0; b0 < n; b0 += kMaxBatch) {
    const int64_t count = std::min<int64_t>(kMaxBatch, n - b0);
    rows_dot_range<D, kMaxBatch>(count, w, rb, begin, end, x + b0 * cols, cols, b0 == 0 ? rows : 0, y + b0 * ys, ys);
  }
}

// Many rows of x (a prefill chunk): each task decodes tile_rows(cols) weight rows to float32 once and runs
// every group of kTallBatch rows of x over that tile with the F32 decoder, kSegmentCols columns at a
// time (the group's segment of x stays in L1 while the tile's rows pass; each pair's accumulators
// carry over to the next segment). Blocks decode to exactly the floats the F32 path reads and every
// output is summed in run's order, so the bits are run's; the weights are read from memory and
// decoded once instead of once per kMaxBatch rows of x, and x is reused from registers and L1.
constexpr int64_t kSegmentCols = 1024;
constexpr int64_t kTileFloats = 16384;  // a tile's rows times min(cols, kSegmentCols): 64 KB, L2-resident
constexpr int64_t kMaxTileRows = 64;
inline int64_t tile_rows(int64_t cols) { return std::clamp<int64_t>(kTileFloats / std::min(cols, kSegmentCols), 16, kMaxTileRows); }
constexpr int kTallBatch = 6;  // rows of x per pass over a tile: rows_for(6) weight rows share it

// Rows [0, rows) of a float32 tile (stride tb bytes) against count (1..N) rows of x.
template <int N>
void tile_pass(int64_t count, const uint8_t* tile, int64_t tb, int64_t rows, const float* x, int64_t cols, float* y, int64_t ys) {
  using F = blocks::F32;
  if constexpr (N > 1) {
    if (count < N) return tile_pass<N - 1>(count, tile, tb, rows, x, cols, y, ys);
  }
  constexpr int R = rows_for(N);
  const int64_t groups = rows / R, steps = cols / F::kQK, segment = kSegmentCols / F::kQK;
  if (steps <= segment) {  // one segment: the accumulators never leave registers
    for (int64_t g = 0; g < groups; ++g) rows_dot<F, R, N>(tile + g * R * tb, tb, x, cols, 0, y + g * R, ys);
  } else {
    DecoderAccumulators<F, R, N> acc[kMaxTileRows / R];
    for (int64_t g = 0; g < groups; ++g) acc[g].clear();
    for (int64_t k0 = 0; k0 < steps; k0 += segment) {
      for (int64_t g = 0; g < groups; ++g)
        rows_dot_blocks<F, R, N>(acc[g], tile + g * R * tb, tb, x, cols, k0, std::min(k0 + segment, steps), 0);
    }
    for (int64_t g = 0; g < groups; ++g) rows_dot_finish<F, R, N>(acc[g], tile + g * R * tb, tb, x, cols, y + g * R, ys);
  }
  for (int64_t i = groups * R; i < rows; ++i) rows_dot<F, 1, N>(tile + i * tb, tb, x, cols, 0, y + i, ys);
}

// Weight rows [begin, end) (at most one tile) against x [n, cols], many rows of x: the tile decoded
// to float32 once (a buffer per thread, reused), then tile_pass over groups of kTallBatch rows.
template <class D>
void run_tall(const uint8_t* w, int64_t /*rows*/, int64_t rb, int64_t begin, int64_t end, int64_t cols, const float* x, int64_t n, float* y, int64_t ys) {
  const uint8_t* tw = w + begin * rb;
  int64_t tb = rb;
  if constexpr (D::kType != blocks::F32::kType) {
    thread_local std::vector<float> tile;
    tile.resize(static_cast<size_t>((end - begin) * cols));
    for (int64_t r = begin; r < end; ++r) decode_row<D>(w + r * rb, cols, tile.data() + (r - begin) * cols);
    tw = reinterpret_cast<const uint8_t*>(tile.data());
    tb = cols * static_cast<int64_t>(sizeof(float));
  }
  for (int64_t b0 = 0; b0 < n; b0 += kTallBatch) {
    tile_pass<kTallBatch>(std::min<int64_t>(kTallBatch, n - b0), tw, tb, end - begin, x + b0 * cols, cols, y + b0 * ys + begin, ys);
  }
}

template <class D>
int64_t row_bytes(int64_t cols) {
  if constexpr (blocks::kHasTail<D>) return cols / D::kQK * D::kBytes + cols % D::kQK / D::Tail::kQK * D::Tail::kBytes;
  return D::kElementwise ? cols * (D::kBytes / D::kQK) : cols / D::kQK * D::kBytes;
}

// Checks and the decoder of `type`, then fn(D{}) for a [rows, row_bytes] uint8 tensor of `cols` columns.
template <class Fn>
void dispatch(const torch::Tensor& data, int64_t type, int64_t cols, Fn&& fn) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.dim() == 2 && data.is_contiguous(), "weight data must be contiguous [rows, row_bytes] uint8");
  const bool known = blocks::with_decoder(type, [&](auto d) {
    using D = decltype(d);
    int64_t multiple = D::kQK;
    if constexpr (blocks::kHasTail<D>) multiple = D::Tail::kQK;
    TORCH_CHECK(cols > 0 && (D::kElementwise || cols % multiple == 0), "cols must be a multiple of ", multiple, " for ggml type ", type);
    TORCH_CHECK(data.size(1) == row_bytes<D>(cols), "row_bytes ", data.size(1), " does not match ", cols, " columns of ggml type ", type);
    fn(d);
  });
  TORCH_CHECK(known, "unsupported ggml type ", type);
}

// Rows [begin, end) of matrix `part`: one chunk of quant_linear_parts' region.
struct Slice {
  size_t part;
  int64_t begin, end;
};

// x [n, cols] float32 against several matrices (data_i [rows_i, row_bytes_i] in ggml types_i) ->
// y [n, sum rows_i], their outputs side by side (q/k/v, gate/up): one call and one parallel region
// (one synchronisation, not one per matrix), no concatenation.
torch::Tensor quant_linear_parts(torch::Tensor x, std::vector<torch::Tensor> data, std::vector<int64_t> types, int64_t cols) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == cols, "x must be [n, cols] float32");
  TORCH_CHECK(!data.empty() && data.size() == types.size(), "one ggml type per matrix");
  x = x.contiguous();
  const int64_t n = x.size(0);
  const bool tall = n > kTallMinRows;
  std::vector<Slice> slices;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (size_t p = 0; p < data.size(); ++p) {
    dispatch(data[p], types[p], cols, [](auto) {});  // the checks only
    const int64_t rows = data[p].size(0), step = tall ? tile_rows(cols) : chunk_rows(data[p].size(1));
    for (int64_t begin = 0; begin < rows; begin += step) slices.push_back({p, begin, std::min(rows, begin + step)});
    offsets.push_back(total);
    total += rows;
  }
  auto y = torch::empty({n, total}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  sv_pool::instance()->run(static_cast<int64_t>(slices.size()), [&](int64_t c) {
    const Slice& s = slices[c];
    blocks::with_decoder(types[s.part], [&](auto d) {
      using D = decltype(d);
      const auto go = tall ? run_tall<D> : run<D>;
      go(data[s.part].data_ptr<uint8_t>(), data[s.part].size(0), data[s.part].size(1), s.begin, s.end, cols, xp, n,
         yp + offsets[s.part], total);
    });
  });
  return y;
}

// x [n, cols] float32, data [rows, row_bytes] uint8 in ggml `type` -> y [n, rows] float32.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, int64_t type, int64_t cols) {
  return quant_linear_parts(x, {data}, {type}, cols);
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
    sv_pool::parallel_for(k, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) decode_row<D>(w + ip[r] * rb, cols, op + r * cols);
    });
  });
  return out;
}

}  // namespace gemm
}  // namespace

#include "lanes_pack.h"  // uses gemm::dispatch and gemm::row_bytes above
#include "layer_plan.h"  // uses gemm::quant_linear_parts above

// The functions every path's module defines.
#define SPECVOCAB_DEFINE_GEMM(m)                                                                              \
  m.attr("path") = simd::kPath;                                                                               \
  m.def("skinny_linear", &gemm::skinny_linear, "fp32 x @ w.T for a few rows of x, weights streamed once");    \
  m.def("quant_linear", &gemm::quant_linear, "x @ dequantize(w).T over ggml blocks, in the skinny order");    \
  m.def("quant_linear_parts", &gemm::quant_linear_parts, "quant_linear against several matrices, outputs side by side"); \
  m.def("rms_norm", &ops::rms_norm, "RMSNorm of each row, the mean's sum in the fixed order");               \
  m.def("prepare_qkv", &ops::prepare_qkv, "q/k norm and rotary in place, k and v written to the cache");   \
  m.def("attend", &ops::attend, "attention of single queries over the cached keys each sees");                \
  m.def("softmax", &ops::softmax, "attention weights exp(s * scale - max) of each row, and their sums");     \
  m.def("take_rows", &gemm::take_rows, "exact dequantized rows of a ggml-format matrix");                \
  m.def("pack_lanes", &lanes_pack::pack_lanes, "Q5_0 / Q4_K / Q6_K rows repacked into their lanes layout, in out"); \
  m.def("set_threads", [](int64_t threads, bool adaptive) { sv_pool::instance()->set_threads(threads, adaptive); }, \
        "the threads of every parallel region; adaptive: stand the workers down while they do not pay");     \
  m.def("thread_stats", [] { return sv_pool::instance()->stats(); }, "the kernel thread pool's counters");     \
  pybind11::class_<plan::LayerPlan>(m, "LayerPlan")                                                           \
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<double>, std::vector<std::vector<torch::Tensor>>, \
                          std::vector<std::vector<int64_t>>, std::vector<int64_t>, std::vector<torch::Tensor>, int64_t, \
                          int64_t, int64_t, double, std::string>())                                           \
      .def("forward", &plan::LayerPlan::forward, "one decoder layer over a few rows: the new residual")                          \
      .def("forward_input", &plan::LayerPlan::forward_input, "the layer with its attention's input given: the new residual")
