// dpbalance/metrics.h — live measurement: the DP bubble, running statistics and A/B arms.
//
// Contract: plain value types; not thread-safe (one per rank, updated from its step thread).
// Confidence intervals are normal-approximation 95% intervals over epoch means (the epochs of
// an A/B run are the independent samples; steps within an epoch are correlated).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/types/span.h"

namespace dpbalance {

// The DP bubble: the fraction of the instance's attention time that ranks spend idle at the MoE
// barrier. In a step every rank waits for the slowest, so a rank with attention time a_r idles
// max - a_r; over R ranks the idle time is R * (max - mean) out of R * max, and
//   the step's bubble  = 1 - mean / max                (mean, max over the step's ranks)
//   the run's bubble   = 1 - Σ mean / Σ max            (sums over steps: a long step weighs more)
// the run's figure is what docs/results.md and the replay report. A step whose slowest rank has
// no attention time (max = 0) has no bubble (0); so does a run with no steps.
// Times are in µs, finite and >= 0; the caller measures them (wall clock, or a model).
class BubbleMeter {
 public:
  // One step: each rank's attention time, µs. No ranks counts as a step with no attention time.
  void AddStep(absl::Span<const double> rank_attention_us) {
    if (rank_attention_us.empty()) return AddStepMeanMax(0.0, 0.0);
    double sum_us = 0, max_us = 0;
    for (double a : rank_attention_us) {
      sum_us += a;
      max_us = std::max(max_us, a);
    }
    AddStepMeanMax(sum_us / static_cast<double>(rank_attention_us.size()), max_us);
  }
  // One step from its mean and max rank attention time, µs (mean_us <= max_us).
  void AddStepMeanMax(double mean_us, double max_us) {
    ++steps_;
    last_fraction_ = max_us > 0 ? 1 - mean_us / max_us : 0.0;
    last_idle_us_ = max_us - mean_us;
    sum_mean_us_ += mean_us;
    sum_max_us_ += max_us;
    sum_step_fraction_ += last_fraction_;
  }
  int64_t steps() const { return steps_; }
  // The last step's bubble, 1 - mean/max (0 before the first step).
  double last_fraction() const { return last_fraction_; }
  // The last step's idle time per rank, max - mean, µs.
  double last_idle_us() const { return last_idle_us_; }
  // The run's bubble, 1 - Σ mean / Σ max over all steps.
  double fraction() const { return 1 - balance_efficiency(); }
  // Σ mean / Σ max over all steps (1 when no step had attention time).
  double balance_efficiency() const { return sum_max_us_ > 0 ? sum_mean_us_ / sum_max_us_ : 1.0; }
  // The mean of the steps' bubbles (every step weighs the same, however long).
  double mean_step_fraction() const { return steps_ ? sum_step_fraction_ / steps_ : 0.0; }
  // Idle time per rank per step, µs: Σ (max - mean) / steps.
  double mean_idle_us() const { return steps_ ? (sum_max_us_ - sum_mean_us_) / steps_ : 0.0; }

 private:
  int64_t steps_ = 0;
  double last_fraction_ = 0, last_idle_us_ = 0;
  double sum_mean_us_ = 0, sum_max_us_ = 0, sum_step_fraction_ = 0;
};

class RunningStat {  // Welford
 public:
  void Add(double x) {
    ++n_;
    const double d = x - mean_;
    mean_ += d / n_;
    m2_ += d * (x - mean_);
  }
  int64_t count() const { return n_; }
  double mean() const { return n_ ? mean_ : 0.0; }
  double stddev() const { return n_ > 1 ? std::sqrt(m2_ / (n_ - 1)) : 0.0; }
  // Half-width of the 95% confidence interval of the mean.
  double ci95() const { return n_ > 1 ? 1.96 * stddev() / std::sqrt(static_cast<double>(n_)) : 0.0; }

 private:
  int64_t n_ = 0;
  double mean_ = 0, m2_ = 0;
};

// One arm of an A/B run: per-step sums folded into per-epoch means.
class ArmStats {
 public:
  void AddStep(double bubble_fraction, double tokens, double step_us) {
    bubble_sum_ += bubble_fraction;
    tokens_ += tokens;
    time_us_ += step_us;
    ++steps_;
  }
  void EndEpoch() {
    if (steps_ == 0) return;
    bubble_.Add(bubble_sum_ / steps_);
    if (time_us_ > 0) goodput_.Add(tokens_ / (time_us_ * 1e-6));
    bubble_sum_ = tokens_ = time_us_ = 0;
    steps_ = 0;
  }
  const RunningStat& bubble() const { return bubble_; }
  const RunningStat& goodput() const { return goodput_; }

 private:
  double bubble_sum_ = 0, tokens_ = 0, time_us_ = 0;
  int64_t steps_ = 0;
  RunningStat bubble_, goodput_;
};

}  // namespace dpbalance
