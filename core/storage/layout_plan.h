// LayoutPlan: where every parameter lives in the flat buffers, and which slice of each
// buffer a rank owns (DESIGN.md, "Storage layout"). Pure arithmetic, 64-bit throughout.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/common/dtype.h"
#include "core/common/status.h"

namespace hps {

// The longest parameter name, in bytes: a checkpoint's manifest and a safetensors file name
// the parameter (prefixed in the manifest: see core/checkpoint/checkpointable.h), and their
// readers refuse longer names.
inline constexpr size_t kMaxParamNameBytes = 4096;

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  bool trainable = true;
  bool is_distributed = false;
  bool need_clip = true;
  bool shared_not_first = false;
  bool weight_decay = true;  // false: the optimizer's weight decay skips it
  int32_t unit = 0;          // the layer gathered and released together
  uint64_t numel() const;
};

// One flat buffer (a bucket): parameters of one (trainability, dtype, unit), each starting
// on an alignment boundary, padded to a multiple of alignment × degree and cut into
// `degree` equal shards. A unit whose parameters exceed the bucket size cap is split into
// several buckets, in registration order, so its gradients are reduced in several
// collectives that can overlap its backward.
struct FlatBuffer {
  DType dtype;
  int32_t unit;
  bool trainable;
  uint64_t numel = 0;        // padded length, elements
  uint64_t shard_numel = 0;  // numel / degree
  std::vector<size_t> params;
  int32_t bucket = 0;  // which bucket of its (trainability, dtype, unit)
};

struct Placement {
  size_t buffer = 0;
  uint64_t offset = 0;  // first element within the buffer
  uint64_t numel = 0;
};

// A run of a rank's shard of one buffer whose elements are treated alike by the clip and
// the optimizer: `partial` says which sum of squares they count in (kClipPartialD for
// is_distributed parameters, kClipPartialN for the others, -1 for need_clip = false and
// shared_not_first copies), `clipped` whether the clip coefficient scales them (need_clip),
// `decayed` whether the optimizer's weight decay applies (ParamSpec::weight_decay).
struct ShardSpan {
  uint64_t begin = 0;  // elements, within the shard
  uint64_t end = 0;
  int partial = -1;
  bool clipped = false;
  bool decayed = true;
};

// Alignments accepted by seal(): powers of two up to this many bytes.
inline constexpr uint64_t kMaxAlignmentBytes = uint64_t{1} << 21;

class LayoutPlan {
 public:
  Status add(ParamSpec spec);
  // Lays the parameters out for `degree` shards; `bucket_bytes` > 0 caps a flat buffer's
  // size (a parameter larger than the cap gets a bucket of its own). After this, add()
  // fails.
  Status seal(int32_t degree, uint64_t alignment_bytes = 256, uint64_t bucket_bytes = 0);
  bool sealed() const { return sealed_; }

  int32_t degree() const { return degree_; }
  uint64_t alignment_bytes() const { return alignment_bytes_; }
  const std::vector<ParamSpec>& params() const { return params_; }
  const std::vector<FlatBuffer>& buffers() const { return buffers_; }
  const Placement& placement(size_t param) const { return placements_[param]; }
  // Element range [begin, end) of buffer `b` that `rank` owns.
  std::pair<uint64_t, uint64_t> shard(size_t b, int32_t rank) const;
  // The part of `param` inside `rank`'s shard, as [begin, end) within the parameter
  // (empty when begin == end).
  std::pair<uint64_t, uint64_t> local_part(size_t param, int32_t rank) const;
  // `rank`'s shard of buffer `b` cut into runs of equal clip and weight-decay treatment,
  // covering the whole shard (padding joins a neighbour). With `clip` false, no span is
  // counted or scaled (runs differ only in weight decay).
  std::vector<ShardSpan> shard_spans(size_t b, int32_t rank, bool clip) const;
  // Identifies names, shapes, dtypes, flags and units: equal on every rank or the ranks
  // registered different models.
  uint64_t fingerprint() const;

 private:
  std::vector<ParamSpec> params_;
  std::vector<FlatBuffer> buffers_;
  std::vector<Placement> placements_;
  int32_t degree_ = 1;
  uint64_t alignment_bytes_ = 256;
  bool sealed_ = false;
};

}  // namespace hps
