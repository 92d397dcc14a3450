#include "dpbalance/lag.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

namespace dpbalance {

PredictedRequest PredictRequest(int64_t seen_ctx, int64_t seen_remaining,
                                absl::Span<const int32_t> pending_verify_len,
                                const AcceptanceCurve& curve, int32_t k_max) {
  PredictedRequest out;
  const int64_t remaining = std::max<int64_t>(seen_remaining, 0);
  const int64_t steps = static_cast<int64_t>(pending_verify_len.size());
  out.ctx_tokens = std::max<int64_t>(seen_ctx, 0);
  out.k_cap = static_cast<int32_t>(std::clamp<int64_t>(remaining - steps - 1, 0, std::max(k_max, 0)));
  if (steps == 0) {  // nothing pending: the state seen is the state
    out.alive = remaining > 0 ? 1.0 : 0.0;
    out.acceptance = curve;
    return out;
  }
  // Step 1: the distribution of the tokens emitted in the pending steps, E in 0..remaining
  // (a request stops emitting once it has emitted all it may).
  int64_t most = 0;
  for (int32_t k : pending_verify_len) most += std::clamp<int32_t>(k, 0, kMaxDraftLen) + 1;
  const int64_t top = std::min(most, remaining);
  std::vector<double> dist(static_cast<size_t>(top) + 1, 0.0), next(dist.size());
  dist[0] = 1.0;
  for (int32_t k_raw : pending_verify_len) {
    const int k = std::clamp<int32_t>(k_raw, 0, kMaxDraftLen);
    std::fill(next.begin(), next.end(), 0.0);
    for (int64_t e = 0; e <= top; ++e) {
      if (dist[e] == 0) continue;
      if (e >= remaining) {  // finished: emits nothing
        next[e] += dist[e];
        continue;
      }
      for (int m = 0; m <= k; ++m) {  // m drafts accepted: P(m) = P_m - P_{m+1} (P_0 = 1)
        const double at_least = m == 0 ? 1.0 : curve.Accept(m);
        const double p = m == k ? at_least : at_least - curve.Accept(m + 1);
        const int64_t emitted = std::min<int64_t>(m + 1, remaining - e);
        next[std::min(e + emitted, top)] += dist[e] * std::max(p, 0.0);
      }
    }
    dist.swap(next);
  }
  // Step 2: what follows from it. P(E <= x) for the survival factors.
  double mean = 0, at_most = 0;
  std::vector<double> cdf(dist.size());
  for (int64_t e = 0; e <= top; ++e) {
    mean += static_cast<double>(e) * dist[e];
    at_most += dist[e];
    cdf[e] = at_most;
  }
  auto prob_at_most = [&](int64_t x) {
    if (x < 0) return 0.0;
    return cdf[static_cast<size_t>(std::min(x, top))] / at_most;
  };
  out.alive = prob_at_most(remaining - 1);
  out.pending_tokens = mean / at_most;
  // Saturating: a context near the int64 limit (bad engine input) must not overflow.
  const int64_t grown = static_cast<int64_t>(std::llround(out.pending_tokens));
  out.ctx_tokens = out.ctx_tokens > std::numeric_limits<int64_t>::max() - grown
                       ? std::numeric_limits<int64_t>::max()
                       : out.ctx_tokens + grown;
  // Step 3: draft j emits only if the request can still emit j + 1 tokens (R - E >= j + 1).
  std::array<double, kMaxDraftLen> survivals{};
  for (int j = 1; j <= kMaxDraftLen; ++j) {
    survivals[j - 1] = std::min(curve.Accept(j) * prob_at_most(remaining - j - 1),
                                j == 1 ? 1.0 : survivals[j - 2]);
  }
  out.acceptance = *AcceptanceCurve::FromSurvivals(survivals);
  return out;
}

PlanRequest LaggedPlanRequest(int64_t seen_ctx, int64_t seen_remaining,
                              absl::Span<const int32_t> pending_verify_len,
                              const AcceptanceCurve& curve, int32_t k_max, uint32_t predict,
                              PredictedRequest* predicted) {
  const PredictedRequest pr = PredictRequest(seen_ctx, seen_remaining, pending_verify_len, curve, k_max);
  PlanRequest p;
  p.ctx_tokens = predict & kPredictContext ? pr.ctx_tokens : seen_ctx;
  p.k_cap = predict & kPredictCap
                ? pr.k_cap
                : static_cast<int32_t>(std::clamp<int64_t>(seen_remaining - 1, 0, std::max(k_max, 0)));
  p.acceptance = predict & kPredictGain ? pr.acceptance : curve;
  if (predicted != nullptr) *predicted = pr;
  return p;
}

}  // namespace dpbalance
