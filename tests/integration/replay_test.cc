#include <algorithm>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "dpbalance/acceptance.h"
#include "gtest/gtest.h"
#include "dpbalance/dspark.h"
#include "simulator.h"
#include "trace.h"

namespace dpbalance::replay {
namespace {

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(Trace, ErrorsNameFileLineAndValue) {
  const std::string neg = WriteTemp("neg.jsonl",
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5}\n"
      "{\"timestamp\": 0, \"input_length\": -3, \"output_length\": 5}\n");
  absl::StatusOr<std::vector<TraceRequest>> t = LoadTrace(neg, TraceFormat::kAuto, 1);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("neg.jsonl:2"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("-3"), std::string::npos);

  const std::string bad = WriteTemp("bad.jsonl", "{\"timestamp\": 0, \"input_length\": 10}\n");
  t = LoadTrace(bad, TraceFormat::kAuto, 1);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("output_length"), std::string::npos);

  const std::string garbled = WriteTemp("g.jsonl", "{\"timestamp\": 0, \"input_len");
  EXPECT_FALSE(LoadTrace(garbled, TraceFormat::kMooncakeJsonl, 1).ok());

  const std::string csv = WriteTemp("a.csv",
      "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
      "2023-11-16 18:15:47.00,abc,5\n");
  t = LoadTrace(csv, TraceFormat::kAuto, 1);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("a.csv:3"), std::string::npos);
  EXPECT_NE(t.status().message().find("abc"), std::string::npos);

  EXPECT_FALSE(LoadTrace(WriteTemp("empty.jsonl", ""), TraceFormat::kAuto, 1).ok());
  EXPECT_FALSE(LoadTrace(WriteTemp("x.txt", "hello\n"), TraceFormat::kAuto, 1).ok());
  EXPECT_FALSE(LoadTrace("/nonexistent.jsonl", TraceFormat::kAuto, 1).ok());
  EXPECT_FALSE(ParseTraceFormat("parquet").ok());
}

// `n` requests of 100 prompt tokens at timestamp 0, each `{..., REST}` (a JSONL trace's line).
std::vector<TraceRequest> Repeated(const std::string& name, const std::string& rest, int n = 40) {
  std::string text;
  for (int i = 0; i < n; ++i) text += "{\"timestamp\": 0, \"input_length\": 100, " + rest + "}\n";
  return *LoadTrace(WriteTemp(name, text), TraceFormat::kAuto, 1);
}

// Two ranks, 8 requests in flight, static k.
SimConfig TwoRanks(int static_k) {
  SimConfig c;
  c.num_ranks = 2;
  c.inflight = 8;
  c.static_k = static_k;
  return c;
}

// A bad trace line's error names the file, the line and `what`.
void ExpectBadLine(const std::string& name, const std::string& line, const std::string& what) {
  absl::StatusOr<std::vector<TraceRequest>> bad = LoadTrace(WriteTemp(name, line + "\n"), TraceFormat::kAuto, 1);
  ASSERT_FALSE(bad.ok()) << line;
  EXPECT_NE(bad.status().message().find(name + ":1"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find(what), std::string::npos) << bad.status();
}

// A request's own measured acceptance rides in the trace ("acceptance": conditional rates); the
// replay draws its accept counts from it: a request that accepts every draft emits k + 1 tokens a
// step at static k, one that accepts none emits one.
TEST(Trace, MeasuredAcceptanceDrivesTheReplaysDraws) {
  const auto every = Repeated("all.jsonl", "\"output_length\": 30, \"acceptance\": [1, 1, 1]");
  ASSERT_EQ(every[0].acceptance, (std::vector<double>{1, 1, 1}));
  const RunResult r_all = *Simulate(TwoRanks(2), TruthModel{}, every);
  const RunResult r_none =
      *Simulate(TwoRanks(2), TruthModel{}, Repeated("none.jsonl", "\"output_length\": 30, \"acceptance\": [0]"));
  EXPECT_NEAR(r_all.tokens / r_none.tokens, 1.0, 0.05);  // the same outputs, emitted
  EXPECT_LT(3 * r_all.steps, r_none.steps + 12);          // three tokens a step against one
  // Bad rates are errors naming the line and the value.
  ExpectBadLine("badacc.jsonl", "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 2, \"acceptance\": [0.5, 1.5]}",
                "1.5");
}

// The drafts a drafter offers ride in the trace too ("offered": the chance of at least j drafts
// a step); every row verifies at most what was offered: at static k = 3, offered [1, 0.5, 0.5]
// gives 1 + 0.5 + 0.5 = 2 drafts a request-step on average (3 without it), and a request that
// accepts everything emits a token more per draft.
TEST(Trace, OfferedDraftsCapEveryRowsVerifyLength) {
  const std::string accepts_all = "\"output_length\": 200, \"acceptance\": [1, 1, 1]";
  const auto with = Repeated("offered.jsonl", accepts_all + ", \"offered\": [1, 0.5, 0.5]");
  ASSERT_EQ(with[0].offered, (std::vector<double>{1, 0.5, 0.5}));
  SimConfig c = TwoRanks(3);
  const RunResult r_with = *Simulate(c, TruthModel{}, with);
  const RunResult r_every = *Simulate(c, TruthModel{}, Repeated("every.jsonl", accepts_all));
  EXPECT_NEAR(r_with.mean_verify_len, 2.0, 0.15) << r_with.mean_verify_len;
  EXPECT_NEAR(r_every.mean_verify_len, 3.0, 0.15) << r_every.mean_verify_len;
  EXPECT_GT(r_with.steps, r_every.steps);  // 3 tokens a step against 4
  // The planner's rows are capped the same way: the goodput row at k_max 7 never verifies more
  // than offered (at most 3 here, 2 on average).
  c.verify = VerifyMode::kGoodput;
  c.k_max = 7;
  const RunResult planned = *Simulate(c, TruthModel{}, with);
  EXPECT_LE(planned.mean_verify_len, 2.0 + 0.15) << planned.mean_verify_len;
  // Bad chances are errors naming the line and the value: out of [0, 1], or rising with j.
  for (const char* bad : {"[0.5, 1.5]", "[0.5, 0.7]"}) {
    ExpectBadLine("badoff.jsonl",
                  absl::StrCat("{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 2, \"offered\": ", bad, "}"),
                  "'offered' chance");
  }
}

TEST(Trace, AzureTimestampsAreMillisecondsFromFirst) {
  const std::string csv = WriteTemp("ok.csv",
      "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5,374,44\n"
      "2023-11-16 18:15:48.0,396,109\n");
  absl::StatusOr<std::vector<TraceRequest>> t = LoadTrace(csv, TraceFormat::kAuto, 1);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_NEAR((*t)[1].arrival_ms, 1500, 1e-3);
  EXPECT_EQ((*t)[1].input_tokens, 396);
}

// A small real slice of the bundled Mooncake trace.
std::vector<TraceRequest> Slice(size_t n) {
  absl::StatusOr<std::vector<TraceRequest>> t =
      LoadTrace(DPB_TEST_TRACE, TraceFormat::kAuto, 1);
  EXPECT_TRUE(t.ok()) << t.status();
  t->resize(n);
  return *t;
}

SimConfig Small() {
  SimConfig c;
  c.num_ranks = 8;
  c.inflight = 256;
  c.rank_capacity_tokens = 512000;
  return c;
}

// SGLang DSpark's engine on Small(): its tiers, default length 1, the dspark row.
SimConfig DsparkEngine() {
  SimConfig c = Small();
  c.static_k = 1;
  c.token_tiers = SglangDefaultTiers(c.max_batch_per_rank, c.k_max);
  c.verify = VerifyMode::kDspark;
  return c;
}

TEST(Simulator, DeterministicForASeedAndConsistent) {
  const auto trace = Slice(600);
  SimConfig c = Small();
  c.verify = VerifyMode::kGoodput;
  c.static_k = 1;
  TruthModel truth;
  absl::StatusOr<RunResult> a = Simulate(c, truth, trace), b = Simulate(c, truth, trace);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->steps, b->steps);
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_GT(a->steps, 10);
  EXPECT_GT(a->balance_efficiency, 0.5);
  EXPECT_LE(a->balance_efficiency, 1.0);
  EXPECT_GE(a->cost_ratio_v2, 1.0 - 1e-9);  // the balanced ideal is a lower bound
  EXPECT_LE(a->goodput_tok_per_s, a->ideal_goodput_tok_per_s * (1 + 1e-9));
  EXPECT_GT(a->tpot_p99_ms, 0);
}

TEST(Simulator, StaticKZeroEmitsOneTokenPerRequestStep) {
  const auto trace = Slice(300);
  SimConfig c = Small();
  c.static_k = 0;
  absl::StatusOr<RunResult> r = Simulate(c, TruthModel{}, trace);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->mean_verify_len, 0);
  EXPECT_EQ(r->mean_draft_depth, 0);
}

TEST(Simulator, PlannerBeatsWorstStaticAndOracleIsBest) {
  // On real trace data: verify balancing (goodput) must beat static k=3 and the local mode must
  // not beat the coordinated one; the oracle (truth model + true acceptance) bounds both.
  const auto trace = Slice(1500);
  TruthModel truth;
  SimConfig c = Small();
  c.static_k = 3;
  const double k3 = Simulate(c, truth, trace)->goodput_tok_per_s;
  c.verify = VerifyMode::kGoodput;
  c.static_k = 1;
  const RunResult gp = *Simulate(c, truth, trace);
  c.verify = VerifyMode::kOracle;
  const RunResult orc = *Simulate(c, truth, trace);
  EXPECT_GT(gp.goodput_tok_per_s, k3);
  EXPECT_GT(orc.goodput_tok_per_s, 0.99 * gp.goodput_tok_per_s);
  EXPECT_LT(1 - gp.balance_efficiency, 0.05);
}

// One width for the instance (granularity instance: SGLang's EAGLE/MTP step graphs), on real
// trace data: the agreed depth each step does at least about as well as the best fixed width of a
// sweep (what a user finds by benchmarking), and the oracle bounds it.
TEST(Simulator, InstanceWidthMatchesTheBestFixedWidth) {
  const auto trace = Slice(1500);
  TruthModel truth;
  SimConfig c = Small();
  c.k_max = 4;
  double best_static = 0;
  int best_k = 0;
  for (int k = 0; k <= c.k_max; ++k) {
    c.static_k = k;
    const double g = Simulate(c, truth, trace)->goodput_tok_per_s;
    if (g > best_static) best_static = g, best_k = k;
  }
  c.verify = VerifyMode::kGoodput;
  c.uniform_instance = true;
  // An untuned default width (1) without the TPOT guard: the plan finds the best width itself.
  c.static_k = 1;
  c.max_step_slack = -1;
  const RunResult free = *Simulate(c, truth, trace);
  // The engine's default at the best width, under the guard (SimConfig's 5%).
  c.static_k = best_k;
  c.max_step_slack = 0.05;
  const RunResult tuned = *Simulate(c, truth, trace);
  c.verify = VerifyMode::kOracle;
  const RunResult orc = *Simulate(c, truth, trace);
  EXPECT_GT(free.goodput_tok_per_s, 0.99 * best_static);
  EXPECT_GT(tuned.goodput_tok_per_s, 0.99 * best_static);
  EXPECT_GT(orc.goodput_tok_per_s, 0.99 * tuned.goodput_tok_per_s);
  std::printf("instance width: goodput %.1f (default 1, no guard; mean depth %.2f), %.1f (default "
              "%d, guarded) vs best fixed width k=%d %.1f tok/s; oracle %.1f\n",
              free.goodput_tok_per_s, free.mean_draft_depth, tuned.goodput_tok_per_s, best_k,
              best_k, best_static, orc.goodput_tok_per_s);
}

// The balancer's quiet mode in the replay (SimConfig::quiet, quiet.h): with a default guard no
// plan beats, every plan keeps the default lengths, so skipping the plan on quiet spans changes
// nothing the instance runs (the same steps, tokens and time, to the bit) while most steps go
// without a plan (after 4, spans up to 32: about 32 of every 33). With a guard plans beat,
// the quiet steps are few and the planner still balances.
TEST(Simulator, QuietModeSkipsOnlyPlansThatKeptTheDefault) {
  const auto trace = Slice(600);
  SimConfig c = Small();
  c.verify = VerifyMode::kGoodput;
  c.static_k = 3;
  c.min_plan_gain = 10;
  const RunResult kept = *Simulate(c, TruthModel{}, trace);
  c.quiet = {.after = 4, .max_steps = 32};
  const RunResult quiet = *Simulate(c, TruthModel{}, trace);
  EXPECT_EQ(quiet.steps, kept.steps);
  EXPECT_EQ(quiet.tokens, kept.tokens);
  EXPECT_EQ(quiet.sim_time_s, kept.sim_time_s);
  EXPECT_EQ(kept.quiet_step_fraction, 0);
  EXPECT_GT(quiet.quiet_step_fraction, 0.85);
  c.min_plan_gain = 0.02;
  const RunResult planned = *Simulate(c, TruthModel{}, trace);
  c.quiet = {};
  const RunResult always = *Simulate(c, TruthModel{}, trace);
  EXPECT_LT(planned.quiet_step_fraction, 0.5);
  EXPECT_GT(planned.goodput_tok_per_s, 0.97 * always.goodput_tok_per_s);
}

TEST(Simulator, TpotSloKeepsTheStaticTailOnRealRequests) {
  // The goodput plan shortens low-acceptance requests, whose TPOT then follows the step time.
  // With the SLO set at the static run's TPOT p99 (the replay's 'auto'), the planner holds the
  // requests that would miss it at the default length.
  const auto trace = Slice(1500);
  TruthModel truth;
  SimConfig c = Small();
  c.static_k = 1;
  const RunResult base = *Simulate(c, truth, trace);
  c.verify = VerifyMode::kGoodput;
  const RunResult free = *Simulate(c, truth, trace);
  c.tpot_slo_us = base.tpot_p99_ms * 1000;
  const RunResult slo = *Simulate(c, truth, trace);
  EXPECT_LT(slo.tpot_p99_ms, free.tpot_p99_ms);
  EXPECT_LE(slo.tpot_p99_ms, 1.05 * base.tpot_p99_ms);  // the TPOT p99 target (docs/results.md)
  EXPECT_GT(slo.goodput_tok_per_s, base.goodput_tok_per_s);
  EXPECT_LT(1 - slo.balance_efficiency, 0.3 * (1 - base.balance_efficiency));
}

// --draft per_rank: a rank that runs its own draft spends draft_per_step_us per draft step, to its
// deepest verify length, before the barrier. In static mode with the truth's noise off the
// verify lengths and accepted tokens do not depend on time, so a run with a 1.5 ms draft and one
// with a free draft take the same steps, and each step differs by the slowest rank's draft:
// at most 1.5 ms x k, and about that (nearly every rank verifies k). The agreed draft (every
// rank drafts k) costs at least as much.
TEST(Simulator, PerRankDraftTimeRunsBeforeTheBarrier) {
  const auto trace = Slice(600);
  SimConfig c = Small();
  c.static_k = 3;
  TruthModel truth;
  truth.per_rank_draft = true;
  truth.global.draft_per_step_us = 1500;
  const RunResult paid = *Simulate(c, truth, trace);
  truth.global.draft_per_step_us = 0;
  const RunResult free = *Simulate(c, truth, trace);
  truth.per_rank_draft = false;
  truth.global.draft_per_step_us = 1500;
  const RunResult agreed = *Simulate(c, truth, trace);
  ASSERT_EQ(paid.steps, free.steps);
  ASSERT_EQ(paid.tokens, free.tokens);
  const double draft_ms_per_step = (paid.sim_time_s - free.sim_time_s) * 1000 / paid.steps;
  EXPECT_LE(draft_ms_per_step, 1.5 * 3 * (1 + 1e-9));
  EXPECT_GE(draft_ms_per_step, 0.9 * 1.5 * 3);
  EXPECT_GE(agreed.sim_time_s, paid.sim_time_s * (1 - 1e-12));
  // The planner, told the draft is per rank, still beats the static run.
  c.verify = VerifyMode::kGoodput;
  c.static_k = 1;
  truth.per_rank_draft = true;
  const RunResult planned = *Simulate(c, truth, trace);
  EXPECT_GT(planned.goodput_tok_per_s, paid.goodput_tok_per_s);
  EXPECT_LT(1 - planned.balance_efficiency, 1 - paid.balance_efficiency);
}

// --noise: log-normal noise on each rank's attention. Static runs take the same steps with or
// without it (the draws share the run's generator, so the steps differ a little); the noise
// widens the bubble and, the step being the slowest rank's time, lengthens the mean step.
// Deterministic for a seed; another seed draws other noise.
TEST(Simulator, NoiseWidensTheBubbleAndIsSeeded) {
  const auto trace = Slice(600);
  SimConfig c = Small();
  c.static_k = 2;
  TruthModel truth;
  const RunResult quiet = *Simulate(c, truth, trace);
  truth.noise_sigma = 0.3;
  const RunResult noisy = *Simulate(c, truth, trace), again = *Simulate(c, truth, trace);
  EXPECT_EQ(noisy.sim_time_s, again.sim_time_s);
  EXPECT_LT(noisy.balance_efficiency, quiet.balance_efficiency - 0.05);
  EXPECT_GT(noisy.mean_step_ms, quiet.mean_step_ms);
  c.seed = 2;
  const RunResult other = *Simulate(c, truth, trace);
  EXPECT_NE(other.sim_time_s, noisy.sim_time_s);
}

// --open_loop: requests are admitted at their arrival times (divided by --arrival_speedup), so
// the run lasts at least until the last one arrives, and at 10x the trace's pace the instance
// is nearly idle: shorter steps than the closed loop's full batches.
TEST(Simulator, OpenLoopAdmitsAtArrivalTimes) {
  const auto trace = Slice(300);
  SimConfig c = Small();
  c.static_k = 2;
  const RunResult closed = *Simulate(c, TruthModel{}, trace);
  c.open_loop = true;
  c.arrival_speedup = 10;
  const RunResult open = *Simulate(c, TruthModel{}, trace);
  const double last_arrival_s = trace.back().arrival_ms / 10 / 1000;
  ASSERT_GT(last_arrival_s, 5);
  EXPECT_GE(open.sim_time_s, last_arrival_s);
  EXPECT_LE(open.sim_time_s, last_arrival_s + 1.0);  // the last one is admitted within steps
  EXPECT_LT(open.mean_step_ms, closed.mean_step_ms);
  EXPECT_GT(closed.goodput_tok_per_s, open.goodput_tok_per_s);
}

// --drain: the run goes on until every request has finished. Two requests of 10 tokens that
// accept no draft, 1,000 and 3,000 tokens of context, routed by A onto the two ranks: each emits
// one token a step, both finish at step 10, and each step's context imbalance is the larger
// rank's context over the mean, (3000 + s) / (2000 + s) at step s. Without --drain the trace is
// exhausted after the first step and nothing finishes.
TEST(Simulator, DrainFinishesEveryRequestWithItsLatencyAndContextImbalance) {
  const std::vector<TraceRequest> trace = {{0, 1000, 10, {0.0}}, {0, 3000, 10, {0.0}}};
  SimConfig c;
  c.num_ranks = 2;
  c.inflight = 8;
  c.static_k = 0;
  c.routing.strategy = RoutingStrategy::kMinBatch;
  const RunResult cut = *Simulate(c, TruthModel{}, trace);
  EXPECT_EQ(cut.steps, 1);
  EXPECT_EQ(cut.requests_finished, 0);
  EXPECT_EQ(cut.latency_mean_ms, 0);
  c.drain = true;
  const RunResult r = *Simulate(c, TruthModel{}, trace);
  EXPECT_EQ(r.steps, 10);
  EXPECT_EQ(r.requests_finished, 2);
  EXPECT_NEAR(r.latency_mean_ms, r.sim_time_s * 1e3, 1e-6);  // both ran from the start to the end
  EXPECT_NEAR(r.latency_p50_ms, r.latency_mean_ms, 1e-9);
  double want = 0;
  for (int s = 0; s < 10; ++s) want += (3000.0 + s) / (2000.0 + s) / 10;
  EXPECT_NEAR(r.ctx_imbalance, want, 1e-12);
}

// --planner_model online: the planner starts from a model 3x too slow and refits it from the
// measured attention; its error against the truth ends small, and it plans better than the
// same wrong model held fixed.
TEST(Simulator, OnlineModelLearnsTheTruth) {
  const auto trace = Slice(1500);
  SimConfig c = Small();
  c.verify = VerifyMode::kGoodput;
  c.static_k = 1;
  c.planner_model = CostModel::PublishedV2().Scaled(3);
  const RunResult fixed = *Simulate(c, TruthModel{}, trace);
  c.planner_online = true;
  const RunResult online = *Simulate(c, TruthModel{}, trace);
  EXPECT_EQ(fixed.planner_model_error, 0);  // measured only for an online model
  EXPECT_GT(online.planner_model_error, 0);
  EXPECT_LT(online.planner_model_error, 0.15);
  EXPECT_GE(online.goodput_tok_per_s, fixed.goodput_tok_per_s);
}

// --verify local: each rank plans alone. It changes the verify lengths, but without the other
// ranks' barrier it does worse than the coordinated plan (on this slice even worse than the
// static default: each rank lengthens its own batch and the slowest sets the step).
// The replay's online model sees every rank's attention each step where each rank's Balancer sees
// its own: it must forget per step as that one does. Forgetting per observation, it forgot 64x
// too fast at DP64, chased the noise and lost 8% of the tiered goodput on Mooncake V2 with 10%
// noise (issue #49, docs/results.md section 0); on a noisy truth starting from the truth's own
// form, refitting online must cost next to nothing.
TEST(Simulator, OnlineModelUnderNoiseLosesNothingToTheFixedOne) {
  const auto trace = Slice(2500);
  SimConfig c = Small();
  c.num_ranks = 64;
  c.inflight = 1024;
  c.verify = VerifyMode::kGoodput;
  c.static_k = 1;
  TruthModel noisy;
  noisy.noise_sigma = 0.1;
  const RunResult fixed = *Simulate(c, noisy, trace);
  c.planner_online = true;
  const RunResult online = *Simulate(c, noisy, trace);
  EXPECT_GT(online.planner_model_error, 0.05);  // the noise itself
  EXPECT_GE(online.goodput_tok_per_s, 0.99 * fixed.goodput_tok_per_s);
}

TEST(Simulator, LocalPlansLoseToCoordinated) {
  const auto trace = Slice(1500);
  SimConfig c = Small();
  c.static_k = 1;
  const RunResult base = *Simulate(c, TruthModel{}, trace);
  c.verify = VerifyMode::kLocal;
  const RunResult local = *Simulate(c, TruthModel{}, trace);
  c.verify = VerifyMode::kGoodput;
  const RunResult coord = *Simulate(c, TruthModel{}, trace);
  EXPECT_NE(local.mean_verify_len, base.mean_verify_len);
  EXPECT_GT(coord.goodput_tok_per_s, base.goodput_tok_per_s);
  EXPECT_LT(local.goodput_tok_per_s, coord.goodput_tok_per_s);
  EXPECT_LT(local.balance_efficiency, coord.balance_efficiency);
}

// --groups: D inside groups routes every request and stays within capacity.
TEST(Simulator, DualPathInsideGroupsRoutesTheTrace) {
  const auto trace = Slice(600);
  SimConfig c = Small();
  c.routing.groups = 2;
  c.routing.group_choice = RoutingStrategy::kMinContext;
  const RunResult g = *Simulate(c, TruthModel{}, trace);
  c.routing.groups = 1;
  const RunResult one = *Simulate(c, TruthModel{}, trace);
  EXPECT_GT(g.steps, 10);
  EXPECT_NE(g.sim_time_s, one.sim_time_s);  // the groups changed where requests went
  EXPECT_GT(g.balance_efficiency, 0.5);
}

TEST(Simulator, BadConfigIsAnError) {
  const auto trace = Slice(10);
  SimConfig c = Small();
  c.static_k = 9;
  EXPECT_FALSE(Simulate(c, TruthModel{}, trace).ok());
  c = Small();
  c.rank_capacity_tokens = 10;  // nothing fits anywhere
  absl::StatusOr<RunResult> r = Simulate(c, TruthModel{}, trace);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("capacity"), std::string::npos);
}

// The agreed count is the smallest tier holding the largest rank's tokens (past the last tier,
// the largest rank's tokens); SGLang's default tiers are its speculative capture sizes times the
// verify window. (How the spare tokens run: dspark::PadToTier, tests/runtime/dspark_test.cc.)
TEST(Tiers, TheAgreedTierHoldsTheLargestRank) {
  const std::vector<int32_t> tiers = {8, 16, 24, 32};
  EXPECT_EQ(AgreedTier(tiers, 19), 24);
  EXPECT_EQ(AgreedTier(tiers, 24), 24);
  EXPECT_EQ(AgreedTier(tiers, 33), 33);  // past the last tier: no graph, no padding
  EXPECT_EQ(AgreedTier({}, 19), 19);     // no tiers: the largest rank's tokens
  // SGLang's speculative capture sizes up to a batch of 64, times the verify window of 8.
  const std::vector<int32_t> sglang = SglangDefaultTiers(64, 7);
  ASSERT_EQ(sglang.size(), 27u);
  EXPECT_EQ(sglang.front(), 8);
  EXPECT_EQ(sglang[8], 80);  // batch 10 follows 8
  EXPECT_EQ(sglang.back(), 512);
}

// DSpark's tier fill spends the tier's spare tokens on real drafts: with it almost nothing that
// runs is padding, without it the ranks below the largest pad; neither has an instance plan of
// its own (step_over_plan 0).
TEST(Dspark, TierFillRunsTheTierWithRealDrafts) {
  const auto trace = Slice(1500);
  SimConfig c = DsparkEngine();
  const RunResult plain = *Simulate(c, TruthModel{}, trace);
  c.verify = VerifyMode::kDsparkFill;
  const RunResult fill = *Simulate(c, TruthModel{}, trace);
  EXPECT_GT(plain.padding_fraction, 0.0);
  EXPECT_LT(fill.padding_fraction, 0.2 * plain.padding_fraction);
  EXPECT_EQ(plain.step_over_plan, 0);
  EXPECT_EQ(fill.step_over_plan, 0);
  // The sensitivity row prices with the planner's model instead of the profiled table and plans
  // differently.
  c.dspark_table = DsparkTable::kContext;
  const RunResult context = *Simulate(c, TruthModel{}, trace);
  EXPECT_NE(context.tokens, fill.tokens);
}

// SGLang's other DSpark tables in the replay: the table profiled at the workload's context is the
// default table when that context is the profiler's own; the additive table and a table profiled
// at longer contexts plan differently; the online profiler rebuilds each rank's table every 1000
// of its steps and from then on plans differently from the table it started with.
TEST(Dspark, EveryTableSglangShipsRunsAndTheOnlineOneRebuilds) {
  const auto trace = Slice(4000);
  SimConfig c = DsparkEngine();
  const RunResult profiled = *Simulate(c, TruthModel{}, trace);
  c.dspark_table = DsparkTable::kWorkload;
  c.dspark_profile_context = dspark::kProfileContextTokens;
  const RunResult same = *Simulate(c, TruthModel{}, trace);
  EXPECT_EQ(same.tokens, profiled.tokens);
  EXPECT_EQ(same.sim_time_s, profiled.sim_time_s);
  c.dspark_profile_context = 20000;
  const RunResult workload = *Simulate(c, TruthModel{}, trace);
  EXPECT_NE(workload.sim_time_s, profiled.sim_time_s);
  c.dspark_table = DsparkTable::kAdditive;
  const RunResult additive = *Simulate(c, TruthModel{}, trace);
  EXPECT_NE(additive.sim_time_s, workload.sim_time_s);
  EXPECT_EQ(additive.dspark_table_rebuilds, 0);
  c.dspark_table = DsparkTable::kOnline;
  const RunResult online = *Simulate(c, TruthModel{}, trace);
  ASSERT_GT(profiled.steps, 1000);
  EXPECT_GE(online.dspark_table_rebuilds, c.num_ranks);  // every rank, at least once
  EXPECT_GE(online.dspark_warmup_rebuilds, 2 * c.num_ranks);  // two warm-up passes
  c.dspark_online_warmup = 0;
  const RunResult cold = *Simulate(c, TruthModel{}, trace);
  EXPECT_EQ(cold.dspark_warmup_rebuilds, 0);
  EXPECT_NE(cold.sim_time_s, online.sim_time_s);
  EXPECT_NE(online.sim_time_s, workload.sim_time_s);
}

// A draft-confidence signal of stated quality (issue #49): with acceptance varying step to step,
// DSpark reads the draft's confidence fresh for its top-k and two steps back for its budget. The
// measured AUC falls as the signal's noise grows; a perfect signal lifts DSpark over the
// estimators' acceptance, a useless one sinks it.
TEST(Dspark, AConfidenceSignalOfKnownQualityDrivesDsparksTopK) {
  const auto trace = Slice(1500);
  SimConfig c = DsparkEngine();
  c.verify = VerifyMode::kDsparkFill;
  c.step_acceptance_sigma = 0.7;
  const RunResult none = *Simulate(c, TruthModel{}, trace);
  EXPECT_EQ(none.confidence_auc, 0);  // no signal, nothing measured
  c.confidence_sigma = 0;
  const RunResult perfect = *Simulate(c, TruthModel{}, trace);
  c.confidence_sigma = 1;
  const RunResult noisy = *Simulate(c, TruthModel{}, trace);
  c.confidence_sigma = 5;
  const RunResult useless = *Simulate(c, TruthModel{}, trace);
  EXPECT_GT(perfect.confidence_auc, noisy.confidence_auc);
  EXPECT_GT(noisy.confidence_auc, useless.confidence_auc);
  EXPECT_GT(perfect.confidence_auc, 0.65);
  EXPECT_LT(useless.confidence_auc, 0.6);
  EXPECT_GT(perfect.goodput_tok_per_s, none.goodput_tok_per_s);
  EXPECT_LT(useless.goodput_tok_per_s, none.goodput_tok_per_s);
  // Our tiered planner spends each rank's planned tokens by the same fresh signal: a good one
  // lifts it too.
  c.verify = VerifyMode::kGoodput;
  c.padded = true;
  c.confidence_sigma = -1;
  const RunResult ours_none = *Simulate(c, TruthModel{}, trace);
  c.confidence_sigma = 0;
  const RunResult ours_perfect = *Simulate(c, TruthModel{}, trace);
  EXPECT_GT(ours_perfect.goodput_tok_per_s, ours_none.goodput_tok_per_s);
}

// The dspark row pads every rank to the agreed tier. Its verify lengths do not depend on the
// step times, so the same requests run the same steps under any tiers; only the time differs:
// more padding, less goodput.
TEST(Dspark, PaddingToCoarserTiersCostsTime) {
  const auto trace = Slice(600);
  SimConfig c = Small();
  c.verify = VerifyMode::kDspark;
  c.static_k = 1;
  c.token_tiers = {};
  const RunResult none = *Simulate(c, TruthModel{}, trace);
  c.token_tiers = SglangDefaultTiers(c.max_batch_per_rank, c.k_max);
  const RunResult sglang = *Simulate(c, TruthModel{}, trace);
  c.token_tiers = {1024};
  const RunResult coarse = *Simulate(c, TruthModel{}, trace);
  EXPECT_EQ(none.steps, sglang.steps);
  EXPECT_EQ(none.tokens, coarse.tokens);
  EXPECT_GT(none.padding_fraction, 0);  // ranks differ: all run the largest rank's tokens
  EXPECT_GE(sglang.padding_fraction, none.padding_fraction);
  EXPECT_GT(coarse.padding_fraction, 0.5);
  EXPECT_GE(none.goodput_tok_per_s, sglang.goodput_tok_per_s);
  EXPECT_GT(sglang.goodput_tok_per_s, coarse.goodput_tok_per_s);
  EXPECT_EQ(sglang.step_over_plan, 0);  // no instance plan
}

// What the v2 plugin does on tiers: the goodput planner in its padded mode fills the tier's spare
// tokens with verify work, so far less of what runs is padding than under DSpark, and it beats
// DSpark on the same tiers.
TEST(Tiers, PaddedPlannerFillsTheTierAndBeatsDspark) {
  const auto trace = Slice(1500);
  SimConfig c = DsparkEngine();
  const RunResult dspark = *Simulate(c, TruthModel{}, trace);
  c.verify = VerifyMode::kGoodput;
  c.padded = true;
  const RunResult v2 = *Simulate(c, TruthModel{}, trace);
  EXPECT_LT(v2.padding_fraction, 0.5 * dspark.padding_fraction);
  EXPECT_GT(v2.goodput_tok_per_s, dspark.goodput_tok_per_s);
  c.padded = false;  // the same planner without tiers runs no padding
  EXPECT_EQ(Simulate(c, TruthModel{}, trace)->padding_fraction, 0);
}

// --acceptance truth (SimConfig::plan_on_true_acceptance): every row that plans reads each
// request's true curve. Our planner on tiers then is the oracle on tiers, to the bit (on a V2
// truth, with the truth as the planner's model, nothing else tells them apart), and DSpark's
// row plans on the same knowledge: its verify lengths change.
TEST(Tiers, TrueAcceptanceGivesEveryRowTheOraclesKnowledge) {
  const auto trace = Slice(1500);
  SimConfig c = Small();
  c.static_k = 1;
  c.stale_steps = 1;
  c.token_tiers = SglangDefaultTiers(c.max_batch_per_rank, c.k_max);
  auto run = [&](VerifyMode verify, bool knows) {
    c.verify = verify;
    c.padded = verify != VerifyMode::kDsparkFill;  // a DSpark row pads to its own tier
    c.plan_on_true_acceptance = knows;
    return *Simulate(c, TruthModel{}, trace);
  };
  const RunResult oracle = run(VerifyMode::kOracle, false);
  const RunResult estimated = run(VerifyMode::kGoodput, false);
  const RunResult knowing = run(VerifyMode::kGoodput, true);
  EXPECT_EQ(knowing.steps, oracle.steps);
  EXPECT_EQ(knowing.tokens, oracle.tokens);
  EXPECT_EQ(knowing.goodput_tok_per_s, oracle.goodput_tok_per_s);
  EXPECT_NE(knowing.tokens, estimated.tokens);
  const RunResult dspark_knowing = run(VerifyMode::kDsparkFill, true);
  const RunResult dspark_estimated = run(VerifyMode::kDsparkFill, false);
  EXPECT_NE(dspark_knowing.tokens, dspark_estimated.tokens);
}

// --stale_steps: 0 is today's replay; a planner N steps behind still plans every step (requests
// it has not seen run the default length) and the run differs.
TEST(Stale, ZeroIsTodayAndStalePlansStillRun) {
  const auto trace = Slice(600);
  SimConfig c = Small();
  c.verify = VerifyMode::kGoodput;
  c.static_k = 1;
  const RunResult today = *Simulate(c, TruthModel{}, trace);
  c.stale_steps = 0;
  const RunResult zero = *Simulate(c, TruthModel{}, trace);
  EXPECT_EQ(zero.steps, today.steps);
  EXPECT_EQ(zero.sim_time_s, today.sim_time_s);
  for (int n : {1, 2}) {
    c.stale_steps = n;
    for (VerifyMode v : {VerifyMode::kGoodput, VerifyMode::kDspark, VerifyMode::kOracle}) {
      c.verify = v;
      absl::StatusOr<RunResult> r = Simulate(c, TruthModel{}, trace);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_GT(r->requests_finished, 0);
      if (v == VerifyMode::kGoodput) {
        EXPECT_NE(r->sim_time_s, today.sim_time_s) << n;
        EXPECT_GT(r->mean_verify_len, 0);
      }
    }
  }
}

// The lag model: with lag 1 a finished request stays in the batch the engine scheduled before it
// learned, charged and emitting nothing, so a static row runs wasted tokens that it runs none of
// without lag; every request still finishes.
TEST(Stale, FinishedRequestsRunUntilTheEngineLearns) {
  const auto trace = Slice(800);
  SimConfig c = Small();
  c.static_k = 2;
  const RunResult fresh = *Simulate(c, TruthModel{}, trace);
  c.stale_steps = 1;
  const RunResult lagged = *Simulate(c, TruthModel{}, trace);
  EXPECT_EQ(fresh.wasted_token_fraction, 0.0);
  EXPECT_GT(lagged.wasted_token_fraction, 0.0);
  EXPECT_LT(lagged.wasted_token_fraction, 0.05);
  EXPECT_LT(lagged.goodput_tok_per_s, fresh.goodput_tok_per_s);
}

// Planning on the predicted state (lag.h) rather than on the last state seen: caps that count the
// pending steps' tokens and gains that count the chance a draft can still emit leave fewer
// wasted verify tokens, and every part switched off plans differently from all of them on.
TEST(Stale, PredictionWastesFewerTokens) {
  const auto trace = Slice(1500);
  SimConfig c = Small();
  c.verify = VerifyMode::kGoodput;
  c.static_k = 2;
  c.stale_steps = 1;
  c.tpot_slo_us = 60000;  // about the static tail here, so the floors act
  c.lag_predict = kPredictAll;
  const RunResult predicted = *Simulate(c, TruthModel{}, trace);
  c.lag_predict = kPredictNone;
  const RunResult seen = *Simulate(c, TruthModel{}, trace);
  EXPECT_LT(predicted.wasted_token_fraction, seen.wasted_token_fraction);
  for (uint32_t part : {kPredictContext, kPredictCap, kPredictGain, kPredictSlo}) {
    c.lag_predict = kPredictAll & ~part;
    EXPECT_NE(Simulate(c, TruthModel{}, trace)->tokens, predicted.tokens) << part;
  }
}

// The step bound holds: on the V2 truth no row's plans expect more tokens per second than the
// bound on any of its steps, the oracle (true acceptance) included, so every row's ratio is >= 1,
// and the rows that plan with less knowledge sit further below it.
TEST(StepBound, IsAtLeastEveryPlanOnTheV2Truth) {
  const auto trace = Slice(700);
  SimConfig c = Small();
  c.static_k = 2;
  c.padded = true;
  c.step_bound = true;
  c.token_tiers = SglangDefaultTiers(c.max_batch_per_rank, c.k_max);
  TruthModel truth;
  truth.global.step_overhead_us += truth.global.draft_per_step_us;  // a block draft
  truth.global.draft_per_step_us = 0;
  truth.block_draft = true;
  std::vector<double> ratios;
  for (VerifyMode v : {VerifyMode::kStatic, VerifyMode::kDsparkFill, VerifyMode::kGoodput, VerifyMode::kOracle}) {
    c.verify = v;
    c.max_step_slack = v == VerifyMode::kOracle ? -1 : 0.03;
    const RunResult r = *Simulate(c, truth, trace);
    EXPECT_GE(r.step_bound_over_expected, 1.0) << VerifyModeName(v);
    EXPECT_NEAR(r.expected_tok_per_s, r.goodput_tok_per_s, 0.03 * r.goodput_tok_per_s) << VerifyModeName(v);
    ratios.push_back(r.step_bound_over_expected);
  }
  EXPECT_GT(ratios[0], ratios[3]);  // static k sits further below the bound than the oracle
}

TEST(Tiers, BadTiersAndStalenessAreErrorsNamingTheValue) {
  const auto trace = Slice(10);
  SimConfig c = Small();
  c.padded = true;
  c.verify = VerifyMode::kGoodput;
  c.token_tiers = {16, 8};
  absl::StatusOr<RunResult> r = Simulate(c, TruthModel{}, trace);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tier 8 (position 2)"), std::string::npos) << r.status();
  c.token_tiers = {0};
  r = Simulate(c, TruthModel{}, trace);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tier 0"), std::string::npos) << r.status();
  c.token_tiers = {};
  c.stale_steps = 65;
  r = Simulate(c, TruthModel{}, trace);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--stale_steps = 65"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace dpbalance::replay
