"""Every compiled op and how to build it (sources relative to csrc/). Imports no torch."""

from __future__ import annotations

from slipstream.ops.builder import OpSpec

# -ffp-contract=off: the kernel's multiply/add order mirrors torch's AdamW (see cpu_adam.cpp).
# No -march=native: the kernel picks AVX-512/AVX2 at run time, so one build serves every x86-64.
CPU_ADAM = OpSpec(
    name="slipstream_cpu_adam",
    sources=("adam/cpu_adam.cpp", "adam/cpu_adam_binding.cpp"),
    cflags=("-fopenmp", "-ffp-contract=off"),
    ldflags=("-fopenmp",),
)

# The .cu file holds only CUDA (no torch headers); the binding is built where torch has CUDA.
FUSED_ADAM = OpSpec(
    name="slipstream_fused_adam",
    sources=("adam/fused_adam_binding.cpp", "adam/fused_adam_kernel.cu"),
    cuda=True,
    cuda_cflags=("-O3", "-fmad=false"),
)

ALL_OPS: dict[str, OpSpec] = {"cpu_adam": CPU_ADAM, "fused_adam": FUSED_ADAM}

# Async file I/O for NVMe offload: threads doing pread/pwrite, O_DIRECT where aligned. Plain POSIX:
# no libaio or io_uring needed, so it builds wherever a C++ compiler does.
AIO = OpSpec(
    name="slipstream_aio",
    sources=("aio/aio_pool.cpp", "aio/aio_binding.cpp"),
    cflags=("-pthread",),
    ldflags=("-pthread",),
    include_dirs=("includes", "aio"),
)

ALL_OPS["aio"] = AIO

# Large CPU blocks on their own mappings (huge pages where the kernel has them): only c10's allocator header and
# CPython's, so it builds in seconds (slipstream/ops/large_blocks.py).
LARGE_BLOCKS = OpSpec(name="slipstream_large_blocks", sources=("alloc/large_blocks.cpp",))

ALL_OPS["large_blocks"] = LARGE_BLOCKS

# Gradient arrivals counted in C++ post hooks on the parameters' gradient accumulators: no Python per parameter
# tensor per step (engine/zero/arrivals.py).
GRAD_ARRIVALS = OpSpec(name="slipstream_grad_arrivals", sources=("hooks/grad_arrivals.cpp",))

ALL_OPS["grad_arrivals"] = GRAD_ARRIVALS
