// integration/replay/simulator.h — trace-replay simulator of one DP decode instance.
//
// Contract
// - `Simulate` replays `trace` through routing, verify-length planning (the runtime's Router and
//   Planner, the same code an engine links) and a *truth* timing model, and returns the metrics
//   of one run. Deterministic for a given config and seed.
// - Closed loop (default): the next trace request is admitted whenever the instance has fewer
//   than `inflight` requests and some rank has capacity; open loop: at its (scaled) arrival time.
//   Requests that fit nowhere wait, in order. Measurement stops when the trace is exhausted
//   (the drain at the end is not measured).
// - The planner never sees the truth: it plans with `planner_model` and acceptance estimated
//   from observed accept counts; `kOracle` plans with the truth model and true acceptance.
// - Token tiers (`padded`): every rank runs the instance's agreed token count, the smallest tier
//   >= the largest rank's query tokens (the largest rank's count past the last tier). The truth
//   charges a rank's spare tokens (padding) attention like real verify tokens, spread round-robin
//   over its requests (a rank with none: one request with no context), and the FFN every rank's
//   padded tokens. The planner rows plan in the planner's padded mode (PlannerConfig::token_tiers,
//   GlobalCost::padded_tokens) and fill the tier's spare tokens with verify work where it pays.
// - `kDspark`: SGLang's DSpark verify planner under DP attention (simulator.cc, DsparkPlan): each
//   rank alone picks its verify-token budget by expected tokens per second, and the ranks agree
//   only on the padded tier.
// - Staleness (`stale_steps` N > 0), an engine that plans (and drafts) a step ahead of what it
//   has seen: the planner (and kDspark) plans the batch the engine scheduled, with each
//   request's context and remaining tokens as of N steps ago (as admitted, if admitted since),
//   the acceptance statistics (and TPOT SLO pace) of then, and the requests that finished in
//   those N steps still in it. The truth charges the real batch.
// - Thread-compatible: independent calls may run concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dpbalance/cost_model.h"
#include "dpbalance/planner.h"
#include "dpbalance/routing.h"
#include "trace.h"

namespace dpbalance::replay {

enum class VerifyMode { kStatic, kLocal, kGoodput, kFill, kOracle, kDspark };
std::string VerifyModeName(VerifyMode m);  // "off" for static

struct TruthModel {
  CostModel attention = CostModel::PublishedV2();  // per-rank attention time
  GlobalCost global;                                // FFN + EP comm, overhead, draft
  double noise_sigma = 0;                           // multiplicative log-normal noise per rank/step
  bool per_rank_draft = false;  // dense draft: each rank drafts to its own deepest verify length,
                                // before the barrier (default: one depth, MTP with MoE layers)
};

struct SimConfig {
  int num_ranks = 64;
  int64_t rank_capacity_tokens = 512000;  // KV tokens per rank
  int max_batch_per_rank = 64;
  int inflight = 2048;                    // closed loop: requests in flight, whole instance
  bool open_loop = false;
  double arrival_speedup = 1.0;           // open loop: arrival times divided by this
  RoutingConfig routing;
  VerifyMode verify = VerifyMode::kStatic;
  int static_k = 3;                       // kStatic: verify length; planner modes: default_k
  int k_max = 7;                          // planner modes: draft depth limit
  double max_step_slack = 0.05;           // planner modes: TPOT guard (PlannerConfig), < 0 off
  bool floor_at_default = false;          // planner modes: k_min = min(static_k, cap) (TPOT floor)
  bool uniform_per_rank = false;          // planner modes: one verify length per rank (granularity)
  double tpot_slo_us = 0;                 // planner modes: per-request TPOT SLO floors (TpotSlo),
                                          // <= 0: none
  // Token tiers: every rank padded to the agreed tier (see the contract); kDspark always is.
  bool padded = false;
  std::vector<int32_t> token_tiers;       // ascending, > 0; empty: the largest rank's tokens
  int stale_steps = 0;                    // planner modes: plan with the state N steps old
  CostModel planner_model = CostModel::PublishedV2();
  bool planner_online = false;            // refit planner_model online from measured attention
  // How the planner simulates a grid model (PlannerConfig::grid_simulation; unset: the planner's
  // default, head-major verify launches from sampled heads); the oracle prices with the truth as
  // it is, every head simulated.
  std::optional<GridSimulation> planner_grid_simulation;
  double acceptance_sigma = 1.0;          // per-request logit shift, standard deviation
  double acceptance_prior_strength = 4.0;
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
  double token_balance = 0;            // mean over steps of avg/max rank query tokens
  double mean_verify_len = 0;          // mean k over request-steps
  double mean_draft_depth = 0;
  double blocked_step_fraction = 0;    // steps where the next request waited for KV capacity
  double step_over_plan = 0;           // sum of true step times / sum of planned - 1 (0: no
                                       // instance plan, as in static and local runs)
  double planner_model_error = 0;      // online model: mean |predicted - truth| / truth per rank-step
  double padding_fraction = 0;         // padded runs: spare tier tokens / all tokens run
  double wall_s = 0;
};

// The agreed per-rank token count for ranks whose largest runs `max_tokens` query tokens: the
// smallest tier >= it, or `max_tokens` past the last tier (or with no tiers).
int64_t AgreedTier(absl::Span<const int32_t> tiers, int64_t max_tokens);
// Spreads `pad` spare tier tokens over a rank's batch round-robin, as verify tokens of its
// requests (padding costs attention like real tokens); a rank with no request runs one request
// with no context and `pad` query tokens. No-op for pad <= 0.
void AddPadding(std::vector<RequestLoad>& batch, int64_t pad);

// SGLang DSpark's choice for one rank (simulator.cc has the source read and the
// simplifications): the verify lengths (into `verify`, one per request) that maximise expected
// tokens per second of this rank's step as `model` and `global` price it, with the FFN charged
// as if all `num_ranks` ranks ran this rank's tokens. Returns the deepest length.
struct DsparkScratch {
  struct Candidate {
    double survival;
    int32_t req, pos;
  };
  std::vector<Candidate> candidates;
  std::vector<RequestLoad> loads;
};
int DsparkRankPlan(absl::Span<const PlanRequest> batch, const CostModel& model,
                   const GlobalCost& global, int num_ranks, bool agreed_depth,
                   absl::Span<int32_t> verify, DsparkScratch& scratch);

// SGLang's default token tiers for a speculative decode: the CUDA-graph batch sizes it captures
// with speculative decoding, up to `max_batch`, times the verify window k_max + 1 (simulator.cc).
std::vector<int32_t> SglangDefaultTiers(int max_batch, int k_max);

absl::StatusOr<RunResult> Simulate(const SimConfig& config, const TruthModel& truth,
                                   absl::Span<const TraceRequest> trace);

}  // namespace dpbalance::replay
