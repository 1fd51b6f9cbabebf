// The runtime's own step on one device at world size 1, with no model compute: the
// engines' protocol (gathers, releases, gradient check-ins, the reduce-scatters, the
// optimizer pipeline with clipping, the all-gathers) on device memory, with synthetic
// gradients copied in on the compute stream. It runs wherever the engines run — CPU or
// CUDA — and needs no Gloo, so tools/gpu-check.sh runs it on the GPU machine. Reference in
// the same run: the fused optimizer kernel alone over the same parameters (the floor of a
// step at world size 1).
#pragma once

#include <cstdint>
#include <string>

#include "core/device/device.h"
#include "tools/hpshard-bench/report.h"

namespace hps::bench {

struct DeviceStepConfig {
  Device device = Device::cpu();
  int32_t width = 1024;
  int32_t depth = 8;
  int32_t steps = 10;  // timed steps per repetition
  int32_t reps = 5;
  int32_t warmup = 2;  // untimed steps first
  bool adamw = true;
  double clip = 1.0;
};

struct DeviceStepResult {
  size_t parameters = 0;
  double stage2_seconds = 0;  // per step, median over repetitions
  double stage3_seconds = 0;
  double optimizer_seconds = 0;        // the optimizer kernel alone over every parameter, per step
  uint64_t stage2_host_syncs_max = 0;  // most host syncs in one steady step
  uint64_t stage3_host_syncs_max = 0;
  double stage2_max_diff = 0;  // stage 2 vs stage 3 parameters after the same steps
};

// Exits the process with a message on a failure (a benchmark, not a library call).
DeviceStepResult run_device_step(const DeviceStepConfig& config);
void print_device_step(const DeviceStepConfig& config, const DeviceStepResult& result);
Json device_step_to_json(const DeviceStepConfig& config, const DeviceStepResult& result);

}  // namespace hps::bench
