// The C ABI: converts and validates, then calls the C++ Balancer. No exception, C++ type or
// absl::Status crosses this boundary; every failure is a result code and the default lengths.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "dpbalance/balancer.h"
#include "dpbalance/inprocess_allgather.h"
#include "dpbalance/log.h"
#include "dpbalance/nccl_allgather.h"
#include "dpbalance/plugin/dpbalance_plugin_v1.h"
#include "flags.h"

namespace dpbalance::plugin {
namespace {

struct Context {
  std::unique_ptr<Balancer> balancer;
  int32_t default_k = 0;
  int32_t k_min = 0;
  std::vector<BalancerRequest> requests;
  std::vector<BalancerAccepted> accepted;
};

void DefaultLengths(const dpbRequest_v1_t* req, int32_t n, int32_t default_k, int32_t* out) {
  for (int32_t i = 0; i < n; ++i) out[i] = DefaultVerifyLen(default_k, req[i].k_cap);
}

absl::StatusOr<std::unique_ptr<AllGather>> MakeBackend(const dpbInitArgs_v1_t& a, const PluginFlags& f) {
  dpbBackend_t b = a.backend;
  if (b == dpbBackendFromFlags) {
    b = f.backend == "inproc" ? dpbBackendInProcess : f.backend == "callback" ? dpbBackendCallback : dpbBackendNccl;
  }
  switch (b) {
    case dpbBackendInProcess: {
      absl::StatusOr<std::shared_ptr<InProcessGroup>> g =
          InProcessGroup::Named(f.group, a.num_ranks, sizeof(RankSummary));
      if (!g.ok()) return g.status();
      return (*g)->Join(a.rank);
    }
    case dpbBackendCallback:
      return MakeCallbackAllGather(a.num_ranks, a.rank, sizeof(RankSummary), a.allgather_fn, a.allgather_user);
    case dpbBackendNccl: {
      NcclAllGatherOptions o;
      o.num_ranks = a.num_ranks;
      o.rank = a.rank;
      o.record_bytes = sizeof(RankSummary);
      o.comm = a.nccl_comm;
      o.stream = a.cuda_stream;
      o.unique_id = a.nccl_unique_id;
      o.device = a.cuda_device;
      return MakeNcclAllGather(o);
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown backend ", static_cast<int>(b)));
  }
}

dpbResult_t Init(const dpbInitArgs_v1_t* args, void** context) {
  try {
    if (context == nullptr || args == nullptr) return dpbInvalidArgument;
    *context = nullptr;
    absl::StatusOr<PluginFlags> f = ParseFlags(DpbEnvironment(), args->config ? args->config : "");
    if (!f.ok()) {
      Logger()->error("init: {}", std::string(f.status().message()));
      return dpbInvalidArgument;
    }
    SetLogLevel(f->log_level);
    f->balancer.planner.num_ranks = args->num_ranks;
    if (args->num_ranks < 1 || args->rank < 0 || args->rank >= args->num_ranks) {
      Logger()->error("init: rank {} of num_ranks {} is out of range", args->rank, args->num_ranks);
      return dpbInvalidArgument;
    }
    absl::StatusOr<std::unique_ptr<AllGather>> comm = MakeBackend(*args, *f);
    if (!comm.ok()) {
      Logger()->error("init rank {}: all-gather backend: {}", args->rank, std::string(comm.status().message()));
      return dpbInvalidArgument;
    }
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Create(f->balancer, args->rank, *std::move(comm));
    if (!b.ok()) {
      Logger()->error("init rank {}: {}", args->rank, std::string(b.status().message()));
      return dpbInvalidArgument;
    }
    auto ctx = std::make_unique<Context>();
    ctx->default_k = f->balancer.planner.default_k;
    ctx->k_min = f->k_min;
    ctx->balancer = *std::move(b);
    const bool enabled = ctx->balancer->enabled();
    *context = ctx.release();
    return enabled ? dpbSuccess : dpbDisabled;
  } catch (...) {
    Logger()->error("init: internal error");
    return dpbInternalError;
  }
}

dpbResult_t Plan(void* context, const dpbRequest_v1_t* req, int32_t n, int64_t kv_free_tokens,
                 int32_t* verify_len, int32_t* draft_depth) {
  auto* ctx = static_cast<Context*>(context);
  if (ctx == nullptr) return dpbInvalidArgument;
  if (n < 0 || (n > 0 && (req == nullptr || verify_len == nullptr))) {
    // No batch to plan, but this rank still joins the step's exchange (marked unusable), so the
    // other ranks plan without it instead of waiting for it; Abstain logs why.
    try {
      const PlanOutcome o = ctx->balancer->Abstain(absl::InvalidArgumentError(absl::StrFormat(
          "plan: num_requests = %d with requests %s and verify_len %s", n, req ? "set" : "NULL",
          verify_len ? "set" : "NULL")));
      if (draft_depth) *draft_depth = o.draft_depth;
    } catch (...) {
      if (draft_depth) *draft_depth = ctx->default_k;
    }
    return dpbInvalidArgument;
  }
  // Balancer::Plan fills the default lengths first thing; the catch below covers a throw.
  try {
    ctx->requests.resize(n);
    for (int32_t i = 0; i < n; ++i) {
      BalancerRequest& r = ctx->requests[i];
      r.request_id = req[i].request_id;
      r.ctx_tokens = req[i].ctx_tokens;
      r.k_cap = req[i].k_cap;
      r.k_min = std::min(std::max(req[i].k_min, ctx->k_min), std::max(req[i].k_cap, 0));
      r.draft_confidence = req[i].draft_confidence && req[i].num_confidence > 0
                               ? absl::MakeConstSpan(req[i].draft_confidence, req[i].num_confidence)
                               : absl::Span<const float>();
    }
    const PlanOutcome o = ctx->balancer->Plan(ctx->requests, kv_free_tokens, absl::MakeSpan(verify_len, n));
    if (draft_depth) *draft_depth = o.draft_depth;
    if (!ctx->balancer->enabled()) return dpbDisabled;
    // Default lengths by design (mode off, the A/B off arm) are a success, not a fallback.
    return o.balanced || o.status.ok() ? dpbSuccess : dpbFallback;
  } catch (...) {
    DefaultLengths(req, n, ctx->default_k, verify_len);
    if (draft_depth) *draft_depth = ctx->default_k;
    return dpbInternalError;
  }
}

dpbResult_t Report(void* context, double attention_us, double step_us, const dpbAccepted_v1_t* acc,
                   int32_t n) {
  auto* ctx = static_cast<Context*>(context);
  if (ctx == nullptr || n < 0 || (n > 0 && acc == nullptr)) return dpbInvalidArgument;
  try {
    ctx->accepted.resize(n);
    for (int32_t i = 0; i < n; ++i) {
      ctx->accepted[i] = BalancerAccepted{acc[i].request_id, acc[i].verify_len, acc[i].accepted, acc[i].finished != 0};
    }
    return ctx->balancer->Report(attention_us, step_us, ctx->accepted).ok() ? dpbSuccess : dpbInvalidArgument;
  } catch (...) {
    return dpbInternalError;
  }
}

dpbResult_t Stats(void* context, dpbStats_v1_t* out) {
  auto* ctx = static_cast<Context*>(context);
  if (ctx == nullptr || out == nullptr) return dpbInvalidArgument;
  const BalancerStats s = ctx->balancer->Stats();
  std::memset(out, 0, sizeof(*out));
  out->steps = s.steps;
  out->balanced_steps = s.balanced_steps;
  out->fallbacks = s.fallbacks;
  out->enabled = s.enabled;
  out->bubble_fraction = s.bubble_fraction;
  out->bubble_us = s.bubble_us;
  out->predicted_error = s.predicted_error;
  out->tokens_per_step = s.tokens_per_step;
  out->goodput_tok_per_s = s.goodput_tok_per_s;
  out->ab_on_epochs = s.arm_on.epochs;
  out->ab_off_epochs = s.arm_off.epochs;
  out->ab_on_bubble = s.arm_on.bubble_fraction;
  out->ab_on_bubble_ci95 = s.arm_on.bubble_ci95;
  out->ab_on_goodput = s.arm_on.goodput_tok_per_s;
  out->ab_on_goodput_ci95 = s.arm_on.goodput_ci95;
  out->ab_off_bubble = s.arm_off.bubble_fraction;
  out->ab_off_bubble_ci95 = s.arm_off.bubble_ci95;
  out->ab_off_goodput = s.arm_off.goodput_tok_per_s;
  out->ab_off_goodput_ci95 = s.arm_off.goodput_ci95;
  return dpbSuccess;
}

dpbResult_t Finalize(void* context) {
  delete static_cast<Context*>(context);
  return dpbSuccess;
}

}  // namespace
}  // namespace dpbalance::plugin

extern "C" __attribute__((visibility("default"))) const dpbalancePlugin_v1_t dpbalancePlugin_v1 = {
    "dpbalance", dpbalance::plugin::Init, dpbalance::plugin::Plan, dpbalance::plugin::Report,
    dpbalance::plugin::Stats, dpbalance::plugin::Finalize};
