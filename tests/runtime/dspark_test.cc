#include "dpbalance/dspark.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dpbalance::dspark {
namespace {

TEST(SpsTable, IsAFloorStepFunctionClampedAtBothEnds) {
  const SpsTable t = *SpsTable::Create({8, 16, 64}, {50.0, 40.0, 10.0});
  EXPECT_EQ(t.StepsPerSecond(1), 50.0);    // below the first probe: the first value
  EXPECT_EQ(t.StepsPerSecond(8), 50.0);
  EXPECT_EQ(t.StepsPerSecond(15), 50.0);   // between probes: the lower probe's
  EXPECT_EQ(t.StepsPerSecond(16), 40.0);
  EXPECT_EQ(t.StepsPerSecond(63), 40.0);
  EXPECT_EQ(t.StepsPerSecond(64), 10.0);
  EXPECT_EQ(t.StepsPerSecond(1000), 10.0);  // past the last: the last value
}

TEST(SpsTable, BadTablesAreErrorsNamingTheValue) {
  absl::StatusOr<SpsTable> t = SpsTable::Create({8, 8}, {1.0, 1.0});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("probe 1 has 8 tokens"), std::string::npos) << t.status();
  t = SpsTable::Create({8}, {0.0});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("0 steps/s"), std::string::npos) << t.status();
  EXPECT_FALSE(SpsTable::Create({}, {}).ok());
  EXPECT_FALSE(SpsTable::Create({8, 16}, {1.0}).ok());
}

TEST(ProfilerBatchSizes, AreTheProfilersSweepCutAtTheCap) {
  EXPECT_EQ(ProfilerBatchSizes(64), (std::vector<int32_t>{1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64}));
  EXPECT_EQ(ProfilerBatchSizes(50), (std::vector<int32_t>{1, 2, 4, 8, 16, 24, 32, 40, 48, 50}));
  EXPECT_EQ(ProfilerBatchSizes(256).size(), 19u);
}

// A random rank: per-request survivals (falling along positions) and caps.
struct RandomRank {
  std::vector<std::vector<double>> survival;  // [req][pos - 1]
  std::vector<int32_t> caps;
};
RandomRank MakeRank(std::mt19937_64& rng, int n) {
  std::uniform_real_distribution<double> u(0, 1);
  RandomRank r;
  for (int i = 0; i < n; ++i) {
    const int cap = static_cast<int>(rng() % 8);
    std::vector<double> s;
    double p = 1;
    for (int j = 0; j < cap; ++j) {
      p *= u(rng) < 0.1 ? 1.0 : u(rng);  // some positions never fail (ties)
      s.push_back(u(rng) < 0.05 ? 0.0 : p);
      p = s.back();
    }
    r.survival.push_back(s);
    r.caps.push_back(cap);
  }
  return r;
}

// The allocator's order, then the budget and the allocation, against brute force on random ranks:
// the budget is the first b maximising (n + best b survivals) x SPS(n + b); the allocation takes
// exactly the first `budget` candidates, a prefix of each request.
TEST(Dspark, BudgetAndAllocationEqualBruteForce) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 12);
    const RandomRank rank = MakeRank(rng, n);
    std::vector<Candidate> cands;
    OrderCandidates(rank.caps, [&](int32_t i, int32_t j) { return rank.survival[i][j - 1]; }, cands);
    // Every position at or above the epsilon, up to the first below it, is a candidate.
    std::vector<double> all;
    for (int i = 0; i < n; ++i) {
      for (double s : rank.survival[i]) {
        if (s < kSurvivalEps) break;
        all.push_back(s);
      }
    }
    ASSERT_EQ(all.size(), cands.size());
    for (size_t c = 1; c < cands.size(); ++c) {
      const Candidate& a = cands[c - 1];
      const Candidate& b = cands[c];
      ASSERT_TRUE(a.survival > b.survival || (a.survival == b.survival && (a.pos < b.pos || (a.pos == b.pos && a.req < b.req))));
    }
    // A random falling SPS table.
    std::vector<int64_t> probes;
    std::vector<double> rates;
    double rate = 100;
    for (int64_t t = 1 + rng() % 4; t < 200; t += 1 + rng() % 20) {
      probes.push_back(t);
      rate *= 0.7 + 0.3 * std::uniform_real_distribution<double>(0, 1)(rng);
      rates.push_back(rate);
    }
    const SpsTable sps = *SpsTable::Create(probes, rates);
    std::sort(all.begin(), all.end(), std::greater<>());
    double best = -1;
    int64_t want = -1;
    for (size_t b = 0; b <= all.size(); ++b) {
      const double theta = (n + std::accumulate(all.begin(), all.begin() + b, 0.0)) * sps.StepsPerSecond(n + b);
      if (theta > best) {
        best = theta;
        want = static_cast<int64_t>(b);
      }
    }
    const int64_t budget = SpsBudget(n, cands, sps);
    ASSERT_EQ(budget, want) << trial;
    std::vector<int32_t> lens(n, -1);
    AssignTopK(cands, budget, absl::MakeSpan(lens));
    int64_t taken = 0;
    for (int i = 0; i < n; ++i) {
      ASSERT_GE(lens[i], 0);
      ASSERT_LE(lens[i], rank.caps[i]);
      taken += lens[i];
      // A prefix: every position up to the length is among the first `budget` candidates.
      for (int j = 1; j <= lens[i]; ++j) {
        const auto it = std::find_if(cands.begin(), cands.begin() + budget,
                                     [&](const Candidate& c) { return c.req == i && c.pos == j; });
        ASSERT_NE(it, cands.begin() + budget) << trial << " req " << i << " pos " << j;
      }
    }
    ASSERT_EQ(taken, budget);
  }
}

TEST(Dspark, TiesGoToTheSmallestBudget) {
  // Constant SPS: a zero-survival candidate is never there (below eps); survival-1 positions
  // always pay; with a rate that halves at the first extra token, b = 0 ties b = 2 exactly.
  const std::vector<Candidate> cands = {{1.0, 0, 1}, {1.0, 1, 1}};
  const SpsTable halves = *SpsTable::Create({2, 3}, {1.0, 0.5});
  EXPECT_EQ(SpsBudget(2, cands, halves), 0);  // 2 x 1 = (2 + 2) x 0.5: the first maximum
}

TEST(Dspark, TierAndFillFollowSglang) {
  const std::vector<int32_t> tiers = {8, 16, 24, 32, 48, 64};
  EXPECT_EQ(LocalTier(4, 3, 8), 7);
  EXPECT_EQ(LocalTier(4, 40, 8), 32);  // capped at n x W
  EXPECT_EQ(LocalTier(0, 0, 8), 0);
  // The largest local tier, capped at the largest batch x W, rounded up to the grid.
  EXPECT_EQ(AgreedTier(tiers, 17, 4, 8), 24);
  EXPECT_EQ(AgreedTier(tiers, 40, 4, 8), 32);  // 4 requests x 8 caps 40
  EXPECT_EQ(AgreedTier(tiers, 70, 10, 8), 70);  // past the last tier: the count itself
  // Every rank fills to the tier, at most its own full window.
  EXPECT_EQ(FillBudget(24, 4, 8), 20);
  EXPECT_EQ(FillBudget(24, 2, 8), 14);  // 2 x 8 = 16 tokens at most
  EXPECT_EQ(FillBudget(24, 0, 8), 0);
}

TEST(PadToTier, FreeSlotsGetDummyRowsOfAtMostTheWindow) {
  // Tier 24 with 64 slots, 3 requests running 10 tokens: 14 spare over 21 free slots.
  Padding p = PadToTier(24, 3, 10, 64, 8);
  EXPECT_EQ(p.last_row_tokens, 0);
  EXPECT_EQ(p.run_tokens(), 14);
  EXPECT_EQ(p.pad_tokens.size(), 14u);  // one token each, empty slots not listed
  // Few free slots: spread evenly, the first ones one more, each at most W; the rest is not run.
  p = PadToTier(64, 60, 60, 62, 8);
  ASSERT_EQ(p.pad_tokens.size(), 2u);
  EXPECT_EQ(p.pad_tokens[0], 2);
  EXPECT_EQ(p.pad_tokens[1], 2);
  p = PadToTier(512, 60, 100, 62, 8);  // 412 spare over 2 slots of at most 8
  EXPECT_EQ(p.run_tokens(), 16);
  // No free slot: everything on the last real request.
  p = PadToTier(64, 64, 60, 64, 8);
  EXPECT_TRUE(p.pad_tokens.empty());
  EXPECT_EQ(p.last_row_tokens, 4);
  // An idle rank runs the whole tier on dummy slots; a rank at the tier runs nothing more.
  p = PadToTier(16, 0, 0, 64, 8);
  EXPECT_EQ(p.run_tokens(), 16);
  EXPECT_EQ(PadToTier(16, 2, 16, 64, 8).run_tokens(), 0);
}

}  // namespace
}  // namespace dpbalance::dspark
