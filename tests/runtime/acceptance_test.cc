#include "dpbalance/acceptance.h"

#include <random>

#include "gtest/gtest.h"

namespace dpbalance {
namespace {

TEST(AcceptanceCurve, MtpProfileReproducesPublishedMeanLength) {
  const auto a = MtpK8ConditionalProfile();
  const AcceptanceCurve c = *AcceptanceCurve::FromConditional(a);
  EXPECT_NEAR(c.ExpectedTokens(8), 4.497, 1e-9);  // published mean accepted length 4.50
  EXPECT_NEAR(c.Accept(1), 0.762, 1e-12);
  EXPECT_NEAR(c.Accept(8), 0.237, 1e-12);
}

TEST(AcceptanceCurve, ConcaveAndNonDecreasingForRandomRates) {
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<double> u(0, 1);
  for (int t = 0; t < 500; ++t) {
    std::array<double, kMaxDraftLen> a;
    for (double& x : a) x = u(rng);
    const AcceptanceCurve c = *AcceptanceCurve::FromConditional(a);
    for (int k = 1; k <= kMaxDraftLen; ++k) {
      const double d1 = c.ExpectedTokens(k) - c.ExpectedTokens(k - 1);
      EXPECT_GE(d1, 0);
      if (k >= 2) {
        EXPECT_LE(d1, c.ExpectedTokens(k - 1) - c.ExpectedTokens(k - 2) + 1e-15);
      }
    }
  }
}

TEST(AcceptanceCurve, RejectsBadRates) {
  const double nan_rates[] = {0.5, std::nan("")};
  absl::StatusOr<AcceptanceCurve> c = AcceptanceCurve::FromConditional(nan_rates);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("position 2"), std::string::npos);
  const float conf[] = {1.5f};
  EXPECT_FALSE(AcceptanceCurve::FromConfidences(conf).ok());
}

TEST(AcceptanceEstimator, ConvergesToTrueRatesAndStartsAtPooledPrior) {
  std::mt19937_64 rng(5);
  const double truth[] = {0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.5, 0.5};
  AcceptanceEstimator est(4.0, MtpK8ConditionalProfile());
  std::uniform_real_distribution<double> u(0, 1);
  for (int step = 0; step < 3000; ++step) {
    int accepted = 0;
    while (accepted < 4 && u(rng) < truth[accepted]) ++accepted;
    ASSERT_TRUE(est.Observe(42, 4, accepted).ok());
  }
  const AcceptanceCurve c = est.Curve(42);
  EXPECT_NEAR(c.Accept(1), 0.9, 0.03);
  EXPECT_NEAR(c.Accept(2), 0.9 * 0.8, 0.03);
  EXPECT_NEAR(c.Accept(4), 0.9 * 0.8 * 0.7 * 0.6, 0.03);
  // A request never seen starts from the pooled estimate, which has learnt from request 42.
  EXPECT_NEAR(est.Curve(7).Accept(1), 0.9, 0.03);
  est.Forget(42);
  EXPECT_EQ(est.num_tracked(), 0u);
}

TEST(AcceptanceEstimator, RejectsImpossibleCounts) {
  AcceptanceEstimator est(4.0, MtpK8ConditionalProfile());
  absl::Status s = est.Observe(3, 2, 3);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("accepted=3"), std::string::npos);
  EXPECT_FALSE(est.Observe(3, 9, 0).ok());
}

}  // namespace
}  // namespace dpbalance

namespace dpbalance {
namespace {

TEST(ShiftedProfile, ZeroShiftIsTheProfileAndShiftsAreMonotone) {
  const auto p = MtpK8ConditionalProfile();
  const auto same = ShiftedProfile(p, 0.0);
  for (int j = 0; j < kMaxDraftLen; ++j) EXPECT_NEAR(same[j], p[j], 1e-12);
  const auto up = ShiftedProfile(p, 1.0), down = ShiftedProfile(p, -1.0);
  for (int j = 0; j < kMaxDraftLen; ++j) {
    EXPECT_GT(up[j], p[j]);
    EXPECT_LT(down[j], p[j]);
    EXPECT_GT(down[j], 0.0);
    EXPECT_LT(up[j], 1.0);
  }
}

}  // namespace
}  // namespace dpbalance
