#include "dpbalance/planner.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "hash.h"

namespace dpbalance {
namespace {

constexpr double kTinyUs = 1e-3;  // floor on a marginal cost, so ratios stay finite

// Relative slack when testing "fits under the barrier": the barrier itself came from the same
// model through float storage in the summary record.
constexpr double kBarrierSlack = 1e-6;

// Marginal cost (us) of one more query token for a request, at the base batch in the
// multi-query regime. Used only to order items; knot costs are evaluated exactly.
double MarginalUs(const CostModel& m, const BatchAggregates& base, int64_t ctx, int32_t q) {
  return std::max(m.MarginalUs(base, ctx, q), kTinyUs);
}

int32_t TierFor(absl::Span<const int32_t> tiers, int64_t tokens) {
  for (int32_t t : tiers) {
    if (t >= tokens) return t;
  }
  return static_cast<int32_t>(tokens);  // beyond the largest tier: no padding
}

uint32_t FloatKey(float v) { return std::bit_cast<uint32_t>(v); }  // monotone for v >= 0

// Stable LSD radix sort of events by their upper 32 bits (the cost key). Ties keep insertion
// order, which is deterministic; the sweep applies equal costs together anyway.
void SortByCost(std::vector<uint64_t>& v, std::vector<uint64_t>& tmp) {
  if (v.size() < 512) {  // below this, four 256-bucket passes cost more than a comparison sort
    std::sort(v.begin(), v.end());  // keys are unique (rank, knot in the low bits)
    return;
  }
  tmp.resize(v.size());
  for (int shift = 32; shift < 64; shift += 8) {
    std::array<uint32_t, 257> count{};
    for (uint64_t e : v) ++count[((e >> shift) & 0xff) + 1];
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (uint64_t e : v) tmp[count[(e >> shift) & 0xff]++] = e;
    v.swap(tmp);
  }
}

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
bool SummaryUsable(const RankSummary& s, size_t idx) {
  if (!(s.flags & kSummaryValid) || s.rank_idx != idx) return false;
  if (!(std::isfinite(s.base_attention_us) && s.base_attention_us >= 0)) return false;
  if (!(std::isfinite(s.base_gain) && s.base_gain >= 0)) return false;
  if (!(std::isfinite(s.default_attention_us) && s.default_attention_us >= 0)) return false;
  if (s.min_depth > kMaxDraftLen || s.max_depth > kMaxDraftLen || s.min_depth > s.max_depth) {
    return false;
  }
  for (int d = 0; d < kMaxDraftLen; ++d) {
    if (s.knot_begin[d] + s.num_knots[d] > kKnotPool) return false;
    float prev_cost = s.base_attention_us, prev_gain = s.base_gain;
    for (int k = s.knot_begin[d]; k < s.knot_begin[d] + s.num_knots[d]; ++k) {
      const float c = s.knot_attention_us[k], g = s.knot_gain[k];
      if (!(std::isfinite(c) && std::isfinite(g) && c >= prev_cost && g >= prev_gain)) return false;
      prev_cost = c;
      prev_gain = g;
    }
  }
  return true;
}

// The best plan found so far. Within the TPOT guard the best goodput wins; if nothing fits the
// guard, the shortest step.
struct Incumbent {
  double max_step_us;
  GlobalDecision best;
  double best_j = -1;
  bool within_guard = false;

  void Consider(int depth, double barrier, double gain, double step_us, double ffn_tokens,
                int32_t padded_rank_tokens) {
    const double j = gain / step_us;
    const bool within = step_us <= max_step_us;
    const bool better = within ? (!within_guard || j > best_j)
                               : (!within_guard && (best_j < 0 || step_us < best.step_us));
    if (!better) return;
    within_guard = within;
    best_j = j;
    best.draft_depth = depth;
    best.barrier_us = barrier;
    best.step_us = step_us;
    best.expected_tokens = gain;
    best.tokens_per_us = j;
    best.ffn_tokens = std::llround(ffn_tokens);
    best.padded_rank_tokens = padded_rank_tokens;
  }
};

}  // namespace

std::string_view PlanModeName(PlanMode m) {
  switch (m) {
    case PlanMode::kOff: return "off";
    case PlanMode::kGoodput: return "goodput";
    case PlanMode::kFill: return "fill";
    case PlanMode::kLocal: return "local";
  }
  return "?";
}

absl::StatusOr<PlanMode> ParsePlanMode(std::string_view name) {
  for (PlanMode m : {PlanMode::kOff, PlanMode::kGoodput, PlanMode::kFill, PlanMode::kLocal}) {
    if (name == PlanModeName(m)) return m;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown verify mode '", std::string(name), "' (expected off, goodput, fill or local)"));
}

absl::Status PlannerConfig::Validate() const {
  if (std::isnan(max_step_slack)) {
    return absl::InvalidArgumentError("planner: max_step_slack is NaN");
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
  h.Value(agreed_draft_depth);
  h.Value(kSummaryVersion);
  return h.digest();
}

Planner::Planner(PlannerConfig config, CostModel model)
    : config_(std::move(config)), model_(std::move(model)), config_hash_(config_.Hash()) {}

absl::StatusOr<Planner> Planner::Create(PlannerConfig config, CostModel model) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  return Planner(std::move(config), std::move(model));
}

int32_t Planner::Floor(const PlanRequest& r) const {
  if (config_.mode == PlanMode::kFill) return std::max(r.k_min, DefaultVerifyLen(config_.default_k, r.k_cap));
  return r.k_min;
}

absl::Status Planner::ValidateBatch(absl::Span<const PlanRequest> batch) const {
  if (batch.size() > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("planner: batch of %d requests exceeds 65535", batch.size()));
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    const PlanRequest& r = batch[i];
    if (r.ctx_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("planner: request %d: ctx_tokens = %d is negative", i, r.ctx_tokens));
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

  // Step 1: base assignment (every request at its floor).
  st.batch.assign(batch.begin(), batch.end());
  st.kv_free_tokens = kv_free_tokens;
  st.base_len.resize(batch.size());
  st.base_agg = BatchAggregates{};
  double base_gain = 0;
  int min_depth = 0, max_depth = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const int32_t k = Floor(batch[i]);
    st.base_len[i] = k;
    st.base_agg.Add(RequestLoad{batch[i].ctx_tokens, 1 + k});
    base_gain += batch[i].acceptance.ExpectedTokens(k);
    min_depth = std::max(min_depth, k);
    max_depth = std::max(max_depth, static_cast<int>(batch[i].k_cap));
  }
  // A dense draft run to this rank's own depth is part of its time before the barrier.
  const double rank_draft_us = config_.agreed_draft_depth ? 0.0 : config_.global.draft_per_step_us;
  st.min_depth = min_depth;
  st.base_attention_us = model_.AttentionUs(st.base_agg) + rank_draft_us * min_depth;
  BatchAggregates default_agg;
  double default_gain = 0;
  int default_depth = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const int32_t k = DefaultVerifyLen(config_.default_k, batch[i].k_cap);
    default_agg.Add(RequestLoad{batch[i].ctx_tokens, 1 + k});
    default_gain += batch[i].acceptance.ExpectedTokens(k);
    default_depth = std::max(default_depth, static_cast<int>(k));
  }

  // Step 2: extra-token items ordered by expected tokens per marginal microsecond. An item whose
  // gain cannot pay for its FFN cost at last step's goodput never helps, so it is dropped.
  const double min_gain = config_.global.padded_tokens
                              ? 0.0
                              : last_tokens_per_us_ * config_.global.ffn_per_token_us;
  st.items.clear();
  for (size_t i = 0; i < batch.size(); ++i) {
    const double marginal = MarginalUs(model_, st.base_agg, batch[i].ctx_tokens, 1 + st.base_len[i]);
    for (int j = st.base_len[i] + 1; j <= batch[i].k_cap; ++j) {
      const double gain = batch[i].acceptance.Accept(j);
      if (gain <= min_gain) break;  // gains fall with j
      const uint32_t ratio_bits = FloatKey(static_cast<float>(gain / marginal));
      st.items.push_back(Item{(uint64_t{~ratio_bits} << 32) | (uint64_t{static_cast<uint32_t>(i)} << 8) |
                                  static_cast<uint64_t>(j),
                              static_cast<float>(gain)});
    }
  }
  std::sort(st.items.begin(), st.items.end(),
            [](const Item& a, const Item& b) { return a.key < b.key; });

  // Step 3: per draft depth, knots spread evenly along the frontier, costs evaluated exactly.
  RankSummary& s = *out;
  std::memset(&s, 0, sizeof(s));
  s.magic = kSummaryMagic;
  s.version = kSummaryVersion;
  s.flags = kSummaryValid;
  s.config_hash = config_hash_;
  s.rank_idx = static_cast<uint32_t>(rank_idx);
  s.prev_attention_us = s.prev_step_us = s.prev_accepted_tokens = -1.f;
  s.base_attention_us = static_cast<float>(st.base_attention_us);
  s.base_gain = static_cast<float>(base_gain);
  s.base_tokens = static_cast<uint32_t>(st.base_agg.query_tokens);
  s.num_requests = static_cast<uint16_t>(batch.size());
  s.default_attention_us =
      static_cast<float>(model_.AttentionUs(default_agg) + rank_draft_us * default_depth);
  s.default_gain = static_cast<float>(default_gain);
  s.default_tokens = static_cast<uint32_t>(default_agg.query_tokens);
  s.min_depth = static_cast<uint8_t>(min_depth);
  s.max_depth = static_cast<uint8_t>(std::max(min_depth, max_depth));
  const int64_t kv_cap = kv_free_tokens < 0 ? std::numeric_limits<int64_t>::max() : kv_free_tokens;
  // Items available at each depth (capped by the KV budget).
  std::array<int64_t, kMaxDraftLen + 1> avail{};
  for (const Item& it : st.items) ++avail[it.pos()];
  int64_t running = 0;
  for (int d = 1; d <= kMaxDraftLen; ++d) {
    running += avail[d];
    avail[d] = std::min<int64_t>({running, kv_cap, 65535});
  }
  // Water-fill the knot pool: a depth with few items gets one knot per item.
  std::array<int, kMaxDraftLen + 1> share{};
  int depths_left = 0;
  for (int d = std::max(1, min_depth); d <= s.max_depth; ++d) depths_left += avail[d] > 0;
  int pool = kKnotPool;
  for (bool changed = true; changed && depths_left > 0;) {
    changed = false;
    for (int d = std::max(1, min_depth); d <= s.max_depth; ++d) {
      if (avail[d] == 0 || share[d] > 0) continue;
      if (avail[d] <= pool / depths_left) {
        share[d] = static_cast<int>(avail[d]);
        pool -= share[d];
        --depths_left;
        changed = true;
      }
    }
  }
  for (int d = std::max(1, min_depth); d <= s.max_depth && depths_left > 0; ++d) {
    if (avail[d] > 0 && share[d] == 0) {
      share[d] = pool / depths_left;
      pool -= share[d];
      --depths_left;
    }
  }
  int next_knot = 0;
  for (int d = std::max(1, min_depth); d <= s.max_depth; ++d) {
    const int64_t n = avail[d];
    const int knots = share[d];
    s.knot_begin[d - 1] = static_cast<uint8_t>(next_knot);
    if (n == 0 || knots == 0) continue;
    BatchAggregates agg = st.base_agg;
    double gain = base_gain;
    int64_t taken = 0;
    int knot = 0;
    // A fitted model may price the multi-query kernel path below the single-query one; more
    // verify work is never really faster, so knot costs follow the running maximum.
    double cost = st.base_attention_us;
    int deepest = min_depth;
    for (const Item& it : st.items) {
      if (it.pos() > d) continue;
      agg.AddQueryToken(RequestLoad{batch[it.req_idx()].ctx_tokens, it.pos()});
      gain += it.gain;
      deepest = std::max(deepest, it.pos());
      ++taken;
      const int64_t at = (n * (knot + 1) + knots - 1) / knots;  // ceil(n * (knot+1) / knots)
      if (taken == at) {
        cost = std::max(cost, model_.AttentionUs(agg) + rank_draft_us * deepest);
        s.knot_attention_us[next_knot + knot] = static_cast<float>(cost);
        s.knot_gain[next_knot + knot] = static_cast<float>(gain);
        s.knot_tokens[next_knot + knot] = static_cast<uint16_t>(taken);
        if (++knot == knots) break;
      }
    }
    s.num_knots[d - 1] = static_cast<uint8_t>(knot);
    next_knot += knot;
  }
  return absl::OkStatus();
}

absl::StatusOr<GlobalDecision> Planner::Decide(absl::Span<const RankSummary> summaries) const {
  const PlannerConfig& c = config_;
  const bool local = c.mode == PlanMode::kLocal;
  if (summaries.empty()) return absl::InvalidArgumentError("planner: no summaries to decide on");
  if (!local && summaries.size() != static_cast<size_t>(c.num_ranks)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: %d summaries for %d ranks", summaries.size(), c.num_ranks));
  }
  GlobalDecision best;
  best.draft_depth = c.default_k;
  if (c.mode == PlanMode::kOff) return best;

  // Step 1: which ranks take part; the floor barrier and the feasible depths.
  valid_.clear();
  int depth_lo = 0;
  double floor_us = 0, base_gain = 0, base_tokens = 0, max_base_tokens = 0;
  double default_barrier = 0, default_tokens = 0, max_default_tokens = 0;
  for (size_t r = 0; r < summaries.size(); ++r) {
    const RankSummary& s = summaries[r];
    const size_t idx = local ? s.rank_idx : r;
    if (absl::Status st = CheckSummary(s, idx, config_hash_); !st.ok()) return st;
    if (!SummaryUsable(s, idx)) continue;
    valid_.push_back(static_cast<uint32_t>(r));
    default_barrier = std::max<double>(default_barrier, s.default_attention_us);
    default_tokens += s.default_tokens;
    max_default_tokens = std::max<double>(max_default_tokens, s.default_tokens);
    depth_lo = std::max<int>(depth_lo, s.min_depth);
    floor_us = std::max<double>(floor_us, s.base_attention_us);
    base_gain += s.base_gain;
    base_tokens += s.base_tokens;
    max_base_tokens = std::max<double>(max_base_tokens, s.base_tokens);
  }
  const int num_valid = static_cast<int>(valid_.size());
  if (num_valid == 0) {
    return absl::UnavailableError("planner: no rank sent a usable summary this step");
  }
  const GlobalCost& g = c.global;
  // FFN tokens: padded mode charges every rank at the tier of the largest; otherwise the sum,
  // scaled up for ranks that sent no usable summary (or, in local mode, for all other ranks).
  const double ffn_scale = static_cast<double>(c.num_ranks) / num_valid;
  auto ffn_tokens = [&](double sum_tokens, double max_tokens) -> double {
    if (g.padded_tokens) return c.num_ranks * static_cast<double>(TierFor(c.token_tiers,
                                                                         std::llround(max_tokens)));
    return sum_tokens * ffn_scale;
  };
  auto depth_knots = [&](const RankSummary& s, int d, int* first) {
    const int slot = std::min<int>(d, s.max_depth);
    *first = slot > 0 ? s.knot_begin[slot - 1] : 0;
    return slot > 0 ? static_cast<int>(s.num_knots[slot - 1]) : 0;
  };

  // With per-rank draft depths the draft time is already inside each rank's costs.
  const int global_draft_depth = c.agreed_draft_depth ? c.default_k : 0;
  const double default_step =
      default_barrier + g.StepUs(ffn_tokens(default_tokens, max_default_tokens), global_draft_depth);
  const double max_step =
      c.max_step_slack < 0 ? std::numeric_limits<double>::infinity()
                           : default_step * (1 + c.max_step_slack);
  best.default_step_us = default_step;
  Incumbent inc{max_step, best};
  // Aliases keep the sweep below readable.
  double& best_j = inc.best_j;
  bool& best_within_guard = inc.within_guard;
  // `d` is the decision's depth; the step pays for it globally only when the depth is agreed.
  auto consider = [&](int d, double barrier, double gain, double sum_tok, double max_tok) {
    const double ffn = ffn_tokens(sum_tok, max_tok);
    inc.Consider(d, barrier, gain, barrier + g.StepUs(ffn, c.agreed_draft_depth ? d : 0), ffn,
                 g.padded_tokens ? TierFor(c.token_tiers, std::llround(max_tok)) : 0);
  };

  if (!c.agreed_draft_depth) {
    // Per-rank draft depths: every knot of every depth is a candidate for its rank, whose cost
    // already holds its own draft time. At barrier T each rank takes its best-gain knot with
    // cost <= T (not a prefix across depths, so gains are steps, without chords).
    events_.clear();
    seg_.assign(summaries.size(), Segment{});
    for (uint32_t r : valid_) {
      const RankSummary& s = summaries[r];
      seg_[r].a_gain = s.base_gain;  // the rank's current gain; a_tok: its current extra tokens
      for (int d = 0; d < kMaxDraftLen; ++d) {
        for (int k = s.knot_begin[d]; k < s.knot_begin[d] + s.num_knots[d]; ++k) {
          events_.push_back((uint64_t{FloatKey(s.knot_attention_us[k])} << 32) | (uint64_t{r} << 8) |
                            static_cast<uint64_t>(k));
        }
      }
    }
    SortByCost(events_, sort_tmp_);
    double gain = base_gain, sum_tok = base_tokens, max_tok = max_base_tokens;
    auto apply = [&](uint64_t ev) {
      const uint32_t r = static_cast<uint32_t>((ev >> 8) & 0xffffffu);
      const int k = static_cast<int>(ev & 0xff);
      const RankSummary& s = summaries[r];
      if (s.knot_gain[k] <= seg_[r].a_gain) return;
      gain += s.knot_gain[k] - seg_[r].a_gain;
      sum_tok += s.knot_tokens[k] - seg_[r].a_tok;
      seg_[r].a_gain = s.knot_gain[k];
      seg_[r].a_tok = s.knot_tokens[k];
      max_tok = std::max<double>(max_tok, s.base_tokens + s.knot_tokens[k]);
    };
    size_t e = 0;
    for (; e < events_.size() && std::bit_cast<float>(static_cast<uint32_t>(events_[e] >> 32)) <= floor_us; ++e) {
      apply(events_[e]);
    }
    consider(c.k_max, floor_us, gain, sum_tok, max_tok);
    while (e < events_.size()) {
      const uint32_t key = static_cast<uint32_t>(events_[e] >> 32);
      for (; e < events_.size() && static_cast<uint32_t>(events_[e] >> 32) == key; ++e) apply(events_[e]);
      consider(c.k_max, std::bit_cast<float>(key), gain, sum_tok, max_tok);
    }
    best = inc.best;
    best.draft_depth = c.k_max;  // a cap: each rank drafts to its deepest assigned length
    best.num_planned_ranks = num_valid;
    return best;
  }

  // Upper bound on goodput for any barrier >= `barrier` when the gain can still grow from `gain`
  // to `ub_gain`: every extra token adds at most one expected token (P_j <= 1), so x more gain
  // costs at least x more FFN tokens. (a + x) / (b + slope x) is monotone in x, so the bound is
  // at one end of [0, ub_gain - gain].
  const double ffn_slope = g.padded_tokens ? 0.0 : g.ffn_per_token_us * ffn_scale;
  auto bound = [&](double gain, double ub_gain, double barrier, double ffn, int d) {
    const double b = barrier + g.StepUs(ffn, d);
    return std::max(gain / b, ub_gain / (b + ffn_slope * (ub_gain - gain)));
  };

  // Step 2: the feasible depths. Pass 0 below visits them all; pass 1 orders them by bound.
  const int depth_hi = std::max(depth_lo, c.k_max);
  std::array<std::pair<double, int>, kMaxDraftLen + 1> order{};
  int num_depths = 0;
  for (int d = depth_lo; d <= depth_hi; ++d) order[num_depths++] = {0.0, d};

  // Step 3: for each depth, sweep the barrier T upwards over the knot costs. Every rank sits on
  // the segment of its frontier that contains T: between knots that are single items its gain is
  // a step (exact: items are indivisible); between knots that skip items it is the chord (the
  // frontier is concave, so the chord is a conservative estimate that Assign's fill achieves).
  // Totals are linear in T between events, so goodput (linear-fractional) peaks at an event.
  seg_.assign(summaries.size(), Segment{});
  auto knot = [](const RankSummary& s, int first, int k, double* c, double* gn, double* t) {
    if (k < 0) {
      *c = s.base_attention_us;
      *gn = s.base_gain;
      *t = 0;
    } else {
      *c = s.knot_attention_us[first + k];
      *gn = s.knot_gain[first + k];
      *t = s.knot_tokens[first + k];
    }
  };
  auto segment = [&](const RankSummary& s, int first, int n, int k) {
    double c0, g0, t0;
    knot(s, first, k, &c0, &g0, &t0);
    Segment sg{g0, 0, t0, 0};
    if (k + 1 < n) {
      double c1, g1, t1;
      knot(s, first, k + 1, &c1, &g1, &t1);
      if (t1 - t0 > 1 && c1 > c0) {
        sg.s_gain = (g1 - g0) / (c1 - c0);
        sg.s_tok = (t1 - t0) / (c1 - c0);
        sg.a_gain = g0 - sg.s_gain * c0;
        sg.a_tok = t0 - sg.s_tok * c0;
      }
    }
    return sg;
  };
  constexpr uint32_t kProbe = 0xffffffu;  // an event that only evaluates a barrier

  // Pass 0 (cheap, every depth): the goodput at the floor barrier, and a bound for every barrier
  // above it, evaluated at the lowest knot cost above the floor (the barrier's first possible
  // jump). Pass 1 sweeps only the depths whose bound beats the best found, best bound first.
  std::array<std::pair<double, int>, kMaxDraftLen + 1> refined{};
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      order = refined;
      std::sort(order.begin(), order.begin() + num_depths);
    }
    for (int oi = 0; oi < num_depths; ++oi) {
      const int d = order[oi].second;
      if (pass == 1 && best_within_guard && -order[oi].first <= best_j) break;
      double a_gain = 0, s_gain = 0, a_tok = 0, s_tok = 0, max_tok = max_base_tokens, ub_gain = 0;
      float first_jump = std::numeric_limits<float>::infinity();
      events_.clear();
      for (uint32_t r : valid_) {
        const RankSummary& s = summaries[r];
        int first;
        const int n = depth_knots(s, d, &first);
        int k = 0;
        for (; k < n && s.knot_attention_us[first + k] <= floor_us; ++k) {}
        // The rank sits on the segment starting at knot k-1 (k-1 = -1: its base).
        const Segment sg = segment(s, first, n, k - 1);
        seg_[r] = sg;
        a_gain += sg.a_gain;
        s_gain += sg.s_gain;
        a_tok += sg.a_tok;
        s_tok += sg.s_tok;
        if (k > 0) max_tok = std::max<double>(max_tok, s.base_tokens + s.knot_tokens[first + k - 1]);
        ub_gain += (n > 0 ? s.knot_gain[first + n - 1] : s.base_gain) - s.base_gain;
        if (c.mode == PlanMode::kFill || k == n) continue;  // fill: the barrier stays at the floor
        first_jump = std::min(first_jump, s.knot_attention_us[first + k]);
        if (pass == 1) {
          for (int kk = k; kk < n; ++kk) {
            events_.push_back((uint64_t{FloatKey(s.knot_attention_us[first + kk])} << 32) |
                              (uint64_t{r} << 8) | static_cast<uint64_t>(kk));
          }
        }
      }
      ub_gain += base_gain;
      // Knot gains are totals (base included); knot tokens are extra over the base.
      auto gain_at = [&](double t) { return a_gain + s_gain * t; };
      auto tokens_at = [&](double t) { return base_tokens + a_tok + s_tok * t; };
      if (pass == 0) {
        consider(d, floor_us, gain_at(floor_us), tokens_at(floor_us), max_tok);
        const double above =
            std::isfinite(first_jump)
                ? bound(gain_at(floor_us), ub_gain, first_jump,
                        ffn_tokens(tokens_at(floor_us), max_tok), d)
                : 0.0;
        refined[oi] = {-above, d};
        continue;
      }
      if (c.mode != PlanMode::kFill && default_barrier > floor_us) {
        events_.push_back((uint64_t{FloatKey(static_cast<float>(default_barrier))} << 32) |
                          (uint64_t{kProbe} << 8));
      }
      SortByCost(events_, sort_tmp_);
      for (size_t e = 0; e < events_.size();) {
        const uint32_t key = static_cast<uint32_t>(events_[e] >> 32);
        const double barrier = std::bit_cast<float>(key);
        const double gain_now = gain_at(barrier), tok_now = tokens_at(barrier);
        const double ffn_now = ffn_tokens(tok_now, max_tok);
        if (best_within_guard && (bound(gain_now, ub_gain, barrier, ffn_now, d) <= best_j ||
                                  barrier + g.StepUs(ffn_now, d) > max_step)) {
          break;  // no later barrier can win (steps only grow from here)
        }
        for (; e < events_.size() && static_cast<uint32_t>(events_[e] >> 32) == key; ++e) {
          const uint32_t r = static_cast<uint32_t>((events_[e] >> 8) & 0xffffffu);
          if (r == kProbe) continue;
          const int k = static_cast<int>(events_[e] & 0xff);
          const RankSummary& s = summaries[r];
          int first;
          const int n = depth_knots(s, d, &first);
          const Segment sg = segment(s, first, n, k);
          a_gain += sg.a_gain - seg_[r].a_gain;
          s_gain += sg.s_gain - seg_[r].s_gain;
          a_tok += sg.a_tok - seg_[r].a_tok;
          s_tok += sg.s_tok - seg_[r].s_tok;
          seg_[r] = sg;
          max_tok = std::max<double>(max_tok, s.base_tokens + s.knot_tokens[first + k]);
        }
        consider(d, barrier, gain_at(barrier), tokens_at(barrier), max_tok);
      }
    }
  }
  best = inc.best;
  best.num_planned_ranks = num_valid;
  // A rank that sent no usable summary runs the engine's default lengths; every rank sees that
  // in the same bytes, so all agree to draft deep enough for it (an MTP draft has MoE layers:
  // one depth for the whole instance).
  if (!local && num_valid < static_cast<int>(summaries.size())) {
    best.draft_depth = std::max(best.draft_depth, c.default_k);
  }
  return best;
}

absl::Status Planner::Assign(const GlobalDecision& decision, absl::Span<int32_t> verify_len) {
  last_tokens_per_us_ = decision.tokens_per_us;
  return AssignFrom(local_, decision, verify_len);
}

absl::Status Planner::AssignFrom(const LocalState& st, const GlobalDecision& d,
                                 absl::Span<int32_t> verify_len) const {
  const size_t n = st.batch.size();
  if (verify_len.size() != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "planner: verify_len has %d slots for a batch of %d", verify_len.size(), n));
  }
  if (config_.mode == PlanMode::kOff) {
    for (size_t i = 0; i < n; ++i) verify_len[i] = DefaultVerifyLen(config_.default_k, st.batch[i].k_cap);
    return absl::OkStatus();
  }
  for (size_t i = 0; i < n; ++i) {
    if (st.base_len[i] > d.draft_depth) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "planner: request %d needs verify length %d but the agreed draft depth is %d", i,
          st.base_len[i], d.draft_depth));
    }
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

double Planner::FillUnder(const LocalState& st, const GlobalDecision& d, int depth_cap,
                          absl::Span<int32_t> verify_len) const {
  // Greedy fill in gain-per-microsecond order, skipping items that do not fit: attention (plus,
  // with per-rank draft depths, this rank's own draft time) must stay under the agreed barrier,
  // tokens under the padded tier (padded mode) or each item must pay for its FFN time at the
  // planned goodput, and extra tokens within the KV budget.
  const GlobalCost& g = config_.global;
  const double rank_draft_us = config_.agreed_draft_depth ? 0.0 : g.draft_per_step_us;
  const double min_gain = g.padded_tokens ? 0.0 : d.tokens_per_us * g.ffn_per_token_us;
  const double barrier = d.barrier_us * (1 + kBarrierSlack) + kBarrierSlack;
  const int64_t kv_cap =
      st.kv_free_tokens < 0 ? std::numeric_limits<int64_t>::max() : st.kv_free_tokens;
  double gain = 0;
  for (size_t i = 0; i < st.batch.size(); ++i) {
    verify_len[i] = st.base_len[i];
    gain += st.batch[i].acceptance.ExpectedTokens(st.base_len[i]);
  }
  BatchAggregates agg = st.base_agg;
  int64_t extra = 0;
  int deepest = st.min_depth;
  for (const Item& it : st.items) {
    const int32_t i = it.req_idx(), pos = it.pos();
    if (pos > depth_cap || verify_len[i] != pos - 1) continue;
    if (it.gain < min_gain || extra >= kv_cap) continue;
    if (g.padded_tokens && agg.query_tokens + 1 > d.padded_rank_tokens) continue;
    BatchAggregates next = agg;
    next.AddQueryToken(RequestLoad{st.batch[i].ctx_tokens, pos});
    const int next_deepest = std::max(deepest, static_cast<int>(pos));
    if (model_.AttentionUs(next) + rank_draft_us * next_deepest > barrier) continue;
    agg = next;
    deepest = next_deepest;
    verify_len[i] = pos;
    gain += it.gain;
    ++extra;
  }
  return gain;
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
  return result;
}

}  // namespace dpbalance
