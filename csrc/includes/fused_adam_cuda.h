// Launch API of the multi-tensor CUDA Adam kernel: raw device pointers, sizes and a stream, so the
// .cu file needs no torch headers (the CPU wheel of torch lacks complete CUDA headers).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "adam_common.h"

namespace slipstream {

// One tensor's device buffers. `param` is float32, bfloat16 or float16 (one dtype per call);
// `grad` is float32 or the param dtype; state is float32; `lowp_out` (nullable, float32 params
// only) receives the updated parameter rounded to the call's low-precision dtype.
struct FusedAdamTensor {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* lowp_out;
  int64_t numel;
};

// Updates every tensor with one kernel launch per batch of chunks (up to kMaxTensorsPerLaunch
// tensors, kMaxBlocksPerLaunch chunks). `tensors` is a host array; the pointers in it are device
// pointers. Returns the first CUDA error (the launch is asynchronous on `stream`).
cudaError_t fused_adam_cuda(const FusedAdamTensor* tensors, int64_t count, DType param_dtype, DType grad_dtype,
                            DType lowp_dtype, const AdamHyper& hyper, cudaStream_t stream);

}  // namespace slipstream
