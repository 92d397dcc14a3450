// The inspection ABI (dpbalance_inspect_v1.h) through dlopen, as a host uses it: the flags checked
// at the engine's start with the message init would log, and the last reported step's prediction.
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dpbalance/plugin/dpbalance_inspect_v1.h"
#include "dpbalance/plugin/dpbalance_inspect_v2.h"
#include "dpbalance/plugin/dpbalance_plugin_v2.h"
#include "gtest/gtest.h"

namespace {

class Inspect : public ::testing::Test {
 protected:
  void SetUp() override {
    lib_ = dlopen(DPB_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    ASSERT_NE(lib_, nullptr) << dlerror();
    api_ = static_cast<const dpbalanceInspect_v1_t*>(dlsym(lib_, DPB_INSPECT_SYMBOL_V1));
    v2_ = static_cast<const dpbalancePlugin_v2_t*>(dlsym(lib_, "dpbalancePlugin_v2"));
    ASSERT_NE(api_, nullptr);
    ASSERT_NE(v2_, nullptr);
  }
  void TearDown() override {
    for (const std::string& name : set_) unsetenv(name.c_str());
    if (lib_) dlclose(lib_);
  }
  void SetEnv(const std::string& name, const std::string& value) {
    setenv(name.c_str(), value.c_str(), 1);
    set_.push_back(name);
  }
  // check_flags with roomy buffers: (result, error, settings).
  std::tuple<dpbResult_t, std::string, std::string> Check(const char* config, int dp = 2) {
    std::array<char, 1024> error{}, settings{};
    error[0] = settings[0] = 'x';  // overwritten with "" or the text
    const dpbResult_t r = api_->check_flags(config, dp, error.data(), error.size(), settings.data(), settings.size());
    return {r, std::string(error.data()), std::string(settings.data())};
  }

  // ABI v2 init of DP rank `r` of `dp` on the in-process backend with `config` (asserted).
  void* InitV2(int dp, int r, const char* config) {
    dpbInitArgs_v2_t a{};
    a.struct_size = sizeof(a);
    a.dp_size = dp;
    a.dp_rank = r;
    a.attn_tp_size = 1;
    a.config = config;
    a.backend = dpbBackendFromFlags;
    a.cuda_device = -1;
    void* ctx = nullptr;
    EXPECT_EQ(v2_->init(&a, &ctx), dpbSuccess);
    return ctx;
  }

  void* lib_ = nullptr;
  const dpbalanceInspect_v1_t* api_ = nullptr;
  const dpbalancePlugin_v2_t* v2_ = nullptr;
  std::vector<std::string> set_;
};

TEST_F(Inspect, GoodFlagsGiveTheSettingsInEffect) {
  SetEnv("DPB_DRAFT_US", "0");
  SetEnv("DPB_MODE", "fill");
  const auto [r, error, settings] = Check("default_k=5;k_max=6");
  EXPECT_EQ(r, dpbSuccess);
  EXPECT_EQ(error, "");
  EXPECT_NE(settings.find("mode=fill"), std::string::npos) << settings;
  EXPECT_NE(settings.find("k_max=6 default_k=5"), std::string::npos) << settings;
  EXPECT_NE(settings.find("cost_model=published-v2"), std::string::npos) << settings;
  EXPECT_NE(settings.find("draft_us=0 "), std::string::npos) << settings;
  EXPECT_NE(settings.find("metrics_file=-"), std::string::npos) << settings;
  EXPECT_NE(settings.find("step_slack=0.03 guard_overhead_us=0 guard_measured=0 "), std::string::npos)
      << settings;
  EXPECT_NE(settings.find("acceptance=beta "), std::string::npos) << settings;
  const auto [r2, error2, settings2] = Check("acceptance=shift");
  EXPECT_EQ(r2, dpbSuccess) << error2;
  EXPECT_NE(settings2.find("acceptance=shift "), std::string::npos) << settings2;
}

TEST_F(Inspect, TheHostsOwnVariablesAreNotFlags) {
  SetEnv("DPB_PLUGIN", "dpbalance");
  SetEnv("DPB_STRICT", "1");  // the host's: refuse to start on a bad flag
  const auto [r, error, settings] = Check("");
  EXPECT_EQ(r, dpbSuccess) << error;
}

TEST_F(Inspect, EachBadValueIsNamedWithItsSource) {
  struct Case {
    const char* env_name;
    const char* env_value;
    const char* config;
    const char* says;
  };
  const Case cases[] = {
      {"DPB_MODE", "bogus", "", "flag 'mode' in environment variable DPB_MODE: 'bogus' is not"},
      {"DPB_COST_MODEL", "/nonexistent/model.json", "", "/nonexistent/model.json"},
      {"DPB_METRICS_FILE", "/nonexistent/dir/m.jsonl", "", "directory '/nonexistent/dir' does not exist"},
      {"DPB_NO_SUCH_FLAG", "1", "", "unknown flag 'no_such_flag' in environment variable DPB_NO_SUCH_FLAG"},
      {"DPB_K_MAX", "2", "default_k=5", "exceeds 'k_max'"},
      {"DPB_TIERS", "8,4", "", "strictly ascending"},
      {nullptr, nullptr, "timeout_ms=0", "flag 'timeout_ms' in the config string: '0'"},
  };
  for (const Case& c : cases) {
    if (c.env_name) SetEnv(c.env_name, c.env_value);
    const auto [r, error, settings] = Check(c.config);
    EXPECT_EQ(r, dpbInvalidArgument) << c.says;
    EXPECT_NE(error.find(c.says), std::string::npos) << "got: " << error;
    EXPECT_EQ(settings, "");
    if (c.env_name) unsetenv(c.env_name);
  }
}

TEST_F(Inspect, ChecksTheRankCountAndCutsTheMessageToTheBuffer) {
  auto [r, error, settings] = Check("", 0);
  EXPECT_EQ(r, dpbInvalidArgument);
  EXPECT_NE(error.find("dp_size 0"), std::string::npos) << error;
  SetEnv("DPB_MODE", "bogus");
  std::array<char, 8> small{};
  std::memset(small.data(), 'x', small.size());
  EXPECT_EQ(api_->check_flags("", 2, small.data(), small.size(), nullptr, 0), dpbInvalidArgument);
  EXPECT_EQ(std::string(small.data()), "flag 'm");  // 7 bytes and the NUL
  EXPECT_EQ(api_->check_flags("", 2, nullptr, 0, nullptr, 0), dpbInvalidArgument);
}

TEST_F(Inspect, CheckingStartsNothingAndCreatesNoFile) {
  const std::string path = ::testing::TempDir() + "/dpb_inspect_metrics.jsonl";
  std::remove(path.c_str());
  SetEnv("DPB_METRICS_FILE", path);
  const auto [r, error, settings] = Check("");
  EXPECT_EQ(r, dpbSuccess) << error;
  EXPECT_NE(settings.find("metrics_file=" + path), std::string::npos) << settings;
  EXPECT_NE(access(path.c_str(), F_OK), 0) << "check_flags created " << path;
}

TEST_F(Inspect, LastStepGivesTheReportedPlansPredictionBesideTheMeasuredTime) {
  const int dp = 2;
  std::vector<std::vector<dpbStepInfo_v1_t>> infos(dp);
  std::vector<std::thread> ranks;
  for (int r = 0; r < dp; ++r) {
    ranks.emplace_back([&, r] {
      void* ctx = InitV2(dp, r, "backend=inproc;group=inspect2;log_every=0;timeout_ms=20000");
      ASSERT_NE(ctx, nullptr);
      dpbStepInfo_v1_t before{};
      ASSERT_EQ(api_->last_step(ctx, &before), dpbSuccess);
      EXPECT_EQ(before.plan_id, -1);
      for (int step = 0; step < 12; ++step) {
        std::vector<std::string> ids;
        std::vector<dpbRequest_v2_t> reqs;
        for (int i = 0; i < 4 + 4 * r; ++i) ids.push_back("r" + std::to_string(r) + "-" + std::to_string(i));
        for (size_t i = 0; i < ids.size(); ++i) {
          reqs.push_back({ids[i].data(), static_cast<int32_t>(ids[i].size()), 2000 + 4000 * r, 0, 7, nullptr, 0});
        }
        // Step 5 of rank 0 runs prefill beside its decodes.
        const bool extend = r == 0 && step == 5;
        dpbStep_v2_t st{extend ? dpbStepExtend : dpbStepDecode, reqs.data(), static_cast<int32_t>(reqs.size()), -1,
                        extend ? 256 : 0};
        std::vector<int32_t> lens(reqs.size());
        dpbPlanResult_v2_t res{};
        res.verify_len = lens.data();
        ASSERT_EQ(v2_->plan(ctx, &st, &res), dpbSuccess);
        dpbReport_v2_t rep{res.plan_id, 400.0 + 100 * r + step, 9000.0, nullptr, 0};
        ASSERT_EQ(v2_->report(ctx, &rep), dpbSuccess);
        dpbStepInfo_v1_t info{};
        ASSERT_EQ(api_->last_step(ctx, &info), dpbSuccess);
        EXPECT_EQ(info.plan_id, res.plan_id);
        EXPECT_DOUBLE_EQ(info.measured_attention_us, 400.0 + 100 * r + step);
        EXPECT_EQ(info.extend, extend ? 1 : 0) << "rank " << r << " step " << step;
        if (res.balanced) {
          EXPECT_GT(info.predicted_attention_us, 0) << "rank " << r << " step " << step;
          EXPECT_GE(info.planned_barrier_us, 0);
        } else {
          EXPECT_LT(info.predicted_attention_us, 0);
        }
        infos[r].push_back(info);
      }
      EXPECT_EQ(api_->last_step(nullptr, nullptr), dpbInvalidArgument);
      EXPECT_EQ(v2_->finalize(ctx), dpbSuccess);
    });
  }
  for (auto& t : ranks) t.join();
  int balanced = 0;
  for (const auto& rank : infos) {
    for (const auto& i : rank) balanced += i.predicted_attention_us > 0;
  }
  EXPECT_GT(balanced, 12);
}

// dpbalanceInspect_v2.step_terms: the step terms the plan prices with. With the online fit on,
// they leave the flags' values (here a 30 ms fixed term) for what the engine's cycle measures (a
// step of ~3 ms of sleep and 0.4 ms of attention); with it off, they are the flags exactly.
TEST_F(Inspect, StepTermsAreLearntFromTheEngineCycleOrAreTheFlags) {
  const auto* v2 = static_cast<const dpbalanceInspect_v2_t*>(dlsym(lib_, DPB_INSPECT_SYMBOL_V2));
  ASSERT_NE(v2, nullptr);
  EXPECT_EQ(v2->check_flags, api_->check_flags);
  for (const int learn : {1, 0}) {
    const int dp = 2;
    std::vector<dpbStepTerms_v1_t> terms(dp);
    std::vector<std::thread> ranks;
    const std::string config = "backend=inproc;group=terms" + std::to_string(learn) +
                               ";log_every=0;timeout_ms=20000;ffn_fixed_us=30000;ffn_per_token_us=3;"
                               "draft_us=0;learn_step_terms=" + std::to_string(learn);
    for (int r = 0; r < dp; ++r) {
      ranks.emplace_back([&, r] {
        void* ctx = InitV2(dp, r, config.c_str());
        ASSERT_NE(ctx, nullptr);
        for (int step = 0; step < 80; ++step) {
          std::vector<std::string> ids;
          std::vector<dpbRequest_v2_t> reqs;
          for (int i = 0; i < 3 + (step + r) % 5; ++i) ids.push_back("r" + std::to_string(r) + "-" + std::to_string(i));
          for (size_t i = 0; i < ids.size(); ++i) {
            reqs.push_back({ids[i].data(), static_cast<int32_t>(ids[i].size()), 3000, 0, 7, nullptr, 0});
          }
          dpbStep_v2_t st{dpbStepDecode, reqs.data(), static_cast<int32_t>(reqs.size()), -1, 0};
          std::vector<int32_t> lens(reqs.size());
          dpbPlanResult_v2_t res{};
          res.verify_len = lens.data();
          ASSERT_EQ(v2_->plan(ctx, &st, &res), dpbSuccess);
          std::this_thread::sleep_for(std::chrono::microseconds(3000));  // the forward
          dpbReport_v2_t rep{res.plan_id, 400.0, 3400.0, nullptr, 0};
          ASSERT_EQ(v2_->report(ctx, &rep), dpbSuccess);
        }
        ASSERT_EQ(v2->step_terms(ctx, &terms[r]), dpbSuccess);
        EXPECT_EQ(v2->step_terms(ctx, nullptr), dpbInvalidArgument);
        EXPECT_EQ(v2_->finalize(ctx), dpbSuccess);
      });
    }
    for (auto& t : ranks) t.join();
    SCOPED_TRACE(learn);
    for (const dpbStepTerms_v1_t& t : terms) {
      EXPECT_EQ(t.online, learn);
      if (learn) {
        EXPECT_GE(t.rows, 40);
        EXPECT_GE(t.fits, 2);
        EXPECT_EQ(t.resets, 0);
        // ~3 ms per step measured against the flags' 30 ms: the fit follows the measurements.
        EXPECT_LT(t.ffn_fixed_us + 20 * t.ffn_per_token_us, 15000);
        EXPECT_GT(t.ffn_fixed_us + t.step_overhead_us + 20 * t.ffn_per_token_us, 1000);
      } else {
        EXPECT_EQ(t.ffn_fixed_us, 30000);
        EXPECT_EQ(t.ffn_per_token_us, 3);
        EXPECT_EQ(t.draft_us, 0);
        EXPECT_EQ(t.rows, 0);
      }
    }
    EXPECT_EQ(std::memcmp(&terms[0], &terms[1], offsetof(dpbStepTerms_v1_t, rows)), 0) << "ranks differ";
  }
}

}  // namespace
