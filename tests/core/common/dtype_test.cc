#include "core/common/dtype.h"

#include <gtest/gtest.h>

namespace hps {
namespace {

TEST(DType, SizesAndNames) {
  struct Expect {
    DType d;
    size_t size;
    const char* name;
  };
  const Expect expected[] = {{DType::kFloat32, 4, "float32"}, {DType::kFloat64, 8, "float64"},
                             {DType::kFloat16, 2, "float16"}, {DType::kBFloat16, 2, "bfloat16"},
                             {DType::kInt32, 4, "int32"},     {DType::kInt64, 8, "int64"},
                             {DType::kUInt8, 1, "uint8"}};
  ASSERT_EQ(std::size(expected), std::size(kAllDTypes));
  for (const auto& e : expected) {
    EXPECT_EQ(dtype_size(e.d), e.size);
    EXPECT_EQ(dtype_name(e.d), e.name);
    auto by_name = dtype_from_name(e.name);
    ASSERT_TRUE(by_name.ok());
    EXPECT_EQ(*by_name, e.d);
    auto by_int = dtype_from_int(static_cast<int32_t>(e.d));
    ASSERT_TRUE(by_int.ok());
    EXPECT_EQ(*by_int, e.d);
  }
}

TEST(DType, Aliases) {
  EXPECT_EQ(*dtype_from_name("bf16"), DType::kBFloat16);
  EXPECT_EQ(*dtype_from_name("fp16"), DType::kFloat16);
  EXPECT_EQ(*dtype_from_name("fp32"), DType::kFloat32);
}

TEST(DType, UnknownValuesAreErrors) {
  for (int32_t raw : {-1, 7, 99, 0x7FFFFFFF}) {
    auto d = dtype_from_int(raw);
    EXPECT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find(std::to_string(raw)), std::string::npos);
  }
  EXPECT_EQ(dtype_from_name("float8").status().code(), StatusCode::kInvalidArgument);
}

TEST(DType, Floating) {
  EXPECT_TRUE(dtype_is_floating(DType::kBFloat16));
  EXPECT_FALSE(dtype_is_floating(DType::kInt64));
}

}  // namespace
}  // namespace hps
