// The ckpt family of hpshard-bench: checkpoints of a Stage2Engine (AdamW, ranks as threads)
// beside plain file I/O of the same bytes in the same run: a save (snapshot, checksums,
// write, fsync, publish) against each rank writing as many bytes sequentially and fsyncing
// them; a load (read, verify, convert, all-gather) against each rank reading its data file
// with one pread, both from a cold page cache (and, for comparison, against a cold read of
// the plain file the reference wrote); and the training step right after save(), and
// `steps` steps from save() on, against as many steps without a save.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "core/device/device.h"
#include "tools/hpshard-bench/report.h"

namespace hps::bench {

// Targets of /work/shared/PERFORMANCE.md for checkpoints.
inline constexpr double kCkptBandwidthTarget = 0.8;  // save / load ≥ 0.8× plain I/O
inline constexpr double kCkptOverlapTarget = 1.05;   // the step right after save() ≤ 1.05×

struct CkptConfig {
  // The engine's device. Off the CPU the checkpointer's group is a CPU communicator of its
  // own (ranks 1 needs no Gloo: tools/gpu-check.sh runs it on the GPU machine).
  Device device = Device::cpu();
  int32_t ranks = 2;
  size_t bytes = size_t{64} << 20;  // fp32 parameter bytes (AdamW saves 3×)
  int32_t tensors = 8;              // parameters, one unit each
  int32_t reps = 3;
  int32_t steps = 6;           // steps timed per repetition, with and without a save
  int32_t compute_passes = 4;  // passes over the parameters in a step's "forward/backward"
  // How a pass runs: host loops on the caller's thread (the CPU's default), or the kernel
  // table's accumulate (gradient += parameter) on the engine's compute stream (the only way
  // off the CPU).
  bool kernel_passes = false;
  std::string dir;  // where the checkpoints go (default: a temporary directory)
  bool progress = true;
};

struct CkptResult {
  int32_t ranks = 0;
  uint64_t saved_bytes = 0;  // every rank's data file
  // Medians over repetitions of the slowest rank's time.
  double save_seconds = 0;   // save() to the Work's completion (published)
  double write_seconds = 0;  // write + fsync of the same bytes per rank
  double load_seconds = 0;   // load(), cold cache
  double read_seconds = 0;   // pread of each rank's data file, cold cache
  // pread of as many bytes per rank from the plain file just written (through the page
  // cache), cold cache.
  double read_plain_file_seconds = 0;
  double first_step_seconds = 0;            // one step, no save
  double first_step_with_save_seconds = 0;  // the step right after save()
  double step_seconds = 0;                  // per step of `steps`, no save
  double step_with_save_seconds = 0;
  // Medians over repetitions of each back-to-back pair's ratio: plain write / save, plain
  // read / load, step with a save / step alone.
  double save_ratio = 0;
  double load_ratio = 0;
  double load_ratio_plain_file = 0;  // against read_plain_file_seconds
  double first_step_ratio = 0;       // the step right after save() / a step without a save
  double step_ratio = 0;             // `steps` steps from save() on / as many without
  int32_t first_overlapped = 0;      // 1 when the step right after save() began with it in flight
  int32_t overlapped_steps = 0;      // of `steps`, those that began with the save still in flight
  uint64_t host_syncs_in_overlapped_steps = 0;  // the most in one step, any rank
  bool loaded_equal = false;                    // the loaded state is bitwise the saved one
};

// Whether a step's passes run as kernels: asked for, or off the CPU (no host loops there).
inline bool uses_kernel_passes(const CkptConfig& c) {
  return c.kernel_passes || c.device.type != DeviceType::kCpu;
}

CkptResult run_ckpt(const CkptConfig& config);
void print_ckpt(std::FILE* out, const CkptConfig& config, const RunInfo& info,
                const CkptResult& result);
Json ckpt_to_json(const CkptConfig& config, const RunInfo& info, const CkptResult& result);

}  // namespace hps::bench
