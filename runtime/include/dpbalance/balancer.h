// dpbalance/balancer.h — the per-rank balancer an engine calls once per decode step.
//
// Contract
// - `Create` runs a handshake all-gather: every rank must run the same summary version and the
//   same config hash. On a mismatch every rank sees the same gathered bytes, so every rank
//   disables itself (and logs why) consistently; Create still succeeds and `Plan` then returns
//   the engine's default verify lengths. Create fails only on bad arguments.
// - `Plan(batch)` always fills `verify_len` (never throws, never blocks longer than the
//   timeout): the balanced lengths, or on any failure the engine's default length
//   min(default_k, k_cap) with the failure counted and a rate-limited warning. A rank whose own
//   input is bad still joins the all-gather (with a record marked unusable), so no other rank
//   waits for it (`Abstain` does the same for a step with no batch at all). On failure the
//   lengths are the defaults cut to the draft depth the rank returns, which is the agreed one
//   whenever the other ranks planned with its record. After `max_consecutive_failures`
//   failures in a row the balancer disables; on an ordered backend (AllGather::ordered) a
//   disabled rank still joins every step's all-gather, with a zero record.
// - `Report(step)` feeds measured times and accept counts: the acceptance estimator, the
//   predicted-vs-measured error, the online cost-model refit (OnlineCostModel, when
//   `online_calibration`), and the next summary's "previous step" fields.
// - A/B epochs (`ab_epoch_steps` > 0): balancing is on in even epochs and off in odd ones, by
//   step number (the smallest step index among the gathered records), with no extra traffic.
// - Not thread-safe: one Balancer per rank, called from that rank's step thread.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "dpbalance/acceptance.h"
#include "dpbalance/allgather.h"
#include "dpbalance/lag.h"
#include "dpbalance/metrics.h"
#include "dpbalance/planner.h"
#include "dpbalance/quiet.h"
#include "dpbalance/tpot_slo.h"

namespace dpbalance {

class OnlineCostModel;  // calibration.h (internal): the online refit a Balancer may own
class OnlineStepTerms;  // step_terms.h (internal): the step terms' online fit

struct BalancerConfig {
  PlannerConfig planner;                   // num_ranks, mode, k_max, default_k, global terms...
  CostModel model = CostModel::PublishedV2();
  absl::Duration timeout = absl::Milliseconds(50);
  int max_consecutive_failures = 8;
  int ab_epoch_steps = 0;                  // 0: no A/B
  int log_every_steps = 1000;              // periodic one-line summary (0: never)
  std::string metrics_file;                // JSON lines, one per log period (empty: none)
  double acceptance_prior_strength = 4.0;
  AcceptanceModel acceptance_model = AcceptanceModel::kBeta;  // DPB_ACCEPTANCE (acceptance.h)
  bool online_calibration = true;          // refit `model` from this rank's measured attention
  // Per-request TPOT SLO (decode time / emitted tokens), us: a request that would exceed it if
  // it emitted only its bonus token this step gets the shortest verify length, up to the
  // default, whose expected tokens keep it within (TpotSlo). 0: none.
  double tpot_slo_us = 0;
  // Attention TP (plugin ABI v2): processes per DP rank that each run a Balancer for the same
  // batch; the all-gather group is num_ranks x attn_tp_size in (dp rank, attn_tp rank) order.
  // Members plan from identical inputs: the same batch and accept counts, and the measured times
  // of member 0 (from the exchange), never their own; their records carry a digest of the
  // planning inputs, and a DP rank whose members disagree falls back on all of them.
  int attn_tp_size = 1;
  int attn_tp_rank = 0;
  int abi_version = 1;          // the plugin ABI the engine uses: every rank must agree
  // true: the exchange runs on every step even once disabled (with a record that still carries
  // this rank's token total), so an engine whose own DP sync rides in the exchange keeps it.
  bool always_exchange = false;
  // An engine that plans step t+1 before step t's results are in (Report(step) one step late):
  // which parts of lag.h's prediction the plan uses for a request whose earlier plans are not
  // yet reported (LagPredict bits; kPredictNone plans on the state the engine passes as if it
  // were current). An engine that reports every step before planning the next has nothing
  // pending, and the plan is the same either way.
  uint32_t lag_predict = kPredictAll;
  // Quiet mode (quiet.h): skip the exchange on spans of steps while every decision keeps the
  // default plan. Only where the exchange is the plugin's alone. Hashed only when on.
  QuietConfig quiet;
  // Learn planner.global's step terms online (OnlineStepTerms, step_terms.h) from the gathered
  // records, with planner.global as the prior: ffn_fixed_us, ffn_per_token_us,
  // draft_per_step_us (with an agreed depth) and step_overhead_us (the plugin's own time).
  bool learn_step_terms = true;
  // The clock of the plan calls (the engine cycle the step terms learn from, and each call's own
  // time, own_us); null: absl::Now. Not hashed: a test's fake clock.
  absl::Time (*clock)() = nullptr;
  uint64_t Hash() const;                   // what the handshake compares
};

// A request as the engine last saw it: `ctx_tokens` and `k_cap` count what the engine knows,
// before the tokens of any step it scheduled but has not yet reported (those the balancer
// predicts, BalancerConfig::lag_predict).
struct BalancerRequest {
  int64_t request_id = 0;
  int64_t ctx_tokens = 0;
  int32_t k_min = 0;
  int32_t k_cap = 0;                          // <= k_max; tokens the request may still emit - 1
  absl::Span<const float> draft_confidence;  // optional, per draft position
};

struct BalancerAccepted {
  int64_t request_id = 0;
  int32_t verify_len = 0;
  int32_t accepted = 0;
  bool finished = false;  // the request left the batch: forget its statistics
};

// One step of a rank (plugin ABI v2): its decode batch and what else it runs.
struct StepInput {
  absl::Span<const BalancerRequest> batch;
  int64_t kv_free_tokens = -1;  // < 0: unlimited
  int64_t extra_tokens = 0;     // query tokens beside verify (prefill chunks)
  uint16_t kind = 0;            // kSummaryExtend | kSummaryNoVerify | kSummaryIdle
  // An error the caller found in the step's input (e.g. a request without an id): the rank runs
  // its default lengths and still joins the exchange, marked unusable.
  absl::Status input_error;
};

// Every DP rank's token total and flags for the step, derived from the one exchange identically
// on every rank (Planner::RankTokens).
struct StepTotals {
  bool known = false;                // false: the exchange failed; only this rank's own is known
  std::vector<int64_t> rank_tokens;  // per DP rank, -1 when unknown
  std::vector<uint16_t> rank_flags;  // per DP rank: kSummary* bits (kSummaryValid: planned)
  int64_t padded_tokens = 0;         // the smallest tier >= the largest total (the max itself
                                     // without tiers or beyond the largest)
  uint16_t any_flags = 0;            // OR of rank_flags
};

struct PlanOutcome {
  bool balanced = false;  // false: the default lengths were returned
  int draft_depth = 0;    // draft depth: the instance's agreed one, or with per-rank depths this
                          // rank's own (its deepest verify length); the default k when no rank
                          // balanced. Never below any returned verify length.
  absl::Status status;    // why not balanced, when it was a failure
  uint64_t step = 0;      // this plan's step index, for Report
};

struct ArmSummary {
  int64_t epochs = 0;
  double bubble_fraction = 0, bubble_ci95 = 0;
  double goodput_tok_per_s = 0, goodput_ci95 = 0;
};

// The step of the latest Report, as it was planned and measured (Balancer::LastReport): what a
// host exports per step (e.g. a histogram of the prediction error) beside the running means of
// BalancerStats.
struct ReportedStep {
  uint64_t step = UINT64_MAX;  // the plan reported; UINT64_MAX: no report yet
  double predicted_us = -1;    // this rank's predicted attention for it; < 0: not balanced
  double measured_us = -1;     // the attention time the report gave
  double barrier_us = -1;      // the agreed barrier; < 0: not balanced
  bool extra_work = false;     // the rank ran prefill beside the plan (not priced by it)
};

struct BalancerStats {
  int64_t steps = 0;
  int64_t balanced_steps = 0;
  int64_t kept_default_steps = 0;     // balanced steps whose plan the default guard kept at the
                                      // default lengths (PlannerConfig::min_plan_gain)
  int64_t fallbacks = 0;
  bool enabled = true;
  std::string disabled_reason;
  double bubble_fraction = 0;         // instance, from measured attention times (mean over steps)
  double bubble_us = 0;               // mean idle time per rank per step
  double predicted_error = 0;         // mean |predicted - measured| / measured, this rank
  // Instance, balanced steps with one agreed depth: measured max-rank attention / the planned
  // barrier (1: steps run as planned; 0: no such step yet). Per-rank errors that look small
  // add up here, since the barrier is a max: whichever rank the model underestimates sets it.
  double barrier_over_plan = 0;
  double tokens_per_step = 0;         // instance tokens per step
  double goodput_tok_per_s = 0;       // instance tokens / instance step time
  ArmSummary arm_on, arm_off;         // A/B arms (epochs == 0 without A/B)
  int64_t tp_mismatches = 0;          // steps this DP rank's attention-TP members disagreed
  int64_t exchange_failures = 0;      // exchanges (handshake included) that failed
  double max_exchange_ms = 0;         // longest exchange, handshake included
  double own_us = 0;                  // median of this rank's recent plan calls (RankSummary::own_us)
  int64_t quiet_steps = 0;            // steps that skipped the exchange (quiet.h)
  int64_t quiet_spans = 0;            // quiet spans started
  // The step terms the planner prices with now: planner.global, learnt online when
  // BalancerConfig::learn_step_terms (then the rows fitted, the fits, the resets after the ranks'
  // digests differed, and which terms the latest fit learnt; the rest keep the flags' values).
  GlobalCost step_terms;
  bool step_terms_online = false;
  int64_t step_terms_rows = 0, step_terms_fits = 0, step_terms_resets = 0;
  bool step_terms_per_token_learnt = false, step_terms_draft_learnt = false;
  double step_terms_sigma_us = 0;     // the latest fit's robust residual sigma
};

class Balancer {
 public:
  static absl::StatusOr<std::unique_ptr<Balancer>> Create(BalancerConfig config, int rank,
                                                          std::unique_ptr<AllGather> comm);
  // A rank whose init failed (a bad flag) once its group was known: it joins the peers'
  // handshake on `comm` with a refusal carrying `why`, so every peer's Create fails the
  // handshake at once, naming this rank and why, instead of waiting `timeout` for it. Returns
  // the exchange's status (the peers may have given up already).
  static absl::Status Refuse(std::unique_ptr<AllGather> comm, int num_ranks, int attn_tp_size,
                             int abi_version, absl::Duration timeout, std::string_view why);
  ~Balancer();

  PlanOutcome Plan(absl::Span<const BalancerRequest> batch, int64_t kv_free_tokens,
                   absl::Span<int32_t> verify_len);
  // The same for one step of any kind, also giving every DP rank's token total (`totals` may be
  // null). A kNoVerify step must pass k_cap = 0; an idle one an empty batch.
  PlanOutcome Plan(const StepInput& step, absl::Span<int32_t> verify_len, StepTotals* totals);
  // A step this rank cannot plan (the engine passed arguments that describe no batch, `why`):
  // it still joins the exchange, with a record marked unusable, so its peers plan without it
  // instead of waiting for it. The outcome carries `why` and the depth to draft.
  PlanOutcome Abstain(const absl::Status& why);
  // Reports the latest plan.
  absl::Status Report(double attention_us, double step_us,
                      absl::Span<const BalancerAccepted> accepted);
  // Reports plan `step` (PlanOutcome::step): the latest or the one before it, for an engine that
  // plans step t+1 before step t's results are in. Measurements of an older plan are dropped
  // (the accept counts still train the acceptance estimator).
  absl::Status Report(uint64_t step, double attention_us, double step_us,
                      absl::Span<const BalancerAccepted> accepted);
  BalancerStats Stats() const;
  // The latest reported step (its plan's prediction and the measured time); `step` is
  // UINT64_MAX before the first report, and its prediction < 0 when the plan was not found.
  const ReportedStep& LastReport() const { return last_report_; }
  // The model this rank prices with now (the online refit's latest, when it runs).
  const CostModel& model() const { return planner_.model(); }
  bool enabled() const { return enabled_; }

 private:
  // The latest reported step: its measurements go out with the next record (once), and the
  // next exchange accounts the instance's measured step against its plan.
  struct Measured {
    uint64_t step = UINT64_MAX;      // the plan it measured
    bool fresh = false;              // not yet sent
    bool planned = false;            // its plan was found (arm and barrier below are known)
    bool arm_on = true;
    double barrier_us = -1;
    double attention_us = -1, step_us = -1, tokens = -1;
  };
  Balancer(BalancerConfig config, int rank, std::unique_ptr<AllGather> comm, Planner planner);
  absl::Status Handshake();
  // The one all-gather: `send` out, every rank's record into gathered_.
  absl::Status Exchange(const RankSummary& send, absl::Duration timeout);
  // PlanStepUntimed, timed into own_us_; or on a quiet step QuietStep.
  PlanOutcome PlanStep(const StepInput& step, absl::Span<int32_t> verify_len, absl::Status local,
                       StepTotals* totals);
  PlanOutcome PlanStepUntimed(const StepInput& step, absl::Span<int32_t> verify_len,
                              absl::Status local, StepTotals* totals);
  // What every step starts with: the engine's default lengths in `verify_len`, this rank's own
  // total in `totals`, the default depth, and the step's index (step_ advanced).
  PlanOutcome BeginStep(const StepInput& step, absl::Span<int32_t> verify_len, StepTotals* totals);
  // A step of a quiet span: the defaults, no exchange (quiet.h). The latest report waits for the
  // next exchange; a bad local input is a fallback here and is said in that exchange.
  PlanOutcome QuietStep(const StepInput& step, absl::Span<int32_t> verify_len,
                        const absl::Status& local, StepTotals* totals);
  // Idle rows (IdleRowRecord) in gathered_ into records of this config that plan nothing, and
  // which DP ranks sent one (idle_rows_).
  void ReadIdleRows();
  // The DP ranks' records of the exchange: gathered_ itself, or with attention TP each DP rank's
  // member 0, marked unusable where its members' digests differ.
  absl::Span<const RankSummary> DpRecords() const;
  // With attention TP: the DP view of gathered_ (leaders_); true if this DP rank's members agree.
  bool GatherLeaders();
  // With attention TP: the SLO and refit observations of the last report, priced with member 0's
  // measured times from this exchange.
  void ApplyLeaderMeasurements();
  uint32_t InputDigest(const StepInput& step) const;
  static int64_t OwnTokens(const StepInput& in, absl::Span<const int32_t> lens);
  // Every DP rank's total from the records (this rank's own from what it runs, `own_len`, when
  // it `fell_back_alone` from a decision the others applied).
  void FillTotals(const GlobalDecision* decision, bool balanced, const StepInput& in,
                  absl::Span<const int32_t> own_len, bool fell_back_alone, StepTotals* totals);
  // PlanStep's steps: the engine's batch as the planner's (acceptance curves, SLO floors) into
  // plan_batch_; this step's index and previous measurements on own_summary_ (a bare record
  // when `local` failed); the agreed step, A/B arm and epoch, with the previous step accounted
  // (returns whether the arm is on); the decision and this rank's lengths into `out`.
  absl::Status ToPlanBatch(absl::Span<const BalancerRequest> batch);
  // The verify lengths of `step` for its batch, until a report covers them (unreported_).
  void RememberUnreported(uint64_t step, absl::Span<const BalancerRequest> batch,
                          absl::Span<const int32_t> verify_len);
  // Drops what a report of `step` (and the steps before it) covers.
  void ForgetReported(uint64_t step);
  void StampOwnSummary(const absl::Status& local, uint64_t step, const StepInput& in,
                       absl::Span<const int32_t> fallback_len, const Measured& measured);
  bool AgreeOnStep(uint64_t step, const Measured& measured);
  // Returns the decision it applied (null when it fell back).
  const GlobalDecision* DecideAndAssign(absl::Span<const BalancerRequest> batch,
                                        absl::Span<int32_t> verify_len, PlanOutcome& out);
  // Before the exchange only this rank's own total (of `own_len`, its defaults) is known.
  void StartTotals(const StepInput& in, absl::Span<const int32_t> own_len, StepTotals* totals) const;
  // After the exchange: true when a peer's record ends the step before planning (a disabled
  // peer disables this rank too; an empty record pauses balancing for the step), with `out`
  // and `totals` filled.
  bool PeersStopStep(const StepInput& in, absl::Span<const int32_t> own_len, PlanOutcome& out,
                     StepTotals* totals);
  // This rank's own input failed (`local`), or the engine sent an idle row for it: its
  // defaults, at the depth the others agree on (a failure counted only in the first case).
  void FailLocally(const absl::Status& local, bool arm_on, const StepInput& in,
                   absl::Span<const int32_t> own_len, PlanOutcome& out, StepTotals* totals);
  // Disabled, on an ordered backend or with always_exchange: join this step's exchange with a
  // record marked kSummaryDisabled that still carries this rank's token total.
  void KeepInStep(const StepInput& in, absl::Span<const int32_t> fallback_len,
                  const Measured& measured, StepTotals* totals);
  // The engine's default lengths, never deeper than `depth_cap` (the drafted depth).
  void Fallback(absl::Span<const BalancerRequest> batch, absl::Span<int32_t> verify_len,
                int depth_cap = kMaxDraftLen) const;
  void Fail(const absl::Status& s);
  void Disable(const std::string& why);
  // `planned_barrier`: the previous step's agreed barrier, < 0 when it was not balanced.
  void AccountPreviousStep(absl::Span<const RankSummary> all, bool prev_arm_on,
                           double planned_barrier);
  void MaybeLog();
  bool ArmOn(uint64_t step) const;

  BalancerConfig config_;
  int rank_;
  std::unique_ptr<AllGather> comm_;
  Planner planner_;
  AcceptanceEstimator estimator_;
  TpotSlo slo_;
  // DSpark modes: decode steps each running request has been planned for (capped at the lag of
  // DSpark's survivals), so a request without lagged survivals counts 1 in the budget.
  absl::flat_hash_map<int64_t, int32_t> dspark_steps_;
  // Per request, the verify lengths of the steps planned for it and not yet reported, oldest
  // first (at most kMaxUnreportedSteps): the pending steps of lag.h's prediction.
  static constexpr int kMaxUnreportedSteps = 4;
  struct Unreported {
    std::array<uint64_t, kMaxUnreportedSteps> step{};
    std::array<int32_t, kMaxUnreportedSteps> verify_len{};
    int count = 0;
  };
  absl::flat_hash_map<int64_t, Unreported> unreported_;
  uint64_t reported_through_ = UINT64_MAX;  // the newest step reported (UINT64_MAX: none yet)
  bool enabled_ = true;
  bool handshake_ok_ = false;  // every rank agreed on versions, ABI, group and config
  std::string disabled_reason_;
  int consecutive_failures_ = 0;
  uint64_t step_ = 0;
  std::vector<PlanRequest> plan_batch_;
  std::vector<RankSummary> gathered_;  // the group's records: num_ranks x attn_tp_size
  std::vector<RankSummary> leaders_;   // attention TP: member 0 of each DP rank
  std::vector<bool> idle_rows_;        // per DP rank: the engine sent its idle row this step
  GlobalDecision decision_;            // the last decision applied
  QuietSchedule quiet_;
  RankSummary own_summary_{};  // this rank's record of the step
  // The last two plans, by step index (an engine may report step t after planning t+1).
  struct Planned {
    uint64_t step = UINT64_MAX;      // UINT64_MAX: empty (or reported)
    bool arm_on = true;              // the agreed A/B arm
    double barrier_us = -1;          // the agreed barrier (< 0: not balanced)
    double predicted_us = -1;        // this rank's predicted attention (< 0: not balanced)
    // The rank ran tokens beside the planned batch (an extend step: prefill chunks): its
    // measured attention includes work the plan did not price, so it neither refits the model
    // nor counts in the predicted error.
    bool extra_work = false;
    BatchAggregates agg;             // the batch as planned, for the online refit
  };
  std::array<Planned, 2> planned_;
  Measured measured_;
  ReportedStep last_report_;
  std::vector<RequestLoad> planned_loads_;
  std::unique_ptr<OnlineCostModel> online_;
  // The step terms' online fit (null when off): per step, when its plan call started, and what
  // the exchange said it runs (its FFN tokens, draft depth, and whether it is a row: every rank's
  // total known, no prefill beside it), until a later exchange brings its measured times.
  std::unique_ptr<OnlineStepTerms> step_terms_;
  struct StepStart {
    uint64_t step = UINT64_MAX;
    absl::Time at;
  };
  std::array<StepStart, 4> step_starts_;
  struct StepRun {
    uint64_t step = UINT64_MAX;
    double ffn_tokens = 0;
    int draft_depth = 0;
    bool row = false;
  };
  std::array<StepRun, 8> step_runs_;
  // A lagged exchange (an engine whose per-step sync runs after its scheduler planned, vLLM:
  // the records a plan call gets back were sent by an earlier call): the measurement each of
  // this rank's records carried, by the record's step index, so that what the gathered records
  // measured is paired with this rank's own measurement of the same step.
  struct SentMeasured {
    uint32_t step_idx = UINT32_MAX;
    Measured measured;
  };
  std::array<SentMeasured, 8> sent_measured_;
  // The measurement that went out in this rank's own gathered record: `sent_now` when the
  // exchange returned the record this call sent (every engine but a lagged one), else the one
  // sent with the record's step (not fresh when it is no longer known).
  Measured ArrivedMeasured(uint64_t step, const Measured& sent_now) const;
  // This process's own row of the latest exchange (what the engine delivered for it).
  const RankSummary& OwnGathered() const { return gathered_[static_cast<size_t>(comm_->rank())]; }
  std::vector<int64_t> scratch_tokens_;  // FillTotals' rank totals when the engine asks for none
  absl::Time Now() const { return config_.clock ? config_.clock() : absl::Now(); }
  // The engine cycle of plan `step`: its plan call to the next one, us; < 0 unknown.
  double CycleUs(uint64_t step) const;
  // After the exchange, on every rank alike: the ranks' step-term digests compared (a difference
  // resets every rank to the prior), the measured step's row fitted, the planner's terms updated.
  void LearnStepTerms(const Measured& measured);
  // What the exchange says step `step` runs (every DP rank's total as the records say, from
  // FillTotals), for its later row.
  void RememberStepRun(uint64_t step, const GlobalDecision* decision, bool balanced,
                       absl::Span<const int64_t> record_tokens);
  int64_t epoch_ = -1;
  // Metrics.
  int64_t balanced_steps_ = 0, kept_default_steps_ = 0, fallbacks_ = 0;
  BubbleMeter bubble_;  // measured attention times of every step (BalancerStats: per-step mean)
  RunningStat predicted_error_, tokens_per_step_, barrier_over_plan_;
  bool warned_barrier_ = false;
  double tokens_sum_ = 0, time_sum_us_ = 0;
  ArmStats arm_on_, arm_off_;
  int64_t last_warn_step_ = -1000000;
  int64_t tp_mismatches_ = 0, exchange_failures_ = 0;
  double max_exchange_ms_ = 0;
  // This rank's own time per step: the median of its last kOwnWindow exchanged plan calls
  // (exchange included), sent as RankSummary::own_us for the TPOT guard's measured overhead. A
  // median, because one call can wait out a peer's start-up or a stall (the first exchange of a
  // live vLLM run waits ~0.85 s for the other rank), and a mean would charge that to every plan
  // for as long as it stays in the window; with quiet mode, that is many steps.
  static constexpr int kOwnWindow = 32;
  std::array<double, kOwnWindow> own_samples_{};
  int64_t own_calls_ = 0;
  double own_us_ = 0;
  // Attention TP: the last report's observations, applied with member 0's times.
  struct Pending {
    int64_t request_id;
    int tokens;
  };
  std::vector<Pending> pending_slo_;
  bool pending_refit_ = false;
  BatchAggregates pending_agg_;  // the reported plan's batch, for the pending refit
};

}  // namespace dpbalance
