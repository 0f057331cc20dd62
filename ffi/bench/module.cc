// nanobind module kdtree_jax._kernel_bench: the benchmark target, built beside the production extension and never
// imported by the op. Ceilings (mma.sync rate, copy bandwidth) and the verify kernels timed with CUDA events.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "bench.h"

namespace nb = nanobind;

NB_MODULE(_kernel_bench, m) {
  m.doc() = "GPU micro-benchmarks of the kdtree-jax kernels (ceilings, verify kernels timed outside XLA)";
  m.def("bench_mma_sync_tflops", &kdtree::bench_mma_sync_tflops, nb::arg("device") = 0,
        "Measured rate of mma.sync.m16n8k16 bf16 (fp32 accumulate) over the whole GPU, TFLOP/s.");
  m.def("bench_copy_gbps", &kdtree::bench_copy_gbps, nb::arg("device") = 0, nb::arg("bytes") = int64_t{1} << 31,
        nb::arg("iters") = 20, "Device-to-device cudaMemcpy bandwidth, bytes read + written per second / 1e9.");
  m.def("bench_verify_attention", &kdtree::bench_verify_attention, nb::arg("batch"), nb::arg("num_queries"),
        nb::arg("num_heads"), nb::arg("length"), nb::arg("num_splits"), nb::arg("variant") = 0,
        nb::arg("scattered") = true, nb::arg("iters") = 20,
        "The verify kernels of `variant` (0 = automatic) timed with CUDA events, us per call: [plain launches, CUDA "
        "graph replay, main kernel alone, merge alone] (-1 on failure).");
}
