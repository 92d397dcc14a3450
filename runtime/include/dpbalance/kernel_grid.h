// dpbalance/kernel_grid.h — how a decode attention kernel's thread blocks run on the GPU.
//
// Contract
// - `KernelGrid` describes a kernel's launch: how a batch becomes thread blocks (CTAs), in which
//   order they launch, how many key blocks each iterates, and the GPU's SM count and CTAs per SM.
//   It is a description of the kernel and the device (tile sizes, launch order, the split-KV
//   rule), not a fitted constant; the fit decides how much each simulated term costs.
// - `SimulateGrid` turns one rank's batch into grid terms: CTA count, total key-block
//   iterations, a bank of simulated makespans, and the split-KV combine work. The makespans
//   come from a processor-sharing simulation: CTAs launch in grid order, breadth-first over
//   the SMs and then into whichever SM frees a slot first; CTAs sharing an SM split its
//   throughput, and a CTA alone on an SM runs at a fraction `alone_rate` of the SM (a single
//   CTA cannot fill it). Each makespan of the bank uses another (alone_rate, per-CTA overhead).
// - Layouts (FlashAttention-2 varlen forward, bf16, head dim 256, as measured in
//   integration/calibrate/data/README.md):
//   - kHeadMajor: one CTA per (query head, request, row block); grid order: row block fastest,
//     then request, then head. With every q_i = 1 the kernel swaps the query heads of one KV
//     head into rows (`heads` rows per request) and may split each request's keys over several
//     CTAs, followed by a combine kernel (`SplitKvCount`); its makespans average several
//     placements of its first wave on the SMs (kFirstWavePlacements).
//   - kPackedRows: the heads of each query token are rows (heads * q_i rows per request); one
//     CTA per (row block, request), row block fastest; row blocks past a request's rows exit
//     at once.
// - Costs: SimulateGrid is O(CTAs log SMs) per distinct overhead of the makespans asked for (the
//   runs that share one share all but their tails); a DP rank of 64 requests at q = 8 is ~1k CTAs
//   (packed) or 8k CTAs (head-major). The planner simulates once per step and kernel path (a
//   packed batch once for both: PathsShareLaunch; a head-major verify launch from its first
//   heads by default: GridSimulation::kSampledHeads), and moves the terms linearly with the
//   batch's work in between (`GridState`); Assign then
//   simulates each rank's filled plan a few times to keep it under the barrier (planner.cc).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dpbalance {

struct RequestLoad;

struct KernelGrid {
  enum class Layout { kNone, kHeadMajor, kPackedRows };
  Layout layout = Layout::kNone;
  int heads = 128;       // query heads per KV head
  int block_m = 64;      // query rows per CTA
  int block_n = 64;      // keys per CTA iteration
  int num_sms = 132;
  int ctas_per_sm = 2;   // resident CTAs per SM (shared memory bound)
  int max_splits = 128;  // split-KV limit (head-major, every q_i = 1)

  bool enabled() const { return layout != Layout::kNone; }
  // Whether the verify launch's grid terms change with the requests' query tokens when none has
  // more than `max_query_tokens`: packed rows add CTAs per token; a head-major launch does not
  // while every request's queries fit one row block (then the planner's linear move is exact).
  bool VerifyTermsDependOnQueryTokens(int max_query_tokens) const {
    return layout == Layout::kPackedRows || (layout == Layout::kHeadMajor && max_query_tokens > block_m);
  }
  // "none", "fa2-gqa-h200" (head-major), "fa2-packed-h200" (packed rows). Unknown names are an
  // error that lists the known ones.
  static absl::StatusOr<KernelGrid> Named(std::string_view name);
  std::string Name() const;
  // Every field, in declaration order (what equality compares).
  std::array<int, 7> Fields() const {
    return {static_cast<int>(layout), heads, block_m, block_n, num_sms, ctas_per_sm, max_splits};
  }
  bool operator==(const KernelGrid& o) const { return Fields() == o.Fields(); }
};

// Grid terms, in this order; makespans and reuse windows are in key-block iterations of one SM.
// - counts: CTAs, key-block work (CTAs x their key blocks), split-KV combine work;
// - makespans: the simulated launch under each (alone_rate, per-CTA overhead) of the bank;
// - cold reads: key blocks fetched from HBM rather than L2. CTAs that read the same keys (the
//   heads of one request in a head-major launch, the row blocks of one request, or of one split)
//   share one fetch when they start within a reuse window of the CTA that fetched them; a CTA
//   starting later fetches them again. Start times come from the makespan simulation with
//   kColdReadsMakespan's parameters. The window is not known, so it is a bank too; the fit weighs.
inline constexpr int kNumGridMakespans = 6;
inline constexpr int kNumGridReuseWindows = 4;
inline constexpr int kNumGridTerms = 3 + kNumGridMakespans + kNumGridReuseWindows;
enum GridTerm : int {
  kGridCtas = 0,
  kGridWork = 1,
  kGridCombine = 2,
  kGridMakespan0 = 3,
  kGridColdReads0 = kGridMakespan0 + kNumGridMakespans,
};
// (alone_rate, per-CTA overhead in key blocks) of each simulated makespan.
inline constexpr std::array<std::array<double, 2>, kNumGridMakespans> kGridMakespanParams = {
    {{1.0, 1.0}, {0.8, 1.0}, {0.65, 1.0}, {0.8, 4.0}, {0.8, 0.25}, {0.65, 4.0}}};
inline constexpr int kColdReadsMakespan = 1;  // the makespan whose start times cold reads use
inline constexpr std::array<double, kNumGridReuseWindows> kGridReuseWindows = {16, 64, 256, 1024};
// A head-major decode launch (every q_i = 1) shares SMs between CTAs the hardware pairs
// differently from launch to launch: its makespans are the mean over this many placements of
// its first wave (the launch order and fixed pseudo-random permutations of its first num_sms
// CTAs, the first wave's first round; kernel_grid.cc, AverageFirstWavePlacements). Cold reads
// keep the launch order's start times.
inline constexpr int kFirstWavePlacements = 8;
using GridTerms = std::array<double, kNumGridTerms>;
std::string GridTermName(int term);

// The FlashAttention-2 split-KV rule, in our words: with `parallel_ctas` CTAs filling at least
// 80% of `num_slots`, one split; otherwise the fewest splits whose wave efficiency
// (waves / ceil(waves), waves = parallel_ctas * splits / num_slots) is within 85% of the best,
// over split counts up to min(max_splits, num_slots, num_key_blocks) that change the blocks per
// split.
int SplitKvCount(int parallel_ctas, int num_slots, int num_key_blocks, int max_splits);

// How SimulateGrid simulates the makespans.
// - kReference: one event-by-event simulation per makespan (SimulateMakespan, TieRule::
//   kHeapOrder): what the published fits were calibrated with, and what a truth evaluates.
// - kFast: SimulateMakespans (TieRule::kSpread): the list phase once per overhead, closed-form
//   drains, a calendar queue where costs allow. It equals kReference up to rounding wherever no
//   two slots free at the same instant, and differs where they do (the heap's arbitrary order
//   against a breadth-first one), by up to 30% on real batches: a model fitted under one rule
//   must be priced under it (docs/cost-model.md measures what pricing the published fits with
//   kFast costs).
// - kSampledHeads: kReference, except for a head-major verify launch with more heads than
//   `SampledHeads` asks for. Its heads repeat one list of CTAs, so it simulates only the first
//   SampledHeads heads (at least kSampledWaves waves of the grid's slots), in one list phase at
//   the cold reads' overhead, and extends the terms to every head: each makespan by the work of
//   the heads left out and its own overhead's difference, spread over the SMs (while CTAs wait,
//   every SM works at full throughput), and the cold reads range by range from its last fetch,
//   the heads left out starting one per-head share of the work apart. Counts and
//   work are exact; start times of the heads simulated are exact (a CTA's start depends only on
//   the CTAs before it). The makespans' tails are not: which SMs the last heads' CTAs share is
//   decided by ties, and a launch with other heads before it ties otherwise, so a makespan moves
//   by a few per cent either way (docs/cost-model.md measures it, and what it does to plans). A
//   planner's pricing, not a model's rule: a model file or a fit cannot carry it.
// A model's own rule: CostModel::grid_simulation (from its file); the planner's copy:
// PlannerConfig::grid_simulation when set, else kSampledHeads for a kReference model and the
// model's rule otherwise.
enum class GridSimulation { kReference, kFast, kSampledHeads };
// Their names in model files and flags: "reference", "fast", "sampled". An unknown name is an
// error that says what it got and what is known.
absl::StatusOr<GridSimulation> GridSimulationNamed(std::string_view name);
std::string_view GridSimulationName(GridSimulation sim);

// How many heads a kSampledHeads launch simulates when each head has `ctas_per_head` CTAs: enough
// for kSampledWaves waves of the grid's num_sms x ctas_per_sm slots; every head if the whole
// launch is at most twice that (sampling would save little) or that is all of them.
inline constexpr int kSampledWaves = 2;
int SampledHeads(const KernelGrid& grid, int64_t ctas_per_head);

// Grid terms of `batch` launched on `grid`. `single_query_launch`: the launch the kernel uses
// when every q_i = 1 (head-major: the swapped split-KV launch); otherwise the verify launch.
// Counts and work are always filled; of the simulated terms only those flagged in `terms` (bit t:
// grid term t) are computed, the others may be 0.
GridTerms SimulateGrid(const KernelGrid& grid, absl::Span<const RequestLoad> batch,
                       bool single_query_launch, unsigned terms = (1u << kNumGridTerms) - 1,
                       GridSimulation sim = GridSimulation::kReference);

// Whether a batch's two launches (single_query_launch true and false) are one grid: packed rows
// launch the same CTAs either way (a head-major launch swaps heads into rows when every q_i = 1).
// Then one SimulateGrid over both paths' terms serves both (KeepGridTerms).
inline bool PathsShareLaunch(const KernelGrid& grid) {
  return grid.layout == KernelGrid::Layout::kPackedRows;
}
// What SimulateGrid(grid, batch, launch, terms) returns, from SimulateGrid(grid, batch, launch,
// more) for any `more` that has every bit of `terms`, to the bit: the terms it would not have
// computed set to 0 (the cold reads' makespan is computed with them).
GridTerms KeepGridTerms(const GridTerms& computed, unsigned terms);

// Which of several simultaneous events (two slots freeing at the same instant) goes first.
// - kHeapOrder: whichever the binary heap of SM events leaves on top, only times compared, in
//   one fixed order of heap operations (kernel_grid.cc, EventHeap): libstdc++'s std::pop_heap /
//   std::push_heap order, which the published fits were calibrated with. It is our code, not the
//   standard library's, so every build prices a model alike (libc++'s heap breaks ties otherwise).
// - kSpread: every SM's first before any SM's second, then the lower SM: simultaneous frees take
//   the next CTAs breadth-first over SMs, as the first wave does. Defined by the order alone, so
//   any data structure can reproduce it (SimulateMakespans does).
enum class TieRule { kHeapOrder, kSpread };

// Makespan of CTAs with the given work (key-block iterations; a negative entry is a CTA that
// exits at once and costs `exit_cost`), launched in order, under the sharing model above.
// `starts` (optional) receives each CTA's start time; they never decrease in launch order.
// Event by event while CTAs wait to start, O(CTAs log SMs); then each SM drains on its own by the
// same arithmetic (so the result is what events in time order to the end give, to the bit).
double SimulateMakespan(absl::Span<const double> works, int num_sms, int ctas_per_sm,
                        double alone_rate, double overhead, double exit_cost,
                        std::vector<double>* starts = nullptr,
                        TieRule ties = TieRule::kHeapOrder);

// SimulateMakespan (TieRule::kHeapOrder) for every (alone_rate, overhead) pair of `params` whose
// bit is set in `mask`, into out[j], equal to separate runs to the bit; `starts` (optional)
// receives the start times under params[starts_of]. Runs that share an overhead share the part
// of the simulation before every CTA has started (it does not read the alone rate) and only
// finish separately (a launch of one wave has no such part: only the drains). What SimulateGrid's
// kReference uses.
void ReferenceMakespans(absl::Span<const double> works, int num_sms, int ctas_per_sm,
                        absl::Span<const std::array<double, 2>> params, unsigned mask,
                        double exit_cost, double* out, int starts_of = -1,
                        std::vector<double>* starts = nullptr);

// The makespans of several (alone_rate, overhead) pairs of `params` at once: out[j] for every j
// whose bit is set in `mask`, each equal to SimulateMakespan's with TieRule::kSpread (to the bit
// where every time is a whole number of half blocks, else up to rounding). Until the queue
// empties every SM is full, so that phase is list scheduling on num_sms x ctas_per_sm slots and
// depends on the overhead alone: it runs once per distinct overhead. After it each SM drains on
// its own (a closed form); a launch of one wave is only that. `starts` (optional) receives the start times
// under params[starts_of]. O(CTAs log slots) per distinct overhead.
void SimulateMakespans(absl::Span<const double> works, int num_sms, int ctas_per_sm,
                       absl::Span<const std::array<double, 2>> params, unsigned mask,
                       double exit_cost, double* out, int starts_of = -1,
                       std::vector<double>* starts = nullptr);

// Linear change of each grid term per extra query token and per extra query-key pair on the
// verify launch (the planner's increments between simulations): packed rows add heads/block_m
// CTAs of ceil(ctx/block_n) blocks per token, spread over all SMs, beside their request's other
// row blocks (so no cold reads); head-major verify grids do not depend on q.
struct GridSlopes {
  GridTerms per_token{};
  GridTerms per_pair{};
};
GridSlopes VerifyGridSlopes(const KernelGrid& grid);

}  // namespace dpbalance
