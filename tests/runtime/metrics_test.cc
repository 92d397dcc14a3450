#include "dpbalance/metrics.h"

#include <vector>

#include "gtest/gtest.h"

namespace dpbalance {
namespace {

// Expected values are worked by hand from the definition in metrics.h:
// step bubble 1 - mean/max, run bubble 1 - Σmean/Σmax, idle µs per rank-step Σ(max - mean)/steps.

TEST(BubbleMeter, EmptyMeterReportsNoBubble) {
  const BubbleMeter m;
  EXPECT_EQ(m.steps(), 0);
  EXPECT_EQ(m.last_fraction(), 0);
  EXPECT_EQ(m.last_idle_us(), 0);
  EXPECT_EQ(m.fraction(), 0);
  EXPECT_EQ(m.balance_efficiency(), 1);
  EXPECT_EQ(m.mean_step_fraction(), 0);
  EXPECT_EQ(m.mean_idle_us(), 0);
}

TEST(BubbleMeter, OneStepIsOneMinusMeanOverMax) {
  BubbleMeter m;
  // mean (100 + 60 + 80) / 3 = 80, max 100: the ranks idle 0, 40, 20 µs, 20 µs each on average.
  m.AddStep(std::vector<double>{100, 60, 80});
  EXPECT_EQ(m.steps(), 1);
  EXPECT_DOUBLE_EQ(m.last_fraction(), 0.2);
  EXPECT_DOUBLE_EQ(m.last_idle_us(), 20);
  EXPECT_DOUBLE_EQ(m.fraction(), 0.2);
  EXPECT_DOUBLE_EQ(m.balance_efficiency(), 0.8);
  EXPECT_DOUBLE_EQ(m.mean_step_fraction(), 0.2);
  EXPECT_DOUBLE_EQ(m.mean_idle_us(), 20);
}

TEST(BubbleMeter, MeanAndMaxOverloadMatchesTheRanks) {
  BubbleMeter m;
  m.AddStepMeanMax(80.0, 100.0);
  EXPECT_EQ(m.steps(), 1);
  EXPECT_DOUBLE_EQ(m.last_fraction(), 0.2);
  EXPECT_DOUBLE_EQ(m.last_idle_us(), 20);
}

TEST(BubbleMeter, RunIsARatioOfSumsNotAMeanOfSteps) {
  BubbleMeter m;
  // A short step with a large bubble: mean 5, max 10 -> 0.5, idle 5 µs.
  m.AddStep(std::vector<double>{10, 0});
  // A long step with none: mean 1000, max 1000 -> 0, idle 0 µs.
  m.AddStep(std::vector<double>{1000, 1000});
  EXPECT_EQ(m.steps(), 2);
  EXPECT_DOUBLE_EQ(m.last_fraction(), 0);
  EXPECT_DOUBLE_EQ(m.last_idle_us(), 0);
  EXPECT_NEAR(m.fraction(), 5.0 / 1010.0, 1e-15);  // 1 - 1005/1010: the long step dominates
  EXPECT_DOUBLE_EQ(m.mean_step_fraction(), 0.25);  // (0.5 + 0) / 2: every step weighs the same
  EXPECT_DOUBLE_EQ(m.mean_idle_us(), 2.5);         // (5 + 0) / 2
}

TEST(BubbleMeter, ZeroMaxAttentionIsNoBubbleNotNaN) {
  BubbleMeter m;
  m.AddStep(std::vector<double>{0, 0, 0});
  EXPECT_EQ(m.steps(), 1);
  EXPECT_EQ(m.last_fraction(), 0);
  EXPECT_EQ(m.last_idle_us(), 0);
  EXPECT_EQ(m.fraction(), 0);
  EXPECT_EQ(m.mean_step_fraction(), 0);
  EXPECT_EQ(m.mean_idle_us(), 0);
  // The empty step counts as a step: it adds nothing to Σmean, Σmax or the idle time.
  m.AddStep(std::vector<double>{100, 60, 80});
  EXPECT_EQ(m.steps(), 2);
  EXPECT_DOUBLE_EQ(m.last_fraction(), 0.2);
  EXPECT_DOUBLE_EQ(m.fraction(), 0.2);             // 1 - (0 + 80) / (0 + 100)
  EXPECT_DOUBLE_EQ(m.mean_step_fraction(), 0.1);   // (0 + 0.2) / 2
  EXPECT_DOUBLE_EQ(m.mean_idle_us(), 10);          // (0 + 20) / 2
}

TEST(BubbleMeter, NoRanksIsAStepWithNoAttention) {
  BubbleMeter m;
  m.AddStep(absl::Span<const double>());
  EXPECT_EQ(m.steps(), 1);
  EXPECT_EQ(m.last_fraction(), 0);
  EXPECT_EQ(m.fraction(), 0);
}

TEST(BubbleMeter, SingleRankNeverWaits) {
  BubbleMeter m;
  m.AddStep(std::vector<double>{42});
  m.AddStep(std::vector<double>{7});
  EXPECT_EQ(m.steps(), 2);
  EXPECT_EQ(m.last_fraction(), 0);
  EXPECT_EQ(m.fraction(), 0);
  EXPECT_EQ(m.mean_step_fraction(), 0);
  EXPECT_EQ(m.mean_idle_us(), 0);
}

TEST(BubbleMeter, EqualRanksHaveNoBubble) {
  BubbleMeter m;
  m.AddStep(std::vector<double>{3, 3, 3, 3});
  m.AddStep(std::vector<double>{250, 250});
  EXPECT_EQ(m.steps(), 2);
  EXPECT_EQ(m.last_fraction(), 0);
  EXPECT_EQ(m.last_idle_us(), 0);
  EXPECT_EQ(m.fraction(), 0);
  EXPECT_EQ(m.mean_step_fraction(), 0);
  EXPECT_EQ(m.mean_idle_us(), 0);
}

TEST(BubbleMeter, OneRankDoingAllTheWorkIdlesTheRest) {
  BubbleMeter m;
  // Four ranks, one with 400 µs: mean 100, the three others idle 400 µs each, 300 µs per rank.
  m.AddStep(std::vector<double>{0, 400, 0, 0});
  EXPECT_DOUBLE_EQ(m.last_fraction(), 0.75);
  EXPECT_DOUBLE_EQ(m.last_idle_us(), 300);
}

}  // namespace
}  // namespace dpbalance
