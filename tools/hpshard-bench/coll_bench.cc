#include "tools/hpshard-bench/coll_bench.h"

#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/comm/communicator.h"
#include "core/comm/store.h"
#include "tools/hpshard-bench/gloo_reference.h"

namespace hps::bench {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& message) {
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  std::fflush(stdout);
  std::fprintf(stderr, "hpshard-bench: error: %s\n", message.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

void fill(DType dtype, void* base, size_t offset, size_t count, double value) {
  if (dtype == DType::kFloat64) {
    std::fill_n(static_cast<double*>(base) + offset, count, value);
  } else {
    std::fill_n(static_cast<float*>(base) + offset, count, static_cast<float>(value));
  }
}

double load(DType dtype, const void* base, size_t i) {
  if (dtype == DType::kFloat64) return static_cast<const double*>(base)[i];
  return static_cast<const float*>(base)[i];
}

struct Case {
  CollOp op;
  size_t bytes;
  size_t count;
  int32_t iters;
  int32_t warmup;
};

// Fills the inputs of `c` with known values before the checked run.
void fill_inputs(const Case& c, DType dtype, int32_t rank, int32_t size, void* send, void* recv) {
  const double mine = rank + 1;
  switch (c.op) {
    case CollOp::kAllReduce:
    case CollOp::kAllGather: fill(dtype, send, 0, c.count, mine); return;
    case CollOp::kReduceScatter:
      fill(dtype, send, 0, c.count * static_cast<size_t>(size), mine);
      // Gloo's reduce-scatter works in place on recv (size × count).
      fill(dtype, recv, 0, c.count * static_cast<size_t>(size), mine);
      return;
    case CollOp::kBroadcast: fill(dtype, recv, 0, c.count, rank == 0 ? 7.0 : 0.0); return;
  }
}

// Samples the output of the checked run; empty when right, else what is wrong.
std::string check_output(const Case& c, DType dtype, int32_t size, const void* recv) {
  const double n = size;
  const double sum = n * (n + 1) / 2;
  auto sample = [&](size_t offset, double expected) -> std::string {
    for (size_t i : {size_t{0}, c.count / 2, c.count - 1}) {
      const double got = load(dtype, recv, offset + i);
      if (got != expected) {
        return "element " + std::to_string(offset + i) + " is " + std::to_string(got) +
               ", expected " + std::to_string(expected);
      }
    }
    return {};
  };
  switch (c.op) {
    case CollOp::kAllReduce:
    case CollOp::kReduceScatter: return sample(0, sum);
    case CollOp::kBroadcast: return sample(0, 7.0);
    case CollOp::kAllGather:
      for (int32_t r = 0; r < size; ++r) {
        std::string wrong = sample(static_cast<size_t>(r) * c.count, r + 1);
        if (!wrong.empty()) return wrong;
      }
      return {};
  }
  return {};
}

Status run_hpshard(Communicator& comm, const Case& c, DType dtype, const void* send, void* recv) {
  StatusOr<std::shared_ptr<Work>> work = [&]() -> StatusOr<std::shared_ptr<Work>> {
    switch (c.op) {
      case CollOp::kAllReduce: return comm.all_reduce(send, recv, c.count, dtype, ReduceOp::kSum);
      case CollOp::kAllGather: return comm.all_gather(send, recv, c.count, dtype);
      case CollOp::kReduceScatter:
        return comm.reduce_scatter(send, recv, c.count, dtype, ReduceOp::kSum);
      case CollOp::kBroadcast: return comm.broadcast(recv, c.count, dtype, 0);
    }
    return invalid_argument("unknown op");
  }();
  if (!work.ok()) return work.status();
  return (*work)->wait();
}

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Median over iterations of the slowest rank: times[iteration * ranks + rank].
double median_of_slowest(const std::vector<double>& times, int32_t ranks) {
  std::vector<double> slowest;
  for (size_t i = 0; i + static_cast<size_t>(ranks) <= times.size(); i += ranks) {
    slowest.push_back(*std::max_element(times.begin() + static_cast<std::ptrdiff_t>(i),
                                        times.begin() + static_cast<std::ptrdiff_t>(i + ranks)));
  }
  if (slowest.empty()) return 0;
  std::sort(slowest.begin(), slowest.end());
  const size_t m = slowest.size() / 2;
  return slowest.size() % 2 ? slowest[m] : (slowest[m - 1] + slowest[m]) / 2;
}

std::string size_label(size_t bytes) {
  if (bytes >= (size_t{1} << 20) && bytes % (size_t{1} << 20) == 0) {
    return std::to_string(bytes >> 20) + " MiB";
  }
  if (bytes >= 1024 && bytes % 1024 == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

}  // namespace

std::vector<size_t> message_sizes(const CollConfig& config) {
  std::vector<size_t> sizes;
  for (size_t s = std::max<size_t>(config.min_bytes, 1); s <= config.max_bytes; s *= 2) {
    sizes.push_back(s);
  }
  return sizes;
}

int32_t iterations_for(const CollConfig& config, size_t bytes) {
  if (config.iters > 0) return config.iters;
  const size_t budget = size_t{256} << 20;  // ~bytes per case and implementation
  return static_cast<int32_t>(std::clamp<size_t>(budget / std::max<size_t>(bytes, 1), 5, 40));
}

int32_t warmup_for(const CollConfig& config, size_t bytes) {
  if (config.warmup >= 0) return config.warmup;
  return bytes < (size_t{1} << 20) ? 3 : 1;
}

// Timed blocks per implementation and case (fewer when a case has fewer iterations).
constexpr int32_t kBlocks = 4;

WorldResult run_world(const CollConfig& config, int32_t ranks) {
  const size_t element = dtype_size(config.dtype);
  std::vector<Case> cases;
  size_t largest = 0;
  for (CollOp op : config.ops) {
    for (size_t s : message_sizes(config)) {
      const size_t divisor = element * (count_is_per_rank(op) ? static_cast<size_t>(ranks) : 1);
      const size_t count = s / divisor;
      if (count == 0) continue;
      const size_t bytes = count * divisor;
      cases.push_back({op, bytes, count, iterations_for(config, bytes), warmup_for(config, bytes)});
      largest = std::max(largest, bytes);
    }
  }

  // hpshard[case][iteration * ranks + rank], gloo likewise.
  std::vector<std::vector<double>> hpshard_times(cases.size()), gloo_times(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    hpshard_times[i].assign(static_cast<size_t>(cases[i].iters * ranks), 0.0);
    gloo_times[i].assign(static_cast<size_t>(cases[i].iters * ranks), 0.0);
  }

  auto store = make_in_memory_store();
  ::gloo::rendezvous::HashStore gloo_store;
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  try {
    ::gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    gloo_device = ::gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    die(std::string("cannot open a Gloo TCP device on 127.0.0.1: ") + e.what());
  }
  std::barrier sync(ranks);
  std::atomic<int32_t> gloo_wrong{0};

  auto rank_main = [&](int32_t rank) {
    CommOptions options;
    options.timeout = config.timeout;
    options.name = "bench";
    options.check_arguments = config.check_arguments;
    options.shared_memory = config.shared_memory;
    options.shared_memory_direct = config.shared_memory_direct;
    auto comm = create_communicator(store, rank, ranks, Device::cpu(), options);
    if (!comm.ok()) die("creating the hpshard communicator: " + comm.status().to_string());
    const std::string_view wanted = config.shared_memory ? "shm" : "tcp";
    if ((*comm)->transport() != wanted) {
      die("the hpshard communicator uses " + std::string((*comm)->transport()) + ", not " +
          std::string(wanted));
    }
    std::unique_ptr<GlooReference> gloo;
    try {
      gloo = std::make_unique<GlooReference>(rank, ranks, gloo_store, gloo_device, config.timeout);
    } catch (const std::exception& e) {
      die(std::string("creating the Gloo context: ") + e.what());
    }
    // Zero-filled, so every page is touched before the first timed run.
    std::vector<std::byte> send(largest + element), recv(largest + element);

    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& c = cases[ci];
      const std::string what = std::to_string(ranks) + " ranks, " +
                               std::string(coll_op_name(c.op)) + " " + size_label(c.bytes);
      if (rank == 0 && config.progress) {
        std::fprintf(stderr, "[hpshard-bench] %s (%d iterations)\n", what.c_str(), c.iters);
      }
      // The checked runs: known inputs, sampled outputs, untimed.
      fill_inputs(c, config.dtype, rank, ranks, send.data(), recv.data());
      Status s = run_hpshard(**comm, c, config.dtype, send.data(), recv.data());
      if (!s.ok()) die("hpshard " + what + ": " + s.to_string());
      if (auto wrong = check_output(c, config.dtype, ranks, recv.data()); !wrong.empty()) {
        die("hpshard " + what + " gave a wrong result on rank " + std::to_string(rank) + ": " +
            wrong);
      }
      fill_inputs(c, config.dtype, rank, ranks, send.data(), recv.data());
      sync.arrive_and_wait();
      try {
        gloo->prepare(c.op, config.dtype, recv.data(), c.count);
        gloo->run(c.op, config.dtype, send.data(), recv.data(), c.count);
      } catch (const std::exception& e) {
        die("Gloo " + what + ": " + e.what());
      }
      if (auto wrong = check_output(c, config.dtype, ranks, recv.data()); !wrong.empty()) {
        if (c.op != CollOp::kReduceScatter) {
          die("Gloo " + what + " gave a wrong result on rank " + std::to_string(rank) + ": " +
              wrong);
        }
        // Gloo 0.5's ReduceScatterHalvingDoubling races with itself (docs/benchmarks.md):
        // counted and reported, the timing is kept.
        ++gloo_wrong;
        if (config.progress) {
          std::fprintf(stderr, "[hpshard-bench] note: Gloo %s gave a wrong result on rank %d: %s\n",
                       what.c_str(), rank, wrong.c_str());
        }
      }

      // Blocks, A/B/B/A...: the timed iterations run in up to kBlocks blocks per
      // implementation, each after its own warmup, and which goes first alternates, so drift
      // falls on both. Blocks rather than single runs: Gloo 0.5's event loop spins while a
      // pair's lock is held, and with a second context busy on the other run's heels those
      // spins starve the lock holder for whole scheduler ticks (docs/benchmarks.md).
      const int32_t blocks = std::min(c.iters, kBlocks);
      int32_t done = 0;
      for (int32_t b = 0; b < blocks; ++b) {
        const int32_t timed = (c.iters - done) / (blocks - b);
        for (int32_t k = 0; k < 2; ++k) {
          const bool hpshard_turn = (k == 0) == (b % 2 == 0);
          auto& times = hpshard_turn ? hpshard_times[ci] : gloo_times[ci];
          for (int32_t it = 0; it < c.warmup + timed; ++it) {
            sync.arrive_and_wait();
            const auto start = Clock::now();
            if (hpshard_turn) {
              s = run_hpshard(**comm, c, config.dtype, send.data(), recv.data());
              if (!s.ok()) die("hpshard " + what + ": " + s.to_string());
            } else {
              try {
                gloo->run(c.op, config.dtype, send.data(), recv.data(), c.count);
              } catch (const std::exception& e) {
                die("Gloo " + what + ": " + e.what());
              }
            }
            const double t = seconds_between(start, Clock::now());
            if (it >= c.warmup) {
              times[static_cast<size_t>((done + it - c.warmup) * ranks + rank)] = t;
            }
          }
        }
        done += timed;
      }
      sync.arrive_and_wait();  // every rank is done with this case's Gloo buffers
      gloo->release();
    }
    sync.arrive_and_wait();
    gloo.reset();
    comm->reset();
  };

  std::vector<std::thread> threads;
  for (int32_t r = 0; r < ranks; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();

  WorldResult result;
  result.ranks = ranks;
  result.gloo_reduce_scatter_wrong = gloo_wrong.load();
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    CollRow row;
    row.op = cases[ci].op;
    row.bytes = cases[ci].bytes;
    row.count = cases[ci].count;
    row.iters = cases[ci].iters;
    row.hpshard_seconds = median_of_slowest(hpshard_times[ci], ranks);
    row.gloo_seconds = median_of_slowest(gloo_times[ci], ranks);
    result.rows.push_back(row);
  }
  return result;
}

WorldResult run_world_repeated(const CollConfig& config, int32_t ranks,
                               const std::function<void(WorldResult&)>& after_each) {
  std::vector<WorldResult> runs;
  for (int32_t k = 0; k < config.repeat; ++k) {
    if (config.progress && config.repeat > 1) {
      std::fprintf(stderr, "[hpshard-bench] %d ranks, repetition %d of %d\n", ranks, k + 1,
                   config.repeat);
    }
    runs.push_back(run_world(config, ranks));
    if (after_each) after_each(runs.back());
  }
  WorldResult merged = runs.front();
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  };
  for (size_t i = 0; i < merged.rows.size(); ++i) {
    std::vector<double> hpshard, gloo, mpi;
    for (const auto& run : runs) {
      hpshard.push_back(run.rows[i].hpshard_seconds);
      gloo.push_back(run.rows[i].gloo_seconds);
      if (run.rows[i].mpi_seconds) mpi.push_back(*run.rows[i].mpi_seconds);
    }
    merged.rows[i].hpshard_seconds = median(hpshard);
    merged.rows[i].gloo_seconds = median(gloo);
    merged.rows[i].mpi_seconds.reset();
    if (!mpi.empty()) merged.rows[i].mpi_seconds = median(mpi);
  }
  merged.gloo_reduce_scatter_wrong = 0;
  for (const auto& run : runs) merged.gloo_reduce_scatter_wrong += run.gloo_reduce_scatter_wrong;
  return merged;
}

}  // namespace hps::bench
