#include "tools/hpshard-bench/ckpt_bench.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "core/checkpoint/checkpointer.h"
#include "core/checkpoint/file_io.h"
#include "core/checkpoint/format.h"
#include "core/comm/communicator.h"
#include "core/device/host_sync.h"
#include "core/device/stream.h"
#include "core/kernels/kernel_table.h"
#include "core/sharding/sharded_engine.h"

namespace hps::bench {
namespace {

using Clock = std::chrono::steady_clock;

// The temporary directory run_ckpt made (no --dir), removed by a run that fails too.
std::string g_made_dir;

[[noreturn]] void die(const std::string& message) {
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  std::fflush(stdout);
  std::fprintf(stderr, "hpshard-bench: error: %s\n", message.c_str());
  if (!g_made_dir.empty()) (void)ckpt::remove_tree(g_made_dir);
  std::_Exit(1);
}

void check(const Status& s, const std::string& what) {
  if (!s.ok()) die(what + ": " + s.to_string());
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The slowest rank's figure.
double slowest(Communicator& comm, double mine) {
  double out = 0;
  auto w = comm.all_reduce(&mine, &out, 1, DType::kFloat64, ReduceOp::kMax);
  check(w.status(), "all_reduce");
  check((*w)->wait(), "all_reduce");
  return out;
}

void barrier(Communicator& comm) {
  auto w = comm.barrier();
  check(w.status(), "barrier");
  check((*w)->wait(), "barrier");
}

// A barrier after which the filesystem holding `dir` has no writes of the repetitions
// before pending (the deletions' metadata, say): each timed operation, hpshard's or the
// reference's, starts on a quiet disk instead of paying for whatever the one before it left.
void quiet_barrier(Communicator& comm, const std::string& dir) {
  barrier(comm);
  if (comm.rank() == 0) {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || ::syncfs(fd) != 0) die("syncfs of " + dir + ": " + std::strerror(errno));
    ::close(fd);
  }
  barrier(comm);
}

// A checksum of every state tensor's bytes on this rank, read back to the host (a copy on
// the CPU too, so the path a GPU run takes runs here).
uint64_t state_checksum(Checkpointable& state, ShardedEngine& engine) {
  check(engine.synchronize(), "synchronize");
  auto tensors = state.state_tensors();
  check(tensors.status(), "state_tensors");
  uint64_t sum = 0;
  std::vector<uint8_t> host;
  for (const auto& t : *tensors) {
    host.resize((t.end - t.begin) * dtype_size(t.dtype));
    check(copy_to_host(state.state_stream(), host.data(), t.data, host.size()), "copy_to_host");
    sum = sum * 31 + ckpt::checksum(host.data(), host.size());
  }
  return sum;
}

struct RankFigures {
  std::vector<double> save, write, load, read, read_plain_file;
  std::vector<double> first_step, first_step_with_save, step, step_with_save;
  int32_t first_overlapped = 0;
  int32_t overlapped = 0;
  uint64_t syncs = 0;
  uint64_t bytes = 0;
  bool has_file = false;  // a rank that holds no shard of any tensor writes no data file
  bool equal = true;
};

void run_rank(const CkptConfig& c, int32_t rank, std::shared_ptr<Store> store,
              const std::string& dir, RankFigures& out) {
  const bool on_host = c.device.type == DeviceType::kCpu;
  CommOptions co;
  co.timeout = Milliseconds(600'000);
  auto comm_or = create_communicator(store, rank, c.ranks, c.device, co);
  check(comm_or.status(), "communicator");
  std::shared_ptr<Communicator> comm(std::move(*comm_or));
  // The checkpoint's agreement, the barriers and the figures go over a CPU group: the
  // engine's own on the CPU, one of its own for another device.
  std::shared_ptr<Communicator> host = comm;
  if (!on_host) {
    CommOptions hco = co;
    hco.name = "ckpt-bench-host";
    auto host_or = create_communicator(store, rank, c.ranks, Device::cpu(), hco);
    check(host_or.status(), "host communicator");
    host = std::move(*host_or);
  }
  // Kernel passes run on the engine's compute stream (declared first: it outlives the
  // engine).
  std::unique_ptr<Stream> compute;
  const Kernels* kernels = nullptr;
  if (uses_kernel_passes(c)) {
    auto stream_or = create_stream(c.device);
    check(stream_or.status(), "compute stream");
    compute = std::move(*stream_or);
    auto kernels_or = kernels_for(c.device.type);
    check(kernels_or.status(), "kernels");
    kernels = *kernels_or;
  }
  EngineOptions o;
  o.optimizer = OptimizerKind::kAdamW;
  o.compute_stream = compute.get();
  auto engine_or = create_sharded_engine(2, comm, nullptr, o);
  check(engine_or.status(), "engine");
  ShardedEngine& engine = **engine_or;
  const int64_t per_tensor = static_cast<int64_t>(c.bytes / 4 / static_cast<size_t>(c.tensors));
  for (int32_t t = 0; t < c.tensors; ++t) {
    ParamSpec spec{"layer" + std::to_string(t) + ".weight", {per_tensor}, DType::kFloat32};
    spec.unit = t;
    check(engine.add_param(spec).status(), "add_param");
  }
  check(engine.seal(), "seal");
  std::vector<float> initial(static_cast<size_t>(per_tensor));
  for (int64_t i = 0; i < per_tensor; ++i) initial[i] = static_cast<float>(i % 101) * 1e-3f;
  for (int32_t t = 0; t < c.tensors; ++t) {
    auto v = engine.param_data(static_cast<size_t>(t));
    check(v.status(), "param_data");
    if (compute) {
      check(compute->memcpy_async(*v, initial.data(), initial.size() * sizeof(float)), "copy");
      check(compute->synchronize(), "copy");  // set-up: the host vector is reused
    } else {
      std::memcpy(*v, initial.data(), initial.size() * sizeof(float));
    }
  }
  check(engine.broadcast_parameters(), "broadcast_parameters");
  auto& state = *dynamic_cast<Checkpointable*>(&engine);
  CheckpointOptions ckpt_options;
  ckpt_options.keep_last = 1;
  auto checkpointer_or = Checkpointer::create(state, host, dir, ckpt_options);
  check(checkpointer_or.status(), "checkpointer");
  Checkpointer& checkpointer = **checkpointer_or;

  // A step: each layer's parameters read compute_passes times into its gradient, by host
  // loops or by the kernel table's accumulate on the compute stream.
  auto train_step = [&] {
    for (int32_t t = 0; t < c.tensors; ++t) check(engine.gather(t), "gather");
    for (int32_t t = c.tensors; t-- > 0;) {
      const auto index = static_cast<size_t>(t);
      if (kernels != nullptr) {
        auto p = engine.param_data(index);
        auto g = engine.grad_data(index);
        check(p.status(), "param_data");
        check(g.status(), "grad_data");
        for (int32_t pass = 0; pass < c.compute_passes; ++pass) {
          check(kernels->accumulate(*compute, DevicePtr<float>(static_cast<float*>(*g)),
                                    DType::kFloat32, DevicePtr<const void>(*p),
                                    static_cast<size_t>(per_tensor)),
                "accumulate");
        }
        check(engine.grad_ready(index, compute.get()), "grad_ready");
        continue;
      }
      const float* p = *engine.param(index);
      float* g = *engine.grad(index);
      for (int32_t pass = 0; pass < c.compute_passes; ++pass) {
        for (int64_t i = 0; i < per_tensor; ++i) g[i] += p[i] * 1e-3f + 1e-4f;
      }
      check(engine.grad_ready(index, nullptr), "grad_ready");
    }
    check(engine.step(), "step");
  };
  for (int i = 0; i < 2; ++i) train_step();
  check(engine.synchronize(), "synchronize");

  std::vector<uint8_t> plain;
  for (int32_t rep = 0; rep < c.reps; ++rep) {
    if (c.progress && rank == 0) std::fprintf(stderr, "[hpshard-bench] ckpt repetition %d\n", rep);
    // Each pair (hpshard, reference) runs in one order on even repetitions and in the
    // other on odd ones, so a drift of the machine's load favours neither side.
    const bool reference_first = rep % 2 == 1;
    auto in_turn = [reference_first](const auto& hpshard, const auto& reference) {
      if (reference_first) reference();
      hpshard();
      if (!reference_first) reference();
    };
    const std::string name = "bench-" + std::to_string(rep);
    const std::string file =
        ckpt::join_path(ckpt::join_path(dir, name), ckpt::data_file_name(rank));
    const std::string plain_path = ckpt::join_path(dir, "plain-" + std::to_string(rank));
    const uint64_t before = state_checksum(state, engine);

    auto time_save = [&] {
      quiet_barrier(*host, dir);
      auto start = Clock::now();
      auto work = checkpointer.save(name);
      check(work.status(), "save");
      check((*work)->wait(), "save");
      out.save.push_back(slowest(*host, seconds_since(start)));
      check(checkpointer.wait(), "save");  // the older checkpoint's files deleted too
      auto f = ckpt::File::open_read(file);
      out.has_file = f.ok();
      if (!f.ok() && f.status().code() == StatusCode::kNotFound) {
        out.bytes = 0;  // this rank holds no shard: nothing of its own to write or read
        return;
      }
      check(f.status(), "the saved data file");
      auto size = f->size();
      check(size.status(), "the saved data file");
      out.bytes = *size;
    };
    // The same bytes, written plainly (as many as the data file, which repetition 0 saves
    // before the first reference goes first).
    auto time_write = [&] {
      plain.resize(out.bytes);
      std::memset(plain.data(), rep + 1, plain.size());
      (void)ckpt::remove_tree(plain_path);
      quiet_barrier(*host, dir);
      auto start = Clock::now();
      auto f = ckpt::File::create(plain_path);
      check(f.status(), "plain write");
      check(f->write_all(plain.data(), plain.size()), "plain write");
      check(f->sync(), "plain fsync");
      check(f->close(), "plain close");
      out.write.push_back(slowest(*host, seconds_since(start)));
    };
    in_turn(time_save, time_write);
    // Loads and reads from a cold cache.
    auto time_load = [&] {
      auto f = ckpt::File::open_read(file);
      if (f.ok()) f->drop_cache();
      quiet_barrier(*host, dir);
      auto start = Clock::now();
      check(checkpointer.load(name).status(), "load");
      out.load.push_back(slowest(*host, seconds_since(start)));
      out.equal = out.equal && state_checksum(state, engine) == before;
    };
    // A cold read of this rank's data file of the checkpoint the load reads (the same
    // bytes, as the same file holds them), and one of the plain file written above
    // (through the page cache).
    // A rank without a data file reads nothing there, but times its part all the same.
    auto time_read = [&](const std::string& path, std::vector<double>& into) {
      std::optional<ckpt::File> f;
      if (path != file || out.has_file) {
        auto opened = ckpt::File::open_read(path);
        check(opened.status(), "plain read");
        opened->drop_cache();
        f = std::move(*opened);
      }
      quiet_barrier(*host, dir);
      auto start = Clock::now();
      if (f) check(f->pread_all(plain.data(), plain.size(), 0), "plain read");
      into.push_back(slowest(*host, seconds_since(start)));
    };
    in_turn(time_load, [&] { time_read(file, out.read); });
    time_read(plain_path, out.read_plain_file);
    (void)ckpt::remove_tree(plain_path);
    // `steps` steps from a barrier to their completion (divided by `steps`), without a save
    // or right after a save() (the steps that begin with the save in flight are counted, and
    // the most host syncs one of them counted).
    auto time_steps = [&](int32_t steps, std::vector<double>& into) {
      quiet_barrier(*host, dir);
      auto start = Clock::now();
      for (int32_t s = 0; s < steps; ++s) train_step();
      check(engine.synchronize(), "synchronize");
      into.push_back(slowest(*host, seconds_since(start)) / steps);
    };
    auto time_steps_with_save = [&](int32_t steps, const std::string& saved,
                                    std::vector<double>& into, int32_t& overlapped) {
      quiet_barrier(*host, dir);
      auto start = Clock::now();
      auto work = checkpointer.save(saved);
      check(work.status(), "save");
      int32_t in_flight = 0;
      for (int32_t s = 0; s < steps; ++s) {
        auto done = (*work)->test();
        const bool running = done.ok() && !*done;
        host_sync_reset();
        train_step();
        if (running) {
          ++in_flight;
          out.syncs = std::max(out.syncs, host_sync_count_thread());
        }
      }
      check(engine.synchronize(), "synchronize");
      into.push_back(slowest(*host, seconds_since(start)) / steps);
      check((*work)->wait(), "save");
      check(checkpointer.wait(), "save");
      overlapped = rep == 0 ? in_flight : std::min(overlapped, in_flight);
    };
    // The step right after save(), and `c.steps` steps from save() on.
    in_turn(
        [&] {
          time_steps_with_save(1, name + "-first", out.first_step_with_save, out.first_overlapped);
        },
        [&] { time_steps(1, out.first_step); });
    in_turn(
        [&] {
          time_steps_with_save(c.steps, name + "-overlapped", out.step_with_save, out.overlapped);
        },
        [&] { time_steps(c.steps, out.step); });
  }
}

// The median of the repetitions' ratios a[i] / b[i] (each pair measured back to back).
double median_ratio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> ratios;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) ratios.push_back(a[i] / b[i]);
  return median(ratios);
}

}  // namespace

CkptResult run_ckpt(const CkptConfig& c) {
  std::string dir = c.dir;
  std::string made;
  if (dir.empty()) {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "hpshard-bench-ckpt-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) die("cannot create a temporary directory");
    dir = made = g_made_dir = pattern;
  }
  auto store = make_in_memory_store();
  std::vector<RankFigures> figures(static_cast<size_t>(c.ranks));
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < c.ranks; ++r) {
    threads.emplace_back([&, r] { run_rank(c, r, store, dir, figures[static_cast<size_t>(r)]); });
  }
  for (auto& t : threads) t.join();
  if (!made.empty()) (void)ckpt::remove_tree(made);
  g_made_dir.clear();
  CkptResult r;
  r.ranks = c.ranks;
  const RankFigures& f = figures[0];
  for (const auto& rank : figures) {
    r.saved_bytes += rank.bytes;
    r.loaded_equal = (&rank == &figures[0] || r.loaded_equal) && rank.equal;
    r.host_syncs_in_overlapped_steps = std::max(r.host_syncs_in_overlapped_steps, rank.syncs);
  }
  r.save_seconds = median(f.save);
  r.write_seconds = median(f.write);
  r.load_seconds = median(f.load);
  r.read_seconds = median(f.read);
  r.read_plain_file_seconds = median(f.read_plain_file);
  r.first_step_seconds = median(f.first_step);
  r.first_step_with_save_seconds = median(f.first_step_with_save);
  r.first_step_ratio = median_ratio(f.first_step_with_save, f.first_step);
  r.first_overlapped = f.first_overlapped;
  r.step_seconds = median(f.step);
  r.step_with_save_seconds = median(f.step_with_save);
  r.save_ratio = median_ratio(f.write, f.save);
  r.load_ratio = median_ratio(f.read, f.load);
  r.load_ratio_plain_file = median_ratio(f.read_plain_file, f.load);
  r.step_ratio = median_ratio(f.step_with_save, f.step);
  r.overlapped_steps = f.overlapped;
  return r;
}

void print_ckpt(std::FILE* out, const CkptConfig& c, const RunInfo& info, const CkptResult& r) {
  const double gb = static_cast<double>(r.saved_bytes) / 1e9;
  print_run_header(out, "ckpt", info);
  std::fprintf(out,
               "# Stage2Engine on %s, AdamW, %d ranks as threads, %d fp32 parameters of %s in "
               "all; a step's %d passes %s; medians of %d repetitions of the slowest rank; each "
               "ratio the median of the repetitions' ratios (each pair back to back, in "
               "alternating order); GB/s = 1e9\n",
               c.device.to_string().c_str(), c.ranks, c.tensors, size_text(c.bytes).c_str(),
               c.compute_passes,
               uses_kernel_passes(c) ? "by the kernel table's accumulate on the compute stream"
                                     : "by host loops",
               c.reps);
  std::fprintf(out,
               "# reference: each rank writes (write + fsync) as many bytes as its data file, "
               "sequentially, beside the others, and reads (pread) its data file of the "
               "checkpoint loaded; loads and reads from a cold cache, each timed operation "
               "after a syncfs\n");
  std::fprintf(out, "\n%-6s %12s %10s %10s %8s\n", "what", "bytes", "hpshard_s", "plain_s",
               "ratio");
  std::fprintf(out, "%-6s %12llu %10.4f %10.4f %8.3f\n", "save",
               static_cast<unsigned long long>(r.saved_bytes), r.save_seconds, r.write_seconds,
               r.save_ratio);
  std::fprintf(out, "%-6s %12llu %10.4f %10.4f %8.3f\n", "load",
               static_cast<unsigned long long>(r.saved_bytes), r.load_seconds, r.read_seconds,
               r.load_ratio);
  std::fprintf(out, "%-6s %12llu %10.4f %10.4f %8.3f  (plain: the plain file written above)\n",
               "load", static_cast<unsigned long long>(r.saved_bytes), r.load_seconds,
               r.read_plain_file_seconds, r.load_ratio_plain_file);
  std::fprintf(out, "\n%-34s %10s %16s %8s %11s %10s\n",
               ("step (MLP-like, " + std::to_string(c.compute_passes) + " passes)").c_str(),
               "alone_ms", "with_save_ms", "ratio", "overlapped", "host_syncs");
  std::fprintf(out, "%-34s %10.3f %16.3f %8.3f %7d/%-3d %10llu\n", "the step right after save()",
               r.first_step_seconds * 1e3, r.first_step_with_save_seconds * 1e3, r.first_step_ratio,
               r.first_overlapped, 1,
               static_cast<unsigned long long>(r.host_syncs_in_overlapped_steps));
  std::fprintf(out, "%-34s %10.3f %16.3f %8.3f %7d/%-3d %10llu\n",
               (std::to_string(c.steps) + " steps from save() on, each").c_str(),
               r.step_seconds * 1e3, r.step_with_save_seconds * 1e3, r.step_ratio,
               r.overlapped_steps, c.steps,
               static_cast<unsigned long long>(r.host_syncs_in_overlapped_steps));
  std::fprintf(
      out,
      "\nsummary: ckpt: save %.3f GB/s = %.3fx plain write (target >= %.2f: %s); load "
      "%.3f GB/s = %.3fx plain read of its files (target >= %.2f: %s; %.3fx a read of the "
      "plain file); the step right after save() %.3fx a step without a save (target <= %.2f: "
      "%s; %d steps from save() on %.3fx); loaded state %s\n",
      gb / r.save_seconds, r.save_ratio, kCkptBandwidthTarget,
      r.save_ratio >= kCkptBandwidthTarget ? "met" : "missed", gb / r.load_seconds, r.load_ratio,
      kCkptBandwidthTarget, r.load_ratio >= kCkptBandwidthTarget ? "met" : "missed",
      r.load_ratio_plain_file, r.first_step_ratio, kCkptOverlapTarget,
      r.first_step_ratio <= kCkptOverlapTarget ? "met" : "missed", c.steps, r.step_ratio,
      r.loaded_equal ? "bitwise equal to the saved state" : "DIFFERS from the saved state");
}

Json ckpt_to_json(const CkptConfig& c, const RunInfo& info, const CkptResult& r) {
  Json j;
  add_run_info(j, "ckpt", info);
  j["config"] = {{"device", c.device.to_string()},
                 {"ranks", c.ranks},
                 {"bytes", c.bytes},
                 {"tensors", c.tensors},
                 {"reps", c.reps},
                 {"steps", c.steps},
                 {"compute_passes", c.compute_passes},
                 {"kernel_passes", uses_kernel_passes(c)}};
  j["units"] = {{"time", "seconds, median over repetitions of the slowest rank"},
                {"ratio", "median over repetitions of each back-to-back pair's ratio"},
                {"bytes", "every rank's data file"}};
  j["reference"] =
      "each rank writes (write + fsync) as many bytes as its data file, sequentially, beside "
      "the others, and reads (pread, cold cache) its data file of the checkpoint loaded; "
      "read_plain_file: a cold read of the plain file written; a syncfs before each timed "
      "operation";
  j["targets"] = {{"save_ratio_min", kCkptBandwidthTarget},
                  {"load_ratio_min", kCkptBandwidthTarget},
                  {"first_step_ratio_max", kCkptOverlapTarget}};
  j["torch"] = {{"ran", false}, {"status", "no torch column for checkpoints"}};
  j["results"] =
      Json::array({{{"ranks", r.ranks},
                    {"saved_bytes", r.saved_bytes},
                    {"save_seconds", r.save_seconds},
                    {"write_seconds", r.write_seconds},
                    {"save_ratio", r.save_ratio},
                    {"load_seconds", r.load_seconds},
                    {"read_seconds", r.read_seconds},
                    {"load_ratio", r.load_ratio},
                    {"read_plain_file_seconds", r.read_plain_file_seconds},
                    {"load_ratio_plain_file", r.load_ratio_plain_file},
                    {"first_step_seconds", r.first_step_seconds},
                    {"first_step_with_save_seconds", r.first_step_with_save_seconds},
                    {"first_step_ratio", r.first_step_ratio},
                    {"first_step_overlapped", r.first_overlapped},
                    {"step_seconds", r.step_seconds},
                    {"step_with_save_seconds", r.step_with_save_seconds},
                    {"step_ratio", r.step_ratio},
                    {"overlapped_steps", r.overlapped_steps},
                    {"host_syncs_in_overlapped_steps_max", r.host_syncs_in_overlapped_steps},
                    {"loaded_equal", r.loaded_equal}}});
  return j;
}

}  // namespace hps::bench
