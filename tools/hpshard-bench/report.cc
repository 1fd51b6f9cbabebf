#include "tools/hpshard-bench/report.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace hps::bench {
namespace {

double busbw(const CollRow& row, int32_t ranks, double seconds) {
  return algbw_gbps(row.bytes, seconds) * bus_factor(row.op, ranks);
}

// hpshard's busbw over the reference's: the reference's time over hpshard's.
double ratio(double hpshard_seconds, double reference_seconds) {
  return hpshard_seconds > 0 ? reference_seconds / hpshard_seconds : 0.0;
}

}  // namespace

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

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

std::string json_optional(const std::optional<double>& v) { return v ? json_number(*v) : "null"; }
std::string json_optional(const std::optional<bool>& v) {
  return v ? (*v ? "true" : "false") : "null";
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
  std::fprintf(out, "# hpshard-bench coll — %s — %s\n", info.date.c_str(), info.machine.c_str());
  std::fprintf(out, "# command: %s\n", info.command.c_str());
  std::fprintf(out,
               "# dtype %s, check_arguments %d, hpshard transport %s; time = median over "
               "iterations of the slowest rank (us), then over %d repetition(s) of the sweep; "
               "bandwidth in GB/s (1e9)\n",
               std::string(dtype_name(config.dtype)).c_str(), config.check_arguments ? 1 : 0,
               config.shared_memory ? "shm" : "tcp", config.repeat);
  std::fprintf(out,
               "# reference: Gloo called directly (gloo::allreduce ring, gloo::allgather, "
               "gloo::broadcast, ReduceScatterHalvingDoubling), measured alternately with "
               "hpshard\n");
  std::fprintf(out, "# torch: %s\n", info.torch.c_str());
  for (const auto& world : worlds) {
    for (CollOp op : config.ops) {
      const auto rows = rows_of(world, op);
      if (rows.empty()) continue;
      std::fprintf(out, "\n## %s, %d ranks\n", std::string(coll_op_name(op)).c_str(), world.ranks);
      std::fprintf(out, "%10s %11s %6s %12s %8s %8s %12s %8s %7s", "size", "count", "iters",
                   "hpshard_us", "algbw", "busbw", "gloo_us", "g_busbw", "ratio");
      if (info.torch_ran) std::fprintf(out, " %12s %8s %7s", "torch_us", "t_busbw", "t_ratio");
      std::fprintf(out, "\n");
      for (const auto& row : rows) {
        std::fprintf(out, "%10s %11zu %6d %12.1f %8.3f %8.3f %12.1f %8.3f %7.3f",
                     size_text(row.bytes).c_str(), row.count, row.iters, row.hpshard_seconds * 1e6,
                     algbw_gbps(row.bytes, row.hpshard_seconds),
                     busbw(row, world.ranks, row.hpshard_seconds), row.gloo_seconds * 1e6,
                     busbw(row, world.ranks, row.gloo_seconds),
                     ratio(row.hpshard_seconds, row.gloo_seconds));
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

std::string to_json(const CollConfig& config, const RunInfo& info,
                    const std::vector<WorldResult>& worlds) {
  std::ostringstream j;
  j << "{\n  \"tool\": \"hpshard-bench\",\n  \"family\": \"coll\",\n";
  j << "  \"command\": " << json_string(info.command) << ",\n";
  j << "  \"date\": " << json_string(info.date) << ",\n";
  j << "  \"machine\": " << json_string(info.machine) << ",\n";
  j << "  \"config\": {\"ranks\": [";
  for (size_t i = 0; i < config.ranks.size(); ++i) j << (i ? ", " : "") << config.ranks[i];
  j << "], \"min_bytes\": " << config.min_bytes << ", \"max_bytes\": " << config.max_bytes
    << ", \"iters\": " << config.iters << ", \"warmup\": " << config.warmup
    << ", \"repeat\": " << config.repeat << ", \"ops\": [";
  for (size_t i = 0; i < config.ops.size(); ++i) {
    j << (i ? ", " : "") << json_string(std::string(coll_op_name(config.ops[i])));
  }
  j << "], \"dtype\": " << json_string(std::string(dtype_name(config.dtype)))
    << ", \"check_arguments\": " << (config.check_arguments ? "true" : "false")
    << ", \"transport\": " << json_string(config.shared_memory ? "shm" : "tcp") << "},\n";
  j << "  \"units\": {\"time\": \"seconds, median over iterations of the slowest rank\", "
       "\"bandwidth\": \"GB/s (1e9 bytes)\", \"ratio\": \"hpshard busbw / reference busbw\"},\n";
  j << "  \"reference\": \"gloo direct: gloo::allreduce (ring), gloo::allgather, gloo::broadcast, "
       "gloo::ReduceScatterHalvingDoubling; rendezvous HashStore, tcp device 127.0.0.1\",\n";
  j << "  \"targets\": {\"gloo_ratio_min\": " << kGlooTarget
    << ", \"torch_all_gather_ratio_min\": " << kTorchGatherTarget
    << ", \"summary_from_bytes\": " << kSummaryFromBytes << "},\n";
  j << "  \"torch\": {\"ran\": " << (info.torch_ran ? "true" : "false")
    << ", \"status\": " << json_string(info.torch) << "},\n";
  j << "  \"results\": [";
  bool first = true;
  for (const auto& world : worlds) {
    for (CollOp op : config.ops) {
      const auto rows = rows_of(world, op);
      if (rows.empty()) continue;
      j << (first ? "\n" : ",\n") << "    {\"op\": " << json_string(std::string(coll_op_name(op)))
        << ", \"ranks\": " << world.ranks;
      if (op == CollOp::kReduceScatter) {
        j << ", \"gloo_wrong_results\": " << world.gloo_reduce_scatter_wrong;
      }
      j << ", \"rows\": [";
      first = false;
      for (size_t i = 0; i < rows.size(); ++i) {
        const auto& row = rows[i];
        j << (i ? ",\n" : "\n") << "      {\"bytes\": " << row.bytes << ", \"count\": " << row.count
          << ", \"iters\": " << row.iters
          << ", \"hpshard_seconds\": " << json_number(row.hpshard_seconds)
          << ", \"hpshard_algbw\": " << json_number(algbw_gbps(row.bytes, row.hpshard_seconds))
          << ", \"hpshard_busbw\": " << json_number(busbw(row, world.ranks, row.hpshard_seconds))
          << ", \"gloo_seconds\": " << json_number(row.gloo_seconds)
          << ", \"gloo_busbw\": " << json_number(busbw(row, world.ranks, row.gloo_seconds))
          << ", \"ratio\": " << json_number(ratio(row.hpshard_seconds, row.gloo_seconds));
        std::optional<double> torch_busbw, torch_ratio;
        if (row.torch_seconds) {
          torch_busbw = busbw(row, world.ranks, *row.torch_seconds);
          torch_ratio = ratio(row.hpshard_seconds, *row.torch_seconds);
        }
        j << ", \"torch_seconds\": " << json_optional(row.torch_seconds)
          << ", \"torch_busbw\": " << json_optional(torch_busbw)
          << ", \"torch_ratio\": " << json_optional(torch_ratio) << "}";
      }
      const Summary s = summarize(op, rows);
      j << "\n    ], \"summary\": {\"rows_from_1MiB\": " << s.rows
        << ", \"median_ratio\": " << json_optional(s.median_ratio)
        << ", \"meets_target\": " << json_optional(s.meets_target)
        << ", \"torch_rows_from_1MiB\": " << s.torch_rows
        << ", \"median_torch_ratio\": " << json_optional(s.median_torch_ratio)
        << ", \"meets_torch_target\": " << json_optional(s.meets_torch_target) << "}}";
    }
  }
  j << "\n  ]\n}\n";
  return j.str();
}

}  // namespace hps::bench
