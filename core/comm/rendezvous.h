// How a process learns its rank, the world size and where the ranks meet (a store URL):
// from the variables hpshard-run sets, or those of torchrun, Open MPI or Slurm.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/comm/job.h"
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

// How a store is opened beyond its URL: what the launcher (or torchrun, Slurm, Open MPI)
// says about the job.
struct StoreOptions {
  // TCP: the job's shared secret (HPS_STORE_TOKEN); empty: no authentication.
  std::string token;
  // file and TCP: the job the store is opened for (see job.h); an empty id is made up by
  // rank 0.
  JobIdentity job;
  // Compared with rank 0's when both are known; 0: unknown.
  int32_t world_size = 0;
  // TCP, rank 0: serve on this listening socket (HPS_STORE_FD) instead of binding.
  int listen_fd = -1;
};

// HPS_STORE_TOKEN (checked: not empty, at most 1 KiB), the job identity
// (job_identity_from_env), the world size of rendezvous_from_env() when its store is `url`,
// and for rank 0 of that store HPS_STORE_FD, a listening socket handed down by hpshard-run
// (taken once per process: a later open binds the port itself). Errors name the variable.
StatusOr<StoreOptions> store_options_from_env(const std::string& url, int32_t rank);

// Opens the store at `url` for `rank`:
//   file:///path     a FileStore in /path (created 0700 when missing; a directory every user
//                    may write to is refused);
//   tcp://host:port  a TcpStore; rank 0 serves it (see store_bind_address), every rank
//                    connects, retrying until `timeout`, and proves the token when there is
//                    one;
//   memory://name    a process-wide in-memory store shared by every open of that name (ranks
//                    that are threads of one process).
// File and TCP stores are joined to the job (join_job): the store returned is the job's own
// key space. An unknown scheme or a malformed URL is INVALID_ARGUMENT.
StatusOr<std::shared_ptr<Store>> open_store(const std::string& url, int32_t rank,
                                            Milliseconds timeout, const StoreOptions& options);
// The same with store_options_from_env(url, rank).
StatusOr<std::shared_ptr<Store>> open_store(const std::string& url, int32_t rank,
                                            Milliseconds timeout);

// The address rank 0 of tcp://host:port listens on: a numeric address as given; loopback
// (127.0.0.1) for "localhost" and names under ".localhost"; every interface (0.0.0.0) for
// this machine's own name (which Debian maps to 127.0.1.1 locally while other hosts reach
// it by its real address); any other name's first address.
StatusOr<std::string> store_bind_address(const std::string& host);

}  // namespace hps
