#include "dpbalance/planner.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include "absl/base/attributes.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "dpbalance/radix_sort.h"
#include "hash.h"

namespace dpbalance {
int32_t TierFor(absl::Span<const int32_t> tiers, int64_t tokens) {
  for (int32_t t : tiers) {
    if (t >= tokens) return t;
  }
  return static_cast<int32_t>(tokens);  // beyond the largest tier: no padding
}

namespace {

using internal::DecideScratch;
using internal::TierPair;
using internal::TierPair;
using internal::FrontierSegment;
using internal::TierPoint;

constexpr double kTinyUs = 1e-3;  // floor on a marginal cost, so ratios stay finite

// Relative slack when testing "fits under the barrier": the barrier itself came from the same
// model through float storage in the summary record.
constexpr double kBarrierSlack = 1e-6;


// Knots one rank spends on its frontier. Decide's work grows with ranks x knots, and with many
// ranks the instance's frontier already has hundreds of points per depth, so each sends fewer.
// About 1024 knots for the instance, at least 16 a rank (DP64 and DP256: 16, up to DP36: 28).
// Fewer make the chords between sparse knots undervalue deeper drafts (docs/design.md, "Knot
// budget", and docs/results.md give the measurement).
int KnotBudget(int num_ranks) { return std::clamp(1024 / num_ranks, 16, kKnotPool); }

uint32_t FloatKey(float v) { return std::bit_cast<uint32_t>(v); }  // monotone for v >= 0

absl::Status CheckSummary(const RankSummary& s, size_t idx, uint64_t want_hash) {
  if (s.magic != kSummaryMagic || s.version != kSummaryVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "summary from rank %d: magic 0x%08x version %d, expected 0x%08x version %d", idx, s.magic,
        s.version, kSummaryMagic, kSummaryVersion));
  }
  if (s.config_hash != want_hash) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "summary from rank %d: config hash %016x differs from this rank's %016x", idx,
        s.config_hash, want_hash));
  }
  return absl::OkStatus();
}

// Garbage in a valid-looking record is excluded (consistently on every rank) rather than fatal.
// Token tiers priced by the planner (SweepTiers: one agreed draft depth), each rank filling the
// agreed tier (the Filler) with its padding priced at its `pad_us`.
bool PricesTiers(const PlannerConfig& c) {
  return c.global.padded_tokens && !c.token_tiers.empty() && !c.uniform_per_rank && !c.uniform_instance &&
         c.agreed_draft_depth && c.mode == PlanMode::kGoodput;
}

// A padding token's price above this (10 s) is garbage, not a rank's cost.
constexpr float kMaxPadUs = 1e7f;

bool SummaryUsable(const RankSummary& s, size_t idx) {
  if (!(s.flags & kSummaryValid) || s.rank_idx != idx) return false;
  if (!(std::isfinite(s.base_attention_us) && s.base_attention_us >= 0)) return false;
  if (!(std::isfinite(s.base_gain) && s.base_gain >= 0)) return false;
  if (!(std::isfinite(s.default_attention_us) && s.default_attention_us >= 0)) return false;
  if (!(s.pad_us >= 0 && s.pad_us <= kMaxPadUs)) return false;  // NaN and inf too
  if (s.min_depth > kMaxDraftLen || s.max_depth > kMaxDraftLen || s.min_depth > s.max_depth) {
    return false;
  }
  for (int d = 0; d < kMaxDraftLen; ++d) {
    if (s.knot_begin[d] + s.num_knots[d] > kKnotPool) return false;
    if (!(s.base_max_slope[d] >= 0)) return false;  // NaN too
    // Knots must not fall (a NaN fails every comparison); then only the last can be infinite.
    float prev_cost = s.base_attention_us, prev_gain = s.base_gain;
    const int end = s.knot_begin[d] + s.num_knots[d];
    for (int k = s.knot_begin[d]; k < end; ++k) {
      const float c = s.knot_attention_us[k], g = s.knot_gain[k];
      if (!(c >= prev_cost && g >= prev_gain && s.knot_max_slope[k] >= 0)) return false;
      prev_cost = c;
      prev_gain = g;
    }
    if (!(std::isfinite(prev_cost) && std::isfinite(prev_gain))) return false;
  }
  return true;
}

// Prices a candidate plan's step and keeps the best plan so far (Decide's objective): within the
// TPOT guard the highest goodput wins; while nothing fits the guard, the shortest step.
class BestPlan {
 public:
  // `num_usable_ranks` (>= 1): the ranks whose summaries take part.
  BestPlan(const PlannerConfig& config, int num_usable_ranks)
      : config_(&config),
        global_(config.global),
        agreed_draft_depth_(config.agreed_draft_depth),
        ffn_scale_(static_cast<double>(config.num_ranks) / num_usable_ranks) {
    best_.draft_depth = config.default_k;
  }

  // Tokens the FFN term is charged for: padded mode charges every rank at the tier of the
  // largest; otherwise the sum, scaled up for ranks that sent no usable summary (or, in local
  // mode, for all other ranks).
  double FfnTokens(double sum_tokens, double max_tokens) const {
    if (global_.padded_tokens) {
      return config_->num_ranks *
             static_cast<double>(TierFor(config_->token_tiers, std::llround(max_tokens)));
    }
    return sum_tokens * ffn_scale_;
  }
  // FFN microseconds per extra token of the instance (0 when padded: the tier counts).
  double FfnUsPerToken() const {
    return global_.padded_tokens ? 0.0 : global_.ffn_per_token_us * ffn_scale_;
  }
  // The instance-wide part of a step with `depth` draft steps.
  double GlobalUs(double sum_tokens, double max_tokens, int depth) const {
    return global_.StepUs(FfnTokens(sum_tokens, max_tokens), depth);
  }
  // The step time of the engine's default plan: the TPOT guard's reference.
  // `overhead_us`: the plugin's own time per step, which the default plan does not pay.
  void SetDefaultStep(double default_step_us, double overhead_us) {
    best_.default_step_us = default_step_us;
    max_step_us_ = config_->max_step_slack < 0
                       ? std::numeric_limits<double>::infinity()
                       : default_step_us * (1 + config_->max_step_slack) - overhead_us;
  }

  // A plan at `barrier_us` with `depth` draft steps (paid globally only when the depth is
  // agreed), `gain` expected tokens and the instance's tokens summed and at the largest rank.
  void Consider(int depth, double barrier_us, double gain, double sum_tokens, double max_tokens) {
    const double ffn = FfnTokens(sum_tokens, max_tokens);
    const double step_us =
        barrier_us + global_.StepUs(ffn, agreed_draft_depth_ ? depth : 0);
    // Most barriers of a sweep lose to the best so far: decide that with one multiplication.
    if (within_guard_ && step_us <= max_step_us_ && gain <= tokens_per_us_ * step_us) return;
    const double tokens_per_us = gain / step_us;
    const bool within = step_us <= max_step_us_;
    const bool better = within ? (!within_guard_ || tokens_per_us > tokens_per_us_)
                               : (!within_guard_ && (tokens_per_us_ < 0 || step_us < best_.step_us));
    if (!better) return;
    within_guard_ = within;
    tokens_per_us_ = tokens_per_us;
    best_.draft_depth = depth;
    best_.barrier_us = barrier_us;
    best_.step_us = step_us;
    best_.expected_tokens = gain;
    best_.tokens_per_us = tokens_per_us;
    best_ffn_ = ffn;  // rounded once, by best(): most sweeps improve on the best many times
    best_max_tokens_ = max_tokens;
  }
  // Whether an upper bound on goodput is clearly below the best within the guard (only clearly:
  // rounding in the bound never drops a barrier that would tie or narrowly win).
  bool CannotWin(double goodput_bound) const {
    return within_guard_ && goodput_bound <= tokens_per_us_ * (1 - 1e-12);
  }
  bool within_guard() const { return within_guard_; }
  double tokens_per_us() const { return tokens_per_us_; }  // the best's goodput; < 0: none yet
  double max_step_us() const { return max_step_us_; }
  GlobalDecision best() const {
    GlobalDecision b = best_;
    if (best_ffn_ >= 0) {
      b.ffn_tokens = std::llround(best_ffn_);
      b.padded_rank_tokens =
          global_.padded_tokens ? TierFor(config_->token_tiers, std::llround(best_max_tokens_)) : 0;
    }
    return b;
  }

 private:
  const PlannerConfig* config_;  // a pointer: plans are copied into a sweep and back
  GlobalCost global_;            // copies of what every Consider reads: kept in registers
  bool agreed_draft_depth_;
  double ffn_scale_;
  double max_step_us_ = std::numeric_limits<double>::infinity();
  GlobalDecision best_;
  double best_ffn_ = -1, best_max_tokens_ = 0;  // the best's FFN and largest rank's tokens
  double tokens_per_us_ = -1;
  bool within_guard_ = false;
};

// A Decide event: a rank's knot (cost key in the upper 32 bits, then rank, then knot index).
uint64_t KnotEvent(float cost_us, uint32_t rank, int knot) {
  return (uint64_t{FloatKey(cost_us)} << 32) | (uint64_t{rank} << 8) | static_cast<uint64_t>(knot);
}
uint32_t EventCostKey(uint64_t ev) { return static_cast<uint32_t>(ev >> 32); }
uint32_t EventRank(uint64_t ev) { return static_cast<uint32_t>((ev >> 8) & 0xffffffu); }
int EventKnot(uint64_t ev) { return static_cast<int>(ev & 0xff); }
constexpr uint32_t kProbeRank = 0xffffffu;  // an event that only evaluates a barrier

// A binary min-heap over Decide's events, in place in `v`.
class EventHeap {
 public:
  explicit EventHeap(std::vector<uint64_t>& v) : v_(v) {
    for (size_t i = v_.size() / 2; i-- > 0;) SiftDown(i);
  }
  bool empty() const { return v_.empty(); }
  uint64_t top() const { return v_[0]; }
  void Pop() {
    v_[0] = v_.back();
    v_.pop_back();
    if (!v_.empty()) SiftDown(0);
  }
  void ReplaceTop(uint64_t ev) {
    v_[0] = ev;
    SiftDown(0);
  }

 private:
  void SiftDown(size_t i) {  // restores the heap below i
    const size_t n = v_.size();
    const uint64_t v = v_[i];
    for (size_t child = 2 * i + 1; child < n; child = 2 * i + 1) {
      if (child + 1 < n && v_[child + 1] < v_[child]) ++child;
      if (v_[child] >= v) break;
      v_[i] = v_[child];
      i = child;
    }
    v_[i] = v;
  }
  std::vector<uint64_t>& v_;
};

// The barrier a fill must stay under: the agreed one, with room for the float storage of the
// summary record it came through.
double FillBarrierUs(const GlobalDecision& d) { return d.barrier_us * (1 + kBarrierSlack) + kBarrierSlack; }

// Tokens of KV capacity left for extra verify tokens (an engine's negative value: unlimited).
int64_t KvCap(int64_t kv_free_tokens) {
  return kv_free_tokens < 0 ? std::numeric_limits<int64_t>::max() : kv_free_tokens;
}

// exact_rank_tokens: where a rank's plan lands on its frontier under a decision, from its
// summary alone (so every rank computes it for every rank): at the agreed depth (or, with
// per-rank depths, the depth whose knot gains most, the shallower on a tie), the last knot that
// costs no more than the fill barrier and, padded, stays within the tier; the base if none does.
struct KnotChoice {
  int depth = 0;
  int64_t extra_tokens = 0;  // over the base
  double gain = 0;
};

// A rank's knots at draft depth d: its frontier of the deepest depth it can use up to d.
struct DepthKnots {
  int slot = 0, first = 0, count = 0;  // slot 0: none
};
ABSL_ATTRIBUTE_ALWAYS_INLINE inline DepthKnots KnotsAtDepth(const RankSummary& s, int depth) {
  const int slot = std::min<int>(depth, s.max_depth);
  if (slot <= 0) return DepthKnots{};
  return DepthKnots{slot, s.knot_begin[slot - 1], s.num_knots[slot - 1]};
}

// Padded mode with token tiers: a rank's fill-or-pad points at a tier `want` tokens over its
// base, in frontier order (gain rises): its base, each knot below the tier, and the chord up to
// the tier where the frontier reaches it. `f(cost, tokens, gain)` gets each point's attention
// without the padding (the rest of the tier, want - tokens, at the rank's pad_us). Decide's chains
// (TierPoints) and the budget path's knot (KnotInTier) list the same points through it.
template <class F>
ABSL_ATTRIBUTE_ALWAYS_INLINE inline void ForEachTierPoint(const RankSummary& s, DepthKnots dk,
                                                          double want, F&& f) {
  double c0 = s.base_attention_us, g0 = s.base_gain, t0 = 0;
  f(c0, t0, g0);
  int k = 0;
  for (; k < dk.count && s.knot_tokens[dk.first + k] < want; ++k) {
    c0 = s.knot_attention_us[dk.first + k];
    g0 = s.knot_gain[dk.first + k];
    t0 = s.knot_tokens[dk.first + k];
    f(c0, t0, g0);
  }
  if (want > 0 && k < dk.count) {  // the tier filled along the chord to knot k
    const double t1 = s.knot_tokens[dk.first + k];
    const double frac = t1 > t0 ? (want - t0) / (t1 - t0) : 1.0;
    f(c0 + frac * (s.knot_attention_us[dk.first + k] - c0), want,
      g0 + frac * (s.knot_gain[dk.first + k] - g0));
  }
}

// Token tiers priced by Decide (PricesTiers): the rank's point is the last of its fill-or-pad
// points whose cost, the rest of the tier padded at its pad_us, is within the fill barrier, then
// as far along the chord to the next point as the barrier allows. The last, not the first over:
// a verify token may cost less than the padding it replaces, so the costs need not rise.
KnotChoice KnotInTier(const RankSummary& s, const GlobalDecision& d, int depth) {
  KnotChoice k{depth, 0, s.base_gain};
  const double want = static_cast<double>(d.padded_rank_tokens) - s.base_tokens;
  const DepthKnots dk = KnotsAtDepth(s, depth);
  if (dk.slot < std::max(1, static_cast<int>(s.min_depth)) || !(want > 0)) return k;
  const double barrier = FillBarrierUs(d);
  struct Point {
    double cost, tokens, gain;
  };
  auto padded = [&](const Point& p) { return p.cost + s.pad_us * (want - p.tokens); };
  Point last{s.base_attention_us, 0, s.base_gain};  // the last point within the barrier
  std::optional<Point> next;                        // the point after it
  ForEachTierPoint(s, dk, want, [&](double cost, double tokens, double gain) {
    const Point p{cost, tokens, gain};
    if (padded(p) <= barrier) {
      last = p;
      next.reset();
    } else if (!next) {
      next = p;
    }
  });
  k.extra_tokens = std::llround(last.tokens);
  k.gain = last.gain;
  if (next && next->tokens > last.tokens) {
    const double c0 = padded(last), c1 = padded(*next);
    const double f = c1 > c0 ? std::clamp((barrier - c0) / (c1 - c0), 0.0, 1.0) : 0.0;
    k.extra_tokens += static_cast<int64_t>(std::floor(f * (next->tokens - last.tokens)));
    k.gain += f * (next->gain - last.gain);
  }
  return k;
}

KnotChoice KnotAtDepth(const RankSummary& s, const GlobalDecision& d, const PlannerConfig& c,
                       int depth) {
  if (PricesTiers(c) && d.padded_rank_tokens > 0) return KnotInTier(s, d, depth);
  KnotChoice k{depth, 0, s.base_gain};
  const int dd = std::min(depth, static_cast<int>(s.max_depth));
  if (dd < std::max(1, static_cast<int>(s.min_depth))) return k;
  const double barrier = FillBarrierUs(d);
  const int begin = s.knot_begin[dd - 1], end = std::min<int>(begin + s.num_knots[dd - 1], kKnotPool);
  double cost = s.base_attention_us;
  int i = begin;
  for (; i < end; ++i) {
    if (s.knot_attention_us[i] > barrier) break;  // knot costs never fall
    if (c.global.padded_tokens && d.padded_rank_tokens > 0 &&
        int64_t{s.base_tokens} + s.knot_tokens[i] > d.padded_rank_tokens) {
      return k;
    }
    k.extra_tokens = s.knot_tokens[i];
    k.gain = s.knot_gain[i];
    cost = s.knot_attention_us[i];
  }
  // Between this knot and the next one, which costs more than the barrier: as far along the
  // chord as the barrier allows (Decide placed the rank there), rounded down to whole tokens.
  // The items there cost what the chord says only on average, so the rank's attention may pass
  // the barrier by what the chord underestimates (the planner tests bound it at 1%); without
  // it, a rank would stop at its last knot (4.7% of the goodput on Mooncake, V2 truth).
  if (i < end) {
    const double span = s.knot_attention_us[i] - cost;
    const double frac = span > 0 ? std::clamp((barrier - cost) / span, 0.0, 1.0) : 0.0;
    int64_t more = static_cast<int64_t>(std::floor(frac * (s.knot_tokens[i] - k.extra_tokens)));
    if (c.global.padded_tokens && d.padded_rank_tokens > 0) {  // and never past the tier
      more = std::clamp<int64_t>(d.padded_rank_tokens - s.base_tokens - k.extra_tokens, 0, more);
    }
    k.gain += frac * (s.knot_gain[i] - k.gain);
    k.extra_tokens += more;
  }
  return k;
}

// Instance mode (PlannerConfig::uniform_instance): a rank's point when every rank runs level d
// (every request at min(d, k_cap), at least its floor): its attention, expected tokens and query
// tokens over its base. A level past the rank's deepest cap is its deepest; one past 65535 extra
// tokens is not there (false). SummarizeUniform stored level L as the L-th knot of depth L.
struct LevelPt {
  double cost = 0, gain = 0;
  int64_t tokens = 0;
};
bool LevelPoint(const RankSummary& s, int d, LevelPt* p) {
  const int level = std::min<int>(d, s.max_depth);
  if (level <= 0) {
    *p = LevelPt{s.base_attention_us, s.base_gain, 0};
    return true;
  }
  const DepthKnots dk = KnotsAtDepth(s, level);
  if (dk.count < level) return false;
  const int k = dk.first + level - 1;
  *p = LevelPt{s.knot_attention_us[k], s.knot_gain[k], s.knot_tokens[k]};
  return true;
}

KnotChoice ChooseKnot(const RankSummary& s, const GlobalDecision& d, const PlannerConfig& c) {
  if (c.agreed_draft_depth) return KnotAtDepth(s, d, c, d.draft_depth);
  KnotChoice best = KnotAtDepth(s, d, c, s.min_depth);
  for (int depth = s.min_depth + 1; depth <= std::min<int>(d.draft_depth, s.max_depth); ++depth) {
    const KnotChoice k = KnotAtDepth(s, d, c, depth);
    if (k.gain > best.gain) best = k;
  }
  return best;
}

// Shares one rank's knot pool among the draft depths d_lo..d_hi: every depth with items gets one
// knot, then rounds hand out the rest, most to the depths around the previous decision's (where
// the next one most likely lands: the chord between sparse knots undervalues a depth): 6 knots
// a round to that depth, 2 to each neighbour, 1 to the others, never more than a depth has
// items (`avail`). Small batches get one knot per item at every depth, so small cases are exact.
std::array<int, kMaxDraftLen + 1> ShareKnotPool(const std::array<int64_t, kMaxDraftLen + 1>& avail,
                                               int d_lo, int d_hi, int focus_depth, int pool) {
  std::array<int, kMaxDraftLen + 1> share{};
  for (int d = d_lo; d <= d_hi && pool > 0; ++d) {
    share[d] = avail[d] > 0 ? 1 : 0;
    pool -= share[d];
  }
  const int focus = std::clamp(focus_depth, d_lo, std::max(d_lo, d_hi));
  auto give = [&](int d, int per_round) {
    if (d < d_lo || d > d_hi) return false;
    const int more = static_cast<int>(std::min<int64_t>({per_round, avail[d] - share[d], pool}));
    if (more <= 0) return false;
    share[d] += more;
    pool -= more;
    return true;
  };
  for (bool gave = true; gave && pool > 0;) {
    gave = give(focus, 6);
    for (int dist = 1; dist <= kMaxDraftLen && pool > 0; ++dist) {
      const int per_round = dist == 1 ? 2 : 1;
      gave |= give(focus - dist, per_round);
      gave |= give(focus + dist, per_round);
    }
  }
  return share;
}

// The instance's lines at one depth: the sum of every usable rank's segment.
struct SegmentSum {
  double gain0 = 0, gain_slope = 0, tokens0 = 0, tokens_slope = 0;
  double bound0 = 0, bound_slope = 0;
  int unbounded = 0;  // ranks whose gain has no line above it

  void Add(const FrontierSegment& s) {
    gain0 += s.gain0;
    gain_slope += s.gain_slope;
    tokens0 += s.tokens0;
    tokens_slope += s.tokens_slope;
    bound0 += s.bound0;
    bound_slope += s.bound_slope;
    unbounded += s.unbounded;
  }
  void Replace(const FrontierSegment& was, const FrontierSegment& now) {
    gain0 += now.gain0 - was.gain0;
    gain_slope += now.gain_slope - was.gain_slope;
    tokens0 += now.tokens0 - was.tokens0;
    tokens_slope += now.tokens_slope - was.tokens_slope;
    bound0 += now.bound0 - was.bound0;
    bound_slope += now.bound_slope - was.bound_slope;
    unbounded += static_cast<int>(now.unbounded) - static_cast<int>(was.unbounded);
  }
};

// (a superset of later knots: still an upper bound for the shallower depths).
void FillMaxSlopes(RankSummary& s) {
  for (int d = 1; d <= kMaxDraftLen; ++d) {
    const int first = s.knot_begin[d - 1], n = s.num_knots[d - 1];
    double steepest = 0;
    for (int i = n - 1; i >= -1; --i) {
      if (i >= 0) {
        s.knot_max_slope[first + i] = static_cast<float>(steepest);
      } else {
        s.base_max_slope[d - 1] = static_cast<float>(steepest);
        break;
      }
      const double dc = s.knot_attention_us[first + i] -
                        (i > 0 ? s.knot_attention_us[first + i - 1] : s.base_attention_us);
      const double dg = s.knot_gain[first + i] - (i > 0 ? s.knot_gain[first + i - 1] : s.base_gain);
      const double m = dg <= 0 ? 0.0 : dc > 0 ? dg / dc : std::numeric_limits<double>::infinity();
      steepest = std::max(steepest, m);
    }
  }
}

// Rank r's segment from knot k (-1: its base) among its knots `dk` at the depth swept. Between
// knots that skip items the gain is the chord; `steps_only` (uniform levels): steps. Inlined:
// it runs once per knot event of the sweep.
ABSL_ATTRIBUTE_ALWAYS_INLINE inline FrontierSegment SegmentFrom(const RankSummary& s, DepthKnots dk, int k, bool steps_only) {
  const int first = dk.first;
  const double c0 = k < 0 ? s.base_attention_us : s.knot_attention_us[first + k];
  const double g0 = k < 0 ? s.base_gain : s.knot_gain[first + k];
  const double t0 = k < 0 ? 0.0 : s.knot_tokens[first + k];
  FrontierSegment sg{g0, 0, t0, 0, g0, 0, false};
  if (k + 1 < dk.count) {
    const double c1 = s.knot_attention_us[first + k + 1], t1 = s.knot_tokens[first + k + 1];
    if (t1 - t0 > 1 && c1 > c0 && !steps_only) {
      const double inv = 1.0 / (c1 - c0);
      sg.gain_slope = (s.knot_gain[first + k + 1] - g0) * inv;
      sg.tokens_slope = (t1 - t0) * inv;
      sg.gain0 = g0 - sg.gain_slope * c0;
      sg.tokens0 = t0 - sg.tokens_slope * c0;
    }
  }
  const double m = k >= 0        ? s.knot_max_slope[first + k]
                   : dk.slot > 0 ? s.base_max_slope[dk.slot - 1]
                                 : 0.0;
  if (std::isinf(m)) {
    sg.unbounded = true;
  } else {
    sg.bound_slope = m;
    sg.bound0 = g0 - m * c0;
  }
  return sg;
}

// What Decide reads off the usable summaries before it sweeps.
struct UsableTotals {
  int depth_lo = 0;     // the deepest floor of any usable rank: no shallower depth is feasible
  double floor_us = 0;  // the barrier with every rank at its floors
  double base_gain = 0, base_tokens = 0, max_base_tokens = 0;
  double default_barrier = 0, default_tokens = 0, max_default_tokens = 0;
  double default_gain = 0;  // expected tokens of the engine's default plan
};

// Checks every summary (a wrong magic, version or config hash is an error) and totals the usable
// ones (garbage in a valid-looking record excludes that rank, on every rank alike). `usable`
// receives their indices.
absl::StatusOr<UsableTotals> TotalUsable(absl::Span<const RankSummary> summaries, bool local,
                                         uint64_t config_hash, std::vector<uint32_t>& usable) {
  usable.clear();
  UsableTotals t;
  for (size_t r = 0; r < summaries.size(); ++r) {
    const RankSummary& s = summaries[r];
    const size_t idx = local ? s.rank_idx : r;
    if (absl::Status st = CheckSummary(s, idx, config_hash); !st.ok()) return st;
    if (!SummaryUsable(s, idx)) continue;
    usable.push_back(static_cast<uint32_t>(r));
    t.default_barrier = std::max<double>(t.default_barrier, s.default_attention_us);
    t.default_tokens += s.default_tokens;
    t.default_gain += s.default_gain;
    t.max_default_tokens = std::max<double>(t.max_default_tokens, s.default_tokens);
    t.depth_lo = std::max<int>(t.depth_lo, s.min_depth);
    t.floor_us = std::max<double>(t.floor_us, s.base_attention_us);
    t.base_gain += s.base_gain;
    t.base_tokens += s.base_tokens;
    t.max_base_tokens = std::max<double>(t.max_base_tokens, s.base_tokens);
  }
  if (usable.empty()) {
    return absl::UnavailableError("planner: no rank sent a usable summary this step");
  }
  return t;
}

// Per-rank draft depths: every knot of every depth is a candidate for its rank, whose cost
// already holds its own draft time. At barrier T each rank takes its best-gain knot with cost
// <= T (not a prefix across depths, so gains are steps, without chords).
void SweepPerRankDepths(const PlannerConfig& c, absl::Span<const RankSummary> summaries,
                        const UsableTotals& t, DecideScratch& scratch, BestPlan& plans) {
  std::vector<uint64_t>& events = scratch.events;
  events.clear();
  // Per rank, gain0 is its current gain and tokens0 its current extra tokens.
  scratch.segments.assign(summaries.size(), FrontierSegment{});
  for (uint32_t r : scratch.usable_ranks) {
    const RankSummary& s = summaries[r];
    scratch.segments[r].gain0 = s.base_gain;
    for (int d = 0; d < kMaxDraftLen; ++d) {
      for (int k = s.knot_begin[d]; k < s.knot_begin[d] + s.num_knots[d]; ++k) {
        events.push_back(KnotEvent(s.knot_attention_us[k], r, k));
      }
    }
  }
  // Ties keep insertion order (deterministic; the sweep applies equal costs together anyway).
  // Below 512 events four byte passes cost more than a comparison sort.
  SortByHighHalf(events, scratch.sort_tmp, 512);
  double gain = t.base_gain, sum_tokens = t.base_tokens, max_tokens = t.max_base_tokens;
  auto apply = [&](uint64_t ev) {
    const RankSummary& s = summaries[EventRank(ev)];
    const int k = EventKnot(ev);
    FrontierSegment& now = scratch.segments[EventRank(ev)];
    if (s.knot_gain[k] <= now.gain0) return;
    gain += s.knot_gain[k] - now.gain0;
    sum_tokens += s.knot_tokens[k] - now.tokens0;
    now.gain0 = s.knot_gain[k];
    now.tokens0 = s.knot_tokens[k];
    max_tokens = std::max<double>(max_tokens, s.base_tokens + s.knot_tokens[k]);
  };
  size_t e = 0;
  for (; e < events.size() && std::bit_cast<float>(EventCostKey(events[e])) <= t.floor_us; ++e) {
    apply(events[e]);
  }
  plans.Consider(c.k_max, t.floor_us, gain, sum_tokens, max_tokens);
  while (e < events.size()) {
    const uint32_t key = EventCostKey(events[e]);
    for (; e < events.size() && EventCostKey(events[e]) == key; ++e) apply(events[e]);
    plans.Consider(c.k_max, std::bit_cast<float>(key), gain, sum_tokens, max_tokens);
  }
}

// The instance at one agreed depth as lines in the barrier T: gain and tokens at T, and what
// bounds the sweep.
struct DepthLines {
  SegmentSum sum;
  double base_tokens = 0;
  double max_tokens = 0;  // tokens of the largest rank so far (padded tiers)
  double max_gain = 0;    // every rank at its last knot
  double top_cost = 0;    // the costliest knot that can be reached (the sweep's end)
  double GainAt(double t) const { return sum.gain0 + sum.gain_slope * t; }
  double TokensAt(double t) const { return base_tokens + sum.tokens0 + sum.tokens_slope * t; }
};

// Upper bound on goodput at every barrier T' >= T of one depth. Each rank's gain from T on lies
// under the line bound0 + bound_slope * T' (from its segment's left knot, with its steepest
// later slope), so the instance's gain G' <= min(A + S * T', G_max). The step is at least T'
// plus the global terms at today's tokens, plus the FFN time of G' - gain more tokens (an extra
// token adds at most one expected token). That ratio is monotone in T' between T and the T*
// where the line meets G_max and falls after, so the bound is its larger end value.
ABSL_ATTRIBUTE_ALWAYS_INLINE inline double GoodputBound(double barrier, double gain, const DepthLines& lines, double global_us,
                    double ffn_us_per_token) {
  auto at = [&](double t, double g_hi) {
    return g_hi / (t + global_us + ffn_us_per_token * std::max(0.0, g_hi - gain));
  };
  const SegmentSum& sum = lines.sum;
  if (sum.unbounded > 0) return at(barrier, lines.max_gain);
  const double g_now = std::min(sum.bound0 + sum.bound_slope * barrier, lines.max_gain);
  double v = at(barrier, g_now);
  if (sum.bound_slope > 0 && g_now < lines.max_gain) {
    v = std::max(v, at((lines.max_gain - sum.bound0) / sum.bound_slope, lines.max_gain));
  }
  return v;
}

// Every usable rank on the segment that contains the floor barrier; `events` gets each rank's
// next knot (none in fill mode: the barrier stays at the floor).
DepthLines EnterDepth(const PlannerConfig& c, int d, absl::Span<const RankSummary> summaries,
                      const UsableTotals& t, DecideScratch& scratch) {
  DepthLines lines;
  lines.base_tokens = t.base_tokens;
  lines.max_tokens = t.max_base_tokens;
  lines.max_gain = t.base_gain;
  lines.top_cost = t.floor_us;
  scratch.events.clear();
  for (uint32_t r : scratch.usable_ranks) {
    const RankSummary& s = summaries[r];
    const DepthKnots dk = KnotsAtDepth(s, d);
    int k = 0;
    for (; k < dk.count && s.knot_attention_us[dk.first + k] <= t.floor_us; ++k) {}
    // The rank sits on the segment starting at knot k-1 (k-1 = -1: its base).
    const FrontierSegment sg = SegmentFrom(s, dk, k - 1, c.uniform_per_rank);
    scratch.segments[r] = sg;
    lines.sum.Add(sg);
    if (k > 0) {
      lines.max_tokens = std::max<double>(lines.max_tokens, s.base_tokens + s.knot_tokens[dk.first + k - 1]);
    }
    if (dk.count > 0) lines.max_gain += s.knot_gain[dk.first + dk.count - 1] - s.base_gain;
    if (c.mode == PlanMode::kFill || k == dk.count) continue;
    lines.top_cost = std::max<double>(lines.top_cost, s.knot_attention_us[dk.first + dk.count - 1]);
    scratch.events.push_back(KnotEvent(s.knot_attention_us[dk.first + k], r, k));
  }
  return lines;
}

// Merges the ranks' knot lists (each ascending in cost) with a min-heap holding each rank's next
// knot: only the knots the sweep reaches are ever ordered. Keys are unique (rank and knot in the
// low bits), so the order is deterministic. Knots above `top_key` never enter.
void MergeKnots(int d, absl::Span<const RankSummary> summaries, bool steps_only, uint32_t top_key,
                DepthLines depth_lines, DecideScratch& scratch, BestPlan& best_plan) {
  // Local copies: the sweep's sums and the best plan stay in registers while the segments are
  // written through `scratch` (which could otherwise alias them).
  DepthLines lines = depth_lines;
  BestPlan plans = best_plan;
  std::erase_if(scratch.events, [&](uint64_t ev) { return EventCostKey(ev) > top_key; });
  EventHeap heap(scratch.events);
  int groups = 0;
  while (!heap.empty()) {
    const uint32_t key = EventCostKey(heap.top());
    const double barrier = std::bit_cast<float>(key);
    // The bound every other barrier: it costs a few divisions, an event a few additions.
    if (plans.within_guard() && (groups++ & 1) == 0) {
      const double global_now = plans.GlobalUs(lines.TokensAt(barrier), lines.max_tokens, d);
      if (barrier + global_now > plans.max_step_us() ||
          plans.CannotWin(GoodputBound(barrier, lines.GainAt(barrier), lines, global_now,
                                       plans.FfnUsPerToken()))) {
        break;  // no later barrier can win (steps only grow from here)
      }
    }
    while (!heap.empty() && EventCostKey(heap.top()) == key) {
      const uint64_t ev = heap.top();
      const uint32_t r = EventRank(ev);
      if (r == kProbeRank) {
        heap.Pop();
        continue;
      }
      const int k = EventKnot(ev);
      const RankSummary& s = summaries[r];
      const DepthKnots dk = KnotsAtDepth(s, d);
      const FrontierSegment sg = SegmentFrom(s, dk, k, steps_only);
      lines.sum.Replace(scratch.segments[r], sg);
      scratch.segments[r] = sg;
      lines.max_tokens = std::max<double>(lines.max_tokens, s.base_tokens + s.knot_tokens[dk.first + k]);
      // The rank's next knot takes its place in the heap, unless it lies past the cut-off.
      const uint32_t next_key =
          k + 1 < dk.count ? FloatKey(s.knot_attention_us[dk.first + k + 1]) : top_key + 1;
      if (next_key <= top_key) {
        heap.ReplaceTop((uint64_t{next_key} << 32) | (uint64_t{r} << 8) | static_cast<uint64_t>(k + 1));
      } else {
        heap.Pop();
      }
    }
    plans.Consider(d, barrier, lines.GainAt(barrier), lines.TokensAt(barrier), lines.max_tokens);
  }
  best_plan = plans;
}

// One agreed draft depth: sweeps the barrier T upwards over the knot costs. Every rank sits on
// the segment of its frontier that contains T: between knots that are single items its gain is
// a step (exact: items are indivisible); between knots that skip items it is the chord (the
// frontier is concave, so the chord is a conservative estimate that Assign's fill achieves).
// Totals are linear in T between events, so goodput (linear-fractional) peaks at an event. The
// sweep stops once the bound says no higher barrier can win; knots above the barrier where even
// the largest gain cannot beat the best never enter the merge.
void SweepDepth(const PlannerConfig& c, int d, absl::Span<const RankSummary> summaries,
                const UsableTotals& t, DecideScratch& scratch, BestPlan& plans) {
  if (d == 0) {  // no drafts: every rank at its base (EnterDepth's lines, without the walk)
    plans.Consider(0, t.floor_us, t.base_gain, t.base_tokens, t.max_base_tokens);
    return;
  }
  DepthLines lines = EnterDepth(c, d, summaries, t, scratch);
  plans.Consider(d, t.floor_us, lines.GainAt(t.floor_us), lines.TokensAt(t.floor_us),
                 lines.max_tokens);
  if (c.mode == PlanMode::kFill || scratch.events.empty()) return;
  if (t.default_barrier > t.floor_us) {  // the default plan's barrier is always evaluated
    scratch.events.push_back(KnotEvent(static_cast<float>(t.default_barrier), kProbeRank, 0));
    lines.top_cost = std::max(lines.top_cost, t.default_barrier);
  }
  const double global_floor = plans.GlobalUs(lines.TokensAt(t.floor_us), lines.max_tokens, d);
  if (plans.CannotWin(GoodputBound(t.floor_us, lines.GainAt(t.floor_us), lines, global_floor,
                                   plans.FfnUsPerToken()))) {
    return;
  }
  // Goodput at barrier T is at most G_max / (T + global terms at the floor): knots above `top`
  // can never win (nor can steps past the TPOT guard).
  double top = lines.top_cost;
  if (plans.within_guard()) {
    top = std::min({top, lines.max_gain / plans.tokens_per_us() - global_floor,
                    plans.max_step_us() - global_floor});
  }
  if (!(top > t.floor_us)) return;  // nothing above the floor can win (NaN-safe)
  MergeKnots(d, summaries, c.uniform_per_rank, FloatKey(static_cast<float>(top)), lines, scratch,
             plans);
}

// Upper bounds on goodput at each depth d_lo..d_hi (>= 1) over every barrier, from the
// summaries' bases alone (EnterDepth's bound starts from the segment at the floor): each rank's
// gain lies under the line from its base with its steepest slope, and under its last knot's. One
// pass over the ranks for every depth, far cheaper than entering one, so a depth that cannot win
// is never entered. Non-padded only (the FFN term linear in tokens): +inf there.
// `knots` gets each depth's knots summed over the ranks: Summarize gives most of a rank's pool to
// the depth of its previous decision (ShareKnotPool), so the depth with the most is where the
// last plan landed, read off the summaries.
std::array<double, kMaxDraftLen + 1> DepthBounds(const PlannerConfig& c, int d_lo, int d_hi,
                                                 absl::Span<const RankSummary> summaries,
                                                 const UsableTotals& t, const DecideScratch& scratch,
                                                 const BestPlan& plans,
                                                 std::array<int, kMaxDraftLen + 1>& knots) {
  std::array<double, kMaxDraftLen + 1> bound;
  bound.fill(std::numeric_limits<double>::infinity());
  knots.fill(0);
  std::array<DepthLines, kMaxDraftLen + 1> lines{};
  for (int d = d_lo; d <= d_hi; ++d) lines[d].max_gain = t.base_gain;
  for (uint32_t r : scratch.usable_ranks) {
    const RankSummary& s = summaries[r];
    for (int d = d_lo; d <= d_hi; ++d) {
      knots[d] += s.num_knots[d - 1];
      const DepthKnots dk = KnotsAtDepth(s, d);
      if (dk.slot == 0) {  // no knots at any depth: its base, slope 0
        lines[d].sum.bound0 += s.base_gain;
        continue;
      }
      if (dk.count > 0) lines[d].max_gain += s.knot_gain[dk.first + dk.count - 1] - s.base_gain;
      const double m = s.base_max_slope[dk.slot - 1];
      if (std::isinf(m)) {
        ++lines[d].sum.unbounded;
      } else {
        lines[d].sum.bound_slope += m;
        lines[d].sum.bound0 += s.base_gain - m * s.base_attention_us;
      }
    }
  }
  if (c.global.padded_tokens) return bound;
  for (int d = d_lo; d <= d_hi; ++d) {
    const double global_base = plans.GlobalUs(t.base_tokens, t.max_base_tokens, d);
    const double b = GoodputBound(t.floor_us, t.base_gain, lines[d], global_base, plans.FfnUsPerToken());
    if (b >= 0) bound[d] = b;  // a NaN (0 / 0) stays +inf: never skipped
  }
  return bound;
}

// Padded mode with token tiers: every rank runs the agreed tier's P tokens. A rank fills part of
// its spare tokens with verify work (a prefix of its frontier at depth d: up to a knot, or along
// the chord up to P) and pads the rest, each padding token at its `pad_us` (a dummy slot costs
// less than a verify token on a long context, more than one on a short context). A plan is a
// tier, a depth and a barrier T: every rank takes the most gain whose attention, padding
// included, stays within T; the FFN runs every rank's P tokens.

// What TierPoints leaves in `scratch` beside the points: the barrier with every rank at its
// cheapest point and at its dearest one, and the gain of the dearest.
struct TierStart {
  double cheapest_barrier = 0, dearest_barrier = 0, gain = 0;
};

// Each usable rank's points at tier `tier` and depth d, the Pareto chain of its prefixes with the
// rest padded (cheapest first; scratch.points from scratch.point_begin[i]); every rank starts at
// its dearest point (the tier filled where its frontier reaches), scratch.at.
TierStart TierPoints(int d, double tier, absl::Span<const RankSummary> summaries,
                     const UsableTotals& t, DecideScratch& scratch) {
  std::vector<TierPoint>& pts = scratch.points;
  std::vector<uint32_t>&begin = scratch.point_begin, &at = scratch.at;
  const size_t n = scratch.usable_ranks.size();
  pts.clear();
  begin.assign(1, 0);
  at.resize(n);
  TierStart start{t.floor_us, t.floor_us, 0};
  for (size_t i = 0; i < n; ++i) {
    const RankSummary& s = summaries[scratch.usable_ranks[i]];
    const DepthKnots dk = KnotsAtDepth(s, d);
    const double want = tier - s.base_tokens;  // the tier tokens over this rank's base
    // Prefixes in frontier order (gain rises): a point cheaper than the ones kept before it
    // dominates them.
    ForEachTierPoint(s, dk, want, [&](double cost, double tokens, double g) {
      const double padded = cost + s.pad_us * (want - tokens);
      while (pts.size() > begin[i] && pts.back().cost >= padded) pts.pop_back();
      pts.push_back({padded, g});
    });
    start.cheapest_barrier = std::max(start.cheapest_barrier, pts[begin[i]].cost);
    begin.push_back(static_cast<uint32_t>(pts.size()));
    at[i] = begin[i + 1] - 1;
    start.gain += pts[at[i]].gain;
    start.dearest_barrier = std::max(start.dearest_barrier, pts[at[i]].cost);
  }
  return start;
}

// One tier: from every rank at its dearest point, lowers the barrier one point at a time (the
// rank that sets it, the top of a max-heap by cost, moves to its next cheaper point) until that
// rank has none or the gain left over the cheapest barrier cannot beat the best plan.
void SweepTier(int d, double tier, absl::Span<const RankSummary> summaries, const UsableTotals& t,
               DecideScratch& scratch, BestPlan& plans) {
  TierStart start = TierPoints(d, tier, summaries, t, scratch);
  const std::vector<TierPoint>& pts = scratch.points;
  const std::vector<uint32_t>&begin = scratch.point_begin;
  std::vector<uint32_t>& at = scratch.at;
  std::vector<uint64_t>& heap = scratch.heap;
  const size_t n = scratch.usable_ranks.size();
  const double all_tokens = tier * static_cast<double>(n);
  double gain = start.gain;
  plans.Consider(d, start.dearest_barrier, gain, all_tokens, tier);
  // The gain only falls as the barrier does, and no barrier is below the cheapest.
  const double global_us = plans.GlobalUs(all_tokens, tier, d);
  if (plans.CannotWin(gain / (start.cheapest_barrier + global_us))) return;
  // Ranks (their place in usable_ranks) by the cost of the point they sit on; ties by place, so
  // every rank orders them alike.
  auto dearer = [&](uint64_t a, uint64_t b) {
    const double ca = pts[at[a]].cost, cb = pts[at[b]].cost;
    return ca != cb ? ca < cb : a > b;
  };
  heap.resize(n);
  std::iota(heap.begin(), heap.end(), uint64_t{0});
  std::make_heap(heap.begin(), heap.end(), dearer);
  while (true) {
    const uint64_t i = heap.front();
    if (at[i] == begin[i]) return;  // the rank that sets the barrier has no cheaper point
    std::pop_heap(heap.begin(), heap.end(), dearer);
    gain -= pts[at[i]].gain - pts[at[i] - 1].gain;
    --at[i];
    std::push_heap(heap.begin(), heap.end(), dearer);
    plans.Consider(d, std::max(pts[at[heap.front()]].cost, t.floor_us), gain, all_tokens, tier);
    if (plans.CannotWin(gain / (start.cheapest_barrier + global_us))) return;
  }
}

// Every allowed depth and every tier at or above the largest base (past the last tier the largest
// base is the count: no graph), most promising first. A (depth, tier) pair's plans gain at most
// every rank at its dearest point and wait at least every rank at its cheapest (TierPoints' two
// ends, SweepTier's own first test), so the pairs are swept in falling order of that bound, and
// the sweep stops at the first that cannot beat the best plan found. The two ends come from one
// walk per rank and depth over its knots and the tiers together: a point's padded cost is
// cost - pad * tokens + pad * want, so below the tier the cheapest is a running minimum. The best
// plan does not depend on the order (only exact ties could), and every rank orders alike.
void SweepTiers(const PlannerConfig& c, int depth_lo, int depth_hi,
                absl::Span<const RankSummary> summaries, const UsableTotals& t,
                DecideScratch& scratch, BestPlan& plans) {
  std::vector<double>& tiers = scratch.tiers;
  tiers.clear();
  for (int32_t tier : c.token_tiers) {
    if (tier >= t.max_base_tokens) tiers.push_back(tier);
  }
  if (tiers.empty()) tiers.push_back(t.max_base_tokens);
  const size_t num_tiers = tiers.size();
  const double n = static_cast<double>(scratch.usable_ranks.size());
  std::vector<TierPair>& pairs = scratch.tier_pairs;
  pairs.clear();
  std::vector<double>&gain = scratch.tier_gain, &cheapest = scratch.tier_cheapest;
  for (int d = depth_lo; d <= depth_hi; ++d) {
    if (!c.DepthAllowed(d)) continue;
    gain.assign(num_tiers, 0.0);
    cheapest.assign(num_tiers, t.floor_us);
    double* __restrict gain_at = gain.data();
    double* __restrict cheapest_at = cheapest.data();
    const double* __restrict tier_at = tiers.data();
    for (uint32_t r : scratch.usable_ranks) {
      const RankSummary& s = summaries[r];
      const DepthKnots dk = KnotsAtDepth(s, d);
      const double pad = s.pad_us, base_tokens = s.base_tokens;
      double low = s.base_attention_us;  // the least cost - pad * tokens of the points so far
      double c0 = s.base_attention_us, g0 = s.base_gain, t0 = 0;  // the last point so far
      size_t i = 0;
      // The tiers on the chord from that point to knot k (above the point, up to the knot), as
      // ForEachTierPoint takes them. No tier lies below a rank's base (want >= 0), and one at
      // the base (want 0, on the first chord: t0 = 0) gets the base point: over = 0.
      for (int k = 0; k < dk.count && i < num_tiers; ++k) {
        const double c1 = s.knot_attention_us[dk.first + k], g1 = s.knot_gain[dk.first + k];
        const double t1 = s.knot_tokens[dk.first + k];
        // A knot no further than the point (garbage tokens) is a point of its own (frac 1).
        const bool rises = t1 > t0;
        const double cost_slope = rises ? (c1 - c0) / (t1 - t0) : 0.0;
        const double gain_slope = rises ? (g1 - g0) / (t1 - t0) : 0.0;
        const double cost_at0 = rises ? c0 : c1, gain_at0 = rises ? g0 : g1;
        for (; i < num_tiers && tier_at[i] - base_tokens <= t1; ++i) {
          const double want = tier_at[i] - base_tokens, over = want - t0;
          gain_at[i] += gain_at0 + over * gain_slope;
          cheapest_at[i] =
              std::max(cheapest_at[i], std::min(low + pad * want, cost_at0 + over * cost_slope));
        }
        c0 = c1;
        g0 = g1;
        t0 = t1;
        low = std::min(low, c0 - pad * t0);
      }
      for (; i < num_tiers; ++i) {  // past the last knot: the whole frontier, the rest padded
        gain_at[i] += g0;
        cheapest_at[i] = std::max(cheapest_at[i], low + pad * (tier_at[i] - base_tokens));
      }
    }
    for (size_t i = 0; i < num_tiers; ++i) {
      const double bound = gain[i] / (cheapest[i] + plans.GlobalUs(tiers[i] * n, tiers[i], d));
      // A bound that is not a number (it cannot be from usable summaries) sweeps its pair first.
      pairs.push_back({bound >= 0 ? bound : std::numeric_limits<double>::infinity(), d,
                       static_cast<uint32_t>(i)});
    }
  }
  std::sort(pairs.begin(), pairs.end(), [](const TierPair& x, const TierPair& y) {
    if (x.bound != y.bound) return x.bound > y.bound;
    return x.depth != y.depth ? x.depth < y.depth : x.tier < y.tier;
  });
  for (const TierPair& p : pairs) {
    if (plans.CannotWin(p.bound)) break;  // nor can any pair after it
    SweepTier(p.depth, tiers[p.tier], summaries, t, scratch, plans);
  }
}

// Instance mode: every allowed depth d from the floors' up, every usable rank at level d; the
// slowest rank's level sets the barrier. A depth some rank's record does not hold is out.
void SweepInstance(const PlannerConfig& c, absl::Span<const RankSummary> summaries,
                   const UsableTotals& t, absl::Span<const uint32_t> usable, BestPlan& plans) {
  for (int d = t.depth_lo; d <= std::max(t.depth_lo, c.k_max); ++d) {
    if (!c.DepthAllowed(d)) continue;
    double barrier = 0, gain = 0, sum_tokens = 0, max_tokens = 0;
    bool reachable = true;
    for (uint32_t r : usable) {
      LevelPt p;
      if (!LevelPoint(summaries[r], d, &p)) {
        reachable = false;
        break;
      }
      const double tokens = summaries[r].base_tokens + static_cast<double>(p.tokens);
      barrier = std::max(barrier, p.cost);
      gain += p.gain;
      sum_tokens += tokens;
      max_tokens = std::max(max_tokens, tokens);
    }
    if (reachable) plans.Consider(d, barrier, gain, sum_tokens, max_tokens);
  }
}

}  // namespace

std::string_view PlanModeName(PlanMode m) {
  switch (m) {
    case PlanMode::kOff: return "off";
    case PlanMode::kGoodput: return "goodput";
    case PlanMode::kFill: return "fill";
    case PlanMode::kLocal: return "local";
    case PlanMode::kDspark: return "dspark";
    case PlanMode::kDsparkFill: return "dspark_fill";
  }
  return "?";
}

absl::StatusOr<PlanMode> ParsePlanMode(std::string_view name) {
  for (PlanMode m : {PlanMode::kOff, PlanMode::kGoodput, PlanMode::kFill, PlanMode::kLocal,
                     PlanMode::kDspark, PlanMode::kDsparkFill}) {
    if (name == PlanModeName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown verify mode '", std::string(name),
      "' (expected off, goodput, fill, local, dspark or dspark_fill)"));
}

absl::Status PlannerConfig::Validate() const {
  if (std::isnan(max_step_slack)) {
    return absl::InvalidArgumentError("planner: max_step_slack is NaN");
  }
  if (!(guard_overhead_us >= 0 && guard_overhead_us <= 1e7)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: guard_overhead_us = %g must be in 0..1e7 (microseconds)", guard_overhead_us));
  }
  if (!(min_plan_gain >= 0 && min_plan_gain <= 10)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("planner: min_plan_gain = %g must be in 0..10", min_plan_gain));
  }
  if (num_ranks < 1 || num_ranks > 65536) {
    return absl::InvalidArgumentError(
        absl::StrFormat("planner: num_ranks = %d must be in 1..65536", num_ranks));
  }
  if (k_max < 0 || k_max > kMaxDraftLen) {
    return absl::InvalidArgumentError(
        absl::StrFormat("planner: k_max = %d must be in 0..%d", k_max, kMaxDraftLen));
  }
  if (default_k < 0 || default_k > k_max) {
    return absl::InvalidArgumentError(
        absl::StrFormat("planner: default_k = %d must be in 0..k_max (%d)", default_k, k_max));
  }
  if (exact_rank_tokens && uniform_per_rank) {
    return absl::InvalidArgumentError(
        "planner: exact_rank_tokens needs per-request lengths (uniform_per_rank is set)");
  }
  if (uniform_instance && (uniform_per_rank || !agreed_draft_depth)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: granularity instance needs one agreed draft depth and not one length per rank "
        "(agreed_draft_depth = %d, uniform_per_rank = %d)", agreed_draft_depth, uniform_per_rank));
  }
  if (uniform_instance && mode != PlanMode::kGoodput && mode != PlanMode::kOff) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: granularity instance plans in mode goodput or off, not %s", PlanModeName(mode)));
  }
  if (allowed_depths >> (kMaxDraftLen + 1)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: allowed_depths = 0x%x names a depth above %d", allowed_depths, kMaxDraftLen));
  }
  if (!DepthAllowed(default_k) || !DepthAllowed(k_max)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: allowed_depths = 0x%x must hold default_k (%d) and k_max (%d)", allowed_depths,
        default_k, k_max));
  }
  for (size_t i = 0; i < token_tiers.size(); ++i) {
    if (token_tiers[i] <= 0 || (i > 0 && token_tiers[i] <= token_tiers[i - 1])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "planner: token tier %d (index %d) must be positive and ascending", token_tiers[i], i));
    }
  }
  return global.Validate();
}

uint64_t PlannerConfig::Hash() const {
  internal::Fnv1a h;
  h.Value(num_ranks);
  h.Value(static_cast<int>(mode));
  h.Value(k_max);
  h.Value(default_k);
  h.Value(global.Hash());
  for (int32_t t : token_tiers) h.Value(t);
  h.Value(max_step_slack);
  h.Value(guard_overhead_us);
  h.Value(agreed_draft_depth);
  h.Value(uniform_per_rank);
  h.Value(exact_rank_tokens);
  h.Value(order_by_gain);
  h.Value(dspark_context_sps);
  // Hashed only when set, so the hash of every configuration without them is unchanged.
  if (min_plan_gain != 0) h.Value(min_plan_gain);
  if (guard_measured_overhead) h.Value(uint64_t{0x6d6561737572656f});  // a tag: "measureo"
  if (value_deferral) h.Value(value_deferral);
  if (uniform_instance) h.Value(uint64_t{0x696e7374616e6365});  // a tag: "instance"
  if (allowed_depths != 0) h.Value(allowed_depths);
  h.Value(kSummaryVersion);
  return h.digest();
}

Planner::Planner(PlannerConfig config, CostModel model)
    : config_(std::move(config)),
      model_(PricedCopy(model)),
      config_hash_(config_.Hash()),
      focus_depth_(config_.default_k) {}

absl::StatusOr<Planner> Planner::Create(PlannerConfig config, CostModel model) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  Planner planner(std::move(config), std::move(model));
  const PlannerConfig& c = planner.config_;
  if (planner.dspark() && !c.dspark_context_sps && !c.dspark_additive) {
    absl::StatusOr<dspark::SpsTable> table =
        c.dspark_sps_tokens.empty()
            ? dspark::ProfileSps(planner.model_, c.global, c.num_ranks,
                                 c.token_tiers.empty() ? 256 : c.token_tiers.back() / (c.k_max + 1),
                                 c.k_max, !c.agreed_draft_depth)
            : dspark::SpsTable::Create(c.dspark_sps_tokens, c.dspark_sps_steps_per_s);
    if (!table.ok()) return table.status();
    planner.sps_ = *std::move(table);
  }
  return planner;
}

absl::Status Planner::SetDsparkRankTable(int rank_idx, dspark::SpsTable table) {
  if (!sps_) {
    return absl::FailedPreconditionError(
        "planner: a rank's SPS table needs a DSpark mode priced by the table (not the additive "
        "table or dspark_context_sps)");
  }
  if (rank_idx < 0 || rank_idx >= config_.num_ranks) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: rank_idx = %d outside 0..%d", rank_idx, config_.num_ranks - 1));
  }
  rank_sps_.resize(static_cast<size_t>(config_.num_ranks));
  rank_sps_[static_cast<size_t>(rank_idx)] = std::move(table);
  return absl::OkStatus();
}

int32_t Planner::Floor(const PlanRequest& r) const {
  if (config_.mode == PlanMode::kFill) return std::max(r.k_min, DefaultVerifyLen(config_.default_k, r.k_cap));
  if (dspark()) return 0;  // DSpark has no floors
  return r.k_min;
}

absl::Status Planner::ValidateBatch(absl::Span<const PlanRequest> batch) const {
  if (batch.size() > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("planner: batch of %d requests exceeds 65535", batch.size()));
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    const PlanRequest& r = batch[i];
    if (r.ctx_tokens < 0 || r.ctx_tokens > kMaxCtxTokens) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "planner: request %d: ctx_tokens = %d %s", i, r.ctx_tokens,
          r.ctx_tokens < 0 ? "is negative" : "exceeds 2^40 (kMaxCtxTokens)"));
    }
    if (r.k_cap < 0 || r.k_cap > config_.k_max) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "planner: request %d: k_cap = %d must be in 0..k_max (%d)", i, r.k_cap, config_.k_max));
    }
    if (r.k_min < 0 || r.k_min > r.k_cap) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "planner: request %d: k_min = %d must be in 0..k_cap (%d)", i, r.k_min, r.k_cap));
    }
  }
  return absl::OkStatus();
}

absl::Status Planner::Summarize(int rank_idx, absl::Span<const PlanRequest> batch,
                                int64_t kv_free_tokens, RankSummary* out) {
  return SummarizeInto(local_, rank_idx, batch, kv_free_tokens, out);
}

absl::Status Planner::SummarizeInto(LocalState& st, int rank_idx,
                                    absl::Span<const PlanRequest> batch, int64_t kv_free_tokens,
                                    RankSummary* out) const {
  if (rank_idx < 0 || rank_idx >= config_.num_ranks) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: rank_idx = %d outside 0..%d", rank_idx, config_.num_ranks - 1));
  }
  if (absl::Status s = ValidateBatch(batch); !s.ok()) return s;
  RankSummary& s = *out;
  // Step 1: the base plan (every request at its floor) and the engine's default plan.
  SetBase(st, batch, kv_free_tokens);
  StartSummary(st, rank_idx, s);
  SummarizeDefault(st, s);
  if (dspark()) {
    SummarizeDspark(st, s);
    return absl::OkStatus();
  }
  const int64_t kv_cap = KvCap(kv_free_tokens);
  if (config_.uniform_per_rank || config_.uniform_instance) {
    st.items.clear();
    SummarizeUniform(st, kv_cap, s, config_.uniform_instance);
  } else {
    // Step 2: extra-token items ordered by expected tokens per marginal microsecond.
    OrderItems(st);
    // Step 3: per draft depth, knots spread along the frontier, costs evaluated exactly.
    std::array<int64_t, kMaxDraftLen + 1> avail = ItemsPerDepth(st.items, kv_cap);
    const int d_lo = std::max(1, static_cast<int>(s.min_depth));
    WalkKnots(st, avail, ShareKnotPool(avail, d_lo, s.max_depth, focus_depth_, KnotBudget(config_.num_ranks)), s);
  }
  FillMaxSlopes(s);
  if (config_.exact_rank_tokens) st.summary = s;
  return absl::OkStatus();
}

std::vector<double> DeferralWeights(const CostModel& model, const GlobalCost& global,
                                    int num_ranks, int default_k, bool agreed_draft_depth,
                                    absl::Span<const PlanRequest> batch) {
  const size_t n = batch.size();
  std::vector<double> w(n, 1.0);
  if (n < 2) return w;
  // The batch at its default lengths, and the critical-path maxima without each request
  // (prefix and suffix maxima).
  BatchAggregates all;
  std::vector<double> q(n), pre_pairs(n + 1, 0), pre_keys(n + 1, 0), suf_pairs(n + 1, 0),
      suf_keys(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    q[i] = 1.0 + DefaultVerifyLen(default_k, batch[i].k_cap);
    all.Add(RequestLoad{batch[i].ctx_tokens, static_cast<int32_t>(q[i])});
    const double ctx = static_cast<double>(batch[i].ctx_tokens);
    pre_pairs[i + 1] = std::max(pre_pairs[i], q[i] * ctx);
    pre_keys[i + 1] = std::max(pre_keys[i], ctx);
  }
  for (size_t i = n; i-- > 0;) {
    const double ctx = static_cast<double>(batch[i].ctx_tokens);
    suf_pairs[i] = std::max(suf_pairs[i + 1], q[i] * ctx);
    suf_keys[i] = std::max(suf_keys[i + 1], ctx);
  }
  const double rank_us = model.AttentionUs(all);
  std::vector<double> own(n);
  double own_sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const double ctx = static_cast<double>(batch[i].ctx_tokens);
    BatchAggregates without = all;
    without.num_requests -= 1;
    without.query_tokens -= q[i];
    without.query_key_pairs -= q[i] * ctx;
    without.key_tokens -= ctx;
    without.max_query_key_pairs = std::max(pre_pairs[i], suf_pairs[i + 1]);
    without.max_key_tokens = std::max(pre_keys[i], suf_keys[i + 1]);
    own[i] = std::max(0.0, rank_us - model.AttentionUs(without));
    own_sum += own[i];
  }
  // The rest of the rank's attention, and its share of the instance's step (as if every rank ran
  // this rank's tokens), shared equally by its requests.
  const double shared =
      (std::max(0.0, rank_us - own_sum) +
       global.StepUs(all.query_tokens * num_ranks, agreed_draft_depth ? default_k : 0) / num_ranks) /
      static_cast<double>(n);
  double cost_sum = 0, tokens_sum = 0;
  std::vector<double> per_token(n);
  for (size_t i = 0; i < n; ++i) {
    const double cost = own[i] + shared;
    const double tokens = batch[i].acceptance.ExpectedTokens(static_cast<int>(q[i]) - 1);
    per_token[i] = cost / tokens;
    cost_sum += cost;
    tokens_sum += tokens;
  }
  const double mean = cost_sum / tokens_sum;
  if (!(mean > 0) || !std::isfinite(mean)) return w;
  for (size_t i = 0; i < n; ++i) w[i] = std::clamp(per_token[i] / mean, 0.25, 4.0);
  return w;
}

void Planner::SetBase(LocalState& st, absl::Span<const PlanRequest> batch,
                      int64_t kv_free_tokens) const {
  st.batch.assign(batch.begin(), batch.end());
  if (config_.value_deferral && !dspark()) {
    // Each request's tokens at its deferral value: every gain below (base, default, items,
    // knots, Assign's fill) reads the valued curve.
    const std::vector<double> w =
        DeferralWeights(model_, config_.global, config_.num_ranks, config_.default_k,
                        config_.agreed_draft_depth, batch);
    for (size_t i = 0; i < st.batch.size(); ++i) st.batch[i].acceptance = st.batch[i].acceptance.Valued(w[i]);
  }
  // From here on only st.batch is read: its curves are the valued ones.
  const std::vector<PlanRequest>& reqs = st.batch;
  st.kv_free_tokens = kv_free_tokens;
  st.base_len.resize(reqs.size());
  st.base_agg = BatchAggregates{};
  st.base_gain = 0;
  st.min_depth = 0;
  st.max_cap = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const int32_t k = Floor(reqs[i]);
    st.base_len[i] = k;
    st.base_agg.Add(RequestLoad{reqs[i].ctx_tokens, 1 + k});
    st.base_gain += reqs[i].acceptance.ExpectedTokens(k);
    st.min_depth = std::max(st.min_depth, static_cast<int>(k));
    st.max_cap = std::max(st.max_cap, static_cast<int>(reqs[i].k_cap));
  }
  if (model_.uses_grid()) {  // one simulation per kernel path; later steps move it linearly
    st.base_loads.clear();
    for (size_t i = 0; i < reqs.size(); ++i) {
      st.base_loads.push_back(RequestLoad{reqs[i].ctx_tokens, 1 + st.base_len[i]});
    }
    model_.FillGrid(st.base_loads, &st.base_agg);
  }
  st.base_attention_us = model_.AttentionUs(st.base_agg) + RankDraftUs() * st.min_depth;
  st.pad_us = PricesTiers(config_) ? PadPriceUs(st) : 0.0;
}

// What one padding token adds to the rank's base, on the base's own launch (a dummy request of
// one query token leaves a batch of single-query requests on the decode launch, as the kernel
// runs it), as a dummy request of one query token and one key: the most a padding token costs
// while the engine has a free request slot for each (SGLang puts several on one dummy row when it
// has not: dspark::PadToTier). Averaged over the tokens from the base up to the tier of the rank's
// whole frontier (every request at its cap; the next tier above the base where that is the
// base's own), at most kPadPriceRows of them, and over a quarter of them, whichever is dearer: a
// grid model simulates the launches, and whether a few dummy rows' CTAs fill its idle slots or
// lengthen its tail depends on how many there are (a head-major launch priced 64 rows at nothing
// a token where 32 added 6.6%).
double Planner::PadPriceUs(const LocalState& st) const {
  const std::vector<int32_t>& tiers = config_.token_tiers;
  const int64_t base = std::llround(st.base_agg.query_tokens);
  int64_t full = base;
  for (size_t i = 0; i < st.batch.size(); ++i) {
    full += std::max(0, st.batch[i].k_cap - st.base_len[i]);
  }
  int64_t tier = TierFor(tiers, full);
  if (tier <= base) tier = TierFor(tiers, base + 1);
  // At most kPadPriceRows dummy rows are simulated: the price is a mean, and a head-major
  // launch runs every head of each row.
  constexpr int64_t kPadPriceRows = 64;
  const int64_t rows = std::min(tier - base, kPadPriceRows);
  std::vector<RequestLoad> loads;
  loads.reserve(st.batch.size() + static_cast<size_t>(rows));
  for (size_t i = 0; i < st.batch.size(); ++i) {
    loads.push_back(RequestLoad{st.batch[i].ctx_tokens, 1 + st.base_len[i]});
  }
  // A price is a difference of two launches: sampled heads move a head-major launch's makespans
  // by a few per cent either way (kernel_grid.h), more than a few dummy rows add, so both are
  // simulated whole.
  const std::optional<CostModel> whole =
      model_.uses_grid() && model_.grid_simulation() == GridSimulation::kSampledHeads
          ? std::optional<CostModel>(model_.WithGridSimulation(GridSimulation::kReference))
          : std::nullopt;
  const CostModel& model = whole ? *whole : model_;
  auto launch_us = [&](absl::Span<const RequestLoad> batch) {
    const BatchAggregates agg = model.Aggregate(batch);  // the launch the batch runs
    return model.AttentionUs(agg);
  };
  const double without = launch_us(loads);
  double per_token = 0;
  const size_t n = loads.size();
  for (int64_t r : {std::max<int64_t>(1, rows / 4), rows}) {
    loads.resize(n);
    loads.insert(loads.end(), static_cast<size_t>(r), RequestLoad{1, 1});
    per_token = std::max(per_token, (launch_us(loads) - without) / static_cast<double>(r));
  }
  return std::isfinite(per_token) ? per_token : 0.0;
}

void Planner::StartSummary(const LocalState& st, int rank_idx, RankSummary& s) const {
  std::memset(&s, 0, sizeof(s));
  s.magic = kSummaryMagic;
  s.version = kSummaryVersion;
  s.flags = kSummaryValid;
  s.config_hash = config_hash_;
  s.rank_idx = static_cast<uint16_t>(rank_idx);
  s.prev_attention_us = s.prev_step_us = s.prev_accepted_tokens = s.prev_cycle_us = -1.f;
  s.base_attention_us = static_cast<float>(st.base_attention_us);
  s.base_gain = static_cast<float>(st.base_gain);
  s.base_tokens = static_cast<uint32_t>(st.base_agg.query_tokens);
  s.num_requests = static_cast<uint16_t>(st.batch.size());
  s.min_depth = static_cast<uint8_t>(st.min_depth);
  s.max_depth = static_cast<uint8_t>(std::max(st.min_depth, st.max_cap));
  s.pad_us = static_cast<float>(st.pad_us);
}

void Planner::SummarizeDefault(LocalState& st, RankSummary& s) const {
  double default_gain = 0;
  int default_depth = 0;
  st.default_loads.clear();
  for (const PlanRequest& r : st.batch) {
    const int32_t k = DefaultVerifyLen(config_.default_k, r.k_cap);
    st.default_loads.push_back(RequestLoad{r.ctx_tokens, 1 + k});
    default_gain += r.acceptance.ExpectedTokens(k);
    default_depth = std::max(default_depth, static_cast<int>(k));
  }
  // Where the base's simulation moves exactly with the query tokens (no grid, or a head-major
  // one) the default plan is priced from the base's; otherwise it is simulated.
  BatchAggregates default_agg;
  if (model_.uses_grid() &&
      model_.kernel_grid().VerifyTermsDependOnQueryTokens(1 + config_.default_k)) {
    default_agg = model_.Aggregate(st.default_loads);
  } else {
    for (const RequestLoad& l : st.default_loads) default_agg.Add(l);
    default_agg.grid = st.base_agg.grid;
  }
  s.default_attention_us =
      static_cast<float>(model_.AttentionUs(default_agg) + RankDraftUs() * default_depth);
  s.default_gain = static_cast<float>(default_gain);
  s.default_tokens = static_cast<uint32_t>(default_agg.query_tokens);
}

void Planner::OrderItems(LocalState& st) const {
  // An item whose gain cannot pay for its FFN cost at last step's goodput never helps, so it is
  // dropped.
  const double min_gain = MinItemGain(last_tokens_per_us_);
  // Marginal cost (us) of one more query token for a request, at the base batch in the
  // multi-query regime. It only orders the items; knot costs are evaluated exactly.
  BatchAggregates multi = st.base_agg;
  multi.multi_query = true;
  const double multi_us = model_.AttentionUs(multi);
  st.items.clear();
  const BatchAggregates::TokenMark multi_mark = multi.Mark();
  for (size_t i = 0; i < st.batch.size(); ++i) {
    const PlanRequest& r = st.batch[i];
    double marginal = 1.0;  // order_by_gain: the engine's confidence order
    if (!config_.order_by_gain) {
      multi.AddQueryToken(RequestLoad{r.ctx_tokens, 1 + st.base_len[i]});
      marginal = std::max(model_.AttentionUs(multi) - multi_us, kTinyUs);
      multi.Restore(multi_mark);
    }
    for (int j = st.base_len[i] + 1; j <= r.k_cap; ++j) {
      const double gain = r.acceptance.Accept(j);
      if (gain <= min_gain) break;  // gains fall with j
      const uint32_t ratio_bits = FloatKey(static_cast<float>(gain / marginal));
      st.items.push_back(Item{(uint64_t{~ratio_bits} << 32) |
                              (uint64_t{static_cast<uint32_t>(i)} << 8) | static_cast<uint64_t>(j)});
    }
  }
  // Pushed in request order, positions rising: in the order of the keys' low halves, so the
  // radix sort (from 64 items: it beat std::sort in the planner bench) gives the key order.
  SortByHighHalf(st.items, st.items_tmp, 64);
}

std::array<int64_t, kMaxDraftLen + 1> Planner::ItemsPerDepth(absl::Span<const Item> items,
                                                             int64_t kv_cap) {
  std::array<int64_t, kMaxDraftLen + 1> avail{};
  for (const Item& it : items) ++avail[it.pos()];
  int64_t running = 0;
  for (int d = 1; d <= kMaxDraftLen; ++d) {
    running += avail[d];
    avail[d] = std::min<int64_t>({running, kv_cap, 65535});
  }
  return avail;
}

void Planner::WalkKnots(const LocalState& st, const std::array<int64_t, kMaxDraftLen + 1>& avail,
                        const std::array<int, kMaxDraftLen + 1>& share, RankSummary& s) const {
  // One walk down the item list serves every depth: items are summed per draft position, and
  // depth d's totals are the base plus the sums of positions 1..d, formed only at its knots.
  struct PositionSums {
    double tokens = 0, pairs = 0, max_pairs = 0, gain = 0;
  };
  std::array<PositionSums, kMaxDraftLen + 1> pos_sums{};
  std::array<int64_t, kMaxDraftLen + 1> taken{}, next_at{};
  std::array<int, kMaxDraftLen + 1> knot{};
  // A fitted model may price the multi-query kernel path below the single-query one; more
  // verify work is never really faster, so knot costs follow the running maximum.
  std::array<double, kMaxDraftLen + 1> cost{};
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  // Knot i of depth d sits after item ceil(n * (i + 1) / knots) of that depth's list.
  auto knot_at = [&](int d, int i) {
    return i < share[d] ? (avail[d] * (i + 1) + share[d] - 1) / share[d] : kNever;
  };
  const int d_lo = std::max(1, st.min_depth), d_hi = s.max_depth;
  int next_knot = 0, depths_open = 0;
  for (int d = d_lo; d <= d_hi; ++d) {
    s.knot_begin[d - 1] = static_cast<uint8_t>(next_knot);
    next_knot += avail[d] > 0 ? share[d] : 0;
    next_at[d] = avail[d] > 0 ? knot_at(d, 0) : kNever;
    cost[d] = st.base_attention_us;
    depths_open += next_at[d] != kNever;
  }
  const double rank_draft_us = RankDraftUs();
  BatchAggregates agg = st.base_agg;  // each knot's batch, rebuilt from the base in place
  const BatchAggregates::TokenMark base_mark = agg.Mark();
  for (const Item& it : st.items) {
    if (depths_open == 0) break;
    const int p = it.pos();
    const PlanRequest& r = st.batch[it.req_idx()];
    const double ctx = static_cast<double>(r.ctx_tokens);
    PositionSums& ps = pos_sums[p];
    ps.tokens += 1;
    ps.pairs += ctx;
    ps.max_pairs = std::max(ps.max_pairs, (p + 1.0) * ctx);
    ps.gain += r.acceptance.Accept(p);
    for (int d = std::max(p, d_lo); d <= d_hi; ++d) {
      if (++taken[d] != next_at[d]) continue;
      agg.Restore(base_mark);
      agg.multi_query = true;
      double gain = st.base_gain;
      int deepest = st.min_depth;
      for (int q = 1; q <= d; ++q) {
        const PositionSums& sum = pos_sums[q];
        agg.query_tokens += sum.tokens;
        agg.query_key_pairs += sum.pairs;
        agg.max_query_key_pairs = std::max(agg.max_query_key_pairs, sum.max_pairs);
        gain += sum.gain;
        if (sum.tokens > 0) deepest = std::max(deepest, q);
      }
      cost[d] = std::max(cost[d], model_.AttentionUs(agg) + rank_draft_us * deepest);
      const int k = s.knot_begin[d - 1] + knot[d];
      s.knot_attention_us[k] = static_cast<float>(cost[d]);
      s.knot_gain[k] = static_cast<float>(gain);
      s.knot_tokens[k] = static_cast<uint16_t>(taken[d]);
      next_at[d] = knot_at(d, ++knot[d]);
      depths_open -= next_at[d] == kNever;
    }
  }
  for (int d = d_lo; d <= d_hi; ++d) s.num_knots[d - 1] = static_cast<uint8_t>(knot[d]);
}

namespace {
// What the TPOT guard charges a plan beyond its planned step: the configured overhead plus, when
// measured overhead is on, the largest own time among the usable records (the same bytes on
// every rank, so the same value).
double GuardOverheadUs(const PlannerConfig& c, absl::Span<const RankSummary> summaries,
                       absl::Span<const uint32_t> usable) {
  double measured = 0;
  if (c.guard_measured_overhead) {
    for (uint32_t r : usable) measured = std::max<double>(measured, summaries[r].own_us);
  }
  return c.guard_overhead_us + measured;
}

// After Decide's sweep, the default guard (PlannerConfig::min_plan_gain): records the default
// plan's predicted goodput in `best` and, unless `best` beats it by more than the margin,
// replaces `best` with the default plan. The default plan must respect every floor
// (default_k >= the deepest), else the plan stands. Every rank runs this on the same bytes, so all keep or all plan.
// Replaces `best` with the engine's default plan (every request at default_k).
void KeepDefault(const PlannerConfig& c, const UsableTotals& t, double default_step_us,
                 const BestPlan& plans, GlobalDecision& best) {
  const int num_planned = best.num_planned_ranks;
  const double default_tokens_per_us = default_step_us > 0 ? t.default_gain / default_step_us : 0;
  best = GlobalDecision{};
  best.kept_default = true;
  best.draft_depth = c.default_k;
  best.barrier_us = t.default_barrier;
  best.step_us = default_step_us;
  best.expected_tokens = t.default_gain;
  best.tokens_per_us = default_tokens_per_us;
  best.default_tokens_per_us = default_tokens_per_us;
  best.default_step_us = default_step_us;
  best.ffn_tokens = std::llround(plans.FfnTokens(t.default_tokens, t.max_default_tokens));
  best.padded_rank_tokens = c.global.padded_tokens
                                ? TierFor(c.token_tiers, std::llround(t.max_default_tokens))
                                : 0;
  best.num_planned_ranks = num_planned;
}

void GuardDefault(const PlannerConfig& c, const UsableTotals& t, double default_step_us,
                  const BestPlan& plans, GlobalDecision& best) {
  if (!(default_step_us > 0)) return;
  best.default_tokens_per_us = t.default_gain / default_step_us;
  if (c.min_plan_gain <= 0 || t.depth_lo > c.default_k) return;
  if (best.tokens_per_us > best.default_tokens_per_us * (1 + c.min_plan_gain)) return;
  KeepDefault(c, t, default_step_us, plans, best);
}
}  // namespace

absl::StatusOr<GlobalDecision> Planner::Decide(absl::Span<const RankSummary> summaries) const {
  const PlannerConfig& c = config_;
  const bool local = c.mode == PlanMode::kLocal;
  if (summaries.empty()) return absl::InvalidArgumentError("planner: no summaries to decide on");
  if (!local && summaries.size() != static_cast<size_t>(c.num_ranks)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: %d summaries for %d ranks", summaries.size(), c.num_ranks));
  }
  if (c.mode == PlanMode::kOff) {
    GlobalDecision off;
    off.draft_depth = c.default_k;
    return off;
  }
  if (dspark()) return DecideDspark(summaries);
  // Step 1: which ranks take part; the floor barrier and the feasible depths.
  absl::StatusOr<UsableTotals> totals =
      TotalUsable(summaries, local, config_hash_, decide_.usable_ranks);
  if (!totals.ok()) return totals.status();
  const int num_usable = static_cast<int>(decide_.usable_ranks.size());
  // Step 2: the engine's default plan prices the TPOT guard. With per-rank draft depths the
  // draft time is already inside each rank's costs.
  BestPlan plans(c, num_usable);
  const double default_step_us =
      totals->default_barrier + plans.GlobalUs(totals->default_tokens, totals->max_default_tokens,
                                               c.agreed_draft_depth ? c.default_k : 0);
  plans.SetDefaultStep(default_step_us, GuardOverheadUs(c, summaries, decide_.usable_ranks));
  // Step 3: sweep the barrier over the ranks' knots, for each feasible depth.
  if (!c.agreed_draft_depth) {
    SweepPerRankDepths(c, summaries, *totals, decide_, plans);
    GlobalDecision best = plans.best();
    best.draft_depth = c.k_max;  // a cap: each rank drafts to its deepest assigned length
    best.num_planned_ranks = num_usable;
    GuardDefault(c, *totals, default_step_us, plans, best);
    return best;
  }
  decide_.segments.resize(summaries.size());
  const int depth_hi = std::max(totals->depth_lo, c.k_max);
  const bool tiers = PricesTiers(c);
  if (c.uniform_instance) {
    SweepInstance(c, summaries, *totals, decide_.usable_ranks, plans);
  } else if (tiers) {
    SweepTiers(c, totals->depth_lo, depth_hi, summaries, *totals, decide_, plans);
  } else {
    // No drafts first (one Consider: a plan to beat), then the depth the last plan chose (the
    // one whose knots the ranks' summaries hold most of; with one length per rank every depth's
    // knots are its levels, so none), then the others, shallow to deep. A depth whose bound
    // from the bases cannot beat the best so far is never entered. The order comes from the
    // summaries alone, so every rank sweeps alike.
    const int d_lo = std::max(1, totals->depth_lo);
    std::array<int, kMaxDraftLen + 1> knots;
    const std::array<double, kMaxDraftLen + 1> bound =
        DepthBounds(c, d_lo, depth_hi, summaries, *totals, decide_, plans, knots);
    int focus = 0;
    if (!c.uniform_per_rank) {
      for (int d = d_lo; d <= depth_hi; ++d) {
        if (c.DepthAllowed(d) && (focus == 0 || knots[d] > knots[focus])) focus = d;
      }
    }
    auto sweep = [&](int d) {
      if (d > 0 && plans.CannotWin(bound[d])) return;
      SweepDepth(c, d, summaries, *totals, decide_, plans);
    };
    if (totals->depth_lo == 0 && c.DepthAllowed(0)) sweep(0);
    if (focus > 0) sweep(focus);
    for (int d = d_lo; d <= depth_hi; ++d) {
      if (d != focus && c.DepthAllowed(d)) sweep(d);
    }
  }
  // Step 4: a rank that sent no usable summary runs the engine's default lengths; every rank
  // sees that in the same bytes, so all agree to draft deep enough for it (an MTP draft has MoE
  // layers: one depth for the whole instance).
  GlobalDecision best = plans.best();
  best.num_planned_ranks = num_usable;
  GuardDefault(c, *totals, default_step_us, plans, best);
  if (!local && num_usable < static_cast<int>(summaries.size())) {
    // Instance mode: the rank without a usable summary verifies the default width, so every
    // rank does (one width for the instance).
    if (c.uniform_instance) KeepDefault(c, *totals, default_step_us, plans, best);
    best.draft_depth = std::max(best.draft_depth, c.default_k);
  }
  return best;
}

double Planner::MinItemGain(double tokens_per_us) const {
  return config_.global.padded_tokens ? 0.0 : tokens_per_us * config_.global.ffn_per_token_us;
}

double Planner::RankDraftUs() const {
  return config_.agreed_draft_depth ? 0.0 : config_.global.draft_per_step_us;
}

absl::Status Planner::Assign(const GlobalDecision& decision, absl::Span<int32_t> verify_len) {
  last_tokens_per_us_ = decision.tokens_per_us;
  focus_depth_ = config_.agreed_draft_depth ? decision.draft_depth : config_.default_k;
  return AssignFrom(local_, decision, verify_len);
}

absl::Status Planner::AssignFrom(const LocalState& st, const GlobalDecision& d,
                                 absl::Span<int32_t> verify_len) const {
  const size_t n = st.batch.size();
  if (verify_len.size() != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: verify_len has %d slots for a batch of %d", verify_len.size(), n));
  }
  // Mode off, or the default guard kept the default plan (DSpark decisions never do): every
  // request at the engine's default length.
  if (config_.mode == PlanMode::kOff || d.kept_default) {
    for (size_t i = 0; i < n; ++i) verify_len[i] = DefaultVerifyLen(config_.default_k, st.batch[i].k_cap);
    return absl::OkStatus();
  }
  if (dspark()) {
    AssignDspark(st, d, verify_len);
    return absl::OkStatus();
  }
  for (size_t i = 0; i < n; ++i) {
    if (st.base_len[i] > d.draft_depth) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "planner: request %d needs verify length %d but the agreed draft depth is %d", i,
          st.base_len[i], d.draft_depth));
    }
  }
  if (config_.uniform_instance) {  // every rank at the agreed level
    UniformLens(st, d.draft_depth, verify_len);
    return absl::OkStatus();
  }
  // Exact totals take the knot; so does a budget (the engine spreads it by confidence, which is
  // the knot's prefix), padded or not. Padded per-request lengths fill up to the tier instead.
  if (config_.exact_rank_tokens && (!config_.global.padded_tokens || config_.order_by_gain)) {
    AssignKnot(st, d, verify_len);
    return absl::OkStatus();
  }
  if (config_.agreed_draft_depth) {
    FillUnder(st, d, d.draft_depth, verify_len);
    return absl::OkStatus();
  }
  // Per-rank draft depth: the rank picks the depth whose fill under the barrier gains most.
  std::vector<int32_t> trial(n);
  double best_gain = -1;
  for (int cap = st.min_depth; cap <= d.draft_depth; ++cap) {
    const double gain = FillUnder(st, d, cap, absl::MakeSpan(trial));
    if (gain > best_gain) {
      best_gain = gain;
      std::copy(trial.begin(), trial.end(), verify_len.begin());
    }
  }
  return absl::OkStatus();
}

void Planner::AssignKnot(const LocalState& st, const GlobalDecision& d,
                         absl::Span<int32_t> verify_len) const {
  const KnotChoice k = ChooseKnot(st.summary, d, config_);
  std::copy(st.base_len.begin(), st.base_len.end(), verify_len.begin());
  // The knot sits after its first `extra_tokens` items of depth <= k.depth in frontier order
  // (WalkKnots counts them the same way), and a request's items come in position order there.
  int64_t taken = 0;
  for (const Item& it : st.items) {
    if (taken == k.extra_tokens) break;
    if (it.pos() > k.depth) continue;
    verify_len[it.req_idx()] = it.pos();
    ++taken;
  }
}

void Planner::RankTokens(absl::Span<const RankSummary> summaries, const GlobalDecision& decision,
                         bool balanced, absl::Span<int64_t> out) const {
  for (size_t r = 0; r < summaries.size() && r < out.size(); ++r) {
    const RankSummary& s = summaries[r];
    if (s.magic != kSummaryMagic) {  // an empty record (no plugin there): nothing is known
      out[r] = -1;
      continue;
    }
    int64_t tokens = s.default_tokens;
    if (balanced && config_.mode != PlanMode::kOff && SummaryUsable(s, r)) {
      if (dspark()) {  // every rank runs the agreed tier, an idle one on dummy rows
        tokens = decision.padded_rank_tokens;
      } else if (config_.global.padded_tokens) {
        // A rank that can verify runs the tier and fills up to it; one that cannot (no
        // requests, no drafts) runs what it has.
        tokens = s.max_depth > 0 ? decision.padded_rank_tokens : int64_t{s.base_tokens};
      } else if (!decision.kept_default && config_.uniform_instance) {
        LevelPt p;
        if (LevelPoint(s, decision.draft_depth, &p)) tokens = s.base_tokens + p.tokens;
      } else if (!decision.kept_default) {  // kept: the default lengths' tokens, as unbalanced
        tokens = config_.exact_rank_tokens ? s.base_tokens + ChooseKnot(s, decision, config_).extra_tokens
                                           : s.base_tokens;
      }
    }
    out[r] = tokens + s.extra_tokens;
  }
}

int Planner::UniformLens(const LocalState& st, int level, absl::Span<int32_t> lens) const {
  int deepest = st.min_depth;
  for (size_t i = 0; i < st.batch.size(); ++i) {
    lens[i] = std::max(st.base_len[i], std::min<int32_t>(level, st.batch[i].k_cap));
    deepest = std::max(deepest, static_cast<int>(lens[i]));
  }
  return deepest;
}

void Planner::SummarizeUniform(LocalState& st, int64_t kv_cap, RankSummary& s,
                               bool every_level) const {
  // One knot per level that adds tokens, priced exactly (a grid model simulates the launch),
  // stored once and shared by every depth at or above it: depth d reads the first knots, those
  // of levels <= d. Levels past the KV budget are left out whole (a level is all or nothing).
  // Every level is kept for Assign (st.levels), also past the last knot.
  const size_t n = st.batch.size();
  const double rank_draft_us = RankDraftUs();
  const double base_gain = st.base_gain;
  std::vector<int32_t> lens(n);
  std::vector<RequestLoad> loads(n);
  bool open = true;  // still adding knots
  std::array<int, kMaxDraftLen + 1> upto{};  // knots of levels <= d
  int stored = 0;
  int64_t prev_added = 0;
  double cost = st.base_attention_us, prev_gain = base_gain;
  const double min_gain = MinItemGain(last_tokens_per_us_);
  for (int level = 1; level <= s.max_depth; ++level) {
    upto[level] = stored;
    const int deepest = UniformLens(st, level, absl::MakeSpan(lens));
    int64_t added = 0;
    double gain = 0;
    for (size_t i = 0; i < n; ++i) {
      loads[i] = RequestLoad{st.batch[i].ctx_tokens, 1 + lens[i]};
      added += lens[i] - st.base_len[i];
      gain += st.batch[i].acceptance.ExpectedTokens(lens[i]);
    }
    const double us = model_.AttentionUs(model_.Aggregate(loads)) + rank_draft_us * deepest;
    st.levels[level] = {us, gain, added};
    if (!open || (added == prev_added && !every_level)) continue;  // no request can go this deep
    // Past the KV budget, or (as items) a level whose extra tokens cannot pay for their FFN time
    // at last step's goodput, ends the knots: the deeper ones do not help either. In instance
    // mode neither does: another rank's gain may pay for this rank's level, and the engine
    // reserves the KV of the width it runs (a captured step graph) itself.
    if (added > 65535 ||
        (!every_level && (added > kv_cap ||
                          gain - prev_gain < min_gain * static_cast<double>(added - prev_added)))) {
      open = false;
      continue;
    }
    cost = std::max(cost, us);  // more work is never cheaper (see OrderItems)
    s.knot_attention_us[stored] = static_cast<float>(cost);
    s.knot_gain[stored] = static_cast<float>(std::max(gain, base_gain));
    s.knot_tokens[stored] = static_cast<uint16_t>(added);
    upto[level] = ++stored;
    prev_added = added;
    prev_gain = gain;
  }
  // Levels above every cap put each request where the deepest level did.
  st.levels[0] = {st.base_attention_us, base_gain, 0};
  for (int level = std::max(1, static_cast<int>(s.max_depth) + 1); level <= kMaxDraftLen; ++level) {
    st.levels[level] = st.levels[level - 1];
  }
  for (int level = 2; level <= kMaxDraftLen; ++level) upto[level] = std::max(upto[level], upto[level - 1]);
  for (int d = std::max(1, st.min_depth); d <= s.max_depth; ++d) {
    s.knot_begin[d - 1] = 0;
    s.num_knots[d - 1] = static_cast<uint8_t>(upto[d]);
  }
}

double Planner::FillUniform(const LocalState& st, const GlobalDecision& d, int depth_cap,
                            absl::Span<int32_t> verify_len) const {
  // The deepest level that fits under the barrier, the KV budget and the padded tier, and whose
  // extra tokens over the level below it taken pay for their FFN time at the planned goodput
  // (the items' rule). Level 0 is the base (every request at its floor). Levels are priced
  // exactly, and a kernel grid's launch is not monotone in the tokens (waves, tiles), so a level
  // above one that does not fit may still fit: every level is tried. It is at least the knot
  // Decide placed this rank on, whose price is the running maximum.
  const GlobalCost& g = config_.global;
  const double min_gain = MinItemGain(d.tokens_per_us);
  const double barrier = FillBarrierUs(d);
  const int64_t kv_cap = KvCap(st.kv_free_tokens);
  const double base_tokens = st.base_agg.query_tokens;
  int best = 0;
  for (int level = 1; level <= depth_cap; ++level) {
    const LocalState::Level &l = st.levels[level], &b = st.levels[best];
    if (l.added == b.added || l.us > barrier || l.added > kv_cap ||
        (g.padded_tokens && base_tokens + static_cast<double>(l.added) > d.padded_rank_tokens) ||
        l.gain - b.gain < min_gain * static_cast<double>(l.added - b.added)) {
      continue;
    }
    best = level;
  }
  UniformLens(st, best, verify_len);
  return st.levels[best].gain;
}

// Assign's fill of one rank: greedy in gain-per-microsecond order, skipping items that do not
// fit: attention (plus, with per-rank draft depths, this rank's own draft time) must stay under
// the agreed barrier, tokens under the padded tier (padded mode) or each item must pay for its
// FFN time at the planned goodput, and extra tokens within the KV budget.
class Planner::Filler {
 public:
  Filler(const Planner& planner, const LocalState& st, const GlobalDecision& d, int depth_cap,
         absl::Span<int32_t> verify_len)
      : planner_(planner),
        st_(st),
        decision_(d),
        depth_cap_(depth_cap),
        verify_len_(verify_len),
        rank_draft_us_(planner.RankDraftUs()),
        min_gain_(planner.MinItemGain(d.tokens_per_us)),
        barrier_us_(FillBarrierUs(d)),
        kv_cap_(KvCap(st.kv_free_tokens)),
        deepest_(st.min_depth) {
    for (size_t i = 0; i < st.batch.size(); ++i) verify_len_[i] = st.base_len[i];
  }

  // One greedy pass over the items from `agg` (the aggregates of the current plan); appends what
  // it takes to `added_`. An item is taken while the plan stays under the barrier, or when it
  // lowers the plan's cost: with token tiers a verify token may cost less than the padding token
  // it replaces (a dummy request on a grid, a per-request term), and then the rank's base with
  // the tier padded can sit above a barrier its filled tier is under (Decide's chain).
  void Greedy(BatchAggregates agg) {
    const CostModel& model = planner_.model_;
    const bool padded = planner_.config_.global.padded_tokens;
    double current = model.AttentionUs(agg) + PadRestUs(agg.query_tokens) + rank_draft_us_ * deepest_;
    for (uint32_t idx = 0; idx < st_.items.size(); ++idx) {
      const Item& it = st_.items[idx];
      const int32_t i = it.req_idx(), pos = it.pos();
      if (pos > depth_cap_ || verify_len_[i] != pos - 1) continue;
      if (st_.batch[i].acceptance.Accept(pos) < min_gain_ || extra_tokens_ >= kv_cap_) continue;
      if (padded && agg.query_tokens + 1 > decision_.padded_rank_tokens) continue;
      const BatchAggregates::TokenMark mark = agg.Mark();
      agg.AddQueryToken(RequestLoad{st_.batch[i].ctx_tokens, pos});
      const int next_deepest = std::max(deepest_, static_cast<int>(pos));
      const double cost =
          model.AttentionUs(agg) + PadRestUs(agg.query_tokens) + rank_draft_us_ * next_deepest;
      if (cost > std::max(barrier_us_, current)) {
        agg.Restore(mark);
        continue;
      }
      current = cost;
      deepest_ = next_deepest;
      verify_len_[i] = pos;
      ++extra_tokens_;
      added_.push_back(idx);
    }
  }
  bool took_any() const { return !added_.empty(); }

  // With a kernel grid the greedy moved the simulated terms linearly from the base, and a real
  // launch is not linear: waves and tails jump. The barrier is a max over ranks, so every rank
  // whose plan the line underestimates would set a higher one. Checks the plan with a
  // simulation; if it is over the barrier, keeps the longest prefix of what was added that fits
  // (bisection); if it fits, fills on from a simulation at the plan, where the line is close.
  // A few simulations per step (kMaxFillRounds + about log2 of the items added). Where even the
  // committed plan is over the barrier (padding dearer than verify: Greedy took items that lower
  // the cost), the cheaper of it and the whole plan stays.
  void KeepUnderSimulatedLaunch() {
    constexpr int kMaxFillRounds = 3;
    committed_.assign(st_.base_len.begin(), st_.base_len.end());
    loads_.resize(st_.batch.size());
    for (int round = 1;; ++round) {
      const double whole_us = Simulate(verify_len_);
      if (whole_us > barrier_us_) {
        size_t lo = 0, hi = added_.size();  // the committed plan fits, if any prefix does
        while (hi - lo > 1) {
          const size_t mid = lo + (hi - lo) / 2;
          ApplyPrefix(mid);
          (Simulate(verify_len_) <= barrier_us_ ? lo : hi) = mid;
        }
        ApplyPrefix(lo);
        if (lo == 0 && Simulate(verify_len_) > std::max(barrier_us_, whole_us)) {
          ApplyPrefix(added_.size());
        }
        return;
      }
      if (round == kMaxFillRounds) return;
      std::copy(verify_len_.begin(), verify_len_.end(), committed_.begin());
      added_.clear();
      Greedy(exact_);  // `exact_` holds the simulated plan: the line starts from here
      if (added_.empty()) return;
    }
  }

  // Expected tokens of the plan in verify_len.
  double PlanGain() const {
    double gain = 0;
    for (size_t i = 0; i < st_.batch.size(); ++i) {
      gain += st_.batch[i].acceptance.ExpectedTokens(verify_len_[i]);
    }
    return gain;
  }

 private:
  // The plan `lens` priced by simulating its launch (every plan here adds verify tokens, so it
  // runs the verify launch); `exact_` keeps its aggregates.
  double Simulate(absl::Span<const int32_t> lens) {
    int deepest = st_.min_depth;
    for (size_t i = 0; i < st_.batch.size(); ++i) {
      loads_[i] = RequestLoad{st_.batch[i].ctx_tokens, 1 + lens[i]};
      deepest = std::max(deepest, static_cast<int>(lens[i]));
    }
    exact_ = planner_.model_.Aggregate(loads_);
    return planner_.model_.AttentionUs(exact_) + PadRestUs(exact_.query_tokens) +
           rank_draft_us_ * deepest;
  }
  // Token tiers: the padding that fills the agreed tier beyond `query_tokens`, at the rank's
  // pad_us a token (0 without tiers).
  double PadRestUs(double query_tokens) const {
    return st_.pad_us * std::max(0.0, decision_.padded_rank_tokens - query_tokens);
  }
  // The committed plan plus the first m items added.
  void ApplyPrefix(size_t m) {
    std::copy(committed_.begin(), committed_.end(), verify_len_.begin());
    for (size_t a = 0; a < m; ++a) {
      const Item& it = st_.items[added_[a]];
      verify_len_[it.req_idx()] = it.pos();
    }
  }

  const Planner& planner_;
  const LocalState& st_;
  const GlobalDecision& decision_;
  const int depth_cap_;
  absl::Span<int32_t> verify_len_;
  const double rank_draft_us_, min_gain_, barrier_us_;
  const int64_t kv_cap_;
  int deepest_;
  int64_t extra_tokens_ = 0;
  std::vector<uint32_t> added_;  // indices into st_.items, in the order taken
  std::vector<int32_t> committed_;
  std::vector<RequestLoad> loads_;
  BatchAggregates exact_;  // the last plan simulated
};

double Planner::FillUnder(const LocalState& st, const GlobalDecision& d, int depth_cap,
                          absl::Span<int32_t> verify_len) const {
  if (config_.uniform_per_rank) return FillUniform(st, d, depth_cap, verify_len);
  Filler fill(*this, st, d, depth_cap, verify_len);
  fill.Greedy(st.base_agg);
  if (model_.uses_grid() && fill.took_any() &&
      model_.kernel_grid().VerifyTermsDependOnQueryTokens(1 + depth_cap)) {
    fill.KeepUnderSimulatedLaunch();
  }
  return fill.PlanGain();
}


// SGLang's DSpark, dpbalance/dspark.h: the budget is the first argmax of expected tokens times
// steps per second over the rank's survivals (1 at every position of a request without lagged
// ones), priced by the SPS table at n + b tokens, or with dspark_context_sps by this planner's
// model of the rank's own step (its attention with the candidates added, the FFN as if every rank
// ran n + b tokens, the draft at its full depth: no marginal draft cost, as DSpark sees it). The
// summary carries the local tier min(n + b, n x W) as its base tokens.
void Planner::SummarizeDspark(LocalState& st, RankSummary& s) const {
  const PlannerConfig& c = config_;
  const int window = c.k_max + 1;
  const int64_t n = static_cast<int64_t>(st.batch.size());
  std::vector<int32_t> caps(st.batch.size());
  for (size_t i = 0; i < st.batch.size(); ++i) caps[i] = st.batch[i].k_cap;
  std::vector<dspark::Candidate> candidates;
  dspark::OrderCandidates(caps, [&](int32_t i, int32_t j) {
    const PlanRequest& p = st.batch[i];
    if (p.no_lagged_survival) return 1.0;
    return (p.lagged_acceptance ? *p.lagged_acceptance : p.acceptance).Accept(j);
  }, candidates);
  const size_t rank = s.rank_idx;
  if (rank < rank_sps_.size() && rank_sps_[rank]) {
    st.dspark_budget = dspark::SpsBudget(n, candidates, *rank_sps_[rank]);
  } else if (sps_) {
    st.dspark_budget = dspark::SpsBudget(n, candidates, *sps_);
  } else if (c.dspark_additive) {
    st.dspark_budget = dspark::AdditiveBudget(n, candidates, *c.dspark_additive);
  } else {
    std::vector<RequestLoad> loads;
    for (const PlanRequest& p : st.batch) loads.push_back({p.ctx_tokens, 1});
    BatchAggregates agg = model_.Aggregate(loads);
    const double own_draft = c.agreed_draft_depth ? 0.0 : c.global.draft_per_step_us * c.k_max;
    const double fixed_us = c.global.StepUs(0, c.agreed_draft_depth ? c.k_max : 0) + own_draft;
    st.dspark_budget = dspark::VerifyTokenBudget(n, candidates, [&](int64_t b, const dspark::Candidate* added) {
      if (added != nullptr) agg.AddQueryToken(RequestLoad{st.batch[added->req].ctx_tokens, added->pos});
      const double ffn = c.global.ffn_per_token_us * static_cast<double>(c.num_ranks) * static_cast<double>(n + b);
      return 1e6 / (model_.AttentionUs(agg) + ffn + fixed_us);
    });
  }
  s.base_tokens = static_cast<uint32_t>(dspark::LocalTier(n, st.dspark_budget, window));
}

// _maybe_gather_dp_verify_tier: the ranks agree on the largest local tier (a rank in fallback
// counts with its default lengths' tokens), capped at the largest batch x W and rounded up to
// the captured tiers; every rank runs it (its spare tokens are padding, or with tier fill real
// drafts). The draft proposes its whole block: depth k_max.
absl::StatusOr<GlobalDecision> Planner::DecideDspark(absl::Span<const RankSummary> summaries) const {
  const PlannerConfig& c = config_;
  int64_t max_local = 0, max_requests = 0;
  int usable = 0;
  for (size_t r = 0; r < summaries.size(); ++r) {
    const RankSummary& s = summaries[r];
    if (absl::Status st = CheckSummary(s, r, config_hash_); !st.ok()) return st;
    const bool ok = SummaryUsable(s, r);
    usable += ok ? 1 : 0;
    max_local = std::max<int64_t>(max_local, ok ? int64_t{s.base_tokens} : int64_t{s.default_tokens});
    max_requests = std::max<int64_t>(max_requests, s.num_requests);
  }
  if (usable == 0) return absl::UnavailableError("planner: no rank sent a usable summary this step");
  GlobalDecision d;
  d.draft_depth = c.k_max;
  d.padded_rank_tokens = static_cast<int32_t>(
      c.token_tiers.empty() ? max_local : dspark::AgreedTier(c.token_tiers, max_local, max_requests, c.k_max + 1));
  d.num_planned_ranks = usable;
  return d;
}

// ScheduleVerifyLensTopk over the current survivals: the rank's own budget, or with tier fill
// graph_tier_fill_budget of the agreed tier.
void Planner::AssignDspark(const LocalState& st, const GlobalDecision& d, absl::Span<int32_t> verify_len) const {
  const int window = config_.k_max + 1;
  const int64_t n = static_cast<int64_t>(st.batch.size());
  std::vector<int32_t> caps(st.batch.size());
  for (size_t i = 0; i < st.batch.size(); ++i) caps[i] = st.batch[i].k_cap;
  std::vector<dspark::Candidate> candidates;
  dspark::OrderCandidates(caps, [&](int32_t i, int32_t j) { return st.batch[i].acceptance.Accept(j); },
                          candidates);
  const int64_t budget = config_.mode == PlanMode::kDsparkFill
                             ? dspark::FillBudget(d.padded_rank_tokens, n, window)
                             : st.dspark_budget;
  dspark::AssignTopK(candidates, budget, verify_len);
}

absl::StatusOr<GlobalDecision> Planner::PlanAll(absl::Span<const std::vector<PlanRequest>> batches,
                                                absl::Span<const int64_t> kv_free_tokens,
                                                std::vector<std::vector<int32_t>>* verify_len) {
  const size_t num = batches.size();
  if (num != static_cast<size_t>(config_.num_ranks) || kv_free_tokens.size() != num) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: PlanAll got %d batches and %d KV budgets for %d ranks", num,
        kv_free_tokens.size(), config_.num_ranks));
  }
  all_local_.resize(num);
  all_summaries_.resize(num);
  verify_len->resize(num);
  for (size_t r = 0; r < num; ++r) {
    if (absl::Status s = SummarizeInto(all_local_[r], static_cast<int>(r), batches[r],
                                       kv_free_tokens[r], &all_summaries_[r]);
        !s.ok()) {
      return s;
    }
    (*verify_len)[r].resize(batches[r].size());
  }
  GlobalDecision result;
  if (config_.mode == PlanMode::kLocal) {
    // Each rank decides alone; the instance drafts as deep as the deepest rank asks.
    double tokens_per_us = 0;
    for (size_t r = 0; r < num; ++r) {
      absl::StatusOr<GlobalDecision> d = Decide(absl::MakeConstSpan(&all_summaries_[r], 1));
      if (!d.ok()) return d.status();
      if (absl::Status s = AssignFrom(all_local_[r], *d, absl::MakeSpan((*verify_len)[r])); !s.ok()) {
        return s;
      }
      result.draft_depth = std::max(r == 0 ? 0 : result.draft_depth, d->draft_depth);
      tokens_per_us += d->tokens_per_us / num;
    }
    result.tokens_per_us = tokens_per_us;
  } else {
    absl::StatusOr<GlobalDecision> d = Decide(all_summaries_);
    if (!d.ok()) return d.status();
    result = *d;
    for (size_t r = 0; r < num; ++r) {
      if (absl::Status s = AssignFrom(all_local_[r], result, absl::MakeSpan((*verify_len)[r]));
          !s.ok()) {
        return s;
      }
    }
  }
  last_tokens_per_us_ = result.tokens_per_us;
  focus_depth_ = config_.agreed_draft_depth ? result.draft_depth : config_.default_k;
  return result;
}

}  // namespace dpbalance
