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
#include "dpbalance/planner.h"

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

// Which parts of the prediction the planner uses; each on its own is a bit, so that the cost of
// lag can be split by part (the replay's --lag_predict, docs/results.md 8).
enum LagPredict : uint32_t {
  kPredictNone = 0,
  kPredictContext = 1u << 0,  // contexts after the pending steps' expected tokens
  kPredictCap = 1u << 1,      // caps less one token per pending step
  kPredictGain = 1u << 2,     // gains times the probability the request can still emit them
  kPredictSlo = 1u << 3,      // TPOT floors credit the pending steps' expected tokens
  kPredictAll = kPredictContext | kPredictCap | kPredictGain | kPredictSlo,
};

// The planner's request for a step planned ahead of results (the one builder the replay and the
// Balancer share): PredictRequest's parts that `predict` names, the state seen for the rest.
// With nothing pending it is the state seen: ctx `seen_ctx`, cap min(seen_remaining - 1, k_max),
// acceptance `curve`. k_min is left 0 (the caller's TPOT floor: TpotSlo::Floor with
// `predicted->pending_tokens` when kPredictSlo). `predicted` (may be null) receives the
// prediction itself.
PlanRequest LaggedPlanRequest(int64_t seen_ctx, int64_t seen_remaining,
                              absl::Span<const int32_t> pending_verify_len,
                              const AcceptanceCurve& curve, int32_t k_max, uint32_t predict,
                              PredictedRequest* predicted = nullptr);

}  // namespace dpbalance
