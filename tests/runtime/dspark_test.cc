#include "dpbalance/dspark.h"

#include <algorithm>
#include <cmath>
#include <optional>
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

// SpsAdditiveCostTable.step_time read literally (dspark_sps_table.py at 692c5f7d:
// bias + _interp_clamped(bs) + _interp_clamped(bs + budget)), on hand-worked values.
TEST(AdditiveSpsTable, IsBiasPlusTwoClampedLinearInterpolations) {
  const AdditiveSpsTable t = *AdditiveSpsTable::Create(0.010, {1, 4, 8}, {0.0, 0.003, 0.005},
                                                       {0, 64, 128}, {0.0, 0.002, 0.010});
  EXPECT_DOUBLE_EQ(t.StepSeconds(1, 0), 0.010 + 0.0 + 0.002 * 1 / 64);
  EXPECT_DOUBLE_EQ(t.StepSeconds(2, 30), 0.010 + 0.001 + 0.001);        // alpha 1/3, theta 32/64
  EXPECT_DOUBLE_EQ(t.StepSeconds(6, 90), 0.010 + 0.004 + 0.002 + 0.008 * 32 / 64);
  EXPECT_DOUBLE_EQ(t.StepSeconds(20, 500), 0.010 + 0.005 + 0.010);      // past both: end values
  EXPECT_DOUBLE_EQ(t.StepSeconds(0, 0), 0.010);                        // below both: first values
  absl::StatusOr<AdditiveSpsTable> bad = AdditiveSpsTable::Create(0, {1}, {0.0}, {0}, {0.0});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bias_seconds = 0"), std::string::npos) << bad.status();
  bad = AdditiveSpsTable::Create(0.01, {1, 1}, {0.0, 0.0}, {0}, {0.0});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bs probe 1 is 1"), std::string::npos) << bad.status();
  EXPECT_FALSE(AdditiveSpsTable::Create(0.01, {1}, {0.0, 1.0}, {0}, {0.0}).ok());
}

// The budget on the additive table: the first b maximising (n + best b survivals) / T(n, b),
// by brute force over every b.
TEST(AdditiveSpsTable, BudgetEqualsBruteForce) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(0, 1);
  for (int trial = 0; trial < 200; ++trial) {
    const AdditiveSpsTable t = *AdditiveSpsTable::Create(
        0.005 + 0.01 * u(rng), {1, 8, 32}, {0.0, 0.004 * u(rng), 0.01 * u(rng)}, {0, 64, 256},
        {0.0, 0.003 * u(rng), 0.02 * u(rng)});
    const int n = 1 + static_cast<int>(rng() % 16);
    const RandomRank r = MakeRank(rng, n);
    std::vector<Candidate> cands;
    OrderCandidates(r.caps, [&](int32_t i, int32_t j) { return r.survival[i][j - 1]; }, cands);
    int64_t best_b = 0;
    double best = -1;
    for (size_t b = 0; b <= cands.size(); ++b) {
      double tau = n;
      for (size_t c = 0; c < b; ++c) tau += cands[c].survival;
      const double theta = tau / t.StepSeconds(n, static_cast<int64_t>(b));
      if (theta > best) best = theta, best_b = static_cast<int64_t>(b);
    }
    EXPECT_EQ(AdditiveBudget(n, cands, t), best_b) << "trial " << trial;
  }
}

// ols_resid_backfit read literally: numpy lstsq on [1 | onehot(bs)[1:] | onehot(mbin(M))[1:]],
// mbin = round(M / 64) x 64 with Python's ties to even. Brute force: the normal equations solved
// by Gaussian elimination on a full-rank design, and the bins worked by hand.
TEST(AdditiveSpsTable, FitIsTheProfilersLeastSquares) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<SpsCell> cells;
  for (int64_t bs : {1, 4, 16}) {
    for (int64_t m : {bs, bs + 40, bs + 100, bs + 200}) cells.push_back({bs, m, 0.01 + 0.01 * u(rng)});
  }
  const AdditiveSpsTable t = *FitAdditive(cells);
  // The levels: bs 1, 4, 16; bins of M (1, 41, 101, 201, 4, 44, 104, 204, 16, 56, 116, 216):
  // 0, 64, 128, 192 (216 / 64 = 3.4 rounds to 3).
  EXPECT_EQ(std::vector<int64_t>(t.bs_probes().begin(), t.bs_probes().end()),
            (std::vector<int64_t>{1, 4, 16}));
  EXPECT_EQ(std::vector<int64_t>(t.m_probes().begin(), t.m_probes().end()),
            (std::vector<int64_t>{0, 64, 128, 192}));
  auto bin = [&](int64_t m) {
    const std::vector<int64_t> levels = {0, 64, 128, 192};
    const double q = static_cast<double>(m) / 64;
    const double r = std::nearbyint(q);  // round half to even (the default rounding mode)
    return static_cast<size_t>(std::find(levels.begin(), levels.end(), static_cast<int64_t>(r) * 64) -
                               levels.begin());
  };
  // Normal equations X'X beta = X'y, 1 + 2 + 3 columns.
  const size_t k = 6;
  std::vector<std::vector<double>> a(k, std::vector<double>(k + 1, 0.0));
  for (const SpsCell& c : cells) {
    std::vector<double> x(k, 0.0);
    x[0] = 1;
    if (c.bs == 4) x[1] = 1;
    if (c.bs == 16) x[2] = 1;
    if (const size_t b = bin(c.m); b > 0) x[2 + b] = 1;
    for (size_t i = 0; i < k; ++i) {
      for (size_t j = 0; j < k; ++j) a[i][j] += x[i] * x[j];
      a[i][k] += x[i] * c.step_s;
    }
  }
  for (size_t col = 0; col < k; ++col) {  // Gauss-Jordan with partial pivoting
    size_t piv = col;
    for (size_t r = col; r < k; ++r) {
      if (std::abs(a[r][col]) > std::abs(a[piv][col])) piv = r;
    }
    std::swap(a[col], a[piv]);
    for (size_t r = 0; r < k; ++r) {
      if (r == col) continue;
      const double f = a[r][col] / a[col][col];
      for (size_t j = col; j <= k; ++j) a[r][j] -= f * a[col][j];
    }
  }
  std::vector<double> beta(k);
  for (size_t i = 0; i < k; ++i) beta[i] = a[i][k] / a[i][i];
  EXPECT_NEAR(t.bias_s(), beta[0], 1e-12);
  EXPECT_EQ(t.alpha_s()[0], 0.0);
  EXPECT_NEAR(t.alpha_s()[1], beta[1], 1e-12);
  EXPECT_NEAR(t.alpha_s()[2], beta[2], 1e-12);
  EXPECT_EQ(t.theta_s()[0], 0.0);
  for (size_t m = 1; m < 4; ++m) EXPECT_NEAR(t.theta_s()[m], beta[2 + m], 1e-12) << m;
  // Ties go to even: 32 -> 0, 96 -> 128, 160 -> 128.
  const AdditiveSpsTable ties = *FitAdditive(std::vector<SpsCell>{
      {1, 32, 0.01}, {1, 96, 0.02}, {2, 160, 0.02}, {2, 33, 0.011}});
  EXPECT_EQ(std::vector<int64_t>(ties.m_probes().begin(), ties.m_probes().end()),
            (std::vector<int64_t>{0, 64, 128}));
  EXPECT_FALSE(FitAdditive(std::vector<SpsCell>{{1, 1, 0.01}, {2, 2, 0.01}, {4, 4, 0.01}}).ok());
  absl::StatusOr<AdditiveSpsTable> negative = FitAdditive(std::vector<SpsCell>{
      {1, 1, 0.001}, {1, 200, 0.01}, {8, 8, 0.01}, {8, 200, 0.1}});  // bias -0.019
  ASSERT_FALSE(negative.ok());  // the fit's bias comes out negative: the profiler raises
  EXPECT_NE(negative.status().message().find("bias_seconds"), std::string::npos) << negative.status();
}

// OnlineSpsProfiler read literally (dspark_sps_online.py at 692c5f7d), re-derived here the slow
// way: per bin the last 128 samples, 1 / median where >= 32, the initial table's value
// elsewhere, then the non-increasing fit by repeated passes (merge the first violating pair of
// blocks until none is left) and the 0.999 step.
std::vector<double> BruteRebuild(const SpsTable& initial,
                                 const std::vector<std::vector<double>>& all_samples) {
  const size_t n = initial.tokens().size();
  std::vector<std::vector<double>> blocks;  // {mean, weight, bins}
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> last(all_samples[i].end() - std::min<size_t>(all_samples[i].size(), 128),
                             all_samples[i].end());
    double rate = initial.StepsPerSecond(initial.tokens()[i]);
    if (last.size() >= 32) {
      std::sort(last.begin(), last.end());
      const size_t m = last.size();
      rate = 1 / (m % 2 ? last[m / 2] : 0.5 * (last[m / 2 - 1] + last[m / 2]));
    }
    blocks.push_back({rate, static_cast<double>(std::max<size_t>(last.size(), 1)), 1});
  }
  for (bool merged = true; merged;) {
    merged = false;
    for (size_t i = 0; i + 1 < blocks.size(); ++i) {
      if (blocks[i + 1][0] > blocks[i][0]) {
        const double w = blocks[i][1] + blocks[i + 1][1];
        blocks[i] = {(blocks[i][0] * blocks[i][1] + blocks[i + 1][0] * blocks[i + 1][1]) / w, w,
                     blocks[i][2] + blocks[i + 1][2]};
        blocks.erase(blocks.begin() + static_cast<long>(i) + 1);
        merged = true;
        break;
      }
    }
  }
  std::vector<double> out;
  for (const auto& b : blocks) out.insert(out.end(), static_cast<size_t>(b[2]), b[0]);
  for (size_t i = 1; i < out.size(); ++i) out[i] = std::min(out[i], out[i - 1] * 0.999);
  return out;
}

TEST(OnlineSps, RebuildsEveryThousandStepsAsSglangDoes) {
  const SpsTable initial = *SpsTable::Create({8, 16, 32, 64, 128}, {90.0, 80.0, 60.0, 40.0, 20.0});
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> u(0, 1);
  for (int trial = 0; trial < 20; ++trial) {
    OnlineSps online(initial);
    std::vector<std::vector<double>> seen(5);
    for (int round = 0; round < 3; ++round) {
      for (int step = 0; step < 1000; ++step) {
        // Mostly the middle bins, rarely the ends (which stay below 32 samples); times that do
        // not fall with tokens everywhere (PAVA has work); a few intervals that are not steps.
        const int64_t tokens = u(rng) < 0.02 ? 4 + static_cast<int64_t>(rng() % 4)
                               : u(rng) < 0.01 ? 200 : 16 + static_cast<int64_t>(rng() % 48);
        const double dt = u(rng) < 0.01 ? 1.5 : 0.008 + 0.02 * u(rng) + 0.0002 * static_cast<double>(tokens);
        const std::optional<SpsTable> table = online.Observe(tokens, dt);
        if (dt <= 1.0) {
          const size_t bin = tokens < 16 ? 0 : tokens < 32 ? 1 : tokens < 64 ? 2 : tokens < 128 ? 3 : 4;
          seen[bin].push_back(dt);
        }
        ASSERT_EQ(table.has_value(), step == 999) << "trial " << trial << " step " << step;
        if (!table) continue;
        const std::vector<double> want = BruteRebuild(initial, seen);
        ASSERT_EQ(table->steps_per_s().size(), want.size());
        for (size_t i = 0; i < want.size(); ++i) {
          EXPECT_NEAR(table->steps_per_s()[i], want[i], 1e-9 * want[i]) << "trial " << trial << " bin " << i;
          if (i > 0) {
            EXPECT_LT(table->steps_per_s()[i], table->steps_per_s()[i - 1]);
          }
        }
      }
    }
    EXPECT_EQ(online.rebuilds(), 3);
  }
  // No bin with 32 samples (intervals over 1 s are not steps): no table, the current one stays.
  OnlineSps sparse(initial);
  for (int step = 0; step < 999; ++step) ASSERT_FALSE(sparse.Observe(8, step % 40 == 0 ? 0.01 : 2.0));
  EXPECT_FALSE(sparse.Observe(8, 0.01));
  EXPECT_EQ(sparse.rebuilds(), 0);
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
