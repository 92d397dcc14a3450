// OnlineStepTerms (step_terms.h): a windowed, robust, prior-anchored fit of the step's
// non-attention terms.
#include "dpbalance/step_terms.h"

#include <Eigen/Dense>
#include <algorithm>
#include <array>
#include <cmath>

#include "dpbalance/calibration.h"
#include "dpbalance/median.h"
#include "hash.h"

namespace dpbalance {
namespace {

// Columns of the fit: the fixed term, the FFN's per-token term, the per-draft-step term.
constexpr int kFixed = 0, kPerToken = 1, kDraft = 2, kTerms = 3;

double Feature(const StepTermsRow& r, int j) {
  return j == kFixed ? 1.0 : j == kPerToken ? r.ffn_tokens : static_cast<double>(r.draft_depth);
}

// Whether feature j varies enough over `rows` to be told from the fixed term: at least
// `min_rows` rows (and `min_share` of them) half a unit or more away from its median.
bool Varies(const std::vector<StepTermsRow>& rows, int j, int min_rows, double min_share) {
  std::vector<double> v;
  v.reserve(rows.size());
  for (const StepTermsRow& r : rows) v.push_back(Feature(r, j));
  const double mid = Median(v);
  int64_t off = 0;
  for (double x : v) off += std::abs(x - mid) >= 0.5 ? 1 : 0;
  return off >= min_rows && static_cast<double>(off) >= min_share * static_cast<double>(rows.size());
}

}  // namespace

OnlineStepTerms::OnlineStepTerms(const GlobalCost& prior, bool learn_draft, Options options)
    : prior_(prior), terms_(prior), learn_draft_(learn_draft), options_(options) {
  options_.window = std::max(options_.window, 1);
  options_.refit_every = std::max(options_.refit_every, 1);
  options_.min_rows = std::clamp(options_.min_rows, 1, options_.window);
  ring_.reserve(static_cast<size_t>(options_.window));
  Publish();
}

void OnlineStepTerms::Reset() {
  ring_.clear();
  next_ = 0;
  rows_seen_ = since_fit_ = fits_ = last_outliers_ = 0;
  sigma_us_ = 0;
  learnt_per_token_ = learnt_draft_ = false;
  terms_ = prior_;
  ++resets_;
  Publish();
}

bool OnlineStepTerms::Observe(const StepTermsRow& row) {
  if (!(std::isfinite(row.ffn_tokens) && std::isfinite(row.other_us) && std::isfinite(row.plugin_us) &&
        row.ffn_tokens >= 0 && row.draft_depth >= 0 && row.plugin_us >= 0)) {
    return false;
  }
  if (ring_.size() < static_cast<size_t>(options_.window)) {
    ring_.push_back(row);
  } else {
    ring_[next_] = row;
    next_ = (next_ + 1) % ring_.size();
  }
  ++rows_seen_;
  ++since_fit_;
  if (static_cast<int64_t>(ring_.size()) < options_.min_rows || since_fit_ < options_.refit_every) {
    return false;
  }
  since_fit_ = 0;
  const uint32_t before = digest_;
  Fit();
  return digest_ != before;
}

void OnlineStepTerms::Fit() {
  // The window in arrival order (the fit does not depend on it, but a fixed order keeps every
  // rank's floating-point sums the same).
  std::vector<StepTermsRow> rows;
  rows.reserve(ring_.size());
  for (size_t i = 0; i < ring_.size(); ++i) rows.push_back(ring_[(next_ + i) % ring_.size()]);

  const std::array<double, kTerms> prior_theta = {prior_.ffn_fixed_us, prior_.ffn_per_token_us,
                                                  prior_.draft_per_step_us};
  std::array<bool, kTerms> fit_term = {
      true, Varies(rows, kPerToken, options_.min_varied_rows, options_.min_varied_share),
      learn_draft_ && Varies(rows, kDraft, options_.min_varied_rows, options_.min_varied_share)};
  // The mean row: each term's coefficient is fitted as its contribution there (microseconds), so
  // the ridge weighs the terms alike whatever their units.
  std::array<double, kTerms> mean{};
  for (const StepTermsRow& r : rows) {
    for (int j = 0; j < kTerms; ++j) mean[j] += Feature(r, j);
  }
  for (int j = 0; j < kTerms; ++j) {
    mean[j] /= static_cast<double>(rows.size());
    if (!(mean[j] > 0)) fit_term[j] = false;
  }
  std::vector<int> cols;
  for (int j = 0; j < kTerms; ++j) {
    if (fit_term[j]) cols.push_back(j);
  }
  const int m = static_cast<int>(cols.size());
  // Each row's target without a held per-token term (at its prior). A draft term the window
  // cannot tell from the fixed one stays in the target: the fixed column fits both, split below.
  auto target = [&](const StepTermsRow& r) {
    return fit_term[kPerToken] ? r.other_us : r.other_us - prior_theta[kPerToken] * r.ffn_tokens;
  };
  Eigen::VectorXd c_prior(m);
  for (int k = 0; k < m; ++k) c_prior[k] = prior_theta[cols[k]] * mean[cols[k]];
  if (!fit_term[kDraft]) c_prior[0] += prior_theta[kDraft] * mean[kDraft];  // cols[0] is kFixed

  // The ridge, `prior_rows` rows' worth of what the window tells: on the step's level at the
  // mean row (the sum of the contributions: 1 per row) and on each other term's slope (its
  // scaled feature's variance per row). So the prior pulls each by about prior_rows / rows of
  // its distance, however little a feature varies, and never trades a term's slope for level.
  Eigen::VectorXd slope(m);
  for (int k = 0; k < m; ++k) {
    slope[k] = 0;
    if (cols[k] == kFixed) continue;
    for (const StepTermsRow& r : rows) {
      const double d = Feature(r, cols[k]) / mean[cols[k]] - 1;
      slope[k] += d * d;
    }
    slope[k] = options_.prior_rows * std::max(slope[k] / static_cast<double>(rows.size()), 1e-6);
  }
  Eigen::MatrixXd penalty = Eigen::MatrixXd::Constant(m, m, options_.prior_rows);
  penalty.diagonal() += slope;
  std::vector<bool> keep(rows.size(), true);
  Eigen::VectorXd c = c_prior;
  for (int pass = 0; pass < 2; ++pass) {
    Eigen::MatrixXd g = penalty;
    Eigen::VectorXd rhs = penalty * c_prior;
    Eigen::VectorXd z(m);
    for (size_t i = 0; i < rows.size(); ++i) {
      if (!keep[i]) continue;
      for (int k = 0; k < m; ++k) z[k] = Feature(rows[i], cols[k]) / mean[cols[k]];
      g.noalias() += z * z.transpose();
      rhs.noalias() += z * target(rows[i]);
    }
    c = SolveNnlsGram(g, rhs, &c);
    if (pass == 1) break;
    // Robust scale of the first pass's residuals; rows beyond it leave the second pass.
    std::vector<double> res(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      for (int k = 0; k < m; ++k) z[k] = Feature(rows[i], cols[k]) / mean[cols[k]];
      res[i] = target(rows[i]) - z.dot(c);
    }
    const double mid = Median(res);
    std::vector<double> dev(res.size());
    for (size_t i = 0; i < res.size(); ++i) dev[i] = std::abs(res[i] - mid);
    // A floor of 1% of the typical row keeps a steady engine's window (residuals that are the
    // ridge's pull, not noise) from dropping its rows of highest leverage.
    std::vector<double> level(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) level[i] = std::abs(target(rows[i]));
    sigma_us_ = std::max({1.4826 * Median(dev), 0.01 * Median(std::move(level)), 1.0});
    last_outliers_ = 0;
    for (size_t i = 0; i < res.size(); ++i) {
      keep[i] = dev[i] <= options_.outlier_sigmas * sigma_us_;
      last_outliers_ += keep[i] ? 0 : 1;
    }
  }
  std::vector<double> plugin;
  plugin.reserve(rows.size());
  for (const StepTermsRow& r : rows) plugin.push_back(r.plugin_us);

  terms_ = prior_;
  for (int k = 0; k < m; ++k) {
    const double theta = c[k] / mean[cols[k]];
    if (cols[k] == kFixed) terms_.ffn_fixed_us = theta;
    if (cols[k] == kPerToken) terms_.ffn_per_token_us = theta;
    if (cols[k] == kDraft) terms_.draft_per_step_us = theta;
  }
  if (!fit_term[kDraft] && mean[kDraft] > 0) {
    // The fixed column fitted the constant and the draft at the window's one depth together:
    // the draft keeps its prior cost unless that alone exceeds what the steps measured.
    const double together = terms_.ffn_fixed_us;
    terms_.draft_per_step_us = std::min(prior_.draft_per_step_us, together / mean[kDraft]);
    terms_.ffn_fixed_us = together - terms_.draft_per_step_us * mean[kDraft];
  }
  terms_.step_overhead_us = Median(std::move(plugin));
  learnt_per_token_ = fit_term[kPerToken];
  learnt_draft_ = fit_term[kDraft];
  ++fits_;
  Publish();
}

void OnlineStepTerms::Publish() {
  internal::Fnv1a h;
  h.Value(terms_.ffn_fixed_us);
  h.Value(terms_.ffn_per_token_us);
  h.Value(terms_.draft_per_step_us);
  h.Value(terms_.step_overhead_us);
  const uint64_t d = h.digest();
  digest_ = static_cast<uint32_t>(d ^ (d >> 32)) | 1u;
}

}  // namespace dpbalance
