#include "dpbalance/tpot_slo.h"

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dpbalance {
namespace {

// Conditional rates a_1..a_n as a curve.
AcceptanceCurve Curve(std::vector<double> rates) { return *AcceptanceCurve::FromConditional(rates); }

TEST(TpotSlo, OffForZeroNegativeOrNonFiniteSlo) {
  for (double slo : {0.0, -5.0, std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity()}) {
    TpotSlo t(slo);
    EXPECT_FALSE(t.enabled()) << slo;
    ASSERT_TRUE(t.Observe(1, 60000, 1).ok());
    EXPECT_EQ(t.Floor(1, 3, AcceptanceCurve()), 0);
    EXPECT_EQ(t.num_tracked(), 0u);
  }
}

TEST(TpotSlo, WorkedCase) {
  TpotSlo t(50000);  // 50 ms
  // Expected tokens at k = 0, 1, 2: 1, 1.5, 1.75.
  const AcceptanceCurve half = Curve({0.5, 0.5}), never;
  EXPECT_EQ(t.Floor(7, 2, half), 0);  // nothing seen yet: no step time to judge by
  ASSERT_TRUE(t.Observe(7, 60000, 1).ok());
  // 60 ms for 1 token, the next step 60 ms too: it needs 120 / 50 - 1 = 1.4 tokens, which
  // k = 1 brings (1.5).
  EXPECT_EQ(t.Floor(7, 2, half), 1);
  // Drafts that are never accepted bring nothing: the SLO is out of reach even at the default,
  // and the bare token keeps the default's pace (longer verifies only lengthen the step).
  EXPECT_EQ(t.Floor(7, 2, never), 0);
  // Out of reach with drafts that are accepted (a 500 ms stall: 10 tokens needed): the
  // default's pace (1.75 tokens) needs k = 2; rarely accepted (1.05, then 1.0525 expected),
  // k = 1 is within 2% of it.
  TpotSlo stalled(50000);
  ASSERT_TRUE(stalled.Observe(9, 500000, 1).ok());
  EXPECT_EQ(stalled.Floor(9, 2, half), 2);
  EXPECT_EQ(stalled.Floor(9, 2, Curve({0.05, 0.05})), 1);
  EXPECT_EQ(stalled.Floor(9, 2, never), 0);
  // A new request is judged by the step time alone: it needs 60 / 50 = 1.2 tokens.
  EXPECT_EQ(t.Floor(8, 2, half), 1);
  ASSERT_TRUE(t.Observe(7, 60000, 3).ok());
  // 120 ms for 4 tokens; a bare token: 180 ms / 5 = 36 ms <= 50 ms, so it may be shortened.
  EXPECT_EQ(t.Floor(7, 2, never), 0);
  EXPECT_EQ(t.Floor(7, 0, half), 0);  // a default length of 0 is no floor
  EXPECT_EQ(t.num_tracked(), 1u);
  t.Forget(7);
  EXPECT_EQ(t.num_tracked(), 0u);
  EXPECT_EQ(t.Floor(7, 2, half), 1);  // forgotten: judged as new again
}

TEST(TpotSlo, BadObservationsAreErrorsNamingTheValueAndRecordNothing) {
  TpotSlo t(50000);
  const absl::Status zero = t.Observe(3, 0, 1);
  EXPECT_FALSE(zero.ok());
  EXPECT_NE(zero.message().find("request 3"), std::string::npos) << zero;
  EXPECT_NE(zero.message().find("step time 0"), std::string::npos) << zero;
  EXPECT_FALSE(t.Observe(3, std::numeric_limits<double>::quiet_NaN(), 1).ok());
  const absl::Status tokens = t.Observe(3, 1000, 0);
  EXPECT_FALSE(tokens.ok());
  EXPECT_NE(tokens.message().find("0 tokens"), std::string::npos) << tokens;
  EXPECT_EQ(t.num_tracked(), 0u);
  EXPECT_EQ(t.Floor(3, 1, AcceptanceCurve()), 0);  // no step time was recorded either
}

TEST(TpotSlo, FloorMatchesTheHistoryRecomputedFromScratch) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> step(20000, 90000), rate(0, 1);
  std::uniform_int_distribution<int> tokens(1, 4), id(0, 9), len(0, 4);
  TpotSlo t(40000);
  std::map<int64_t, std::vector<std::pair<double, int>>> history;
  double last = 0;
  for (int s = 0; s < 2000; ++s) {
    const int64_t r = id(rng);
    if (s % 97 == 0) {
      t.Forget(r);
      history.erase(r);
    }
    double decode = 0;
    int64_t emitted = 0;
    for (auto [us, n] : history[r]) {
      decode += us;
      emitted += n;
    }
    const AcceptanceCurve c = Curve({rate(rng), rate(rng), rate(rng), rate(rng)});
    const int32_t default_len = len(rng);
    // The shortest k <= default whose expected tokens keep (decode + last) / tokens <= SLO;
    // none: the shortest within 2% of the default's expected tokens.
    int32_t want = -1;
    for (int32_t k = default_len; k >= 0; --k) {
      if ((decode + last) <= 40000.0 * (emitted + c.ExpectedTokens(k))) want = k;
    }
    if (want < 0) {
      want = default_len;
      for (int32_t k = default_len; k >= 0; --k) {
        if (c.ExpectedTokens(k) >= 0.98 * c.ExpectedTokens(default_len)) want = k;
      }
    }
    ASSERT_EQ(t.Floor(r, default_len, c), want) << "step " << s << " request " << r;
    last = step(rng);
    const int n = tokens(rng);
    ASSERT_TRUE(t.Observe(r, last, n).ok());
    history[r].push_back({last, n});
  }
}

TEST(TpotSlo, ARequestWhoseDefaultMeetsTheSloNeverExceedsIt) {
  // Constant step time S. The request's first two drafts are always accepted and the third
  // never, so verifying k brings exactly 1 + min(k, 2) tokens (its expected tokens). At the
  // default length 2 its TPOT is S / 3 <= SLO. Given exactly its floor each step (the least
  // the planner may give), its TPOT stays <= SLO after every step, and it is given less than
  // the default on most steps (the floor is not "always the default").
  constexpr double kSlo = 50000, kStep = 80000;
  const AcceptanceCurve two = Curve({1, 1, 0});
  TpotSlo t(kSlo);
  double decode = 0;
  int64_t emitted = 0;
  int below_default = 0;
  ASSERT_TRUE(t.Observe(99, kStep, 1).ok());  // another request sets the step time
  for (int s = 0; s < 500; ++s) {
    const int32_t k = t.Floor(1, 2, two);
    const int n = 1 + std::min(k, 2);
    below_default += k < 2;
    ASSERT_TRUE(t.Observe(1, kStep, n).ok());
    decode += kStep;
    emitted += n;
    ASSERT_LE(decode / emitted, kSlo + 1e-9) << "step " << s;
  }
  EXPECT_GT(below_default, 250);
}

}  // namespace
}  // namespace dpbalance
