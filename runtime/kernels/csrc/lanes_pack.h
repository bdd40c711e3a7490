// Repacking GGML rows into the lanes layouts (runtime/kernels/lanes.py describes them; its torch
// `pack` is the reference this must equal byte for byte). Scalar code: it runs once per matrix at
// load, and its cost is reading the file's pages.
//
// Included by bindings.h after gemm::dispatch and gemm::row_bytes, whose checks and sizes it uses;
// the block sizes are blocks.h's decoders'.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#include "pool.h"

namespace {
namespace lanes_pack {

using blocks::Q5_0;
using blocks::Q5_0Lanes;

// Fields q[16 f + i] (f < count, values < 2^width) into their 32-bit words per lane: field f at bits
// [width f, width (f + 1)) of lane i's value, word w of every lane in the w-th 64-byte vector, little-endian.
inline void put_fields(const uint8_t* q, int count, int width, uint8_t* out) {
  const int words = (width * count + 31) / 32;
  uint32_t lane[3][16] = {};
  for (int f = 0; f < count; ++f) {
    const int bit = width * f, w = bit / 32, off = bit % 32;
    for (int i = 0; i < 16; ++i) {
      const uint32_t v = q[16 * f + i];
      lane[w][i] |= v << off;
      if (off + width > 32) lane[w + 1][i] |= v >> (32 - off);
    }
  }
  for (int w = 0; w < words; ++w)
    for (int i = 0; i < 16; ++i)
      for (int b = 0; b < 4; ++b) out[64 * w + 4 * i + b] = static_cast<uint8_t>(lane[w][i] >> (8 * b));
}

// A Q5_0 block's 32 quants (0..31) in element order: nibble j % 16 (low for j < 16), bit j of qh as bit 4.
inline void q5_0_quants(const uint8_t* b, uint8_t* q) {
  const uint32_t qh = b[2] | b[3] << 8 | b[4] << 16 | static_cast<uint32_t>(b[5]) << 24;
  for (int j = 0; j < 32; ++j) q[j] = ((b[6 + j % 16] >> (j < 16 ? 0 : 4)) & 0x0F) | ((qh >> j) & 1) << 4;
}

// One Q5_0 row: groups of three blocks (64 bytes of fields, then the three d), and the tail blocks as they are.
inline void pack_q5_0_row(const uint8_t* src, int64_t cols, uint8_t* dst) {
  uint8_t q[Q5_0Lanes::kQK];
  for (int64_t g = 0; g < cols / Q5_0Lanes::kQK; ++g, src += 3 * Q5_0::kBytes, dst += Q5_0Lanes::kBytes) {
    for (int k = 0; k < 3; ++k) {
      q5_0_quants(src + k * Q5_0::kBytes, q + 32 * k);
      std::memcpy(dst + 64 + 2 * k, src + k * Q5_0::kBytes, 2);
    }
    put_fields(q, 6, 5, dst);
  }
  std::memcpy(dst, src, static_cast<size_t>(cols % Q5_0Lanes::kQK / Q5_0::kQK * Q5_0::kBytes));
}

// One Q4_K super-block: 128 bytes of nibble fields (element 64 r + j: low nibble of qs[32 r + j],
// 64 r + 32 + j: its high nibble), then the 16-byte header.
inline void pack_q4_k(const uint8_t* b, uint8_t* dst) {
  uint8_t q[256];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 32; ++j) {
      q[64 * r + j] = b[16 + 32 * r + j] & 0x0F;
      q[64 * r + 32 + j] = b[16 + 32 * r + j] >> 4;
    }
  put_fields(q, 16, 4, dst);
  std::memcpy(dst + 128, b, 16);
}

// One Q6_K super-block: 192 bytes of 6-bit fields (element 128 h + r: the low nibble of ql[64 h + r % 64]
// >> 4 (r / 64), the high bits of qh[32 h + r % 32] >> 2 (r / 32)), then the 16 scales and d.
inline void pack_q6_k(const uint8_t* b, uint8_t* dst) {
  uint8_t q[256];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < 128; ++r) {
      const int low = (b[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F, high = (b[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
      q[128 * h + r] = static_cast<uint8_t>(low | high << 4);
    }
  put_fields(q, 16, 6, dst);
  std::memcpy(dst + 192, b + 192, 18);
}

// Rows of `data` packed by pack_row(src, dst) into `out` [rows, lanes decoder L's row bytes], rows in parallel.
template <class L, class PackRow>
void pack_rows(const torch::Tensor& data, int64_t cols, torch::Tensor& out, PackRow&& pack_row) {
  const int64_t rb = data.size(1), ob = gemm::row_bytes<L>(cols);
  TORCH_CHECK(out.dtype() == torch::kUInt8 && out.is_contiguous() && out.dim() == 2 && out.size(0) == data.size(0) && out.size(1) == ob,
              "pack_lanes writes a contiguous uint8 [", data.size(0), ", ", ob, "] tensor, not ", out.sizes());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  sv_pool::parallel_for(data.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) pack_row(src + r * rb, dst + r * ob);
  });
}

// One row of super-blocks (Q4_K, Q6_K: their lanes layouts keep the block size), each by pack_block.
template <class D>
inline void pack_super_blocks(const uint8_t* src, int64_t cols, uint8_t* dst, void (*pack_block)(const uint8_t*, uint8_t*)) {
  for (int64_t k = 0; k < cols / D::kQK; ++k) pack_block(src + k * D::kBytes, dst + k * D::kBytes);
}

// data [rows, row_bytes] uint8 in GGML `type` (Q5_0, Q4_K or Q6_K; gemm::dispatch checks the rest) ->
// the same rows in its lanes layout, written into `out` [rows, lanes row bytes] (the caller's memory:
// huge pages, for the native backend) and returned.
torch::Tensor pack_lanes(torch::Tensor data, int64_t type, int64_t cols, torch::Tensor out) {
  TORCH_CHECK(type == Q5_0::kType || type == blocks::Q4_K::kType || type == blocks::Q6_K::kType,
              "pack_lanes repacks Q5_0, Q4_K and Q6_K, not ggml type ", type);
  gemm::dispatch(data, type, cols, [&](auto d) {
    using D = decltype(d);
    if constexpr (D::kType == Q5_0::kType) {
      pack_rows<Q5_0Lanes>(data, cols, out, [&](const uint8_t* s, uint8_t* t) { pack_q5_0_row(s, cols, t); });
    } else if constexpr (D::kType == blocks::Q4_K::kType) {
      pack_rows<blocks::Q4_KLanes>(data, cols, out, [&](const uint8_t* s, uint8_t* t) { pack_super_blocks<D>(s, cols, t, pack_q4_k); });
    } else if constexpr (D::kType == blocks::Q6_K::kType) {
      pack_rows<blocks::Q6_KLanes>(data, cols, out, [&](const uint8_t* s, uint8_t* t) { pack_super_blocks<D>(s, cols, t, pack_q6_k); });
    }
  });
  return out;
}

}  // namespace lanes_pack
}  // namespace
