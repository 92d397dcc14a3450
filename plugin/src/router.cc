// The router C ABI (dpbalance_router_v1.h): converts and validates, then calls the C++ Router
// the replay runs. No exception, C++ type or absl::Status crosses this boundary.
#include <optional>
#include <string>
#include <vector>

#include "dpbalance/log.h"
#include "dpbalance/plugin/dpbalance_router_v1.h"
#include "dpbalance/routing.h"
#include "flags.h"

namespace dpbalance::plugin {
namespace {

struct RouterContext {
  Router router;
  int32_t num_ranks;
  int32_t query_tokens;  // E's typical q per request, as the replay's loads carry it
  std::vector<RankLoad> loads;
};

// The first field of `l` that no real rank has, or nullopt.
std::optional<std::string> BadField(const dpbRankLoad_v1_t& l) {
  if (l.num_requests < 0) return "num_requests = " + std::to_string(l.num_requests);
  if (l.max_requests < 0) return "max_requests = " + std::to_string(l.max_requests);
  if (l.ctx_tokens < 0) return "ctx_tokens = " + std::to_string(l.ctx_tokens);
  if (l.max_ctx_tokens < 0 || l.max_ctx_tokens > l.ctx_tokens) {
    return "max_ctx_tokens = " + std::to_string(l.max_ctx_tokens) + " (ctx_tokens " +
           std::to_string(l.ctx_tokens) + ")";
  }
  if (l.reserved_tokens < 0) return "reserved_tokens = " + std::to_string(l.reserved_tokens);
  if (l.capacity_tokens < 0) return "capacity_tokens = " + std::to_string(l.capacity_tokens);
  return std::nullopt;
}

dpbResult_t Create(const dpbRouterArgs_v1_t* args, void** router) {
  try {
    if (router == nullptr) return dpbInvalidArgument;
    *router = nullptr;
    if (args == nullptr) return dpbInvalidArgument;
    absl::StatusOr<PluginFlags> f = ParseFlags(DpbEnvironment(), args->config ? args->config : "");
    if (!f.ok()) {
      Logger()->error("router create: {}", std::string(f.status().message()));
      return dpbInvalidArgument;
    }
    SetLogLevel(f->log_level);
    absl::StatusOr<Router> r = Router::Create(f->routing, args->num_ranks, f->balancer.model);
    if (!r.ok()) {
      Logger()->error("router create: {}", std::string(r.status().message()));
      return dpbInvalidArgument;
    }
    *router = new RouterContext{*std::move(r), args->num_ranks,
                                static_cast<int32_t>(f->routing.query_tokens_per_request), {}};
    return dpbSuccess;
  } catch (...) {
    Logger()->error("router create: internal error");
    return dpbInternalError;
  }
}

dpbResult_t Route(void* router, const dpbRankLoad_v1_t* loads, int32_t num_ranks,
                  int64_t input_tokens, int64_t output_tokens, int32_t* rank) {
  if (rank != nullptr) *rank = -1;
  auto* ctx = static_cast<RouterContext*>(router);
  if (ctx == nullptr || loads == nullptr || rank == nullptr) return dpbInvalidArgument;
  try {
    if (num_ranks != ctx->num_ranks) {
      Logger()->error("route: {} rank loads for a router of {} ranks", num_ranks, ctx->num_ranks);
      return dpbInvalidArgument;
    }
    ctx->loads.resize(num_ranks);
    for (int32_t i = 0; i < num_ranks; ++i) {
      const dpbRankLoad_v1_t& l = loads[i];
      if (std::optional<std::string> bad = BadField(l)) {
        Logger()->error("route: rank {} load has {}", i, *bad);
        return dpbInvalidArgument;
      }
      RankLoad& r = ctx->loads[i];
      r.num_requests = l.num_requests;
      r.max_requests = l.max_requests;
      r.ctx_tokens = l.ctx_tokens;
      r.reserved_tokens = l.reserved_tokens;
      r.capacity_tokens = l.capacity_tokens;
      r.agg = TypicalBatchAggregates(l.num_requests, l.ctx_tokens, l.max_ctx_tokens,
                                     ctx->query_tokens);
    }
    absl::StatusOr<int> r = ctx->router.Route({input_tokens, output_tokens}, ctx->loads);
    if (r.ok()) {
      *rank = *r;
      return dpbSuccess;
    }
    if (r.status().code() == absl::StatusCode::kResourceExhausted) return dpbFallback;  // waits
    Logger()->error("route: {}", std::string(r.status().message()));
    return dpbInvalidArgument;
  } catch (...) {
    Logger()->error("route: internal error");
    return dpbInternalError;
  }
}

dpbResult_t ObserveFinished(void* router, int64_t output_tokens) {
  auto* ctx = static_cast<RouterContext*>(router);
  if (ctx == nullptr) return dpbInvalidArgument;
  if (output_tokens < 0) {
    Logger()->error("observe_finished: output_tokens = {} must be >= 0", output_tokens);
    return dpbInvalidArgument;
  }
  ctx->router.ObserveFinished(output_tokens);
  return dpbSuccess;
}

dpbResult_t Destroy(void* router) {
  delete static_cast<RouterContext*>(router);
  return dpbSuccess;
}

}  // namespace
}  // namespace dpbalance::plugin

extern "C" __attribute__((visibility("default"))) const dpbalanceRouter_v1_t dpbalanceRouter_v1 = {
    "dpbalance", dpbalance::plugin::Create, dpbalance::plugin::Route,
    dpbalance::plugin::ObserveFinished, dpbalance::plugin::Destroy};
