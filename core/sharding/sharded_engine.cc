#include "core/sharding/sharded_engine.h"

#include "core/sharding/stage2_engine.h"
#include "core/sharding/stage3_engine.h"

namespace hps {

Status check_engine_arguments(const std::shared_ptr<Communicator>& sharding,
                              const std::shared_ptr<Communicator>& dp,
                              const EngineOptions& options) {
  if (!sharding) return invalid_argument("engine: the sharding communicator is null");
  for (const auto* c : {&sharding, &dp}) {
    if (*c && (*c)->device().type != DeviceType::kCpu) {
      return unimplemented("engine: this version shards over CPU communicators only");
    }
  }
  if (options.accumulation_steps < 1) {
    return invalid_argument("engine: accumulation_steps must be >= 1");
  }
  if (!(options.clip_max_norm >= 0)) return invalid_argument("engine: clip_max_norm must be >= 0");
  if (options.optimizer != OptimizerKind::kSgd && options.optimizer != OptimizerKind::kAdamW) {
    return invalid_argument("engine: unknown optimizer");
  }
  if (options.prefetch_window < 1) return invalid_argument("engine: prefetch_window must be >= 1");
  return Status::Ok();
}

Status check_same_model(Communicator& comm, const LayoutPlan& plan) {
  if (comm.size() == 1) return Status::Ok();
  const uint64_t mine = plan.fingerprint();
  std::vector<uint64_t> all(static_cast<size_t>(comm.size()));
  HPS_ASSIGN_OR_RETURN(auto work, comm.all_gather(&mine, all.data(), 1, DType::kInt64));
  HPS_RETURN_IF_ERROR(work->wait());
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] != mine) {
      return invalid_argument("engine: rank " + std::to_string(r) + " of group '" + comm.name() +
                              "' registered different parameters (names, shapes, dtypes, flags "
                              "or units differ from this rank's " +
                              std::to_string(plan.params().size()) + ")");
    }
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<ShardedEngine>> create_sharded_engine(
    int32_t stage, std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
    const EngineOptions& options) {
  if (stage == 2) {
    HPS_ASSIGN_OR_RETURN(auto e, Stage2Engine::create(std::move(sharding), std::move(dp), options));
    return std::unique_ptr<ShardedEngine>(std::move(e));
  }
  if (stage == 3) {
    HPS_ASSIGN_OR_RETURN(auto e, Stage3Engine::create(std::move(sharding), std::move(dp), options));
    return std::unique_ptr<ShardedEngine>(std::move(e));
  }
  return invalid_argument("engine: stage must be 2 or 3, not " + std::to_string(stage));
}

}  // namespace hps
