// dpbalance/metrics.h — live measurement: running statistics and A/B arms.
//
// Contract: plain value types; not thread-safe (one per rank, updated from its step thread).
// Confidence intervals are normal-approximation 95% intervals over epoch means (the epochs of
// an A/B run are the independent samples; steps within an epoch are correlated).
#pragma once

#include <cmath>
#include <cstdint>

namespace dpbalance {

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
