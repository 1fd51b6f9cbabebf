// libFuzzer target (clang 14, -fsanitize=fuzzer,address,undefined): what a checkpoint
// reader parses from disk, on hostile bytes. The first byte picks the parser:
//   0: a manifest; when it parses, the resharding planner on targets made from its tensors
//   1: a safetensors header (the data section as long as the input)
//   2: a data file header
// Every input must end in a Status, never a crash, a hang or a sanitizer report.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/checkpoint/format.h"
#include "core/checkpoint/manifest.h"
#include "core/checkpoint/reshard.h"
#include "core/checkpoint/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  using namespace hps::ckpt;
  switch (data[0] % 3) {
    case 0: {
      auto m = parse_manifest(text, "fuzz");
      if (!m.ok()) return 0;
      const SourceIndex source = source_of(*m, "/nonexistent");
      // Each tensor's second half, as a rank would ask for it, in its own and another dtype.
      std::vector<TargetRange> targets;
      for (const auto& t : m->tensors) {
        targets.push_back({t.name, t.dtype, t.shape, t.numel / 2, t.numel});
        targets.push_back({"master/" + t.name, hps::DType::kFloat32, t.shape, 0, t.numel / 3});
      }
      for (bool partial : {false, true}) {
        auto plan = plan_load(source, targets, SourceNaming::kCheckpoint, partial);
        if (plan.ok() && plan->source_of_target.size() != targets.size()) __builtin_trap();
      }
      (void)manifest_to_json(*m);
      return 0;
    }
    case 1: {
      (void)parse_safetensors_header(text, size, "fuzz");
      return 0;
    }
    default: {
      if (text.size() < kDataHeaderBytes) return 0;
      (void)check_data_file_header(reinterpret_cast<const uint8_t*>(text.data()),
                                   "0123456789abcdef0123456789abcdef", 1, "fuzz");
      return 0;
    }
  }
}
