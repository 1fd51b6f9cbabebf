// What the opaque C handles hold. Shared by the capi/src files; never installed.
#pragma once

#include <memory>

#include "core/comm/communicator.h"
#include "core/comm/store.h"
#include "core/device/stream.h"
#include "core/topology/hybrid_group.h"
#include "core/topology/topology.h"

struct hps_stream {
  std::shared_ptr<hps::Stream> impl;  // shared with engines using it as compute stream
};

struct hps_event {
  std::unique_ptr<hps::Event> impl;
};

struct hps_store {
  std::shared_ptr<hps::Store> impl;
};

struct hps_comm {
  std::shared_ptr<hps::Communicator> impl;  // shared with hybrid groups
};

struct hps_work {
  std::shared_ptr<hps::Work> impl;
};

struct hps_topology {
  hps::Topology impl;
};

struct hps_hybrid_group {
  std::unique_ptr<hps::HybridGroup> impl;
};
