#include "simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
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
      aggs_(num_ranks_) {
  if (cfg.planner_online && cfg.verify != VerifyMode::kOracle) online_.emplace(cfg.planner_model);
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
  absl::StatusOr<GlobalDecision> d = planner_.PlanAll(batches_, kv_free_, &verify_);
  if (!d.ok()) return d.status();
  totals_.planned_step_sum += d->step_us;
  return d->draft_depth;
}

// The truth's time of the step, and the step's balance, cost-ratio and ideal-time sums.
double Simulation::Time(int depth) {
  const int num_ranks = num_ranks_;
  double max_attn = 0, sum_attn = 0, sum_q = 0, max_q = 0;
  BatchAggregates total;
  for (int r = 0; r < num_ranks; ++r) {
    rank_batch_.clear();
    for (size_t i = 0; i < ranks_[r].size(); ++i) rank_batch_.push_back({ranks_[r][i].ctx, 1 + verify_[r][i]});
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
    sum_q += aggs_[r].query_tokens;
    max_q = std::max(max_q, aggs_[r].query_tokens);
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
  const double global_us = truth_.global.StepUs(sum_q, truth_.per_rank_draft ? 0 : depth);
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
  for (int r = 0; r < num_ranks_; ++r) {
    auto& reqs = ranks_[r];
    for (size_t i = 0; i < reqs.size(); ++i) {
      InflightRequest& a = reqs[i];
      const int k = verify_[r][i];
      int m = 0;
      while (m < k && unif_(rng_) < a.rates[m]) ++m;
      if (absl::Status s = estimators_[r].Observe(a.id, k, m); !s.ok()) return s;
      if (absl::Status s = slos_[r].Observe(a.id, step_us, m + 1); !s.ok()) return s;
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
      estimators_[r].Forget(reqs[i].id);
      slos_[r].Forget(reqs[i].id);
      reqs[i] = reqs.back();
      reqs.pop_back();
      verify_[r][i] = verify_[r].back();
      verify_[r].pop_back();
      --active_;
      ++res_.requests_finished;
    }
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

std::string VerifyModeName(VerifyMode m) {
  switch (m) {
    case VerifyMode::kStatic: return "off";
    case VerifyMode::kLocal: return "local";
    case VerifyMode::kGoodput: return "goodput";
    case VerifyMode::kFill: return "fill";
    case VerifyMode::kOracle: return "oracle";
  }
  return "?";
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
