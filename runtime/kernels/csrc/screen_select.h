// What screen_select shares on every ISA (screen_avx512.cpp, screen_avx2.cpp): its inputs, checked alike
// (one row's center, coefficients, optional |Q(W_i)| and noise [V] float32, and k), and the k-th largest
// lower bound for k > 1.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <functional>
#include <queue>
#include <vector>

namespace {

struct SelectInputs {
  const float* center;
  const float* coef;
  const float* noise;  // nullptr: no noise
  const float* qnorm;  // nullptr: no remainder term
  int64_t V;
};

inline SelectInputs select_inputs(const torch::Tensor& center, const torch::Tensor& coef, const torch::Tensor& qnorm,
                                  const torch::Tensor& noise, int64_t k) {
  TORCH_CHECK(center.dtype() == torch::kFloat32 && center.dim() == 1 && center.is_contiguous(), "center: [V] fp32");
  TORCH_CHECK(coef.dtype() == torch::kFloat32 && coef.is_contiguous() && coef.numel() == center.numel(), "coef: [V] fp32");
  const int64_t V = center.numel();
  TORCH_CHECK(k >= 1 && k <= V && V < INT32_MAX, "k or V out of range");
  const bool has_noise = noise.numel() > 0, has_qnorm = qnorm.numel() > 0;
  TORCH_CHECK(!has_noise || (noise.dtype() == torch::kFloat32 && noise.is_contiguous() && noise.numel() == V), "noise: [V] fp32");
  TORCH_CHECK(!has_qnorm || (qnorm.dtype() == torch::kFloat32 && qnorm.is_contiguous() && qnorm.numel() == V), "qnorm: [V] fp32");
  return {center.data_ptr<float>(), coef.data_ptr<float>(), has_noise ? noise.data_ptr<float>() : nullptr,
          has_qnorm ? qnorm.data_ptr<float>() : nullptr, V};
}

// The k-th largest of the values offered so far (at least k offered): a size-k min-heap.
class KthLargest {
 public:
  explicit KthLargest(int64_t k) : k_(k) {}
  void offer(float value) {
    if (static_cast<int64_t>(heap_.size()) < k_) heap_.push(value);
    else if (value > heap_.top()) { heap_.pop(); heap_.push(value); }
  }
  float value() const { return heap_.top(); }

 private:
  int64_t k_;
  std::priority_queue<float, std::vector<float>, std::greater<float>> heap_;
};

}  // namespace
