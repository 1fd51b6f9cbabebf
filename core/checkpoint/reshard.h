// The resharding planner: pure functions from what a source stores (SourceIndex) and what
// this rank holds (its state tensors' ranges) to the reads that fill them. Loading is the
// same whatever wrote the source: stage 2 or 3, any sharding and dp degree, any bucket
// layout (ranges are in logical tensors, never in flat buffers), any parameter dtype.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/checkpoint/manifest.h"

namespace hps::ckpt {

// A range this rank holds and wants filled: a StateTensor without its memory.
struct TargetRange {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};
std::vector<TargetRange> target_ranges(const std::vector<StateTensor>& tensors);

enum class SourceNaming {
  // A checkpoint's names: "param/<p>", "master/<p>", optimizer state, step scalars.
  kCheckpoint,
  // A model file's bare parameter names (safetensors): "<p>" fills "param/<p>" and
  // "master/<p>"; other targets must not be asked for.
  kBareParameters,
};

// Part of one stored chunk that fills part of one target.
struct ReadPiece {
  size_t target = 0;   // index into the targets
  size_t tensor = 0;   // index into source.tensors
  size_t chunk = 0;    // index into that tensor's chunks
  uint64_t begin = 0;  // elements of the logical tensor, inside both
  uint64_t end = 0;
};

struct LoadPlan {
  // Per target: the source tensor it is read from (and cast from its dtype), or -1 when it
  // stays unchanged (a partial load).
  std::vector<int64_t> source_of_target;
  std::vector<ReadPiece> pieces;       // ordered by file, then by offset in the file
  std::vector<std::string> unchanged;  // targets the source lacks (partial loads only)
  std::vector<std::string> unused;     // source tensors nothing here reads (partial only)
};

// Which stored tensor fills each target, and the pieces to read:
//  - "param/<p>" of dtype D: the stored "param/<p>" when it is D; else "master/<p>" when
//    stored (fp32 masters kept, rounded once to D); else "param/<p>" cast to D.
//  - "master/<p>": "master/<p>" when stored, else "param/<p>" (an fp32 parameter is its
//    own master; fp16/bf16 ones widen exactly).
//  - anything else: the same name; float dtypes convert, integer ones must match.
// Shapes must match (and integer dtypes), even in a partial load. Without `allow_partial`,
// targets the source lacks and stored tensors nothing reads (beyond the param/master pair
// of a parameter that is loaded) are an error too. One INVALID_ARGUMENT names all of them;
// a partial load lists the missing and extra ones in the plan.
StatusOr<LoadPlan> plan_load(const SourceIndex& source, const std::vector<TargetRange>& targets,
                             SourceNaming naming, bool allow_partial);

// "[7, 13]".
std::string shape_text(const std::vector<int64_t>& shape);

}  // namespace hps::ckpt
