#include "flags.h"

#include "gtest/gtest.h"

namespace dpbalance::plugin {
namespace {

TEST(Flags, DefaultsEnvironmentAndConfigStringWhichWins) {
  absl::StatusOr<PluginFlags> f = ParseFlags({}, "");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->balancer.planner.mode, PlanMode::kGoodput);
  EXPECT_EQ(f->balancer.planner.k_max, 7);
  EXPECT_DOUBLE_EQ(f->balancer.planner.max_step_slack, 0.03);
  EXPECT_EQ(f->balancer.tpot_slo_us, 0);  // no SLO unless the engine sets one
  EXPECT_FALSE(f->balancer.planner.uniform_per_rank);
  EXPECT_TRUE(f->balancer.planner.sample_heads);

  f = ParseFlags({{"DPB_MODE", "fill"}, {"DPB_K_MAX", "5"}, {"DPB_TIERS", "8,16,32"}},
                 "k_max=6; timeout_ms=20 ;ab_epoch=100;padded=1;agreed_depth=0;tpot_slo_ms=52.5;"
                 "granularity=rank;grid_sim=exact");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->balancer.planner.sample_heads);
  EXPECT_EQ(f->balancer.planner.mode, PlanMode::kFill);
  EXPECT_EQ(f->balancer.planner.k_max, 6);
  EXPECT_EQ(f->balancer.planner.token_tiers, (std::vector<int32_t>{8, 16, 32}));
  EXPECT_EQ(f->balancer.timeout, absl::Milliseconds(20));
  EXPECT_EQ(f->balancer.ab_epoch_steps, 100);
  EXPECT_TRUE(f->balancer.planner.global.padded_tokens);
  EXPECT_FALSE(f->balancer.planner.agreed_draft_depth);
  EXPECT_DOUBLE_EQ(f->balancer.tpot_slo_us, 52500);
  EXPECT_TRUE(f->balancer.planner.uniform_per_rank);
  // DPB_PLUGIN is the host's variable, not a flag.
  EXPECT_TRUE(ParseFlags({{"DPB_PLUGIN", "dpbalance"}}, "").ok());
}

// The router ABI's flags (dpbalance_router_v1.h) share the table: DPB_ROUTING etc. in the
// environment must not break the balancer's init either.
TEST(Flags, RoutingFlagsSetTheRouterAndNameBadValues) {
  absl::StatusOr<PluginFlags> f = ParseFlags({}, "");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->routing.strategy, RoutingStrategy::kCostAware);
  f = ParseFlags({{"DPB_ROUTING", "D"}, {"DPB_Z", "1.3"}},
                 "groups=4;group_choice=B;split_percentile=0.8;split_window=50;"
                 "route_query_tokens=2;route_initial_output=120");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->routing.strategy, RoutingStrategy::kDualPath);
  EXPECT_DOUBLE_EQ(f->routing.z, 1.3);
  EXPECT_EQ(f->routing.groups, 4);
  EXPECT_EQ(f->routing.group_choice, RoutingStrategy::kMinContext);
  EXPECT_DOUBLE_EQ(f->routing.split_percentile, 0.8);
  EXPECT_EQ(f->routing.split_window, 50);
  EXPECT_DOUBLE_EQ(f->routing.query_tokens_per_request, 2);
  EXPECT_DOUBLE_EQ(f->routing.initial_output_tokens, 120);
  for (const auto& [config, value] : std::vector<std::pair<std::string, std::string>>{
           {"routing=F", "'F'"}, {"group_choice=C", "'C'"}, {"split_percentile=1", "'1'"},
           {"z=0", "'0'"}, {"route_query_tokens=0.5", "'0.5'"}}) {
    f = ParseFlags({}, config);
    ASSERT_FALSE(f.ok()) << config;
    EXPECT_NE(f.status().message().find(config.substr(0, config.find('='))), std::string::npos) << f.status();
    EXPECT_NE(f.status().message().find(value), std::string::npos) << f.status();
  }
}

TEST(Flags, UnknownAndMalformedFlagsAreNamed) {
  absl::StatusOr<PluginFlags> f = ParseFlags({{"DPB_KMAX", "5"}}, "");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("'kmax'"), std::string::npos) << f.status();
  EXPECT_NE(f.status().message().find("DPB_KMAX"), std::string::npos);

  f = ParseFlags({}, "k_max=nine");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("k_max"), std::string::npos);
  EXPECT_NE(f.status().message().find("nine"), std::string::npos);
  EXPECT_NE(f.status().message().find("config string"), std::string::npos);

  EXPECT_FALSE(ParseFlags({}, "mode=turbo").ok());
  f = ParseFlags({{"DPB_GRANULARITY", "batch"}}, "");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("granularity"), std::string::npos) << f.status();
  EXPECT_NE(f.status().message().find("batch"), std::string::npos) << f.status();
  f = ParseFlags({{"DPB_GRID_SIM", "fast"}}, "");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("grid_sim"), std::string::npos) << f.status();
  EXPECT_NE(f.status().message().find("'fast'"), std::string::npos) << f.status();
  EXPECT_FALSE(ParseFlags({}, "k_max").ok());
  EXPECT_FALSE(ParseFlags({}, "tiers=8,-1").ok());
  EXPECT_FALSE(ParseFlags({}, "k_max=2;default_k=3").ok());
  EXPECT_FALSE(ParseFlags({}, "cost_model=/nonexistent.json").ok());
  EXPECT_FALSE(ParseFlags({}, "cost_model=v2+fa9").ok());
  absl::StatusOr<PluginFlags> grid = ParseFlags({}, "cost_model=v2+fa2-packed-h200");
  ASSERT_TRUE(grid.ok()) << grid.status();
  EXPECT_TRUE(grid->balancer.model.uses_grid());
  EXPECT_FALSE(ParseFlags({}, "ffn_per_token_us=nan").ok());
  f = ParseFlags({{"DPB_TPOT_SLO_MS", "-3"}}, "");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("tpot_slo_ms"), std::string::npos) << f.status();
  EXPECT_NE(f.status().message().find("-3"), std::string::npos) << f.status();
}

// A value's error names the flag, where the value came from and the value, once each.
TEST(Flags, BadValueMessagesNameFlagSourceAndValue) {
  absl::StatusOr<PluginFlags> f = ParseFlags({}, "mode=turbo");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(),
            "flag 'mode' in the config string: 'turbo' is not off, goodput, fill, local, dspark or dspark_fill");
  f = ParseFlags({{"DPB_BACKEND", "mpi"}}, "");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(),
            "flag 'backend' in environment variable DPB_BACKEND: 'mpi' is not inproc, callback or nccl");
  f = ParseFlags({}, "k_max=nine");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(), "flag 'k_max' in the config string: 'nine' is not an integer in 0..8");
  f = ParseFlags({}, "tiers=8,-1");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(),
            "flag 'tiers' in the config string: '8,-1' is not a comma list of positive token counts");
}

}  // namespace
}  // namespace dpbalance::plugin
