// dpbalance-reference-engine: a small multi-rank decode loop that uses dpbalance exactly as a
// real engine would: dlopen(DPB_PLUGIN) + the C ABI + DPB_* flags, nothing else.
//
// Ranks are threads. Each step a rank plans its verify lengths through the plugin, spends its
// attention phase as real wall-clock time from the truth cost model (published V2, scaled by
// --time_scale), meets the other ranks at a barrier (the MoE layer), spends the FFN + draft time,
// samples acceptance and reports. The engine measures the bubble itself (wall clock, per step:
// 1 - mean/max attention time) and the goodput (tokens per wall second), for three runs: plugin
// off, on, and A/B epochs (where the plugin's own per-arm statistics are printed too).
//
// Requests: `--routing rr` (default) keeps each rank at --reqs_per_rank, a finished request
// replaced by the rank's next one from the trace (round robin). `--routing A..E` routes every new
// request centrally through the same library's router ABI (dpbalanceRouter_v1), as an engine's
// DP router would: the instance keeps dp x reqs_per_rank in flight and ranks' batches differ.
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
ABSL_FLAG(std::string, routing, "rr",
          "rr (each rank replaces its own finished requests) or A, B, C, D, E (every new request "
          "routed through the library's router ABI)");

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

// Request `i` of the trace (cyclic), with its acceptance rates shifted by `logit_shift`.
Req TraceReq(const std::vector<replay::TraceRequest>& trace, size_t i, double logit_shift) {
  const replay::TraceRequest& t = trace[i % trace.size()];
  return Req{static_cast<int64_t>(i), t.input_tokens, t.output_tokens,
             ShiftedProfile(MtpK8ConditionalProfile(), logit_shift)};
}

// A rank's load as the router ABI reads it, with one more request.
void AddToLoad(dpbRankLoad_v1_t& l, const Req& q) {
  l.num_requests += 1;
  l.ctx_tokens += q.ctx;
  l.max_ctx_tokens = std::max(l.max_ctx_tokens, q.ctx);
  l.reserved_tokens += q.ctx + q.remaining;
}

// The central admission of `--routing A..E`: new requests from the trace, each routed through
// the router ABI on the ranks' current loads. Called by one thread while the ranks wait.
class Admission {
 public:
  Admission(const dpbalanceRouter_v1_t* api, void* router, const std::vector<replay::TraceRequest>& trace,
            uint64_t seed)
      : api_(api), router_(router), trace_(trace), rng_(seed) {}
  // Routes `n` more requests (plus any still waiting) into `batches`.
  void Admit(int n, std::vector<std::vector<Req>>& batches) {
    std::normal_distribution<double> shift(0, 1);
    for (int i = 0; i < n; ++i) {
      waiting_.push_back(TraceReq(trace_, next_, shift(rng_)));
      ++next_;
    }
    const int R = static_cast<int>(batches.size());
    std::vector<dpbRankLoad_v1_t> loads(R);
    for (int r = 0; r < R; ++r) {
      dpbRankLoad_v1_t& l = loads[r];
      l = {};
      l.capacity_tokens = int64_t{1} << 40;  // the reference engine's KV never binds
      for (const Req& q : batches[r]) AddToLoad(l, q);
    }
    size_t placed = 0;
    for (; placed < waiting_.size(); ++placed) {
      const Req& q = waiting_[placed];
      int32_t rank = -1;
      const dpbResult_t rc = api_->route(router_, loads.data(), R, q.ctx, q.remaining, &rank);
      if (rc == dpbFallback) break;  // no room: waits, in order
      if (rc != dpbSuccess) {        // the engine's own rule
        rank = static_cast<int32_t>(next_ % R);
        ++router_errors_;
      }
      batches[rank].push_back(q);
      AddToLoad(loads[rank], q);
    }
    waiting_.erase(waiting_.begin(), waiting_.begin() + static_cast<long>(placed));
  }
  void Finished(int64_t output_tokens) { api_->observe_finished(router_, output_tokens); }
  int router_errors() const { return router_errors_; }

 private:
  const dpbalanceRouter_v1_t* api_;
  void* router_;
  const std::vector<replay::TraceRequest>& trace_;
  std::mt19937_64 rng_;
  size_t next_ = 0;
  std::vector<Req> waiting_;
  int router_errors_ = 0;
};

RunResult Run(const dpbalancePlugin_v1_t* plugin, const std::string& config,
              const std::vector<replay::TraceRequest>& trace, Admission* admission) {
  const int R = absl::GetFlag(FLAGS_dp), per_rank = absl::GetFlag(FLAGS_reqs_per_rank);
  const int steps = absl::GetFlag(FLAGS_steps), k_max = absl::GetFlag(FLAGS_k_max);
  const int default_k = absl::GetFlag(FLAGS_default_k);
  const double scale = absl::GetFlag(FLAGS_time_scale);
  const CostModel truth = CostModel::PublishedV2();
  const GlobalCost global;  // 20 ms FFN + 2 us/token, 1.5 ms per draft step (replay defaults)

  std::vector<void*> ctx(R, nullptr);
  std::vector<double> attn_us(R), step_tokens(R), query_tokens(R);
  std::vector<int32_t> depth(R);
  std::atomic<int> init_failures{0}, fallbacks{0};
  std::barrier sync(R);
  RunResult result;
  std::vector<std::vector<Req>> batches(R);
  std::vector<std::vector<int64_t>> finished_outputs(R);  // this step's, per rank (routing)
  if (admission) admission->Admit(R * per_rank, batches);
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
      const Req q = TraceReq(trace, next, shift(rng));
      next += R;
      return q;
    };
    std::vector<Req>& batch = batches[r];
    if (!admission) {
      for (int i = 0; i < per_rank; ++i) batch.push_back(draw());
    }

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
      query_tokens[r] = agg.query_tokens;
      // MoE barrier: the slowest rank sets the pace.
      sync.arrive_and_wait();
      // The FFN and EP communication see the instance's tokens; the draft runs the agreed depth.
      int32_t step_depth = 0;
      double q_total = 0;
      for (int i = 0; i < R; ++i) {
        step_depth = std::max(step_depth, depth[i]);
        q_total += query_tokens[i];
      }
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
      if (admission) {  // leave; rank 0 routes the replacements below, while the others wait
        finished_outputs[r].clear();
        for (size_t i = 0; i < batch.size();) {
          if (batch[i].remaining > 0) {
            ++i;
            continue;
          }
          finished_outputs[r].push_back(trace[batch[i].id % trace.size()].output_tokens);
          batch[i] = batch.back();
          batch.pop_back();
        }
      } else {
        for (auto& q : batch) {
          if (q.remaining <= 0) q = draw();
        }
      }
      sync.arrive_and_wait();
      if (r == 0 && admission) {
        int n = 0;
        for (const auto& f : finished_outputs) {
          for (int64_t out : f) admission->Finished(out);
          n += static_cast<int>(f.size());
        }
        admission->Admit(n, batches);
      }
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
  const std::string routing = absl::GetFlag(FLAGS_routing);
  if (routing != "rr" && routing != "A" && routing != "B" && routing != "C" && routing != "D" &&
      routing != "E") {
    std::fprintf(stderr, "reference engine: --routing=%s: expected rr, A, B, C, D or E\n", routing.c_str());
    return 2;
  }
  const dpbalanceRouter_v1_t* router_api = nullptr;
  if (routing != "rr") {
    router_api = static_cast<const dpbalanceRouter_v1_t*>(dlsym(lib, DPB_ROUTER_SYMBOL));
    if (!router_api) {
      std::fprintf(stderr, "reference engine: '%s' has no symbol %s (--routing=%s)\n", path.c_str(),
                   DPB_ROUTER_SYMBOL, routing.c_str());
      return 1;
    }
  }
  std::printf("reference engine: plugin %s (%s), DP%d, %d requests/rank from %s, %d steps per run, "
              "routing %s\n",
              path.c_str(), plugin->name, absl::GetFlag(FLAGS_dp), absl::GetFlag(FLAGS_reqs_per_rank),
              absl::GetFlag(FLAGS_trace).c_str(), absl::GetFlag(FLAGS_steps),
              routing == "rr" ? "round robin per rank" : absl::StrCat(routing, " (router ABI)").c_str());
  // Each run routes with a fresh router and the same request sequence.
  int router_errors = 0;
  auto run = [&](const std::string& config) -> absl::StatusOr<RunResult> {
    if (!router_api) return Run(plugin, config, *trace, nullptr);
    const std::string rc = absl::StrCat("routing=", routing);
    const dpbRouterArgs_v1_t args{absl::GetFlag(FLAGS_dp), rc.c_str()};
    void* router = nullptr;
    if (router_api->create(&args, &router) != dpbSuccess) {
      return absl::InvalidArgumentError(absl::StrCat("router create with '", rc, "' failed (see the log)"));
    }
    Admission admission(router_api, router, *trace, absl::GetFlag(FLAGS_seed) * 1000 + 999);
    RunResult r = Run(plugin, config, *trace, &admission);
    router_errors += admission.router_errors();
    router_api->destroy(router);
    return r;
  };
  absl::StatusOr<RunResult> off_r = run(absl::StrCat(common, ";mode=off;group=off"));
  absl::StatusOr<RunResult> on_r = run(absl::StrCat(common, ";mode=goodput;group=on"));
  absl::StatusOr<RunResult> ab_r = run(absl::StrCat(common, ";mode=goodput;group=ab;ab_epoch=",
                                                   absl::GetFlag(FLAGS_ab_epoch)));
  for (const auto* r : {&off_r, &on_r, &ab_r}) {
    if (!r->ok()) {
      std::fprintf(stderr, "reference engine: %s\n", std::string(r->status().message()).c_str());
      return 1;
    }
  }
  if (router_errors > 0) {
    std::fprintf(stderr, "reference engine: the router refused %d requests (see the log)\n", router_errors);
    return 1;
  }
  const RunResult &off = *off_r, &on = *on_r, &ab = *ab_r;
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
        "{\"routing\":\"%s\",\"bubble_fraction_off\":%.6f,\"bubble_fraction_on\":%.6f,\"bubble_fraction_ab_run\":%.6f,"
        "\"goodput_off_tok_per_s\":%.3f,\"goodput_on_tok_per_s\":%.3f,\"goodput_ab_run_tok_per_s\":%.3f,"
        "\"bubble_reduction\":%.6f,\"fallbacks_on\":%d,"
        "\"ab\":{\"on_epochs\":%d,\"on_bubble\":%.6f,\"on_bubble_ci95\":%.6f,\"on_goodput\":%.3f,"
        "\"on_goodput_ci95\":%.3f,\"off_epochs\":%d,\"off_bubble\":%.6f,\"off_bubble_ci95\":%.6f,"
        "\"off_goodput\":%.3f,\"off_goodput_ci95\":%.3f}}\n",
        routing, off.bubble_fraction, on.bubble_fraction, ab.bubble_fraction, off.goodput, on.goodput, ab.goodput,
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
