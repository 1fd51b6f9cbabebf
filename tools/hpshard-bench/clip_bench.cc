#include "tools/hpshard-bench/clip_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <sstream>

#include "core/clip/hybrid_clip.h"
#include "core/common/half.h"
#include "core/device/cpu/stream.h"
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

// One model's buffers: the gradients, a copy destination, and for fp32 tensors the
// parameters and AdamW state.
struct Tensor {
  ClipTensorSpec spec;
  std::vector<std::byte> grad, copy;
  std::vector<float> param, exp_avg, exp_avg_sq;
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

std::vector<ClipRow> run_clip(const ClipConfig& config) {
  std::vector<ClipRow> rows;
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
      if (!model.mixed) {
        t.param.assign(spec.count, 0.5f);
        t.exp_avg.assign(spec.count, 0.0f);
        t.exp_avg_sq.assign(spec.count, 0.0f);
      }
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
    std::unique_ptr<HybridClip> fold;
    if (!model.mixed) fold = make_clip(tensors, config.max_norm, false, true);
    const AdamWHyper hyper;
    long adamw_step = 0;
    std::vector<Tensor>* ts = &tensors;
    auto enqueue_adamw = [&](const float* coefficient) {
      const long step = ++adamw_step;
      stream.enqueue([ts, hyper, step, coefficient] {
        for (auto& t : *ts) {
          cpu::adamw(t.param.data(), reinterpret_cast<const float*>(t.grad.data()),
                     t.exp_avg.data(), t.exp_avg_sq.data(), t.spec.count, hyper, step, coefficient,
                     1.0f);
        }
      });
    };

    struct Contender {
      const char* name;
      std::function<void()> enqueue;
      std::vector<double> times;
    };
    std::vector<Contender> contenders;
    contenders.push_back({"copy",
                          [&] {
                            for (auto& t : tensors) {
                              check(
                                  stream.memcpy_async(t.copy.data(), t.grad.data(), t.grad.size()),
                                  "memcpy_async");
                            }
                          },
                          {}});
    contenders.push_back(
        {"clip", [&] { check(clip->run(stream, nullptr, true), "clip run"); }, {}});
    contenders.push_back(
        {"deterministic",
         [&] { check(deterministic->run(stream, nullptr, true), "deterministic clip run"); },
         {}});
    if (fold) {
      contenders.push_back({"adamw", [&] { enqueue_adamw(nullptr); }, {}});
      contenders.push_back({"adamw+clip",
                            [&] {
                              check(fold->run(stream, nullptr, false), "clip run (scale=false)");
                              enqueue_adamw(fold->coefficient());
                            },
                            {}});
    }

    // Rounds: every contender once, the order rotated each round (and reversed every
    // other), so drift on this shared machine falls on all of them alike.
    const size_t n = contenders.size();
    for (int32_t round = 0; round < config.warmup + row.iters; ++round) {
      for (size_t k = 0; k < n; ++k) {
        const size_t rotated = (k + static_cast<size_t>(round)) % n;
        Contender& c = contenders[round % 2 ? n - 1 - rotated : rotated];
        const auto start = Clock::now();
        c.enqueue();
        check(stream.synchronize(), std::string(c.name) + " synchronize");
        const double t = std::chrono::duration<double>(Clock::now() - start).count();
        if (round >= config.warmup) c.times.push_back(t);
      }
    }
    row.copy_seconds = median(contenders[0].times);
    row.clip_seconds = median(contenders[1].times);
    row.deterministic_seconds = median(contenders[2].times);
    if (fold) {
      row.adamw_seconds = median(contenders[3].times);
      row.adamw_clip_seconds = median(contenders[4].times);
    }
    // Sanity: the clip left finite gradients behind.
    for (const auto& t : tensors) {
      const double squares = cpu::sum_of_squares(t.spec.dtype, t.grad.data(), t.spec.count);
      if (!std::isfinite(squares)) die("clip " + model_label(model) + ": gradients not finite");
    }
    rows.push_back(row);
  }
  return rows;
}

namespace {

std::optional<double> ratio_of(std::optional<double> a, std::optional<double> b) {
  if (!a || !b || *b <= 0) return std::nullopt;
  return *a / *b;
}

struct ClipSummary {
  std::optional<double> copy_ratio;     // median clip bw / copy bw
  std::optional<double> fold_ratio;     // median (adamw+clip) / adamw time
  std::optional<double> det_cost;       // median deterministic / float clip time
  std::optional<double> torch_speedup;  // median torch / hpshard clip time
};

ClipSummary summarize_clip(const std::vector<ClipRow>& rows) {
  std::vector<double> copy, fold, det, torch;
  for (const auto& r : rows) {
    copy.push_back(clip_bandwidth_gbps(r, r.clip_seconds) / copy_bandwidth_gbps(r));
    det.push_back(r.deterministic_seconds / r.clip_seconds);
    if (auto f = ratio_of(r.adamw_clip_seconds, r.adamw_seconds)) fold.push_back(*f);
    if (auto t = ratio_of(r.torch_seconds, r.clip_seconds)) torch.push_back(*t);
  }
  ClipSummary s;
  if (!copy.empty()) s.copy_ratio = median(copy);
  if (!fold.empty()) s.fold_ratio = median(fold);
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

}  // namespace

void print_clip(std::FILE* out, const ClipConfig& config, const RunInfo& info,
                const std::vector<ClipRow>& rows) {
  std::fprintf(out, "# hpshard-bench clip — %s — %s\n", info.date.c_str(), info.machine.c_str());
  std::fprintf(out, "# command: %s\n", info.command.c_str());
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
  std::fprintf(out, "%-18s %4s %6s %10s %8s %10s %8s %7s %10s %7s", "model", "tens", "iters",
               "copy_us", "copy_bw", "clip_us", "clip_bw", "ratio", "determ_us", "d_cost");
  if (info.torch_ran) std::fprintf(out, " %10s %8s", "torch_us", "speedup");
  std::fprintf(out, "\n");
  for (const auto& r : rows) {
    std::fprintf(out, "%-18s %4zu %6d %10.1f %8.3f %10.1f %8.3f %7.3f %10.1f %7.3f",
                 model_label(r.model).c_str(), r.tensors, r.iters, r.copy_seconds * 1e6,
                 copy_bandwidth_gbps(r), r.clip_seconds * 1e6,
                 clip_bandwidth_gbps(r, r.clip_seconds),
                 clip_bandwidth_gbps(r, r.clip_seconds) / copy_bandwidth_gbps(r),
                 r.deterministic_seconds * 1e6, r.deterministic_seconds / r.clip_seconds);
    if (info.torch_ran) {
      std::fprintf(out, " %10s %8s", opt_us(r.torch_seconds).c_str(),
                   opt_ratio(ratio_of(r.torch_seconds, r.clip_seconds)).c_str());
    }
    std::fprintf(out, "\n");
  }
  std::fprintf(out, "\n## AdamW with the clip folded in vs AdamW alone (fp32 models)\n");
  std::fprintf(out, "%-18s %6s %12s %14s %7s\n", "model", "iters", "adamw_us", "adamw+clip_us",
               "ratio");
  for (const auto& r : rows) {
    if (!r.adamw_seconds) continue;
    std::fprintf(out, "%-18s %6d %12.1f %14.1f %7.3f\n", model_label(r.model).c_str(), r.iters,
                 *r.adamw_seconds * 1e6, *r.adamw_clip_seconds * 1e6,
                 *r.adamw_clip_seconds / *r.adamw_seconds);
  }
  const ClipSummary s = summarize_clip(rows);
  if (s.copy_ratio) {
    std::fprintf(out,
                 "summary: clip: median clip/copy bandwidth = %.3f over %zu models: %s (target "
                 ">= %.2fx the copy on CPU)\n",
                 *s.copy_ratio, rows.size(), *s.copy_ratio >= kClipCopyTarget ? "MEETS" : "BELOW",
                 kClipCopyTarget);
  }
  if (s.fold_ratio) {
    std::fprintf(out,
                 "summary: clip folded into AdamW: median time / AdamW alone = %.3f: %s (target "
                 "<= %.2fx)\n",
                 *s.fold_ratio, *s.fold_ratio <= kClipFoldTarget ? "MEETS" : "ABOVE",
                 kClipFoldTarget);
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

std::string clip_to_json(const ClipConfig& config, const RunInfo& info,
                         const std::vector<ClipRow>& rows) {
  std::ostringstream j;
  j << "{\n  \"tool\": \"hpshard-bench\",\n  \"family\": \"clip\",\n";
  j << "  \"command\": " << json_string(info.command) << ",\n";
  j << "  \"date\": " << json_string(info.date) << ",\n";
  j << "  \"machine\": " << json_string(info.machine) << ",\n";
  j << "  \"config\": {\"models\": [";
  for (size_t i = 0; i < config.models.size(); ++i) {
    j << (i ? ", " : "") << "{\"bytes\": " << config.models[i].bytes
      << ", \"mixed\": " << (config.models[i].mixed ? "true" : "false") << "}";
  }
  j << "], \"iters\": " << config.iters << ", \"warmup\": " << config.warmup
    << ", \"max_norm\": " << json_number(config.max_norm) << "},\n";
  j << "  \"units\": {\"time\": \"seconds, median over iterations of enqueue + stream "
       "synchronize\", \"bandwidth\": \"GB/s (1e9 bytes); clip moves 3S, copy 2S\"},\n";
  j << "  \"reference\": \"memcpy_async of the same tensors on the same CPU stream; cpu::adamw "
       "without a clip coefficient\",\n";
  j << "  \"targets\": {\"clip_copy_ratio_min\": " << kClipCopyTarget
    << ", \"fold_ratio_max\": " << kClipFoldTarget << "},\n";
  j << "  \"torch\": {\"ran\": " << (info.torch_ran ? "true" : "false")
    << ", \"status\": " << json_string(info.torch) << "},\n";
  j << "  \"results\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    j << (i ? ",\n" : "\n") << "    {\"model\": " << json_string(model_label(r.model))
      << ", \"bytes\": " << r.bytes << ", \"fp32_bytes\": " << r.fp32_bytes
      << ", \"mixed\": " << (r.model.mixed ? "true" : "false") << ", \"tensors\": " << r.tensors
      << ", \"iters\": " << r.iters << ", \"copy_seconds\": " << json_number(r.copy_seconds)
      << ", \"copy_bandwidth\": " << json_number(copy_bandwidth_gbps(r))
      << ", \"clip_seconds\": " << json_number(r.clip_seconds)
      << ", \"clip_bandwidth\": " << json_number(clip_bandwidth_gbps(r, r.clip_seconds))
      << ", \"clip_copy_ratio\": "
      << json_number(clip_bandwidth_gbps(r, r.clip_seconds) / copy_bandwidth_gbps(r))
      << ", \"deterministic_seconds\": " << json_number(r.deterministic_seconds)
      << ", \"deterministic_cost\": " << json_number(r.deterministic_seconds / r.clip_seconds)
      << ", \"adamw_seconds\": " << json_optional(r.adamw_seconds)
      << ", \"adamw_clip_seconds\": " << json_optional(r.adamw_clip_seconds)
      << ", \"fold_ratio\": " << json_optional(ratio_of(r.adamw_clip_seconds, r.adamw_seconds))
      << ", \"torch_seconds\": " << json_optional(r.torch_seconds)
      << ", \"torch_speedup\": " << json_optional(ratio_of(r.torch_seconds, r.clip_seconds)) << "}";
  }
  const ClipSummary s = summarize_clip(rows);
  j << "\n  ],\n  \"summary\": {\"median_clip_copy_ratio\": " << json_optional(s.copy_ratio)
    << ", \"meets_copy_target\": "
    << json_optional(s.copy_ratio ? std::optional<bool>(*s.copy_ratio >= kClipCopyTarget)
                                  : std::nullopt)
    << ", \"median_fold_ratio\": " << json_optional(s.fold_ratio) << ", \"meets_fold_target\": "
    << json_optional(s.fold_ratio ? std::optional<bool>(*s.fold_ratio <= kClipFoldTarget)
                                  : std::nullopt)
    << ", \"median_deterministic_cost\": " << json_optional(s.det_cost)
    << ", \"median_torch_speedup\": " << json_optional(s.torch_speedup) << "}\n}\n";
  return j.str();
}

}  // namespace hps::bench
