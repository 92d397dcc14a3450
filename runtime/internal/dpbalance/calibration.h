// dpbalance/calibration.h — fitting the cost model to measured timings, offline and online.
//
// Contract
// - A `TimingSample` is one rank's batch (as aggregates) and its measured time in microseconds.
// - `FitCostModel` fits every CostModel feature at once by non-negative least absolute
//   *relative* error (rows weighted by 1/measured, so a 40 us and a 40 ms batch count alike;
//   iteratively reweighted NNLS, since MAPE is the figure of merit),
//   over every feature of the model family at once. Which terms matter is decided by the fit
//   (NNLS zeroes the rest); nothing is tuned per data file. A kernel path's extras join the fit
//   only where the rows show both paths (`KernelPathSupport`).
//   Linear algebra: Eigen (column-pivoting Householder QR inside a Lawson-Hanson active set).
// - `OnlineCostModel` refits from a rank's own measured steps on two time scales: the shape is
//   recursive least squares with exponential forgetting kept in normal-equation form (an O(F^2)
//   update per step) and solved with non-negativity every few steps (warm-started NNLS, ridge-
//   anchored to the starting coefficients); a fast global level (log-space EWMA of measured /
//   predicted) follows a hardware or clock change within tens of steps. Residuals are
//   clipped at a multiple of a running robust scale, so one 3x-slow step from a GC pause moves
//   the model little. It starts from given coefficients (an offline fit, or the published form).
//   Cold start: the refit is trusted once `trust_rows` (8) observations agree, i.e. each one's
//   ratio of measured to the starting model's price lies within a factor `outlier_factor` (2) of
//   the median ratio (or 3 robust standard deviations, 1.4826 x the median absolute deviation in
//   log space, where that is wider). Until then `model()` is the starting model, rescaled by the
//   median ratio of the agreeing observations once there are 3; an observation that does not
//   agree (a page fault, a compile, a late rank) is an outlier: dropped, neither fitted nor
//   counted. Trusted, the agreeing rows are fitted in order, and until the robust scale has 50
//   steps behind it a step weighs min(1, threshold / its distance from that median ratio).
//   Not thread-safe (one per rank).
#pragma once

#include <Eigen/Dense>
#include <array>
#include <cmath>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dpbalance/cost_model.h"

namespace dpbalance {

struct TimingSample {
  BatchAggregates agg;
  double measured_us = 0;
};

struct ErrorStats {
  size_t rows = 0;
  double mape = 0;     // mean |pred - measured| / measured
  double p90_ape = 0;
  double max_ape = 0;
};
ErrorStats EvaluateModel(const CostModel& model, absl::Span<const TimingSample> samples);
// The statistics of absolute percentage errors given as fractions (consumes the vector).
ErrorStats SummarizeErrors(std::vector<double> ape);

struct FitOptions {
  std::string name = "fitted";
  // The kernel launch the samples' grid terms were simulated for (kept by the fitted model).
  KernelGrid grid;
  // Features the fit may use (empty: all). The published form's refit uses three.
  std::vector<int> features;
  // The loss on relative errors r: sum |r|^loss_power, by iteratively reweighted NNLS from the
  // least-squares fit. 1 (default): least absolute error, what MAPE measures; 2: least squares,
  // which weighs large errors more: the tail (p90) shrinks, MAPE may grow (docs/cost-model.md).
  double loss_power = 1;
  int irls_iterations = 30;   // 0: plain least squares whatever loss_power says
  double irls_floor = 0.005;  // residuals below 0.5% weigh as 0.5% (keeps weights bounded)
};
absl::StatusOr<CostModel> FitCostModel(absl::Span<const TimingSample> samples,
                                       const FitOptions& options = {});

// Whether timing rows show both kernel paths (every q_i = 1, or some q_i > 1) well enough to fit
// each its own extras. With every feature (`FitOptions::features` empty) the fit gives the paths
// extras only where `split`: each path has at least kMinPathRows rows, and each path's largest
// batch (its key tokens, the sum of its contexts) reaches kMinPathReach of the other's.
// Otherwise the fit keeps the base terms alone and one formula prices both paths: extras fitted
// on a handful of small batches extrapolate (live vLLM rows from speculative arms alone hold five
// one-request decode steps against 13,000 verify steps: their single-query path priced a
// 12-request decode step at 2.6 ms, measured 12 ms; docs/cost-model.md, "Kernel paths").
inline constexpr size_t kMinPathRows = 16;
// A path fitted on batches within a decade of the other's largest extrapolates tolerably (gqa
// with its longest fifth held out: decode rows up to 850k keys of 7.2M, held-out MAPE 3.9%,
// docs/generated/calibrate_gqa_holdout.txt); 55x did not (the live rows above).
inline constexpr double kMinPathReach = 0.1;
struct PathSupport {
  std::array<size_t, 2> rows{};               // [0]: single-query path, [1]: multi-query path
  std::array<double, 2> max_key_tokens{};     // 0 for a path without rows
  bool split = false;
};
PathSupport KernelPathSupport(absl::Span<const TimingSample> samples);

// Non-negative least squares in normal-equation form: argmin x'Gx - 2c'x subject to x >= 0
// (Lawson-Hanson active set; each passive-set solve is Eigen's LDLT). `warm` (optional) is a
// previous solution whose positive entries seed the passive set.
Eigen::VectorXd SolveNnlsGram(const Eigen::MatrixXd& g, const Eigen::VectorXd& c,
                              const Eigen::VectorXd* warm = nullptr);
// argmin ||A x - b|| subject to x >= 0.
inline Eigen::VectorXd SolveNnls(const Eigen::MatrixXd& a, const Eigen::VectorXd& b) {
  return SolveNnlsGram(a.transpose() * a, a.transpose() * b);
}

class OnlineCostModel {
 public:
  struct Options {
    double shape_forgetting = 0.999;  // per step: the shape's memory is ~1000 steps
    int refit_every = 8;              // steps between NNLS solves (each ~tens of microseconds)
    double prior_weight = 0.01;       // ridge towards the starting shape, in steps' worth
    double level_rate = 0.05;         // global scale: EWMA rate in log space (~20 steps)
    double clip_scales = 3.0;         // residuals beyond this many robust scales weigh less
    int trust_rows = 8;               // cold start: observations that agree before the refit
    double outlier_factor = 2.0;      // cold start: how far from the median ratio one may lie
  };
  OnlineCostModel(const CostModel& start, Options options);
  explicit OnlineCostModel(const CostModel& start) : OnlineCostModel(start, Options{}) {}

  // One measured step. Non-finite or non-positive measurements are ignored (returns false).
  bool Observe(const BatchAggregates& agg, double measured_us);
  // The current model: level x shape.
  const CostModel& model() const { return model_; }
  double level() const { return std::exp(log_level_); }
  // Observations fitted (the cold start's once it is trusted).
  int64_t observations() const { return n_; }
  // Whether the refit is trusted yet (before: the starting model, rescaled).
  bool trusted() const { return trusted_; }
  // Cold-start observations dropped as outliers.
  int64_t outliers() const { return outliers_; }

 private:
  // An observation before the refit is trusted.
  struct ColdRow {
    BatchAggregates agg;
    double measured_us;
    double log_ratio;  // log(measured / the starting model's price); NaN where it prices 0
  };
  bool ObserveCold(const BatchAggregates& agg, double measured_us);
  // The shape's update from one observation whose step weighs `weight` (steps 2 and 3).
  void FitRow(const BatchAggregates& agg, double measured_us, double weight);
  void Refit();
  void Publish();

  CostModel model_;
  CostModel start_model_;  // the cold start's reference
  Options options_;
  Eigen::VectorXd start_;   // starting coefficients, scaled units
  Eigen::VectorXd theta_;   // current shape coefficients, scaled units (feature / scale_)
  Eigen::VectorXd scale_;   // per-feature scale, fixed at the feature's first nonzero value
  Eigen::MatrixXd gram_;    // forgetting-weighted sum of h h' (relative-error rows)
  Eigen::VectorXd rhs_;     // forgetting-weighted sum of h
  double log_level_ = 0;        // fast global scale (hardware, clocks, co-tenants)
  double robust_scale_ = 0.1;   // running mean |relative residual|
  int64_t n_ = 0;
  // Cold start: its rows until trusted; then the agreeing rows' median log ratio and the
  // distance from it beyond which a warm-up step weighs less.
  std::vector<ColdRow> cold_;
  bool trusted_ = false;
  double cold_median_ = 0, cold_threshold_ = 0;
  int64_t outliers_ = 0;
};

}  // namespace dpbalance
