// The router ABI as an engine's DP router sees it: dlopen + dlsym + dpbalance_router_v1.h. Its
// choices must equal the reference written from the routing contract (reference_router.h), and
// so the runtime Router's (the replay's) for the same loads.
#include <dlfcn.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "dpbalance/cost_model.h"
#include "dpbalance/plugin/dpbalance_plugin.h"
#include "dpbalance/routing.h"
#include "gtest/gtest.h"
#include "../runtime/reference_router.h"

namespace dpbalance {
namespace {

class RouterAbi : public ::testing::Test {
 protected:
  void SetUp() override {
    lib_ = dlopen(DPB_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    ASSERT_NE(lib_, nullptr) << dlerror();
    router_ = static_cast<const dpbalanceRouter_t*>(dlsym(lib_, DPB_ROUTER_SYMBOL));
    ASSERT_NE(router_, nullptr);
  }
  void TearDown() override {
    if (lib_) dlclose(lib_);
  }
  // A router through the ABI, or nullptr with the create result in *result.
  void* Create(int ranks, const std::string& config, dpbResult_t* result = nullptr) {
    dpbRouterArgs_t a{ranks, config.c_str()};
    void* r = nullptr;
    const dpbResult_t res = router_->create(&a, &r);
    if (result) *result = res;
    return r;
  }
  void* lib_ = nullptr;
  const dpbalanceRouter_t* router_ = nullptr;
};

// A fitted per-rank model (no published form): V2's weights plus a critical-path term on the
// longest context, so E's choice depends on max_ctx_tokens too.
std::string WriteFitModel() {
  CostModel::Weights w = CostModel::PublishedV2().weights_us();
  w[FeatureIndex(Regime::kBase, CostTerm::kMaxKeyTokens)] = 0.05;
  const std::string path = ::testing::TempDir() + "/router_abi_fit.json";
  std::ofstream(path) << CostModel::Create(w, "fit")->ToJson();
  return path;
}

TEST_F(RouterAbi, ChoosesAsTheReferenceAndTheRuntimeRouterForEveryStrategy) {
  const std::string fit = WriteFitModel();
  struct Case {
    std::string config;
    RoutingConfig rc;
    CostModel model;
  };
  auto rc = [](RoutingStrategy s, double z = 1.2, int groups = 1) {
    RoutingConfig c;
    c.strategy = s;
    c.z = z;
    c.groups = groups;
    return c;
  };
  std::vector<Case> cases = {
      {"routing=A", rc(RoutingStrategy::kMinBatch), CostModel::PublishedV2()},
      {"routing=B", rc(RoutingStrategy::kMinContext), CostModel::PublishedV2()},
      {"routing=C;split_window=50", rc(RoutingStrategy::kLengthSplit), CostModel::PublishedV2()},
      {"routing=D;z=1.3", rc(RoutingStrategy::kDualPath, 1.3), CostModel::PublishedV2()},
      {"routing=D;groups=4;group_choice=B", rc(RoutingStrategy::kDualPath, 1.2, 4), CostModel::PublishedV2()},
      {"routing=E", rc(RoutingStrategy::kCostAware), CostModel::PublishedV2()},
      {"routing=E;cost_model=v1;route_query_tokens=2", rc(RoutingStrategy::kCostAware), CostModel::PublishedV1()},
      {"routing=E;cost_model=" + fit, rc(RoutingStrategy::kCostAware), *CostModel::FromFile(fit)},
  };
  cases[2].rc.split_window = 50;
  cases[4].rc.group_choice = RoutingStrategy::kMinContext;
  cases[6].rc.query_tokens_per_request = 2;
  const int ranks = 16;
  for (Case& c : cases) {
    SCOPED_TRACE(c.config);
    void* abi = Create(ranks, c.config);
    ASSERT_NE(abi, nullptr);
    absl::StatusOr<Router> cpp = Router::Create(c.rc, ranks, c.model);
    ASSERT_TRUE(cpp.ok()) << cpp.status();
    testing::ReferenceRouter ref(c.rc, ranks, c.model);
    std::mt19937_64 rng(5);
    // Each rank's requests (contexts); loads are rebuilt from them before every route.
    std::vector<std::vector<int64_t>> reqs(ranks);
    int routed = 0, waited = 0;
    for (int t = 0; t < 400; ++t) {
      std::vector<RankLoad> cl(ranks);
      std::vector<dpbRankLoad_t> al(ranks);
      for (int r = 0; r < ranks; ++r) {
        RankLoad& l = cl[r];
        l.capacity_tokens = 200000;
        l.max_requests = 40;
        for (int64_t ctx : reqs[r]) {
          l.num_requests += 1;
          l.ctx_tokens += ctx;
          l.reserved_tokens += ctx + 500;
          l.agg.Add({ctx, static_cast<int32_t>(c.rc.query_tokens_per_request)});
        }
        al[r] = {l.num_requests, l.max_requests, l.ctx_tokens,
                 static_cast<int64_t>(l.agg.max_key_tokens), l.reserved_tokens, l.capacity_tokens};
      }
      std::lognormal_distribution<double> len(8.5, 1.2);
      const int64_t input = std::min<int64_t>(200000, static_cast<int64_t>(len(rng)));
      const RouteRequest req{input, 500};
      const int want = ref.Route(req, cl);
      absl::StatusOr<int> runtime = cpp->Route(req, cl);
      ASSERT_EQ(runtime.ok(), want >= 0) << "request " << t;
      if (runtime.ok()) {
        ASSERT_EQ(*runtime, want) << "request " << t;
      }
      int32_t got = -7;
      const dpbResult_t res = router_->route(abi, al.data(), ranks, req.input_tokens, req.output_tokens, &got);
      if (want < 0) {
        EXPECT_EQ(res, dpbFallback);
        EXPECT_EQ(got, -1);
        ++waited;
      } else {
        ASSERT_EQ(res, dpbSuccess) << "request " << t;
        ASSERT_EQ(got, want) << "request " << t;
        reqs[got].push_back(input);
        ++routed;
      }
      // Requests leave now and then; both routers learn the output length.
      if (t % 3 == 0) {
        const int r = static_cast<int>(rng() % ranks);
        if (!reqs[r].empty()) {
          reqs[r].erase(reqs[r].begin() + static_cast<long>(rng() % reqs[r].size()));
          const int64_t out = static_cast<int64_t>(rng() % 3000);
          cpp->ObserveFinished(out);
          ref.ObserveFinished(out);
          EXPECT_EQ(router_->observe_finished(abi, out), dpbSuccess);
        }
      }
    }
    EXPECT_GT(routed, 200);
    EXPECT_GT(waited, 0);  // the capacity filter was reached
    EXPECT_EQ(router_->destroy(abi), dpbSuccess);
  }
}

TEST_F(RouterAbi, BadInputFailsWithoutARank) {
  dpbResult_t res;
  EXPECT_EQ(Create(4, "routing=F", &res), nullptr);
  EXPECT_EQ(res, dpbInvalidArgument);
  EXPECT_EQ(Create(4, "groups=8", &res), nullptr);  // more groups than ranks
  EXPECT_EQ(res, dpbInvalidArgument);
  EXPECT_EQ(Create(0, "", &res), nullptr);
  EXPECT_EQ(res, dpbInvalidArgument);
  EXPECT_EQ(router_->create(nullptr, nullptr), dpbInvalidArgument);

  void* r = Create(2, "routing=E");
  ASSERT_NE(r, nullptr);
  std::vector<dpbRankLoad_t> loads = {{3, 0, 9000, 5000, 10000, 100000}, {2, 0, 4000, 3000, 6000, 100000}};
  int32_t rank = -7;
  ASSERT_EQ(router_->route(r, loads.data(), 2, 1000, 100, &rank), dpbSuccess);
  EXPECT_EQ(rank, 1);
  auto expect_bad = [&](std::vector<dpbRankLoad_t> l, int32_t n, int64_t in, int64_t out) {
    int32_t got = -7;
    EXPECT_EQ(router_->route(r, l.data(), n, in, out, &got), dpbInvalidArgument);
    EXPECT_EQ(got, -1);
  };
  expect_bad(loads, 3, 1000, 100);  // three loads for two ranks
  expect_bad(loads, 2, -1, 100);
  expect_bad(loads, 2, 1000, -1);
  for (int field = 0; field < 5; ++field) {
    std::vector<dpbRankLoad_t> l = loads;
    switch (field) {
      case 0: l[1].num_requests = -1; break;
      case 1: l[1].ctx_tokens = -1; break;
      case 2: l[1].max_ctx_tokens = l[1].ctx_tokens + 1; break;  // longer than the rank's sum
      case 3: l[1].reserved_tokens = -1; break;
      case 4: l[1].capacity_tokens = -1; break;
    }
    expect_bad(l, 2, 1000, 100);
  }
  EXPECT_EQ(router_->route(r, nullptr, 2, 1000, 100, &rank), dpbInvalidArgument);
  EXPECT_EQ(router_->route(r, loads.data(), 2, 1000, 100, nullptr), dpbInvalidArgument);
  EXPECT_EQ(router_->observe_finished(r, -5), dpbInvalidArgument);
  EXPECT_EQ(router_->observe_finished(nullptr, 5), dpbInvalidArgument);
  // Full ranks: the request waits (dpbFallback, no rank), and the router still works after.
  std::vector<dpbRankLoad_t> full = {{3, 3, 9000, 5000, 10000, 100000}, {2, 0, 4000, 3000, 99500, 100000}};
  EXPECT_EQ(router_->route(r, full.data(), 2, 1000, 100, &rank), dpbFallback);
  EXPECT_EQ(rank, -1);
  ASSERT_EQ(router_->route(r, loads.data(), 2, 1000, 100, &rank), dpbSuccess);
  EXPECT_EQ(rank, 1);
  EXPECT_EQ(router_->destroy(r), dpbSuccess);
}

}  // namespace
}  // namespace dpbalance
