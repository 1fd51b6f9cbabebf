// Optimizer kernels against straightforward scalar references written here (the update
// rules of torch.optim.SGD and torch.optim.AdamW), with and without a folded clip.
#include "core/kernels/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace hps {
namespace {

std::vector<float> ramp(size_t n, float a, float b) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = a + b * std::sin(static_cast<float>(i) * 0.7f);
  return v;
}

TEST(SgdKernel, MatchesTheReferenceWithMomentumDecayAndClip) {
  const size_t n = 1031;
  for (bool nesterov : {false, true}) {
    SgdHyper h{0.1f, 0.9f, 0.01f, nesterov};
    auto p = ramp(n, 0.5f, 1.0f), g = ramp(n, 0.0f, 2.0f), buf(std::vector<float>(n, 0.0f));
    auto rp = p, rbuf = buf;
    const float coef = 0.25f;
    for (int step = 0; step < 3; ++step) {
      cpu::sgd(p.data(), g.data(), buf.data(), n, h, &coef, 2.0f, step == 0);
      for (size_t i = 0; i < n; ++i) {
        const float gi = g[i] * coef * 2.0f + h.weight_decay * rp[i];
        rbuf[i] = step == 0 ? gi : h.momentum * rbuf[i] + gi;
        rp[i] -= h.learning_rate * (nesterov ? gi + h.momentum * rbuf[i] : rbuf[i]);
      }
    }
    for (size_t i = 0; i < n; ++i) ASSERT_NEAR(p[i], rp[i], 1e-5f * (1 + std::fabs(rp[i])));
  }
}

TEST(SgdKernel, PlainSgdLeavesTheMomentumBufferAlone) {
  std::vector<float> p = {1.0f, 2.0f}, g = {0.5f, -0.5f};
  SgdHyper h{0.1f, 0.0f, 0.0f, false};
  cpu::sgd(p.data(), g.data(), nullptr, 2, h, nullptr, 1.0f, true);
  EXPECT_FLOAT_EQ(p[0], 0.95f);
  EXPECT_FLOAT_EQ(p[1], 2.05f);
}

TEST(AdamWKernel, MatchesTheReference) {
  const size_t n = 777;
  AdamWHyper h{1e-2f, 0.9f, 0.99f, 1e-8f, 0.1f};
  auto p = ramp(n, 0.1f, 1.0f), g = ramp(n, 0.0f, 3.0f);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  auto rp = p, rm = m, rv = v;
  const float coef = 0.5f;
  for (long step = 1; step <= 4; ++step) {
    cpu::adamw(p.data(), g.data(), m.data(), v.data(), n, h, step, &coef, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      const double gi = g[i] * coef;
      rm[i] = static_cast<float>(h.beta1 * rm[i] + (1 - h.beta1) * gi);
      rv[i] = static_cast<float>(h.beta2 * rv[i] + (1 - h.beta2) * gi * gi);
      const double mhat = rm[i] / (1 - std::pow(h.beta1, step));
      const double vhat = rv[i] / (1 - std::pow(h.beta2, step));
      rp[i] = static_cast<float>(rp[i] * (1 - h.learning_rate * h.weight_decay) -
                                 h.learning_rate * mhat / (std::sqrt(vhat) + h.epsilon));
    }
  }
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(p[i], rp[i], 1e-5f * (1 + std::fabs(rp[i]))) << i;
}

}  // namespace
}  // namespace hps
