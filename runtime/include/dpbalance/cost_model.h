// dpbalance/cost_model.h — predicted decode-step time of one DP rank and of the instance.
//
// Contract
// - A rank's batch is a list of requests, each with `ctx_tokens` (keys it attends, its context)
//   and `query_tokens` (q_i = 1 + k_i, k_i = draft tokens verified this step).
// - `CostModel` is linear in a fixed set of per-rank features (sums, maxima, critical-path and
//   wave terms, roofline knees), each with a base coefficient and per-kernel-path extras. Published forms, fitted forms and online refits are all coefficient sets
//   of this one class, so the planner, the replay and the plugin share one implementation.
//   Every prediction is in microseconds. Coefficients are non-negative for physical features.
// - `GlobalCost` is the instance-wide part of a step: MoE FFN + EP communication as a function
//   of the instance's tokens, a fixed per-step overhead, and the draft cost per draft step.
// - Step time of the instance (the form used everywhere, see docs/cost-model.md):
//     step_us = max_r attention_us(rank r) + global.StepUs(tokens, draft_depth)
//   `PublishedInstanceCost` evaluates the published V1/V2 formulas exactly (with their two
//   separate max() terms) for scoring against the published study.
// - Thread safety: all methods are const and thread-compatible.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dpbalance/kernel_grid.h"

namespace dpbalance {

// One request's load in one decode step.
struct RequestLoad {
  int64_t ctx_tokens = 0;    // keys attended (context incl. tokens being verified), >= 0
  int32_t query_tokens = 1;  // q_i = 1 + verify_len, >= 1
};

// Per-rank terms of a batch. Each has a base coefficient and extras for the two kernel paths:
// every q_i = 1 (the split-KV decode path) or some q_i > 1 (the varlen/verify path); the fit
// decides which matter. The banks of hinge terms (waves over keys and
// over query-key pairs at several widths, GEMM knees at several token counts) let non-negative
// combinations express convex piecewise-linear costs: critical paths, wave quantisation and
// roofline knees, without a per-kernel constant. All terms follow from `BatchAggregates`, which
// updates one query token at a time, so the planner evaluates its frontier exactly.
enum class CostTerm : int {
  kConstant = 0,          // 1 (launch and fixed cost)
  kNumRequests,           // B: number of requests
  kQueryTokens,           // Q = sum q_i
  kQueryKeyPairs,         // C = sum q_i * ctx_i   (attention FLOPs)
  kKeyTokens,             // K = sum ctx_i         (KV bytes read)
  kMaxQueryKeyPairs,      // max_i q_i * ctx_i     (critical path, rows x keys)
  kMaxKeyTokens,          // max_i ctx_i           (critical path: one request's blocks)
  kWaveKeys0,             // max(K / w, max ctx) for w in kWaveWidths (a bank)
  kWavePairs0 = kWaveKeys0 + 8,  // max(C / w, max ctx) for w in kWaveWidths
  kKnee0 = kWavePairs0 + 8,      // max(0, Q - k) for k in kKneeTokens (a bank)
  kGrid0 = kKnee0 + 6,           // the kernel grid's simulated terms (kernel_grid.h, GridTerm)
  kNumTerms = kGrid0 + kNumGridTerms
};
// Terms before the hinge banks are read straight off the aggregates.
inline constexpr int kNumPlainTerms = static_cast<int>(CostTerm::kWaveKeys0);
inline constexpr double kWaveWidths[8] = {1, 2, 4, 8, 16, 32, 64, 128};
inline constexpr double kKneeTokens[6] = {16, 32, 64, 128, 256, 512};
// Each term has a base coefficient (every batch) and non-negative extras that apply only on one
// kernel path: kSingleQuery (every q_i = 1) or kMultiQuery (some q_i > 1). Shared and fully
// split regimes are both special cases; the fit chooses.
enum class Regime : int { kBase = 0, kMultiQuery = 1, kSingleQuery = 2 };
inline constexpr int kNumCostTerms = static_cast<int>(CostTerm::kNumTerms);
inline constexpr int kNumCostFeatures = 3 * kNumCostTerms;
constexpr int FeatureIndex(Regime r, CostTerm t, int bank_idx = 0) {
  return static_cast<int>(r) * kNumCostTerms + static_cast<int>(t) + bank_idx;
}
// "constant", "wave_keys_w4", "knee_128", ...; "multi_" / "single_" + that for the extras.
std::string FeatureName(int feature_idx);

// A batch's kernel-grid terms, for models with a KernelGrid: simulated once per kernel path at
// a reference batch (its query tokens and query-key pairs), then moved linearly with the
// verify launch's slopes as query tokens are added. Invalid (all grid terms 0) unless filled
// by `CostModel::FillGrid` or `FillGridState`.
struct GridState {
  bool valid = false;
  std::array<GridTerms, 2> at_ref{};  // [0]: the launch with every q_i = 1, [1]: the verify launch
  double ref_tokens = 0;
  double ref_pairs = 0;
};

// Aggregates from which every feature is derived; cheap to update incrementally.
struct BatchAggregates {
  double num_requests = 0;
  double query_tokens = 0;
  double query_key_pairs = 0;
  double key_tokens = 0;
  double max_query_key_pairs = 0;
  double max_key_tokens = 0;
  bool multi_query = false;
  GridState grid;

  void Add(const RequestLoad& r) {
    const double q = r.query_tokens, ctx = static_cast<double>(r.ctx_tokens);
    num_requests += 1;
    query_tokens += q;
    query_key_pairs += q * ctx;
    key_tokens += ctx;
    max_query_key_pairs = std::max(max_query_key_pairs, q * ctx);
    max_key_tokens = std::max(max_key_tokens, ctx);
    multi_query = multi_query || r.query_tokens > 1;
  }
  // One more query token for a request whose load was `before` (ctx unchanged).
  void AddQueryToken(const RequestLoad& before) {
    const double ctx = static_cast<double>(before.ctx_tokens);
    query_tokens += 1;
    query_key_pairs += ctx;
    max_query_key_pairs = std::max(max_query_key_pairs, (before.query_tokens + 1.0) * ctx);
    multi_query = true;
  }
  // The fields AddQueryToken changes: hot loops try a token in place and restore these, rather
  // than copying the aggregates with their grid state (sums of whole tokens are exact in double).
  struct TokenMark {
    double query_tokens, query_key_pairs, max_query_key_pairs;
    bool multi_query;
  };
  TokenMark Mark() const { return {query_tokens, query_key_pairs, max_query_key_pairs, multi_query}; }
  void Restore(const TokenMark& m) {
    query_tokens = m.query_tokens;
    query_key_pairs = m.query_key_pairs;
    max_query_key_pairs = m.max_query_key_pairs;
    multi_query = m.multi_query;
  }
};

// The two published formulas (docs/cost-model.md, "The published forms").
enum class PublishedForm { kV1, kV2 };

class CostModel {
 public:
  using Weights = std::array<double, kNumCostFeatures>;

  CostModel() = default;
  // Weights in microseconds per unit of each feature.
  // `grid`: the kernel launch the grid terms describe (none: they stay 0).
  static absl::StatusOr<CostModel> Create(const Weights& weights_us, std::string name,
                                          const KernelGrid& grid = KernelGrid{});

  // The published formulas as one per-rank scalar (single barrier) with B -> sum q_i,
  // C -> sum q_i * ctx_i; the cost units are read as milliseconds. See docs/cost-model.md.
  static CostModel PublishedV1();
  static CostModel PublishedV2();

  // Loads a model file written by dpbalance-calibrate (JSON). Errors name the file and field.
  static absl::StatusOr<CostModel> FromFile(const std::string& path);
  // A model named the way flags name one: "v1", "v2", "v1+GRID" / "v2+GRID" (the published form
  // with a KernelGrid::Named grid whose makespans are seeded, `WithSeededGrid`), or a JSON file.
  // Errors name the spec.
  static absl::StatusOr<CostModel> FromSpec(std::string_view spec);
  // A copy with `grid`, and a small weight (kGridSeedUs) on every makespan term of both kernel
  // paths that has none: the terms are then simulated and an online refit can learn their
  // weights (it only learns terms its starting model weighs). The seed adds microseconds at most.
  static constexpr double kGridSeedUs = 1e-3;  // per key-block iteration of the makespan
  CostModel WithSeededGrid(const KernelGrid& grid) const;
  static absl::StatusOr<CostModel> FromJson(std::string_view json_text, std::string_view source);
  std::string ToJson() const;

  // Predicted attention time of one rank in microseconds. The span form simulates the kernel
  // grid when the model has one (`Aggregate`).
  double AttentionUs(absl::Span<const RequestLoad> batch) const;
  double AttentionUs(const BatchAggregates& agg) const;
  // Feature vector of a batch (what a fit regresses on).
  Weights Features(const BatchAggregates& agg) const;

  const Weights& weights_us() const { return weights_us_; }
  const KernelGrid& kernel_grid() const { return grid_; }
  // Whether any grid term has a nonzero weight (then aggregates need `FillGrid`).
  bool uses_grid() const { return grid_.enabled() && (grid_mask_[0] | grid_mask_[1]) != 0; }
  // The aggregates of `batch`, with the grid terms simulated when the model uses them, for the
  // launch the batch runs only (what its cost and features read). A caller that then adds
  // query tokens to a batch of single-query requests needs `FillGrid` with both paths.
  // The grid is simulated as `grid_simulation()` says.
  BatchAggregates Aggregate(absl::Span<const RequestLoad> batch) const;
  // Simulates the grid terms of `batch` (whose aggregates `agg` are) for the kernel paths in
  // `paths` (bit 0: every q_i = 1, bit 1: the verify launch; default both), each only the
  // simulated terms its path weighs; no-op unless `uses_grid()`.
  void FillGrid(absl::Span<const RequestLoad> batch, BatchAggregates* agg, unsigned paths = 3u) const;
  // How this model simulates its grid (kernel_grid.h): the rule it was fitted under. kReference
  // unless its file says "grid_simulation": "fast" (`dpbalance-calibrate --grid_sim fast`); a
  // planner may price with a copy under another rule (`WithGridSimulation`, PlannerConfig::
  // grid_simulation): the same weights, priced differently (docs/cost-model.md measures it).
  GridSimulation grid_simulation() const { return grid_sim_; }
  CostModel WithGridSimulation(GridSimulation sim) const;

  const std::string& name() const { return name_; }
  // The published formula this model is the per-rank form of: set by PublishedV1/V2 (flags "v1",
  // "v2") and kept by Scaled; none for every other model (fits, grids, files). Cost-aware routing
  // then prices the instance as the formula does, with its two separate max() terms; the planner
  // and the balancer never read it.
  std::optional<PublishedForm> published_form() const { return published_form_; }
  // Returns a copy with every coefficient multiplied by `factor` (> 0).
  CostModel Scaled(double factor) const;
  // The fit's cross-validated error (mean absolute percentage error over out-of-fold rows, as a
  // fraction), when the model was fitted with it (dpbalance-calibrate --cv writes it to the
  // model file as "cv_mape"); 0: unknown. The plugin's default guard takes it as its margin
  // (docs/flags.md, DPB_MIN_PLAN_GAIN).
  double cv_mape() const { return cv_mape_; }
  CostModel WithCvMape(double cv_mape) const;

 private:
  void IndexActiveTerms();
  double TermValue(const BatchAggregates& agg, int term) const;

  Weights weights_us_{};
  std::string name_ = "zero";
  std::optional<PublishedForm> published_form_;
  double cv_mape_ = 0;
  KernelGrid grid_;
  GridSlopes grid_slopes_;
  GridSimulation grid_sim_ = GridSimulation::kReference;
  std::array<unsigned, 2> grid_mask_{};  // per path: bit t - kGrid0 set if grid term t is weighed
  // Evaluation form, per kernel path (0: single query, 1: multi query): the base weights plus
  // the path's extras. The seven plain terms are one dot product; of the hinge banks only the
  // terms with a nonzero weight are evaluated. The planner calls this per knot and per item.
  struct Path {
    std::array<double, kNumPlainTerms> plain{};
    std::array<uint8_t, kNumCostTerms> hinge{};
    std::array<double, kNumCostTerms> hinge_w{};
    int num_hinges = 0;
  };
  std::array<Path, 2> paths_{};
};

// Fills `agg->grid` for `grid` from `batch` (whose aggregates `agg` are), for the kernel paths
// in `paths` (bit 0: the launch with every q_i = 1, bit 1: the verify launch). `single_mask` and
// `multi_mask` select each launch's simulated terms (bit t: grid term t); counts and work are
// always filled. Where both paths are one launch (PathsShareLaunch: packed rows) and both are
// asked for, it is simulated once for the terms of both (KeepGridTerms: the same to the bit).
void FillGridState(const KernelGrid& grid, absl::Span<const RequestLoad> batch,
                   unsigned single_mask, unsigned multi_mask, unsigned paths,
                   BatchAggregates* agg, GridSimulation sim = GridSimulation::kReference);

// The instance-wide part of a step (identical on every rank).
struct GlobalCost {
  double ffn_fixed_us = 20000.0;       // MoE FFN + EP comm at zero tokens (replay default 20 ms)
  double ffn_per_token_us = 2.0;       // per instance query token (replay default 0.002 ms)
  double step_overhead_us = 0.0;       // scheduler, sampling, launch
  double draft_per_step_us = 1500.0;   // one draft step (replay default 1.5 ms, MTP with MoE)
  bool padded_tokens = false;          // FFN sees num_ranks * max rank tokens (CUDA-graph padding)

  double StepUs(double ffn_tokens, int draft_depth) const {
    return ffn_fixed_us + ffn_per_token_us * ffn_tokens + step_overhead_us +
           draft_per_step_us * draft_depth;
  }
  absl::Status Validate() const;
  uint64_t Hash() const;
};

// The published V1/V2 instance cost with separate max() terms: the score of the published study,
// and what cost-aware routing minimises when its model is a published one (routing.h).
// `ranks[r]` is rank r's batch. Returns cost in the published units.
double PublishedInstanceCost(PublishedForm form, absl::Span<const BatchAggregates> ranks);
// Per-rank value of the same formula (each max() term evaluated on that rank alone).
double PublishedRankCost(PublishedForm form, const BatchAggregates& rank);
// The arguments of the formula's two max() terms for one rank (B, and B + s * C), and the cost
// given each term's maximum over the ranks: PublishedInstanceCost is the second applied to the
// elementwise maxima of the first.
struct PublishedTerms {
  double batch = 0;
  double mix = 0;
};
PublishedTerms PublishedTermsOf(PublishedForm form, const BatchAggregates& rank);
double PublishedCostOfMaxima(PublishedForm form, const PublishedTerms& maxima);

}  // namespace dpbalance
