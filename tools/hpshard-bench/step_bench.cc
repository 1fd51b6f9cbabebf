#include "tools/hpshard-bench/step_bench.h"

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "core/comm/communicator.h"
#include "core/comm/store.h"
#include "core/device/host_sync.h"
#include "core/kernels/norm.h"
#include "core/kernels/optimizer.h"
#include "core/sharding/stage2_engine.h"
#include "core/sharding/stage3_engine.h"
#include "core/trace/trace.h"

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

void check(const Status& s, const std::string& what) {
  if (!s.ok()) die(what + ": " + s.to_string());
}

// ---- The model: depth linear layers width x width, ReLU between them, squared error. ----
// Row-major: x[B][K] W[K][N]. The loops put a row of W (or of its gradient) in the inner
// loop for all B samples at once, so each weight matrix streams through the cache once
// per pass (a simple blocking for small batches).

// out[i][:] = b + Σ_k in[i][k] W[k][:]
void linear_forward(const float* in, const float* w, const float* b, float* out, size_t batch,
                    size_t k_dim, size_t n_dim) {
  for (size_t i = 0; i < batch; ++i) std::memcpy(out + i * n_dim, b, n_dim * sizeof(float));
  for (size_t k = 0; k < k_dim; ++k) {
    const float* wk = w + k * n_dim;
    for (size_t i = 0; i < batch; ++i) {
      const float a = in[i * k_dim + k];
      float* o = out + i * n_dim;
      for (size_t j = 0; j < n_dim; ++j) o[j] += a * wk[j];
    }
  }
}

float dot(const float* a, const float* b, size_t n) {
  float acc[8] = {};
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    for (size_t u = 0; u < 8; ++u) acc[u] += a[j + u] * b[j + u];
  }
  float s = 0;
  for (; j < n; ++j) s += a[j] * b[j];
  for (float v : acc) s += v;
  return s;
}

// gW += in^T dz, gb += Σ_i dz[i]; din = dz W^T (when din is not null).
void linear_backward(const float* in, const float* w, const float* dz, float* gw, float* gb,
                     float* din, size_t batch, size_t k_dim, size_t n_dim) {
  for (size_t k = 0; k < k_dim; ++k) {
    float* g = gw + k * n_dim;
    for (size_t i = 0; i < batch; ++i) {
      const float a = in[i * k_dim + k];
      const float* d = dz + i * n_dim;
      for (size_t j = 0; j < n_dim; ++j) g[j] += a * d[j];
    }
  }
  for (size_t i = 0; i < batch; ++i) {
    const float* d = dz + i * n_dim;
    for (size_t j = 0; j < n_dim; ++j) gb[j] += d[j];
  }
  if (din == nullptr) return;
  for (size_t k = 0; k < k_dim; ++k) {
    const float* wk = w + k * n_dim;
    for (size_t i = 0; i < batch; ++i) din[i * k_dim + k] = dot(dz + i * n_dim, wk, n_dim);
  }
}

// Per layer: the parameters and the gradient buffers one contender's forward and backward
// use.
struct LayerViews {
  std::vector<const float*> w, b;
  std::vector<float*> gw, gb;
  explicit LayerViews(size_t depth) : w(depth), b(depth), gw(depth), gb(depth) {}
};

struct Mlp {
  size_t width = 0, depth = 0, batch = 0;
  std::vector<std::vector<float>> act;  // depth + 1 activations, [batch][width]
  std::vector<std::vector<float>> pre;  // depth pre-activations
  std::vector<float> target, dz, din;

  Mlp(size_t w, size_t d, size_t b) : width(w), depth(d), batch(b) {
    act.assign(depth + 1, std::vector<float>(batch * width));
    pre.assign(depth, std::vector<float>(batch * width));
    target.resize(batch * width);
    dz.resize(batch * width);
    din.resize(batch * width);
  }

  // This rank's samples of global step `step`.
  void make_batch(int64_t step, int32_t rank) {
    for (size_t i = 0; i < batch; ++i) {
      const double sample = static_cast<double>(step * 4096 + rank * 64) + static_cast<double>(i);
      for (size_t k = 0; k < width; ++k) {
        act[0][i * width + k] = static_cast<float>(std::sin(0.37 * sample + 0.91 * double(k)));
        target[i * width + k] = static_cast<float>(0.5 * std::cos(0.23 * sample + 0.7 * double(k)));
      }
    }
  }

  // One forward and backward. views.w[l], views.b[l]: layer l's parameters; views.gw[l],
  // views.gb[l]: where its gradients are added. The hooks (each may be empty) get the
  // layer and the views, which they may change (stage 3's views exist only while the
  // layer is gathered and may move between gathers): the loops read layer l's pointers
  // after the hook before its use. before_forward(l) / after_forward(l) run around layer
  // l's forward, before_backward(l) before its backward, after_backward(l) once its
  // gradients are complete.
  struct Hooks {
    std::function<void(size_t, LayerViews&)> before_forward, after_forward, before_backward,
        after_backward;
  };
  void forward_backward(LayerViews& views, const Hooks& hooks) {
    for (size_t l = 0; l < depth; ++l) {
      if (hooks.before_forward) hooks.before_forward(l, views);
      linear_forward(act[l].data(), views.w[l], views.b[l], pre[l].data(), batch, width, width);
      float* next = act[l + 1].data();
      const float* p = pre[l].data();
      const bool relu = l + 1 < depth;
      for (size_t j = 0; j < batch * width; ++j) next[j] = relu ? std::max(p[j], 0.0f) : p[j];
      if (hooks.after_forward) hooks.after_forward(l, views);
    }
    // Loss = mean over samples of ½‖out − target‖²: dz = (out − target) / batch.
    const float inv = 1.0f / static_cast<float>(batch);
    for (size_t j = 0; j < batch * width; ++j) dz[j] = (act[depth][j] - target[j]) * inv;
    for (size_t l = depth; l-- > 0;) {
      if (hooks.before_backward) hooks.before_backward(l, views);
      linear_backward(act[l].data(), views.w[l], dz.data(), views.gw[l], views.gb[l],
                      l > 0 ? din.data() : nullptr, batch, width, width);
      if (hooks.after_backward) hooks.after_backward(l, views);
      if (l == 0) break;
      const float* p = pre[l - 1].data();
      for (size_t j = 0; j < batch * width; ++j) dz[j] = p[j] > 0 ? din[j] : 0.0f;
    }
  }
};

float initial_value(size_t layer, size_t index, size_t width) {
  return static_cast<float>(std::sin(1.7 * static_cast<double>(layer * 7919 + index) + 0.5) /
                            std::sqrt(static_cast<double>(width)));
}

// Median over repetitions of the slowest rank: times[rep * ranks + rank].
double median_of_slowest(const std::vector<double>& times, int32_t ranks) {
  std::vector<double> slowest;
  for (size_t i = 0; i + static_cast<size_t>(ranks) <= times.size(); i += ranks) {
    slowest.push_back(*std::max_element(times.begin() + static_cast<std::ptrdiff_t>(i),
                                        times.begin() + static_cast<std::ptrdiff_t>(i + ranks)));
  }
  return median(slowest);
}

enum Contender : size_t {
  kStage2 = 0,
  kStage3 = 1,
  kUnsharded = 2,
  kCompute = 3,
  kStage2Traced = 4,  // with trace_overhead only
  kStage3Traced = 5,
  kAllContenders = 6
};

// Stage 2 and stage 3 with the same options and the same model registration: each layer
// is one unit (one bucket: its weight and bias).
template <typename Engine>
std::unique_ptr<Engine> make_engine(const std::shared_ptr<Communicator>& comm,
                                    const EngineOptions& eo, size_t width, size_t depth,
                                    const char* what) {
  auto created = Engine::create(comm, nullptr, eo);
  if (!created.ok()) die(std::string(what) + "::create: " + created.status().to_string());
  std::unique_ptr<Engine> engine = std::move(*created);
  const int64_t wide = static_cast<int64_t>(width);
  for (size_t l = 0; l < depth; ++l) {
    ParamSpec weight{"layer" + std::to_string(l) + ".weight", {wide, wide}};
    weight.unit = static_cast<int32_t>(l);
    ParamSpec bias{"layer" + std::to_string(l) + ".bias", {wide}};
    bias.unit = static_cast<int32_t>(l);
    if (!engine->add_param(weight).ok() || !engine->add_param(bias).ok()) {
      die(std::string(what) + "::add_param");
    }
  }
  check(engine->seal(), std::string(what) + "::seal");
  return engine;
}

float* view(StatusOr<float*> v, const char* what) {
  if (!v.ok()) die(std::string(what) + ": " + v.status().to_string());
  return *v;
}

// Rank 0 writes the initial values into the engine's views (before broadcast_parameters()
// both engines expose full buffers), then every rank broadcasts.
void initialise(ShardedEngine& engine, int32_t rank, size_t width, size_t depth) {
  if (rank == 0) {
    for (size_t l = 0; l < depth; ++l) {
      float* w = view(engine.param(2 * l), "param");
      float* b = view(engine.param(2 * l + 1), "param");
      for (size_t i = 0; i < width * width; ++i) w[i] = initial_value(l, i, width);
      for (size_t i = 0; i < width; ++i) b[i] = initial_value(l, width * width + i, width);
    }
  }
  check(engine.broadcast_parameters(), "broadcast_parameters");
}

}  // namespace

StepWorld run_step_world(const StepConfig& config, int32_t ranks) {
  const size_t width = static_cast<size_t>(config.width);
  const size_t depth = static_cast<size_t>(config.depth);
  const size_t batch = static_cast<size_t>(config.batch);
  const size_t layer_numel = width * width + width;
  const int32_t total_reps = config.warmup + config.reps;

  StepWorld world;
  world.ranks = ranks;
  world.width = config.width;
  world.parameters = layer_numel * depth;
  world.timed_steps = static_cast<int64_t>(config.reps) * config.steps;
  const size_t kContenders = config.trace_overhead ? kAllContenders : kCompute + 1;
  std::vector<std::vector<double>> times(kAllContenders);
  for (auto& t : times) t.assign(static_cast<size_t>(config.reps * ranks), 0.0);
  std::mutex result_mutex;

  auto store = make_in_memory_store();
  std::barrier sync(ranks);

  auto rank_main = [&](int32_t rank) {
    CommOptions defaults;
    defaults.timeout = Milliseconds(600'000);
    defaults.name = "bench";
    auto options = comm_options_from_env(defaults);
    if (!options.ok()) die("communicator options: " + options.status().to_string());
    auto created = create_communicator(store, rank, ranks, Device::cpu(), *options);
    if (!created.ok()) die("creating the hpshard communicator: " + created.status().to_string());
    std::shared_ptr<Communicator> comm = std::move(*created);
    if (rank == 0) world.transport = std::string(comm->transport());

    EngineOptions eo;
    eo.optimizer = config.adamw ? OptimizerKind::kAdamW : OptimizerKind::kSgd;
    eo.sgd = {0.01f, 0.9f, 0.0f, false};
    eo.clip_max_norm = config.clip;
    eo.prefetch_window = config.prefetch_window;

    // (a) Stage 2: full parameters and gradients stay resident, so the views are fixed.
    std::unique_ptr<Stage2Engine> stage2 =
        make_engine<Stage2Engine>(comm, eo, width, depth, "Stage2Engine");
    LayerViews s_views(depth);
    for (size_t l = 0; l < depth; ++l) {
      s_views.w[l] = view(stage2->param(2 * l), "Stage2Engine::param");
      s_views.b[l] = view(stage2->param(2 * l + 1), "Stage2Engine::param");
      s_views.gw[l] = view(stage2->grad(2 * l), "Stage2Engine::grad");
      s_views.gb[l] = view(stage2->grad(2 * l + 1), "Stage2Engine::grad");
    }
    initialise(*stage2, rank, width, depth);

    // (b) Stage 3: only shards resident; a layer's views exist while it is gathered and are
    // taken again after every gather().
    std::unique_ptr<Stage3Engine> stage3 =
        make_engine<Stage3Engine>(comm, eo, width, depth, "Stage3Engine");
    initialise(*stage3, rank, width, depth);
    LayerViews s3_views(depth);  // filled by the hooks

    // (c) Unsharded data parallel: per layer one flat [W | b] buffer, its gradient, the
    // optimizer state over the full parameters.
    std::vector<std::vector<float>> u_param(depth), u_grad(depth), u_a(depth), u_b(depth);
    LayerViews u_views(depth);
    for (size_t l = 0; l < depth; ++l) {
      u_param[l].resize(layer_numel);
      for (size_t i = 0; i < layer_numel; ++i) u_param[l][i] = initial_value(l, i, width);
      u_grad[l].assign(layer_numel, 0.0f);
      u_a[l].assign(layer_numel, 0.0f);
      if (config.adamw) u_b[l].assign(layer_numel, 0.0f);
      u_views.w[l] = u_param[l].data();
      u_views.b[l] = u_param[l].data() + width * width;
      u_views.gw[l] = u_grad[l].data();
      u_views.gb[l] = u_grad[l].data() + width * width;
    }
    // (d) Forward + backward alone, on the unsharded parameters, into gradients nobody
    // reads (one layer's buffer shared by every layer).
    std::vector<float> c_grad(layer_numel, 0.0f);
    LayerViews c_views = u_views;
    for (size_t l = 0; l < depth; ++l) {
      c_views.gw[l] = c_grad.data();
      c_views.gb[l] = c_grad.data() + width * width;
    }

    Mlp mlp(width, depth, batch);
    int64_t stage2_step = 0, stage3_step = 0, unsharded_step = 0;
    uint64_t my_stage2_syncs = 0, my_stage3_syncs = 0, my_unsharded_syncs = 0;
    std::vector<std::shared_ptr<Work>> reduced(depth);

    Mlp::Hooks stage2_hooks;
    stage2_hooks.before_forward = [&](size_t l, LayerViews&) {
      check(stage2->wait_parameters(static_cast<int32_t>(l)), "wait_parameters");
    };
    stage2_hooks.after_backward = [&](size_t l, LayerViews&) {
      check(stage2->grad_ready(2 * l), "grad_ready");
      check(stage2->grad_ready(2 * l + 1), "grad_ready");
    };
    auto run_stage2 = [&](bool timed) {
      const uint64_t before = host_sync_count_thread();
      mlp.make_batch(stage2_step++, rank);
      mlp.forward_backward(s_views, stage2_hooks);
      check(stage2->step(), "Stage2Engine::step");
      if (timed) my_stage2_syncs = std::max(my_stage2_syncs, host_sync_count_thread() - before);
    };

    Mlp::Hooks stage3_hooks;
    const auto gather3 = [&](size_t l, LayerViews& v, bool grads) {
      check(stage3->gather(static_cast<int32_t>(l)), "Stage3Engine::gather");
      v.w[l] = view(stage3->param(2 * l), "Stage3Engine::param");
      v.b[l] = view(stage3->param(2 * l + 1), "Stage3Engine::param");
      if (grads) {
        v.gw[l] = view(stage3->grad(2 * l), "Stage3Engine::grad");
        v.gb[l] = view(stage3->grad(2 * l + 1), "Stage3Engine::grad");
      }
    };
    stage3_hooks.before_forward = [&](size_t l, LayerViews& v) { gather3(l, v, false); };
    stage3_hooks.after_forward = [&](size_t l, LayerViews&) {
      check(stage3->release(static_cast<int32_t>(l)), "Stage3Engine::release");
    };
    stage3_hooks.before_backward = [&](size_t l, LayerViews& v) { gather3(l, v, true); };
    stage3_hooks.after_backward = [&](size_t l, LayerViews& v) {
      check(stage3->grad_ready(2 * l, nullptr), "grad_ready");
      check(stage3->grad_ready(2 * l + 1, nullptr), "grad_ready");
      check(stage3->release(static_cast<int32_t>(l)), "Stage3Engine::release");
      v.w[l] = v.b[l] = nullptr;  // gone with the release
      v.gw[l] = v.gb[l] = nullptr;
    };
    auto run_stage3 = [&](bool timed) {
      const uint64_t before = host_sync_count_thread();
      mlp.make_batch(stage3_step++, rank);
      mlp.forward_backward(s3_views, stage3_hooks);
      check(stage3->step(), "Stage3Engine::step");
      if (timed) my_stage3_syncs = std::max(my_stage3_syncs, host_sync_count_thread() - before);
    };

    Mlp::Hooks unsharded_hooks;
    unsharded_hooks.after_backward = [&](size_t l, LayerViews&) {
      auto work = comm->all_reduce(u_grad[l].data(), u_grad[l].data(), layer_numel, DType::kFloat32,
                                   ReduceOp::kAvg);
      if (!work.ok()) die("all_reduce: " + work.status().to_string());
      reduced[l] = std::move(*work);
    };
    double unsharded_wait = 0, unsharded_optimizer = 0;  // seconds over the timed steps
    auto run_unsharded = [&](bool timed) {
      const uint64_t before = host_sync_count_thread();
      mlp.make_batch(unsharded_step++, rank);
      mlp.forward_backward(u_views, unsharded_hooks);
      double squares = 0;
      double waited = 0;
      const auto optimizer_start = Clock::now();
      for (size_t l = 0; l < depth; ++l) {
        const auto wait_start = Clock::now();
        check(reduced[l]->wait(), "all_reduce wait");
        waited += std::chrono::duration<double>(Clock::now() - wait_start).count();
        if (config.clip > 0) {
          squares += cpu::sum_of_squares(DType::kFloat32, u_grad[l].data(), layer_numel);
        }
      }
      float coefficient = 1.0f;
      if (config.clip > 0) {
        const double norm = std::sqrt(squares);
        coefficient = static_cast<float>(config.clip / (std::max(norm, config.clip) + 1e-6));
      }
      const float* coef = config.clip > 0 ? &coefficient : nullptr;
      for (size_t l = 0; l < depth; ++l) {
        if (config.adamw) {
          cpu::adamw(u_param[l].data(), u_grad[l].data(), u_a[l].data(), u_b[l].data(), layer_numel,
                     eo.adamw, static_cast<long>(unsharded_step), coef, 1.0f);
        } else {
          cpu::sgd(u_param[l].data(), u_grad[l].data(), u_a[l].data(), layer_numel, eo.sgd, coef,
                   1.0f, unsharded_step == 1);
        }
        std::memset(u_grad[l].data(), 0, layer_numel * sizeof(float));
      }
      if (timed) {
        my_unsharded_syncs = std::max(my_unsharded_syncs, host_sync_count_thread() - before);
        unsharded_wait += waited;
        unsharded_optimizer +=
            std::chrono::duration<double>(Clock::now() - optimizer_start).count() - waited;
      }
    };
    const Mlp::Hooks no_hooks;
    auto run_compute = [&](bool) {
      mlp.make_batch(0, rank);
      mlp.forward_backward(c_views, no_hooks);
    };

    // The dependency-wait counters are process-global and only the rank threads add to
    // them (in gather()/wait_parameters()). Contenders never overlap: after each one a
    // barrier, then rank 0 reads the counters and charges the difference since its last
    // reading to that contender; the other ranks wait at the next contender's barrier
    // meanwhile, so nothing counts between the readings but that contender's steps.
    uint64_t last_waits = 0, last_wait_ns = 0;
    std::vector<uint64_t> waits(kAllContenders, 0), wait_ns(kAllContenders, 0);
    uint64_t traced_events = 0, traced_steps = 0;
    sync.arrive_and_wait();
    if (rank == 0) {
      last_waits = dependency_wait_count();
      last_wait_ns = dependency_wait_nanoseconds();
    }

    for (int32_t rep = 0; rep < total_reps; ++rep) {
      const bool timed = rep >= config.warmup;
      if (rank == 0 && config.progress) {
        std::fprintf(stderr, "[hpshard-bench] step, %d ranks, repetition %d/%d%s\n", ranks, rep + 1,
                     total_reps, timed ? "" : " (warmup)");
      }
      for (size_t k = 0; k < kContenders; ++k) {
        const size_t rotated = (k + static_cast<size_t>(rep)) % kContenders;
        const size_t c = rep % 2 ? kContenders - 1 - rotated : rotated;
        const bool traced = c == kStage2Traced || c == kStage3Traced;
        // Recording is process-wide: on while every rank runs this contender only.
        if (traced && rank == 0) trace::start(std::filesystem::temp_directory_path().string());
        sync.arrive_and_wait();
        const auto start = Clock::now();
        for (int32_t s = 0; s < config.steps; ++s) {
          if (c == kStage2 || c == kStage2Traced) run_stage2(timed);
          if (c == kStage3 || c == kStage3Traced) run_stage3(timed);
          if (c == kUnsharded) run_unsharded(timed);
          if (c == kCompute) run_compute(timed);
        }
        // The engines' last step is still in flight: their time includes draining it.
        if (c == kStage2 || c == kStage2Traced) {
          check(stage2->synchronize(), "Stage2Engine::synchronize");
        }
        if (c == kStage3 || c == kStage3Traced) {
          check(stage3->synchronize(), "Stage3Engine::synchronize");
        }
        const double t = std::chrono::duration<double>(Clock::now() - start).count();
        // The engines took extra steps traced: the reference takes them too (untimed), so
        // the parameters still compare.
        if (c == kStage2Traced) {
          for (int32_t s = 0; s < config.steps; ++s) run_unsharded(false);
        }
        if (timed) {
          times[c][static_cast<size_t>((rep - config.warmup) * ranks + rank)] = t / config.steps;
        }
        sync.arrive_and_wait();
        if (rank == 0) {
          const uint64_t n = dependency_wait_count(), ns = dependency_wait_nanoseconds();
          if (timed) {
            waits[c] += n - last_waits;
            wait_ns[c] += ns - last_wait_ns;
          }
          last_waits = n;
          last_wait_ns = ns;
          if (traced) {  // what was recorded is dropped, never written
            trace::stop();
            if (timed) {
              traced_events += trace::event_count();
              traced_steps += static_cast<uint64_t>(config.steps) * static_cast<uint64_t>(ranks);
            }
            trace::clear();
          }
        }
      }
    }
    sync.arrive_and_wait();

    // The same training on every side: compare the parameters with the reference's.
    auto gathered = stage3->gather_all();  // collective
    if (!gathered.ok()) die("Stage3Engine::gather_all: " + gathered.status().to_string());
    double diff2 = 0, diff3 = 0;
    for (size_t l = 0; l < depth; ++l) {
      const std::vector<float>& w3 = (*gathered)[2 * l];
      const std::vector<float>& b3 = (*gathered)[2 * l + 1];
      if (w3.size() != width * width || b3.size() != width) die("gather_all: wrong sizes");
      for (size_t i = 0; i < width * width; ++i) {
        diff2 = std::max(diff2, static_cast<double>(std::fabs(s_views.w[l][i] - u_views.w[l][i])));
        diff3 = std::max(diff3, static_cast<double>(std::fabs(w3[i] - u_views.w[l][i])));
      }
      for (size_t i = 0; i < width; ++i) {
        diff2 = std::max(diff2, static_cast<double>(std::fabs(s_views.b[l][i] - u_views.b[l][i])));
        diff3 = std::max(diff3, static_cast<double>(std::fabs(b3[i] - u_views.b[l][i])));
      }
    }
    uint64_t unsharded_bytes = 0;
    for (size_t l = 0; l < depth; ++l) {
      unsharded_bytes +=
          (u_param[l].size() + u_grad[l].size() + u_a[l].size() + u_b[l].size()) * sizeof(float);
    }
    {
      std::lock_guard lock(result_mutex);
      world.max_param_diff = std::max(world.max_param_diff, diff2);
      world.stage3_max_param_diff = std::max(world.stage3_max_param_diff, diff3);
      world.stage2_resident_bytes = std::max(world.stage2_resident_bytes, stage2->resident_bytes());
      world.stage3_resident_bytes =
          std::max(world.stage3_resident_bytes, stage3->peak_resident_bytes());
      world.unsharded_resident_bytes = std::max(world.unsharded_resident_bytes, unsharded_bytes);
      world.stage2_host_syncs_max = std::max(world.stage2_host_syncs_max, my_stage2_syncs);
      world.stage3_host_syncs_max = std::max(world.stage3_host_syncs_max, my_stage3_syncs);
      world.unsharded_host_syncs_max = std::max(world.unsharded_host_syncs_max, my_unsharded_syncs);
      // Means over ranks, per step.
      const double per_step = 1.0 / static_cast<double>(world.timed_steps * ranks);
      world.unsharded_wait_seconds += unsharded_wait * per_step;
      world.unsharded_optimizer_seconds += unsharded_optimizer * per_step;
      if (rank == 0) {
        world.dependency_waits = waits[kStage2];
        world.dependency_wait_seconds = static_cast<double>(wait_ns[kStage2]) * 1e-9;
        world.stage3_dependency_waits = waits[kStage3];
        world.stage3_dependency_wait_seconds = static_cast<double>(wait_ns[kStage3]) * 1e-9;
        if (traced_steps) {
          world.trace_events_per_step =
              static_cast<double>(traced_events) / static_cast<double>(traced_steps);
        }
      }
    }
    sync.arrive_and_wait();
    stage3.reset();
    stage2.reset();
    comm.reset();
  };

  std::vector<std::thread> threads;
  for (int32_t r = 0; r < ranks; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();

  world.stage2_seconds = median_of_slowest(times[kStage2], ranks);
  world.stage3_seconds = median_of_slowest(times[kStage3], ranks);
  world.unsharded_seconds = median_of_slowest(times[kUnsharded], ranks);
  world.compute_seconds = median_of_slowest(times[kCompute], ranks);
  if (config.trace_overhead) {
    world.stage2_traced_seconds = median_of_slowest(times[kStage2Traced], ranks);
    world.stage3_traced_seconds = median_of_slowest(times[kStage3Traced], ranks);
    // What one event costs, without the step's noise around it: the span of an empty
    // stream task, recorded as the runner does, best of a few rounds.
    constexpr int kEvents = 200'000;
    const uint32_t track = trace::new_stream_track();
    double best = 1e30;
    trace::start(std::filesystem::temp_directory_path().string());
    for (int round = 0; round < 5; ++round) {
      const auto start = Clock::now();
      for (int i = 0; i < kEvents; ++i) trace::TaskScope scope(track, "bench");
      best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count() / kEvents);
      trace::clear();
    }
    trace::stop();
    world.trace_seconds_per_event = best;
  }
  return world;
}

uint64_t step_memory_estimate(const StepConfig& config, int32_t ranks) {
  const double w = config.width, p = static_cast<double>(config.depth) * (w * w + w);
  const double n = ranks;
  // Per rank, in fp32 elements: stage 2 (full parameters and gradients; shards of the
  // gradient, masters and two moments), stage 3 (shards of the same and a window of full
  // layers), the unsharded reference (parameters, gradients, two moments) and the compute
  // contender's one layer of gradients.
  const double layer = w * w + w;
  const double stage2 = 2 * p + 4 * p / n;
  const double stage3 = 5 * p / n + 6 * layer;
  const double unsharded = 4 * p;
  return static_cast<uint64_t>((stage2 + stage3 + unsharded + layer) * 4 * n);
}

namespace {

std::optional<double> ratio_of(std::optional<double> a, std::optional<double> b) {
  if (!a || !b || *b <= 0) return std::nullopt;
  return *a / *b;
}

std::string mib(uint64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", static_cast<double>(bytes) / (1 << 20));
  return b;
}

// One contender's time per step split for the report and the chart: the forward and
// backward alone (the compute contender's time), the time blocked on communication (the
// engines' dependency waits, the reference's all-reduce waits), the optimizer where it is
// measured apart (the reference's), and the rest.
struct Split {
  double total = 0, compute = 0, waits = 0, optimizer = 0, rest = 0;
};

// The parts are clamped so they add up to the total: waits and the optimizer are means over
// ranks, the total is the slowest rank's median, and compute comes from its own contender.
Split split_of(double total, double compute, double waits, double optimizer) {
  Split s;
  s.total = total;
  s.compute = std::min(compute, total);
  s.waits = std::min(waits, total - s.compute);
  s.optimizer = std::min(optimizer, total - s.compute - s.waits);
  s.rest = total - s.compute - s.waits - s.optimizer;
  return s;
}

double per_rank_step(const StepWorld& w, double value) {
  return value / static_cast<double>(w.timed_steps * w.ranks);
}

Split stage2_split(const StepWorld& w) {
  return split_of(w.stage2_seconds, w.compute_seconds, per_rank_step(w, w.dependency_wait_seconds),
                  0);
}
Split stage3_split(const StepWorld& w) {
  return split_of(w.stage3_seconds, w.compute_seconds,
                  per_rank_step(w, w.stage3_dependency_wait_seconds), 0);
}
Split unsharded_split(const StepWorld& w) {
  return split_of(w.unsharded_seconds, w.compute_seconds, w.unsharded_wait_seconds,
                  w.unsharded_optimizer_seconds);
}

Json split_json(const Split& s) {
  return {{"total", s.total},
          {"compute", s.compute},
          {"communication_waits", s.waits},
          {"optimizer", s.optimizer},
          {"rest", s.rest}};
}

std::string number_text(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

double ns_per_parameter(double seconds, size_t parameters) {
  return parameters > 0 ? seconds / static_cast<double>(parameters) * 1e9 : 0.0;
}

}  // namespace

void print_step(std::FILE* out, const StepConfig& config, const RunInfo& info,
                const std::vector<StepWorld>& all_worlds) {
  std::vector<StepWorld> worlds;
  for (const auto& w : all_worlds) {
    if (w.skipped.empty()) worlds.push_back(w);
  }
  print_run_header(out, "step", info);
  std::fprintf(out,
               "# MLP width %d depth %d (ReLU, squared error), batch %d per rank, %s%s; ranks as "
               "threads; time per step = median over %d repetitions of the slowest rank's time "
               "for %d steps (last drained) / %d, in ms\n",
               config.width, config.depth, config.batch, config.adamw ? "AdamW" : "SGD momentum",
               config.clip > 0 ? (", clip " + number_text(config.clip)).c_str() : "", config.reps,
               config.steps, config.steps);
  std::fprintf(out,
               "# stage2: Stage2Engine; stage3: Stage3Engine (gather/release around each layer's "
               "forward and backward, prefetch window %d); one unit per layer\n",
               config.prefetch_window);
  std::fprintf(out,
               "# reference: unsharded data parallel on the same backend (per-layer all_reduce "
               "avg as each layer's backward ends, clip + optimizer on the full parameters), "
               "alternated with stage 2 and stage 3; compute = forward + backward alone\n");
  std::string transports;
  for (const auto& w : worlds) {
    transports += (transports.empty() ? "" : ", ") + std::to_string(w.ranks) + " ranks " +
                  (w.transport.empty() ? "-" : w.transport);
  }
  std::fprintf(out, "# transport of the hpshard communicators: %s (HPS_COMM_SHM=0: tcp, Gloo)\n",
               transports.c_str());
  std::fprintf(out, "# torch: %s\n", info.torch.c_str());
  std::fprintf(out, "\n## training step\n");
  std::fprintf(out, "%5s %6s %10s %10s %10s %12s %8s %8s %11s", "ranks", "width", "params",
               "stage2_ms", "stage3_ms", "unsharded_ms", "s2_ratio", "s3_ratio", "compute_ms");
  if (info.torch_ran) {
    std::fprintf(out, " %10s %12s %10s %10s", "torch_ms", "t_compute_ms", "s2_speedup",
                 "s3_speedup");
  }
  std::fprintf(out, "\n");
  for (const auto& w : worlds) {
    std::fprintf(out, "%5d %6d %10zu %10.2f %10.2f %12.2f %8.3f %8.3f %11.2f", w.ranks, w.width,
                 w.parameters, w.stage2_seconds * 1e3, w.stage3_seconds * 1e3,
                 w.unsharded_seconds * 1e3, w.stage2_seconds / w.unsharded_seconds,
                 w.stage3_seconds / w.unsharded_seconds, w.compute_seconds * 1e3);
    if (info.torch_ran) {
      if (w.torch_seconds) {
        std::fprintf(out, " %10.2f %12.2f %10.3f %10.3f", *w.torch_seconds * 1e3,
                     w.torch_compute_seconds ? *w.torch_compute_seconds * 1e3 : 0.0,
                     *w.torch_seconds / w.stage2_seconds, *w.torch_seconds / w.stage3_seconds);
      } else {
        std::fprintf(out, " %10s %12s %10s %10s", "-", "-", "-", "-");
      }
    }
    std::fprintf(out, "\n");
  }
  std::fprintf(out,
               "\n## time per step split (ms): compute = forward + backward alone; waits = "
               "blocked on communication; optimizer = measured apart (reference only); "
               "rest = the remainder; the parts are clamped to add up to the total\n");
  std::fprintf(out, "%5s %6s %-10s %9s %9s %9s %9s %9s\n", "ranks", "width", "contender", "total",
               "compute", "waits", "optimizer", "rest");
  for (const auto& w : worlds) {
    const std::pair<const char*, Split> rows[] = {{"stage2", stage2_split(w)},
                                                  {"stage3", stage3_split(w)},
                                                  {"unsharded", unsharded_split(w)}};
    for (const auto& [name, sp] : rows) {
      char optimizer[32] = "-";
      if (sp.optimizer > 0) std::snprintf(optimizer, sizeof optimizer, "%.2f", sp.optimizer * 1e3);
      std::fprintf(out, "%5d %6d %-10s %9.2f %9.2f %9.2f %9s %9.2f\n", w.ranks, w.width, name,
                   sp.total * 1e3, sp.compute * 1e3, sp.waits * 1e3, optimizer, sp.rest * 1e3);
    }
  }
  std::fprintf(out, "\n## per rank: resident bytes, host syncs\n");
  std::fprintf(out, "%5s %6s %11s %11s %14s %8s %8s %14s %14s %16s\n", "ranks", "width",
               "stage2_MiB", "stage3_MiB", "unsharded_MiB", "s2_ratio", "s3_ratio", "s2_host_syncs",
               "s3_host_syncs", "unsh_host_syncs");
  for (const auto& w : worlds) {
    const double unsharded = static_cast<double>(w.unsharded_resident_bytes);
    std::fprintf(out, "%5d %6d %11s %11s %14s %8.3f %8.3f %14llu %14llu %16llu\n", w.ranks, w.width,
                 mib(w.stage2_resident_bytes).c_str(), mib(w.stage3_resident_bytes).c_str(),
                 mib(w.unsharded_resident_bytes).c_str(),
                 static_cast<double>(w.stage2_resident_bytes) / unsharded,
                 static_cast<double>(w.stage3_resident_bytes) / unsharded,
                 static_cast<unsigned long long>(w.stage2_host_syncs_max),
                 static_cast<unsigned long long>(w.stage3_host_syncs_max),
                 static_cast<unsigned long long>(w.unsharded_host_syncs_max));
  }
  std::fprintf(out,
               "# stage2_MiB: resident_bytes() (full params and grads, grad shard, state); "
               "stage3_MiB: peak_resident_bytes() over the run (shards, state, live gathered "
               "units and gradients); host syncs: the most counted in one steady step on any "
               "rank (hps::host_sync_count_thread; stage 2 and 3 must be 0)\n");
  std::fprintf(out, "\n## per step and rank: dependency waits; parameters vs the reference\n");
  std::fprintf(out, "%5s %6s %13s %15s %13s %15s %14s %14s\n", "ranks", "width", "s2_dep_waits",
               "s2_dep_wait_ms", "s3_dep_waits", "s3_dep_wait_ms", "s2_param_diff",
               "s3_param_diff");
  for (const auto& w : worlds) {
    std::fprintf(out, "%5d %6d %13.2f %15.3f %13.2f %15.3f %14.3g %14.3g\n", w.ranks, w.width,
                 per_rank_step(w, static_cast<double>(w.dependency_waits)),
                 per_rank_step(w, w.dependency_wait_seconds) * 1e3,
                 per_rank_step(w, static_cast<double>(w.stage3_dependency_waits)),
                 per_rank_step(w, w.stage3_dependency_wait_seconds) * 1e3, w.max_param_diff,
                 w.stage3_max_param_diff);
  }
  std::fprintf(out,
               "# dep_waits, dep_wait_ms: gather()/wait_parameters() calls that blocked on their "
               "layer's all-gather, and the time blocked, per step and rank; param_diff: the "
               "largest difference from the unsharded reference's parameters after the run\n");
  if (config.trace_overhead) {
    std::fprintf(out, "\n## the timeline's cost (recording as with HPS_TRACE, alternated)\n");
    std::fprintf(out, "%5s %10s %17s %9s %10s %17s %9s %16s %9s %12s\n", "ranks", "stage2_ms",
                 "stage2_traced_ms", "s2_ratio", "stage3_ms", "stage3_traced_ms", "s3_ratio",
                 "events_per_step", "ns_event", "implied_pct");
    for (const auto& w : worlds) {
      if (!w.stage2_traced_seconds || !w.stage3_traced_seconds) continue;
      const double implied = w.trace_events_per_step * w.trace_seconds_per_event /
                             std::min(w.stage2_seconds, w.stage3_seconds) * 100.0;
      std::fprintf(out, "%5d %10.2f %17.2f %9.3f %10.2f %17.2f %9.3f %16.1f %9.0f %12.4f\n",
                   w.ranks, w.stage2_seconds * 1e3, *w.stage2_traced_seconds * 1e3,
                   *w.stage2_traced_seconds / w.stage2_seconds, w.stage3_seconds * 1e3,
                   *w.stage3_traced_seconds * 1e3, *w.stage3_traced_seconds / w.stage3_seconds,
                   w.trace_events_per_step, w.trace_seconds_per_event * 1e9, implied);
    }
    std::fprintf(out,
                 "# target: traced / untraced <= 1.03; events_per_step: per rank; ns_event: "
                 "one task span recorded alone (best of 5 x 200,000); implied_pct: events per "
                 "step x ns_event / the faster step, the cost without the machine's noise\n");
  }
  if (config.scale) {
    std::fprintf(out,
                 "\n## scaling: time per step per parameter (ns), widths x1 x2 x4 of %d at 1, 2 "
                 "and 4 ranks; ratios to the unsharded step of the same cell\n",
                 config.width / kScaleWidths[0]);
    std::fprintf(out, "%6s %10s %5s %10s %10s %10s %8s %8s  %s\n", "width", "params", "ranks",
                 "s2_ns/p", "s3_ns/p", "unsh_ns/p", "s2_ratio", "s3_ratio", "");
    for (const auto& w : all_worlds) {
      if (!w.skipped.empty()) {
        std::fprintf(out, "%6d %10zu %5d %10s %10s %10s %8s %8s  skipped: %s\n", w.width,
                     w.parameters, w.ranks, "-", "-", "-", "-", "-", w.skipped.c_str());
        continue;
      }
      std::fprintf(out, "%6d %10zu %5d %10.3f %10.3f %10.3f %8.3f %8.3f\n", w.width, w.parameters,
                   w.ranks, ns_per_parameter(w.stage2_seconds, w.parameters),
                   ns_per_parameter(w.stage3_seconds, w.parameters),
                   ns_per_parameter(w.unsharded_seconds, w.parameters),
                   w.stage2_seconds / w.unsharded_seconds, w.stage3_seconds / w.unsharded_seconds);
    }
  }
  for (const auto& w : worlds) {
    const std::string cell = std::to_string(w.ranks) + " ranks" +
                             (config.scale ? ", width " + std::to_string(w.width) : "");
    const double r = w.stage2_seconds / w.unsharded_seconds;
    std::fprintf(out,
                 "summary: step %s: stage2 / unsharded time = %.3f: %s (target <= %.2fx); "
                 "host syncs per steady step %llu: %s\n",
                 cell.c_str(), r, r <= kStepUnshardedTarget ? "MEETS" : "ABOVE",
                 kStepUnshardedTarget, static_cast<unsigned long long>(w.stage2_host_syncs_max),
                 w.stage2_host_syncs_max == 0 ? "MEETS" : "ABOVE (target 0)");
    const double r3 = w.stage3_seconds / w.unsharded_seconds;
    std::fprintf(out,
                 "summary: step %s: stage3 / unsharded time = %.3f: %s (target <= %.2fx); "
                 "host syncs per steady step %llu: %s\n",
                 cell.c_str(), r3, r3 <= kStepUnshardedTarget ? "MEETS" : "ABOVE",
                 kStepUnshardedTarget, static_cast<unsigned long long>(w.stage3_host_syncs_max),
                 w.stage3_host_syncs_max == 0 ? "MEETS" : "ABOVE (target 0)");
    if (w.torch_seconds) {
      const double s = *w.torch_seconds / w.stage2_seconds;
      std::fprintf(out,
                   "summary: step %s: torch DDP+ZeRO / hpshard stage 2 time = %.3f: %s "
                   "(target >= %.1fx faster)\n",
                   cell.c_str(), s, s >= kStepTorchTarget ? "MEETS" : "BELOW", kStepTorchTarget);
      const double s3 = *w.torch_seconds / w.stage3_seconds;
      std::fprintf(out,
                   "summary: step %s: torch DDP+ZeRO / hpshard stage 3 time = %.3f: %s "
                   "(target >= %.1fx faster)\n",
                   cell.c_str(), s3, s3 >= kStepTorchTarget ? "MEETS" : "BELOW", kStepTorchTarget);
    }
  }
}

Json step_to_json(const StepConfig& config, const RunInfo& info,
                  const std::vector<StepWorld>& worlds) {
  Json j;
  add_run_info(j, "step", info);
  j["config"] = {{"ranks", config.ranks},   {"width", config.width},
                 {"depth", config.depth},   {"batch_per_rank", config.batch},
                 {"steps", config.steps},   {"reps", config.reps},
                 {"warmup", config.warmup}, {"optimizer", config.adamw ? "adamw" : "sgd"},
                 {"clip", config.clip},     {"stage3_prefetch_window", config.prefetch_window},
                 {"scale", config.scale}};
  j["units"] = {{"time",
                 "seconds per step, median over repetitions of the slowest rank; split: per "
                 "step, mean over ranks"},
                {"bytes",
                 "per rank: parameters, gradients, optimizer state (stage 3: the peak over the "
                 "run)"}};
  j["reference"] =
      "unsharded data parallel, same backend: per-layer all_reduce (avg), clip and optimizer "
      "on the full parameters";
  j["targets"] = {{"unsharded_ratio_max", kStepUnshardedTarget},
                  {"torch_speedup_min", kStepTorchTarget},
                  {"host_syncs", 0}};
  j["torch"] = {{"ran", info.torch_ran}, {"status", info.torch}};
  Json results = Json::array();
  for (const auto& w : worlds) {
    if (!w.skipped.empty()) {
      results.push_back({{"ranks", w.ranks},
                         {"width", w.width},
                         {"parameters", w.parameters},
                         {"skipped", w.skipped}});
      continue;
    }
    const double r = w.stage2_seconds / w.unsharded_seconds;
    const double r3 = w.stage3_seconds / w.unsharded_seconds;
    const auto speedup = ratio_of(w.torch_seconds, w.stage2_seconds);
    const auto speedup3 = ratio_of(w.torch_seconds, w.stage3_seconds);
    const auto meets_torch = [](std::optional<double> s) {
      return s ? std::optional<bool>(*s >= kStepTorchTarget) : std::nullopt;
    };
    Json split = {{"stage2", split_json(stage2_split(w))},
                  {"stage3", split_json(stage3_split(w))},
                  {"unsharded", split_json(unsharded_split(w))}};
    if (w.torch_seconds) {
      split["torch"] =
          split_json(split_of(*w.torch_seconds, w.torch_compute_seconds.value_or(0), 0, 0));
    }
    results.push_back(
        {{"ranks", w.ranks},
         {"width", w.width},
         {"parameters", w.parameters},
         {"transport", w.transport},
         {"stage2_seconds", w.stage2_seconds},
         {"unsharded_seconds", w.unsharded_seconds},
         {"ratio", r},
         {"meets_target", r <= kStepUnshardedTarget},
         {"compute_seconds", w.compute_seconds},
         {"torch_seconds", json_optional(w.torch_seconds)},
         {"torch_compute_seconds", json_optional(w.torch_compute_seconds)},
         {"torch_speedup", json_optional(speedup)},
         {"meets_torch_target", json_optional(meets_torch(speedup))},
         {"stage2_resident_bytes", w.stage2_resident_bytes},
         {"unsharded_resident_bytes", w.unsharded_resident_bytes},
         {"stage2_host_syncs_per_step_max", w.stage2_host_syncs_max},
         {"unsharded_host_syncs_per_step_max", w.unsharded_host_syncs_max},
         {"dependency_waits_per_step", per_rank_step(w, static_cast<double>(w.dependency_waits))},
         {"dependency_wait_seconds_per_step", per_rank_step(w, w.dependency_wait_seconds)},
         {"max_param_diff", w.max_param_diff},
         {"stage3_seconds", w.stage3_seconds},
         {"stage3_ratio", r3},
         {"stage3_meets_target", r3 <= kStepUnshardedTarget},
         {"stage3_torch_speedup", json_optional(speedup3)},
         {"stage3_meets_torch_target", json_optional(meets_torch(speedup3))},
         {"stage3_resident_bytes", w.stage3_resident_bytes},
         {"stage3_host_syncs_per_step_max", w.stage3_host_syncs_max},
         {"stage3_dependency_waits_per_step",
          per_rank_step(w, static_cast<double>(w.stage3_dependency_waits))},
         {"stage3_dependency_wait_seconds_per_step",
          per_rank_step(w, w.stage3_dependency_wait_seconds)},
         {"stage3_max_param_diff", w.stage3_max_param_diff},
         {"unsharded_wait_seconds_per_step", w.unsharded_wait_seconds},
         {"unsharded_optimizer_seconds_per_step", w.unsharded_optimizer_seconds},
         {"stage2_ns_per_parameter", ns_per_parameter(w.stage2_seconds, w.parameters)},
         {"stage3_ns_per_parameter", ns_per_parameter(w.stage3_seconds, w.parameters)},
         {"unsharded_ns_per_parameter", ns_per_parameter(w.unsharded_seconds, w.parameters)},
         {"stage2_traced_seconds", json_optional(w.stage2_traced_seconds)},
         {"stage3_traced_seconds", json_optional(w.stage3_traced_seconds)},
         {"trace_events_per_step", w.trace_events_per_step},
         {"trace_seconds_per_event", w.trace_seconds_per_event},
         {"split", split}});
  }
  j["results"] = results;
  return j;
}

}  // namespace hps::bench
