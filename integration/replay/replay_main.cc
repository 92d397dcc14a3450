// dpbalance-replay: replays a serving trace through a simulated DP decode instance and compares
// routing strategies and verify balancing. `--help` lists the flags; docs/results.md the runs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <filesystem>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli.h"
#include "nlohmann/json.hpp"
#include "simulator.h"
#include "trace.h"

#ifndef DPB_DEFAULT_TRACE
#define DPB_DEFAULT_TRACE "integration/replay/data/mooncake_conversation.jsonl"
#endif

ABSL_FLAG(std::string, trace, DPB_DEFAULT_TRACE, "trace file (Mooncake JSONL or Azure CSV)");
ABSL_FLAG(std::string, trace_format, "auto", "auto, mooncake or azure");
ABSL_FLAG(int, dp, 64, "DP ranks of the decode instance");
ABSL_FLAG(int64_t, rank_capacity_tokens, 512000, "KV capacity per rank, tokens");
ABSL_FLAG(int, max_batch, 64, "batch limit per rank, requests");
ABSL_FLAG(int, inflight, 2048, "closed loop: requests in flight for the whole instance");
ABSL_FLAG(bool, open_loop, false, "admit at trace arrival times instead of closed loop");
ABSL_FLAG(double, arrival_speedup, 1.0, "open loop: divide arrival times by this");
ABSL_FLAG(bool, drain, false,
          "after the trace is exhausted, run until every request has finished and measure the "
          "drain too (as a live stream's figures cover every request)");
ABSL_FLAG(bool, compare, true,
          "run the default comparison; false: one run with --routing/--verify/--k");
ABSL_FLAG(std::string, routing, "D", "routing for a single run: A, B, C, D or E (ours)");
ABSL_FLAG(double, z, 1.2, "D: usage threshold factor Z");
ABSL_FLAG(int, groups, 1, "routing groups (D inside the chosen group)");
ABSL_FLAG(std::string, group_choice, "A", "group choice: A or B");
ABSL_FLAG(double, split_percentile, 0.9, "C: percentile Px as a fraction");
ABSL_FLAG(int, split_window, 1000, "C: last N requests");
ABSL_FLAG(std::string, verify, "off",
          "single run: off, local, goodput, fill, oracle, dspark or dspark_fill (SGLang's DSpark "
          "planner as shipped: each rank's verify budget by its own expected tokens per second "
          "from a steps-per-second table, every rank padded to the largest rank's tier; "
          "dspark_fill: with --speculative-dspark-align-verify-tokens-to-graph-tier, every rank "
          "fills the tier with its best drafts)");
ABSL_FLAG(std::string, dspark_sps, "profiled",
          "the table of the DSpark rows that name none (dspark, dspark_fill, a single run): "
          "'profiled' (SGLang's dspark_sps_profiler table at its defaults, measured on the truth "
          "at uniform DP load and 16-token prompts, a floor step function), 'workload' (the same "
          "profiled at the trace's decode contexts), 'additive' (SpsAdditiveCostTable fitted by "
          "the profiler's --fracs sweep, at the trace's contexts), 'online' (OnlineSpsProfiler: "
          "each rank refits the table from its measured steps every 1000, starting from "
          "'workload', after two warm-up passes over the trace: a server has run long before it "
          "is measured) or 'context' (the planner's own context-aware model: a sensitivity run)");
ABSL_FLAG(std::string, tiers, "sglang",
          "token tiers of the rows that run with them (dspark, the 'tiers' rows, --padded): "
          "'sglang' (SGLang's default CUDA-graph batch sizes with speculative decoding, up to "
          "--max_batch, times k_max + 1 tokens), 'none' (pad to the largest rank's tokens) or "
          "ascending token counts separated by commas");
ABSL_FLAG(bool, padded, false,
          "single run: every rank padded to the agreed --tiers tier (a planner in its "
          "padded mode: what the v2 plugin does with DPB_TIERS and DPB_PADDED)");
ABSL_FLAG(int, stale_steps, 1,
          "lag, every row: the engine plans step t while steps t-N..t-1 still run (SGLang's "
          "overlap scheduler, vLLM's async scheduling: 1): contexts, remaining tokens and "
          "acceptance statistics N steps old, finished requests learned of N steps late; the "
          "truth charges what was scheduled. 0: every plan sees the last step's results");
ABSL_FLAG(bool, step_bound, false,
          "padded rows with one draft depth: also compute each step's bound on expected tokens "
          "per second (true acceptance, every spare token on the cheapest slot) and report "
          "step_bound_over_expected; for truths whose attention never falls when a query token "
          "moves to a dummy slot (v1, v2, fits without a grid)");
ABSL_FLAG(std::string, lag_predict, "all",
          "planner rows under lag: what they predict of a request after the pending steps "
          "(dpbalance/lag.h): 'all', 'none', or a comma list of context, cap, gain, slo");
ABSL_FLAG(std::string, k, "best", "static verify length (off mode; default k of fill), or 'best'");
ABSL_FLAG(int, k_max, 7, "draft depth limit for the planner and the static sweep");
ABSL_FLAG(bool, floor_at_default, false,
          "planner modes: never verify fewer than the default k (a per-request TPOT floor)");
ABSL_FLAG(std::string, tpot_slo_ms, "auto",
          "planner modes: per-request TPOT SLO in ms; a request that would exceed it gets the "
          "shortest verify length up to the default k that keeps it within. 'auto': the TPOT p99 of the static baseline (D z1.2 at its best k in "
          "the comparison; the same routing at the default k in a single run); 'off' or 0: none");
ABSL_FLAG(double, step_slack, 0.03,
          "planner TPOT guard: step time <= (1 + this) x the default-k step; < 0 disables");
ABSL_FLAG(double, guard_overhead_us, 0,
          "planner TPOT guard: the plugin's own time per step outside the forward, counted "
          "against the guard (DPB_GUARD_OVERHEAD_US); the replay's steps do not include it");
ABSL_FLAG(int32_t, quiet_after, 0,
          "planner rows: the balancer's quiet mode (DPB_QUIET_AFTER): after this many plans in a "
          "row that kept the default lengths, spans of steps run them without a plan; 0: off");
ABSL_FLAG(int32_t, quiet_max, 32, "planner rows, quiet mode: the longest span (DPB_QUIET_MAX)");
ABSL_FLAG(double, min_plan_gain, 0,
          "planner default guard: a plan replaces the default-k plan only when its predicted "
          "goodput is more than (1 + this) x the default plan's; 0 disables");
ABSL_FLAG(bool, value_deferral, false,
          "planner rows: value each request's tokens by its own cost per emitted token at the "
          "default length over its rank's mean (PlannerConfig::value_deferral): a token a plan "
          "defers costs its request another step later");
ABSL_FLAG(std::string, truth, "v2",
          "truth attention model: v2, v1, v2+GRID or a cost-model JSON file");
ABSL_FLAG(std::string, planner_model, "auto",
          "planner's model: auto (what it has in production: online:v1 where the truth is v1, "
          "else online:v2), v2, v1, v2+GRID (V2 with a kernel grid's makespans seeded, e.g. "
          "v2+fa2-packed-h200), a JSON file (e.g. dpbalance-calibrate's fit of your rows), "
          "online[:START] (refit online from the measured attention, starting from START = v2 by "
          "default), or truth (the replay's own truth: an oracle, never a headline; its rows are "
          "marked so)");
ABSL_FLAG(std::string, planner_grid_sim, "default",
          "how the planner simulates a grid model's launch: 'reference' (as the fits were "
          "calibrated and the truth is evaluated), 'fast' (SimulateMakespans: closed-form drains, "
          "another tie rule; docs/cost-model.md), 'sampled' (reference, a head-major verify "
          "launch from its first heads) or 'default' (the planner's default: sampled for a "
          "reference model, fast where its file says \"grid_simulation\": \"fast\")");
ABSL_FLAG(int, truth_layers, 1,
          "attention layers per step: the truth model (e.g. a per-layer fit from "
          "dpbalance-calibrate) is multiplied by this");
ABSL_FLAG(std::string, eval_cost, "v2", "published form the attention cost ratio uses: v1 or v2");
ABSL_FLAG(double, ffn_fixed_ms, 20.0, "truth: MoE FFN + EP comm fixed time per step, ms");
ABSL_FLAG(double, ffn_per_token_ms, 0.002, "truth: FFN + comm per instance query token, ms");
ABSL_FLAG(double, draft_ms, 1.5, "truth: draft time per draft step, ms (depth agreed by all)");
ABSL_FLAG(std::string, draft, "agreed",
          "truth: 'agreed' (one draft depth for the instance, MTP with MoE layers, --draft_ms a "
          "step), 'per_rank' (a dense draft each rank runs to its own deepest verify length, "
          "before the barrier) or 'block' (one forward proposes the whole block, --draft_ms a "
          "step whatever the depth: SGLang DSpark's draft). The comparison runs its DSpark "
          "section with 'block' when this is 'agreed'");
ABSL_FLAG(std::string, granularity, "request",
          "planner rows: 'request' (a verify length per request), 'rank' (one per rank, for "
          "engines that vary it per batch only) or 'instance' (one width for every rank, the "
          "agreed draft depth: SGLang's EAGLE/MTP step graphs; the static rows are that "
          "engine's fixed widths)");
ABSL_FLAG(double, noise, 0.0, "truth: multiplicative log-normal noise sigma on attention");
ABSL_FLAG(double, acceptance_sigma, 1.0, "per-request acceptance shift, logit std-dev");
ABSL_FLAG(double, prior_strength, 4.0,
          "planner rows' and DSpark's acceptance estimator: pseudo-observations the instance "
          "prior is worth per position (the plugin's DPB_PRIOR_STRENGTH)");
ABSL_FLAG(std::string, acceptance, "beta",
          "planner rows' and DSpark's acceptance estimator: 'beta' (per position) or 'shift' "
          "(one logit shift per request, its prior width learnt online; the plugin's "
          "DPB_ACCEPTANCE); or 'truth': every row that plans, ours and DSpark's alike, reads "
          "each request's true acceptance (the oracle's knowledge for every row)");
ABSL_FLAG(double, step_acceptance_sigma, 0,
          "acceptance that varies step to step: each request-step's rates shifted by one logit "
          "offset N(0, this) (0: i.i.d. per request)");
ABSL_FLAG(double, confidence_sigma, -1,
          "the draft's confidence signal DSpark reads (fresh for its top-k, two steps back for its "
          "budget): the step's true rates with N(0, this) logit noise per request-step (0: "
          "perfect, large: useless; < 0: none, DSpark reads the estimators' acceptance). The JSON "
          "gives its AUC against the first draft's acceptance (confidence_auc)");
ABSL_FLAG(uint64_t, seed, 1, "random seed");
ABSL_FLAG(int, max_requests, 0, "use only the first N trace requests (0: all)");
ABSL_FLAG(int, threads, 0, "worker threads for the comparison (0: all cores)");
ABSL_FLAG(std::string, json, "", "write {\"runs\":[...]} to this file");

namespace dpbalance::replay {
namespace {

// One configuration of the comparison, before it runs: a row of the table.
struct RowSpec {
  std::string name;
  RoutingStrategy routing;
  double z;
  int groups;
  VerifyMode verify;
  std::optional<int> k;  // nullopt: best static k (off) or the best static k of D (planner)
  bool slo = true;       // planner rows: run under the TPOT SLO (when there is one)
  bool guard = true;     // planner rows: run under the step guard (--step_slack)
  bool padded = false;   // every rank padded to the agreed --tiers tier (dspark always is)
  // The DSpark section: SGLang DSpark's engine, whose draft proposes its block in one forward
  // (Instance::dspark_truth); its planner rows take their default k and SLO from its static row.
  bool dspark_engine = false;
  std::string verify_label;  // JSON verify_mode when not the mode's own name ("static_best")
  // DSpark rows: the table that prices the budget (unset: --dspark_sps).
  std::optional<DsparkTable> dspark_table;
};

// A row of the table after its run.
struct Row {
  std::string name;
  std::string routing;
  double z = 0;
  int groups = 1;
  std::string verify;
  int k = 0;
  double tpot_slo_ms = 0;  // planner rows: the SLO they ran under (0: none)
  RunResult result;
  double step_slack = -1;  // planner rows: the TPOT guard they ran under (< 0: none)
  bool padded = false;     // ran with token tiers (every rank padded to the agreed tier)
  int stale_steps = 0;     // the lag every row ran at
  std::string draft;       // the truth's draft: agreed, per_rank or block
  std::string verify_mode; // JSON: off, static_best, goodput, dspark, dspark_fill, ...
  std::string dspark_table;  // DSpark rows: DsparkTableName
  // What the row planned with (PlannerModelOf): "" for rows that do not plan (static) or plan by
  // a DSpark table alone; "truth" where it reads the replay's truth (an oracle: not a headline).
  std::string planner_model;
  bool headline = true;  // planned with no more than production knowledge
  double min_plan_gain = 0;  // planner rows: the default guard they ran under (0: none)
  bool value_deferral = false;  // planner rows: tokens valued by their deferral cost
};

// What every row shares: the trace, the truth timing model and the configuration the rows vary.
struct Instance {
  std::vector<TraceRequest> trace;
  TruthModel truth;
  TruthModel dspark_truth;  // the DSpark section's: a block draft where the run's is agreed
  SimConfig base;
};

std::string DraftName(const TruthModel& t) {
  return t.per_rank_draft ? "per_rank" : t.block_draft ? "block" : "agreed";
}

// The truth with SGLang DSpark's draft: one forward proposes the whole block, at --draft_ms, a
// step cost that does not grow with the depth. A dense per-rank draft stays as it is.
TruthModel BlockDraft(TruthModel t) {
  if (t.per_rank_draft || t.block_draft) return t;
  t.global.step_overhead_us += t.global.draft_per_step_us;
  t.global.draft_per_step_us = 0;
  t.block_draft = true;
  return t;
}

// The comparison's outcome: its rows (then the ideal row, when there is one) and the TPOT SLO
// the planner rows ran under.
struct Comparison {
  std::vector<Row> rows;
  bool any_planned = false;      // some row plans verify lengths
  std::optional<double> slo_ms;  // set whenever any_planned (0: none)
  std::string slo_source;
  // The DSpark section's planner rows: the default k of its static row (D z1.2 at its best
  // static k on the same tiers, with the block draft).
  int dspark_default_k = 0;
};

// Exit codes: integration/common/cli.h (0 ok, 1 internal, 2 bad flag, 3 bad input file).
int Fail(const absl::Status& s, cli::ExitCode exit_code) { return cli::Fail("dpbalance-replay", s, exit_code); }

// A model spec (--truth, --planner_model) that failed: a file (one that exists, or a spec that
// names a path) missing or bad is bad data, an unknown model name a bad flag.
cli::ExitCode ModelSpecExitCode(const std::string& spec) {
  std::error_code ec;
  const bool names_file = std::filesystem::exists(spec, ec) || spec.find('/') != std::string::npos ||
                          absl::EndsWith(spec, ".json");
  return names_file ? cli::kBadData : cli::kUsageError;
}


// --planner_model with 'auto' resolved: the knowledge the planner has in production. Where the
// truth is a published form it starts from that form (every engine can have it) and refits
// online; anywhere else from V2 and refits online (a calibrated fit is passed by name).
std::string PlannerModelSpec() {
  const std::string spec = absl::GetFlag(FLAGS_planner_model);
  if (spec != "auto") return spec;
  return absl::GetFlag(FLAGS_truth) == "v1" ? "online:v1" : "online:v2";
}

// The model the planner starts from (PlannerModelSpec without its online[:START] prefix: START,
// V2 when none is given) and whether it refits online.
struct PlannerModelStart {
  std::string spec;
  bool online = false;
};
PlannerModelStart PlannerStart() {
  const std::string spec = PlannerModelSpec();
  if (spec.rfind("online", 0) != 0) return {spec, false};
  return {spec.size() > 7 && spec[6] == ':' ? spec.substr(7) : "v2", true};
}

// What a row plans with: "" where no cost model plans it (static rows; DSpark rows priced by
// one of SGLang's tables, profiled on the truth as SGLang's profiler measures the hardware);
// "truth (oracle)" for the oracle rows; else the resolved --planner_model ("truth" when it is the
// truth: an oracle's knowledge).
std::string PlannerModelOf(VerifyMode verify, DsparkTable table) {
  if (verify == VerifyMode::kStatic) return "";
  if (verify == VerifyMode::kOracle) return "truth (oracle)";
  if (IsDspark(verify) && table != DsparkTable::kContext) return "";
  return PlannerModelSpec();
}

// The context SGLang's profiler runs at when told the workload: --input-len the trace's median
// prompt, then half its new tokens (as dspark::kProfileContextTokens at its default input).
int64_t WorkloadProfileContext(const std::vector<TraceRequest>& trace) {
  if (trace.empty()) return dspark::kProfileContextTokens;
  std::vector<int64_t> inputs;
  for (const TraceRequest& r : trace) inputs.push_back(r.input_tokens);
  std::nth_element(inputs.begin(), inputs.begin() + static_cast<long>(inputs.size() / 2), inputs.end());
  return inputs[inputs.size() / 2] + dspark::kProfileOutputTokens / 2;
}

// --tpot_slo_ms: nullopt for 'auto', else the SLO in ms (0: none).
absl::StatusOr<std::optional<double>> ParseSlo(const std::string& v) {
  if (v == "auto") return std::optional<double>();
  if (v == "off") return std::optional<double>(0.0);
  double ms;
  if (!absl::SimpleAtod(v, &ms) || !(ms >= 0) || !std::isfinite(ms)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tpot_slo_ms = '", v, "' must be 'auto', 'off' or a number of ms >= 0"));
  }
  return std::optional<double>(ms);
}

absl::StatusOr<CostModel> ModelByName(const std::string& name, const std::string& flag) {
  absl::StatusOr<CostModel> m = CostModel::FromSpec(name);
  if (!m.ok()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", m.status().message()));
  return m;
}

absl::StatusOr<VerifyMode> ParseVerifyMode(const std::string& name) {
  if (name == "off") return VerifyMode::kStatic;
  if (name == "local") return VerifyMode::kLocal;
  if (name == "goodput") return VerifyMode::kGoodput;
  if (name == "fill") return VerifyMode::kFill;
  if (name == "oracle") return VerifyMode::kOracle;
  if (name == "dspark") return VerifyMode::kDspark;
  if (name == "dspark_fill") return VerifyMode::kDsparkFill;
  return absl::InvalidArgumentError(absl::StrCat(
      "--verify = '", name, "' is not off, local, goodput, fill, oracle, dspark or dspark_fill"));
}


// --lag_predict: 'all', 'none' or a comma list of context, cap, gain, slo.
absl::StatusOr<uint32_t> ParseLagPredict(const std::string& v) {
  if (v == "all") return uint32_t{kPredictAll};
  if (v == "none") return uint32_t{kPredictNone};
  uint32_t bits = 0;
  for (absl::string_view part : absl::StrSplit(v, ',')) {
    if (part == "context") {
      bits |= kPredictContext;
    } else if (part == "cap") {
      bits |= kPredictCap;
    } else if (part == "gain") {
      bits |= kPredictGain;
    } else if (part == "slo") {
      bits |= kPredictSlo;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--lag_predict = '", v, "': '", part, "' is not all, none, context, cap, gain or slo"));
    }
  }
  return bits;
}

// --tiers: 'sglang', 'none' or ascending positive token counts separated by commas.
absl::StatusOr<std::vector<int32_t>> ParseTiers(const std::string& v, int max_batch, int k_max) {
  if (v == "sglang") return SglangDefaultTiers(max_batch, k_max);
  if (v == "none") return std::vector<int32_t>();
  std::vector<int32_t> tiers;
  for (absl::string_view part : absl::StrSplit(v, ',')) {
    int32_t t;
    if (!absl::SimpleAtoi(part, &t) || t <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tiers = '", v, "': '", part, "' is not a positive token count (expected 'sglang', "
          "'none' or ascending counts separated by commas)"));
    }
    if (!tiers.empty() && t <= tiers.back()) {
      return absl::InvalidArgumentError(absl::StrCat("--tiers = '", v, "': ", t,
                                                     " does not exceed the tier before it, ",
                                                     tiers.back(), " (tiers must ascend)"));
    }
    tiers.push_back(t);
  }
  return tiers;
}

// The checks on every flag, before anything is loaded or run (exit status 2 when one fails):
// numbers finite and in range, names known, the output writable.
absl::Status CheckFlags() {
  // [lo, hi], finite (hi's reason in the comment next to each use).
  auto in_range = [](const char* name, double v, double lo, double hi) -> absl::Status {
    if (!(std::isfinite(v) && v >= lo && v <= hi)) {
      return absl::InvalidArgumentError(absl::StrFormat("--%s = %g must be a number in [%g, %g]", name, v, lo, hi));
    }
    return absl::OkStatus();
  };
  auto positive = [](const char* name, double v, double hi) -> absl::Status {
    if (!(std::isfinite(v) && v > 0 && v <= hi)) {
      return absl::InvalidArgumentError(absl::StrFormat("--%s = %g must be > 0 and <= %g", name, v, hi));
    }
    return absl::OkStatus();
  };
  const int dp = absl::GetFlag(FLAGS_dp);
  for (absl::Status s : {
           in_range("dp", dp, 1, 4096),  // 16x the largest DP decode instance deployed (256)
           // 2^40 tokens: far above any rank's KV (an H200 holds ~2^22 tokens of V3's MLA cache).
           positive("rank_capacity_tokens", absl::GetFlag(FLAGS_rank_capacity_tokens), 1099511627776.0),
           in_range("max_batch", absl::GetFlag(FLAGS_max_batch), 1, 65536),
           in_range("inflight", absl::GetFlag(FLAGS_inflight), 1, 1 << 24),
           positive("arrival_speedup", absl::GetFlag(FLAGS_arrival_speedup), 1e6),
           positive("z", absl::GetFlag(FLAGS_z), 1e6),
           in_range("groups", absl::GetFlag(FLAGS_groups), 1, dp),
           in_range("split_window", absl::GetFlag(FLAGS_split_window), 1, 1e8),
           in_range("step_slack", absl::GetFlag(FLAGS_step_slack), -1e9, 100),  // < 0: no guard
           in_range("min_plan_gain", absl::GetFlag(FLAGS_min_plan_gain), 0, 10),
           in_range("guard_overhead_us", absl::GetFlag(FLAGS_guard_overhead_us), 0, 1e7),
           in_range("quiet_after", absl::GetFlag(FLAGS_quiet_after), 0, QuietConfig::kMaxAfter),
           in_range("quiet_max", absl::GetFlag(FLAGS_quiet_max), 1, QuietConfig::kMaxSpan),
           in_range("truth_layers", absl::GetFlag(FLAGS_truth_layers), 1, 1000),
           in_range("ffn_fixed_ms", absl::GetFlag(FLAGS_ffn_fixed_ms), 0, 1e6),  // a step over 1000 s is a typo
           in_range("ffn_per_token_ms", absl::GetFlag(FLAGS_ffn_per_token_ms), 0, 1e6),
           in_range("draft_ms", absl::GetFlag(FLAGS_draft_ms), 0, 1e6),
           in_range("noise", absl::GetFlag(FLAGS_noise), 0, 10),  // sigma 10: a factor e^10 already
           in_range("acceptance_sigma", absl::GetFlag(FLAGS_acceptance_sigma), 0, 100),  // logits
           positive("prior_strength", absl::GetFlag(FLAGS_prior_strength), 1e6),  // DPB_PRIOR_STRENGTH's range
           in_range("max_requests", absl::GetFlag(FLAGS_max_requests), 0, 2147483647),
           in_range("threads", absl::GetFlag(FLAGS_threads), 0, 1024),
           in_range("stale_steps", absl::GetFlag(FLAGS_stale_steps), 0, 64)}) {
    if (!s.ok()) return s;
  }
  if (const double p = absl::GetFlag(FLAGS_split_percentile); !(p > 0 && p < 1)) {
    return absl::InvalidArgumentError(absl::StrFormat("--split_percentile = %g must be in (0, 1)", p));
  }
  const int k_max = absl::GetFlag(FLAGS_k_max);
  if (k_max < 0 || k_max > kMaxDraftLen) {
    return absl::InvalidArgumentError(absl::StrFormat("--k_max = %d must be in 0..%d", k_max, kMaxDraftLen));
  }
  const std::string k = absl::GetFlag(FLAGS_k);
  int kv;
  if (k != "best" && (!absl::SimpleAtoi(k, &kv) || kv < 0 || kv > k_max)) {
    return absl::InvalidArgumentError(absl::StrCat("--k = '", k, "' must be 'best' or 0..k_max (", k_max, ")"));
  }
  if (absl::StatusOr<std::optional<double>> slo = ParseSlo(absl::GetFlag(FLAGS_tpot_slo_ms)); !slo.ok()) {
    return slo.status();
  }
  const std::string e = absl::GetFlag(FLAGS_eval_cost);
  if (e != "v1" && e != "v2") {
    return absl::InvalidArgumentError(absl::StrCat("--eval_cost = '", e, "' must be v1 or v2"));
  }
  if (absl::StatusOr<TraceFormat> f = ParseTraceFormat(absl::GetFlag(FLAGS_trace_format)); !f.ok()) {
    return f.status();
  }
  if (const std::string d = absl::GetFlag(FLAGS_draft); d != "agreed" && d != "per_rank" && d != "block") {
    return absl::InvalidArgumentError(absl::StrCat("--draft = '", d, "' must be agreed, per_rank or block"));
  }
  if (absl::StatusOr<DsparkTable> t = ParseDsparkTable(absl::GetFlag(FLAGS_dspark_sps)); !t.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--dspark_sps: ", t.status().message()));
  }
  if (const double s = absl::GetFlag(FLAGS_step_acceptance_sigma); !(s >= 0 && s <= 10)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--step_acceptance_sigma = %g must be in 0..10 (a logit std-dev)", s));
  }
  if (const double s = absl::GetFlag(FLAGS_confidence_sigma); !(s >= -1 && s <= 100)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--confidence_sigma = %g must be in -1..100 (< 0: no signal)", s));
  }
  if (absl::StatusOr<uint32_t> p = ParseLagPredict(absl::GetFlag(FLAGS_lag_predict)); !p.ok()) {
    return p.status();
  }
  if (const std::string g = absl::GetFlag(FLAGS_granularity);
      g != "request" && g != "rank" && g != "instance") {
    return absl::InvalidArgumentError(
        absl::StrCat("--granularity = '", g, "' must be request, rank or instance"));
  }
  if (absl::StatusOr<RoutingStrategy> r = ParseRouting(absl::GetFlag(FLAGS_group_choice));
      !r.ok() || (*r != RoutingStrategy::kMinBatch && *r != RoutingStrategy::kMinContext)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--group_choice = '", absl::GetFlag(FLAGS_group_choice), "' must be A or B"));
  }
  if (absl::StatusOr<RoutingStrategy> r = ParseRouting(absl::GetFlag(FLAGS_routing)); !r.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--routing = '", absl::GetFlag(FLAGS_routing),
                                                   "' must be A, B, C, D or E"));
  }
  if (absl::StatusOr<VerifyMode> v = ParseVerifyMode(absl::GetFlag(FLAGS_verify)); !v.ok()) return v.status();
  if (absl::StatusOr<std::vector<int32_t>> t =
          ParseTiers(absl::GetFlag(FLAGS_tiers), absl::GetFlag(FLAGS_max_batch), k_max);
      !t.ok()) {
    return t.status();
  }
  return cli::CheckWritable("--json", absl::GetFlag(FLAGS_json));
}

// --trace, --trace_format, --seed, --max_requests.
absl::StatusOr<std::vector<TraceRequest>> TraceFromFlags() {
  absl::StatusOr<TraceFormat> format = ParseTraceFormat(absl::GetFlag(FLAGS_trace_format));
  if (!format.ok()) return format.status();
  absl::StatusOr<std::vector<TraceRequest>> trace =
      LoadTrace(absl::GetFlag(FLAGS_trace), *format, absl::GetFlag(FLAGS_seed));
  if (!trace.ok()) return trace.status();
  if (const int n = absl::GetFlag(FLAGS_max_requests); n > 0 && n < static_cast<int>(trace->size())) {
    trace->resize(n);
  }
  return trace;
}

// --truth, --truth_layers, --ffn_*, --draft_ms, --noise, --draft.
absl::StatusOr<TruthModel> TruthFromFlags() {
  TruthModel truth;
  absl::StatusOr<CostModel> truth_model = ModelByName(absl::GetFlag(FLAGS_truth), "--truth");
  if (!truth_model.ok()) return truth_model.status();
  if (absl::GetFlag(FLAGS_truth_layers) < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--truth_layers = %d must be >= 1", absl::GetFlag(FLAGS_truth_layers)));
  }
  truth.attention = truth_model->Scaled(absl::GetFlag(FLAGS_truth_layers));
  truth.global.ffn_fixed_us = absl::GetFlag(FLAGS_ffn_fixed_ms) * 1000;
  truth.global.ffn_per_token_us = absl::GetFlag(FLAGS_ffn_per_token_ms) * 1000;
  truth.global.draft_per_step_us = absl::GetFlag(FLAGS_draft_ms) * 1000;
  truth.noise_sigma = absl::GetFlag(FLAGS_noise);
  if (const std::string d = absl::GetFlag(FLAGS_draft); d == "per_rank") {
    truth.per_rank_draft = true;
  } else if (d == "block") {
    truth = BlockDraft(truth);
  } else if (d != "agreed") {
    return absl::InvalidArgumentError(absl::StrCat("--draft = '", d, "' must be agreed, per_rank or block"));
  }
  return truth;
}

// The configuration every row starts from; the rows set routing, Z, groups, verify mode and k.
absl::StatusOr<SimConfig> BaseConfigFromFlags(const TruthModel& truth) {
  SimConfig base;
  if (const std::string g = absl::GetFlag(FLAGS_granularity); g == "rank") {
    base.uniform_per_rank = true;
  } else if (g == "instance") {
    base.uniform_instance = true;
  } else if (g != "request") {
    return absl::InvalidArgumentError(
        absl::StrCat("--granularity = '", g, "' must be request, rank or instance"));
  }
  base.num_ranks = absl::GetFlag(FLAGS_dp);
  base.rank_capacity_tokens = absl::GetFlag(FLAGS_rank_capacity_tokens);
  base.max_batch_per_rank = absl::GetFlag(FLAGS_max_batch);
  base.inflight = absl::GetFlag(FLAGS_inflight);
  base.open_loop = absl::GetFlag(FLAGS_open_loop);
  base.arrival_speedup = absl::GetFlag(FLAGS_arrival_speedup);
  base.drain = absl::GetFlag(FLAGS_drain);
  base.k_max = absl::GetFlag(FLAGS_k_max);
  base.acceptance_sigma = absl::GetFlag(FLAGS_acceptance_sigma);
  base.acceptance_prior_strength = absl::GetFlag(FLAGS_prior_strength);
  if (absl::GetFlag(FLAGS_acceptance) == "truth") {
    base.plan_on_true_acceptance = true;
  } else {
    absl::StatusOr<AcceptanceModel> m = ParseAcceptanceModel(absl::GetFlag(FLAGS_acceptance));
    if (!m.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--acceptance: ", m.status().message(), " (the replay also takes truth)"));
    }
    base.acceptance_model = *m;
  }
  base.max_step_slack = absl::GetFlag(FLAGS_step_slack);
  base.guard_overhead_us = absl::GetFlag(FLAGS_guard_overhead_us);
  base.min_plan_gain = absl::GetFlag(FLAGS_min_plan_gain);
  base.quiet = {.after = absl::GetFlag(FLAGS_quiet_after), .max_steps = absl::GetFlag(FLAGS_quiet_max)};
  base.value_deferral = absl::GetFlag(FLAGS_value_deferral);
  base.floor_at_default = absl::GetFlag(FLAGS_floor_at_default);
  base.seed = absl::GetFlag(FLAGS_seed);
  base.step_acceptance_sigma = absl::GetFlag(FLAGS_step_acceptance_sigma);
  base.confidence_sigma = absl::GetFlag(FLAGS_confidence_sigma);
  base.stale_steps = absl::GetFlag(FLAGS_stale_steps);
  absl::StatusOr<uint32_t> lag_predict = ParseLagPredict(absl::GetFlag(FLAGS_lag_predict));
  if (!lag_predict.ok()) return lag_predict.status();
  base.lag_predict = *lag_predict;
  base.dspark_table = *ParseDsparkTable(absl::GetFlag(FLAGS_dspark_sps));
  base.step_bound = absl::GetFlag(FLAGS_step_bound);
  absl::StatusOr<std::vector<int32_t>> tiers =
      ParseTiers(absl::GetFlag(FLAGS_tiers), base.max_batch_per_rank, base.k_max);
  if (!tiers.ok()) return tiers.status();
  base.token_tiers = *std::move(tiers);
  base.routing.split_percentile = absl::GetFlag(FLAGS_split_percentile);
  base.routing.split_window = absl::GetFlag(FLAGS_split_window);
  if (const std::string sim = absl::GetFlag(FLAGS_planner_grid_sim); sim != "default") {
    absl::StatusOr<GridSimulation> named = GridSimulationNamed(sim);
    if (!named.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--planner_grid_sim: '", sim, "' is not one of reference, fast, sampled, default"));
    }
    base.planner_grid_simulation = *named;
  }
  const PlannerModelStart start = PlannerStart();
  base.planner_online = start.online;
  if (start.spec == "truth") {
    base.planner_model = truth.attention;
  } else {
    absl::StatusOr<CostModel> m = ModelByName(start.spec, "--planner_model");
    if (!m.ok()) return m.status();
    base.planner_model = *m;
  }
  absl::StatusOr<RoutingStrategy> group_choice = ParseRouting(absl::GetFlag(FLAGS_group_choice));
  if (!group_choice.ok()) return group_choice.status();
  base.routing.group_choice = *group_choice;
  return base;
}

// The trace and the models; on an error, `exit_code` says whose: a bad input file (the trace, a
// model JSON) or a bad model name.
absl::StatusOr<Instance> InstanceFromFlags(cli::ExitCode& exit_code) {
  exit_code = cli::kBadData;
  absl::StatusOr<std::vector<TraceRequest>> trace = TraceFromFlags();
  if (!trace.ok()) return trace.status();
  exit_code = ModelSpecExitCode(absl::GetFlag(FLAGS_truth));
  absl::StatusOr<TruthModel> truth = TruthFromFlags();
  if (!truth.ok()) return truth.status();
  exit_code = ModelSpecExitCode(PlannerStart().spec);
  absl::StatusOr<SimConfig> base = BaseConfigFromFlags(*truth);
  if (!base.ok()) return base.status();
  TruthModel dspark_truth = BlockDraft(*truth);
  base->dspark_profile_context = WorkloadProfileContext(*trace);
  return Instance{*std::move(trace), *std::move(truth), std::move(dspark_truth), *std::move(base)};
}

// The default comparison: routings A-E at the static verify length, then verify balancing on D.
// `fixed_k`: --k, or nullopt for each row's best static k.
std::vector<RowSpec> AllComparisonRows(std::optional<int> fixed_k);

// Grouped rows with more groups than --dp ranks are left out (`skipped` names them): a group
// needs at least one rank.
std::vector<RowSpec> ComparisonRows(std::optional<int> fixed_k, int num_ranks, std::vector<std::string>& skipped) {
  std::vector<RowSpec> rows = AllComparisonRows(fixed_k);
  std::vector<RowSpec> kept;
  // One width for the instance (EAGLE/MTP step graphs): per-rank local plans, the fill mode and
  // DSpark's engine do not apply (their lengths differ per rank or per request).
  const bool instance = absl::GetFlag(FLAGS_granularity) == "instance";
  for (RowSpec& r : rows) {
    if (instance && (r.dspark_engine || r.verify == VerifyMode::kLocal || r.verify == VerifyMode::kFill)) {
      skipped.push_back(absl::StrFormat("%s (granularity instance)", r.name));
    } else if (r.groups > num_ranks) {
      skipped.push_back(absl::StrFormat("%s (%d groups > --dp %d)", r.name, r.groups, num_ranks));
    } else {
      kept.push_back(std::move(r));
    }
  }
  return kept;
}

std::vector<RowSpec> AllComparisonRows(std::optional<int> fixed_k) {
  using RS = RoutingStrategy;
  std::vector<RowSpec> rows = {
      {"A", RS::kMinBatch, 1.2, 1, VerifyMode::kStatic, fixed_k},
      {"B", RS::kMinContext, 1.2, 1, VerifyMode::kStatic, fixed_k},
      {"C", RS::kLengthSplit, 1.2, 1, VerifyMode::kStatic, fixed_k},
      {"D z1.05", RS::kDualPath, 1.05, 1, VerifyMode::kStatic, fixed_k},
      {"D z1.2", RS::kDualPath, 1.2, 1, VerifyMode::kStatic, fixed_k},
      {"D z1.3", RS::kDualPath, 1.3, 1, VerifyMode::kStatic, fixed_k},
      {"D z1.2 G2", RS::kDualPath, 1.2, 2, VerifyMode::kStatic, fixed_k},
      {"D z1.2 G4", RS::kDualPath, 1.2, 4, VerifyMode::kStatic, fixed_k},
      {"D z1.2 G10", RS::kDualPath, 1.2, 10, VerifyMode::kStatic, fixed_k},
      {"E (cost-aware)", RS::kCostAware, 1.2, 1, VerifyMode::kStatic, fixed_k},
      {"D z1.2 k=3", RS::kDualPath, 1.2, 1, VerifyMode::kStatic, 3},
      {"D z1.2 + local", RS::kDualPath, 1.2, 1, VerifyMode::kLocal, fixed_k},
      {"D z1.2 + goodput", RS::kDualPath, 1.2, 1, VerifyMode::kGoodput, fixed_k},
      {"D z1.2 goodput no-SLO", RS::kDualPath, 1.2, 1, VerifyMode::kGoodput, fixed_k, false},
      {"D z1.2 + fill", RS::kDualPath, 1.2, 1, VerifyMode::kFill, fixed_k},
      {"D z1.2 + oracle", RS::kDualPath, 1.2, 1, VerifyMode::kOracle, fixed_k},
      // The ceiling: the per-step optimum with true acceptance when TPOT is free.
      {"D z1.2 oracle no-guard", RS::kDualPath, 1.2, 1, VerifyMode::kOracle, fixed_k, false, false},
      {"E + goodput", RS::kCostAware, 1.2, 1, VerifyMode::kGoodput, fixed_k}};
  // SGLang DSpark's engine (token tiers, a block draft): the best fixed verify length there, SGLang
  // DSpark as shipped (tier fill off, its default) and with its tier-fill option on, the same with
  // our context-aware model instead of its SPS table (a sensitivity row), and our planner.
  const std::vector<RowSpec> dspark_section = {
      {"D z1.2 static_best tiers", RS::kDualPath, 1.2, 1, VerifyMode::kStatic, fixed_k, true, true,
       true, true, "static_best"},
      {"D z1.2 dspark", RS::kDualPath, 1.2, 1, VerifyMode::kDspark, fixed_k, false, false, true, true},
      {"D z1.2 dspark_fill", RS::kDualPath, 1.2, 1, VerifyMode::kDsparkFill, fixed_k, false, false,
       true, true},
      // SGLang's other tables, each with and without tier fill: profiled at the trace's contexts
      // (as SGLang advises), the additive table of its --fracs sweep, its online profiler.
      {"D z1.2 dspark workload-SPS", RS::kDualPath, 1.2, 1, VerifyMode::kDspark, fixed_k, false,
       false, true, true, "", DsparkTable::kWorkload},
      {"D z1.2 dspark_fill workload-SPS", RS::kDualPath, 1.2, 1, VerifyMode::kDsparkFill, fixed_k,
       false, false, true, true, "", DsparkTable::kWorkload},
      {"D z1.2 dspark additive", RS::kDualPath, 1.2, 1, VerifyMode::kDspark, fixed_k, false, false,
       true, true, "", DsparkTable::kAdditive},
      {"D z1.2 dspark_fill additive", RS::kDualPath, 1.2, 1, VerifyMode::kDsparkFill, fixed_k, false,
       false, true, true, "", DsparkTable::kAdditive},
      {"D z1.2 dspark online", RS::kDualPath, 1.2, 1, VerifyMode::kDspark, fixed_k, false, false,
       true, true, "", DsparkTable::kOnline},
      {"D z1.2 dspark_fill online", RS::kDualPath, 1.2, 1, VerifyMode::kDsparkFill, fixed_k, false,
       false, true, true, "", DsparkTable::kOnline},
      // Our context-aware model in DSpark's budget rule (a sensitivity row, not SGLang's).
      {"D z1.2 dspark_fill ctx-SPS", RS::kDualPath, 1.2, 1, VerifyMode::kDsparkFill, fixed_k, false,
       false, true, true, "", DsparkTable::kContext},
      // No TPOT SLO here, like DSpark: near this engine's step time the SLO's floors feed on
      // themselves (docs/results.md section 8); the step guard stays.
      {"D z1.2 + goodput (tiers)", RS::kDualPath, 1.2, 1, VerifyMode::kGoodput, fixed_k, false, true,
       true, true},
      // The ceiling of per-step planning on this engine: the same with the truth's model and
      // true acceptance (an oracle: never a headline).
      {"D z1.2 oracle (tiers)", RS::kDualPath, 1.2, 1, VerifyMode::kOracle, fixed_k, false, true,
       true, true}};
  rows.insert(rows.end(), dspark_section.begin(), dspark_section.end());
  return rows;
}

// --compare=false: the one row --routing, --z, --groups, --verify and --k name.
absl::StatusOr<RowSpec> SingleRunRow(std::optional<int> fixed_k) {
  absl::StatusOr<RoutingStrategy> routing = ParseRouting(absl::GetFlag(FLAGS_routing));
  if (!routing.ok()) return routing.status();
  const std::string verify_name = absl::GetFlag(FLAGS_verify);
  absl::StatusOr<VerifyMode> verify = ParseVerifyMode(verify_name);
  if (!verify.ok()) return verify.status();
  const bool dspark = IsDspark(*verify);
  const bool padded = dspark || absl::GetFlag(FLAGS_padded);
  return RowSpec{absl::StrCat(absl::GetFlag(FLAGS_routing), " ", verify_name,
                              padded && !dspark ? " (tiers)" : ""),
                 *routing, absl::GetFlag(FLAGS_z), absl::GetFlag(FLAGS_groups), *verify, fixed_k,
                 !dspark, !dspark, padded};
}

// Runs `jobs` on a few threads; results keep the jobs' order.
template <typename Job>
std::vector<absl::StatusOr<RunResult>> RunAll(const std::vector<Job>& jobs, int threads) {
  std::vector<absl::StatusOr<RunResult>> out(jobs.size(), absl::UnknownError("not run"));
  std::mutex mu;
  size_t next = 0;
  auto worker = [&] {
    while (true) {
      size_t i;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (next >= jobs.size()) return;
        i = next++;
      }
      out[i] = jobs[i]();
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker);
  for (auto& t : pool) t.join();
  return out;
}

// Runs the rows in two phases: the static rows (every k when the best is wanted), then the
// planner rows, whose default k and TPOT SLO come from the static phase.
class ComparisonRunner {
 public:
  ComparisonRunner(const Instance& instance, int threads) : instance_(instance), threads_(threads) {}

  absl::StatusOr<Comparison> Run(const std::vector<RowSpec>& specs, std::optional<int> fixed_k);

 private:
  // The default k and TPOT SLO of the planner rows, in `comparison`; returns the default k.
  absl::StatusOr<int> PlannerDefaults(const std::vector<RowSpec>& specs,
                                      const std::vector<std::optional<Row>>& rows,
                                      std::optional<int> fixed_k, Comparison& comparison) const;
  absl::Status RunStaticRows(const std::vector<RowSpec>& specs, std::vector<std::optional<Row>>& rows) const;
  absl::Status RunPlannerRows(const std::vector<RowSpec>& specs, const Comparison& comparison,
                              int default_k, std::vector<std::optional<Row>>& rows) const;
  SimConfig ConfigFor(const RowSpec& spec, int k) const;
  const TruthModel& TruthFor(const RowSpec& spec) const {
    return spec.dspark_engine ? instance_.dspark_truth : instance_.truth;
  }
  std::function<absl::StatusOr<RunResult>()> Job(const SimConfig& config, const TruthModel& truth) const {
    return [config, &truth, this] { return Simulate(config, truth, instance_.trace); };
  }
  Row MakeRow(const RowSpec& spec, int k, double slo_ms, const RunResult& result) const;

  const Instance& instance_;
  int threads_;
};

SimConfig ComparisonRunner::ConfigFor(const RowSpec& spec, int k) const {
  SimConfig c = instance_.base;
  c.routing.strategy = spec.routing;
  c.routing.z = spec.z;
  c.routing.groups = spec.groups;
  c.verify = spec.verify;
  c.static_k = k;
  c.padded = spec.padded;
  if (spec.dspark_table) c.dspark_table = *spec.dspark_table;
  return c;
}

Row ComparisonRunner::MakeRow(const RowSpec& spec, int k, double slo_ms, const RunResult& result) const {
  const bool planned = spec.verify != VerifyMode::kStatic;
  Row row{spec.name, std::string(RoutingName(spec.routing)), spec.z, spec.groups,
          VerifyModeName(spec.verify), k, planned ? slo_ms : 0, result,
          planned && spec.guard ? instance_.base.max_step_slack : -1,
          spec.padded || IsDspark(spec.verify), instance_.base.stale_steps};
  row.min_plan_gain =
      planned && spec.guard && !IsDspark(spec.verify) ? instance_.base.min_plan_gain : 0;
  row.value_deferral = planned && !IsDspark(spec.verify) && instance_.base.value_deferral;
  row.draft = DraftName(TruthFor(spec));
  row.verify_mode = spec.verify_label.empty() ? row.verify : spec.verify_label;
  const DsparkTable table = spec.dspark_table.value_or(instance_.base.dspark_table);
  if (IsDspark(spec.verify)) row.dspark_table = DsparkTableName(table);
  row.planner_model = PlannerModelOf(spec.verify, table);
  // True acceptance (--acceptance truth) is an oracle's knowledge too.
  row.headline = row.planner_model.rfind("truth", 0) != 0 &&
                 !(planned && instance_.base.plan_on_true_acceptance);
  return row;
}

absl::Status ComparisonRunner::RunStaticRows(const std::vector<RowSpec>& specs,
                                             std::vector<std::optional<Row>>& rows) const {
  std::vector<std::function<absl::StatusOr<RunResult>()>> jobs;
  std::vector<std::pair<size_t, int>> job_row_k;  // (row, k) of each job
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].verify != VerifyMode::kStatic) continue;
    const int lo = specs[i].k ? *specs[i].k : 0, hi = specs[i].k ? *specs[i].k : instance_.base.k_max;
    for (int k = lo; k <= hi; ++k) {
      jobs.push_back(Job(ConfigFor(specs[i], k), TruthFor(specs[i])));
      job_row_k.push_back({i, k});
    }
  }
  std::vector<absl::StatusOr<RunResult>> results = RunAll(jobs, threads_);
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (!results[j].ok()) return results[j].status();
    auto [i, k] = job_row_k[j];
    if (!rows[i] || results[j]->goodput_tok_per_s > rows[i]->result.goodput_tok_per_s) {
      rows[i] = MakeRow(specs[i], k, 0, *results[j]);
    }
  }
  return absl::OkStatus();
}

// The planner rows' default k is D z1.2's best static k (or --k), and their TPOT SLO (auto) the
// TPOT p99 of that static run: verify balancing must keep the tail the static configuration
// delivers. A single planner run takes its own routing, static, at the default k.
absl::StatusOr<int> ComparisonRunner::PlannerDefaults(const std::vector<RowSpec>& specs,
                                                      const std::vector<std::optional<Row>>& rows,
                                                      std::optional<int> fixed_k,
                                                      Comparison& comparison) const {
  int default_k = fixed_k.value_or(3);
  comparison.slo_ms = *ParseSlo(absl::GetFlag(FLAGS_tpot_slo_ms));
  comparison.slo_source = "--tpot_slo_ms";
  for (size_t i = 0; i < specs.size(); ++i) {
    if (rows[i] && specs[i].name == "D z1.2") {
      default_k = rows[i]->k;
      if (!comparison.slo_ms) {
        comparison.slo_ms = rows[i]->result.tpot_p99_ms;
        comparison.slo_source = absl::StrFormat("auto: TPOT p99 of D z1.2 at k=%d", default_k);
      }
    }
  }
  // The DSpark section's static row sets its planner rows' default k.
  for (size_t i = 0; i < specs.size(); ++i) {
    if (rows[i] && specs[i].dspark_engine && specs[i].verify == VerifyMode::kStatic) {
      comparison.dspark_default_k = rows[i]->k;
    }
  }
  if (!comparison.slo_ms && comparison.any_planned) {
    const RowSpec& spec = specs.front();
    SimConfig c = ConfigFor(spec, spec.k.value_or(default_k));
    c.verify = VerifyMode::kStatic;
    c.padded = spec.padded && !IsDspark(spec.verify);  // the same engine's static run: on tiers if it runs on them
    absl::StatusOr<RunResult> r = Simulate(c, instance_.truth, instance_.trace);
    if (!r.ok()) return r.status();
    comparison.slo_ms = r->tpot_p99_ms;
    comparison.slo_source = absl::StrFormat("auto: TPOT p99 of %s off at k=%d%s",
                                            absl::GetFlag(FLAGS_routing), c.static_k,
                                            c.padded ? " on the same tiers" : "");
  }
  return default_k;
}

absl::Status ComparisonRunner::RunPlannerRows(const std::vector<RowSpec>& specs,
                                              const Comparison& comparison, int default_k,
                                              std::vector<std::optional<Row>>& rows) const {
  auto row_slo_ms = [&](const RowSpec& s) { return s.slo ? comparison.slo_ms.value_or(0) : 0.0; };
  std::vector<std::function<absl::StatusOr<RunResult>()>> jobs;
  std::vector<std::pair<size_t, int>> job_row_k;  // (row, k) of each job
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].verify == VerifyMode::kStatic) continue;
    const int section_k = specs[i].dspark_engine && comparison.dspark_default_k > 0
                              ? comparison.dspark_default_k
                              : default_k;
    const int k = specs[i].k.value_or(section_k);
    SimConfig c = ConfigFor(specs[i], k);
    c.tpot_slo_us = row_slo_ms(specs[i]) * 1000;
    if (!specs[i].guard) {  // the oracle rows: no guard of either kind
      c.max_step_slack = -1;
      c.min_plan_gain = 0;
    }
    jobs.push_back(Job(c, TruthFor(specs[i])));
    job_row_k.push_back({i, k});
  }
  std::vector<absl::StatusOr<RunResult>> results = RunAll(jobs, threads_);
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (!results[j].ok()) return results[j].status();
    auto [i, k] = job_row_k[j];
    rows[i] = MakeRow(specs[i], k, row_slo_ms(specs[i]), *results[j]);
  }
  return absl::OkStatus();
}

// The ideal row: `row`'s run with attention perfectly balanced every step.
Row IdealRow(const Row& row) {
  Row ideal = row;
  ideal.name = "ideal";
  ideal.routing = "ideal";
  ideal.result.balance_efficiency = 1;
  ideal.result.cost_ratio_v1 = ideal.result.cost_ratio_v2 = 1;
  ideal.result.goodput_tok_per_s = row.result.ideal_goodput_tok_per_s;
  ideal.result.token_balance = 1;
  ideal.result.tpot_p50_ms = ideal.result.tpot_p99_ms = 0;
  ideal.tpot_slo_ms = 0;
  ideal.result.wall_s = 0;
  return ideal;
}

absl::StatusOr<Comparison> ComparisonRunner::Run(const std::vector<RowSpec>& specs,
                                                 std::optional<int> fixed_k) {
  Comparison comparison;
  comparison.any_planned = std::any_of(specs.begin(), specs.end(),
                                       [](const RowSpec& s) { return s.verify != VerifyMode::kStatic; });
  std::vector<std::optional<Row>> rows(specs.size());
  if (absl::Status s = RunStaticRows(specs, rows); !s.ok()) return s;
  absl::StatusOr<int> default_k = PlannerDefaults(specs, rows, fixed_k, comparison);
  if (!default_k.ok()) return default_k.status();
  if (absl::Status s = RunPlannerRows(specs, comparison, *default_k, rows); !s.ok()) {
    return s;
  }
  for (auto& row : rows) comparison.rows.push_back(*row);
  // The ideal: D z1.2's best static run (or a single run's row), perfectly balanced.
  for (const Row& row : comparison.rows) {
    if (row.name == "D z1.2" || (!absl::GetFlag(FLAGS_compare) && comparison.rows.size() == 1)) {
      comparison.rows.push_back(IdealRow(row));
      break;
    }
  }
  return comparison;
}

nlohmann::json RowJson(const Row& row, const std::string& eval_cost, const SimConfig& base) {
  const RunResult& r = row.result;
  nlohmann::json j;
  j["name"] = row.name;
  j["routing"] = row.routing;
  j["z"] = row.z;
  j["groups"] = row.groups;
  j["verify_mode"] = row.verify_mode.empty() ? row.verify : row.verify_mode;
  j["padded"] = row.padded;
  j["stale_steps"] = row.stale_steps;
  j["seed"] = base.seed;
  j["draft"] = row.draft;
  if (!row.dspark_table.empty()) j["dspark_table"] = row.dspark_table;
  if (row.dspark_table == "online") {
    j["dspark_table_rebuilds"] = r.dspark_table_rebuilds;
    j["dspark_warmup_rebuilds"] = r.dspark_warmup_rebuilds;
  }
  if (!row.planner_model.empty()) j["planner_model"] = row.planner_model;
  j["headline"] = row.headline;
  j["k"] = row.k;
  j["k_max"] = absl::GetFlag(FLAGS_k_max);
  j["step_slack"] = row.step_slack;
  // Written only when set, so every output without the default guard is unchanged.
  if (row.min_plan_gain > 0) j["min_plan_gain"] = row.min_plan_gain;
  if (row.value_deferral) j["value_deferral"] = true;
  if (base.plan_on_true_acceptance) {
    j["acceptance"] = "truth";
  } else if (base.acceptance_model != AcceptanceModel::kBeta) {
    j["acceptance"] = std::string(AcceptanceModelName(base.acceptance_model));
  }
  if (base.step_acceptance_sigma > 0) j["step_acceptance_sigma"] = base.step_acceptance_sigma;
  if (base.confidence_sigma >= 0) {
    j["confidence_sigma"] = base.confidence_sigma;
    j["confidence_auc"] = r.confidence_auc;
  }
  j["tpot_slo_ms"] = row.tpot_slo_ms;
  j["eval_cost"] = eval_cost;
  j["steps"] = r.steps;
  j["balance_efficiency"] = r.balance_efficiency;
  j["bubble_fraction"] = 1 - r.balance_efficiency;
  j["attention_cost_ratio_to_ideal"] = eval_cost == "v1" ? r.cost_ratio_v1 : r.cost_ratio_v2;
  j["attention_cost_ratio_to_ideal_v1"] = r.cost_ratio_v1;
  j["attention_cost_ratio_to_ideal_v2"] = r.cost_ratio_v2;
  j["goodput_tok_per_s"] = r.goodput_tok_per_s;
  j["mean_step_ms"] = r.mean_step_ms;
  j["tpot_p50_ms"] = r.tpot_p50_ms;
  j["tpot_p99_ms"] = r.tpot_p99_ms;
  j["latency_mean_ms"] = r.latency_mean_ms;
  j["latency_p50_ms"] = r.latency_p50_ms;
  j["ctx_imbalance"] = r.ctx_imbalance;
  j["token_balance"] = r.token_balance;
  j["mean_verify_len"] = r.mean_verify_len;
  j["mean_draft_depth"] = r.mean_draft_depth;
  j["requests_finished"] = r.requests_finished;
  j["blocked_step_fraction"] = r.blocked_step_fraction;
  if (base.quiet.after > 0) j["quiet_step_fraction"] = r.quiet_step_fraction;  // only when on
  j["planner_model_error"] = r.planner_model_error;
  j["step_over_plan"] = r.step_over_plan;
  j["tokens_over_plan"] = r.tokens_over_plan;
  j["wasted_token_fraction"] = r.wasted_token_fraction;
  j["wall_s"] = r.wall_s;
  j["sim_steps_per_s"] = r.wall_s > 0 ? r.steps / r.wall_s : 0;
  // Keys only the rows with tiers carry.
  if (row.padded) {
    j["token_tiers"] = base.token_tiers;
    j["padding_fraction"] = r.padding_fraction;
  }
  if (r.step_bound_over_expected > 0) {
    j["expected_tok_per_s"] = r.expected_tok_per_s;
    j["step_bound_over_expected"] = r.step_bound_over_expected;
  }
  return j;
}

// --json: {"trace", "requests", "dp", "truth", "runs": [a row each]}.
absl::Status WriteJson(const std::string& path, const Instance& instance, const std::vector<Row>& rows,
                       const std::string& eval_cost) {
  nlohmann::json out;
  out["trace"] = absl::GetFlag(FLAGS_trace);
  out["requests"] = instance.trace.size();
  out["dp"] = instance.base.num_ranks;
  out["truth"] = instance.truth.attention.name();
  out["runs"] = nlohmann::json::array();
  for (const Row& row : rows) out["runs"].push_back(RowJson(row, eval_cost, instance.base));
  std::ofstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("--json: cannot write '", path, "'"));
  f << out.dump(2) << "\n";
  return absl::OkStatus();
}

void PrintHeader(const Instance& instance, const Comparison& comparison, const std::string& eval_cost) {
  const SimConfig& base = instance.base;
  std::printf("dpbalance-replay: %s, %zu requests, DP%d, %s, capacity %lld tokens/rank, batch cap %d, truth %s, eval %s\n",
              absl::GetFlag(FLAGS_trace).c_str(), instance.trace.size(), base.num_ranks,
              base.open_loop ? "open loop" : absl::StrCat("closed loop at ", base.inflight, " in flight").c_str(),
              static_cast<long long>(base.rank_capacity_tokens), base.max_batch_per_rank,
              instance.truth.attention.name().c_str(), eval_cost.c_str());
  std::printf("lag %d step(s) (every row plans step t while steps t-%d..t-1 run), draft %s, seed %llu\n",
              base.stale_steps, base.stale_steps, DraftName(instance.truth).c_str(),
              static_cast<unsigned long long>(base.seed));
  if (comparison.any_planned) {
    const std::string model = PlannerModelSpec();
    std::printf("planner model: %s%s\n", model.c_str(),
                model == "truth" ? " -- the replay's own truth: ORACLE KNOWLEDGE, no row it plans is a headline"
                : absl::GetFlag(FLAGS_planner_model) == "auto" ? " (auto: what the planner has in production)"
                                                              : "");
    const double slo_ms = *comparison.slo_ms;
    std::printf("TPOT SLO of the planner rows: %s\n",
                slo_ms > 0 ? absl::StrFormat("%.2f ms (%s)", slo_ms, comparison.slo_source).c_str() : "none");
    if (comparison.dspark_default_k > 0) {
      std::printf("DSpark section (token tiers, %s draft): default k %d (its static_best), no TPOT SLO "
                  "(DSpark has none), the step guard on\n",
                  DraftName(instance.dspark_truth).c_str(), comparison.dspark_default_k);
    }
  }
}

void PrintTable(const std::vector<Row>& rows, const std::string& eval_cost) {
  std::printf("%-28s %-5s %-11s %3s %6s %7s %7s %9s %10s %8s %8s %8s %7s %6s\n", "name", "route",
              "verify", "k", "depth", "bubble", "costR", "costR-v1", "goodput", "step_ms",
              "tpot50", "tpot99", "tokbal", "wall_s");
  for (const Row& row : rows) {
    const RunResult& r = row.result;
    std::printf("%-28s %-5s %-11s %3d %6.2f %7.4f %7.4f %9.4f %10.1f %8.2f %8.2f %8.2f %7.4f %6.2f\n",
                row.name.c_str(), row.routing.c_str(), row.verify.c_str(), row.k, r.mean_draft_depth,
                1 - r.balance_efficiency, eval_cost == "v1" ? r.cost_ratio_v1 : r.cost_ratio_v2,
                r.cost_ratio_v1, r.goodput_tok_per_s, r.mean_step_ms, r.tpot_p50_ms, r.tpot_p99_ms,
                r.token_balance, r.wall_s);
  }
}

void PrintStepRate(const std::vector<Row>& rows) {
  double total_wall = 0;
  int64_t total_steps = 0;
  for (const Row& row : rows) {
    total_wall += row.result.wall_s;
    total_steps += row.routing == "ideal" ? 0 : row.result.steps;
  }
  std::printf("simulated %lld steps (reported rows) at %.0f steps/s of replay compute\n",
              static_cast<long long>(total_steps), total_wall > 0 ? total_steps / total_wall : 0.0);
}

const Row* FindRow(const std::vector<Row>& rows, const std::string& name) {
  for (const Row& row : rows)
    if (row.name == name) return &row;
  return nullptr;
}

// What a row planned with, for a summary line: its model, and for a row that is not a headline,
// a warning saying so.
std::string Knowledge(const Row& row) {
  if (row.headline) return absl::StrCat("planned with ", row.planner_model.empty() ? "no model" : row.planner_model);
  return absl::StrCat("planned with ", row.planner_model,
                      row.planner_model.rfind("truth", 0) == 0 ? "" : " and true acceptance",
                      ": ORACLE KNOWLEDGE, NOT A HEADLINE");
}

// Verify balancing on this instance's own draft, against the best a user gets without it: D z1.2
// at the best static verify length of the sweep.
void PrintVerifyBalancingSummary(const std::vector<Row>& rows) {
  const Row* d_static = FindRow(rows, "D z1.2");
  const Row* d_goodput = FindRow(rows, "D z1.2 + goodput");
  if (!d_static || !d_goodput) return;
  const RunResult& base = d_static->result;
  const RunResult& g = d_goodput->result;
  std::printf("\nVerify balancing, %s draft, lag %d. Baseline: D z1.2 at k=%d, the best fixed verify "
              "length of the sweep 0..k_max\n(what any user can set without dpbalance).\n",
              d_static->draft.c_str(), d_static->stale_steps, d_static->k);
  std::printf("  D z1.2 + goodput: goodput x%.4f (%.1f vs %.1f tok/s), bubble %.4f -> %.4f, TPOT p99 x%.4f;\n    %s\n",
              g.goodput_tok_per_s / base.goodput_tok_per_s, g.goodput_tok_per_s, base.goodput_tok_per_s,
              1 - base.balance_efficiency, 1 - g.balance_efficiency, g.tpot_p99_ms / base.tpot_p99_ms,
              Knowledge(*d_goodput).c_str());
  if (const Row* oracle = FindRow(rows, "D z1.2 oracle no-guard")) {
    std::printf("  ceiling (true acceptance, no TPOT guard or SLO): goodput x%.4f at TPOT p99 x%.4f\n",
                oracle->result.goodput_tok_per_s / base.goodput_tok_per_s,
                oracle->result.tpot_p99_ms / base.tpot_p99_ms);
  }
  if (const Row* k3 = FindRow(rows, "D z1.2 k=3")) {
    std::printf("  against the engines' common static k=3 instead: goodput x%.4f\n",
                g.goodput_tok_per_s / k3->result.goodput_tok_per_s);
  }
  if (const Row* local = FindRow(rows, "D z1.2 + local")) {
    std::printf("  each rank planning alone (no exchange): goodput x%.4f, bubble %.4f\n",
                local->result.goodput_tok_per_s / base.goodput_tok_per_s, 1 - local->result.balance_efficiency);
  }
}

// The DSpark section: our planner on SGLang DSpark's engine (token tiers, a block draft) against
// the engines' best: the best of every DSpark row (each of SGLang's tables, with and without its
// tier-fill option) and its static mode at the best fixed verify length on the same tiers.
void PrintDsparkSummary(const std::vector<Row>& rows) {
  const Row* ours = FindRow(rows, "D z1.2 + goodput (tiers)");
  std::vector<const Row*> engine_rows;
  for (const Row& row : rows) {
    if (row.verify == "dspark" || row.verify == "dspark_fill" || row.verify_mode == "static_best") {
      engine_rows.push_back(&row);
    }
  }
  if (!ours || engine_rows.empty()) return;
  const Row* best = *std::max_element(engine_rows.begin(), engine_rows.end(), [](const Row* a, const Row* b) {
    return a->result.goodput_tok_per_s < b->result.goodput_tok_per_s;
  });
  const RunResult& g = ours->result;
  const RunResult& e = best->result;
  std::printf("\nOn SGLang DSpark's engine (token tiers, %s draft, lag %d). Baseline: the engines' best, the "
              "best of\nevery DSpark row (SGLang's tables, tier fill off and on) and its static mode at the "
              "best fixed length:\n",
              ours->draft.c_str(), ours->stale_steps);
  for (const Row* row : engine_rows) {
    std::printf("  %-32s %9.1f tok/s  (ours x%.4f)%s\n", row->name.c_str(), row->result.goodput_tok_per_s,
                g.goodput_tok_per_s / row->result.goodput_tok_per_s, row == best ? "  <- the engines' best" : "");
  }
  std::printf("  D z1.2 + goodput (tiers): goodput x%.4f the engines' best (%.1f vs %.1f tok/s), TPOT p99 "
              "x%.4f, bubble %.4f vs %.4f;\n    %s\n",
              g.goodput_tok_per_s / e.goodput_tok_per_s, g.goodput_tok_per_s, e.goodput_tok_per_s,
              g.tpot_p99_ms / e.tpot_p99_ms, 1 - g.balance_efficiency, 1 - e.balance_efficiency,
              Knowledge(*ours).c_str());
  if (const Row* oracle = FindRow(rows, "D z1.2 oracle (tiers)")) {
    std::printf("  ceiling (the same planner with the truth's model and true acceptance): x%.4f the "
                "engines' best;\n    ours reaches %.4f of it\n",
                oracle->result.goodput_tok_per_s / e.goodput_tok_per_s,
                g.goodput_tok_per_s / oracle->result.goodput_tok_per_s);
  }
  std::printf("  padding: %.4f of the tokens run (ours) vs %.4f (%s)\n", g.padding_fraction,
              e.padding_fraction, best->name.c_str());
}

// Our cost-aware routing E against the best D over Z, on both published cost ratios (E should
// be at least as good); one seed here, scripts/studies/routing_seeds.py for the spread over seeds.
void PrintRoutingSummary(const std::vector<Row>& rows, const CostModel& planner_model) {
  const Row* cost_aware = FindRow(rows, "E (cost-aware)");
  if (!cost_aware) return;
  const Row* best_d = nullptr;
  for (const char* name : {"D z1.05", "D z1.2", "D z1.3"}) {
    const Row* d = FindRow(rows, name);
    if (d && (!best_d || d->result.cost_ratio_v2 < best_d->result.cost_ratio_v2)) best_d = d;
  }
  if (!best_d) return;
  const RunResult& e = cost_aware->result;
  const RunResult& d = best_d->result;
  std::printf("\nrouting E vs the best D (%s) on attention cost ratio (lower is better):\n"
              "  v2 %.4f vs %.4f, v1 %.4f vs %.4f; bubble %.4f vs %.4f\n",
              best_d->name.c_str(), e.cost_ratio_v2, d.cost_ratio_v2, e.cost_ratio_v1, d.cost_ratio_v1,
              1 - e.balance_efficiency, 1 - d.balance_efficiency);
  if (!planner_model.published_form()) {
    std::printf("  E minimises the planner model's cost (%s), not V1's or V2's;\n"
                "  goodput %.1f vs %.1f tok/s\n",
                planner_model.name().c_str(), e.goodput_tok_per_s, d.goodput_tok_per_s);
  }
}

int Main() {
  if (absl::Status s = CheckFlags(); !s.ok()) return Fail(s, cli::kUsageError);
  cli::ExitCode load_exit_code;
  absl::StatusOr<Instance> instance = InstanceFromFlags(load_exit_code);
  if (!instance.ok()) return Fail(instance.status(), load_exit_code);
  const std::string eval_cost = absl::GetFlag(FLAGS_eval_cost);
  const int threads = absl::GetFlag(FLAGS_threads) > 0
                          ? absl::GetFlag(FLAGS_threads)
                          : std::max(1u, std::thread::hardware_concurrency());
  const std::string k_flag = absl::GetFlag(FLAGS_k);
  const std::optional<int> fixed_k = k_flag == "best" ? std::nullopt : std::optional<int>(std::stoi(k_flag));

  std::vector<RowSpec> specs;
  std::vector<std::string> skipped;
  if (absl::GetFlag(FLAGS_compare)) {
    specs = ComparisonRows(fixed_k, instance->base.num_ranks, skipped);
  } else {
    absl::StatusOr<RowSpec> single = SingleRunRow(fixed_k);
    if (!single.ok()) return Fail(single.status(), cli::kUsageError);
    specs = {*single};
  }
  absl::StatusOr<Comparison> comparison = ComparisonRunner(*instance, threads).Run(specs, fixed_k);
  if (!comparison.ok()) return Fail(comparison.status(), cli::kInternalError);

  PrintHeader(*instance, *comparison, eval_cost);
  for (const std::string& row : skipped) std::printf("note: row %s left out of the comparison\n", row.c_str());
  PrintTable(comparison->rows, eval_cost);
  PrintStepRate(comparison->rows);
  PrintVerifyBalancingSummary(comparison->rows);
  PrintDsparkSummary(comparison->rows);
  PrintRoutingSummary(comparison->rows, instance->base.planner_model);
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    if (absl::Status s = WriteJson(path, *instance, comparison->rows, eval_cost); !s.ok()) {
      return Fail(s, cli::kUsageError);
    }
  }
  return 0;
}

}  // namespace
}  // namespace dpbalance::replay

int main(int argc, char** argv) {
  // --help lists the flags defined in this file; Abseil's default lists only flags whose file is
  // named after the program (dpbalance-replay), which matches none.
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "replay_main.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  usage_config.normalize_filename = [](absl::string_view file) {  // the path in the repository
    const size_t pos = file.rfind("integration/replay/");
    return std::string(pos == absl::string_view::npos ? file : file.substr(pos));
  };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "Replays a serving trace through a simulated DP decode instance; compares routing "
      "strategies A-E and verify balancing.\nUsage: dpbalance-replay [--trace FILE] [flags]");
  dpbalance::cli::ParseFlags("dpbalance-replay", argc, argv);
  return dpbalance::replay::Main();
}
