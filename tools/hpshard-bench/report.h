// What hpshard-bench coll prints: one table per op and world size with Gloo (and torch)
// beside each figure, a summary line per table against PERFORMANCE.md's targets, and
// the same as one JSON object.
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "tools/hpshard-bench/coll_bench.h"

namespace hps::bench {

// Targets of /work/shared/PERFORMANCE.md for the collectives.
inline constexpr double kGlooTarget = 0.95;      // busbw ≥ 0.95× Gloo called directly
inline constexpr double kTorchGatherTarget = 3;  // all-gather busbw ≥ 3× torch gloo
inline constexpr size_t kSummaryFromBytes = size_t{1} << 20;

struct Summary {
  size_t rows = 0;  // rows from kSummaryFromBytes up
  std::optional<double> median_ratio;
  std::optional<bool> meets_target;
  size_t torch_rows = 0;
  std::optional<double> median_torch_ratio;
  std::optional<bool> meets_torch_target;  // all_gather only
};

// The rows of `op` in `world`, ascending by size.
std::vector<CollRow> rows_of(const WorldResult& world, CollOp op);
Summary summarize(CollOp op, const std::vector<CollRow>& rows);

// Helpers shared by the families' reports (clip_bench.cc, step_bench.cc).
double median(std::vector<double> v);  // 0 for an empty list
std::string size_text(size_t bytes);   // "4 KiB", "16 MiB"
std::string json_string(const std::string& s);
std::string json_number(double v);  // null when not finite
std::string json_optional(const std::optional<double>& v);
std::string json_optional(const std::optional<bool>& v);

struct RunInfo {
  std::string command;
  std::string date;     // UTC, ISO 8601
  std::string machine;  // hostname, CPUs
  std::string torch;    // "torch 1.13.1 (gloo)", "not installed", "skipped (--no-torch)", ...
  bool torch_ran = false;
};

void print_tables(std::FILE* out, const CollConfig& config, const RunInfo& info,
                  const std::vector<WorldResult>& worlds);
std::string to_json(const CollConfig& config, const RunInfo& info,
                    const std::vector<WorldResult>& worlds);

}  // namespace hps::bench
