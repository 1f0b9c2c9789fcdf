// Argument checks shared by the op bindings (torch headers: include only from binding files).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "adam_common.h"

namespace slipstream {

inline DType to_dtype(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t.scalar_type(), " (use float32, bfloat16 or float16)");
  }
}

// `t` is a contiguous tensor of `numel` elements on `device`.
inline void check_buffer(const at::Tensor& t, const char* op, const char* what, int64_t numel, const at::Device& device) {
  TORCH_CHECK(t.device() == device, op, ": ", what, " is on ", t.device(), ", expected ", device);
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, op, ": ", what, " has ", t.numel(), " elements, the parameter ", numel);
}

}  // namespace slipstream

#define SS_STRINGIFY2(x) #x
#define SS_STRINGIFY(x) SS_STRINGIFY2(x)
#ifndef SLIPSTREAM_OP_KEY
#define SLIPSTREAM_OP_KEY unkeyed
#endif
