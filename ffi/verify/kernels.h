// The verify-attention kernels as the launcher sees them: per kernel, a one-time setup of its function attributes
// (dynamic shared memory, carveout) and a launch over (row tiles, splits, batch), as a programmatic dependent launch
// when `pdl` (pdl.cuh). One kernel per file.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"

namespace kdtree::verify {

cudaError_t wide_kernel_setup();       // wide_kernel.cu: T*H > 16 within 99 KB of shared memory (sm_120)
void launch_wide_kernel(const Params& p, int64_t batch, cudaStream_t stream, bool pdl);
cudaError_t pipelined_kernel_setup();  // pipelined_kernel.cu: T*H > 16 with 213 KB of shared memory (sm_90-class)
void launch_pipelined_kernel(const Params& p, int64_t batch, cudaStream_t stream, bool pdl);
int pipelined_kernel_smem_bytes();
cudaError_t hopper_kernel_setup();     // hopper_kernel.cu: wgmma, 64 rows a block (sm_90a; KDTREE_WITH_HOPPER)
void launch_hopper_kernel(const Params& p, int64_t batch, cudaStream_t stream, bool pdl);
int hopper_kernel_smem_bytes();
cudaError_t merge_setup();             // merge.cu
void launch_merge(const Params& p, int64_t batch, cudaStream_t stream, bool pdl);

// launch.cu: the variant `requested` resolves to on `device` for `rows` = T*H query rows (kAuto: from the shapes and
// the device's opt-in shared memory); -1 when the variant cannot run there.
int64_t resolve_variant(int64_t requested, int64_t rows, int device);
// The main kernel (main) and the merge (merge, when p.num_splits > 1) of a resolved variant, after the one-time setup
// for `device`.
cudaError_t launch_verify(const Params& p, int64_t batch, int64_t variant, int device, cudaStream_t stream,
                          bool main = true, bool merge = true);

}  // namespace kdtree::verify
