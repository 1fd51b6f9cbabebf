#include "core/comm/agreement.h"

#include "core/device/buffer.h"

namespace hps {

StatusOr<std::vector<uint64_t>> gather_values(Communicator& comm,
                                              const std::vector<uint64_t>& mine) {
  const auto n = static_cast<size_t>(comm.size());
  const size_t width = mine.size();
  std::vector<uint64_t> all;
  all.reserve(n * width);
  for (size_t r = 0; r < n; ++r) all.insert(all.end(), mine.begin(), mine.end());
  if (n == 1 || width == 0) return all;
  HPS_ASSIGN_OR_RETURN(DeviceBuffer memory,
                       DeviceBuffer::allocate(comm.device(), (n + 1) * width * sizeof(uint64_t)));
  DevicePtr<uint64_t> values = memory.data<uint64_t>();
  Stream& stream = comm.stream();
  const Status gathered = [&]() -> Status {
    HPS_RETURN_IF_ERROR(stream.memcpy_async(values.get(), mine.data(), width * sizeof(uint64_t)));
    HPS_ASSIGN_OR_RETURN(
        auto work, comm.all_gather(values.get(), (values + width).get(), width, DType::kInt64));
    HPS_RETURN_IF_ERROR(work->wait());
    return copy_to_host(stream, all.data(), (values + width).get(), n * width * sizeof(uint64_t));
  }();
  if (!gathered.ok()) {
    // An all-gather refused at once (an aborted or failed group) left the copy of `mine`
    // queued on the stream, behind whatever the group ran before: it completes before
    // `mine` and `memory` go.
    (void)drain(stream);
    return gathered;
  }
  return all;
}

StatusOr<std::vector<uint64_t>> gather_values(Communicator& comm, uint64_t mine) {
  return gather_values(comm, std::vector<uint64_t>{mine});
}

StatusOr<uint64_t> combine_over(const std::vector<Communicator*>& groups, uint64_t mine,
                                const std::function<uint64_t(uint64_t, uint64_t)>& combine) {
  for (Communicator* group : groups) {
    if (group == nullptr || group->size() == 1) continue;
    HPS_ASSIGN_OR_RETURN(std::vector<uint64_t> all, gather_values(*group, mine));
    for (uint64_t v : all) mine = combine(mine, v);
  }
  return mine;
}

}  // namespace hps
