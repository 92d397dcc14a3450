// dpbalance/planner.h — verify-length planner: the one implementation every caller shares.
//
// Objective: maximise the instance's expected emitted tokens per second of step time, where
//   step_us = max_r attention_us(r) + GlobalCost::StepUs(ffn_tokens, draft_depth),
// subject to per-request floors/caps, per-rank KV capacity for extra tokens and (optionally)
// CUDA-graph token tiers. See docs/design.md for the per-step flow.
//
// Three phases, so it runs inside a DP rank:
//   1. `Summarize(rank batch) -> RankSummary`       local, O(n k log(n k))
//   2. the engine/collectives all-gather the summaries (rank order)
//   3. `Decide(all summaries) -> GlobalDecision`    identical bytes in, identical result out
//      `Assign(decision) -> verify_len per request`  local, uses the state kept by Summarize
// `Decide` is bit-for-bit deterministic: it reads only the summaries and the config, in a fixed
// order, with no threads and no fast-math.
//
// Thread safety: a Planner is owned by one rank's step thread. Summarize/Assign keep scratch
// state between them (no allocation per step once warm). Decide is const.
// Errors: every method returns absl::Status naming the bad value and where it came from.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dpbalance/acceptance.h"
#include "dpbalance/cost_model.h"
#include "dpbalance/dspark.h"
#include "dpbalance/summary.h"

namespace dpbalance {

enum class PlanMode {
  kOff,      // engine default verify length for every request
  kGoodput,  // maximise expected tokens per second of the instance
  kFill,     // never raise the barrier set by the slowest rank at the default length; spend the
             // other ranks' idle time on extra verify (and deeper drafts where they pay)
  kLocal,    // each rank maximises its own goodput, no coordination (ignores other summaries)
  // SGLang DSpark's planner as shipped (dspark.h), the engines' baseline: each rank's verify-token
  // budget by its own argmax of expected tokens x steps per second, the ranks agree on the largest
  // rank's tier only; floors, the TPOT guard and the KV budget play no part (DSpark has none).
  kDspark,
  kDsparkFill,  // the same with its tier fill: every rank fills the agreed tier with its best drafts
};
std::string_view PlanModeName(PlanMode m);

// The engine's default verify length for a request: min(default_k, k_cap), never negative (an
// engine may pass any k_cap; the fallback must still be a valid length).
inline int32_t DefaultVerifyLen(int default_k, int32_t k_cap) {
  return k_cap < default_k ? (k_cap < 0 ? 0 : k_cap) : default_k;
}
absl::StatusOr<PlanMode> ParsePlanMode(std::string_view name);

struct PlannerConfig {
  int num_ranks = 1;
  PlanMode mode = PlanMode::kGoodput;
  int k_max = 7;        // the engine's draft depth limit, 0..kMaxDraftLen
  int default_k = 3;    // the engine's static verify length (mode off, fallback)
  GlobalCost global;    // identical on every rank
  // Allowed per-rank query-token counts (CUDA-graph tiers), ascending; empty: any count. With
  // global.padded_tokens and one agreed draft depth (goodput mode) every rank runs the agreed
  // tier: a prefix of its frontier as verify work, the rest padding slots priced at its
  // RankSummary::pad_us; the tier and the barrier are chosen together (planner.cc, SweepTiers).
  std::vector<int32_t> token_tiers;
  // TPOT guard: a plan's step time may not exceed (1 + max_step_slack) x the step time of the
  // engine's default plan (every request at default_k) for the same batches. < 0: no guard.
  // Requests that accept little get ~1 token a step, so their TPOT follows the step time.
  double max_step_slack = -1;
  // The plugin's own time per step outside the planned forward (its exchange and the engine
  // adapter around it, which the engine without dpbalance does not pay), in microseconds,
  // counted against the TPOT guard: a plan's step + guard_overhead_us may not exceed (1 +
  // max_step_slack) x the default plan's step. Set by the user from a measurement (the live
  // bench's scripts/studies/live_steps.py reports it per arm); the same on every rank (hashed). 0: the
  // guard bounds the planned step alone. Ignored when the guard is off.
  double guard_overhead_us = 0;
  // Measured overhead: the guard also counts the largest `RankSummary::own_us` among the usable
  // records (each rank's running mean of its own plan calls, exchange included), on top of
  // guard_overhead_us, which then covers only what the plugin cannot see (the engine adapter
  // around the call). Every rank reads the same records, so every rank prices the same overhead.
  // false: guard_overhead_us alone (a replay has no plan calls to time: it stays false there).
  bool guard_measured_overhead = false;
  // Default guard: the plan replaces the engine's default plan (every request at default_k) only
  // when its predicted goodput beats the default plan's by more than this fraction; otherwise
  // every rank keeps its default lengths (GlobalDecision::kept_default). A plan is a bet on the
  // cost model and the acceptance estimates: a predicted gain smaller than their error is as
  // likely a loss (docs/live_vllm.md, greedy). Applies only where the default plan is feasible
  // (no request's floor above default_k). 0: off, the best plan always runs.
  double min_plan_gain = 0;
  // Deferral value (DeferralWeights): a token a plan does not verify now is not lost, it is
  // emitted in a later step, which costs its request one more step's attention and share of the
  // step. Each request's tokens are then valued by its own cost per emitted token (at the
  // engine's default lengths) over its rank's mean: a request whose tokens cost more to emit
  // later (a long context re-read every step) keeps its drafts before a cheap one does. The
  // weights have a token-weighted mean of 1 on each rank, so only the order within a rank
  // changes, not how ranks trade against the barrier. false: every token counts 1.
  bool value_deferral = false;
  // true: one draft depth for the instance (an MTP draft has MoE layers, so every rank runs the
  // same number of draft steps; its cost is global). false: a dense draft (e.g. EAGLE) that each
  // rank runs to its own depth, the deepest verify length it assigns; the draft time is then part
  // of that rank's time before the barrier.
  bool agreed_draft_depth = true;
  // true: one verify length per rank (every request verifies min(level, k_cap), at least its
  // floor), for engines that can vary the verify length per batch but not per request. The
  // rank's frontier is then its few uniform levels, and Decide treats them as steps.
  bool uniform_per_rank = false;
  // true: one verify width for the whole instance (granularity "instance"): every request on
  // every rank verifies min(draft_depth, k_cap) drafts, at least its floor, where draft_depth is
  // the agreed depth. For engines whose verify width is the draft depth of a captured step graph
  // (SGLang's EAGLE/EAGLE3/MTP with topk 1: speculative_num_steps, the same on every DP rank).
  // Each rank sends the exact price and gain of every level (one knot a level); Decide picks
  // the depth whose instance goodput is best (the slowest rank's level sets the barrier). Needs
  // agreed_draft_depth; excludes uniform_per_rank.
  bool uniform_instance = false;
  // The draft depths the engine can run (bit d: depth d), e.g. the step graphs it captured;
  // Decide considers no other agreed depth. 0: every depth 0..k_max. When set it must hold
  // default_k and k_max. Hashed (ranks must agree).
  uint32_t allowed_depths = 0;
  bool DepthAllowed(int d) const { return allowed_depths == 0 || ((allowed_depths >> d) & 1u); }
  // true: every rank's token total follows from the exchanged summaries alone (RankTokens), and
  // Assign gives each rank exactly that many: the extra tokens of the last knot of its frontier
  // under the agreed barrier, taken in frontier order. The plugin's ABI v2 sets it so an engine
  // fills its DP sync's token counts and padding from one exchange. In padded mode it changes
  // nothing: every rank runs the agreed tier (RankTokens says so) and fills its spare tokens
  // with verify work where it pays, the rest being padding rows. false: Assign also fills
  // between knots (a few more tokens, known only to the rank itself).
  bool exact_rank_tokens = false;
  // true: extra verify tokens are ordered by their acceptance alone, not per microsecond: the
  // order an engine that spreads a verify-token budget by its draft confidence uses
  // (granularity "budget"), so the plan is priced for the lengths the engine will really run.
  bool order_by_gain = false;
  // How the planner simulates a grid model's launch (kernel_grid.h), when set: the planner's
  // copy of the model simulates this way, whatever rule the model carries; the model as given
  // (a truth, a fit) is not changed. Unset: the model's own rule (CostModel::grid_simulation,
  // from its file), except that a kReference model's head-major verify launches are priced from
  // sampled heads (GridSimulation::kSampledHeads; docs/cost-model.md measures what that changes)
  // while `sample_heads` is true. Each rank prices its own batch, so ranks need not agree (not in
  // Hash).
  std::optional<GridSimulation> grid_simulation;
  bool sample_heads = true;
  // DSpark modes: the steps-per-second table its budget reads (dspark::SpsTable: per-rank tokens,
  // steps per second). Empty: the table dspark::ProfileSps takes from this planner's model and
  // global terms when it is created (the plugin); the replay gives the one profiled on its truth.
  // Each rank prices its own batch, so ranks need not agree (not in Hash).
  std::vector<int64_t> dspark_sps_tokens;
  std::vector<double> dspark_sps_steps_per_s;
  // DSpark modes: price the budget with this planner's own context-aware model instead of the
  // table (a sensitivity setting; not SGLang's behaviour).
  bool dspark_context_sps = false;
  // DSpark modes: price the budget with SGLang's additive table (dspark::AdditiveSpsTable)
  // instead of the steps-per-second table. Not in Hash (each rank prices its own batch).
  std::optional<dspark::AdditiveSpsTable> dspark_additive;

  absl::Status Validate() const;
  // Hash over everything that must agree across ranks. The cost model is not in it: each rank
  // prices its own batch with its own (calibrated, refitted online) model, and the summaries
  // carry prices, not coefficients.
  uint64_t Hash() const;
};

// The largest context a request may claim: 2^40 tokens, thousands of times any model's window.
// A larger one is bad engine input (the planner refuses the batch and the step falls back); the
// bound keeps every sum and block count of contexts far from int64's limit.
inline constexpr int64_t kMaxCtxTokens = int64_t{1} << 40;

// One request as the planner sees it this step.
struct PlanRequest {
  int64_t ctx_tokens = 0;  // context (keys) before this step's verify tokens, >= 0
  int32_t k_min = 0;       // floor on verify length (SLO), 0..k_cap
  int32_t k_cap = 7;       // cap: min(k_max, tokens the request may still emit - 1), >= 0
  AcceptanceCurve acceptance;
  // DSpark modes: the request has no survivals from the draft two decode steps back (it is in its
  // first decode steps), so DSpark's budget counts survival 1 at each of its positions.
  bool no_lagged_survival = false;
  // DSpark modes: the draft's confidences two decode steps back, which DSpark's budget reads
  // (SGLang's confidence relay) while its top-k reads this step's (`acceptance`). Unset: the
  // budget reads `acceptance` too.
  std::optional<AcceptanceCurve> lagged_acceptance;
};

// Per-request value weights of PlannerConfig::value_deferral for one rank's batch. Each request
// i at its default length k_i = min(default_k, k_cap) costs c_i per step: its own attention (the
// model's time for the batch less the time without it, kernel-grid terms left out) plus an equal
// share of the rest of the rank's attention and of the instance step's global cost divided by
// the ranks; it emits e_i = ExpectedTokens(k_i) tokens a step. w_i = (c_i / e_i) / (sum c / sum
// e), clamped to [1/4, 4]: the weights' mean weighted by e_i is 1 (before the clamp). Fewer than
// two requests: all 1.
// The smallest of `tiers` (ascending) at or above `tokens`; `tokens` itself beyond the largest
// (or without tiers): the size a rank of that many tokens is padded to.
int32_t TierFor(absl::Span<const int32_t> tiers, int64_t tokens);

std::vector<double> DeferralWeights(const CostModel& model, const GlobalCost& global,
                                    int num_ranks, int default_k, bool agreed_draft_depth,
                                    absl::Span<const PlanRequest> batch);

struct GlobalDecision {
  int draft_depth = 0;             // agreed draft depth (every rank drafts this many steps);
                                   // per-rank depths: the cap (each rank drafts max verify_len)
  double barrier_us = 0;           // planned max-rank attention time
  double step_us = 0;              // planned step time
  double expected_tokens = 0;      // planned instance tokens (sum over planned ranks)
  double tokens_per_us = 0;        // planned goodput; also the fill threshold for Assign
  double default_step_us = 0;      // predicted step time of the engine's default plan
  int64_t ffn_tokens = 0;          // tokens the FFN term was charged for
  int32_t padded_rank_tokens = 0;  // per-rank token tier (padded mode), else 0
  int num_planned_ranks = 0;       // ranks whose summaries were valid
  bool kept_default = false;       // the default guard kept every rank at its default lengths
  double default_tokens_per_us = 0;  // predicted goodput of the engine's default plan (0: none)

  bool operator==(const GlobalDecision&) const = default;  // every field equal
};

namespace internal {
// Decide's scratch (planner.cc), kept between calls so a warm planner does not allocate.
// One rank's frontier between two knots, as lines in the barrier T: its gain
// gain0 + gain_slope * T and extra tokens tokens0 + tokens_slope * T, and a line
// bound0 + bound_slope * T above its gain at every barrier from here on (none when `unbounded`:
// a later knot costs no more but gains more).
struct FrontierSegment {
  double gain0 = 0, gain_slope = 0, tokens0 = 0, tokens_slope = 0;
  double bound0 = 0, bound_slope = 0;
  bool unbounded = false;
};
// One point of a rank's tier plan (SweepTiers): its attention with the rest of the tier padded,
// and its expected tokens.
struct TierPoint {
  double cost = 0, gain = 0;
};
struct TierPair {
  double bound = 0;  // no plan of the pair has more goodput
  int depth = 0;
  uint32_t tier = 0;  // the tier's place among the swept tiers
};
struct DecideScratch {
  std::vector<uint32_t> usable_ranks;      // indices of the summaries that take part
  std::vector<uint64_t> events, sort_tmp;  // knot events: cost key, rank, knot index
  std::vector<FrontierSegment> segments;   // per rank: the segment it sits on
  // SweepTiers: every usable rank's points, cheapest first, from point_begin[i] (i: its place in
  // usable_ranks; one more entry ends the last); the point each rank sits on; the heap of ranks
  // by the cost of that point.
  std::vector<TierPoint> points;
  std::vector<uint32_t> point_begin, at;
  std::vector<uint64_t> heap;
  // SweepTiers: the (depth, tier) pairs with the bound on their goodput, swept in falling order.
  std::vector<TierPair> tier_pairs;
  std::vector<double> tiers, tier_gain, tier_cheapest;  // per tier swept: the bound's two ends
};
}  // namespace internal

class Planner {
 public:
  static absl::StatusOr<Planner> Create(PlannerConfig config, CostModel model);

  // DSpark modes: from now on rank `rank_idx` prices its budget with `table` (a table SGLang's
  // online profiler rebuilt from that rank's measured steps: dspark::OnlineSps). Not for the
  // additive table or dspark_context_sps.
  absl::Status SetDsparkRankTable(int rank_idx, dspark::SpsTable table);

  // Phase 1. Builds this rank's summary from its batch. Keeps the batch's frontier for Assign.
  // `kv_free_tokens`: tokens of KV capacity left for extra verify tokens (< 0: unlimited).
  absl::Status Summarize(int rank_idx, absl::Span<const PlanRequest> batch, int64_t kv_free_tokens,
                         RankSummary* out);
  // Phase 3a. Global decision from all ranks' summaries (index = rank).
  absl::StatusOr<GlobalDecision> Decide(absl::Span<const RankSummary> summaries) const;
  // Phase 3b. This rank's verify lengths for the batch last given to Summarize.
  absl::Status Assign(const GlobalDecision& decision, absl::Span<int32_t> verify_len);

  // Every rank's query tokens this step from the summaries alone, identical on every rank:
  // `balanced` (the decision was applied): for a usable summary the agreed tier in padded mode
  // (the rank's lengths stay within it, padding rows make up the rest; a kept default too), else
  // the planned knot's tokens (exact_rank_tokens) or the base's, or for a kept default
  // (GlobalDecision::kept_default) its default lengths' tokens; otherwise (and for records
  // without kSummaryValid) the tokens of its default lengths. Each plus the rank's extra_tokens; -1 for a record without the
  // summary magic (an empty one: nothing is known of that rank). One slot per summary.
  void RankTokens(absl::Span<const RankSummary> summaries, const GlobalDecision& decision,
                  bool balanced, absl::Span<int64_t> out) const;

  // Convenience for single-process callers (replay, oracle): runs all three phases for all
  // ranks with one model each. `batches[r]` is rank r's batch; `verify_len[r]` gets its result.
  absl::StatusOr<GlobalDecision> PlanAll(absl::Span<const std::vector<PlanRequest>> batches,
                                         absl::Span<const int64_t> kv_free_tokens,
                                         std::vector<std::vector<int32_t>>* verify_len);

  // The last PlanAll's summaries, one per rank.
  absl::Span<const RankSummary> last_summaries() const { return all_summaries_; }
  const PlannerConfig& config() const { return config_; }
  const CostModel& model() const { return model_; }
  // The planner's model from now on, simulating its grid as config().grid_simulation says (when
  // set).
  void set_model(const CostModel& model) { model_ = PricedCopy(model); }
  // The step terms from now on (the online fit's, OnlineStepTerms); the config hash stays the
  // one the ranks agreed on at the handshake (the prior's).
  void set_global(const GlobalCost& global) { config_.global = global; }
  bool dspark() const { return config_.mode == PlanMode::kDspark || config_.mode == PlanMode::kDsparkFill; }
  uint64_t config_hash() const { return config_hash_; }

 private:
  Planner(PlannerConfig config, CostModel model);
  // `model` simulating its grid as config_.grid_simulation says; when unset, as it carries, a
  // kReference model's head-major verify launches from sampled heads (config_.sample_heads).
  CostModel PricedCopy(const CostModel& model) const {
    const GridSimulation own = model.grid_simulation();
    const bool sample = config_.sample_heads && own == GridSimulation::kReference;
    return model.WithGridSimulation(
        config_.grid_simulation.value_or(sample ? GridSimulation::kSampledHeads : own));
  }
  struct Item {
    // Sort key: ~bits(gain per marginal us) << 32 | req_idx << 8 | pos, so ascending keys are
    // descending ratios with ties broken by request then position.
    // (8 bytes, so sorting moves little; the gain P_j is the request's Accept(pos)).
    uint64_t key;
    int32_t req_idx() const { return static_cast<int32_t>((key >> 8) & 0xffffffu); }
    int32_t pos() const { return static_cast<int32_t>(key & 0xff); }  // draft position j, 1-based
  };
  absl::Status ValidateBatch(absl::Span<const PlanRequest> batch) const;
  int32_t Floor(const PlanRequest& r) const;

  PlannerConfig config_;
  CostModel model_;
  uint64_t config_hash_ = 0;
  double last_tokens_per_us_ = 0;  // previous decision's goodput (filters unprofitable items)
  int focus_depth_ = 0;            // previous decision's draft depth (knots cluster around it)

  // What Summarize keeps of one rank's batch for Assign.
  struct LocalState {
    std::vector<PlanRequest> batch;
    std::vector<Item> items;  // extra-token items, by gain per microsecond, descending
    std::vector<Item> items_tmp;  // OrderItems' sort buffer
    std::vector<int32_t> base_len;
    int64_t kv_free_tokens = -1;
    BatchAggregates base_agg;
    std::vector<RequestLoad> base_loads;  // for the kernel-grid simulation (grid models only)
    std::vector<RequestLoad> default_loads;  // the engine's default plan (scratch)
    double base_attention_us = 0;
    double base_gain = 0;  // expected tokens of the base plan
    int min_depth = 0;     // the deepest floor
    int max_cap = 0;       // the largest k_cap
    // Uniform-per-rank mode, from Summarize: each level's exact attention (+ own draft) time,
    // expected tokens and query tokens over the base (level 0 is the base).
    struct Level {
      double us = 0, gain = 0;
      int64_t added = 0;
    };
    std::array<Level, kMaxDraftLen + 1> levels{};
    RankSummary summary{};  // what this rank sent (exact_rank_tokens: Assign reads its knots)
    int64_t dspark_budget = 0;  // DSpark modes: this rank's own budget (verify tokens over n)
    // Token tiers: what one padding token (a dummy request of one query token, one key) adds
    // to the base's attention (RankSummary::pad_us); 0 otherwise.
    double pad_us = 0;
  };
  absl::Status SummarizeInto(LocalState& st, int rank_idx, absl::Span<const PlanRequest> batch,
                             int64_t kv_free_tokens, RankSummary* out) const;
  // Summarize's steps: the base plan (every request at its floor) into `st`; the summary's
  // header and base; the engine's default plan (the TPOT guard's reference); the extra-token
  // items by gain per microsecond; the items each depth can take; the knots of every depth.
  void SetBase(LocalState& st, absl::Span<const PlanRequest> batch, int64_t kv_free_tokens) const;
  // Token tiers: the price of one padding token on this rank (RankSummary::pad_us), after SetBase.
  double PadPriceUs(const LocalState& st) const;
  void StartSummary(const LocalState& st, int rank_idx, RankSummary& s) const;
  void SummarizeDefault(LocalState& st, RankSummary& s) const;
  void OrderItems(LocalState& st) const;
  static std::array<int64_t, kMaxDraftLen + 1> ItemsPerDepth(absl::Span<const Item> items,
                                                             int64_t kv_cap);
  void WalkKnots(const LocalState& st, const std::array<int64_t, kMaxDraftLen + 1>& avail,
                 const std::array<int, kMaxDraftLen + 1>& share, RankSummary& s) const;
  // DSpark modes (dspark.h): Summarize's budget and local tier, Decide's agreed tier, Assign's
  // top-k allocation.
  void SummarizeDspark(LocalState& st, RankSummary& s) const;
  absl::StatusOr<GlobalDecision> DecideDspark(absl::Span<const RankSummary> summaries) const;
  void AssignDspark(const LocalState& st, const GlobalDecision& d, absl::Span<int32_t> verify_len) const;
  // Uniform-per-rank mode: each level a knot, priced exactly. `every_level` (instance mode): a
  // knot for every level, whether or not its tokens pay and whatever the KV budget (up to 65535
  // extra tokens), so that knot L-1 is level L (LevelPoint reads it).
  void SummarizeUniform(LocalState& st, int64_t kv_cap, RankSummary& s, bool every_level) const;
  // Greedy fill under the barrier with draft positions <= depth_cap; returns the expected gain.
  double FillUnder(const LocalState& st, const GlobalDecision& d, int depth_cap,
                   absl::Span<int32_t> verify_len) const;
  class Filler;  // FillUnder's greedy fill of the items (planner.cc)
  // Uniform-per-rank mode: the deepest level that fits; returns its expected gain.
  double FillUniform(const LocalState& st, const GlobalDecision& d, int depth_cap,
                     absl::Span<int32_t> verify_len) const;
  // Uniform-per-rank mode: the lengths at `level`; returns the deepest.
  int UniformLens(const LocalState& st, int level, absl::Span<int32_t> lens) const;
  absl::Status AssignFrom(const LocalState& st, const GlobalDecision& decision,
                          absl::Span<int32_t> verify_len) const;
  // exact_rank_tokens: the knot RankTokens names for this rank, as verify lengths.
  void AssignKnot(const LocalState& st, const GlobalDecision& decision,
                  absl::Span<int32_t> verify_len) const;
  // Expected tokens an extra verify token must add to pay for its FFN time at `tokens_per_us`
  // (0 with padded tokens: the tier is paid, not the token).
  double MinItemGain(double tokens_per_us) const;
  // Draft time per draft step that is this rank's own, before the barrier: a dense draft run to
  // the rank's depth; 0 when the depth is agreed (its cost is global).
  double RankDraftUs() const;

  std::optional<dspark::SpsTable> sps_;   // DSpark modes, unless dspark_context_sps
  std::vector<std::optional<dspark::SpsTable>> rank_sps_;  // SetDsparkRankTable's, per rank
  LocalState local_;
  std::vector<LocalState> all_local_;     // PlanAll: one per rank
  std::vector<RankSummary> all_summaries_;
  mutable internal::DecideScratch decide_;
};

}  // namespace dpbalance
