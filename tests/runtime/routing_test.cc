#include "dpbalance/routing.h"

#include <random>

#include "gtest/gtest.h"

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
}

TEST(Routing, CostAwarePicksLowestPredictedCostAfterAdding) {
  // Same batch sizes; rank 1 holds far less context -> lower predicted cost.
  const auto loads = Loads({{4, 400000}, {4, 4000}, {5, 4000}});
  Router e = Make(RoutingStrategy::kCostAware, 3);
  EXPECT_EQ(*e.Route({1000, 100}, loads), 1);
}

TEST(Routing, PropertyRouteAlwaysFitsAndIsDeterministic) {
  std::mt19937_64 rng(3);
  for (RoutingStrategy s : {RoutingStrategy::kMinBatch, RoutingStrategy::kMinContext,
                            RoutingStrategy::kLengthSplit, RoutingStrategy::kDualPath,
                            RoutingStrategy::kCostAware}) {
    Router r1 = Make(s, 16), r2 = Make(s, 16);
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
      ASSERT_EQ(a.ok(), b.ok());
      if (!a.ok()) continue;
      EXPECT_EQ(*a, *b);
      const RankLoad& l = loads[*a];
      EXPECT_LE(l.reserved_tokens + req.input_tokens + req.output_tokens, l.capacity_tokens);
      EXPECT_LT(l.num_requests, l.max_requests);
    }
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

}  // namespace
}  // namespace dpbalance
