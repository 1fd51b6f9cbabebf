// The state tensors of an engine laid out by a LayoutPlan (core/storage), built from the
// engine's per-buffer shard pointers: the one place that turns flat sharded buffers into
// the named logical tensors of checkpointable.h, shared by every engine.
#pragma once

#include <vector>

#include "core/checkpoint/checkpointable.h"
#include "core/storage/layout_plan.h"

namespace hps {

// Per flat buffer b of the plan, memory holding element 0 of this rank's shard (the
// shard's length is plan.buffers()[b].shard_numel); null where the engine has none.
struct ShardPointers {
  std::vector<void*> params;    // in the buffer's dtype; required for every buffer
  std::vector<float*> masters;  // fp32 masters of trainable fp16/bf16 buffers
  std::vector<float*> state_a;  // momentum (SGD) or exp_avg (AdamW)
  std::vector<float*> state_b;  // exp_avg_sq (AdamW)
  bool adamw = false;           // names state_a "exp_avg/" rather than "momentum/"
};

// The engine's step scalars (StepState), in the state stream's memory.
struct StepScalarPointers {
  float* loss_scale = nullptr;
  int32_t* good_steps = nullptr;
  int64_t* applied_steps = nullptr;
  int64_t* skipped_steps = nullptr;
};

// Every state tensor of `plan` on `shard_rank`, in registration order of the parameters
// (param, master, optimizer state per parameter), then the step scalars. `dp_rank`: this
// rank's coordinate in the replica group above sharding (only dp rank 0 writes).
std::vector<StateTensor> sharded_state_tensors(const LayoutPlan& plan, int32_t shard_rank,
                                               int32_t dp_rank, const ShardPointers& shards,
                                               const StepScalarPointers& step);

}  // namespace hps
