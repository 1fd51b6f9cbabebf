// What the ranks of a collective must agree on, and the error naming who disagreed.
// Exchanged before (TCP) or with (shared memory) the first data of every collective.
#pragma once

#include <cstdint>
#include <string>

#include "core/comm/rank_names.h"
#include "core/common/status.h"

namespace hps {

struct CollectiveDescriptor {
  int32_t kind = 0;  // CollectiveKind
  int32_t dtype = 0;
  int32_t op = 0;
  int32_t root = 0;
  uint64_t count = 0;
  uint64_t sequence = 0;
  uint64_t tag = 0;  // the caller's (Communicator::all_reduce); 0: none
};

enum CollectiveKind : int32_t {
  kAllReduceKind = 1,
  kReduceKind,
  kBroadcastKind,
  kAllGatherKind,
  kReduceScatterKind,
  kBarrierKind,
};

// OK when all `size` descriptors equal `mine`; otherwise INVALID_ARGUMENT at `place`
// listing what each disagreeing rank (named by `names`) called.
Status check_agreement(const std::string& place, const CollectiveDescriptor& mine,
                       const CollectiveDescriptor* all, int32_t size, const RankNames& names);

}  // namespace hps
