#include "core/comm/agreement.h"

#include "core/device/buffer.h"

namespace hps {

StatusOr<std::vector<uint64_t>> gather_values(Communicator& comm, uint64_t mine) {
  const auto n = static_cast<size_t>(comm.size());
  std::vector<uint64_t> all(n, mine);
  if (n == 1) return all;
  HPS_ASSIGN_OR_RETURN(DeviceBuffer memory,
                       DeviceBuffer::allocate(comm.device(), (n + 1) * sizeof(uint64_t)));
  DevicePtr<uint64_t> values = memory.data<uint64_t>();
  Stream& stream = comm.stream();
  HPS_RETURN_IF_ERROR(stream.memcpy_async(values.get(), &mine, sizeof mine));
  HPS_ASSIGN_OR_RETURN(auto work,
                       comm.all_gather(values.get(), (values + 1).get(), 1, DType::kInt64));
  HPS_RETURN_IF_ERROR(work->wait());
  HPS_RETURN_IF_ERROR(copy_to_host(stream, all.data(), (values + 1).get(), n * sizeof(uint64_t)));
  return all;
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
