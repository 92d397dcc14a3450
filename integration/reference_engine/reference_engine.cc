// dpbalance-reference-engine: a small multi-rank decode loop that uses dpbalance exactly as a
// real engine would: dlopen(DPB_PLUGIN) + the C ABI + DPB_* flags, nothing else.
//
// Ranks are threads. Each step a rank plans its verify lengths through the plugin, spends its
// attention phase as real wall-clock time from the truth cost model (published V2, scaled by
// --time_scale), meets the other ranks at a barrier (the MoE layer), spends the FFN + draft time,
// samples acceptance and reports. The engine measures the bubble itself (wall clock, per step:
// 1 - mean/max attention time) and the goodput (tokens per wall second), for three runs: plugin
// off, on, and A/B epochs (where the plugin's own per-arm statistics are printed too).
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "dpbalance/acceptance.h"
#include "dpbalance/cost_model.h"
#include "dpbalance/plugin/dpbalance_plugin.h"
#include "trace.h"

#ifndef DPB_DEFAULT_TRACE
#define DPB_DEFAULT_TRACE "integration/replay/data/mooncake_conversation.jsonl"
#endif
#ifndef DPB_DEFAULT_PLUGIN
#define DPB_DEFAULT_PLUGIN "libdpbalance.so"
#endif

ABSL_FLAG(std::string, plugin, "", "plugin library (default: $DPB_PLUGIN, else the built one)");
ABSL_FLAG(std::string, trace, DPB_DEFAULT_TRACE, "trace the batch mix is drawn from");
ABSL_FLAG(int, dp, 8, "DP ranks (threads)");
ABSL_FLAG(int, reqs_per_rank, 24, "requests per rank (a finished request is replaced)");
ABSL_FLAG(int, steps, 240, "decode steps per run");
ABSL_FLAG(int, k_max, 7, "draft depth limit");
ABSL_FLAG(int, default_k, 1, "the engine's static verify length (plugin off)");
ABSL_FLAG(double, time_scale, 0.2,
          "wall-clock seconds per model second (shorter runs, but sleep jitter grows relative)");
ABSL_FLAG(int, ab_epoch, 20, "steps per A/B epoch in the A/B run");
ABSL_FLAG(uint64_t, seed, 7, "random seed (same batch mix in every run)");
ABSL_FLAG(std::string, json, "", "write the measured figures to this file");

namespace dpbalance::reference {
namespace {

using Clock = std::chrono::steady_clock;

struct Req {
  int64_t id;
  int64_t ctx;
  int64_t remaining;
  std::array<double, kMaxDraftLen> rates;
};

struct RunResult {
  double bubble_fraction = 0;  // engine-measured, wall clock
  double goodput = 0;          // tokens per wall second
  double model_goodput = 0;    // tokens per model second
  int64_t tokens = 0;
  int fallbacks = 0;
  dpbStats_v1_t stats{};       // rank 0's plugin stats
  bool plugin_ok = true;
};

// Sleeps until `until`, spinning for the last stretch so short phases keep their length.
void SleepUntil(Clock::time_point until) {
  const auto spin = std::chrono::microseconds(200);
  if (until - Clock::now() > spin) std::this_thread::sleep_until(until - spin);
  while (Clock::now() < until) std::this_thread::yield();
}

RunResult Run(const dpbalancePlugin_v1_t* plugin, const std::string& config,
              const std::vector<replay::TraceRequest>& trace) {
  const int R = absl::GetFlag(FLAGS_dp), per_rank = absl::GetFlag(FLAGS_reqs_per_rank);
  const int steps = absl::GetFlag(FLAGS_steps), k_max = absl::GetFlag(FLAGS_k_max);
  const int default_k = absl::GetFlag(FLAGS_default_k);
  const double scale = absl::GetFlag(FLAGS_time_scale);
  const CostModel truth = CostModel::PublishedV2();
  const GlobalCost global;  // 20 ms FFN + 2 us/token, 1.5 ms per draft step (replay defaults)
  const auto profile = MtpK8ConditionalProfile();

  std::vector<void*> ctx(R, nullptr);
  std::vector<double> attn_us(R), step_tokens(R);
  std::vector<int32_t> depth(R);
  std::atomic<int> init_failures{0}, fallbacks{0};
  std::barrier sync(R);
  RunResult result;
  double bubble_num = 0, bubble_den = 0, model_time_us = 0;
  int64_t tokens = 0;
  Clock::time_point t0;

  auto rank_main = [&](int r) {
    std::mt19937_64 rng(absl::GetFlag(FLAGS_seed) * 1000 + r);
    std::normal_distribution<double> shift(0, 1);
    std::uniform_real_distribution<double> u(0, 1);
    // Round-robin placement from the trace: request i goes to rank i % R (engine default).
    size_t next = r;
    auto draw = [&]() {
      const replay::TraceRequest& t = trace[next % trace.size()];
      Req q{static_cast<int64_t>(next), t.input_tokens, t.output_tokens, {}};
      next += R;
      q.rates = ShiftedProfile(profile, shift(rng));
      return q;
    };
    std::vector<Req> batch;
    for (int i = 0; i < per_rank; ++i) batch.push_back(draw());

    if (plugin) {
      dpbInitArgs_v1_t args{};
      args.num_ranks = R;
      args.rank = r;
      args.config = config.c_str();
      args.backend = dpbBackendInProcess;
      args.cuda_device = -1;
      if (plugin->init(&args, &ctx[r]) != dpbSuccess) init_failures++;
    }
    std::vector<dpbRequest_v1_t> reqs;
    std::vector<int32_t> verify;
    std::vector<dpbAccepted_v1_t> acc;
    sync.arrive_and_wait();
    if (r == 0) t0 = Clock::now();
    sync.arrive_and_wait();
    for (int s = 0; s < steps; ++s) {
      // Plan.
      reqs.resize(batch.size());
      verify.resize(batch.size());
      for (size_t i = 0; i < batch.size(); ++i) {
        reqs[i] = dpbRequest_v1_t{batch[i].id, batch[i].ctx, 0,
                                  static_cast<int32_t>(std::min<int64_t>(k_max, batch[i].remaining - 1)),
                                  nullptr, 0};
        verify[i] = std::min(default_k, reqs[i].k_cap);
      }
      int32_t d = default_k;
      if (plugin && ctx[r]) {
        const dpbResult_t rc = plugin->plan(ctx[r], reqs.data(), static_cast<int32_t>(reqs.size()), -1,
                                            verify.data(), &d);
        if (rc != dpbSuccess) fallbacks++;
      }
      depth[r] = d;
      // Attention phase: real time from the truth model.
      std::vector<RequestLoad> loads;
      for (size_t i = 0; i < batch.size(); ++i) loads.push_back({batch[i].ctx, 1 + verify[i]});
      const BatchAggregates agg = truth.Aggregate(loads);  // simulates a grid truth's kernel
      const double attention_us = truth.AttentionUs(agg);
      const auto start = Clock::now();
      SleepUntil(start + std::chrono::nanoseconds(static_cast<int64_t>(attention_us * scale * 1000)));
      const auto end_attn = Clock::now();
      attn_us[r] = std::chrono::duration<double, std::micro>(end_attn - start).count();
      // MoE barrier: the slowest rank sets the pace.
      sync.arrive_and_wait();
      int32_t step_depth = 0;
      double q_total = 0;
      for (int i = 0; i < R; ++i) step_depth = std::max(step_depth, depth[i]);
      q_total = agg.query_tokens * R;  // approximately: FFN time barely depends on it
      SleepUntil(Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(
                                    global.StepUs(q_total, step_depth) * scale * 1000)));
      const double step_wall_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      // Acceptance.
      acc.resize(batch.size());
      double emitted = 0;
      for (size_t i = 0; i < batch.size(); ++i) {
        int m = 0;
        while (m < verify[i] && u(rng) < batch[i].rates[m]) ++m;
        batch[i].ctx += m + 1;
        batch[i].remaining -= m + 1;
        emitted += m + 1;
        acc[i] = dpbAccepted_v1_t{batch[i].id, verify[i], m, batch[i].remaining <= 0};
      }
      step_tokens[r] = emitted;
      if (plugin && ctx[r]) {
        plugin->report(ctx[r], attn_us[r] / scale, step_wall_us / scale, acc.data(),
                       static_cast<int32_t>(acc.size()));
      }
      for (auto& q : batch) {
        if (q.remaining <= 0) q = draw();
      }
      sync.arrive_and_wait();
      if (r == 0) {  // engine-side measurement of this step
        double mx = 0, sum = 0;
        for (int i = 0; i < R; ++i) {
          mx = std::max(mx, attn_us[i]);
          sum += attn_us[i];
          tokens += static_cast<int64_t>(step_tokens[i]);
        }
        bubble_num += mx - sum / R;
        bubble_den += mx;
        model_time_us += step_wall_us / scale;
      }
      sync.arrive_and_wait();
    }
    if (r == 0) {
      const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
      result.goodput = tokens / wall;
      result.model_goodput = tokens / (model_time_us * 1e-6);
    }
    if (plugin && ctx[r]) {
      if (r == 0) plugin->stats(ctx[r], &result.stats);
      sync.arrive_and_wait();
      plugin->finalize(ctx[r]);
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  result.bubble_fraction = bubble_num / bubble_den;
  result.tokens = tokens;
  result.fallbacks = fallbacks.load();
  result.plugin_ok = init_failures.load() == 0;
  return result;
}

int Main() {
  std::string path = absl::GetFlag(FLAGS_plugin);
  if (path.empty()) {
    const char* env = std::getenv("DPB_PLUGIN");
    path = env && *env ? env : DPB_DEFAULT_PLUGIN;
  }
  if (path == "none") {
    std::fprintf(stderr, "reference engine: DPB_PLUGIN=none: nothing to compare\n");
    return 2;
  }
  // NCCL's convention: a bare name means lib<name>.so.
  if (path.find('/') == std::string::npos && path.find(".so") == std::string::npos) {
    path = absl::StrCat("lib", path, ".so");
  }
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!lib) {
    std::fprintf(stderr, "reference engine: cannot load plugin '%s': %s\n", path.c_str(), dlerror());
    return 1;
  }
  const auto* plugin = static_cast<const dpbalancePlugin_v1_t*>(dlsym(lib, DPB_PLUGIN_SYMBOL));
  if (!plugin) {
    std::fprintf(stderr, "reference engine: '%s' has no symbol %s\n", path.c_str(), DPB_PLUGIN_SYMBOL);
    return 1;
  }
  absl::StatusOr<std::vector<replay::TraceRequest>> trace =
      replay::LoadTrace(absl::GetFlag(FLAGS_trace), replay::TraceFormat::kAuto, absl::GetFlag(FLAGS_seed));
  if (!trace.ok()) {
    std::fprintf(stderr, "reference engine: %s\n", std::string(trace.status().message()).c_str());
    return 1;
  }
  const std::string common = absl::StrFormat("backend=inproc;k_max=%d;default_k=%d;log_every=0;timeout_ms=2000",
                                             absl::GetFlag(FLAGS_k_max), absl::GetFlag(FLAGS_default_k));
  std::printf("reference engine: plugin %s (%s), DP%d, %d requests/rank from %s, %d steps per run\n",
              path.c_str(), plugin->name, absl::GetFlag(FLAGS_dp), absl::GetFlag(FLAGS_reqs_per_rank),
              absl::GetFlag(FLAGS_trace).c_str(), absl::GetFlag(FLAGS_steps));
  const RunResult off = Run(plugin, absl::StrCat(common, ";mode=off;group=off"), *trace);
  const RunResult on = Run(plugin, absl::StrCat(common, ";mode=goodput;group=on"), *trace);
  const RunResult ab = Run(plugin, absl::StrCat(common, ";mode=goodput;group=ab;ab_epoch=",
                                                absl::GetFlag(FLAGS_ab_epoch)), *trace);
  if (!off.plugin_ok || !on.plugin_ok || !ab.plugin_ok) {
    std::fprintf(stderr, "reference engine: plugin init failed (see the log)\n");
    return 1;
  }
  std::printf("%-6s %10s %14s %16s %10s\n", "run", "bubble", "goodput tok/s", "model tok/s", "fallbacks");
  for (const auto& [name, r] : {std::pair<const char*, const RunResult&>{"off", off}, {"on", on}, {"A/B", ab}}) {
    std::printf("%-6s %10.4f %14.1f %16.1f %10d\n", name, r.bubble_fraction, r.goodput, r.model_goodput, r.fallbacks);
  }
  std::printf("measured bubble reduction on vs off: %.1f%% (target >= 30%%); goodput x%.4f\n",
              100 * (1 - on.bubble_fraction / off.bubble_fraction), on.goodput / off.goodput);
  const dpbStats_v1_t& s = ab.stats;
  std::printf("A/B (plugin's own measurement, %lld on / %lld off epochs of %d steps):\n"
              "  on : bubble %.4f +- %.4f, goodput %.1f +- %.1f tok/s (model time)\n"
              "  off: bubble %.4f +- %.4f, goodput %.1f +- %.1f tok/s (model time)\n",
              static_cast<long long>(s.ab_on_epochs), static_cast<long long>(s.ab_off_epochs),
              absl::GetFlag(FLAGS_ab_epoch), s.ab_on_bubble, s.ab_on_bubble_ci95, s.ab_on_goodput,
              s.ab_on_goodput_ci95, s.ab_off_bubble, s.ab_off_bubble_ci95, s.ab_off_goodput,
              s.ab_off_goodput_ci95);
  if (const std::string j = absl::GetFlag(FLAGS_json); !j.empty()) {
    std::ofstream f(j);
    f << absl::StrFormat(
        "{\"bubble_fraction_off\":%.6f,\"bubble_fraction_on\":%.6f,\"bubble_fraction_ab_run\":%.6f,"
        "\"goodput_off_tok_per_s\":%.3f,\"goodput_on_tok_per_s\":%.3f,\"goodput_ab_run_tok_per_s\":%.3f,"
        "\"bubble_reduction\":%.6f,\"fallbacks_on\":%d,"
        "\"ab\":{\"on_epochs\":%d,\"on_bubble\":%.6f,\"on_bubble_ci95\":%.6f,\"on_goodput\":%.3f,"
        "\"on_goodput_ci95\":%.3f,\"off_epochs\":%d,\"off_bubble\":%.6f,\"off_bubble_ci95\":%.6f,"
        "\"off_goodput\":%.3f,\"off_goodput_ci95\":%.3f}}\n",
        off.bubble_fraction, on.bubble_fraction, ab.bubble_fraction, off.goodput, on.goodput, ab.goodput,
        1 - on.bubble_fraction / off.bubble_fraction, on.fallbacks, s.ab_on_epochs, s.ab_on_bubble,
        s.ab_on_bubble_ci95, s.ab_on_goodput, s.ab_on_goodput_ci95, s.ab_off_epochs, s.ab_off_bubble,
        s.ab_off_bubble_ci95, s.ab_off_goodput, s.ab_off_goodput_ci95);
  }
  return 0;
}

}  // namespace
}  // namespace dpbalance::reference

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Multi-rank reference decode loop that loads dpbalance via dlopen + C ABI.");
  absl::ParseCommandLine(argc, argv);
  return dpbalance::reference::Main();
}
