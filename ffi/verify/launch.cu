// Which kernel runs, and its one-time setup per device. No host synchronisation and no allocation here: a launch is
// safe inside CUDA graph capture (XLA command buffers).
#include <mutex>

#include "../pdl.cuh"
#include "kernels.h"

namespace kdtree::verify {
namespace {

constexpr int kMaxDevices = 64;
std::once_flag setup_once[kMaxDevices];
cudaError_t setup_status[kMaxDevices];
int optin_smem[kMaxDevices];
bool hopper_ok[kMaxDevices];

#if defined(KDTREE_WITH_HOPPER)
constexpr bool kHopperBuilt = true;
#else
constexpr bool kHopperBuilt = false;
#endif

// Function attributes are per device and host-side; raising them once per device keeps them out of graph capture.
cudaError_t ensure_setup(int device) {
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  std::call_once(setup_once[device], [device] {
    int smem = 0, major = 0, minor = 0;
    cudaError_t err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    optin_smem[device] = smem;
    if (err == cudaSuccess) err = wide_kernel_setup();
    if (err == cudaSuccess && smem >= pipelined_kernel_smem_bytes()) err = pipelined_kernel_setup();
#if defined(KDTREE_WITH_HOPPER)
    // sm_90a machine code runs on compute capability 9.0 exactly.
    hopper_ok[device] = major == 9 && minor == 0 && smem >= hopper_kernel_smem_bytes();
    if (err == cudaSuccess && hopper_ok[device]) err = hopper_kernel_setup();
#endif
    if (err == cudaSuccess) err = merge_setup();
    setup_status[device] = err;
  });
  return setup_status[device];
}

}  // namespace

int64_t resolve_variant(int64_t requested, int64_t rows, int device) {
  if (ensure_setup(device) != cudaSuccess) return -1;
  const bool pipelined_fits = optin_smem[device] >= pipelined_kernel_smem_bytes();
  const bool hopper = kHopperBuilt && hopper_ok[device];
  if (requested == kAuto) return hopper ? kHopper : (pipelined_fits ? kPipelined : kWide);
  if (requested == kPipelined && !pipelined_fits) return -1;
  if (requested == kHopper && !hopper) return -1;
  return requested > kAuto && requested < kNumVariants ? requested : -1;
}

cudaError_t launch_verify(const Params& p, int64_t batch, int64_t variant, int device, cudaStream_t stream, bool main,
                          bool merge) {
  if (cudaError_t err = ensure_setup(device); err != cudaSuccess) return err;
  const bool pdl = kdtree::pdl_supported();  // `device` is the current device (api.cu asks it)
  if (main) {
    switch (variant) {
      case kWide: launch_wide_kernel(p, batch, stream, pdl); break;
      case kPipelined: launch_pipelined_kernel(p, batch, stream, pdl); break;
#if defined(KDTREE_WITH_HOPPER)
      case kHopper: launch_hopper_kernel(p, batch, stream, pdl); break;
#endif
      default: return cudaErrorInvalidValue;
    }
  }
  if (merge) launch_merge(p, batch, stream, pdl);
  return cudaGetLastError();
}

}  // namespace kdtree::verify
