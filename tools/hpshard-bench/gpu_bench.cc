// hpshard-gpu-bench: the CUDA kernels beside a device-to-device copy of the same bytes, on
// one GPU (/work/shared/PERFORMANCE.md: clip ≥ 0.85× the copy's bandwidth on GPU; the
// clip folded into AdamW ≤ 1.1× AdamW alone). Built wherever CUDA is (no Gloo needed: the
// GPU machine has none); tools/gpu-check.sh runs it. Exits 77 where no CUDA device is
// usable.
//
//   hpshard-gpu-bench [--mib N] [--iters N] [--json FILE]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/kernels/norm.h"
#include "core/kernels/optimizer.h"

namespace {

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
T* device_buffer(size_t count, int byte) {
  void* p = nullptr;
  check(cudaMalloc(&p, count * sizeof(T)), "cudaMalloc");
  check(cudaMemset(p, byte, count * sizeof(T)), "cudaMemset");
  return static_cast<T*>(p);
}

}  // namespace

int main(int argc, char** argv) {
  size_t mib = 256;
  int iters = 20;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--mib") {
      mib = std::strtoul(value().c_str(), nullptr, 10);
    } else if (flag == "--iters") {
      iters = std::atoi(value().c_str());
    } else if (flag == "--json") {
      json_path = value();
    } else if (flag == "-h" || flag == "--help") {
      std::puts("hpshard-gpu-bench [--mib N (256)] [--iters N (20)] [--json FILE]");
      return 0;
    } else {
      die("unknown flag " + flag);
    }
  }
  if (mib == 0 || iters < 1) die("--mib and --iters must be positive");
  if (hps::device_count(hps::DeviceType::kCuda) == 0) {
    std::puts("skipped: no usable CUDA device");
    return 77;
  }
  check(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

  const size_t bytes = mib << 20, n = bytes / sizeof(float);
  // 0x3c3c3c3c is about 0.0115 as a float: finite, non-zero values everywhere.
  float* grad = device_buffer<float>(n, 0x3c);
  float* copy = device_buffer<float>(n, 0);
  float* param = device_buffer<float>(n, 0x3c);
  float* exp_avg = device_buffer<float>(n, 0);
  float* exp_avg_sq = device_buffer<float>(n, 0);
  double* partials = device_buffer<double>(2, 0);
  double* scratch = device_buffer<double>(hps::cuda::kSumOfSquaresMaxBlocks, 0);
  float* coefficient = device_buffer<float>(1, 0);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");

  const hps::AdamWHyper hyper;
  long step = 0;
  auto norm = [&] {
    check(cudaMemsetAsync(partials, 0, 2 * sizeof(double), stream), "cudaMemsetAsync");
    check(hps::cuda::sum_of_squares(hps::DType::kFloat32, grad, n, partials, scratch, stream),
          "sum_of_squares");
    // max_norm far above the norm: the coefficient stays 1, the gradients keep their values.
    check(hps::cuda::finish_clip(partials, nullptr, false, 1e30, nullptr, coefficient, nullptr,
                                 stream),
          "finish_clip");
  };
  struct Contender {
    const char* name;
    std::function<void()> run;
    std::vector<float> ms;
  };
  std::vector<Contender> contenders = {
      {"copy",
       [&] { check(cudaMemcpyAsync(copy, grad, bytes, cudaMemcpyDeviceToDevice, stream), "copy"); },
       {}},
      {"clip",
       [&] {
         norm();
         check(hps::cuda::scale(hps::DType::kFloat32, grad, n, coefficient, stream), "scale");
       },
       {}},
      {"adamw",
       [&] {
         check(hps::cuda::adamw(param, grad, exp_avg, exp_avg_sq, n, hyper, ++step, nullptr, 1.0f,
                                stream),
               "adamw");
       },
       {}},
      {"adamw+clip",
       [&] {
         norm();
         check(hps::cuda::adamw(param, grad, exp_avg, exp_avg_sq, n, hyper, ++step, coefficient,
                                1.0f, stream),
               "adamw");
       },
       {}},
  };
  // Rounds: every contender once per round, the order rotated, after two warm-up rounds.
  for (int round = 0; round < iters + 2; ++round) {
    for (size_t k = 0; k < contenders.size(); ++k) {
      Contender& c = contenders[(k + static_cast<size_t>(round)) % contenders.size()];
      check(cudaEventRecord(start, stream), "cudaEventRecord");
      c.run();
      check(cudaEventRecord(stop, stream), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
      if (round >= 2) c.ms.push_back(ms);
    }
  }
  auto median = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return static_cast<double>(v[v.size() / 2]);
  };
  const double copy_ms = median(contenders[0].ms), clip_ms = median(contenders[1].ms);
  const double adamw_ms = median(contenders[2].ms), fold_ms = median(contenders[3].ms);
  const double gb = static_cast<double>(bytes) / 1e9;
  // Bytes moved: the copy reads and writes S; the clip reads S (norm) and reads and writes
  // S (scale), as the CPU table counts them.
  const double copy_bw = 2 * gb / (copy_ms * 1e-3), clip_bw = 3 * gb / (clip_ms * 1e-3);
  const double ratio = clip_bw / copy_bw, fold = fold_ms / adamw_ms;
  std::printf("# hpshard-gpu-bench — %s, %zu MiB fp32, median of %d rounds (cudaEvent timing)\n",
              prop.name, mib, iters);
  std::printf("%10s %10s %10s %10s %10s %10s %8s %8s\n", "copy_ms", "copy_GB/s", "clip_ms",
              "clip_GB/s", "adamw_ms", "fold_ms", "ratio", "fold");
  std::printf("%10.3f %10.1f %10.3f %10.1f %10.3f %10.3f %8.3f %8.3f\n", copy_ms, copy_bw, clip_ms,
              clip_bw, adamw_ms, fold_ms, ratio, fold);
  std::printf("summary: gpu clip: clip/copy bandwidth = %.3f: %s (target >= 0.85x the copy)\n",
              ratio, ratio >= 0.85 ? "MEETS" : "BELOW");
  std::printf(
      "summary: gpu clip folded into AdamW: time / AdamW alone = %.3f: %s (target <= "
      "1.10x)\n",
      fold, fold <= 1.10 ? "MEETS" : "ABOVE");
  if (!json_path.empty()) {
    std::FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) die("cannot write " + json_path);
    std::fprintf(f,
                 "{\"tool\": \"hpshard-gpu-bench\", \"device\": \"%s\", \"mib\": %zu, "
                 "\"iters\": %d, \"copy_ms\": %.6f, \"clip_ms\": %.6f, \"adamw_ms\": %.6f, "
                 "\"adamw_clip_ms\": %.6f, \"copy_gbps\": %.3f, \"clip_gbps\": %.3f, "
                 "\"clip_copy_ratio\": %.4f, \"fold_ratio\": %.4f}\n",
                 prop.name, mib, iters, copy_ms, clip_ms, adamw_ms, fold_ms, copy_bw, clip_bw,
                 ratio, fold);
    std::fclose(f);
  }
  for (void* p :
       {static_cast<void*>(grad), static_cast<void*>(copy), static_cast<void*>(param),
        static_cast<void*>(exp_avg), static_cast<void*>(exp_avg_sq), static_cast<void*>(partials),
        static_cast<void*>(scratch), static_cast<void*>(coefficient)}) {
    cudaFree(p);
  }
  cudaStreamDestroy(stream);
  return 0;
}
