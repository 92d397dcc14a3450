// tests/runtime/reference_router.h — the routing strategies written out from their contract
// (runtime/include/dpbalance/routing.h, docs/design.md "Routing"), plainly and slowly, so the
// tests of the runtime Router (routing_test) and of the router ABI (router_abi_test) compare
// against something that is not the code under test.
//
// Every strategy filters by capacity first, then:
//   A  min (requests, context, index)          B  min (context, requests, index)
//   C  input > Px of the last N routed inputs -> A, else B (no history: B)
//   D  limit = (sum of context over the ranks considered / their count) * z;
//      A among fitting ranks under the limit, else B among fitting ranks
//   E  published form: the whole formula over every rank with the request added to one;
//      per-rank model: that rank's attention after adding; ties: fewer requests, more
//      context, lower index. The request counts as input + mean output / 2 at q tokens.
//   G > 1 groups: contiguous blocks [g n / G, (g + 1) n / G); among groups with a fitting rank
//   the min (requests, context) (A) or (context, requests) (B) total, then D inside.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "dpbalance/cost_model.h"
#include "dpbalance/routing.h"

namespace dpbalance::testing {

class ReferenceRouter {
 public:
  ReferenceRouter(RoutingConfig config, int num_ranks, CostModel model)
      : c_(config), n_(num_ranks), model_(std::move(model)) {}

  // The rank, or -1 when no rank fits.
  int Route(const RouteRequest& req, const std::vector<RankLoad>& ranks) {
    int rank = -1;
    if (c_.groups == 1) {
      rank = Pick(c_.strategy, req, ranks, 0, n_);
    } else {
      int best_g = -1;
      std::tuple<int64_t, int64_t> best_key;
      for (int g = 0; g < c_.groups; ++g) {
        const int b = g * n_ / c_.groups, e = (g + 1) * n_ / c_.groups;
        int64_t batch = 0, ctx = 0;
        bool fits = false;
        for (int i = b; i < e; ++i) {
          batch += ranks[i].num_requests;
          ctx += ranks[i].ctx_tokens;
          fits = fits || Fits(req, ranks[i]);
        }
        if (!fits) continue;
        const auto key = c_.group_choice == RoutingStrategy::kMinBatch ? std::make_tuple(batch, ctx)
                                                                       : std::make_tuple(ctx, batch);
        if (best_g < 0 || key < best_key) {
          best_g = g;
          best_key = key;
        }
      }
      if (best_g >= 0) {
        rank = Pick(RoutingStrategy::kDualPath, req, ranks, best_g * n_ / c_.groups,
                    (best_g + 1) * n_ / c_.groups);
      }
    }
    if (rank >= 0 && c_.strategy == RoutingStrategy::kLengthSplit) {
      window_.push_back(req.input_tokens);
      if (static_cast<int>(window_.size()) > c_.split_window) window_.pop_front();
    }
    return rank;
  }
  void ObserveFinished(int64_t output_tokens) {
    ++finished_;
    finished_sum_ += static_cast<double>(output_tokens);
  }

 private:
  static bool Fits(const RouteRequest& req, const RankLoad& r) {
    if (r.max_requests > 0 && r.num_requests >= r.max_requests) return false;
    return r.reserved_tokens + req.input_tokens + req.output_tokens <= r.capacity_tokens;
  }
  // The lowest index among fitting ranks in [b, e) with `ok`, by `key` (smaller is better).
  template <typename Key, typename Ok>
  static int Min(const RouteRequest& req, const std::vector<RankLoad>& ranks, int b, int e, Key key,
                 Ok ok) {
    int best = -1;
    for (int i = b; i < e; ++i) {
      if (!Fits(req, ranks[i]) || !ok(i)) continue;
      if (best < 0 || key(i) < key(best)) best = i;
    }
    return best;
  }
  int Pick(RoutingStrategy s, const RouteRequest& req, const std::vector<RankLoad>& ranks, int b,
           int e) const {
    auto key_a = [&](int i) { return std::make_tuple(ranks[i].num_requests, ranks[i].ctx_tokens); };
    auto key_b = [&](int i) { return std::make_tuple(ranks[i].ctx_tokens, ranks[i].num_requests); };
    auto all = [](int) { return true; };
    switch (s) {
      case RoutingStrategy::kMinBatch: return Min(req, ranks, b, e, key_a, all);
      case RoutingStrategy::kMinContext: return Min(req, ranks, b, e, key_b, all);
      case RoutingStrategy::kLengthSplit: {
        if (window_.empty()) return Min(req, ranks, b, e, key_b, all);
        std::vector<int64_t> w(window_.begin(), window_.end());
        std::sort(w.begin(), w.end());
        const size_t k = std::min(w.size() - 1, static_cast<size_t>(c_.split_percentile * w.size()));
        return req.input_tokens > w[k] ? Min(req, ranks, b, e, key_a, all)
                                       : Min(req, ranks, b, e, key_b, all);
      }
      case RoutingStrategy::kDualPath: {
        double sum = 0;
        for (int i = b; i < e; ++i) sum += static_cast<double>(ranks[i].ctx_tokens);
        const double limit = sum / (e - b) * c_.z;
        const int under = Min(req, ranks, b, e, key_a,
                              [&](int i) { return static_cast<double>(ranks[i].ctx_tokens) < limit; });
        return under >= 0 ? under : Min(req, ranks, b, e, key_b, all);
      }
      case RoutingStrategy::kCostAware: return CostAware(req, ranks, b, e);
    }
    return -1;
  }
  int CostAware(const RouteRequest& req, const std::vector<RankLoad>& ranks, int b, int e) const {
    const double mean_out = finished_ > 0 ? finished_sum_ / finished_ : c_.initial_output_tokens;
    const RequestLoad load{req.input_tokens + static_cast<int64_t>(mean_out / 2),
                           static_cast<int32_t>(c_.query_tokens_per_request)};
    const std::optional<PublishedForm> form = model_.published_form();
    int best = -1;
    double best_cost = 0;
    for (int i = b; i < e; ++i) {
      if (!Fits(req, ranks[i])) continue;
      double cost;
      if (form) {
        std::vector<BatchAggregates> with;
        for (int j = b; j < e; ++j) with.push_back(ranks[j].agg);
        with[i - b].Add(load);
        cost = PublishedInstanceCost(*form, with);
      } else {
        BatchAggregates a = ranks[i].agg;
        a.Add(load);
        cost = model_.AttentionUs(a);
      }
      const bool better =
          best < 0 || cost < best_cost ||
          (cost == best_cost && (ranks[i].num_requests < ranks[best].num_requests ||
                                 (ranks[i].num_requests == ranks[best].num_requests &&
                                  ranks[i].ctx_tokens > ranks[best].ctx_tokens)));
      if (better) {
        best = i;
        best_cost = cost;
      }
    }
    return best;
  }

  RoutingConfig c_;
  int n_;
  CostModel model_;
  std::deque<int64_t> window_;
  double finished_ = 0, finished_sum_ = 0;
};

}  // namespace dpbalance::testing
