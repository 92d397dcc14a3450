// One rank's per-step planner compute: Summarize + Decide (over all ranks' summaries) + Assign.
// The other ranks' summaries are built beforehand, as the all-gather would deliver them.
// Targets: dp:64/reqs:64 <= 20 us, dp:256/reqs:256 <= 200 us on the 2-core dev box.
// BM_SimulateGrid: what a model with a kernel grid adds per step and kernel path.
// BM_Route: one request routed by the runtime Router (what the router ABI's `route` runs).
#include <cmath>
#include <random>
#include <string>

#include "benchmark/benchmark.h"
#include "dpbalance/kernel_grid.h"
#include "dpbalance/planner.h"
#include "dpbalance/routing.h"

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

// An instance of `dp` ranks with `reqs` requests each; every rank's summary built, as the
// all-gather would deliver them to rank 0.
struct Instance {
  Planner planner;
  std::vector<std::vector<PlanRequest>> batches;
  std::vector<RankSummary> summaries;

  explicit Instance(benchmark::State& state, const CostModel& model = CostModel::PublishedV2(),
                    bool uniform_per_rank = false, bool tiers = false)
      : planner(*Planner::Create(Config(static_cast<int>(state.range(0)), uniform_per_rank, tiers),
                                 model)) {
    const int dp = static_cast<int>(state.range(0));
    std::mt19937_64 rng(1);
    summaries.resize(dp);
    for (int r = 0; r < dp; ++r) {
      batches.push_back(RandomBatch(rng, static_cast<int>(state.range(1)), 7));
      if (!planner.Summarize(r, batches.back(), -1, &summaries[r]).ok()) state.SkipWithError("sum");
    }
    // Rank 0 is the one measured: its planner keeps its own batch's state.
    if (!planner.Summarize(0, batches[0], -1, &summaries[0]).ok()) state.SkipWithError("sum");
  }
  static PlannerConfig Config(int dp, bool uniform_per_rank, bool tiers) {
    PlannerConfig c;
    c.num_ranks = dp;
    c.k_max = 7;
    c.uniform_per_rank = uniform_per_rank;
    if (tiers) {  // SGLang's CUDA-graph batch sizes up to 64 (the replay's), 8 tokens each
      c.global.padded_tokens = true;
      for (int b = 1; b <= 8; ++b) c.token_tiers.push_back(8 * b);
      for (int b = 10; b <= 32; b += 2) c.token_tiers.push_back(8 * b);
      for (int b = 40; b <= 64; b += 4) c.token_tiers.push_back(8 * b);
    }
    return c;
  }
};

// The measured loop: rank 0's Summarize, Decide over every summary, Assign.
void PlanRankZero(benchmark::State& state, Instance& in) {
  std::vector<int32_t> verify_len(in.batches[0].size());
  for (auto _ : state) {
    if (!in.planner.Summarize(0, in.batches[0], -1, &in.summaries[0]).ok()) {
      state.SkipWithError("summarize");
    }
    absl::StatusOr<GlobalDecision> d = in.planner.Decide(in.summaries);
    if (!d.ok()) state.SkipWithError("decide");
    if (!in.planner.Assign(*d, absl::MakeSpan(verify_len)).ok()) state.SkipWithError("assign");
    benchmark::DoNotOptimize(verify_len.data());
  }
}

void BM_PlanOneRank(benchmark::State& state) {
  Instance in(state);
  PlanRankZero(state, in);
  state.counters["summary_bytes"] = sizeof(RankSummary);
}

// The same with a model fitted by dpbalance-calibrate with a kernel grid (docs/generated), whose
// planner simulates the rank's launch once per step and kernel path.
void BM_PlanOneRankGridModel(benchmark::State& state, const char* model_file, bool uniform) {
  absl::StatusOr<CostModel> model =
      CostModel::FromFile(std::string(DPB_SOURCE_DIR) + "/docs/generated/" + model_file);
  if (!model.ok()) {
    state.SkipWithError(std::string(model.status().message()).c_str());
    return;
  }
  Instance in(state, *model, uniform);
  PlanRankZero(state, in);
}
BENCHMARK_CAPTURE(BM_PlanOneRankGridModel, packed, "model_packed.json", false)
    ->ArgNames({"dp", "reqs"})->Args({64, 32})->Args({256, 256})->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_PlanOneRankGridModel, gqa, "model_gqa.json", false)
    ->ArgNames({"dp", "reqs"})->Args({64, 32})->Args({256, 256})->Unit(benchmark::kMicrosecond);
// One verify length per rank (granularity=rank): each level a rank may take is simulated.
BENCHMARK_CAPTURE(BM_PlanOneRankGridModel, packed_per_rank, "model_packed.json", true)
    ->ArgNames({"dp", "reqs"})->Args({64, 32})->Unit(benchmark::kMicrosecond);

// Token tiers (padded mode, SGLang's tiers): each tier's barrier swept over every rank's
// fill-or-pad points (SweepTiers).
void BM_PlanOneRankTiers(benchmark::State& state) {
  Instance in(state, CostModel::PublishedV2(), /*uniform_per_rank=*/false, /*tiers=*/true);
  PlanRankZero(state, in);
}
BENCHMARK(BM_PlanOneRankTiers)
    ->ArgNames({"dp", "reqs"})->Args({64, 32})->Args({64, 64})->Unit(benchmark::kMicrosecond);

void BM_PlanOneRankPerRankGranularity(benchmark::State& state) {
  Instance in(state, CostModel::PublishedV2(), /*uniform_per_rank=*/true);
  PlanRankZero(state, in);
}
BENCHMARK(BM_PlanOneRankPerRankGranularity)
    ->ArgNames({"dp", "reqs"})->Args({64, 64})->Args({256, 256})->Unit(benchmark::kMicrosecond);

// The phases alone, to see where the time goes.
void BM_Phase(benchmark::State& state, int phase) {
  Instance in(state);
  absl::StatusOr<GlobalDecision> d = in.planner.Decide(in.summaries);
  if (!d.ok()) state.SkipWithError("decide");
  std::vector<int32_t> verify_len(in.batches[0].size());
  for (auto _ : state) {
    if (phase == 0) {
      benchmark::DoNotOptimize(in.planner.Summarize(0, in.batches[0], -1, &in.summaries[0]).ok());
    } else if (phase == 1) {
      benchmark::DoNotOptimize(in.planner.Decide(in.summaries).ok());
    } else {
      benchmark::DoNotOptimize(in.planner.Assign(*d, absl::MakeSpan(verify_len)).ok());
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

// One simulation of a rank's kernel launch (a grid model's cost per step and kernel path):
// the verify launch of `reqs` requests at q = 4, every grid term or one makespan.
void BM_SimulateGrid(benchmark::State& state) {
  const bool packed = state.range(0) == 1;
  const KernelGrid grid = *KernelGrid::Named(packed ? "fa2-packed-h200" : "fa2-gqa-h200");
  std::mt19937_64 rng(1);
  std::vector<RequestLoad> batch;
  for (const PlanRequest& r : RandomBatch(rng, static_cast<int>(state.range(1)), 7)) {
    batch.push_back({r.ctx_tokens, 4});
  }
  const unsigned terms = state.range(2) == 1 ? ~0u : 1u << kGridMakespan0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(SimulateGrid(grid, batch, /*single_query_launch=*/false, terms));
  }
  state.counters["ctas"] = SimulateGrid(grid, batch, false, 0)[kGridCtas];
}
BENCHMARK(BM_SimulateGrid)
    ->ArgNames({"packed", "reqs", "all_terms"})
    ->Args({1, 32, 0})
    ->Args({1, 32, 1})
    ->Args({0, 32, 0})
    ->Args({0, 32, 1})
    ->Args({0, 64, 1})
    ->Unit(benchmark::kMicrosecond);

// One route over `dp` ranks of 32 Mooncake-like requests each: D, E with the published V2 (its
// two maxima) and E with a per-rank model (V2's weights without the published form).
void BM_Route(benchmark::State& state) {
  const int which = static_cast<int>(state.range(0)), dp = static_cast<int>(state.range(1));
  RoutingConfig c;
  c.strategy = which == 0 ? RoutingStrategy::kDualPath : RoutingStrategy::kCostAware;
  const CostModel v2 = CostModel::PublishedV2();
  Router router = *Router::Create(c, dp, which == 2 ? *CostModel::Create(v2.weights_us(), "fit") : v2);
  std::mt19937_64 rng(3);
  std::vector<RankLoad> loads(dp);
  for (RankLoad& l : loads) {
    l.capacity_tokens = 1 << 22;
    for (const PlanRequest& r : RandomBatch(rng, 32, 7)) {
      l.num_requests += 1;
      l.ctx_tokens += r.ctx_tokens;
      l.reserved_tokens += r.ctx_tokens + 300;
      l.agg.Add({r.ctx_tokens, 4});
    }
  }
  for (auto _ : state) benchmark::DoNotOptimize(router.Route({5000, 300}, loads).ok());
}
BENCHMARK(BM_Route)
    ->ArgNames({"E", "dp"})  // E: 0 = routing D, 1 = E published V2, 2 = E per-rank model
    ->ArgsProduct({{0, 1, 2}, {64, 256}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace dpbalance

BENCHMARK_MAIN();
