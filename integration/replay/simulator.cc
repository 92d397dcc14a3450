#include "simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "absl/strings/str_format.h"
#include <optional>

#include "dpbalance/acceptance.h"
#include "dpbalance/calibration.h"
#include "dpbalance/tpot_slo.h"

namespace dpbalance::replay {
namespace {

struct Active {
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
  const int R = cfg.num_ranks;
  if (R < 1) return absl::InvalidArgumentError(absl::StrFormat("--dp %d must be >= 1", R));
  if (cfg.static_k < 0 || cfg.static_k > cfg.k_max || cfg.k_max > kMaxDraftLen) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "static k %d / k_max %d must satisfy 0 <= k <= k_max <= %d", cfg.static_k, cfg.k_max,
        kMaxDraftLen));
  }
  absl::StatusOr<Router> router = Router::Create(cfg.routing, R, cfg.planner_model);
  if (!router.ok()) return router.status();

  const bool planned = cfg.verify != VerifyMode::kStatic;
  PlannerConfig pc;
  pc.num_ranks = R;
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
  // One online model for the instance (every rank is the same hardware): it learns from every
  // rank's measured attention each step, as each rank's own Balancer does in an engine.
  std::optional<OnlineCostModel> online;
  if (cfg.planner_online && cfg.verify != VerifyMode::kOracle) online.emplace(cfg.planner_model);

  std::mt19937_64 rng(cfg.seed);
  std::normal_distribution<double> shift(0, cfg.acceptance_sigma);
  std::normal_distribution<double> noise(0, 1);
  std::uniform_real_distribution<double> unif(0, 1);
  const auto profile = MtpK8ConditionalProfile();
  std::vector<AcceptanceEstimator> estimators(
      R, AcceptanceEstimator(cfg.acceptance_prior_strength, profile));
  // Each rank's own TPOT SLO floors, as each rank's Balancer keeps them in an engine.
  std::vector<TpotSlo> slos(R, TpotSlo(planned ? cfg.tpot_slo_us : 0));

  std::vector<std::vector<Active>> ranks(R);
  std::vector<RankLoad> loads(R);
  std::vector<std::vector<PlanRequest>> batches(R);
  std::vector<std::vector<int32_t>> verify(R);
  std::vector<int64_t> kv_free(R, -1);
  std::vector<BatchAggregates> aggs(R);
  std::vector<RequestLoad> rank_batch;  // one rank's batch in step 3, reused across steps
  std::vector<double> tpots;
  size_t next = 0;
  int64_t active = 0;
  double now_us = 0;
  RunResult res;
  double planned_step_sum = 0, actual_step_sum = 0;  // planner rows: the plan's step vs truth
  double sum_mean_attn = 0, sum_max_attn = 0, v1_act = 0, v1_ideal = 0, v2_act = 0, v2_ideal = 0;
  double ideal_time_us = 0, token_balance_sum = 0, k_sum = 0, k_count = 0, depth_sum = 0;
  int64_t blocked_steps = 0;
  double model_error_sum = 0, model_error_n = 0;

  auto add_to_load = [&](RankLoad& l, const Active& a) {
    l.num_requests += 1;
    l.ctx_tokens += a.ctx;
    l.reserved_tokens += a.ctx + a.remaining;
    l.agg.Add({a.ctx, static_cast<int32_t>(cfg.routing.query_tokens_per_request)});
  };
  auto rank_load = [&](int r) {
    RankLoad l;
    l.capacity_tokens = cfg.rank_capacity_tokens;
    l.max_requests = cfg.max_batch_per_rank;
    for (const Active& a : ranks[r]) add_to_load(l, a);
    return l;
  };

  while (true) {
    // Step 1: admission.
    if (next >= trace.size()) break;  // the trace no longer feeds the instance: stop measuring
    for (int r = 0; r < R; ++r) loads[r] = rank_load(r);
    while (next < trace.size()) {
      const TraceRequest& t = trace[next];
      if (cfg.open_loop ? t.arrival_ms / cfg.arrival_speedup * 1000.0 > now_us
                        : active >= cfg.inflight) {
        break;
      }
      absl::StatusOr<int> r = router->Route({t.input_tokens, t.output_tokens}, loads);
      if (!r.ok()) {
        if (absl::IsResourceExhausted(r.status())) {  // waits, in order
          ++blocked_steps;
          break;
        }
        return r.status();
      }
      Active a;
      a.id = static_cast<int64_t>(next);
      a.ctx = t.input_tokens;
      a.remaining = t.output_tokens;
      a.output = t.output_tokens;
      a.start_us = now_us;
      a.rates = ShiftedProfile(profile, shift(rng));
      a.truth_curve = *AcceptanceCurve::FromConditional(a.rates);
      ranks[*r].push_back(a);
      add_to_load(loads[*r], a);
      ++active;
      ++next;
    }
    if (active == 0) {
      if (!cfg.open_loop) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "request %d (input %d + output %d tokens) fits on no rank of capacity %d tokens",
            next, trace[next].input_tokens, trace[next].output_tokens, cfg.rank_capacity_tokens));
      }
      now_us = std::max(now_us, trace[next].arrival_ms / cfg.arrival_speedup * 1000.0);
      continue;
    }

    // Step 2: verify lengths.
    int depth = cfg.static_k;
    for (int r = 0; r < R; ++r) {
      batches[r].resize(ranks[r].size());
      verify[r].resize(ranks[r].size());
      for (size_t i = 0; i < ranks[r].size(); ++i) {
        const Active& a = ranks[r][i];
        PlanRequest& p = batches[r][i];
        p.ctx_tokens = a.ctx;
        p.k_cap = static_cast<int32_t>(std::min<int64_t>(cfg.k_max, a.remaining - 1));
        const int32_t default_len = DefaultVerifyLen(cfg.static_k, p.k_cap);
        if (!planned) {
          verify[r][i] = default_len;
          continue;
        }
        p.acceptance = cfg.verify == VerifyMode::kOracle ? a.truth_curve : estimators[r].Curve(a.id);
        p.k_min = cfg.floor_at_default ? default_len : slos[r].Floor(a.id, default_len, p.acceptance);
      }
    }
    if (planned) {
      absl::StatusOr<GlobalDecision> d = planner->PlanAll(batches, kv_free, &verify);
      if (!d.ok()) return d.status();
      depth = d->draft_depth;
      planned_step_sum += d->step_us;
    }

    // Step 3: truth timing of the step.
    double max_attn = 0, sum_attn = 0, sum_q = 0, max_q = 0;
    BatchAggregates total;
    for (int r = 0; r < R; ++r) {
      rank_batch.clear();
      for (size_t i = 0; i < ranks[r].size(); ++i) rank_batch.push_back({ranks[r][i].ctx, 1 + verify[r][i]});
      aggs[r] = truth.attention.Aggregate(rank_batch);
      double attn = truth.attention.AttentionUs(aggs[r]);
      if (truth.noise_sigma > 0) attn *= std::exp(truth.noise_sigma * noise(rng));
      if (truth.per_rank_draft) {  // this rank's own draft steps run before the barrier
        int rank_depth = 0;
        for (int32_t v : verify[r]) rank_depth = std::max(rank_depth, static_cast<int>(v));
        attn += truth.global.draft_per_step_us * rank_depth;
      }
      if (online && aggs[r].num_requests > 0) {
        // The batch as the online model sees it: its own grid terms, not the truth's.
        const BatchAggregates seen = online->model().Aggregate(rank_batch);
        const double predicted = online->model().AttentionUs(seen);
        model_error_sum += std::abs(predicted - attn) / attn;
        model_error_n += 1;
        online->Observe(seen, attn);
      }
      max_attn = std::max(max_attn, attn);
      sum_attn += attn;
      sum_q += aggs[r].query_tokens;
      max_q = std::max(max_q, aggs[r].query_tokens);
      total.num_requests += aggs[r].num_requests;
      total.query_tokens += aggs[r].query_tokens;
      total.query_key_pairs += aggs[r].query_key_pairs;
      total.key_tokens += aggs[r].key_tokens;
      total.max_query_key_pairs = std::max(total.max_query_key_pairs, aggs[r].max_query_key_pairs);
      total.max_key_tokens = std::max(total.max_key_tokens, aggs[r].max_key_tokens);
    }
    // The same work spread perfectly over the ranks; a request cannot be split, so the ideal
    // rank still holds the instance's longest one (critical-path terms of a fitted model).
    BatchAggregates ideal;
    ideal.num_requests = total.num_requests / R;
    ideal.query_tokens = total.query_tokens / R;
    ideal.query_key_pairs = total.query_key_pairs / R;
    ideal.key_tokens = total.key_tokens / R;
    ideal.max_query_key_pairs = total.max_query_key_pairs;
    ideal.max_key_tokens = total.max_key_tokens;
    ideal.multi_query = total.query_tokens > total.num_requests;
    if (online) planner->set_model(online->model());
    const double global_us = truth.global.StepUs(sum_q, truth.per_rank_draft ? 0 : depth);
    const double step_us = max_attn + global_us;
    if (planned) actual_step_sum += step_us;
    sum_mean_attn += sum_attn / R;
    sum_max_attn += max_attn;
    v1_act += PublishedInstanceCost(PublishedForm::kV1, aggs);
    v2_act += PublishedInstanceCost(PublishedForm::kV2, aggs);
    v1_ideal += PublishedRankCost(PublishedForm::kV1, ideal);
    v2_ideal += PublishedRankCost(PublishedForm::kV2, ideal);
    // A grid truth needs a batch to simulate, which the averaged ideal rank is not: there the
    // ideal attention is the ranks' mean (the bubble-free time of the same assignment).
    const double ideal_attention_us =
        truth.attention.uses_grid() ? sum_attn / R : truth.attention.AttentionUs(ideal);
    ideal_time_us += ideal_attention_us + global_us;
    token_balance_sum += max_q > 0 ? (sum_q / R) / max_q : 1.0;
    depth_sum += depth;
    now_us += step_us;

    // Step 4: acceptance, progress, completion.
    for (int r = 0; r < R; ++r) {
      auto& reqs = ranks[r];
      for (size_t i = 0; i < reqs.size(); ++i) {
        Active& a = reqs[i];
        const int k = verify[r][i];
        int m = 0;
        while (m < k && unif(rng) < a.rates[m]) ++m;
        if (absl::Status s = estimators[r].Observe(a.id, k, m); !s.ok()) return s;
        if (absl::Status s = slos[r].Observe(a.id, step_us, m + 1); !s.ok()) return s;
        a.ctx += m + 1;
        a.remaining -= m + 1;
        res.tokens += m + 1;
        k_sum += k;
        k_count += 1;
      }
      for (size_t i = 0; i < reqs.size();) {
        if (reqs[i].remaining > 0) {
          ++i;
          continue;
        }
        tpots.push_back((now_us - reqs[i].start_us) / 1000.0 / reqs[i].output);
        router->ObserveFinished(reqs[i].output);
        estimators[r].Forget(reqs[i].id);
        slos[r].Forget(reqs[i].id);
        reqs[i] = reqs.back();
        reqs.pop_back();
        verify[r][i] = verify[r].back();
        verify[r].pop_back();
        --active;
        ++res.requests_finished;
      }
    }
    ++res.steps;
  }
  if (res.steps == 0) return absl::FailedPreconditionError("replay ran no decode step");
  res.sim_time_s = now_us / 1e6;
  res.balance_efficiency = sum_mean_attn / sum_max_attn;
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
  res.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  return res;
}

}  // namespace dpbalance::replay
