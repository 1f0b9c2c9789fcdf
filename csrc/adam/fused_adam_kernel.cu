// Multi-tensor fused Adam/AdamW on CUDA: the tensors of a param group are cut into chunks, and one
// launch updates a batch of chunks whose addresses travel in the kernel's parameter block.
//
// Per element it performs the operations of csrc/adam/cpu_adam.cpp in the same order, with the
// same explicit FMAs (built with -fmad=false so nvcc fuses nothing else), so CPU and GPU steps
// agree bit for bit on float32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "fused_adam_cuda.h"

namespace slipstream {
namespace {

constexpr int kMaxTensorsPerLaunch = 36;
constexpr int kMaxBlocksPerLaunch = 320;
constexpr int64_t kChunk = 65536;  // elements per block
constexpr int kThreads = 512;

// Passed by value as the kernel argument (3.3 KB, under the 4 KB parameter limit of every arch).
struct ChunkBatch {
  void* param[kMaxTensorsPerLaunch];
  const void* grad[kMaxTensorsPerLaunch];
  float* exp_avg[kMaxTensorsPerLaunch];
  float* exp_avg_sq[kMaxTensorsPerLaunch];
  void* lowp_out[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  unsigned char tensor_of_block[kMaxBlocksPerLaunch];
  int chunk_of_block[kMaxBlocksPerLaunch];
};
static_assert(sizeof(ChunkBatch) <= 4096, "kernel parameter block too large");

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

template <typename P, typename G>
__global__ void __launch_bounds__(kThreads) adam_kernel(ChunkBatch batch, AdamScalars s, DType lowp_dtype) {
  const int tensor = batch.tensor_of_block[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(batch.chunk_of_block[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, batch.numel[tensor]);
  P* param = static_cast<P*>(batch.param[tensor]);
  const G* grad = static_cast<const G*>(batch.grad[tensor]);
  float* exp_avg = batch.exp_avg[tensor];
  float* exp_avg_sq = batch.exp_avg_sq[tensor];
  void* lowp = batch.lowp_out[tensor];
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float p = to_float(param[i]);
    float g = to_float(grad[i]);
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    p = __fmul_rn(p, s.decay);
    g = __fmul_rn(g, s.grad_scale);
    if (s.use_l2) g = __fmaf_rn(p, s.l2, g);
    m = __fmaf_rn(s.w1, __fsub_rn(g, m), m);
    v = __fmaf_rn(__fmul_rn(s.c2, g), g, __fmul_rn(v, s.beta2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step, m), denom));
    param[i] = from_float<P>(p);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (lowp != nullptr) {
      if (lowp_dtype == DType::kBFloat16) {
        static_cast<__nv_bfloat16*>(lowp)[i] = __float2bfloat16_rn(p);
      } else {
        static_cast<__half*>(lowp)[i] = __float2half_rn(p);
      }
    }
  }
}

template <typename P, typename G>
cudaError_t launch_all(const FusedAdamTensor* tensors, int64_t count, DType lowp_dtype, const AdamScalars& s,
                       cudaStream_t stream) {
  ChunkBatch batch;
  int loaded = 0;  // tensors in the batch
  int blocks = 0;  // chunks in the batch
  for (int64_t k = 0; k < count; ++k) {
    const FusedAdamTensor& t = tensors[k];
    if (t.numel == 0) continue;
    batch.param[loaded] = t.param;
    batch.grad[loaded] = t.grad;
    batch.exp_avg[loaded] = t.exp_avg;
    batch.exp_avg_sq[loaded] = t.exp_avg_sq;
    batch.lowp_out[loaded] = t.lowp_out;
    batch.numel[loaded] = t.numel;
    ++loaded;
    const int64_t chunks = (t.numel + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      batch.tensor_of_block[blocks] = static_cast<unsigned char>(loaded - 1);
      batch.chunk_of_block[blocks] = static_cast<int>(c);
      ++blocks;
      const bool batch_full = blocks == kMaxBlocksPerLaunch;
      const bool tensors_full = loaded == kMaxTensorsPerLaunch && c == chunks - 1;
      const bool last = k == count - 1 && c == chunks - 1;
      if (batch_full || tensors_full || last) {
        adam_kernel<P, G><<<blocks, kThreads, 0, stream>>>(batch, s, lowp_dtype);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
        blocks = 0;
        if (c == chunks - 1) {
          loaded = 0;
        } else {  // the current tensor continues in the next batch, in slot 0
          batch.param[0] = batch.param[loaded - 1];
          batch.grad[0] = batch.grad[loaded - 1];
          batch.exp_avg[0] = batch.exp_avg[loaded - 1];
          batch.exp_avg_sq[0] = batch.exp_avg_sq[loaded - 1];
          batch.lowp_out[0] = batch.lowp_out[loaded - 1];
          batch.numel[0] = batch.numel[loaded - 1];
          loaded = 1;
        }
      }
    }
  }
  if (blocks > 0) {  // only reachable when the last tensors were empty
    adam_kernel<P, G><<<blocks, kThreads, 0, stream>>>(batch, s, lowp_dtype);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

template <typename P>
cudaError_t dispatch_grad(const FusedAdamTensor* tensors, int64_t count, DType grad_dtype, DType lowp_dtype,
                          const AdamScalars& s, cudaStream_t stream) {
  switch (grad_dtype) {
    case DType::kFloat32: return launch_all<P, float>(tensors, count, lowp_dtype, s, stream);
    case DType::kBFloat16: return launch_all<P, __nv_bfloat16>(tensors, count, lowp_dtype, s, stream);
    case DType::kFloat16: return launch_all<P, __half>(tensors, count, lowp_dtype, s, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t fused_adam_cuda(const FusedAdamTensor* tensors, int64_t count, DType param_dtype, DType grad_dtype,
                            DType lowp_dtype, const AdamHyper& hyper, cudaStream_t stream) {
  if (lowp_dtype != DType::kNone && (param_dtype != DType::kFloat32 || lowp_dtype == DType::kFloat32)) {
    return cudaErrorInvalidValue;  // a low-precision copy is only for float32 parameters
  }
  const AdamScalars s = make_adam_scalars(hyper);
  switch (param_dtype) {
    case DType::kFloat32: return dispatch_grad<float>(tensors, count, grad_dtype, lowp_dtype, s, stream);
    case DType::kBFloat16: return dispatch_grad<__nv_bfloat16>(tensors, count, grad_dtype, lowp_dtype, s, stream);
    case DType::kFloat16: return dispatch_grad<__half>(tensors, count, grad_dtype, lowp_dtype, s, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace slipstream
