#include "core/checkpoint/engine_state.h"

#include <string>

namespace hps {

std::vector<StateTensor> sharded_state_tensors(const LayoutPlan& plan, int32_t shard_rank,
                                               int32_t dp_rank, const ShardPointers& shards,
                                               const StepScalarPointers& step) {
  std::vector<StateTensor> out;
  const bool writer = dp_rank == 0;
  for (size_t i = 0; i < plan.params().size(); ++i) {
    const ParamSpec& p = plan.params()[i];
    const Placement& pl = plan.placement(i);
    const FlatBuffer& buf = plan.buffers()[pl.buffer];
    // Plain variables, not a structured binding: the lambda below captures them.
    const auto part = plan.local_part(i, shard_rank);
    const uint64_t lo = part.first, hi = part.second;
    // Where this parameter's local part starts within the shard, in elements.
    const uint64_t shard_begin = plan.shard(pl.buffer, shard_rank).first;
    const uint64_t at = lo == hi ? 0 : pl.offset + lo - shard_begin;
    auto add = [&](std::string_view prefix, DType dtype, void* base) {
      if (base == nullptr) return;
      StateTensor t;
      t.name = std::string(prefix) + p.name;
      t.shape = p.shape;
      t.dtype = dtype;
      t.begin = lo;
      t.end = hi;
      t.data = lo == hi ? nullptr : static_cast<uint8_t*>(base) + at * dtype_size(dtype);
      t.writer = writer;
      out.push_back(std::move(t));
    };
    add(kParamPrefix, buf.dtype, shards.params[pl.buffer]);
    if (!buf.trainable) continue;
    add(kMasterPrefix, DType::kFloat32,
        shards.masters.empty() ? nullptr : shards.masters[pl.buffer]);
    add(shards.adamw ? kExpAvgPrefix : kMomentumPrefix, DType::kFloat32,
        shards.state_a.empty() ? nullptr : shards.state_a[pl.buffer]);
    add(kExpAvgSqPrefix, DType::kFloat32,
        shards.state_b.empty() ? nullptr : shards.state_b[pl.buffer]);
  }
  // The step scalars are the same on every rank: the first rank of the engine writes them.
  const bool first = writer && shard_rank == 0;
  auto scalar = [&](std::string_view name, DType dtype, void* data) {
    StateTensor t;
    t.name = std::string(name);
    t.dtype = dtype;
    t.begin = 0;
    t.end = 1;
    t.data = data;
    t.writer = first;
    out.push_back(std::move(t));
  };
  scalar(kStepLossScale, DType::kFloat32, step.loss_scale);
  scalar(kStepGoodSteps, DType::kInt32, step.good_steps);
  scalar(kStepAppliedSteps, DType::kInt64, step.applied_steps);
  scalar(kStepSkippedSteps, DType::kInt64, step.skipped_steps);
  return out;
}

}  // namespace hps
