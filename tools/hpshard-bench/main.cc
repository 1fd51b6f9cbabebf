// hpshard-bench: hpshard's benchmarks, printed as tables with the reference measured in
// the same run beside each figure (docs/benchmarks.md). One subcommand per family (coll,
// clip, step, ckpt, torch), each set up by its own add_<family>() below: its options
// (CLI11) and what it runs. `hpshard-bench FAMILY --help` lists a family's options.
//
// Exit status: 0 when every case ran and gave the right result; 1 on an error or a wrong
// result; 2 for bad usage.
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/common/output_file.h"
#include "core/kernels/cpu/kernel_set.h"
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

// An output the run will write (--json, --plot): refused at once when it is no regular
// file (a directory, a FIFO the write would block on), not after the whole run.
CLI::Validator output_path() {
  return CLI::Validator(
      [](std::string& text) {
        if (text.empty()) return std::string("an empty path");
        const hps::OutputFile checked = hps::output_file(text);
        return checked.error.empty() ? std::string() : "'" + text + "': " + checked.error;
      },
      "FILE");
}

// CLI11 reads integers with base 0 (010 is 8, 0x10 is 16): integer options take decimal
// digits only.
CLI::Validator decimal() {
  return CLI::Validator(
      [](std::string& text) {
        const bool digits =
            !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
        return digits && (text.size() == 1 || text[0] != '0')
                   ? std::string()
                   : "'" + text + "' is not a decimal integer";
      },
      "INT");
}

// A finite number: CLI::Range compares, and every comparison with NaN is false, so 'nan'
// passed a range check and failed in the engine (exit 1 instead of a usage error).
CLI::Validator finite_number() {
  return CLI::Validator(
      [](std::string& text) {
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        return !text.empty() && *end == '\0' && std::isfinite(value)
                   ? std::string()
                   : "'" + text + "' is not a finite number";
      },
      "NUMBER");
}

using namespace hps::bench;

constexpr int kUsageError = 2;

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "hpshard-bench: %s (see --help)\n", message.c_str());
  std::exit(kUsageError);
}

// ---- what every family shares ----

// A list option's values each once: a value given twice ran its sweep twice, and a table
// printed twice held both runs' rows. `same(a, b)`: whether two values measure one thing
// ("16M" and "16777216" are one model).
template <typename T, typename Same>
void refuse_repeats(const char* option, const std::vector<T>& values, Same same,
                    const std::function<std::string(const T&)>& show) {
  for (size_t i = 1; i < values.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (!same(values[j], values[i])) continue;
      const std::string first = show(values[j]), again = show(values[i]);
      usage_error(std::string(option) + ": " + first +
                  (first == again ? " is given twice" : " and " + again + " are one value"));
    }
  }
}

void refuse_repeats(const char* option, const std::vector<int32_t>& values) {
  refuse_repeats<int32_t>(option, values, std::equal_to<>(),
                          [](const int32_t& v) { return std::to_string(v); });
}

void refuse_repeats(const char* option, const std::vector<std::string>& values) {
  refuse_repeats<std::string>(option, values, std::equal_to<>(),
                              [](const std::string& v) { return "'" + v + "'"; });
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// A peer's process group while it runs (run_in_own_group): SIGINT, SIGTERM and SIGHUP sent
// to the bench go to every process of it (the script and the ranks it spawned), not to the
// script alone.
volatile sig_atomic_t g_child_group = 0;
volatile sig_atomic_t g_forwarded_signal = 0;

void forward_to_child(int signal) {
  g_forwarded_signal = signal;
  if (g_child_group > 0) ::kill(-static_cast<pid_t>(g_child_group), signal);
}

// Runs argv (argv[0] a path) in a process group of its own and waits for it; a signal sent to
// the bench is forwarded to that group, and whatever of the group outlives the script is
// killed, so no rank is left running under pid 1. The script gets SIGTERM when the bench dies
// (PR_SET_PDEATHSIG; its ranks die with it in turn). With `stdout_text`, its standard output
// is collected there instead. Returns its exit code, 128 + a signal that ended it or that the
// bench was sent (the bench's own signal actions are back by then), 1 when it could not
// start.
int run_in_own_group(std::vector<std::string> args, std::string* stdout_text = nullptr) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int output[2] = {-1, -1};
  if (stdout_text && ::pipe2(output, O_CLOEXEC) != 0) {
    std::fprintf(stderr, "hpshard-bench: pipe: %s\n", std::strerror(errno));
    return 1;
  }
  sigset_t all, previous;
  sigfillset(&all);
  ::sigprocmask(SIG_SETMASK, &all, &previous);
  const pid_t bench = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != bench) ::_exit(128 + SIGTERM);
    for (int s : {SIGINT, SIGTERM, SIGHUP}) std::signal(s, SIG_DFL);
    if (output[1] >= 0) ::dup2(output[1], STDOUT_FILENO);
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    ::execv(argv[0], argv.data());
    std::fprintf(stderr, "hpshard-bench: cannot run %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  if (output[1] >= 0) ::close(output[1]);
  if (pid < 0) {
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    std::fprintf(stderr, "hpshard-bench: fork: %s\n", std::strerror(errno));
    if (output[0] >= 0) ::close(output[0]);
    return 1;
  }
  ::setpgid(pid, pid);  // also here: the group exists before a signal is forwarded to it
  g_child_group = pid;
  g_forwarded_signal = 0;
  constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP};
  struct sigaction action {
  }, before[3];
  action.sa_handler = forward_to_child;
  sigemptyset(&action.sa_mask);
  for (int i = 0; i < 3; ++i) ::sigaction(kForwarded[i], &action, &before[i]);
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  int status = 0;
  bool reaped = false;
  char buffer[4096];
  // Its output until it ends (a process it started may hold the pipe open longer).
  while (output[0] >= 0 && !reaped) {
    pollfd readable{output[0], POLLIN, 0};
    if (::poll(&readable, 1, 200) > 0) {
      const ssize_t n = ::read(output[0], buffer, sizeof buffer);
      if (n > 0) stdout_text->append(buffer, static_cast<size_t>(n));
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break;
    }
    reaped = ::waitpid(pid, &status, WNOHANG) == pid;
  }
  while (!reaped && ::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  // What the script left of its group (ranks, a resource tracker) goes with it.
  ::kill(-pid, SIGKILL);
  g_child_group = 0;
  for (int i = 0; i < 3; ++i) ::sigaction(kForwarded[i], &before[i], nullptr);
  if (output[0] >= 0) {  // the rest of its output: every writer is gone now
    ssize_t n = 0;
    while ((n = ::read(output[0], buffer, sizeof buffer)) > 0 || (n < 0 && errno == EINTR)) {
      if (n > 0) stdout_text->append(buffer, static_cast<size_t>(n));
    }
    ::close(output[0]);
  }
  if (g_forwarded_signal != 0) return 128 + g_forwarded_signal;
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

// A peer's shell command, its standard output captured; *status its exit code (128 + a
// signal). A signal the bench was sent meanwhile ends the bench too, once the peer's whole
// group is gone.
std::string run_and_capture(const std::string& command, int* status) {
  std::string output;
  *status = run_in_own_group({"/bin/sh", "-c", command}, &output);
  if (g_forwarded_signal != 0) std::raise(g_forwarded_signal);
  return output;
}

std::string tail_of(const std::string& log) {
  return log.substr(log.size() > 2000 ? log.size() - 2000 : 0);
}

std::filesystem::path temp_path(const std::string& what) {
  return std::filesystem::temp_directory_path() /
         ("hpshard-bench-" + what + "-" + std::to_string(::getpid()) + ".json");
}

// Where an installed hpshard-bench finds its scripts and gpt.py: <prefix>/share/hpshard/bench
// beside <prefix>/bin/hpshard-bench (the packages put them there). Empty when the binary runs
// from a build tree (no such directory), which uses the sources instead.
std::filesystem::path installed_data_dir() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  const auto dir = exe.parent_path().parent_path() / "share" / "hpshard" / "bench";
  if (!std::filesystem::is_directory(dir, ec)) return {};
  return dir;
}

// A script of hpshard-bench: `explicit_path`, else $`env`, else the installed one, else
// beside the sources (a build tree).
std::string find_script(const std::string& explicit_path, const char* env,
                        const std::string& name) {
  if (!explicit_path.empty()) return explicit_path;
  if (const char* value = std::getenv(env); value && *value) return value;
  std::error_code ec;
  if (const auto installed = installed_data_dir(); !installed.empty()) {
    const auto path = installed / name;
    return std::filesystem::exists(path, ec) ? path.string() : std::string();
  }
  const std::string beside = std::string(HPS_BENCH_SOURCE_DIR) + "/" + name;
  if (std::filesystem::exists(beside, ec)) return beside;
  return {};
}

// The JSON document in `path`, or why not.
std::optional<Json> read_json(const std::filesystem::path& path, std::string* why) {
  std::ifstream in(path);
  if (!in) {
    *why = "cannot open " + path.string();
    return std::nullopt;
  }
  try {
    return Json::parse(in);
  } catch (const Json::exception& e) {
    *why = "cannot parse " + path.string() + ": " + e.what();
    return std::nullopt;
  }
}

// Options every family has.
struct CommonCli {
  std::string json_path;
  std::string plot_path;
  bool no_torch = false;
  std::string torch_script;
  bool quiet = false;
  std::string isa;  // empty: the best the CPU runs
};

void add_common(CLI::App& command, CommonCli& c, const std::string& torch_script, bool isa) {
  command.add_option("--json", c.json_path, "also write every figure as one JSON object")
      ->check(output_path());
  command
      .add_option("--plot", c.plot_path,
                  "also draw the figures into this PNG (python3-matplotlib, plot.py)")
      ->check(output_path());
  command.add_flag("--no-torch", c.no_torch, "skip the torch column");
  command.add_option("--torch-script", c.torch_script,
                     torch_script + " (default: $HPS_BENCH_TORCH_SCRIPT, else the installed " +
                         "share/hpshard/bench copy, else beside the sources in a build tree)");
  command.add_flag("--quiet", c.quiet, "no progress lines on stderr");
  if (isa) {
    command
        .add_option("--isa", c.isa, "the CPU kernels' variant (default: the best this CPU runs)")
        ->check(CLI::IsMember({"baseline", "avx2", "avx512"}));
  }
}

// Selects --isa (before any kernel runs) and notes the variant in use.
void use_isa(const CommonCli& cli, RunInfo& info) {
  if (!cli.isa.empty()) {
    const hps::Status s = hps::cpu::select_cpu_kernels(*hps::cpu::cpu_isa_from_name(cli.isa));
    if (!s.ok()) usage_error("--isa: " + s.to_string());
  }
  info.cpu_kernels = hps::cpu::cpu_isa_name(hps::cpu::active_cpu_kernels().isa);
  info.cpu_features = hps::cpu::cpu_feature_text();
}

// Whether the torch column can run: fills info.torch and returns the script (or "").
std::string torch_setup(const CommonCli& cli, const std::string& name, RunInfo& info) {
  std::string script;
  if (cli.no_torch) {
    info.torch = "skipped (--no-torch)";
  } else if (std::system("/usr/bin/python3 -c 'import torch.distributed as d; "
                         "assert d.is_available()' >/dev/null 2>&1") != 0) {
    info.torch = "not installed";
  } else if ((script = find_script(cli.torch_script, "HPS_BENCH_TORCH_SCRIPT", name)).empty()) {
    info.torch = name + " not found (--torch-script or HPS_BENCH_TORCH_SCRIPT), skipped";
  } else {
    info.torch = "torch";
  }
  if (script.empty()) std::printf("torch: %s\n", info.torch.c_str());
  return script;
}

// Writes the JSON (to --json, or for --plot alone to a scratch file) and draws --plot.
int finish(const CommonCli& cli, const char* family, RunInfo& info,
           const std::function<Json(const RunInfo&)>& to_json) {
  if (cli.json_path.empty() && cli.plot_path.empty()) return 0;
  info.load_after = load_average();
  const std::filesystem::path json_path = cli.json_path.empty()
                                              ? temp_path(std::string(family) + "-plot")
                                              : std::filesystem::path(cli.json_path);
  const std::string error = hps::write_output(json_path.string(), to_json(info).dump(2) + "\n");
  if (!error.empty()) {
    std::fprintf(stderr, "hpshard-bench: %s\n", error.c_str());
    return 1;
  }
  if (cli.plot_path.empty()) return 0;
  const std::string script = find_script("", "HPS_BENCH_PLOT_SCRIPT", "plot.py");
  int status = 0;
  std::string log;
  if (script.empty()) {
    log = "plot.py not found ($HPS_BENCH_PLOT_SCRIPT, installed, or beside the sources)";
    status = -1;
  } else {
    log = run_and_capture("/usr/bin/python3 " + shell_quote(script) + " " +
                              shell_quote(json_path.string()) + " " + shell_quote(cli.plot_path) +
                              " 2>&1",
                          &status);
  }
  if (cli.json_path.empty()) {
    std::error_code ec;
    std::filesystem::remove(json_path, ec);
  }
  if (status != 0) {
    std::fprintf(stderr, "hpshard-bench: --plot %s failed: %s\n", cli.plot_path.c_str(),
                 tail_of(log).c_str());
    return 1;
  }
  if (!cli.quiet)
    std::fprintf(stderr, "[hpshard-bench] chart written to %s\n", cli.plot_path.c_str());
  return 0;
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

// Sets up a subcommand: its options now, and what it runs once parsed.
struct Family {
  CLI::App* command = nullptr;
  std::function<int()> run;
};

// ---- coll ----

struct CollCli {
  CollConfig config;
  CommonCli common;
  std::string transport = "shm";
  std::string dtype = "float32";
  std::vector<std::string> ops;
  bool no_mpi = false;
  std::string mpi_helper;
};

// torch_coll.py at `world.ranks` ranks on the same cases; fills torch_seconds. Returns an
// empty string when it ran, else why not.
std::string run_torch_coll(const std::string& script, const CollConfig& config, WorldResult& world,
                           std::string* version) {
  std::ostringstream cases;
  for (size_t i = 0; i < world.rows.size(); ++i) {
    const auto& r = world.rows[i];
    cases << (i ? "," : "") << coll_op_name(r.op) << ":" << r.count << ":" << r.iters << ":"
          << warmup_for(config, r.bytes);
  }
  const auto out = temp_path("coll-torch");
  const std::string command = "timeout 1800 /usr/bin/python3 " + shell_quote(script) + " --ranks " +
                              std::to_string(world.ranks) + " --dtype " +
                              std::string(hps::dtype_name(config.dtype)) + " --cases " +
                              cases.str() + " --out " + shell_quote(out.string()) + " 2>&1";
  if (config.progress) {
    std::fprintf(stderr, "[hpshard-bench] torch.distributed gloo, %d ranks\n", world.ranks);
  }
  int status = 0;
  const std::string log = run_and_capture(command, &status);
  std::string why;
  std::optional<Json> doc = status == 0 ? read_json(out, &why) : std::nullopt;
  std::error_code ec;
  std::filesystem::remove(out, ec);
  if (!doc) {
    return "torch_coll.py failed (status " + std::to_string(status) + "): " + why + " " +
           tail_of(log);
  }
  *version = doc->value("torch_version", "?");
  for (const Json& r : doc->value("results", Json::array())) {
    if (!r.contains("seconds") || !r["seconds"].is_number()) continue;
    const auto op = coll_op_from_name(r.value("op", ""));
    for (auto& row : world.rows) {
      if (op && row.op == *op && row.count == r.value("count", size_t{0})) {
        row.torch_seconds = r["seconds"].get<double>();
      }
    }
  }
  return {};
}

// The Open MPI side: hpshard-bench-mpi (mpi_coll.cc) under mpirun at `world.ranks`
// processes on the same cases, shared-memory transport; fills mpi_seconds. Returns an empty
// string when it ran, else why not.
std::string run_mpi_coll(const std::string& helper, const CollConfig& config, WorldResult& world,
                         std::string* version) {
  std::ostringstream cases;
  for (size_t i = 0; i < world.rows.size(); ++i) {
    const auto& r = world.rows[i];
    cases << (i ? "," : "") << coll_op_name(r.op) << ":" << r.count << ":" << r.iters << ":"
          << warmup_for(config, r.bytes);
  }
  const auto out = temp_path("coll-mpi");
  // vader is Open MPI 4's shared-memory transport (with single-copy CMA where the kernel
  // allows it). The ranks share this machine's cores with others, as hpshard's threads do:
  // waiting ranks yield the core (Open MPI's own choice when it sees more ranks than cores;
  // spinning ranks measured up to 10x slower here at 2 ranks on a busy machine).
  const std::string command =
      "timeout 1800 mpirun --allow-run-as-root --oversubscribe --bind-to none -np " +
      std::to_string(world.ranks) +
      " --mca pml ob1 --mca btl self,vader --mca mpi_yield_when_idle 1 " + shell_quote(helper) +
      " --dtype " + std::string(hps::dtype_name(config.dtype)) + " --cases " + cases.str() +
      " --out " + shell_quote(out.string()) + " 2>&1";
  if (config.progress) std::fprintf(stderr, "[hpshard-bench] Open MPI, %d ranks\n", world.ranks);
  int status = 0;
  const std::string log = run_and_capture(command, &status);
  std::string why;
  std::optional<Json> doc = status == 0 ? read_json(out, &why) : std::nullopt;
  std::error_code ec;
  std::filesystem::remove(out, ec);
  if (!doc) {
    return "mpirun hpshard-bench-mpi failed (status " + std::to_string(status) + "): " + why + " " +
           tail_of(log);
  }
  *version = doc->value("mpi_version", "?");
  for (const Json& r : doc->value("results", Json::array())) {
    if (r.value("wrong", false)) return "Open MPI gave a wrong result: " + r.dump();
    const auto op = coll_op_from_name(r.value("op", ""));
    for (auto& row : world.rows) {
      if (op && row.op == *op && row.count == r.value("count", size_t{0})) {
        row.mpi_seconds = r.value("seconds", 0.0);
      }
    }
  }
  return {};
}

// hpshard-bench-mpi beside this program (or --mpi-helper), and mpirun on PATH.
std::string mpi_setup(const CollCli& cli, RunInfo& info) {
  if (cli.no_mpi) {
    info.mpi = "skipped (--no-mpi)";
    return {};
  }
  std::string helper = cli.mpi_helper;
  if (helper.empty()) {
    std::error_code ec;
    const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) helper = (self.parent_path() / "hpshard-bench-mpi").string();
  }
  std::error_code ec;
  if (helper.empty() || !std::filesystem::exists(helper, ec)) {
    info.mpi =
        "hpshard-bench-mpi not found beside hpshard-bench (a build tree has it where "
        "Open MPI's libopenmpi-dev is installed; no package ships it; --mpi-helper "
        "names one)";
  } else if (std::system("mpirun --version >/dev/null 2>&1") != 0) {
    info.mpi = "mpirun not installed (Debian openmpi-bin)";
  } else {
    return helper;
  }
  std::printf("Open MPI: %s\n", info.mpi.c_str());
  return {};
}

int run_coll(CollCli& cli, int argc, char** argv) {
  CollConfig& c = cli.config;
  refuse_repeats("--ranks", c.ranks);
  refuse_repeats("--ops", cli.ops);
  if (!cli.ops.empty()) {
    c.ops.clear();
    for (const auto& name : cli.ops) c.ops.push_back(*coll_op_from_name(name));
  }
  c.dtype = *hps::dtype_from_name(cli.dtype);
  c.shared_memory = cli.transport == "shm";
  c.progress = !cli.common.quiet;
  if (c.min_bytes > c.max_bytes) usage_error("--min-bytes is larger than --max-bytes");
  // Every operation measures at least one size at every world size: a size below one element
  // (per rank, for all_gather and reduce_scatter) is skipped, and a sweep of such sizes alone
  // gave an empty table with exit 0 (and a plot.py traceback with --plot).
  const size_t largest_size = message_sizes(c).empty() ? 0 : message_sizes(c).back();
  for (CollOp op : c.ops) {
    for (int32_t ranks : c.ranks) {
      const size_t least =
          hps::dtype_size(c.dtype) * (count_is_per_rank(op) ? static_cast<size_t>(ranks) : 1);
      if (largest_size < least) {
        usage_error("--max-bytes " + std::to_string(c.max_bytes) + " gives " +
                    std::string(coll_op_name(op)) + " at " + std::to_string(ranks) +
                    " ranks no message: it needs at least " + std::to_string(least) + " bytes");
      }
    }
  }
  RunInfo info = run_info(argc, argv);
  use_isa(cli.common, info);
  const std::string script = torch_setup(cli.common, "torch_coll.py", info);
  const std::string mpi = mpi_setup(cli, info);
  std::string mpi_version, mpi_failure;
  auto worlds = run_worlds<WorldResult>(
      c.ranks, script, info,
      [&](int32_t ranks) {
        // Open MPI after each repetition of hpshard's and Gloo's sweep, so the three
        // alternate; its figure is the median over the repetitions like theirs.
        return run_world_repeated(c, ranks, [&](WorldResult& world) {
          if (mpi.empty() || !mpi_failure.empty()) return;
          mpi_failure = run_mpi_coll(mpi, c, world, &mpi_version);
          if (!mpi_failure.empty()) {
            std::fprintf(stderr, "hpshard-bench: Open MPI column dropped: %s\n",
                         mpi_failure.c_str());
          }
        });
      },
      [&](WorldResult& world, std::string* version) {
        return run_torch_coll(script, c, world, version);
      },
      [](const std::string& version) {
        return "torch " + version + " torch.distributed gloo (processes, 127.0.0.1)";
      });
  if (!mpi.empty()) {
    if (mpi_failure.empty()) {
      info.mpi_ran = true;
      info.mpi = mpi_version +
                 " (mpirun processes, --mca btl self,vader: shared memory, mpi_yield_when_idle 1; "
                 "measured after each repetition of hpshard's and Gloo's sweep)";
    } else {
      info.mpi = mpi_failure;
      for (auto& w : worlds) {
        for (auto& row : w.rows) row.mpi_seconds.reset();
      }
    }
  }
  info.load_after = load_average();
  print_tables(stdout, c, info, worlds);
  return finish(cli.common, "coll", info, [&](const RunInfo& i) { return to_json(c, i, worlds); });
}

// The largest message --help promises (each rank holds its buffers, as threads of one
// process): 256 MiB.
constexpr size_t kMaxCollBytes = size_t{1} << 28;

Family add_coll(CLI::App& app, int argc, char** argv) {
  auto cli = std::make_shared<CollCli>();
  CollConfig& c = cli->config;
  CLI::App* cmd = app.add_subcommand(
      "coll",
      "Times hpshard's collectives (ranks as threads, in-memory store) against Gloo called "
      "directly on the same sizes and ranks, Open MPI (processes under mpirun, shared memory) "
      "and torch.distributed gloo when installed. S is the total bytes of the operation (for "
      "all_gather and reduce_scatter: count per rank x ranks, as nccl-tests); busbw uses "
      "nccl-tests' factors.");
  cmd->add_option("--ranks", c.ranks, "world sizes (default 2,4)")
      ->check(decimal())
      ->delimiter(',')
      ->check(CLI::Range(2, 64));
  cmd->add_option("--min-bytes", c.min_bytes,
                  "smallest message S in bytes (default 4096; 1 to 268435456)")
      ->check(decimal())
      ->check(CLI::Range(size_t{1}, kMaxCollBytes));
  cmd->add_option("--max-bytes", c.max_bytes,
                  "largest message S in bytes (default 67108864; 1 to 268435456; at least one "
                  "element, per rank for all_gather and reduce_scatter)")
      ->check(decimal())
      ->check(CLI::Range(size_t{1}, kMaxCollBytes));
  cmd->add_option("--iters", c.iters, "timed iterations per size (default: 40 small .. 5 large)")
      ->check(decimal())
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--warmup", c.warmup, "untimed runs per size after the checked one (3 / 1)")
      ->check(decimal())
      ->check(CLI::Range(0, 100000));
  cmd->add_option("--repeat", c.repeat,
                  "the whole sweep N times; each figure is the median of the N (default 1)")
      ->check(decimal())
      ->check(CLI::Range(1, 100));
  cmd->add_option("--ops", cli->ops, "all_reduce,all_gather,reduce_scatter,broadcast (default all)")
      ->delimiter(',')
      ->check(CLI::IsMember({"all_reduce", "all_gather", "reduce_scatter", "broadcast"}));
  cmd->add_option("--dtype", cli->dtype, "float32 or float64 (default float32)")
      ->check(CLI::IsMember({"float32", "float64"}));
  cmd->add_option("--check-arguments", c.check_arguments,
                  "hpshard's per-collective argument agreement, 0 or 1 (default 1)")
      ->check(CLI::IsMember({"0", "1"}));
  cmd->add_option("--transport", cli->transport,
                  "hpshard's transport between its same-host ranks (default shm)")
      ->check(CLI::IsMember({"shm", "tcp"}));
  cmd->add_option("--shm-direct", c.shared_memory_direct,
                  "0 or 1: shared-memory all-gather and broadcast read the peers' buffers in "
                  "place, one copy per byte (CommOptions::shared_memory_direct; default 1, as in "
                  "the library)")
      ->check(CLI::IsMember({"0", "1"}));
  cmd->add_flag("--no-mpi", cli->no_mpi, "skip the Open MPI column");
  cmd->add_option("--mpi-helper", cli->mpi_helper,
                  "hpshard-bench-mpi (default: beside this program)");
  add_common(*cmd, cli->common, "torch_coll.py", false);
  return {cmd, [cli, argc, argv] { return run_coll(*cli, argc, argv); }};
}

// ---- clip ----

struct ClipCli {
  ClipConfig config;
  CommonCli common;
  std::vector<std::string> sizes;
  std::string kernel_bytes;
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
  size_t n = 0;
  for (char ch : text) {
    if (ch < '0' || ch > '9' || n > (size_t{4} << 30)) return std::nullopt;
    n = n * 10 + static_cast<size_t>(ch - '0');
  }
  if (text.empty() || n < 1 || n > (size_t{4} << 30) / multiplier) return std::nullopt;
  return n * multiplier;
}

// "16M", "32M:mixed", "64K:fp32" → a model; nothing when the text is none.
std::optional<ClipModel> parse_model(std::string_view text) {
  ClipModel model;
  if (const size_t colon = text.find(':'); colon != std::string_view::npos) {
    const std::string_view kind = text.substr(colon + 1);
    if (kind == "mixed") {
      model.mixed = true;
    } else if (kind != "fp32") {
      return std::nullopt;
    }
    text = text.substr(0, colon);
  }
  auto bytes = parse_bytes(text);
  if (!bytes || *bytes < 64) return std::nullopt;
  model.bytes = *bytes;
  return model;
}

// torch_clip.py on the same tensors: a case file, one model per line
// "index iters warmup max_norm dtype:count ...", and one result per model back.
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
  std::string why;
  std::optional<Json> doc = status == 0 ? read_json(out, &why) : std::nullopt;
  std::filesystem::remove(out, ec);
  if (!doc) {
    return "torch_clip.py failed (status " + std::to_string(status) + "): " + why + " " +
           tail_of(log);
  }
  *version = doc->value("torch_version", "?");
  for (const Json& r : doc->value("results", Json::array())) {
    const size_t i = r.value("index", rows.size());
    if (i < rows.size() && r.contains("seconds") && r["seconds"].is_number()) {
      rows[i].torch_seconds = r["seconds"].get<double>();
    }
  }
  return {};
}

int run_clip_family(ClipCli& cli, int argc, char** argv) {
  ClipConfig& c = cli.config;
  refuse_repeats<std::string>(
      "--sizes", cli.sizes,
      [](const std::string& a, const std::string& b) {
        const ClipModel x = *parse_model(a), y = *parse_model(b);
        return x.bytes == y.bytes && x.mixed == y.mixed;
      },
      [](const std::string& v) { return "'" + v + "'"; });
  if (!cli.sizes.empty()) {
    c.models.clear();
    for (const auto& s : cli.sizes) c.models.push_back(*parse_model(s));
  }
  if (!cli.kernel_bytes.empty()) {
    c.kernel_bytes = cli.kernel_bytes == "0" ? 0 : *parse_bytes(cli.kernel_bytes);
  }
  c.progress = !cli.common.quiet;
  RunInfo info = run_info(argc, argv);
  use_isa(cli.common, info);
  const std::string script = torch_setup(cli.common, "torch_clip.py", info);
  ClipResult result = run_clip(c);
  if (!script.empty()) {
    std::string version;
    const std::string why = run_torch_clip(script, c, result.rows, &version);
    if (!why.empty()) {
      info.torch = why;
      std::fprintf(stderr, "hpshard-bench: torch column dropped: %s\n", why.c_str());
    } else {
      info.torch_ran = true;
      info.torch = "torch " + version +
                   " torch.nn.utils.clip_grad_norm_ (1 intra-op thread, measured after hpshard)";
    }
  }
  info.load_after = load_average();
  print_clip(stdout, c, info, result);
  return finish(cli.common, "clip", info,
                [&](const RunInfo& i) { return clip_to_json(c, i, result); });
}

Family add_clip(CLI::App& app, int argc, char** argv) {
  auto cli = std::make_shared<ClipCli>();
  ClipConfig& c = cli->config;
  CLI::App* cmd = app.add_subcommand(
      "clip",
      "Global-norm clipping (HybridClip, one rank) of a model's gradients beside a copy of the "
      "same bytes; the clip folded into the engines' step (from the reductions' writes of the "
      "shards: the unscale pass taking the partial sums after each reduction, finish, AdamW "
      "reading the coefficient) beside the step without it; each CPU "
      "kernel over fp32, bf16 and fp16 beside a copy; the deterministic mode's cost; "
      "torch.nn.utils.clip_grad_norm_ on the same tensors when installed.");
  cmd->add_option("--sizes", cli->sizes,
                  "models: total gradient bytes (suffix K, M or G), ':mixed' for bf16 weights and "
                  "fp32 biases (default 16M,64M,32M:mixed)")
      ->delimiter(',')
      ->check(CLI::Validator(
          [](std::string& text) {
            return parse_model(text) ? std::string()
                                     : "'" + text + "' is not a model from 64 B to 4G";
          },
          "SIZE[:mixed]"));
  cmd->add_option("--iters", c.iters, "timed iterations per model (default: 7 .. 31 by size)")
      ->check(decimal())
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--warmup", c.warmup, "untimed iterations per model (default 2)")
      ->check(decimal())
      ->check(CLI::Range(0, 100000));
  cmd->add_option("--max-norm", c.max_norm, "the clip's max_norm (default 1)")
      ->check(finite_number())
      ->check(CLI::Range(1e-6, 1e30));
  cmd->add_option("--kernel-bytes", cli->kernel_bytes,
                  "fp32 bytes of each kernel's buffers in the kernel table (suffix K, M, G; 0: "
                  "no kernel table; default 128M)")
      ->check(CLI::Validator(
          [](std::string& text) {
            return text == "0" || parse_bytes(text) ? std::string()
                                                    : "'" + text + "' is not a size up to 4G";
          },
          "SIZE"));
  add_common(*cmd, cli->common, "torch_clip.py", true);
  return {cmd, [cli, argc, argv] { return run_clip_family(*cli, argc, argv); }};
}

// ---- step ----

struct StepCli {
  StepConfig config;
  CommonCli common;
  std::string optimizer = "adamw";
};

// torch_step.py at `world.ranks` ranks on the same model; fills the torch figures.
std::string run_torch_step(const std::string& script, const StepConfig& config, StepWorld& world,
                           std::string* version) {
  const auto out = temp_path("step-torch");
  const std::string command =
      "timeout 1800 /usr/bin/python3 " + shell_quote(script) + " --ranks " +
      std::to_string(world.ranks) + " --width " + std::to_string(world.width) + " --depth " +
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
  std::string why;
  std::optional<Json> doc = status == 0 ? read_json(out, &why) : std::nullopt;
  std::error_code ec;
  std::filesystem::remove(out, ec);
  if (!doc) {
    return "torch_step.py failed (status " + std::to_string(status) + "): " + why + " " +
           tail_of(log);
  }
  *version = doc->value("torch_version", "?");
  if (doc->contains("seconds") && (*doc)["seconds"].is_number()) {
    world.torch_seconds = (*doc)["seconds"].get<double>();
  }
  if (doc->contains("compute_seconds") && (*doc)["compute_seconds"].is_number()) {
    world.torch_compute_seconds = (*doc)["compute_seconds"].get<double>();
  }
  return {};
}

uint64_t mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

int run_step_family(StepCli& cli, int argc, char** argv) {
  StepConfig& c = cli.config;
  refuse_repeats("--ranks", c.ranks);
  c.adamw = cli.optimizer == "adamw";
  c.progress = !cli.common.quiet;
  if (!c.device.empty()) {
    // One row of figures: plot.py charts the world-size sweep, which --device does not run.
    if (!cli.common.plot_path.empty()) usage_error("--plot: step --device has no chart");
    DeviceStepConfig d;
    d.device = *hps::parse_device(c.device);
    d.width = c.width;
    d.depth = c.depth;
    d.steps = c.steps;
    d.reps = c.reps;
    d.warmup = c.warmup;
    d.adamw = c.adamw;
    d.clip = c.clip;
    RunInfo info = run_info(argc, argv);
    use_isa(cli.common, info);
    if (d.device.type == hps::DeviceType::kCuda && hps::device_count(hps::DeviceType::kCuda) == 0) {
      std::fprintf(stderr, "hpshard-bench: no CUDA device\n");
      return 77;
    }
    const DeviceStepResult r = run_device_step(d);
    info.load_after = load_average();
    print_run_header(stdout, "step", info);
    print_device_step(d, r);
    return finish(cli.common, "step", info, [&](const RunInfo& i) {
      Json j = device_step_to_json(d, r);
      add_run_info(j, "step", i);
      return j;
    });
  }
  RunInfo info = run_info(argc, argv);
  use_isa(cli.common, info);
  // The scaling sweep compares the engines with their own reference only: torch at x4 the
  // width would take most of an hour here.
  if (c.scale) cli.common.no_torch = true;
  const std::string script = torch_setup(cli.common, "torch_step.py", info);
  if (c.scale) info.torch = "skipped (--scale)";
  // The cells: the world sizes at --width, or the scaling sweep's widths × ranks.
  struct Cell {
    int32_t width, ranks;
  };
  std::vector<Cell> cells;
  if (c.scale) {
    for (int32_t k : kScaleWidths) {
      for (int32_t r : kScaleRanks) cells.push_back({c.width * k, r});
    }
  } else {
    for (int32_t r : c.ranks) cells.push_back({c.width, r});
  }
  std::vector<int32_t> indices(cells.size());
  for (size_t i = 0; i < cells.size(); ++i) indices[i] = static_cast<int32_t>(i);
  auto worlds = run_worlds<StepWorld>(
      indices, script, info,
      [&](int32_t i) {
        StepConfig cell = c;
        cell.width = cells[static_cast<size_t>(i)].width;
        const int32_t ranks = cells[static_cast<size_t>(i)].ranks;
        const uint64_t needed = step_memory_estimate(cell, ranks);
        const uint64_t available = mem_available_bytes();
        if (c.scale && available > 0 && needed > available / 10 * 8) {
          StepWorld skipped;
          skipped.ranks = ranks;
          skipped.width = cell.width;
          skipped.parameters = static_cast<size_t>(cell.depth) *
                               (static_cast<size_t>(cell.width) * static_cast<size_t>(cell.width) +
                                static_cast<size_t>(cell.width));
          char why[128];
          std::snprintf(why, sizeof why, "needs ~%.1f GiB, 80%% of MemAvailable is %.1f GiB",
                        static_cast<double>(needed) / (1 << 30),
                        static_cast<double>(available) / (1 << 30) * 0.8);
          skipped.skipped = why;
          std::fprintf(stderr, "[hpshard-bench] width %d, %d ranks skipped: %s\n", cell.width,
                       ranks, why);
          return skipped;
        }
        return run_step_world(cell, ranks);
      },
      [&](StepWorld& world, std::string* version) {
        if (!world.skipped.empty()) return std::string();
        return run_torch_step(script, c, world, version);
      },
      [&](const std::string& version) {
        return "torch " + version + " DDP + ZeroRedundancyOptimizer(" + (c.adamw ? "Adam" : "SGD") +
               ") + clip_grad_norm_, gloo, processes, 1 intra-op thread each, measured after "
               "hpshard";
      });
  info.load_after = load_average();
  print_step(stdout, c, info, worlds);
  return finish(cli.common, "step", info,
                [&](const RunInfo& i) { return step_to_json(c, i, worlds); });
}

// A --device value: cpu, cuda or cuda:N.
CLI::Validator device_validator() {
  return CLI::Validator(
      [](std::string& text) {
        return hps::parse_device(text).ok() ? std::string()
                                            : "'" + text + "' is not cpu, cuda or cuda:N";
      },
      "DEVICE");
}

Family add_step(CLI::App& app, int argc, char** argv) {
  auto cli = std::make_shared<StepCli>();
  StepConfig& c = cli->config;
  CLI::App* cmd = app.add_subcommand(
      "step",
      "A training step of an MLP (forward/backward in the bench) with ranks as threads: "
      "Stage2Engine and Stage3Engine beside unsharded data parallel (all-reduce avg, optimizer "
      "on the full parameters) on the same backend; torch DDP + ZeroRedundancyOptimizer(Adam) + "
      "clip_grad_norm_ when installed.");
  cmd->add_option("--ranks", c.ranks, "world sizes (default 2,4)")
      ->check(decimal())
      ->delimiter(',')
      ->check(CLI::Range(1, 16));
  cmd->add_option("--width", c.width, "the MLP's width (default 1024)")
      ->check(decimal())
      ->check(CLI::Range(1, 16384));
  cmd->add_option("--depth", c.depth, "the MLP's depth (default 8)")
      ->check(decimal())
      ->check(CLI::Range(1, 256));
  cmd->add_option("--batch", c.batch, "samples per rank per step (default 8)")
      ->check(decimal())
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--steps", c.steps, "steps per timed repetition (default 3)")
      ->check(decimal())
      ->check(CLI::Range(1, 10000));
  cmd->add_option("--reps", c.reps, "timed repetitions (default 5)")
      ->check(decimal())
      ->check(CLI::Range(1, 10000));
  cmd->add_option("--warmup", c.warmup, "untimed repetitions (default 1)")
      ->check(decimal())
      ->check(CLI::Range(0, 10000));
  cmd->add_option("--optimizer", cli->optimizer, "adamw or sgd (momentum 0.9); default adamw")
      ->check(CLI::IsMember({"adamw", "sgd"}));
  cmd->add_option("--clip", c.clip, "global-norm max_norm, 0 for none (default 1)")
      ->check(finite_number())
      ->check(CLI::Range(0.0, 1e30));
  cmd->add_option("--prefetch-window", c.prefetch_window,
                  "stage 3: units live at once, prefetch included (default 2)")
      ->check(decimal())
      ->check(CLI::Range(1, 1024));
  cmd->add_flag("--scale", c.scale,
                "instead of --ranks: widths x1, x2, x4 of --width (about x1, x4, x16 parameters) "
                "at 1, 2 and 4 ranks, time per parameter and the ratios per cell; cells that "
                "would not fit in MemAvailable are skipped and say so");
  cmd->add_option("--device", c.device,
                  "instead: the runtime's own step on cpu, cuda or cuda:N at world size 1 (no "
                  "model compute; synthetic gradients), beside the optimizer kernel alone; exit "
                  "77 when the device is absent; no --plot (one row, no chart)")
      ->check(device_validator());
  cmd->add_flag("--trace-overhead", c.trace_overhead,
                "also time stage 2 and 3 while the timeline records (HPS_TRACE)");
  add_common(*cmd, cli->common, "torch_step.py", true);
  return {cmd, [cli, argc, argv] { return run_step_family(*cli, argc, argv); }};
}

// ---- ckpt ----

struct CkptCli {
  CkptConfig config;
  CommonCli common;
  std::string bytes;
  std::string device;
};

int run_ckpt_family(CkptCli& cli, int argc, char** argv) {
  CkptConfig& c = cli.config;
  if (!cli.bytes.empty()) c.bytes = *parse_bytes(cli.bytes);
  if (!cli.device.empty()) c.device = *hps::parse_device(cli.device);
  if (c.device.type == hps::DeviceType::kCuda && hps::device_count(hps::DeviceType::kCuda) == 0) {
    std::fprintf(stderr, "hpshard-bench: no CUDA device\n");
    return 77;
  }
  c.progress = !cli.common.quiet;
  RunInfo info = run_info(argc, argv);
  use_isa(cli.common, info);
  info.torch = "no torch column for checkpoints";
  const CkptResult result = run_ckpt(c);
  info.load_after = load_average();
  print_ckpt(stdout, c, info, result);
  const int written = finish(cli.common, "ckpt", info,
                             [&](const RunInfo& i) { return ckpt_to_json(c, i, result); });
  return written != 0 || !result.loaded_equal ? 1 : 0;
}

Family add_ckpt(CLI::App& app, int argc, char** argv) {
  auto cli = std::make_shared<CkptCli>();
  CkptConfig& c = cli->config;
  CLI::App* cmd = app.add_subcommand(
      "ckpt",
      "Checkpoints of a Stage2Engine (AdamW, ranks as threads): save and load beside each rank "
      "writing (with fsync) and reading (cold cache) as many bytes plainly; a step while an "
      "asynchronous save is written beside the same step without one.");
  cmd->add_option("--ranks", c.ranks, "ranks (default 2)")
      ->check(decimal())
      ->check(CLI::Range(1, 16));
  cmd->add_option("--bytes", cli->bytes,
                  "fp32 parameter bytes (suffix K, M or G; AdamW saves 3x; default 64M)")
      ->check(CLI::Validator(
          [](std::string& text) {
            auto b = parse_bytes(text);
            return b && *b >= 4096 ? std::string() : "'" + text + "' is not 4K to 4G";
          },
          "SIZE"));
  cmd->add_option("--tensors", c.tensors, "parameters, one unit each (default 8)")
      ->check(decimal())
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--reps", c.reps, "repetitions (default 3)")
      ->check(decimal())
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--steps", c.steps,
                  "steps timed with and without a save, per repetition (default 6)")
      ->check(decimal())
      ->check(CLI::Range(1, 10000));
  cmd->add_option("--compute-passes", c.compute_passes,
                  "passes over the parameters in a step's compute (default 4)")
      ->check(decimal())
      ->check(CLI::Range(0, 1000));
  cmd->add_flag("--kernel-passes", c.kernel_passes,
                "run the compute passes as the kernel table's accumulate on the engine's "
                "compute stream (always so off the CPU; default on the CPU: host loops)");
  cmd->add_option("--device", cli->device,
                  "the engine's device: cpu (default) or cuda[:N]; exits 77 when it is absent")
      ->check(device_validator());
  cmd->add_option("--dir", c.dir, "where the checkpoints go (default: a temporary directory)");
  cmd->add_option("--json", cli->common.json_path, "also write every figure as one JSON object")
      ->check(output_path());
  cmd->add_flag("--quiet", cli->common.quiet, "no progress lines on stderr");
  return {cmd, [cli, argc, argv] { return run_ckpt_family(*cli, argc, argv); }};
}

// ---- torch ----

// The torch family runs entirely in torch_peer.py (every contender is torch compute): this
// finds the script, the model and the Python binding, and passes the options through.
// torch_peer.py writes its JSON to a scratch file; the bench adds the header every family's
// JSON has (add_run_info: command, date, machine, cpu_kernels, load_average) and writes it
// to --json FILE, checked before anything runs as the other families check theirs.
int run_torch_family(const std::string& script_option, const std::vector<std::string>& pass,
                     int argc, char** argv) {
  RunInfo info = run_info(argc, argv);
  use_isa(CommonCli{}, info);
  std::string json_path;
  std::vector<std::string> args;
  for (size_t i = 0; i < pass.size(); ++i) {
    if (pass[i] == "--json" && i + 1 < pass.size()) {
      json_path = pass[++i];
    } else if (pass[i].rfind("--json=", 0) == 0) {
      json_path = pass[i].substr(7);
    } else {
      args.push_back(pass[i]);
    }
  }
  std::filesystem::path scratch;
  if (!json_path.empty() || std::find(pass.begin(), pass.end(), "--json") != pass.end()) {
    const hps::OutputFile checked = hps::output_file(json_path);
    if (json_path.empty()) usage_error("--json: an empty path");
    if (!checked.error.empty()) usage_error("--json: '" + json_path + "': " + checked.error);
    std::error_code ec;
    const auto parent = std::filesystem::absolute(checked.target, ec).parent_path();
    if (!std::filesystem::is_directory(parent, ec)) {
      usage_error("--json: '" + json_path + "': its directory does not exist");
    }
    scratch = temp_path("torch");
    args.push_back("--json");
    args.push_back(scratch.string());
  }
  const std::string script = find_script(script_option, "HPS_BENCH_TORCH_SCRIPT", "torch_peer.py");
  if (script.empty()) usage_error("torch_peer.py not found (--torch-script)");
  // gpt.py: installed beside the scripts, or in the sources' examples.
  const auto installed = installed_data_dir();
  const auto models = !installed.empty() ? installed
                                         : std::filesystem::path(HPS_BENCH_SOURCE_DIR) / ".." /
                                               ".." / "examples" / "python";
  // --bench-header: the script leaves out the header lines the bench prints itself.
  std::vector<std::string> command{"/usr/bin/python3", script, "--bench-header", "--model-dir",
                                   models.lexically_normal().string()};
  command.insert(command.end(), args.begin(), args.end());
#ifdef HPS_BENCH_PYTHON_DIR
  // From a build tree, the build tree's Python binding; installed, the installed one.
  if (installed.empty()) {
    const char* old = std::getenv("PYTHONPATH");
    const std::string path =
        std::string(HPS_BENCH_PYTHON_DIR) + (old && *old ? ":" + std::string(old) : "");
    ::setenv("PYTHONPATH", path.c_str(), 1);
  }
#endif
  // Its report goes out after the header every family's report has (print_run_header).
  std::string report;
  const int code = run_in_own_group(std::move(command), &report);
  info.load_after = load_average();
  if (code == 0) print_run_header(stdout, "torch", info);
  std::fputs(report.c_str(), stdout);
  std::fflush(stdout);
  if (scratch.empty()) return code;
  std::string why;
  std::optional<Json> doc = code == 0 ? read_json(scratch, &why) : std::nullopt;
  std::error_code ignored;
  std::filesystem::remove(scratch, ignored);
  if (code != 0) return code;
  if (!doc) {
    std::fprintf(stderr, "hpshard-bench: torch_peer.py's JSON: %s\n", why.c_str());
    return 1;
  }
  add_run_info(*doc, "torch", info);
  why = hps::write_output(json_path, doc->dump(1) + "\n");
  if (!why.empty()) {
    std::fprintf(stderr, "hpshard-bench: %s\n", why.c_str());
    return 1;
  }
  return 0;
}

Family add_torch(CLI::App& app, int argc, char** argv) {
  struct TorchCli {
    std::string script;
    std::vector<std::string> pass;
  };
  auto cli = std::make_shared<TorchCli>();
  CLI::App* cmd = app.add_subcommand(
      "torch",
      "One PyTorch transformer (examples/python/gpt.py) with the same torch forward and "
      "backward for every contender: hpshard stage 2 and stage 3 through hpshard.torch, torch "
      "DDP + ZeroRedundancyOptimizer(AdamW) + clip_grad_norm_, torch DDP unsharded (FSDP where "
      "it imports), and the compute alone; ranks as processes. Step time, resident bytes per "
      "rank, host syncs. Its options go to torch_peer.py: --ranks LIST, --width N, --layers "
      "N, --heads N, --context N, --vocab N, --batch N (per rank), --steps N, --reps N, "
      "--warmup N, --clip X, --prefetch-window N, --json FILE, --quiet.");
  cmd->add_option(
      "--torch-script", cli->script,
      "torch_peer.py (default: $HPS_BENCH_TORCH_SCRIPT, the installed one, or beside the "
      "sources)");
  cmd->allow_extras();
  return {cmd, [cli, cmd, argc, argv] {
            return run_torch_family(cli->script, cmd->remaining(), argc, argv);
          }};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "hpshard-bench: hpshard's benchmarks, each figure beside a reference measured in the same "
      "run (benchmarks.md: docs/ in the source, /usr/share/doc/hpshard-tools/ in the packages)",
      "hpshard-bench"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "hpshard-bench " HPS_TOOLS_VERSION);
  // The Python scripts a family runs (installed under share/hpshard/bench) write no
  // __pycache__ there: a directory of the package that its removal would leave behind.
  ::setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
  // One line per family: its subcommand and options, and what runs once it is parsed.
  const std::vector<Family> families{add_coll(app, argc, argv), add_clip(app, argc, argv),
                                     add_step(app, argc, argv), add_ckpt(app, argc, argv),
                                     add_torch(app, argc, argv)};
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kUsageError;  // --help prints and exits 0
  }
  for (const Family& family : families) {
    if (family.command->parsed()) return family.run();
  }
  return kUsageError;
}
