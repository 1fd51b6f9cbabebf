#include "core/common/logging.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include "core/common/env.h"

namespace hps {
namespace {

TEST(Logging, ParsesNamesAndNumbers) {
  LogLevel level = LogLevel::kOff;
  EXPECT_TRUE(parse_log_level("debug", &level));
  EXPECT_EQ(level, LogLevel::kDebug);
  EXPECT_TRUE(parse_log_level("4", &level));
  EXPECT_EQ(level, LogLevel::kError);
  EXPECT_TRUE(parse_log_level("warning", &level));
  EXPECT_EQ(level, LogLevel::kWarn);
  EXPECT_FALSE(parse_log_level("loud", &level));
  EXPECT_EQ(level, LogLevel::kWarn) << "an unknown level leaves the output alone";
}

TEST(Logging, LevelFiltersLines) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kError);
  testing::internal::CaptureStderr();
  HPS_LOG(kInfo) << "hidden line";
  HPS_LOG(kError) << "shown line " << 42;
  const std::string err = testing::internal::GetCapturedStderr();
  set_log_level(saved);
  EXPECT_EQ(err.find("hidden line"), std::string::npos);
  EXPECT_NE(err.find("shown line 42"), std::string::npos);
  EXPECT_NE(err.find("[hpshard E "), std::string::npos);
  EXPECT_NE(err.find("logging_test.cc:"), std::string::npos);
}

TEST(Env, Integers) {
  ::setenv("HPS_TEST_ENV_INT", "123", 1);
  EXPECT_EQ(*env_int("HPS_TEST_ENV_INT", 7), 123);
  ::setenv("HPS_TEST_ENV_INT", "12x", 1);
  auto bad = env_int("HPS_TEST_ENV_INT", 7);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("HPS_TEST_ENV_INT"), std::string::npos);
  // A hostile value is shown cut and with its odd bytes escaped, not echoed whole.
  ::setenv("HPS_TEST_ENV_INT", (std::string("\x01\xff") + std::string(100000, '7') + "x").c_str(),
           1);
  bad = env_int("HPS_TEST_ENV_INT", 7);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_LT(bad.status().message().size(), 300u);
  EXPECT_NE(bad.status().message().find("'\\x01\\xff7777"), std::string::npos)
      << bad.status().message();
  EXPECT_NE(bad.status().message().find("... (100003 bytes)"), std::string::npos);
  EXPECT_EQ(shown_value("a\\b"), "a\\x5cb");
  // A path is shown whole, its control bytes escaped and backslashes doubled, UTF-8 kept.
  EXPECT_EQ(shown_path("/tmp/a\x1b[31m\nb\\c/\xc3\xa9" + std::string(300, 'x')),
            "/tmp/a\\x1b[31m\\x0ab\\\\c/\xc3\xa9" + std::string(300, 'x'));
  // Well-formed UTF-8 only: every lead byte's range, overlong forms, surrogates, past U+10FFFF,
  // cut sequences.
  for (const char* good : {"", "plain", "\xc2\x80", "\xdf\xbf", "\xe0\xa0\x80", "\xed\x9f\xbf",
                           "\xee\x80\x80", "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf"}) {
    EXPECT_TRUE(is_utf8(good)) << shown_value(good);
  }
  for (const char* broken : {"\x80", "\xc0\xaf", "\xc1\xbf", "\xc2", "\xc2\x41", "\xe0\x80\xaf",
                             "\xed\xa0\x80", "\xe1\x80", "\xf0\x80\x80\x80", "\xf4\x90\x80\x80",
                             "\xf5\x80\x80\x80", "\xff", "ok\xe2\x82"}) {
    EXPECT_FALSE(is_utf8(broken)) << shown_value(broken);
  }
  // A switch's refused value is shown escaped too (it was printed raw: a terminal escape
  // in the variable reached the terminal).
  ::setenv("HPS_TEST_ENV_INT", "\x1b[2J", 1);
  auto flag = env_flag("HPS_TEST_ENV_INT", false);
  ASSERT_FALSE(flag.ok());
  EXPECT_EQ(flag.status().message().find('\x1b'), std::string::npos) << flag.status().message();
  EXPECT_NE(flag.status().message().find("\\x1b[2J"), std::string::npos) << flag.status().message();
  ::unsetenv("HPS_TEST_ENV_INT");
  EXPECT_EQ(*env_int("HPS_TEST_ENV_INT", 7), 7);
  EXPECT_FALSE(env_string("HPS_TEST_ENV_INT").has_value());
}

}  // namespace
}  // namespace hps

namespace hps {
namespace {

// Run by ctest once without HPS_LOG_LEVEL and once with HPS_LOG_LEVEL=debug.
TEST(Logging, InitialLevelMatchesEnvironment) {
  LogLevel expected = LogLevel::kWarn;
  if (auto text = env_string("HPS_LOG_LEVEL")) {
    ASSERT_TRUE(parse_log_level(*text, &expected));
  }
  EXPECT_EQ(log_level(), expected);
}

}  // namespace
}  // namespace hps
