// One decoder layer of the ladder as one call: the same kernels and ATen ops, in the same order,
// as runtime/backends/decoder.py's Decoder._layer takes one at a time from Python.
//
// Included by bindings.h after layer_ops.h. A short forward (a decode step, a verify chain of up
// to 16 tokens, a token tree) spends most of its time between kernels, in the interpreter; here a
// layer is one crossing. Every step is the Python path's own call (gemm::quant_linear_parts,
// ops::rms_norm / prepare_qkv / attend, at::add / at::mul / at::silu / at::gelu on the same
// views), so the hidden states are the same bits; tests/test_layer_plan.py checks that.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace {
namespace plan {

// A projection: matrices whose outputs sit side by side (q/k/v, gate/up), then an optional bias.
struct Linear {
  std::vector<torch::Tensor> data;  // [rows_i, row_bytes_i] uint8 each
  std::vector<int64_t> types;       // ggml type of each (F32 for the lean backend's weights)
  int64_t cols = 0;
  torch::Tensor bias;  // [sum rows_i], or undefined

  torch::Tensor operator()(const torch::Tensor& x) const {
    auto y = gemm::quant_linear_parts(x, data, types, cols);
    return bias.defined() ? y.add_(bias) : y;
  }
};

// An RMSNorm (factor = weight or 1 + weight), or none when factor is undefined.
struct Norm {
  torch::Tensor factor;  // [d]
  double eps = 0.0;

  torch::Tensor operator()(const torch::Tensor& x) const { return ops::rms_norm(x, factor, eps); }
  bool present() const { return factor.defined(); }
};

class LayerPlan {
 public:
  // norms: input, q, k, post-attention, pre-MLP, post-MLP (an empty tensor: the layer has none; without
  // an input norm only forward_input runs);
  // projections qkv, o, gate_up, down as (matrices, ggml types, columns, bias or empty).
  LayerPlan(std::vector<torch::Tensor> norm_factors, std::vector<double> norm_eps, std::vector<std::vector<torch::Tensor>> proj_data,
            std::vector<std::vector<int64_t>> proj_types, std::vector<int64_t> proj_cols, std::vector<torch::Tensor> proj_bias,
            int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, std::string activation)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scaling_(scaling) {
    TORCH_CHECK(norm_factors.size() == 6 && norm_eps.size() == 6, "a layer plan takes 6 norms");
    TORCH_CHECK(proj_data.size() == 4 && proj_types.size() == 4 && proj_cols.size() == 4 && proj_bias.size() == 4, "a layer plan takes 4 projections");
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "activation must be silu or gelu_tanh, got ", activation);
    Norm* norms[6] = {&input_, &q_norm_, &k_norm_, &post_attention_, &pre_mlp_, &post_mlp_};
    for (int i = 0; i < 6; ++i) {
      if (norm_factors[i].numel() > 0) ops::check_float(norm_factors[i], 1, "a norm factor");
      *norms[i] = {norm_factors[i].numel() > 0 ? norm_factors[i] : torch::Tensor(), norm_eps[i]};
    }
    TORCH_CHECK(pre_mlp_.present() && q_norm_.present() == k_norm_.present(), "a layer plan needs its pre-MLP norm, and q and k norms together");
    Linear* linears[4] = {&qkv_, &o_, &gate_up_, &down_};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(!proj_data[i].empty() && proj_data[i].size() == proj_types[i].size(), "one ggml type per matrix");
      *linears[i] = {proj_data[i], proj_types[i], proj_cols[i], proj_bias[i].numel() > 0 ? proj_bias[i] : torch::Tensor()};
    }
    gelu_ = activation == "gelu_tanh";
  }

  // x [T, d] (T <= 16, or a token tree's nodes) -> the layer's new residual [T, d]; writes the
  // rows' K/V to keys, values [KV, capacity, hd] at slots start..; positions [T]; row t attends to
  // slots first[t] .. end[t] - 1, then extra[t] up to its first -1 (ops::attend); cos, sin [P, hd].
  torch::Tensor forward(torch::Tensor x, torch::Tensor keys, torch::Tensor values, torch::Tensor positions, torch::Tensor first,
                        torch::Tensor end, torch::Tensor extra, int64_t start, torch::Tensor cos, torch::Tensor sin) const {
    TORCH_CHECK(input_.present(), "this layer plan has no input norm: call forward_input");
    x = x.contiguous();  // what the Python norm's reshape hands the kernel
    return forward_input(input_(x), x, keys, values, positions, first, end, extra, start, cos, sin);
  }

  // forward's layer where attention reads h [T, in], given (an EAGLE-3 head's normed [embedding,
  // features], 2d wide), over the residual x [T, d].
  torch::Tensor forward_input(torch::Tensor h, torch::Tensor x, torch::Tensor keys, torch::Tensor values, torch::Tensor positions,
                              torch::Tensor first, torch::Tensor end, torch::Tensor extra, int64_t start, torch::Tensor cos,
                              torch::Tensor sin) const {
    const int64_t count = x.size(0);
    TORCH_CHECK(h.dim() == 2 && h.size(0) == count, "h [T, in] and x [T, d] must have the same rows");
    auto qkv = qkv_(h).view({count, heads_ + 2 * kv_heads_, head_dim_});
    ops::prepare_qkv(qkv, heads_, q_norm_.present() ? q_norm_.factor : no_factor_, k_norm_.present() ? k_norm_.factor : no_factor_,
                     q_norm_.present() ? q_norm_.eps : 0.0, cos, sin, positions, keys, values, start);
    auto attended = o_(ops::attend(qkv, heads_, keys, values, first, end, extra, scaling_));
    if (post_attention_.present()) attended = post_attention_(attended);
    x = x + attended;
    const auto gate_up = gate_up_(pre_mlp_(x));
    const int64_t half = gate_up.size(1) / 2;
    const auto gate = gate_up.slice(1, 0, half);
    auto mlp = down_((gelu_ ? at::gelu(gate, "tanh") : at::silu(gate)) * gate_up.slice(1, half));
    if (post_mlp_.present()) mlp = post_mlp_(mlp);
    return x + mlp;
  }

 private:
  Norm input_, q_norm_, k_norm_, post_attention_, pre_mlp_, post_mlp_;
  Linear qkv_, o_, gate_up_, down_;
  int64_t heads_, kv_heads_, head_dim_;
  double scaling_;
  bool gelu_ = false;
  torch::Tensor no_factor_ = torch::empty({0});  // prepare_qkv's "no head norms", made once, not per step
};

}  // namespace plan
}  // namespace
