#include "dpbalance/lag.h"

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dpbalance {
namespace {

AcceptanceCurve Curve(double shift) {
  return *AcceptanceCurve::FromConditional(ShiftedProfile(MtpK8ConditionalProfile(), shift));
}

TEST(Lag, NothingPendingIsTheStateSeen) {
  const AcceptanceCurve c = Curve(0.3);
  const PredictedRequest p = PredictRequest(1000, 50, {}, c, 7);
  EXPECT_EQ(p.ctx_tokens, 1000);
  EXPECT_EQ(p.k_cap, 7);
  EXPECT_EQ(p.alive, 1.0);
  EXPECT_EQ(p.pending_tokens, 0.0);
  for (int j = 1; j <= kMaxDraftLen; ++j) EXPECT_EQ(p.acceptance.Accept(j), c.Accept(j));
  EXPECT_EQ(PredictRequest(1000, 3, {}, c, 7).k_cap, 2);  // it can emit 3: at most 2 drafts pay
}

// Exact enumeration of every accept outcome of the pending steps, against PredictRequest on random
// small cases: the expected tokens, the probability it still runs, each position's worth.
TEST(Lag, EqualsEnumerationOfEveryOutcome) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const AcceptanceCurve c = Curve(std::normal_distribution<double>(0, 1.5)(rng));
    const int64_t remaining = 1 + static_cast<int64_t>(rng() % 14);
    std::vector<int32_t> pending(1 + rng() % 3);
    for (int32_t& k : pending) k = static_cast<int32_t>(rng() % 8);
    // Enumerate: (probability, tokens emitted so far), step by step.
    std::vector<std::pair<double, int64_t>> states = {{1.0, 0}};
    for (int32_t k : pending) {
      std::vector<std::pair<double, int64_t>> next;
      for (auto [p, e] : states) {
        if (e >= remaining) {
          next.push_back({p, e});
          continue;
        }
        for (int m = 0; m <= k; ++m) {
          const double at_least = m == 0 ? 1.0 : c.Accept(m);
          const double pm = m == k ? at_least : at_least - c.Accept(m + 1);
          next.push_back({p * pm, e + std::min<int64_t>(m + 1, remaining - e)});
        }
      }
      states = next;
    }
    double mean = 0, alive = 0;
    std::vector<double> can_emit(kMaxDraftLen + 1, 0.0);  // P(remaining - E >= j + 1)
    for (auto [p, e] : states) {
      mean += p * e;
      if (e < remaining) alive += p;
      for (int j = 1; j <= kMaxDraftLen; ++j) {
        if (remaining - e >= j + 1) can_emit[j] += p;
      }
    }
    const PredictedRequest got = PredictRequest(500, remaining, pending, c, 7);
    ASSERT_NEAR(got.pending_tokens, mean, 1e-9) << trial;
    ASSERT_NEAR(got.alive, alive, 1e-9) << trial;
    ASSERT_EQ(got.ctx_tokens, 500 + std::llround(mean));
    ASSERT_EQ(got.k_cap, std::clamp<int64_t>(remaining - static_cast<int64_t>(pending.size()) - 1, 0, 7));
    double prev = 1;
    for (int j = 1; j <= kMaxDraftLen; ++j) {
      const double want = std::min(c.Accept(j) * can_emit[j], prev);
      ASSERT_NEAR(got.acceptance.Accept(j), want, 1e-9) << trial << " position " << j;
      prev = want;
    }
  }
}

TEST(Lag, ARequestSureToHaveFinishedIsWorthNothing) {
  // It could emit 2 tokens and each pending step emits at least one.
  const PredictedRequest p = PredictRequest(100, 2, {3, 3}, Curve(0), 7);
  EXPECT_EQ(p.alive, 0.0);
  EXPECT_EQ(p.k_cap, 0);
  EXPECT_EQ(p.acceptance.Accept(1), 0.0);
  EXPECT_NEAR(p.pending_tokens, 2.0, 1e-12);
}

TEST(Lag, BadInputIsClamped) {
  const PredictedRequest p = PredictRequest(-5, -1, {-2, 99}, Curve(0), 7);
  EXPECT_EQ(p.ctx_tokens, 0);
  EXPECT_EQ(p.k_cap, 0);
  EXPECT_EQ(p.alive, 0.0);
}

// A context at the int64 limit (a fuzzer found it through the plugin) saturates instead of
// overflowing when the pending steps' tokens are added.
TEST(Lag, ContextAtTheLimitSaturates) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const PredictedRequest p = PredictRequest(kMax, 100, {7, 7}, Curve(0.3), 7);
  EXPECT_EQ(p.ctx_tokens, kMax);
  EXPECT_GT(p.pending_tokens, 0.0);
  const PredictedRequest near = PredictRequest(kMax - 1000, 100, {7}, Curve(0.3), 7);
  EXPECT_EQ(near.ctx_tokens, kMax - 1000 + static_cast<int64_t>(std::llround(near.pending_tokens)));
}

// The planner's request: each LagPredict bit takes its part from the prediction and leaves the
// others as seen; with nothing pending every bit gives the state seen.
TEST(Lag, LaggedPlanRequestTakesEachPartItsBitNames) {
  const AcceptanceCurve c = Curve(0.5);
  const std::vector<int32_t> pending = {3};
  const PredictedRequest pr = PredictRequest(2000, 4, pending, c, 7);
  ASSERT_GT(pr.ctx_tokens, 2000);
  ASSERT_EQ(pr.k_cap, 2);  // 4 it may emit, at least 1 in the pending step, 1 bonus: 2 drafts
  for (uint32_t bits = 0; bits <= kPredictAll; ++bits) {
    PredictedRequest got;
    const PlanRequest p = LaggedPlanRequest(2000, 4, pending, c, 7, bits, &got);
    EXPECT_EQ(p.ctx_tokens, bits & kPredictContext ? pr.ctx_tokens : 2000) << bits;
    EXPECT_EQ(p.k_cap, bits & kPredictCap ? 2 : 3) << bits;
    for (int j = 1; j <= kMaxDraftLen; ++j) {
      EXPECT_EQ(p.acceptance.Accept(j), bits & kPredictGain ? pr.acceptance.Accept(j) : c.Accept(j)) << bits;
    }
    EXPECT_EQ(p.k_min, 0);
    EXPECT_EQ(got.pending_tokens, pr.pending_tokens);
    const PlanRequest seen = LaggedPlanRequest(2000, 4, {}, c, 7, bits);
    EXPECT_EQ(seen.ctx_tokens, 2000);
    EXPECT_EQ(seen.k_cap, 3);
    for (int j = 1; j <= kMaxDraftLen; ++j) EXPECT_EQ(seen.acceptance.Accept(j), c.Accept(j));
  }
}

}  // namespace
}  // namespace dpbalance
