// plugin/src/flags.h — the plugin's runtime flags: DPB_* environment variables, overridden by
// the `key=value;...` config string given to init. docs/flags.md lists every flag.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "dpbalance/balancer.h"
#include "dpbalance/routing.h"

namespace dpbalance::plugin {

struct PluginFlags {
  BalancerConfig balancer;         // mode, k_max, default_k, global terms, timeout, A/B, ...
  RoutingConfig routing;           // the router ABI's strategy (E prices with balancer.model)
  int32_t k_min = 0;               // floor added to every request's own k_min
  std::string backend = "nccl";    // inproc | callback | nccl (when init says "from flags")
  std::string group = "default";   // inproc group name
  std::string log_level = "info";
  // Whether min_plan_gain was given (DPB_MIN_PLAN_GAIN or the config string); if not, a cost
  // model that records its fit's error (CostModel::cv_mape) sets the default guard's margin.
  bool min_plan_gain_set = false;
};

// `env` maps variable names to values (the process environment in production, a map in tests).
// Errors name the flag, its source (environment or config string) and the value.
absl::StatusOr<PluginFlags> ParseFlags(const std::map<std::string, std::string>& env,
                                       const std::string& config);
// The DPB_* variables of this process's environment (DPB_PLUGIN and DPB_STRICT, the host's,
// excluded).
std::map<std::string, std::string> DpbEnvironment();
// Every flag's name, lower case without the prefix, sorted (what docs/flags.md must list).
std::vector<std::string> FlagNames();
// One flag's help (flag_help.cc): the tier and topic of docs/flags.md it sits under, its name
// (lower case, no prefix), its default as text and one line of help.
struct FlagHelpLine {
  const char* topic;
  const char* name;
  const char* default_value;
  const char* help;
};
// Every flag's line, in docs/flags.md's order: "What a deployment sets", then the research and
// tuning topics, then "Router flags".
const std::vector<FlagHelpLine>& FlagHelpLines();
// The text `dpbalance-flags --help` prints: the lines above under their tiers and topics.
std::string FlagHelp();
// The timeout_ms flag alone (the config string's wins), for a rank whose other flags failed:
// its refusal joins the handshake for as long as its peers wait. A missing or bad value gives
// the default (BalancerConfig::timeout).
absl::Duration TimeoutFlag(const std::map<std::string, std::string>& env, const std::string& config);

}  // namespace dpbalance::plugin
