// Repacking GGML rows into the lanes layouts (runtime/kernels/lanes.py describes them; its torch
// `pack` is the reference this must equal byte for byte). Scalar code: it runs once per matrix at
// load, and its cost is reading the file's pages.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {
namespace lanes_pack {

constexpr int kQ5_0 = 6, kQ4_K = 12, kQ6_K = 14;          // the GGML ids packed
constexpr int64_t kQ5_0Bytes = 22, kGroup = 96, kGroupBytes = 70;  // a Q5_0 block; a lanes group of three

// Fields q[16 f + i] (f < count, values < 2^width) into `words` 32-bit words per lane: field f at bits
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

// One row: Q5_0 groups of three blocks (64 bytes of fields, then the three d) and the tail blocks as they are.
inline void pack_q5_0(const uint8_t* src, int64_t cols, uint8_t* dst) {
  const int64_t groups = cols / kGroup;
  uint8_t q[kGroup];
  for (int64_t g = 0; g < groups; ++g, src += 3 * kQ5_0Bytes, dst += kGroupBytes) {
    for (int k = 0; k < 3; ++k) {
      q5_0_quants(src + k * kQ5_0Bytes, q + 32 * k);
      std::memcpy(dst + 64 + 2 * k, src + k * kQ5_0Bytes, 2);
    }
    put_fields(q, 6, 5, dst);
  }
  std::memcpy(dst, src, static_cast<size_t>(cols % kGroup / 32 * kQ5_0Bytes));
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

// data [rows, row_bytes] uint8 in GGML `type` (Q5_0, Q4_K or Q6_K) -> [rows, out_bytes] in its lanes layout.
torch::Tensor pack_lanes(torch::Tensor data, int64_t type, int64_t cols, int64_t out_bytes) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.dim() == 2 && data.is_contiguous(), "data must be contiguous [rows, row_bytes] uint8");
  TORCH_CHECK(type == kQ5_0 || type == kQ4_K || type == kQ6_K, "pack_lanes repacks Q5_0, Q4_K and Q6_K, not ggml type ", type);
  const int64_t block = type == kQ5_0 ? 32 : 256, block_bytes = type == kQ5_0 ? kQ5_0Bytes : type == kQ4_K ? 144 : 210;
  TORCH_CHECK(cols > 0 && cols % block == 0 && data.size(1) == cols / block * block_bytes, "rows of ", data.size(1),
              " bytes are not ", cols, " columns of ggml type ", type);
  const int64_t expected = type == kQ5_0 ? cols / kGroup * kGroupBytes + cols % kGroup / 32 * kQ5_0Bytes : data.size(1);
  TORCH_CHECK(out_bytes == expected, "a lanes row of ", cols, " columns of ggml type ", type, " holds ", expected, " bytes, not ", out_bytes);
  auto out = torch::empty({data.size(0), out_bytes}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t rb = data.size(1);
  at::parallel_for(0, data.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* s = src + r * rb;
      uint8_t* d = dst + r * out_bytes;
      if (type == kQ5_0) {
        pack_q5_0(s, cols, d);
      } else {
        for (int64_t k = 0; k < cols / 256; ++k) (type == kQ4_K ? pack_q4_k : pack_q6_k)(s + k * block_bytes, d + k * block_bytes);
      }
    }
  });
  return out;
}

}  // namespace lanes_pack
}  // namespace
