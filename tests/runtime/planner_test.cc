#include "dpbalance/planner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>

#include "dpbalance/radix_sort.h"
#include "gtest/gtest.h"

namespace dpbalance {
namespace {

using Batches = std::vector<std::vector<PlanRequest>>;

// Draft depth argument of Objective: each rank drafts to its own deepest verify length before
// the barrier (a dense draft), instead of one depth paid globally.
constexpr int kPerRankDepth = -1;

// Instance objective of an assignment: expected tokens per microsecond with drafting `depth`
// (agreed by the instance), or kPerRankDepth.
double Objective(const Batches& b, const std::vector<std::vector<int32_t>>& k, int depth,
                 const CostModel& m, const GlobalCost& g) {
  double gain = 0, tokens = 0, barrier = 0;
  for (size_t r = 0; r < b.size(); ++r) {
    BatchAggregates a;
    int rank_depth = 0;
    for (size_t i = 0; i < b[r].size(); ++i) {
      a.Add({b[r][i].ctx_tokens, 1 + k[r][i]});
      gain += b[r][i].acceptance.ExpectedTokens(k[r][i]);
      rank_depth = std::max(rank_depth, static_cast<int>(k[r][i]));
    }
    tokens += a.query_tokens;
    const double rank_draft = depth == kPerRankDepth ? g.draft_per_step_us * rank_depth : 0.0;
    barrier = std::max(barrier, m.AttentionUs(a) + rank_draft);
  }
  return gain / (barrier + g.StepUs(tokens, depth == kPerRankDepth ? 0 : depth));
}

// Calls fn(k, depth) for every assignment k[r][i] in [k_min, k_cap] of every request (depth: the
// largest length used).
template <typename Fn>
void ForEachAssignment(const Batches& b, Fn fn) {
  std::vector<std::pair<int, int>> idx;
  for (size_t r = 0; r < b.size(); ++r)
    for (size_t i = 0; i < b[r].size(); ++i) idx.push_back({static_cast<int>(r), static_cast<int>(i)});
  std::vector<std::vector<int32_t>> k(b.size());
  for (size_t r = 0; r < b.size(); ++r) {
    k[r].resize(b[r].size());
    for (size_t i = 0; i < b[r].size(); ++i) k[r][i] = b[r][i].k_min;
  }
  while (true) {
    int depth = 0;
    for (const auto& row : k)
      for (int32_t v : row) depth = std::max(depth, v);
    fn(k, depth);
    size_t p = 0;
    for (; p < idx.size(); ++p) {
      auto [r, i] = idx[p];
      if (k[r][i] < b[r][i].k_cap) {
        ++k[r][i];
        break;
      }
      k[r][i] = b[r][i].k_min;
    }
    if (p == idx.size()) break;
  }
}

// Exhaustive search over every request's verify length; an agreed depth is the largest length
// used (per_rank_depth: each rank's own).
double BruteForce(const Batches& b, const CostModel& m, const GlobalCost& g,
                  bool per_rank_depth = false) {
  double best = 0;
  ForEachAssignment(b, [&](const std::vector<std::vector<int32_t>>& k, int depth) {
    best = std::max(best, Objective(b, k, per_rank_depth ? kPerRankDepth : depth, m, g));
  });
  return best;
}

AcceptanceCurve RandomCurve(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0.3, 0.97);
  std::array<double, kMaxDraftLen> a;
  for (double& x : a) x = u(rng);
  return *AcceptanceCurve::FromConditional(a);
}

Batches RandomInstance(std::mt19937_64& rng, int ranks, int max_reqs, int k_max, bool floors) {
  std::uniform_int_distribution<int> nreq(1, max_reqs);
  std::lognormal_distribution<double> ctx(std::log(6000), 1.3);
  Batches b(ranks);
  for (auto& rank : b) {
    const int n = nreq(rng);
    for (int i = 0; i < n; ++i) {
      PlanRequest r;
      r.ctx_tokens = std::min<int64_t>(131000, static_cast<int64_t>(ctx(rng)));
      r.k_cap = static_cast<int32_t>(rng() % (k_max + 1));
      r.k_min = floors ? static_cast<int32_t>(rng() % (r.k_cap + 1)) / 2 : 0;
      r.acceptance = RandomCurve(rng);
      rank.push_back(r);
    }
  }
  return b;
}

// A rank's batch at its assigned verify lengths: the loads, with their query tokens and
// expected emitted tokens added to `tokens` and `gain` (either may be null).
std::vector<RequestLoad> AssignedLoads(const std::vector<PlanRequest>& batch,
                                       const std::vector<int32_t>& verify_len, int64_t* tokens,
                                       double* gain) {
  std::vector<RequestLoad> loads;
  for (size_t i = 0; i < batch.size(); ++i) {
    loads.push_back({batch[i].ctx_tokens, 1 + verify_len[i]});
    if (tokens) *tokens += 1 + verify_len[i];
    if (gain) *gain += batch[i].acceptance.ExpectedTokens(verify_len[i]);
  }
  return loads;
}

GlobalCost RandomGlobal(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0, 1);
  GlobalCost g;
  g.ffn_fixed_us = 20000 * u(rng);
  g.ffn_per_token_us = 5 * u(rng);
  g.draft_per_step_us = 2000 * u(rng);
  return g;
}

// A planner config for `ranks` ranks with a random draft limit (1..kMaxDraftLen), default
// length (0..k_max) and global costs.
PlannerConfig RandomConfig(std::mt19937_64& rng, int ranks) {
  PlannerConfig c;
  c.num_ranks = ranks;
  c.k_max = 1 + static_cast<int>(rng() % kMaxDraftLen);
  c.default_k = static_cast<int>(rng() % (c.k_max + 1));
  c.global = RandomGlobal(rng);
  return c;
}

CostModel RegimeModel() {
  // A fitted-style model: fixed cost, a kernel-path jump when any q > 1, critical-path term.
  CostModel::Weights w{};
  for (Regime r : {Regime::kSingleQuery, Regime::kMultiQuery}) {
    w[FeatureIndex(r, CostTerm::kConstant)] = 40;
    w[FeatureIndex(r, CostTerm::kQueryTokens)] = 3;
    w[FeatureIndex(r, CostTerm::kKeyTokens)] = 0.004;
    w[FeatureIndex(r, CostTerm::kMaxQueryKeyPairs)] = 0.01;
  }
  w[FeatureIndex(Regime::kMultiQuery, CostTerm::kConstant)] += 25;  // path switch when q > 1
  w[FeatureIndex(Regime::kMultiQuery, CostTerm::kQueryKeyPairs)] = 0.02;
  return *CostModel::Create(w, "regime");
}

CostModel CheaperVerifyPathModel() {
  CostModel::Weights w{};
  w[FeatureIndex(Regime::kSingleQuery, CostTerm::kConstant)] = 400;
  w[FeatureIndex(Regime::kMultiQuery, CostTerm::kConstant)] = 30;
  w[FeatureIndex(Regime::kBase, CostTerm::kQueryTokens)] = 4;
  w[FeatureIndex(Regime::kBase, CostTerm::kQueryKeyPairs)] = 0.002;
  return *CostModel::Create(w, "cheaper-verify-path");
}

struct BruteCase {
  const char* name;
  CostModel model;
};

// A random instance small enough for exhaustive search (2-4 ranks, 1-4 requests, k_max <= 4,
// at most 3e5 assignments) and its config; every third trial has floors.
std::pair<Batches, PlannerConfig> SmallCase(std::mt19937_64& rng, int trial) {
  while (true) {
    const int ranks = 2 + static_cast<int>(rng() % 3);
    const int k_max = 1 + static_cast<int>(rng() % 4);
    Batches b = RandomInstance(rng, ranks, 4, k_max, /*floors=*/trial % 3 == 0);
    double space = 1;
    for (auto& rank : b)
      for (auto& r : rank) space *= r.k_cap - r.k_min + 1;
    if (space > 3e5) continue;
    PlannerConfig c;
    c.num_ranks = ranks;
    c.k_max = k_max;
    c.default_k = std::min(3, k_max);
    c.global = RandomGlobal(rng);
    return {std::move(b), c};
  }
}

class PlannerBruteForce : public ::testing::TestWithParam<int> {};

// The planner's objective is within 1% of an exhaustive search on small instances.
TEST_P(PlannerBruteForce, WithinOnePercentOfExhaustive) {
  const CostModel model = GetParam() == 0 ? CostModel::PublishedV2() : RegimeModel();
  std::mt19937_64 rng(1000 + GetParam());
  int trials = 0;
  double worst = 1.0;
  while (trials < 60) {
    auto [b, c] = SmallCase(rng, trials++);
    Planner p = *Planner::Create(c, model);
    std::vector<int64_t> kv(c.num_ranks, -1);
    std::vector<std::vector<int32_t>> k;
    absl::StatusOr<GlobalDecision> d = p.PlanAll(b, kv, &k);
    ASSERT_TRUE(d.ok()) << d.status();
    const double got = Objective(b, k, d->draft_depth, model, c.global);
    const double best = BruteForce(b, model, c.global);
    ASSERT_GE(got, 0.99 * best) << "trial " << trials << " ranks " << c.num_ranks << " k_max " << c.k_max;
    worst = std::min(worst, got / best);
  }
  RecordProperty("worst_ratio_to_exhaustive", std::to_string(worst));
  std::printf("worst planner/exhaustive objective ratio over 60 instances: %.5f\n", worst);
}
INSTANTIATE_TEST_SUITE_P(Models, PlannerBruteForce, ::testing::Values(0, 1));

struct RankRun {
  std::vector<RankSummary> summaries;
  std::vector<GlobalDecision> decisions;
  std::vector<std::vector<int32_t>> k;
};

// Runs the three phases as separate ranks would: one Planner per rank.
RankRun RunAsRanks(const PlannerConfig& c, const CostModel& m, const Batches& b,
                   const std::vector<int64_t>& kv) {
  RankRun out;
  std::vector<Planner> planners;
  out.summaries.resize(b.size());
  for (size_t r = 0; r < b.size(); ++r) {
    planners.push_back(*Planner::Create(c, m));
    EXPECT_TRUE(planners[r].Summarize(static_cast<int>(r), b[r], kv[r], &out.summaries[r]).ok());
  }
  out.k.resize(b.size());
  for (size_t r = 0; r < b.size(); ++r) {
    absl::StatusOr<GlobalDecision> d = planners[r].Decide(out.summaries);
    EXPECT_TRUE(d.ok()) << d.status();
    out.decisions.push_back(*d);
    out.k[r].resize(b[r].size());
    EXPECT_TRUE(planners[r].Assign(*d, absl::MakeSpan(out.k[r])).ok());
  }
  return out;
}

TEST(PlannerProperties, DeterministicAndRespectsConstraintsOnRandomInstances) {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 40; ++trial) {
    const int ranks = 1 + static_cast<int>(rng() % 64);
    PlannerConfig c = RandomConfig(rng, ranks);
    c.global.padded_tokens = trial % 2 == 1;
    if (trial % 4 == 1) c.token_tiers = {8, 16, 32, 64, 128, 256, 512};
    const CostModel m = trial % 3 == 0 ? RegimeModel() : CostModel::PublishedV2();
    Batches b = RandomInstance(rng, ranks, 40, c.k_max, trial % 2 == 0);
    std::vector<int64_t> kv(ranks);
    for (auto& v : kv) v = (rng() % 3 == 0) ? static_cast<int64_t>(rng() % 30) : -1;
    const RankRun run = RunAsRanks(c, m, b, kv);
    const GlobalDecision& d0 = run.decisions[0];
    for (const GlobalDecision& d : run.decisions) {
      EXPECT_EQ(d, d0) << "ranks disagree on the decision";
    }
    for (int r = 0; r < ranks; ++r) {
      BatchAggregates a;
      int64_t extra = 0;
      for (size_t i = 0; i < b[r].size(); ++i) {
        const int32_t k = run.k[r][i];
        EXPECT_GE(k, b[r][i].k_min);
        EXPECT_LE(k, b[r][i].k_cap);
        EXPECT_LE(k, d0.draft_depth);
        extra += k - b[r][i].k_min;
        a.Add({b[r][i].ctx_tokens, 1 + k});
      }
      if (kv[r] >= 0) {
        EXPECT_LE(extra, kv[r]);
      }
      EXPECT_LE(m.AttentionUs(a), d0.barrier_us * (1 + 1e-5) + 1e-3);
      if (c.global.padded_tokens) {
        EXPECT_LE(a.query_tokens, d0.padded_rank_tokens);
      }
    }
    // The whole flow agrees with the single-process PlanAll.
    Planner all = *Planner::Create(c, m);
    std::vector<std::vector<int32_t>> k2;
    absl::StatusOr<GlobalDecision> d2 = all.PlanAll(b, kv, &k2);
    ASSERT_TRUE(d2.ok());
    EXPECT_EQ(*d2, d0);
    EXPECT_EQ(k2, run.k);
  }
}

// ABI v2's contract: every rank derives every rank's token total from the exchanged summaries
// alone (RankTokens), identically, and each rank's own lengths add up to exactly its total; the
// plan still respects floors, caps, the depth, the KV budget, the barrier and (padded) the tier.
// Exact totals trade the fill between knots for that; the plan must stay a good one: at least
// the static default's goodput, as the greedy fill's is (GoodputBeatsOrMatchesStaticDefault).
TEST(PlannerExactRankTokens, EveryRankDerivesEveryTotalAndItsOwnLengthsAddUpToIt) {
  std::mt19937_64 rng(2026);
  for (int trial = 0; trial < 60; ++trial) {
    const int ranks = 1 + static_cast<int>(rng() % 48);
    PlannerConfig c = RandomConfig(rng, ranks);
    c.exact_rank_tokens = true;
    c.global.padded_tokens = trial % 2 == 1;
    if (trial % 4 == 1) c.token_tiers = {8, 16, 32, 64, 128, 256, 512};
    c.agreed_draft_depth = trial % 5 != 2;
    c.order_by_gain = trial % 3 == 1;
    c.mode = trial % 7 == 3 ? PlanMode::kFill : PlanMode::kGoodput;
    const CostModel m = trial % 3 == 0 ? RegimeModel() : CostModel::PublishedV2();
    const Batches b = RandomInstance(rng, ranks, 40, c.k_max, trial % 2 == 0);
    std::vector<int64_t> kv(ranks);
    for (auto& v : kv) v = (rng() % 3 == 0) ? static_cast<int64_t>(rng() % 30) : -1;
    const RankRun run = RunAsRanks(c, m, b, kv);
    const GlobalDecision& d0 = run.decisions[0];
    Planner any = *Planner::Create(c, m);
    std::vector<int64_t> totals(ranks), again(ranks);
    any.RankTokens(run.summaries, d0, /*balanced=*/true, absl::MakeSpan(totals));
    any.RankTokens(run.summaries, run.decisions[ranks - 1], true, absl::MakeSpan(again));
    EXPECT_EQ(totals, again) << "trial " << trial;
    for (int r = 0; r < ranks; ++r) {
      BatchAggregates a;
      int64_t extra = 0;
      for (size_t i = 0; i < b[r].size(); ++i) {
        const int32_t k = run.k[r][i];
        EXPECT_GE(k, b[r][i].k_min);
        EXPECT_LE(k, b[r][i].k_cap);
        if (c.agreed_draft_depth) {
          EXPECT_LE(k, d0.draft_depth);
        }
        extra += k - std::max(b[r][i].k_min, c.mode == PlanMode::kFill ? DefaultVerifyLen(c.default_k, b[r][i].k_cap) : 0);
        a.Add({b[r][i].ctx_tokens, 1 + k});
      }
      if (c.global.padded_tokens) {  // every rank that can verify runs the agreed tier
        EXPECT_EQ(totals[r], run.summaries[r].max_depth > 0 ? d0.padded_rank_tokens
                                                            : int64_t{run.summaries[r].base_tokens})
            << "trial " << trial << " rank " << r;
        EXPECT_LE(static_cast<int64_t>(a.query_tokens), totals[r]) << "trial " << trial << " rank " << r;
      } else {
        EXPECT_EQ(static_cast<int64_t>(a.query_tokens), totals[r]) << "trial " << trial << " rank " << r;
      }
      if (kv[r] >= 0) {
        EXPECT_LE(extra, kv[r]);
      }
      if (c.agreed_draft_depth) {  // a rank between knots runs along the chord (planner.cc)
        EXPECT_LE(m.AttentionUs(a), d0.barrier_us * 1.01 + 1e-3) << "trial " << trial;
      }
      if (c.global.padded_tokens) {
        EXPECT_LE(a.query_tokens, d0.padded_rank_tokens);
      }
    }
    // Not balanced (an off arm): every rank runs its defaults, and says so.
    any.RankTokens(run.summaries, d0, /*balanced=*/false, absl::MakeSpan(totals));
    for (int r = 0; r < ranks; ++r) {
      int64_t def = 0;
      for (const PlanRequest& q : b[r]) def += 1 + DefaultVerifyLen(c.default_k, q.k_cap);
      EXPECT_EQ(totals[r], def);
    }
  }
}

// Budget granularity: the engine spreads a rank's verify budget over its requests by draft
// confidence, best first; with order_by_gain the planner's lengths are exactly that spread.
TEST(PlannerExactRankTokens, OrderByGainAssignsTheBudgetByAcceptance) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    PlannerConfig c = RandomConfig(rng, 4);
    c.exact_rank_tokens = true;
    c.order_by_gain = true;
    const Batches b = RandomInstance(rng, 4, 24, c.k_max, /*floors=*/false);
    const RankRun run = RunAsRanks(c, CostModel::PublishedV2(), b, {-1, -1, -1, -1});
    for (int r = 0; r < 4; ++r) {
      // Every verified draft position accepts at least as likely as every one left out.
      double lowest_in = 2, highest_out = -1;
      for (size_t i = 0; i < b[r].size(); ++i) {
        const int32_t k = run.k[r][i];
        if (k > 0) lowest_in = std::min(lowest_in, b[r][i].acceptance.Accept(k));
        if (k < b[r][i].k_cap && k < run.decisions[0].draft_depth) {
          highest_out = std::max(highest_out, b[r][i].acceptance.Accept(k + 1));
        }
      }
      if (highest_out >= 0 && lowest_in <= 1) {
        // Items left out at a knot boundary may tie with the last taken.
        EXPECT_LE(highest_out, lowest_in + 1e-6) << "trial " << trial << " rank " << r;
      }
    }
  }
}

// A model shaped like the H200 packed-rows fit (docs/generated/model_packed.json): fixed costs
// and simulated makespans of the kernel grid, whose waves and tails make a rank's time jump
// as verify tokens are added.
CostModel PackedGridModel() {
  CostModel::Weights w{};
  w[FeatureIndex(Regime::kBase, CostTerm::kConstant)] = 17;
  w[FeatureIndex(Regime::kMultiQuery, CostTerm::kConstant)] = 2;
  w[FeatureIndex(Regime::kMultiQuery, CostTerm::kNumRequests)] = 0.0135;
  w[FeatureIndex(Regime::kMultiQuery, CostTerm::kMaxKeyTokens)] = 0.0013;
  w[FeatureIndex(Regime::kMultiQuery, CostTerm::kGrid0) + kGridMakespan0] = 0.57;
  w[FeatureIndex(Regime::kMultiQuery, CostTerm::kGrid0) + kGridMakespan0 + 4] = 0.71;
  w[FeatureIndex(Regime::kSingleQuery, CostTerm::kGrid0) + kGridMakespan0] = 0.36;
  w[FeatureIndex(Regime::kSingleQuery, CostTerm::kGrid0) + kGridMakespan0 + 4] = 0.66;
  return *CostModel::Create(w, "packed-grid", *KernelGrid::Named("fa2-packed-h200"));
}

// With a kernel-grid model the planner moves simulated terms linearly between simulations; the
// barrier is a max over ranks, so a rank whose plan the line underestimates would raise it. Every
// rank's plan, simulated, must fit under the planned barrier (Assign re-simulates each rank's
// filled plan to keep it there), in both draft-depth modes, on both grids and with both grid
// simulations (priced as the planner simulates).
TEST(PlannerProperties, WithAKernelGridEveryRankFitsUnderThePlannedBarrier) {
  std::mt19937_64 rng(7);
  CostModel::Weights gw{};
  gw[FeatureIndex(Regime::kBase, CostTerm::kConstant)] = 20;
  gw[FeatureIndex(Regime::kBase, CostTerm::kGrid0) + kGridMakespan0 + 1] = 1.5;
  gw[FeatureIndex(Regime::kSingleQuery, CostTerm::kGrid0) + kGridCombine] = 0.2;
  const CostModel models[] = {PackedGridModel(),
                              *CostModel::Create(gw, "gqa-grid", *KernelGrid::Named("fa2-gqa-h200"))};
  int planned_extra = 0;
  for (int trial = 0; trial < 16; ++trial) {
    const int ranks = 4 + static_cast<int>(rng() % 13);
    PlannerConfig c = RandomConfig(rng, ranks);
    c.grid_simulation = trial >= 12 ? GridSimulation::kFast : GridSimulation::kReference;
    const CostModel m = models[trial % 2].WithGridSimulation(*c.grid_simulation);
    c.k_max = kMaxDraftLen;
    c.global.ffn_per_token_us = 0.5;
    c.agreed_draft_depth = trial % 4 < 2;
    c.uniform_per_rank = trial % 3 == 2;  // levels are priced by simulation: they fit exactly
    Batches b = RandomInstance(rng, ranks, 48, c.k_max, trial % 3 == 0);
    const std::vector<int64_t> kv(ranks, -1);
    const RankRun run = RunAsRanks(c, m, b, kv);
    const GlobalDecision& d = run.decisions[0];
    for (int r = 0; r < ranks; ++r) {
      std::vector<RequestLoad> loads;
      int rank_depth = 0;
      for (size_t i = 0; i < b[r].size(); ++i) {
        loads.push_back({b[r][i].ctx_tokens, 1 + run.k[r][i]});
        rank_depth = std::max(rank_depth, static_cast<int>(run.k[r][i]));
        planned_extra += run.k[r][i] - b[r][i].k_min;
      }
      const double rank_draft = c.agreed_draft_depth ? 0.0 : c.global.draft_per_step_us * rank_depth;
      EXPECT_LE(m.AttentionUs(loads) + rank_draft, d.barrier_us * (1 + 1e-5) + 1e-3)
          << "trial " << trial << " rank " << r << " of " << m.name();
      // The default plan (the TPOT guard's reference) is priced as simulated, on both grids.
      std::vector<RequestLoad> default_loads;
      int default_depth = 0;
      for (const PlanRequest& q : b[r]) {
        const int32_t k = DefaultVerifyLen(c.default_k, q.k_cap);
        default_loads.push_back({q.ctx_tokens, 1 + k});
        default_depth = std::max(default_depth, static_cast<int>(k));
      }
      const double default_draft =
          c.agreed_draft_depth ? 0.0 : c.global.draft_per_step_us * default_depth;
      EXPECT_NEAR(run.summaries[r].default_attention_us, m.AttentionUs(default_loads) + default_draft,
                  1e-5 * (m.AttentionUs(default_loads) + default_draft))
          << "trial " << trial << " rank " << r << " of " << m.name();
    }
  }
  EXPECT_GT(planned_extra, 0) << "no instance planned any extra verify work: the test is void";
}

// The planner prices with its own copy of the model, simulated as PlannerConfig::grid_simulation
// says, also after set_model (the online refit hands it a reference-simulated model).
TEST(Planner, PricesWithItsConfiguredGridSimulation) {
  PlannerConfig c;
  c.grid_simulation = GridSimulation::kFast;
  const CostModel given = PackedGridModel();
  absl::StatusOr<Planner> p = Planner::Create(c, given);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->model().grid_simulation(), GridSimulation::kFast);
  EXPECT_EQ(given.grid_simulation(), GridSimulation::kReference);
  p->set_model(given);
  EXPECT_EQ(p->model().grid_simulation(), GridSimulation::kFast);
  // Unset, the planner prices a model the way it carries (a fit under kFast says so in its file),
  // a reference model's head-major verify launches from sampled heads.
  absl::StatusOr<Planner> own = Planner::Create(PlannerConfig{}, given.WithGridSimulation(GridSimulation::kFast));
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->model().grid_simulation(), GridSimulation::kFast);
  own->set_model(given);
  EXPECT_EQ(own->model().grid_simulation(), GridSimulation::kSampledHeads);
  // Its summary's base price is the fast simulation's.
  // Mooncake-like contexts, 378 CTAs: a batch whose tail the two tie rules price 30% apart.
  std::vector<PlanRequest> batch(63);
  std::vector<RequestLoad> loads;
  std::mt19937_64 rng(43);
  std::lognormal_distribution<double> ctx(std::log(7000), 1.2);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].ctx_tokens = std::min<int64_t>(131072, 1 + static_cast<int64_t>(ctx(rng)));
    batch[i].k_min = batch[i].k_cap = 2;
    batch[i].acceptance = *AcceptanceCurve::FromConditional(MtpK8ConditionalProfile());
    loads.push_back({batch[i].ctx_tokens, 3});
  }
  RankSummary s;
  ASSERT_TRUE(p->Summarize(0, batch, -1, &s).ok());
  const CostModel fast = given.WithGridSimulation(GridSimulation::kFast);
  EXPECT_FLOAT_EQ(s.base_attention_us, static_cast<float>(fast.AttentionUs(loads)));
  // (and the batch is one the two simulations price apart, so the check can fail)
  EXPECT_NE(fast.AttentionUs(loads), given.AttentionUs(loads));
}

// By default the planner prices a reference model's head-major verify launch from sampled heads
// (GridSimulation::kSampledHeads), the model itself staying as it is.
TEST(Planner, PricesHeadMajorVerifyLaunchesFromSampledHeadsByDefault) {
  absl::StatusOr<CostModel> given = CostModel::FromSpec("v2+fa2-gqa-h200");
  ASSERT_TRUE(given.ok()) << given.status();
  absl::StatusOr<Planner> p = Planner::Create(PlannerConfig{}, *given);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->model().grid_simulation(), GridSimulation::kSampledHeads);
  EXPECT_EQ(given->grid_simulation(), GridSimulation::kReference);
  // 32 Mooncake-like requests verifying 2 drafts: 4,096 CTAs, of which 17 heads are simulated.
  std::vector<PlanRequest> batch(32);
  std::vector<RequestLoad> loads;
  std::mt19937_64 rng(47);
  std::lognormal_distribution<double> ctx(std::log(7000), 1.2);
  for (PlanRequest& r : batch) {
    r.ctx_tokens = std::min<int64_t>(131072, 1 + static_cast<int64_t>(ctx(rng)));
    r.k_min = r.k_cap = 2;
    r.acceptance = *AcceptanceCurve::FromConditional(MtpK8ConditionalProfile());
    loads.push_back({r.ctx_tokens, 3});
  }
  RankSummary s;
  ASSERT_TRUE(p->Summarize(0, batch, -1, &s).ok());
  const CostModel sampled = given->WithGridSimulation(GridSimulation::kSampledHeads);
  EXPECT_FLOAT_EQ(s.base_attention_us, static_cast<float>(sampled.AttentionUs(loads)));
  EXPECT_NE(sampled.AttentionUs(loads), given->AttentionUs(loads));  // so the check can fail
  // Told not to sample (DPB_GRID_SIM=exact), it prices as the model does.
  PlannerConfig c;
  c.sample_heads = false;
  absl::StatusOr<Planner> exact = Planner::Create(c, *given);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_EQ(exact->model().grid_simulation(), GridSimulation::kReference);
  ASSERT_TRUE(exact->Summarize(0, batch, -1, &s).ok());
  EXPECT_FLOAT_EQ(s.base_attention_us, static_cast<float>(given->AttentionUs(loads)));
}

// The planner's goodput at a barrier T of depth d, recomputed from the summaries alone: every rank
// sits on its frontier segment containing T (a step between single-item knots, the chord
// otherwise). Non-padded FFN, every summary usable.
double SweepValueAt(const std::vector<RankSummary>& sums, const GlobalCost& g, int d, double t) {
  double gain = 0, tokens = 0;
  for (const RankSummary& s : sums) {
    const int slot = std::min<int>(d, s.max_depth);
    const int first = slot > 0 ? s.knot_begin[slot - 1] : 0;
    const int n = slot > 0 ? s.num_knots[slot - 1] : 0;
    int k = 0;
    while (k < n && s.knot_attention_us[first + k] <= t) ++k;
    double c0 = s.base_attention_us, g0 = s.base_gain, t0 = 0;
    if (k > 0) {
      c0 = s.knot_attention_us[first + k - 1];
      g0 = s.knot_gain[first + k - 1];
      t0 = s.knot_tokens[first + k - 1];
    }
    double gr = g0, tr = t0;
    if (k < n && s.knot_tokens[first + k] - t0 > 1 && s.knot_attention_us[first + k] > c0) {
      const double f = (t - c0) / (s.knot_attention_us[first + k] - c0);
      gr += f * (s.knot_gain[first + k] - g0);
      tr += f * (s.knot_tokens[first + k] - t0);
    }
    gain += gr;
    tokens += s.base_tokens + tr;
  }
  return gain / (t + g.StepUs(tokens, d));
}

// Decide prunes its sweep with an upper bound and leaves unsorted the knots it proves useless.
// On DP64-sized instances its answer must equal the best over every depth and every candidate
// barrier (the floor, each knot cost above it), evaluated independently.
TEST(PlannerProperties, PrunedSweepFindsTheBestBarrierOfAFullSweep) {
  std::mt19937_64 rng(2024);
  int infinite_slopes = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const int ranks = 16 + static_cast<int>(rng() % 49);
    PlannerConfig c = RandomConfig(rng, ranks);
    // The third model prices the verify path below the decode path, so knot costs (a running
    // maximum) stay flat over several items: slopes of +inf, the bound's unbounded case.
    const CostModel m = trial % 3 == 0   ? RegimeModel()
                        : trial % 3 == 1 ? CostModel::PublishedV2()
                                         : CheaperVerifyPathModel();
    const Batches b = RandomInstance(rng, ranks, 64, c.k_max, trial % 4 == 0);
    const RankRun run = RunAsRanks(c, m, b, std::vector<int64_t>(ranks, -1));
    double floor_us = 0, default_barrier = 0;
    int depth_lo = 0;
    for (const RankSummary& s : run.summaries) {
      floor_us = std::max<double>(floor_us, s.base_attention_us);
      default_barrier = std::max<double>(default_barrier, s.default_attention_us);
      depth_lo = std::max<int>(depth_lo, s.min_depth);
    }
    double best = 0;
    for (int d = depth_lo; d <= std::max(depth_lo, c.k_max); ++d) {
      best = std::max(best, SweepValueAt(run.summaries, c.global, d, floor_us));
      if (default_barrier > floor_us) {
        best = std::max(best, SweepValueAt(run.summaries, c.global, d,
                                           static_cast<float>(default_barrier)));
      }
      for (const RankSummary& s : run.summaries) {
        const int slot = std::min<int>(d, s.max_depth);
        for (int k = 0; slot > 0 && k < s.num_knots[slot - 1]; ++k) {
          const double t = s.knot_attention_us[s.knot_begin[slot - 1] + k];
          if (t > floor_us) best = std::max(best, SweepValueAt(run.summaries, c.global, d, t));
        }
      }
    }
    EXPECT_NEAR(run.decisions[0].tokens_per_us, best, best * 1e-9) << "trial " << trial;
    for (const RankSummary& s : run.summaries) {
      for (int k = 0; k < kKnotPool; ++k) infinite_slopes += std::isinf(s.knot_max_slope[k]);
    }
  }
  EXPECT_GT(infinite_slopes, 0) << "the unbounded case was never exercised";
}

TEST(PlannerProperties, OffReproducesDefault) {
  std::mt19937_64 rng(4);
  PlannerConfig c;
  c.num_ranks = 8;
  c.mode = PlanMode::kOff;
  c.default_k = 3;
  Batches b = RandomInstance(rng, 8, 20, 7, false);
  const RankRun run = RunAsRanks(c, CostModel::PublishedV2(), b, std::vector<int64_t>(8, -1));
  for (int r = 0; r < 8; ++r)
    for (size_t i = 0; i < b[r].size(); ++i) EXPECT_EQ(run.k[r][i], std::min(3, b[r][i].k_cap));
  EXPECT_EQ(run.decisions[0].draft_depth, 3);
}

TEST(PlannerProperties, FillNeverRaisesTheDefaultBarrier) {
  std::mt19937_64 rng(8);
  const CostModel m = CostModel::PublishedV2();
  for (int trial = 0; trial < 30; ++trial) {
    PlannerConfig c;
    c.num_ranks = 16;
    c.mode = PlanMode::kFill;
    c.global = RandomGlobal(rng);
    Batches b = RandomInstance(rng, 16, 30, 7, false);
    double default_barrier = 0;
    for (auto& rank : b) {
      BatchAggregates a;
      for (auto& r : rank) a.Add({r.ctx_tokens, 1 + std::min(c.default_k, r.k_cap)});
      default_barrier = std::max(default_barrier, m.AttentionUs(a));
    }
    const RankRun run = RunAsRanks(c, m, b, std::vector<int64_t>(16, -1));
    for (int r = 0; r < 16; ++r) {
      BatchAggregates a;
      for (size_t i = 0; i < b[r].size(); ++i) {
        EXPECT_GE(run.k[r][i], std::min(c.default_k, b[r][i].k_cap));
        a.Add({b[r][i].ctx_tokens, 1 + run.k[r][i]});
      }
      EXPECT_LE(m.AttentionUs(a), default_barrier * (1 + 1e-5) + 1e-3);
    }
  }
}

TEST(PlannerProperties, GoodputBeatsOrMatchesStaticDefault) {
  std::mt19937_64 rng(21);
  const CostModel m = CostModel::PublishedV2();
  for (int trial = 0; trial < 30; ++trial) {
    PlannerConfig c;
    c.num_ranks = 32;
    c.global = RandomGlobal(rng);
    Batches b = RandomInstance(rng, 32, 40, 7, false);
    std::vector<std::vector<int32_t>> k, kdef(32);
    Planner p = *Planner::Create(c, m);
    absl::StatusOr<GlobalDecision> d = p.PlanAll(b, std::vector<int64_t>(32, -1), &k);
    ASSERT_TRUE(d.ok());
    for (int r = 0; r < 32; ++r)
      for (auto& q : b[r]) kdef[r].push_back(std::min(c.default_k, q.k_cap));
    EXPECT_GE(Objective(b, k, d->draft_depth, m, c.global),
              0.995 * Objective(b, kdef, c.default_k, m, c.global));
  }
}

// Step time of an assignment, priced independently of the planner: the slowest rank's attention
// plus the instance's FFN and draft time at `depth` (agreed) draft steps.
double StepTimeUs(const Batches& b, const std::vector<std::vector<int32_t>>& k, int depth,
                  const CostModel& m, const GlobalCost& g) {
  double tokens = 0, barrier = 0;
  for (size_t r = 0; r < b.size(); ++r) {
    BatchAggregates a;
    for (size_t i = 0; i < b[r].size(); ++i) a.Add({b[r][i].ctx_tokens, 1 + k[r][i]});
    tokens += a.query_tokens;
    barrier = std::max(barrier, m.AttentionUs(a));
  }
  return barrier + g.StepUs(tokens, depth);
}

// Exhaustive search for the best objective among assignments whose step time stays within
// `max_step_us` (the TPOT guard); an agreed depth is the largest length used.
double BruteForceGuarded(const Batches& b, const CostModel& m, const GlobalCost& g,
                         double max_step_us) {
  double best = 0;
  ForEachAssignment(b, [&](const std::vector<std::vector<int32_t>>& k, int depth) {
    if (StepTimeUs(b, k, depth, m, g) <= max_step_us) best = std::max(best, Objective(b, k, depth, m, g));
  });
  return best;
}

// The TPOT guard (PlannerConfig::max_step_slack): the planned step never exceeds (1 + slack) x
// the step of the engine's default plan (every request at min(default_k, k_cap), default_k draft
// steps), both priced here from the cost model, and the plan is within 1% of the best guarded
// assignment found by exhaustive search. Short defaults and tight slacks, so the unguarded
// optimum often breaks the guard.
TEST(PlannerTpotGuard, StepWithinSlackOfDefaultAndNearBestGuardedPlan) {
  for (int model_idx = 0; model_idx < 2; ++model_idx) {
    const CostModel model = model_idx == 0 ? CostModel::PublishedV2() : RegimeModel();
    std::mt19937_64 rng(5000 + model_idx);
    int guard_binds = 0;  // trials where the unguarded plan breaks the guard
    for (int trial = 0; trial < 60; ++trial) {
      auto [b, c] = SmallCase(rng, 1);  // trial 1: no floors, so the default plan is feasible
      c.max_step_slack = std::array<double, 3>{0.0, 0.02, 0.1}[trial % 3];
      c.default_k = std::min(c.k_max, trial % 2);  // short defaults: the optimum drafts deeper
      std::vector<std::vector<int32_t>> kdef(b.size());
      for (size_t r = 0; r < b.size(); ++r)
        for (const PlanRequest& q : b[r]) kdef[r].push_back(std::min(c.default_k, q.k_cap));
      const double default_step = StepTimeUs(b, kdef, c.default_k, model, c.global);
      // Every fourth trial counts the plugin's own overhead per step (guard_overhead_us, 1% of
      // the default step here) against the guard: the planned step must leave room for it.
      c.guard_overhead_us = trial % 4 == 3 ? 0.01 * default_step : 0;
      const double max_step = default_step * (1 + c.max_step_slack) - c.guard_overhead_us;

      Planner p = *Planner::Create(c, model);
      std::vector<std::vector<int32_t>> k;
      absl::StatusOr<GlobalDecision> d = p.PlanAll(b, std::vector<int64_t>(c.num_ranks, -1), &k);
      ASSERT_TRUE(d.ok()) << d.status();
      SCOPED_TRACE(::testing::Message() << "model " << model_idx << " trial " << trial << " slack "
                                        << c.max_step_slack << " overhead "
                                        << c.guard_overhead_us);
      EXPECT_NEAR(d->default_step_us, default_step, 1e-5 * default_step);
      const double step = StepTimeUs(b, k, d->draft_depth, model, c.global);
      EXPECT_LE(step, max_step * (1 + 1e-6));
      const double best = BruteForceGuarded(b, model, c.global, max_step * (1 + 1e-9));
      EXPECT_GE(Objective(b, k, d->draft_depth, model, c.global), 0.99 * best);

      PlannerConfig free = c;
      free.max_step_slack = -1;
      Planner unguarded = *Planner::Create(free, model);
      std::vector<std::vector<int32_t>> ku;
      absl::StatusOr<GlobalDecision> du = unguarded.PlanAll(b, std::vector<int64_t>(c.num_ranks, -1), &ku);
      ASSERT_TRUE(du.ok());
      guard_binds += StepTimeUs(b, ku, du->draft_depth, model, c.global) > max_step * (1 + 1e-6);
    }
    EXPECT_GT(guard_binds, 10) << "the guard rarely mattered: the test shows little";
    std::printf("TPOT guard: the unguarded plan broke it in %d of 60 instances\n", guard_binds);
  }
}

// guard_overhead_us is part of what ranks must agree on, and a value out of 0..1e7 (or NaN) is
// refused naming it.
TEST(PlannerTpotGuard, OverheadIsHashedAndChecked) {
  PlannerConfig c;
  c.num_ranks = 2;
  c.max_step_slack = 0.03;
  PlannerConfig o = c;
  o.guard_overhead_us = 1700;
  EXPECT_TRUE(o.Validate().ok()) << o.Validate();
  EXPECT_NE(c.Hash(), o.Hash()) << "ranks that count different overheads must not agree";
  for (double bad : {-1.0, 2e7, std::nan("")}) {
    o.guard_overhead_us = bad;
    const absl::Status st = o.Validate();
    EXPECT_FALSE(st.ok()) << bad;
    EXPECT_NE(std::string(st.message()).find("guard_overhead_us"), std::string::npos) << st;
  }
}

// Measured overhead (PlannerConfig::guard_measured_overhead): the guard charges the configured
// overhead plus the largest `own_us` among the usable records, so the decision equals that of a
// planner configured with that sum as a constant; an excluded record's own_us is not read. The
// measured value must change the plan in some trials, or the test shows nothing.
TEST(PlannerTpotGuard, MeasuredOverheadIsTheLargestUsableOwnTime) {
  std::mt19937_64 rng(5100);
  int changed = 0;
  for (int trial = 0; trial < 80; ++trial) {
    const int ranks = 2 + trial % 3;
    const Batches b = RandomInstance(rng, ranks, 6, 5, false);
    PlannerConfig measured;
    measured.num_ranks = ranks;
    measured.k_max = 5;
    measured.default_k = 1 + trial % 2;
    measured.max_step_slack = 0.05;
    measured.guard_measured_overhead = true;
    measured.guard_overhead_us = trial % 2 == 0 ? 0 : 150;
    const CostModel model = CostModel::PublishedV2();
    Planner pm = *Planner::Create(measured, model);
    std::vector<RankSummary> recs(ranks);
    for (int r = 0; r < ranks; ++r) ASSERT_TRUE(pm.Summarize(r, b[r], -1, &recs[r]).ok());
    const int excluded = trial % 4 == 3 ? static_cast<int>(rng() % ranks) : -1;
    uint16_t largest = 0;
    for (int r = 0; r < ranks; ++r) {
      recs[r].own_us = static_cast<uint16_t>(rng() % 4000);
      if (r == excluded) {
        recs[r].flags &= ~kSummaryValid;
        recs[r].own_us = 65535;  // must not count: the record takes no part
      } else {
        largest = std::max(largest, recs[r].own_us);
      }
    }
    absl::StatusOr<GlobalDecision> dm = pm.Decide(recs);
    ASSERT_TRUE(dm.ok()) << dm.status();

    PlannerConfig fixed = measured;
    fixed.guard_measured_overhead = false;
    fixed.guard_overhead_us = measured.guard_overhead_us + largest;
    EXPECT_NE(fixed.Hash(), measured.Hash()) << "ranks must agree on whether own times count";
    Planner pf = *Planner::Create(fixed, model);
    std::vector<RankSummary> frecs(ranks);
    for (int r = 0; r < ranks; ++r) {
      ASSERT_TRUE(pf.Summarize(r, b[r], -1, &frecs[r]).ok());
      if (r == excluded) frecs[r].flags &= ~kSummaryValid;
    }
    absl::StatusOr<GlobalDecision> df = pf.Decide(frecs);
    ASSERT_TRUE(df.ok()) << df.status();
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " largest own_us " << largest);
    EXPECT_EQ(*dm, *df);

    fixed.guard_overhead_us = measured.guard_overhead_us;  // own times not counted
    Planner p0 = *Planner::Create(fixed, model);
    for (int r = 0; r < ranks; ++r) {
      ASSERT_TRUE(p0.Summarize(r, b[r], -1, &frecs[r]).ok());
      if (r == excluded) frecs[r].flags &= ~kSummaryValid;
    }
    absl::StatusOr<GlobalDecision> d0 = p0.Decide(frecs);
    ASSERT_TRUE(d0.ok());
    changed += !(*d0 == *dm);
  }
  EXPECT_GT(changed, 8) << "the measured overhead rarely changed a plan: the test shows little";
}

// The default guard (PlannerConfig::min_plan_gain): the guarded planner keeps every rank at
// min(default_k, k_cap) exactly when the unguarded plan's predicted goodput is at most (1 + margin)
// x the default plan's (priced here independently) and no floor is above default_k; otherwise
// its decision and lengths are the unguarded planner's, bit for bit. Run as separate ranks,
// every rank takes the same decision and RankTokens gives the default plan's tokens. Both
// outcomes must occur often, or the test shows nothing.
TEST(PlannerDefaultGuard, KeepsTheDefaultExactlyWhenThePlanDoesNotBeatItByTheMargin) {
  std::mt19937_64 rng(6100);
  int kept = 0, planned = 0, floors_block = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const CostModel m = trial % 2 ? CostModel::PublishedV2() : RegimeModel();
    PlannerConfig c = RandomConfig(rng, 4);
    c.max_step_slack = trial % 4 < 2 ? -1 : 0.03;
    c.agreed_draft_depth = trial % 5 != 0;  // every fifth: a dense draft, per-rank depths
    Batches b = RandomInstance(rng, 4, 12, c.k_max, /*floors=*/trial % 4 == 1);
    for (auto& rank : b)
      for (PlanRequest& r : rank) r.k_cap = std::min(r.k_cap, c.k_max);
    for (auto& rank : b)
      for (PlanRequest& r : rank) r.k_min = std::min(r.k_min, r.k_cap);
    if (trial % 7 < 3) {  // drafts that almost never pass: the default verifies what no plan would
      std::array<double, kMaxDraftLen> rare;
      rare.fill(0.002);
      for (auto& rank : b)
        for (size_t i = 0; i < rank.size(); i += 2) {
          rank[i].acceptance = *AcceptanceCurve::FromConditional(rare);
        }
    }
    const double margin = std::array<double, 3>{0.01, 0.05, 0.2}[trial % 3];
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " margin " << margin);
    std::vector<std::vector<int32_t>> kdef(b.size());
    bool floors_ok = true;
    for (size_t r = 0; r < b.size(); ++r) {
      for (const PlanRequest& q : b[r]) {
        kdef[r].push_back(DefaultVerifyLen(c.default_k, q.k_cap));
        floors_ok = floors_ok && q.k_min <= c.default_k;
      }
    }
    const double default_goodput =
        Objective(b, kdef, c.agreed_draft_depth ? c.default_k : kPerRankDepth, m, c.global);

    Planner free = *Planner::Create(c, m);
    std::vector<std::vector<int32_t>> kfree;
    absl::StatusOr<GlobalDecision> dfree = free.PlanAll(b, std::vector<int64_t>(4, -1), &kfree);
    ASSERT_TRUE(dfree.ok()) << dfree.status();
    EXPECT_FALSE(dfree->kept_default);
    EXPECT_NEAR(dfree->default_tokens_per_us, default_goodput, 1e-5 * default_goodput);

    PlannerConfig gc = c;
    gc.min_plan_gain = margin;
    EXPECT_NE(gc.Hash(), c.Hash()) << "ranks with different margins must not agree";
    Planner guarded = *Planner::Create(gc, m);
    std::vector<std::vector<int32_t>> kg;
    absl::StatusOr<GlobalDecision> dg = guarded.PlanAll(b, std::vector<int64_t>(4, -1), &kg);
    ASSERT_TRUE(dg.ok()) << dg.status();
    const bool beats = dfree->tokens_per_us > (1 + margin) * dfree->default_tokens_per_us;
    floors_block += !floors_ok && !beats;
    const bool keep = floors_ok && !beats;
    ASSERT_EQ(dg->kept_default, keep);
    if (keep) {
      ++kept;
      EXPECT_EQ(kg, kdef);
      EXPECT_EQ(dg->draft_depth, c.default_k);
      EXPECT_NEAR(dg->tokens_per_us, default_goodput, 1e-5 * default_goodput);
      EXPECT_NEAR(dg->step_us, dfree->default_step_us, 1e-6 * dfree->default_step_us);
    } else {
      ++planned;
      EXPECT_EQ(kg, kfree);
      EXPECT_EQ(*dg, *dfree);
    }

    const RankRun run = RunAsRanks(gc, m, b, std::vector<int64_t>(4, -1));
    for (const GlobalDecision& d : run.decisions) EXPECT_EQ(d, *dg) << "ranks disagree";
    EXPECT_EQ(run.k, kg);
    if (keep) {  // RankTokens: each rank's default lengths' tokens
      std::vector<int64_t> totals(4);
      guarded.RankTokens(run.summaries, *dg, /*balanced=*/true, absl::MakeSpan(totals));
      for (int r = 0; r < 4; ++r) {
        int64_t tokens = 0;
        for (int32_t v : kdef[r]) tokens += 1 + v;
        EXPECT_EQ(totals[r], tokens) << "rank " << r;
      }
    }
  }
  std::printf("default guard: kept %d, planned %d (%d only because a floor is above default_k)\n",
              kept, planned, floors_block);
  EXPECT_GE(kept, 15);
  EXPECT_GE(planned, 15);
  EXPECT_GE(floors_block, 1);
}

// A margin outside 0..10 (or NaN) is refused at Create, naming the value.
TEST(PlannerDefaultGuard, BadMarginIsAnErrorNamingIt) {
  for (double bad : {-0.1, 11.0, std::nan("")}) {
    PlannerConfig c;
    c.min_plan_gain = bad;
    absl::StatusOr<Planner> p = Planner::Create(c, CostModel::PublishedV2());
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_NE(p.status().message().find("min_plan_gain"), std::string::npos) << p.status();
  }
  PlannerConfig off;
  PlannerConfig zero = off;
  zero.min_plan_gain = 0;
  EXPECT_EQ(off.Hash(), zero.Hash());
}

// DeferralWeights against an independent pricing. With a model of per-request terms only (B,
// Q, C, K: no maxima, no hinges), a request's own attention is its terms at its default length,
// and the shared part is the instance step's global cost over the ranks, split equally; the
// weight is its cost per expected token over the batch's. The weights' mean weighted by the
// tokens is 1; a longer context or a lower acceptance (the rest equal) weighs more; identical
// requests weigh 1; fewer than two requests weigh 1.
TEST(PlannerValueDeferral, WeightsAreEachRequestsCostPerTokenOverItsRanks) {
  CostModel::Weights wt{};
  for (Regime r : {Regime::kSingleQuery, Regime::kMultiQuery}) {
    wt[FeatureIndex(r, CostTerm::kNumRequests)] = 7;
    wt[FeatureIndex(r, CostTerm::kQueryTokens)] = 3;
    wt[FeatureIndex(r, CostTerm::kKeyTokens)] = 0.004;
  }
  wt[FeatureIndex(Regime::kMultiQuery, CostTerm::kQueryKeyPairs)] = 0.02;
  const CostModel m = *CostModel::Create(wt, "per-request");
  std::mt19937_64 rng(7100);
  int clamped = 0, unclamped = 0;
  for (int trial = 0; trial < 200; ++trial) {
    PlannerConfig c = RandomConfig(rng, 1 + static_cast<int>(rng() % 8));
    const Batches b = RandomInstance(rng, 1, 24, c.k_max, false);
    const std::vector<PlanRequest>& batch = b[0];
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " n " << batch.size());
    const std::vector<double> w =
        DeferralWeights(m, c.global, c.num_ranks, c.default_k, c.agreed_draft_depth, batch);
    ASSERT_EQ(w.size(), batch.size());
    if (batch.size() < 2) {
      EXPECT_EQ(w, std::vector<double>(batch.size(), 1.0));
      continue;
    }
    bool multi = false;
    double q_sum = 0;
    for (const PlanRequest& r : batch) {
      multi = multi || DefaultVerifyLen(c.default_k, r.k_cap) > 0;
      q_sum += 1 + DefaultVerifyLen(c.default_k, r.k_cap);
    }
    const double shared =
        c.global.StepUs(q_sum * c.num_ranks, c.default_k) / c.num_ranks / batch.size();
    std::vector<double> cost, tokens;
    double cost_sum = 0, tokens_sum = 0;
    for (const PlanRequest& r : batch) {
      const int k = DefaultVerifyLen(c.default_k, r.k_cap);
      const double q = 1 + k, ctx = static_cast<double>(r.ctx_tokens);
      cost.push_back(7 + 3 * q + 0.004 * ctx + (multi ? 0.02 * q * ctx : 0) + shared);
      tokens.push_back(r.acceptance.ExpectedTokens(k));
      cost_sum += cost.back();
      tokens_sum += tokens.back();
    }
    double weighted_tokens = 0;
    bool any_clamped = false;
    for (size_t i = 0; i < batch.size(); ++i) {
      const double want = (cost[i] / tokens[i]) / (cost_sum / tokens_sum);
      any_clamped = any_clamped || want < 0.25 || want > 4;
      EXPECT_NEAR(w[i], std::clamp(want, 0.25, 4.0), 1e-9 * want) << "request " << i;
      weighted_tokens += w[i] * tokens[i];
    }
    clamped += any_clamped;
    unclamped += !any_clamped;
    if (!any_clamped) {
      EXPECT_NEAR(weighted_tokens, tokens_sum, 1e-9 * tokens_sum);
    }
  }
  // Both cases occur (the lognormal contexts span two orders of magnitude).
  EXPECT_GE(clamped, 10);
  EXPECT_GE(unclamped, 50);

  // The direction, on any model: one request changed, the rest equal.
  for (const CostModel& model : {m, CostModel::PublishedV2(), RegimeModel()}) {
    PlannerConfig c;
    c.num_ranks = 4;
    std::vector<PlanRequest> batch(6);
    std::array<double, kMaxDraftLen> rates;
    rates.fill(0.8);
    for (PlanRequest& r : batch) {
      r.ctx_tokens = 4000;
      r.k_cap = 7;
      r.acceptance = *AcceptanceCurve::FromConditional(rates);
    }
    for (double w : DeferralWeights(model, c.global, 4, 3, true, batch)) EXPECT_NEAR(w, 1.0, 1e-12);
    batch[0].ctx_tokens = 40000;  // a long context re-read every step
    rates.fill(0.3);
    batch[1].acceptance = *AcceptanceCurve::FromConditional(rates);  // few tokens a step
    const std::vector<double> w = DeferralWeights(model, c.global, 4, 3, true, batch);
    EXPECT_GT(w[0], w[2]) << model.name();
    EXPECT_GT(w[1], w[2]) << model.name();
    EXPECT_NEAR(w[2], w[5], 1e-12);
  }
}

// With value_deferral the planner maximises the valued objective: each request's expected tokens
// times its weight, per microsecond. On small instances it is within 1% of an exhaustive search
// of that objective (the batches valued by DeferralWeights, searched as plain tokens), and it
// plans differently from the unvalued planner on some of them (or the test shows nothing).
TEST(PlannerValueDeferral, WithinOnePercentOfTheExhaustiveValuedOptimum) {
  std::mt19937_64 rng(7200);
  int differs = 0;
  double worst = 1.0;
  for (int trial = 0; trial < 60; ++trial) {
    const CostModel model = trial % 2 ? CostModel::PublishedV2() : RegimeModel();
    auto [b, c] = SmallCase(rng, trial);
    Batches valued = b;
    for (auto& rank : valued) {
      const std::vector<double> w =
          DeferralWeights(model, c.global, c.num_ranks, c.default_k, c.agreed_draft_depth, rank);
      for (size_t i = 0; i < rank.size(); ++i) rank[i].acceptance = rank[i].acceptance.Valued(w[i]);
    }
    PlannerConfig vc = c;
    vc.value_deferral = true;
    EXPECT_NE(vc.Hash(), c.Hash()) << "ranks that value differently must not agree";
    Planner p = *Planner::Create(vc, model);
    std::vector<std::vector<int32_t>> k;
    absl::StatusOr<GlobalDecision> d = p.PlanAll(b, std::vector<int64_t>(c.num_ranks, -1), &k);
    ASSERT_TRUE(d.ok()) << d.status();
    const double got = Objective(valued, k, d->draft_depth, model, c.global);
    const double best = BruteForce(valued, model, c.global);
    ASSERT_GE(got, 0.99 * best) << "trial " << trial;
    worst = std::min(worst, got / best);
    // The flag is the same as handing the planner the valued batch.
    Planner on_valued = *Planner::Create(c, model);
    std::vector<std::vector<int32_t>> kv;
    ASSERT_TRUE(on_valued.PlanAll(valued, std::vector<int64_t>(c.num_ranks, -1), &kv).ok());
    EXPECT_EQ(kv, k);
    Planner plain = *Planner::Create(c, model);
    std::vector<std::vector<int32_t>> kp;
    ASSERT_TRUE(plain.PlanAll(b, std::vector<int64_t>(c.num_ranks, -1), &kp).ok());
    differs += kp != k;
  }
  std::printf("value_deferral: worst planner/exhaustive valued objective %.5f, %d of 60 plans differ\n",
              worst, differs);
  EXPECT_GE(differs, 5);
}

// PlanMode::kLocal: each rank plans alone, as if every other rank ran a batch like its own (its
// FFN term scaled by num_ranks), with the draft depth it needs. Each rank's lengths are within
// 1% of an exhaustive search of that rank-local objective.
TEST(PlannerLocalMode, EachRankWithinOnePercentOfItsOwnExhaustiveOptimum) {
  std::mt19937_64 rng(6000);
  const CostModel model = CostModel::PublishedV2();
  int differs_from_goodput = 0;
  for (int trial = 0; trial < 60; ++trial) {
    auto [b, c] = SmallCase(rng, trial);
    c.mode = PlanMode::kLocal;
    Planner p = *Planner::Create(c, model);
    std::vector<std::vector<int32_t>> k;
    absl::StatusOr<GlobalDecision> d = p.PlanAll(b, std::vector<int64_t>(c.num_ranks, -1), &k);
    ASSERT_TRUE(d.ok()) << d.status();
    int deepest = 0;
    for (size_t r = 0; r < b.size(); ++r) {
      // The rank alone, with its FFN tokens counted num_ranks times.
      GlobalCost g = c.global;
      g.ffn_per_token_us *= c.num_ranks;
      const Batches alone = {b[r]};
      const std::vector<std::vector<int32_t>> mine = {k[r]};
      int depth = 0;
      for (size_t i = 0; i < b[r].size(); ++i) {
        EXPECT_GE(k[r][i], b[r][i].k_min);
        EXPECT_LE(k[r][i], b[r][i].k_cap);
        depth = std::max(depth, static_cast<int>(k[r][i]));
      }
      deepest = std::max(deepest, depth);
      EXPECT_GE(Objective(alone, mine, depth, model, g), 0.99 * BruteForce(alone, model, g))
          << "trial " << trial << " rank " << r;
    }
    EXPECT_GE(d->draft_depth, deepest);  // the instance drafts as deep as the deepest rank asks
    PlannerConfig gc = c;
    gc.mode = PlanMode::kGoodput;
    Planner gp = *Planner::Create(gc, model);
    std::vector<std::vector<int32_t>> kg;
    ASSERT_TRUE(gp.PlanAll(b, std::vector<int64_t>(c.num_ranks, -1), &kg).ok());
    differs_from_goodput += kg != k;
  }
  EXPECT_GT(differs_from_goodput, 5) << "local plans equal coordinated ones: the test shows little";
}

TEST(PlannerErrors, BadInputIsAStatusNamingTheValue) {
  PlannerConfig c;
  c.num_ranks = 2;
  Planner p = *Planner::Create(c, CostModel::PublishedV2());
  RankSummary s;
  std::vector<PlanRequest> b(1);
  b[0].ctx_tokens = -3;
  absl::Status st = p.Summarize(0, b, -1, &s);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("ctx_tokens = -3"), std::string::npos);
  b[0].ctx_tokens = kMaxCtxTokens;  // the largest allowed
  EXPECT_TRUE(p.Summarize(0, b, -1, &s).ok());
  b[0].ctx_tokens = std::numeric_limits<int64_t>::max();
  st = p.Summarize(0, b, -1, &s);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("ctx_tokens = 9223372036854775807 exceeds 2^40"), std::string::npos) << st;
  b[0] = PlanRequest{};
  b[0].k_min = 5;
  b[0].k_cap = 2;
  st = p.Summarize(0, b, -1, &s);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("k_min = 5"), std::string::npos);
  EXPECT_FALSE(p.Summarize(7, {}, -1, &s).ok());

  PlannerConfig zero;
  zero.num_ranks = 0;
  EXPECT_FALSE(Planner::Create(zero, CostModel::PublishedV2()).ok());
  PlannerConfig kbad;
  kbad.k_max = 2;
  kbad.default_k = 3;
  EXPECT_FALSE(Planner::Create(kbad, CostModel::PublishedV2()).ok());
  EXPECT_FALSE(ParsePlanMode("fast").ok());
}

TEST(PlannerErrors, MismatchedVersionOrConfigIsRejectedAndGarbageExcluded) {
  PlannerConfig c;
  c.num_ranks = 2;
  Planner p = *Planner::Create(c, CostModel::PublishedV2());
  std::vector<PlanRequest> b(3);
  std::vector<RankSummary> s(2);
  ASSERT_TRUE(p.Summarize(0, b, -1, &s[0]).ok());
  ASSERT_TRUE(p.Summarize(1, b, -1, &s[1]).ok());
  ASSERT_TRUE(p.Decide(s).ok());

  std::vector<RankSummary> v = s;
  v[1].version = kSummaryVersion + 1;
  EXPECT_EQ(p.Decide(v).status().code(), absl::StatusCode::kFailedPrecondition);
  v = s;
  v[1].config_hash ^= 1;
  EXPECT_NE(p.Decide(v).status().message().find("config hash"), std::string::npos);

  v = s;
  v[1].base_max_slope[0] = std::nanf("");  // a NaN slope bound is garbage too
  ASSERT_TRUE(p.Decide(v).ok());
  EXPECT_EQ(p.Decide(v)->num_planned_ranks, 1);
  for (float pad : {std::nanf(""), -1.f, std::numeric_limits<float>::infinity(), 3e38f, 1.1e7f}) {
    v = s;
    v[1].pad_us = pad;  // a padding price that is no rank's cost (above 10 s a token) is garbage
    ASSERT_TRUE(p.Decide(v).ok());
    EXPECT_EQ(p.Decide(v)->num_planned_ranks, 1) << pad;
  }
  v = s;
  v[1].base_attention_us = std::nanf("");  // garbage: excluded, the other rank still plans
  absl::StatusOr<GlobalDecision> d = p.Decide(v);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->num_planned_ranks, 1);
  v[0].flags = 0;
  EXPECT_EQ(p.Decide(v).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace dpbalance

namespace dpbalance {
namespace {

// Padded mode with token tiers (the v2 plugin's DPB_TIERS + DPB_PADDED): every rank runs the
// agreed tier, the tokens it does not fill with verify work going on padding rows (dummy requests
// of one key, laid out by dspark::PadToTier as the replay's truth does, here with a free request
// slot for every padding token: the layout the price assumes), priced at the rank's pad_us. The
// plan must price that: its step holds every rank's assigned plan padded to the tier, the tier is
// a tier (or the largest rank's tokens past the last) and holds every rank, and the ranks together
// gain what the plan expected. Five models: V2 (linear in the sums: the price is exact; the
// planner that priced the knots without the padding planned up to 15% short here), one with a
// kernel-path jump, one whose every request costs more than a token (padding dearer than verify
// work: the Filler must take the items that lower its cost), and the two kernel grids (a padding
// row is new CTAs: the price simulates them). Measured with a5721b6's planner (a slot added to
// the aggregates, no CTAs; a Filler that skipped cost-lowering items), worst step over plan and
// gain under it: 1.0000 / 1.0001 / 1.0239 / 1.0005 / 1.2795 and 1.0000 / 0.9261 / 0.8906 /
// 0.9278 / 1.0000. Now 1.0000 / 1.0001 / 1.0000 / 1.0005 / 1.2206 and 1.0000 / 0.9261 / 0.9930 /
// 0.9278 / 0.9937. Open, and measured here rather than hidden: the head-major decode launch
// (every request at one query token, padding rows of one token) is not linear in its padding
// rows at all (they change its split-KV count, so 4 rows can add what 64 rows' mean says of 40),
// so a rank at its base there runs up to 22% over plan; on the regime model and the packed grid a
// rank's fill gains up to 7.4% less than Decide's knots said. With the engine's fewer slots (the
// largest tier over the window, several tokens a row) a rank at its base on the packed grid runs
// the verify launch where it was priced on the decode one: 15% over (not asserted here).
TEST(PlannerProperties, WithTokenTiersThePlanPricesEveryRankAtTheAgreedTier) {
  std::vector<int32_t> tiers;  // SGLang's speculative CUDA-graph sizes up to 64, x 8 tokens
  for (int bs = 1; bs <= 64; bs += bs < 8 ? 1 : bs < 32 ? 2 : 4) {
    if (bs == 9) bs = 10;
    if (bs == 34) bs = 40;
    tiers.push_back(8 * bs);
  }
  CostModel::Weights per_request{};  // a request dearer than a token: padding dearer than verify
  per_request[FeatureIndex(Regime::kBase, CostTerm::kConstant)] = 10;
  per_request[FeatureIndex(Regime::kBase, CostTerm::kNumRequests)] = 5;
  per_request[FeatureIndex(Regime::kBase, CostTerm::kQueryTokens)] = 1;
  per_request[FeatureIndex(Regime::kBase, CostTerm::kQueryKeyPairs)] = 0.001;
  CostModel::Weights gw{};
  gw[FeatureIndex(Regime::kBase, CostTerm::kConstant)] = 20;
  gw[FeatureIndex(Regime::kBase, CostTerm::kGrid0) + kGridMakespan0 + 1] = 1.5;
  gw[FeatureIndex(Regime::kSingleQuery, CostTerm::kGrid0) + kGridCombine] = 0.2;
  const struct {
    CostModel model;
    double step_tolerance, gain_tolerance;
  } models[] = {{CostModel::PublishedV2(), 1.01, 0.99},
                {RegimeModel(), 1.01, 0.92},
                {*CostModel::Create(per_request, "per-request"), 1.01, 0.99},
                {PackedGridModel(), 1.01, 0.92},
                {*CostModel::Create(gw, "gqa-grid", *KernelGrid::Named("fa2-gqa-h200")), 1.23, 0.99}};
  const int window = 8, slots = tiers.back();  // a free request slot for every padding token
  for (const auto& [m, tolerance, gain_tolerance] : models) {
    std::mt19937_64 rng(17);
    double worst = 0, worst_gain = 1;
    for (int trial = 0; trial < 24; ++trial) {
      PlannerConfig c;
      c.num_ranks = 8;
      c.k_max = window - 1;
      c.default_k = 1 + trial % 3;
      c.global.padded_tokens = true;
      c.global.ffn_fixed_us = 2000;  // attention a large part of the step, as on the H200 truth
      c.global.ffn_per_token_us = 0.05;
      c.global.draft_per_step_us = 100;
      c.token_tiers = tiers;
      c.sample_heads = false;  // the planner prices as the truth simulates: padding alone differs
      const Batches b = RandomInstance(rng, c.num_ranks, 40, c.k_max, trial % 3 == 0);
      Planner p = *Planner::Create(c, m);
      std::vector<std::vector<int32_t>> k;
      absl::StatusOr<GlobalDecision> d = p.PlanAll(b, std::vector<int64_t>(c.num_ranks, -1), &k);
      ASSERT_TRUE(d.ok()) << d.status();
      int64_t max_tokens = 0;
      double barrier = 0, gain = 0;
      for (int r = 0; r < c.num_ranks; ++r) {
        int64_t tokens = 0;
        std::vector<RequestLoad> loads = AssignedLoads(b[r], k[r], &tokens, &gain);
        max_tokens = std::max(max_tokens, tokens);
        ASSERT_LE(tokens, d->padded_rank_tokens);
        const dspark::Padding pad = dspark::PadToTier(
            d->padded_rank_tokens, static_cast<int64_t>(loads.size()), tokens, slots, window);
        if (pad.last_row_tokens > 0) loads.back().query_tokens += static_cast<int32_t>(pad.last_row_tokens);
        for (int32_t t : pad.pad_tokens) loads.push_back({1, t});
        barrier = std::max(barrier, m.AttentionUs(loads));
      }
      EXPECT_TRUE(std::binary_search(tiers.begin(), tiers.end(), d->padded_rank_tokens) ||
                  (d->padded_rank_tokens == max_tokens && max_tokens > tiers.back()))
          << d->padded_rank_tokens;
      const double step = barrier + c.global.StepUs(c.num_ranks * d->padded_rank_tokens, d->draft_depth);
      worst = std::max(worst, step / d->step_us);
      worst_gain = std::min(worst_gain, gain / d->expected_tokens);
      EXPECT_LE(step, tolerance * d->step_us) << m.name() << " trial " << trial;
      EXPECT_GE(gain, gain_tolerance * d->expected_tokens) << m.name() << " trial " << trial;
    }
    std::printf("padded tiers, %s: worst true step / planned %.4f, worst gain / planned %.4f\n",
                m.name().c_str(), worst, worst_gain);
  }
}

// The budget path (exact_rank_tokens + order_by_gain: each rank's total from the records alone)
// with padded tiers: a rank's knot is the last fill-or-pad point within the barrier, its padding
// included (KnotInTier), so every rank's true attention, padded to the tier, stays under the
// planned barrier, up to what the chord to the tier underestimates the items it stands for (the
// same chord Decide prices; gain order is not cost order, so the frontier is not concave in cost
// there): 1.35% at worst here. Before KnotInTier the knot was compared without its padding:
// 2.39% over (the same instances, a5721b6's planner).
TEST(PlannerExactRankTokens, PaddedBudgetKnotsStayUnderTheBarrierWithTheirPadding) {
  std::vector<int32_t> tiers;
  for (int bs = 1; bs <= 64; bs += bs < 8 ? 1 : bs < 32 ? 2 : 4) tiers.push_back(8 * bs);
  const CostModel m = CostModel::PublishedV2();
  std::mt19937_64 rng(5);
  double worst = 0;
  int planned = 0;
  for (int trial = 0; trial < 40; ++trial) {
    PlannerConfig c;
    c.num_ranks = 4;
    c.k_max = 7;
    c.default_k = 3;
    c.global.padded_tokens = true;
    c.exact_rank_tokens = true;
    c.order_by_gain = true;
    c.token_tiers = tiers;
    const Batches b = RandomInstance(rng, c.num_ranks, 30, c.k_max, false);
    Planner p = *Planner::Create(c, m);
    std::vector<std::vector<int32_t>> k;
    absl::StatusOr<GlobalDecision> d = p.PlanAll(b, std::vector<int64_t>(c.num_ranks, -1), &k);
    ASSERT_TRUE(d.ok()) << d.status();
    if (d->kept_default) continue;
    ++planned;
    double barrier = 0;
    for (int r = 0; r < c.num_ranks; ++r) {
      int64_t tokens = 0;
      std::vector<RequestLoad> loads = AssignedLoads(b[r], k[r], &tokens, nullptr);
      ASSERT_LE(tokens, d->padded_rank_tokens);
      for (int64_t pad = d->padded_rank_tokens - tokens; pad > 0; --pad) loads.push_back({1, 1});
      barrier = std::max(barrier, m.AttentionUs(loads));
    }
    worst = std::max(worst, barrier / d->barrier_us);
    EXPECT_LE(barrier, 1.015 * d->barrier_us) << "trial " << trial;
  }
  EXPECT_GT(planned, 20);
  std::printf("padded budget: worst true barrier / planned %.4f over %d plans\n", worst, planned);
}

// Token tiers with padding (SweepTiers): every rank runs the agreed tier, filling part of it with
// verify work (a prefix of its frontier at the agreed depth: its base, a knot, or the chord up to
// the tier) and padding the rest at its pad_us, so a rank whose verify tokens cost more than a
// padding slot may pad to lower the barrier. Decide's plan is the best over every tier, depth and
// every rank's choice of prefix: checked against an exhaustive search over those choices on small
// instances, on V2 (linear, so pad_us is exact) and on a model whose multi-query path costs more.
// With the TPOT guard on (no slack over the default plan's step) the plan is the best within the
// guard, or the shortest step while none fits: the sweep visits tiers and depths best-first and
// stops early, which must not change either.
TEST(PlannerProperties, TierSweepFindsTheBestFillOrPadOfEveryRank) {
  const std::vector<int32_t> tiers = {4, 8, 16, 32};
  int checked = 0, best_pads = 0, guard_binds = 0;
  for (int guarded = 0; guarded < 2; ++guarded)
  for (int model_idx = 0; model_idx < 2; ++model_idx) {
    const CostModel model = model_idx == 0 ? CostModel::PublishedV2() : RegimeModel();
    std::mt19937_64 rng(23 + model_idx);
    for (int trial = 0; trial < 30; ++trial) {
      auto [b, c] = SmallCase(rng, trial);
      c.global.padded_tokens = true;
      c.token_tiers = tiers;
      // Unguarded: the best plan, whatever its step.
      c.max_step_slack = guarded ? 0.0 : -1;
      c.guard_overhead_us = 0;
      Planner p = *Planner::Create(c, model);
      std::vector<RankSummary> s(c.num_ranks);
      for (int r = 0; r < c.num_ranks; ++r) ASSERT_TRUE(p.Summarize(r, b[r], -1, &s[r]).ok());
      absl::StatusOr<GlobalDecision> d = p.Decide(s);
      ASSERT_TRUE(d.ok()) << d.status();
      if (d->kept_default) continue;  // the default plan beat every plan (the default guard)
      double max_base = 0, floor = 0;
      int depth_lo = 0;
      for (const RankSummary& x : s) {
        max_base = std::max<double>(max_base, x.base_tokens);
        floor = std::max<double>(floor, x.base_attention_us);
        depth_lo = std::max<int>(depth_lo, x.min_depth);
      }
      std::vector<double> sweep_tiers;
      for (int32_t t : tiers) {
        if (t >= max_base) sweep_tiers.push_back(t);
      }
      if (sweep_tiers.empty()) sweep_tiers.push_back(max_base);
      double best = -1, best_any = -1, best_step = std::numeric_limits<double>::infinity();
      const double max_step = guarded ? d->default_step_us * (1 + c.max_step_slack)
                                      : std::numeric_limits<double>::infinity();
      bool best_padded = false, any_within = false;
      for (double tier : sweep_tiers) {
        for (int depth = depth_lo; depth <= std::max(depth_lo, c.k_max); ++depth) {
          // Each rank's choices: its base, each knot below the tier, the chord up to it; the
          // rest padded. The last is the tier filled.
          std::vector<std::vector<std::pair<double, double>>> options(c.num_ranks);
          for (int r = 0; r < c.num_ranks; ++r) {
            const RankSummary& x = s[r];
            const double want = tier - x.base_tokens;
            options[r].push_back({x.base_attention_us + x.pad_us * want, x.base_gain});
            const int slot = std::min<int>(depth, x.max_depth);
            const int first = slot > 0 ? x.knot_begin[slot - 1] : 0, count = slot > 0 ? x.num_knots[slot - 1] : 0;
            double c0 = x.base_attention_us, g0 = x.base_gain, t0 = 0;
            int k = 0;
            for (; k < count && x.knot_tokens[first + k] < want; ++k) {
              c0 = x.knot_attention_us[first + k];
              g0 = x.knot_gain[first + k];
              t0 = x.knot_tokens[first + k];
              options[r].push_back({c0 + x.pad_us * (want - t0), g0});
            }
            if (want > 0 && k < count) {
              const double t1 = x.knot_tokens[first + k];
              const double f = t1 > t0 ? (want - t0) / (t1 - t0) : 1.0;
              options[r].push_back({c0 + f * (x.knot_attention_us[first + k] - c0),
                                    g0 + f * (x.knot_gain[first + k] - g0)});
            }
          }
          const double global = c.global.StepUs(c.num_ranks * tier, depth);
          std::vector<size_t> pick(c.num_ranks, 0);
          while (true) {  // every combination
            double barrier = floor, gain = 0;
            bool pads = false;
            for (int r = 0; r < c.num_ranks; ++r) {
              barrier = std::max(barrier, options[r][pick[r]].first);
              gain += options[r][pick[r]].second;
              pads = pads || pick[r] + 1 < options[r].size();
            }
            const double step = barrier + global;
            best_any = std::max(best_any, gain / step);
            if (step <= max_step) {
              if (!any_within || gain / step > best) {
                best = gain / step;
                best_padded = pads;
              }
              any_within = true;
            } else if (!any_within && step < best_step) {
              best_step = step;
            }
            int r = 0;
            while (r < c.num_ranks && ++pick[r] == options[r].size()) pick[r++] = 0;
            if (r == c.num_ranks) break;
          }
        }
      }
      if (any_within) {
        EXPECT_NEAR(d->tokens_per_us, best, 1e-9 * best)
            << "guarded " << guarded << " model " << model_idx << " trial " << trial;
        best_pads += best_padded;
      } else {
        EXPECT_NEAR(d->step_us, best_step, 1e-9 * best_step)
            << "guarded " << guarded << " model " << model_idx << " trial " << trial;
      }
      guard_binds += guarded && (!any_within || best < best_any);  // the guard changed the plan
      ++checked;
    }
  }
  std::printf("tier sweep: %d instances checked, %d where the best plan pads a rank\n", checked, best_pads);
  std::printf("tier sweep: the TPOT guard changed the best plan in %d instances\n", guard_binds);
  EXPECT_GE(checked, 80);
  EXPECT_GT(best_pads, 10);
  EXPECT_GT(guard_binds, 5);
}

// DSpark's modes through the planner's three phases (what the plugin's DPB_MODE=dspark_fill runs):
// every rank's record carries its local tier min(n + b, n x W); all ranks agree on the largest,
// capped at the largest batch x W and rounded up to the tiers; with tier fill each rank verifies
// its best survivals up to min(tier, n x W) (fewer only where no candidate is left), without it its
// own budget; every rank's total (RankTokens) is the tier, and a request on top of its budget
// changes nothing.
// DSpark's two confidences (SGLang's relay): the budget is sized on the draft's confidences two
// steps back, the top-k spends it on this step's. A batch whose lagged curve is B plans B's
// budget whatever its fresh curve, and spends it in the fresh curve's order.
TEST(PlannerDspark, TheBudgetReadsTheLaggedConfidencesAndTheTopKTheFreshOnes) {
  std::mt19937_64 rng(31);
  std::uniform_real_distribution<double> u(0.05, 0.95);
  for (int trial = 0; trial < 50; ++trial) {
    PlannerConfig c;
    c.num_ranks = 1;
    c.k_max = 7;
    c.mode = PlanMode::kDspark;
    c.global = RandomGlobal(rng);
    Planner p = *Planner::Create(c, CostModel::PublishedV2());
    const int n = 1 + static_cast<int>(rng() % 12);
    auto curve = [&] {
      std::array<double, kMaxDraftLen> a;
      for (double& x : a) x = u(rng);
      return *AcceptanceCurve::FromConditional(a);
    };
    std::vector<PlanRequest> fresh_lagged(n), lagged_only(n);
    for (int i = 0; i < n; ++i) {
      PlanRequest r;
      r.ctx_tokens = 100 + static_cast<int64_t>(rng() % 20000);
      r.k_cap = static_cast<int32_t>(rng() % 8);
      const AcceptanceCurve fresh = curve(), lagged = curve();
      fresh_lagged[i] = r;
      fresh_lagged[i].acceptance = fresh;
      fresh_lagged[i].lagged_acceptance = lagged;
      lagged_only[i] = r;
      lagged_only[i].acceptance = lagged;  // no lagged curve: the budget reads this one
    }
    RankSummary with_fresh, plain;
    ASSERT_TRUE(p.Summarize(0, lagged_only, -1, &plain).ok());
    ASSERT_TRUE(p.Summarize(0, fresh_lagged, -1, &with_fresh).ok());
    EXPECT_EQ(with_fresh.base_tokens, plain.base_tokens) << "trial " << trial;  // the same budget
    // The allocation: the first `budget` candidates in the fresh curve's order.
    const GlobalDecision d = *p.Decide(std::vector<RankSummary>{with_fresh});
    std::vector<int32_t> got(n);
    ASSERT_TRUE(p.Assign(d, absl::MakeSpan(got)).ok());
    std::vector<int32_t> caps(n);
    for (int i = 0; i < n; ++i) caps[i] = fresh_lagged[i].k_cap;
    std::vector<dspark::Candidate> cands;
    dspark::OrderCandidates(caps, [&](int32_t i, int32_t j) { return fresh_lagged[i].acceptance.Accept(j); },
                            cands);
    std::vector<int32_t> want(n);
    dspark::AssignTopK(cands, static_cast<int64_t>(with_fresh.base_tokens) - n, absl::MakeSpan(want));
    EXPECT_EQ(got, want) << "trial " << trial;
  }
}

TEST(PlannerDspark, EveryRankRunsTheAgreedTierAndFillsItWithItsBestDrafts) {
  const std::vector<int32_t> tiers = {8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128};
  std::mt19937_64 rng(23);
  for (int trial = 0; trial < 20; ++trial) {
    for (PlanMode mode : {PlanMode::kDspark, PlanMode::kDsparkFill}) {
      PlannerConfig c;
      c.num_ranks = 6;
      c.k_max = 7;
      c.mode = mode;
      c.token_tiers = tiers;
      c.global = RandomGlobal(rng);
      const Batches b = RandomInstance(rng, c.num_ranks, 16, c.k_max, false);
      Planner p = *Planner::Create(c, CostModel::PublishedV2());
      std::vector<std::vector<int32_t>> k;
      absl::StatusOr<GlobalDecision> d = p.PlanAll(b, std::vector<int64_t>(c.num_ranks, -1), &k);
      ASSERT_TRUE(d.ok()) << d.status();
      const int64_t tier = d->padded_rank_tokens;
      int64_t max_requests = 0;
      for (const auto& rank : b) max_requests = std::max<int64_t>(max_requests, rank.size());
      EXPECT_LE(tier, std::max<int64_t>(tiers.back(), max_requests * 8));
      for (int r = 0; r < c.num_ranks; ++r) {
        int64_t tokens = 0, room = 0;
        for (size_t i = 0; i < b[r].size(); ++i) {
          ASSERT_LE(k[r][i], b[r][i].k_cap);
          tokens += 1 + k[r][i];
          for (int j = 1; j <= b[r][i].k_cap && b[r][i].acceptance.Accept(j) >= dspark::kSurvivalEps; ++j) ++room;
        }
        EXPECT_LE(tokens, tier) << "trial " << trial;
        if (mode == PlanMode::kDsparkFill) {  // filled as far as the tier and the candidates go
          const int64_t n = static_cast<int64_t>(b[r].size());
          EXPECT_EQ(tokens, n + std::min(dspark::FillBudget(tier, n, 8), room)) << "trial " << trial;
        }
      }
      // Every rank's record says the same totals: the tier.
      std::vector<RankSummary> recs(c.num_ranks);
      for (int r = 0; r < c.num_ranks; ++r) ASSERT_TRUE(p.Summarize(r, b[r], -1, &recs[r]).ok());
      std::vector<int64_t> totals(c.num_ranks);
      p.RankTokens(recs, *d, true, absl::MakeSpan(totals));
      for (int64_t t : totals) EXPECT_EQ(t, tier);
    }
  }
  EXPECT_EQ(*ParsePlanMode("dspark_fill"), PlanMode::kDsparkFill);
  EXPECT_EQ(*ParsePlanMode("dspark"), PlanMode::kDspark);
}

// What an engine meets in serving: empty ranks, requests that may not verify at all (cap 0, the
// last token), no drafting (k_max 0), default k 0, zero context, CUDA-graph padding.
// The planner's radix sort (Summarize's items, Decide's knot events) against comparison sorts:
// items, whose low halves rise in the order they are pushed, come out in key order; events, in
// any order, by their high halves with ties in insertion order. High halves drawn from few
// values share bytes (the skipped passes) and tie.
TEST(PlannerItemSort, RadixSortEqualsAComparisonSort) {
  struct Keyed {
    uint64_t key;
  };
  std::mt19937_64 rng(7);
  int radix_lists = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const size_t n = trial < 100 ? rng() % 80 : rng() % 1200;
    const uint32_t spread = trial % 3 == 0 ? 4 : trial % 3 == 1 ? 1u << 12 : ~0u;
    std::vector<Keyed> items(n), tmp;
    std::vector<uint64_t> events(n), etmp;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t high = uint64_t{static_cast<uint32_t>(0x3f000000u + rng() % spread)} << 32;
      items[i].key = high | static_cast<uint64_t>(i);
      events[i] = high | (rng() & 0xffffffffu);
    }
    std::vector<Keyed> want_items = items;
    std::sort(want_items.begin(), want_items.end(),
              [](const Keyed& a, const Keyed& b) { return a.key < b.key; });
    std::vector<uint64_t> want_events = events;
    if (n < 512) {
      std::sort(want_events.begin(), want_events.end());
    } else {
      std::stable_sort(want_events.begin(), want_events.end(),
                       [](uint64_t a, uint64_t b) { return (a >> 32) < (b >> 32); });
    }
    SortByHighHalf(items, tmp, 64);
    SortByHighHalf(events, etmp, 512);
    radix_lists += n >= 64;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(items[i].key, want_items[i].key) << "trial " << trial << " item " << i;
      ASSERT_EQ(events[i], want_events[i]) << "trial " << trial << " event " << i;
    }
  }
  EXPECT_GT(radix_lists, 150);
}

TEST(PlannerEdgeCases, DegenerateBatchesPlanWithoutErrors) {
  PlanRequest r;
  r.ctx_tokens = 1000;
  r.k_cap = 3;
  r.acceptance = *AcceptanceCurve::FromConditional(MtpK8ConditionalProfile());
  PlanRequest capped = r;
  capped.k_cap = 0;
  PlanRequest empty_ctx = r;
  empty_ctx.ctx_tokens = 0;
  struct Case {
    int k_max, default_k;
    bool padded;
    Batches batches;
  };
  const std::vector<Case> cases = {{7, 3, false, {{}, {r, r}}},         {7, 3, false, {{}, {}}},
                                   {7, 3, false, {{capped, capped}, {capped}}}, {0, 0, false, {{capped}, {capped}}},
                                   {7, 0, false, {{r}, {r, r, r}}},     {7, 3, true, {{r}, {r, r, r}}},
                                   {7, 3, false, {{empty_ctx}, {r}}}};
  for (const Case& k : cases) {
    PlannerConfig c;
    c.num_ranks = static_cast<int>(k.batches.size());
    c.k_max = k.k_max;
    c.default_k = k.default_k;
    c.global.padded_tokens = k.padded;
    if (k.padded) c.token_tiers = {8, 16};
    Planner p = *Planner::Create(c, CostModel::PublishedV2());
    std::vector<std::vector<int32_t>> v;
    absl::StatusOr<GlobalDecision> d = p.PlanAll(k.batches, std::vector<int64_t>(k.batches.size(), -1), &v);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_TRUE(std::isfinite(d->tokens_per_us));
    for (size_t q = 0; q < k.batches.size(); ++q) {
      for (size_t i = 0; i < k.batches[q].size(); ++i) {
        EXPECT_GE(v[q][i], 0);
        EXPECT_LE(v[q][i], k.batches[q][i].k_cap);
        EXPECT_LE(v[q][i], d->draft_depth);
      }
    }
  }
}

}  // namespace
}  // namespace dpbalance

namespace dpbalance {
namespace {

TEST(PlannerPerRankDepth, WithinOnePercentOfExhaustiveAndDeterministic) {
  for (int model_idx = 0; model_idx < 2; ++model_idx) {
    const CostModel model = model_idx == 0 ? CostModel::PublishedV2() : RegimeModel();
    std::mt19937_64 rng(3000 + model_idx);
    int trials = 0;
    double worst = 1.0;
    while (trials < 60) {
      auto [b, c] = SmallCase(rng, trials++);
      c.agreed_draft_depth = false;
      std::vector<int64_t> kv(c.num_ranks, -1);
      Planner p = *Planner::Create(c, model);
      std::vector<std::vector<int32_t>> k;
      ASSERT_TRUE(p.PlanAll(b, kv, &k).ok());
      const double got = Objective(b, k, kPerRankDepth, model, c.global);
      const double best = BruteForce(b, model, c.global, /*per_rank_depth=*/true);
      // Within 1.5%: since v5 of the record a rank sends 27 knots at most (one knot's bytes went
      // to the padding price, RankSummary::pad_us), shared by every depth at this DP; the worst
      // of these 120 instances plans 1.14% short of the exhaustive optimum (none short with 28).
      ASSERT_GE(got, 0.985 * best) << "model " << model_idx << " trial " << trials;
      worst = std::min(worst, got / best);
      // The phases run as separate ranks reach the same verify lengths.
      const RankRun run = RunAsRanks(c, model, b, kv);
      EXPECT_EQ(run.k, k);
    }
    std::printf("per-rank draft depth: worst planner/exhaustive ratio over 60 instances: %.5f\n", worst);
  }
}

// The level a rank's lengths sit at in uniform mode (every request at max(k_min, min(level,
// k_cap))), or -1 when they are not one level.
int UniformLevelOf(const std::vector<PlanRequest>& rank, const std::vector<int32_t>& k) {
  for (int level = 0; level <= kMaxDraftLen; ++level) {
    bool all = true;
    for (size_t i = 0; i < rank.size(); ++i) {
      all = all && k[i] == std::max(rank[i].k_min, std::min<int32_t>(level, rank[i].k_cap));
    }
    if (all) return level;
  }
  return -1;
}

// Exhaustive search over one level per rank (0..k_max each).
double BruteForceUniform(const Batches& b, int k_max, const CostModel& m, const GlobalCost& g,
                         bool per_rank_depth) {
  std::vector<int> level(b.size(), 0);
  std::vector<std::vector<int32_t>> k(b.size());
  double best = 0;
  while (true) {
    int depth = 0;
    for (size_t r = 0; r < b.size(); ++r) {
      k[r].resize(b[r].size());
      for (size_t i = 0; i < b[r].size(); ++i) {
        k[r][i] = std::max(b[r][i].k_min, std::min<int32_t>(level[r], b[r][i].k_cap));
        depth = std::max(depth, static_cast<int>(k[r][i]));
      }
    }
    best = std::max(best, Objective(b, k, per_rank_depth ? kPerRankDepth : depth, m, g));
    size_t r = 0;
    for (; r < b.size() && level[r] == k_max; ++r) level[r] = 0;
    if (r == b.size()) break;
    ++level[r];
  }
  return best;
}

// One verify length per rank: the sweep over the ranks' level knots (steps, priced exactly) is
// exact, so the plan's objective equals the best over every combination of levels, and every
// rank's lengths are one level. Both draft-depth modes, floors on a third of the instances.
TEST(PlannerUniformPerRank, EqualsExhaustiveOverLevelsAndEveryRankIsOneLevel) {
  for (int model_idx = 0; model_idx < 2; ++model_idx) {
    const CostModel model = model_idx == 0 ? CostModel::PublishedV2() : RegimeModel();
    std::mt19937_64 rng(4000 + model_idx);
    int moved = 0;
    double worst = 1;
    for (int trial = 0; trial < 80; ++trial) {
      const int ranks = 2 + static_cast<int>(rng() % 4);
      PlannerConfig c = RandomConfig(rng, ranks);
      c.uniform_per_rank = true;
      c.agreed_draft_depth = trial % 2 == 0;
      Batches b = RandomInstance(rng, ranks, 12, c.k_max, /*floors=*/trial % 3 == 0);
      const std::vector<int64_t> kv(ranks, -1);
      Planner p = *Planner::Create(c, model);
      std::vector<std::vector<int32_t>> k;
      absl::StatusOr<GlobalDecision> d = p.PlanAll(b, kv, &k);
      ASSERT_TRUE(d.ok()) << d.status();
      std::set<int> levels;
      for (int r = 0; r < ranks; ++r) {
        const int level = UniformLevelOf(b[r], k[r]);
        ASSERT_GE(level, 0) << "model " << model_idx << " trial " << trial << " rank " << r;
        levels.insert(level);
      }
      moved += levels.size() > 1;
      const bool per_rank = !c.agreed_draft_depth;
      const double got = Objective(b, k, per_rank ? kPerRankDepth : d->draft_depth, model, c.global);
      const double best = BruteForceUniform(b, c.k_max, model, c.global, per_rank);
      EXPECT_GE(got, best * (1 - 1e-5)) << "model " << model_idx << " trial " << trial;
      worst = std::min(worst, got / best);
      EXPECT_EQ(RunAsRanks(c, model, b, kv).k, k);  // as separate ranks: the same lengths
    }
    EXPECT_GT(moved, 10) << "ranks rarely took different levels: the test shows little";
    std::printf("uniform per rank: worst planner/exhaustive ratio over 80 instances: %.7f\n", worst);
  }
}

// One verify width for the instance (granularity "instance": SGLang's EAGLE/MTP step graphs):
// the plan is the best single depth, every request of every rank at min(depth, k_cap) (at least
// its floor), over the allowed depths only; exhaustive over those depths on random instances,
// with KV budgets that rule some depths out on some ranks; every rank derives the same decision,
// its lengths and every rank's token total (ABI v2's exact_rank_tokens) from the records alone.
TEST(PlannerInstanceWidth, EqualsExhaustiveOverAllowedDepthsAndEveryRankRunsIt) {
  for (int model_idx = 0; model_idx < 2; ++model_idx) {
    const CostModel model = model_idx == 0 ? CostModel::PublishedV2() : RegimeModel();
    std::mt19937_64 rng(5000 + model_idx);
    std::set<int> chosen;
    int kv_limited = 0;
    for (int trial = 0; trial < 120; ++trial) {
      const int ranks = 1 + static_cast<int>(rng() % 8);
      PlannerConfig c = RandomConfig(rng, ranks);
      c.uniform_instance = true;
      c.exact_rank_tokens = trial % 2 == 0;
      if (trial % 3 != 0) {  // a captured subset: default_k, k_max and random others
        c.allowed_depths = (1u << c.default_k) | (1u << c.k_max) | static_cast<uint32_t>(rng() % 512);
        c.allowed_depths &= (2u << c.k_max) - 1;
      }
      Batches b = RandomInstance(rng, ranks, 12, c.k_max, /*floors=*/trial % 4 == 0);
      std::vector<int64_t> kv(ranks, -1);
      if (trial % 5 == 1) kv[rng() % ranks] = static_cast<int64_t>(rng() % 20);
      Planner p = *Planner::Create(c, model);
      std::vector<std::vector<int32_t>> k;
      absl::StatusOr<GlobalDecision> d = p.PlanAll(b, kv, &k);
      ASSERT_TRUE(d.ok()) << d.status();
      ASSERT_TRUE(c.DepthAllowed(d->draft_depth)) << "trial " << trial << ": depth " << d->draft_depth;
      // Exhaustive: every allowed depth at or above the deepest floor; the plan's objective is
      // the best of them. KV budgets do not cut levels in this mode (the engine reserves the KV
      // of the width it runs): the plan is the same with or without them.
      int depth_lo = 0;
      for (const auto& rank : b)
        for (const auto& r : rank) depth_lo = std::max(depth_lo, static_cast<int>(r.k_min));
      double best = -1;
      for (int depth = depth_lo; depth <= c.k_max; ++depth) {
        if (!c.DepthAllowed(depth)) continue;
        std::vector<std::vector<int32_t>> lens(ranks);
        for (int r = 0; r < ranks; ++r) {
          int64_t added = 0;
          for (const auto& q : b[r]) {
            const int32_t floor = q.k_min, len = std::max(floor, std::min<int32_t>(depth, q.k_cap));
            lens[r].push_back(len);
            added += len - floor;
          }
          kv_limited += kv[r] >= 0 && added > kv[r];
        }
        best = std::max(best, Objective(b, lens, depth, model, c.global));
      }
      {  // the same plan without the KV budgets
        std::vector<std::vector<int32_t>> k_free;
        ASSERT_TRUE(Planner::Create(c, model)->PlanAll(b, std::vector<int64_t>(ranks, -1), &k_free).ok());
        EXPECT_EQ(k_free, k);
      }
      const double got = Objective(b, k, d->draft_depth, model, c.global);
      EXPECT_GE(got, best * (1 - 1e-5)) << "model " << model_idx << " trial " << trial;
      chosen.insert(d->draft_depth);
      for (int r = 0; r < ranks; ++r) {
        for (size_t i = 0; i < b[r].size(); ++i) {
          ASSERT_EQ(k[r][i], std::max(b[r][i].k_min, std::min<int32_t>(d->draft_depth, b[r][i].k_cap)))
              << "trial " << trial << " rank " << r << " request " << i;
        }
      }
      const RankRun run = RunAsRanks(c, model, b, kv);
      EXPECT_EQ(run.k, k);
      std::vector<int64_t> totals(ranks);
      for (int r = 0; r < ranks; ++r) {
        EXPECT_EQ(run.decisions[r], run.decisions[0]) << "ranks disagree, trial " << trial;
        std::vector<int64_t> mine(ranks);
        Planner own = *Planner::Create(c, model);
        own.RankTokens(run.summaries, run.decisions[r], /*balanced=*/true, absl::MakeSpan(mine));
        if (r == 0) totals = mine;
        EXPECT_EQ(mine, totals);
        int64_t tokens = 0;
        AssignedLoads(b[r], run.k[r], &tokens, nullptr);
        EXPECT_EQ(totals[r], tokens) << "trial " << trial << " rank " << r;
      }
    }
    EXPECT_GE(chosen.size(), 3u) << "the chosen depth hardly varies: the test shows little";
    EXPECT_GT(kv_limited, 0);
    std::printf("instance width: depths chosen %zu distinct, %d rank-levels over a KV budget\n",
                chosen.size(), kv_limited);
  }
}

// Instance mode with a rank that sends no usable record: it verifies the default width, so the
// whole instance does (kept default), on every rank alike. And bad settings are errors naming
// them.
TEST(PlannerInstanceWidth, AnUnusableRankKeepsEveryRankAtTheDefaultWidth) {
  std::mt19937_64 rng(77);
  PlannerConfig c = RandomConfig(rng, 3);
  c.k_max = 5;
  c.default_k = 2;
  c.uniform_instance = true;
  Batches b = RandomInstance(rng, 3, 6, c.k_max, false);
  const CostModel m = CostModel::PublishedV2();
  std::vector<Planner> ps;
  std::vector<RankSummary> sums(3);
  for (int r = 0; r < 3; ++r) {
    ps.push_back(*Planner::Create(c, m));
    ASSERT_TRUE(ps[r].Summarize(r, b[r], -1, &sums[r]).ok());
  }
  sums[1].flags &= ~kSummaryValid;  // rank 1 fell back: its record says so
  for (int r = 0; r < 3; ++r) {
    absl::StatusOr<GlobalDecision> d = ps[r].Decide(sums);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_TRUE(d->kept_default);
    EXPECT_EQ(d->draft_depth, c.default_k);
    std::vector<int32_t> k(b[r].size());
    ASSERT_TRUE(ps[r].Assign(*d, absl::MakeSpan(k)).ok());
    for (size_t i = 0; i < k.size(); ++i) EXPECT_EQ(k[i], std::min<int32_t>(2, b[r][i].k_cap));
  }
  PlannerConfig bad = c;
  bad.uniform_per_rank = true;
  EXPECT_NE(Planner::Create(bad, m).status().message().find("granularity instance"), std::string::npos);
  bad = c;
  bad.allowed_depths = (1u << 1) | (1u << 5);  // default_k 2 not captured
  EXPECT_NE(Planner::Create(bad, m).status().message().find("must hold default_k (2)"), std::string::npos);
  bad.allowed_depths = 1u << 12;
  EXPECT_NE(Planner::Create(bad, m).status().message().find("above 8"), std::string::npos);
}

}  // namespace
}  // namespace dpbalance
