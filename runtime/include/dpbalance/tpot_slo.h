// dpbalance/tpot_slo.h — per-request TPOT service-level floors for the planner.
//
// Why: the goodput-optimal plan takes the verify slot away from requests that accept little
// (their drafts cost as much as anyone's and pay less). Such a request then emits one token a
// step, and its TPOT (decode time / emitted tokens) follows the step time: on the Azure trace
// the TPOT p99 rose 1.27x (docs/results.md). A TPOT SLO bounds that loss without giving up the
// rest of the plan: only the requests that would break the SLO get a floor, at most the
// default length.
//
// Contract
// - `TpotSlo` keeps, per request id, its decode time so far (the sum of the measured step
//   times of the steps it took part in) and the tokens it emitted (accepted + 1 each step).
// - `Floor(id, default_len, curve)`: taking this step to last as long as the last one, the
//   request needs n = (decode_us + last_step_us) / slo_us - emitted tokens from it to stay
//   within the SLO. The floor is the shortest verify length k <= default_len whose expected
//   tokens, curve.ExpectedTokens(k), reach n: 0 when the bonus token alone does (the planner
//   may then shorten it freely), and at most the default length. A request that cannot keep
//   the SLO even at the default keeps its pace there: the floor is the shortest k whose
//   expected tokens are within kUnreachableTolerance of the default's (0 for drafts that are
//   never accepted: longer verifies would only lengthen its rank's step; the live vLLM tail had
//   such requests, put behind the SLO by one start-up stall, verifying the default length at
//   ~0 acceptance for their whole lives). A request never seen has no history: its first step
//   is judged by the step time alone.
// - `slo_us <= 0` (or not finite) turns the SLO off: every floor is 0 and nothing is kept.
// - Not thread-safe: one per rank, used from that rank's step thread (as AcceptanceEstimator).
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "dpbalance/acceptance.h"

namespace dpbalance {

class TpotSlo {
 public:
  // A request behind the SLO even at the default keeps the default's expected tokens to within
  // this fraction (Floor).
  static constexpr double kUnreachableTolerance = 0.02;
  explicit TpotSlo(double slo_us);

  bool enabled() const { return slo_us_ > 0; }
  double slo_us() const { return slo_us_; }
  // The verify-length floor for request `id` this step, 0..max(default_len, 0) (see above);
  // `curve`: the request's acceptance as the planner sees it.
  int32_t Floor(int64_t id, int32_t default_len, const AcceptanceCurve& curve) const {
    return Floor(id, default_len, curve, 0, 0.0);
  }
  // The same for a step planned ahead of results not yet observed (lag.h): `pending_steps` steps
  // ran since the last observation, each taken to last as long as the last one, and brought the
  // request `pending_tokens` tokens in expectation.
  int32_t Floor(int64_t id, int32_t default_len, const AcceptanceCurve& curve, int pending_steps,
                double pending_tokens) const;
  // After a step that took `step_us` (measured, > 0): request `id` took part and emitted
  // `tokens` (>= 1, the bonus token included). Errors name the bad value; nothing is recorded.
  absl::Status Observe(int64_t id, double step_us, int64_t tokens);
  // The request left the batch.
  void Forget(int64_t id) { per_request_.erase(id); }
  size_t num_tracked() const { return per_request_.size(); }

 private:
  struct Pace {
    double decode_us = 0;
    int64_t tokens = 0;
  };
  double slo_us_;
  double last_step_us_ = 0;
  absl::flat_hash_map<int64_t, Pace> per_request_;
};

}  // namespace dpbalance
