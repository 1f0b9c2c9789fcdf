// CPU Adam/AdamW step over many tensors in one pass. Free of torch headers: the kernel file
// compiles in seconds and the binding (csrc/adam/cpu_adam_binding.cpp) owns the torch types.
#pragma once

#include <cstdint>

#include "adam_common.h"

namespace slipstream {

// One tensor's buffers. `grad` holds `numel` values of the call's gradient dtype; `lowp_out`
// (nullable) receives the updated parameter rounded to the call's low-precision dtype.
struct AdamTensor {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* lowp_out;
  int64_t numel;
};

// The instruction set the kernel dispatches to on this CPU: "avx512", "avx2" or "scalar".
// SLIPSTREAM_CPU_ADAM_ISA=avx2|scalar lowers it (for tests and comparisons).
const char* cpu_adam_isa();

void cpu_adam_step(const AdamTensor* tensors, int64_t count, DType grad_dtype, DType lowp_dtype,
                   const AdamHyper& hyper, int num_threads);

// Same loads, stores, partitioning and threads as cpu_adam_step with trivial arithmetic: the
// memory-bandwidth ceiling for that access pattern. Overwrites the buffers.
void cpu_stream_probe(const AdamTensor* tensors, int64_t count, DType grad_dtype, DType lowp_dtype,
                      int num_threads);

}  // namespace slipstream
