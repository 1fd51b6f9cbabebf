#include "core/sharding/sharded_engine.h"

#include <cmath>
#include <string>

#include "core/kernels/kernel_table.h"
#include "core/sharding/stage2_engine.h"
#include "core/sharding/stage3_engine.h"

namespace hps {

Status check_engine_arguments(const std::shared_ptr<Communicator>& sharding,
                              const std::shared_ptr<Communicator>& dp,
                              const EngineOptions& options) {
  if (!sharding) return invalid_argument("engine: the sharding communicator is null");
  if (dp && !(dp->device() == sharding->device())) {
    return invalid_argument("engine: the dp communicator is on " + dp->device().to_string() +
                            " and the sharding one on " + sharding->device().to_string());
  }
  if (!kernels_for(sharding->device().type).ok()) {
    return unavailable("engine: this build of hpshard has no kernels for " +
                       sharding->device().to_string());
  }
  if (options.compute_stream != nullptr &&
      !(options.compute_stream->device() == sharding->device())) {
    return invalid_argument("engine: the compute stream is on " +
                            options.compute_stream->device().to_string() +
                            ", the communicators on " + sharding->device().to_string());
  }
  return check_engine_options(options);
}

StatusOr<std::unique_ptr<ShardedEngine>> create_sharded_engine(
    int32_t stage, std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
    const EngineOptions& options) {
  // One communicator as both would average each gradient twice over the same ranks.
  if (sharding && dp && sharding == dp) {
    return invalid_argument(
        "engine: the sharding and dp communicators are the same communicator (give no dp "
        "group where there is no dp axis)");
  }
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
