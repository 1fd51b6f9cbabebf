// How a process learns its rank, the world size and where the ranks meet (a store URL):
// from the variables hpshard-run sets, or those of torchrun, Open MPI or Slurm.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/comm/store.h"
#include "core/common/status.h"

namespace hps {

struct RendezvousInfo {
  int32_t rank = 0;
  int32_t world_size = 1;
  int32_t local_rank = 0;  // the rank among the processes of this host
  std::string store_url;   // file:///path, tcp://host:port or memory://name
  std::string source;      // which variables were used, e.g. "torchrun (RANK, WORLD_SIZE, ...)"
};

// Reads, in this priority:
//   1. HPS_RANK, HPS_WORLD_SIZE, HPS_STORE, optional HPS_LOCAL_RANK (set by hpshard-run);
//   2. torchrun: RANK, WORLD_SIZE, LOCAL_RANK;
//   3. Open MPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK;
//   4. Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID.
// A family is chosen when its rank or world-size variable is set. For families 2-4 the store
// is HPS_STORE when set, else tcp://MASTER_ADDR:MASTER_PORT. A missing local rank means
// local_rank = rank (one host). Errors (INVALID_ARGUMENT) name the variable that is missing
// or malformed; NOT_FOUND when no family is present at all.
StatusOr<RendezvousInfo> rendezvous_from_env();

// Opens the store at `url` for `rank`:
//   file:///path     a FileStore in /path (created when missing);
//   tcp://host:port  a TcpStore; rank 0 serves it (on host when host is a numeric address,
//                    else on every interface), every rank connects, retrying until `timeout`;
//   memory://name    a process-wide in-memory store shared by every open of that name (ranks
//                    that are threads of one process).
// An unknown scheme or a malformed URL is INVALID_ARGUMENT.
StatusOr<std::shared_ptr<Store>> open_store(const std::string& url, int32_t rank,
                                            Milliseconds timeout);

}  // namespace hps
