// Fuzzes the plugin's v2 C ABI (plugin/include/dpbalance/plugin/dpbalance_plugin_v2.h): `plan`
// and `report` with arbitrary arguments on 1-rank in-process instances initialised once per
// process (one per init below). The header's contract: anything may come back as a result code,
// but never a crash; `plan` always fills verify_len with lengths in 0..max(k_cap, 0) (0 on a
// no-verify step); this rank's rank_tokens entry is what its lengths add up to, except on a
// balanced step of an instance with tiers, where it is the agreed tier (the lengths within it,
// padding rows make up the rest) or, for a rank that cannot verify, its lengths' total (the
// header's "Token totals"); each plus extra_tokens, and the padded size is never below it.
//
// Input (FuzzedDataProvider): which instance; then up to 4 steps, each a step kind (any int32,
// not only the enumerators), a batch (ids as byte strings from a small pool, or NULL, or of any
// length; contexts, floors, caps and confidences anywhere in their C types), the KV budget and
// extra tokens, then a report naming a plan (this one, an older one or garbage).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "plugin_request_fuzz.h"
#include "dpbalance/plugin/dpbalance_plugin_v2.h"

extern "C" const dpbalancePlugin_v2_t dpbalancePlugin_v2;

namespace {

using dpbalance::fuzz::ConsumeInt32;
using dpbalance::fuzz::ConsumeRequest;

struct Init {
  const char* config;
  std::vector<int32_t> tiers;
  int32_t granularity;
};
const Init kInits[] = {
    {"backend=inproc;group=fuzzv2a;log_level=off;mode=goodput", {}, dpbGranularityRequest},
    {"backend=inproc;group=fuzzv2b;log_level=off;mode=goodput;tpot_slo_ms=40", {8, 16, 32, 64, 128}, dpbGranularityBudget},
    {"backend=inproc;group=fuzzv2c;log_level=off;mode=fill;agreed_depth=0;k_min=1", {}, dpbGranularityRequest},
    {"backend=inproc;group=fuzzv2d;log_level=off;mode=goodput;cost_model=v2+fa2-packed-h200;ab_epoch=2", {16, 48},
     dpbGranularityRequest},
};
constexpr int kNumInits = sizeof(kInits) / sizeof(kInits[0]);

struct Instances {
  Instances();
  ~Instances() {
    for (void* ctx : contexts) (void)dpbalancePlugin_v2.finalize(ctx);
  }
  std::vector<void*> contexts;
};

Instances::Instances() {
  for (const Init& init : kInits) {
    dpbInitArgs_v2_t a{};
    a.struct_size = sizeof(a);
    a.dp_size = 1;
    a.attn_tp_size = 1;
    a.config = init.config;
    a.backend = dpbBackendInProcess;
    a.cuda_device = -1;
    a.token_tiers = init.tiers.empty() ? nullptr : init.tiers.data();
    a.num_token_tiers = static_cast<int32_t>(init.tiers.size());
    std::memcpy(&a.granularity, &init.granularity, sizeof(int32_t));
    void* ctx = nullptr;
    const dpbResult_t r = dpbalancePlugin_v2.init(&a, &ctx);
    if ((r != dpbSuccess && r != dpbDisabled) || ctx == nullptr) {
      std::fprintf(stderr, "init '%s' failed: %d\n", init.config, static_cast<int>(r));
      std::abort();
    }
    contexts.push_back(ctx);
  }
}

[[noreturn]] void Fail(const char* what, long a, long b) {
  std::fprintf(stderr, "plan: %s (%ld vs %ld)\n", what, a, b);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Instances instances;
  static const std::vector<std::string> kIds = {"a", "req-1", "req-2", std::string(40, 'x'), std::string("\0\1", 2)};
  FuzzedDataProvider in(data, size);
  const int inst = in.ConsumeIntegralInRange(0, kNumInits - 1);
  void* ctx = instances.contexts[inst];

  std::vector<dpbRequest_v2_t> requests;
  std::vector<std::string> ids;
  std::vector<std::vector<float>> confidences;
  std::vector<int32_t> verify_len;
  std::vector<dpbAccepted_v2_t> accepted;
  int64_t last_plan = -1;
  for (int step = in.ConsumeIntegralInRange(1, 4); step > 0 && in.remaining_bytes() > 0; --step) {
    const int32_t kind = in.ConsumeIntegralInRange(0, 9) == 0 ? in.ConsumeIntegral<int32_t>()
                                                              : in.ConsumeIntegralInRange(0, 3);
    const int32_t n = in.ConsumeIntegralInRange(0, 20);
    requests.assign(n, dpbRequest_v2_t{});
    ids.assign(n, "");
    confidences.assign(n, {});
    for (int32_t i = 0; i < n; ++i) {
      dpbRequest_v2_t& r = requests[i];
      const int id_kind = in.ConsumeIntegralInRange(0, 15);
      ids[i] = id_kind == 0 ? in.ConsumeRandomLengthString(64) : kIds[in.ConsumeIntegralInRange<size_t>(0, kIds.size() - 1)];
      r.id = id_kind == 1 ? nullptr : ids[i].data();
      r.id_bytes = id_kind == 2 ? in.ConsumeIntegral<int32_t>() : static_cast<int32_t>(ids[i].size());
      if (r.id_bytes > static_cast<int32_t>(ids[i].size())) r.id_bytes = static_cast<int32_t>(ids[i].size());
      ConsumeRequest(in, r, confidences[i]);
    }
    dpbStep_v2_t st{};
    std::memcpy(&st.kind, &kind, sizeof(kind));
    st.requests = requests.data();
    st.num_requests = n;
    st.kv_free_tokens = in.ConsumeBool() ? in.ConsumeIntegral<int64_t>() : in.ConsumeIntegralInRange<int64_t>(-1, 512);
    st.extra_tokens = in.ConsumeBool() ? in.ConsumeIntegral<int64_t>() : in.ConsumeIntegralInRange<int64_t>(0, 4096);
    verify_len.assign(n, -12345);
    int64_t rank_tokens = -12345;
    uint32_t rank_flags = 0;
    dpbPlanResult_v2_t res{};
    res.verify_len = verify_len.data();
    res.rank_tokens = &rank_tokens;
    res.rank_flags = &rank_flags;
    const int misuse = in.ConsumeIntegralInRange(0, 15);
    if (misuse == 0) {  // no batch: NULL arrays, a negative count, or no result
      st.requests = nullptr;
      st.num_requests = in.ConsumeBool() ? -1 : n;
      (void)dpbalancePlugin_v2.plan(ctx, &st, in.ConsumeBool() ? &res : nullptr);
      continue;
    }
    const dpbResult_t r = dpbalancePlugin_v2.plan(ctx, &st, &res);
    last_plan = res.plan_id;
    int64_t own = 0;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t hi = kind == dpbStepNoVerify ? 0 : std::max(requests[i].k_cap, 0);
      if (verify_len[i] < 0 || verify_len[i] > hi) Fail("verify_len outside 0..k_cap", verify_len[i], hi);
      own += 1 + verify_len[i];
    }
    // A step the plugin accepted (so extra_tokens was in range): its own total is what the
    // lengths add up to or, balanced with tiers, a tier holding them; the padded size holds it.
    if (r == dpbSuccess) {
      const std::vector<int32_t>& tiers = kInits[inst].tiers;
      const int64_t planned = rank_tokens - st.extra_tokens;
      const bool tier = res.balanced && !tiers.empty() && planned >= own &&
                        std::find(tiers.begin(), tiers.end(), planned) != tiers.end();
      own += st.extra_tokens;
      if (rank_tokens != own && !tier) Fail("own rank_tokens is neither the lengths' total nor a tier holding them", rank_tokens, own);
      if (res.padded_tokens < rank_tokens) Fail("padded size below the rank's total", res.padded_tokens, rank_tokens);
    }
    // The report: this plan, an older one or garbage; measured times anywhere in double.
    dpbReport_v2_t rep{};
    const int which = in.ConsumeIntegralInRange(0, 7);
    rep.plan_id = which == 0 ? in.ConsumeIntegral<int64_t>() : which == 1 ? last_plan - 1 : last_plan;
    rep.attention_us = in.ConsumeBool() ? in.ConsumeFloatingPoint<double>() : in.ConsumeFloatingPointInRange<double>(0, 1e5);
    rep.step_us = in.ConsumeBool() ? in.ConsumeFloatingPoint<double>() : in.ConsumeFloatingPointInRange<double>(0, 2e5);
    accepted.assign(in.ConsumeIntegralInRange(0, n + 2), dpbAccepted_v2_t{});
    for (size_t i = 0; i < accepted.size(); ++i) {
      dpbAccepted_v2_t& a = accepted[i];
      const bool planned = i < static_cast<size_t>(n) && in.ConsumeBool();
      const std::string& id = planned ? ids[i] : kIds[in.ConsumeIntegralInRange<size_t>(0, kIds.size() - 1)];
      a.id = in.ConsumeIntegralInRange(0, 15) == 0 ? nullptr : id.data();
      a.id_bytes = static_cast<int32_t>(id.size());
      a.verify_len = planned ? verify_len[i] : ConsumeInt32(in, 0, 9);
      a.accepted = ConsumeInt32(in, 0, 9);
      a.finished = in.ConsumeIntegralInRange(0, 3) == 0;
    }
    rep.accepted = accepted.data();
    rep.num_accepted = in.ConsumeIntegralInRange(0, 15) == 0 ? -1 : static_cast<int32_t>(accepted.size());
    (void)dpbalancePlugin_v2.report(ctx, &rep);
  }
  dpbStats_v2_t stats;
  (void)dpbalancePlugin_v2.stats(ctx, &stats);
  return 0;
}
