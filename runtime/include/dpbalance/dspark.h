// dpbalance/dspark.h — SGLang's DSpark verify planner as it ships: the engines' baseline.
//
// What this is for: dpbalance is judged against the best a user gets without it, and under DP
// attention that is SGLang's DSpark. The replay's `dspark` / `dspark_fill` rows and the plugin's
// DSpark-like mode (DPB_MODE=dspark) run this one implementation, so a live arm and a replay row
// are the same planner.
//
// Source read (docs/results.md section 8 has the full account): sgl-project/sglang
// python/sglang/srt/speculative/dspark_components/dspark_planner.py at commits
// 00c3cffac9ff9fe6ca7a67a430c878664837e871 and 45fb003a819aa4b25053bc28311c00592b145153
// (identical in what follows): `compute_verify_token_budget`, `local_verify_tier_num_tokens`,
// `dp_global_verify_tier_num_tokens`, `_budget_aligned_to_graph_tier`, `graph_tier_fill_budget`;
// the top-k allocator `ScheduleVerifyLensTopk`
// (python/sglang/kernels/ops/speculative/dspark/dspark_schedule.py, 98984213ca90b9d0f5ad2099efcda7c469ab4e49);
// the steps-per-second table `SpsCostTable` (dspark_components/dspark_sps.py,
// 45b76f55042711c33f1e2f0ba2a4281f7a51704a) as `python/sglang/benchmark/dspark_sps_profiler.py`
// (0cdfa2f8363e82641db14b68545ea9df27b2a7f4) builds it; the padding of a compact verify to its
// captured tier (python/sglang/kernels/ops/speculative/ragged_verify_kernels.py,
// 1f4feddf3ad6cec0f910f59d563ec165b56b0705, `pad_verify_lens_to_bucket`).
//
// Units and names: W = gamma + 1 is the verify window (the bonus token and gamma drafts); SGLang's
// verify_len is 1 + k, ours is k, the drafts verified. A request's survival at position j is the
// probability that drafts 1..j are all accepted (AcceptanceCurve::Accept(j)).
//
// Contract: pure functions and one small value type; no state between steps. Thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dpbalance/cost_model.h"

namespace dpbalance::dspark {

// DSparkScheduleConfig.survival_eps: positions whose survival is below it are never verified.
inline constexpr double kSurvivalEps = 1e-6;
// The budget reads the confidences of the draft two decode steps back, with the overlap scheduler
// or without it (SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS, default 2; the relay ring's lag,
// CONFIDENCE_RELAY_RING_LAG = 2; HostConfidenceBudgetPlanner). A request in its first two decode
// steps has none of its own and counts survival 1 at every position.
inline constexpr int kConfidenceLagSteps = 2;
// dspark_sps_profiler's inputs: prompts of 16 tokens (`--input-len`) and 572 new tokens per
// request, every step committing exactly one (SGLANG_SIMULATE_ACC_LEN=1.0), so contexts run from
// 17 to about 590 tokens; the table's median step sits near the middle of that.
inline constexpr int64_t kProfileInputTokens = 16;
inline constexpr int64_t kProfileOutputTokens = 572;
inline constexpr int64_t kProfileContextTokens = kProfileInputTokens + kProfileOutputTokens / 2;

// One draft position a rank may verify.
struct Candidate {
  double survival;  // probability that drafts 1..pos are all accepted
  int32_t req;      // index into the rank's batch
  int32_t pos;      // draft position, 1-based
};

// The profiler's per-rank request counts (`build_request_count_sweep`, max 256): 1, 2, 4, 8,
// 16..64 step 8, 80..128 step 16, 160..256 step 32, cut at `max_batch`, which is always included.
std::vector<int32_t> ProfilerBatchSizes(int max_batch);

// SpsCostTable: steps per second measured at per-rank token counts (profiled batch size x W,
// every request verifying its full window, the DP load uniform). Looked up as a floor step
// function: the value at the largest probe <= tokens; below the first probe the first value,
// past the last the last.
class SpsTable {
 public:
  // `tokens` strictly ascending and positive, `steps_per_s` finite and > 0, the same length >= 1.
  static absl::StatusOr<SpsTable> Create(std::vector<int64_t> tokens, std::vector<double> steps_per_s);
  double StepsPerSecond(int64_t tokens) const;
  absl::Span<const int64_t> tokens() const { return tokens_; }
  absl::Span<const double> steps_per_s() const { return steps_per_s_; }

 private:
  SpsTable(std::vector<int64_t> tokens, std::vector<double> steps_per_s)
      : tokens_(std::move(tokens)), steps_per_s_(std::move(steps_per_s)) {}
  std::vector<int64_t> tokens_;
  std::vector<double> steps_per_s_;
};

// The table dspark_sps_profiler measures, taken from a cost model instead of hardware: every one
// of `num_ranks` ranks holds bs requests (ProfilerBatchSizes(max_batch)) of kProfileContextTokens
// context, each verifying its full window W = k_max + 1 (the profiler's static mode), so the DP
// load is uniform; the step is `attention` at that batch, plus the global terms at num_ranks x bs
// x W tokens and the full draft depth (a dense per-rank draft: its k_max steps before the
// barrier). Keyed by bs x W. The replay profiles its truth (the hardware it stands for); the
// plugin's DSpark mode its own calibrated model.
absl::StatusOr<SpsTable> ProfileSps(const CostModel& attention, const GlobalCost& global,
                                    int num_ranks, int max_batch, int k_max, bool per_rank_draft);

// ProfileSps with the profiler's `--input-len` set near the workload, as SGLang advises: every
// request at `context_tokens` (ProfileSps uses kProfileContextTokens).
absl::StatusOr<SpsTable> ProfileSpsAt(const CostModel& attention, const GlobalCost& global,
                                      int num_ranks, int max_batch, int k_max, bool per_rank_draft,
                                      int64_t context_tokens);

// SpsAdditiveCostTable (sgl-project/sglang dspark_components/dspark_sps_table.py at 692c5f7d,
// dspark_sps.py at 45b76f55; scripts/studies/sglang_dspark_tables_spec.md): a step of `bs`
// requests verifying M = bs + budget tokens takes bias + alpha(bs) + theta(M) seconds, alpha and
// theta read by linear interpolation between their probes and held at the end values outside
// them. The budget maximises tau(b) / T(bs, b).
class AdditiveSpsTable {
 public:
  // Probes strictly ascending, each the same length as its values (>= 1), every value finite,
  // bias > 0 (the loader's checks).
  static absl::StatusOr<AdditiveSpsTable> Create(double bias_s, std::vector<int64_t> bs_probes,
                                                 std::vector<double> alpha_s,
                                                 std::vector<int64_t> m_probes,
                                                 std::vector<double> theta_s);
  double StepSeconds(int64_t num_requests, int64_t budget) const;
  double bias_s() const { return bias_s_; }
  absl::Span<const int64_t> bs_probes() const { return bs_probes_; }
  absl::Span<const double> alpha_s() const { return alpha_s_; }
  absl::Span<const int64_t> m_probes() const { return m_probes_; }
  absl::Span<const double> theta_s() const { return theta_s_; }

 private:
  AdditiveSpsTable() = default;
  double bias_s_ = 0;
  std::vector<int64_t> bs_probes_, m_probes_;
  std::vector<double> alpha_s_, theta_s_;
};

// One profiler round with a forced budget: `bs` requests verifying `m` tokens took `step_s`.
struct SpsCell {
  int64_t bs;
  int64_t m;
  double step_s;
};

// The profiler's additive fit (dspark_sps_profiler.py `ols_resid_backfit`, mbin_w = 64): least
// squares of step_s on an intercept, one indicator per bs but the smallest and one per M bin
// (round(M / 64) x 64, ties to even) but the smallest; the smallest levels read 0. Minimum-norm
// where the columns are dependent (numpy lstsq). Needs >= 4 cells and a positive bias.
absl::StatusOr<AdditiveSpsTable> FitAdditive(absl::Span<const SpsCell> cells);

// The profiler's `--fracs` sweep taken from a cost model, as ProfileSpsAt: per batch size, per
// frac, the budget int(frac x bs x k_max) spread as the top-k allocator spreads equal
// confidences (position by position over the requests), then FitAdditive. SGLang has no default
// fracs; the replay passes {0.25, 0.5, 0.75, 1}.
absl::StatusOr<AdditiveSpsTable> ProfileAdditiveSps(const CostModel& attention, const GlobalCost& global,
                                                    int num_ranks, int max_batch, int k_max,
                                                    bool per_rank_draft, int64_t context_tokens,
                                                    absl::Span<const double> fracs);
int64_t AdditiveBudget(int64_t num_requests, absl::Span<const Candidate> candidates,
                       const AdditiveSpsTable& table);

// OnlineSpsProfiler (dspark_sps_online.py at 692c5f7d; removed from SGLang by 00c3cffa): each
// step's time goes to the bin of the rank's bs + budget (the floor probe of the initial table's
// tokens), the last `window` kept; every `rebuild_interval` steps a bin with >= `min_bin_samples`
// gets 1 / median, the others the initial table's value, then pool-adjacent-violators makes the
// rates non-increasing (count-weighted) and each is held <= 0.999 x the one before. Rank-local.
struct OnlineSpsOptions {
  int rebuild_interval = 1000;  // SGLANG_DSPARK_SPS_ONLINE_REBUILD_INTERVAL
  int min_bin_samples = 32;     // SGLANG_DSPARK_SPS_ONLINE_MIN_BIN_SAMPLES
  int window = 128;             // samples kept per bin
  double max_step_s = 1.0;      // a longer interval is not a step
};
class OnlineSps {
 public:
  OnlineSps(SpsTable initial, OnlineSpsOptions options = {});
  // One step of `step_s` seconds at `batch_tokens` = bs + budget. Returns the rebuilt table when
  // a rebuild is due and some bin qualifies (the caller swaps it in), else nullopt.
  std::optional<SpsTable> Observe(int64_t batch_tokens, double step_s);
  int rebuilds() const { return rebuilds_; }
  // The last table a rebuild gave (nullopt: none yet; the initial one is in use).
  const std::optional<SpsTable>& current() const { return current_; }

 private:
  std::optional<SpsTable> Rebuild() const;
  std::optional<SpsTable> current_;
  SpsTable initial_;
  OnlineSpsOptions options_;
  std::vector<std::vector<double>> samples_;  // per bin, a ring of the last `window`
  std::vector<size_t> next_;                  // per bin, the ring's next slot
  int steps_ = 0;
  int rebuilds_ = 0;
};

// The candidates of a rank's batch, in the top-k allocator's order: survival descending, ties to
// the lower position, then the lower request. `survival(i, j)` for request i's position j in
// 1..caps[i]; a request's positions stop at the first below kSurvivalEps (survival never rises
// along a request). Clears and fills `out`.
void OrderCandidates(absl::Span<const int32_t> caps,
                     absl::FunctionRef<double(int32_t req, int32_t pos)> survival,
                     std::vector<Candidate>& out);

// compute_verify_token_budget: the budget b in 0..C (C = candidates.size()) maximising
// theta(b) = (n + the b best survivals) x steps_per_s(b), the first maximum (torch.argmax).
// `steps_per_s(b, added)` is the rate with the first b candidates verified; `added` is the b-th
// (null for b = 0), for pricers that follow what is added. SGLang's own pricer is an SpsTable at
// n + b tokens (SpsBudget). `candidates` in OrderCandidates' order.
int64_t VerifyTokenBudget(int64_t num_requests, absl::Span<const Candidate> candidates,
                          absl::FunctionRef<double(int64_t b, const Candidate* added)> steps_per_s);
int64_t SpsBudget(int64_t num_requests, absl::Span<const Candidate> candidates, const SpsTable& sps);

// local_verify_tier_num_tokens: the token count a rank asks the DP group for, min(n + budget,
// n x W). 0 for an empty batch.
int64_t LocalTier(int64_t num_requests, int64_t budget, int window);

// The agreed tier: the largest rank's request count `max_requests` and the largest local tier
// give min(max local, max_requests x W), rounded up to the smallest captured tier (`tiers`
// ascending); past the last tier (SGLang then verifies eagerly), the count itself.
int64_t AgreedTier(absl::Span<const int32_t> tiers, int64_t max_local_tier, int64_t max_requests,
                   int window);

// graph_tier_fill_budget (tier fill on): the budget a rank of `num_requests` gets once the DP
// tier is agreed, max(0, min(tier, n x W) - n); every rank, the one that set the tier included.
int64_t FillBudget(int64_t tier, int64_t num_requests, int window);

// ScheduleVerifyLensTopk: verifies the first `budget` candidates (fewer when there are fewer);
// verify_len[i] = drafts verified for request i (a prefix, since survival falls along a
// request). Writes every slot of `verify_len` (0 for requests with nothing selected).
void AssignTopK(absl::Span<const Candidate> candidates, int64_t budget, absl::Span<int32_t> verify_len);

// pad_verify_lens_to_bucket for one rank running `tier` tokens: the tier is captured with
// min(tier, max_slots) request slots; the spare tokens tier - sum(1 + verify_len) go to the slots
// the batch leaves free, as dummy requests of sequence length 1 (`pad_tokens[s]` query tokens
// for free slot s, spread evenly, the first ones one more, each at most W; what does not fit is
// not run); with no free slot, all of them go to the last request (`last_row_tokens`). An empty
// rank runs the whole tier on dummy slots. Returns the padding actually run.
struct Padding {
  std::vector<int32_t> pad_tokens;  // query tokens of each dummy slot used
  int64_t last_row_tokens = 0;      // extra query tokens on the last real request
  int64_t run_tokens() const;
};
Padding PadToTier(int64_t tier, int64_t num_requests, int64_t real_tokens, int64_t max_slots, int window);

}  // namespace dpbalance::dspark
