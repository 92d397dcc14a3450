#include "dpbalance/tpot_slo.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "absl/strings/str_format.h"

namespace dpbalance {

TpotSlo::TpotSlo(double slo_us) : slo_us_(std::isfinite(slo_us) && slo_us > 0 ? slo_us : 0) {}

int32_t TpotSlo::Floor(int64_t id, int32_t default_len, const AcceptanceCurve& curve,
                       int pending_steps, double pending_tokens) const {
  if (!enabled() || default_len <= 0) return 0;
  Pace p;
  if (auto it = per_request_.find(id); it != per_request_.end()) p = it->second;
  // Tokens this step must bring: (decode + pending + step) / (emitted + pending + n) <= slo.
  const double steps = 1.0 + std::max(pending_steps, 0);
  const double need = (p.decode_us + steps * last_step_us_) / slo_us_ -
                      static_cast<double>(p.tokens) - std::max(pending_tokens, 0.0);
  double expected = 1.0;  // curve.ExpectedTokens(k), summed in the same order
  std::array<double, kMaxDraftLen + 1> by_len{};
  const int32_t top = std::min<int32_t>(default_len, kMaxDraftLen);
  for (int32_t k = 0; k < top; ++k) {
    if (expected >= need) return k;
    by_len[k] = expected;
    expected += curve.Accept(k + 1);
  }
  if (expected >= need) return top;
  // Not even the default keeps the SLO (a stall put the request far behind, or its drafts are
  // rarely accepted): what the floor can still keep is the request's pace at the default. Its
  // shortest length within kUnreachableTolerance of the default's expected tokens does; longer
  // verifies only lengthen its rank's step (a request whose drafts are never accepted: 0).
  for (int32_t k = 0; k < top; ++k) {
    if (by_len[k] >= (1.0 - kUnreachableTolerance) * expected) return k;
  }
  return top;
}

absl::Status TpotSlo::Observe(int64_t id, double step_us, int64_t tokens) {
  if (!(std::isfinite(step_us) && step_us > 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tpot slo: request %d: step time %g us must be finite and > 0", id, step_us));
  }
  if (tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tpot slo: request %d: %d tokens emitted in a step, must be >= 1", id, tokens));
  }
  if (!enabled()) return absl::OkStatus();
  last_step_us_ = step_us;
  Pace& p = per_request_[id];
  p.decode_us += step_us;
  p.tokens += tokens;
  return absl::OkStatus();
}

}  // namespace dpbalance
