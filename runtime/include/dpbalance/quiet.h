// dpbalance/quiet.h — skipping the exchange while balancing keeps the default plan.
//
// When the planner keeps every rank at its default lengths step after step (the default guard:
// the predicted gain does not pay for the exchange and the model's error), the exchange buys
// nothing and still costs a collective per step. Quiet mode skips it: after `after` exchanged
// steps in a row whose decision kept the default plan, every rank runs its default lengths for a
// span of steps without exchanging, then exchanges again (a probe). A probe that keeps the
// default again doubles the span, up to `max_steps`; any other decision ends quiet mode until
// the next streak. Steady state with nothing to balance: one exchange every max_steps + 1 steps.
//
// Contract
// - Every rank must skip exactly the same steps (the exchange is a collective). So a span starts
//   only from the exchange itself: each record proposes a level (this rank's readiness, in the
//   record's flags, QuietSchedule::ProposalFlags) and the span is that of the smallest level
//   among all gathered records, and only when the step's decision, computed from the same bytes,
//   kept the default. A rank that is not ready (a failed local input, a disabled balancer, an
//   engine-written idle row, a record without the plugin) proposes level 0, so nobody goes quiet.
// - A span once started plays out on every rank whatever its local state (a local failure, a
//   disable), so the next exchange is on the same step everywhere; what changed is then said in
//   that exchange.
// - Off (`after` = 0): never skips, proposes nothing; records are as without it.
// - Use it only where the exchange is the plugin's alone: on a quiet step the balancer calls no
//   all-gather, so an engine whose own per-step sync rides in the exchange must keep it off (the
//   Python adapter's Piggyback then still runs the engine's sync, without the plugin).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "dpbalance/summary.h"

namespace dpbalance {

// The proposal's bits in RankSummary::flags: a level 0..15.
inline constexpr int kSummaryQuietShift = 8;
inline constexpr uint16_t kSummaryQuietMask = 0x0f00;

struct QuietConfig {
  static constexpr int kMaxAfter = 1000;  // the bounds Validate checks (and the flags say)
  static constexpr int kMaxSpan = 4096;
  int after = 0;       // kept-default exchanges in a row before the first span (0: off), <= kMaxAfter
  int max_steps = 32;  // the longest span, 1..kMaxSpan
  absl::Status Validate() const;
};

class QuietSchedule {
 public:
  explicit QuietSchedule(QuietConfig config = {});

  // Before a step's exchange: true when this step is quiet (no exchange, default lengths).
  bool SkipStep();
  // This rank's proposal for the record it is about to send (OR into RankSummary::flags).
  uint16_t ProposalFlags() const;
  // After an exchange whose records this rank read and whose decision it computed:
  // `kept_default` is the decision's GlobalDecision::kept_default (false when there was none or
  // the A/B arm was off). Starts a span when every record proposed one and the default was kept.
  void AfterExchange(absl::Span<const RankSummary> records, bool kept_default);
  // The same with the smallest proposal already known (`agreed`, a level 0..15): the replay's
  // instance, whose ranks share one schedule, passes its own.
  void AfterAgreement(int agreed, bool kept_default);
  int ProposedLevel() const { return level_; }
  // An exchange this rank could not read (it failed here): readiness starts over. A span in
  // progress is not touched.
  void Reset();

  // Steps of a span at `level` (1..15), and the level whose span is max_steps.
  int SpanSteps(int level) const;
  int MaxLevel() const { return max_level_; }
  static int Level(uint16_t flags) { return (flags & kSummaryQuietMask) >> kSummaryQuietShift; }

  bool on() const { return config_.after > 0; }
  int64_t quiet_steps() const { return quiet_steps_; }  // steps skipped so far
  int64_t spans() const { return spans_; }              // spans started so far
  int left() const { return left_; }                    // steps left in the current span

 private:
  QuietConfig config_;
  int max_level_ = 1;
  int streak_ = 0;  // exchanged steps in a row whose decision kept the default
  int level_ = 0;   // what this rank proposes next
  int left_ = 0;
  int64_t quiet_steps_ = 0, spans_ = 0;
};

}  // namespace dpbalance
