// dpbalance-reference-engine: a small multi-rank decode loop that uses dpbalance exactly as a
// real engine would: dlopen(DPB_PLUGIN) + the C ABI + DPB_* flags, nothing else.
//
// Ranks are threads. Each step a rank plans its verify lengths through the plugin, spends its
// attention phase as real wall-clock time from the truth cost model (published V2, scaled by
// --time_scale), meets the other ranks at a barrier (the MoE layer), spends the FFN + draft time,
// samples acceptance and reports. The engine measures the bubble itself from the ranks' wall-clock
// attention times (BubbleMeter's run figure, 1 - Σ mean / Σ max over steps; dpbalance/metrics.h)
// and the goodput (tokens per wall second), for three runs: plugin off, on, and A/B epochs (where
// the plugin's own per-arm statistics are printed too).
//
// Idle ranks (`--idle_ranks N`): the last N ranks have no work in every other block of
// --idle_block steps. The summaries then ride the engine's own per-step DP sync (the plugin's
// callback backend, as SGLang's MLPSyncBatchInfo.all_gather would carry them), and an idle rank
// makes no plan: the engine writes its row itself, the idle row (`--idle_row idle`,
// IdleRowRecord in dpbalance/summary.h) or zeros (`--idle_row zeros`, what a row without a
// working plugin holds). An idle rank spends no attention and drafts nothing, and its requests
// wait; it still meets the others at the MoE barrier.
//
// Requests: `--routing rr` (default) keeps each rank at --reqs_per_rank, a finished request
// replaced by the rank's next one from the trace (round robin). `--routing A..E` routes every new
// request centrally through the same library's router ABI (dpbalanceRouter_v1), as an engine's
// DP router would: the instance keeps dp x reqs_per_rank in flight and ranks' batches differ.
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "dpbalance/acceptance.h"
#include "dpbalance/cost_model.h"
#include "dpbalance/metrics.h"
#include "dpbalance/plugin/dpbalance_plugin.h"
#include "dpbalance/summary.h"
#include "cli.h"
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
ABSL_FLAG(int, idle_ranks, 0,
          "the last N ranks are idle (no work, no plan) in every other block of --idle_block "
          "steps; the summaries then ride the engine's own per-step sync");
ABSL_FLAG(int, idle_block, 10, "steps per block of --idle_ranks (idle in the odd blocks)");
ABSL_FLAG(std::string, idle_row, "idle",
          "the engine's row for an idle rank in its sync: idle (the idle row) or zeros (what a "
          "rank without a working plugin sends)");

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
  // Tokens per second of truth time: each step priced by the truth model (the slowest active
  // rank's attention + FFN and draft), not by the wall clock (for runs on a loaded machine).
  double truth_goodput = 0;
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
    const int num_ranks = static_cast<int>(batches.size());
    std::vector<dpbRankLoad_v1_t> loads(num_ranks);
    for (int r = 0; r < num_ranks; ++r) {
      dpbRankLoad_v1_t& l = loads[r];
      l = {};
      l.capacity_tokens = int64_t{1} << 40;  // the reference engine's KV never binds
      for (const Req& q : batches[r]) AddToLoad(l, q);
    }
    size_t placed = 0;
    for (; placed < waiting_.size(); ++placed) {
      const Req& q = waiting_[placed];
      int32_t rank = -1;
      const dpbResult_t rc = api_->route(router_, loads.data(), num_ranks, q.ctx, q.remaining, &rank);
      if (rc == dpbFallback) break;  // no room: waits, in order
      if (rc != dpbSuccess) {        // the engine's own rule
        rank = static_cast<int32_t>(next_ % num_ranks);
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

// The run's settings, read from the flags once.
struct RunSettings {
  int num_ranks = 0;
  int reqs_per_rank = 0;
  int steps = 0;
  int k_max = 0;
  int default_k = 0;
  double time_scale = 0;  // wall-clock seconds per model second
  uint64_t seed = 0;
  int idle_ranks = 0;       // the last ones, idle in the odd blocks of idle_block steps
  int idle_block = 1;
  bool idle_row = true;     // the engine's row for an idle rank: the idle row, else zeros

  static RunSettings FromFlags() {
    return RunSettings{.num_ranks = absl::GetFlag(FLAGS_dp),
                       .reqs_per_rank = absl::GetFlag(FLAGS_reqs_per_rank),
                       .steps = absl::GetFlag(FLAGS_steps),
                       .k_max = absl::GetFlag(FLAGS_k_max),
                       .default_k = absl::GetFlag(FLAGS_default_k),
                       .time_scale = absl::GetFlag(FLAGS_time_scale),
                       .seed = absl::GetFlag(FLAGS_seed),
                       .idle_ranks = absl::GetFlag(FLAGS_idle_ranks),
                       .idle_block = absl::GetFlag(FLAGS_idle_block),
                       .idle_row = absl::GetFlag(FLAGS_idle_row) == "idle"};
  }
  bool Idle(int rank_idx, int step) const {
    return rank_idx >= num_ranks - idle_ranks && (step / idle_block) % 2 == 1;
  }
};

// The engine's own per-step DP sync (SGLang's MLPSyncBatchInfo.all_gather): every rank gives one
// row a step, its plugin's record (the plugin's all-gather callback) or the engine's own row for
// a rank that makes no plan, and reads every rank's rows.
class EngineSync {
 public:
  explicit EngineSync(int num_ranks) : rows_(num_ranks * kSummaryBytes), sync_(num_ranks) {}
  void Gather(int rank_idx, const void* row, void* all_rows) {
    std::memcpy(&rows_[rank_idx * kSummaryBytes], row, kSummaryBytes);
    sync_.arrive_and_wait();
    std::memcpy(all_rows, rows_.data(), rows_.size());
    sync_.arrive_and_wait();  // every rank has read before any writes the next step's row
  }

 private:
  std::vector<uint8_t> rows_;
  std::barrier<> sync_;
};

// One rank's end of the sync, as the plugin's all-gather callback (dpbBackendCallback).
struct SyncMember {
  EngineSync* sync = nullptr;
  int rank_idx = 0;
  bool gathered = false;  // the plugin ran the sync this step
};

int SyncCallback(void* user, const void* send, void* recv, size_t record_bytes, int32_t /*timeout_ms*/) {
  auto* m = static_cast<SyncMember*>(user);
  if (record_bytes != kSummaryBytes) return 1;
  m->sync->Gather(m->rank_idx, send, recv);
  m->gathered = true;
  return 0;
}

// What one run needs: the plugin (null: none) with its config string, the trace, and the central
// admission (null: `--routing rr`).
struct RunInputs {
  RunSettings settings;
  const dpbalancePlugin_v1_t* plugin = nullptr;
  std::string config;
  const std::vector<replay::TraceRequest>* trace = nullptr;
  Admission* admission = nullptr;
};

// The state the rank threads share. Each rank writes its own slot of the per-rank vectors before
// a barrier; rank 0 reads all of them after it and alone updates the run's measurement.
struct SharedState {
  explicit SharedState(int num_ranks)
      : sync(num_ranks),
        plugin_ctx(num_ranks, nullptr),
        attention_us(num_ranks),
        emitted_tokens(num_ranks),
        query_tokens(num_ranks),
        draft_depth(num_ranks),
        batches(num_ranks),
        finished_outputs(num_ranks),
        engine_sync(num_ranks),
        members(num_ranks),
        idle(num_ranks),
        truth_attention_us(num_ranks) {}

  std::barrier<> sync;
  std::vector<void*> plugin_ctx;
  std::vector<double> attention_us;    // this step's measured attention, wall-clock µs
  std::vector<double> emitted_tokens;  // this step's accepted + bonus tokens
  std::vector<double> query_tokens;    // this step's verify tokens (the FFN's load)
  std::vector<int32_t> draft_depth;    // this step's planned draft depth
  std::vector<std::vector<Req>> batches;
  std::vector<std::vector<int64_t>> finished_outputs;  // this step's, per rank (routing)
  EngineSync engine_sync;               // with --idle_ranks: the engine's per-step DP sync
  std::vector<SyncMember> members;
  std::vector<uint8_t> idle;            // this step, per rank
  std::atomic<int> init_failures{0}, fallbacks{0};
  // Rank 0's measurement of the run.
  Clock::time_point start;
  BubbleMeter bubble;  // wall-clock attention times
  double model_time_us = 0;
  std::vector<double> truth_attention_us;  // this step's attention per the truth model, per rank
  double truth_time_us = 0;
  int64_t tokens = 0;
  RunResult result;
};

// One rank's decode loop. A step (Step) plans verify lengths through the plugin, spends the
// attention time, meets the other ranks at the MoE barrier, spends the FFN + draft time, samples
// acceptance, reports to the plugin and releases finished requests; then rank 0, while the others
// wait, admits the routed replacements and measures the step.
class RankLoop {
 public:
  RankLoop(int rank_idx, const RunInputs& in, SharedState& shared)
      : rank_idx_(rank_idx),
        in_(in),
        settings_(in.settings),
        shared_(shared),
        batch_(shared.batches[rank_idx]),
        rng_(settings_.seed * 1000 + rank_idx),
        next_trace_idx_(rank_idx) {}

  void Run() {
    if (!in_.admission) {
      for (int i = 0; i < settings_.reqs_per_rank; ++i) batch_.push_back(DrawRoundRobin());
    }
    InitPlugin();
    shared_.sync.arrive_and_wait();
    if (rank_idx_ == 0) shared_.start = Clock::now();
    shared_.sync.arrive_and_wait();
    for (int s = 0; s < settings_.steps; ++s) Step(s);
    Finish();
  }

 private:
  void* plugin_ctx() const { return in_.plugin ? shared_.plugin_ctx[rank_idx_] : nullptr; }

  // Round-robin placement from the trace: request i goes to rank i % num_ranks (engine default).
  Req DrawRoundRobin() {
    const Req q = TraceReq(*in_.trace, next_trace_idx_, shift_(rng_));
    next_trace_idx_ += settings_.num_ranks;
    return q;
  }

  void InitPlugin() {
    if (!in_.plugin) return;
    dpbInitArgs_v1_t args{};
    args.num_ranks = settings_.num_ranks;
    args.rank = rank_idx_;
    args.config = in_.config.c_str();
    args.backend = dpbBackendInProcess;
    args.cuda_device = -1;
    if (settings_.idle_ranks > 0) {  // the records ride the engine's own sync
      SyncMember& m = shared_.members[rank_idx_];
      m = SyncMember{&shared_.engine_sync, rank_idx_, false};
      args.backend = dpbBackendCallback;
      args.allgather_fn = SyncCallback;
      args.allgather_user = &m;
    }
    if (in_.plugin->init(&args, &shared_.plugin_ctx[rank_idx_]) != dpbSuccess) shared_.init_failures++;
  }

  void Step(int step) {
    const bool idle = settings_.Idle(rank_idx_, step);
    shared_.idle[rank_idx_] = idle;
    if (idle) {
      JoinSyncIdle();
    } else {
      Plan();
    }
    const Clock::time_point start = idle ? Clock::now() : SpendAttention();
    shared_.sync.arrive_and_wait();  // the MoE layer: the slowest rank sets the pace
    SpendFfnAndDraft();
    const double step_wall_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    if (!idle) {
      SampleAcceptance();
      Report(step_wall_us);
      ReleaseFinished();
    }
    shared_.sync.arrive_and_wait();
    if (rank_idx_ == 0) {  // while the other ranks wait
      AdmitRouted();
      MeasureStep(step_wall_us);
    }
    shared_.sync.arrive_and_wait();
  }

  // Verify lengths and draft depth: the plugin's, else the engine's static default.
  void Plan() {
    reqs_.resize(batch_.size());
    verify_len_.resize(batch_.size());
    for (size_t i = 0; i < batch_.size(); ++i) {
      const int32_t k_cap = static_cast<int32_t>(std::min<int64_t>(settings_.k_max, batch_[i].remaining - 1));
      reqs_[i] = dpbRequest_v1_t{batch_[i].id, batch_[i].ctx, 0, k_cap, nullptr, 0};
      verify_len_[i] = std::min(settings_.default_k, k_cap);
    }
    int32_t draft_depth = settings_.default_k;
    SyncMember& m = shared_.members[rank_idx_];
    m.gathered = false;
    if (void* ctx = plugin_ctx()) {
      const dpbResult_t rc = in_.plugin->plan(ctx, reqs_.data(), static_cast<int32_t>(reqs_.size()), -1,
                                              verify_len_.data(), &draft_depth);
      if (rc != dpbSuccess) shared_.fallbacks++;
    }
    if (settings_.idle_ranks > 0 && !m.gathered) {  // the engine's sync runs every step regardless
      const std::array<uint8_t, kSummaryBytes> zeros{};
      std::vector<uint8_t> rows(kSummaryBytes * settings_.num_ranks);
      shared_.engine_sync.Gather(rank_idx_, zeros.data(), rows.data());
    }
    shared_.draft_depth[rank_idx_] = draft_depth;
  }

  // An idle rank's step: no plan; the engine writes its row in the sync itself. It spends no
  // attention, drafts nothing and emits nothing.
  void JoinSyncIdle() {
    const RankSummary idle_row = IdleRowRecord();
    const std::array<uint8_t, kSummaryBytes> zeros{};
    std::vector<uint8_t> rows(kSummaryBytes * settings_.num_ranks);
    shared_.engine_sync.Gather(rank_idx_, settings_.idle_row ? static_cast<const void*>(&idle_row) : zeros.data(),
                               rows.data());
    shared_.attention_us[rank_idx_] = 0;
    shared_.truth_attention_us[rank_idx_] = 0;
    shared_.query_tokens[rank_idx_] = 0;
    shared_.draft_depth[rank_idx_] = 0;
    shared_.emitted_tokens[rank_idx_] = 0;
    if (in_.admission) shared_.finished_outputs[rank_idx_].clear();
  }

  // Spends the batch's attention time from the truth cost model as wall-clock time; returns when
  // it started.
  Clock::time_point SpendAttention() {
    std::vector<RequestLoad> loads;
    loads.reserve(batch_.size());
    for (size_t i = 0; i < batch_.size(); ++i) loads.push_back({batch_[i].ctx, 1 + verify_len_[i]});
    const BatchAggregates agg = truth_.Aggregate(loads);  // simulates a grid truth's kernel
    const double attention_us = truth_.AttentionUs(agg);
    shared_.truth_attention_us[rank_idx_] = attention_us;
    const Clock::time_point start = Clock::now();
    SleepUntil(start + ScaledDuration(attention_us));
    shared_.attention_us[rank_idx_] = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    shared_.query_tokens[rank_idx_] = agg.query_tokens;
    return start;
  }

  // The FFN and EP communication see the instance's tokens; the draft runs the deepest planned
  // depth.
  void SpendFfnAndDraft() {
    int32_t step_depth = 0;
    double query_tokens = 0;
    for (int i = 0; i < settings_.num_ranks; ++i) {
      step_depth = std::max(step_depth, shared_.draft_depth[i]);
      query_tokens += shared_.query_tokens[i];
    }
    SleepUntil(Clock::now() + ScaledDuration(global_.StepUs(query_tokens, step_depth)));
  }

  // Accepts each draft position with the request's conditional rate, up to the first rejection.
  void SampleAcceptance() {
    accepted_.resize(batch_.size());
    double emitted = 0;
    for (size_t i = 0; i < batch_.size(); ++i) {
      Req& q = batch_[i];
      int num_accepted = 0;
      while (num_accepted < verify_len_[i] && uniform_(rng_) < q.rates[num_accepted]) ++num_accepted;
      q.ctx += num_accepted + 1;
      q.remaining -= num_accepted + 1;
      emitted += num_accepted + 1;
      accepted_[i] = dpbAccepted_v1_t{q.id, verify_len_[i], num_accepted, q.remaining <= 0};
    }
    shared_.emitted_tokens[rank_idx_] = emitted;
  }

  // Reports the step to the plugin in model time.
  void Report(double step_wall_us) {
    void* ctx = plugin_ctx();
    if (!ctx) return;
    const double scale = settings_.time_scale;
    in_.plugin->report(ctx, shared_.attention_us[rank_idx_] / scale, step_wall_us / scale, accepted_.data(),
                       static_cast<int32_t>(accepted_.size()));
  }

  // Finished requests leave: with routing, rank 0 routes their replacements after the barrier
  // (AdmitRouted); round robin, the rank draws its own next one in place.
  void ReleaseFinished() {
    if (!in_.admission) {
      for (Req& q : batch_) {
        if (q.remaining <= 0) q = DrawRoundRobin();
      }
      return;
    }
    std::vector<int64_t>& finished = shared_.finished_outputs[rank_idx_];
    finished.clear();
    for (size_t i = 0; i < batch_.size();) {
      if (batch_[i].remaining > 0) {
        ++i;
        continue;
      }
      finished.push_back((*in_.trace)[batch_[i].id % in_.trace->size()].output_tokens);
      batch_[i] = batch_.back();
      batch_.pop_back();
    }
  }

  // Rank 0, routing: tells the router what finished and routes as many new requests.
  void AdmitRouted() {
    if (!in_.admission) return;
    int num_finished = 0;
    for (const std::vector<int64_t>& outputs : shared_.finished_outputs) {
      for (int64_t output_tokens : outputs) in_.admission->Finished(output_tokens);
      num_finished += static_cast<int>(outputs.size());
    }
    in_.admission->Admit(num_finished, shared_.batches);
  }

  // Rank 0: the engine's own measurement of the step (wall clock; model time from rank 0's step).
  void MeasureStep(double step_wall_us) {
    std::vector<double> active;  // an idle rank is not part of the step's bubble
    for (int r = 0; r < settings_.num_ranks; ++r) {
      if (!shared_.idle[r]) active.push_back(shared_.attention_us[r]);
    }
    shared_.bubble.AddStep(active);
    for (double tokens : shared_.emitted_tokens) shared_.tokens += static_cast<int64_t>(tokens);
    shared_.model_time_us += step_wall_us / settings_.time_scale;
    int32_t depth = 0;
    double query_tokens = 0, barrier_us = 0;
    for (int r = 0; r < settings_.num_ranks; ++r) {
      depth = std::max(depth, shared_.draft_depth[r]);
      query_tokens += shared_.query_tokens[r];
      barrier_us = std::max(barrier_us, shared_.truth_attention_us[r]);
    }
    shared_.truth_time_us += barrier_us + global_.StepUs(query_tokens, depth);
  }

  // Rank 0 takes the goodput and the plugin's statistics before any rank finalizes.
  void Finish() {
    if (rank_idx_ == 0) {
      const double wall_s = std::chrono::duration<double>(Clock::now() - shared_.start).count();
      shared_.result.goodput = shared_.tokens / wall_s;
      shared_.result.model_goodput = shared_.tokens / (shared_.model_time_us * 1e-6);
      shared_.result.truth_goodput = shared_.tokens / (shared_.truth_time_us * 1e-6);
    }
    if (!in_.plugin) return;
    void* ctx = plugin_ctx();
    if (rank_idx_ == 0 && ctx) in_.plugin->stats(ctx, &shared_.result.stats);
    shared_.sync.arrive_and_wait();  // every rank, also one whose init failed: else the others wait forever
    if (ctx) in_.plugin->finalize(ctx);
  }

  std::chrono::nanoseconds ScaledDuration(double model_us) const {
    return std::chrono::nanoseconds(static_cast<int64_t>(model_us * settings_.time_scale * 1000));
  }

  const int rank_idx_;
  const RunInputs& in_;
  const RunSettings& settings_;
  SharedState& shared_;
  std::vector<Req>& batch_;
  const CostModel truth_ = CostModel::PublishedV2();
  const GlobalCost global_;  // 20 ms FFN + 2 us/token, 1.5 ms per draft step (replay defaults)
  std::mt19937_64 rng_;
  std::normal_distribution<double> shift_{0, 1};        // a request's acceptance logit shift
  std::uniform_real_distribution<double> uniform_{0, 1};  // acceptance draws
  size_t next_trace_idx_;
  std::vector<dpbRequest_v1_t> reqs_;
  std::vector<int32_t> verify_len_;
  std::vector<dpbAccepted_v1_t> accepted_;
};

// One run: the ranks as threads, the instance's bubble and goodput as the engine measures them.
RunResult Run(const RunInputs& in) {
  const int num_ranks = in.settings.num_ranks;
  SharedState shared(num_ranks);
  if (in.admission) in.admission->Admit(num_ranks * in.settings.reqs_per_rank, shared.batches);
  std::vector<std::thread> threads;
  for (int r = 0; r < num_ranks; ++r) {
    threads.emplace_back([&in, &shared, r] { RankLoop(r, in, shared).Run(); });
  }
  for (std::thread& t : threads) t.join();
  RunResult result = shared.result;
  result.bubble_fraction = shared.bubble.fraction();
  result.tokens = shared.tokens;
  result.fallbacks = shared.fallbacks.load();
  result.plugin_ok = shared.init_failures.load() == 0;
  return result;
}

// The library's entry points.
struct Library {
  std::string path;
  const dpbalancePlugin_v1_t* plugin = nullptr;
  const dpbalanceRouter_v1_t* router_api = nullptr;  // null with --routing rr
};

// The plugin library to load: --plugin, else $DPB_PLUGIN, else the built one; a bare name means
// lib<name>.so (NCCL's convention). "none" stays "none".
std::string PluginPath() {
  std::string path = absl::GetFlag(FLAGS_plugin);
  if (path.empty()) {
    const char* env = std::getenv("DPB_PLUGIN");
    path = env && *env ? env : DPB_DEFAULT_PLUGIN;
  }
  if (path != "none" && path.find('/') == std::string::npos && path.find(".so") == std::string::npos) {
    path = absl::StrCat("lib", path, ".so");
  }
  return path;
}

// Loads the plugin, and the router ABI when `routing` is not "rr".
absl::StatusOr<Library> LoadLibrary(const std::string& path, const std::string& routing) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!lib) return absl::NotFoundError(absl::StrFormat("cannot load plugin '%s': %s", path, dlerror()));
  Library out{path};
  out.plugin = static_cast<const dpbalancePlugin_v1_t*>(dlsym(lib, DPB_PLUGIN_SYMBOL));
  if (!out.plugin) return absl::NotFoundError(absl::StrFormat("'%s' has no symbol %s", path, DPB_PLUGIN_SYMBOL));
  if (routing == "rr") return out;
  out.router_api = static_cast<const dpbalanceRouter_v1_t*>(dlsym(lib, DPB_ROUTER_SYMBOL));
  if (!out.router_api) {
    return absl::NotFoundError(
        absl::StrFormat("'%s' has no symbol %s (--routing=%s)", path, DPB_ROUTER_SYMBOL, routing));
  }
  return out;
}

// One run with plugin `config`; with routing, through a fresh router over the same request
// sequence. Adds the requests the router refused to `router_errors`.
absl::StatusOr<RunResult> RunWithRouting(const Library& lib, const std::string& routing, const std::string& config,
                                         const std::vector<replay::TraceRequest>& trace, int& router_errors) {
  RunInputs in{RunSettings::FromFlags(), lib.plugin, config, &trace, nullptr};
  if (!lib.router_api) return Run(in);
  const std::string router_config = absl::StrCat("routing=", routing);
  const dpbRouterArgs_v1_t args{in.settings.num_ranks, router_config.c_str()};
  void* router = nullptr;
  if (lib.router_api->create(&args, &router) != dpbSuccess) {
    return absl::InvalidArgumentError(absl::StrCat("router create with '", router_config, "' failed (see the log)"));
  }
  Admission admission(lib.router_api, router, trace, in.settings.seed * 1000 + 999);
  in.admission = &admission;
  RunResult result = Run(in);
  router_errors += admission.router_errors();
  lib.router_api->destroy(router);
  return result;
}

struct ThreeRuns {
  RunResult off, on, ab;
};

// The plugin off, on, and in A/B epochs; an error when a run could not start or the plugin or the
// router failed in one.
absl::StatusOr<ThreeRuns> RunOffOnAb(const Library& lib, const std::string& routing,
                                     const std::vector<replay::TraceRequest>& trace) {
  const std::string common = absl::StrFormat("backend=inproc;k_max=%d;default_k=%d;log_every=0;timeout_ms=2000",
                                             absl::GetFlag(FLAGS_k_max), absl::GetFlag(FLAGS_default_k));
  int router_errors = 0;
  absl::StatusOr<RunResult> off = RunWithRouting(lib, routing, absl::StrCat(common, ";mode=off;group=off"), trace,
                                                 router_errors);
  absl::StatusOr<RunResult> on = RunWithRouting(lib, routing, absl::StrCat(common, ";mode=goodput;group=on"),
                                                trace, router_errors);
  absl::StatusOr<RunResult> ab = RunWithRouting(
      lib, routing, absl::StrCat(common, ";mode=goodput;group=ab;ab_epoch=", absl::GetFlag(FLAGS_ab_epoch)), trace,
      router_errors);
  for (const absl::StatusOr<RunResult>* r : {&off, &on, &ab}) {
    if (!r->ok()) return r->status();
  }
  if (router_errors > 0) {
    return absl::InternalError(absl::StrFormat("the router refused %d requests (see the log)", router_errors));
  }
  if (!off->plugin_ok || !on->plugin_ok || !ab->plugin_ok) {
    return absl::InternalError("plugin init failed (see the log)");
  }
  return ThreeRuns{*off, *on, *ab};
}

void PrintResults(const ThreeRuns& runs) {
  std::printf("%-6s %10s %14s %16s %10s\n", "run", "bubble", "goodput tok/s", "model tok/s", "fallbacks");
  for (const auto& [name, r] :
       {std::pair<const char*, const RunResult&>{"off", runs.off}, {"on", runs.on}, {"A/B", runs.ab}}) {
    std::printf("%-6s %10.4f %14.1f %16.1f %10d\n", name, r.bubble_fraction, r.goodput, r.model_goodput, r.fallbacks);
  }
  std::printf("measured bubble reduction on vs off: %.1f%% (target >= 30%%); goodput x%.4f\n",
              100 * (1 - runs.on.bubble_fraction / runs.off.bubble_fraction), runs.on.goodput / runs.off.goodput);
  if (const int idle = absl::GetFlag(FLAGS_idle_ranks); idle > 0) {
    std::printf("idle ranks: %d of %d idle in every other block of %d steps, the engine's row for them: %s;\n"
                "  plugin on: rank 0 planned %lld of %lld steps (%lld fallbacks); goodput in truth time "
                "(each step priced by the truth model): off %.1f, on %.1f tok/s (x%.4f)\n",
                idle, absl::GetFlag(FLAGS_dp), absl::GetFlag(FLAGS_idle_block), absl::GetFlag(FLAGS_idle_row).c_str(),
                static_cast<long long>(runs.on.stats.balanced_steps), static_cast<long long>(runs.on.stats.steps),
                static_cast<long long>(runs.on.stats.fallbacks), runs.off.truth_goodput, runs.on.truth_goodput,
                runs.on.truth_goodput / runs.off.truth_goodput);
  }
  const dpbStats_v1_t& s = runs.ab.stats;
  std::printf("A/B (plugin's own measurement, %lld on / %lld off epochs of %d steps):\n"
              "  on : bubble %.4f +- %.4f, goodput %.1f +- %.1f tok/s (model time)\n"
              "  off: bubble %.4f +- %.4f, goodput %.1f +- %.1f tok/s (model time)\n",
              static_cast<long long>(s.ab_on_epochs), static_cast<long long>(s.ab_off_epochs),
              absl::GetFlag(FLAGS_ab_epoch), s.ab_on_bubble, s.ab_on_bubble_ci95, s.ab_on_goodput,
              s.ab_on_goodput_ci95, s.ab_off_bubble, s.ab_off_bubble_ci95, s.ab_off_goodput,
              s.ab_off_goodput_ci95);
}

void WriteJson(const std::string& path, const std::string& routing, const ThreeRuns& runs) {
  const RunResult &off = runs.off, &on = runs.on, &ab = runs.ab;
  const dpbStats_v1_t& s = ab.stats;
  std::ofstream f(path);
  f << absl::StrFormat(
      "{\"routing\":\"%s\",\"bubble_fraction_off\":%.6f,\"bubble_fraction_on\":%.6f,\"bubble_fraction_ab_run\":%.6f,"
      "\"goodput_off_tok_per_s\":%.3f,\"goodput_on_tok_per_s\":%.3f,\"goodput_ab_run_tok_per_s\":%.3f,"
      "\"bubble_reduction\":%.6f,\"fallbacks_on\":%d,\"model_goodput_on_tok_per_s\":%.3f,"
      "\"steps_on\":%d,\"balanced_steps_on\":%d,\"idle_ranks\":%d,\"idle_row\":\"%s\","
      "\"truth_goodput_off_tok_per_s\":%.3f,\"truth_goodput_on_tok_per_s\":%.3f,"
      "\"ab\":{\"on_epochs\":%d,\"on_bubble\":%.6f,\"on_bubble_ci95\":%.6f,\"on_goodput\":%.3f,"
      "\"on_goodput_ci95\":%.3f,\"off_epochs\":%d,\"off_bubble\":%.6f,\"off_bubble_ci95\":%.6f,"
      "\"off_goodput\":%.3f,\"off_goodput_ci95\":%.3f}}\n",
      routing, off.bubble_fraction, on.bubble_fraction, ab.bubble_fraction, off.goodput, on.goodput, ab.goodput,
      1 - on.bubble_fraction / off.bubble_fraction, on.fallbacks, on.model_goodput, on.stats.steps,
      on.stats.balanced_steps, absl::GetFlag(FLAGS_idle_ranks), absl::GetFlag(FLAGS_idle_row), off.truth_goodput,
      on.truth_goodput, s.ab_on_epochs, s.ab_on_bubble,
      s.ab_on_bubble_ci95, s.ab_on_goodput, s.ab_on_goodput_ci95, s.ab_off_epochs, s.ab_off_bubble,
      s.ab_off_bubble_ci95, s.ab_off_goodput, s.ab_off_goodput_ci95);
}

bool IsRouting(const std::string& routing) {
  for (const char* known : {"rr", "A", "B", "C", "D", "E"}) {
    if (routing == known) return true;
  }
  return false;
}

// Every flag checked before the plugin is loaded (exit status 2): numbers in range, the routing
// known, --json writable.
absl::Status CheckFlags() {
  auto in_range = [](const char* name, int64_t v, int64_t lo, int64_t hi) -> absl::Status {
    if (v < lo || v > hi) {
      return absl::InvalidArgumentError(absl::StrFormat("--%s = %d must be in %d..%d", name, v, lo, hi));
    }
    return absl::OkStatus();
  };
  const int k_max = absl::GetFlag(FLAGS_k_max);
  for (absl::Status s : {in_range("dp", absl::GetFlag(FLAGS_dp), 1, 1024),  // ranks are threads
                         in_range("reqs_per_rank", absl::GetFlag(FLAGS_reqs_per_rank), 1, 4096),
                         // 10^6 steps at ~50 ms a step: a 14 h run, past any use of a reference engine
                         in_range("steps", absl::GetFlag(FLAGS_steps), 1, 1000000),
                         in_range("k_max", k_max, 0, kMaxDraftLen),
                         in_range("default_k", absl::GetFlag(FLAGS_default_k), 0, k_max),
                         in_range("ab_epoch", absl::GetFlag(FLAGS_ab_epoch), 1, 1000000),
                         in_range("idle_ranks", absl::GetFlag(FLAGS_idle_ranks), 0, absl::GetFlag(FLAGS_dp) - 1),
                         in_range("idle_block", absl::GetFlag(FLAGS_idle_block), 1, 1000000)}) {
    if (!s.ok()) return s;
  }
  // Wall seconds per model second: above 100 a step sleeps minutes; 1e-4 already rounds phases to 0.
  if (const double t = absl::GetFlag(FLAGS_time_scale); !(std::isfinite(t) && t >= 1e-4 && t <= 100)) {
    return absl::InvalidArgumentError(absl::StrFormat("--time_scale = %g must be a number in [0.0001, 100]", t));
  }
  if (const std::string row = absl::GetFlag(FLAGS_idle_row); row != "idle" && row != "zeros") {
    return absl::InvalidArgumentError(absl::StrFormat("--idle_row=%s: expected idle or zeros", row));
  }
  const std::string routing = absl::GetFlag(FLAGS_routing);
  if (!IsRouting(routing)) {
    return absl::InvalidArgumentError(absl::StrFormat("--routing=%s: expected rr, A, B, C, D or E", routing));
  }
  return cli::CheckWritable("--json", absl::GetFlag(FLAGS_json));
}

// Exit status (integration/common/cli.h): 0; 1 when the plugin or the router fails in a run; 2 on
// a bad flag; 3 when the plugin library or the trace is missing or bad.
int Main() {
  auto fail = [](const absl::Status& status, cli::ExitCode code) {
    return cli::Fail("dpbalance-reference-engine", status, code);
  };
  if (absl::Status s = CheckFlags(); !s.ok()) return fail(s, cli::kUsageError);
  const std::string routing = absl::GetFlag(FLAGS_routing);
  const std::string path = PluginPath();
  if (path == "none") {
    return fail(absl::InvalidArgumentError("DPB_PLUGIN=none: nothing to compare"), cli::kUsageError);
  }
  const absl::StatusOr<Library> lib = LoadLibrary(path, routing);
  if (!lib.ok()) return fail(lib.status(), cli::kBadData);
  const absl::StatusOr<std::vector<replay::TraceRequest>> trace =
      replay::LoadTrace(absl::GetFlag(FLAGS_trace), replay::TraceFormat::kAuto, absl::GetFlag(FLAGS_seed));
  if (!trace.ok()) return fail(trace.status(), cli::kBadData);
  std::printf("reference engine: plugin %s (%s), DP%d, %d requests/rank from %s, %d steps per run, "
              "routing %s\n",
              path.c_str(), lib->plugin->name, absl::GetFlag(FLAGS_dp), absl::GetFlag(FLAGS_reqs_per_rank),
              absl::GetFlag(FLAGS_trace).c_str(), absl::GetFlag(FLAGS_steps),
              routing == "rr" ? "round robin per rank" : absl::StrCat(routing, " (router ABI)").c_str());
  const absl::StatusOr<ThreeRuns> runs = RunOffOnAb(*lib, routing, *trace);
  if (!runs.ok()) return fail(runs.status(), cli::kInternalError);
  PrintResults(*runs);
  if (const std::string json = absl::GetFlag(FLAGS_json); !json.empty()) WriteJson(json, routing, *runs);
  return 0;
}

}  // namespace
}  // namespace dpbalance::reference

int main(int argc, char** argv) {
  // Abseil's --help lists only the flags of files named like the program; these are this file's.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, "reference_engine.cc"); };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "Multi-rank reference decode loop that loads dpbalance via dlopen + C ABI: runs the plugin off, on "
      "and in A/B epochs and prints the measured bubble and goodput.\n"
      "Usage: dpbalance-reference-engine [--dp=8] [--steps=240] [--routing=rr|A..E] [--json=out.json]");
  dpbalance::cli::ParseFlags("dpbalance-reference-engine", argc, argv);
  return dpbalance::reference::Main();
}
