#include "simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/str_format.h"
#include "dpbalance/acceptance.h"
#include "dpbalance/calibration.h"
#include "dpbalance/metrics.h"
#include "dpbalance/tpot_slo.h"

namespace dpbalance::replay {
namespace {

// A request in flight on a rank: its KV context, what it still has to emit, and its true
// acceptance (which the planner never sees, except in kOracle).
struct InflightRequest {
  int64_t id;
  int64_t ctx;        // tokens in KV (input + emitted)
  int64_t remaining;  // tokens still to emit
  int64_t output;     // total output length
  double start_us;
  std::array<double, kMaxDraftLen> rates;  // true conditional acceptance
  AcceptanceCurve truth_curve;
};

// Limit on --stale_steps: the engine keeps N old batches (a planner that far behind plans
// requests that have long left).
constexpr int kMaxStaleSteps = 64;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

// What a run sums over its measured steps; `Finish` turns the sums into RunResult's metrics.
struct RunTotals {
  double planned_step_sum = 0, actual_step_sum = 0;  // planner rows: the plan's step vs truth
  BubbleMeter bubble;  // the steps' rank attention times (balance efficiency = 1 - bubble)
  double v1_act = 0, v1_ideal = 0, v2_act = 0, v2_ideal = 0;
  double ideal_time_us = 0, token_balance_sum = 0, k_sum = 0, k_count = 0, depth_sum = 0;
  int64_t blocked_steps = 0;
  double model_error_sum = 0, model_error_n = 0;
  double pad_tokens = 0, run_tokens = 0;  // padded runs: spare tier tokens, all tokens run


  void Finish(RunResult& res, double now_us, const std::vector<double>& tpots) const {
    res.sim_time_s = now_us / 1e6;
    res.balance_efficiency = bubble.balance_efficiency();
    res.cost_ratio_v1 = v1_act / v1_ideal;
    res.cost_ratio_v2 = v2_act / v2_ideal;
    res.goodput_tok_per_s = res.tokens / res.sim_time_s;
    res.ideal_goodput_tok_per_s = res.tokens / (ideal_time_us / 1e6);
    res.mean_step_ms = now_us / 1000.0 / res.steps;
    res.tpot_p50_ms = Percentile(tpots, 0.5);
    res.tpot_p99_ms = Percentile(tpots, 0.99);
    res.token_balance = token_balance_sum / res.steps;
    res.mean_verify_len = k_count > 0 ? k_sum / k_count : 0;
    res.mean_draft_depth = depth_sum / res.steps;
    res.blocked_step_fraction = static_cast<double>(blocked_steps) / res.steps;
    res.step_over_plan = planned_step_sum > 0 ? actual_step_sum / planned_step_sum - 1 : 0;
    res.planner_model_error = model_error_n > 0 ? model_error_sum / model_error_n : 0;
    res.padding_fraction = run_tokens > 0 ? pad_tokens / run_tokens : 0;
  }
};

// One run's state. Each step: Admit (route new requests) -> Plan (verify lengths) -> Time (the
// truth's step time) -> Progress (acceptance, emitted tokens, completion).
class Simulation {
 public:
  static absl::StatusOr<Simulation> Create(const SimConfig& cfg, const TruthModel& truth,
                                           absl::Span<const TraceRequest> trace);
  absl::StatusOr<RunResult> Run();

 private:
  enum class Admission {
    kStep,       // requests in flight: run a step
    kIdle,       // open loop, nothing in flight: the clock moved to the next arrival
    kTraceDone,  // the trace no longer feeds the instance: stop measuring
  };

  Simulation(const SimConfig& cfg, const TruthModel& truth, absl::Span<const TraceRequest> trace,
             Router router, Planner planner);

  absl::StatusOr<Admission> Admit();
  absl::StatusOr<int> Plan();  // the step's draft depth
  // Plan with --stale_steps > 0: plans the batch seen N steps ago, then maps it onto today's.
  absl::StatusOr<int> PlanStale();
  // The planner's PlanRequest for a request with context `ctx`, `remaining` tokens to emit.
  PlanRequest PlanRequestFor(int rank, int64_t id, int64_t ctx, int64_t remaining,
                             const AcceptanceCurve& truth_curve) const;
  // The planner (or DsparkPlan) on batches_, lengths into `verify`; returns the draft depth.
  absl::StatusOr<int> Decide(std::vector<std::vector<int32_t>>& verify);
  // SGLang DSpark's per-rank verify budgets on batches_ (see the definition); the draft depth.
  int DsparkPlan(std::vector<std::vector<int32_t>>& verify);
  // Feeds a step's acceptance and pace observations to the estimators and SLO floors (at once,
  // or N steps late with --stale_steps N).
  absl::Status ApplyObservations();
  double Time(int depth);      // the step's time, us
  absl::Status Progress(double step_us);

  RankLoad LoadOf(int rank) const;
  void AddToLoad(RankLoad& l, const InflightRequest& a) const;

  const SimConfig& cfg_;
  const TruthModel& truth_;
  const absl::Span<const TraceRequest> trace_;
  const int num_ranks_;
  const bool planned_;
  Router router_;
  Planner planner_;
  // One online model for the instance (every rank is the same hardware): it learns from every
  // rank's measured attention each step, as each rank's own Balancer does in an engine.
  std::optional<OnlineCostModel> online_;

  std::mt19937_64 rng_;
  std::normal_distribution<double> shift_;  // per-request acceptance shift
  std::normal_distribution<double> noise_;  // truth attention noise
  std::uniform_real_distribution<double> unif_{0, 1};
  const std::array<double, kMaxDraftLen> profile_ = MtpK8ConditionalProfile();
  std::vector<AcceptanceEstimator> estimators_;
  // Each rank's own TPOT SLO floors, as each rank's Balancer keeps them in an engine.
  std::vector<TpotSlo> slos_;

  std::vector<std::vector<InflightRequest>> ranks_;
  std::vector<RankLoad> loads_;
  std::vector<std::vector<PlanRequest>> batches_;
  std::vector<std::vector<int32_t>> verify_;
  std::vector<int64_t> kv_free_;
  std::vector<BatchAggregates> aggs_;
  std::vector<RequestLoad> rank_batch_;  // one rank's batch in Time, reused across steps
  const bool padded_;                    // token tiers: every rank runs the agreed tier
  // --stale_steps: the batches of the last N + 1 steps as the planner saw them (oldest first),
  // the observations of the last N steps not yet fed back, and the stale plan's lengths.
  struct Seen {
    int64_t id, ctx, remaining;
    AcceptanceCurve truth_curve;
  };
  struct Observation {
    int rank;
    int64_t id;
    int k, m;           // verified, accepted
    double step_us;
    bool forget;        // the request finished: forget it after its last observation
  };
  std::deque<std::vector<std::vector<Seen>>> history_;
  std::deque<std::vector<Observation>> pending_;
  std::vector<std::vector<int32_t>> stale_verify_;
  DsparkScratch dspark_scratch_;
  std::vector<double> tpots_;
  size_t next_ = 0;
  int64_t active_ = 0;
  double now_us_ = 0;
  RunResult res_;
  RunTotals totals_;
};

absl::StatusOr<Simulation> Simulation::Create(const SimConfig& cfg, const TruthModel& truth,
                                              absl::Span<const TraceRequest> trace) {
  const int num_ranks = cfg.num_ranks;
  if (num_ranks < 1) return absl::InvalidArgumentError(absl::StrFormat("--dp %d must be >= 1", num_ranks));
  if (cfg.static_k < 0 || cfg.static_k > cfg.k_max || cfg.k_max > kMaxDraftLen) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "static k %d / k_max %d must satisfy 0 <= k <= k_max <= %d", cfg.static_k, cfg.k_max,
        kMaxDraftLen));
  }
  if (cfg.stale_steps < 0 || cfg.stale_steps > kMaxStaleSteps) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--stale_steps = %d must be in 0..%d", cfg.stale_steps, kMaxStaleSteps));
  }
  for (size_t i = 0; i < cfg.token_tiers.size(); ++i) {
    if (cfg.token_tiers[i] <= 0 || (i > 0 && cfg.token_tiers[i] <= cfg.token_tiers[i - 1])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--tiers: tier %d (position %d) must be positive and above the one before it",
          cfg.token_tiers[i], i + 1));
    }
  }
  absl::StatusOr<Router> router = Router::Create(cfg.routing, num_ranks, cfg.planner_model);
  if (!router.ok()) return router.status();

  PlannerConfig pc;
  pc.num_ranks = num_ranks;
  pc.k_max = cfg.k_max;
  pc.default_k = cfg.static_k;
  pc.global = truth.global;  // the global terms are instance facts every rank knows
  pc.max_step_slack = cfg.max_step_slack;
  pc.agreed_draft_depth = !truth.per_rank_draft;
  pc.uniform_per_rank = cfg.uniform_per_rank;
  if (cfg.verify != VerifyMode::kOracle) {
    pc.grid_simulation = cfg.planner_grid_simulation;
  } else {
    pc.sample_heads = false;  // the oracle prices exactly as the truth charges
  }
  if (cfg.padded && cfg.verify != VerifyMode::kDspark) {  // the planner's padded mode (v2)
    pc.token_tiers = cfg.token_tiers;
    pc.global.padded_tokens = true;
  }
  pc.mode = cfg.verify == VerifyMode::kLocal  ? PlanMode::kLocal
            : cfg.verify == VerifyMode::kFill ? PlanMode::kFill
                                              : PlanMode::kGoodput;
  absl::StatusOr<Planner> planner = Planner::Create(
      pc, cfg.verify == VerifyMode::kOracle ? truth.attention : cfg.planner_model);
  if (!planner.ok()) return planner.status();
  return Simulation(cfg, truth, trace, *std::move(router), *std::move(planner));
}

Simulation::Simulation(const SimConfig& cfg, const TruthModel& truth,
                       absl::Span<const TraceRequest> trace, Router router, Planner planner)
    : cfg_(cfg),
      truth_(truth),
      trace_(trace),
      num_ranks_(cfg.num_ranks),
      planned_(cfg.verify != VerifyMode::kStatic),
      router_(std::move(router)),
      planner_(std::move(planner)),
      rng_(cfg.seed),
      shift_(0, cfg.acceptance_sigma),
      noise_(0, 1),
      estimators_(num_ranks_, AcceptanceEstimator(cfg.acceptance_prior_strength, profile_)),
      slos_(num_ranks_, TpotSlo(planned_ ? cfg.tpot_slo_us : 0)),
      ranks_(num_ranks_),
      loads_(num_ranks_),
      batches_(num_ranks_),
      verify_(num_ranks_),
      kv_free_(num_ranks_, -1),
      aggs_(num_ranks_),
      padded_(cfg.padded || cfg.verify == VerifyMode::kDspark) {
  // Not the oracle: its planner holds planner_model, priced as planner_grid_simulation says.
  if (cfg.planner_online && cfg.verify != VerifyMode::kOracle) online_.emplace(planner_.model());
}

// The rank's load as the router sees it; E's aggregates price every request at the typical q.
RankLoad Simulation::LoadOf(int rank) const {
  RankLoad l;
  l.capacity_tokens = cfg_.rank_capacity_tokens;
  l.max_requests = cfg_.max_batch_per_rank;
  int64_t max_ctx_tokens = 0;
  for (const InflightRequest& a : ranks_[rank]) {
    l.num_requests += 1;
    l.ctx_tokens += a.ctx;
    l.reserved_tokens += a.ctx + a.remaining;
    max_ctx_tokens = std::max(max_ctx_tokens, a.ctx);
  }
  l.agg = TypicalBatchAggregates(l.num_requests, l.ctx_tokens, max_ctx_tokens,
                                 static_cast<int32_t>(cfg_.routing.query_tokens_per_request));
  return l;
}

// `l` with one more request `a` (what LoadOf would give after admitting it, in O(1)).
void Simulation::AddToLoad(RankLoad& l, const InflightRequest& a) const {
  l.num_requests += 1;
  l.ctx_tokens += a.ctx;
  l.reserved_tokens += a.ctx + a.remaining;
  const int64_t max_ctx_tokens = std::max(static_cast<int64_t>(l.agg.max_key_tokens), a.ctx);
  l.agg = TypicalBatchAggregates(l.num_requests, l.ctx_tokens, max_ctx_tokens,
                                 static_cast<int32_t>(cfg_.routing.query_tokens_per_request));
}

// Routes the trace's next requests while the instance takes them (closed loop: fewer than
// `inflight` in flight; open loop: arrived); a request that fits on no rank waits, in order.
absl::StatusOr<Simulation::Admission> Simulation::Admit() {
  if (next_ >= trace_.size()) return Admission::kTraceDone;
  for (int r = 0; r < num_ranks_; ++r) loads_[r] = LoadOf(r);
  while (next_ < trace_.size()) {
    const TraceRequest& t = trace_[next_];
    if (cfg_.open_loop ? t.arrival_ms / cfg_.arrival_speedup * 1000.0 > now_us_
                       : active_ >= cfg_.inflight) {
      break;
    }
    absl::StatusOr<int> r = router_.Route({t.input_tokens, t.output_tokens}, loads_);
    if (!r.ok()) {
      if (absl::IsResourceExhausted(r.status())) {  // waits, in order
        ++totals_.blocked_steps;
        break;
      }
      return r.status();
    }
    InflightRequest a;
    a.id = static_cast<int64_t>(next_);
    a.ctx = t.input_tokens;
    a.remaining = t.output_tokens;
    a.output = t.output_tokens;
    a.start_us = now_us_;
    a.rates = ShiftedProfile(profile_, shift_(rng_));
    a.truth_curve = *AcceptanceCurve::FromConditional(a.rates);
    ranks_[*r].push_back(a);
    AddToLoad(loads_[*r], a);
    ++active_;
    ++next_;
  }
  if (active_ > 0) return Admission::kStep;
  if (!cfg_.open_loop) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "request %d (input %d + output %d tokens) fits on no rank of capacity %d tokens",
        next_, trace_[next_].input_tokens, trace_[next_].output_tokens, cfg_.rank_capacity_tokens));
  }
  now_us_ = std::max(now_us_, trace_[next_].arrival_ms / cfg_.arrival_speedup * 1000.0);
  return Admission::kIdle;
}

// Sets every request's verify length in verify_: the default length, or the planner's.
absl::StatusOr<int> Simulation::Plan() {
  if (planned_ && cfg_.stale_steps > 0) return PlanStale();
  for (int r = 0; r < num_ranks_; ++r) {
    batches_[r].resize(ranks_[r].size());
    verify_[r].resize(ranks_[r].size());
    for (size_t i = 0; i < ranks_[r].size(); ++i) {
      const InflightRequest& a = ranks_[r][i];
      PlanRequest& p = batches_[r][i];
      p.ctx_tokens = a.ctx;
      p.k_cap = static_cast<int32_t>(std::min<int64_t>(cfg_.k_max, a.remaining - 1));
      const int32_t default_len = DefaultVerifyLen(cfg_.static_k, p.k_cap);
      if (!planned_) {
        verify_[r][i] = default_len;
        continue;
      }
      p.acceptance = cfg_.verify == VerifyMode::kOracle ? a.truth_curve : estimators_[r].Curve(a.id);
      p.k_min = cfg_.floor_at_default ? default_len : slos_[r].Floor(a.id, default_len, p.acceptance);
    }
  }
  if (!planned_) return cfg_.static_k;
  return Decide(verify_);
}

absl::StatusOr<int> Simulation::Decide(std::vector<std::vector<int32_t>>& verify) {
  if (cfg_.verify == VerifyMode::kDspark) return DsparkPlan(verify);
  absl::StatusOr<GlobalDecision> d = planner_.PlanAll(batches_, kv_free_, &verify);
  if (!d.ok()) return d.status();
  totals_.planned_step_sum += d->step_us;
  return d->draft_depth;
}

PlanRequest Simulation::PlanRequestFor(int rank, int64_t id, int64_t ctx, int64_t remaining,
                                       const AcceptanceCurve& truth_curve) const {
  PlanRequest p;
  p.ctx_tokens = ctx;
  p.k_cap = static_cast<int32_t>(std::clamp<int64_t>(remaining - 1, 0, cfg_.k_max));
  const int32_t default_len = DefaultVerifyLen(cfg_.static_k, p.k_cap);
  p.acceptance = cfg_.verify == VerifyMode::kOracle ? truth_curve : estimators_[rank].Curve(id);
  p.k_min = cfg_.floor_at_default ? default_len : slos_[rank].Floor(id, default_len, p.acceptance);
  return p;
}

// The engine plans a step ahead of what it has seen (a step-ahead engine drafts before it knows
// the last steps' outcome). It knows the batch it scheduled, but each request's context and
// remaining tokens only as of N steps ago (a request admitted since: as admitted), and the
// estimators and SLO floors as they were (ApplyObservations feeds them N steps late). Requests
// that finished in those N steps are still planned, and their lengths dropped. A planned length
// is cut to what the request can still emit.
absl::StatusOr<int> Simulation::PlanStale() {
  std::vector<std::vector<Seen>> now(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) {
    for (const InflightRequest& a : ranks_[r]) now[r].push_back({a.id, a.ctx, a.remaining, a.truth_curve});
  }
  history_.push_back(std::move(now));
  while (history_.size() > static_cast<size_t>(cfg_.stale_steps) + 1) history_.pop_front();
  const std::vector<std::vector<Seen>>& seen = history_.front();
  for (int r = 0; r < num_ranks_; ++r) {
    batches_[r].clear();
    for (const InflightRequest& a : ranks_[r]) {  // batches are small (<= --max_batch)
      const TraceRequest& t = trace_[a.id];
      int64_t ctx = t.input_tokens, remaining = t.output_tokens;
      for (const Seen& s : seen[r]) {
        if (s.id == a.id) {
          ctx = s.ctx;
          remaining = s.remaining;
          break;
        }
      }
      batches_[r].push_back(PlanRequestFor(r, a.id, ctx, remaining, a.truth_curve));
    }
    for (const Seen& s : seen[r]) {  // finished since, which the engine does not know yet
      bool running = false;
      for (const InflightRequest& a : ranks_[r]) running = running || a.id == s.id;
      if (!running) batches_[r].push_back(PlanRequestFor(r, s.id, s.ctx, s.remaining, s.truth_curve));
    }
  }
  stale_verify_.resize(num_ranks_);
  absl::StatusOr<int> depth = Decide(stale_verify_);
  if (!depth.ok()) return depth.status();
  for (int r = 0; r < num_ranks_; ++r) {
    verify_[r].resize(ranks_[r].size());
    for (size_t i = 0; i < ranks_[r].size(); ++i) {
      const int32_t cap = static_cast<int32_t>(std::clamp<int64_t>(ranks_[r][i].remaining - 1, 0, cfg_.k_max));
      verify_[r][i] = std::min(stale_verify_[r][i], cap);
    }
  }
  return *depth;
}

// SGLang's DSpark verify planner under DP attention, as read at sgl-project/sglang commit
// 00c3cffac9ff9fe6ca7a67a430c878664837e871,
// python/sglang/srt/speculative/dspark_components/dspark_planner.py:
// `compute_verify_token_budget` sorts a rank's draft positions by survival probability (the
// chance every draft up to it is accepted), and picks the budget b (extra verify tokens over one
// per request) that maximises expected tokens (n + the b best survivals) times the steps per
// second its SPS table gives for n + b batch tokens; `ScheduleVerifyLensTopk` then verifies the
// b best positions. `local_verify_tier_num_tokens` (n + b) is all-gathered by
// `_maybe_gather_dp_verify_tier`, the DP tier is the largest (`dp_global_verify_tier_num_tokens`)
// rounded up to the captured token grid (`round_up_grid`), and the tier's spare tokens are
// padding rows (`graph_tier_fill_budget` is off by default: speculative_dspark_align_verify_
// tokens_to_graph_tier). The padding is Time's (padded_).
// Simplified here: the survival probabilities are the estimators' curves the planner rows see
// (not a confidence head), the SPS table is the planner's model of this rank's step (its own
// attention, its draft depth and the FFN as if every rank ran its tokens), a position never
// passes the request's cap, and there is no TPOT floor or guard (DSpark has none).
int Simulation::DsparkPlan(std::vector<std::vector<int32_t>>& verify) {
  int depth = 0;
  for (int r = 0; r < num_ranks_; ++r) {
    verify[r].resize(batches_[r].size());
    depth = std::max(depth, DsparkRankPlan(batches_[r], planner_.model(), truth_.global, num_ranks_,
                                           !truth_.per_rank_draft, absl::MakeSpan(verify[r]),
                                           dspark_scratch_));
  }
  return depth;
}

// The truth's time of the step, and the step's balance, cost-ratio and ideal-time sums.
double Simulation::Time(int depth) {
  const int num_ranks = num_ranks_;
  double max_attn = 0, sum_attn = 0, sum_q = 0, max_q = 0;
  BatchAggregates total;
  // Token tiers: every rank runs the agreed tier of the largest rank's real tokens.
  int64_t tier = 0;
  if (padded_) {
    int64_t max_tokens = 0;
    for (int r = 0; r < num_ranks; ++r) {
      int64_t tokens = 0;
      for (int32_t v : verify_[r]) tokens += 1 + v;
      max_tokens = std::max(max_tokens, tokens);
    }
    tier = AgreedTier(cfg_.token_tiers, max_tokens);
  }
  for (int r = 0; r < num_ranks; ++r) {
    rank_batch_.clear();
    for (size_t i = 0; i < ranks_[r].size(); ++i) rank_batch_.push_back({ranks_[r][i].ctx, 1 + verify_[r][i]});
    double real_q = 0;
    if (padded_) {
      for (const RequestLoad& l : rank_batch_) real_q += l.query_tokens;
      AddPadding(rank_batch_, tier - static_cast<int64_t>(real_q));
      totals_.pad_tokens += static_cast<double>(tier) - real_q;
      totals_.run_tokens += static_cast<double>(tier);
    }
    aggs_[r] = truth_.attention.Aggregate(rank_batch_);
    double attn = truth_.attention.AttentionUs(aggs_[r]);
    if (truth_.noise_sigma > 0) attn *= std::exp(truth_.noise_sigma * noise_(rng_));
    if (truth_.per_rank_draft) {  // this rank's own draft steps run before the barrier
      int rank_depth = 0;
      for (int32_t v : verify_[r]) rank_depth = std::max(rank_depth, static_cast<int>(v));
      attn += truth_.global.draft_per_step_us * rank_depth;
    }
    if (online_ && aggs_[r].num_requests > 0) {
      // The batch as the online model sees it: its own grid terms, not the truth's.
      const BatchAggregates seen = online_->model().Aggregate(rank_batch_);
      const double predicted = online_->model().AttentionUs(seen);
      totals_.model_error_sum += std::abs(predicted - attn) / attn;
      totals_.model_error_n += 1;
      online_->Observe(seen, attn);
    }
    max_attn = std::max(max_attn, attn);
    sum_attn += attn;
    // Token balance counts real tokens; padding is what the tier adds to them.
    const double rank_q = padded_ ? real_q : aggs_[r].query_tokens;
    sum_q += rank_q;
    max_q = std::max(max_q, rank_q);
    total.num_requests += aggs_[r].num_requests;
    total.query_tokens += aggs_[r].query_tokens;
    total.query_key_pairs += aggs_[r].query_key_pairs;
    total.key_tokens += aggs_[r].key_tokens;
    total.max_query_key_pairs = std::max(total.max_query_key_pairs, aggs_[r].max_query_key_pairs);
    total.max_key_tokens = std::max(total.max_key_tokens, aggs_[r].max_key_tokens);
  }
  // The same work spread perfectly over the ranks; a request cannot be split, so the ideal
  // rank still holds the instance's longest one (critical-path terms of a fitted model).
  BatchAggregates ideal;
  ideal.num_requests = total.num_requests / num_ranks;
  ideal.query_tokens = total.query_tokens / num_ranks;
  ideal.query_key_pairs = total.query_key_pairs / num_ranks;
  ideal.key_tokens = total.key_tokens / num_ranks;
  ideal.max_query_key_pairs = total.max_query_key_pairs;
  ideal.max_key_tokens = total.max_key_tokens;
  ideal.multi_query = total.query_tokens > total.num_requests;
  if (online_) planner_.set_model(online_->model());
  // The FFN sees every rank's tokens: with tiers, every rank's padded tier.
  const double ffn_tokens = padded_ ? static_cast<double>(num_ranks) * static_cast<double>(tier) : sum_q;
  const double global_us = truth_.global.StepUs(ffn_tokens, truth_.per_rank_draft ? 0 : depth);
  const double step_us = max_attn + global_us;
  if (planned_) totals_.actual_step_sum += step_us;
  totals_.bubble.AddStepMeanMax(sum_attn / num_ranks, max_attn);
  totals_.v1_act += PublishedInstanceCost(PublishedForm::kV1, aggs_);
  totals_.v2_act += PublishedInstanceCost(PublishedForm::kV2, aggs_);
  totals_.v1_ideal += PublishedRankCost(PublishedForm::kV1, ideal);
  totals_.v2_ideal += PublishedRankCost(PublishedForm::kV2, ideal);
  // A grid truth needs a batch to simulate, which the averaged ideal rank is not: there the
  // ideal attention is the ranks' mean (the bubble-free time of the same assignment).
  const double ideal_attention_us =
      truth_.attention.uses_grid() ? sum_attn / num_ranks : truth_.attention.AttentionUs(ideal);
  totals_.ideal_time_us += ideal_attention_us + global_us;
  totals_.token_balance_sum += max_q > 0 ? (sum_q / num_ranks) / max_q : 1.0;
  totals_.depth_sum += depth;
  return step_us;
}

// Draws each request's accepted tokens, feeds the estimators and SLO floors, and retires the
// requests that finished.
absl::Status Simulation::Progress(double step_us) {
  const bool stale = planned_ && cfg_.stale_steps > 0;
  if (stale) pending_.emplace_back();
  for (int r = 0; r < num_ranks_; ++r) {
    auto& reqs = ranks_[r];
    for (size_t i = 0; i < reqs.size(); ++i) {
      InflightRequest& a = reqs[i];
      const int k = verify_[r][i];
      int m = 0;
      while (m < k && unif_(rng_) < a.rates[m]) ++m;
      if (stale) {
        pending_.back().push_back({r, a.id, k, m, step_us, false});
      } else {
        if (absl::Status s = estimators_[r].Observe(a.id, k, m); !s.ok()) return s;
        if (absl::Status s = slos_[r].Observe(a.id, step_us, m + 1); !s.ok()) return s;
      }
      a.ctx += m + 1;
      a.remaining -= m + 1;
      res_.tokens += m + 1;
      totals_.k_sum += k;
      totals_.k_count += 1;
    }
    for (size_t i = 0; i < reqs.size();) {
      if (reqs[i].remaining > 0) {
        ++i;
        continue;
      }
      tpots_.push_back((now_us_ - reqs[i].start_us) / 1000.0 / reqs[i].output);
      router_.ObserveFinished(reqs[i].output);
      if (stale) {
        pending_.back().push_back({r, reqs[i].id, 0, 0, 0, true});
      } else {
        estimators_[r].Forget(reqs[i].id);
        slos_[r].Forget(reqs[i].id);
      }
      reqs[i] = reqs.back();
      reqs.pop_back();
      verify_[r][i] = verify_[r].back();
      verify_[r].pop_back();
      --active_;
      ++res_.requests_finished;
    }
  }
  return stale ? ApplyObservations() : absl::OkStatus();
}

// The observations of the step N steps back reach the estimators and SLO floors now: the plan of
// the next step sees the outcomes of steps up to N + 1 before it.
absl::Status Simulation::ApplyObservations() {
  while (pending_.size() > static_cast<size_t>(cfg_.stale_steps)) {
    for (const Observation& o : pending_.front()) {
      if (o.forget) {
        estimators_[o.rank].Forget(o.id);
        slos_[o.rank].Forget(o.id);
        continue;
      }
      if (absl::Status s = estimators_[o.rank].Observe(o.id, o.k, o.m); !s.ok()) return s;
      if (absl::Status s = slos_[o.rank].Observe(o.id, o.step_us, o.m + 1); !s.ok()) return s;
    }
    pending_.pop_front();
  }
  return absl::OkStatus();
}

absl::StatusOr<RunResult> Simulation::Run() {
  while (true) {
    absl::StatusOr<Admission> admission = Admit();
    if (!admission.ok()) return admission.status();
    if (*admission == Admission::kTraceDone) break;
    if (*admission == Admission::kIdle) continue;
    absl::StatusOr<int> depth = Plan();
    if (!depth.ok()) return depth.status();
    const double step_us = Time(*depth);
    now_us_ += step_us;
    if (absl::Status s = Progress(step_us); !s.ok()) return s;
    ++res_.steps;
  }
  if (res_.steps == 0) return absl::FailedPreconditionError("replay ran no decode step");
  totals_.Finish(res_, now_us_, tpots_);
  return res_;
}

}  // namespace

int DsparkRankPlan(absl::Span<const PlanRequest> batch, const CostModel& model,
                   const GlobalCost& global, int num_ranks, bool agreed_depth,
                   absl::Span<int32_t> verify, DsparkScratch& scratch) {
  const int64_t n = static_cast<int64_t>(batch.size());
  std::fill(verify.begin(), verify.end(), 0);
  if (n == 0) return 0;
  std::vector<DsparkScratch::Candidate>& candidates = scratch.candidates;
  candidates.clear();
  scratch.loads.clear();
  for (int32_t i = 0; i < static_cast<int32_t>(n); ++i) {
    scratch.loads.push_back({batch[i].ctx_tokens, 1});
    for (int32_t j = 1; j <= batch[i].k_cap; ++j) {
      const double survival = batch[i].acceptance.Accept(j);
      if (survival < 1e-6) break;  // DSparkScheduleConfig.survival_eps
      candidates.push_back({survival, i, j});
    }
  }
  // Best survival first; ties keep request, then position, order (a request's prefix first).
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const DsparkScratch::Candidate& a, const DsparkScratch::Candidate& b) {
                     return a.survival > b.survival;
                   });
  BatchAggregates agg;
  for (const RequestLoad& l : scratch.loads) agg.Add(l);
  model.FillGrid(scratch.loads, &agg);  // both kernel paths: verify tokens are added below
  auto step_us = [&](int64_t tokens, int deepest) {
    return model.AttentionUs(agg) + (agreed_depth ? 0.0 : global.draft_per_step_us * deepest) +
           global.StepUs(static_cast<double>(num_ranks) * static_cast<double>(tokens),
                         agreed_depth ? deepest : 0);
  };
  double expected = static_cast<double>(n);
  double best = expected / step_us(n, 0);
  size_t best_b = 0;
  int deepest = 0;
  for (size_t b = 0; b < candidates.size(); ++b) {
    const DsparkScratch::Candidate& c = candidates[b];
    agg.AddQueryToken(RequestLoad{batch[c.req].ctx_tokens, c.pos});
    expected += c.survival;
    deepest = std::max(deepest, static_cast<int>(c.pos));
    const double theta = expected / step_us(n + static_cast<int64_t>(b) + 1, deepest);
    if (theta > best) {  // torch.argmax: the first maximum
      best = theta;
      best_b = b + 1;
    }
  }
  int depth = 0;
  for (size_t b = 0; b < best_b; ++b) {
    const DsparkScratch::Candidate& c = candidates[b];
    verify[c.req] = std::max(verify[c.req], c.pos);
    depth = std::max(depth, static_cast<int>(c.pos));
  }
  return depth;
}

std::string VerifyModeName(VerifyMode m) {
  switch (m) {
    case VerifyMode::kStatic: return "off";
    case VerifyMode::kLocal: return "local";
    case VerifyMode::kGoodput: return "goodput";
    case VerifyMode::kFill: return "fill";
    case VerifyMode::kOracle: return "oracle";
    case VerifyMode::kDspark: return "dspark";
  }
  return "?";
}

void AddPadding(std::vector<RequestLoad>& batch, int64_t pad) {
  if (pad <= 0) return;
  if (batch.empty()) {
    batch.push_back({0, static_cast<int32_t>(pad)});
    return;
  }
  const int64_t n = static_cast<int64_t>(batch.size()), each = pad / n, rem = pad % n;
  for (int64_t i = 0; i < n; ++i) batch[i].query_tokens += static_cast<int32_t>(each + (i < rem ? 1 : 0));
}

int64_t AgreedTier(absl::Span<const int32_t> tiers, int64_t max_tokens) {
  for (int32_t t : tiers) {
    if (t >= max_tokens) return t;
  }
  return max_tokens;  // past the last tier (or none): the largest rank's tokens, no graph
}

// sgl-project/sglang python/sglang/srt/server_args.py, ServerArgs._generate_cuda_graph_batch_sizes,
// the speculative-decoding branch (the copy read carried no commit id): 1..8, 10..32 step 2,
// 40..64 step 4, 72..256 step 8, then 272.. step 16, up to cuda_graph_max_bs (here the replay's
// batch cap, --max_batch). python/sglang/srt/speculative/ragged_verify.py (commit
// 02d548f314373ad861130ad9b9e13fc7c1e9ba59), build_ragged_capture_token_buckets: the compact
// verify's token grid is {bs * num_draft_tokens}, num_draft_tokens = gamma + 1 (here k_max + 1).
std::vector<int32_t> SglangDefaultTiers(int max_batch, int k_max) {
  std::vector<int32_t> bs;
  for (int b = 1; b <= 8; ++b) bs.push_back(b);
  for (int b = 10; b <= 32; b += 2) bs.push_back(b);
  for (int b = 40; b <= 64; b += 4) bs.push_back(b);
  for (int b = 72; b <= 256; b += 8) bs.push_back(b);
  for (int b = 272; b <= max_batch; b += 16) bs.push_back(b);
  std::vector<int32_t> tiers;
  for (int32_t b : bs) {
    if (b <= max_batch) tiers.push_back(b * (k_max + 1));
  }
  return tiers;
}

absl::StatusOr<RunResult> Simulate(const SimConfig& cfg, const TruthModel& truth,
                                   absl::Span<const TraceRequest> trace) {
  const auto wall0 = std::chrono::steady_clock::now();
  absl::StatusOr<Simulation> simulation = Simulation::Create(cfg, truth, trace);
  if (!simulation.ok()) return simulation.status();
  absl::StatusOr<RunResult> res = simulation->Run();
  if (!res.ok()) return res.status();
  res->wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  return res;
}

}  // namespace dpbalance::replay
