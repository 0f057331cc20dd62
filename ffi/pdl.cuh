// Programmatic dependent launch (compute capability 9.0 and later): a kernel launched with the attribute may start
// while the kernel before it on the stream is still finishing, and waits for that kernel's results only where it
// executes griddepcontrol.wait. Why: a verify call is two dependent launches (main kernel, then the merge), and
// at short contexts or one query token the merge's launch latency and block start are a sizeable part of the
// call; under PDL the merge's blocks are resident before the main kernel's last block retires. The MoE ops' kernels
// (moe_pairs.cu, moe_experts.cu) chain the same way.
//
// Device side: `wait_for_previous_grid()` before a kernel reads anything an earlier kernel wrote (a no-op when the
// kernel was launched without the attribute, and compiled out below sm_90); `allow_dependent_launch()` once a
// kernel's blocks are running (the dependent still waits for this grid's completion and memory flush).
// Host side: `launch_kernel` sets the attribute when asked; ask on compute capability >= 9 only (`pdl_supported`).
// Both are graph-safe: stream capture records the programmatic edge.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <utility>

namespace kdtree {

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the stream's previous kernel when
// `pdl`.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                   Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Whether the current device takes programmatic dependent launches (compute capability 9.0 and later); asked once
// per device, outside any graph capture's device work (attribute queries only).
inline bool pdl_supported() {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static bool ok[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return false;
  std::call_once(once[device], [device] {
    int major = 0;
    ok[device] = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
  });
  return ok[device];
}

}  // namespace kdtree
