// What hpshard-bench coll prints: one table per op and world size with Gloo, Open MPI (and
// torch) beside each figure, a summary line per table against PERFORMANCE.md's targets, and
// the same as one JSON object (nlohmann::json); and what every family's report shares.
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tools/hpshard-bench/coll_bench.h"

namespace hps::bench {

// Targets of /work/shared/PERFORMANCE.md for the collectives.
inline constexpr double kGlooTarget = 0.95;      // busbw ≥ 0.95× Gloo called directly
inline constexpr double kTorchGatherTarget = 3;  // all-gather busbw ≥ 3× torch gloo
inline constexpr double kMpiTarget = 1.0;        // busbw ≥ 1.0× Open MPI (shared memory)
inline constexpr size_t kSummaryFromBytes = size_t{1} << 20;

struct Summary {
  size_t rows = 0;  // rows from kSummaryFromBytes up
  std::optional<double> median_ratio;
  std::optional<bool> meets_target;
  size_t torch_rows = 0;
  std::optional<double> median_torch_ratio;
  std::optional<bool> meets_torch_target;  // all_gather only
  size_t mpi_rows = 0;
  std::optional<double> median_mpi_ratio;
  std::optional<bool> meets_mpi_target;
};

// The rows of `op` in `world`, ascending by size.
std::vector<CollRow> rows_of(const WorldResult& world, CollOp op);
Summary summarize(CollOp op, const std::vector<CollRow>& rows);

// Helpers shared by the families' reports (clip_bench.cc, step_bench.cc).
using Json = nlohmann::ordered_json;   // keys in the order written; NaN and Inf dump as null
double median(std::vector<double> v);  // 0 for an empty list
std::string size_text(size_t bytes);   // "4 KiB", "16 MiB"
template <typename T>
Json json_optional(const std::optional<T>& v) {
  return v ? Json(*v) : Json(nullptr);
}

struct RunInfo {
  std::string command;
  std::string date;     // UTC, ISO 8601
  std::string machine;  // hostname, CPUs
  std::string torch;    // "torch 1.13.1 (gloo)", "not installed", "skipped (--no-torch)", ...
  bool torch_ran = false;
  std::string mpi;  // coll: "Open MPI 4.1.4, ...", "skipped (--no-mpi)", why not
  bool mpi_ran = false;
  std::string cpu_kernels;   // the CPU kernels' variant in use ("avx2")
  std::string cpu_features;  // what the CPU reports ("avx2 f16c fma")
  double load_before = -1;   // 1-minute load average when the run started and ended
  double load_after = -1;
};

// When and where a run starts: the UTC date, this host and its CPUs, the command line and
// the 1-minute load average.
RunInfo run_info(int argc, char** argv);
double load_average();  // -1 when /proc/loadavg cannot be read

// The header lines every family prints (date, machine, command, CPU kernels, load).
void print_run_header(std::FILE* out, const char* family, const RunInfo& info);
// The same as JSON keys of the family's object.
void add_run_info(Json& j, const char* family, const RunInfo& info);

void print_tables(std::FILE* out, const CollConfig& config, const RunInfo& info,
                  const std::vector<WorldResult>& worlds);
Json to_json(const CollConfig& config, const RunInfo& info, const std::vector<WorldResult>& worlds);

}  // namespace hps::bench
