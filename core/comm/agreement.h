// Set-up agreement among the ranks of a group: every rank's value of something that must
// be equal (a model fingerprint, the clip flags), gathered through memory of the group's
// device (NCCL communicators take device buffers only). Host-blocking, for set-up.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/comm/communicator.h"

namespace hps {

// Every rank's `mine`, in rank order.
StatusOr<std::vector<uint64_t>> gather_values(Communicator& comm, uint64_t mine);
// Every rank's `mine` (the same length on every rank), rank after rank.
StatusOr<std::vector<uint64_t>> gather_values(Communicator& comm,
                                              const std::vector<uint64_t>& mine);

// `mine` folded with every rank's value over `groups` (null ones and groups of one rank
// skipped), one gather along each in turn: where the groups are the axes of one grid,
// every rank of it gets the same result, provided `combine` is associative and
// commutative. A verdict that all ranks must share before one of them acts alone.
StatusOr<uint64_t> combine_over(const std::vector<Communicator*>& groups, uint64_t mine,
                                const std::function<uint64_t(uint64_t, uint64_t)>& combine);

}  // namespace hps
