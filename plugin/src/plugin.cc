// The C ABI: converts and validates, then calls the C++ Balancer. No exception, C++ type or
// absl::Status crosses this boundary; every failure is a result code and the default lengths.
#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "dpbalance/balancer.h"
#include "dpbalance/inprocess_allgather.h"
#include "dpbalance/log.h"
#include "dpbalance/nccl_allgather.h"
#include "dpbalance/plugin/dpbalance_inspect_v1.h"
#include "dpbalance/plugin/dpbalance_inspect_v2.h"
#include "dpbalance/plugin/dpbalance_plugin_v1.h"
#include "dpbalance/plugin/dpbalance_plugin_v2.h"
#include "dpbalance/summary.h"
#include "flags.h"

namespace dpbalance::plugin {
namespace {

struct Context {
  std::unique_ptr<Balancer> balancer;
  int32_t default_k = 0;
  int32_t k_min = 0;
  int32_t dp_size = 1;
  std::vector<BalancerRequest> requests;
  std::vector<BalancerAccepted> accepted;
  // ABI v2
  StepTotals totals;
  std::deque<uint64_t> outstanding;  // plans not reported yet, oldest first (at most two)
  int64_t missing_reports = 0;
};

// What init needs of either ABI's arguments.
struct InitCommon {
  int32_t dp_size = 0, dp_rank = 0, attn_tp_size = 1, attn_tp_rank = 0;
  const char* config = nullptr;
  int32_t backend = dpbBackendFromFlags;  // RawEnum of the engine's field
  dpbAllGatherFn_v1_t allgather_v1 = nullptr;
  dpbAllGatherFn_v2_t allgather_v2 = nullptr;
  void* allgather_user = nullptr;
  void* nccl_comm = nullptr;
  void* cuda_stream = nullptr;
  const void* nccl_unique_id = nullptr;
  int32_t cuda_device = -1;
  int abi_version = 1;
};

// A request id of any length as the balancer's key: 64-bit FNV-1a of its bytes. Keys only index
// this rank's per-request statistics (acceptance, TPOT), never cross ranks. Two live requests
// whose ids collide (about 1 in 10^11 for 10^4 live requests) share those statistics: both are
// planned from their pooled acceptance, nothing else changes (tests: DuplicateIdsShareStatistics).
int64_t RequestKey(const void* id, int32_t id_bytes) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(id);
  for (int32_t i = 0; i < id_bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h);
}

constexpr int32_t kMaxIdBytes = 4096;

// A C enum field as the engine wrote it: any int may arrive, and loading one that is not an
// enumerator as the enum type is undefined behaviour, so it is read as its bytes.
template <typename Enum>
int32_t RawEnum(const Enum& e) {
  static_assert(sizeof(Enum) == sizeof(int32_t));
  int32_t v;
  std::memcpy(&v, &e, sizeof(v));
  return v;
}

void DefaultLengths(const dpbRequest_v1_t* req, int32_t n, int32_t default_k, int32_t* out) {
  for (int32_t i = 0; i < n; ++i) out[i] = DefaultVerifyLen(default_k, req[i].k_cap);
}

absl::StatusOr<std::unique_ptr<AllGather>> MakeBackend(const InitCommon& a, const PluginFlags& f) {
  int32_t b = a.backend;
  const int group = a.dp_size * a.attn_tp_size, rank = a.dp_rank * a.attn_tp_size + a.attn_tp_rank;
  if (b == dpbBackendFromFlags) {
    b = f.backend == "inproc" ? dpbBackendInProcess : f.backend == "callback" ? dpbBackendCallback : dpbBackendNccl;
  }
  switch (b) {
    case dpbBackendInProcess: {
      absl::StatusOr<std::shared_ptr<InProcessGroup>> g =
          InProcessGroup::Named(f.group, group, sizeof(RankSummary));
      if (!g.ok()) return g.status();
      return (*g)->Join(rank);
    }
    case dpbBackendCallback:
      if (a.abi_version >= 2) {
        return MakeSizedCallbackAllGather(group, rank, sizeof(RankSummary), a.allgather_v2, a.allgather_user);
      }
      return MakeCallbackAllGather(group, rank, sizeof(RankSummary), a.allgather_v1, a.allgather_user);
    case dpbBackendNccl: {
      NcclAllGatherOptions o;
      o.num_ranks = group;
      o.rank = rank;
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

bool GroupInRange(const InitCommon& a) {
  return a.dp_size >= 1 && a.dp_size <= 65536 && a.dp_rank >= 0 && a.dp_rank < a.dp_size &&
         a.attn_tp_size >= 1 && a.attn_tp_size <= 1024 && a.attn_tp_rank >= 0 &&
         a.attn_tp_rank < a.attn_tp_size;
}

// Init failed on a flag, after the group was known: where the engine's own callback carries
// the exchange (named in the init arguments, not chosen by the failed flags), this rank joins
// its peers' handshake with a refusal saying `why`, so they fail at once instead of waiting for
// it. Not on NCCL: there an exchange is ordered on a communicator the peers keep using.
void RefuseHandshake(const InitCommon& a, const absl::Status& why) {
  if (!GroupInRange(a) || a.backend != dpbBackendCallback) return;
  absl::StatusOr<std::unique_ptr<AllGather>> comm = MakeBackend(a, PluginFlags{});
  if (!comm.ok()) return;
  const absl::Duration timeout = TimeoutFlag(DpbEnvironment(), a.config ? a.config : "");
  absl::Status s = Balancer::Refuse(*std::move(comm), a.dp_size, a.attn_tp_size, a.abi_version, timeout,
                                    absl::StrFormat("rank %d: %s", a.dp_rank, why.message()));
  if (!s.ok()) Logger()->warn("init rank {}: the refusal's exchange failed: {}", a.dp_rank, std::string(s.message()));
}

// Both ABIs' init: flags, then `adjust` (the v2 arguments that set flags), the backend, the
// balancer.
template <typename Adjust>
dpbResult_t InitWith(const InitCommon& a, void** context, Adjust adjust) {
  try {
    if (context == nullptr) return dpbInvalidArgument;
    *context = nullptr;
    absl::StatusOr<PluginFlags> f = ParseFlags(DpbEnvironment(), a.config ? a.config : "");
    if (!f.ok()) {
      Logger()->error("init: {}", std::string(f.status().message()));
      RefuseHandshake(a, f.status());
      return dpbInvalidArgument;
    }
    SetLogLevel(f->log_level);
    if (!GroupInRange(a)) {
      Logger()->error("init: rank {} of num_ranks {} (attention-TP rank {} of {}) is out of range",
                      a.dp_rank, a.dp_size, a.attn_tp_rank, a.attn_tp_size);
      return dpbInvalidArgument;
    }
    f->balancer.planner.num_ranks = a.dp_size;
    f->balancer.attn_tp_size = a.attn_tp_size;
    f->balancer.attn_tp_rank = a.attn_tp_rank;
    f->balancer.abi_version = a.abi_version;
    if (absl::Status s = adjust(*f); !s.ok()) {
      Logger()->error("init rank {}: {}", a.dp_rank, std::string(s.message()));
      RefuseHandshake(a, s);
      return dpbInvalidArgument;
    }
    absl::StatusOr<std::unique_ptr<AllGather>> comm = MakeBackend(a, *f);
    if (!comm.ok()) {
      Logger()->error("init rank {}: all-gather backend: {}", a.dp_rank, std::string(comm.status().message()));
      return dpbInvalidArgument;
    }
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Create(f->balancer, a.dp_rank, *std::move(comm));
    if (!b.ok()) {
      Logger()->error("init rank {}: {}", a.dp_rank, std::string(b.status().message()));
      return dpbInvalidArgument;
    }
    auto ctx = std::make_unique<Context>();
    ctx->default_k = f->balancer.planner.default_k;
    ctx->k_min = f->k_min;
    ctx->dp_size = a.dp_size;
    ctx->balancer = *std::move(b);
    const bool enabled = ctx->balancer->enabled();
    *context = ctx.release();
    return enabled ? dpbSuccess : dpbDisabled;
  } catch (...) {
    Logger()->error("init: internal error");
    return dpbInternalError;
  }
}

// The fields both ABIs' init arguments share, by name.
template <typename InitArgs>
InitCommon CommonFields(const InitArgs& args) {
  InitCommon a;
  a.config = args.config;
  a.backend = RawEnum(args.backend);
  a.allgather_user = args.allgather_user;
  a.nccl_comm = args.nccl_comm;
  a.cuda_stream = args.cuda_stream;
  a.nccl_unique_id = args.nccl_unique_id;
  a.cuda_device = args.cuda_device;
  return a;
}

dpbResult_t Init(const dpbInitArgs_v1_t* args, void** context) {
  if (args == nullptr) return dpbInvalidArgument;
  InitCommon a = CommonFields(*args);
  a.dp_size = args->num_ranks;
  a.dp_rank = args->rank;
  a.allgather_v1 = args->allgather_fn;
  return InitWith(a, context, [](PluginFlags&) { return absl::OkStatus(); });
}

dpbResult_t InitV2(const dpbInitArgs_v2_t* args, void** context) {
  if (args == nullptr) return dpbInvalidArgument;
  if (args->struct_size < sizeof(dpbInitArgs_v2_t)) {
    Logger()->error("init (ABI v2): struct_size = {} is smaller than dpbInitArgs_v2_t ({} bytes): "
                    "the engine was built against another header", args->struct_size,
                    sizeof(dpbInitArgs_v2_t));
    return dpbInvalidArgument;
  }
  InitCommon a = CommonFields(*args);
  a.dp_size = args->dp_size;
  a.dp_rank = args->dp_rank;
  a.attn_tp_size = args->attn_tp_size;
  a.attn_tp_rank = args->attn_tp_rank;
  a.allgather_v2 = args->allgather_fn;
  a.abi_version = DPB_PLUGIN_ABI_VERSION_2;
  return InitWith(a, context, [args](PluginFlags& f) -> absl::Status {
    f.balancer.planner.exact_rank_tokens = true;  // every rank's total from the one exchange
    f.balancer.always_exchange = true;            // the exchange may carry the engine's own sync
    if (args->num_token_tiers < 0 || args->num_token_tiers > 4096 ||
        (args->num_token_tiers > 0 && args->token_tiers == nullptr)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token_tiers: %d tiers at %s", args->num_token_tiers, args->token_tiers ? "set" : "NULL"));
    }
    if (args->num_token_tiers > 0) {  // the engine's captured sizes override DPB_TIERS
      f.balancer.planner.token_tiers.assign(args->token_tiers, args->token_tiers + args->num_token_tiers);
      f.balancer.planner.global.padded_tokens = true;
    }
    switch (const int32_t g = RawEnum(args->granularity)) {
      case dpbGranularityRequest: break;
      case dpbGranularityBudget: f.balancer.planner.order_by_gain = true; break;
      default:
        return absl::InvalidArgumentError(absl::StrFormat("granularity = %d is not 0 (request) or 1 (budget)", g));
    }
    return f.balancer.planner.Validate();  // e.g. tiers not ascending, named
  });
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

uint32_t RankFlagsV2(uint16_t summary_flags) {
  uint32_t f = 0;
  if (summary_flags & kSummaryValid) f |= DPB_RANK_PLANNED;
  if (summary_flags & kSummaryExtend) f |= DPB_RANK_EXTEND;
  if (summary_flags & kSummaryNoVerify) f |= DPB_RANK_NO_VERIFY;
  if (summary_flags & kSummaryIdle) f |= DPB_RANK_IDLE;
  return f;
}

// The step's requests as the balancer's; the first bad one, if any, named in the returned status
// (the rank then runs its defaults and still joins the exchange).
absl::Status ToRequests(Context& ctx, const dpbStep_v2_t& step) {
  const int32_t n = step.num_requests;
  const bool no_verify = RawEnum(step.kind) == dpbStepNoVerify;
  ctx.requests.resize(n);
  absl::Status bad;
  for (int32_t i = 0; i < n; ++i) {
    const dpbRequest_v2_t& q = step.requests[i];
    BalancerRequest& r = ctx.requests[i];
    const bool id_ok = q.id != nullptr && q.id_bytes >= 1 && q.id_bytes <= kMaxIdBytes;
    if (!id_ok && bad.ok()) {
      bad = absl::InvalidArgumentError(absl::StrFormat(
          "plan: request %d has id %s with id_bytes = %d (expected 1..%d bytes)", i,
          q.id ? "set" : "NULL", q.id_bytes, kMaxIdBytes));
    }
    r.request_id = id_ok ? RequestKey(q.id, q.id_bytes) : 0;
    r.ctx_tokens = q.ctx_tokens;
    // A step without verify plans (and falls back to) zero drafts for every request.
    r.k_cap = no_verify ? 0 : q.k_cap;
    r.k_min = no_verify ? 0 : std::min(std::max(q.k_min, ctx.k_min), std::max(q.k_cap, 0));
    r.draft_confidence = !no_verify && q.draft_confidence && q.num_confidence > 0
                             ? absl::MakeConstSpan(q.draft_confidence, q.num_confidence)
                             : absl::Span<const float>();
  }
  return bad;
}

void FillResultV2(const Context& ctx, const PlanOutcome& o, dpbPlanResult_v2_t* res, int32_t n) {
  res->draft_depth = o.draft_depth;
  res->balanced = o.balanced ? 1 : 0;
  int64_t budget = 0;
  for (int32_t i = 0; i < n; ++i) budget += res->verify_len[i];
  res->verify_budget = static_cast<int32_t>(budget);
  const StepTotals& t = ctx.totals;
  res->padded_tokens = t.known ? t.padded_tokens : 0;
  res->any_rank_flags = 0;
  for (int32_t r = 0; r < ctx.dp_size; ++r) {
    const bool known = r < static_cast<int32_t>(t.rank_tokens.size()) && t.rank_tokens[r] >= 0;
    const uint32_t f = known ? RankFlagsV2(t.rank_flags[r]) : DPB_RANK_UNKNOWN;
    if (res->rank_tokens) res->rank_tokens[r] = known ? t.rank_tokens[r] : -1;
    if (res->rank_flags) res->rank_flags[r] = f;
    res->any_rank_flags |= f;
  }
}

dpbResult_t PlanV2(void* context, const dpbStep_v2_t* step, dpbPlanResult_v2_t* res) {
  auto* ctx = static_cast<Context*>(context);
  if (ctx == nullptr) return dpbInvalidArgument;
  if (ctx->outstanding.size() == 2) {  // a third outstanding plan: the oldest is never reported
    ctx->outstanding.pop_front();
    ++ctx->missing_reports;
  }
  const bool shape_ok = step != nullptr && res != nullptr && step->num_requests >= 0 &&
                        (step->num_requests == 0 || (step->requests != nullptr && res->verify_len != nullptr));
  if (!shape_ok) {  // nothing to fill; still joins the exchange so no rank waits for this one
    try {
      const PlanOutcome o = ctx->balancer->Abstain(absl::InvalidArgumentError(absl::StrFormat(
          "plan (ABI v2): step %s, result %s, num_requests %d, requests %s, verify_len %s",
          step ? "set" : "NULL", res ? "set" : "NULL", step ? step->num_requests : -1,
          step && step->requests ? "set" : "NULL", res && res->verify_len ? "set" : "NULL")));
      ctx->outstanding.push_back(o.step);
      if (res) {
        res->draft_depth = o.draft_depth;
        res->plan_id = static_cast<int64_t>(o.step);
      }
    } catch (...) {
      if (res) res->draft_depth = ctx->default_k;
    }
    return dpbInvalidArgument;
  }
  const int32_t n = step->num_requests;
  try {
    StepInput in;
    in.kv_free_tokens = step->kv_free_tokens;
    in.extra_tokens = step->extra_tokens;
    const int32_t kind = RawEnum(step->kind);
    switch (kind) {
      case dpbStepDecode: break;
      case dpbStepIdle: in.kind = kSummaryIdle; break;
      case dpbStepExtend: in.kind = kSummaryExtend; break;
      case dpbStepNoVerify: in.kind = kSummaryNoVerify; break;
      default:
        in.input_error = absl::InvalidArgumentError(
            absl::StrFormat("plan: step kind %d is not 0..3", kind));
    }
    if (in.input_error.ok() && kind == dpbStepIdle && n > 0) {
      in.input_error = absl::InvalidArgumentError(absl::StrFormat("plan: an idle step with %d requests", n));
    }
    if (absl::Status s = ToRequests(*ctx, *step); !s.ok() && in.input_error.ok()) in.input_error = s;
    in.batch = ctx->requests;
    const PlanOutcome o = ctx->balancer->Plan(in, absl::MakeSpan(res->verify_len, n), &ctx->totals);
    ctx->outstanding.push_back(o.step);
    res->plan_id = static_cast<int64_t>(o.step);
    FillResultV2(*ctx, o, res, n);
    if (!ctx->balancer->enabled()) return dpbDisabled;
    if (!in.input_error.ok()) return dpbInvalidArgument;
    return o.balanced || o.status.ok() ? dpbSuccess : dpbFallback;
  } catch (...) {
    for (int32_t i = 0; i < n; ++i) {
      res->verify_len[i] = RawEnum(step->kind) == dpbStepNoVerify ? 0 : DefaultVerifyLen(ctx->default_k, step->requests[i].k_cap);
    }
    res->draft_depth = ctx->default_k;
    res->balanced = 0;
    // Nothing of the exchange is known here: every total unknown (the engine must not read an
    // agreement from this result), no tier, no plan to report.
    res->padded_tokens = 0;
    res->plan_id = -1;
    res->any_rank_flags = DPB_RANK_UNKNOWN;
    for (int32_t r = 0; r < ctx->dp_size; ++r) {
      if (res->rank_tokens) res->rank_tokens[r] = -1;
      if (res->rank_flags) res->rank_flags[r] = DPB_RANK_UNKNOWN;
    }
    return dpbInternalError;
  }
}

dpbResult_t ReportV2(void* context, const dpbReport_v2_t* rep) {
  auto* ctx = static_cast<Context*>(context);
  if (ctx == nullptr || rep == nullptr || rep->num_accepted < 0 ||
      (rep->num_accepted > 0 && rep->accepted == nullptr)) {
    return dpbInvalidArgument;
  }
  const auto it = std::find(ctx->outstanding.begin(), ctx->outstanding.end(),
                            static_cast<uint64_t>(rep->plan_id));
  if (rep->plan_id < 0 || it == ctx->outstanding.end()) {
    Logger()->warn("report (ABI v2): plan_id {} is not an outstanding plan: ignored", rep->plan_id);
    return dpbInvalidArgument;
  }
  // Only this plan is settled: an engine may report out of order (SGLang reports a step where
  // every rank was idle at once, while the batch before it is still in flight under its overlap
  // scheduler). A plan never reported is counted when a third outstanding plan evicts it.
  ctx->outstanding.erase(it);
  try {
    ctx->accepted.resize(rep->num_accepted);
    for (int32_t i = 0; i < rep->num_accepted; ++i) {
      const dpbAccepted_v2_t& a = rep->accepted[i];
      if (a.id == nullptr || a.id_bytes < 1 || a.id_bytes > kMaxIdBytes) {
        Logger()->warn("report: accepted entry {} has id {} with id_bytes = {}: report ignored", i,
                       a.id ? "set" : "NULL", a.id_bytes);
        ++ctx->missing_reports;
        return dpbInvalidArgument;
      }
      ctx->accepted[i] = BalancerAccepted{RequestKey(a.id, a.id_bytes), a.verify_len, a.accepted, a.finished != 0};
    }
    return ctx->balancer->Report(static_cast<uint64_t>(rep->plan_id), rep->attention_us, rep->step_us,
                                 ctx->accepted).ok()
               ? dpbSuccess
               : dpbInvalidArgument;
  } catch (...) {
    return dpbInternalError;
  }
}

dpbResult_t StatsV2(void* context, dpbStats_v2_t* out) {
  auto* ctx = static_cast<Context*>(context);
  if (ctx == nullptr || out == nullptr) return dpbInvalidArgument;
  std::memset(out, 0, sizeof(*out));
  if (dpbResult_t r = Stats(context, &out->v1); r != dpbSuccess) return r;
  const BalancerStats s = ctx->balancer->Stats();
  out->missing_reports = ctx->missing_reports;
  out->tp_mismatches = s.tp_mismatches;
  out->exchange_failures = s.exchange_failures;
  out->max_exchange_ms = s.max_exchange_ms;
  return dpbSuccess;
}

// --- dpbalance_inspect_v1.h ---------------------------------------------------------------

// `text` into the caller's buffer of `bytes`, NUL-terminated and cut to fit (nothing when the
// buffer is NULL or empty).
void CopyOut(const std::string& text, char* out, size_t bytes) {
  if (out == nullptr || bytes == 0) return;
  const size_t n = std::min(text.size(), bytes - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

// init's checks without a balancer: the flags (ParseFlags), then the planner's settings for
// dp_size ranks with the model (Planner::Create, as Balancer::Create runs it).
dpbResult_t CheckFlags(const char* config, int32_t dp_size, char* error, size_t error_bytes,
                       char* settings, size_t settings_bytes) {
  CopyOut("", error, error_bytes);
  CopyOut("", settings, settings_bytes);
  try {
    if (dp_size < 1 || dp_size > 65536) {
      CopyOut(absl::StrFormat("dp_size %d is not in 1..65536", dp_size), error, error_bytes);
      return dpbInvalidArgument;
    }
    absl::StatusOr<PluginFlags> f = ParseFlags(DpbEnvironment(), config ? config : "");
    if (!f.ok()) {
      CopyOut(std::string(f.status().message()), error, error_bytes);
      return dpbInvalidArgument;
    }
    f->balancer.planner.num_ranks = dp_size;
    if (absl::StatusOr<Planner> p = Planner::Create(f->balancer.planner, f->balancer.model); !p.ok()) {
      CopyOut(std::string(p.status().message()), error, error_bytes);
      return dpbInvalidArgument;
    }
    const PlannerConfig& pc = f->balancer.planner;
    CopyOut(absl::StrFormat("mode=%s k_max=%d default_k=%d cost_model=%s draft_us=%g ffn_fixed_us=%g "
                            "ffn_per_token_us=%g step_overhead_us=%g online=%d tpot_slo_ms=%g "
                            "min_plan_gain=%g value_deferral=%d acceptance=%s log_every=%d "
                            "step_slack=%g guard_overhead_us=%g guard_measured=%d quiet_after=%d quiet_max=%d "
                            "metrics_file=%s",
                            PlanModeName(pc.mode), pc.k_max, pc.default_k, f->balancer.model.name(),
                            pc.global.draft_per_step_us, pc.global.ffn_fixed_us,
                            pc.global.ffn_per_token_us, pc.global.step_overhead_us,
                            f->balancer.online_calibration ? 1 : 0, f->balancer.tpot_slo_us / 1000,
                            pc.min_plan_gain, pc.value_deferral ? 1 : 0,
                            AcceptanceModelName(f->balancer.acceptance_model),
                            f->balancer.log_every_steps, pc.max_step_slack, pc.guard_overhead_us,
                            pc.guard_measured_overhead ? 1 : 0,
                            f->balancer.quiet.after, f->balancer.quiet.max_steps,
                            f->balancer.metrics_file.empty() ? "-" : f->balancer.metrics_file),
            settings, settings_bytes);
    return dpbSuccess;
  } catch (...) {
    CopyOut("internal error while checking the flags", error, error_bytes);
    return dpbInternalError;
  }
}

dpbResult_t LastStep(void* context, dpbStepInfo_v1_t* out) {
  auto* ctx = static_cast<Context*>(context);
  if (ctx == nullptr || out == nullptr) return dpbInvalidArgument;
  const ReportedStep& r = ctx->balancer->LastReport();
  out->plan_id = r.step == UINT64_MAX ? -1 : static_cast<int64_t>(r.step);
  out->predicted_attention_us = r.predicted_us;
  out->measured_attention_us = r.measured_us;
  out->planned_barrier_us = r.barrier_us;
  out->extend = r.extra_work ? 1 : 0;
  return dpbSuccess;
}

// --- dpbalance_inspect_v2.h ---------------------------------------------------------------

dpbResult_t StepTerms(void* context, dpbStepTerms_v1_t* out) {
  auto* ctx = static_cast<Context*>(context);
  if (ctx == nullptr || out == nullptr) return dpbInvalidArgument;
  const BalancerStats s = ctx->balancer->Stats();
  std::memset(out, 0, sizeof(*out));
  out->ffn_fixed_us = s.step_terms.ffn_fixed_us;
  out->ffn_per_token_us = s.step_terms.ffn_per_token_us;
  out->draft_us = s.step_terms.draft_per_step_us;
  out->step_overhead_us = s.step_terms.step_overhead_us;
  out->online = s.step_terms_online ? 1 : 0;
  out->per_token_learnt = s.step_terms_per_token_learnt ? 1 : 0;
  out->draft_learnt = s.step_terms_draft_learnt ? 1 : 0;
  out->rows = s.step_terms_rows;
  out->fits = s.step_terms_fits;
  out->resets = s.step_terms_resets;
  return dpbSuccess;
}

}  // namespace
}  // namespace dpbalance::plugin

extern "C" __attribute__((visibility("default"))) const dpbalanceInspect_v1_t dpbalanceInspect_v1 = {
    "dpbalance", dpbalance::plugin::CheckFlags, dpbalance::plugin::LastStep};

extern "C" __attribute__((visibility("default"))) const dpbalanceInspect_v2_t dpbalanceInspect_v2 = {
    "dpbalance", dpbalance::plugin::CheckFlags, dpbalance::plugin::LastStep, dpbalance::plugin::StepTerms};

extern "C" __attribute__((visibility("default"))) const dpbalancePlugin_v1_t dpbalancePlugin_v1 = {
    "dpbalance", dpbalance::plugin::Init, dpbalance::plugin::Plan, dpbalance::plugin::Report,
    dpbalance::plugin::Stats, dpbalance::plugin::Finalize};

extern "C" __attribute__((visibility("default"))) const dpbalancePlugin_v2_t dpbalancePlugin_v2 = {
    DPB_PLUGIN_ABI_VERSION_2, "dpbalance", dpbalance::plugin::InitV2, dpbalance::plugin::PlanV2,
    dpbalance::plugin::ReportV2, dpbalance::plugin::StatsV2, dpbalance::plugin::Finalize};
