// hps_last_error_message() is thread-local: concurrent failures on different threads
// each see their own message.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "hpshard/hpshard.h"

TEST(LastError, IsPerThread) {
  constexpr int kThreads = 8;
  std::vector<std::string> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &seen] {
      const auto bad = static_cast<hps_dtype_t>(100 + t);
      size_t size = 0;
      for (int i = 0; i < 1000; ++i) {
        if (hps_dtype_size(bad, &size) != HPS_STATUS_INVALID_ARGUMENT) return;
        seen[t] = hps_last_error_message();
        if (seen[t].find(std::to_string(100 + t)) == std::string::npos) return;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_NE(seen[t].find("unknown dtype value " + std::to_string(100 + t)), std::string::npos)
        << "thread " << t << " saw '" << seen[t] << "'";
  }
  std::string fresh;
  std::thread([&] { fresh = hps_last_error_message(); }).join();
  EXPECT_EQ(fresh, "") << "a thread that never failed has an empty message";
}
