// hpshard-bench: hpshard's benchmarks, printed as tables with the reference measured in
// the same run beside each figure (docs/benchmarks.md).
//
//   hpshard-bench coll [--ranks 2,4] [--min-bytes 4096] [--max-bytes 67108864] [--iters N]
//                      [--warmup N] [--repeat N]
//                      [--ops all_reduce,all_gather,reduce_scatter,broadcast]
//                      [--dtype float32|float64] [--json FILE] [--no-torch]
//                      [--torch-script FILE] [--check-arguments 0|1] [--transport shm|tcp]
//                      [--quiet]
//   hpshard-bench clip [--sizes 16M,64M,32M:mixed] [--iters N] [--warmup N] [--max-norm X]
//                      [--json FILE] [--no-torch] [--torch-script FILE] [--quiet]
//   hpshard-bench torch [--ranks 2,4] [--width N] [--layers N] ... (torch_peer.py)
//   hpshard-bench step [--ranks 2,4] [--width 1024] [--depth 8] [--batch 8] [--steps 3]
//                      [--reps 5] [--warmup 1] [--optimizer adamw|sgd] [--clip X]
//                      [--prefetch-window N] [--device cpu|cuda[:N]] [--trace-overhead]
//                      [--json FILE] [--no-torch] [--torch-script FILE] [--quiet]
//   hpshard-bench ckpt [--ranks N] [--bytes 64M] [--tensors N] [--reps N] [--steps N]
//                      [--compute-passes N] [--dir DIR] [--json FILE] [--quiet]
//
// Exit status: 0 when every case ran and gave the right result; 1 on an error or a wrong
// result; 2 for bad usage.
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tools/hpshard-bench/ckpt_bench.h"
#include "tools/hpshard-bench/clip_bench.h"
#include "tools/hpshard-bench/coll_bench.h"
#include "tools/hpshard-bench/device_step.h"
#include "tools/hpshard-bench/report.h"
#include "tools/hpshard-bench/step_bench.h"

#ifndef HPS_BENCH_SOURCE_DIR
#define HPS_BENCH_SOURCE_DIR ""
#endif

namespace {

using namespace hps::bench;

constexpr int kUsageError = 2;

const char kUsage[] =
    "usage: hpshard-bench coll [options]\n"
    "  Times hpshard's collectives (ranks as threads, in-memory store) against Gloo called\n"
    "  directly on the same sizes and ranks, and torch.distributed gloo when importable.\n"
    "  --ranks LIST            world sizes, e.g. 2,4 (default 2,4)\n"
    "  --min-bytes N           smallest message S in bytes (default 4096)\n"
    "  --max-bytes N           largest message S in bytes (default 67108864; up to 268435456)\n"
    "  --iters N               timed iterations per size (default: 40 small .. 5 large)\n"
    "  --warmup N              untimed runs per size after the checked one (default 3 / 1)\n"
    "  --repeat N              the whole sweep N times; each figure is the median of the N\n"
    "                          (default 1)\n"
    "  --ops LIST              all_reduce,all_gather,reduce_scatter,broadcast (default all)\n"
    "  --dtype T               float32 or float64 (default float32)\n"
    "  --check-arguments 0|1   hpshard's per-collective argument agreement (default 1)\n"
    "  --transport shm|tcp     hpshard's transport between its same-host ranks (default shm)\n"
    "  --json FILE             also write every figure as one JSON object\n"
    "  --no-torch              skip the torch.distributed column\n"
    "  --torch-script FILE     torch_coll.py (default: beside the sources, or\n"
    "                          $HPS_BENCH_TORCH_SCRIPT)\n"
    "  --quiet                 no progress lines on stderr\n"
    "  S is the total bytes of the operation (for all_gather and reduce_scatter: count per\n"
    "  rank x ranks, as nccl-tests); busbw uses nccl-tests' factors.\n"
    "\n"
    "usage: hpshard-bench clip [options]\n"
    "  Global-norm clipping (HybridClip, one rank) of a model's gradients beside a copy of\n"
    "  the same bytes; AdamW with the clip folded in beside AdamW alone; the deterministic\n"
    "  mode's cost; torch.nn.utils.clip_grad_norm_ on the same tensors when importable.\n"
    "  --sizes LIST            models: total gradient bytes (suffix K, M or G), ':mixed' for\n"
    "                          bf16 weights and fp32 biases (default 16M,64M,32M:mixed)\n"
    "  --iters N               timed iterations per model (default: 7 .. 31 by size)\n"
    "  --warmup N              untimed iterations per model (default 2)\n"
    "  --max-norm X            the clip's max_norm (default 1)\n"
    "  --json FILE, --no-torch, --torch-script FILE (torch_clip.py), --quiet: as for coll\n"
    "\n"
    "usage: hpshard-bench step [options]\n"
    "  A training step of an MLP (forward/backward in the bench) with ranks as threads:\n"
    "  Stage2Engine and Stage3Engine beside unsharded data parallel (all-reduce avg,\n"
    "  optimizer on the full parameters) on the same backend; torch DDP +\n"
    "  ZeroRedundancyOptimizer(Adam) + clip_grad_norm_ when importable.\n"
    "  --ranks LIST            world sizes (default 2,4)\n"
    "  --width N, --depth N    the MLP (default 1024, 8)\n"
    "  --batch N               samples per rank per step (default 8)\n"
    "  --steps N               steps per timed repetition (default 3)\n"
    "  --reps N, --warmup N    timed and untimed repetitions (default 5, 1)\n"
    "  --optimizer adamw|sgd   (default adamw; sgd: momentum 0.9)\n"
    "  --clip X                global-norm max_norm, 0 for none (default 1)\n"
    "  --prefetch-window N     stage 3: units live at once, prefetch included (default 2)\n"
    "  --device cpu|cuda[:N]   instead: the runtime's own step on that device at world size 1\n"
    "                          (no model compute; synthetic gradients), beside the optimizer\n"
    "                          kernel alone; exit 77 when the device is absent\n"
    "  --trace-overhead        also time stage 2 and 3 while the timeline records (HPS_TRACE)\n"
    "  --json FILE, --no-torch, --torch-script FILE (torch_step.py), --quiet: as for coll\n"
    "\n"
    "usage: hpshard-bench torch [options]\n"
    "  One PyTorch transformer (examples/python/gpt.py) with the same torch forward and\n"
    "  backward for every contender: hpshard stage 2 and stage 3 through hpshard.torch,\n"
    "  torch DDP + ZeroRedundancyOptimizer(AdamW) + clip_grad_norm_, torch DDP unsharded\n"
    "  (FSDP where it imports), and the compute alone; ranks as processes. Step time,\n"
    "  resident bytes per rank, host syncs. Options (torch_peer.py): --ranks LIST,\n"
    "  --width N, --layers N, --heads N, --context N, --vocab N, --batch N (per rank),\n"
    "  --steps N, --reps N, --warmup N, --clip X, --prefetch-window N, --json FILE,\n"
    "  --quiet; --torch-script FILE (default: torch_peer.py beside the sources, or\n"
    "  $HPS_BENCH_TORCH_SCRIPT).\n"
    "\n"
    "usage: hpshard-bench ckpt [options]\n"
    "  Checkpoints of a Stage2Engine (AdamW, ranks as threads): save and load beside each\n"
    "  rank writing (with fsync) and reading (cold cache) as many bytes plainly; a step while\n"
    "  an asynchronous save is written beside the same step without one.\n"
    "  --ranks N               ranks (default 2)\n"
    "  --bytes SIZE            fp32 parameter bytes (suffix K, M or G; AdamW saves 3x; default "
    "64M)\n"
    "  --tensors N             parameters, one unit each (default 8)\n"
    "  --reps N                repetitions (default 3)\n"
    "  --steps N               steps timed with and without a save, per repetition (default 6)\n"
    "  --compute-passes N      passes over the parameters in a step's compute (default 4)\n"
    "  --dir DIR               where the checkpoints go (default: a temporary directory)\n"
    "  --json FILE, --quiet: as for coll\n";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "hpshard-bench: %s\n%s", message.c_str(), kUsage);
  std::exit(kUsageError);
}

std::optional<long long> parse_integer(std::string_view text) {
  long long v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return v;
}

std::vector<std::string> split_list(std::string_view text) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const size_t end = comma == std::string_view::npos ? text.size() : comma;
    if (end > start) parts.emplace_back(text.substr(start, end - start));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return parts;
}

struct Cli {
  CollConfig config;
  std::string json_path;
  bool torch = true;
  std::string torch_script;
};

Cli parse(int argc, char** argv) {
  Cli cli;
  auto& c = cli.config;
  for (int i = 2; i < argc; ++i) {
    const std::string_view flag = argv[i];
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) usage_error(std::string(flag) + " needs a value");
      return argv[++i];
    };
    auto integer = [&](long long min, long long max) -> long long {
      const std::string_view v = value();
      auto n = parse_integer(v);
      if (!n || *n < min || *n > max) {
        usage_error(std::string(flag) + ": '" + std::string(v) + "' is not an integer in [" +
                    std::to_string(min) + ", " + std::to_string(max) + "]");
      }
      return *n;
    };
    if (flag == "--ranks") {
      c.ranks.clear();
      for (const auto& part : split_list(value())) {
        auto n = parse_integer(part);
        if (!n || *n < 2 || *n > 64) usage_error("--ranks: '" + part + "' is not in [2, 64]");
        c.ranks.push_back(static_cast<int32_t>(*n));
      }
      if (c.ranks.empty()) usage_error("--ranks: empty list");
    } else if (flag == "--min-bytes") {
      c.min_bytes = static_cast<size_t>(integer(1, 1LL << 31));
    } else if (flag == "--max-bytes") {
      c.max_bytes = static_cast<size_t>(integer(1, 1LL << 31));
    } else if (flag == "--iters") {
      c.iters = static_cast<int32_t>(integer(1, 100000));
    } else if (flag == "--warmup") {
      c.warmup = static_cast<int32_t>(integer(0, 100000));
    } else if (flag == "--repeat") {
      c.repeat = static_cast<int32_t>(integer(1, 100));
    } else if (flag == "--ops") {
      c.ops.clear();
      for (const auto& part : split_list(value())) {
        auto op = coll_op_from_name(part);
        if (!op) usage_error("--ops: unknown operation '" + part + "'");
        c.ops.push_back(*op);
      }
      if (c.ops.empty()) usage_error("--ops: empty list");
    } else if (flag == "--dtype") {
      const std::string_view v = value();
      auto dtype = hps::dtype_from_name(v);
      if (!dtype.ok() || (*dtype != hps::DType::kFloat32 && *dtype != hps::DType::kFloat64)) {
        usage_error("--dtype: '" + std::string(v) + "' is not float32 or float64");
      }
      c.dtype = *dtype;
    } else if (flag == "--transport") {
      const std::string v(value());
      if (v != "shm" && v != "tcp") usage_error("--transport: '" + v + "' is not shm or tcp");
      c.shared_memory = v == "shm";
    } else if (flag == "--check-arguments") {
      c.check_arguments = integer(0, 1) == 1;
    } else if (flag == "--json") {
      cli.json_path = value();
    } else if (flag == "--no-torch") {
      cli.torch = false;
    } else if (flag == "--torch-script") {
      cli.torch_script = value();
    } else if (flag == "--quiet") {
      c.progress = false;
    } else if (flag == "-h" || flag == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else {
      usage_error("unknown option '" + std::string(flag) + "'");
    }
  }
  if (c.min_bytes > c.max_bytes) usage_error("--min-bytes is larger than --max-bytes");
  return cli;
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

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

std::string run_and_capture(const std::string& command, int* status) {
  std::string output;
  std::FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) {
    *status = -1;
    return output;
  }
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, n);
  *status = ::pclose(pipe);
  return output;
}

// The torch side: which script, and whether /usr/bin/python3 imports torch.
std::string find_script(const std::string& explicit_path, const std::string& name) {
  if (!explicit_path.empty()) return explicit_path;
  if (const char* env = std::getenv("HPS_BENCH_TORCH_SCRIPT"); env && *env) return env;
  const std::string beside = std::string(HPS_BENCH_SOURCE_DIR) + "/" + name;
  std::error_code ec;
  if (std::filesystem::exists(beside, ec)) return beside;
  return {};
}

// Minimal field extraction from the flat one-result-per-line JSON torch_coll.py writes.
std::optional<std::string> json_field(const std::string& line, const std::string& key) {
  const std::string needle = "\"" + key + "\": ";
  const size_t at = line.find(needle);
  if (at == std::string::npos) return std::nullopt;
  size_t start = at + needle.size();
  size_t end = start;
  if (line[start] == '"') {
    end = line.find('"', start + 1);
    if (end == std::string::npos) return std::nullopt;
    return line.substr(start + 1, end - start - 1);
  }
  while (end < line.size() && line[end] != ',' && line[end] != '}') ++end;
  return line.substr(start, end - start);
}

// Runs torch_coll.py at `world.ranks` ranks on the same cases and fills torch_seconds.
// Returns an empty string when it ran, else why not.
std::string run_torch(const std::string& script, const CollConfig& config, WorldResult& world,
                      std::string* version) {
  std::ostringstream cases;
  for (size_t i = 0; i < world.rows.size(); ++i) {
    const auto& r = world.rows[i];
    cases << (i ? "," : "") << coll_op_name(r.op) << ":" << r.count << ":" << r.iters << ":"
          << warmup_for(config, r.bytes);
  }
  const auto out = std::filesystem::temp_directory_path() /
                   ("hpshard-bench-torch-" + std::to_string(::getpid()) + ".json");
  const std::string command = "timeout 1800 /usr/bin/python3 " + shell_quote(script) + " --ranks " +
                              std::to_string(world.ranks) + " --dtype " +
                              std::string(hps::dtype_name(config.dtype)) + " --cases " +
                              cases.str() + " --out " + shell_quote(out.string()) + " 2>&1";
  if (config.progress) {
    std::fprintf(stderr, "[hpshard-bench] torch.distributed gloo, %d ranks\n", world.ranks);
  }
  int status = 0;
  const std::string log = run_and_capture(command, &status);
  std::ifstream in(out);
  if (status != 0 || !in) {
    std::error_code ec;
    std::filesystem::remove(out, ec);
    return "torch_coll.py failed (status " + std::to_string(status) +
           "): " + log.substr(log.size() > 2000 ? log.size() - 2000 : 0);
  }
  std::string line;
  while (std::getline(in, line)) {
    if (auto v = json_field(line, "torch_version")) *version = *v;
    auto op_name = json_field(line, "op");
    auto count = json_field(line, "count");
    auto seconds = json_field(line, "seconds");
    if (!op_name || !count || !seconds || *seconds == "null") continue;
    auto op = coll_op_from_name(*op_name);
    for (auto& row : world.rows) {
      if (op && row.op == *op && std::to_string(row.count) == *count) {
        row.torch_seconds = std::strtod(seconds->c_str(), nullptr);
      }
    }
  }
  std::error_code ec;
  std::filesystem::remove(out, ec);
  return {};
}

RunInfo run_info(int argc, char** argv) {
  RunInfo info;
  info.date = utc_now();
  info.machine = machine_text();
  for (int i = 0; i < argc; ++i) {
    if (i) info.command += ' ';
    info.command += argv[i];
  }
  return info;
}

int write_json(const std::string& path, const std::string& text) {
  if (path.empty()) return 0;
  std::ofstream json(path);
  json << text;
  if (!json.flush()) {
    std::fprintf(stderr, "hpshard-bench: cannot write %s\n", path.c_str());
    return 1;
  }
  return 0;
}

// Whether the torch column can run: fills info.torch and returns the script (or "").
std::string torch_setup(bool wanted, const std::string& explicit_path, const std::string& name,
                        RunInfo& info) {
  std::string script;
  if (!wanted) {
    info.torch = "skipped (--no-torch)";
  } else if (std::system("/usr/bin/python3 -c 'import torch.distributed as d; "
                         "assert d.is_available()' >/dev/null 2>&1") != 0) {
    info.torch = "not installed";
  } else if ((script = find_script(explicit_path, name)).empty()) {
    info.torch = name + " not found (--torch-script or HPS_BENCH_TORCH_SCRIPT), skipped";
  } else {
    info.torch = "torch";
  }
  if (script.empty()) std::printf("torch: %s\n", info.torch.c_str());
  return script;
}

std::filesystem::path temp_path(const std::string& what) {
  return std::filesystem::temp_directory_path() /
         ("hpshard-bench-" + what + "-" + std::to_string(::getpid()) + ".json");
}

// ---- clip ----

struct ClipCli {
  ClipConfig config;
  std::string json_path;
  bool torch = true;
  std::string torch_script;
};

std::optional<size_t> parse_bytes(std::string_view text) {
  size_t multiplier = 1;
  if (!text.empty()) {
    const char last = text.back();
    if (last == 'K' || last == 'k') multiplier = size_t{1} << 10;
    if (last == 'M' || last == 'm') multiplier = size_t{1} << 20;
    if (last == 'G' || last == 'g') multiplier = size_t{1} << 30;
    if (multiplier != 1) text.remove_suffix(1);
  }
  auto n = parse_integer(text);
  if (!n || *n < 1 || static_cast<unsigned long long>(*n) > (size_t{4} << 30) / multiplier) {
    return std::nullopt;
  }
  return static_cast<size_t>(*n) * multiplier;
}

// Shared option loop of clip and step: calls `own` for family options, handles the rest.
template <typename OwnFlag>
void parse_options(int argc, char** argv, std::string& json_path, bool& torch,
                   std::string& torch_script, bool& progress, OwnFlag own) {
  for (int i = 2; i < argc; ++i) {
    const std::string_view flag = argv[i];
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) usage_error(std::string(flag) + " needs a value");
      return argv[++i];
    };
    auto integer = [&](long long min, long long max) -> long long {
      const std::string_view v = value();
      auto n = parse_integer(v);
      if (!n || *n < min || *n > max) {
        usage_error(std::string(flag) + ": '" + std::string(v) + "' is not an integer in [" +
                    std::to_string(min) + ", " + std::to_string(max) + "]");
      }
      return *n;
    };
    auto real = [&](double min, double max) -> double {
      const std::string v(value());
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(x >= min && x <= max)) {
        usage_error(std::string(flag) + ": '" + v + "' is not a number in [" + std::to_string(min) +
                    ", " + std::to_string(max) + "]");
      }
      return x;
    };
    if (own(flag, value, integer, real)) continue;
    if (flag == "--json") {
      json_path = value();
    } else if (flag == "--no-torch") {
      torch = false;
    } else if (flag == "--torch-script") {
      torch_script = value();
    } else if (flag == "--quiet") {
      progress = false;
    } else if (flag == "-h" || flag == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else {
      usage_error("unknown option '" + std::string(flag) + "'");
    }
  }
}

ClipCli parse_clip(int argc, char** argv) {
  ClipCli cli;
  auto& c = cli.config;
  parse_options(argc, argv, cli.json_path, cli.torch, cli.torch_script, c.progress,
                [&](std::string_view flag, auto& value, auto& integer, auto& real) {
                  if (flag == "--sizes") {
                    c.models.clear();
                    for (const auto& part : split_list(value())) {
                      std::string_view text = part;
                      ClipModel model;
                      if (const size_t colon = text.find(':'); colon != std::string_view::npos) {
                        const std::string_view kind = text.substr(colon + 1);
                        if (kind == "mixed") {
                          model.mixed = true;
                        } else if (kind != "fp32") {
                          usage_error("--sizes: '" + part + "': the kind is fp32 or mixed");
                        }
                        text = text.substr(0, colon);
                      }
                      auto bytes = parse_bytes(text);
                      if (!bytes || *bytes < 64) {
                        usage_error("--sizes: '" + part + "' is not a size from 64 B to 4G");
                      }
                      model.bytes = *bytes;
                      c.models.push_back(model);
                    }
                    if (c.models.empty()) usage_error("--sizes: empty list");
                  } else if (flag == "--iters") {
                    c.iters = static_cast<int32_t>(integer(1, 100000));
                  } else if (flag == "--warmup") {
                    c.warmup = static_cast<int32_t>(integer(0, 100000));
                  } else if (flag == "--max-norm") {
                    c.max_norm = real(1e-6, 1e30);
                  } else {
                    return false;
                  }
                  return true;
                });
  return cli;
}

// torch_clip.py on the same tensors: a case file, one model per line
// "index iters warmup max_norm dtype:count ...", and one result per line back.
std::string run_torch_clip(const std::string& script, const ClipConfig& config,
                           std::vector<ClipRow>& rows, std::string* version) {
  const auto cases = temp_path("clip-cases");
  const auto out = temp_path("clip-torch");
  {
    std::ofstream spec(cases);
    for (size_t i = 0; i < rows.size(); ++i) {
      spec << i << " " << rows[i].iters << " " << config.warmup << " " << config.max_norm;
      for (const auto& t : model_tensors(rows[i].model)) {
        spec << " " << (t.dtype == hps::DType::kBFloat16 ? "bfloat16" : "float32") << ":"
             << t.count;
      }
      spec << "\n";
    }
  }
  const std::string command = "timeout 1800 /usr/bin/python3 " + shell_quote(script) + " --cases " +
                              shell_quote(cases.string()) + " --out " + shell_quote(out.string()) +
                              " 2>&1";
  if (config.progress) std::fprintf(stderr, "[hpshard-bench] torch clip_grad_norm_\n");
  int status = 0;
  const std::string log = run_and_capture(command, &status);
  std::error_code ec;
  std::filesystem::remove(cases, ec);
  std::ifstream in(out);
  if (status != 0 || !in) {
    std::filesystem::remove(out, ec);
    return "torch_clip.py failed (status " + std::to_string(status) +
           "): " + log.substr(log.size() > 2000 ? log.size() - 2000 : 0);
  }
  std::string line;
  while (std::getline(in, line)) {
    if (auto v = json_field(line, "torch_version")) *version = *v;
    auto index = json_field(line, "index");
    auto seconds = json_field(line, "seconds");
    if (!index || !seconds || *seconds == "null") continue;
    const size_t i = std::strtoul(index->c_str(), nullptr, 10);
    if (i < rows.size()) rows[i].torch_seconds = std::strtod(seconds->c_str(), nullptr);
  }
  std::filesystem::remove(out, ec);
  return {};
}

int main_clip(int argc, char** argv) {
  ClipCli cli = parse_clip(argc, argv);
  RunInfo info = run_info(argc, argv);
  const std::string script = torch_setup(cli.torch, cli.torch_script, "torch_clip.py", info);
  std::vector<ClipRow> rows = run_clip(cli.config);
  if (!script.empty()) {
    std::string version;
    const std::string why = run_torch_clip(script, cli.config, rows, &version);
    if (!why.empty()) {
      info.torch = why;
      std::fprintf(stderr, "hpshard-bench: torch column dropped: %s\n", why.c_str());
    } else {
      info.torch_ran = true;
      info.torch = "torch " + version +
                   " torch.nn.utils.clip_grad_norm_ (1 intra-op thread, measured after hpshard)";
    }
  }
  print_clip(stdout, cli.config, info, rows);
  return write_json(cli.json_path, clip_to_json(cli.config, info, rows));
}

// ---- step ----

struct StepCli {
  StepConfig config;
  std::string json_path;
  bool torch = true;
  std::string torch_script;
};

StepCli parse_step(int argc, char** argv) {
  StepCli cli;
  auto& c = cli.config;
  parse_options(argc, argv, cli.json_path, cli.torch, cli.torch_script, c.progress,
                [&](std::string_view flag, auto& value, auto& integer, auto& real) {
                  if (flag == "--ranks") {
                    c.ranks.clear();
                    for (const auto& part : split_list(value())) {
                      auto n = parse_integer(part);
                      if (!n || *n < 1 || *n > 16) {
                        usage_error("--ranks: '" + part + "' is not in [1, 16]");
                      }
                      c.ranks.push_back(static_cast<int32_t>(*n));
                    }
                    if (c.ranks.empty()) usage_error("--ranks: empty list");
                  } else if (flag == "--width") {
                    c.width = static_cast<int32_t>(integer(1, 16384));
                  } else if (flag == "--depth") {
                    c.depth = static_cast<int32_t>(integer(1, 256));
                  } else if (flag == "--batch") {
                    c.batch = static_cast<int32_t>(integer(1, 4096));
                  } else if (flag == "--steps") {
                    c.steps = static_cast<int32_t>(integer(1, 10000));
                  } else if (flag == "--reps") {
                    c.reps = static_cast<int32_t>(integer(1, 10000));
                  } else if (flag == "--warmup") {
                    c.warmup = static_cast<int32_t>(integer(0, 10000));
                  } else if (flag == "--optimizer") {
                    const std::string_view v = value();
                    if (v != "adamw" && v != "sgd") usage_error("--optimizer: adamw or sgd");
                    c.adamw = v == "adamw";
                  } else if (flag == "--clip") {
                    c.clip = real(0, 1e30);
                  } else if (flag == "--prefetch-window") {
                    c.prefetch_window = static_cast<int32_t>(integer(1, 1024));
                  } else if (flag == "--device") {
                    c.device = std::string(value());
                    if (!hps::parse_device(c.device).ok()) {
                      usage_error("--device: '" + c.device + "' is not cpu, cuda or cuda:N");
                    }
                  } else if (flag == "--trace-overhead") {
                    c.trace_overhead = true;
                  } else {
                    return false;
                  }
                  return true;
                });
  return cli;
}

// torch_step.py at `world.ranks` ranks on the same model; fills the torch figures.
std::string run_torch_step(const std::string& script, const StepConfig& config, StepWorld& world,
                           std::string* version) {
  const auto out = temp_path("step-torch");
  const std::string command =
      "timeout 1800 /usr/bin/python3 " + shell_quote(script) + " --ranks " +
      std::to_string(world.ranks) + " --width " + std::to_string(config.width) + " --depth " +
      std::to_string(config.depth) + " --batch " + std::to_string(config.batch) + " --steps " +
      std::to_string(config.steps) + " --reps " + std::to_string(config.reps) + " --warmup " +
      std::to_string(config.warmup) + " --clip " + std::to_string(config.clip) + " --optimizer " +
      (config.adamw ? "adam" : "sgd") + " --threads 1 --out " + shell_quote(out.string()) + " 2>&1";
  if (config.progress) {
    std::fprintf(stderr, "[hpshard-bench] torch DDP + ZeroRedundancyOptimizer, %d ranks\n",
                 world.ranks);
  }
  int status = 0;
  const std::string log = run_and_capture(command, &status);
  std::ifstream in(out);
  std::error_code ec;
  if (status != 0 || !in) {
    std::filesystem::remove(out, ec);
    return "torch_step.py failed (status " + std::to_string(status) +
           "): " + log.substr(log.size() > 2000 ? log.size() - 2000 : 0);
  }
  std::string line;
  while (std::getline(in, line)) {
    if (auto v = json_field(line, "torch_version")) *version = *v;
    if (auto v = json_field(line, "seconds"); v && *v != "null") {
      world.torch_seconds = std::strtod(v->c_str(), nullptr);
    }
    if (auto v = json_field(line, "compute_seconds"); v && *v != "null") {
      world.torch_compute_seconds = std::strtod(v->c_str(), nullptr);
    }
  }
  std::filesystem::remove(out, ec);
  return {};
}

// Runs every world size, each followed by torch's figures while torch keeps working; a
// torch failure drops its column (the reason goes into info.torch), otherwise info.torch
// becomes describe(torch's version).
template <typename World, typename RunWorld, typename RunTorch, typename Describe>
std::vector<World> run_worlds(const std::vector<int32_t>& ranks, const std::string& script,
                              RunInfo& info, RunWorld run_world_at, RunTorch run_torch_beside,
                              Describe describe) {
  std::vector<World> worlds;
  std::string version;
  bool torch_failed = false;
  for (int32_t n : ranks) {
    worlds.push_back(run_world_at(n));
    if (!script.empty() && !torch_failed) {
      const std::string why = run_torch_beside(worlds.back(), &version);
      if (!why.empty()) {
        torch_failed = true;
        info.torch = why;
        std::fprintf(stderr, "hpshard-bench: torch column dropped: %s\n", why.c_str());
      }
    }
  }
  if (!script.empty() && !torch_failed) {
    info.torch_ran = true;
    info.torch = describe(version);
  }
  return worlds;
}

int main_step(int argc, char** argv) {
  StepCli cli = parse_step(argc, argv);
  if (!cli.config.device.empty()) {
    DeviceStepConfig d;
    d.device = *hps::parse_device(cli.config.device);
    d.width = cli.config.width;
    d.depth = cli.config.depth;
    d.steps = cli.config.steps;
    d.reps = cli.config.reps;
    d.warmup = cli.config.warmup;
    d.adamw = cli.config.adamw;
    d.clip = cli.config.clip;
    if (d.device.type == hps::DeviceType::kCuda && hps::device_count(hps::DeviceType::kCuda) == 0) {
      std::fprintf(stderr, "hpshard-bench: no CUDA device\n");
      return 77;
    }
    const DeviceStepResult r = run_device_step(d);
    print_device_step(d, r);
    return write_json(cli.json_path, device_step_to_json(d, r));
  }
  RunInfo info = run_info(argc, argv);
  const std::string script = torch_setup(cli.torch, cli.torch_script, "torch_step.py", info);
  auto worlds = run_worlds<StepWorld>(
      cli.config.ranks, script, info,
      [&](int32_t ranks) { return run_step_world(cli.config, ranks); },
      [&](StepWorld& world, std::string* version) {
        return run_torch_step(script, cli.config, world, version);
      },
      [&](const std::string& version) {
        return "torch " + version + " DDP + ZeroRedundancyOptimizer(" +
               (cli.config.adamw ? "Adam" : "SGD") +
               ") + clip_grad_norm_, gloo, processes, 1 intra-op thread each, measured after "
               "hpshard";
      });
  print_step(stdout, cli.config, info, worlds);
  return write_json(cli.json_path, step_to_json(cli.config, info, worlds));
}

// ---- ckpt ----

int main_ckpt(int argc, char** argv) {
  CkptConfig c;
  std::string json_path, unused_script;
  bool unused_torch = false;
  parse_options(argc, argv, json_path, unused_torch, unused_script, c.progress,
                [&](std::string_view flag, auto& value, auto& integer, auto&) {
                  if (flag == "--ranks") {
                    c.ranks = static_cast<int32_t>(integer(1, 16));
                  } else if (flag == "--bytes") {
                    const std::string v(value());
                    auto bytes = parse_bytes(v);
                    if (!bytes || *bytes < 4096)
                      usage_error("--bytes: '" + v + "' is not 4K to 4G");
                    c.bytes = *bytes;
                  } else if (flag == "--tensors") {
                    c.tensors = static_cast<int32_t>(integer(1, 1024));
                  } else if (flag == "--reps") {
                    c.reps = static_cast<int32_t>(integer(1, 1000));
                  } else if (flag == "--steps") {
                    c.steps = static_cast<int32_t>(integer(1, 10000));
                  } else if (flag == "--compute-passes") {
                    c.compute_passes = static_cast<int32_t>(integer(0, 1000));
                  } else if (flag == "--dir") {
                    c.dir = value();
                  } else {
                    return false;
                  }
                  return true;
                });
  RunInfo info = run_info(argc, argv);
  info.torch = "no torch column for checkpoints";
  const CkptResult result = run_ckpt(c);
  print_ckpt(stdout, c, info, result);
  if (write_json(json_path, ckpt_to_json(c, info, result)) != 0) return 1;
  return result.loaded_equal ? 0 : 1;
}

// The torch family runs entirely in torch_peer.py (every contender is torch compute); this
// finds the script, the model and the Python binding, and passes the options through.
int main_torch(int argc, char** argv) {
  std::string script;
  std::vector<std::string> pass;
  for (int i = 2; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--torch-script") {
      if (i + 1 >= argc) usage_error("--torch-script needs a value");
      script = argv[++i];
    } else {
      pass.emplace_back(argv[i]);
    }
  }
  script = find_script(script, "torch_peer.py");
  if (script.empty()) usage_error("torch_peer.py not found (--torch-script)");
  const auto models =
      std::filesystem::path(HPS_BENCH_SOURCE_DIR) / ".." / ".." / "examples" / "python";
  std::string command = "/usr/bin/python3 " + shell_quote(script) + " --model-dir " +
                        shell_quote(models.lexically_normal().string());
  for (const auto& a : pass) command += " " + shell_quote(a);
#ifdef HPS_BENCH_PYTHON_DIR
  const char* old = std::getenv("PYTHONPATH");
  const std::string path =
      std::string(HPS_BENCH_PYTHON_DIR) + (old && *old ? ":" + std::string(old) : "");
  ::setenv("PYTHONPATH", path.c_str(), 1);
#endif
  const int status = std::system(command.c_str());
  return status == 0 ? 0 : 1;
}

int main_coll(int argc, char** argv) {
  Cli cli = parse(argc, argv);
  RunInfo info = run_info(argc, argv);
  const std::string script = torch_setup(cli.torch, cli.torch_script, "torch_coll.py", info);
  auto worlds = run_worlds<WorldResult>(
      cli.config.ranks, script, info,
      [&](int32_t ranks) { return run_world_repeated(cli.config, ranks); },
      [&](WorldResult& world, std::string* version) {
        return run_torch(script, cli.config, world, version);
      },
      [](const std::string& version) {
        return "torch " + version + " torch.distributed gloo (processes, 127.0.0.1)";
      });
  print_tables(stdout, cli.config, info, worlds);
  return write_json(cli.json_path, to_json(cli.config, info, worlds));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) usage_error("missing the benchmark family");
  const std::string_view family = argv[1];
  if (family == "-h" || family == "--help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (family == "coll") return main_coll(argc, argv);
  if (family == "clip") return main_clip(argc, argv);
  if (family == "step") return main_step(argc, argv);
  if (family == "ckpt") return main_ckpt(argc, argv);
  if (family == "torch") return main_torch(argc, argv);
  usage_error("unknown benchmark family '" + std::string(family) + "'");
}
