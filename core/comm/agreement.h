// Set-up agreement among the ranks of a group: every rank's value of something that must
// be equal (a model fingerprint, the clip flags), gathered through memory of the group's
// device (NCCL communicators take device buffers only). Host-blocking, for set-up.
#pragma once

#include <cstdint>
#include <vector>

#include "core/comm/communicator.h"

namespace hps {

// Every rank's `mine`, in rank order.
StatusOr<std::vector<uint64_t>> gather_values(Communicator& comm, uint64_t mine);

}  // namespace hps
