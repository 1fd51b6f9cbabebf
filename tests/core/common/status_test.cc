#include "core/common/status.h"

#include <gtest/gtest.h>

#include <memory>

namespace hps {
namespace {

StatusOr<int> parse_positive(int x) {
  if (x <= 0) return invalid_argument("not positive: " + std::to_string(x));
  return x;
}

Status add_positive(int a, int b, int* out) {
  HPS_ASSIGN_OR_RETURN(int pa, parse_positive(a));
  HPS_ASSIGN_OR_RETURN(int pb, parse_positive(b));
  *out = pa + pb;
  return Status::Ok();
}

Status forward(Status s) {
  HPS_RETURN_IF_ERROR(s);
  return internal_error("reached the end");
}

TEST(Status, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.to_string(), "ok");
}

TEST(Status, CarriesCodeAndMessage) {
  Status s = timeout_error("all_reduce on group dp seq 7");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kTimeout);
  EXPECT_EQ(s.to_string(), "timeout: all_reduce on group dp seq 7");
  EXPECT_EQ(s.with_context("step").message(), "step: all_reduce on group dp seq 7");
  EXPECT_TRUE(Status::Ok().with_context("x").ok());
}

TEST(Status, CodeNamesAreDistinct) {
  for (int a = 0; a <= 12; ++a) {
    for (int b = a + 1; b <= 12; ++b) {
      EXPECT_NE(status_code_name(static_cast<StatusCode>(a)),
                status_code_name(static_cast<StatusCode>(b)));
    }
  }
  EXPECT_EQ(status_code_name(static_cast<StatusCode>(99)), "unknown status");
}

TEST(StatusOr, ValueAndError) {
  int out = 0;
  EXPECT_TRUE(add_positive(2, 3, &out).ok());
  EXPECT_EQ(out, 5);
  Status s = add_positive(2, -1, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "not positive: -1");
  EXPECT_EQ(out, 5) << "a failing call must not change its output";
  EXPECT_EQ(forward(aborted("peer died")).code(), StatusCode::kAborted);
  EXPECT_EQ(forward(Status::Ok()).code(), StatusCode::kInternal);
}

TEST(StatusOr, MoveOnlyValue) {
  StatusOr<std::unique_ptr<int>> p = std::make_unique<int>(4);
  ASSERT_TRUE(p.ok());
  std::unique_ptr<int> owned = std::move(p).value();
  EXPECT_EQ(*owned, 4);
}

TEST(StatusOr, OkStatusWithoutValueIsAnInternalError) {
  StatusOr<int> bad = Status::Ok();
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace hps
