#include "simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "dpbalance/acceptance.h"
#include "dpbalance/calibration.h"
#include "dpbalance/dspark.h"
#include "dpbalance/lag.h"
#include "dpbalance/metrics.h"
#include "dpbalance/tpot_slo.h"

namespace dpbalance::replay {
namespace {

// The additive table's --fracs sweep: SGLang gives no default; a quarter to the whole window.
constexpr double kAdditiveFracs[] = {0.25, 0.5, 0.75, 1.0};

// A request in flight on a rank: its KV context, what it still has to emit, and its true
// acceptance (which the planner never sees, except in kOracle or with plan_on_true_acceptance).
struct InflightRequest {
  int64_t id;
  int64_t ctx;        // tokens in KV (input + emitted)
  int64_t remaining;  // tokens still to emit
  int64_t output;     // total output length
  double start_us;
  std::array<double, kMaxDraftLen> rates;  // true conditional acceptance
  AcceptanceCurve truth_curve;
  // SimConfig::step_acceptance_sigma: this step's logit offset on `rates` and the rates it
  // gives (what the step's accept draws use); confidence_sigma: the draft confidence's logit
  // offset at this step and the two before (newest first), and how many steps have drawn one.
  double step_shift = 0;
  std::array<double, kMaxDraftLen> step_rates;
  std::array<double, 3> confidence_offset{};
  int64_t confidence_steps = 0;
  AcceptanceCurve confidence;  // this step's confidence curve (offset 0), drawn with it
  int64_t steps_planned = 0;   // decode steps it has been planned for before this one
  int64_t finished_step = -1;  // the step it emitted its last token in (-1: running); with lag
                               // it stays in the batch until the engine learns of it
  // What the engine saw when it planned each of the last N + 1 steps (oldest first): the state
  // before that step and the verify length it gave the request there. The oldest is what the
  // engine knows now; the verify lengths after it are the pending steps'.
  struct Seen {
    int64_t ctx, remaining;
    int32_t verify_len;
  };
  std::vector<Seen> seen;
};

// Limit on --stale_steps: the engine keeps N old batches (a planner that far behind plans
// requests that have long left).
constexpr int kMaxStaleSteps = 64;

// Mann-Whitney AUC of the scores against the labels (ties count a half; 0.5 with one class).
double Auc(std::vector<std::pair<float, bool>> samples) {
  std::sort(samples.begin(), samples.end());
  double positives = 0, rank_sum = 0;
  for (size_t i = 0; i < samples.size();) {
    size_t j = i;
    while (j < samples.size() && samples[j].first == samples[i].first) ++j;
    const double mid_rank = 0.5 * static_cast<double>(i + 1 + j);  // ranks i+1..j
    for (size_t t = i; t < j; ++t) {
      if (samples[t].second) {
        positives += 1;
        rank_sum += mid_rank;
      }
    }
    i = j;
  }
  const double negatives = static_cast<double>(samples.size()) - positives;
  if (positives == 0 || negatives == 0) return 0.5;
  return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives);
}

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
  double ctx_imbalance_sum = 0;
  int64_t ctx_imbalance_steps = 0;  // steps with context on some rank
  int64_t blocked_steps = 0;
  int64_t quiet_steps = 0;  // planner rows in quiet mode: steps without a plan
  double model_error_sum = 0, model_error_n = 0;
  double pad_tokens = 0, run_tokens = 0;  // padded runs: spare tier tokens, all tokens run
  double planned_tokens_sum = 0, planned_steps_tokens = 0;  // planner rows: expected vs emitted
  double wasted_tokens = 0, real_tokens = 0;  // lag: query tokens that could emit nothing
  double expected_tokens = 0, bound_tokens = 0, bound_time_us = 0;  // step_bound


  void Finish(RunResult& res, double now_us, const std::vector<double>& tpots,
              const std::vector<double>& latencies) const {
    res.sim_time_s = now_us / 1e6;
    res.balance_efficiency = bubble.balance_efficiency();
    res.cost_ratio_v1 = v1_act / v1_ideal;
    res.cost_ratio_v2 = v2_act / v2_ideal;
    res.goodput_tok_per_s = res.tokens / res.sim_time_s;
    res.ideal_goodput_tok_per_s = res.tokens / (ideal_time_us / 1e6);
    res.mean_step_ms = now_us / 1000.0 / res.steps;
    res.tpot_p50_ms = Percentile(tpots, 0.5);
    res.tpot_p99_ms = Percentile(tpots, 0.99);
    if (!latencies.empty()) {
      double sum = 0;
      for (double l : latencies) sum += l;
      res.latency_mean_ms = sum / static_cast<double>(latencies.size());
      res.latency_p50_ms = Percentile(latencies, 0.5);
    }
    res.ctx_imbalance = ctx_imbalance_steps > 0 ? ctx_imbalance_sum / ctx_imbalance_steps : 0;
    res.token_balance = token_balance_sum / res.steps;
    res.mean_verify_len = k_count > 0 ? k_sum / k_count : 0;
    res.mean_draft_depth = depth_sum / res.steps;
    res.blocked_step_fraction = static_cast<double>(blocked_steps) / res.steps;
    res.quiet_step_fraction = static_cast<double>(quiet_steps) / res.steps;
    res.step_over_plan = planned_step_sum > 0 ? actual_step_sum / planned_step_sum - 1 : 0;
    res.planner_model_error = model_error_n > 0 ? model_error_sum / model_error_n : 0;
    res.padding_fraction = run_tokens > 0 ? pad_tokens / run_tokens : 0;
    res.tokens_over_plan = planned_tokens_sum > 0 ? planned_steps_tokens / planned_tokens_sum - 1 : 0;
    res.wasted_token_fraction = real_tokens > 0 ? wasted_tokens / real_tokens : 0;
    if (bound_time_us > 0) {
      res.expected_tok_per_s = expected_tokens / (bound_time_us / 1e6);
      res.step_bound_over_expected = bound_tokens / expected_tokens;
    }
  }
};

// One run's state. Each step: Admit (route new requests) -> Plan (verify lengths) -> Time (the
// truth's step time) -> Progress (acceptance, emitted tokens, completion) -> Retire (requests
// whose end the engine has learned of).
class Simulation {
 public:
  static absl::StatusOr<Simulation> Create(const SimConfig& cfg, const TruthModel& truth,
                                           absl::Span<const TraceRequest> trace);
  absl::StatusOr<RunResult> Run();
  // kOnline: carries `warm`'s profilers (and each rank's last rebuilt table) into this run.
  absl::Status AdoptOnlineSps(const Simulation& warm);

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
  // What the engine knows of request `a` when it plans this step (the lag model in simulator.h):
  // records the state into a.seen and returns the oldest seen entry; `pending` gets the verify
  // lengths of the steps since it.
  const InflightRequest::Seen& Observe(InflightRequest& a, std::vector<int32_t>& pending) const;
  // The planner's PlanRequest for `a` on rank `rank`, from what the engine knows.
  PlanRequest PlanRequestFor(int rank, const InflightRequest& a, const InflightRequest::Seen& seen,
                             absl::Span<const int32_t> pending, int32_t offered) const;
  // This step's count of drafts the drafter offers a request: drawn from its trace row's
  // `offered` (the request's id is its row), every draft where that is empty.
  int32_t OfferedDrafts(const InflightRequest& a);
  // Feeds a step's acceptance and pace observations to the estimators and SLO floors (at once,
  // or N steps late with --stale_steps N).
  absl::Status ApplyObservations();
  double Time(int depth);      // the step's time, us
  // step_bound: the step's bound on expected tokens per us, and the expected tokens of its plan
  // (true acceptance); see the definition.
  std::pair<double, double> StepBound(int depth);
  absl::Status Progress(double step_us);
  // Draws each request's step acceptance offset and draft confidence for the step about to run.
  void DrawStepSignals();
  // Our rows with a confidence signal: each rank's planned tokens, its floors first, spent again
  // by this step's draft confidence (DSpark's top-k within the plan's budget: what the engine
  // does when the plan hands it each rank's budget instead of lengths), no deeper than `depth`.
  void SpendOnConfidence(int depth);
  // The draft's confidence curve `lag` steps back (0: this step's).
  AcceptanceCurve ConfidenceCurve(const InflightRequest& a, int lag) const;
  absl::Status ObserveSps(double step_us);
  // Drops the requests whose end the engine has now learned of (N steps after it, with lag).
  void Retire();

  RankLoad LoadOf(int rank) const;
  void AddToLoad(RankLoad& l, const InflightRequest& a) const;

  const SimConfig& cfg_;
  const TruthModel& truth_;
  const absl::Span<const TraceRequest> trace_;
  const int num_ranks_;
  const bool planned_;
  const bool dspark_;
  Router router_;
  Planner planner_;
  // One online model for the instance (every rank is the same hardware): it learns from every
  // rank's measured attention each step (each rank's own Balancer in an engine learns from its
  // own), forgetting per step as that one does (its options scaled by the rank count).
  std::optional<OnlineCostModel> online_;
  // DsparkTable::kOnline: each rank's OnlineSpsProfiler (rank-local, as in SGLang).
  std::vector<dspark::OnlineSps> online_sps_;

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
  int64_t planned_tier_ = 0;             // the tier the step's plan agreed (0: the largest rank's)
  double planned_tokens_ = 0;            // the step's plan: expected tokens (planner rows)
  // The balancer's quiet mode (SimConfig::quiet): every rank shares the one schedule, so the
  // instance's agreed level is its own. planned_now_: this step runs a plan (planned_ and not
  // quiet).
  QuietSchedule quiet_;
  bool planned_now_ = false;
  struct Observation {
    int rank;
    int64_t id;
    int k, m;           // verified, accepted
    double step_us;
    int64_t emitted;
    bool forget;        // the request finished: forget it after its last observation
  };
  std::deque<std::vector<Observation>> pending_;  // the last N steps' outcomes, not yet seen
  std::vector<int32_t> pending_scratch_;
  std::vector<double> tpots_;
  std::vector<double> latencies_;  // per finished request, ms (RunResult::latency_mean_ms)
  std::vector<std::pair<float, bool>> confidence_samples_;  // (first draft's confidence, accepted)
  size_t next_ = 0;
  int64_t active_ = 0;  // requests the engine believes in flight (finished ones until it learns)
  int64_t step_ = 0;
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

  const bool dspark = IsDspark(cfg.verify);
  PlannerConfig pc;
  pc.num_ranks = num_ranks;
  pc.k_max = cfg.k_max;
  pc.default_k = cfg.static_k;
  pc.global = truth.global;  // the global terms are instance facts every rank knows
  pc.max_step_slack = cfg.max_step_slack;
  pc.guard_overhead_us = cfg.guard_overhead_us;
  pc.min_plan_gain = cfg.min_plan_gain;
  pc.value_deferral = cfg.value_deferral;
  pc.agreed_draft_depth = !truth.per_rank_draft;
  pc.uniform_per_rank = cfg.uniform_per_rank;
  pc.uniform_instance = cfg.uniform_instance;
  if (cfg.verify != VerifyMode::kOracle) {
    pc.grid_simulation = cfg.planner_grid_simulation;
  } else {
    pc.sample_heads = false;  // the oracle prices exactly as the truth charges
  }
  if (cfg.padded && !dspark) {  // the planner's padded mode (v2)
    pc.token_tiers = cfg.token_tiers;
    pc.global.padded_tokens = true;
  }
  pc.mode = cfg.verify == VerifyMode::kLocal        ? PlanMode::kLocal
            : cfg.verify == VerifyMode::kFill       ? PlanMode::kFill
            : cfg.verify == VerifyMode::kDspark     ? PlanMode::kDspark
            : cfg.verify == VerifyMode::kDsparkFill ? PlanMode::kDsparkFill
                                                    : PlanMode::kGoodput;
  if (dspark) {
    // A dense draft cannot run DSpark's compact verify in CUDA graphs under DP attention (SGLang
    // refuses at start): no tiers then, each rank runs its own budget.
    if (!truth.per_rank_draft) pc.token_tiers = cfg.token_tiers;
    // Every table is profiled on the truth, the hardware the replay stands for (the profiler
    // takes a median: no noise).
    const int64_t context = cfg.dspark_table == DsparkTable::kProfiled ? dspark::kProfileContextTokens
                                                                       : cfg.dspark_profile_context;
    switch (cfg.dspark_table) {
      case DsparkTable::kContext:
        pc.dspark_context_sps = true;
        break;
      case DsparkTable::kAdditive: {
        absl::StatusOr<dspark::AdditiveSpsTable> table = dspark::ProfileAdditiveSps(
            truth.attention, truth.global, num_ranks, cfg.max_batch_per_rank, cfg.k_max,
            truth.per_rank_draft, context, kAdditiveFracs);
        if (!table.ok()) return table.status();
        pc.dspark_additive = *std::move(table);
        break;
      }
      case DsparkTable::kProfiled:
      case DsparkTable::kWorkload:
      case DsparkTable::kOnline: {
        absl::StatusOr<dspark::SpsTable> table = dspark::ProfileSpsAt(
            truth.attention, truth.global, num_ranks, cfg.max_batch_per_rank, cfg.k_max,
            truth.per_rank_draft, context);
        if (!table.ok()) return table.status();
        pc.dspark_sps_tokens.assign(table->tokens().begin(), table->tokens().end());
        pc.dspark_sps_steps_per_s.assign(table->steps_per_s().begin(), table->steps_per_s().end());
        break;
      }
    }
  }
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
      dspark_(IsDspark(cfg.verify)),
      router_(std::move(router)),
      planner_(std::move(planner)),
      rng_(cfg.seed),
      shift_(0, cfg.acceptance_sigma),
      noise_(0, 1),
      estimators_(num_ranks_, AcceptanceEstimator(cfg.acceptance_prior_strength, profile_,
                                                  cfg.acceptance_model)),
      slos_(num_ranks_, TpotSlo(planned_ ? cfg.tpot_slo_us : 0)),
      ranks_(num_ranks_),
      loads_(num_ranks_),
      batches_(num_ranks_),
      verify_(num_ranks_),
      kv_free_(num_ranks_, -1),
      aggs_(num_ranks_),
      // A dense draft cannot run DSpark's compact verify in CUDA graphs under DP attention
      // (SGLang refuses at start), so its DSpark row runs unpadded.
      padded_(cfg.padded || (dspark_ && !truth.per_rank_draft)),
      quiet_(planned_ ? cfg.quiet : QuietConfig{}) {
  // Not the oracle: its planner holds planner_model, priced as planner_grid_simulation says.
  // Only where a row plans with the model: static rows and DSpark's table-priced rows never read
  // it (refitting for them only costs time).
  const bool plans_with_model =
      planned_ && cfg.verify != VerifyMode::kOracle &&
      !(dspark_ && cfg.dspark_table != DsparkTable::kContext);
  if (cfg.planner_online && plans_with_model) {
    // Every rank's attention each step: num_ranks observations a step where each rank's Balancer
    // in an engine makes one (its own). Its memory, level rate and refit cadence are per step:
    // scaled so that this model forgets as fast, in steps, as each rank's does.
    OnlineCostModel::Options o;
    const double r = static_cast<double>(num_ranks_);
    o.shape_forgetting = std::pow(o.shape_forgetting, 1.0 / r);
    o.level_rate = 1.0 - std::pow(1.0 - o.level_rate, 1.0 / r);
    o.refit_every = o.refit_every * num_ranks_;
    o.trust_rows = o.trust_rows * num_ranks_;
    online_.emplace(planner_.model(), o);
  }
  if (dspark_ && cfg.dspark_table == DsparkTable::kOnline) {
    const PlannerConfig& pc = planner_.config();
    const dspark::SpsTable initial =
        *dspark::SpsTable::Create(pc.dspark_sps_tokens, pc.dspark_sps_steps_per_s);
    online_sps_.assign(static_cast<size_t>(num_ranks_), dspark::OnlineSps(initial));
  }
}

absl::Status Simulation::AdoptOnlineSps(const Simulation& warm) {
  online_sps_ = warm.online_sps_;
  for (size_t r = 0; r < online_sps_.size(); ++r) {
    res_.dspark_warmup_rebuilds += online_sps_[r].rebuilds();
    if (const std::optional<dspark::SpsTable>& table = online_sps_[r].current()) {
      if (absl::Status s = planner_.SetDsparkRankTable(static_cast<int>(r), *table); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

// OnlineSpsProfiler: each rank that planned this step records its step time at its own bs +
// budget, and swaps in the table its profiler rebuilds.
absl::Status Simulation::ObserveSps(double step_us) {
  if (online_sps_.empty() || !planned_now_) return absl::OkStatus();
  const absl::Span<const RankSummary> summaries = planner_.last_summaries();
  for (int r = 0; r < num_ranks_; ++r) {
    if (ranks_[r].empty() || static_cast<size_t>(r) >= summaries.size()) continue;
    std::optional<dspark::SpsTable> table =
        online_sps_[static_cast<size_t>(r)].Observe(summaries[r].base_tokens, step_us * 1e-6);
    if (table) {
      if (absl::Status s = planner_.SetDsparkRankTable(r, *std::move(table)); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
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
  if (next_ >= trace_.size()) {
    return cfg_.drain && active_ > 0 ? Admission::kStep : Admission::kTraceDone;
  }
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
    a.rates = ShiftedProfile(profile_, shift_(rng_));  // drawn for every request: same stream
    if (!t.acceptance.empty()) {  // the trace's measured rates (positions past them: 0)
      a.rates.fill(0.0);
      std::copy(t.acceptance.begin(), t.acceptance.end(), a.rates.begin());
    }
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

const InflightRequest::Seen& Simulation::Observe(InflightRequest& a, std::vector<int32_t>& pending) const {
  a.seen.push_back({a.ctx, a.remaining, 0});
  const size_t keep = static_cast<size_t>(cfg_.stale_steps) + 1;
  if (a.seen.size() > keep) a.seen.erase(a.seen.begin(), a.seen.end() - keep);
  pending.clear();
  for (size_t s = 0; s + 1 < a.seen.size(); ++s) pending.push_back(a.seen[s].verify_len);
  return a.seen.front();
}

void Simulation::DrawStepSignals() {
  if (cfg_.step_acceptance_sigma <= 0 && cfg_.confidence_sigma < 0) return;
  for (auto& rank : ranks_) {
    for (InflightRequest& a : rank) {
      if (cfg_.step_acceptance_sigma > 0) {
        a.step_shift = cfg_.step_acceptance_sigma * noise_(rng_);
        a.step_rates = ShiftedProfile(a.rates, a.step_shift);
      }
      if (cfg_.confidence_sigma >= 0) {
        a.confidence_offset = {a.step_shift + cfg_.confidence_sigma * noise_(rng_),
                               a.confidence_offset[0], a.confidence_offset[1]};
        a.confidence = ConfidenceCurve(a, 0);
        ++a.confidence_steps;
      }
    }
  }
}

AcceptanceCurve Simulation::ConfidenceCurve(const InflightRequest& a, int lag) const {
  return *AcceptanceCurve::FromConditional(ShiftedProfile(a.rates, a.confidence_offset[lag]));
}

void Simulation::SpendOnConfidence(int depth) {
  std::vector<int32_t> caps;
  std::vector<dspark::Candidate> candidates;
  for (int r = 0; r < num_ranks_; ++r) {
    const size_t n = ranks_[r].size();
    caps.resize(n);
    int64_t budget = 0;
    for (size_t i = 0; i < n; ++i) {
      caps[i] = std::min(batches_[r][i].k_cap, depth);
      budget += verify_[r][i];
    }
    // A floor's positions come first (survival above any real one, falling along the request).
    dspark::OrderCandidates(caps, [&](int32_t i, int32_t j) {
      return j <= batches_[r][i].k_min ? 3.0 - 0.1 * j : ranks_[r][i].confidence.Accept(j);
    }, candidates);
    dspark::AssignTopK(candidates, budget, absl::MakeSpan(verify_[r]));
  }
}

// Sets every request's verify length in verify_ from what the engine knows (the lag model in
// simulator.h): the default length, the planner's, or DSpark's.
absl::StatusOr<int> Simulation::Plan() {
  planned_tier_ = 0;
  DrawStepSignals();
  planned_now_ = planned_ && !quiet_.SkipStep();
  if (planned_ && !planned_now_) ++totals_.quiet_steps;
  for (int r = 0; r < num_ranks_; ++r) {
    batches_[r].resize(ranks_[r].size());
    verify_[r].resize(ranks_[r].size());
    for (size_t i = 0; i < ranks_[r].size(); ++i) {
      InflightRequest& a = ranks_[r][i];
      const InflightRequest::Seen& seen = Observe(a, pending_scratch_);
      // Sure of: one token a pending step at least, while it runs.
      const int64_t pending_steps = static_cast<int64_t>(pending_scratch_.size());
      int32_t sure_cap = static_cast<int32_t>(std::clamp<int64_t>(seen.remaining - pending_steps - 1, 0, cfg_.k_max));
      const int32_t offered = OfferedDrafts(a);
      sure_cap = std::min(sure_cap, offered);
      if (!planned_now_) {
        verify_[r][i] = DefaultVerifyLen(cfg_.static_k, sure_cap);
        continue;
      }
      batches_[r][i] = PlanRequestFor(r, a, seen, pending_scratch_, offered);
      if (dspark_) {
        // DSpark plans on what it has seen, capped at what the engine is sure of (SGLang does
        // not cap it; that only helps it). Its budget reads survivals two decode steps back.
        batches_[r][i].k_cap = sure_cap;
        batches_[r][i].no_lagged_survival = a.steps_planned < dspark::kConfidenceLagSteps;
        if (cfg_.confidence_sigma >= 0) {  // the draft's own signal: fresh for the top-k
          batches_[r][i].acceptance = a.confidence;
          if (a.confidence_steps > dspark::kConfidenceLagSteps) {
            batches_[r][i].lagged_acceptance = ConfidenceCurve(a, dspark::kConfidenceLagSteps);
          } else {
            batches_[r][i].no_lagged_survival = true;
          }
        }
      }
    }
  }
  int depth = cfg_.static_k;
  if (planned_now_) {
    absl::StatusOr<GlobalDecision> d = planner_.PlanAll(batches_, kv_free_, &verify_);
    if (!d.ok()) return d.status();
    quiet_.AfterAgreement(quiet_.ProposedLevel(), d->kept_default);
    totals_.planned_step_sum += d->step_us;
    planned_tokens_ = d->expected_tokens;
    planned_tier_ = d->padded_rank_tokens;
    depth = d->draft_depth;
    if (!dspark_ && cfg_.confidence_sigma >= 0 && cfg_.verify != VerifyMode::kOracle) {
      SpendOnConfidence(d->draft_depth);
    }
    if (dspark_) {  // the draft proposes its block; the truth charges the deepest length (MTP)
      depth = 0;
      for (const auto& lens : verify_) {
        for (int32_t v : lens) depth = std::max(depth, static_cast<int>(v));
      }
    }
  }
  for (int r = 0; r < num_ranks_; ++r) {
    for (size_t i = 0; i < ranks_[r].size(); ++i) {
      ranks_[r][i].seen.back().verify_len = verify_[r][i];
      ++ranks_[r][i].steps_planned;
    }
  }
  return depth;
}

int32_t Simulation::OfferedDrafts(const InflightRequest& a) {
  const std::vector<double>& offered = trace_[static_cast<size_t>(a.id)].offered;
  if (offered.empty()) return kMaxDraftLen;  // no draw: the stream of draws stays as it was
  const double u = unif_(rng_);
  int32_t n = 0;  // s_j falls with j: one draw gives the count (u < s_j for j = 1..n)
  while (n < static_cast<int32_t>(offered.size()) && u < offered[n]) ++n;
  return n;
}

PlanRequest Simulation::PlanRequestFor(int rank, const InflightRequest& a,
                                       const InflightRequest::Seen& seen,
                                       absl::Span<const int32_t> pending, int32_t offered) const {
  const AcceptanceCurve curve =
      cfg_.verify == VerifyMode::kOracle || cfg_.plan_on_true_acceptance
          ? a.truth_curve
          : estimators_[rank].Curve(a.id);
  PredictedRequest pr;
  PlanRequest p = LaggedPlanRequest(seen.ctx, seen.remaining, pending, curve, cfg_.k_max, cfg_.lag_predict, &pr);
  p.k_cap = std::min(p.k_cap, offered);  // the drafts the drafter offered this step
  const int32_t default_len = DefaultVerifyLen(cfg_.static_k, p.k_cap);
  if (cfg_.floor_at_default) {
    p.k_min = default_len;
  } else if (cfg_.lag_predict & kPredictSlo) {
    p.k_min = slos_[rank].Floor(a.id, default_len, curve, static_cast<int>(pending.size()), pr.pending_tokens);
  } else {
    p.k_min = slos_[rank].Floor(a.id, default_len, curve);
  }
  return p;
}

// The truth's time of the step, and the step's balance, cost-ratio and ideal-time sums.
double Simulation::Time(int depth) {
  const int num_ranks = num_ranks_;
  const int window = cfg_.k_max + 1;
  double max_attn = 0, sum_attn = 0, sum_q = 0, max_q = 0;
  BatchAggregates total;
  // Token tiers: every rank runs the agreed tier (the plan's, else the largest rank's).
  int64_t tier = 0;
  if (padded_) {
    int64_t max_tokens = 0;
    for (int r = 0; r < num_ranks; ++r) {
      int64_t tokens = 0;
      for (int32_t v : verify_[r]) tokens += 1 + v;
      max_tokens = std::max(max_tokens, tokens);
    }
    tier = std::max(AgreedTier(cfg_.token_tiers, max_tokens), planned_tier_);
  }
  for (int r = 0; r < num_ranks; ++r) {
    rank_batch_.clear();
    double real_q = 0;
    for (size_t i = 0; i < ranks_[r].size(); ++i) {
      const InflightRequest& a = ranks_[r][i];
      const int32_t q = 1 + verify_[r][i];
      rank_batch_.push_back({a.ctx, q});
      real_q += q;
      // Query tokens that can emit nothing: a finished request's, and drafts past what it may
      // still emit (remaining - 1).
      totals_.wasted_tokens += a.finished_step >= 0
                                   ? q
                                   : std::max<int64_t>(0, verify_[r][i] - (a.remaining - 1));
    }
    totals_.real_tokens += real_q;
    if (padded_) {
      const dspark::Padding pad = dspark::PadToTier(tier, static_cast<int64_t>(rank_batch_.size()),
                                                    static_cast<int64_t>(real_q),
                                                    cfg_.max_batch_per_rank, window);
      if (pad.last_row_tokens > 0) rank_batch_.back().query_tokens += static_cast<int32_t>(pad.last_row_tokens);
      for (int32_t t : pad.pad_tokens) rank_batch_.push_back({1, t});  // dummy slots: sequence length 1
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
  if (planned_now_ && !dspark_) totals_.actual_step_sum += step_us;
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
  // The ranks' context as the live harness measures it (the contexts of each rank's running
  // requests, summed): the largest over the mean.
  double ctx_sum = 0, ctx_max = 0;
  for (const auto& rank : ranks_) {
    double ctx = 0;
    for (const InflightRequest& a : rank) {
      if (a.finished_step < 0) ctx += static_cast<double>(a.ctx);
    }
    ctx_sum += ctx;
    ctx_max = std::max(ctx_max, ctx);
  }
  if (ctx_sum > 0) {
    totals_.ctx_imbalance_sum += ctx_max / (ctx_sum / num_ranks);
    ++totals_.ctx_imbalance_steps;
  }
  totals_.depth_sum += depth;
  return step_us;
}

// A bound on what any plan could expect of this step, for padded runs with one draft depth. A
// plan runs every rank at a tier P (at least every request's bonus token) with drafts up to a
// depth d. Its expected tokens are at most, rank by rank, the n_r bonus tokens of its running
// requests and its best P - n_r draft positions by true survival (positions a request cannot emit
// are worth nothing, a finished request nothing at all): the best survivals are a prefix of each
// request. Its time is at least the truth's attention with every spare token on the cheapest
// place, dummy slots of sequence length 1 (the truth's padding), taken over the ranks, plus the
// global terms at P tokens a rank and depth d. So the step can expect at most
// max over (P, d) of bound tokens / bound time per us. This holds for a truth whose attention does
// not fall when a query token moves from a real request to a dummy slot (V1, V2 and the fitted
// sums); a kernel-grid truth's waves can break it, so results.md uses it on V2 only. Also returns
// the expected tokens of the plan in verify_ (true acceptance, the same worth).
std::pair<double, double> Simulation::StepBound(int depth) {
  const int window = cfg_.k_max + 1;
  const bool depth_costs = truth_.global.draft_per_step_us > 0;
  // Per rank: its requests' draft worths (position, survival) and its bonus tokens.
  std::vector<std::vector<std::pair<int32_t, double>>> worth(num_ranks_);
  std::vector<double> bonus(num_ranks_, 0.0);
  std::vector<int64_t> base(num_ranks_, 0);
  double expected = 0;
  int64_t max_base = 0;
  for (int r = 0; r < num_ranks_; ++r) {
    for (size_t i = 0; i < ranks_[r].size(); ++i) {
      const InflightRequest& a = ranks_[r][i];
      ++base[r];
      if (a.finished_step >= 0) continue;
      bonus[r] += 1;
      const int32_t useful = static_cast<int32_t>(std::clamp<int64_t>(a.remaining - 1, 0, cfg_.k_max));
      for (int32_t j = 1; j <= useful; ++j) worth[r].push_back({j, a.truth_curve.Accept(j)});
      expected += a.truth_curve.ExpectedTokens(std::min(verify_[r][i], useful));
    }
    std::sort(worth[r].begin(), worth[r].end(), [](const auto& x, const auto& y) { return x.second > y.second; });
    max_base = std::max(max_base, base[r]);
  }
  std::vector<int32_t> tiers(cfg_.token_tiers.begin(), cfg_.token_tiers.end());
  tiers.erase(std::remove_if(tiers.begin(), tiers.end(), [&](int32_t t) { return t < max_base; }), tiers.end());
  if (tiers.empty()) tiers.push_back(static_cast<int32_t>(max_base));
  double best = 0;
  std::vector<RequestLoad> loads;
  for (int32_t tier : tiers) {
    double attn = 0;
    for (int r = 0; r < num_ranks_; ++r) {
      loads.clear();
      for (const InflightRequest& a : ranks_[r]) loads.push_back({a.ctx, 1});
      const dspark::Padding pad = dspark::PadToTier(tier, base[r], base[r], cfg_.max_batch_per_rank, window);
      if (pad.last_row_tokens > 0) loads.back().query_tokens += static_cast<int32_t>(pad.last_row_tokens);
      for (int32_t t : pad.pad_tokens) loads.push_back({1, t});
      attn = std::max(attn, truth_.attention.AttentionUs(truth_.attention.Aggregate(loads)));
    }
    for (int d = depth_costs ? 0 : cfg_.k_max; d <= cfg_.k_max; ++d) {
      double tokens = 0;
      for (int r = 0; r < num_ranks_; ++r) {
        int64_t room = tier - base[r];
        tokens += bonus[r];
        for (const auto& [pos, p] : worth[r]) {
          if (room <= 0) break;
          if (pos > d) continue;
          tokens += p;
          --room;
        }
      }
      const double time_us = attn + truth_.global.StepUs(static_cast<double>(num_ranks_) * tier, d);
      best = std::max(best, tokens / time_us);
    }
  }
  (void)depth;
  return {best, expected};
}

// Draws each running request's accepted tokens and feeds the estimators and SLO floors (N steps
// late with lag N). A request emits at most what it has left; one that emits its last token
// finishes (its TPOT counts now) and stays in the batch until the engine learns of it.
absl::Status Simulation::Progress(double step_us) {
  pending_.emplace_back();
  double step_tokens = 0;
  for (int r = 0; r < num_ranks_; ++r) {
    for (size_t i = 0; i < ranks_[r].size(); ++i) {
      InflightRequest& a = ranks_[r][i];
      const int k = verify_[r][i];
      totals_.k_sum += k;
      totals_.k_count += 1;
      if (a.finished_step >= 0) continue;  // its work this step is wasted
      const std::array<double, kMaxDraftLen>& rates =
          cfg_.step_acceptance_sigma > 0 ? a.step_rates : a.rates;
      int m = 0;
      while (m < k && unif_(rng_) < rates[m]) ++m;
      if (cfg_.confidence_sigma >= 0 && k >= 1) {
        confidence_samples_.emplace_back(static_cast<float>(a.confidence.Accept(1)), m >= 1);
      }
      const int64_t emitted = std::min<int64_t>(m + 1, a.remaining);
      pending_.back().push_back({r, a.id, k, m, step_us, emitted, false});
      a.ctx += emitted;
      a.remaining -= emitted;
      res_.tokens += static_cast<double>(emitted);
      step_tokens += static_cast<double>(emitted);
      if (a.remaining > 0) continue;
      a.finished_step = step_;
      tpots_.push_back((now_us_ - a.start_us) / 1000.0 / a.output);
      latencies_.push_back((now_us_ - a.start_us) / 1000.0);
      ++res_.requests_finished;
      pending_.back().push_back({r, a.id, 0, 0, 0, 0, true});
    }
  }
  if (planned_now_ && planned_tokens_ > 0) {
    totals_.planned_tokens_sum += planned_tokens_;
    totals_.planned_steps_tokens += step_tokens;
  }
  return ApplyObservations();
}

void Simulation::Retire() {
  for (int r = 0; r < num_ranks_; ++r) {
    auto& reqs = ranks_[r];
    for (size_t i = 0; i < reqs.size();) {
      if (reqs[i].finished_step < 0 || step_ - reqs[i].finished_step < cfg_.stale_steps) {
        ++i;
        continue;
      }
      router_.ObserveFinished(reqs[i].output);
      reqs[i] = std::move(reqs.back());
      reqs.pop_back();
      verify_[r][i] = verify_[r].back();
      verify_[r].pop_back();
      --active_;
    }
  }
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
      if (absl::Status s = slos_[o.rank].Observe(o.id, o.step_us, o.emitted); !s.ok()) return s;
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
    const auto [bound_rate, expected] =
        cfg_.step_bound && padded_ && !truth_.per_rank_draft ? StepBound(*depth) : std::pair(0.0, 0.0);
    const double step_us = Time(*depth);
    if (bound_rate > 0) {
      totals_.bound_tokens += bound_rate * step_us;
      totals_.expected_tokens += expected;
      totals_.bound_time_us += step_us;
    }
    now_us_ += step_us;
    if (absl::Status s = ObserveSps(step_us); !s.ok()) return s;
    if (absl::Status s = Progress(step_us); !s.ok()) return s;
    Retire();
    ++res_.steps;
    ++step_;
  }
  if (res_.steps == 0) return absl::FailedPreconditionError("replay ran no decode step");
  totals_.Finish(res_, now_us_, tpots_, latencies_);
  if (!confidence_samples_.empty()) res_.confidence_auc = Auc(std::move(confidence_samples_));
  for (const dspark::OnlineSps& o : online_sps_) res_.dspark_table_rebuilds += o.rebuilds();
  res_.dspark_table_rebuilds -= res_.dspark_warmup_rebuilds;
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
    case VerifyMode::kDspark: return "dspark";
    case VerifyMode::kDsparkFill: return "dspark_fill";
  }
  return "?";
}

bool IsDspark(VerifyMode m) { return m == VerifyMode::kDspark || m == VerifyMode::kDsparkFill; }

std::string DsparkTableName(DsparkTable t) {
  switch (t) {
    case DsparkTable::kProfiled: return "profiled";
    case DsparkTable::kWorkload: return "workload";
    case DsparkTable::kAdditive: return "additive";
    case DsparkTable::kOnline: return "online";
    case DsparkTable::kContext: return "context";
  }
  return "?";
}

absl::StatusOr<DsparkTable> ParseDsparkTable(const std::string& name) {
  for (DsparkTable t : {DsparkTable::kProfiled, DsparkTable::kWorkload, DsparkTable::kAdditive,
                        DsparkTable::kOnline, DsparkTable::kContext}) {
    if (name == DsparkTableName(t)) return t;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "DSpark table '", name, "' is not one of profiled, workload, additive, online, context"));
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
  if (IsDspark(cfg.verify) && cfg.dspark_table == DsparkTable::kOnline) {
    // Warm-up passes: the same trace and seed, each carrying the profilers of the pass before.
    std::optional<Simulation> previous;
    for (int pass = 0; pass < cfg.dspark_online_warmup; ++pass) {
      absl::StatusOr<Simulation> warm = Simulation::Create(cfg, truth, trace);
      if (!warm.ok()) return warm.status();
      if (previous) {
        if (absl::Status s = warm->AdoptOnlineSps(*previous); !s.ok()) return s;
      }
      if (absl::StatusOr<RunResult> r = warm->Run(); !r.ok()) return r.status();
      previous.emplace(*std::move(warm));
    }
    if (previous) {
      if (absl::Status s = simulation->AdoptOnlineSps(*previous); !s.ok()) return s;
    }
  }
  absl::StatusOr<RunResult> res = simulation->Run();
  if (!res.ok()) return res.status();
  res->wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  return res;
}

}  // namespace dpbalance::replay
