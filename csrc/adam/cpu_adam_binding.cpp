// Python binding of the CPU Adam kernel: checks tensors, collects raw pointers, releases the GIL.
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "binding_checks.h"
#include "cpu_adam.h"

namespace {

using slipstream::AdamTensor;
using slipstream::check_buffer;
using slipstream::DType;
using slipstream::to_dtype;

constexpr const char* kOp = "cpu_adam";
const at::Device kCPU(at::kCPU);

// Checks the lists and returns the kernel's view of them plus the gradient and copy dtypes.
std::vector<AdamTensor> gather(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                               const std::vector<at::Tensor>& lowp_out, DType* grad_dtype, DType* lowp_dtype) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "cpu_adam: params, grads, exp_avgs and exp_avg_sqs must have the same length");
  TORCH_CHECK(lowp_out.empty() || lowp_out.size() == n, "cpu_adam: lowp_out must be empty or one per parameter");
  *grad_dtype = n ? to_dtype(grads[0], kOp) : DType::kFloat32;
  *lowp_dtype = lowp_out.empty() ? DType::kNone : to_dtype(lowp_out[0], kOp);
  TORCH_CHECK(*lowp_dtype != DType::kFloat32, "cpu_adam: lowp_out must be bfloat16 or float16");
  std::vector<AdamTensor> out(n);
  for (size_t k = 0; k < n; ++k) {
    const int64_t numel = params[k].numel();
    for (const at::Tensor* t : {&params[k], &exp_avgs[k], &exp_avg_sqs[k]}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat, "cpu_adam: parameters and Adam state must be float32, got ", t->scalar_type());
      check_buffer(*t, kOp, "parameter/state", numel, kCPU);
    }
    check_buffer(grads[k], kOp, "grad", numel, kCPU);
    TORCH_CHECK(to_dtype(grads[k], kOp) == *grad_dtype, "cpu_adam: all grads of one call must share a dtype");
    void* lowp = nullptr;
    if (!lowp_out.empty()) {
      check_buffer(lowp_out[k], kOp, "lowp_out", numel, kCPU);
      TORCH_CHECK(to_dtype(lowp_out[k], kOp) == *lowp_dtype, "cpu_adam: all lowp_out tensors must share a dtype");
      lowp = lowp_out[k].data_ptr();
    }
    out[k] = AdamTensor{params[k].data_ptr<float>(), grads[k].data_ptr(), exp_avgs[k].data_ptr<float>(),
                        exp_avg_sqs[k].data_ptr<float>(), lowp, numel};
  }
  return out;
}

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& lowp_out, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool adamw_mode, double grad_scale, int64_t num_threads) {
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1 (the count after this update), got ", step);
  DType grad_dtype, lowp_dtype;
  const auto tensors = gather(params, grads, exp_avgs, exp_avg_sqs, lowp_out, &grad_dtype, &lowp_dtype);
  const slipstream::AdamHyper hyper{lr, beta1, beta2, eps, weight_decay, step, adamw_mode, grad_scale};
  pybind11::gil_scoped_release no_gil;
  slipstream::cpu_adam_step(tensors.data(), static_cast<int64_t>(tensors.size()), grad_dtype, lowp_dtype, hyper,
                            static_cast<int>(num_threads));
}

void stream_probe(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                  const std::vector<at::Tensor>& lowp_out, int64_t num_threads) {
  DType grad_dtype, lowp_dtype;
  const auto tensors = gather(params, grads, exp_avgs, exp_avg_sqs, lowp_out, &grad_dtype, &lowp_dtype);
  pybind11::gil_scoped_release no_gil;
  slipstream::cpu_stream_probe(tensors.data(), static_cast<int64_t>(tensors.size()), grad_dtype, lowp_dtype,
                               static_cast<int>(num_threads));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Slipstream CPU Adam/AdamW (AVX-512 / AVX2 / scalar, OpenMP)";
  m.def("adam_step", &adam_step, "One Adam/AdamW step over lists of tensors (one param group)");
  m.def("stream_probe", &stream_probe, "Memory-bandwidth probe with adam_step's access pattern");
  m.def("isa", &slipstream::cpu_adam_isa, "Instruction set the kernel uses on this CPU");
  m.def("build_key", [] { return std::string(SS_STRINGIFY(SLIPSTREAM_OP_KEY)); }, "Key of the build inputs");
}
