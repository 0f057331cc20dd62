// The XLA FFI glue of the CUDA verify-attention op: checks the buffers and attributes, fills Params, launches the
// resolved variant (launch.cu). See ffi/verify_attention.h for the semantics every implementation keeps.
//
// Scratch for the split partials arrives as two extra outputs of the custom call (kdtree_jax/ops/ffi.py): their
// addresses are fixed by XLA's buffer assignment, so a captured CUDA graph replays with valid pointers. The handler
// only launches: no host synchronisation, no allocation (kCmdBufferCompatible).
#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "../verify_attention.h"
#include "kernels.h"

namespace ffi = xla::ffi;

namespace kdtree {
namespace {

using verify::kLatent;
using verify::kRope;
using verify::kWidth;

constexpr int kMaxDevices = 64;
std::once_flag sm_once[kMaxDevices];
int sm_counts[kMaxDevices];

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("verify_attention (CUDA): ") + what + ": " + cudaGetErrorString(err));
}

using Scalar32 = ffi::Buffer<ffi::S32, 0>;
using Slots = ffi::Buffer<ffi::S32, 2>;
using Lens = ffi::Buffer<ffi::S32, 1>;
using Mask = ffi::Buffer<ffi::U32, 3>;
using Lse = ffi::Buffer<ffi::F32, 3>;
using OutPart = ffi::Buffer<ffi::F32, 2>;
using LsePart = ffi::Buffer<ffi::F32, 1>;

ffi::Error VerifyAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv_pool, Scalar32 layer,
                               Slots kv_slots, Lens kv_lens, Mask tree_mask, float softmax_scale, int64_t rope_dim,
                               int64_t num_splits, int64_t split_parts, int64_t variant, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<Lse> lse, ffi::Result<OutPart> out_part, ffi::Result<LsePart> lse_part) {
  const auto qd = q.dimensions();
  const auto pd = kv_pool.dimensions();
  if (q.element_type() != ffi::DataType::BF16 || kv_pool.element_type() != ffi::DataType::BF16 ||
      out->element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("verify_attention (CUDA): q, kv_pool and out must be bfloat16");
  }
  if (qd.size() != 4 || pd.size() != 3 || qd[3] != kWidth || pd[2] != kWidth || rope_dim != kRope) {
    return ffi::Error::InvalidArgument("verify_attention (CUDA): rows must be 576 wide with rope_dim 64");
  }
  const int64_t batch = qd[0], num_queries = qd[1], num_heads = qd[2];
  const int64_t rows = num_queries * num_heads;
  const int64_t max_len = kv_slots.dimensions()[1];
  if (num_splits < 1 || num_splits > verify::kMaxSplits || split_parts < 0 || split_parts > verify::kMaxSplits ||
      batch > 65535 || rows * batch > (int64_t{1} << 31) ||
      rows > (int64_t{1} << 26) || pd[0] < 1 || pd[1] < 1 || tree_mask.dimensions()[2] * 32 < num_queries) {
    return ffi::Error::InvalidArgument("verify_attention (CUDA): unsupported sizes or num_splits");
  }
  if (num_splits > 1 && (out_part->element_count() < batch * num_splits * rows * kLatent ||
                         lse_part->element_count() < batch * num_splits * rows)) {
    return ffi::Error::InvalidArgument("verify_attention (CUDA): partial buffers too small for num_splits");
  }
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cuda_error("cudaGetDevice", err);
  const int64_t resolved = verify::resolve_variant(variant, rows, device);
  if (resolved < 0) {
    return ffi::Error::InvalidArgument("verify_attention (CUDA): variant " + std::to_string(variant) +
                                       " cannot run " + std::to_string(rows) + " query rows on this device");
  }

  verify::Params p{};
  p.q = static_cast<const uint16_t*>(q.untyped_data());
  p.kv_pool = static_cast<const uint16_t*>(kv_pool.untyped_data());
  p.layer = layer.typed_data();
  p.kv_slots = kv_slots.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.tree_mask = tree_mask.typed_data();
  p.out = static_cast<uint16_t*>(out->untyped_data());
  p.lse = lse->typed_data();
  p.out_part = out_part->typed_data();
  p.lse_part = lse_part->typed_data();
  p.num_queries = static_cast<int>(num_queries);
  p.num_heads = static_cast<int>(num_heads);
  p.rows = static_cast<int>(rows);
  p.mask_words = static_cast<int>(tree_mask.dimensions()[2]);
  p.max_len = static_cast<int>(max_len);
  p.num_layers = static_cast<int>(pd[0]);
  p.num_slots = pd[1];
  p.num_splits = static_cast<int>(num_splits);
  p.split_parts = static_cast<int>(split_parts);
  p.scale_log2 = softmax_scale * verify::kLog2e;
  if (rows == 0 || batch == 0) return ffi::Error::Success();

  if (cudaError_t err = verify::launch_verify(p, batch, resolved, device, stream); err != cudaSuccess) {
    return cuda_error("kernel launch", err);
  }
  return ffi::Error::Success();
}

}  // namespace

int cuda_sm_count(int device) {
  if (device < 0 || device >= kMaxDevices) return -1;
  std::call_once(sm_once[device], [device] {
    int count = -1;
    int num_devices = 0;
    if (cudaGetDeviceCount(&num_devices) != cudaSuccess || device >= num_devices ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      count = -1;
      cudaGetLastError();  // clear the error so later calls start clean
    }
    sm_counts[device] = count;
  });
  return sm_counts[device];
}

int cuda_resolve_variant(int64_t variant, int64_t rows, int device) {
  return static_cast<int>(verify::resolve_variant(variant, rows, device));
}

}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(kdtree_verify_attention_cuda, kdtree::VerifyAttentionCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv_pool
                                  .Arg<kdtree::Scalar32>()
                                  .Arg<kdtree::Slots>()
                                  .Arg<kdtree::Lens>()
                                  .Arg<kdtree::Mask>()
                                  .Attr<float>("softmax_scale")
                                  .Attr<int64_t>("rope_dim")
                                  .Attr<int64_t>("num_splits")
                                  .Attr<int64_t>("split_parts")
                                  .Attr<int64_t>("variant")
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<kdtree::Lse>()
                                  .Ret<kdtree::OutPart>()
                                  .Ret<kdtree::LsePart>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
