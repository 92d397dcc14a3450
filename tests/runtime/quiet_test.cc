#include "dpbalance/quiet.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dpbalance {
namespace {

RankSummary Record(uint16_t flags) {
  RankSummary r{};
  r.magic = kSummaryMagic;
  r.version = kSummaryVersion;
  r.flags = flags;
  return r;
}

// One rank alone: which of `steps` steps skip the exchange when every decision keeps the default.
std::vector<int> QuietSteps(QuietConfig c, int steps) {
  QuietSchedule q(c);
  std::vector<int> quiet;
  for (int s = 0; s < steps; ++s) {
    if (q.SkipStep()) {
      quiet.push_back(s);
      continue;
    }
    const RankSummary mine = Record(kSummaryValid | q.ProposalFlags());
    q.AfterExchange(absl::MakeConstSpan(&mine, 1), true);
  }
  return quiet;
}

TEST(QuietSchedule, OffNeverSkipsAndProposesNothing) {
  QuietSchedule q;
  const RankSummary ready = Record(kSummaryValid | (5 << kSummaryQuietShift));
  for (int s = 0; s < 100; ++s) {
    EXPECT_FALSE(q.SkipStep());
    EXPECT_EQ(q.ProposalFlags(), 0);
    q.AfterExchange(absl::MakeConstSpan(&ready, 1), true);
  }
  EXPECT_EQ(q.quiet_steps(), 0);
  EXPECT_TRUE(QuietSteps({}, 50).empty());
}

// after = 3, max 8: exchanges at steps 0-3 (three kept decisions make the rank ready; step 3's
// exchange agrees), then spans of 3, 6 and 8 steps with a probe between them: exchanges at
// 0, 1, 2, 3, 7, 14, 23, 32, ...
TEST(QuietSchedule, SpansDoubleFromAfterUpToTheMax) {
  QuietSchedule q({.after = 3, .max_steps = 8});
  EXPECT_EQ(q.SpanSteps(1), 3);
  EXPECT_EQ(q.SpanSteps(2), 6);
  EXPECT_EQ(q.SpanSteps(3), 8);
  EXPECT_EQ(q.MaxLevel(), 3);
  const std::vector<int> quiet = QuietSteps({.after = 3, .max_steps = 8}, 60);
  std::vector<int> exchanged;
  for (int s = 0, i = 0; s < 60; ++s) {
    if (i < static_cast<int>(quiet.size()) && quiet[i] == s) {
      ++i;
    } else {
      exchanged.push_back(s);
    }
  }
  EXPECT_EQ(exchanged, (std::vector<int>{0, 1, 2, 3, 7, 14, 23, 32, 41, 50, 59}));
  // The longest span caps the exchange rate: 4096 with after = 1000 still fits the 4-bit level.
  QuietSchedule wide({.after = 1000, .max_steps = 4096});
  EXPECT_EQ(wide.SpanSteps(wide.MaxLevel()), 4096);
  EXPECT_EQ(wide.SpanSteps(1), 1000);
}

TEST(QuietSchedule, AChangedPlanOrAnUnreadyRecordStartsNoSpan) {
  QuietSchedule q({.after = 1, .max_steps = 4});
  const RankSummary unready = Record(kSummaryValid);
  RankSummary mine = Record(kSummaryValid | q.ProposalFlags());
  q.AfterExchange(absl::MakeConstSpan(&mine, 1), true);  // ready from now on
  mine = Record(kSummaryValid | q.ProposalFlags());
  ASSERT_EQ(QuietSchedule::Level(mine.flags), 1);
  const RankSummary both[] = {mine, unready};
  q.AfterExchange(both, true);  // a peer not ready: no span, still ready
  EXPECT_FALSE(q.SkipStep());
  EXPECT_EQ(QuietSchedule::Level(q.ProposalFlags()), 1);
  const RankSummary ready[] = {mine, mine};
  q.AfterExchange(ready, false);  // a plan changed: readiness starts over
  EXPECT_FALSE(q.SkipStep());
  EXPECT_EQ(q.ProposalFlags(), 0);
}

// The contract that keeps a collective from hanging: ranks whose local state differs still skip
// exactly the same steps, because a span starts only from what every rank read, the smallest
// proposal. Random decisions, 2-6 ranks, 300 runs of 400 steps, with three kinds of divergence:
// a rank whose input fails sends no proposal (StampOwnSummary); a rank forgets its readiness
// between exchanges (Reset: its own exchange failed while the others' did not, at a step that
// started no span); an exchange fails on every rank (the collective fails as a whole). A rank
// that planned a span from its own readiness alone would leave the others waiting.
TEST(QuietSchedule, EveryRankSkipsTheSameStepsWhateverItsLocalState) {
  std::mt19937_64 rng(7);
  int64_t total_quiet = 0;
  for (int run = 0; run < 300; ++run) {
    const int ranks = 2 + static_cast<int>(rng() % 5);
    const QuietConfig c{.after = 1 + static_cast<int>(rng() % 6), .max_steps = 1 + static_cast<int>(rng() % 40)};
    std::vector<QuietSchedule> qs(ranks, QuietSchedule(c));
    std::bernoulli_distribution keep(0.9), fail_local(0.05), fail_all(0.02), forget(0.05);
    int kept_run = 0;  // kept decisions in a row, as every rank saw them
    for (int s = 0; s < 400; ++s) {
      std::vector<bool> skip(ranks);
      for (int r = 0; r < ranks; ++r) skip[r] = qs[r].SkipStep();
      for (int r = 1; r < ranks; ++r) ASSERT_EQ(skip[r], skip[0]) << "run " << run << " step " << s;
      if (skip[0]) {
        // A span needs `after` kept decisions in a row before it.
        EXPECT_GE(kept_run, c.after) << "run " << run << " step " << s;
        continue;
      }
      std::vector<RankSummary> recs;
      for (int r = 0; r < ranks; ++r) {
        // A rank whose input failed sends a record without the proposal (StampOwnSummary).
        recs.push_back(Record(fail_local(rng) ? 0 : kSummaryValid | qs[r].ProposalFlags()));
      }
      if (fail_all(rng)) {
        for (QuietSchedule& q : qs) q.Reset();
        kept_run = 0;
        continue;
      }
      const bool kept = keep(rng);
      kept_run = kept ? kept_run + 1 : 0;
      for (QuietSchedule& q : qs) q.AfterExchange(recs, kept);
      if (qs[0].left() == 0 && forget(rng)) {
        qs[rng() % ranks].Reset();
        kept_run = 0;  // that rank counts its streak from here
      }
    }
    for (int r = 1; r < ranks; ++r) ASSERT_EQ(qs[r].quiet_steps(), qs[0].quiet_steps());
    total_quiet += qs[0].quiet_steps();
  }
  EXPECT_GT(total_quiet, 10000) << "the random decisions must make spans, or the test proves nothing";
}

TEST(QuietSchedule, ConfigOutOfRangeIsAnErrorNamingTheValue) {
  EXPECT_TRUE(QuietConfig{}.Validate().ok());
  EXPECT_TRUE((QuietConfig{.after = 1000, .max_steps = 4096}).Validate().ok());
  for (QuietConfig bad : {QuietConfig{.after = -1}, QuietConfig{.after = 1001},
                          QuietConfig{.after = 2, .max_steps = 0}, QuietConfig{.after = 2, .max_steps = 4097}}) {
    const absl::Status s = bad.Validate();
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(std::to_string(bad.after < 0 || bad.after > 1000 ? bad.after : bad.max_steps)),
              std::string::npos)
        << s;
  }
}

}  // namespace
}  // namespace dpbalance
