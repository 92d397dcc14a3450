// The v2 plugin ABI as an engine sees it: dlopen + dlsym("dpbalancePlugin_v2"), ranks as threads
// over the in-process backend or an engine callback. Real processes over gloo:
// tests/integration/contract_*.py.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dpbalance/plugin/dpbalance_plugin.h"
#include "gtest/gtest.h"

namespace {

// One engine step of one process, as it went.
struct StepSeen {
  dpbResult_t result = dpbSuccess;
  int32_t depth = 0, balanced = 0, budget = 0;
  int64_t padded = 0;
  uint32_t any_flags = 0;
  std::vector<int64_t> rank_tokens;
  std::vector<uint32_t> rank_flags;
  std::vector<int32_t> verify_len;
  int64_t own_total = 0;  // sum(1 + verify_len) + extra_tokens
};

// What the engine gives one process for one step.
struct EngineStep {
  dpbStepKind_t kind = dpbStepDecode;
  std::vector<std::string> ids;
  std::vector<int64_t> ctx;
  int32_t k_cap = 5;
  int64_t extra = 0;
};

class PluginV2 : public ::testing::Test {
 protected:
  void SetUp() override {
    lib_ = dlopen(DPB_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    ASSERT_NE(lib_, nullptr) << dlerror();
    v2_ = static_cast<const dpbalancePlugin_v2_t*>(dlsym(lib_, DPB_PLUGIN_SYMBOL_V2));
    v1_ = static_cast<const dpbalancePlugin_v1_t*>(dlsym(lib_, "dpbalancePlugin_v1"));
    ASSERT_NE(v2_, nullptr);
    ASSERT_NE(v1_, nullptr);
    ASSERT_EQ(v2_->abi_version, static_cast<uint32_t>(DPB_PLUGIN_ABI_VERSION_2));
  }
  void TearDown() override {
    if (lib_) dlclose(lib_);
  }

  static dpbInitArgs_v2_t Args(int dp, int rank, int tp, int tp_rank, const char* config) {
    dpbInitArgs_v2_t a{};
    a.struct_size = sizeof(a);
    a.dp_size = dp;
    a.dp_rank = rank;
    a.attn_tp_size = tp;
    a.attn_tp_rank = tp_rank;
    a.config = config;
    a.backend = dpbBackendFromFlags;
    a.cuda_device = -1;
    return a;
  }

  // The engine's requests in ABI form (ids point into `e`).
  static std::vector<dpbRequest_v2_t> Requests(const EngineStep& e) {
    std::vector<dpbRequest_v2_t> reqs(e.ids.size());
    for (size_t i = 0; i < e.ids.size(); ++i) {
      reqs[i] = dpbRequest_v2_t{e.ids[i].data(), static_cast<int32_t>(e.ids[i].size()), e.ctx[i], 0, e.k_cap,
                                nullptr, 0};
    }
    return reqs;
  }

  // One plan + report of one process.
  StepSeen Step(void* ctx, int dp, const EngineStep& e, double attention_us) const {
    std::vector<dpbRequest_v2_t> reqs = Requests(e);
    dpbStep_v2_t step{e.kind, reqs.data(), static_cast<int32_t>(reqs.size()), -1, e.extra};
    StepSeen s;
    s.verify_len.assign(reqs.size(), -1);
    s.rank_tokens.assign(dp, -7);
    s.rank_flags.assign(dp, 0);
    dpbPlanResult_v2_t res{};
    res.verify_len = s.verify_len.data();
    res.rank_tokens = s.rank_tokens.data();
    res.rank_flags = s.rank_flags.data();
    s.result = v2_->plan(ctx, &step, &res);
    s.depth = res.draft_depth;
    s.balanced = res.balanced;
    s.budget = res.verify_budget;
    s.padded = res.padded_tokens;
    s.any_flags = res.any_rank_flags;
    s.own_total = e.extra;
    std::vector<dpbAccepted_v2_t> acc;
    for (size_t i = 0; i < reqs.size(); ++i) {
      s.own_total += 1 + s.verify_len[i];
      // A draft that accepts about 80% of what it verifies.
      acc.push_back({e.ids[i].data(), static_cast<int32_t>(e.ids[i].size()), s.verify_len[i],
                     (s.verify_len[i] * 4) / 5, 0});
    }
    dpbReport_v2_t rep{res.plan_id, attention_us, attention_us + 3000, acc.data(), static_cast<int32_t>(acc.size())};
    EXPECT_EQ(v2_->report(ctx, &rep), dpbSuccess);
    return s;
  }

  // Runs dp x tp processes as threads for `steps` steps; `engine(dp_rank, tp_rank, step)` gives
  // each its step. Returns seen[process][step].
  std::vector<std::vector<StepSeen>> Run(int dp, int tp, const std::string& config, int steps,
                                         const std::function<EngineStep(int, int, int)>& engine,
                                         std::vector<dpbStats_v2_t>* stats = nullptr) {
    std::vector<std::vector<StepSeen>> seen(dp * tp);
    if (stats) stats->assign(dp * tp, dpbStats_v2_t{});
    std::vector<std::thread> threads;
    for (int r = 0; r < dp; ++r) {
      for (int t = 0; t < tp; ++t) {
        threads.emplace_back([&, r, t] {
          const dpbInitArgs_v2_t a = Args(dp, r, tp, t, config.c_str());
          void* ctx = nullptr;
          ASSERT_EQ(v2_->init(&a, &ctx), dpbSuccess);
          for (int step = 0; step < steps; ++step) {
            // Members of one DP rank measure different attention times (their own heads).
            seen[r * tp + t].push_back(Step(ctx, dp, engine(r, t, step), 300.0 + 150 * r + 40 * t));
          }
          if (stats) {
            EXPECT_EQ(v2_->stats(ctx, &(*stats)[r * tp + t]), dpbSuccess);
          }
          EXPECT_EQ(v2_->finalize(ctx), dpbSuccess);
        });
      }
    }
    for (auto& th : threads) th.join();
    return seen;
  }

  // A decode batch whose size and contexts differ by rank, with the engine's string ids.
  static EngineStep Decode(int rank, int step) {
    EngineStep e;
    const int n = 3 + 4 * rank + step % 3;
    for (int i = 0; i < n; ++i) {
      e.ids.push_back("req-" + std::to_string(rank) + "-" + std::to_string(i) + "-abcdefghijklmnop");
      e.ctx.push_back(1500 + 3000 * rank + 97 * i + 11 * step);
    }
    return e;
  }

  // Every process agrees on the step's depth, totals, tier and flags, and each one's own lengths
  // add up to its total.
  static void ExpectOneExchange(const std::vector<std::vector<StepSeen>>& seen, int dp, int tp,
                                bool tiers = false) {
    for (size_t step = 0; step < seen[0].size(); ++step) {
      const StepSeen& first = seen[0][step];
      for (int p = 0; p < dp * tp; ++p) {
        const StepSeen& s = seen[p][step];
        EXPECT_EQ(s.depth, first.depth) << "process " << p << " step " << step;
        EXPECT_EQ(s.rank_tokens, first.rank_tokens) << "process " << p << " step " << step;
        EXPECT_EQ(s.rank_flags, first.rank_flags) << "process " << p << " step " << step;
        EXPECT_EQ(s.padded, first.padded) << "process " << p << " step " << step;
        EXPECT_EQ(s.any_flags, first.any_flags);
        if (tiers && (s.rank_flags[p / tp] & DPB_RANK_PLANNED)) {
          // A planned rank runs the agreed tier: its own verify work stays within it.
          EXPECT_LE(s.own_total, s.rank_tokens[p / tp]) << "process " << p << " step " << step;
          EXPECT_EQ(s.rank_tokens[p / tp], s.padded) << "process " << p << " step " << step;
        } else {
          EXPECT_EQ(s.own_total, s.rank_tokens[p / tp]) << "process " << p << " step " << step;
        }
        int32_t budget = 0;
        for (int32_t v : s.verify_len) {
          EXPECT_GE(v, 0);
          EXPECT_LE(v, s.depth);
          budget += v;
        }
        EXPECT_EQ(budget, s.budget);
      }
      int64_t max_total = 0;
      for (int64_t t : first.rank_tokens) max_total = std::max(max_total, t);
      EXPECT_GE(first.padded, max_total);
    }
  }

  void* lib_ = nullptr;
  const dpbalancePlugin_v2_t* v2_ = nullptr;
  const dpbalancePlugin_v1_t* v1_ = nullptr;
};

TEST_F(PluginV2, EveryRankDerivesEveryTokenTotalAndTheTierFromOneExchange) {
  const int dp = 4;
  const auto seen = Run(dp, 1, "backend=inproc;group=v2totals;log_every=0;default_k=2;timeout_ms=20000", 40,
                        [](int r, int, int step) { return Decode(r, step); });
  ExpectOneExchange(seen, dp, 1);
  int balanced = 0;
  for (const StepSeen& s : seen[0]) balanced += s.balanced;
  EXPECT_GT(balanced, 30);
  // The slow rank (longest contexts) verifies less per request than the fast one.
  auto per_request = [&](int r) {
    double budget = 0, requests = 0;
    for (const StepSeen& s : seen[r]) {
      budget += s.budget;
      requests += static_cast<double>(s.verify_len.size());
    }
    return budget / requests;
  };
  EXPECT_LT(per_request(3), per_request(0));
}

TEST_F(PluginV2, TiersPadEveryRankToTheTierOfTheLargest) {
  const int dp = 3;
  const auto seen = Run(dp, 1, "backend=inproc;group=v2tiers;log_every=0;default_k=2;timeout_ms=20000;"
                        "tiers=16,24,32,48,64,96,128;padded=1", 30,
                        [](int r, int, int step) { return Decode(r, step); });
  ExpectOneExchange(seen, dp, 1, /*tiers=*/true);
  for (const StepSeen& s : seen[0]) {
    const std::vector<int64_t> tiers{16, 24, 32, 48, 64, 96, 128};
    const int64_t max_total = *std::max_element(s.rank_tokens.begin(), s.rank_tokens.end());
    const auto it = std::lower_bound(tiers.begin(), tiers.end(), max_total);
    EXPECT_EQ(s.padded, it == tiers.end() ? max_total : *it);
  }
}

TEST_F(PluginV2, IdleExtendAndNoVerifyStepsJoinTheExchangeWithTheirTotals) {
  const int dp = 4;
  const auto seen = Run(dp, 1, "backend=inproc;group=v2kinds;log_every=0;default_k=2;timeout_ms=20000", 30,
                        [](int r, int, int step) {
                          EngineStep e = Decode(r, step);
                          if (r == 1 && step % 2 == 0) e = EngineStep{dpbStepIdle};  // a dummy batch
                          if (r == 2 && step % 3 == 0) {  // a prefill chunk beside decode
                            e.kind = dpbStepExtend;
                            e.extra = 512;
                          }
                          if (r == 3 && step % 5 == 0) e.kind = dpbStepNoVerify;
                          return e;
                        });
  ExpectOneExchange(seen, dp, 1);
  for (size_t step = 0; step < seen[0].size(); ++step) {
    const StepSeen& s = seen[0][step];
    if (step % 2 == 0) {
      EXPECT_EQ(s.rank_tokens[1], 0);
      EXPECT_TRUE(s.rank_flags[1] & DPB_RANK_IDLE);
    }
    if (step % 3 == 0) {
      EXPECT_TRUE(s.rank_flags[2] & DPB_RANK_EXTEND);
      EXPECT_TRUE(s.any_flags & DPB_RANK_EXTEND);
      EXPECT_GE(s.rank_tokens[2], 512);
    }
    if (step % 5 == 0) {
      EXPECT_TRUE(s.rank_flags[3] & DPB_RANK_NO_VERIFY);
      for (int32_t v : seen[3][step].verify_len) EXPECT_EQ(v, 0);
      EXPECT_EQ(s.rank_tokens[3], static_cast<int64_t>(seen[3][step].verify_len.size()));
    }
  }
}

TEST_F(PluginV2, AttentionTpMembersGetTheSamePlan) {
  const int dp = 2, tp = 2;
  std::vector<dpbStats_v2_t> stats;
  const auto seen = Run(dp, tp, "backend=inproc;group=v2tp;log_every=0;default_k=2;timeout_ms=20000", 40,
                        [](int r, int, int step) { return Decode(r, step); }, &stats);
  ExpectOneExchange(seen, dp, tp);
  for (int r = 0; r < dp; ++r) {
    for (size_t step = 0; step < seen[0].size(); ++step) {
      EXPECT_EQ(seen[r * tp][step].verify_len, seen[r * tp + 1][step].verify_len) << "DP rank " << r;
    }
  }
  for (const dpbStats_v2_t& s : stats) EXPECT_EQ(s.tp_mismatches, 0);
  int balanced = 0;
  for (const StepSeen& s : seen[0]) balanced += s.balanced;
  EXPECT_GT(balanced, 30);
}

TEST_F(PluginV2, AttentionTpMembersWithDifferentInputsFallBackTogether) {
  const int dp = 2, tp = 2;
  std::vector<dpbStats_v2_t> stats;
  const auto seen = Run(dp, tp, "backend=inproc;group=v2tpbad;log_every=0;default_k=2;timeout_ms=20000;max_failures=1000", 20,
                        [](int r, int t, int step) {
                          EngineStep e = Decode(r, step);
                          if (r == 1 && t == 1 && step >= 10) e.ctx[0] += 5000;  // a diverged member
                          return e;
                        },
                        &stats);
  ExpectOneExchange(seen, dp, tp);
  for (size_t step = 10; step < seen[0].size(); ++step) {
    EXPECT_EQ(seen[2][step].verify_len, seen[3][step].verify_len);
    EXPECT_FALSE(seen[0][step].rank_flags[1] & DPB_RANK_PLANNED);
    EXPECT_NE(seen[2][step].result, dpbSuccess);
  }
  EXPECT_EQ(stats[2].tp_mismatches, 10);
  EXPECT_EQ(stats[3].tp_mismatches, 10);
  EXPECT_EQ(stats[0].tp_mismatches, 0);
}

// Engine callbacks: a group that disagrees on its size returns fewer (or more) bytes than the
// plugin's buffer holds; the plugin names it, falls back and never lets the callback overflow.
struct FakeGroup {
  int bytes_to_report;  // what the callback claims it wrote
  std::atomic<int> calls{0};
};

int64_t ShortCallback(void* user, const void* send, size_t send_bytes, void* recv, size_t recv_bytes,
                      int32_t) {
  auto* g = static_cast<FakeGroup*>(user);
  ++g->calls;
  // A real engine group of one: writes what it has, never past the capacity it was told.
  const size_t n = std::min<size_t>(send_bytes, recv_bytes);
  std::memcpy(recv, send, n);
  return g->bytes_to_report;
}

TEST_F(PluginV2, ACallbackThatDeliversTheWrongSizeIsAFallbackNamingIt) {
  for (int reported : {512, 1536}) {  // 2 ranks need 1024 bytes
    FakeGroup g{reported};
    dpbInitArgs_v2_t a = Args(2, 0, 1, 0, "log_every=0;default_k=2;timeout_ms=200");
    a.backend = dpbBackendCallback;
    a.allgather_fn = ShortCallback;
    a.allgather_user = &g;
    void* ctx = nullptr;
    // The handshake already sees it: the plugin disables (no hang, no overflow under ASan).
    EXPECT_EQ(v2_->init(&a, &ctx), dpbDisabled);
    ASSERT_NE(ctx, nullptr);
    const EngineStep e = Decode(0, 0);
    const StepSeen s = Step(ctx, 2, e, 500);
    EXPECT_EQ(s.result, dpbDisabled);
    for (size_t i = 0; i < e.ids.size(); ++i) EXPECT_EQ(s.verify_len[i], std::min(2, e.k_cap));
    EXPECT_EQ(s.rank_tokens[1], -1);  // unknown: the engine runs its own sync this step
    dpbStats_v2_t st{};
    EXPECT_EQ(v2_->stats(ctx, &st), dpbSuccess);
    EXPECT_EQ(st.exchange_failures, 1);
    EXPECT_EQ(g.calls.load(), 1);  // after a failed collective it is not called again
    EXPECT_EQ(v2_->finalize(ctx), dpbSuccess);
  }
}

TEST_F(PluginV2, RanksOnDifferentAbiVersionsDisableTogether) {
  std::vector<dpbResult_t> init(2);
  std::vector<dpbResult_t> plan(2);
  std::thread v1_rank([&] {
    dpbInitArgs_v1_t a{};
    a.num_ranks = 2;
    a.rank = 0;
    a.config = "backend=inproc;group=v1v2;log_every=0;default_k=2;timeout_ms=20000";
    void* ctx = nullptr;
    init[0] = v1_->init(&a, &ctx);
    dpbRequest_v1_t r{7, 4000, 0, 5, nullptr, 0};
    int32_t len = -1, depth = -1;
    plan[0] = v1_->plan(ctx, &r, 1, -1, &len, &depth);
    EXPECT_EQ(len, 2);
    v1_->finalize(ctx);
  });
  std::thread v2_rank([&] {
    const dpbInitArgs_v2_t a = Args(2, 1, 1, 0, "backend=inproc;group=v1v2;log_every=0;default_k=2;timeout_ms=20000");
    void* ctx = nullptr;
    init[1] = v2_->init(&a, &ctx);
    plan[1] = Step(ctx, 2, Decode(1, 0), 400).result;
    v2_->finalize(ctx);
  });
  v1_rank.join();
  v2_rank.join();
  EXPECT_EQ(init[0], dpbDisabled);
  EXPECT_EQ(init[1], dpbDisabled);
  EXPECT_EQ(plan[0], dpbDisabled);
  EXPECT_EQ(plan[1], dpbDisabled);
}

TEST_F(PluginV2, PlanAndReportStayPairedAndBadIdsFallBack) {
  const dpbInitArgs_v2_t a = Args(1, 0, 1, 0, "backend=inproc;group=v2pair;log_every=0;default_k=2");
  void* ctx = nullptr;
  ASSERT_EQ(v2_->init(&a, &ctx), dpbSuccess);
  auto report = [&](int64_t plan_id) {
    dpbReport_v2_t r{plan_id, 100, 200, nullptr, 0};
    return v2_->report(ctx, &r);
  };
  EXPECT_EQ(report(0), dpbInvalidArgument);  // no plan yet
  const EngineStep e = Decode(0, 0);
  std::vector<dpbRequest_v2_t> reqs = Requests(e);
  std::vector<int32_t> v(reqs.size());
  dpbPlanResult_v2_t res{};
  res.verify_len = v.data();
  dpbStep_v2_t step{dpbStepDecode, reqs.data(), static_cast<int32_t>(reqs.size()), -1, 0};
  // An engine one step behind (overlap scheduling): plan t+1, then report t.
  EXPECT_EQ(v2_->plan(ctx, &step, &res), dpbSuccess);
  const int64_t first = res.plan_id;
  EXPECT_EQ(v2_->plan(ctx, &step, &res), dpbSuccess);
  const int64_t second = res.plan_id;
  EXPECT_NE(first, second);
  EXPECT_EQ(report(first), dpbSuccess);
  EXPECT_EQ(report(first), dpbInvalidArgument);  // a second report for one plan
  EXPECT_EQ(v2_->plan(ctx, &step, &res), dpbSuccess);
  EXPECT_EQ(report(second), dpbSuccess);
  EXPECT_EQ(report(res.plan_id), dpbSuccess);
  // Three plans without a report: the oldest is dropped, counted.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(v2_->plan(ctx, &step, &res), dpbSuccess);
  EXPECT_EQ(report(res.plan_id - 2), dpbInvalidArgument);
  // Out of order (SGLang reports an all-idle step at once, the batch before it later): the
  // newer report leaves the older plan outstanding, and its late report still pairs.
  EXPECT_EQ(report(res.plan_id), dpbSuccess);
  EXPECT_EQ(report(res.plan_id - 1), dpbSuccess);
  EXPECT_EQ(report(res.plan_id - 1), dpbInvalidArgument);
  reqs[1].id = nullptr;  // a request without an id: defaults, named
  EXPECT_EQ(v2_->plan(ctx, &step, &res), dpbInvalidArgument);
  for (int32_t x : v) EXPECT_EQ(x, 2);
  EXPECT_EQ(report(res.plan_id), dpbSuccess);
  reqs[1].id = e.ids[1].data();
  const int32_t bad_kind = 7;  // not an enumerator: read as bytes, refused by value
  std::memcpy(&step.kind, &bad_kind, sizeof(bad_kind));
  EXPECT_EQ(v2_->plan(ctx, &step, &res), dpbInvalidArgument);
  for (int32_t x : v) EXPECT_EQ(x, 2);
  EXPECT_EQ(report(res.plan_id), dpbSuccess);
  dpbStats_v2_t st{};
  EXPECT_EQ(v2_->stats(ctx, &st), dpbSuccess);
  EXPECT_EQ(st.missing_reports, 1);
  EXPECT_EQ(st.v1.fallbacks, 2);
  EXPECT_EQ(v2_->finalize(ctx), dpbSuccess);
}

// An engine one step behind (SGLang's overlap scheduler, vLLM's async scheduling) reports step t
// after planning t+1: nothing is missed, the bubble is still measured, and the online refit
// still learns (measured times here follow the batch: more and longer requests take longer).
TEST_F(PluginV2, ReportsOneStepLateStayPairedWithTheirPlans) {
  const int dp = 3, steps = 200;
  auto run = [&](bool late, const std::string& group) {
    std::vector<dpbStats_v2_t> stats(dp);
    std::vector<std::thread> threads;
    for (int r = 0; r < dp; ++r) {
      threads.emplace_back([&, r] {
        const std::string config = "backend=inproc;group=" + group + ";log_every=0;default_k=2;timeout_ms=20000";
        const dpbInitArgs_v2_t a = Args(dp, r, 1, 0, config.c_str());
        void* ctx = nullptr;
        ASSERT_EQ(v2_->init(&a, &ctx), dpbSuccess);
        int64_t pending = -1;
        double pending_us = 0;
        std::vector<dpbAccepted_v2_t> pending_acc;
        std::vector<std::string> ids;
        auto report = [&] {
          dpbReport_v2_t rep{pending, pending_us, pending_us + 3000, pending_acc.data(),
                             static_cast<int32_t>(pending_acc.size())};
          EXPECT_EQ(v2_->report(ctx, &rep), dpbSuccess);
        };
        for (int step = 0; step < steps; ++step) {
          const EngineStep e = Decode(r, step);
          std::vector<dpbRequest_v2_t> reqs = Requests(e);
          std::vector<int32_t> v(reqs.size());
          dpbPlanResult_v2_t res{};
          res.verify_len = v.data();
          dpbStep_v2_t st{dpbStepDecode, reqs.data(), static_cast<int32_t>(reqs.size()), -1, 0};
          EXPECT_EQ(v2_->plan(ctx, &st, &res), dpbSuccess);
          if (late && pending >= 0) report();  // the previous step's results arrive now
          ids = e.ids;
          pending_acc.clear();
          pending_us = 25;
          for (size_t i = 0; i < ids.size(); ++i) {
            pending_acc.push_back({ids[i].data(), static_cast<int32_t>(ids[i].size()), v[i], (v[i] * 4) / 5, 0});
            pending_us += 4 + 0.002 * static_cast<double>(e.ctx[i]) * (1 + v[i]);
          }
          pending = res.plan_id;
          if (!late) report();
        }
        EXPECT_EQ(v2_->stats(ctx, &stats[r]), dpbSuccess);
        EXPECT_EQ(v2_->finalize(ctx), dpbSuccess);
      });
    }
    for (auto& th : threads) th.join();
    return stats;
  };
  const std::vector<dpbStats_v2_t> late = run(true, "v2late"), lockstep = run(false, "v2lockstep");
  for (int r = 0; r < dp; ++r) {
    EXPECT_EQ(late[r].missing_reports, 0);
    EXPECT_GT(late[r].v1.balanced_steps, steps - 5);
    EXPECT_GT(late[r].v1.bubble_fraction, 0);  // the measured steps were accounted
    // The refit learns one step later, so it tracks the alternating batches a step behind;
    // pairing itself is checked exactly in balancer_test (OneStepLateReportsArePaired...).
    EXPECT_LT(late[r].v1.predicted_error, 2 * lockstep[r].v1.predicted_error + 0.05) << "rank " << r;
  }
}

// Request ids are hashed (64-bit FNV-1a) to index this rank's statistics. Two requests with the
// same key, which is what a collision is, share those statistics and nothing else: both plan,
// with valid lengths, as here with literally equal ids.
TEST_F(PluginV2, DuplicateIdsShareStatistics) {
  const auto seen = Run(2, 1, "backend=inproc;group=v2dup;log_every=0;default_k=2;timeout_ms=20000", 20,
                        [](int r, int, int step) {
                          EngineStep e = Decode(r, step);
                          for (std::string& id : e.ids) id = "same";
                          return e;
                        });
  ExpectOneExchange(seen, 2, 1);
  for (const auto& p : seen) {
    for (const StepSeen& s : p) EXPECT_EQ(s.result, dpbSuccess);
  }
}

TEST_F(PluginV2, BadInitArgumentsAreRefusedByName) {
  dpbInitArgs_v2_t a = Args(2, 0, 1, 0, "backend=inproc;group=v2bad;log_every=0");
  void* ctx = nullptr;
  a.struct_size = 8;
  EXPECT_EQ(v2_->init(&a, &ctx), dpbInvalidArgument);
  a = Args(2, 0, 3, 3, "backend=inproc;group=v2bad;log_every=0");
  EXPECT_EQ(v2_->init(&a, &ctx), dpbInvalidArgument);
  a = Args(2, 0, 1, 0, "backend=inproc;group=v2bad;log_every=0");
  const int32_t tiers[] = {64, 32};
  a.token_tiers = tiers;
  a.num_token_tiers = 2;
  EXPECT_EQ(v2_->init(&a, &ctx), dpbInvalidArgument);
  a.num_token_tiers = 0;
  const int32_t bad_granularity = 9;  // not an enumerator: read as bytes, refused by value
  std::memcpy(&a.granularity, &bad_granularity, sizeof(bad_granularity));
  EXPECT_EQ(v2_->init(&a, &ctx), dpbInvalidArgument);
  EXPECT_EQ(ctx, nullptr);
}

}  // namespace
