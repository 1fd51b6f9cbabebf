#include "tools/hpshard-bench/report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <fstream>
#include <thread>

namespace hps::bench {
namespace {

double busbw(const CollRow& row, int32_t ranks, double seconds) {
  return algbw_gbps(row.bytes, seconds) * bus_factor(row.op, ranks);
}

// hpshard's busbw over the reference's: the reference's time over hpshard's.
double ratio(double hpshard_seconds, double reference_seconds) {
  return hpshard_seconds > 0 ? reference_seconds / hpshard_seconds : 0.0;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

std::string machine_text() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return std::string(host) + ", " + std::to_string(std::thread::hardware_concurrency()) + " CPUs";
}

}  // namespace

double load_average() {
  std::ifstream in("/proc/loadavg");
  double one = -1;
  if (!(in >> one)) return -1;
  return one;
}

RunInfo run_info(int argc, char** argv) {
  RunInfo info;
  info.date = utc_now();
  info.machine = machine_text();
  for (int i = 0; i < argc; ++i) {
    if (i) info.command += ' ';
    info.command += argv[i];
  }
  info.load_before = load_average();
  return info;
}

// Shared by every family's report (report.h).
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

std::string size_text(size_t bytes) {
  char b[32];
  if (bytes >= (size_t{1} << 20)) {
    std::snprintf(b, sizeof b, "%g MiB", static_cast<double>(bytes) / (1 << 20));
  } else if (bytes >= 1024) {
    std::snprintf(b, sizeof b, "%g KiB", static_cast<double>(bytes) / 1024);
  } else {
    std::snprintf(b, sizeof b, "%zu B", bytes);
  }
  return b;
}

void print_run_header(std::FILE* out, const char* family, const RunInfo& info) {
  std::fprintf(out, "# hpshard-bench %s — %s — %s\n", family, info.date.c_str(),
               info.machine.c_str());
  std::fprintf(out, "# command: %s\n", info.command.c_str());
  std::fprintf(
      out, "# cpu kernels: %s (cpu: %s); load average %.2f at the start, %.2f at the end\n",
      info.cpu_kernels.c_str(), info.cpu_features.c_str(), info.load_before, info.load_after);
}

void add_run_info(Json& j, const char* family, const RunInfo& info) {
  j["tool"] = "hpshard-bench";
  j["family"] = family;
  j["command"] = info.command;
  j["date"] = info.date;
  j["machine"] = info.machine;
  j["cpu_kernels"] = {{"isa", info.cpu_kernels}, {"cpu_features", info.cpu_features}};
  j["load_average"] = {{"start", info.load_before}, {"end", info.load_after}};
}

std::vector<CollRow> rows_of(const WorldResult& world, CollOp op) {
  std::vector<CollRow> rows;
  for (const auto& row : world.rows) {
    if (row.op == op) rows.push_back(row);
  }
  return rows;
}

Summary summarize(CollOp op, const std::vector<CollRow>& rows) {
  Summary s;
  std::vector<double> ratios, torch_ratios;
  for (const auto& row : rows) {
    if (row.bytes < kSummaryFromBytes) continue;
    ratios.push_back(ratio(row.hpshard_seconds, row.gloo_seconds));
    if (row.torch_seconds) torch_ratios.push_back(ratio(row.hpshard_seconds, *row.torch_seconds));
  }
  s.rows = ratios.size();
  if (!ratios.empty()) {
    s.median_ratio = median(ratios);
    s.meets_target = *s.median_ratio >= kGlooTarget;
  }
  std::vector<double> mpi_ratios;
  for (const auto& row : rows) {
    if (row.bytes >= kSummaryFromBytes && row.mpi_seconds) {
      mpi_ratios.push_back(ratio(row.hpshard_seconds, *row.mpi_seconds));
    }
  }
  s.mpi_rows = mpi_ratios.size();
  if (!mpi_ratios.empty()) {
    s.median_mpi_ratio = median(mpi_ratios);
    s.meets_mpi_target = *s.median_mpi_ratio >= kMpiTarget;
  }
  s.torch_rows = torch_ratios.size();
  if (!torch_ratios.empty()) {
    s.median_torch_ratio = median(torch_ratios);
    if (op == CollOp::kAllGather)
      s.meets_torch_target = *s.median_torch_ratio >= kTorchGatherTarget;
  }
  return s;
}

void print_tables(std::FILE* out, const CollConfig& config, const RunInfo& info,
                  const std::vector<WorldResult>& worlds) {
  print_run_header(out, "coll", info);
  std::fprintf(out,
               "# dtype %s, check_arguments %d, hpshard transport %s%s; time = median over "
               "iterations of the slowest rank (us), then over %d repetition(s) of the sweep; "
               "bandwidth in GB/s (1e9)\n",
               std::string(dtype_name(config.dtype)).c_str(), config.check_arguments ? 1 : 0,
               config.shared_memory ? "shm" : "tcp", config.shared_memory_direct ? " (direct)" : "",
               config.repeat);
  std::fprintf(out,
               "# reference: Gloo called directly (gloo::allreduce ring, gloo::allgather, "
               "gloo::broadcast, ReduceScatterHalvingDoubling), measured alternately with "
               "hpshard\n");
  std::fprintf(out, "# Open MPI: %s\n", info.mpi.c_str());
  std::fprintf(out, "# torch: %s\n", info.torch.c_str());
  for (const auto& world : worlds) {
    for (CollOp op : config.ops) {
      const auto rows = rows_of(world, op);
      if (rows.empty()) continue;
      std::fprintf(out, "\n## %s, %d ranks\n", std::string(coll_op_name(op)).c_str(), world.ranks);
      std::fprintf(out, "%10s %11s %6s %12s %8s %8s %12s %8s %7s", "size", "count", "iters",
                   "hpshard_us", "algbw", "busbw", "gloo_us", "g_busbw", "ratio");
      if (info.mpi_ran) std::fprintf(out, " %12s %8s %7s", "mpi_us", "m_busbw", "m_ratio");
      if (info.torch_ran) std::fprintf(out, " %12s %8s %7s", "torch_us", "t_busbw", "t_ratio");
      std::fprintf(out, "\n");
      for (const auto& row : rows) {
        std::fprintf(out, "%10s %11zu %6d %12.1f %8.3f %8.3f %12.1f %8.3f %7.3f",
                     size_text(row.bytes).c_str(), row.count, row.iters, row.hpshard_seconds * 1e6,
                     algbw_gbps(row.bytes, row.hpshard_seconds),
                     busbw(row, world.ranks, row.hpshard_seconds), row.gloo_seconds * 1e6,
                     busbw(row, world.ranks, row.gloo_seconds),
                     ratio(row.hpshard_seconds, row.gloo_seconds));
        if (info.mpi_ran) {
          if (row.mpi_seconds) {
            std::fprintf(out, " %12.1f %8.3f %7.3f", *row.mpi_seconds * 1e6,
                         busbw(row, world.ranks, *row.mpi_seconds),
                         ratio(row.hpshard_seconds, *row.mpi_seconds));
          } else {
            std::fprintf(out, " %12s %8s %7s", "-", "-", "-");
          }
        }
        if (info.torch_ran) {
          if (row.torch_seconds) {
            std::fprintf(out, " %12.1f %8.3f %7.3f", *row.torch_seconds * 1e6,
                         busbw(row, world.ranks, *row.torch_seconds),
                         ratio(row.hpshard_seconds, *row.torch_seconds));
          } else {
            std::fprintf(out, " %12s %8s %7s", "-", "-", "-");
          }
        }
        std::fprintf(out, "\n");
      }
      const Summary s = summarize(op, rows);
      const std::string name(coll_op_name(op));
      if (s.median_ratio) {
        std::fprintf(out,
                     "summary: %s %d ranks: median hpshard/Gloo busbw from 1 MiB = %.3f over %zu "
                     "sizes: %s (target >= %.2fx Gloo)\n",
                     name.c_str(), world.ranks, *s.median_ratio, s.rows,
                     *s.meets_target ? "MEETS" : "BELOW", kGlooTarget);
      } else {
        std::fprintf(out, "summary: %s %d ranks: no sizes >= 1 MiB measured, no verdict\n",
                     name.c_str(), world.ranks);
      }
      if (op == CollOp::kReduceScatter && world.gloo_reduce_scatter_wrong > 0) {
        std::fprintf(out,
                     "note: Gloo's ReduceScatterHalvingDoubling gave a wrong result in %d checked "
                     "rank-runs (a race inside Gloo 0.5, see docs/benchmarks.md); timings kept\n",
                     world.gloo_reduce_scatter_wrong);
      }
      if (s.median_mpi_ratio) {
        std::fprintf(out,
                     "summary: %s %d ranks: median hpshard/Open MPI busbw from 1 MiB = %.3f over "
                     "%zu sizes: %s (target >= %.2fx Open MPI)\n",
                     name.c_str(), world.ranks, *s.median_mpi_ratio, s.mpi_rows,
                     *s.meets_mpi_target ? "MEETS" : "BELOW", kMpiTarget);
      }
      if (s.median_torch_ratio) {
        std::fprintf(out, "summary: %s %d ranks: median hpshard/torch busbw from 1 MiB = %.3f%s\n",
                     name.c_str(), world.ranks, *s.median_torch_ratio,
                     s.meets_torch_target ? (*s.meets_torch_target ? ": MEETS (target >= 3x torch)"
                                                                   : ": BELOW (target >= 3x torch)")
                                          : "");
      }
    }
  }
}

Json to_json(const CollConfig& config, const RunInfo& info,
             const std::vector<WorldResult>& worlds) {
  Json j;
  add_run_info(j, "coll", info);
  Json ops = Json::array();
  for (CollOp op : config.ops) ops.push_back(std::string(coll_op_name(op)));
  j["config"] = {{"ranks", config.ranks},
                 {"min_bytes", config.min_bytes},
                 {"max_bytes", config.max_bytes},
                 {"iters", config.iters},
                 {"warmup", config.warmup},
                 {"repeat", config.repeat},
                 {"ops", ops},
                 {"dtype", std::string(dtype_name(config.dtype))},
                 {"check_arguments", config.check_arguments},
                 {"transport", config.shared_memory ? "shm" : "tcp"},
                 {"shm_direct", config.shared_memory_direct}};
  j["units"] = {{"time", "seconds, median over iterations of the slowest rank"},
                {"bandwidth", "GB/s (1e9 bytes)"},
                {"ratio", "hpshard busbw / reference busbw"}};
  j["reference"] =
      "gloo direct: gloo::allreduce (ring), gloo::allgather, gloo::broadcast, "
      "gloo::ReduceScatterHalvingDoubling; rendezvous HashStore, tcp device 127.0.0.1";
  j["targets"] = {{"gloo_ratio_min", kGlooTarget},
                  {"torch_all_gather_ratio_min", kTorchGatherTarget},
                  {"mpi_ratio_min", kMpiTarget},
                  {"summary_from_bytes", kSummaryFromBytes}};
  j["mpi"] = {{"ran", info.mpi_ran}, {"status", info.mpi}};
  j["torch"] = {{"ran", info.torch_ran}, {"status", info.torch}};
  Json results = Json::array();
  for (const auto& world : worlds) {
    for (CollOp op : config.ops) {
      const auto rows = rows_of(world, op);
      if (rows.empty()) continue;
      Json result;
      result["op"] = std::string(coll_op_name(op));
      result["ranks"] = world.ranks;
      if (op == CollOp::kReduceScatter) {
        result["gloo_wrong_results"] = world.gloo_reduce_scatter_wrong;
      }
      Json out_rows = Json::array();
      for (const auto& row : rows) {
        auto busbw_of = [&](std::optional<double> seconds) -> std::optional<double> {
          if (!seconds) return std::nullopt;
          return busbw(row, world.ranks, *seconds);
        };
        auto ratio_to = [&](std::optional<double> seconds) -> std::optional<double> {
          if (!seconds) return std::nullopt;
          return ratio(row.hpshard_seconds, *seconds);
        };
        out_rows.push_back({{"bytes", row.bytes},
                            {"count", row.count},
                            {"iters", row.iters},
                            {"hpshard_seconds", row.hpshard_seconds},
                            {"hpshard_algbw", algbw_gbps(row.bytes, row.hpshard_seconds)},
                            {"hpshard_busbw", busbw(row, world.ranks, row.hpshard_seconds)},
                            {"gloo_seconds", row.gloo_seconds},
                            {"gloo_busbw", busbw(row, world.ranks, row.gloo_seconds)},
                            {"ratio", ratio(row.hpshard_seconds, row.gloo_seconds)},
                            {"mpi_seconds", json_optional(row.mpi_seconds)},
                            {"mpi_busbw", json_optional(busbw_of(row.mpi_seconds))},
                            {"mpi_ratio", json_optional(ratio_to(row.mpi_seconds))},
                            {"torch_seconds", json_optional(row.torch_seconds)},
                            {"torch_busbw", json_optional(busbw_of(row.torch_seconds))},
                            {"torch_ratio", json_optional(ratio_to(row.torch_seconds))}});
      }
      result["rows"] = out_rows;
      const Summary s = summarize(op, rows);
      result["summary"] = {{"rows_from_1MiB", s.rows},
                           {"median_ratio", json_optional(s.median_ratio)},
                           {"meets_target", json_optional(s.meets_target)},
                           {"mpi_rows_from_1MiB", s.mpi_rows},
                           {"median_mpi_ratio", json_optional(s.median_mpi_ratio)},
                           {"meets_mpi_target", json_optional(s.meets_mpi_target)},
                           {"torch_rows_from_1MiB", s.torch_rows},
                           {"median_torch_ratio", json_optional(s.median_torch_ratio)},
                           {"meets_torch_target", json_optional(s.meets_torch_target)}};
      results.push_back(result);
    }
  }
  j["results"] = results;
  return j;
}

}  // namespace hps::bench
