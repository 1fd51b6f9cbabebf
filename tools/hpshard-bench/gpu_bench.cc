// hpshard-gpu-bench: the CUDA kernel table beside a device-to-device copy of the same
// bytes, on one GPU (/work/shared/PERFORMANCE.md: the fused norm and AdamW kernels ≥ 0.85×
// the copy's bandwidth; the clip folded into AdamW ≤ 1.1× AdamW alone). Built wherever
// CUDA is (no Gloo needed: the GPU machine has none); tools/gpu-check.sh runs it. Exits 77
// where no CUDA device is usable, 1 on any error.
//
//   hpshard-gpu-bench [--mib N] [--iters N] [--json FILE]
//   hpshard-gpu-bench --info    the driver, runtime, device, stream-ordered allocator
//                               support and the NCCL that would be loaded (and from where)
//   hpshard-gpu-bench --step    the engines' step at world size 1 (device_step.h)
//   hpshard-gpu-bench --ckpt    a CUDA engine's checkpoints at world size 1 (ckpt_bench.h)
//
// Every buffer is device memory filled by the table's own kernels (no host copies); the
// only host waits are the ones that read each round's timing events.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "core/common/config.h"
#include "core/common/output_file.h"
#include "core/device/buffer.h"
#include "core/device/cuda/stream.h"
#include "core/device/device.h"
#include "core/kernels/cpu/kernel_set.h"
#include "core/kernels/kernel_table.h"
#include "tools/hpshard-bench/ckpt_bench.h"
#include "tools/hpshard-bench/device_step.h"
#if HPS_HAVE_NCCL
#include "core/comm/nccl/nccl_api.h"
#endif

namespace {

using hps::DevicePtr;
using hps::DType;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "hpshard-gpu-bench: %s\n", what.c_str());
  std::exit(1);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}

void check(const hps::Status& s, const char* what) {
  if (!s.ok()) die(std::string(what) + ": " + s.to_string());
}

template <typename T>
T take(hps::StatusOr<T> v, const char* what) {
  if (!v.ok()) die(std::string(what) + ": " + v.status().to_string());
  return std::move(v).value();
}

struct Contender {
  const char* name;
  double bytes_per_element;  // bytes the kernel must read + write per element
  std::function<void()> run;
  std::vector<double> ms;
};

// What a GPU run needs to know first. 77 when no CUDA device is usable.
int print_info() {
  int driver = 0, runtime = 0;
  const cudaError_t driver_error = cudaDriverGetVersion(&driver);
  (void)cudaRuntimeGetVersion(&runtime);
  std::printf("cuda driver: %d.%d%s\n", driver / 1000, driver % 1000 / 10,
              driver_error == cudaSuccess && driver > 0 ? "" : " (no driver)");
  std::printf("cuda runtime: %d.%d (linked statically)\n", runtime / 1000, runtime % 1000 / 10);
#if HPS_HAVE_NCCL
  auto nccl = hps::nccl_backend::nccl_api();
  if (nccl.ok()) {
    std::printf("nccl: %s from %s\n", hps::nccl_backend::nccl_version_string(**nccl).c_str(),
                (*nccl)->file.c_str());
  } else {
    std::printf("nccl: unavailable: %s\n", nccl.status().message().c_str());
  }
#else
  std::printf("nccl: not in this build\n");
#endif
  const int32_t devices = hps::device_count(hps::DeviceType::kCuda);
  std::printf("cuda devices: %d\n", devices);
  for (int32_t d = 0; d < devices; ++d) {
    auto p = hps::device_properties(hps::Device::cuda(d));
    if (!p.ok()) die("device properties: " + p.status().to_string());
    int pools = 0;
    check(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, d),
          "cudaDeviceGetAttribute");
    std::printf(
        "cuda:%d: %s, compute capability %d.%d, %d SMs, %.1f GiB, stream-ordered "
        "allocator (cudaMallocAsync): %s\n",
        d, p->name.c_str(), p->compute_capability_major, p->compute_capability_minor,
        p->multiprocessor_count,
        static_cast<double>(p->total_memory_bytes) / (1024.0 * 1024.0 * 1024.0),
        pools != 0 ? "supported" : "NOT supported");
  }
  if (devices == 0) {
    std::printf("skipped: no usable CUDA device\n");
    return 77;
  }
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The value after the flag at argv[i] (i moves onto it).
std::string flag_value(int argc, char** argv, int& i) {
  if (i + 1 >= argc) die(std::string(argv[i]) + " needs a value");
  return argv[++i];
}

// The decimal integer in min..max after the flag at argv[i] (i moves onto it): decimal
// digits only, as hpshard-bench takes them (no sign, no leading zero, no trailing text).
int64_t int_value(int argc, char** argv, int& i, int64_t min, int64_t max) {
  const std::string flag = argv[i];
  const std::string text = flag_value(argc, argv, i);
  int64_t v = 0;
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos &&
                      (text.size() == 1 || text[0] != '0');
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (!digits || ec != std::errc() || end != text.data() + text.size() || v < min || v > max) {
    die(flag + " '" + text + "': not a decimal integer in " + std::to_string(min) + ".." +
        std::to_string(max));
  }
  return v;
}

// A mode's figures as one JSON object in `path` (nothing when it is empty).
void write_json(const std::string& path, const hps::bench::Json& j) {
  if (path.empty()) return;
  const std::string error = hps::write_output(path, j.dump(2) + "\n");
  if (!error.empty()) die(error);
}

// A --json FILE, refused before the run when it is no regular file (output_file.h).
std::string json_value(int argc, char** argv, int& i) {
  std::string path = flag_value(argc, argv, i);
  const hps::OutputFile checked = hps::output_file(path);
  if (path.empty() || !checked.error.empty()) {
    die("--json '" + path + "': " + (path.empty() ? "an empty path" : checked.error));
  }
  return path;
}

// --step [--width N] [--depth N] [--json FILE]: the runtime's step on CUDA at world size 1.
int step_mode(int argc, char** argv, int first) {
  hps::bench::DeviceStepConfig c;
  c.device = hps::Device::cuda(0);
  std::string json_path;
  for (int i = first; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--width") {
      c.width = static_cast<int>(int_value(argc, argv, i, 1, 65536));
    } else if (flag == "--depth") {
      c.depth = static_cast<int>(int_value(argc, argv, i, 1, 1024));
    } else if (flag == "--json") {
      json_path = json_value(argc, argv, i);
    } else {
      die("--step: unknown flag " + flag);
    }
  }
  if (hps::device_count(hps::DeviceType::kCuda) == 0) {
    std::puts("skipped: no usable CUDA device");
    return 77;
  }
  const hps::bench::DeviceStepResult r = hps::bench::run_device_step(c);
  hps::bench::print_device_step(c, r);
  write_json(json_path, hps::bench::device_step_to_json(c, r));
  // No host sync in a steady step, and both stages trained to the same parameters.
  return r.stage2_host_syncs_max == 0 && r.stage3_host_syncs_max == 0 && r.stage2_max_diff < 1e-6
             ? 0
             : 1;
}

// --ckpt [--mib N] [--reps N] [--steps N] [--compute-passes N] [--dir DIR] [--json FILE]:
// checkpoints of a CUDA engine at world size 1 (tools/hpshard-bench/ckpt_bench.h: the same
// code as `hpshard-bench ckpt --device cuda --ranks 1`).
int ckpt_mode(int argc, char** argv, int first) {
  hps::bench::CkptConfig c;
  c.device = hps::Device::cuda(0);
  c.ranks = 1;
  c.reps = 9;
  c.compute_passes = 200;  // a step long enough on a GPU for a snapshot to hide in
  c.progress = false;
  std::string json_path;
  size_t mib = 64;
  for (int i = first; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&] { return flag_value(argc, argv, i); };
    if (flag == "--mib") {
      mib = static_cast<size_t>(int_value(argc, argv, i, 1, 65536));
    } else if (flag == "--reps") {
      c.reps = static_cast<int>(int_value(argc, argv, i, 1, 1000));
    } else if (flag == "--steps") {
      c.steps = static_cast<int>(int_value(argc, argv, i, 1, 10000));
    } else if (flag == "--compute-passes") {
      c.compute_passes = static_cast<int>(int_value(argc, argv, i, 0, 100000));
    } else if (flag == "--dir") {
      c.dir = value();
    } else if (flag == "--json") {
      json_path = json_value(argc, argv, i);
    } else {
      die("--ckpt: unknown flag " + flag);
    }
  }
  c.bytes = mib << 20;
  if (hps::device_count(hps::DeviceType::kCuda) == 0) {
    std::puts("skipped: no usable CUDA device");
    return 77;
  }
  hps::bench::RunInfo info = hps::bench::run_info(argc, argv);
  info.machine += ", " + take(hps::device_properties(c.device), "device properties").name;
  info.torch = "no torch column for checkpoints";
  // The report's header names the CPU kernels too (the engine's host-side work runs on them).
  info.cpu_kernels = hps::cpu::cpu_isa_name(hps::cpu::active_cpu_kernels().isa);
  info.cpu_features = hps::cpu::cpu_feature_text();
  const hps::bench::CkptResult r = hps::bench::run_ckpt(c);
  info.load_after = hps::bench::load_average();
  hps::bench::print_ckpt(stdout, c, info, r);
  write_json(json_path, hps::bench::ckpt_to_json(c, info, r));
  // The loaded state equals the saved one, and no step beside a save synced.
  return r.loaded_equal && r.host_syncs_in_overlapped_steps == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  size_t mib = 256;
  int iters = 20;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--mib") {
      mib = static_cast<size_t>(int_value(argc, argv, i, 1, int64_t{1} << 20));
    } else if (flag == "--iters") {
      iters = static_cast<int>(int_value(argc, argv, i, 1, 10000));
    } else if (flag == "--json") {
      json_path = json_value(argc, argv, i);
    } else if (flag == "--info") {
      return print_info();
    } else if (flag == "--step") {
      // The engines' own step at world size 1 on the GPU (tools/hpshard-bench/device_step.h):
      // the same code as `hpshard-bench step --device cuda`, here because this binary needs
      // no Gloo.
      return step_mode(argc, argv, i + 1);
    } else if (flag == "--ckpt") {
      return ckpt_mode(argc, argv, i + 1);
    } else if (flag == "-h" || flag == "--help") {
      std::puts(
          "hpshard-gpu-bench [--mib N (256)] [--iters N (20)] [--json FILE] | --info\n"
          "hpshard-gpu-bench --step [--width N (1024)] [--depth N (8)] [--json FILE]\n"
          "hpshard-gpu-bench --ckpt [--mib N (64)] [--reps N (9)] [--steps N (6)]\n"
          "                  [--compute-passes N (200)] [--dir DIR] [--json FILE]");
      return 0;
    } else {
      die("unknown flag " + flag);
    }
  }
  if (hps::device_count(hps::DeviceType::kCuda) == 0) {
    std::puts("skipped: no usable CUDA device");
    return 77;
  }
  const hps::Device gpu = hps::Device::cuda(0);
  const auto properties = take(hps::device_properties(gpu), "device properties");
  const hps::Kernels& k = *take(hps::kernels_for(hps::DeviceType::kCuda), "kernels_for");
  auto stream = take(hps::create_stream(gpu), "create_stream");
  cudaStream_t native = static_cast<hps::cuda::CudaStream&>(*stream).native();

  const size_t bytes = mib << 20, n = bytes / sizeof(float);
  auto buffer = [&](size_t size, DType fill_dtype, size_t count, double value) {
    auto b = take(hps::DeviceBuffer::allocate(gpu, size), "allocate");
    check(k.fill(*stream, fill_dtype, b.data(), count, value), "fill");
    return b;
  };
  // Finite, non-zero values: a gradient the norm, unscale and AdamW read in full.
  auto grad = buffer(bytes, DType::kFloat32, n, 0.0115);
  auto grad16 = buffer(bytes / 2, DType::kBFloat16, n, 0.0115);
  auto copy = buffer(bytes, DType::kFloat32, n, 0.0);
  auto param = buffer(bytes, DType::kFloat32, n, 0.5);
  auto exp_avg = buffer(bytes, DType::kFloat32, n, 0.0);
  auto exp_avg_sq = buffer(bytes, DType::kFloat32, n, 0.0);
  auto clip = take(hps::DeviceBuffer::allocate(gpu, sizeof(hps::ClipState)), "allocate");
  auto state = take(hps::DeviceBuffer::allocate(gpu, sizeof(hps::StepState)), "allocate");
  const auto clip_state = clip.data<hps::ClipState>();
  const auto step_state = state.data<hps::StepState>();
  const hps::AdamWHyper hyper;
  hps::StepState initial;
  initial.applied_steps = 1;
  const hps::AdamWConstants constants = hps::adamw_constants(hyper, 1);
  initial.adamw_step_size = constants.step_size;
  initial.adamw_bias2_sqrt = constants.bias2_sqrt;
  check(k.write_step_state(*stream, step_state, initial), "write_step_state");

  // The clip's norm: the partials zeroed, the squares, the coefficient (max_norm far above
  // the norm: the coefficient stays 1 and the gradients keep their values).
  auto norm = [&](DType dtype, DevicePtr<const void> data) {
    check(stream->memset_async(clip_state.get(), 0, 2 * sizeof(double)), "memset_async");
    check(k.sum_of_squares(*stream, dtype, data, n, clip_state.as<double>()), "sum_of_squares");
    check(k.finish_clip(*stream, clip_state, false, 1e30), "finish_clip");
  };
  auto adamw = [&](bool folded) {
    hps::AdamWArgs a;
    a.param = param.data<float>();
    a.grad = grad.data<const float>();
    a.exp_avg = exp_avg.data<float>();
    a.exp_avg_sq = exp_avg_sq.data<float>();
    a.count = n;
    a.hyper = hyper;
    a.state = step_state;
    if (folded)
      a.clip_coefficient =
          clip_state.byte_offset(offsetof(hps::ClipState, coefficient)).as<const float>();
    check(k.adamw(*stream, a), "adamw");
  };
  std::vector<Contender> contenders = {
      {"copy",
       8,
       [&] { check(stream->memcpy_async(copy.data().get(), grad.data().get(), bytes), "copy"); },
       {}},
      {"norm_fp32", 4, [&] { norm(DType::kFloat32, grad.data<const void>()); }, {}},
      {"norm_bf16", 2, [&] { norm(DType::kBFloat16, grad16.data<const void>()); }, {}},
      {"clip",
       12,
       [&] {
         norm(DType::kFloat32, grad.data<const void>());
         check(k.scale(*stream, DType::kFloat32, grad.data(), n, clip_state), "scale");
       },
       {}},
      {"unscale",
       8,
       [&] {
         hps::UnscaleArgs u;
         u.src = grad.data<const void>();
         u.dst = grad.data<float>();  // in place, as the engines unscale fp32 gradients
         u.count = n;
         u.state = step_state;  // loss scale 1: the values stay
         u.check_finite = true;
         u.clip = clip_state;
         u.partial = hps::kClipPartialN;
         check(k.unscale(*stream, u), "unscale");
       },
       {}},
      {"adamw", 28, [&] { adamw(false); }, {}},
      {"adamw+clip",
       32,
       [&] {
         norm(DType::kFloat32, grad.data<const void>());
         adamw(true);
       },
       {}},
  };
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  // Rounds: every contender once per round, the order rotated, after two warm-up rounds.
  for (int round = 0; round < iters + 2; ++round) {
    for (size_t c = 0; c < contenders.size(); ++c) {
      Contender& x = contenders[(c + static_cast<size_t>(round)) % contenders.size()];
      check(cudaEventRecord(start, native), "cudaEventRecord");
      x.run();
      check(cudaEventRecord(stop, native), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
      if (round >= 2) x.ms.push_back(ms);
    }
  }
  check(stream->synchronize(), "synchronize");

  const double copy_ms = median(contenders[0].ms);
  const double copy_gbps = 8.0 * static_cast<double>(n) / (copy_ms * 1e6);
  std::printf("# hpshard-gpu-bench — %s, %zu MiB of fp32 (%zu elements), median of %d rounds\n",
              properties.name.c_str(), mib, n, iters);
  std::printf("%-12s %10s %10s %8s\n", "kernel", "ms", "GB/s", "vs copy");
  std::string json = "{\"tool\": \"hpshard-gpu-bench\", \"device\": \"" + properties.name +
                     "\", \"mib\": " + std::to_string(mib) +
                     ", \"iters\": " + std::to_string(iters) + ", \"kernels\": {";
  double ratios[8] = {};
  for (size_t c = 0; c < contenders.size(); ++c) {
    const Contender& x = contenders[c];
    const double ms = median(x.ms);
    const double gbps = x.bytes_per_element * static_cast<double>(n) / (ms * 1e6);
    ratios[c] = gbps / copy_gbps;
    std::printf("%-12s %10.3f %10.1f %8.3f\n", x.name, ms, gbps, ratios[c]);
    char entry[256];
    std::snprintf(entry, sizeof entry,
                  "%s\"%s\": {\"ms\": %.6f, \"gbps\": %.3f, \"vs_copy\": %.4f}", c == 0 ? "" : ", ",
                  x.name, ms, gbps, ratios[c]);
    json += entry;
  }
  const double fold = median(contenders[6].ms) / median(contenders[5].ms);
  std::printf("summary: gpu fused norm (fp32): bandwidth / copy = %.3f: %s (target >= 0.85x)\n",
              ratios[1], ratios[1] >= 0.85 ? "MEETS" : "BELOW");
  std::printf("summary: gpu clip (norm + scale): bandwidth / copy = %.3f: %s (target >= 0.85x)\n",
              ratios[3], ratios[3] >= 0.85 ? "MEETS" : "BELOW");
  std::printf("summary: gpu AdamW: bandwidth / copy = %.3f: %s (target >= 0.85x)\n", ratios[5],
              ratios[5] >= 0.85 ? "MEETS" : "BELOW");
  std::printf(
      "summary: gpu clip folded into AdamW: time / AdamW alone = %.3f: %s (target <= 1.10x)\n",
      fold, fold <= 1.10 ? "MEETS" : "ABOVE");
  char tail[160];
  std::snprintf(tail, sizeof tail, "}, \"copy_gbps\": %.3f, \"fold_ratio\": %.4f}\n", copy_gbps,
                fold);
  json += tail;
  if (!json_path.empty()) {
    const std::string error = hps::write_output(json_path, json);
    if (!error.empty()) die(error);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 0;
}
