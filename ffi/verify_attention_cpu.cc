// CPU handler of the verify-attention op: plain loops, float32 accumulation, float32 or bfloat16 inputs,
// any latent/rope split.  It is the executable spec the CUDA kernel is compared with on machines without
// a GPU, so it is written for clarity, not speed (tests use short sequences).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "verify_attention.h"

namespace ffi = xla::ffi;

namespace {

float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

uint16_t float_to_bf16(float value) {  // round to nearest even, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// Reads element `index` of a float32 or bfloat16 buffer as float.
float load_as_float(const void* data, ffi::DataType dtype, int64_t index) {
  if (dtype == ffi::DataType::F32) return static_cast<const float*>(data)[index];
  return bf16_to_float(static_cast<const uint16_t*>(data)[index]);
}

void store_from_float(void* data, ffi::DataType dtype, int64_t index, float value) {
  if (dtype == ffi::DataType::F32) {
    static_cast<float*>(data)[index] = value;
  } else {
    static_cast<uint16_t*>(data)[index] = float_to_bf16(value);
  }
}

bool supported(ffi::DataType dtype) { return dtype == ffi::DataType::F32 || dtype == ffi::DataType::BF16; }

ffi::Error VerifyAttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer kv_pool, ffi::Buffer<ffi::S32, 0> layer,
                              ffi::Buffer<ffi::S32, 2> kv_slots, ffi::Buffer<ffi::S32, 1> kv_lens,
                              ffi::Buffer<ffi::U32, 3> tree_mask, float softmax_scale, int64_t rope_dim,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32, 3>> lse) {
  // Shapes were validated in Python; re-check what an out-of-bounds access would depend on.
  const auto qd = q.dimensions();
  const auto pd = kv_pool.dimensions();
  if (qd.size() != 4 || pd.size() != 3 || qd[3] != pd[2]) {
    return ffi::Error::InvalidArgument("verify_attention: q must be [B,T,H,D] and kv_pool [NL,S,D]");
  }
  if (!supported(q.element_type()) || !supported(kv_pool.element_type()) ||
      out->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("verify_attention (CPU): q/kv_pool/out must be float32 or bfloat16");
  }
  const int64_t batch = qd[0], num_queries = qd[1], num_heads = qd[2], width = qd[3];
  const int64_t latent = width - rope_dim;
  const int64_t num_layers = pd[0], num_slots = pd[1];
  const int64_t max_len = kv_slots.dimensions()[1];
  const int64_t words = tree_mask.dimensions()[2];
  if (latent <= 0 || rope_dim < 0 || kv_slots.dimensions()[0] != batch || num_slots <= 0 || num_layers <= 0 ||
      words * 32 < num_queries) {
    return ffi::Error::InvalidArgument("verify_attention (CPU): inconsistent shapes");
  }

  const int64_t layer_index = kdtree::clamp_layer(layer.typed_data()[0], num_layers);
  const void* q_data = q.untyped_data();
  const void* kv_data = kv_pool.untyped_data();
  const auto q_type = q.element_type(), kv_type = kv_pool.element_type();
  const int64_t layer_offset = layer_index * num_slots * width;

  std::vector<float> keys;           // this sequence's latent rows, [Lmax, width] float32
  std::vector<float> scores(max_len);
  std::vector<float> query(width);
  std::vector<double> acc(latent);   // one output row; double costs nothing here and keeps the sum exact

  for (int64_t b = 0; b < batch; ++b) {
    const int64_t kv_len = kv_lens.typed_data()[b];
    const int64_t valid = std::clamp<int64_t>(kv_len, 0, max_len);
    const int64_t first = kv_len - num_queries;
    keys.assign(valid * width, 0.0f);
    for (int64_t p = 0; p < valid; ++p) {
      const int64_t slot = std::clamp<int64_t>(kv_slots.typed_data()[b * max_len + p], 0, num_slots - 1);
      for (int64_t d = 0; d < width; ++d) keys[p * width + d] = load_as_float(kv_data, kv_type, layer_offset + slot * width + d);
    }
    for (int64_t t = 0; t < num_queries; ++t) {
      const uint32_t* mask_row = tree_mask.typed_data() + (b * num_queries + t) * words;
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t row = (b * num_queries + t) * num_heads + h;
        for (int64_t d = 0; d < width; ++d) query[d] = load_as_float(q_data, q_type, row * width + d);

        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < valid; ++p) {
          if (!kdtree::position_visible(p, first, num_queries, mask_row)) {
            scores[p] = -std::numeric_limits<float>::infinity();
            continue;
          }
          float dot = 0.0f;
          for (int64_t d = 0; d < width; ++d) dot += query[d] * keys[p * width + d];
          scores[p] = dot * softmax_scale;
          max_score = std::max(max_score, scores[p]);
        }

        std::fill(acc.begin(), acc.end(), 0.0);
        double denom = 0.0;
        if (max_score > -std::numeric_limits<float>::infinity()) {
          for (int64_t p = 0; p < valid; ++p) {
            if (scores[p] == -std::numeric_limits<float>::infinity()) continue;
            const double weight = std::exp(static_cast<double>(scores[p] - max_score));
            denom += weight;
            for (int64_t d = 0; d < latent; ++d) acc[d] += weight * keys[p * width + d];
          }
        }
        for (int64_t d = 0; d < latent; ++d) {
          const float value = denom > 0.0 ? static_cast<float>(acc[d] / denom) : 0.0f;
          store_from_float(out->untyped_data(), q_type, row * latent + d, value);
        }
        lse->typed_data()[row] = denom > 0.0 ? max_score + static_cast<float>(std::log(denom))
                                             : -std::numeric_limits<float>::infinity();
      }
    }
  }
  return ffi::Error::Success();
}

// Aliases: template arguments with commas cannot appear inside the handler macro.
using Scalar32 = ffi::Buffer<ffi::S32, 0>;
using Slots = ffi::Buffer<ffi::S32, 2>;
using Lens = ffi::Buffer<ffi::S32, 1>;
using Mask = ffi::Buffer<ffi::U32, 3>;
using Lse = ffi::Buffer<ffi::F32, 3>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kdtree_verify_attention_cpu, VerifyAttentionCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()                 // q
                                  .Arg<ffi::AnyBuffer>()                 // kv_pool
                                  .Arg<Scalar32>()                     // layer
                                  .Arg<Slots>()                        // kv_slots
                                  .Arg<Lens>()                         // kv_lens
                                  .Arg<Mask>()                         // tree_mask
                                  .Attr<float>("softmax_scale")
                                  .Attr<int64_t>("rope_dim")
                                  .Ret<ffi::AnyBuffer>()                 // out
                                  .Ret<Lse>());                        // lse
