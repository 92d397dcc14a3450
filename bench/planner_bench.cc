// One rank's per-step planner compute: Summarize + Decide (over all ranks' summaries) + Assign.
// The other ranks' summaries are built beforehand, as the all-gather would deliver them.
// Targets (issue 2): dp:64/reqs:64 <= 20 us, dp:256/reqs:256 <= 200 us on the 2-core dev box.
#include <cmath>
#include <random>

#include "benchmark/benchmark.h"
#include "dpbalance/planner.h"

namespace dpbalance {
namespace {

std::vector<PlanRequest> RandomBatch(std::mt19937_64& rng, int n, int k_max) {
  std::lognormal_distribution<double> ctx(std::log(7000), 1.2);  // Mooncake-like contexts
  std::normal_distribution<double> shift(0, 1);
  const auto profile = MtpK8ConditionalProfile();
  std::vector<PlanRequest> b(n);
  for (PlanRequest& r : b) {
    r.ctx_tokens = std::min<int64_t>(131072, static_cast<int64_t>(ctx(rng)));
    r.k_cap = k_max;
    r.acceptance = *AcceptanceCurve::FromConditional(ShiftedProfile(profile, shift(rng)));
  }
  return b;
}

void BM_PlanOneRank(benchmark::State& state) {
  const int dp = static_cast<int>(state.range(0));
  const int reqs = static_cast<int>(state.range(1));
  PlannerConfig c;
  c.num_ranks = dp;
  c.k_max = 7;
  Planner planner = *Planner::Create(c, CostModel::PublishedV2());
  std::mt19937_64 rng(1);
  std::vector<RankSummary> summaries(dp);
  std::vector<std::vector<PlanRequest>> batches;
  for (int r = 0; r < dp; ++r) {
    batches.push_back(RandomBatch(rng, reqs, c.k_max));
    if (!planner.Summarize(r, batches.back(), -1, &summaries[r]).ok()) state.SkipWithError("sum");
  }
  std::vector<int32_t> verify_len(reqs);
  for (auto _ : state) {
    if (!planner.Summarize(0, batches[0], -1, &summaries[0]).ok()) state.SkipWithError("summarize");
    absl::StatusOr<GlobalDecision> d = planner.Decide(summaries);
    if (!d.ok()) state.SkipWithError("decide");
    if (!planner.Assign(*d, absl::MakeSpan(verify_len)).ok()) state.SkipWithError("assign");
    benchmark::DoNotOptimize(verify_len.data());
  }
  state.counters["summary_bytes"] = sizeof(RankSummary);
}
// The phases alone, to see where the time goes.
void BM_Phase(benchmark::State& state, int phase) {
  const int dp = static_cast<int>(state.range(0));
  const int reqs = static_cast<int>(state.range(1));
  PlannerConfig c;
  c.num_ranks = dp;
  c.k_max = 7;
  Planner planner = *Planner::Create(c, CostModel::PublishedV2());
  std::mt19937_64 rng(1);
  std::vector<RankSummary> summaries(dp);
  std::vector<std::vector<PlanRequest>> batches;
  for (int r = 0; r < dp; ++r) {
    batches.push_back(RandomBatch(rng, reqs, c.k_max));
    if (!planner.Summarize(r, batches.back(), -1, &summaries[r]).ok()) state.SkipWithError("sum");
  }
  if (!planner.Summarize(0, batches[0], -1, &summaries[0]).ok()) state.SkipWithError("summarize");
  absl::StatusOr<GlobalDecision> d = planner.Decide(summaries);
  std::vector<int32_t> verify_len(reqs);
  for (auto _ : state) {
    if (phase == 0) {
      benchmark::DoNotOptimize(planner.Summarize(0, batches[0], -1, &summaries[0]).ok());
    } else if (phase == 1) {
      benchmark::DoNotOptimize(planner.Decide(summaries).ok());
    } else {
      benchmark::DoNotOptimize(planner.Assign(*d, absl::MakeSpan(verify_len)).ok());
    }
  }
}
BENCHMARK_CAPTURE(BM_Phase, summarize, 0)->ArgNames({"dp", "reqs"})->Args({64, 64})->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Phase, decide, 1)->ArgNames({"dp", "reqs"})->Args({64, 64})->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Phase, assign, 2)->ArgNames({"dp", "reqs"})->Args({64, 64})->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_PlanOneRank)
    ->ArgNames({"dp", "reqs"})
    ->Args({8, 32})
    ->Args({64, 64})
    ->Args({256, 256})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace dpbalance

BENCHMARK_MAIN();
