#include "dpbalance/tpot_slo.h"

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dpbalance {
namespace {

TEST(TpotSlo, OffForZeroNegativeOrNonFiniteSlo) {
  for (double slo : {0.0, -5.0, std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity()}) {
    TpotSlo t(slo);
    EXPECT_FALSE(t.enabled()) << slo;
    ASSERT_TRUE(t.Observe(1, 60000, 1).ok());
    EXPECT_EQ(t.Floor(1, 3), 0);
    EXPECT_EQ(t.num_tracked(), 0u);
  }
}

TEST(TpotSlo, WorkedCase) {
  TpotSlo t(50000);  // 50 ms
  EXPECT_EQ(t.Floor(7, 2), 0);  // nothing seen yet: no step time to judge by
  ASSERT_TRUE(t.Observe(7, 60000, 1).ok());
  // 60 ms for 1 token; one more bare token at 60 ms: 120 ms / 2 > 50 ms.
  EXPECT_EQ(t.Floor(7, 2), 2);
  // A new request is judged by the step time alone: 60 ms for its first token > 50 ms.
  EXPECT_EQ(t.Floor(8, 2), 2);
  ASSERT_TRUE(t.Observe(7, 60000, 3).ok());
  // 120 ms for 4 tokens; a bare token: 180 ms / 5 = 36 ms <= 50 ms, so it may be shortened.
  EXPECT_EQ(t.Floor(7, 2), 0);
  EXPECT_EQ(t.Floor(7, 0), 0);  // a default length of 0 is no floor
  EXPECT_EQ(t.num_tracked(), 1u);
  t.Forget(7);
  EXPECT_EQ(t.num_tracked(), 0u);
  EXPECT_EQ(t.Floor(7, 2), 2);  // forgotten: judged as new again
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
  EXPECT_EQ(t.Floor(3, 1), 0);  // no step time was recorded either
}

TEST(TpotSlo, FloorMatchesTheHistoryRecomputedFromScratch) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> step(20000, 90000);
  std::uniform_int_distribution<int> tokens(1, 4), id(0, 9);
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
    const int32_t want = (decode + last > 40000.0 * (emitted + 1)) ? 3 : 0;
    ASSERT_EQ(t.Floor(r, 3), want) << "step " << s << " request " << r;
    last = step(rng);
    const int n = tokens(rng);
    ASSERT_TRUE(t.Observe(r, last, n).ok());
    history[r].push_back({last, n});
  }
}

TEST(TpotSlo, ARequestWhoseDefaultMeetsTheSloNeverExceedsIt) {
  // Constant step time S; at the default length the request emits g >= S / SLO tokens a step
  // (random), shortened it emits 1. Taking the floor whenever asked keeps its TPOT <= SLO after
  // every step, and it is still shortened on some steps (the floor is not "always").
  constexpr double kSlo = 50000, kStep = 80000;
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<int> g(2, 4);  // 80 / 2 = 40 ms <= 50 ms
  TpotSlo t(kSlo);
  double decode = 0;
  int64_t emitted = 0;
  int shortened = 0;
  ASSERT_TRUE(t.Observe(99, kStep, 1).ok());  // another request sets the step time
  for (int s = 0; s < 500; ++s) {
    const int n = t.Floor(1, 2) > 0 ? g(rng) : 1;
    shortened += n == 1;
    ASSERT_TRUE(t.Observe(1, kStep, n).ok());
    decode += kStep;
    emitted += n;
    ASSERT_LE(decode / emitted, kSlo + 1e-9) << "step " << s;
  }
  EXPECT_GT(shortened, 50);
}

}  // namespace
}  // namespace dpbalance
