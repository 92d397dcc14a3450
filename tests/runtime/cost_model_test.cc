#include "dpbalance/cost_model.h"
#include "dpbalance/kernel_grid.h"

#include <random>

#include "absl/strings/str_cat.h"

#include "gtest/gtest.h"

namespace dpbalance {
namespace {

BatchAggregates Agg(std::initializer_list<RequestLoad> reqs) {
  BatchAggregates a;
  for (const RequestLoad& r : reqs) a.Add(r);
  return a;
}

// The published formulas written out literally (docs/cost-model.md, "The published forms"),
// q_i = 1.
double LiteralV1(double max_b, double max_b_plus_c) { return 0.72482 * max_b + 0.27518 * max_b_plus_c; }
double LiteralV2(double max_b, double max_b_plus_c) {
  return 4.32158 + 0.336 * max_b + 0.1238 * max_b_plus_c;
}

TEST(PublishedCost, ReproducesPublishedFormulasWithSeparateMaxTerms) {
  // Rank 0: many short requests (large B); rank 1: few long ones (large C).
  const BatchAggregates r0 = Agg({{1000, 1}, {2000, 1}, {1500, 1}, {800, 1}});
  const BatchAggregates r1 = Agg({{120000, 1}, {90000, 1}});
  const BatchAggregates ranks[] = {r0, r1};
  const double b0 = 4, b1 = 2, c0 = 5300, c1 = 210000;
  const double v1 = LiteralV1(std::max(b0, b1), std::max(b0 + 1.30219 * c0 / 1e5, b1 + 1.30219 * c1 / 1e5));
  const double v2 = LiteralV2(std::max(b0, b1), std::max(b0 + 2.89453 * c0 / 1e5, b1 + 2.89453 * c1 / 1e5));
  EXPECT_DOUBLE_EQ(PublishedInstanceCost(PublishedForm::kV1, ranks), v1);
  EXPECT_DOUBLE_EQ(PublishedInstanceCost(PublishedForm::kV2, ranks), v2);
  // The separate max() terms are not the max of per-rank sums here.
  EXPECT_GT(v2, std::max(PublishedRankCost(PublishedForm::kV2, r0), PublishedRankCost(PublishedForm::kV2, r1)));
}

// CostModel::PublishedV1/V2 on one rank is the published formula (docs/cost-model.md) with both
// max() terms on that rank, in microseconds, extended to q > 1 by B -> sum q_i and
// C -> sum q_i ctx_i. Expected values from the literal formulas, not from PublishedRankCost.
TEST(PublishedCost, PerRankModelIsTheSameFormulaInMicroseconds) {
  // Worked by hand: ctx {10,000, 50,000}, q {1, 3}: B = 4, C = 10,000 + 150,000 = 160,000.
  //   V2 = 4.32158 + 0.336 * 4 + 0.1238 * (4 + 2.89453 * 1.6)  = 6.7341285024 ms
  //   V1 = 0.72482 * 4 + 0.27518 * (4 + 1.30219 * 1.6)          = 4.57333863072 ms
  const std::vector<RequestLoad> worked = {{10000, 1}, {50000, 3}};
  EXPECT_NEAR(CostModel::PublishedV2().AttentionUs(worked), 6734.1285024, 1e-6);
  EXPECT_NEAR(CostModel::PublishedV1().AttentionUs(worked), 4573.33863072, 1e-6);
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int64_t> ctx(0, 130000);
  std::uniform_int_distribution<int> q(1, 8);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<RequestLoad> batch;
    double b = 0, c = 0;
    for (int i = 0; i < 1 + trial % 40; ++i) {
      batch.push_back({ctx(rng), q(rng)});
      b += batch.back().query_tokens;
      c += static_cast<double>(batch.back().query_tokens) * static_cast<double>(batch.back().ctx_tokens);
    }
    EXPECT_NEAR(CostModel::PublishedV1().AttentionUs(batch), 1000 * LiteralV1(b, b + 1.30219 * c / 1e5), 1e-6);
    EXPECT_NEAR(CostModel::PublishedV2().AttentionUs(batch), 1000 * LiteralV2(b, b + 2.89453 * c / 1e5), 1e-6);
  }
}

TEST(CostModel, IncrementalAggregatesMatchRebuild) {
  std::mt19937_64 rng(3);
  std::vector<RequestLoad> batch = {{5000, 1}, {100, 1}, {70000, 2}};
  BatchAggregates inc;
  for (const RequestLoad& r : batch) inc.Add(r);
  for (int step = 0; step < 20; ++step) {
    const size_t i = rng() % batch.size();
    inc.AddQueryToken(batch[i]);
    batch[i].query_tokens += 1;
    BatchAggregates fresh;
    for (const RequestLoad& r : batch) fresh.Add(r);
    EXPECT_DOUBLE_EQ(inc.query_tokens, fresh.query_tokens);
    EXPECT_DOUBLE_EQ(inc.query_key_pairs, fresh.query_key_pairs);
    EXPECT_DOUBLE_EQ(inc.max_query_key_pairs, fresh.max_query_key_pairs);
    EXPECT_EQ(inc.multi_query, fresh.multi_query);
  }
}

TEST(CostModel, RegimeAndKneeFeatures) {
  CostModel::Weights w{};
  w[FeatureIndex(Regime::kMultiQuery, CostTerm::kConstant)] = 50;
  w[FeatureIndex(Regime::kMultiQuery, CostTerm::kKnee0)] = 2;  // knee at 16 query tokens
  w[FeatureIndex(Regime::kSingleQuery, CostTerm::kWaveKeys0, 2)] = 1;  // max(K / 4, max ctx)
  const CostModel m = *CostModel::Create(w, "t");
  EXPECT_DOUBLE_EQ(m.AttentionUs({{{100, 1}, {100, 1}}}), 100);        // max(200 / 4, 100)
  EXPECT_DOUBLE_EQ(m.AttentionUs({{{100, 1}, {100, 1}, {100, 1}, {100, 1}, {100, 1}}}), 125);
  EXPECT_DOUBLE_EQ(m.AttentionUs({{{100, 2}, {100, 1}}}), 50);         // multi regime
  EXPECT_DOUBLE_EQ(m.AttentionUs({{{100, 17}, {100, 1}}}), 50 + 2 * 2);  // Q = 18 > 16
  EXPECT_EQ(FeatureName(FeatureIndex(Regime::kMultiQuery, CostTerm::kKnee0, 3)), "multi_knee_128");
  EXPECT_EQ(FeatureName(FeatureIndex(Regime::kBase, CostTerm::kWavePairs0, 1)), "wave_pairs_w2");
  EXPECT_EQ(FeatureName(FeatureIndex(Regime::kSingleQuery, CostTerm::kConstant)), "single_constant");
}

// Every term of every kernel path counts: with every weight nonzero (base and both paths'
// extras, plain, hinge and grid terms), AttentionUs is the weights times the features, and the
// features are the terms written out from the batch here (the grid terms as simulated). Run on
// the split-KV decode path (every q_i = 1) and the verify path, without a grid and with each
// named kernel grid.
TEST(CostModel, AttentionIsTheWeightsTimesTheFeaturesOnEveryPath) {
  std::mt19937_64 rng(29);
  std::uniform_real_distribution<double> weight(0.5, 2.0);
  for (const char* grid_name : {"none", "fa2-packed-h200", "fa2-gqa-h200"}) {
    CostModel::Weights w;
    for (double& x : w) x = weight(rng);
    const absl::StatusOr<CostModel> m = CostModel::Create(w, "all-terms", *KernelGrid::Named(grid_name));
    ASSERT_TRUE(m.ok()) << m.status();
    for (bool verify : {false, true}) {
      std::vector<RequestLoad> batch;
      for (int i = 0; i < 20; ++i) {
        batch.push_back({static_cast<int64_t>(50 + rng() % 60000), verify ? 1 + static_cast<int32_t>(rng() % 8) : 1});
      }
      const BatchAggregates agg = m->Aggregate(batch);
      ASSERT_EQ(agg.multi_query, verify);
      // The terms from the batch itself.
      double b = 0, q = 0, c = 0, k = 0, max_c = 0, max_k = 0;
      for (const RequestLoad& r : batch) {
        const double ctx = static_cast<double>(r.ctx_tokens);
        b += 1;
        q += r.query_tokens;
        c += r.query_tokens * ctx;
        k += ctx;
        max_c = std::max(max_c, r.query_tokens * ctx);
        max_k = std::max(max_k, ctx);
      }
      std::array<double, kNumCostTerms> term{};
      const double plain[kNumPlainTerms] = {1, b, q, c, k, max_c, max_k};
      std::copy(std::begin(plain), std::end(plain), term.begin());
      for (int j = 0; j < 8; ++j) {
        term[static_cast<int>(CostTerm::kWaveKeys0) + j] = std::max(k / kWaveWidths[j], max_k);
        term[static_cast<int>(CostTerm::kWavePairs0) + j] = std::max(c / kWaveWidths[j], max_k);
      }
      for (int j = 0; j < 6; ++j) term[static_cast<int>(CostTerm::kKnee0) + j] = std::max(0.0, q - kKneeTokens[j]);
      const bool grid = m->kernel_grid().enabled();
      ASSERT_EQ(agg.grid.valid, grid);
      for (int j = 0; j < kNumGridTerms && grid; ++j) {
        term[static_cast<int>(CostTerm::kGrid0) + j] = agg.grid.at_ref[verify ? 1 : 0][j];
      }
      const CostModel::Weights x = m->Features(agg);
      const int extra = static_cast<int>(verify ? Regime::kMultiQuery : Regime::kSingleQuery);
      const int other = static_cast<int>(verify ? Regime::kSingleQuery : Regime::kMultiQuery);
      double want = 0, dot = 0;
      for (int t = 0; t < kNumCostTerms; ++t) {
        const std::string what = absl::StrCat(grid_name, verify ? " verify " : " decode ", FeatureName(t));
        EXPECT_DOUBLE_EQ(x[t], term[t]) << what;
        EXPECT_DOUBLE_EQ(x[extra * kNumCostTerms + t], term[t]) << what;
        EXPECT_EQ(x[other * kNumCostTerms + t], 0) << what;
        want += (w[t] + w[extra * kNumCostTerms + t]) * term[t];
      }
      for (int f = 0; f < kNumCostFeatures; ++f) dot += w[f] * x[f];
      EXPECT_NEAR(m->AttentionUs(agg), want, 1e-12 * want) << grid_name << (verify ? " verify" : " decode");
      EXPECT_NEAR(m->AttentionUs(agg), dot, 1e-12 * dot) << grid_name << (verify ? " verify" : " decode");
      EXPECT_NEAR(m->AttentionUs(batch), want, 1e-12 * want) << grid_name;
    }
  }
}

TEST(CostModel, JsonRoundTripAndErrors) {
  const CostModel v2 = CostModel::PublishedV2();
  absl::StatusOr<CostModel> back = CostModel::FromJson(v2.ToJson(), "mem");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->weights_us(), v2.weights_us());
  EXPECT_EQ(back->kernel_grid(), v2.kernel_grid());

  absl::StatusOr<CostModel> bad = CostModel::FromJson(
      R"({"format":"dpbalance-cost-model","version":1,"weights_us":{"bogus":1}})", "f.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bogus"), std::string::npos);
  EXPECT_NE(bad.status().message().find("f.json"), std::string::npos);

  CostModel::Weights neg{};
  neg[2] = -1;
  absl::StatusOr<CostModel> n = CostModel::Create(neg, "neg");
  ASSERT_FALSE(n.ok());
  EXPECT_NE(n.status().message().find("query_tokens = -1"), std::string::npos);
  EXPECT_FALSE(CostModel::FromFile("/nonexistent/model.json").ok());
  EXPECT_FALSE(CostModel::FromJson("{\"format\":\"x\"}", "g").ok());
}

// The fit's cross-validated error rides in the model file ("cv_mape", written only when known)
// and comes back; a value that is not a fraction in 0..10 is an error naming the file and it.
TEST(CostModel, CvMapeRoundTripsAndIsChecked) {
  const CostModel v2 = CostModel::PublishedV2();
  EXPECT_EQ(v2.cv_mape(), 0);
  EXPECT_EQ(v2.ToJson().find("cv_mape"), std::string::npos) << "unknown: not written";
  absl::StatusOr<CostModel> back = CostModel::FromJson(v2.WithCvMape(0.0991).ToJson(), "fit.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_DOUBLE_EQ(back->cv_mape(), 0.0991);
  EXPECT_EQ(back->weights_us(), v2.weights_us());
  EXPECT_DOUBLE_EQ(back->Scaled(2).WithGridSimulation(GridSimulation::kFast).cv_mape(), 0.0991);
  for (const char* bad : {"-0.1", "11", "\"0.1\""}) {
    absl::StatusOr<CostModel> m = CostModel::FromJson(
        absl::StrCat(R"({"format":"dpbalance-cost-model","version":1,"cv_mape":)", bad,
                     R"(,"weights_us":{}})"),
        "bad.json");
    ASSERT_FALSE(m.ok()) << bad;
    EXPECT_NE(m.status().message().find("bad.json: cv_mape is"), std::string::npos) << m.status();
    EXPECT_NE(m.status().message().find(bad), std::string::npos) << m.status();
  }
}

// "v2+GRID": V2's plain weights, the named grid, and a seed on every makespan of both kernel
// paths (so the terms are simulated and an online refit can learn them), adding at most
// microseconds; bad specs name themselves.
TEST(CostModel, SpecsNameTheFormsGridsAndFiles) {
  const CostModel v2 = CostModel::PublishedV2();
  EXPECT_EQ(CostModel::FromSpec("v2")->weights_us(), v2.weights_us());
  EXPECT_EQ(CostModel::FromSpec("v2")->published_form(), PublishedForm::kV2);
  EXPECT_EQ(CostModel::FromSpec("v1")->weights_us(), CostModel::PublishedV1().weights_us());
  EXPECT_EQ(CostModel::FromSpec("v1")->published_form(), PublishedForm::kV1);
  absl::StatusOr<CostModel> seeded = CostModel::FromSpec("v2+fa2-packed-h200");
  ASSERT_TRUE(seeded.ok()) << seeded.status();
  EXPECT_EQ(seeded->kernel_grid(), *KernelGrid::Named("fa2-packed-h200"));
  EXPECT_TRUE(seeded->uses_grid());
  for (Regime r : {Regime::kSingleQuery, Regime::kMultiQuery}) {
    for (int j = 0; j < kNumGridMakespans; ++j) {
      EXPECT_EQ(seeded->weights_us()[FeatureIndex(r, CostTerm::kGrid0) + kGridMakespan0 + j],
                CostModel::kGridSeedUs);
    }
  }
  for (int t = 0; t < kNumPlainTerms; ++t) {
    EXPECT_EQ(seeded->weights_us()[t], v2.weights_us()[t]) << FeatureName(t);
  }
  const RequestLoad batch[] = {{30000, 3}, {800, 1}, {12000, 5}};
  const double extra = seeded->AttentionUs(batch) - v2.AttentionUs(batch);
  EXPECT_GT(extra, 0);
  EXPECT_LT(extra, 10);  // microseconds, on a V2 cost of milliseconds

  absl::StatusOr<CostModel> bad_grid = CostModel::FromSpec("v2+fa9");
  ASSERT_FALSE(bad_grid.ok());
  EXPECT_NE(bad_grid.status().message().find("v2+fa9"), std::string::npos);
  EXPECT_NE(bad_grid.status().message().find("'fa9'"), std::string::npos);
  absl::StatusOr<CostModel> bad_form = CostModel::FromSpec("v3+fa2-packed-h200");
  ASSERT_FALSE(bad_form.ok());
  EXPECT_NE(bad_form.status().message().find("v3+fa2-packed-h200"), std::string::npos);
  absl::StatusOr<CostModel> missing = CostModel::FromSpec("/nonexistent/model.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/model.json"), std::string::npos);
}

// A model's grid simulation: files and specs load with the reference one (the fits' and the
// truths'); a copy set to kFast simulates with SimulateMakespans, the rest of the model equal.
TEST(CostModel, GridSimulationIsTheModelsOwnAndCopiesKeepTheRest) {
  absl::StatusOr<CostModel> ref = CostModel::FromSpec("v2+fa2-packed-h200");
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->grid_simulation(), GridSimulation::kReference);
  const CostModel fast = ref->WithGridSimulation(GridSimulation::kFast);
  EXPECT_EQ(fast.grid_simulation(), GridSimulation::kFast);
  EXPECT_EQ(ref->grid_simulation(), GridSimulation::kReference);  // the original is untouched
  EXPECT_EQ(fast.weights_us(), ref->weights_us());
  EXPECT_EQ(fast.kernel_grid(), ref->kernel_grid());
  // A batch whose launch has simultaneous frees (equal CTAs): the two tie rules may differ, but
  // each model's terms are exactly its own simulation's.
  std::vector<RequestLoad> batch;
  std::mt19937_64 rng(3);
  for (int i = 0; i < 24; ++i) batch.push_back({static_cast<int64_t>(200 + rng() % 9000), 1 + static_cast<int32_t>(rng() % 6)});
  const CostModel& reference = *ref;
  for (const CostModel* m : {&reference, &fast}) {
    const BatchAggregates agg = m->Aggregate(batch);
    const GridTerms want = SimulateGrid(m->kernel_grid(), batch, /*single_query_launch=*/false,
                                        ~0u, m->grid_simulation());
    for (int t = kGridMakespan0; t < kGridMakespan0 + kNumGridMakespans; ++t) {
      // Aggregate simulates only the weighed terms; the seeded model weighs every makespan.
      EXPECT_EQ(agg.grid.at_ref[1][t], want[t]) << GridTermName(t);
    }
  }
  EXPECT_EQ(CostModel::PublishedV2().WithGridSimulation(GridSimulation::kFast).AttentionUs(batch),
            CostModel::PublishedV2().AttentionUs(batch));  // no grid: nothing to simulate
  // The rule goes into the file (a fit under kFast must be priced under it) and comes back;
  // files without it are reference (every fit before the option), and a bad value names the file.
  absl::StatusOr<CostModel> back = CostModel::FromJson(fast.ToJson(), "fast.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->grid_simulation(), GridSimulation::kFast);
  EXPECT_EQ(back->weights_us(), fast.weights_us());
  EXPECT_EQ(ref->ToJson().find("grid_simulation"), std::string::npos);
  EXPECT_EQ(CostModel::FromJson(ref->ToJson(), "ref.json")->grid_simulation(), GridSimulation::kReference);
  std::string bad = fast.ToJson();
  bad.replace(bad.find("\"fast\""), 6, "\"slow\"");
  absl::StatusOr<CostModel> refused = CostModel::FromJson(bad, "bad.json");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("bad.json: grid_simulation is \"slow\""), std::string::npos)
      << refused.status();
  // A planner's sampled pricing is not a rule a fit carries: a copy priced so writes the model it
  // prices, and a file that says "sampled" is refused.
  const CostModel sampled = ref->WithGridSimulation(GridSimulation::kSampledHeads);
  EXPECT_EQ(sampled.ToJson(), ref->ToJson());
  std::string says_sampled = fast.ToJson();
  says_sampled.replace(says_sampled.find("\"fast\""), 6, "\"sampled\"");
  refused = CostModel::FromJson(says_sampled, "sampled.json");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("sampled.json: grid_simulation is \"sampled\""),
            std::string::npos)
      << refused.status();
}

// Both paths at once (one simulation where the grid is one launch) fill what each path alone
// fills, to the bit, for any masks, grid and simulation.
TEST(CostModel, GridStateOfBothPathsIsEachPathsOwn) {
  std::mt19937_64 rng(41);
  const unsigned all = (1u << kNumGridTerms) - 1;
  for (const char* name : {"fa2-packed-h200", "fa2-gqa-h200"}) {
    const KernelGrid grid = *KernelGrid::Named(name);
    for (int trial = 0; trial < 30; ++trial) {
      std::vector<RequestLoad> batch(1 + rng() % 70);
      BatchAggregates agg;
      for (RequestLoad& r : batch) {
        r = RequestLoad{static_cast<int64_t>(1 + rng() % 40000), trial % 2 ? 1 : 1 + static_cast<int32_t>(rng() % 6)};
        agg.Add(r);
      }
      const unsigned single = static_cast<unsigned>(rng()) & all, multi = static_cast<unsigned>(rng()) & all;
      for (GridSimulation sim : {GridSimulation::kReference, GridSimulation::kFast}) {
        BatchAggregates both = agg, one = agg, two = agg;
        FillGridState(grid, batch, single, multi, 3u, &both, sim);
        FillGridState(grid, batch, single, multi, 1u, &one, sim);
        FillGridState(grid, batch, single, multi, 2u, &two, sim);
        EXPECT_EQ(both.grid.at_ref[0], one.grid.at_ref[0]) << name << " trial " << trial;
        EXPECT_EQ(both.grid.at_ref[1], two.grid.at_ref[1]) << name << " trial " << trial;
      }
    }
  }
}

// Which models price an instance with the published formula's two max() terms (routing E):
// the published forms, also scaled (--truth_layers); not a copy of their weights, a grid-seeded
// form, or a model file.
TEST(CostModel, OnlyThePublishedFormsCarryTheirForm) {
  EXPECT_EQ(CostModel::PublishedV1().published_form(), PublishedForm::kV1);
  EXPECT_EQ(CostModel::FromSpec("v2")->published_form(), PublishedForm::kV2);
  EXPECT_EQ(CostModel::PublishedV2().Scaled(61).published_form(), PublishedForm::kV2);
  EXPECT_FALSE(CostModel::FromSpec("v2+fa2-packed-h200")->published_form().has_value());
  const CostModel v2 = CostModel::PublishedV2();
  absl::StatusOr<CostModel> copy = CostModel::Create(v2.weights_us(), "copy");
  ASSERT_TRUE(copy.ok());
  EXPECT_FALSE(copy->published_form().has_value());
  EXPECT_FALSE(CostModel::FromJson(v2.ToJson(), "v2 json")->published_form().has_value());
  EXPECT_FALSE(CostModel().published_form().has_value());
}

TEST(GlobalCost, ValidateNamesField) {
  GlobalCost g;
  g.ffn_per_token_us = std::nan("");
  absl::Status s = g.Validate();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("ffn_per_token_us"), std::string::npos);
}

}  // namespace
}  // namespace dpbalance
