#include "dpbalance/calibration.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_format.h"
#include "dpbalance/median.h"

namespace dpbalance {
namespace {

constexpr int kF = kNumCostFeatures;
// Cold-start observations before the level leaves the starting model's (a median of fewer
// cannot outvote one outlier).
constexpr size_t kLevelRows = 3;
// Steps before the running robust scale is trusted for the Huber weight.
constexpr int64_t kWarmup = 50;
// Standard deviations per median absolute deviation, for normally distributed values.
constexpr double kMadToSigma = 1.4826;

// A row the fit uses (and KernelPathSupport counts): a positive, finite measured time.
bool Usable(const TimingSample& s) { return s.measured_us > 0 && std::isfinite(s.measured_us); }

}  // namespace

ErrorStats EvaluateModel(const CostModel& model, absl::Span<const TimingSample> samples) {
  std::vector<double> ape;
  for (const TimingSample& s : samples) {
    if (!(s.measured_us > 0)) continue;
    ape.push_back(std::abs(model.AttentionUs(s.agg) - s.measured_us) / s.measured_us);
  }
  return SummarizeErrors(std::move(ape));
}

ErrorStats SummarizeErrors(std::vector<double> ape) {
  ErrorStats e;
  e.rows = ape.size();
  if (ape.empty()) return e;
  double sum = 0;
  for (double a : ape) sum += a;
  e.mape = sum / ape.size();
  std::sort(ape.begin(), ape.end());
  e.p90_ape = ape[std::min(ape.size() - 1, static_cast<size_t>(0.9 * (ape.size() - 1) + 0.5))];
  e.max_ape = ape.back();
  return e;
}

Eigen::VectorXd SolveNnlsGram(const Eigen::MatrixXd& g, const Eigen::VectorXd& c,
                              const Eigen::VectorXd* warm) {
  const int n = static_cast<int>(g.cols());
  Eigen::VectorXd x = Eigen::VectorXd::Zero(n);
  std::vector<bool> passive(n, false);
  const double tol = 1e-12 * std::max(1.0, g.norm());
  // Solves the unconstrained problem on the passive set.
  auto solve_passive = [&](Eigen::VectorXd* z) {
    std::vector<int> idx;
    for (int j = 0; j < n; ++j) {
      if (passive[j]) idx.push_back(j);
    }
    z->setZero(n);
    if (idx.empty()) return;
    Eigen::MatrixXd gp(idx.size(), idx.size());
    Eigen::VectorXd cp(idx.size());
    for (size_t r = 0; r < idx.size(); ++r) {
      cp(r) = c(idx[r]);
      for (size_t k = 0; k < idx.size(); ++k) gp(r, k) = g(idx[r], idx[k]);
    }
    const Eigen::VectorXd zp = gp.ldlt().solve(cp);
    for (size_t k = 0; k < idx.size(); ++k) (*z)(idx[k]) = zp(k);
  };
  // Step 1 (optional): seed the passive set from a previous solution and make it feasible.
  auto restore_feasibility = [&](Eigen::VectorXd z) {
    for (int inner = 0; inner < 3 * n; ++inner) {
      bool all_positive = true;
      for (int j = 0; j < n; ++j) all_positive = all_positive && (!passive[j] || z(j) > 0);
      if (all_positive) break;
      double alpha = 1;
      for (int j = 0; j < n; ++j) {
        if (passive[j] && z(j) <= 0) alpha = std::min(alpha, x(j) / (x(j) - z(j)));
      }
      x += alpha * (z - x);
      for (int j = 0; j < n; ++j) {
        if (passive[j] && x(j) <= 1e-15) {
          passive[j] = false;
          x(j) = 0;
        }
      }
      solve_passive(&z);
    }
    x = z;
    for (int j = 0; j < n; ++j) x(j) = passive[j] ? std::max(0.0, x(j)) : 0.0;
  };
  if (warm != nullptr && warm->size() == n) {
    for (int j = 0; j < n; ++j) passive[j] = (*warm)(j) > 0;
    x = warm->cwiseMax(0.0);
    Eigen::VectorXd z;
    solve_passive(&z);
    restore_feasibility(z);
  }
  // Step 2: Lawson-Hanson: bring in the most violated variable until the gradient is <= 0.
  for (int outer = 0; outer < 3 * n; ++outer) {
    const Eigen::VectorXd w = c - g * x;
    int t = -1;
    for (int j = 0; j < n; ++j) {
      if (!passive[j] && w(j) > tol && (t < 0 || w(j) > w(t))) t = j;
    }
    if (t < 0) break;
    passive[t] = true;
    Eigen::VectorXd z;
    solve_passive(&z);
    restore_feasibility(z);
  }
  return x;
}

PathSupport KernelPathSupport(absl::Span<const TimingSample> samples) {
  PathSupport p;
  for (const TimingSample& s : samples) {
    if (!Usable(s)) continue;
    const int m = s.agg.multi_query ? 1 : 0;
    p.rows[m] += 1;
    p.max_key_tokens[m] = std::max(p.max_key_tokens[m], s.agg.key_tokens);
  }
  p.split = p.rows[0] >= kMinPathRows && p.rows[1] >= kMinPathRows &&
            p.max_key_tokens[0] >= kMinPathReach * p.max_key_tokens[1] &&
            p.max_key_tokens[1] >= kMinPathReach * p.max_key_tokens[0];
  return p;
}

absl::StatusOr<CostModel> FitCostModel(absl::Span<const TimingSample> samples,
                                       const FitOptions& options) {
  if (!(options.loss_power >= 1 && options.loss_power <= 3)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("fit: loss_power %g must be in [1, 3]", options.loss_power));
  }
  std::vector<const TimingSample*> rows;
  for (const TimingSample& s : samples) {
    if (Usable(s)) rows.push_back(&s);
  }
  std::vector<int> cols = options.features;
  if (cols.empty()) {
    const int last = KernelPathSupport(samples).split ? kF : kNumCostTerms;
    for (int f = 0; f < last; ++f) cols.push_back(f);
  }
  if (rows.size() < 2 * cols.size() / 3 + 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "fit: %d usable timing rows for %d features", rows.size(), cols.size()));
  }
  absl::StatusOr<CostModel> shape_or = CostModel::Create(CostModel::Weights{}, "shape", options.grid);
  if (!shape_or.ok()) return shape_or.status();
  const CostModel& shape = *shape_or;
  // Relative-error rows: x / y against 1. Columns scaled to unit norm for conditioning.
  Eigen::MatrixXd a(rows.size(), cols.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const CostModel::Weights x = shape.Features(rows[i]->agg);
    for (size_t c = 0; c < cols.size(); ++c) a(i, c) = x[cols[c]] / rows[i]->measured_us;
  }
  Eigen::VectorXd norm = a.colwise().norm().transpose();
  for (Eigen::Index c = 0; c < a.cols(); ++c) {
    if (norm(c) > 0) a.col(c) /= norm(c);
  }
  // The loss sum |r_i|^p by iteratively reweighted NNLS: each row weighted by |r_i|^((p-2)/2)
  // turns its squared residual into |r_i|^p. p = 1 (least absolute relative error) is what MAPE
  // measures and keeps the noisy tail of the measurements from dragging the fit; p = 2 needs no
  // reweighting.
  const Eigen::VectorXd ones = Eigen::VectorXd::Ones(rows.size());
  Eigen::VectorXd sol = SolveNnls(a, ones);
  const double exponent = (options.loss_power - 2) / 2;
  for (int iter = 0; exponent != 0 && iter < options.irls_iterations; ++iter) {
    const Eigen::VectorXd r = (a * sol - ones).cwiseAbs();
    const Eigen::VectorXd wt = r.cwiseMax(options.irls_floor).array().pow(exponent).matrix();
    sol = SolveNnls(wt.asDiagonal() * a, wt);
  }
  CostModel::Weights w{};
  for (size_t c = 0; c < cols.size(); ++c) w[cols[c]] += norm(c) > 0 ? sol(c) / norm(c) : 0.0;
  return CostModel::Create(w, options.name, options.grid);
}

OnlineCostModel::OnlineCostModel(const CostModel& start, Options options)
    : model_(start), start_model_(start), options_(options) {
  start_.resize(kF);
  for (int f = 0; f < kF; ++f) start_(f) = start.weights_us()[f];
  theta_ = start_;
  scale_ = Eigen::VectorXd::Zero(kF);
  gram_ = Eigen::MatrixXd::Zero(kF, kF);
  rhs_ = Eigen::VectorXd::Zero(kF);
}

void OnlineCostModel::Refit() {
  // Ridge towards the starting shape keeps features with no data yet where they started.
  const double p = options_.prior_weight;
  const Eigen::MatrixXd g = gram_ + p * Eigen::MatrixXd::Identity(kF, kF);
  const Eigen::VectorXd c = rhs_ + p * start_;
  theta_ = SolveNnlsGram(g, c, &theta_);
}

void OnlineCostModel::Publish() {
  CostModel::Weights w{};
  const double level = std::exp(log_level_);
  for (int f = 0; f < kF; ++f) w[f] = level * (scale_(f) > 0 ? theta_(f) / scale_(f) : start_(f));
  absl::StatusOr<CostModel> m = CostModel::Create(w, model_.name(), model_.kernel_grid());
  if (m.ok()) model_ = m->WithGridSimulation(model_.grid_simulation());
}

bool OnlineCostModel::Observe(const BatchAggregates& agg, double measured_us) {
  if (!(measured_us > 0) || !std::isfinite(measured_us)) return false;
  if (!trusted_) return ObserveCold(agg, measured_us);
  // Step 1: the fast level, from the clipped log ratio of measured to predicted (level x shape).
  const double limit = options_.clip_scales * robust_scale_;
  const double predicted = model_.AttentionUs(agg);
  if (predicted > 0) {
    const double log_ratio = std::log(measured_us / predicted);
    log_level_ += options_.level_rate * std::max(-limit, std::min(limit, log_ratio));
  }
  // Until the robust scale is learned, a step far from the cold start's median ratio (against
  // the starting model) weighs less, as far beyond as it lies.
  double weight = 1;
  const double start_price = start_model_.AttentionUs(agg);
  if (n_ < kWarmup && start_price > 0) {
    const double distance = std::abs(std::log(measured_us / start_price) - cold_median_);
    if (distance > cold_threshold_) weight = cold_threshold_ / distance;
  }
  FitRow(agg, measured_us, weight);
  if (n_ <= kWarmup || n_ % options_.refit_every == 0) Refit();
  Publish();
  return true;
}

bool OnlineCostModel::ObserveCold(const BatchAggregates& agg, double measured_us) {
  const double price = start_model_.AttentionUs(agg);
  cold_.push_back({agg, measured_us, price > 0 ? std::log(measured_us / price) : std::nan("")});
  // Step 1: the median ratio of the rows so far, and how far from it a row may lie.
  std::vector<double> ratios;
  for (const ColdRow& c : cold_) {
    if (std::isfinite(c.log_ratio)) ratios.push_back(c.log_ratio);
  }
  if (ratios.size() < kLevelRows) return true;  // the starting model as given
  const double median = Median(ratios);
  for (double& x : ratios) x = std::abs(x - median);
  const double threshold =
      std::max(std::log(options_.outlier_factor), 3 * kMadToSigma * Median(ratios));
  auto agrees = [&](const ColdRow& c) {
    return !std::isfinite(c.log_ratio) || std::abs(c.log_ratio - median) <= threshold;
  };
  // Step 2: the level from the rows that agree (at least half of them lie within one median
  // absolute deviation, well inside the threshold).
  std::vector<double> agreeing;
  int num_agree = 0;
  for (const ColdRow& c : cold_) {
    if (!agrees(c)) continue;
    ++num_agree;
    if (std::isfinite(c.log_ratio)) agreeing.push_back(c.log_ratio);
  }
  log_level_ = Median(agreeing);
  // Step 3: trusted: the agreeing rows are the refit's first, in order. A row that did not
  // agree is fitted after them if the refit prices it within the threshold (the starting
  // model's shape, not the row, was off); otherwise it is an outlier, dropped.
  if (num_agree >= options_.trust_rows) {
    trusted_ = true;
    cold_median_ = log_level_;
    cold_threshold_ = threshold;
    for (const ColdRow& c : cold_) {
      if (!agrees(c)) continue;
      FitRow(c.agg, c.measured_us, 1.0);
      Refit();
    }
    Publish();
    for (const ColdRow& c : cold_) {
      if (agrees(c)) continue;
      if (std::abs(std::log(c.measured_us / model_.AttentionUs(c.agg))) > threshold) {
        ++outliers_;
        continue;
      }
      FitRow(c.agg, c.measured_us, 1.0);
      Refit();
      Publish();
    }
    cold_.clear();
    cold_.shrink_to_fit();
  }
  Publish();
  return true;
}

void OnlineCostModel::FitRow(const BatchAggregates& agg, double measured_us, double warmup_weight) {
  const double limit = options_.clip_scales * robust_scale_;
  const double target = measured_us / std::exp(log_level_);  // what the shape must predict
  // Step 2: fix each feature's scale the first time it is nonzero, in relative units (its value
  // over the step's time then), so every row adds O(1) to the normal equations, like the prior.
  const CostModel::Weights raw = model_.Features(agg);
  Eigen::VectorXd h(kF);
  for (int f = 0; f < kF; ++f) {
    if (scale_(f) == 0 && raw[f] != 0) {
      scale_(f) = std::abs(raw[f]) / target;
      theta_(f) *= scale_(f);
      start_(f) *= scale_(f);
    }
    h(f) = scale_(f) > 0 ? raw[f] / scale_(f) / target : 0.0;
  }
  // Step 3: the shape's normal equations (relative error: h . theta ~ 1), with a Huber weight on
  // outlying steps once the robust scale has been learned (`warmup_weight` before).
  const double r = 1.0 - h.dot(theta_);
  const double weight = n_ < kWarmup ? warmup_weight : std::abs(r) <= limit ? 1.0 : limit / std::abs(r);
  robust_scale_ = 0.95 * robust_scale_ + 0.05 * std::min(std::abs(r), 2 * limit + 1e-3);
  gram_ *= options_.shape_forgetting;
  rhs_ *= options_.shape_forgetting;
  gram_.noalias() += weight * h * h.transpose();
  rhs_ += weight * h;
  ++n_;
}

}  // namespace dpbalance
