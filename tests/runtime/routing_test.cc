#include "dpbalance/routing.h"

#include <random>

#include "gtest/gtest.h"
#include "reference_router.h"

namespace dpbalance {
namespace {

std::vector<RankLoad> Loads(std::initializer_list<std::pair<int, int64_t>> batch_ctx,
                            int64_t capacity = 1000000) {
  std::vector<RankLoad> v;
  for (auto [b, c] : batch_ctx) {
    RankLoad l;
    l.num_requests = b;
    l.ctx_tokens = c;
    l.reserved_tokens = c;
    l.capacity_tokens = capacity;
    l.agg.num_requests = b;
    l.agg.query_tokens = b;
    l.agg.query_key_pairs = static_cast<double>(c);
    v.push_back(l);
  }
  return v;
}

Router Make(RoutingStrategy s, int ranks, double z = 1.2, int groups = 1) {
  RoutingConfig c;
  c.strategy = s;
  c.z = z;
  c.groups = groups;
  return *Router::Create(c, ranks, CostModel::PublishedV2());
}

// V2's coefficients as a per-rank model (what a fit with those weights would be): no published
// form, so E prices the instance by its barrier.
CostModel PerRankV2() { return *CostModel::Create(CostModel::PublishedV2().weights_us(), "v2-fit"); }

// E with one query token per request, so a request's own batch term is small against the
// maxima and the published form leaves them unchanged on most ranks.
Router MakeE(CostModel model, int ranks) {
  RoutingConfig c;
  c.strategy = RoutingStrategy::kCostAware;
  c.query_tokens_per_request = 1;
  return *Router::Create(c, ranks, std::move(model));
}

TEST(Routing, AandBPickMinBatchAndMinContext) {
  const auto loads = Loads({{4, 100}, {2, 900}, {3, 50}});
  Router a = Make(RoutingStrategy::kMinBatch, 3), b = Make(RoutingStrategy::kMinContext, 3);
  EXPECT_EQ(*a.Route({10, 10}, loads), 1);
  EXPECT_EQ(*b.Route({10, 10}, loads), 2);
}

TEST(Routing, CapacityFilterComesFirstAndExhaustionIsAnError) {
  auto loads = Loads({{1, 100}, {5, 500}}, 1000);
  Router a = Make(RoutingStrategy::kMinBatch, 2);
  EXPECT_EQ(*a.Route({300, 10}, loads), 0);
  loads[0].reserved_tokens = 900;  // rank 0 would overflow
  EXPECT_EQ(*a.Route({300, 10}, loads), 1);
  absl::StatusOr<int> none = a.Route({5000, 10}, loads);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(none.status().message().find("5000"), std::string::npos);
}

TEST(Routing, DualPathPrefersMinBatchUnderThresholdElseMinContext) {
  // avg usage 400, z 1.2 -> threshold 480: ranks 1 and 2 qualify, rank 2 has the smaller batch.
  const auto loads = Loads({{1, 700}, {5, 300}, {3, 200}});
  Router d = Make(RoutingStrategy::kDualPath, 3);
  EXPECT_EQ(*d.Route({1, 1}, loads), 2);
  // z tiny: nobody under the threshold -> B (min context).
  Router d2 = Make(RoutingStrategy::kDualPath, 3, 0.01);
  EXPECT_EQ(*d2.Route({1, 1}, loads), 2);
  const auto loads2 = Loads({{1, 700}, {5, 100}, {3, 200}});
  EXPECT_EQ(*d2.Route({1, 1}, loads2), 1);
}

TEST(Routing, LengthSplitUsesPercentileOfRecentRequests) {
  RoutingConfig c;
  c.strategy = RoutingStrategy::kLengthSplit;
  c.split_percentile = 0.5;
  c.split_window = 4;
  Router r = *Router::Create(c, 2, CostModel::PublishedV2());
  const auto loads = Loads({{1, 900}, {5, 100}});  // A -> rank 0, B -> rank 1
  for (int64_t len : {100, 200, 300, 400}) ASSERT_TRUE(r.Route({len, 1}, loads).ok());
  EXPECT_EQ(*r.Route({1000, 1}, loads), 0);  // long -> A
  EXPECT_EQ(*r.Route({10, 1}, loads), 1);    // short -> B
}

TEST(Routing, GroupsChooseGroupThenDualPathInside) {
  const auto loads = Loads({{1, 10}, {9, 10}, {4, 10}, {4, 10}});
  Router g = Make(RoutingStrategy::kDualPath, 4, 1.2, 2);
  // Group 0 total batch 10, group 1 total 8 -> group 1; inside, tie -> lower index (2).
  EXPECT_EQ(*g.Route({1, 1}, loads), 2);
  // D's average is the chosen group's: of 6 ranks in 2 groups, group 1 (ranks 3-5, 10 requests
  // against 15) holds 300 + 100 + 500 tokens: average 300, limit 360 at z 1.2, so ranks 3 and 4
  // are under it and A takes rank 3 (1 request). Dividing the group's usage by all 6 ranks
  // (limit 180) would leave only rank 4.
  Router g6 = Make(RoutingStrategy::kDualPath, 6, 1.2, 2);
  EXPECT_EQ(*g6.Route({1, 1}, Loads({{5, 100}, {5, 100}, {5, 100}, {1, 300}, {4, 100}, {5, 500}})), 3);
  // By context (group_choice B) with three groups of uneven size (ranks 0 | 1-2 | 3-4 of 5):
  // group totals 900, 500, 700 -> group 1; its average 250, limit 300: rank 1 (400) is over,
  // rank 2 (100) under -> rank 2, though rank 1 has fewer requests.
  RoutingConfig c3;
  c3.strategy = RoutingStrategy::kDualPath;
  c3.groups = 3;
  c3.group_choice = RoutingStrategy::kMinContext;
  Router g3 = *Router::Create(c3, 5, CostModel::PublishedV2());
  EXPECT_EQ(*g3.Route({1, 1}, Loads({{1, 900}, {1, 400}, {6, 100}, {1, 350}, {1, 350}})), 2);
}

TEST(Routing, CostAwarePicksLowestPredictedCostAfterAdding) {
  // Same batch sizes; rank 1 holds far less context -> lower predicted cost.
  const auto loads = Loads({{4, 400000}, {4, 4000}, {5, 4000}});
  Router e = MakeE(PerRankV2(), 3);
  EXPECT_EQ(*e.Route({1000, 100}, loads), 1);
}

TEST(Routing, CostAwareWithAPublishedModelKeepsItsMaximaThenTakesFewestRequestsMostContext) {
  // Terms (B, B + s*C) under V2: max B = 6 (rank 0), max B + s*C = 12.7 (rank 1). A request of
  // 1,000 + 150 tokens raises max B on rank 0 and the mix maximum on rank 1; ranks 2, 3, 4 leave
  // both unchanged. Of those, ranks 2 and 4 hold 4 requests, and rank 2 the most context.
  const auto loads = Loads({{6, 0}, {4, 300000}, {4, 150000}, {5, 0}, {4, 120000}});
  const RouteRequest req{1000, 100};
  EXPECT_EQ(*MakeE(CostModel::PublishedV2(), 5).Route(req, loads), 2);
  // The same coefficients as a per-rank model water-fill: rank 4 is the cheapest after adding.
  EXPECT_EQ(*MakeE(PerRankV2(), 5).Route(req, loads), 4);
  // Scaling a published model (the replay's --truth_layers) keeps its form and its choice.
  EXPECT_EQ(*MakeE(CostModel::PublishedV2().Scaled(61), 5).Route(req, loads), 2);
}

// Brute force: every fitting rank priced by the whole formula over every rank, with the request
// added to that rank; the router must return the first rank in (cost, requests, -context) order.
TEST(Routing, CostAwareWithAPublishedModelEqualsBruteForceOverRanks) {
  std::mt19937_64 rng(11);
  for (PublishedForm form : {PublishedForm::kV1, PublishedForm::kV2}) {
    const CostModel model = form == PublishedForm::kV1 ? CostModel::PublishedV1() : CostModel::PublishedV2();
    int checked = 0, unchanged_ties = 0;
    for (int t = 0; t < 400; ++t) {
      const int n = 2 + static_cast<int>(rng() % 7);
      Router e = MakeE(model, n);
      // The request's context as E prices it: input + half the mean output seen so far
      // (RoutingConfig::initial_output_tokens = 300 before any request finished).
      int64_t mid_stay = 150;
      if (t % 2) {
        const int64_t out = static_cast<int64_t>(rng() % 4000);
        e.ObserveFinished(out);
        mid_stay = static_cast<int64_t>(out / 2.0);
      }
      std::vector<RankLoad> loads(n);
      for (auto& l : loads) {
        l.num_requests = static_cast<int>(rng() % 6);
        l.ctx_tokens = static_cast<int64_t>(rng() % 4) * 50000;
        l.reserved_tokens = l.ctx_tokens;
        l.capacity_tokens = rng() % 5 ? 1000000 : l.ctx_tokens + 1000;  // some ranks do not fit
        l.agg.num_requests = l.num_requests;
        l.agg.query_tokens = l.num_requests;
        l.agg.query_key_pairs = static_cast<double>(l.ctx_tokens);
      }
      const RouteRequest req{static_cast<int64_t>(rng() % 30000), 2000};
      absl::StatusOr<int> got = e.Route(req, loads);
      std::vector<BatchAggregates> aggs;
      for (const auto& l : loads) aggs.push_back(l.agg);
      int want = -1;
      double want_cost = 0;
      std::vector<double> costs(n, -1);
      for (int i = 0; i < n; ++i) {
        if (loads[i].reserved_tokens + req.input_tokens + req.output_tokens > loads[i].capacity_tokens) continue;
        std::vector<BatchAggregates> with = aggs;
        with[i].Add({req.input_tokens + mid_stay, 1});
        costs[i] = PublishedInstanceCost(form, with);
        const bool better =
            want < 0 || costs[i] < want_cost ||
            (costs[i] == want_cost &&
             (loads[i].num_requests < loads[want].num_requests ||
              (loads[i].num_requests == loads[want].num_requests &&
               loads[i].ctx_tokens > loads[want].ctx_tokens)));
        if (better) {
          want = i;
          want_cost = costs[i];
        }
      }
      if (want < 0) {
        EXPECT_FALSE(got.ok());
        continue;
      }
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, want) << "trial " << t;
      ++checked;
      int at_min = 0;
      for (double c : costs) at_min += c == want_cost;
      unchanged_ties += at_min > 1;
    }
    EXPECT_GT(checked, 300);
    EXPECT_GT(unchanged_ties, 50);  // the tie-breaks were exercised, not only the cost
  }
}

// Every strategy (and D inside groups, chosen by A or B) on random loads: the route fits, two
// routers fed the same requests agree, and both equal the reference written from the contract
// (reference_router.h), not from the router's code.
TEST(Routing, PropertyRouteAlwaysFitsIsDeterministicAndEqualsTheReference) {
  std::mt19937_64 rng(3);
  struct Case {
    RoutingStrategy s;
    int groups;
    RoutingStrategy group_choice;
  };
  const Case cases[] = {
      {RoutingStrategy::kMinBatch, 1, RoutingStrategy::kMinBatch},
      {RoutingStrategy::kMinContext, 1, RoutingStrategy::kMinBatch},
      {RoutingStrategy::kLengthSplit, 1, RoutingStrategy::kMinBatch},
      {RoutingStrategy::kDualPath, 1, RoutingStrategy::kMinBatch},
      {RoutingStrategy::kCostAware, 1, RoutingStrategy::kMinBatch},
      {RoutingStrategy::kDualPath, 2, RoutingStrategy::kMinBatch},
      {RoutingStrategy::kDualPath, 3, RoutingStrategy::kMinContext},
      {RoutingStrategy::kDualPath, 5, RoutingStrategy::kMinBatch},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(::testing::Message() << RoutingName(k.s) << " groups " << k.groups << " by "
                                      << RoutingName(k.group_choice));
    RoutingConfig c;
    c.strategy = k.s;
    c.groups = k.groups;
    c.group_choice = k.group_choice;
    c.split_window = 50;
    Router r1 = *Router::Create(c, 16, CostModel::PublishedV2());
    Router r2 = *Router::Create(c, 16, CostModel::PublishedV2());
    testing::ReferenceRouter ref(c, 16, CostModel::PublishedV2());
    int routed = 0;
    for (int t = 0; t < 300; ++t) {
      std::vector<RankLoad> loads(16);
      for (auto& l : loads) {
        l.num_requests = static_cast<int>(rng() % 40);
        l.ctx_tokens = static_cast<int64_t>(rng() % 400000);
        l.reserved_tokens = l.ctx_tokens + static_cast<int64_t>(rng() % 20000);
        l.capacity_tokens = 450000;
        l.max_requests = 38;
        l.agg.num_requests = l.num_requests;
        l.agg.query_tokens = l.num_requests;
        l.agg.query_key_pairs = static_cast<double>(l.ctx_tokens);
      }
      const RouteRequest req{static_cast<int64_t>(rng() % 60000), static_cast<int64_t>(rng() % 2000)};
      absl::StatusOr<int> a = r1.Route(req, loads), b = r2.Route(req, loads);
      const int want = ref.Route(req, loads);
      if (t % 7 == 0) {
        const int64_t out = static_cast<int64_t>(rng() % 3000);
        r1.ObserveFinished(out);
        r2.ObserveFinished(out);
        ref.ObserveFinished(out);
      }
      ASSERT_EQ(a.ok(), b.ok());
      ASSERT_EQ(a.ok(), want >= 0) << "request " << t;
      if (!a.ok()) {
        EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
        continue;
      }
      ++routed;
      EXPECT_EQ(*a, *b);
      EXPECT_EQ(*a, want) << "request " << t;
      const RankLoad& l = loads[*a];
      EXPECT_LE(l.reserved_tokens + req.input_tokens + req.output_tokens, l.capacity_tokens);
      EXPECT_LT(l.num_requests, l.max_requests);
    }
    EXPECT_GT(routed, 200);
  }
}

TEST(Routing, BadConfigNamesTheValue) {
  RoutingConfig c;
  c.groups = 100;
  absl::StatusOr<Router> r = Router::Create(c, 64, CostModel::PublishedV2());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("groups = 100"), std::string::npos);
  EXPECT_FALSE(ParseRouting("F").ok());
  EXPECT_EQ(*ParseRouting("cost"), RoutingStrategy::kCostAware);
}

// E's per-rank aggregates from a rank's summaries equal adding its requests one by one.
TEST(TypicalBatchAggregates, EqualsAddingTheRequestsOneByOne) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 500; ++trial) {
    const int n = static_cast<int>(rng() % 40);
    const int32_t q = 1 + static_cast<int32_t>(rng() % 8);
    BatchAggregates want;
    int64_t ctx_sum = 0, ctx_max = 0;
    for (int i = 0; i < n; ++i) {
      const int64_t ctx = static_cast<int64_t>(rng() % 200000);
      want.Add(RequestLoad{ctx, q});
      ctx_sum += ctx;
      ctx_max = std::max(ctx_max, ctx);
    }
    const BatchAggregates got = TypicalBatchAggregates(n, ctx_sum, ctx_max, q);
    EXPECT_EQ(got.num_requests, want.num_requests);
    EXPECT_EQ(got.query_tokens, want.query_tokens);
    EXPECT_EQ(got.query_key_pairs, want.query_key_pairs);
    EXPECT_EQ(got.key_tokens, want.key_tokens);
    EXPECT_EQ(got.max_query_key_pairs, want.max_query_key_pairs);
    EXPECT_EQ(got.max_key_tokens, want.max_key_tokens);
    EXPECT_EQ(got.multi_query, want.multi_query) << "n " << n << " q " << q;
  }
}

}  // namespace
}  // namespace dpbalance
