#include "dpbalance/routing.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dpbalance {

std::string_view RoutingName(RoutingStrategy s) {
  switch (s) {
    case RoutingStrategy::kMinBatch: return "A";
    case RoutingStrategy::kMinContext: return "B";
    case RoutingStrategy::kLengthSplit: return "C";
    case RoutingStrategy::kDualPath: return "D";
    case RoutingStrategy::kCostAware: return "E";
  }
  return "?";
}

BatchAggregates TypicalBatchAggregates(int32_t num_requests, int64_t ctx_tokens,
                                       int64_t max_ctx_tokens, int32_t query_tokens) {
  const double q = query_tokens;
  BatchAggregates a;
  a.num_requests = num_requests;
  a.query_tokens = q * num_requests;
  a.query_key_pairs = q * static_cast<double>(ctx_tokens);
  a.key_tokens = static_cast<double>(ctx_tokens);
  a.max_query_key_pairs = q * static_cast<double>(max_ctx_tokens);
  a.max_key_tokens = static_cast<double>(max_ctx_tokens);
  a.multi_query = num_requests > 0 && query_tokens > 1;
  return a;
}

absl::StatusOr<RoutingStrategy> ParseRouting(std::string_view name) {
  for (RoutingStrategy s : {RoutingStrategy::kMinBatch, RoutingStrategy::kMinContext,
                            RoutingStrategy::kLengthSplit, RoutingStrategy::kDualPath,
                            RoutingStrategy::kCostAware}) {
    if (name == RoutingName(s)) return s;
  }
  if (name == "cost") return RoutingStrategy::kCostAware;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown routing '", std::string(name), "' (expected A, B, C, D or E)"));
}

absl::Status RoutingConfig::Validate(int num_ranks) const {
  if (!(z > 0)) return absl::InvalidArgumentError(absl::StrFormat("routing: z = %g must be > 0", z));
  if (!(split_percentile > 0 && split_percentile < 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("routing: split percentile %g must be in (0, 1)", split_percentile));
  }
  if (split_window < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("routing: split window %d must be >= 1", split_window));
  }
  if (groups < 1 || groups > num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrFormat("routing: groups = %d must be in 1..num_ranks (%d)", groups, num_ranks));
  }
  if (group_choice != RoutingStrategy::kMinBatch && group_choice != RoutingStrategy::kMinContext) {
    return absl::InvalidArgumentError("routing: group choice must be A or B");
  }
  if (!(query_tokens_per_request >= 1) || !(initial_output_tokens >= 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "routing: query_tokens_per_request %g must be >= 1 and initial_output_tokens %g >= 0",
        query_tokens_per_request, initial_output_tokens));
  }
  return absl::OkStatus();
}

absl::StatusOr<Router> Router::Create(RoutingConfig config, int num_ranks, CostModel model) {
  if (num_ranks < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("routing: num_ranks = %d", num_ranks));
  }
  if (absl::Status s = config.Validate(num_ranks); !s.ok()) return s;
  return Router(config, num_ranks, std::move(model));
}

void Router::ObserveFinished(int64_t output_tokens) {
  finished_ += 1;
  finished_output_sum_ += static_cast<double>(output_tokens);
}

bool Router::Fits(const RouteRequest& req, const RankLoad& r) const {
  if (r.max_requests > 0 && r.num_requests >= r.max_requests) return false;
  return r.reserved_tokens + req.input_tokens + req.output_tokens <= r.capacity_tokens;
}

// Best rank in [begin, end) by strategy `s` among ranks that fit; -1 if none fits.
int Router::PickIn(RoutingStrategy s, const RouteRequest& req, absl::Span<const RankLoad> ranks,
                   int begin, int end) const {
  auto better_a = [&](int i, int j) {  // A: batch, then context
    if (ranks[i].num_requests != ranks[j].num_requests) return ranks[i].num_requests < ranks[j].num_requests;
    return ranks[i].ctx_tokens < ranks[j].ctx_tokens;
  };
  auto better_b = [&](int i, int j) {  // B: context, then batch
    if (ranks[i].ctx_tokens != ranks[j].ctx_tokens) return ranks[i].ctx_tokens < ranks[j].ctx_tokens;
    return ranks[i].num_requests < ranks[j].num_requests;
  };
  auto pick = [&](auto better, auto eligible) {
    int best = -1;
    for (int i = begin; i < end; ++i) {
      if (!Fits(req, ranks[i]) || !eligible(i)) continue;
      if (best < 0 || better(i, best)) best = i;
    }
    return best;
  };
  auto any = [](int) { return true; };
  switch (s) {
    case RoutingStrategy::kMinBatch: return pick(better_a, any);
    case RoutingStrategy::kMinContext: return pick(better_b, any);
    case RoutingStrategy::kLengthSplit: {
      // Px of the last N inputs (the window excludes this request).
      int64_t threshold = std::numeric_limits<int64_t>::max();
      if (!recent_inputs_.empty()) {
        std::vector<int64_t> w(recent_inputs_.begin(), recent_inputs_.end());
        const size_t k = std::min(w.size() - 1, static_cast<size_t>(config_.split_percentile * w.size()));
        std::nth_element(w.begin(), w.begin() + k, w.end());
        threshold = w[k];
      }
      return req.input_tokens > threshold ? pick(better_a, any) : pick(better_b, any);
    }
    case RoutingStrategy::kDualPath: {
      double usage = 0;
      for (int i = begin; i < end; ++i) usage += static_cast<double>(ranks[i].ctx_tokens);
      const double limit = usage / (end - begin) * config_.z;
      const int under = pick(better_a, [&](int i) { return ranks[i].ctx_tokens < limit; });
      return under >= 0 ? under : pick(better_b, any);
    }
    case RoutingStrategy::kCostAware: return PickCostAware(req, ranks, begin, end);
  }
  return -1;
}

namespace {

// The largest value over ranks and the largest over every rank but the argmax, so the maximum
// without any one rank is O(1).
struct LargestTwo {
  double largest = 0, second_largest = 0;
  int largest_rank = -1;
  void Add(int rank, double v) {
    if (largest_rank < 0 || v > largest) {
      second_largest = largest_rank < 0 ? 0 : largest;
      largest = v;
      largest_rank = rank;
    } else {
      second_largest = std::max(second_largest, v);
    }
  }
  double MaxWithout(int rank) const { return rank == largest_rank ? second_largest : largest; }
};

}  // namespace

int Router::PickCostAware(const RouteRequest& req, absl::Span<const RankLoad> ranks, int begin,
                          int end) const {
  const double mean_out =
      finished_ > 0 ? finished_output_sum_ / finished_ : config_.initial_output_tokens;
  const RequestLoad load{req.input_tokens + static_cast<int64_t>(mean_out / 2),
                         static_cast<int32_t>(config_.query_tokens_per_request)};
  const std::optional<PublishedForm> form = model_.published_form();
  LargestTwo max_batch, max_mix;  // published form: each max() term over the instance's ranks
  if (form) {
    for (int i = begin; i < end; ++i) {
      const PublishedTerms t = PublishedTermsOf(*form, ranks[i].agg);
      max_batch.Add(i, t.batch);
      max_mix.Add(i, t.mix);
    }
  }
  // Ordered by: predicted cost (see routing.h), fewer requests, more context, lower index.
  int best = -1;
  double best_cost = 0;
  for (int i = begin; i < end; ++i) {
    if (!Fits(req, ranks[i])) continue;
    BatchAggregates a = ranks[i].agg;
    a.Add(load);
    double cost;
    if (form) {
      const PublishedTerms t = PublishedTermsOf(*form, a);
      cost = PublishedCostOfMaxima(*form, {std::max(max_batch.MaxWithout(i), t.batch),
                                           std::max(max_mix.MaxWithout(i), t.mix)});
    } else {
      cost = model_.AttentionUs(a);
    }
    if (best >= 0) {
      const RankLoad &r = ranks[i], &b = ranks[best];
      if (cost != best_cost) {
        if (cost > best_cost) continue;
      } else if (r.num_requests != b.num_requests) {
        if (r.num_requests > b.num_requests) continue;
      } else if (r.ctx_tokens <= b.ctx_tokens) {
        continue;
      }
    }
    best = i;
    best_cost = cost;
  }
  return best;
}

absl::StatusOr<int> Router::Route(const RouteRequest& req, absl::Span<const RankLoad> ranks) {
  if (ranks.size() != static_cast<size_t>(num_ranks_)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("routing: %d rank loads for %d ranks", ranks.size(), num_ranks_));
  }
  if (req.input_tokens < 0 || req.output_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "routing: request with input_tokens %d, output_tokens %d", req.input_tokens, req.output_tokens));
  }
  int rank = -1;
  if (config_.groups == 1) {
    rank = PickIn(config_.strategy, req, ranks, 0, num_ranks_);
  } else {
    // Step 1: the group by A or B over group totals, among groups where the request fits.
    int best_g = -1;
    int64_t best_batch = 0, best_ctx = 0;
    for (int g = 0; g < config_.groups; ++g) {
      const int b = g * num_ranks_ / config_.groups, e = (g + 1) * num_ranks_ / config_.groups;
      int64_t batch = 0, ctx = 0;
      bool fits = false;
      for (int i = b; i < e; ++i) {
        batch += ranks[i].num_requests;
        ctx += ranks[i].ctx_tokens;
        fits = fits || Fits(req, ranks[i]);
      }
      if (!fits) continue;
      const bool by_batch = config_.group_choice == RoutingStrategy::kMinBatch;
      const bool better = best_g < 0 ||
                          (by_batch ? (batch < best_batch || (batch == best_batch && ctx < best_ctx))
                                    : (ctx < best_ctx || (ctx == best_ctx && batch < best_batch)));
      if (better) {
        best_g = g;
        best_batch = batch;
        best_ctx = ctx;
      }
    }
    // Step 2: D inside the group.
    if (best_g >= 0) {
      rank = PickIn(RoutingStrategy::kDualPath, req, ranks, best_g * num_ranks_ / config_.groups,
                    (best_g + 1) * num_ranks_ / config_.groups);
    }
  }
  if (rank >= 0 && config_.strategy == RoutingStrategy::kLengthSplit) {
    recent_inputs_.push_back(req.input_tokens);
    if (static_cast<int>(recent_inputs_.size()) > config_.split_window) recent_inputs_.pop_front();
  }
  if (rank < 0) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "routing: no rank has capacity for a request of %d + %d tokens", req.input_tokens,
        req.output_tokens));
  }
  return rank;
}

}  // namespace dpbalance
