// CPU handler of the verify-attention op (contract: DESIGN.md, "The kernel contract"; oracle:
// kdtree_jax/ops/reference.py): float32 or bfloat16 q / kv_pool / out, any latent/rope split, float32
// accumulation. `impl="auto"` runs it on every CPU, so speculative decoding on a CPU is only worth doing
// if this is at least as fast as XLA's own version of the reference.
//
// Per sequence the op is two small matrix products: scores = Q·Kᵀ over all D = Dc + Dr dims and
// out = softmax(scores)·V over the Dc latent dims (V = the first Dc dims of the same rows), with R = T·H
// query rows against the sequence's L rows. Its speed is how busy the inner loops keep the FMA units,
// hence this structure:
//   * Work items are (sequence, chunk of up to kChunkRows query rows), and when a one-token call would
//     give too few items to keep the threads busy (decode: B · ceil(H / kChunkRows) < kSplitItems), also
//     a split of the positions, merged afterwards by LSE. XLA's intra-op thread pool runs them and the
//     calling thread takes items too, so nothing waits on a pool that is busy elsewhere. The cut depends
//     on static shapes only and each row's arithmetic is the same whichever thread runs it: results are
//     bit-identical from call to call.
//   * A row's arithmetic does not depend on T or the table width either (issue 24: a verify pass's root
//     row equals the one-token call at its position, bit for bit): the split count comes from B and H,
//     the splits cut the root row's positions [0, kv_len - T + 1) in whole blocks (the last one also takes
//     the query tokens after the root, which add exact zeros to the root row), blocks start at position
//     0 in every call, the merge adds the used splits in order, and query rows are vector lanes that
//     never mix.
//   * A chunk walks its sequence in blocks of kBlock positions with an online (flash-attention) softmax.
//     Each block's rows are gathered from the pool and widened to float32 once for all rows of the
//     chunk, so scratch is a few hundred KB per thread whatever L is. Masked positions take part with
//     probability 0 (as in the reference, a NaN in such a row would still reach the output).
//   * The chunk's query rows are stored transposed (row index fastest): one vector holds one dimension
//     of several query rows, scores come out as [position][row-vector], and the mask and the softmax are
//     lane-wise vector operations with no horizontal sums.
//   * Both products are register-tiled (kPosTile positions × kRowVecs row vectors for the scores,
//     kPvRows rows × kPvVecs column vectors for P·V) so one load feeds several FMAs. They are written
//     with GCC/Clang vector extensions because auto-vectorisers do not reliably keep a loop nest's
//     accumulator tile in registers.
//   * The same template is compiled for AVX-512, AVX2+FMA and the baseline ISA (SSE2 / NEON), each with
//     tiles sized for its register file; on x86 the best variant the CPU runs is found once at run time
//     from the CPU's features (no -march flag: the wheel runs on any x86-64 or arm64 machine), and the
//     `isa` attribute may name a lower one (tests and benchmarks only).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "verify_attention.h"

namespace ffi = xla::ffi;

#if defined(__GNUC__) || defined(__clang__)
// The kernels must be inlined into the per-ISA entry points below to be compiled for that ISA.
#define KDTREE_INLINE inline __attribute__((always_inline))
#else
#define KDTREE_INLINE inline
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

float load_as_float(const void* data, ffi::DataType dtype, int64_t index) {
  if (dtype == ffi::DataType::F32) return static_cast<const float*>(data)[index];
  return bf16_to_float(static_cast<const uint16_t*>(data)[index]);
}

bool supported(ffi::DataType dtype) { return dtype == ffi::DataType::F32 || dtype == ffi::DataType::BF16; }

// Widens `count` contiguous float32 or bfloat16 values to float32 (loops simple enough to vectorise).
KDTREE_INLINE void widen_row(const void* src, ffi::DataType dtype, int64_t count, float* dst) {
  if (dtype == ffi::DataType::F32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  const uint16_t* bits = static_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < count; ++d) {
    const uint32_t widened = static_cast<uint32_t>(bits[d]) << 16;
    std::memcpy(dst + d, &widened, sizeof(float));
  }
}

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// One call's inputs and how its work is cut, read-only for every worker (except the output buffers).
struct Problem {
  const void* q;
  ffi::DataType q_type;
  const void* kv_layer;  // row 0 of the chosen layer
  ffi::DataType kv_type;
  const int32_t* slots;
  const int32_t* lens;
  const uint32_t* mask;
  void* out;
  float* lse;
  int64_t batch, num_queries, num_heads, width, latent, num_slots, max_len, words;
  int64_t rows;  // T·H query rows per sequence; row r is query token r / H, head r % H
  float scale;
  // Work items: (sequence, chunk of rows, split of the positions), numbered in that order.
  int64_t chunks;  // row chunks per sequence
  int64_t block;   // positions a block (the kernel's kBlock)
  int64_t blocks;  // position blocks of the table (ceil(Lmax / kBlock))
  int64_t parts;   // the partition's split count (from B and H: split_range)
  int64_t splits;  // work items a (sequence, chunk): at least the splits any sequence uses
  // With more than one split, each item leaves its rows' unnormalised state here ([B·rows, splits] rows of
  // `latent` values, and max / sum each) and merge_splits writes the output.
  float* part_o;
  float* part_max;
  float* part_sum;
};

// The partition of sequence b's positions (see the top of the file): the root row (query token 0) sees
// [0, root_len), root_len = kv_len - T + 1; its blocks are cut into runs of at least kMinSplitBlocks blocks,
// at most pb.parts of them, and the run holding the root's last block also takes the blocks after it.
// Returns the splits used; split < used covers positions [begin, end).
constexpr int64_t kSplitItems = 8, kMinSplitBlocks = 4;

int64_t split_range(const Problem& pb, int64_t b, int64_t split, int64_t* begin, int64_t* end) {
  const int64_t kv_len = pb.lens[b];
  const int64_t valid = std::clamp<int64_t>(kv_len, 0, pb.max_len);
  const int64_t all_blocks = (valid + pb.block - 1) / pb.block;
  const int64_t root_len = std::clamp<int64_t>(kv_len - pb.num_queries + 1, 0, valid);
  const int64_t root_blocks = std::max((root_len + pb.block - 1) / pb.block, std::min<int64_t>(all_blocks, 1));
  int64_t per = std::max(kMinSplitBlocks, (root_blocks + pb.parts - 1) / pb.parts);
  int64_t used = (root_blocks + per - 1) / per;
  if (used > pb.splits) {  // never: pb.splits covers every length the table holds
    per = (root_blocks + pb.splits - 1) / pb.splits;
    used = (root_blocks + per - 1) / per;
  }
  if (begin != nullptr) {
    *begin = std::min(split * per, all_blocks) * pb.block;
    *end = split >= used ? *begin : (split == used - 1 ? valid : std::min(valid, (split + 1) * per * pb.block));
  }
  return used;
}

// Writes one output row, `values` times `factor`, in the output's dtype.
void write_output_row(const Problem& pb, int64_t row, const float* values, float factor) {
  if (pb.q_type == ffi::DataType::F32) {
    float* dst = static_cast<float*>(pb.out) + row * pb.latent;
    for (int64_t c = 0; c < pb.latent; ++c) dst[c] = values[c] * factor;
  } else {
    uint16_t* dst = static_cast<uint16_t*>(pb.out) + row * pb.latent;
    for (int64_t c = 0; c < pb.latent; ++c) dst[c] = float_to_bf16(values[c] * factor);
  }
}

// Combines the splits of every row in a fixed order (the LSE merge of split-KV attention).
void merge_splits(const Problem& pb) {
  std::vector<float> acc(pb.latent), weight(pb.splits);
  for (int64_t row = 0; row < pb.batch * pb.rows; ++row) {
    const int64_t used = split_range(pb, row / pb.rows, 0, nullptr, nullptr);  // splits past it hold nothing
    const float* row_max = pb.part_max + row * pb.splits;
    const float* row_sum = pb.part_sum + row * pb.splits;
    const float top = used > 0 ? *std::max_element(row_max, row_max + used) : kNegInf;
    if (top == kNegInf) {  // nothing visible in any split
      std::fill(acc.begin(), acc.end(), 0.0f);
      write_output_row(pb, row, acc.data(), 0.0f);
      pb.lse[row] = kNegInf;
      continue;
    }
    float total = 0.0f;
    for (int64_t sp = 0; sp < used; ++sp) {
      weight[sp] = std::exp(row_max[sp] - top);  // 0 for a split that saw nothing
      total += weight[sp] * row_sum[sp];
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t sp = 0; sp < used; ++sp) {
      const float* o = pb.part_o + (row * pb.splits + sp) * pb.latent;
      for (int64_t c = 0; c < pb.latent; ++c) acc[c] += weight[sp] * o[c];
    }
    write_output_row(pb, row, acc.data(), 1.0f / total);
    pb.lse[row] = top + std::log(total);
  }
}

// Items 0..n-1 handed out in order to whoever asks; `wait_all` returns once every item is finished.
// Lives in a shared_ptr: a pool task that starts after the call returned finds nothing left to claim
// and only touches this object.
class WorkQueue {
 public:
  explicit WorkQueue(int64_t items) : items_(items) {}
  int64_t claim() {
    const int64_t item = next_.fetch_add(1, std::memory_order_relaxed);
    return item < items_ ? item : -1;
  }
  void finish() {
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == items_) {
      std::lock_guard<std::mutex> lock(mutex_);
      all_done_.notify_all();
    }
  }
  void wait_all() {
    std::unique_lock<std::mutex> lock(mutex_);
    all_done_.wait(lock, [this] { return done_.load(std::memory_order_acquire) == items_; });
  }

 private:
  const int64_t items_;
  std::atomic<int64_t> next_{0}, done_{0};
  std::mutex mutex_;
  std::condition_variable all_done_;
};

// Vector helpers over GCC/Clang vector-extension types: V holds floats, I int32 of the same lane count.
template <class V>
constexpr int lanes_of() { return static_cast<int>(sizeof(V) / sizeof(float)); }

template <class V>
KDTREE_INLINE V load(const float* p) {  // unaligned
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <class V>
KDTREE_INLINE void store(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

// A constant in every lane (x − 0 is x for every x, −0 included, so this folds to a vector constant).
// Lanes of run-time values are broadcast by writing `scalar * vector` in place instead: the kernels are
// compiled for the baseline ISA before being inlined into the AVX-512 entry point, and GCC 12 turns a
// run-time splat made there into one masked insert per lane.
template <class V>
KDTREE_INLINE V splat(float x) {
  return x - V{};
}

template <class V, class I>
KDTREE_INLINE V select(I take_a, V a, V b) {  // lane-wise take_a ? a : b (take_a lanes are 0 or -1)
  return (V)(((I)a & take_a) | ((I)b & ~take_a));
}

template <class V, class I>
KDTREE_INLINE V vmax(V a, V b) { return select<V, I>(a > b, a, b); }

// e^x lane-wise, within about 1 ulp (Cephes' expf: x = k·ln2 + f with |f| <= ln2/2, e^f by a polynomial, 2^k
// written into the exponent bits). Exactly 0 below -87, so e^-inf = 0: masked scores rely on it.
template <class V, class I>
KDTREE_INLINE V vexp(V x) {
  const I underflow = x < splat<V>(-87.0f);
  x = select<V, I>(x > splat<V>(88.0f), splat<V>(88.0f), x);
  x = select<V, I>(underflow, splat<V>(0.0f), x);  // keeps k below in range; the lane becomes 0 at the end
  // Adding 1.5·2^23 rounds x·log2(e) to an integer k that then sits in the low mantissa bits.
  const V magic = splat<V>(12582912.0f);
  const V shifted = x * splat<V>(1.44269504088896341f) + magic;
  const V k = shifted - magic;
  const I k_int = (I)shifted - (I)magic;
  V f = x - k * splat<V>(0.693359375f);
  f = f - k * splat<V>(-2.12194440e-4f);
  V poly = splat<V>(1.9875691500e-4f);
  poly = poly * f + splat<V>(1.3981999507e-3f);
  poly = poly * f + splat<V>(8.3334519073e-3f);
  poly = poly * f + splat<V>(4.1665795894e-2f);
  poly = poly * f + splat<V>(1.6666665459e-1f);
  poly = poly * f + splat<V>(5.0000001201e-1f);
  const V e_f = poly * (f * f) + f + splat<V>(1.0f);
  const V two_k = (V)((k_int + 127) << 23);
  return select<V, I>(underflow, splat<V>(0.0f), e_f * two_k);
}

// Per-worker buffers, sized once per call: about 0.4 MB at K2 widths plus T·kChunkRows mask floats, whatever L.
struct Scratch {
  std::vector<float> qt;    // [width][kChunkRows]  the chunk's query rows, transposed; missing rows 0
  std::vector<float> bias;  // [T][kChunkRows]  0 where query token j is visible to the row, else -inf
  std::vector<float> kv;    // [kBlock][kv_stride]  the block's pool rows as float32; padding 0
  std::vector<float> p;     // [kBlock][kChunkRows]  scores, then probabilities
  std::vector<float> o;     // [kChunkRows][o_stride]  unnormalised output rows
  std::vector<float> m, l, alpha;  // [kChunkRows]  running max, running sum, this block's rescale
};

// The kernel for one ISA. V/I: float/int32 vector types; tiles as described at the top of the file.
template <class V, class I, int kRowVecs, int kPosTile, int kBlock, int kPvRows, int kPvVecs>
struct Kernel {
  static constexpr int kLanes = lanes_of<V>();
  static constexpr int kChunkRows = kLanes * kRowVecs;
  static constexpr int kPvCols = kLanes * kPvVecs;
  static_assert(kBlock % kPosTile == 0 && kChunkRows % kPvRows == 0, "tiles must divide blocks");
  static constexpr int64_t block() { return kBlock; }

  // The output is computed in whole kPvCols-wide column tiles, reading V past Dc (rope dims, then zero
  // padding) for columns that are never stored.
  static int64_t o_stride(const Problem& pb) { return round_up(pb.latent, kPvCols); }
  static int64_t kv_stride(const Problem& pb) { return std::max(round_up(pb.width, kLanes), o_stride(pb)); }

  static KDTREE_INLINE void size(const Problem& pb, Scratch& s) {
    s.qt.assign(pb.width * kChunkRows, 0.0f);
    s.bias.assign(pb.num_queries * kChunkRows, 0.0f);
    s.kv.assign(kBlock * kv_stride(pb), 0.0f);
    s.p.assign(kBlock * kChunkRows, 0.0f);
    s.o.assign(kChunkRows * o_stride(pb), 0.0f);
    s.m.assign(kChunkRows, 0.0f);
    s.l.assign(kChunkRows, 0.0f);
    s.alpha.assign(kChunkRows, 0.0f);
  }

  // A sequence's rows are cut into chunks_per_sequence() chunks of near-equal size (a score tile costs
  // the same for 4 rows as for kChunkRows, so 36 rows go as 18 + 18, not 32 + 4).
  static int64_t chunks_per_sequence(const Problem& pb) { return (pb.rows + kChunkRows - 1) / kChunkRows; }

  static KDTREE_INLINE void run(const Problem& pb, int64_t item, Scratch& s) {
    const int64_t split = item % pb.splits, chunk = item / pb.splits % pb.chunks;
    const int64_t b = item / pb.splits / pb.chunks;
    const int64_t row0 = chunk * pb.rows / pb.chunks;
    const int64_t num_rows = (chunk + 1) * pb.rows / pb.chunks - row0;
    const int64_t kv_len = pb.lens[b];
    const int64_t valid = std::clamp<int64_t>(kv_len, 0, pb.max_len);
    const int64_t first = kv_len - pb.num_queries;  // position of query token 0 (may be negative)
    const int64_t kvs = kv_stride(pb), os = o_stride(pb);
    int64_t begin = 0, end = 0;
    const int64_t used = split_range(pb, b, split, &begin, &end);
    if (split >= used && pb.splits > 1) return;  // a split this sequence does not use: the merge skips it

    load_queries(pb, b, row0, num_rows, s);
    build_bias(pb, b, row0, num_rows, first, s);
    std::fill(s.o.begin(), s.o.end(), 0.0f);
    std::fill(s.m.begin(), s.m.end(), kNegInf);
    std::fill(s.l.begin(), s.l.end(), 0.0f);

    for (int64_t start = begin; start < end; start += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, end - start);
      const int64_t n_tiles = round_up(n, kPosTile);
      gather_block(pb, b, start, n, n_tiles, s.kv.data(), kvs);
      scores(pb, s.kv.data(), kvs, n_tiles, s);
      apply_mask(start, n_tiles, first, valid, s);
      softmax_update(n_tiles, s);
      accumulate_pv(s.kv.data(), kvs, n, round_up(num_rows, kPvRows), os, s);
    }
    if (pb.splits == 1) {
      write_rows(pb, b, row0, num_rows, os, s);
    } else {
      write_partial(pb, b, row0, num_rows, split, os, s);
    }
  }

  // Once per item (kChunkRows·D values), so a plain scalar transpose.
  static KDTREE_INLINE void load_queries(const Problem& pb, int64_t b, int64_t row0, int64_t num_rows, Scratch& s) {
    for (int64_t i = 0; i < kChunkRows; ++i) {
      const int64_t first_elem = (b * pb.rows + row0 + i) * pb.width;
      for (int64_t d = 0; d < pb.width; ++d) {
        s.qt[d * kChunkRows + i] = i < num_rows ? load_as_float(pb.q, pb.q_type, first_elem + d) : 0.0f;
      }
    }
  }

  static KDTREE_INLINE void build_bias(const Problem& pb, int64_t b, int64_t row0, int64_t num_rows, int64_t first,
                                       Scratch& s) {
    const int64_t T = pb.num_queries;
    for (int64_t i = 0; i < kChunkRows; ++i) {
      const uint32_t* mask_row =
          i < num_rows ? pb.mask + (b * T + (row0 + i) / pb.num_heads) * pb.words : nullptr;
      for (int64_t j = 0; j < T; ++j) {
        const bool visible = mask_row == nullptr || kdtree::position_visible(first + j, first, T, mask_row);
        s.bias[j * kChunkRows + i] = visible ? 0.0f : kNegInf;
      }
    }
  }

  // Rows [n, n_tiles) are zeroed: the score tiles read them (their scores are then masked).
  static KDTREE_INLINE void gather_block(const Problem& pb, int64_t b, int64_t start, int64_t n, int64_t n_tiles,
                                         float* kv, int64_t kvs) {
    const size_t elem = pb.kv_type == ffi::DataType::F32 ? 4 : 2;
    const int32_t* slots = pb.slots + b * pb.max_len + start;
    for (int64_t p = 0; p < n; ++p) {
      const int64_t slot = std::clamp<int64_t>(slots[p], 0, pb.num_slots - 1);
      widen_row(static_cast<const char*>(pb.kv_layer) + slot * pb.width * elem, pb.kv_type, pb.width, kv + p * kvs);
    }
    std::fill(kv + n * kvs, kv + n_tiles * kvs, 0.0f);
  }

  // p[pos][row] = scale · q_row · kv_pos over all `width` dims, kPosTile positions × kRowVecs vectors at a
  // time: per dim, kRowVecs query loads and kPosTile broadcasts feed kPosTile·kRowVecs FMAs.
  static KDTREE_INLINE void scores(const Problem& pb, const float* kv, int64_t kvs, int64_t n_tiles, Scratch& s) {
    const float* qt = s.qt.data();
    for (int64_t p0 = 0; p0 < n_tiles; p0 += kPosTile) {
      V acc[kPosTile][kRowVecs];
      for (int j = 0; j < kPosTile; ++j)
        for (int r = 0; r < kRowVecs; ++r) acc[j][r] = splat<V>(0.0f);
      const float* k = kv + p0 * kvs;
      for (int64_t d = 0; d < pb.width; ++d) {
        V q[kRowVecs];
        for (int r = 0; r < kRowVecs; ++r) q[r] = load<V>(qt + d * kChunkRows + r * kLanes);
#pragma GCC unroll 16
        for (int j = 0; j < kPosTile; ++j)
          for (int r = 0; r < kRowVecs; ++r) acc[j][r] += k[j * kvs + d] * q[r];
      }
      for (int j = 0; j < kPosTile; ++j)
        for (int r = 0; r < kRowVecs; ++r) store(s.p.data() + (p0 + j) * kChunkRows + r * kLanes, pb.scale * acc[j][r]);
    }
  }

  // Prefix positions are visible to every row; query tokens through the rows' mask bits; positions past
  // the valid length (the last tile's padding) to none.
  static KDTREE_INLINE void apply_mask(int64_t start, int64_t n_tiles, int64_t first, int64_t valid, Scratch& s) {
    for (int64_t p = std::max<int64_t>(0, first - start); p < n_tiles; ++p) {
      float* row = s.p.data() + p * kChunkRows;
      const int64_t pos = start + p;
      if (pos >= valid) {
        std::fill(row, row + kChunkRows, kNegInf);
        continue;
      }
      const float* bias = s.bias.data() + (pos - first) * kChunkRows;
      for (int r = 0; r < kRowVecs; ++r) {
        store(row + r * kLanes, load<V>(row + r * kLanes) + load<V>(bias + r * kLanes));
      }
    }
  }

  // Online softmax, lane-wise: new max, rescale factor for what was accumulated, probabilities, sums.
  // A row that has seen nothing yet keeps max -inf; it is shifted by 0 instead so that e^(-inf) = 0 and
  // no -inf - -inf appears.
  static KDTREE_INLINE void softmax_update(int64_t n_tiles, Scratch& s) {
    for (int r = 0; r < kRowVecs; ++r) {
      float* col = s.p.data() + r * kLanes;
      const V m_old = load<V>(s.m.data() + r * kLanes);
      V m_new = m_old;
      for (int64_t p = 0; p < n_tiles; ++p) m_new = vmax<V, I>(m_new, load<V>(col + p * kChunkRows));
      const V shift = select<V, I>(m_new == splat<V>(kNegInf), splat<V>(0.0f), m_new);
      V sum = splat<V>(0.0f);
      for (int64_t p = 0; p < n_tiles; ++p) {
        const V prob = vexp<V, I>(load<V>(col + p * kChunkRows) - shift);
        store(col + p * kChunkRows, prob);
        sum += prob;
      }
      const V alpha = vexp<V, I>(m_old - shift);
      store(s.alpha.data() + r * kLanes, alpha);
      store(s.l.data() + r * kLanes, load<V>(s.l.data() + r * kLanes) * alpha + sum);
      store(s.m.data() + r * kLanes, m_new);
    }
  }

  // o[row] = alpha[row] · o[row] + Σ_pos p[pos][row] · v_pos, in tiles of kPvRows rows × kPvVecs column
  // vectors: per position, kPvVecs loads of v and kPvRows broadcasts feed kPvRows·kPvVecs FMAs. The
  // column tile is the outer loop so its slice of the block stays in L1 across the row tiles.
  static KDTREE_INLINE void accumulate_pv(const float* kv, int64_t kvs, int64_t n, int64_t pv_rows, int64_t os,
                                          Scratch& s) {
    const float* prob = s.p.data();
    for (int64_t c = 0; c < os; c += kPvCols) {
      for (int64_t i0 = 0; i0 < pv_rows; i0 += kPvRows) {
        V acc[kPvRows][kPvVecs];
        for (int i = 0; i < kPvRows; ++i) {
          const float alpha = s.alpha[i0 + i];
          for (int v = 0; v < kPvVecs; ++v) acc[i][v] = alpha * load<V>(s.o.data() + (i0 + i) * os + c + v * kLanes);
        }
        for (int64_t p = 0; p < n; ++p) {
          V val[kPvVecs];
          for (int v = 0; v < kPvVecs; ++v) val[v] = load<V>(kv + p * kvs + c + v * kLanes);
#pragma GCC unroll 16
          for (int i = 0; i < kPvRows; ++i) {
            const float w = prob[p * kChunkRows + i0 + i];
            for (int v = 0; v < kPvVecs; ++v) acc[i][v] += w * val[v];
          }
        }
        for (int i = 0; i < kPvRows; ++i)
          for (int v = 0; v < kPvVecs; ++v) store(s.o.data() + (i0 + i) * os + c + v * kLanes, acc[i][v]);
      }
    }
  }

  static KDTREE_INLINE void write_rows(const Problem& pb, int64_t b, int64_t row0, int64_t num_rows, int64_t os,
                                       Scratch& s) {
    for (int64_t i = 0; i < num_rows; ++i) {
      const int64_t row = b * pb.rows + row0 + i;
      const float sum = s.l[i];  // > 0 iff the row saw something
      write_output_row(pb, row, s.o.data() + i * os, sum > 0.0f ? 1.0f / sum : 0.0f);
      pb.lse[row] = sum > 0.0f ? s.m[i] + std::log(sum) : kNegInf;
    }
  }

  static KDTREE_INLINE void write_partial(const Problem& pb, int64_t b, int64_t row0, int64_t num_rows, int64_t split,
                                          int64_t os, Scratch& s) {
    for (int64_t i = 0; i < num_rows; ++i) {
      const int64_t slot = (b * pb.rows + row0 + i) * pb.splits + split;
      std::copy(s.o.data() + i * os, s.o.data() + i * os + pb.latent, pb.part_o + slot * pb.latent);
      pb.part_max[slot] = s.m[i];
      pb.part_sum[slot] = s.l[i];
    }
  }

  // A worker: takes items until none is left. Scratch is allocated only once an item is claimed.
  static KDTREE_INLINE void drain(const Problem& pb, WorkQueue& queue) {
    int64_t item = queue.claim();
    if (item < 0) return;
    Scratch s;
    size(pb, s);
    do {
      run(pb, item, s);
      queue.finish();
    } while ((item = queue.claim()) >= 0);
  }
};

typedef float F32x4 __attribute__((vector_size(16)));
typedef int32_t I32x4 __attribute__((vector_size(16)));
// Baseline (SSE2: 16 registers; NEON: 32): 8-row chunks, 4×2 score and P·V tiles.
using BaselineKernel = Kernel<F32x4, I32x4, 2, 4, 64, 4, 2>;

struct Variant {
  int64_t (*chunks_per_sequence)(const Problem&);
  int64_t block;  // kBlock
  int64_t chunk_rows;  // kChunkRows
  void (*drain)(const Problem&, WorkQueue&);
};

void drain_baseline(const Problem& pb, WorkQueue& queue) { BaselineKernel::drain(pb, queue); }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
typedef float F32x8 __attribute__((vector_size(32)));
typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef float F32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));
// AVX2 (16 ymm): 16-row chunks; scores 6 positions × 2 row vectors (12 accumulators), P·V 4 rows × 2.
using Avx2Kernel = Kernel<F32x8, I32x8, 2, 6, 48, 4, 2>;
// AVX-512 (32 zmm): 32-row chunks; scores 8 positions × 2 row vectors, P·V 4 rows × 4 vectors (16 each).
using Avx512Kernel = Kernel<F32x16, I32x16, 2, 8, 64, 4, 4>;

__attribute__((target("avx2,fma"))) void drain_avx2(const Problem& pb, WorkQueue& queue) {
  Avx2Kernel::drain(pb, queue);
}
__attribute__((target("avx512f,avx2,fma"))) void drain_avx512(const Problem& pb, WorkQueue& queue) {
  Avx512Kernel::drain(pb, queue);
}
#endif

// The variants, by the handler's `isa` attribute (kdtree_jax/ops/ffi.py, CPU_ISAS): 0 = the best the CPU
// runs, 1 = baseline, 2 = AVX2+FMA, 3 = AVX-512. Only tests and benchmarks name one; a variant the CPU cannot
// run is an error, not a fallback. The CPU's features are read once (the first call); each call after that
// is a table lookup.
constexpr int64_t kIsaAuto = 0, kIsaBaseline = 1, kIsaAvx2 = 2, kIsaAvx512 = 3, kNumIsas = 4;

// variants[isa].drain is nullptr where the CPU cannot run it.
struct VariantTable {
  Variant variants[kNumIsas] = {};
};

const VariantTable& variant_table() {
  static const VariantTable table = [] {
    VariantTable t;
    t.variants[kIsaBaseline] = Variant{BaselineKernel::chunks_per_sequence, BaselineKernel::block(),
                                       BaselineKernel::kChunkRows, drain_baseline};
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    const bool fma = __builtin_cpu_supports("fma");
    if (__builtin_cpu_supports("avx2") && fma) {
      t.variants[kIsaAvx2] = Variant{Avx2Kernel::chunks_per_sequence, Avx2Kernel::block(), Avx2Kernel::kChunkRows,
                                     drain_avx2};
    }
    if (__builtin_cpu_supports("avx512f") && fma) {
      t.variants[kIsaAvx512] = Variant{Avx512Kernel::chunks_per_sequence, Avx512Kernel::block(),
                                       Avx512Kernel::kChunkRows, drain_avx512};
    }
#endif
    for (int64_t isa = kNumIsas - 1; isa >= kIsaBaseline; --isa) {  // auto: the best one
      if (t.variants[isa].drain != nullptr) {
        t.variants[kIsaAuto] = t.variants[isa];
        break;
      }
    }
    return t;
  }();
  return table;
}

// The partition's split count: few row chunks in a one-token call (decode: H rows fill one chunk) would
// leave threads idle, so the positions are split too, until a one-token call has about kSplitItems items,
// each split at least kMinSplitBlocks blocks long (its work must outweigh the merge; split_range). From B
// and H only, not T: a verify pass's rows are cut as the one-token call's (issue 24), and not the machine's
// thread count either.
int64_t choose_parts(int64_t batch, int64_t num_heads, int64_t chunk_rows) {
  const int64_t row_items = batch * ((num_heads + chunk_rows - 1) / chunk_rows);
  if (row_items >= kSplitItems) return 1;
  return (kSplitItems + row_items - 1) / row_items;
}

// Runs every item on the calling thread plus up to (pool threads - 1) pool tasks.
void run_items(ffi::ThreadPool& pool, const Problem& pb, const Variant& variant, int64_t items) {
  auto queue = std::make_shared<WorkQueue>(items);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([queue, &pb, drain = variant.drain] { drain(pb, *queue); });
  }
  variant.drain(pb, *queue);
  queue->wait_all();
}

ffi::Error VerifyAttentionCpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv_pool,
                              ffi::Buffer<ffi::S32, 0> layer, ffi::Buffer<ffi::S32, 2> kv_slots,
                              ffi::Buffer<ffi::S32, 1> kv_lens, ffi::Buffer<ffi::U32, 3> tree_mask,
                              float softmax_scale, int64_t rope_dim, int64_t isa, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::F32, 3>> lse) {
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
  if (isa < 0 || isa >= kNumIsas) {
    return ffi::Error::InvalidArgument("verify_attention (CPU): isa must be 0 (auto), 1 (baseline), 2 (avx2) or "
                                       "3 (avx512)");
  }
  const Variant& variant = variant_table().variants[isa];
  if (variant.drain == nullptr) {
    return ffi::Error::InvalidArgument(isa == kIsaAvx2
                                           ? "verify_attention (CPU): isa avx2 requested, but this CPU lacks AVX2+FMA"
                                           : "verify_attention (CPU): isa avx512 requested, but this CPU lacks "
                                             "AVX-512F+FMA");
  }
  Problem pb;
  pb.batch = qd[0];
  pb.num_queries = qd[1];
  pb.num_heads = qd[2];
  pb.width = qd[3];
  pb.latent = pb.width - rope_dim;
  pb.num_slots = pd[1];
  pb.max_len = kv_slots.dimensions()[1];
  pb.words = tree_mask.dimensions()[2];
  const int64_t num_layers = pd[0];
  if (pb.latent <= 0 || rope_dim < 0 || kv_slots.dimensions()[0] != pb.batch || pb.num_slots <= 0 ||
      num_layers <= 0 || pb.words * 32 < pb.num_queries) {
    return ffi::Error::InvalidArgument("verify_attention (CPU): inconsistent shapes");
  }
  pb.rows = pb.num_queries * pb.num_heads;
  pb.scale = softmax_scale;
  pb.q = q.untyped_data();
  pb.q_type = q.element_type();
  pb.kv_type = kv_pool.element_type();
  const int64_t layer_index = kdtree::clamp_layer(layer.typed_data()[0], num_layers);
  const size_t kv_elem = pb.kv_type == ffi::DataType::F32 ? 4 : 2;
  pb.kv_layer = static_cast<const char*>(kv_pool.untyped_data()) + layer_index * pb.num_slots * pb.width * kv_elem;
  pb.slots = kv_slots.typed_data();
  pb.lens = kv_lens.typed_data();
  pb.mask = tree_mask.typed_data();
  pb.out = out->untyped_data();
  pb.lse = lse->typed_data();

  pb.chunks = variant.chunks_per_sequence(pb);
  pb.block = variant.block;
  pb.blocks = (pb.max_len + variant.block - 1) / variant.block;
  pb.parts = choose_parts(pb.batch, pb.num_heads, variant.chunk_rows);
  // Splits of at least kMinSplitBlocks blocks: a table of Lmax positions never uses more than this many.
  pb.splits = std::max<int64_t>(1, std::min(pb.parts, (pb.blocks + kMinSplitBlocks - 1) / kMinSplitBlocks));
  std::vector<float> part_o, part_max, part_sum;
  if (pb.splits > 1) {  // B < kSplitItems and splits <= kSplitItems: B·T·H·splits rows of Dc floats
    const int64_t partial_rows = pb.batch * pb.rows * pb.splits;
    part_o.resize(partial_rows * pb.latent);
    part_max.resize(partial_rows);
    part_sum.resize(partial_rows);
  }
  pb.part_o = part_o.data();
  pb.part_max = part_max.data();
  pb.part_sum = part_sum.data();

  const int64_t items = pb.batch * pb.chunks * pb.splits;
  if (items > 0) run_items(pool, pb, variant, items);
  if (items > 0 && pb.splits > 1) merge_splits(pb);
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
                                  .Ctx<ffi::ThreadPool>()                // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()                 // q
                                  .Arg<ffi::AnyBuffer>()                 // kv_pool
                                  .Arg<Scalar32>()                     // layer
                                  .Arg<Slots>()                        // kv_slots
                                  .Arg<Lens>()                         // kv_lens
                                  .Arg<Mask>()                         // tree_mask
                                  .Attr<float>("softmax_scale")
                                  .Attr<int64_t>("rope_dim")
                                  .Attr<int64_t>("isa")  // 0 auto, 1 baseline, 2 avx2, 3 avx512
                                  .Ret<ffi::AnyBuffer>()                 // out
                                  .Ret<Lse>());                        // lse
