// nanobind module: hands the FFI handlers to Python as capsules (jax.ffi.register_ffi_target takes them)
// and exposes the few host helpers the Python side and the benchmarks need.
#include <nanobind/nanobind.h>

#include "mla_prologue.h"
#include "moe_experts.h"
#include "moe_route.h"
#include "topk.h"
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
  m.doc() = "Paged MLA verify attention, the routed-expert MLP and log-softmax top-k: XLA FFI handlers (CPU, CUDA)";
  m.def("cpu_handler", []() { return encapsulate(kdtree_verify_attention_cpu); });
#if defined(KDTREE_WITH_CUDA)
  m.attr("with_cuda") = true;
  m.def("cuda_handler", []() { return encapsulate(kdtree_verify_attention_cuda); });
  m.def("moe_experts_cuda_handler", []() { return encapsulate(kdtree_moe_experts_cuda); });
  m.def("moe_pairs_cuda_handler", []() { return encapsulate(kdtree_moe_pairs_cuda); });
  m.def("moe_pairs_shared_cuda_handler", []() { return encapsulate(kdtree_moe_pairs_shared_cuda); });
  m.def("log_softmax_top_k_cuda_handler", []() { return encapsulate(kdtree_log_softmax_top_k_cuda); });
  m.def("moe_route_cuda_handler", []() { return encapsulate(kdtree_moe_route_cuda); });
  m.def("mla_prologue_cuda_handler", []() { return encapsulate(kdtree_mla_prologue_cuda); });
  m.def("sm_count", &kdtree::cuda_sm_count, nb::arg("device") = 0,
        "Multiprocessor count of a CUDA device (cached after the first query); -1 without a usable device.");
  m.def("resolve_variant", &kdtree::cuda_resolve_variant, nb::arg("variant"), nb::arg("rows"), nb::arg("device") = 0,
        "The verify kernel variant that `variant` (0 = automatic) resolves to for T*H query rows on a device; -1 when it "
        "cannot run there.");
#else
  m.attr("with_cuda") = false;
#endif
}
