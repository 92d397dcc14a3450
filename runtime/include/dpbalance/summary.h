// dpbalance/summary.h — the per-rank summary record exchanged by the all-gather every step.
//
// Contract
// - Fixed size (kSummaryBytes = 512) whatever the batch size, trivially copyable, host byte
//   order (every rank of an instance runs on the same architecture). Layout in docs/design.md.
// - It describes one rank's cost-versus-gain trade-off for this step: the cost and expected
//   tokens of its base assignment (every request at its floor) and, for each draft depth d, up to
//   a share of kKnotPool points of its best extra-token frontier (greedy by gain per
//   microsecond). Depths with few items get one knot per item (exact); the rest share the
//   rank's knot budget (the whole pool up to DP36, 1024/DP but at least 16 beyond: planner.cc).
// - `flags & kSummaryValid` is clear when the rank is in fallback this step; the other ranks
//   then plan without it (its cost is unknown, so it cannot be the barrier they plan against).
// - The previous step's measured times ride along, so every rank sees every rank's real bubble,
//   and so does the sender's own per-step time (own_us), so every rank prices it alike; with the
//   engine cycle of that step, so every rank fits the same step terms (step_terms.h).
// - Every record, valid or not, lets every rank derive the sender's token total for the step
//   (Planner::RankTokens): the planned knot's tokens, or `default_tokens`, plus `extra_tokens`.
#pragma once

#include <cstdint>
#include <type_traits>

#include "dpbalance/acceptance.h"

namespace dpbalance {

inline constexpr uint32_t kSummaryMagic = 0x31425044;  // "DPB1" read little-endian
inline constexpr uint16_t kSummaryVersion = 6;
inline constexpr int kKnotPool = 27;  // most knots a rank sends, shared by all depths
inline constexpr uint16_t kSummaryValid = 1u << 0;     // planned with: its frontier is usable
inline constexpr uint16_t kSummaryExtend = 1u << 1;    // the rank runs prefill tokens this step
inline constexpr uint16_t kSummaryNoVerify = 1u << 2;  // the rank skips verify this step
inline constexpr uint16_t kSummaryIdle = 1u << 3;      // the rank has no work this step
inline constexpr uint16_t kSummaryDisabled = 1u << 4;  // the sender's balancer is disabled

struct RankSummary {
  // --- header: 68 bytes ---
  uint32_t magic;              // kSummaryMagic
  uint16_t version;            // kSummaryVersion
  uint16_t flags;              // kSummaryValid | ...
  uint64_t config_hash;        // PlannerConfig::Hash(): all ranks must agree
  uint16_t rank_idx;           // sender's rank (a group has at most 65536 members)
  // The sender's own time per step: the median of its last 32 plan calls that exchanged (the
  // exchange included), in microseconds, saturated at 65535; 0 unknown.
  // PlannerConfig::guard_measured_overhead counts the largest across ranks against the TPOT guard.
  uint16_t own_us;
  uint32_t step_idx;           // sender's step counter (low 32 bits)
  float prev_attention_us;     // measured attention time of the previous step, < 0 if unknown
  float prev_step_us;          // measured step time of the previous step, < 0 if unknown
  float prev_accepted_tokens;  // tokens emitted by this rank in the previous step, < 0 unknown
  float base_attention_us;     // predicted attention time with every request at its floor
  float base_gain;             // expected emitted tokens with every request at its floor
  uint32_t base_tokens;        // query tokens with every request at its floor
  uint16_t num_requests;       // requests in this rank's batch
  uint8_t min_depth;           // smallest draft depth the floors allow (max k_min)
  uint8_t max_depth;           // largest draft depth this rank can use
  uint8_t knot_begin[kMaxDraftLen];  // first knot of depth d at index d-1
  uint8_t num_knots[kMaxDraftLen];   // knots of depth d at index d-1
  // --- knots: 412 bytes. Cost and gain are totals (base included), in knot order. ---
  float knot_attention_us[kKnotPool];
  float knot_gain[kKnotPool];
  // The steepest gain-per-microsecond slope of the depth's frontier after this knot (0 at its
  // last knot, +inf where a later knot costs no more). Decide bounds what a higher barrier can
  // still gain with it; the sender computes it once instead of every receiver.
  float knot_max_slope[kKnotPool];
  uint16_t knot_tokens[kKnotPool];    // extra query tokens over the base
  uint16_t reserved0;                 // 0
  float base_max_slope[kMaxDraftLen];  // the same from the base, per depth
  // --- the engine's default plan (every request at min(default_k, cap)): 12 bytes ---
  float default_attention_us;       // predicted attention time at the default verify length
  float default_gain;               // expected emitted tokens at the default verify length
  uint32_t default_tokens;          // query tokens at the default verify length; in a record
                                    // without kSummaryValid: the tokens its default lengths run
  // --- step: 8 bytes ---
  uint32_t extra_tokens;            // query tokens beside verify (prefill), in the rank's total
  uint32_t input_digest;            // digest of the planning inputs (attention-TP members compare)
  // --- padding: 12 bytes ---
  // Predicted attention time one padding token adds to this rank's base batch, on the launch the
  // base runs: a dummy request of one query token and one key (the engine's padding slot; a grid
  // model simulates its CTAs; Planner::PadPriceUs). With token tiers Decide prices the tier
  // tokens a rank does not fill with verify work at this, and Assign fills only while its
  // attention plus the padding left stays under the barrier. 0..1e7; 0 without tiers.
  float pad_us;
  // --- step terms: 8 bytes ---
  // The engine cycle of the step prev_attention_us measured: from its plan call to the next one
  // on this rank, in microseconds; < 0 unknown. The rows of the step terms' online fit.
  float prev_cycle_us;
  // OnlineStepTerms::Digest() of the step terms the sender prices this step with (before this
  // exchange's row); 0: none. Every rank compares them; on a difference all reset to the prior.
  uint32_t step_terms_digest;
};

inline constexpr size_t kSummaryBytes = 512;
static_assert(sizeof(RankSummary) == kSummaryBytes, "RankSummary layout changed: bump version");
static_assert(std::is_trivially_copyable_v<RankSummary>);

// The idle row: the record an engine writes itself for a DP rank that has no work this step and
// makes no plan there (SGLang's fallback row for an inactive rank, whose row the engine
// overwrites): the summary magic and version, flags = kSummaryIdle, every other byte zero. It
// needs no plugin state, so one constant serves every rank and config (the Python adapter's
// IDLE_ROW is the same bytes). Every rank plans it as a rank with zero cost that plans nothing
// and runs no tokens. An all-zero record is different: a rank without a working plugin, which
// runs the engine's default lengths and depth, so balancing pauses for that step.
inline RankSummary IdleRowRecord() {
  RankSummary s{};
  s.magic = kSummaryMagic;
  s.version = kSummaryVersion;
  s.flags = kSummaryIdle;
  return s;
}

}  // namespace dpbalance
