// For the tests that read hostile texts of many MiB (manifests, safetensors headers): the
// texts, and a run of a reader in a child process whose address space may grow by a few
// times the text at most.
#pragma once

#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>

#include "tests/support/sanitized.h"

namespace hps::testing_util {

// A field of /proc/self/status in KiB ("VmRSS:", ...); 0 when it is not there.
inline size_t status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stoul(line.substr(std::strlen(field)));
  }
  return 0;
}

// About `bytes` of JSON: `head`, then `element` over and over, then `tail`. `element` is
// a printf format given two numbers: n and n + 1, n counting up from 0 (or down from
// 999999999 when `down`).
inline std::string repeated(const std::string& head, const std::string& element,
                            const std::string& tail, size_t bytes, bool down = false) {
  std::string text = head;
  text.reserve(bytes + 256);
  char buffer[512];
  for (int i = 0; text.size() < bytes; ++i) {
    if (i > 0) text += ',';
    const int n = down ? 999999999 - i : i;
    std::snprintf(buffer, sizeof buffer, element.c_str(), n, n + 1);
    text += buffer;
  }
  return text + tail;
}

// Runs `read` in a child process whose address space may grow by `times` x `text_bytes`
// at most; `read` says whether its result is the right one and sets `shown` to it. The
// child prints what it touched at the peak (Linux 4.0 on: resident memory counted once
// the pages the parent freed are given back) and exits 0 when the result was right; a
// child that aborted or was killed fails the assertion.
inline ::testing::AssertionResult read_within(const char* what, size_t text_bytes, size_t times,
                                              const std::function<bool(std::string&)>& read) {
  std::fflush(nullptr);
  const pid_t child = ::fork();
  if (child < 0) return ::testing::AssertionFailure() << what << ": fork failed";
  if (child == 0) {
    ::malloc_trim(0);
    if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
      std::fputs("5", f);
      std::fclose(f);
    }
    const size_t resident = status_kib("VmRSS:") << 10;
    const size_t before = status_kib("VmSize:") << 10;
    const rlimit limit{before + times * text_bytes, before + times * text_bytes};
    ::setrlimit(RLIMIT_AS, &limit);
    std::string shown;
    const bool right = read(shown);
    std::fprintf(stderr, "%s (%zu MiB): %zu MiB more resident at the peak; %s\n", what,
                 text_bytes >> 20, ((status_kib("VmHWM:") << 10) - resident) >> 20,
                 shown.substr(0, 160).c_str());
    ::_exit(right ? 0 : 1);
  }
  int status = 0;
  if (::waitpid(child, &status, 0) != child) {
    return ::testing::AssertionFailure() << what << ": waitpid failed";
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << (WIFSIGNALED(status) ? "killed by signal " : "exit ")
         << (WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
}

}  // namespace hps::testing_util
