// Types shared by the CPU and CUDA Adam kernels and their bindings. No torch, no CUDA headers.
#pragma once

#include <cmath>
#include <cstdint>

namespace slipstream {

enum class DType : int { kNone = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

// Hyper-parameters of one call (one param group). The gradient is multiplied by `grad_scale`
// (unscale x clip coefficient) before use; `adamw_mode` chooses decoupled decay over L2.
struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int64_t step;  // already incremented: 1 on the first step
  bool adamw_mode;
  double grad_scale;
};

// The float scalars of one step, computed in double and rounded once, where and as
// torch.optim.AdamW rounds its Python floats.
struct AdamScalars {
  float decay;       // 1 - lr*wd for AdamW, else 1
  float l2;          // wd for Adam (L2), else 0
  bool use_l2;
  float grad_scale;
  float w1;          // 1 - beta1 (lerp weight)
  float beta2;
  float c2;          // 1 - beta2
  float bc2_sqrt;    // sqrt(1 - beta2^step)
  float eps;
  float neg_step;    // -lr / (1 - beta1^step)
};

inline AdamScalars make_adam_scalars(const AdamHyper& h) {
  AdamScalars s;
  const bool decay = h.weight_decay != 0.0;
  s.decay = (decay && h.adamw_mode) ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  s.use_l2 = decay && !h.adamw_mode;
  s.l2 = static_cast<float>(s.use_l2 ? h.weight_decay : 0.0);
  s.grad_scale = static_cast<float>(h.grad_scale);
  s.w1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.c2 = static_cast<float>(1.0 - h.beta2);
  const double step = static_cast<double>(h.step);
  s.bc2_sqrt = static_cast<float>(std::pow(1.0 - std::pow(h.beta2, step), 0.5));  // Python's `bc2 ** 0.5`
  s.eps = static_cast<float>(h.eps);
  s.neg_step = static_cast<float>(-(h.lr / (1.0 - std::pow(h.beta1, step))));
  return s;
}

}  // namespace slipstream
