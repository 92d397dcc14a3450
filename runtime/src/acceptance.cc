#include "dpbalance/acceptance.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"

namespace dpbalance {

absl::StatusOr<AcceptanceCurve> AcceptanceCurve::FromConditional(absl::Span<const double> rates) {
  if (rates.size() > kMaxDraftLen) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "acceptance: %d conditional rates given, at most %d supported", rates.size(), kMaxDraftLen));
  }
  AcceptanceCurve c;
  double p = 1.0;
  for (size_t j = 0; j < rates.size(); ++j) {
    const double a = rates[j];
    if (!(a >= 0.0 && a <= 1.0)) {  // also rejects NaN
      return absl::InvalidArgumentError(
          absl::StrFormat("acceptance: conditional rate at position %d is %g, not in [0, 1]", j + 1, a));
    }
    p *= a;
    c.cum_[j] = p;
  }
  return c;
}

absl::StatusOr<AcceptanceCurve> AcceptanceCurve::FromConfidences(absl::Span<const float> conf) {
  std::array<double, kMaxDraftLen> rates{};
  if (conf.size() > kMaxDraftLen) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "acceptance: %d draft confidences given, at most %d supported", conf.size(), kMaxDraftLen));
  }
  for (size_t j = 0; j < conf.size(); ++j) rates[j] = conf[j];
  return FromConditional(absl::MakeConstSpan(rates.data(), conf.size()));
}

absl::StatusOr<AcceptanceCurve> AcceptanceCurve::FromSurvivals(absl::Span<const double> survivals) {
  if (survivals.size() > kMaxDraftLen) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "acceptance: %d survivals given, at most %d supported", survivals.size(), kMaxDraftLen));
  }
  AcceptanceCurve c;
  double prev = 1.0;
  for (size_t j = 0; j < survivals.size(); ++j) {
    const double p = survivals[j];
    if (!(p >= 0.0 && p <= prev)) {  // also rejects NaN
      return absl::InvalidArgumentError(absl::StrFormat(
          "acceptance: survival at position %d is %g, not in [0, %g] (survivals never rise)", j + 1,
          p, prev));
    }
    c.cum_[j] = p;
    prev = p;
  }
  return c;
}

double AcceptanceCurve::ExpectedTokens(int k) const {
  double e = bonus_;
  for (int j = 0; j < k && j < kMaxDraftLen; ++j) e += cum_[j];
  return e;
}

AcceptanceCurve AcceptanceCurve::Valued(double value) const {
  AcceptanceCurve c = *this;
  for (double& p : c.cum_) p *= value;
  c.bonus_ = bonus_ * value;
  return c;
}

std::array<double, kMaxDraftLen> MtpK8ConditionalProfile() {
  // Per-position (cumulative) acceptance P_j of a multi-layer MTP draft, K = 8, GSM8K,
  // temperature 0, as measured on vLLM; a_j = P_j / P_{j-1}.
  constexpr double kCumulative[kMaxDraftLen] = {0.762, 0.616, 0.513, 0.424,
                                                0.364, 0.309, 0.272, 0.237};
  std::array<double, kMaxDraftLen> a{};
  double prev = 1.0;
  for (int j = 0; j < kMaxDraftLen; ++j) {
    a[j] = kCumulative[j] / prev;
    prev = kCumulative[j];
  }
  return a;
}

std::array<double, kMaxDraftLen> ShiftedProfile(const std::array<double, kMaxDraftLen>& profile,
                                                double logit_shift) {
  std::array<double, kMaxDraftLen> a{};
  for (int j = 0; j < kMaxDraftLen; ++j) {
    const double p = std::min(std::max(profile[j], 1e-9), 1 - 1e-9);
    a[j] = 1 / (1 + std::exp(-(std::log(p / (1 - p)) + logit_shift)));
  }
  return a;
}

absl::StatusOr<AcceptanceModel> ParseAcceptanceModel(std::string_view name) {
  if (name == "beta") return AcceptanceModel::kBeta;
  if (name == "shift") return AcceptanceModel::kShift;
  return absl::InvalidArgumentError(
      absl::StrFormat("acceptance model '%s' is not beta or shift", name));
}

std::string_view AcceptanceModelName(AcceptanceModel model) {
  return model == AcceptanceModel::kShift ? "shift" : "beta";
}

AcceptanceEstimator::AcceptanceEstimator(double prior_strength,
                                         std::array<double, kMaxDraftLen> initial_rates,
                                         AcceptanceModel model)
    : prior_strength_(prior_strength > 0 ? prior_strength : 1.0),
      initial_rates_(initial_rates),
      model_(model) {}

void AcceptanceEstimator::Add(Counts& c, int verify_len, int accepted) {
  for (int j = 0; j < verify_len; ++j) {
    if (j > accepted) break;  // unobserved after the first rejection
    c.trials[j] += 1;
    if (j < accepted) c.successes[j] += 1;
  }
}

absl::Status AcceptanceEstimator::Observe(int64_t request_id, int verify_len, int accepted) {
  if (verify_len < 0 || verify_len > kMaxDraftLen || accepted < 0 || accepted > verify_len) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "acceptance: request %d reported accepted=%d of verify_len=%d (need 0 <= accepted <= "
        "verify_len <= %d)",
        request_id, accepted, verify_len, kMaxDraftLen));
  }
  Add(pooled_, verify_len, accepted);
  Add(per_request_[request_id], verify_len, accepted);
  // About once a step: after as many observations as there are requests tracked.
  if (model_ == AcceptanceModel::kShift &&
      ++observed_since_refit_ >= static_cast<int64_t>(per_request_.size())) {
    RefitShiftVariance();
  }
  return absl::OkStatus();
}

void AcceptanceEstimator::Forget(int64_t request_id) {
  const auto it = per_request_.find(request_id);
  if (it == per_request_.end()) return;
  if (model_ == AcceptanceModel::kShift) {
    const ShiftPosterior post = Shift(it->second, Logits(PooledRates()));
    constexpr double kKeep = 1.0 - 1.0 / kShiftMemoryRequests;
    retired_sum_ = retired_sum_ * kKeep + post.mode * post.mode + post.variance;
    retired_weight_ = retired_weight_ * kKeep + 1.0;
  }
  per_request_.erase(it);
}

std::array<double, kMaxDraftLen> AcceptanceEstimator::Logits(
    std::array<double, kMaxDraftLen> rates) {
  for (double& x : rates) {
    const double p = std::clamp(x, 1e-6, 1 - 1e-6);
    x = std::log(p / (1 - p));
  }
  return rates;
}

// Newton on the log posterior of s, which is strictly concave (the prior's -s^2 / 2 tau^2 plus
// Bernoulli log-likelihoods of sigmoid(b_j + s)), so it converges from 0 in a few steps.
AcceptanceEstimator::ShiftPosterior AcceptanceEstimator::Shift(
    const Counts& c, const std::array<double, kMaxDraftLen>& pooled_logits) const {
  constexpr double kMaxShift = 15;  // logits: rates within ~3e-7 of 0 or 1 at a pooled 0.5
  double s = 0;
  double curvature = 1 / tau2_;  // -(second derivative) at s
  for (int iter = 0; iter < 50; ++iter) {
    double gradient = -s / tau2_;
    curvature = 1 / tau2_;
    for (int j = 0; j < kMaxDraftLen; ++j) {
      if (c.trials[j] == 0) continue;
      const double p = 1 / (1 + std::exp(-(pooled_logits[j] + s)));
      gradient += c.successes[j] - c.trials[j] * p;
      curvature += c.trials[j] * p * (1 - p);
    }
    const double step = gradient / curvature;
    s = std::clamp(s + step, -kMaxShift, kMaxShift);
    if (std::abs(step) < 1e-9) break;
  }
  return {s, 1 / curvature};
}

void AcceptanceEstimator::RefitShiftVariance() {
  observed_since_refit_ = 0;
  const std::array<double, kMaxDraftLen> b = Logits(PooledRates());
  // Summed in request-id order: the hash map's order changes from process to process, and a
  // last-bit difference in tau^2 would make two runs of the same stream plan differently.
  std::vector<std::pair<int64_t, double>> terms;
  terms.reserve(per_request_.size());
  for (const auto& [id, c] : per_request_) {
    const ShiftPosterior post = Shift(c, b);
    terms.emplace_back(id, post.mode * post.mode + post.variance);
  }
  std::sort(terms.begin(), terms.end());
  double sum = kShiftPriorRequests * kShiftTau2Init + retired_sum_;
  for (const auto& [id, term] : terms) sum += term;
  const double weight = kShiftPriorRequests + retired_weight_ + static_cast<double>(terms.size());
  tau2_ = std::clamp(sum / weight, 1e-4, 100.0);
}

std::array<double, kMaxDraftLen> AcceptanceEstimator::PooledRates() const {
  // The initial rates act as a prior worth `prior_strength_` observations per position.
  std::array<double, kMaxDraftLen> a{};
  for (int j = 0; j < kMaxDraftLen; ++j) {
    a[j] = (pooled_.successes[j] + prior_strength_ * initial_rates_[j]) /
           (pooled_.trials[j] + prior_strength_);
  }
  return a;
}

AcceptanceCurve AcceptanceEstimator::Curve(int64_t request_id) const {
  std::array<double, kMaxDraftLen> a = PooledRates();
  const auto it = per_request_.find(request_id);
  if (it != per_request_.end() && model_ == AcceptanceModel::kShift) {
    const std::array<double, kMaxDraftLen> b = Logits(a);
    const double s = Shift(it->second, b).mode;
    for (int j = 0; j < kMaxDraftLen; ++j) a[j] = 1 / (1 + std::exp(-(b[j] + s)));
  } else if (it != per_request_.end()) {
    const Counts& c = it->second;
    for (int j = 0; j < kMaxDraftLen; ++j) {
      a[j] = (c.successes[j] + prior_strength_ * a[j]) / (c.trials[j] + prior_strength_);
    }
  }
  return *AcceptanceCurve::FromConditional(a);
}

}  // namespace dpbalance
