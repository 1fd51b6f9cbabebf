// Checkpointable: the narrow interface between an engine and checkpoints. An engine that
// implements it can be saved (asynchronously, in stream order), loaded into any topology
// and initialised from a safetensors file by core/checkpoint, which knows nothing else of
// the engine. Everything the checkpoint code needs from an engine is in this file.
//
// The state of an engine is a list of logical tensors, each the whole (unsharded) tensor
// of the model, of which each rank holds a contiguous range of the flattened elements:
//
//   "param/<p>"       parameter p in its model dtype (fp32, fp16 or bf16), frozen ones too
//   "master/<p>"      the fp32 master weights of a trainable fp16/bf16 parameter p
//   "momentum/<p>"    SGD momentum (SGD with momentum != 0)
//   "exp_avg/<p>"     AdamW first moment
//   "exp_avg_sq/<p>"  AdamW second moment
//   "step/loss_scale"    float32 scalar: the dynamic loss scale (1 without loss scaling)
//   "step/good_steps"    int32 scalar: finite steps since the scale last changed
//   "step/applied_steps" int64 scalar: steps applied (AdamW's bias-correction step count)
//   "step/skipped_steps" int64 scalar: steps skipped for non-finite gradients
//
// Scalars have shape {} (one element). A rank lists every tensor of the model, with an
// empty range when it holds no part of it, so every rank sees the same names and shapes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/common/dtype.h"
#include "core/common/status.h"
#include "core/device/stream.h"
#include "core/storage/layout_plan.h"

namespace hps {

class Communicator;

struct EngineOptions;

inline constexpr std::string_view kParamPrefix = "param/";
inline constexpr std::string_view kMasterPrefix = "master/";
inline constexpr std::string_view kMomentumPrefix = "momentum/";
inline constexpr std::string_view kExpAvgPrefix = "exp_avg/";
inline constexpr std::string_view kExpAvgSqPrefix = "exp_avg_sq/";
inline constexpr std::string_view kStepLossScale = "step/loss_scale";
inline constexpr std::string_view kStepGoodSteps = "step/good_steps";
inline constexpr std::string_view kStepAppliedSteps = "step/applied_steps";
inline constexpr std::string_view kStepSkippedSteps = "step/skipped_steps";
// Whether a state tensor's name has one of the prefixes above.
inline bool starts_with(std::string_view name, std::string_view prefix) {
  return name.substr(0, prefix.size()) == prefix;
}
// The longest name above: a parameter's longest name after the longest prefix.
inline constexpr size_t kMaxStateNameBytes = kMaxParamNameBytes + kExpAvgSqPrefix.size();

// This rank's part of one logical tensor.
struct StateTensor {
  std::string name;            // as listed above
  std::vector<int64_t> shape;  // of the whole logical tensor; {} for a scalar
  DType dtype = DType::kFloat32;
  // Elements [begin, end) of the flattened logical tensor that this rank holds (row-major);
  // begin == end when it holds none.
  uint64_t begin = 0;
  uint64_t end = 0;
  // Contiguous memory holding exactly those elements, in `dtype`, on the engine's device
  // (state_stream().device()). Valid as long as the engine lives; the checkpoint code only
  // reads it or writes it through copies enqueued on state_stream().
  void* data = nullptr;
  // Whether this rank writes its range into checkpoints. Exactly one rank is the writer of
  // each element: replicas (dp ranks other than 0; for the step scalars every rank but the
  // first) hold the same values and write nothing. Loading ignores it: every rank reads
  // what it holds.
  bool writer = false;
};

// Where an engine's state came from, recorded in the manifest (informational: loading
// depends only on the tensors, so any topology loads any checkpoint).
struct CheckpointTopology {
  int32_t stage = 0;
  int32_t sharding = 1;  // sharding degree and this rank's coordinate
  int32_t sharding_rank = 0;
  int32_t dp = 1;  // dp degree above sharding and this rank's coordinate
  int32_t dp_rank = 0;
  uint64_t alignment_bytes = 0;  // the flat buffers' parameter alignment
  // The part of a model cut across tensor (mp) and pipeline (pp) parallelism this state
  // is: the degrees and this rank's coordinates (1 and 0 without them). A checkpoint holds
  // one part and loads only into the same part.
  int32_t mp = 1;
  int32_t mp_rank = 0;
  int32_t pp = 1;
  int32_t pp_rank = 0;
};

class Checkpointable {
 public:
  virtual ~Checkpointable() = default;

  // Every state tensor, with this rank's range and memory (see the top of this file).
  // FAILED_PRECONDITION when the engine has no state yet (before seal(); stage 3 before
  // broadcast_parameters()). Cheap: no copy, no wait.
  virtual StatusOr<std::vector<StateTensor>> state_tensors() = 0;

  // The stream after whose current end every state tensor holds its final value for the
  // work enqueued so far (a step's updates, its scale update), and whose later work waits
  // for whatever that stream is made to wait on: a save enqueues its snapshot copies after
  // this point and makes the stream wait for them, so the steps that follow cannot change
  // what is saved; a load enqueues its copies into the state here. Its device is where the
  // StateTensor memory lives.
  virtual Stream& state_stream() = 0;

  virtual CheckpointTopology checkpoint_topology() const = 0;
  // The options the engine was created with (saved so a resumer can recreate it).
  virtual const EngineOptions& checkpoint_options() const = 0;
  // The steps the engine has taken (applied or skipped) since it was created: the ranks of
  // a save compare it, as each saves the state its last step left (a rank that stopped
  // before its step() and one after it would publish a mix of two steps).
  virtual int64_t steps_taken() const = 0;

  // Before a load or an import writes any state: checks that the engine can take new state
  // now and waits (host-blocking) for its work in flight. FAILED_PRECONDITION, changing
  // nothing, between the first grad_ready() of a step and its step(), while a unit is
  // gathered (stage 3), or before the engine has state. Called on every rank.
  virtual Status begin_state_load() = 0;

  // After a load overwrote state tensors (its copies on state_stream() have completed):
  // rebuilds what derives from them (stage 2: the full parameters, all-gathered from the
  // shards; stage 3: drops gathered or prefetched units, refreshes derived shards).
  // Collective over the engine's groups: every rank calls it. Host-blocking.
  virtual Status end_state_load() = 0;

  // After end_state_load(), when the checkpoint was saved by an engine without dynamic
  // loss scaling: an engine with it starts its scaling afresh (its initial scale, no good
  // steps), as a new GradScaler would, rather than at the saved scale of 1. Host-blocking.
  virtual Status restart_loss_scaling() { return Status::Ok(); }
  // The groups joining this state's part of a model to the other parts (mp and pp, of
  // more than one rank); empty for a whole model. A load agrees over them, so that every
  // part loads the same checkpoint or none does.
  virtual std::vector<Communicator*> model_parallel_groups() const { return {}; }
};

}  // namespace hps
