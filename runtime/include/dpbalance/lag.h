// dpbalance/lag.h — a request as it will be when the step being planned runs, seen from an
// engine that plans ahead of its results.
//
// Why: under SGLang's overlap scheduler and vLLM's async scheduling, the verify lengths of step
// t are fixed while step t - 1 (and, deeper pipelines, more) still runs. The engine knows what it
// scheduled in those pending steps, but not how many drafts each accepted. Planning on the last
// state seen as if it were current prices the wrong contexts, plans drafts a request can no
// longer emit, gives verify work to requests that may already have finished, and (with a TPOT
// SLO) judges a request's pace without the tokens the pending steps brought it.
// `PredictRequest` turns the last state seen plus the pending steps into what the planner should
// plan with: expected context, the cap it can be sure of, and an acceptance curve whose
// position j is worth what verifying draft j is expected to emit now.
//
// Model: in each pending step s the request verified k_s drafts and emitted min(m_s + 1,
// remaining) tokens, m_s accepted with P(m_s >= j) = curve.Accept(j) for j <= k_s, independent
// across steps; a request that has emitted all it may emits nothing more (it finished; the
// engine learns so only when the step's results arrive).
//
// Contract: pure function, thread-compatible. Inputs are clamped, never rejected: negative
// counts are 0, pending lengths above kMaxDraftLen count as kMaxDraftLen.
#pragma once

#include <cstdint>

#include "absl/types/span.h"
#include "dpbalance/acceptance.h"

namespace dpbalance {

struct PredictedRequest {
  int64_t ctx_tokens = 0;     // expected context when the step runs (seen + expected emitted)
  int32_t k_cap = 0;          // the largest verify length that can still emit anything: the
                              // tokens it may emit as seen, less one per pending step, less one
  double alive = 1;           // probability it has not finished before the step
  double pending_tokens = 0;  // expected tokens the pending steps emitted
  // Position j's survival times the probability the request can still emit draft j
  // (remaining >= j + 1 after the pending steps): the expected tokens draft j adds now.
  AcceptanceCurve acceptance;
};

// `seen_ctx` / `seen_remaining`: the request's context and the tokens it may still emit as last
// seen, before the pending steps; `pending_verify_len`: the verify lengths the engine scheduled
// for it in each step since, oldest first (empty: nothing pending, the prediction is the state
// seen); `curve`: its acceptance as estimated; `k_max`: the draft depth limit.
PredictedRequest PredictRequest(int64_t seen_ctx, int64_t seen_remaining,
                                absl::Span<const int32_t> pending_verify_len,
                                const AcceptanceCurve& curve, int32_t k_max);

}  // namespace dpbalance
