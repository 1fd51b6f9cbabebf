#include "tools/hpshard-bench/clip_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>

#include "core/clip/hybrid_clip.h"
#include "core/common/half.h"
#include "core/device/cpu/stream.h"
#include "core/kernels/cast.h"
#include "core/kernels/kernel_table.h"
#include "core/kernels/norm.h"
#include "core/kernels/optimizer.h"

namespace hps::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kWidth = 1024;

[[noreturn]] void die(const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "hpshard-bench: error: %s\n", message.c_str());
  std::exit(1);
}

void check(const Status& s, const std::string& what) {
  if (!s.ok()) die(what + ": " + s.to_string());
}

// One model's buffers: the gradients (as reduced, in the model dtype), the full gradients
// the engines' step reduces into them (at one rank a copy), a copy destination, the fp32
// gradient the step's unscale pass writes (fp32 tensors: the gradient itself, as in the
// engines), the fp32 master parameters and the AdamW state.
struct Tensor {
  ClipTensorSpec spec;
  std::vector<std::byte> grad, full, copy;
  std::vector<float> grad32, param, exp_avg, exp_avg_sq;
  float* step_grad() {
    return spec.dtype == DType::kFloat32 ? reinterpret_cast<float*>(grad.data()) : grad32.data();
  }
};

void fill_gradient(Tensor& t, size_t salt) {
  for (size_t i = 0; i < t.spec.count; ++i) {
    // Norm well above max_norm at first, then ≈ max_norm after the first scaling.
    const float v = 0.05f * std::sin(0.001f * static_cast<float>(i) + static_cast<float>(salt));
    if (t.spec.dtype == DType::kBFloat16) {
      reinterpret_cast<uint16_t*>(t.grad.data())[i] = float_to_bf16_bits(v);
    } else {
      reinterpret_cast<float*>(t.grad.data())[i] = v;
    }
  }
}

std::unique_ptr<HybridClip> make_clip(std::vector<Tensor>& tensors, double max_norm,
                                      bool deterministic, bool fp32_only) {
  auto clip = HybridClip::create(nullptr, nullptr, nullptr, {max_norm, deterministic});
  if (!clip.ok()) die("HybridClip::create: " + clip.status().to_string());
  for (auto& t : tensors) {
    if (fp32_only && t.spec.dtype != DType::kFloat32) continue;
    check((*clip)->add_tensor({t.grad.data(), t.spec.count, t.spec.dtype}), "clip add_tensor");
  }
  check((*clip)->seal(), "clip seal");
  return std::move(*clip);
}

}  // namespace

int32_t clip_iterations_for(const ClipConfig& config, size_t bytes) {
  if (config.iters > 0) return config.iters;
  const size_t budget = size_t{1} << 30;
  return static_cast<int32_t>(std::clamp<size_t>(budget / std::max<size_t>(bytes, 1), 7, 31));
}

std::vector<ClipTensorSpec> model_tensors(const ClipModel& model) {
  std::vector<ClipTensorSpec> tensors;
  size_t left = model.bytes;
  for (size_t k = 0; left > 0; ++k) {
    const bool weight = k % 2 == 0;
    const DType dtype = weight && model.mixed ? DType::kBFloat16 : DType::kFloat32;
    const size_t element = dtype_size(dtype);
    const size_t count = std::min(weight ? kWidth * kWidth : kWidth, left / element);
    if (count == 0) break;
    tensors.push_back({dtype, count});
    left -= count * element;
  }
  return tensors;
}

std::string model_label(const ClipModel& model) {
  return size_text(model.bytes) + (model.mixed ? " fp32/bf16" : " fp32");
}

double clip_bandwidth_gbps(const ClipRow& row, double seconds) {
  return seconds > 0 ? 3.0 * static_cast<double>(row.bytes) / seconds / 1e9 : 0.0;
}
double copy_bandwidth_gbps(const ClipRow& row) {
  return row.copy_seconds > 0 ? 2.0 * static_cast<double>(row.bytes) / row.copy_seconds / 1e9 : 0.0;
}
double clip_cpu_ratio(const ClipRow& row) {
  // Bandwidths by CPU time: (3S / clip) / (2S / copy).
  return row.clip_cpu_seconds > 0 ? 1.5 * row.copy_cpu_seconds / row.clip_cpu_seconds : 0.0;
}
double kernel_cpu_ratio(const KernelRow& row) {
  const double copy_bytes = 2.0 * static_cast<double>(row.count * sizeof(float));
  return row.cpu_seconds > 0 && row.copy_cpu_seconds > 0
             ? (row.bytes / row.cpu_seconds) / (copy_bytes / row.copy_cpu_seconds)
             : 0.0;
}
double kernel_bandwidth_gbps(const KernelRow& row) {
  return row.seconds > 0 ? row.bytes / row.seconds / 1e9 : 0.0;
}
double kernel_copy_bandwidth_gbps(const KernelRow& row) {
  return row.copy_seconds > 0
             ? 2.0 * static_cast<double>(row.count * sizeof(float)) / row.copy_seconds / 1e9
             : 0.0;
}

namespace {

struct Contender {
  Contender(std::string n, std::function<void()> r) : name(std::move(n)), run(std::move(r)) {}
  std::string name;
  std::function<void()> run;  // one timed run, finished when it returns
  std::vector<double> times;
  std::vector<double> cpu_times;
};

// CPU time of the whole process: the stream's worker and the calling thread, which sleeps
// (a condition variable) while it waits, so this is the kernels' own time without the time
// slices other processes took.
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Rounds: every contender once, the order rotated each round (and reversed every other), so
// drift on this shared machine falls on all of them alike.
void alternate(std::vector<Contender>& contenders, int32_t warmup, int32_t iters) {
  const size_t n = contenders.size();
  for (int32_t round = 0; round < warmup + iters; ++round) {
    for (size_t k = 0; k < n; ++k) {
      const size_t rotated = (k + static_cast<size_t>(round)) % n;
      Contender& c = contenders[round % 2 ? n - 1 - rotated : rotated];
      const double cpu_start = process_cpu_seconds();
      const auto start = Clock::now();
      c.run();
      const double t = std::chrono::duration<double>(Clock::now() - start).count();
      const double cpu = process_cpu_seconds() - cpu_start;
      if (round >= warmup) {
        c.times.push_back(t);
        c.cpu_times.push_back(cpu);
      }
    }
  }
}

// The engines' work after a backward, through the kernel table, in their order at one rank
// (mean scale 1, no loss scaling): each buffer's reduction writes its shard (at one rank a
// copy of the full gradient; the backward's order, last tensor first), then the step.
// Without a clip: per tensor the unscale pass and AdamW. With a clip (ShardedOptimizer::
// reduced): each shard unscaled, its partial sums taken, right after its reduction, while it
// is in cache; the step is finish() and AdamW reading the coefficient.
class EngineStep {
 public:
  EngineStep(cpu::CpuStream& stream, std::vector<Tensor>& tensors, double max_norm)
      : stream_(stream), tensors_(tensors) {
    auto kernels = kernels_for(DeviceType::kCpu);
    if (!kernels.ok()) die("kernels_for(cpu): " + kernels.status().to_string());
    kernels_ = *kernels;
    auto clip = HybridClip::create(nullptr, nullptr, nullptr, {max_norm, false});
    if (!clip.ok()) die("HybridClip::create: " + clip.status().to_string());
    clip_ = std::move(*clip);
    check(clip_->seal(), "clip seal");  // no tensors: the engines add the partials themselves
    state_.loss_scale = 1.0f;
    rule_.adamw = true;
  }

  void run(bool with_clip) {
    const DevicePtr<StepState> state(&state_);
    auto unscale = [&](Tensor& t) {
      UnscaleArgs a;
      a.src_dtype = t.spec.dtype;
      a.src = DevicePtr<const void>(t.grad.data());
      a.dst = DevicePtr<float>(t.step_grad());
      a.count = t.spec.count;
      a.state = state;
      if (with_clip) {
        a.clip = clip_->state();
        a.partial = kClipPartialN;
      }
      check(kernels_->unscale(stream_, a), "unscale");
    };
    auto adamw = [&](Tensor& t) {
      AdamWArgs a{
          DevicePtr<float>(t.param.data()),
          DevicePtr<const float>(t.step_grad()),
          DevicePtr<float>(t.exp_avg.data()),
          DevicePtr<float>(t.exp_avg_sq.data()),
          t.spec.count,
          hyper_,
          state,
          with_clip ? DevicePtr<const float>(clip_->coefficient()) : DevicePtr<const float>()};
      check(kernels_->adamw(stream_, a), "adamw");
    };
    if (with_clip) check(clip_->begin(stream_), "clip begin");
    for (auto t = tensors_.rbegin(); t != tensors_.rend(); ++t) {
      check(stream_.memcpy_async(t->grad.data(), t->full.data(), t->grad.size()), "reduction");
      if (with_clip) unscale(*t);
    }
    if (!with_clip) {
      check(kernels_->update_step_state(stream_, state, rule_), "update_step_state");
      for (Tensor& t : tensors_) {
        unscale(t);
        adamw(t);
      }
    } else {
      check(clip_->finish(stream_, nullptr), "clip finish");
      check(kernels_->update_step_state(stream_, state, rule_), "update_step_state");
      for (Tensor& t : tensors_) adamw(t);
    }
    check(stream_.synchronize(), "step synchronize");
  }

 private:
  cpu::CpuStream& stream_;
  std::vector<Tensor>& tensors_;
  const Kernels* kernels_ = nullptr;
  std::unique_ptr<HybridClip> clip_;
  StepState state_;
  StepRule rule_;
  AdamWHyper hyper_;
};

// Each CPU kernel over `count` elements of fp32, bf16 and fp16 data beside a copy of
// count × 4 bytes, every kernel on the calling thread.
std::vector<KernelRow> run_kernels(const ClipConfig& config) {
  const size_t n = config.kernel_bytes / sizeof(float);
  if (n == 0) return {};
  const int32_t iters = clip_iterations_for(config, config.kernel_bytes);
  if (config.progress) {
    std::fprintf(stderr, "[hpshard-bench] kernels over %zu elements (%d iterations)\n", n, iters);
  }
  std::vector<float> a(n), b(n), param(n, 0.5f), m(n, 0.0f), v(n, 0.0f), wide(n);
  for (size_t i = 0; i < n; ++i) a[i] = 0.05f * std::sin(0.001f * static_cast<float>(i));
  std::vector<uint16_t> bf16(n), fp16(n);
  cpu::cast(DType::kFloat32, a.data(), DType::kBFloat16, bf16.data(), n);
  cpu::cast(DType::kFloat32, a.data(), DType::kFloat16, fp16.data(), n);
  double sink = 0;

  struct Kernel {
    std::string name;
    DType dtype;
    double bytes;
    std::function<void()> run;
  };
  std::vector<Kernel> kernels;
  const double f4 = static_cast<double>(n) * 4, f2 = static_cast<double>(n) * 2;
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    void* data = d == DType::kFloat32    ? static_cast<void*>(a.data())
                 : d == DType::kBFloat16 ? static_cast<void*>(bf16.data())
                                         : static_cast<void*>(fp16.data());
    const double e = d == DType::kFloat32 ? f4 : f2;
    kernels.push_back(
        {"sum_of_squares", d, e, [d, data, n, &sink] { sink += cpu::sum_of_squares(d, data, n); }});
    // A coefficient of 1 keeps the data as they are round after round.
    kernels.push_back({"scale", d, 2 * e, [d, data, n] { cpu::scale(d, data, n, 1.0); }});
    float* dst = d == DType::kFloat32 ? a.data() : wide.data();  // fp32: in place, as the engines
    kernels.push_back({"unscale+partial", d, e + f4, [d, data, dst, n, &sink] {
                         double partial = 0;
                         cpu::unscale(d, data, dst, n, 1.0f, true, &partial, nullptr);
                         sink += partial;
                       }});
    if (d != DType::kFloat32) {
      kernels.push_back({"cast from fp32", d, f4 + e,
                         [d, data, &a, n] { cpu::cast(DType::kFloat32, a.data(), d, data, n); }});
      kernels.push_back({"cast to fp32", d, e + f4, [d, data, &wide, n] {
                           cpu::cast(d, data, DType::kFloat32, wide.data(), n);
                         }});
    }
  }
  const AdamWHyper hyper;
  kernels.push_back({"adamw", DType::kFloat32, 7 * f4, [&] {
                       cpu::adamw(param.data(), a.data(), m.data(), v.data(), n, hyper,
                                  AdamWConstants{1e-3f, 0.5f}, nullptr, 1.0f);
                     }});
  const SgdHyper sgd_hyper{0.01f, 0.9f, 0.0f, false};
  kernels.push_back(
      {"sgd momentum", DType::kFloat32, 5 * f4,
       [&] { cpu::sgd(param.data(), a.data(), m.data(), n, sgd_hyper, nullptr, 1.0f, false); }});

  // Each kernel alternates with its own copy, so its ratio compares neighbours in time.
  std::vector<KernelRow> rows;
  for (const Kernel& k : kernels) {
    std::vector<Contender> contenders{
        {"copy", [&] { std::memcpy(b.data(), a.data(), n * sizeof(float)); }}, {k.name, k.run}};
    alternate(contenders, config.warmup, iters);
    rows.push_back({k.name, k.dtype, n, k.bytes, median(contenders[1].times),
                    median(contenders[0].times), median(contenders[1].cpu_times),
                    median(contenders[0].cpu_times)});
  }
  if (!std::isfinite(sink) && config.progress) std::fprintf(stderr, "[hpshard-bench] (sink)\n");
  return rows;
}

}  // namespace

ClipResult run_clip(const ClipConfig& config) {
  ClipResult result;
  cpu::CpuStream stream;
  for (const ClipModel& model : config.models) {
    ClipRow row;
    row.model = model;
    std::vector<Tensor> tensors;
    for (const auto& spec : model_tensors(model)) {
      Tensor t;
      t.spec = spec;
      const size_t bytes = spec.count * dtype_size(spec.dtype);
      t.grad.resize(bytes);
      t.copy.resize(bytes);
      fill_gradient(t, tensors.size());
      t.full = t.grad;
      if (spec.dtype != DType::kFloat32) t.grad32.assign(spec.count, 0.0f);
      t.param.assign(spec.count, 0.5f);
      t.exp_avg.assign(spec.count, 0.0f);
      t.exp_avg_sq.assign(spec.count, 0.0f);
      row.bytes += bytes;
      if (spec.dtype == DType::kFloat32) row.fp32_bytes += bytes;
      tensors.push_back(std::move(t));
    }
    row.tensors = tensors.size();
    row.iters = clip_iterations_for(config, row.bytes);
    if (config.progress) {
      std::fprintf(stderr, "[hpshard-bench] clip %s, %zu tensors (%d iterations)\n",
                   model_label(model).c_str(), row.tensors, row.iters);
    }

    auto clip = make_clip(tensors, config.max_norm, false, false);
    auto deterministic = make_clip(tensors, config.max_norm, true, false);
    EngineStep step(stream, tensors, config.max_norm);
    auto on_stream = [&](const char* what, const std::function<void()>& enqueue) {
      return [&stream, what, enqueue] {
        enqueue();
        check(stream.synchronize(), std::string(what) + " synchronize");
      };
    };
    std::vector<Contender> contenders;
    contenders.push_back({"copy", on_stream("copy", [&] {
                            for (auto& t : tensors) {
                              check(
                                  stream.memcpy_async(t.copy.data(), t.grad.data(), t.grad.size()),
                                  "memcpy_async");
                            }
                          })});
    contenders.push_back(
        {"clip", on_stream("clip", [&] { check(clip->run(stream, nullptr, true), "clip run"); })});
    contenders.push_back({"deterministic", on_stream("deterministic", [&] {
                            check(deterministic->run(stream, nullptr, true),
                                  "deterministic clip run");
                          })});
    contenders.push_back({"step", [&] { step.run(false); }});
    contenders.push_back({"step+clip", [&] { step.run(true); }});
    alternate(contenders, config.warmup, row.iters);
    row.copy_seconds = median(contenders[0].times);
    row.clip_seconds = median(contenders[1].times);
    row.deterministic_seconds = median(contenders[2].times);
    row.step_seconds = median(contenders[3].times);
    row.step_clip_seconds = median(contenders[4].times);
    row.copy_cpu_seconds = median(contenders[0].cpu_times);
    row.clip_cpu_seconds = median(contenders[1].cpu_times);
    row.step_cpu_seconds = median(contenders[3].cpu_times);
    row.step_clip_cpu_seconds = median(contenders[4].cpu_times);
    // Sanity: the clip left finite gradients behind, and the steps finite parameters.
    for (auto& t : tensors) {
      const double squares = cpu::sum_of_squares(t.spec.dtype, t.grad.data(), t.spec.count);
      const double params = cpu::sum_of_squares(DType::kFloat32, t.param.data(), t.spec.count);
      if (!std::isfinite(squares) || !std::isfinite(params)) {
        die("clip " + model_label(model) + ": gradients or parameters not finite");
      }
    }
    result.rows.push_back(row);
  }
  result.kernels = run_kernels(config);
  return result;
}

namespace {

std::optional<double> ratio_of(std::optional<double> a, std::optional<double> b) {
  if (!a || !b || *b <= 0) return std::nullopt;
  return *a / *b;
}

struct ClipSummary {
  std::optional<double> copy_ratio;     // median clip bw / copy bw
  std::optional<double> fold_ratio;     // median (step+clip) / step time
  std::optional<double> det_cost;       // median deterministic / float clip time
  std::optional<double> torch_speedup;  // median torch / hpshard clip time
  std::optional<double> min_copy_ratio;
  std::optional<double> max_fold_ratio;
  std::optional<double> copy_ratio_cpu;  // the same by CPU time
  std::optional<double> fold_ratio_cpu;
};

ClipSummary summarize_clip(const std::vector<ClipRow>& rows) {
  std::vector<double> copy, fold, det, torch, copy_cpu, fold_cpu;
  for (const auto& r : rows) {
    copy_cpu.push_back(clip_cpu_ratio(r));
    fold_cpu.push_back(r.step_clip_cpu_seconds / r.step_cpu_seconds);
    copy.push_back(clip_bandwidth_gbps(r, r.clip_seconds) / copy_bandwidth_gbps(r));
    det.push_back(r.deterministic_seconds / r.clip_seconds);
    fold.push_back(r.step_clip_seconds / r.step_seconds);
    if (auto t = ratio_of(r.torch_seconds, r.clip_seconds)) torch.push_back(*t);
  }
  ClipSummary s;
  if (!copy.empty()) {
    s.copy_ratio = median(copy);
    s.min_copy_ratio = *std::min_element(copy.begin(), copy.end());
  }
  if (!fold.empty()) {
    s.fold_ratio = median(fold);
    s.max_fold_ratio = *std::max_element(fold.begin(), fold.end());
  }
  if (!copy_cpu.empty()) s.copy_ratio_cpu = median(copy_cpu);
  if (!fold_cpu.empty()) s.fold_ratio_cpu = median(fold_cpu);
  if (!det.empty()) s.det_cost = median(det);
  if (!torch.empty()) s.torch_speedup = median(torch);
  return s;
}

std::string opt_us(std::optional<double> s) {
  char b[32];
  if (!s) return "-";
  std::snprintf(b, sizeof b, "%.1f", *s * 1e6);
  return b;
}
std::string opt_ratio(std::optional<double> r) {
  char b[32];
  if (!r) return "-";
  std::snprintf(b, sizeof b, "%.3f", *r);
  return b;
}

std::string dtype_label(DType d) {
  return d == DType::kFloat32 ? "fp32" : d == DType::kBFloat16 ? "bf16" : "fp16";
}

}  // namespace

void print_clip(std::FILE* out, const ClipConfig& config, const RunInfo& info,
                const ClipResult& result) {
  const auto& rows = result.rows;
  print_run_header(out, "clip", info);
  std::fprintf(out,
               "# one rank, no groups, one CPU stream; time = median over iterations of enqueue + "
               "stream synchronize (us); max_norm %g\n",
               config.max_norm);
  std::fprintf(out,
               "# clip bandwidth = 3S / t (norm read + scale read/write), copy bandwidth = 2S / t "
               "(memcpy_async of the same tensors); GB/s = 1e9; contenders alternate in each "
               "iteration\n");
  std::fprintf(out, "# torch: %s\n", info.torch.c_str());
  std::fprintf(out, "\n## clip (norm + scale) vs copy, deterministic cost, torch\n");
  std::fprintf(out, "%-18s %4s %6s %10s %8s %10s %8s %7s %9s %10s %7s", "model", "tens", "iters",
               "copy_us", "copy_bw", "clip_us", "clip_bw", "ratio", "ratio_cpu", "determ_us",
               "d_cost");
  if (info.torch_ran) std::fprintf(out, " %10s %8s", "torch_us", "speedup");
  std::fprintf(out, "\n");
  for (const auto& r : rows) {
    std::fprintf(out, "%-18s %4zu %6d %10.1f %8.3f %10.1f %8.3f %7.3f %9.3f %10.1f %7.3f",
                 model_label(r.model).c_str(), r.tensors, r.iters, r.copy_seconds * 1e6,
                 copy_bandwidth_gbps(r), r.clip_seconds * 1e6,
                 clip_bandwidth_gbps(r, r.clip_seconds),
                 clip_bandwidth_gbps(r, r.clip_seconds) / copy_bandwidth_gbps(r), clip_cpu_ratio(r),
                 r.deterministic_seconds * 1e6, r.deterministic_seconds / r.clip_seconds);
    if (info.torch_ran) {
      std::fprintf(out, " %10s %8s", opt_us(r.torch_seconds).c_str(),
                   opt_ratio(ratio_of(r.torch_seconds, r.clip_seconds)).c_str());
    }
    std::fprintf(out, "\n");
  }
  std::fprintf(out,
               "\n## the clip folded into the engines' step (kernel table, AdamW), each from the "
               "reductions' writes of the shards: the unscale pass with partial sums after each "
               "reduction + finish + AdamW reading the coefficient, vs unscale + AdamW\n");
  std::fprintf(out, "%-18s %6s %12s %14s %7s %9s\n", "model", "iters", "step_us", "step+clip_us",
               "ratio", "ratio_cpu");
  for (const auto& r : rows) {
    std::fprintf(out, "%-18s %6d %12.1f %14.1f %7.3f %9.3f\n", model_label(r.model).c_str(),
                 r.iters, r.step_seconds * 1e6, r.step_clip_seconds * 1e6,
                 r.step_clip_seconds / r.step_seconds,
                 r.step_clip_cpu_seconds / r.step_cpu_seconds);
  }
  if (!result.kernels.empty()) {
    std::fprintf(out,
                 "\n## CPU kernels (%s) vs a copy of count x 4 bytes in the same rounds; "
                 "bandwidth = bytes the kernel must read + write / t\n",
                 info.cpu_kernels.c_str());
    std::fprintf(out, "%-16s %5s %10s %10s %9s %10s %9s %7s %9s\n", "kernel", "dtype", "count",
                 "kernel_us", "k_bw", "copy_us", "copy_bw", "ratio", "ratio_cpu");
    for (const auto& k : result.kernels) {
      std::fprintf(out, "%-16s %5s %10zu %10.1f %9.3f %10.1f %9.3f %7.3f %9.3f\n", k.kernel.c_str(),
                   dtype_label(k.dtype).c_str(), k.count, k.seconds * 1e6, kernel_bandwidth_gbps(k),
                   k.copy_seconds * 1e6, kernel_copy_bandwidth_gbps(k),
                   kernel_bandwidth_gbps(k) / kernel_copy_bandwidth_gbps(k), kernel_cpu_ratio(k));
    }
  }
  const ClipSummary s = summarize_clip(rows);
  if (s.copy_ratio) {
    std::fprintf(out,
                 "summary: clip: median clip/copy bandwidth = %.3f over %zu models, lowest %.3f: "
                 "%s (target >= %.2fx the copy on CPU for every model); by CPU time %.3f\n",
                 *s.copy_ratio, rows.size(), *s.min_copy_ratio,
                 *s.min_copy_ratio >= kClipCopyTarget ? "MEETS" : "BELOW", kClipCopyTarget,
                 *s.copy_ratio_cpu);
  }
  if (s.fold_ratio) {
    std::fprintf(out,
                 "summary: clip folded into the step: median time / the step without clip = "
                 "%.3f, highest %.3f: %s (target <= %.2fx); by CPU time %.3f\n",
                 *s.fold_ratio, *s.max_fold_ratio,
                 *s.max_fold_ratio <= kClipFoldTarget ? "MEETS" : "ABOVE", kClipFoldTarget,
                 *s.fold_ratio_cpu);
  }
  if (s.det_cost) {
    std::fprintf(out, "summary: deterministic clip: median time / float clip = %.3f (no target)\n",
                 *s.det_cost);
  }
  if (s.torch_speedup) {
    std::fprintf(out,
                 "summary: clip vs torch.nn.utils.clip_grad_norm_: median torch time / hpshard "
                 "time = %.3f (no target)\n",
                 *s.torch_speedup);
  }
}

Json clip_to_json(const ClipConfig& config, const RunInfo& info, const ClipResult& result) {
  Json j;
  add_run_info(j, "clip", info);
  Json models = Json::array();
  for (const auto& m : config.models) models.push_back({{"bytes", m.bytes}, {"mixed", m.mixed}});
  j["config"] = {{"models", models},
                 {"iters", config.iters},
                 {"warmup", config.warmup},
                 {"max_norm", config.max_norm},
                 {"kernel_bytes", config.kernel_bytes}};
  j["units"] = {{"time", "seconds, median over iterations of enqueue + stream synchronize"},
                {"bandwidth", "GB/s (1e9 bytes); clip moves 3S, copy 2S"}};
  j["reference"] =
      "memcpy_async of the same tensors on the same CPU stream; the engines' step (each "
      "shard's reduction write, then unscale + AdamW through the kernel table) without a clip";
  j["targets"] = {{"clip_copy_ratio_min", kClipCopyTarget}, {"fold_ratio_max", kClipFoldTarget}};
  j["torch"] = {{"ran", info.torch_ran}, {"status", info.torch}};
  Json rows = Json::array();
  for (const auto& r : result.rows) {
    rows.push_back(
        {{"model", model_label(r.model)},
         {"bytes", r.bytes},
         {"fp32_bytes", r.fp32_bytes},
         {"mixed", r.model.mixed},
         {"tensors", r.tensors},
         {"iters", r.iters},
         {"copy_seconds", r.copy_seconds},
         {"copy_bandwidth", copy_bandwidth_gbps(r)},
         {"clip_seconds", r.clip_seconds},
         {"clip_bandwidth", clip_bandwidth_gbps(r, r.clip_seconds)},
         {"clip_copy_ratio", clip_bandwidth_gbps(r, r.clip_seconds) / copy_bandwidth_gbps(r)},
         {"deterministic_seconds", r.deterministic_seconds},
         {"deterministic_cost", r.deterministic_seconds / r.clip_seconds},
         {"step_seconds", r.step_seconds},
         {"step_clip_seconds", r.step_clip_seconds},
         {"fold_ratio", r.step_clip_seconds / r.step_seconds},
         {"copy_cpu_seconds", r.copy_cpu_seconds},
         {"clip_cpu_seconds", r.clip_cpu_seconds},
         {"clip_copy_ratio_cpu", clip_cpu_ratio(r)},
         {"step_cpu_seconds", r.step_cpu_seconds},
         {"step_clip_cpu_seconds", r.step_clip_cpu_seconds},
         {"fold_ratio_cpu", r.step_clip_cpu_seconds / r.step_cpu_seconds},
         {"torch_seconds", json_optional(r.torch_seconds)},
         {"torch_speedup", json_optional(ratio_of(r.torch_seconds, r.clip_seconds))}});
  }
  j["results"] = rows;
  Json kernels = Json::array();
  for (const auto& k : result.kernels) {
    kernels.push_back({{"kernel", k.kernel},
                       {"dtype", std::string(dtype_name(k.dtype))},
                       {"count", k.count},
                       {"bytes", k.bytes},
                       {"seconds", k.seconds},
                       {"bandwidth", kernel_bandwidth_gbps(k)},
                       {"copy_seconds", k.copy_seconds},
                       {"copy_bandwidth", kernel_copy_bandwidth_gbps(k)},
                       {"copy_ratio", kernel_bandwidth_gbps(k) / kernel_copy_bandwidth_gbps(k)},
                       {"cpu_seconds", k.cpu_seconds},
                       {"copy_cpu_seconds", k.copy_cpu_seconds},
                       {"copy_ratio_cpu", kernel_cpu_ratio(k)}});
  }
  j["kernels"] = kernels;
  const ClipSummary s = summarize_clip(result.rows);
  j["summary"] = {
      {"median_clip_copy_ratio", json_optional(s.copy_ratio)},
      {"lowest_clip_copy_ratio", json_optional(s.min_copy_ratio)},
      {"meets_copy_target",
       json_optional(s.min_copy_ratio ? std::optional<bool>(*s.min_copy_ratio >= kClipCopyTarget)
                                      : std::nullopt)},
      {"median_fold_ratio", json_optional(s.fold_ratio)},
      {"highest_fold_ratio", json_optional(s.max_fold_ratio)},
      {"meets_fold_target",
       json_optional(s.max_fold_ratio ? std::optional<bool>(*s.max_fold_ratio <= kClipFoldTarget)
                                      : std::nullopt)},
      {"median_clip_copy_ratio_cpu", json_optional(s.copy_ratio_cpu)},
      {"median_fold_ratio_cpu", json_optional(s.fold_ratio_cpu)},
      {"median_deterministic_cost", json_optional(s.det_cost)},
      {"median_torch_speedup", json_optional(s.torch_speedup)}};
  return j;
}

}  // namespace hps::bench
