// plugin/src/flag_help.cc — the flags' one-line help, in the tiers docs/flags.md uses: what a
// deployment sets first, then the research and tuning flags by topic, then the router's.
// flags_test checks that every flag the parser takes has a line here and sits in the same tier
// and topic as in docs/flags.md.
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "flags.h"

namespace dpbalance::plugin {
namespace {

// The tiers and topics, in docs/flags.md's order and words.
constexpr char kDeploy[] = "What a deployment sets";
constexpr char kStepTerms[] = "The step's cost terms, learnt online (the flags are the fit's prior)";
constexpr char kGuards[] = "The plan's guards and objective";
constexpr char kModels[] = "The models";
constexpr char kExchange[] = "The exchange";
constexpr char kRouter[] = "Router flags";

const std::vector<FlagHelpLine>& Lines() {
  static const std::vector<FlagHelpLine> kLines = {
      {kDeploy, "mode", "goodput",
       "off | goodput | fill | local | dspark | dspark_fill: what the plan maximises (goodput: accepted tokens/s)"},
      {kDeploy, "k_max", "7", "drafts 0..8: the draft depth limit (vLLM: num_speculative_tokens)"},
      {kDeploy, "default_k", "3", "drafts: the engine's own verify length (fallback, guard reference)"},
      {kDeploy, "tpot_slo_ms", "0", "ms: the per-request TPOT SLO the plan keeps (0: none)"},
      {kDeploy, "log_level", "info", "trace | debug | info | warn | error | off (stderr)"},
      {kDeploy, "log_every", "1000", "steps: the periodic one-line summary, step terms included (0: never)"},
      {kDeploy, "metrics_file", "", "path: JSON lines, one per log period"},
      {kStepTerms, "learn_step_terms", "1",
       "0..1: learn the four terms below from the engine's step cycle (0: the flags as given)"},
      {kStepTerms, "ffn_fixed_us", "20000",
       "us: MoE FFN + EP time per step at zero tokens (an H200's)"},
      {kStepTerms, "ffn_per_token_us", "2",
       "us per instance query token"},
      {kStepTerms, "step_overhead_us", "0",
       "us per step (learnt: dpbalance's own time)"},
      {kStepTerms, "draft_us", "1500",
       "us per draft step (an H200 MTP step; the vLLM package passes 0 for ngram)"},
      {kStepTerms, "padded", "0",
       "0..1: the FFN runs ranks x the largest rank's tier (CUDA-graph padding)"},
      {kStepTerms, "tiers", "",
       "tokens, ascending: CUDA-graph token tiers per rank"},
      {kStepTerms, "agreed_depth", "1",
       "0..1: one draft depth for the instance (an MTP draft has MoE layers)"},
      {kStepTerms, "depths", "",
       "depths 0..8: the draft depths the engine can run (empty: all)"},
      {kStepTerms, "granularity", "request",
       "request | rank | instance: what one verify length covers"},
      {kGuards, "k_min", "0", "drafts: a floor on every request"},
      {kGuards, "step_slack", "0.03", "fraction: TPOT guard, planned step <= (1 + it) x the default's"},
      {kGuards, "guard_overhead_us", "0", "us: the plugin's own time the TPOT guard counts"},
      {kGuards, "guard_measured", "0", "0..1: the guard also counts the measured own time"},
      {kGuards, "min_plan_gain", "0.02",
       "fraction: a plan must beat the default plan by this (or the model's cv_mape)"},
      {kGuards, "value_deferral", "0", "0..1: value a request's tokens by its cost per token"},
      {kModels, "cost_model", "v2", "v1 | v2 | v2+GRID | FILE: the attention cost model (refitted online)"},
      {kModels, "grid_sim", "sampled", "sampled | exact: how a head-major grid model's launch is priced"},
      {kModels, "online", "1", "0..1: refit the attention model from measured times"},
      {kModels, "prior_strength", "4", "pseudo-observations: the acceptance estimator's prior"},
      {kModels, "acceptance", "beta", "beta | shift: the acceptance estimator's model"},
      {kExchange, "backend", "nccl", "inproc | callback | nccl: when init says \"from flags\""},
      {kExchange, "group", "default", "name: the in-process group"},
      {kExchange, "timeout_ms", "50", "ms: bound on each step's all-gather"},
      {kExchange, "max_failures", "8", "steps: consecutive failures before the rank disables"},
      {kExchange, "ab_epoch", "0", "steps: A/B epochs, balancing on and off (0: none)"},
      {kExchange, "quiet_after", "0", "exchanges: skip the exchange after this many kept-default steps (0: off)"},
      {kExchange, "quiet_max", "32", "steps: the longest span without an exchange"},
      {kRouter, "routing", "E", "A | B | C | D | E: the routing strategy"},
      {kRouter, "z", "1.2", "D: ranks under mean x Z token usage are preferred"},
      {kRouter, "groups", "1", "groups of contiguous ranks"},
      {kRouter, "group_choice", "A", "A | B: how the group is chosen"},
      {kRouter, "split_percentile", "0.9", "C: the length percentile between A and B"},
      {kRouter, "split_window", "1000", "C: requests the percentile is over"},
      {kRouter, "route_query_tokens", "4", "E: query tokens a request is priced at"},
      {kRouter, "route_initial_output", "300", "E: expected output before any request finished"},
  };
  return kLines;
}

}  // namespace

const std::vector<FlagHelpLine>& FlagHelpLines() { return Lines(); }

std::string FlagHelp() {
  std::string out =
      "The plugin's flags: DPB_<NAME> environment variables, or name=value;... in the config string\n"
      "given to init (which wins). Defaults, ranges and details: docs/flags.md.\n";
  std::string topic;
  for (const FlagHelpLine& l : Lines()) {
    if (l.topic != topic) {
      const bool research = topic == kDeploy;  // the research and tuning topics follow the first tier
      topic = l.topic;
      if (topic == kDeploy || topic == kRouter) {
        out += absl::StrFormat("\n%s:\n", topic);
      } else {
        out += absl::StrFormat("%s  %s:\n", research ? "\nResearch and tuning flags:\n" : "", topic);
      }
    }
    std::string name = l.name;
    for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    out += absl::StrFormat("    DPB_%-22s %-9s %s\n", name, l.default_value[0] ? l.default_value : "(empty)", l.help);
  }
  return out;
}

}  // namespace dpbalance::plugin
