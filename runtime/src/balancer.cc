#include "dpbalance/balancer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstddef>
#include <fstream>
#include <limits>

#include "absl/strings/str_format.h"
#include "dpbalance/calibration.h"
#include "dpbalance/log.h"
#include "dpbalance/median.h"
#include "dpbalance/step_terms.h"
#include "hash.h"

namespace dpbalance {
namespace {

constexpr uint32_t kHelloMagic = 0x4f4c4548;  // "HELO"
constexpr int64_t kWarnEverySteps = 1000;     // rate limit for step-path warnings
constexpr int64_t kMaxExtraTokens = 1 << 30;  // a step's prefill tokens on one rank, at most

// Query tokens of a rank's verify forward with these lengths: each request's token plus its drafts.
int64_t QueryTokens(absl::Span<const int32_t> lens) {
  int64_t tokens = 0;
  for (int32_t v : lens) tokens += 1 + v;
  return tokens;
}
constexpr int64_t kBarrierWarnSteps = 200;    // balanced steps before judging barrier/plan
constexpr double kBarrierWarnRatio = 1.10;    // warn above this mean measured/planned barrier

// The handshake record travels in a summary-sized slot so one buffer size serves both.
struct Hello {
  uint32_t magic;
  uint16_t summary_version;
  uint16_t abi_version;  // the plugin ABI the engine calls (BalancerConfig::abi_version)
  uint64_t config_hash;
  int32_t num_ranks;     // DP ranks
  int32_t attn_tp_size;  // processes per DP rank
  uint32_t refused;      // 1: the sender's init failed (Balancer::Refuse); `why` says why
  char why[400];         // NUL-terminated
};
static_assert(sizeof(Hello) <= sizeof(RankSummary));

}  // namespace

uint64_t BalancerConfig::Hash() const {
  internal::Fnv1a h;
  h.Value(planner.Hash());
  h.Value(ab_epoch_steps);
  h.Value(online_calibration);
  h.Value(lag_predict);
  h.Value(learn_step_terms);
  if (quiet.after > 0) {  // hashed only when on: configs without it keep their hashes
    h.Value(quiet.after);
    h.Value(quiet.max_steps);
  }
  return h.digest();
}

absl::StatusOr<std::unique_ptr<Balancer>> Balancer::Create(BalancerConfig config, int rank,
                                                           std::unique_ptr<AllGather> comm) {
  if (comm == nullptr) return absl::InvalidArgumentError("balancer: no all-gather backend");
  const int tp = config.attn_tp_size;
  if (tp < 1 || config.attn_tp_rank < 0 || config.attn_tp_rank >= tp ||
      config.planner.num_ranks > std::numeric_limits<int>::max() / std::max(tp, 1)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "balancer: attn_tp_rank %d of attn_tp_size %d is out of range", config.attn_tp_rank, tp));
  }
  const int group = config.planner.num_ranks * tp, group_rank = rank * tp + config.attn_tp_rank;
  if (comm->num_ranks() != group || comm->rank() != group_rank ||
      comm->record_bytes() != sizeof(RankSummary)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "balancer: backend '%s' is process %d of %d with %d-byte records; config says process %d "
        "of %d (DP rank %d of %d, attention-TP rank %d of %d) with %d-byte records",
        comm->name(), comm->rank(), comm->num_ranks(), comm->record_bytes(), group_rank, group,
        rank, config.planner.num_ranks, config.attn_tp_rank, tp, sizeof(RankSummary)));
  }
  if (config.max_consecutive_failures < 1 || config.ab_epoch_steps < 0 ||
      config.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "balancer: max_consecutive_failures %d must be >= 1, ab_epoch_steps %d >= 0, timeout > 0",
        config.max_consecutive_failures, config.ab_epoch_steps));
  }
  if (absl::Status q = config.quiet.Validate(); !q.ok()) return q;
  if (!(std::isfinite(config.tpot_slo_us) && config.tpot_slo_us >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("balancer: tpot_slo_us %g must be finite and >= 0", config.tpot_slo_us));
  }
  absl::StatusOr<Planner> planner = Planner::Create(config.planner, config.model);
  if (!planner.ok()) return planner.status();
  std::unique_ptr<Balancer> b(new Balancer(std::move(config), rank, std::move(comm), *std::move(planner)));
  if (absl::Status s = b->Handshake(); !s.ok()) {
    b->Disable(std::string(s.message()));
  } else {
    b->handshake_ok_ = true;
  }
  return b;
}

Balancer::Balancer(BalancerConfig config, int rank, std::unique_ptr<AllGather> comm,
                   Planner planner)
    : config_(std::move(config)), rank_(rank), comm_(std::move(comm)), planner_(std::move(planner)),
      estimator_(config_.acceptance_prior_strength, MtpK8ConditionalProfile(),
                 config_.acceptance_model),
      slo_(config_.tpot_slo_us),
      quiet_(config_.quiet) {
  gathered_.resize(static_cast<size_t>(config_.planner.num_ranks) * config_.attn_tp_size);
  idle_rows_.assign(config_.planner.num_ranks, false);
  if (config_.attn_tp_size > 1) leaders_.resize(config_.planner.num_ranks);
  // The refit learns the weights of the terms the planner prices: from the planner's copy.
  if (config_.online_calibration) online_ = std::make_unique<OnlineCostModel>(planner_.model());
  if (config_.learn_step_terms) {
    step_terms_ = std::make_unique<OnlineStepTerms>(config_.planner.global, config_.planner.agreed_draft_depth);
  }
}

Balancer::~Balancer() {
  if (config_.log_every_steps > 0 && step_ > 0) MaybeLog();
}

absl::Status Balancer::Refuse(std::unique_ptr<AllGather> comm, int num_ranks, int attn_tp_size,
                              int abi_version, absl::Duration timeout, std::string_view why) {
  if (comm == nullptr || comm->record_bytes() != sizeof(RankSummary)) {
    return absl::InvalidArgumentError("refuse: no all-gather backend of summary records");
  }
  RankSummary slot{};
  Hello hello{kHelloMagic, kSummaryVersion, static_cast<uint16_t>(abi_version), 0, num_ranks,
              attn_tp_size, 1, {}};
  why.copy(hello.why, std::min(why.size(), sizeof(hello.why) - 1));
  std::memcpy(&slot, &hello, sizeof(hello));
  std::vector<RankSummary> all(static_cast<size_t>(comm->num_ranks()));
  return comm->Gather(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&slot), sizeof(slot)),
                      absl::MakeSpan(reinterpret_cast<uint8_t*>(all.data()), all.size() * sizeof(RankSummary)),
                      timeout);
}

absl::Status Balancer::Handshake() {
  RankSummary slot{};
  const Hello hello{kHelloMagic, kSummaryVersion, static_cast<uint16_t>(config_.abi_version),
                    config_.Hash(), config_.planner.num_ranks, config_.attn_tp_size, 0, {}};
  std::memcpy(&slot, &hello, sizeof(hello));
  absl::Status s = Exchange(slot, config_.timeout);  // DPB_TIMEOUT_MS, as every exchange
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("handshake all-gather failed: ", s.message()));
  for (size_t r = 0; r < gathered_.size(); ++r) {
    Hello h;
    std::memcpy(&h, &gathered_[r], sizeof(h));
    const std::string who = config_.attn_tp_size > 1
                                ? absl::StrFormat("process %d (DP rank %d)", r, r / config_.attn_tp_size)
                                : absl::StrFormat("rank %d", r);
    if (h.magic == kHelloMagic && h.refused == 1) {
      h.why[sizeof(h.why) - 1] = '\0';
      return absl::FailedPreconditionError(absl::StrFormat(
          "handshake: %s failed its init: %s (every rank disables itself)", who, h.why));
    }
    if (h.magic == kHelloMagic && h.abi_version != hello.abi_version) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "handshake: %s calls plugin ABI v%d, rank %d calls v%d (every rank disables itself)",
          who, h.abi_version, rank_, hello.abi_version));
    }
    if (h.magic == kHelloMagic && (h.num_ranks != hello.num_ranks || h.attn_tp_size != hello.attn_tp_size)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "handshake: %s has num_ranks %d x attn_tp_size %d, rank %d has %d x %d (every rank "
          "disables itself)",
          who, h.num_ranks, h.attn_tp_size, rank_, hello.num_ranks, hello.attn_tp_size));
    }
    if (h.magic != kHelloMagic || h.summary_version != kSummaryVersion || h.config_hash != hello.config_hash) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "handshake: %s runs summary version %d with config hash %016x; rank %d runs "
          "version %d with %016x (every rank disables itself)",
          who, h.summary_version, h.config_hash, rank_, kSummaryVersion, hello.config_hash));
    }
  }
  Logger()->info("rank {}: enabled, {} ranks, mode {}, k_max {}, default k {}, backend {}", rank_,
                 config_.planner.num_ranks, PlanModeName(config_.planner.mode),
                 config_.planner.k_max, config_.planner.default_k, comm_->name());
  return absl::OkStatus();
}

void Balancer::Disable(const std::string& why) {
  if (!enabled_) return;
  enabled_ = false;
  disabled_reason_ = why;
  Logger()->error("rank {}: disabled, engine default verify lengths from now on: {}", rank_, why);
}

void Balancer::Fail(const absl::Status& s) {
  ++fallbacks_;
  ++consecutive_failures_;
  if (static_cast<int64_t>(step_) - last_warn_step_ >= kWarnEverySteps) {
    last_warn_step_ = static_cast<int64_t>(step_);
    Logger()->warn("rank {} step {}: default verify lengths this step ({} fallbacks so far): {}",
                   rank_, step_, fallbacks_, std::string(s.message()));
  }
  if (consecutive_failures_ >= config_.max_consecutive_failures) {
    Disable(absl::StrFormat("%d consecutive failures, last: %s", consecutive_failures_, s.message()));
  } else if (!comm_->healthy()) {
    Disable(absl::StrCat("all-gather backend unusable: ", s.message()));
  }
}

void Balancer::Fallback(absl::Span<const BalancerRequest> batch, absl::Span<int32_t> verify_len,
                        int depth_cap) const {
  const size_t n = std::min(batch.size(), verify_len.size());
  for (size_t i = 0; i < n; ++i) {
    verify_len[i] = std::min(DefaultVerifyLen(config_.planner.default_k, batch[i].k_cap), depth_cap);
  }
}

bool Balancer::ArmOn(uint64_t step) const {
  if (config_.planner.mode == PlanMode::kOff) return false;
  if (config_.ab_epoch_steps <= 0) return true;
  return (step / config_.ab_epoch_steps) % 2 == 0;
}

absl::Status Balancer::Exchange(const RankSummary& send, absl::Duration timeout) {
  const absl::Time start = absl::Now();
  absl::Status s = comm_->Gather(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&send), sizeof(send)),
      absl::MakeSpan(reinterpret_cast<uint8_t*>(gathered_.data()), gathered_.size() * sizeof(RankSummary)),
      timeout);
  max_exchange_ms_ = std::max(max_exchange_ms_, absl::ToDoubleMilliseconds(absl::Now() - start));
  if (!s.ok()) ++exchange_failures_;
  return s;
}

void Balancer::KeepInStep(const StepInput& in, absl::Span<const int32_t> fallback_len,
                          const Measured& measured, StepTotals* totals) {
  // always_exchange holds only among ranks that passed the handshake: ranks that disagree on the
  // ABI or the group (a v1 rank does not exchange once disabled) would wait for each other.
  if (!(comm_->ordered() || (config_.always_exchange && handshake_ok_)) || !comm_->healthy()) return;
  // Every receiver sees the disabled record and disables itself too, so all ranks end up here,
  // each still calling once per step; the record still tells them this rank's token total.
  StampOwnSummary(absl::CancelledError("disabled"), step_ - 1, in, fallback_len, measured);
  own_summary_.flags |= kSummaryDisabled;
  if (!Exchange(own_summary_, config_.timeout).ok()) return;
  ReadIdleRows();
  if (config_.attn_tp_size > 1) GatherLeaders();
  FillTotals(nullptr, false, in, fallback_len, false, totals);
}

void Balancer::ReadIdleRows() {
  // An idle row carries no config hash, rank or step: it becomes a record of this config that
  // every check accepts and the planner excludes (no kSummaryValid), with no tokens, no
  // measurements (-1: unknown) and no say in the agreed step (the largest index).
  const RankSummary idle = IdleRowRecord();
  const int tp = config_.attn_tp_size;
  std::fill(idle_rows_.begin(), idle_rows_.end(), false);
  for (size_t p = 0; p < gathered_.size(); ++p) {
    if (std::memcmp(&gathered_[p], &idle, sizeof(idle)) != 0) continue;
    RankSummary& r = gathered_[p];
    r.config_hash = planner_.config_hash();
    r.rank_idx = static_cast<uint16_t>(p / tp);
    r.step_idx = UINT32_MAX;
    r.prev_attention_us = r.prev_step_us = r.prev_accepted_tokens = r.prev_cycle_us = -1.f;
    if (p % tp == 0) idle_rows_[p / tp] = true;  // the DP rank's record is its member 0's
  }
}

absl::Span<const RankSummary> Balancer::DpRecords() const {
  return config_.attn_tp_size > 1 ? absl::MakeConstSpan(leaders_) : absl::MakeConstSpan(gathered_);
}

bool Balancer::GatherLeaders() {
  const int tp = config_.attn_tp_size;
  bool mine_agree = true;
  for (size_t r = 0; r < leaders_.size(); ++r) {
    leaders_[r] = gathered_[r * tp];
    bool agree = true;
    for (int j = 1; j < tp; ++j) {
      const RankSummary& m = gathered_[r * tp + j];
      agree &= m.input_digest == leaders_[r].input_digest &&
               (m.flags & kSummaryValid) == (leaders_[r].flags & kSummaryValid);
    }
    if (!agree) {
      leaders_[r].flags &= static_cast<uint16_t>(~kSummaryValid);  // planned as a fallback rank
      if (static_cast<int>(r) == rank_) mine_agree = false;
    }
  }
  return mine_agree;
}

void Balancer::ApplyLeaderMeasurements() {
  if (config_.attn_tp_size == 1) return;
  const RankSummary& lead = gathered_[static_cast<size_t>(rank_) * config_.attn_tp_size];
  if (lead.prev_step_us > 0) {
    for (const Pending& p : pending_slo_) slo_.Observe(p.request_id, lead.prev_step_us, p.tokens).IgnoreError();
  }
  if (pending_refit_ && online_ && lead.prev_attention_us > 0 &&
      online_->Observe(pending_agg_, lead.prev_attention_us)) {
    planner_.set_model(online_->model());
  }
  pending_slo_.clear();
  pending_refit_ = false;
}

uint32_t Balancer::InputDigest(const StepInput& in) const {
  internal::Fnv1a h;
  h.Value(in.kind);
  h.Value(in.extra_tokens);
  h.Value(in.kv_free_tokens);
  for (const PlanRequest& p : plan_batch_) {
    h.Value(p.ctx_tokens);
    h.Value(p.k_min);
    h.Value(p.k_cap);
    for (int j = 1; j <= kMaxDraftLen; ++j) h.Value(p.acceptance.Accept(j));
  }
  // The summary's planning content: what this rank's model made of the batch.
  const auto* bytes = reinterpret_cast<const uint8_t*>(&own_summary_);
  h.Bytes(bytes + offsetof(RankSummary, base_attention_us),
          offsetof(RankSummary, extra_tokens) - offsetof(RankSummary, base_attention_us));
  const uint64_t d = h.digest();
  return static_cast<uint32_t>(d ^ (d >> 32));
}

// What this rank runs: its lengths plus its extra tokens (a bad extra_tokens, which fails the
// step, counts as its nearest valid value).
int64_t Balancer::OwnTokens(const StepInput& in, absl::Span<const int32_t> lens) {
  return std::clamp<int64_t>(in.extra_tokens, 0, kMaxExtraTokens) + QueryTokens(lens);
}

void Balancer::FillTotals(const GlobalDecision* decision, bool balanced, const StepInput& in,
                          absl::Span<const int32_t> own_len, bool fell_back_alone,
                          StepTotals* totals) {
  if (totals == nullptr && !step_terms_) return;
  const absl::Span<const RankSummary> recs = DpRecords();
  // Every rank's total as the records say (the same bytes on every rank): the step terms' row
  // for this step, and what the engine is told below (before this rank's own correction).
  std::vector<int64_t>& tokens = totals != nullptr ? totals->rank_tokens : scratch_tokens_;
  tokens.resize(recs.size());
  planner_.RankTokens(recs, decision ? *decision : GlobalDecision{}, balanced && decision != nullptr,
                      absl::MakeSpan(tokens));  // -1: an empty record, unknown
  RememberStepRun(step_ - 1, decision, balanced, tokens);
  if (totals == nullptr) return;
  totals->known = true;
  totals->rank_flags.resize(recs.size());
  for (size_t r = 0; r < recs.size(); ++r) {
    uint16_t f = recs[r].flags & (kSummaryExtend | kSummaryNoVerify | kSummaryIdle | kSummaryDisabled);
    if (balanced && decision != nullptr && (recs[r].flags & kSummaryValid)) f |= kSummaryValid;
    totals->rank_flags[r] = totals->rank_tokens[r] < 0 ? 0 : f;
  }
  // Every record says what its rank runs, this rank's own included, except when this rank alone
  // failed to apply the decision the others planned it into (Assign's error): it runs its
  // defaults, which it says here (the others cannot know; the result is a fallback).
  // The same when the engine replaced this rank's own record with an empty one.
  // An idle row the engine wrote for this rank stays 0 here, as on every rank: the engine chose
  // that this rank runs nothing.
  if (fell_back_alone || totals->rank_tokens[rank_] < 0) {
    totals->rank_tokens[rank_] = OwnTokens(in, own_len);
    totals->rank_flags[rank_] = in.kind;
  }
  int64_t max_tokens = 0;
  totals->any_flags = 0;
  for (size_t r = 0; r < recs.size(); ++r) {
    totals->any_flags |= totals->rank_flags[r];
    max_tokens = std::max(max_tokens, totals->rank_tokens[r]);
  }
  totals->padded_tokens = TierFor(config_.planner.token_tiers, max_tokens);
}

PlanOutcome Balancer::Plan(absl::Span<const BalancerRequest> batch, int64_t kv_free_tokens,
                           absl::Span<int32_t> verify_len) {
  return Plan(StepInput{batch, kv_free_tokens, 0, 0}, verify_len, nullptr);
}

PlanOutcome Balancer::Plan(const StepInput& step, absl::Span<int32_t> verify_len,
                           StepTotals* totals) {
  absl::Status local = step.input_error;
  if (local.ok() && verify_len.size() != step.batch.size()) {
    local = absl::InvalidArgumentError(absl::StrFormat(
        "verify_len has %d slots for %d requests", verify_len.size(), step.batch.size()));
  } else if (local.ok() && (step.extra_tokens < 0 || step.extra_tokens > kMaxExtraTokens)) {
    local = absl::InvalidArgumentError(absl::StrFormat("extra_tokens = %d must be in 0..%d",
                                                       step.extra_tokens, kMaxExtraTokens));
  }
  PlanOutcome out = PlanStep(step, verify_len, local, totals);
  if (verify_len.size() == step.batch.size()) RememberUnreported(out.step, step.batch, verify_len);
  return out;
}

void Balancer::RememberUnreported(uint64_t step, absl::Span<const BalancerRequest> batch,
                                  absl::Span<const int32_t> verify_len) {
  for (size_t i = 0; i < batch.size(); ++i) {
    Unreported& u = unreported_[batch[i].request_id];
    if (u.count == kMaxUnreportedSteps) {  // the oldest goes: its report is long overdue
      std::move(u.step.begin() + 1, u.step.end(), u.step.begin());
      std::move(u.verify_len.begin() + 1, u.verify_len.end(), u.verify_len.begin());
      --u.count;
    }
    u.step[u.count] = step;
    u.verify_len[u.count] = verify_len[i];
    ++u.count;
  }
  // A request that left without a report (an abort) is dropped once its last plan is older than
  // any step still worth predicting, so the map holds only the batches of the last few steps.
  for (auto it = unreported_.begin(); it != unreported_.end();) {
    const Unreported& u = it->second;
    if (u.count == 0 || u.step[u.count - 1] + kMaxUnreportedSteps < step) {
      unreported_.erase(it++);
    } else {
      ++it;
    }
  }
}

void Balancer::ForgetReported(uint64_t step) {
  if (reported_through_ != UINT64_MAX && step <= reported_through_) return;
  reported_through_ = step;
  for (auto it = unreported_.begin(); it != unreported_.end();) {
    Unreported& u = it->second;
    int first_left = 0;  // steps are stored oldest first
    while (first_left < u.count && u.step[first_left] <= step) ++first_left;
    if (first_left == u.count) {
      unreported_.erase(it++);
      continue;
    }
    std::move(u.step.begin() + first_left, u.step.begin() + u.count, u.step.begin());
    std::move(u.verify_len.begin() + first_left, u.verify_len.begin() + u.count, u.verify_len.begin());
    u.count -= first_left;
    ++it;
  }
}

PlanOutcome Balancer::Abstain(const absl::Status& why) {
  return PlanStep(StepInput{}, {}, why.ok() ? absl::InvalidArgumentError("abstained without a reason") : why,
                  nullptr);
}

PlanOutcome Balancer::PlanStep(const StepInput& in, absl::Span<int32_t> verify_len,
                               absl::Status local, StepTotals* totals) {
  // The engine cycle starts here (BeginStep gives this plan the index step_). The plan call's
  // own time is on the same clock: a row's cycle and the own time it takes out of it agree.
  const absl::Time start = Now();
  step_starts_[step_ % step_starts_.size()] = StepStart{step_, start};
  if (quiet_.SkipStep()) return QuietStep(in, verify_len, local, totals);  // untimed: no exchange
  PlanOutcome out = PlanStepUntimed(in, verify_len, std::move(local), totals);
  const double us = absl::ToDoubleMicroseconds(Now() - start);
  own_samples_[own_calls_++ % kOwnWindow] = us;
  std::array<double, kOwnWindow> window = own_samples_;
  const auto n = static_cast<size_t>(std::min<int64_t>(own_calls_, kOwnWindow));
  std::nth_element(window.begin(), window.begin() + n / 2, window.begin() + n);
  own_us_ = window[n / 2];  // the upper median of an even count
  return out;
}

PlanOutcome Balancer::BeginStep(const StepInput& in, absl::Span<int32_t> verify_len,
                                StepTotals* totals) {
  PlanOutcome out;
  out.draft_depth = config_.planner.default_k;
  Fallback(in.batch, verify_len);
  StartTotals(in, verify_len, totals);
  out.step = step_++;
  return out;
}

PlanOutcome Balancer::QuietStep(const StepInput& in, absl::Span<int32_t> verify_len,
                                const absl::Status& local, StepTotals* totals) {
  PlanOutcome out = BeginStep(in, verify_len, totals);
  // Reported like any step: a plan at the defaults (no barrier, no prediction). measured_ is
  // left as it is, so the next exchange carries the latest report.
  planned_[out.step % planned_.size()] = Planned{out.step, ArmOn(out.step), -1, -1, false, {}};
  if (!local.ok()) {  // not Fail(): nothing here may change when this rank next exchanges
    ++fallbacks_;
    out.status = local;
  }
  return out;
}

PlanOutcome Balancer::PlanStepUntimed(const StepInput& in, absl::Span<int32_t> verify_len,
                                      absl::Status local, StepTotals* totals) {
  PlanOutcome out = BeginStep(in, verify_len, totals);
  const absl::Span<const BalancerRequest> batch = in.batch;
  const uint64_t step = out.step;
  // The latest reported step goes out with this record, once; its accounting follows the
  // exchange.
  const Measured measured = measured_;
  measured_.fresh = false;
  if (!enabled_) {
    KeepInStep(in, verify_len, measured, totals);
    return out;
  }
  // Step 1: this rank's summary. Bad local input still joins the exchange, marked unusable.
  if (local.ok()) local = ToPlanBatch(batch);
  if (local.ok()) local = planner_.Summarize(rank_, plan_batch_, in.kv_free_tokens, &own_summary_);
  StampOwnSummary(local, step, in, verify_len, measured);
  sent_measured_[step % sent_measured_.size()] = SentMeasured{static_cast<uint32_t>(step), measured};
  // Step 2: the exchange, and what the records say before anyone plans.
  if (absl::Status s = Exchange(own_summary_, config_.timeout); !s.ok()) {
    quiet_.Reset();
    Fail(s);
    out.status = s;
    return out;
  }
  ReadIdleRows();
  if (config_.attn_tp_size > 1) {
    if (!GatherLeaders() && local.ok()) {
      ++tp_mismatches_;
      local = absl::AbortedError(absl::StrFormat(
          "the attention-TP members of DP rank %d planned from different inputs (digests differ)", rank_));
    }
    ApplyLeaderMeasurements();
  }
  if (PeersStopStep(in, verify_len, out, totals)) {
    quiet_.AfterExchange(gathered_, false);  // a paused step ends a streak, on every rank alike
    return out;
  }
  // Step 3: everyone agrees on the step and so on the A/B arm.
  const bool arm_on = AgreeOnStep(step, ArrivedMeasured(step, measured));
  planned_[step % planned_.size()] = Planned{step, arm_on, -1, -1, false, {}};
  if (idle_rows_[rank_] && local.ok()) {  // the engine's choice, not a failure (FailLocally)
    local = absl::UnavailableError(absl::StrFormat(
        "the engine sent an idle row for rank %d: its default lengths this step", rank_));
  }
  if (!local.ok()) {
    FailLocally(local, arm_on, in, verify_len, out, totals);
    return out;
  }
  if (!arm_on) {
    quiet_.AfterExchange(gathered_, false);
    consecutive_failures_ = 0;
    FillTotals(nullptr, false, in, verify_len, false, totals);
    return out;
  }
  // Step 4: the global decision (same bytes on every rank) and this rank's verify lengths.
  const GlobalDecision* applied = DecideAndAssign(batch, verify_len, out);
  FillTotals(applied, applied != nullptr, in, verify_len, !out.balanced, totals);
  return out;
}

void Balancer::StartTotals(const StepInput& in, absl::Span<const int32_t> own_len,
                           StepTotals* totals) const {
  if (totals == nullptr) return;
  const size_t dp = static_cast<size_t>(config_.planner.num_ranks);
  totals->known = false;
  totals->rank_tokens.assign(dp, -1);
  totals->rank_flags.assign(dp, 0);
  totals->rank_tokens[rank_] = OwnTokens(in, own_len);
  totals->rank_flags[rank_] = in.kind;
  totals->padded_tokens = 0;
  totals->any_flags = in.kind;
}

bool Balancer::PeersStopStep(const StepInput& in, absl::Span<const int32_t> own_len,
                             PlanOutcome& out, StepTotals* totals) {
  // A disabled peer is seen by every rank in the same bytes: all disable together. An empty
  // record (a rank without a working plugin) pauses balancing for the step on every rank alike:
  // that rank drafts the engine's default depth. An idle row (ReadIdleRows) pauses nobody: the
  // others plan that rank as one that runs nothing (PlanStep: the rank itself, when the engine
  // wrote its row so, runs its defaults at the agreed depth).
  const absl::Span<const RankSummary> recs = DpRecords();
  for (size_t r = 0; r < recs.size(); ++r) {
    if (recs[r].flags & kSummaryDisabled) {
      Disable(absl::StrFormat("rank %d is disabled", r));
      FillTotals(nullptr, false, in, own_len, false, totals);
      return true;
    }
  }
  for (size_t r = 0; r < recs.size(); ++r) {
    if (recs[r].magic == 0 && recs[r].version == 0) {
      ++fallbacks_;
      out.status = absl::UnavailableError(absl::StrFormat(
          "rank %d sent an empty record (no plugin there, or the engine's row for an inactive "
          "rank): default lengths on every rank this step", r));
      FillTotals(nullptr, false, in, own_len, false, totals);
      return true;
    }
  }
  return false;
}

void Balancer::FailLocally(const absl::Status& local, bool arm_on, const StepInput& in,
                           absl::Span<const int32_t> own_len, PlanOutcome& out,
                           StepTotals* totals) {
  // This rank runs its defaults, but must draft as deep as every other rank agrees to.
  absl::StatusOr<GlobalDecision> d = absl::UnavailableError("off arm");
  if (arm_on) d = planner_.Decide(DpRecords());
  quiet_.AfterExchange(gathered_, d.ok() && d->kept_default);  // this rank's record says 0: no span
  if (d.ok()) out.draft_depth = d->draft_depth;
  if (idle_rows_[rank_]) {
    ++fallbacks_;
  } else {
    Fail(local);
  }
  out.status = local;
  FillTotals(d.ok() ? &*d : nullptr, d.ok(), in, own_len, false, totals);
}

absl::Status Balancer::ToPlanBatch(absl::Span<const BalancerRequest> batch) {
  const int32_t k_max = config_.planner.k_max;
  plan_batch_.resize(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const BalancerRequest& q = batch[i];
    AcceptanceCurve curve;
    if (!q.draft_confidence.empty()) {
      absl::StatusOr<AcceptanceCurve> c = AcceptanceCurve::FromConfidences(q.draft_confidence);
      if (!c.ok()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("request %d: %s", q.request_id, c.status().message()));
      }
      curve = *c;
    } else {
      curve = estimator_.Curve(q.request_id);
    }
    // Steps planned for it and not yet reported: plan on what they leave (lag.h). A cap below
    // k_max says exactly what the request may still emit; at k_max the engine says only "at
    // least that", taken as more than the pending steps can emit.
    absl::Span<const int32_t> pending;
    if (const auto it = unreported_.find(q.request_id); it != unreported_.end()) {
      pending = absl::MakeConstSpan(it->second.verify_len.data(), it->second.count);
    }
    PlanRequest& p = plan_batch_[i];
    int32_t default_len = DefaultVerifyLen(config_.planner.default_k, q.k_cap);
    const bool valid = q.ctx_tokens >= 0 && q.k_cap >= 0 && q.k_cap <= k_max && q.k_min >= 0 &&
                       q.k_min <= q.k_cap;  // else Summarize names what is wrong
    if (pending.empty() || !valid) {  // the state the engine passed is the state: no prediction
      p = PlanRequest{q.ctx_tokens, 0, q.k_cap, curve};
      p.k_min = slo_.Floor(q.request_id, default_len, curve);
    } else {
      const int64_t remaining = q.k_cap < k_max ? int64_t{q.k_cap} + 1
                                                : int64_t{k_max} + 1 + kMaxUnreportedSteps * (kMaxDraftLen + 1);
      PredictedRequest pr;
      p = LaggedPlanRequest(q.ctx_tokens, remaining, pending, curve, k_max, config_.lag_predict, &pr);
      default_len = DefaultVerifyLen(config_.planner.default_k, p.k_cap);
      p.k_min = config_.lag_predict & kPredictSlo
                    ? slo_.Floor(q.request_id, default_len, curve, static_cast<int>(pending.size()), pr.pending_tokens)
                    : slo_.Floor(q.request_id, default_len, curve);
    }
    if (planner_.dspark()) {  // DSpark's budget reads survivals two decode steps back
      int32_t& planned = dspark_steps_[q.request_id];
      p.no_lagged_survival = planned < dspark::kConfidenceLagSteps;
      planned = std::min(planned + 1, dspark::kConfidenceLagSteps);
    }
    // The SLO floor is never above k_cap (DefaultVerifyLen); a bad k_min fails in Summarize. The
    // engine's own floor holds up to the cap the pending steps leave.
    p.k_min = std::max(pending.empty() || !valid ? q.k_min : std::min(q.k_min, p.k_cap), p.k_min);
  }
  return absl::OkStatus();
}

void Balancer::StampOwnSummary(const absl::Status& local, uint64_t step, const StepInput& in,
                               absl::Span<const int32_t> fallback_len, const Measured& measured) {
  if (!local.ok()) {  // a record the others recognise and exclude (no kSummaryValid flag)
    std::memset(&own_summary_, 0, sizeof(own_summary_));
    own_summary_.magic = kSummaryMagic;
    own_summary_.version = kSummaryVersion;
    own_summary_.config_hash = planner_.config_hash();
    own_summary_.rank_idx = static_cast<uint16_t>(rank_);
    // What its default lengths run, so every rank knows its total.
    own_summary_.default_tokens = static_cast<uint32_t>(std::min<int64_t>(QueryTokens(fallback_len), UINT32_MAX));
  }
  own_summary_.flags |= in.kind;
  // No quiet span before the step terms have settled: a quiet step adds no row, so a plugin
  // that starts from the wrong terms (another machine's defaults), keeps the default plan for
  // that reason and goes quiet would never learn better. Every rank's fit is the same, so every
  // rank holds its proposal back alike.
  if (local.ok() && (!step_terms_ || step_terms_->settled())) own_summary_.flags |= quiet_.ProposalFlags();
  own_summary_.extra_tokens = static_cast<uint32_t>(std::clamp<int64_t>(in.extra_tokens, 0, kMaxExtraTokens));
  own_summary_.input_digest = config_.attn_tp_size > 1 && local.ok() ? InputDigest(in) : 0;
  own_summary_.step_idx = static_cast<uint32_t>(step);
  own_summary_.own_us = static_cast<uint16_t>(std::clamp(std::lround(own_us_), 0L, 65535L));
  own_summary_.prev_attention_us = static_cast<float>(measured.fresh ? measured.attention_us : -1);
  own_summary_.prev_step_us = static_cast<float>(measured.fresh ? measured.step_us : -1);
  own_summary_.prev_accepted_tokens = static_cast<float>(measured.fresh ? measured.tokens : -1);
  own_summary_.prev_cycle_us = static_cast<float>(measured.fresh ? CycleUs(measured.step) : -1);
  own_summary_.step_terms_digest = step_terms_ ? step_terms_->Digest() : 0;
}

double Balancer::CycleUs(uint64_t step) const {
  if (step == UINT64_MAX) return -1;
  const StepStart& a = step_starts_[step % step_starts_.size()];
  const StepStart& b = step_starts_[(step + 1) % step_starts_.size()];
  if (a.step != step || b.step != step + 1) return -1;
  return absl::ToDoubleMicroseconds(b.at - a.at);
}

void Balancer::LearnStepTerms(const Measured& measured) {
  if (!step_terms_) return;
  // The terms decide the agreed draft depth: every rank must price with the same ones. A rank
  // whose fit went its own way (a row the others did not see) shows in its digest; every rank
  // sees the same digests, so all reset to the prior together.
  // Compared with the digest this rank's own gathered record carried: on a lagged exchange the
  // records are a step old, and a fit made since then is not a difference.
  const RankSummary& own = OwnGathered();
  const uint32_t mine = own.magic == kSummaryMagic && own.step_terms_digest != 0 ? own.step_terms_digest
                                                                                 : step_terms_->Digest();
  for (const RankSummary& r : gathered_) {
    if (r.magic == kSummaryMagic && r.step_terms_digest != 0 && r.step_terms_digest != mine) {
      step_terms_->Reset();
      planner_.set_global(step_terms_->terms());
      if (step_terms_->resets() == 1 || step_terms_->resets() % 100 == 0) {  // rate-limited
        Logger()->warn("rank {}: the ranks' step terms differ (digest {:08x} here, {:08x} from rank {}): "
                       "every rank starts their fit again from the flags' values ({} resets)", rank_, mine,
                       r.step_terms_digest, r.rank_idx, step_terms_->resets());
      }
      return;
    }
  }
  if (!measured.fresh) return;
  const StepRun& run = step_runs_[measured.step % step_runs_.size()];
  if (measured.step == UINT64_MAX || run.step != measured.step || !run.row) return;
  // The row, from the records alone (the same bytes on every rank): the median cycle, the
  // slowest attention and the largest plugin time among the ranks that ran the step.
  const absl::Span<const RankSummary> recs = DpRecords();
  std::vector<double> cycles;
  cycles.reserve(recs.size());
  double max_attn = 0, plugin_us = 0;
  for (size_t i = 0; i < recs.size(); ++i) {
    if (idle_rows_[i]) continue;
    const RankSummary& r = recs[i];
    if (!(r.prev_attention_us >= 0) || !(r.prev_cycle_us > 0)) return;
    cycles.push_back(r.prev_cycle_us);
    max_attn = std::max<double>(max_attn, r.prev_attention_us);
    plugin_us = std::max<double>(plugin_us, r.own_us);
  }
  if (cycles.empty()) return;
  const double other = Median(std::move(cycles)) - max_attn - plugin_us;
  if (step_terms_->Observe(StepTermsRow{run.ffn_tokens, run.draft_depth, other, plugin_us})) {
    planner_.set_global(step_terms_->terms());
  }
}

void Balancer::RememberStepRun(uint64_t step, const GlobalDecision* decision, bool balanced,
                               absl::Span<const int64_t> record_tokens) {
  if (!step_terms_) return;
  const absl::Span<const RankSummary> recs = DpRecords();
  StepRun run{step, 0, 0, true};
  int64_t sum = 0, max_tokens = 0;
  for (size_t i = 0; i < recs.size(); ++i) {
    // A rank with prefill beside its verify ran work whose time the terms do not model alike.
    if (record_tokens[i] < 0 || recs[i].extra_tokens > 0 || (recs[i].flags & kSummaryExtend)) run.row = false;
    sum += std::max<int64_t>(record_tokens[i], 0);
    max_tokens = std::max(max_tokens, record_tokens[i]);
  }
  // The FFN's tokens as the planner charges them (planner.cc, BestPlan::FfnTokens).
  const PlannerConfig& c = planner_.config();
  run.ffn_tokens = c.global.padded_tokens
                       ? static_cast<double>(c.num_ranks) * TierFor(c.token_tiers, max_tokens)
                       : static_cast<double>(sum);
  run.draft_depth = !c.agreed_draft_depth ? 0 : balanced && decision ? decision->draft_depth : c.default_k;
  step_runs_[step % step_runs_.size()] = run;
}

Balancer::Measured Balancer::ArrivedMeasured(uint64_t step, const Measured& sent_now) const {
  const RankSummary& own = OwnGathered();
  const auto now = static_cast<uint32_t>(step);
  // A row the engine wrote for this rank (an idle row: ReadIdleRows, or zeros) is not one of
  // this rank's records: it measured nothing, and this rank's own measurement stands.
  if (own.magic != kSummaryMagic || own.step_idx == now || idle_rows_[rank_]) return sent_now;
  const SentMeasured& sent = sent_measured_[own.step_idx % sent_measured_.size()];
  return sent.step_idx == own.step_idx ? sent.measured : Measured{};
}

bool Balancer::AgreeOnStep(uint64_t step, const Measured& measured) {
  // The agreed step is the smallest index sent: it picks the A/B arm and epoch on every rank.
  uint32_t agreed_step = own_summary_.step_idx;
  const absl::Span<const RankSummary> recs = DpRecords();
  for (const RankSummary& r : recs) agreed_step = std::min(agreed_step, r.step_idx);
  const bool arm_on = ArmOn(agreed_step);
  // The instance's measured step (every rank's latest report) against its plan.
  if (measured.fresh && measured.planned) AccountPreviousStep(recs, measured.arm_on, measured.barrier_us);
  LearnStepTerms(measured);
  const int64_t epoch = config_.ab_epoch_steps > 0 ? agreed_step / config_.ab_epoch_steps : 0;
  if (epoch != epoch_) {
    arm_on_.EndEpoch();
    arm_off_.EndEpoch();
    epoch_ = epoch;
  }
  if (config_.log_every_steps > 0 && step > 0 && step % config_.log_every_steps == 0) MaybeLog();
  return arm_on;
}

const GlobalDecision* Balancer::DecideAndAssign(absl::Span<const BalancerRequest> batch,
                                                absl::Span<int32_t> verify_len, PlanOutcome& out) {
  absl::StatusOr<GlobalDecision> d = planner_.Decide(DpRecords());
  quiet_.AfterExchange(gathered_, d.ok() && d->kept_default);  // the same bytes on every rank
  if (!d.ok()) {
    if (d.status().code() == absl::StatusCode::kFailedPrecondition) {
      Disable(std::string(d.status().message()));  // version/config mismatch: all ranks see it
    } else {
      Fail(d.status());
    }
    out.status = d.status();
    Fallback(batch, verify_len);
    return nullptr;
  }
  if (absl::Status a = planner_.Assign(*d, verify_len); !a.ok()) {
    // Only this rank failed: every other rank drafts the agreed depth, so this one must too (an
    // MTP draft has MoE layers; a different depth would hang the instance's EP collectives), and
    // its default lengths may not verify more tokens than that depth drafts.
    Fail(a);
    out.status = a;
    if (config_.planner.agreed_draft_depth) {
      out.draft_depth = d->draft_depth;
      Fallback(batch, verify_len, d->draft_depth);
    } else {
      Fallback(batch, verify_len);
    }
    decision_ = *d;
    return &decision_;  // the other ranks apply it
  }
  planned_loads_.clear();
  for (size_t i = 0; i < batch.size(); ++i) planned_loads_.push_back({batch[i].ctx_tokens, 1 + verify_len[i]});
  Planned& p = planned_[(step_ - 1) % planned_.size()];
  p.agg = planner_.model().Aggregate(planned_loads_);
  p.predicted_us = planner_.model().AttentionUs(p.agg);
  p.extra_work = own_summary_.extra_tokens > 0 || (own_summary_.flags & kSummaryExtend) != 0;
  consecutive_failures_ = 0;
  ++balanced_steps_;
  if (d->kept_default) ++kept_default_steps_;
  out.balanced = true;
  out.draft_depth = d->draft_depth;
  if (config_.planner.agreed_draft_depth) {
    // Measured attention excludes the draft, which per-rank depths put inside the barrier.
    p.barrier_us = d->barrier_us;
  } else {  // a dense draft: this rank drafts its own depth
    out.draft_depth = 0;
    for (int32_t v : verify_len) out.draft_depth = std::max(out.draft_depth, static_cast<int>(v));
  }
  decision_ = *d;
  return &decision_;
}

void Balancer::AccountPreviousStep(absl::Span<const RankSummary> all, bool prev_arm_on,
                                   double planned_barrier) {
  double max_attn = 0, sum_attn = 0, tokens = 0, step_us = 0;
  int known = 0, idle = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const RankSummary& r = all[i];
    if (idle_rows_[i]) {  // a rank that runs nothing is not part of the step
      ++idle;
      continue;
    }
    if (!(r.prev_attention_us >= 0) || !(r.prev_step_us >= 0) || !(r.prev_accepted_tokens >= 0)) continue;
    ++known;
    max_attn = std::max<double>(max_attn, r.prev_attention_us);
    sum_attn += r.prev_attention_us;
    tokens += r.prev_accepted_tokens;
    step_us = std::max<double>(step_us, r.prev_step_us);
  }
  if (known + idle != static_cast<int>(all.size()) || known == 0 || max_attn <= 0 || step_us <= 0) return;
  if (planned_barrier > 0) {
    barrier_over_plan_.Add(max_attn / planned_barrier);
    // The known way to lose the gain (docs/results.md 3a): a model without the kernel's launch
    // shape underestimates whichever rank then sets the barrier. Said once, when it is clear.
    if (!warned_barrier_ && barrier_over_plan_.count() >= kBarrierWarnSteps &&
        barrier_over_plan_.mean() > kBarrierWarnRatio) {
      warned_barrier_ = true;
      Logger()->warn(
          "rank {}: the measured barrier runs {:.0f}% over the planned one (mean of {} balanced "
          "steps): the cost model underestimates the slowest ranks. Name the attention kernel "
          "(DPB_COST_MODEL=v2+fa2-packed-h200 or v2+fa2-gqa-h200) or calibrate one "
          "(dpbalance-calibrate); see docs/cost-model.md",
          rank_, 100 * (barrier_over_plan_.mean() - 1), barrier_over_plan_.count());
    }
  }
  bubble_.AddStepMeanMax(sum_attn / known, max_attn);
  tokens_per_step_.Add(tokens);
  tokens_sum_ += tokens;
  time_sum_us_ += step_us;
  (prev_arm_on ? arm_on_ : arm_off_).AddStep(bubble_.last_fraction(), tokens, step_us);
}

absl::Status Balancer::Report(double attention_us, double step_us,
                              absl::Span<const BalancerAccepted> accepted) {
  return Report(step_ == 0 ? UINT64_MAX : step_ - 1, attention_us, step_us, accepted);
}

absl::Status Balancer::Report(uint64_t step, double attention_us, double step_us,
                              absl::Span<const BalancerAccepted> accepted) {
  Planned* plan = nullptr;
  for (Planned& p : planned_) {
    if (p.step == step && step != UINT64_MAX) plan = &p;
  }
  measured_ = Measured{};
  measured_.step = step;
  measured_.fresh = true;  // the next record says "unknown" rather than repeating older times
  last_report_ = ReportedStep{};
  last_report_.step = step;
  last_report_.measured_us = attention_us;
  if (plan != nullptr) {
    measured_.planned = true;
    measured_.arm_on = plan->arm_on;
    measured_.barrier_us = plan->barrier_us;
    last_report_.predicted_us = plan->predicted_us;
    last_report_.barrier_us = plan->barrier_us;
    last_report_.extra_work = plan->extra_work;
  }
  if (step != UINT64_MAX) ForgetReported(step);  // its results are in, whatever their times
  if (!(std::isfinite(attention_us) && attention_us >= 0 && std::isfinite(step_us) && step_us >= 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "report: attention_us %g and step_us %g must be finite and >= 0", attention_us, step_us));
  }
  double tokens = 0;
  absl::Status first_error;
  for (const BalancerAccepted& a : accepted) {
    if (absl::Status s = estimator_.Observe(a.request_id, a.verify_len, a.accepted); !s.ok()) {
      if (first_error.ok()) first_error = s;
      continue;
    }
    tokens += a.accepted + 1;
    if (config_.attn_tp_size > 1) {  // priced with member 0's step time, from the next exchange
      if (!a.finished) pending_slo_.push_back(Pending{a.request_id, a.accepted + 1});
    } else if (step_us > 0) {
      if (absl::Status s = slo_.Observe(a.request_id, step_us, a.accepted + 1); !s.ok() && first_error.ok()) {
        first_error = s;
      }
    }
    if (a.finished) {
      estimator_.Forget(a.request_id);
      slo_.Forget(a.request_id);
      dspark_steps_.erase(a.request_id);
      unreported_.erase(a.request_id);
    }
  }
  measured_.attention_us = attention_us;
  measured_.step_us = step_us;
  measured_.tokens = tokens;
  if (plan != nullptr && !plan->extra_work && plan->predicted_us > 0 && attention_us > 0) {
    predicted_error_.Add(std::abs(plan->predicted_us - attention_us) / attention_us);
    // The online refit learns only from balanced steps, whose batch it knows exactly: not from
    // one that also ran prefill (its attention was measured over work the plan never saw).
    if (config_.attn_tp_size > 1) {  // with member 0's time, from the next exchange
      pending_refit_ = online_ != nullptr;
      pending_agg_ = plan->agg;
    } else if (online_ && online_->Observe(plan->agg, attention_us)) {
      planner_.set_model(online_->model());
    }
  }
  if (plan != nullptr) plan->step = UINT64_MAX;  // reported: a second report finds no plan
  return first_error;
}

BalancerStats Balancer::Stats() const {
  BalancerStats s;
  s.steps = static_cast<int64_t>(step_);
  s.balanced_steps = balanced_steps_;
  s.kept_default_steps = kept_default_steps_;
  s.fallbacks = fallbacks_;
  s.enabled = enabled_;
  s.disabled_reason = disabled_reason_;
  s.bubble_fraction = bubble_.mean_step_fraction();
  s.bubble_us = bubble_.mean_idle_us();
  s.predicted_error = predicted_error_.mean();
  s.barrier_over_plan = barrier_over_plan_.mean();
  s.tokens_per_step = tokens_per_step_.mean();
  s.goodput_tok_per_s = time_sum_us_ > 0 ? tokens_sum_ / (time_sum_us_ * 1e-6) : 0;
  auto arm = [](const ArmStats& a) {
    ArmSummary r;
    r.epochs = a.bubble().count();
    r.bubble_fraction = a.bubble().mean();
    r.bubble_ci95 = a.bubble().ci95();
    r.goodput_tok_per_s = a.goodput().mean();
    r.goodput_ci95 = a.goodput().ci95();
    return r;
  };
  s.arm_on = arm(arm_on_);
  s.arm_off = arm(arm_off_);
  s.tp_mismatches = tp_mismatches_;
  s.exchange_failures = exchange_failures_;
  s.max_exchange_ms = max_exchange_ms_;
  s.own_us = own_us_;
  s.quiet_steps = quiet_.quiet_steps();
  s.quiet_spans = quiet_.spans();
  s.step_terms = planner_.config().global;
  s.step_terms_online = step_terms_ != nullptr;
  if (step_terms_) {
    s.step_terms_rows = step_terms_->rows();
    s.step_terms_fits = step_terms_->fits();
    s.step_terms_resets = step_terms_->resets();
    s.step_terms_per_token_learnt = step_terms_->learnt_per_token();
    s.step_terms_draft_learnt = step_terms_->learnt_draft();
    s.step_terms_sigma_us = step_terms_->residual_sigma_us();
  }
  return s;
}

void Balancer::MaybeLog() {
  const BalancerStats s = Stats();
  Logger()->info(
      "rank {} step {}: bubble {:.4f} ({:.0f} us/rank), goodput {:.0f} tok/s, {:.1f} tok/step, "
      "model error {:.3f}, barrier/plan {:.3f}, balanced {}/{} (kept default {}), fallbacks {}{}; "
      "step terms{} ffn_fixed_us={:.0f} ffn_per_token_us={:.2f} draft_us={:.0f} step_overhead_us={:.0f} "
      "({} rows, {} fits, {} resets)",
      rank_, s.steps, s.bubble_fraction, s.bubble_us, s.goodput_tok_per_s, s.tokens_per_step,
      s.predicted_error, s.barrier_over_plan, s.balanced_steps, s.steps, s.kept_default_steps,
      s.fallbacks, s.enabled ? "" : " (disabled)", s.step_terms_online ? " (learnt online)" : " (flags)",
      s.step_terms.ffn_fixed_us, s.step_terms.ffn_per_token_us, s.step_terms.draft_per_step_us,
      s.step_terms.step_overhead_us, s.step_terms_rows, s.step_terms_fits, s.step_terms_resets);
  if (config_.metrics_file.empty()) return;
  std::ofstream f(config_.metrics_file, std::ios::app);
  if (!f) {  // writable at init (the flag checks it): it went away since; say so once
    static std::atomic<bool> warned{false};  // once per process, not once per log line
    if (!warned.exchange(true)) {
      Logger()->warn("rank {}: metrics file '{}' cannot be opened for appending; its lines are lost",
                     rank_, config_.metrics_file);
    }
    return;
  }
  f << absl::StrFormat(
      "{\"rank\":%d,\"step\":%d,\"bubble_fraction\":%.6f,\"bubble_us\":%.3f,\"goodput_tok_per_s\":%.3f,"
      "\"tokens_per_step\":%.3f,\"predicted_error\":%.6f,\"barrier_over_plan\":%.6f,"
      "\"balanced_steps\":%d,\"kept_default_steps\":%d,\"fallbacks\":%d,"
      "\"enabled\":%s,\"ab\":{\"on\":{\"epochs\":%d,\"bubble\":%.6f,\"bubble_ci95\":%.6f,"
      "\"goodput\":%.3f,\"goodput_ci95\":%.3f},\"off\":{\"epochs\":%d,\"bubble\":%.6f,"
      "\"bubble_ci95\":%.6f,\"goodput\":%.3f,\"goodput_ci95\":%.3f}},"
      "\"step_terms\":{\"online\":%s,\"ffn_fixed_us\":%.3f,\"ffn_per_token_us\":%.5f,"
      "\"draft_us\":%.3f,\"step_overhead_us\":%.3f,\"rows\":%d,\"fits\":%d,\"resets\":%d}}\n",
      rank_, s.steps, s.bubble_fraction, s.bubble_us, s.goodput_tok_per_s, s.tokens_per_step,
      s.predicted_error, s.barrier_over_plan, s.balanced_steps, s.kept_default_steps, s.fallbacks,
      s.enabled ? "true" : "false",
      s.arm_on.epochs, s.arm_on.bubble_fraction, s.arm_on.bubble_ci95, s.arm_on.goodput_tok_per_s,
      s.arm_on.goodput_ci95, s.arm_off.epochs, s.arm_off.bubble_fraction, s.arm_off.bubble_ci95,
      s.arm_off.goodput_tok_per_s, s.arm_off.goodput_ci95, s.step_terms_online ? "true" : "false",
      s.step_terms.ffn_fixed_us, s.step_terms.ffn_per_token_us, s.step_terms.draft_per_step_us,
      s.step_terms.step_overhead_us, s.step_terms_rows, s.step_terms_fits, s.step_terms_resets);
}

}  // namespace dpbalance
