#include "flags.h"

#include <cmath>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "absl/strings/str_format.h"
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
  EXPECT_EQ(f->balancer.acceptance_model, AcceptanceModel::kBeta);
  EXPECT_FALSE(f->balancer.planner.guard_measured_overhead);

  f = ParseFlags({{"DPB_MODE", "fill"}, {"DPB_K_MAX", "5"}, {"DPB_TIERS", "8,16,32"},
                  {"DPB_GUARD_MEASURED", "1"}},
                 "k_max=6; timeout_ms=20 ;ab_epoch=100;padded=1;agreed_depth=0;tpot_slo_ms=52.5;"
                 "granularity=rank;grid_sim=exact;acceptance=shift");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->balancer.planner.guard_measured_overhead);
  EXPECT_EQ(f->balancer.acceptance_model, AcceptanceModel::kShift);
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
  f = ParseFlags({{"DPB_ACCEPTANCE", "gauss"}}, "");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("acceptance"), std::string::npos) << f.status();
  EXPECT_NE(f.status().message().find("'gauss'"), std::string::npos) << f.status();
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
  f = ParseFlags({{"DPB_MIN_PLAN_GAIN", "0.05"}}, "");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_DOUBLE_EQ(f->balancer.planner.min_plan_gain, 0.05);
  EXPECT_DOUBLE_EQ(ParseFlags({}, "")->balancer.planner.min_plan_gain, 0.02);
  f = ParseFlags({{"DPB_MIN_PLAN_GAIN", "-0.5"}}, "");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("min_plan_gain"), std::string::npos) << f.status();
  EXPECT_NE(f.status().message().find("-0.5"), std::string::npos) << f.status();
  EXPECT_FALSE(ParseFlags({}, "")->balancer.planner.value_deferral);
  f = ParseFlags({{"DPB_VALUE_DEFERRAL", "1"}}, "");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->balancer.planner.value_deferral);
  f = ParseFlags({{"DPB_VALUE_DEFERRAL", "2"}}, "");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("value_deferral"), std::string::npos) << f.status();
  f = ParseFlags({{"DPB_GRANULARITY", "instance"}, {"DPB_DEPTHS", "0,1,3,7"}}, "");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->balancer.planner.uniform_instance);
  EXPECT_FALSE(f->balancer.planner.uniform_per_rank);
  EXPECT_EQ(f->balancer.planner.allowed_depths, 0b10001011u);
  f = ParseFlags({}, "depths=1,9");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(),
            "flag 'depths' in the config string: '1,9' is not a comma list of draft depths in 0..8");
  // A depth set without the engine's own depth or the deepest plan is refused at load (found by
  // flags_fuzz: `depths=6` was accepted and the planner refused it later).
  f = ParseFlags({}, "depths=6");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(),
            "flag 'depths' (6) must hold 'default_k' (3) and 'k_max' (7): the engine's own depth "
            "and the deepest plan must be ones it can run");
  f = ParseFlags({{"DPB_DEPTHS", "1,3,5"}}, "k_max=5");
  ASSERT_TRUE(f.ok()) << f.status();
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


// A numeric flag's documented range (docs/flags.md, "lo..hi", both ends included). "k_max" as
// a bound means the k_max flag's value.
struct DocumentedRange {
  std::string flag;     // lower case, no prefix
  std::string lo, hi;   // as written
};

// Every row of docs/flags.md's tables whose "unit / values" column gives a range.
std::vector<DocumentedRange> DocumentedRanges(std::set<std::string>* listed) {
  std::ifstream in(DPB_FLAGS_DOC);
  EXPECT_TRUE(in) << "cannot read " << DPB_FLAGS_DOC;
  const std::regex row(R"(^\| `DPB_([A-Z0-9_]+)` \|[^|]*\|([^|]*)\|)");
  const std::string num = R"(-?[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?)";
  const std::regex range("(" + num + "|k_max)\\.\\.(" + num + "|k_max)");
  std::vector<DocumentedRange> out;
  std::string line;
  while (std::getline(in, line)) {
    std::smatch m, r;
    if (!std::regex_search(line, m, row)) continue;
    std::string flag = m[1];
    for (char& c : flag) c = static_cast<char>(std::tolower(c));
    if (flag == "plugin") continue;  // the host's variable
    listed->insert(flag);
    const std::string values = m[2];
    if (std::regex_search(values, r, range)) out.push_back({flag, r[1], r[2]});
  }
  return out;
}

// The value just outside a bound: the next integer, or for a real-valued flag the next double.
std::string Beyond(const std::string& bound, bool integer, double direction) {
  const double b = std::stod(bound);
  if (integer) return absl::StrFormat("%d", static_cast<int64_t>(b + direction));
  return absl::StrFormat("%.17g", std::nextafter(b, direction * INFINITY));
}

// Every numeric DPB_* flag accepts both ends of its documented range and refuses the values
// just outside them, naming the flag and the value; every flag is documented, and every one not
// listed below as a word, list or path has a range in the table.
// The default guard's margin from the cost model: a model file that records its fit's
// cross-validated error (cv_mape, as dpbalance-calibrate --cv writes it) raises the default
// 0.02 to that error; a smaller error leaves 0.02; DPB_MIN_PLAN_GAIN or the config string,
// given, always win (0 included); a model without the record leaves the default.
TEST(Flags, TheModelsFitErrorSetsTheDefaultGuardUnlessGiven) {
  auto model_file = [](const std::string& name, double cv_mape) {
    const std::string path = ::testing::TempDir() + "/" + name;
    std::ofstream(path) << CostModel::PublishedV2().WithCvMape(cv_mape).ToJson();
    return path;
  };
  const std::string noisy = model_file("flags_cv_noisy.json", 0.123);
  const std::string sharp = model_file("flags_cv_sharp.json", 0.011);
  const std::string none = model_file("flags_cv_none.json", 0);
  auto margin = [](std::map<std::string, std::string> env, const std::string& config) {
    absl::StatusOr<PluginFlags> f = ParseFlags(env, config);
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? f->balancer.planner.min_plan_gain : -1.0;
  };
  EXPECT_DOUBLE_EQ(margin({{"DPB_COST_MODEL", noisy}}, ""), 0.123);
  EXPECT_DOUBLE_EQ(margin({}, "cost_model=" + noisy), 0.123);
  EXPECT_DOUBLE_EQ(margin({{"DPB_COST_MODEL", sharp}}, ""), 0.02);
  EXPECT_DOUBLE_EQ(margin({{"DPB_COST_MODEL", none}}, ""), 0.02);
  EXPECT_DOUBLE_EQ(margin({}, ""), 0.02);
  EXPECT_DOUBLE_EQ(margin({{"DPB_COST_MODEL", noisy}, {"DPB_MIN_PLAN_GAIN", "0.05"}}, ""), 0.05);
  EXPECT_DOUBLE_EQ(margin({{"DPB_COST_MODEL", noisy}, {"DPB_MIN_PLAN_GAIN", "0"}}, ""), 0);
  EXPECT_DOUBLE_EQ(margin({{"DPB_COST_MODEL", noisy}}, "min_plan_gain=0.3"), 0.3);
}

TEST(Flags, EveryNumericFlagTakesItsDocumentedRangeAndNothingOutside) {
  std::set<std::string> listed;
  const std::vector<DocumentedRange> ranges = DocumentedRanges(&listed);
  const std::set<std::string> non_numeric = {"mode",      "tiers",   "granularity",  "cost_model",
                                             "grid_sim",  "backend", "group",        "log_level",
                                             "metrics_file", "routing", "group_choice",
                                             "acceptance"};
  std::set<std::string> with_range;
  for (const DocumentedRange& d : ranges) with_range.insert(d.flag);
  for (const std::string& flag : FlagNames()) {
    EXPECT_TRUE(listed.count(flag)) << "DPB_" << flag << " is not in docs/flags.md";
    EXPECT_TRUE(non_numeric.count(flag) || with_range.count(flag))
        << "DPB_" << flag << ": docs/flags.md gives no lo..hi range";
  }
  EXPECT_EQ(ranges.size(), FlagNames().size() - non_numeric.size());  // one row each
  for (const DocumentedRange& d : ranges) {
    // k_max at its largest, so a bound of "k_max" is a number too (and default_k at 0 while
    // k_max itself is tried, so it may go down to 0).
    const std::string k_max = d.flag == "k_max" ? "default_k=0;" : "k_max=8;";
    const std::string lo = d.lo == "k_max" ? "8" : d.lo, hi = d.hi == "k_max" ? "8" : d.hi;
    // A depth set must hold default_k and k_max: both are set to the one depth tried, after it,
    // so a value out of range is still refused by 'depths' itself.
    auto parse = [&](const std::string& v) {
      if (d.flag == "depths") return ParseFlags({}, "depths=" + v + ";k_max=" + v + ";default_k=" + v);
      return ParseFlags({}, k_max + d.flag + "=" + v);
    };
    // Integer flags refuse a value between two integers inside the range.
    const double mid = 0.5 * (std::stod(lo) + std::stod(hi));
    const bool integer = !parse(absl::StrFormat("%.17g", std::floor(mid) + 0.5)).ok();
    for (const std::string& end : {lo, hi}) {
      absl::StatusOr<PluginFlags> f = parse(end);
      EXPECT_TRUE(f.ok()) << d.flag << "=" << end << " (a documented end): " << f.status();
    }
    for (const std::string& out : {Beyond(lo, integer, -1), Beyond(hi, integer, +1)}) {
      absl::StatusOr<PluginFlags> f = parse(out);
      ASSERT_FALSE(f.ok()) << d.flag << "=" << out << " is outside " << d.lo << ".." << d.hi
                           << " yet accepted";
      EXPECT_NE(f.status().message().find("'" + d.flag + "'"), std::string::npos) << f.status();
      EXPECT_NE(f.status().message().find("'" + out + "'"), std::string::npos) << f.status();
    }
  }
}

// The two tiers: every flag the parser takes has a help line (dpbalance-flags --help), under the
// same tier and topic as its row in docs/flags.md, and nothing else has one.
TEST(Flags, HelpListsEveryFlagUnderItsTierAsTheDocDoes) {
  std::ifstream in(DPB_FLAGS_DOC);
  ASSERT_TRUE(in) << "cannot read " << DPB_FLAGS_DOC;
  const std::regex row(R"(^\| `DPB_([A-Z0-9_]+)` \|)");
  std::map<std::string, std::string> doc_topic;
  std::string line, topic;
  while (std::getline(in, line)) {
    if (line.rfind("## ", 0) == 0) topic = line.substr(3);
    if (line.rfind("### ", 0) == 0) topic = line.substr(4);
    std::smatch m;
    if (!std::regex_search(line, m, row)) continue;
    std::string flag = m[1];
    for (char& c : flag) c = static_cast<char>(std::tolower(c));
    if (topic == "The vLLM package's settings") continue;  // the host's and the package's
    doc_topic[flag] = topic;
  }
  std::set<std::string> helped;
  for (const FlagHelpLine& l : FlagHelpLines()) {
    EXPECT_TRUE(helped.insert(l.name).second) << l.name << " has two help lines";
    EXPECT_EQ(doc_topic[l.name], l.topic) << "DPB_" << l.name << ": docs/flags.md and --help disagree";
    EXPECT_GT(std::string(l.help).size(), 5u) << l.name;
  }
  const std::vector<std::string> names = FlagNames();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), helped) << "a flag without help, or help without a flag";
  const std::string help = FlagHelp();
  EXPECT_LT(help.find("What a deployment sets"), help.find("Research and tuning flags"));
  EXPECT_NE(help.find("DPB_LEARN_STEP_TERMS"), std::string::npos);
}

}  // namespace
}  // namespace dpbalance::plugin
