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


int32_t TierFor(absl::Span<const int32_t> tiers, int64_t tokens) {
  for (int32_t t : tiers) {
    if (t >= tokens) return t;
  }
  return static_cast<int32_t>(tokens);  // beyond the largest tier: no padding
}

// Knots one rank spends on its frontier. Decide's work grows with ranks x knots, and with many
// ranks the instance's frontier already has hundreds of points per depth, so each sends fewer.
// About 1024 knots for the instance, at least 16 a rank (DP64 and DP256: 16, up to DP36: 28).
// With 12-14 at DP64 the chords between sparse knots undervalued deeper drafts (the H200-truth
// replay stuck at depth 6 and lost 1.4% goodput); 16 matched 20 and 28 on both traces.
int KnotBudget(int num_ranks) { return std::clamp(1024 / num_ranks, 16, kKnotPool); }

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

// Steepest slopes after each knot (and from the base) of every depth's frontier, from the stored
// (float) values Decide will read. Knots shared by several depths get the deepest one's
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
  h.Value(uniform_per_rank);
  h.Value(kSummaryVersion);
  return h.digest();
}

Planner::Planner(PlannerConfig config, CostModel model)
    : config_(std::move(config)),
      model_(std::move(model)),
      config_hash_(config_.Hash()),
      focus_depth_(config_.default_k) {}

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
  if (model_.uses_grid()) {  // one simulation per kernel path; later steps move it linearly
    st.base_loads.clear();
    for (size_t i = 0; i < batch.size(); ++i) {
      st.base_loads.push_back(RequestLoad{batch[i].ctx_tokens, 1 + st.base_len[i]});
    }
    model_.FillGrid(st.base_loads, &st.base_agg);
  }
  // A dense draft run to this rank's own depth is part of its time before the barrier.
  const double rank_draft_us = config_.agreed_draft_depth ? 0.0 : config_.global.draft_per_step_us;
  st.min_depth = min_depth;
  st.base_attention_us = model_.AttentionUs(st.base_agg) + rank_draft_us * min_depth;
  double default_gain = 0;
  int default_depth = 0;
  st.default_loads.clear();
  for (size_t i = 0; i < batch.size(); ++i) {
    const int32_t k = DefaultVerifyLen(config_.default_k, batch[i].k_cap);
    st.default_loads.push_back(RequestLoad{batch[i].ctx_tokens, 1 + k});
    default_gain += batch[i].acceptance.ExpectedTokens(k);
    default_depth = std::max(default_depth, static_cast<int>(k));
  }
  // The default plan is the TPOT guard's reference. Where the base's simulation moves exactly
  // with the query tokens (no grid, or a head-major one) it is priced from the base's;
  // otherwise it is simulated.
  BatchAggregates default_agg;
  if (model_.uses_grid() &&
      model_.kernel_grid().VerifyTermsDependOnQueryTokens(1 + config_.default_k)) {
    default_agg = model_.Aggregate(st.default_loads);
  } else {
    for (const RequestLoad& l : st.default_loads) default_agg.Add(l);
    default_agg.grid = st.base_agg.grid;
  }

  // Step 2: extra-token items ordered by expected tokens per marginal microsecond. An item whose
  // gain cannot pay for its FFN cost at last step's goodput never helps, so it is dropped.
  const double min_gain = config_.global.padded_tokens
                              ? 0.0
                              : last_tokens_per_us_ * config_.global.ffn_per_token_us;
  // Marginal cost (us) of one more query token for a request, at the base batch in the
  // multi-query regime. It only orders the items; knot costs are evaluated exactly.
  BatchAggregates multi = st.base_agg;
  multi.multi_query = true;
  const double multi_us = model_.AttentionUs(multi);
  st.items.clear();
  const BatchAggregates::TokenMark multi_mark = multi.Mark();
  for (size_t i = 0; i < batch.size() && !config_.uniform_per_rank; ++i) {
    multi.AddQueryToken(RequestLoad{batch[i].ctx_tokens, 1 + st.base_len[i]});
    const double marginal = std::max(model_.AttentionUs(multi) - multi_us, kTinyUs);
    multi.Restore(multi_mark);
    for (int j = st.base_len[i] + 1; j <= batch[i].k_cap; ++j) {
      const double gain = batch[i].acceptance.Accept(j);
      if (gain <= min_gain) break;  // gains fall with j
      const uint32_t ratio_bits = FloatKey(static_cast<float>(gain / marginal));
      st.items.push_back(Item{(uint64_t{~ratio_bits} << 32) |
                              (uint64_t{static_cast<uint32_t>(i)} << 8) | static_cast<uint64_t>(j)});
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
  if (config_.uniform_per_rank) {
    SummarizeUniform(st, base_gain, kv_cap, s);
    FillMaxSlopes(s);
    return absl::OkStatus();
  }
  // Items available at each depth (capped by the KV budget).
  std::array<int64_t, kMaxDraftLen + 1> avail{};
  for (const Item& it : st.items) ++avail[it.pos()];
  int64_t running = 0;
  for (int d = 1; d <= kMaxDraftLen; ++d) {
    running += avail[d];
    avail[d] = std::min<int64_t>({running, kv_cap, 65535});
  }
  // Share the knot pool: every depth with items gets one knot, then rounds hand out the rest,
  // most to the depths around the previous decision's (where the next one most likely lands:
  // the chord between sparse knots undervalues a depth): 6 knots a round to that depth, 2 to
  // each neighbour, 1 to the others, never more than a depth has items. Small batches get one
  // knot per item at every depth, so small cases are exact.
  std::array<int, kMaxDraftLen + 1> share{};
  int pool = KnotBudget(config_.num_ranks);
  const int d_lo = std::max(1, min_depth), d_hi = s.max_depth;
  for (int d = d_lo; d <= d_hi && pool > 0; ++d) {
    share[d] = avail[d] > 0 ? 1 : 0;
    pool -= share[d];
  }
  const int focus = std::clamp(focus_depth_, d_lo, std::max(d_lo, d_hi));
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
  int next_knot = 0, depths_open = 0;
  for (int d = d_lo; d <= d_hi; ++d) {
    s.knot_begin[d - 1] = static_cast<uint8_t>(next_knot);
    next_knot += avail[d] > 0 ? share[d] : 0;
    next_at[d] = avail[d] > 0 ? knot_at(d, 0) : kNever;
    cost[d] = st.base_attention_us;
    depths_open += next_at[d] != kNever;
  }
  BatchAggregates agg = st.base_agg;  // each knot's batch, rebuilt from the base in place
  const BatchAggregates::TokenMark base_mark = agg.Mark();
  for (const Item& it : st.items) {
    if (depths_open == 0) break;
    const int p = it.pos();
    const double ctx = static_cast<double>(batch[it.req_idx()].ctx_tokens);
    PositionSums& ps = pos_sums[p];
    ps.tokens += 1;
    ps.pairs += ctx;
    ps.max_pairs = std::max(ps.max_pairs, (p + 1.0) * ctx);
    ps.gain += batch[it.req_idx()].acceptance.Accept(p);
    for (int d = std::max(p, d_lo); d <= d_hi; ++d) {
      if (++taken[d] != next_at[d]) continue;
      agg.Restore(base_mark);
      agg.multi_query = true;
      double gain = base_gain;
      int deepest = min_depth;
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
  FillMaxSlopes(s);
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
  // A rank's knots at depth d: its frontier of the deepest depth it can use up to d.
  struct DepthKnots {
    int slot = 0, first = 0, n = 0;  // slot 0: none
  };
  auto depth_knots = [&](const RankSummary& s, int d) {
    const int slot = std::min<int>(d, s.max_depth);
    if (slot <= 0) return DepthKnots{};
    return DepthKnots{slot, s.knot_begin[slot - 1], s.num_knots[slot - 1]};
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
    const double step = barrier + g.StepUs(ffn, c.agreed_draft_depth ? d : 0);
    // Most barriers of a sweep lose to the best so far: decide that with one multiplication.
    if (inc.within_guard && step <= max_step && gain <= inc.best_j * step) return;
    inc.Consider(d, barrier, gain, step, ffn,
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

  // Upper bound on goodput at every barrier T' >= T of one depth. Each rank's gain from T on lies
  // under the line a_ub + s_ub * T' (from its segment's left knot, with its steepest later
  // slope), so the instance's gain G' <= min(A + S * T', G_max). The step is at least T' plus the
  // global terms at today's tokens, plus the FFN time of G' - gain more tokens (an extra token
  // adds at most one expected token). That ratio is monotone in T' between T and the T* where
  // the line meets G_max and falls after, so the bound is its larger end value.
  const double ffn_slope = g.padded_tokens ? 0.0 : g.ffn_per_token_us * ffn_scale;
  auto bound = [&](double barrier, double gain, double ub_a, double ub_s, bool unbounded,
                   double ub_gain, double global_us) {
    auto at = [&](double t, double g_hi) {
      return g_hi / (t + global_us + ffn_slope * std::max(0.0, g_hi - gain));
    };
    if (unbounded) return at(barrier, ub_gain);
    const double g_now = std::min(ub_a + ub_s * barrier, ub_gain);
    double v = at(barrier, g_now);
    if (ub_s > 0 && g_now < ub_gain) v = std::max(v, at((ub_gain - ub_a) / ub_s, ub_gain));
    return v;
  };
  // Prune only clearly below the best, so rounding in the bound never drops a barrier that
  // would tie or narrowly win.
  auto cannot_win = [&](double ub) { return best_within_guard && ub <= best_j * (1 - 1e-12); };

  // Step 2: for each feasible depth, sweep the barrier T upwards over the knot costs. Every rank
  // sits on the segment of its frontier that contains T: between knots that are single items its
  // gain is a step (exact: items are indivisible); between knots that skip items it is the chord
  // (the frontier is concave, so the chord is a conservative estimate that Assign's fill
  // achieves). Totals are linear in T between events, so goodput (linear-fractional) peaks at an
  // event. The sweep stops once the bound says no higher barrier can win; knots above the barrier
  // where even the largest gain cannot beat the best never enter the merge.
  const int depth_hi = std::max(depth_lo, c.k_max);
  seg_.resize(summaries.size());
  constexpr uint32_t kProbe = 0xffffffu;  // an event that only evaluates a barrier
  // Rank r's segment from knot k (-1: its base) among its knots `dk` at the depth swept.
  auto segment = [&](const RankSummary& s, DepthKnots dk, int k) {
    const int first = dk.first;
    const double c0 = k < 0 ? s.base_attention_us : s.knot_attention_us[first + k];
    const double g0 = k < 0 ? s.base_gain : s.knot_gain[first + k];
    const double t0 = k < 0 ? 0.0 : s.knot_tokens[first + k];
    Segment sg{g0, 0, t0, 0, g0, 0, false};
    if (k + 1 < dk.n) {
      const double c1 = s.knot_attention_us[first + k + 1], t1 = s.knot_tokens[first + k + 1];
      if (t1 - t0 > 1 && c1 > c0 && !c.uniform_per_rank) {  // uniform levels: steps
        const double inv = 1.0 / (c1 - c0);
        sg.s_gain = (s.knot_gain[first + k + 1] - g0) * inv;
        sg.s_tok = (t1 - t0) * inv;
        sg.a_gain = g0 - sg.s_gain * c0;
        sg.a_tok = t0 - sg.s_tok * c0;
      }
    }
    const double m = k >= 0        ? s.knot_max_slope[first + k]
                     : dk.slot > 0 ? s.base_max_slope[dk.slot - 1]
                                   : 0.0;
    if (std::isinf(m)) {
      sg.unbounded = true;
    } else {
      sg.s_ub = m;
      sg.a_ub = g0 - m * c0;
    }
    return sg;
  };

  for (int d = depth_lo; d <= depth_hi; ++d) {
    double a_gain = 0, s_gain = 0, a_tok = 0, s_tok = 0, ub_a = 0, ub_s = 0;
    int unbounded = 0;
    double max_tok = max_base_tokens, ub_gain = base_gain, top_cost = floor_us;
    events_.clear();
    for (uint32_t r : valid_) {
      const RankSummary& s = summaries[r];
      const DepthKnots dk = depth_knots(s, d);
      const int first = dk.first, n = dk.n;
      int k = 0;
      for (; k < n && s.knot_attention_us[first + k] <= floor_us; ++k) {}
      // The rank sits on the segment starting at knot k-1 (k-1 = -1: its base).
      const Segment sg = segment(s, dk, k - 1);
      seg_[r] = sg;
      a_gain += sg.a_gain;
      s_gain += sg.s_gain;
      a_tok += sg.a_tok;
      s_tok += sg.s_tok;
      ub_a += sg.a_ub;
      ub_s += sg.s_ub;
      unbounded += sg.unbounded;
      if (k > 0) max_tok = std::max<double>(max_tok, s.base_tokens + s.knot_tokens[first + k - 1]);
      if (n > 0) ub_gain += s.knot_gain[first + n - 1] - s.base_gain;
      if (c.mode == PlanMode::kFill || k == n) continue;  // fill: the barrier stays at the floor
      top_cost = std::max<double>(top_cost, s.knot_attention_us[first + n - 1]);
      // The rank's next knot; the merge below brings in the rest one by one.
      events_.push_back((uint64_t{FloatKey(s.knot_attention_us[first + k])} << 32) |
                        (uint64_t{r} << 8) | static_cast<uint64_t>(k));
    }
    // Knot gains are totals (base included); knot tokens are extra over the base.
    auto gain_at = [&](double t) { return a_gain + s_gain * t; };
    auto tokens_at = [&](double t) { return base_tokens + a_tok + s_tok * t; };
    consider(d, floor_us, gain_at(floor_us), tokens_at(floor_us), max_tok);
    if (c.mode == PlanMode::kFill || events_.empty()) continue;
    if (default_barrier > floor_us) {
      events_.push_back((uint64_t{FloatKey(static_cast<float>(default_barrier))} << 32) |
                        (uint64_t{kProbe} << 8));
      top_cost = std::max(top_cost, default_barrier);
    }
    const double global_floor = g.StepUs(ffn_tokens(tokens_at(floor_us), max_tok), d);
    if (cannot_win(bound(floor_us, gain_at(floor_us), ub_a, ub_s, unbounded > 0,
                         ub_gain, global_floor))) {
      continue;
    }
    // Goodput at barrier T is at most G_max / (T + global terms at the floor): knots above
    // `top` can never win (nor can steps past the TPOT guard).
    double top = top_cost;
    if (best_within_guard) top = std::min({top, ub_gain / best_j - global_floor, max_step - global_floor});
    if (!(top > floor_us)) continue;  // nothing above the floor can win (NaN-safe)
    // Merge the ranks' knot lists (each ascending in cost) with a min-heap holding each rank's
    // next knot: only the knots the sweep reaches are ever ordered. Keys are unique (rank and
    // knot in the low bits), so the order is deterministic.
    const uint32_t top_key = FloatKey(static_cast<float>(top));
    std::erase_if(events_, [&](uint64_t ev) { return static_cast<uint32_t>(ev >> 32) > top_key; });
    auto sift_down = [&](size_t i) {  // restore the min-heap below i
      const size_t n = events_.size();
      const uint64_t v = events_[i];
      for (size_t child = 2 * i + 1; child < n; child = 2 * i + 1) {
        if (child + 1 < n && events_[child + 1] < events_[child]) ++child;
        if (events_[child] >= v) break;
        events_[i] = events_[child];
        i = child;
      }
      events_[i] = v;
    };
    auto pop_top = [&] {
      events_[0] = events_.back();
      events_.pop_back();
      if (!events_.empty()) sift_down(0);
    };
    for (size_t i = events_.size() / 2; i-- > 0;) sift_down(i);
    int groups = 0;
    while (!events_.empty()) {
      const uint32_t key = static_cast<uint32_t>(events_[0] >> 32);
      const double barrier = std::bit_cast<float>(key);
      // The bound every other barrier: it costs a few divisions, an event a few additions.
      if (best_within_guard && (groups++ & 1) == 0) {
        const double global_now = g.StepUs(ffn_tokens(tokens_at(barrier), max_tok), d);
        if (barrier + global_now > max_step ||
            cannot_win(bound(barrier, gain_at(barrier), ub_a, ub_s, unbounded > 0,
                             ub_gain, global_now))) {
          break;  // no later barrier can win (steps only grow from here)
        }
      }
      while (!events_.empty() && static_cast<uint32_t>(events_[0] >> 32) == key) {
        const uint64_t ev = events_[0];
        const uint32_t r = static_cast<uint32_t>((ev >> 8) & 0xffffffu);
        if (r == kProbe) {
          pop_top();
          continue;
        }
        const int k = static_cast<int>(ev & 0xff);
        const RankSummary& s = summaries[r];
        const DepthKnots dk = depth_knots(s, d);
        const Segment sg = segment(s, dk, k);
        Segment& cur = seg_[r];
        a_gain += sg.a_gain - cur.a_gain;
        s_gain += sg.s_gain - cur.s_gain;
        a_tok += sg.a_tok - cur.a_tok;
        s_tok += sg.s_tok - cur.s_tok;
        ub_a += sg.a_ub - cur.a_ub;
        ub_s += sg.s_ub - cur.s_ub;
        unbounded += static_cast<int>(sg.unbounded) - static_cast<int>(cur.unbounded);
        cur = sg;
        max_tok = std::max<double>(max_tok, s.base_tokens + s.knot_tokens[dk.first + k]);
        // The rank's next knot takes its place in the heap, unless it lies past the cut-off.
        const uint32_t next_key =
            k + 1 < dk.n ? FloatKey(s.knot_attention_us[dk.first + k + 1]) : top_key + 1;
        if (next_key <= top_key) {
          events_[0] = (uint64_t{next_key} << 32) | (uint64_t{r} << 8) | static_cast<uint64_t>(k + 1);
          sift_down(0);
        } else {
          pop_top();
        }
      }
      consider(d, barrier, gain_at(barrier), tokens_at(barrier), max_tok);
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

int Planner::UniformLens(const LocalState& st, int level, absl::Span<int32_t> lens) const {
  int deepest = st.min_depth;
  for (size_t i = 0; i < st.batch.size(); ++i) {
    lens[i] = std::max(st.base_len[i], std::min<int32_t>(level, st.batch[i].k_cap));
    deepest = std::max(deepest, static_cast<int>(lens[i]));
  }
  return deepest;
}

void Planner::SummarizeUniform(LocalState& st, double base_gain, int64_t kv_cap,
                               RankSummary& s) const {
  // One knot per level that adds tokens, priced exactly (a grid model simulates the launch),
  // stored once and shared by every depth at or above it: depth d reads the first knots, those
  // of levels <= d. Levels past the KV budget are left out whole (a level is all or nothing).
  // Every level is kept for Assign (st.levels), also past the last knot.
  const size_t n = st.batch.size();
  const double rank_draft_us = config_.agreed_draft_depth ? 0.0 : config_.global.draft_per_step_us;
  std::vector<int32_t> lens(n);
  std::vector<RequestLoad> loads(n);
  bool open = true;  // still adding knots
  std::array<int, kMaxDraftLen + 1> upto{};  // knots of levels <= d
  int stored = 0;
  int64_t prev_added = 0;
  double cost = st.base_attention_us, prev_gain = base_gain;
  const double min_gain = config_.global.padded_tokens
                              ? 0.0
                              : last_tokens_per_us_ * config_.global.ffn_per_token_us;
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
    if (!open || added == prev_added) continue;  // no request can go this deep
    // Past the KV budget, or (as items) a level whose extra tokens cannot pay for their FFN time
    // at last step's goodput, ends the knots: the deeper ones do not help either.
    if (added > kv_cap || added > 65535 ||
        gain - prev_gain < min_gain * static_cast<double>(added - prev_added)) {
      open = false;
      continue;
    }
    cost = std::max(cost, us);  // more work is never cheaper (see Summarize)
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
  const size_t n = st.batch.size();
  if (config_.uniform_per_rank) {
    // The deepest level that fits under the barrier, the KV budget and the padded tier, and
    // whose extra tokens over the level below it taken pay for their FFN time at the planned
    // goodput (the items' rule). Level 0 is the base (every request at its floor). Levels are
    // priced exactly, and a kernel grid's launch is not monotone in the tokens (waves, tiles),
    // so a level above one that does not fit may still fit: every level is tried. It is at
    // least the knot Decide placed this rank on, whose price is the running maximum.
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
  for (size_t i = 0; i < n; ++i) verify_len[i] = st.base_len[i];
  int64_t extra = 0;
  int deepest = st.min_depth;
  // One greedy pass from `agg` (the aggregates of the current plan); appends what it takes.
  std::vector<uint32_t> added;  // indices into st.items, in the order taken
  auto greedy = [&](BatchAggregates agg) {
    for (uint32_t idx = 0; idx < st.items.size(); ++idx) {
      const Item& it = st.items[idx];
      const int32_t i = it.req_idx(), pos = it.pos();
      if (pos > depth_cap || verify_len[i] != pos - 1) continue;
      if (st.batch[i].acceptance.Accept(pos) < min_gain || extra >= kv_cap) continue;
      if (g.padded_tokens && agg.query_tokens + 1 > d.padded_rank_tokens) continue;
      const BatchAggregates::TokenMark mark = agg.Mark();
      agg.AddQueryToken(RequestLoad{st.batch[i].ctx_tokens, pos});
      const int next_deepest = std::max(deepest, static_cast<int>(pos));
      if (model_.AttentionUs(agg) + rank_draft_us * next_deepest > barrier) {
        agg.Restore(mark);
        continue;
      }
      deepest = next_deepest;
      verify_len[i] = pos;
      ++extra;
      added.push_back(idx);
    }
  };
  greedy(st.base_agg);
  auto plan_gain = [&] {
    double gain = 0;
    for (size_t i = 0; i < n; ++i) gain += st.batch[i].acceptance.ExpectedTokens(verify_len[i]);
    return gain;
  };
  if (!model_.uses_grid() || added.empty() ||
      !model_.kernel_grid().VerifyTermsDependOnQueryTokens(1 + depth_cap)) {
    return plan_gain();
  }

  // With a kernel grid the greedy moved the simulated terms linearly from the base, and a real
  // launch is not linear: waves and tails jump. The barrier is a max over ranks, so every rank
  // whose plan the line underestimates would set a higher one. Check the plan with a
  // simulation; if it is over the barrier, keep the longest prefix of what was added that fits
  // (bisection); if it fits, fill on from a simulation at the plan, where the line is close.
  // A few simulations per step (kMaxFillRounds + about log2 of the items added).
  constexpr int kMaxFillRounds = 3;
  std::vector<int32_t> committed(st.base_len.begin(), st.base_len.end());  // fits (the base does)
  std::vector<RequestLoad> loads(n);
  BatchAggregates exact;  // the last plan simulated (its verify launch: every plan here adds)
  auto simulate = [&](absl::Span<const int32_t> lens) {
    int deep = st.min_depth;
    for (size_t i = 0; i < n; ++i) {
      loads[i] = RequestLoad{st.batch[i].ctx_tokens, 1 + lens[i]};
      deep = std::max(deep, static_cast<int>(lens[i]));
    }
    exact = model_.Aggregate(loads);
    return model_.AttentionUs(exact) + rank_draft_us * deep;
  };
  auto apply_prefix = [&](size_t m) {  // committed plan plus the first m items added
    std::copy(committed.begin(), committed.end(), verify_len.begin());
    for (size_t a = 0; a < m; ++a) {
      const Item& it = st.items[added[a]];
      verify_len[it.req_idx()] = it.pos();
    }
  };
  for (int round = 1;; ++round) {
    if (simulate(verify_len) > barrier) {
      size_t lo = 0, hi = added.size();  // the committed plan fits; all of `added` does not
      while (hi - lo > 1) {
        const size_t mid = lo + (hi - lo) / 2;
        apply_prefix(mid);
        (simulate(verify_len) <= barrier ? lo : hi) = mid;
      }
      apply_prefix(lo);
      break;
    }
    if (round == kMaxFillRounds) break;
    std::copy(verify_len.begin(), verify_len.end(), committed.begin());
    added.clear();
    greedy(exact);  // `exact` holds the simulated plan: the line starts from here
    if (added.empty()) break;
  }
  return plan_gain();
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
