// dpbalance/routing.h — request-level DP rank selection (what an engine's DP router calls).
//
// Contract
// - `Router::Route(request, ranks)` returns the rank index for a new request, or
//   ResourceExhausted when no rank has the KV capacity and batch room for it (the request then
//   waits).
// - Every strategy first drops ranks at their batch cap (`max_requests`) or whose reserved
//   tokens + the request's input and output tokens exceed their KV capacity (the published
//   comparison of A-D filters by capacity too: docs/design.md, "Routing"), then picks:
//     A  min batch (requests), ties by min context
//     B  min total context tokens, ties by min batch
//     C  request longer than the Px percentile of the last N requests -> A, else -> B
//     D  DualPath: ranks with token usage < avg * Z -> A among them, else B
//     E  cost-aware (ours): the rank where adding the request least raises the instance's
//        predicted attention cost, priced by the cost model the planner uses with the request's
//        context taken at the middle of its expected stay. How the model prices an instance:
//        - a per-rank model (fits, kernel grids): the barrier, max over ranks of the rank's
//          time; E takes the rank whose time after adding is lowest (water-filling);
//        - a published formula (`CostModel::published_form`, flags "v1"/"v2"): the formula
//          itself, with its two separate max() terms (`PublishedInstanceCost`); most ranks then
//          leave it unchanged, and E takes among them the fewest requests, then the most context
//          (best fit: the emptier ranks keep room for a long request).
//        Remaining ties: fewest requests, most context, lowest index. See docs/design.md.
//        E reads `RankLoad::agg` as given and adds the request with `BatchAggregates::Add`,
//        which does not simulate a kernel grid: a grid model's simulated terms read 0 unless
//        the caller filled them, and they do not move with the added request.
//   With G > 1 groups (contiguous blocks of ranks), a group is chosen first by A or B over the
//   groups' totals (among groups with a rank that fits), then D inside it.
// - Deterministic: ties break towards the lower rank index.
// - Not thread-safe (C keeps a window of recent lengths; E a running output mean).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dpbalance/cost_model.h"

namespace dpbalance {

enum class RoutingStrategy { kMinBatch, kMinContext, kLengthSplit, kDualPath, kCostAware };
// "A", "B", "C", "D" and "E" (also "cost").
std::string_view RoutingName(RoutingStrategy s);
absl::StatusOr<RoutingStrategy> ParseRouting(std::string_view name);

struct RoutingConfig {
  RoutingStrategy strategy = RoutingStrategy::kDualPath;
  double z = 1.2;                    // D: usage threshold factor over the average
  double split_percentile = 0.9;     // C: Px as a fraction
  int split_window = 1000;           // C: N recent requests
  int groups = 1;                    // G >= 1
  RoutingStrategy group_choice = RoutingStrategy::kMinBatch;  // A or B
  double query_tokens_per_request = 4;   // E: typical q (1 + verify length)
  double initial_output_tokens = 300;    // E: expected output before any request finished

  absl::Status Validate(int num_ranks) const;
};

// A rank's load as the router sees it.
struct RankLoad {
  int32_t num_requests = 0;
  int64_t ctx_tokens = 0;       // sum of current contexts (token usage)
  int64_t reserved_tokens = 0;  // KV reserved: contexts + remaining outputs of its requests
  int64_t capacity_tokens = 0;  // KV capacity
  int32_t max_requests = 0;     // batch cap (0: none)
  BatchAggregates agg;          // for E: the batch at typical q (see RoutingConfig)
};

// `RankLoad::agg` from a rank's summaries: `num_requests` requests, each at `query_tokens`
// (RoutingConfig's typical q), with contexts summing to `ctx_tokens` and the longest
// `max_ctx_tokens`. Equals adding the requests one by one with `BatchAggregates::Add` at that q
// (sums of whole tokens are exact in double); the kernel grid terms stay 0.
BatchAggregates TypicalBatchAggregates(int32_t num_requests, int64_t ctx_tokens,
                                       int64_t max_ctx_tokens, int32_t query_tokens);

struct RouteRequest {
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;  // footprint for the capacity filter (engines reserve max_tokens)
};

class Router {
 public:
  static absl::StatusOr<Router> Create(RoutingConfig config, int num_ranks, CostModel model);
  absl::StatusOr<int> Route(const RouteRequest& req, absl::Span<const RankLoad> ranks);
  // Feeds E's running mean of output lengths (call when a request finishes).
  void ObserveFinished(int64_t output_tokens);
  const RoutingConfig& config() const { return config_; }

 private:
  Router(RoutingConfig c, int n, CostModel m) : config_(c), num_ranks_(n), model_(std::move(m)) {}
  int PickIn(RoutingStrategy s, const RouteRequest& req, absl::Span<const RankLoad> ranks,
             int begin, int end) const;
  int PickCostAware(const RouteRequest& req, absl::Span<const RankLoad> ranks, int begin,
                    int end) const;
  bool Fits(const RouteRequest& req, const RankLoad& r) const;

  RoutingConfig config_;
  int num_ranks_;
  CostModel model_;
  std::deque<int64_t> recent_inputs_;
  double finished_ = 0, finished_output_sum_ = 0;
};

}  // namespace dpbalance
