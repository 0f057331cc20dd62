// The ceilings the verify benchmark quotes, measured with CUDA events on a private stream: the mma.sync m16n8k16 bf16 rate (the instruction the
// portable kernel is built on) and device-to-device copy bandwidth.  None of this runs inside XLA.
#include <cuda_bf16.h>
#include <cuda_runtime.h>


#include "bench.h"
#include "../verify_attention.h"

namespace {


constexpr int kChains = 8;           // independent accumulators per warp: hides the MMA latency
constexpr int kMmaIters = 8192;
constexpr int kMmaThreads = 256;

__global__ void __launch_bounds__(kMmaThreads) mma_rate_kernel(float* sink, int write) {
  // Operands: non-zero, lane-dependent bf16 values (zeros would flatter the rate).
  const float seed = 1.f + 0.001f * threadIdx.x;
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 v = __floats2bfloat162_rn(seed * (i + 1), -seed * (i + 2));
    a[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  for (int i = 0; i < 2; ++i) {
    __nv_bfloat162 v = __floats2bfloat162_rn(0.5f * seed, 0.25f * (i + 1));
    b[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  float c[kChains][4] = {};
  for (int it = 0; it < kMmaIters; ++it) {
#pragma unroll
    for (int k = 0; k < kChains; ++k) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float total = 0.f;
  for (int k = 0; k < kChains; ++k) total += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  if (write) sink[blockIdx.x * blockDim.x + threadIdx.x] = total;  // never true: keeps the work alive
}

// Time `launch` (already warmed up) over `reps` runs with events on `stream`; returns milliseconds per run.
template <typename Launch>
float time_ms(cudaStream_t stream, int reps, Launch launch) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  launch();
  cudaEventRecord(start, stream);
  for (int i = 0; i < reps; ++i) launch();
  cudaEventRecord(stop, stream);
  cudaEventSynchronize(stop);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / reps;
}

}  // namespace

namespace kdtree {

double bench_mma_sync_tflops(int device) {
  const int sms = cuda_sm_count(device);
  if (sms <= 0 || cudaSetDevice(device) != cudaSuccess) return -1.0;
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  const int blocks = sms * 4;  // 32 warps per SM
  float* sink = nullptr;
  cudaMalloc(&sink, sizeof(float) * blocks * kMmaThreads);
  const float ms = time_ms(stream, 5, [&] { mma_rate_kernel<<<blocks, kMmaThreads, 0, stream>>>(sink, 0); });
  const bool ok = cudaGetLastError() == cudaSuccess;
  cudaFree(sink);
  cudaStreamDestroy(stream);
  const double flops = 2.0 * 16 * 8 * 16 * kChains * double(kMmaIters) * (blocks * kMmaThreads / 32);
  return ok ? flops / (ms * 1e-3) / 1e12 : -1.0;
}

double bench_copy_gbps(int device, int64_t bytes, int iters) {
  if (cuda_sm_count(device) <= 0 || cudaSetDevice(device) != cudaSuccess || bytes <= 0 || iters <= 0) return -1.0;
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  void *src = nullptr, *dst = nullptr;
  if (cudaMalloc(&src, bytes) != cudaSuccess || cudaMalloc(&dst, bytes) != cudaSuccess) {
    cudaFree(src);
    cudaGetLastError();
    cudaStreamDestroy(stream);
    return -1.0;
  }
  cudaMemsetAsync(src, 0x3c, bytes, stream);  // non-zero data
  const float ms = time_ms(stream, iters, [&] { cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream); });
  const bool ok = cudaGetLastError() == cudaSuccess;
  cudaFree(src);
  cudaFree(dst);
  cudaStreamDestroy(stream);
  return ok ? 2.0 * double(bytes) / (ms * 1e-3) / 1e9 : -1.0;
}

}  // namespace kdtree
