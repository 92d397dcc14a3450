// Fuzzes the plugin's C ABI (plugin/include/dpbalance/plugin/dpbalance_plugin_v1.h): `plan` and
// `report` with arbitrary arguments on 1-rank in-process instances initialised once per
// process (one per config below). The header's contract: anything may come back as a result
// code, but never a crash, and `plan` always fills verify_len with lengths in 0..max(k_cap, 0).
//
// Input (FuzzedDataProvider): which instance; then up to 4 steps, each a batch (ids from a pool
// of 64, so the per-request state the balancer keeps stays bounded and ids recur across steps;
// contexts, floors, caps and draft confidences anywhere in their C types, NaN included), the KV
// budget, then a report of measured times and accept counts. A step may instead pass a NULL
// batch or a negative count.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "plugin_request_fuzz.h"
#include "dpbalance/plugin/dpbalance_plugin_v1.h"

extern "C" const dpbalancePlugin_v1_t dpbalancePlugin_v1;

namespace {

using dpbalance::fuzz::ConsumeInt32;
using dpbalance::fuzz::ConsumeRequest;

// One instance per planning mode and option set; each its own in-process group.
constexpr const char* kConfigs[] = {
    "backend=inproc;group=fuzz0;log_level=off;mode=goodput",
    "backend=inproc;group=fuzz1;log_level=off;mode=fill;step_slack=0.1;tpot_slo_ms=40",
    "backend=inproc;group=fuzz2;log_level=off;mode=local;agreed_depth=0;k_min=1",
    "backend=inproc;group=fuzz3;log_level=off;mode=goodput;granularity=rank;tiers=8,32,128;padded=1",
    "backend=inproc;group=fuzz4;log_level=off;mode=off",
    ("backend=inproc;group=fuzz5;log_level=off;mode=goodput;online=0;cost_model=v2+fa2-packed-h200;"
     "k_max=8;default_k=0;ab_epoch=3"),
};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);

// The instances, initialised on the first input and finalised at exit (LeakSanitizer checks).
struct Instances {
  Instances();
  ~Instances() {
    for (void* ctx : contexts) (void)dpbalancePlugin_v1.finalize(ctx);
  }
  std::vector<void*> contexts;
};

Instances::Instances() {
  for (const char* config : kConfigs) {
    dpbInitArgs_v1_t args{};
    args.num_ranks = 1;
    args.rank = 0;
    args.config = config;
    args.backend = dpbBackendInProcess;
    args.cuda_device = -1;
    void* ctx = nullptr;
    const dpbResult_t r = dpbalancePlugin_v1.init(&args, &ctx);
    if ((r != dpbSuccess && r != dpbDisabled) || ctx == nullptr) {
      std::fprintf(stderr, "init '%s' failed: %d\n", config, static_cast<int>(r));
      std::abort();
    }
    contexts.push_back(ctx);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Instances instances;
  FuzzedDataProvider in(data, size);
  void* ctx = instances.contexts[in.ConsumeIntegralInRange(0, kNumConfigs - 1)];

  std::vector<dpbRequest_v1_t> requests;
  std::vector<std::vector<float>> confidences;
  std::vector<int32_t> verify_len;
  std::vector<dpbAccepted_v1_t> accepted;
  for (int step = in.ConsumeIntegralInRange(1, 4); step > 0 && in.remaining_bytes() > 0; --step) {
    const int32_t n = in.ConsumeIntegralInRange(0, 24);
    requests.assign(n, dpbRequest_v1_t{});
    confidences.assign(n, {});
    for (int32_t i = 0; i < n; ++i) {
      dpbRequest_v1_t& r = requests[i];
      r.request_id = in.ConsumeIntegralInRange<int64_t>(0, 63);
      ConsumeRequest(in, r, confidences[i]);
    }
    const int64_t kv_free_tokens = in.ConsumeBool() ? in.ConsumeIntegral<int64_t>() : in.ConsumeIntegralInRange<int64_t>(-1, 512);
    verify_len.assign(n, -12345);
    int32_t draft_depth = -12345;
    const int misuse = in.ConsumeIntegralInRange(0, 15);
    if (misuse == 0) {  // the ABI's "no batch" paths: a negative count, or NULL arrays
      (void)dpbalancePlugin_v1.plan(ctx, nullptr, in.ConsumeBool() ? -1 : n, kv_free_tokens, nullptr,
                                    in.ConsumeBool() ? &draft_depth : nullptr);
    } else {
      (void)dpbalancePlugin_v1.plan(ctx, requests.data(), n, kv_free_tokens, verify_len.data(), &draft_depth);
      for (int32_t i = 0; i < n; ++i) {
        if (verify_len[i] < 0 || verify_len[i] > std::max(requests[i].k_cap, 0)) {
          std::fprintf(stderr, "plan: request %d verify_len %d outside 0..k_cap %d\n", i, verify_len[i],
                       requests[i].k_cap);
          std::abort();
        }
      }
    }
    // The report: measured times anywhere in double (NaN, inf, negative), accept counts for this
    // batch's requests (or garbage ones).
    const double attention_us = in.ConsumeBool() ? in.ConsumeFloatingPoint<double>() : in.ConsumeFloatingPointInRange<double>(0, 1e5);
    const double step_us = in.ConsumeBool() ? in.ConsumeFloatingPoint<double>() : in.ConsumeFloatingPointInRange<double>(0, 2e5);
    accepted.assign(in.ConsumeIntegralInRange(0, n + 2), dpbAccepted_v1_t{});
    for (size_t i = 0; i < accepted.size(); ++i) {
      dpbAccepted_v1_t& a = accepted[i];
      const bool planned = i < static_cast<size_t>(n) && in.ConsumeBool();
      a.request_id = planned ? requests[i].request_id : in.ConsumeIntegralInRange<int64_t>(0, 63);
      a.verify_len = planned ? verify_len[i] : ConsumeInt32(in, 0, 9);
      a.accepted = ConsumeInt32(in, 0, 9);
      a.finished = in.ConsumeIntegralInRange(0, 3) == 0;
    }
    (void)dpbalancePlugin_v1.report(ctx, attention_us, step_us, accepted.data(),
                                    in.ConsumeIntegralInRange(0, 15) == 0 ? -1 : static_cast<int32_t>(accepted.size()));
  }
  dpbStats_v1_t stats;
  (void)dpbalancePlugin_v1.stats(ctx, &stats);
  return 0;
}
