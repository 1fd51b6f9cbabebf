#include "core/device/cpu/device.h"

#include <unistd.h>

#include <fstream>
#include <string>
#include <thread>

namespace hps::cpu {
namespace {

std::string cpu_model_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      if (auto colon = line.find(':'); colon != std::string::npos && colon + 2 <= line.size()) {
        return "cpu (" + line.substr(colon + 2) + ")";
      }
    }
  }
  return "cpu";
}

}  // namespace

DeviceProperties device_properties() {
  DeviceProperties p;
  p.device = Device::cpu();
  p.name = cpu_model_name();
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page_size > 0) {
    p.total_memory_bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  }
  p.multiprocessor_count = static_cast<int32_t>(std::thread::hardware_concurrency());
  return p;
}

}  // namespace hps::cpu
