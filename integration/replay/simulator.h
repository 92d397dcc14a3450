// integration/replay/simulator.h — trace-replay simulator of one DP decode instance.
//
// Contract
// - `Simulate` replays `trace` through routing, verify-length planning (the runtime's Router and
//   Planner, the same code an engine links) and a *truth* timing model, and returns the metrics
//   of one run. Deterministic for a given config and seed.
// - Closed loop (default): the next trace request is admitted whenever the instance has fewer
//   than `inflight` requests and some rank has capacity; open loop: at its (scaled) arrival time.
//   Requests that fit nowhere wait, in order. Measurement stops when the trace is exhausted
//   (the drain at the end is not measured), or with `drain` when every request has finished.
// - The planner never sees the truth: it plans with `planner_model` and acceptance estimated
//   from observed accept counts; `kOracle` plans with the truth model and true acceptance.
// - Token tiers (`padded`): every rank runs the instance's agreed token count: the tier its
//   planner agreed (the planner rows' padded mode, DSpark's gathered tier), else the smallest tier
//   >= the largest rank's query tokens (the largest rank's count past the last tier). The spare
//   tokens run as SGLang's compact verify pads them (dspark::PadToTier): dummy requests of
//   sequence length 1 in the tier's free request slots (at most --max_batch), or on the last real
//   request when no slot is free. The FFN sees every rank's tier. The planner rows plan in the
//   planner's padded mode (PlannerConfig::token_tiers, GlobalCost::padded_tokens) and fill the
//   tier's spare tokens with verify work where it pays.
// - `kDspark` / `kDsparkFill`: SGLang's DSpark verify planner under DP attention (dpbalance/dspark.h,
//   the code the plugin's DSpark mode runs): each rank alone picks its verify-token budget by
//   expected tokens per second from a steps-per-second table profiled on the truth as SGLang's
//   profiler does (uniform DP load, short contexts, a floor step function), the ranks agree on the
//   largest rank's tier, and with tier fill (kDsparkFill) every rank fills the tier with its best
//   drafts. `dspark_table` says which of SGLang's tables prices the budget (or the planner's own
//   context-aware model, a sensitivity row). A dense draft (TruthModel::per_rank_draft) runs unpadded.
// - Lag (`stale_steps` N): the engine plans step t while steps t-N..t-1 still run (overlap or
//   async scheduling), one model for every row. It knows the batch it scheduled and the verify
//   lengths it gave each request in the pending steps; each request's context and remaining
//   tokens only as of N steps ago (as admitted, if admitted since); acceptance statistics and
//   TPOT pace N steps late; and a request that finished only N steps later, so a finished request
//   stays in the batches it scheduled meanwhile, charged, emitting nothing. A verify length is
//   never cut by what the engine does not know: a draft past what a request can still emit runs
//   and is wasted. The static and DSpark rows cap a request at what the engine can be sure of
//   (the tokens it may emit as seen, less one per pending step). The planner rows plan on the
//   predicted state (lag.h, `lag_predict`: contexts, caps, gains, TPOT floors). DSpark's budget
//   reads survivals two decode steps old whatever the lag (SGLang's confidence relay), a request
//   without one counting survival 1 at every position (its freshness rule).
// - Thread-compatible: independent calls may run concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dpbalance/cost_model.h"
#include "dpbalance/dspark.h"
#include "dpbalance/lag.h"
#include "dpbalance/planner.h"
#include "dpbalance/quiet.h"
#include "dpbalance/routing.h"
#include "trace.h"

namespace dpbalance::replay {

enum class VerifyMode { kStatic, kLocal, kGoodput, kFill, kOracle, kDspark, kDsparkFill };
std::string VerifyModeName(VerifyMode m);  // "off" for static
bool IsDspark(VerifyMode m);               // kDspark or kDsparkFill: SGLang DSpark's planner

// How a DSpark row prices its verify budget, each a way SGLang ships (sgl-project/sglang;
// dpbalance/dspark.h) but kContext:
//   kProfiled  the SPS table dspark_sps_profiler measures at its defaults (16-token prompts)
//   kWorkload  the same profiled at the trace's decode contexts (--input-len near the workload)
//   kAdditive  SpsAdditiveCostTable fitted by the profiler's --fracs sweep, at the workload
//   kOnline    OnlineSpsProfiler: each rank refits its table from its measured steps, starting
//              from kWorkload's
//   kContext   the planner's own context-aware model (a sensitivity row, not SGLang's)
enum class DsparkTable { kProfiled, kWorkload, kAdditive, kOnline, kContext };
std::string DsparkTableName(DsparkTable t);
absl::StatusOr<DsparkTable> ParseDsparkTable(const std::string& name);

struct TruthModel {
  CostModel attention = CostModel::PublishedV2();  // per-rank attention time
  GlobalCost global;                                // FFN + EP comm, overhead, draft
  double noise_sigma = 0;                           // multiplicative log-normal noise per rank/step
  bool per_rank_draft = false;  // dense draft: each rank drafts to its own deepest verify length,
                                // before the barrier (default: one depth, MTP with MoE layers)
  // A draft that proposes its whole block in one forward each step (SGLang DSpark's): its cost
  // is in global.step_overhead_us and does not grow with the depth (global.draft_per_step_us 0).
  bool block_draft = false;
};


struct SimConfig {
  int num_ranks = 64;
  int64_t rank_capacity_tokens = 512000;  // KV tokens per rank
  int max_batch_per_rank = 64;
  int inflight = 2048;                    // closed loop: requests in flight, whole instance
  bool open_loop = false;
  double arrival_speedup = 1.0;           // open loop: arrival times divided by this
  // Run on after the trace is exhausted until every request has finished, the drain measured
  // (a live stream's figures cover every request; scripts/live_vllm.sh --routing's prediction).
  bool drain = false;
  RoutingConfig routing;
  VerifyMode verify = VerifyMode::kStatic;
  int static_k = 3;                       // kStatic: verify length; planner modes: default_k
  int k_max = 7;                          // planner modes: draft depth limit
  double max_step_slack = 0.05;           // planner modes: TPOT guard (PlannerConfig), < 0 off
  double guard_overhead_us = 0;           // planner modes: PlannerConfig::guard_overhead_us
  double min_plan_gain = 0;               // planner modes: default guard (PlannerConfig), 0 off
  // Planner modes: the balancer's quiet mode (quiet.h; after = 0 off): steps of an agreed span
  // run the default lengths without a plan, as every rank's Balancer skips them.
  QuietConfig quiet;
  bool value_deferral = false;            // planner modes: PlannerConfig::value_deferral
  bool floor_at_default = false;          // planner modes: k_min = min(static_k, cap) (TPOT floor)
  bool uniform_per_rank = false;          // planner modes: one verify length per rank (granularity)
  bool uniform_instance = false;          // planner modes: one width for the instance (granularity
                                          // instance: EAGLE/MTP step graphs, the agreed depth)
  double tpot_slo_us = 0;                 // planner modes: per-request TPOT SLO floors (TpotSlo),
                                          // <= 0: none
  // Token tiers: every rank padded to the agreed tier (see the contract); kDspark always is.
  bool padded = false;
  std::vector<int32_t> token_tiers;       // ascending, > 0; empty: the largest rank's tokens
  int stale_steps = 0;                    // lag: plan step t while steps t-N..t-1 run
  uint32_t lag_predict = kPredictAll;     // planner rows under lag: LagPredict bits
  // DSpark rows: how DSpark's budget is priced (DsparkTable) and the context the profiled
  // tables are measured at (the profiler's --input-len plus half its output; kWorkload, kAdditive
  // and kOnline's starting table).
  DsparkTable dspark_table = DsparkTable::kProfiled;
  int64_t dspark_profile_context = dspark::kProfileContextTokens;
  // kOnline: passes over the trace before the measured run, each rank's profiler carried into it
  // (a server has run long before it is measured; one pass is under the profiler's 1000 steps).
  int dspark_online_warmup = 2;
  // Padded runs with one draft depth: each step's bound on expected tokens per second (StepBound
  // in simulator.cc), reported as step_bound_over_expected. Costs a truth evaluation per rank, tier
  // and depth each step.
  bool step_bound = false;
  CostModel planner_model = CostModel::PublishedV2();
  bool planner_online = false;            // refit planner_model online from measured attention
  // How the planner simulates a grid model (PlannerConfig::grid_simulation; unset: the planner's
  // default, head-major verify launches from sampled heads); the oracle prices with the truth as
  // it is, every head simulated.
  std::optional<GridSimulation> planner_grid_simulation;
  double acceptance_sigma = 1.0;          // per-request logit shift, standard deviation
  double acceptance_prior_strength = 4.0;
  AcceptanceModel acceptance_model = AcceptanceModel::kBeta;  // the estimators' (acceptance.h)
  // Every row that plans (ours and DSpark's alike) reads each request's true acceptance curve
  // instead of the estimators': the oracle's knowledge of acceptance given to every row, so a
  // comparison between rows measures the planners alone (`--acceptance truth`). With it a goodput
  // row is the oracle row where the planner's model is the truth's and not refitted online
  // (`--planner_model truth`, the default) and the truth has no kernel grid (the oracle also
  // prices a grid's every head).
  bool plan_on_true_acceptance = false;
  // Acceptance that varies step to step: each request-step's conditional rates are its own
  // shifted by one logit offset drawn N(0, step_acceptance_sigma) (0: i.i.d. per request, as
  // before). And the draft's confidence signal DSpark reads (confidence_sigma >= 0): the step's
  // true rates, logit-offset by N(0, confidence_sigma) noise per request-step (0: perfect; large:
  // useless; < 0: no signal, DSpark reads the estimators' acceptance as every row does). DSpark's
  // top-k reads this step's, its budget the one two decode steps back. Our planner rows plan
  // without it (the plan is made before the step's draft runs) and then spend each rank's
  // planned tokens by it, floors first, as DSpark's top-k would with the plan's budget.
  // RunResult::confidence_auc says how good it was.
  double step_acceptance_sigma = 0;
  double confidence_sigma = -1;
  uint64_t seed = 1;
};

struct RunResult {
  int64_t steps = 0;
  int64_t requests_finished = 0;
  double sim_time_s = 0;
  double tokens = 0;
  double balance_efficiency = 0;       // sum mean-rank attention / sum max-rank attention
  double cost_ratio_v1 = 0;            // published V1 actual / perfectly balanced, summed
  double cost_ratio_v2 = 0;
  double goodput_tok_per_s = 0;
  double ideal_goodput_tok_per_s = 0;  // same steps with attention perfectly balanced
  double mean_step_ms = 0;
  double tpot_p50_ms = 0;
  double tpot_p99_ms = 0;
  // Per finished request, from its admission (the step boundary at which a rank took it) to
  // its last token, ms: mean and median.
  double latency_mean_ms = 0;
  double latency_p50_ms = 0;
  // Mean over steps of the largest rank's summed context tokens over the ranks' mean (1: every
  // rank holds as much context; steps with no context anywhere are left out).
  double ctx_imbalance = 0;
  double token_balance = 0;            // mean over steps of avg/max rank query tokens
  double mean_verify_len = 0;          // mean k over request-steps
  double mean_draft_depth = 0;
  double blocked_step_fraction = 0;    // steps where the next request waited for KV capacity
  double quiet_step_fraction = 0;      // planner rows in quiet mode: steps run without a plan
  double step_over_plan = 0;           // sum of true step times / sum of planned - 1 (0: no
                                       // instance plan, as in static and local runs)
  double planner_model_error = 0;      // online model: mean |predicted - truth| / truth per rank-step
  double padding_fraction = 0;         // padded runs: spare tier tokens / all tokens run
  int64_t dspark_table_rebuilds = 0;   // DsparkTable::kOnline: tables rebuilt, all ranks, in
                                       // the measured run (its warm-up not counted)
  int64_t dspark_warmup_rebuilds = 0;  // the same in its warm-up passes
  // confidence_sigma >= 0: the AUC of the first draft's confidence against whether it was
  // accepted, over every request-step that verified one (0.5: useless, 1: perfect).
  double confidence_auc = 0;
  // Lag diagnostics (0 without lag, except tokens_over_plan):
  double tokens_over_plan = 0;         // planner rows: emitted tokens / planned expected - 1
  double wasted_token_fraction = 0;    // query tokens run for finished requests or past what a
                                       // request could still emit / all real query tokens
  // step_bound: the steps' expected tokens (true acceptance) per second of their true time, and
  // the bound's: what the best plan of each step, as bounded, would emit in the same time over
  // what the row's plans were expected to emit (>= 1).
  double expected_tok_per_s = 0;
  double step_bound_over_expected = 0;
  double wall_s = 0;
};

// The agreed per-rank token count for ranks whose largest runs `max_tokens` query tokens: the
// smallest tier >= it, or `max_tokens` past the last tier (or with no tiers).
int64_t AgreedTier(absl::Span<const int32_t> tiers, int64_t max_tokens);
// SGLang's default token tiers for a speculative decode: the CUDA-graph batch sizes it captures
// with speculative decoding, up to `max_batch`, times the verify window k_max + 1 (simulator.cc).
std::vector<int32_t> SglangDefaultTiers(int max_batch, int k_max);

absl::StatusOr<RunResult> Simulate(const SimConfig& config, const TruthModel& truth,
                                   absl::Span<const TraceRequest> trace);

}  // namespace dpbalance::replay
