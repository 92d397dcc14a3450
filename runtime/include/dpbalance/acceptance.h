// dpbalance/acceptance.h — expected accepted tokens as a function of verify length.
//
// Contract
// - `AcceptanceCurve` holds, for one request, P_j = probability that draft position j (1-based)
//   is accepted, i.e. that drafts 1..j are all accepted. P is non-increasing in j, so
//   expected_tokens(k) = 1 + sum_{j<=k} P_j (the bonus token included) is concave and
//   non-decreasing in k.
// - Curves come from per-position conditional acceptance rates (a_j = P_j / P_{j-1}), from an
//   online estimate (`AcceptanceEstimator`), or from per-token draft confidences for this step.
// - `AcceptanceEstimator` estimates each request's conditional rates from its own accept counts
//   around instance-wide pooled rates (so a new request starts at the instance mean), by one of
//   two models (`AcceptanceModel`):
//   - kBeta: per position, a Beta-Bernoulli posterior around the pooled rate, worth
//     `prior_strength` observations; positions learn nothing from each other.
//   - kShift: one logit shift per request over the pooled rates, its posterior mode under a
//     N(0, tau^2) prior from all the request's positions at once (a request that accepts well
//     at position 1 is expected to do so at position 4), with tau^2 learnt online from the
//     rank's own requests by empirical Bayes (EM over each request's mode and Laplace variance).
//     No width is set by hand; see docs/design.md, "Acceptance".
//   Not thread-safe: one estimator per rank, used from that rank's step thread.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dpbalance {

// Longest verify length dpbalance plans for (draft tokens per request per step).
inline constexpr int kMaxDraftLen = 8;

class AcceptanceCurve {
 public:
  AcceptanceCurve() = default;  // all zeros: nothing is ever accepted
  // From conditional per-position rates a_1..a_n (n <= kMaxDraftLen), each in [0, 1].
  static absl::StatusOr<AcceptanceCurve> FromConditional(absl::Span<const double> rates);
  // From this step's draft-token confidences (probability each draft is accepted given the
  // previous one was), each in [0, 1]. Same maths as FromConditional; named for its source.
  static absl::StatusOr<AcceptanceCurve> FromConfidences(absl::Span<const float> confidences);
  // From the survivals P_1..P_n themselves (n <= kMaxDraftLen), each in [0, 1], never rising.
  static absl::StatusOr<AcceptanceCurve> FromSurvivals(absl::Span<const double> survivals);

  // P_j for j in 1..kMaxDraftLen; 0 outside.
  double Accept(int j) const { return (j >= 1 && j <= kMaxDraftLen) ? cum_[j - 1] : 0.0; }
  // Expected emitted tokens when verifying k drafts (k clamped to [0, kMaxDraftLen]).
  double ExpectedTokens(int k) const;
  // The same curve with every token, the bonus token included, counted as `value` tokens
  // (value > 0): what the planner maximises when a request's tokens are worth more or less than
  // one (PlannerConfig::value_deferral). Accept(j) may then exceed 1.
  AcceptanceCurve Valued(double value) const;

 private:
  std::array<double, kMaxDraftLen> cum_{};
  double bonus_ = 1.0;  // the value of the token every step emits (1 unless Valued)
};

// The conditional profile of multi-layer MTP at K = 8 (GSM8K, temperature 0), derived from the
// per-position acceptance 76.2/61.6/51.3/42.4/36.4/30.9/27.2/23.7 % in docs/cost-model.md.
std::array<double, kMaxDraftLen> MtpK8ConditionalProfile();
// A request's conditional rates: `profile` shifted by `logit_shift` in logit space (the replay's
// and the reference engine's per-request acceptance model; shift ~ N(0, sigma)).
std::array<double, kMaxDraftLen> ShiftedProfile(const std::array<double, kMaxDraftLen>& profile,
                                                double logit_shift);

// How AcceptanceEstimator ties a request's positions together (see the contract above).
enum class AcceptanceModel { kBeta, kShift };
// "beta" or "shift"; anything else is an error naming the text.
absl::StatusOr<AcceptanceModel> ParseAcceptanceModel(std::string_view name);
std::string_view AcceptanceModelName(AcceptanceModel model);

class AcceptanceEstimator {
 public:
  // `prior_strength`: pseudo-observations per position the pooled prior is worth (> 0); also
  // what the pooled rates' own prior (`initial_rates`) is worth.
  // `initial_rates`: conditional rates used before any observation at all.
  AcceptanceEstimator(double prior_strength, std::array<double, kMaxDraftLen> initial_rates,
                      AcceptanceModel model = AcceptanceModel::kBeta);

  // Records that `request_id` verified `verify_len` drafts and `accepted` of them were accepted
  // (0 <= accepted <= verify_len <= kMaxDraftLen). Positions 1..accepted count as successes,
  // position accepted+1 (if verified) as a failure, later ones are unobserved.
  absl::Status Observe(int64_t request_id, int verify_len, int accepted);
  // Posterior-mean curve for the request (the pooled prior for an unknown request).
  AcceptanceCurve Curve(int64_t request_id) const;
  // Pooled conditional rates over all observations (with the initial rates as a weak prior).
  std::array<double, kMaxDraftLen> PooledRates() const;
  // The request is done: its state is dropped (kShift: its posterior joins the learnt width).
  void Forget(int64_t request_id);
  size_t num_tracked() const { return per_request_.size(); }
  // kShift: the learnt prior variance of the per-request logit shift (tau^2).
  double shift_variance() const { return tau2_; }

  // kShift's width: it starts at kShiftTau2Init, worth kShiftPriorRequests requests, and
  // retired requests' weight decays by 1/kShiftMemoryRequests per retired request (a memory of
  // about that many), so a workload that changes is followed.
  static constexpr double kShiftTau2Init = 1.0;  // logit^2; the replay's default sigma is 1
  static constexpr double kShiftPriorRequests = 4.0;
  static constexpr double kShiftMemoryRequests = 256.0;

 private:
  struct ShiftPosterior {
    double mode = 0;      // logit shift
    double variance = 0;  // Laplace: 1 / -(second derivative of the log posterior) at the mode
  };
  struct Counts {
    std::array<float, kMaxDraftLen> trials{};
    std::array<float, kMaxDraftLen> successes{};
  };
  static void Add(Counts& c, int verify_len, int accepted);
  // kShift: the request's shift posterior over `pooled_logits` under N(0, tau2_).
  ShiftPosterior Shift(const Counts& c,
                       const std::array<double, kMaxDraftLen>& pooled_logits) const;
  static std::array<double, kMaxDraftLen> Logits(std::array<double, kMaxDraftLen> rates);
  // kShift: one EM step of tau^2 over the tracked requests and the retired ones' memory.
  void RefitShiftVariance();

  double prior_strength_;
  std::array<double, kMaxDraftLen> initial_rates_;
  AcceptanceModel model_;
  Counts pooled_;
  absl::flat_hash_map<int64_t, Counts> per_request_;
  // kShift state.
  double tau2_ = kShiftTau2Init;
  double retired_sum_ = 0;     // decayed sum of retired requests' mode^2 + variance
  double retired_weight_ = 0;  // their decayed count
  int64_t observed_since_refit_ = 0;
};

}  // namespace dpbalance
