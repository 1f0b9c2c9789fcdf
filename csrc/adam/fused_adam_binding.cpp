// Python binding of the multi-tensor CUDA Adam kernel. Built only where torch has CUDA (the CPU
// wheel lacks the CUDA headers this file needs); the kernel itself is in fused_adam_kernel.cu.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "binding_checks.h"
#include "fused_adam_cuda.h"

namespace {

using slipstream::check_buffer;
using slipstream::DType;
using slipstream::to_dtype;

constexpr const char* kOp = "fused_adam";

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& lowp_out, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool adamw_mode, double grad_scale) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "fused_adam: params, grads, exp_avgs and exp_avg_sqs must have the same length");
  TORCH_CHECK(lowp_out.empty() || lowp_out.size() == n, "fused_adam: lowp_out must be empty or one per parameter");
  TORCH_CHECK(step >= 1, "fused_adam: step must be >= 1 (the count after this update), got ", step);
  if (n == 0) return;
  const at::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "fused_adam: parameters must be CUDA tensors, got ", device);
  const DType param_dtype = to_dtype(params[0], kOp);
  const DType grad_dtype = to_dtype(grads[0], kOp);
  const DType lowp_dtype = lowp_out.empty() ? DType::kNone : to_dtype(lowp_out[0], kOp);
  // Any grad dtype with any parameter dtype: the kernel reads gradients in their own precision and
  // computes in float32 (bf16 gradients of fp32 masters are the mixed-precision case, as on CPU).
  TORCH_CHECK(lowp_dtype == DType::kNone || (param_dtype == DType::kFloat32 && lowp_dtype != DType::kFloat32),
              "fused_adam: lowp_out (bfloat16/float16) is for float32 parameters");
  std::vector<slipstream::FusedAdamTensor> tensors(n);
  for (size_t k = 0; k < n; ++k) {
    const int64_t numel = params[k].numel();
    check_buffer(params[k], kOp, "parameter", numel, device);
    TORCH_CHECK(to_dtype(params[k], kOp) == param_dtype, "fused_adam: all parameters of one call must share a dtype");
    check_buffer(grads[k], kOp, "grad", numel, device);
    TORCH_CHECK(to_dtype(grads[k], kOp) == grad_dtype, "fused_adam: all grads of one call must share a dtype");
    for (const at::Tensor* t : {&exp_avgs[k], &exp_avg_sqs[k]}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat, "fused_adam: Adam state must be float32, got ", t->scalar_type());
      check_buffer(*t, kOp, "state", numel, device);
    }
    void* lowp = nullptr;
    if (!lowp_out.empty()) {
      check_buffer(lowp_out[k], kOp, "lowp_out", numel, device);
      TORCH_CHECK(to_dtype(lowp_out[k], kOp) == lowp_dtype, "fused_adam: all lowp_out tensors must share a dtype");
      lowp = lowp_out[k].data_ptr();
    }
    tensors[k] = slipstream::FusedAdamTensor{params[k].data_ptr(), grads[k].data_ptr(), exp_avgs[k].data_ptr<float>(),
                                             exp_avg_sqs[k].data_ptr<float>(), lowp, numel};
  }
  const c10::cuda::CUDAGuard guard(device);
  const slipstream::AdamHyper hyper{lr, beta1, beta2, eps, weight_decay, step, adamw_mode, grad_scale};
  const cudaError_t err = slipstream::fused_adam_cuda(tensors.data(), static_cast<int64_t>(n), param_dtype, grad_dtype,
                                                      lowp_dtype, hyper, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "fused_adam: kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Slipstream multi-tensor fused Adam/AdamW for CUDA";
  m.def("adam_step", &adam_step, "One Adam/AdamW step over lists of CUDA tensors (one param group)");
  m.def("build_key", [] { return std::string(SS_STRINGIFY(SLIPSTREAM_OP_KEY)); }, "Key of the build inputs");
}
