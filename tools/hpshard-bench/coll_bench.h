// The collective sweep of hpshard-bench: for one world size, ranks as threads of this
// process time hpshard's communicator and Gloo called directly (gloo_reference.h) on the
// same buffers, sizes and ranks, alternating the two.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/common/dtype.h"
#include "tools/hpshard-bench/coll_op.h"

namespace hps::bench {

struct CollConfig {
  std::vector<int32_t> ranks{2, 4};
  size_t min_bytes = 4096;
  size_t max_bytes = size_t{64} << 20;
  // 0: by size (iterations_for); otherwise this many timed iterations for every size.
  int32_t iters = 0;
  // -1: by size (warmup_for); otherwise this many untimed runs after the checked one.
  int32_t warmup = -1;
  std::vector<CollOp> ops{std::begin(kAllCollOps), std::end(kAllCollOps)};
  DType dtype = DType::kFloat32;
  bool check_arguments = true;
  // false: hpshard's collectives use Gloo TCP even between same-host ranks.
  bool shared_memory = true;
  // CommOptions::shared_memory_direct: all-gather and broadcast read peers' buffers in place.
  bool shared_memory_direct = true;
  std::chrono::milliseconds timeout{120'000};
  bool progress = true;  // a line on stderr per case
  // The whole sweep this many times per world size; each row's figures are then the
  // median over the repetitions (PERFORMANCE.md: the median of several repetitions).
  int32_t repeat = 1;
};

// Sizes S doubling from min_bytes to max_bytes.
std::vector<size_t> message_sizes(const CollConfig& config);
// Default timed iterations and warmup runs for a message of `bytes`: many for small
// (latency-bound, cheap), few for large, so the default sweep takes minutes here.
int32_t iterations_for(const CollConfig& config, size_t bytes);
int32_t warmup_for(const CollConfig& config, size_t bytes);

// One (op, size) case at one world size.
struct CollRow {
  CollOp op;
  size_t bytes = 0;  // S: total bytes, count × ranks for all-gather and reduce-scatter
  size_t count = 0;  // elements passed to the call (per rank for AG/RS)
  int32_t iters = 0;
  // Median over iterations of the slowest rank's time, in seconds.
  double hpshard_seconds = 0;
  double gloo_seconds = 0;
  // Torch's figure, filled in from torch_coll.py when it ran.
  std::optional<double> torch_seconds;
  // Open MPI's (processes under mpirun, shared-memory transport), when it ran.
  std::optional<double> mpi_seconds;
};

struct WorldResult {
  int32_t ranks = 0;
  std::vector<CollRow> rows;  // ops in config order, sizes ascending
  // Checked runs in which Gloo's ReduceScatterHalvingDoubling gave a wrong result (a race
  // in Gloo 0.5, docs/benchmarks.md), counted over ranks; its timings are kept.
  int32_t gloo_reduce_scatter_wrong = 0;
};

// Runs the sweep at `ranks` ranks. Each case's results are checked once (untimed) on
// known inputs first, for hpshard and for Gloo. A wrong result, an error or a timeout
// ends the process (exit status 1) with the reason on stderr: a rank thread that fails
// cannot release its peers from a collective they are already waiting in.
WorldResult run_world(const CollConfig& config, int32_t ranks);
// run_world config.repeat times, merged: every time the median over the repetitions, the
// wrong Gloo results summed. `after_each` (when set) runs after each repetition on its
// result (the Open MPI sweep fills mpi_seconds there, so it alternates with hpshard's).
WorldResult run_world_repeated(const CollConfig& config, int32_t ranks,
                               const std::function<void(WorldResult&)>& after_each = {});

}  // namespace hps::bench
