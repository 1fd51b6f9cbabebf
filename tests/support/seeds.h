// The seeds a seeded random test runs: PREFIX_SEED=a,b,... names them; otherwise
// PREFIX_CASES (default `count`) seeds from PREFIX_FIRST_SEED (default 1).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace hps::testing_util {

inline std::vector<uint64_t> seeds_from_env(const std::string& prefix, uint64_t count) {
  std::vector<uint64_t> seeds;
  const std::string list_var = prefix + "_SEED";
  if (const char* list = std::getenv(list_var.c_str()); list != nullptr && *list != '\0') {
    std::stringstream in(list);
    std::string item;
    while (std::getline(in, item, ',')) seeds.push_back(std::stoull(item, nullptr, 0));
    return seeds;
  }
  uint64_t first = 1;
  if (const char* v = std::getenv((prefix + "_FIRST_SEED").c_str()))
    first = std::stoull(v, nullptr, 0);
  if (const char* v = std::getenv((prefix + "_CASES").c_str())) count = std::stoull(v, nullptr, 0);
  for (uint64_t k = 0; k < count; ++k) seeds.push_back(first + k);
  return seeds;
}

}  // namespace hps::testing_util
