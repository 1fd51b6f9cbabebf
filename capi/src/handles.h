// What the opaque C handles hold. Shared by the capi/src files; never installed.
#pragma once

#include <atomic>
#include <memory>

#include "core/comm/communicator.h"
#include "core/comm/store.h"
#include "core/common/fork_generation.h"
#include "core/device/stream.h"
#include "core/sharding/sharded_engine.h"
#include "core/topology/hybrid_group.h"
#include "core/topology/topology.h"

struct hps_stream {
  std::shared_ptr<hps::Stream> impl;       // shared with engines using it as compute stream
  uint64_t born = hps::fork_generation();  // capi::made_before_fork
};

struct hps_event {
  std::unique_ptr<hps::Event> impl;
  uint64_t born = hps::fork_generation();  // capi::made_before_fork
};

struct hps_store {
  std::shared_ptr<hps::AbortableStore> impl;  // hps_store_abort ends its waits
  uint64_t born = hps::fork_generation();     // capi::made_before_fork
};

struct hps_comm {
  std::shared_ptr<hps::Communicator> impl;  // shared with hybrid groups
  uint64_t born = hps::fork_generation();   // capi::made_before_fork
};

struct hps_work {
  std::shared_ptr<hps::Work> impl;
  uint64_t born = hps::fork_generation();  // capi::made_before_fork
};

struct hps_topology {
  hps::Topology impl;
  uint64_t born = hps::fork_generation();  // capi::made_before_fork
};

struct hps_hybrid_group {
  std::unique_ptr<hps::HybridGroup> impl;
  uint64_t born = hps::fork_generation();  // capi::made_before_fork
};

namespace hps::capi {

// What an engine handle, its DLPack views and its checkpoint handles share. Members go in
// reverse order: the engine, then the compute stream it may still use while it finishes.
struct EngineState {
  std::shared_ptr<hps::Stream> compute_stream;
  std::unique_ptr<hps::ShardedEngine> engine;
};

// The engine's users: its handle and its checkpoint handles, which call into it. When the
// last of them goes while DLPack views still keep the state, the engine lets its
// communicators and streams go (ShardedEngine::drop_groups) and the views keep only its
// memory.
struct EngineUse {
  explicit EngineUse(std::shared_ptr<EngineState> s) : state(std::move(s)) {}
  EngineUse(const EngineUse&) = delete;
  EngineUse& operator=(const EngineUse&) = delete;
  ~EngineUse() { (void)drop_groups_if_viewed(); }
  // With views outstanding: finishes what is in flight and lets the groups and streams go
  // (returning what the engine's work in flight ended with); otherwise nothing.
  hps::Status drop_groups_if_viewed() {
    if (state.use_count() <= 1) return hps::Status::Ok();
    const hps::Status finished = state->engine->drop_groups();
    state->compute_stream.reset();
    return finished;
  }
  const std::shared_ptr<EngineState> state;
};

}  // namespace hps::capi

struct hps_engine {
  std::shared_ptr<hps::capi::EngineUse> use;
  hps::ShardedEngine* impl;                // use->state->engine
  hps::Device device;                      // the sharding communicator's, fixed at creation
  uint64_t born = hps::fork_generation();  // capi::made_before_fork
  // Calls on it that returned a failure of its work or groups (hps_engine_failures_returned).
  std::atomic<uint64_t> failures_returned{0};
};
