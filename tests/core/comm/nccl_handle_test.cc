// NCCL's library search and the non-blocking protocol of the CUDA communicator
// (core/comm/nccl/nccl_api.h, nccl_handle.h), on any machine: a fake NCCL (fake_nccl.cc,
// built beside this test) is loaded through the same loader and answers ncclInProgress as a
// real one does while it connects or enqueues. What a GPU run alone can show — NCCL's own
// kernels, events recorded on a real stream — is nccl_communicator_test's (label gpu).
#include "core/comm/nccl/nccl_handle.h"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/comm/nccl/nccl_api.h"

namespace hps::nccl_backend {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// The fake's controls (extern "C" in fake_nccl.cc), looked up in the loaded library.
struct FakeControls {
  void (*reset)();
  void (*script)(int polls, int final_state);
  void (*log)(char* out, size_t size);
  int (*misuse)(char* what, size_t size);
  int (*aborts)();
  int (*settled)();
};

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_.empty()) {
      unsetenv(name_);
    } else {
      setenv(name_, old_.c_str(), 1);
    }
  }

 private:
  const char* name_;
  std::string old_;
};

class NcclHandleTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto api = load_nccl({HPS_FAKE_NCCL});
    ASSERT_TRUE(api.ok()) << api.status().to_string();
    api_ = new NcclApi(std::move(api).value());
    void* library = dlopen(HPS_FAKE_NCCL, RTLD_NOW | RTLD_NOLOAD);
    ASSERT_NE(library, nullptr);
    auto get = [library](const char* name) {
      void* symbol = dlsym(library, name);
      EXPECT_NE(symbol, nullptr) << name;
      return symbol;
    };
    controls_.reset = reinterpret_cast<void (*)()>(get("fake_nccl_reset"));
    controls_.script = reinterpret_cast<void (*)(int, int)>(get("fake_nccl_script"));
    controls_.log = reinterpret_cast<void (*)(char*, size_t)>(get("fake_nccl_log"));
    controls_.misuse = reinterpret_cast<int (*)(char*, size_t)>(get("fake_nccl_misuse"));
    controls_.aborts = reinterpret_cast<int (*)()>(get("fake_nccl_aborts"));
    controls_.settled = reinterpret_cast<int (*)()>(get("fake_nccl_settled"));
  }
  void SetUp() override { controls_.reset(); }
  void TearDown() override {
    char what[256];
    EXPECT_EQ(controls_.misuse(what, sizeof what), 0) << "protocol misuse: " << what;
  }

  static std::string log() {
    char text[8192];
    controls_.log(text, sizeof text);
    return text;
  }
  static size_t count(const std::string& text, const std::string& word) {
    size_t n = 0;
    for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) ++n;
    return n;
  }
  // An initialised handle (init settles after two polls).
  void init(NcclHandle& handle) {
    controls_.script(2, ncclSuccess);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclUniqueId id{};
    ASSERT_TRUE(
        handle
            .init(
                "init",
                [&](ncclComm_t* out) { return api_->CommInitRankConfig(out, 2, id, 0, &config); },
                Clock::now() + 10s)
            .ok());
  }
  static Status all_reduce(NcclHandle& handle, Clock::duration limit = 10s) {
    return handle.run(
        "all_reduce",
        [](ncclComm_t comm) {
          return api_->AllReduce(nullptr, nullptr, 1, ncclFloat32, ncclSum, comm, nullptr);
        },
        Clock::now() + limit);
  }

  static inline NcclApi* api_ = nullptr;
  static inline FakeControls controls_{};
};

// ---- the library search ----

TEST(NcclLibrarySearch, HpsNcclLibraryIsTheOnlyCandidateWhenSet) {
  ScopedEnv env("HPS_NCCL_LIBRARY", HPS_FAKE_NCCL);
  auto candidates = nccl_library_candidates();
  ASSERT_TRUE(candidates.ok());
  EXPECT_EQ(*candidates, std::vector<std::string>{HPS_FAKE_NCCL});
  auto api = load_nccl(*candidates);
  ASSERT_TRUE(api.ok()) << api.status().to_string();
  EXPECT_EQ(api->file, HPS_FAKE_NCCL);
  EXPECT_EQ(nccl_version_string(*api), "2.28.3");
}

TEST(NcclLibrarySearch, AnEmptyHpsNcclLibraryIsAnError) {
  ScopedEnv env("HPS_NCCL_LIBRARY", "");
  auto candidates = nccl_library_candidates();
  EXPECT_EQ(candidates.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(candidates.status().message().find("HPS_NCCL_LIBRARY"), std::string::npos);
}

TEST(NcclLibrarySearch, WithoutItTheLoaderPathComesFirstThenTheWheels) {
  ScopedEnv env("HPS_NCCL_LIBRARY", nullptr);
  // A virtualenv holding NCCL's wheel layout.
  const std::string venv = testing::TempDir() + "hps_nccl_venv";
  const std::string lib = venv + "/lib/python3.99/site-packages/nvidia/nccl/lib";
  ASSERT_EQ(std::system(("mkdir -p " + lib + " && touch " + lib + "/libnccl.so.2").c_str()), 0);
  ScopedEnv venv_env("VIRTUAL_ENV", venv.c_str());
  auto candidates = nccl_library_candidates();
  ASSERT_TRUE(candidates.ok());
  ASSERT_FALSE(candidates->empty());
  EXPECT_EQ(candidates->front(), "libnccl.so.2");
  bool wheel_found = false;
  for (const auto& c : *candidates) wheel_found = wheel_found || c == lib + "/libnccl.so.2";
  EXPECT_TRUE(wheel_found) << "the virtualenv's wheel is not among the candidates";
}

TEST(NcclLibrarySearch, AFailedLoadNamesEveryFileTriedAndWhy) {
  // libm loads but is no NCCL; the other file does not exist.
  auto api = load_nccl({"/nonexistent/libnccl.so.2", "libm.so.6"});
  ASSERT_EQ(api.status().code(), StatusCode::kUnavailable);
  const std::string message = api.status().message();
  EXPECT_NE(message.find("/nonexistent/libnccl.so.2"), std::string::npos) << message;
  EXPECT_NE(message.find("libm.so.6: lacks a symbol"), std::string::npos) << message;
  EXPECT_NE(message.find("HPS_NCCL_LIBRARY"), std::string::npos) << message;
}

// ---- the non-blocking protocol ----

TEST_F(NcclHandleTest, InitWaitsUntilNcclHasFinished) {
  NcclHandle handle(*api_, "world");
  controls_.script(5, ncclSuccess);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclUniqueId id{};
  ASSERT_TRUE(
      handle
          .init(
              "init",
              [&](ncclComm_t* out) { return api_->CommInitRankConfig(out, 2, id, 0, &config); },
              Clock::now() + 10s)
          .ok());
  EXPECT_EQ(count(log(), "poll"), 6u) << log();  // five in progress, then ready
  EXPECT_EQ(controls_.settled(), 1);
  EXPECT_TRUE(handle.open());
}

TEST_F(NcclHandleTest, ACollectiveReturnsOnlyOnceNcclHasEnqueuedIt) {
  NcclHandle handle(*api_, "world");
  init(handle);
  const int before = controls_.settled();
  controls_.script(20, ncclSuccess);
  ASSERT_TRUE(all_reduce(handle).ok());
  // The caller records its done-event now: NCCL's work must already be on the stream.
  EXPECT_EQ(controls_.settled(), before + 1) << log();
  // The next operation is issued only after that (the fake flags it otherwise).
  controls_.script(3, ncclSuccess);
  ASSERT_TRUE(all_reduce(handle).ok());
  ASSERT_TRUE(all_reduce(handle).ok());  // settles at once
  EXPECT_EQ(controls_.settled(), before + 3);
}

TEST_F(NcclHandleTest, AFailedInitIsAbortedNeverFinalized) {
  NcclHandle handle(*api_, "world");
  controls_.script(2, ncclSystemError);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclUniqueId id{};
  const Status s = handle.init(
      "ncclCommInitRankConfig",
      [&](ncclComm_t* out) { return api_->CommInitRankConfig(out, 2, id, 0, &config); },
      Clock::now() + 10s);
  EXPECT_EQ(s.code(), StatusCode::kBackendError);
  EXPECT_NE(s.message().find("fake system error"), std::string::npos) << s.message();
  EXPECT_EQ(controls_.aborts(), 1);
  EXPECT_EQ(count(log(), "finalize"), 0u) << log();
  EXPECT_EQ(count(log(), "destroy"), 0u) << log();
  EXPECT_FALSE(handle.open());
  EXPECT_TRUE(handle.aborted());
}

TEST_F(NcclHandleTest, AnInitThatNeverFinishesTimesOutAndIsAborted) {
  NcclHandle handle(*api_, "world");
  controls_.script(-1, ncclSuccess);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclUniqueId id{};
  const Status s = handle.init(
      "ncclCommInitRankConfig",
      [&](ncclComm_t* out) { return api_->CommInitRankConfig(out, 2, id, 0, &config); },
      Clock::now() + 100ms);
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
  EXPECT_EQ(controls_.aborts(), 1);
  EXPECT_EQ(count(log(), "finalize"), 0u) << log();
}

TEST_F(NcclHandleTest, ATimeoutRecordsTheFailureBeforeAborting) {
  // What the owner sees in before_abort: the failure, while NCCL is not yet aborted (so an
  // operation it ends cannot be seen completing with OK).
  std::atomic<int> aborts_seen{-1};
  Status seen;
  NcclHandle handle(*api_, "sharding", [&](const Status& failure) {
    seen = failure;
    aborts_seen = controls_.aborts();
  });
  init(handle);
  controls_.script(-1, ncclSuccess);
  const Status s = all_reduce(handle, 100ms);
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
  EXPECT_NE(s.message().find("sharding"), std::string::npos) << s.message();
  EXPECT_EQ(aborts_seen.load(), 0) << "before_abort must run before ncclCommAbort";
  EXPECT_EQ(seen.code(), StatusCode::kTimeout);
  EXPECT_EQ(controls_.aborts(), 1);
  EXPECT_EQ(handle.failure().code(), StatusCode::kTimeout);
  // Later operations fail at once, naming the first failure; nothing reaches NCCL.
  const Status later = all_reduce(handle);
  EXPECT_EQ(later.code(), StatusCode::kAborted);
  EXPECT_NE(later.message().find("still in progress"), std::string::npos) << later.message();
  EXPECT_EQ(handle.async_error(), ncclSuccess);
}

TEST_F(NcclHandleTest, AnAsynchronousErrorAbortsTheCommunicator) {
  NcclHandle handle(*api_, "world");
  init(handle);
  controls_.script(1, ncclRemoteError);
  const Status s = all_reduce(handle);
  EXPECT_EQ(s.code(), StatusCode::kBackendError);
  EXPECT_NE(s.message().find("fake remote error"), std::string::npos) << s.message();
  EXPECT_EQ(controls_.aborts(), 1);
}

TEST_F(NcclHandleTest, AbortFromAnotherThreadEndsAPollAtOnce) {
  NcclHandle handle(*api_, "world");
  init(handle);
  controls_.script(-1, ncclSuccess);
  Status result;
  const auto start = Clock::now();
  std::thread issuer([&] { result = all_reduce(handle, 60s); });
  std::this_thread::sleep_for(50ms);
  handle.abort(aborted("aborted by the test"));
  issuer.join();
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_EQ(result.code(), StatusCode::kAborted) << result.to_string();
  EXPECT_NE(result.message().find("aborted by the test"), std::string::npos);
  EXPECT_EQ(controls_.aborts(), 1);
}

TEST_F(NcclHandleTest, TheWatchdogsPollsNeverOverlapTheIssuersCalls) {
  NcclHandle handle(*api_, "world");
  init(handle);
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    while (!done) (void)handle.async_error();
  });
  for (int i = 0; i < 200; ++i) {
    controls_.script(i % 4, ncclSuccess);
    ASSERT_TRUE(all_reduce(handle).ok());
  }
  handle.abort(aborted("end"));  // while the watchdog still polls
  done = true;
  watchdog.join();
  // TearDown checks the fake saw no concurrent call and none on the aborted communicator.
}

TEST_F(NcclHandleTest, CloseFinalizesThenDestroys) {
  NcclHandle handle(*api_, "world");
  init(handle);
  controls_.script(3, ncclSuccess);
  handle.close(1s);
  const std::string calls = log();
  EXPECT_NE(calls.find("finalize poll poll poll poll destroy"), std::string::npos) << calls;
  EXPECT_EQ(controls_.aborts(), 0);
  EXPECT_FALSE(handle.open());
  EXPECT_EQ(all_reduce(handle).code(), StatusCode::kAborted);
}

TEST_F(NcclHandleTest, CloseIsBoundedByItsGrace) {
  bool failed_pending = false;
  NcclHandle handle(*api_, "world", [&](const Status&) { failed_pending = true; });
  init(handle);
  controls_.script(-1, ncclSuccess);  // finalisation never finishes (a peer is gone)
  const auto start = Clock::now();
  handle.close(100ms);
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_EQ(controls_.aborts(), 1);
  EXPECT_EQ(count(log(), "destroy"), 0u);
  EXPECT_TRUE(failed_pending);
}

TEST_F(NcclHandleTest, SplitWaitsForTheChildAndNoColorGetsNone) {
  NcclHandle parent(*api_, "world");
  init(parent);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  NcclHandle child(*api_, "dp");
  controls_.script(4, ncclSuccess);
  ASSERT_TRUE(parent.split("split", 0, 0, &config, child, Clock::now() + 10s).ok());
  EXPECT_TRUE(child.open());
  controls_.script(2, ncclSuccess);
  ASSERT_TRUE(all_reduce(child).ok());
  NcclHandle none(*api_, "none");
  ASSERT_TRUE(parent.split("split", NCCL_SPLIT_NOCOLOR, 0, &config, none, Clock::now() + 10s).ok());
  EXPECT_FALSE(none.open());
  child.close(1s);
  parent.close(1s);
}

TEST_F(NcclHandleTest, DestroyingAnOpenHandleAbortsIt) {
  {
    NcclHandle handle(*api_, "world");
    init(handle);
  }
  EXPECT_EQ(controls_.aborts(), 1);
}

}  // namespace
}  // namespace hps::nccl_backend
