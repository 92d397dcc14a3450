#include "dpbalance/acceptance.h"

#include <cmath>
#include <random>
#include <vector>

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

namespace dpbalance {
namespace {

double Logit(double p) { return std::log(p / (1 - p)); }

// A stream like the replay's: `concurrent` requests at a time, each with a shift drawn from
// N(0, sigma) over the MTP profile, verifying `verify_len` drafts for `steps` steps; feeds `est`
// and returns the mean log-likelihood of each request-step's outcome under est's curve before
// it is seen (higher is better).
double FeedShiftedStream(AcceptanceEstimator& est, double sigma, int num_requests, uint64_t seed,
                         int verify_len = 7, int steps = 40, int concurrent = 16) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> shift(0, sigma);
  std::uniform_real_distribution<double> u(0, 1);
  const auto profile = MtpK8ConditionalProfile();
  struct Live {
    int64_t id;
    std::array<double, kMaxDraftLen> rates;
    int steps_left;
  };
  std::vector<Live> live;
  double loglik = 0;
  int64_t n = 0, next_id = 0;
  while (next_id < num_requests || !live.empty()) {
    while (static_cast<int>(live.size()) < concurrent && next_id < num_requests) {
      live.push_back({next_id++, ShiftedProfile(profile, shift(rng)), steps});
    }
    for (Live& r : live) {
      const AcceptanceCurve c = est.Curve(r.id);
      int accepted = 0;
      while (accepted < verify_len && u(rng) < r.rates[accepted]) ++accepted;
      // P(exactly `accepted` of verify_len) from the curve's survivals.
      const double p_reach = accepted == 0 ? 1.0 : c.Accept(accepted);
      const double p = accepted == verify_len ? p_reach : p_reach - c.Accept(accepted + 1);
      loglik += std::log(std::max(p, 1e-12));
      ++n;
      EXPECT_TRUE(est.Observe(r.id, verify_len, accepted).ok());
      --r.steps_left;
    }
    for (size_t i = 0; i < live.size();) {
      if (live[i].steps_left > 0) {
        ++i;
        continue;
      }
      est.Forget(live[i].id);
      live[i] = live.back();
      live.pop_back();
    }
  }
  return loglik / static_cast<double>(n);
}

TEST(AcceptanceModel, ParsesItsNamesAndNamesWhatItRejects) {
  EXPECT_EQ(*ParseAcceptanceModel("beta"), AcceptanceModel::kBeta);
  EXPECT_EQ(*ParseAcceptanceModel("shift"), AcceptanceModel::kShift);
  EXPECT_EQ(AcceptanceModelName(AcceptanceModel::kShift), "shift");
  const absl::StatusOr<AcceptanceModel> bad = ParseAcceptanceModel("Shift ");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'Shift '"), std::string::npos) << bad.status();
}

// Brute force: the request's shift (read back from its curve) maximises its log posterior
// (Bernoulli terms over the pooled logits, N(0, tau^2) prior with the learnt tau^2) over a
// fine grid, for random counts.
TEST(AcceptanceEstimator, ShiftIsTheModeOfItsPosterior) {
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int> len(0, kMaxDraftLen);
  for (int trial = 0; trial < 30; ++trial) {
    AcceptanceEstimator est(4.0, MtpK8ConditionalProfile(), AcceptanceModel::kShift);
    // Background requests so that the pooled rates and tau^2 are not the initial ones.
    FeedShiftedStream(est, 1.5, 40, 100 + trial, 5, 10, 8);
    std::array<int, kMaxDraftLen> trials{}, successes{};
    const int num_obs = 1 + trial % 12;
    for (int o = 0; o < num_obs; ++o) {
      const int v = len(rng);
      std::uniform_int_distribution<int> acc(0, v);
      const int a = acc(rng);
      ASSERT_TRUE(est.Observe(7777, v, a).ok());
      for (int j = 0; j < v && j <= a; ++j) {
        ++trials[j];
        if (j < a) ++successes[j];
      }
    }
    const auto pooled = est.PooledRates();
    const double tau2 = est.shift_variance();
    const AcceptanceCurve c = est.Curve(7777);
    const double s = Logit(c.Accept(1)) - Logit(pooled[0]);
    auto log_post = [&](double x) {
      double l = -x * x / (2 * tau2);
      for (int j = 0; j < kMaxDraftLen; ++j) {
        const double p = 1 / (1 + std::exp(-(Logit(pooled[j]) + x)));
        l += successes[j] * std::log(p) + (trials[j] - successes[j]) * std::log(1 - p);
      }
      return l;
    };
    double best_x = 0, best = -1e300;
    for (double x = -15; x <= 15; x += 1e-3) {
      if (log_post(x) > best) best = log_post(x), best_x = x;
    }
    EXPECT_NEAR(s, best_x, 2e-3) << "trial " << trial << " tau2 " << tau2;
    EXPECT_GE(log_post(s), best - 1e-9);
    // Every position follows the one shift.
    double prev = 1;
    for (int j = 1; j <= kMaxDraftLen; ++j) {
      const double rate = c.Accept(j) / prev;
      EXPECT_NEAR(Logit(rate) - Logit(pooled[j - 1]), s, 1e-6) << "position " << j;
      prev = c.Accept(j);
    }
  }
}

// Empirical Bayes: the learnt width follows the width the requests' shifts were drawn with.
TEST(AcceptanceEstimator, ShiftLearnsTheWidthOfItsRequests) {
  double last = 0;
  for (double sigma : {0.3, 1.0, 2.0}) {
    AcceptanceEstimator est(4.0, MtpK8ConditionalProfile(), AcceptanceModel::kShift);
    FeedShiftedStream(est, sigma, 2000, 21);
    const double tau = std::sqrt(est.shift_variance());
    EXPECT_NEAR(tau, sigma, 0.25 * sigma + 0.1) << "sigma " << sigma;
    EXPECT_GT(tau, last) << "sigma " << sigma;
    last = tau;
  }
}

// Where requests do differ by a shift, predicting each outcome before it is seen, the shift
// model scores better than per-position Beta; where they do not (sigma 0), it is no worse than
// a small tolerance, since the learnt width shrinks toward 0.
TEST(AcceptanceEstimator, ShiftPredictsShiftedRequestsBetterThanBeta) {
  for (double sigma : {0.0, 1.0, 2.0}) {
    AcceptanceEstimator beta(4.0, MtpK8ConditionalProfile(), AcceptanceModel::kBeta);
    AcceptanceEstimator shift(4.0, MtpK8ConditionalProfile(), AcceptanceModel::kShift);
    const double l_beta = FeedShiftedStream(beta, sigma, 600, 31);
    const double l_shift = FeedShiftedStream(shift, sigma, 600, 31);
    if (sigma == 0) {
      EXPECT_GT(l_shift, l_beta - 0.01);
    } else {
      EXPECT_GT(l_shift, l_beta + 0.01) << "sigma " << sigma;
    }
  }
}

}  // namespace
}  // namespace dpbalance
