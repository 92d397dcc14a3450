#include "flags.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "dpbalance/cost_model.h"
#include "dpbalance/log.h"

extern char** environ;

namespace dpbalance::plugin {
namespace {

using Setter = std::function<absl::Status(PluginFlags&, const std::string&)>;
using FlagTable = std::map<std::string, Setter>;

// A setter's error; `Apply` prefixes the flag's name and where the value came from.
absl::Status BadValue(const std::string& value, const std::string& want) {
  return absl::InvalidArgumentError(absl::StrCat("'", value, "' is not ", want));
}

Setter Int(int lo, int hi, std::function<void(PluginFlags&, int)> set) {
  return [=](PluginFlags& f, const std::string& v) -> absl::Status {
    int x;
    if (!absl::SimpleAtoi(v, &x) || x < lo || x > hi) {
      return BadValue(v, absl::StrCat("an integer in ", lo, "..", hi));
    }
    set(f, x);
    return absl::OkStatus();
  };
}

Setter Double(double lo, double hi, std::function<void(PluginFlags&, double)> set) {
  return [=](PluginFlags& f, const std::string& v) -> absl::Status {
    double x;
    if (!absl::SimpleAtod(v, &x) || !std::isfinite(x) || x < lo || x > hi) {
      return BadValue(v, absl::StrCat("a number in [", lo, ", ", hi, "]"));
    }
    set(f, x);
    return absl::OkStatus();
  };
}

// Flags of the planner and its step cost (PlannerConfig, GlobalCost) and the per-request floor.
void AddPlannerFlags(FlagTable& t) {
  t.insert({
      {"mode", [](PluginFlags& f, const std::string& v) -> absl::Status {
         absl::StatusOr<PlanMode> m = ParsePlanMode(v);
         if (!m.ok()) return BadValue(v, "off, goodput, fill, local, dspark or dspark_fill");
         f.balancer.planner.mode = *m;
         return absl::OkStatus();
       }},
      {"k_max", Int(0, kMaxDraftLen, [](PluginFlags& f, int x) { f.balancer.planner.k_max = x; })},
      {"default_k", Int(0, kMaxDraftLen, [](PluginFlags& f, int x) { f.balancer.planner.default_k = x; })},
      {"k_min", Int(0, kMaxDraftLen, [](PluginFlags& f, int x) { f.k_min = x; })},
      {"tiers", [](PluginFlags& f, const std::string& v) -> absl::Status {
         f.balancer.planner.token_tiers.clear();
         if (v.empty()) return absl::OkStatus();
         for (absl::string_view part : absl::StrSplit(v, ',')) {
           int32_t t;
           if (!absl::SimpleAtoi(part, &t) || t <= 0) return BadValue(v, "a comma list of positive token counts");
           // The planner takes only strictly ascending tiers (PlannerConfig::Validate); said here,
           // the error names the flag and its source instead of failing later in init.
           if (!f.balancer.planner.token_tiers.empty() && t <= f.balancer.planner.token_tiers.back()) {
             return BadValue(v, "a strictly ascending list of token counts");
           }
           f.balancer.planner.token_tiers.push_back(t);
         }
         return absl::OkStatus();
       }},
      {"padded", Int(0, 1, [](PluginFlags& f, int x) { f.balancer.planner.global.padded_tokens = x; })},
      {"ffn_fixed_us", Double(0, 1e9, [](PluginFlags& f, double x) { f.balancer.planner.global.ffn_fixed_us = x; })},
      {"ffn_per_token_us", Double(0, 1e6, [](PluginFlags& f, double x) { f.balancer.planner.global.ffn_per_token_us = x; })},
      {"step_overhead_us", Double(0, 1e9, [](PluginFlags& f, double x) { f.balancer.planner.global.step_overhead_us = x; })},
      {"draft_us", Double(0, 1e9, [](PluginFlags& f, double x) { f.balancer.planner.global.draft_per_step_us = x; })},
      {"step_slack", Double(-1, 100, [](PluginFlags& f, double x) { f.balancer.planner.max_step_slack = x; })},
      {"guard_overhead_us", Double(0, 1e7, [](PluginFlags& f, double x) { f.balancer.planner.guard_overhead_us = x; })},
      {"guard_measured", Int(0, 1, [](PluginFlags& f, int x) { f.balancer.planner.guard_measured_overhead = x; })},
      {"min_plan_gain", Double(0, 10, [](PluginFlags& f, double x) {
         f.balancer.planner.min_plan_gain = x;
         f.min_plan_gain_set = true;
       })},
      {"value_deferral", Int(0, 1, [](PluginFlags& f, int x) { f.balancer.planner.value_deferral = x; })},
      {"granularity", [](PluginFlags& f, const std::string& v) -> absl::Status {
         if (v != "request" && v != "rank" && v != "instance") {
           return BadValue(v, "request, rank or instance");
         }
         f.balancer.planner.uniform_per_rank = v == "rank";
         f.balancer.planner.uniform_instance = v == "instance";
         return absl::OkStatus();
       }},
      {"depths", [](PluginFlags& f, const std::string& v) -> absl::Status {
         f.balancer.planner.allowed_depths = 0;
         if (v.empty()) return absl::OkStatus();
         for (absl::string_view part : absl::StrSplit(v, ',')) {
           int d;
           if (!absl::SimpleAtoi(part, &d) || d < 0 || d > kMaxDraftLen) {
             return BadValue(v, "a comma list of draft depths in 0..8");
           }
           f.balancer.planner.allowed_depths |= 1u << d;
         }
         return absl::OkStatus();
       }},
      {"agreed_depth", Int(0, 1, [](PluginFlags& f, int x) { f.balancer.planner.agreed_draft_depth = x; })},
  });
}

// Flags of the balancer around the planner: backend, timeouts, A/B, logs, cost model, SLO.
void AddBalancerFlags(FlagTable& t) {
  t.insert({
      {"backend", [](PluginFlags& f, const std::string& v) -> absl::Status {
         if (v != "inproc" && v != "callback" && v != "nccl") return BadValue(v, "inproc, callback or nccl");
         f.backend = v;
         return absl::OkStatus();
       }},
      {"group", [](PluginFlags& f, const std::string& v) -> absl::Status {
         if (v.empty()) return BadValue(v, "a non-empty name");
         f.group = v;
         return absl::OkStatus();
       }},
      {"timeout_ms", Int(1, 600000, [](PluginFlags& f, int x) { f.balancer.timeout = absl::Milliseconds(x); })},
      {"max_failures", Int(1, 1000000, [](PluginFlags& f, int x) { f.balancer.max_consecutive_failures = x; })},
      {"ab_epoch", Int(0, 100000000, [](PluginFlags& f, int x) { f.balancer.ab_epoch_steps = x; })},
      {"learn_step_terms", Int(0, 1, [](PluginFlags& f, int x) { f.balancer.learn_step_terms = x; })},
      {"quiet_after", Int(0, QuietConfig::kMaxAfter, [](PluginFlags& f, int x) { f.balancer.quiet.after = x; })},
      {"quiet_max", Int(1, QuietConfig::kMaxSpan, [](PluginFlags& f, int x) { f.balancer.quiet.max_steps = x; })},
      {"log_every", Int(0, 100000000, [](PluginFlags& f, int x) { f.balancer.log_every_steps = x; })},
      {"log_level", [](PluginFlags& f, const std::string& v) -> absl::Status {
         static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "off"};
         for (const char* l : kLevels) {
           if (v == l) {
             f.log_level = v;
             return absl::OkStatus();
           }
         }
         return BadValue(v, "trace, debug, info, warn, error or off");
       }},
      {"metrics_file", [](PluginFlags& f, const std::string& v) -> absl::Status {
         // Checked at init, where a bad value disables the plugin like any bad flag: a path the
         // balancer cannot append to would otherwise lose every metrics line silently.
         if (!v.empty()) {
           std::error_code ec;
           const std::filesystem::path p(v);
           const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
           if (std::filesystem::is_directory(p, ec)) return BadValue(v, "a file (it is a directory)");
           if (!std::filesystem::is_directory(dir, ec)) {
             return BadValue(v, absl::StrCat("a writable file: directory '", dir.string(), "' does not exist"));
           }
           if (std::filesystem::exists(p, ec) ? access(v.c_str(), W_OK) != 0 : access(dir.c_str(), W_OK) != 0) {
             return BadValue(v, "a writable file (permission denied)");
           }
         }
         f.balancer.metrics_file = v;
         return absl::OkStatus();
       }},
      {"cost_model", [](PluginFlags& f, const std::string& v) -> absl::Status {
         absl::StatusOr<CostModel> m = CostModel::FromSpec(v);
         if (!m.ok()) return m.status();
         f.balancer.model = *std::move(m);
         return absl::OkStatus();
       }},
      {"grid_sim", [](PluginFlags& f, const std::string& v) -> absl::Status {
         if (v != "sampled" && v != "exact") return BadValue(v, "sampled or exact");
         f.balancer.planner.sample_heads = v == "sampled";
         return absl::OkStatus();
       }},
      {"tpot_slo_ms", Double(0, 1e6, [](PluginFlags& f, double x) { f.balancer.tpot_slo_us = x * 1000; })},
      {"online", Int(0, 1, [](PluginFlags& f, int x) { f.balancer.online_calibration = x; })},
      {"prior_strength", Double(1e-3, 1e6, [](PluginFlags& f, double x) { f.balancer.acceptance_prior_strength = x; })},
      {"acceptance", [](PluginFlags& f, const std::string& v) -> absl::Status {
         absl::StatusOr<AcceptanceModel> m = ParseAcceptanceModel(v);
         if (!m.ok()) return BadValue(v, "beta or shift");
         f.balancer.acceptance_model = *m;
         return absl::OkStatus();
       }},
  });
}

// Flags of the router ABI (dpbalance_router_v1.h); the balancer accepts and ignores them.
void AddRouterFlags(FlagTable& t) {
  t.insert({
      {"routing", [](PluginFlags& f, const std::string& v) -> absl::Status {
         absl::StatusOr<RoutingStrategy> s = ParseRouting(v);
         if (!s.ok()) return BadValue(v, "A, B, C, D or E");
         f.routing.strategy = *s;
         return absl::OkStatus();
       }},
      {"z", Double(1e-6, 1e6, [](PluginFlags& f, double x) { f.routing.z = x; })},
      {"groups", Int(1, 1 << 20, [](PluginFlags& f, int x) { f.routing.groups = x; })},
      {"group_choice", [](PluginFlags& f, const std::string& v) -> absl::Status {
         if (v != "A" && v != "B") return BadValue(v, "A or B");
         f.routing.group_choice = v == "A" ? RoutingStrategy::kMinBatch : RoutingStrategy::kMinContext;
         return absl::OkStatus();
       }},
      {"split_percentile", Double(1e-6, 0.999999, [](PluginFlags& f, double x) { f.routing.split_percentile = x; })},
      {"split_window", Int(1, 100000000, [](PluginFlags& f, int x) { f.routing.split_window = x; })},
      {"route_query_tokens", Double(1, 1 + kMaxDraftLen, [](PluginFlags& f, double x) { f.routing.query_tokens_per_request = x; })},
      {"route_initial_output", Double(0, 1e9, [](PluginFlags& f, double x) { f.routing.initial_output_tokens = x; })},
  });
}

// Every flag by its lower-case name (DPB_<NAME> without the prefix); docs/flags.md lists them.
const FlagTable& Table() {
  static const FlagTable* table = [] {
    auto* t = new FlagTable;
    AddPlannerFlags(*t);
    AddBalancerFlags(*t);
    AddRouterFlags(*t);
    return t;
  }();
  return *table;
}

absl::Status Apply(PluginFlags& f, const std::string& key, const std::string& value,
                   const std::string& source) {
  const auto it = Table().find(key);
  if (it == Table().end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown flag '", key, "' in ", source));
  }
  if (absl::Status s = it->second(f, value); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("flag '", key, "' in ", source, ": ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace

std::map<std::string, std::string> DpbEnvironment() {
  std::map<std::string, std::string> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string kv(*e);
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || kv.rfind("DPB_", 0) != 0) continue;
    const std::string name = kv.substr(0, eq);
    // The host's: which library to load, and whether a refused flag stops the engine.
    if (name == "DPB_PLUGIN" || name == "DPB_STRICT") continue;
    out[name] = kv.substr(eq + 1);
  }
  return out;
}

absl::Duration TimeoutFlag(const std::map<std::string, std::string>& env, const std::string& config) {
  std::map<std::string, std::string> only;
  if (const auto it = env.find("DPB_TIMEOUT_MS"); it != env.end()) only[it->first] = it->second;
  std::string entry;
  for (absl::string_view item : absl::StrSplit(config, ';', absl::SkipWhitespace())) {
    const size_t eq = item.find('=');
    if (eq != absl::string_view::npos && absl::StripAsciiWhitespace(item.substr(0, eq)) == "timeout_ms") {
      entry = std::string(item);  // the last one wins, as in ParseFlags
    }
  }
  absl::StatusOr<PluginFlags> f = ParseFlags(only, entry);
  return f.ok() ? f->balancer.timeout : BalancerConfig{}.timeout;
}

std::vector<std::string> FlagNames() {
  std::vector<std::string> names;
  for (const auto& [name, setter] : Table()) names.push_back(name);
  return names;
}

absl::StatusOr<PluginFlags> ParseFlags(const std::map<std::string, std::string>& env,
                                       const std::string& config) {
  PluginFlags f;
  f.balancer.planner.max_step_slack = 0.03;
  // The default guard (docs/flags.md): a plan must beat the default plan's predicted goodput by
  // more than 2%, or every rank keeps its default lengths (free on the replay's truths,
  // docs/results.md).
  f.balancer.planner.min_plan_gain = 0.02;
  f.routing.strategy = RoutingStrategy::kCostAware;  // the router ABI recommends ours (E)
  for (const auto& [name, value] : env) {
    if (name.rfind("DPB_", 0) != 0 || name == "DPB_PLUGIN" || name == "DPB_STRICT") continue;
    const std::string key = absl::AsciiStrToLower(name.substr(4));
    if (absl::Status s = Apply(f, key, value, absl::StrCat("environment variable ", name)); !s.ok()) return s;
  }
  for (absl::string_view item : absl::StrSplit(config, ';', absl::SkipWhitespace())) {
    const std::string entry(absl::StripAsciiWhitespace(item));
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("config string entry '", entry, "' is not key=value"));
    }
    const std::string key(absl::StripAsciiWhitespace(entry.substr(0, eq)));
    const std::string value(absl::StripAsciiWhitespace(entry.substr(eq + 1)));
    if (absl::Status s = Apply(f, key, value, "the config string"); !s.ok()) return s;
  }
  // A plan is a bet on the cost model: unless told otherwise, it must beat the default plan by
  // more than the model's own cross-validated error, when its file records one (docs/flags.md).
  if (!f.min_plan_gain_set && f.balancer.model.cv_mape() > f.balancer.planner.min_plan_gain) {
    f.balancer.planner.min_plan_gain = std::min(10.0, f.balancer.model.cv_mape());
  }
  if (f.balancer.planner.default_k > f.balancer.planner.k_max) {
    return absl::InvalidArgumentError(absl::StrCat("flag 'default_k' (", f.balancer.planner.default_k,
                                                   ") exceeds 'k_max' (", f.balancer.planner.k_max, ")"));
  }
  const PlannerConfig& pc = f.balancer.planner;
  if (!pc.DepthAllowed(pc.default_k) || !pc.DepthAllowed(pc.k_max)) {
    std::vector<int> depths;
    for (int d = 0; d <= kMaxDraftLen; ++d) {
      if (pc.DepthAllowed(d)) depths.push_back(d);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "flag 'depths' (", absl::StrJoin(depths, ","), ") must hold 'default_k' (", pc.default_k,
        ") and 'k_max' (", pc.k_max, "): the engine's own depth and the deepest plan must be ones it can run"));
  }
  // Whatever else the flags combine into, the planner must take it: said now, at load, not when
  // the first plan is made.
  if (absl::Status s = pc.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the DPB_* flags and config string together are inconsistent: ", s.message()));
  }
  return f;
}

}  // namespace dpbalance::plugin
