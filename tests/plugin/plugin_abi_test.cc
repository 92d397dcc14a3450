// The plugin as an engine sees it: dlopen + dlsym + the C ABI only.
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dpbalance/plugin/dpbalance_plugin.h"
#include "gtest/gtest.h"

namespace {

class PluginAbi : public ::testing::Test {
 protected:
  void SetUp() override {
    // RTLD_NODELETE: hosts keep plugins loaded for the process lifetime (NCCL never unloads
    // one); the plugin's process-lifetime statics must stay reachable.
    lib_ = dlopen(DPB_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    ASSERT_NE(lib_, nullptr) << dlerror();
    plugin_ = static_cast<const dpbalancePlugin_t*>(dlsym(lib_, DPB_PLUGIN_SYMBOL));
    ASSERT_NE(plugin_, nullptr);
  }
  void TearDown() override {
    if (lib_) dlclose(lib_);
  }
  // What one rank saw in RunRanks.
  struct RankRun {
    int32_t depth = 0;
    dpbResult_t last = dpbSuccess;
    dpbStats_t stats{};
  };
  // Runs `ranks` threads through init, `steps` x (plan, report), stats and finalize, as an
  // engine's DP ranks would. Rank r plans `batch(r)` and reports `attention_us(r)`.
  std::vector<RankRun> RunRanks(int ranks, const std::string& config, int steps,
                                const std::function<std::vector<dpbRequest_t>(int)>& batch,
                                const std::function<double(int)>& attention_us, double step_us) {
    std::vector<RankRun> out(ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        dpbInitArgs_t a{};
        a.num_ranks = ranks;
        a.rank = r;
        a.config = config.c_str();
        a.backend = dpbBackendFromFlags;
        void* ctx = nullptr;
        ASSERT_EQ(plugin_->init(&a, &ctx), dpbSuccess);
        for (int step = 0; step < steps; ++step) {
          std::vector<dpbRequest_t> reqs = batch(r);
          std::vector<int32_t> v(reqs.size(), -1);
          out[r].last = plugin_->plan(ctx, reqs.data(), static_cast<int32_t>(reqs.size()), -1, v.data(),
                                      &out[r].depth);
          std::vector<dpbAccepted_t> acc;
          for (size_t i = 0; i < reqs.size(); ++i) {
            EXPECT_GE(v[i], 0);
            EXPECT_LE(v[i], out[r].depth);
            acc.push_back({reqs[i].request_id, v[i], v[i] > 0 ? 1 : 0, 0});
          }
          EXPECT_EQ(plugin_->report(ctx, attention_us(r), step_us, acc.data(), static_cast<int32_t>(acc.size())),
                    dpbSuccess);
        }
        EXPECT_EQ(plugin_->stats(ctx, &out[r].stats), dpbSuccess);
        EXPECT_EQ(plugin_->finalize(ctx), dpbSuccess);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  void* lib_ = nullptr;
  const dpbalancePlugin_t* plugin_ = nullptr;
};

// The balancer's symbols, the router's (dpbalance_router_v1.h) and the inspection ABI's
// (dpbalance_inspect_v1.h), nothing else.
TEST_F(PluginAbi, ExportsOnlyTheVersionedSymbols) {
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen("nm -D --defined-only " DPB_PLUGIN_PATH, "r"), pclose);
  ASSERT_NE(p, nullptr);
  std::array<char, 512> line;
  std::vector<std::string> symbols;
  while (fgets(line.data(), line.size(), p.get())) {
    std::string s(line.data());
    symbols.push_back(s.substr(s.rfind(' ') + 1, s.size() - s.rfind(' ') - 2));
  }
  std::sort(symbols.begin(), symbols.end());
  EXPECT_EQ(symbols, (std::vector<std::string>{"dpbalanceInspect_v1", "dpbalanceInspect_v2", "dpbalancePlugin_v1", "dpbalancePlugin_v2",
                                               "dpbalanceRouter_v1"}));
  EXPECT_STREQ(plugin_->name, "dpbalance");
}

TEST_F(PluginAbi, MultiRankThroughTheAbiAgreesAndReportsStats) {
  const std::vector<RankRun> runs = RunRanks(
      4, "backend=inproc;group=abi4;log_every=0;default_k=1;timeout_ms=20000", 10,
      [](int r) {
        std::vector<dpbRequest_t> reqs;
        for (int i = 0; i < 6 + r; ++i) reqs.push_back({100 * r + i, 1000 + 20000 * (r == 0) + 300 * i, 0, 7, nullptr, 0});
        return reqs;
      },
      [](int r) { return 10000.0 + 2000 * r; }, 40000);
  for (size_t r = 0; r < runs.size(); ++r) {
    EXPECT_EQ(runs[r].last, dpbSuccess);
    EXPECT_EQ(runs[r].depth, runs[0].depth);
    EXPECT_EQ(runs[r].stats.balanced_steps, 10);
    EXPECT_EQ(runs[r].stats.fallbacks, 0);
    EXPECT_GT(runs[r].stats.bubble_fraction, 0.1);  // reported times differ by rank
  }
}

// A model file from `dpbalance-calibrate --kernel` (one with a simulated kernel grid) drives the
// planner and the online refit through the ABI, with every rank agreeing on its hash.
TEST_F(PluginAbi, KernelGridModelFilePlansAndRefitsOnline) {
  const std::string path = ::testing::TempDir() + "/dpb_grid_model.json";
  {
    std::unique_ptr<FILE, int (*)(FILE*)> f(fopen(path.c_str(), "w"), fclose);
    ASSERT_NE(f, nullptr);
    fputs(R"({"format": "dpbalance-cost-model", "version": 1, "name": "grid-test", "units": "us",
              "kernel_grid": "fa2-packed-h200",
              "weights_us": {"constant": 30, "query_tokens": 2,
                             "multi_grid_makespan_r100_o100": 2.5,
                             "multi_grid_cold_reads_w16": 0.01,
                             "single_grid_makespan_r80_o25": 1.5}})",
          f.get());
  }
  auto run = [&](int online) {
    return RunRanks(
        2,
        "backend=inproc;group=abigrid" + std::to_string(online) +
            ";log_every=0;default_k=1;timeout_ms=20000;online=" + std::to_string(online) +
            ";cost_model=" + path,
        12,
        [](int r) {
          // Rank 0 holds one long request: a critical path of 1,000 key blocks in the packed grid.
          std::vector<dpbRequest_t> reqs;
          for (int i = 0; i < 8; ++i) reqs.push_back({100 * r + i, (r == 0 && i == 0 ? 64000 : 2000) + 50 * i, 0, 7, nullptr, 0});
          return reqs;
        },
        [](int r) { return r == 0 ? 3000.0 : 1200.0; }, 25000);
  };
  const std::vector<RankRun> fixed = run(0), runs = run(1);
  for (size_t r = 0; r < runs.size(); ++r) {
    EXPECT_EQ(runs[r].last, dpbSuccess) << "rank " << r;
    EXPECT_EQ(runs[r].depth, runs[0].depth);
    EXPECT_EQ(runs[r].stats.balanced_steps, 12) << "rank " << r;
    EXPECT_EQ(runs[r].stats.fallbacks, 0) << "rank " << r;
    ASSERT_TRUE(std::isfinite(runs[r].stats.predicted_error)) << "rank " << r;
    // The refit moved the model towards the reported times: the file's model, held fixed,
    // predicts them worse.
    EXPECT_EQ(fixed[r].stats.balanced_steps, 12) << "rank " << r;
    std::printf("rank %zu: predicted error %.4f fixed, %.4f refitted online\n", r,
                fixed[r].stats.predicted_error, runs[r].stats.predicted_error);
    EXPECT_LT(runs[r].stats.predicted_error, 0.5 * fixed[r].stats.predicted_error) << "rank " << r;
  }
  std::remove(path.c_str());
}

// A rank whose engine passes plan no usable batch (here: requests NULL) still joins that step's
// exchange, so the others balance without it instead of waiting for it until the timeout.
TEST_F(PluginAbi, ARankWithUnusableArgumentsStillJoinsTheExchange) {
  constexpr int kRanks = 3, kSteps = 5, kBadRank = 1, kBadStep = 2;
  std::vector<std::vector<dpbResult_t>> result(kRanks, std::vector<dpbResult_t>(kSteps));
  std::vector<std::vector<int32_t>> depth(kRanks, std::vector<int32_t>(kSteps, -1));
  std::vector<dpbStats_t> stats(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      dpbInitArgs_t a{};
      a.num_ranks = kRanks;
      a.rank = r;
      a.config = "backend=inproc;group=abstain3;log_every=0;default_k=1;timeout_ms=3000";
      a.backend = dpbBackendFromFlags;
      void* ctx = nullptr;
      ASSERT_EQ(plugin_->init(&a, &ctx), dpbSuccess);
      for (int s = 0; s < kSteps; ++s) {
        std::vector<dpbRequest_t> reqs;
        for (int i = 0; i < 5 + r; ++i) reqs.push_back({100 * r + i, 2000 + 9000 * (r == 0) + 400 * i, 0, 7, nullptr, 0});
        std::vector<int32_t> v(reqs.size(), -1);
        const bool bad = r == kBadRank && s == kBadStep;
        result[r][s] = plugin_->plan(ctx, bad ? nullptr : reqs.data(), static_cast<int32_t>(reqs.size()), -1,
                                     v.data(), &depth[r][s]);
        if (bad) continue;
        std::vector<dpbAccepted_t> acc;
        for (size_t i = 0; i < reqs.size(); ++i) acc.push_back({reqs[i].request_id, v[i], v[i] > 0 ? 1 : 0, 0});
        plugin_->report(ctx, 10000.0 + 2000 * r, 40000, acc.data(), static_cast<int32_t>(acc.size()));
      }
      EXPECT_EQ(plugin_->stats(ctx, &stats[r]), dpbSuccess);
      EXPECT_EQ(plugin_->finalize(ctx), dpbSuccess);
    });
  }
  for (auto& t : threads) t.join();
  for (int s = 0; s < kSteps; ++s) {
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_EQ(result[r][s], r == kBadRank && s == kBadStep ? dpbInvalidArgument : dpbSuccess)
          << "rank " << r << " step " << s;
      EXPECT_EQ(depth[r][s], depth[0][s]) << "rank " << r << " step " << s;
    }
  }
  EXPECT_EQ(stats[0].balanced_steps, kSteps);
  EXPECT_EQ(stats[kBadRank].fallbacks, 1);
  EXPECT_EQ(stats[kBadRank].balanced_steps, kSteps - 1);
}

TEST_F(PluginAbi, BadFlagsAndArgumentsFallBackToDefaults) {
  dpbInitArgs_t a{};
  a.num_ranks = 1;
  a.rank = 0;
  a.config = "k_max=99";
  a.backend = dpbBackendInProcess;
  void* ctx = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(plugin_->init(&a, &ctx), dpbInvalidArgument);
  EXPECT_EQ(ctx, nullptr);
  a.config = "group=solo;log_every=0";
  a.rank = 3;
  EXPECT_EQ(plugin_->init(&a, &ctx), dpbInvalidArgument);
  a.rank = 0;
  ASSERT_EQ(plugin_->init(&a, &ctx), dpbSuccess);
  // A request with a negative context: default lengths, a fallback, no crash.
  dpbRequest_t reqs[2] = {{1, -10, 0, 5, nullptr, 0}, {2, 100, 0, 2, nullptr, 0}};
  int32_t v[2] = {-1, -1}, d = -1;
  EXPECT_EQ(plugin_->plan(ctx, reqs, 2, -1, v, &d), dpbFallback);
  EXPECT_EQ(v[0], 3);  // min(default_k = 3, cap 5)
  EXPECT_EQ(v[1], 2);
  // A context at int64's limit, on steps whose earlier plans are still unreported (the lag
  // prediction adds to the context): a fallback each step, never an overflow.
  dpbRequest_t huge = {4, INT64_MAX, 0, 5, nullptr, 0};
  for (int step = 0; step < 3; ++step) {
    EXPECT_EQ(plugin_->plan(ctx, &huge, 1, -1, v, &d), dpbFallback);
    EXPECT_EQ(v[0], 3);
  }
  EXPECT_EQ(plugin_->plan(ctx, reqs, -1, -1, v, &d), dpbInvalidArgument);
  EXPECT_EQ(plugin_->plan(nullptr, reqs, 2, -1, v, &d), dpbInvalidArgument);
  // Confidence out of [0, 1]: also a fallback.
  const float conf[2] = {0.9f, 1.7f};
  dpbRequest_t c = {3, 100, 0, 2, conf, 2};
  EXPECT_EQ(plugin_->plan(ctx, &c, 1, -1, v, &d), dpbFallback);
  EXPECT_EQ(plugin_->report(ctx, std::nan(""), 1.0, nullptr, 0), dpbInvalidArgument);
  EXPECT_EQ(plugin_->finalize(ctx), dpbSuccess);
}

}  // namespace
