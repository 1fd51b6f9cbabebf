// fp16 / bf16 conversions: every one of the 65,536 bit patterns of each type, and the
// rounding of every midpoint between neighbours, against references computed here in
// double precision with a different algorithm.
#include "core/common/half.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace hps {
namespace {

// Decodes a binary16 pattern with ldexp: independent of the shift-based code under test.
double reference_half_value(uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  if (exponent == 0x1f) {
    return mantissa ? std::numeric_limits<double>::quiet_NaN()
                    : sign * std::numeric_limits<double>::infinity();
  }
  if (exponent == 0) return sign * std::ldexp(static_cast<double>(mantissa), -24);
  return sign * std::ldexp(static_cast<double>(1024 + mantissa), exponent - 25);
}

bool is_half_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
bool is_bf16_nan(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }

TEST(Half, DecodesAll65536Patterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = half_bits_to_float(h);
    const double ref = reference_half_value(h);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << i;
    } else {
      ASSERT_EQ(static_cast<double>(f), ref) << std::hex << i;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << "sign of zero " << std::hex << i;
    }
  }
}

TEST(Half, RoundTripsAll65536Patterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const uint16_t back = float_to_half_bits(half_bits_to_float(h));
    if (is_half_nan(h)) {
      ASSERT_TRUE(is_half_nan(back)) << std::hex << i;
      ASSERT_EQ(back & 0x8000, h & 0x8000);
      ASSERT_NE(back & 0x0200, 0) << "NaN comes back quiet";
    } else {
      ASSERT_EQ(back, h) << std::hex << i;
    }
  }
}

// For each pair of neighbouring finite halves (lo, hi) of one sign, the float exactly
// between them must round to the one with an even mantissa, and the floats just
// inside must round to the nearer one.
TEST(Half, RoundsEveryMidpointToNearestEven) {
  for (uint32_t sign : {0u, 0x8000u}) {
    for (uint32_t m = 0; m < 0x7c00; ++m) {
      const uint16_t lo = static_cast<uint16_t>(sign | m);
      const uint16_t hi = static_cast<uint16_t>(sign | (m + 1));  // 0x7c00 = Inf at the top
      const double a = reference_half_value(lo);
      const double b = m + 1 == 0x7c00 ? (sign ? -65536.0 : 65536.0) : reference_half_value(hi);
      const float mid = static_cast<float>((a + b) / 2);  // exact: 12 significant bits
      ASSERT_EQ(static_cast<double>(mid), (a + b) / 2);
      const uint16_t even = (lo & 1) == 0 ? lo : hi;
      ASSERT_EQ(float_to_half_bits(mid), even) << std::hex << m;
      const float toward_lo = std::nextafter(mid, static_cast<float>(a));
      const float toward_hi = std::nextafter(mid, static_cast<float>(b));
      ASSERT_EQ(float_to_half_bits(toward_lo), lo) << std::hex << m;
      ASSERT_EQ(float_to_half_bits(toward_hi), hi) << std::hex << m;
    }
  }
}

TEST(Half, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_half_bits(inf), 0x7c00);
  EXPECT_EQ(float_to_half_bits(-inf), 0xfc00);
  EXPECT_EQ(float_to_half_bits(1e10f), 0x7c00);
  EXPECT_EQ(float_to_half_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half_bits(65519.99f), 0x7bff);
  EXPECT_EQ(float_to_half_bits(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_half_bits(0x1p-24f), 0x0001);    // smallest subnormal
  EXPECT_EQ(float_to_half_bits(0x1p-25f), 0x0000);    // half-way to 0 → even (0)
  EXPECT_EQ(float_to_half_bits(0x1.8p-24f), 0x0002);  // 1.5 ulp → even (2)
  EXPECT_EQ(float_to_half_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_half_bits(1e-30f), 0x0000);
  EXPECT_TRUE(is_half_nan(float_to_half_bits(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(is_half_nan(float_to_half_bits(std::bit_cast<float>(0x7f800001u))))
      << "a NaN whose payload sits below fp16's mantissa must not become Inf";
  EXPECT_TRUE(is_half_nan(float_to_half_bits(std::bit_cast<float>(0xff800001u))));
}

TEST(BFloat16, RoundTripsAll65536Patterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t b = static_cast<uint16_t>(i);
    const float f = bf16_bits_to_float(b);
    ASSERT_EQ(std::bit_cast<uint32_t>(f), i << 16);
    const uint16_t back = float_to_bf16_bits(f);
    if (is_bf16_nan(b)) {
      ASSERT_TRUE(is_bf16_nan(back)) << std::hex << i;
      ASSERT_EQ(back & 0x8000, b & 0x8000);
    } else {
      ASSERT_EQ(back, b) << std::hex << i;
    }
  }
}

TEST(BFloat16, RoundsEveryMidpointToNearestEven) {
  for (uint32_t sign : {0u, 0x8000u}) {
    for (uint32_t m = 0; m < 0x7f80; ++m) {
      const uint16_t lo = static_cast<uint16_t>(sign | m);
      const uint16_t hi = static_cast<uint16_t>(sign | (m + 1));
      const double a = bf16_bits_to_float(lo);
      const double b = m + 1 == 0x7f80 ? (sign ? -0x1p128 : 0x1p128) : bf16_bits_to_float(hi);
      const double exact_mid = (a + b) / 2;
      if (std::fabs(exact_mid) > std::numeric_limits<float>::max()) {
        // Past FLT_MAX, there is no float midpoint; the largest float must go to Inf.
        EXPECT_EQ(float_to_bf16_bits(sign ? -std::numeric_limits<float>::max()
                                          : std::numeric_limits<float>::max()),
                  static_cast<uint16_t>(sign | 0x7f80));
        continue;
      }
      const float mid = static_cast<float>(exact_mid);
      ASSERT_EQ(static_cast<double>(mid), exact_mid);
      const uint16_t even = (lo & 1) == 0 ? lo : hi;
      ASSERT_EQ(float_to_bf16_bits(mid), even) << std::hex << m;
      ASSERT_EQ(float_to_bf16_bits(std::nextafter(mid, static_cast<float>(a))), lo)
          << std::hex << m;
      ASSERT_EQ(float_to_bf16_bits(std::nextafter(mid, static_cast<float>(b))), hi)
          << std::hex << m;
    }
  }
}

TEST(BFloat16, SpecialValues) {
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16_bits(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_TRUE(is_bf16_nan(float_to_bf16_bits(std::bit_cast<float>(0x7f800001u))))
      << "a NaN whose payload sits below bf16's mantissa must not become Inf";
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x00000001u)), 0x0000);  // tiny → 0
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x00008000u)), 0x0000);  // tie → even
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x00018000u)), 0x0002);  // tie → even
}

}  // namespace
}  // namespace hps
