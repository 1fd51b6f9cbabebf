// A store belongs to one job at a time. Rank 0 of a job takes the store over (a ticket from
// the store's counter orders rank 0s that arrive together), every rank joins the job rank 0
// took it for, and each job keeps its keys apart (under "hpshard/run/<ticket>-<nonce>/"), so:
//   - a second job on a store whose owner still runs is refused, on every rank, with a
//     message naming the owner;
//   - the keys a crashed run left are ignored, with a message, when its rank 0 provably
//     ended (a process of this host that has gone), or when it closed the store.
// A rank learns its job from the environment (job_identity_from_env); without one, rank 0
// names the job at random and the others join whichever job rank 0 took the store for, told
// apart by their rank numbers alone (two of the same rank are refused).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/comm/store.h"
#include "core/common/status.h"

namespace hps {

struct JobIdentity {
  std::string id;      // empty: rank 0 makes one up and the other ranks read it
  std::string source;  // the variables it came from, for messages
};

// In this priority: HPS_JOB_ID (hpshard-run sets it); torchrun's TORCHELASTIC_RUN_ID with
// TORCHELASTIC_RESTART_COUNT ("none" counts as unset); Open MPI's PMIX_NAMESPACE or
// OMPI_MCA_ess_base_jobid; Slurm's SLURM_JOB_ID with SLURM_STEP_ID and SLURM_RESTART_COUNT.
// An empty id when none is set; INVALID_ARGUMENT naming the variable whose value is malformed
// (a control character, or longer than 256 bytes: its own length), or, when the id the
// values make with their prefix ("slurm:") is longer than 256 bytes, each variable with its
// length.
StatusOr<JobIdentity> job_identity_from_env();

struct JobOptions {
  JobIdentity identity;
  int32_t world_size = 0;  // compared with rank 0's when both are known; 0: unknown
  std::string where;       // the store, for messages (its URL)
  std::string store;       // the store's URL in full: what a process remembers per store
                           // (empty: `where`)
};

// A job without an id keeps the one its rank 0 made up: each process remembers it per store,
// so a rank that opens that store again, rank 0 too, belongs to the same job and follows
// that job's pointer, not the store's current holder (another job's, maybe).
//
// Joins `rank` to its job on `store` and returns the job's own key space. Rank 0 takes the
// store over (FAILED_PRECONDITION when another job holds it); the other ranks wait, up to
// `timeout`, for their job's rank 0 (FAILED_PRECONDITION when it was refused, when their
// rank has joined already, or when the world sizes differ). When rank 0's store is
// destroyed, the job is marked closed and the next job may take the store over.
StatusOr<std::shared_ptr<Store>> join_job(std::shared_ptr<Store> store, int32_t rank,
                                          const JobOptions& options, Milliseconds timeout);

// Whether this process holds the job's store at URL `store` (JobOptions::store) as `rank`
// (opened by join_job and not yet destroyed).
bool job_store_open_here(const std::string& store, int32_t rank);

}  // namespace hps
