// nanobind module: hands the FFI handlers to Python as capsules (jax.ffi.register_ffi_target takes them)
// and exposes the few host helpers the Python side and the benchmarks need.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "moe_experts.h"
#include "verify_attention.h"

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule encapsulate(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_verify_attention_ext, m) {
  m.doc() = "Paged MLA verify attention: XLA FFI handlers (CPU, CUDA) and GPU micro-benchmarks";
  m.def("cpu_handler", []() { return encapsulate(kdtree_verify_attention_cpu); });
#if defined(KDTREE_WITH_CUDA)
  m.attr("with_cuda") = true;
  m.def("cuda_handler", []() { return encapsulate(kdtree_verify_attention_cuda); });
  m.def("moe_experts_cuda_handler", []() { return encapsulate(kdtree_moe_experts_cuda); });
  m.def("sm_count", &kdtree::cuda_sm_count, nb::arg("device") = 0,
        "Multiprocessor count of a CUDA device (cached after the first query); -1 without a usable device.");
  m.def("bench_mma_sync_tflops", &kdtree::bench_mma_sync_tflops, nb::arg("device") = 0,
        "Measured rate of mma.sync.m16n8k16 bf16 (fp32 accumulate) over the whole GPU, TFLOP/s.");
  m.def("bench_copy_gbps", &kdtree::bench_copy_gbps, nb::arg("device") = 0, nb::arg("bytes") = int64_t{1} << 31,
        nb::arg("iters") = 20, "Device-to-device cudaMemcpy bandwidth, bytes read + written per second / 1e9.");
  m.def("bench_verify_attention", &kdtree::bench_verify_attention, nb::arg("batch"), nb::arg("num_queries"),
        nb::arg("num_heads"), nb::arg("length"), nb::arg("num_splits"), nb::arg("row_groups"), nb::arg("variant"),
        nb::arg("scattered") = true, nb::arg("iters") = 20,
        "The verify kernels timed with CUDA events outside XLA, us per call: [plain launches, CUDA graph replay, "
        "main kernel alone, merge alone] (-1 on failure).");
  m.def("bench_verify_block_times", &kdtree::bench_verify_block_times, nb::arg("batch"), nb::arg("num_queries"),
        nb::arg("num_heads"), nb::arg("length"), nb::arg("num_splits"), nb::arg("row_groups"), nb::arg("variant"),
        nb::arg("scattered") = true, nb::arg("warmup") = 3,
        "The main verify kernel's block timeline of one call: [start, end] of every block in us since the first "
        "start (%globaltimer), flattened; empty on failure and unless built with KDTREE_JAX_BLOCK_CLOCK=1.");
#else
  m.attr("with_cuda") = false;
#endif
}
