#include "dpbalance/kernel_grid.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "dpbalance/cost_model.h"

namespace dpbalance {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr int kMaxCtasPerSm = 8;

struct SmEvent {
  double time;
  int sm;
  uint32_t version;
  bool operator>(const SmEvent& o) const { return time > o.time; }
};

}  // namespace

absl::StatusOr<KernelGrid> KernelGrid::Named(std::string_view name) {
  KernelGrid g;  // defaults: 128 query heads on one KV head, 64x64 tiles, H200 (132 SMs, 2 CTAs)
  if (name == "none") return KernelGrid{};
  if (name == "fa2-gqa-h200") {
    g.layout = Layout::kHeadMajor;
    return g;
  }
  if (name == "fa2-packed-h200") {
    g.layout = Layout::kPackedRows;
    return g;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown kernel grid '", std::string(name), "' (known: none, fa2-gqa-h200, fa2-packed-h200)"));
}

std::string KernelGrid::Name() const {
  KernelGrid stock_grid;  // the named grids differ from the defaults only in layout
  stock_grid.layout = layout;
  const bool stock = *this == stock_grid;
  switch (layout) {
    case Layout::kNone:
      return "none";
    case Layout::kHeadMajor:
      return stock ? "fa2-gqa-h200" : "custom-head-major";
    case Layout::kPackedRows:
      return stock ? "fa2-packed-h200" : "custom-packed-rows";
  }
  return "none";
}

std::string GridTermName(int term) {
  if (term == kGridCtas) return "grid_ctas";
  if (term == kGridWork) return "grid_work";
  if (term == kGridCombine) return "grid_combine";
  if (term >= kGridColdReads0) {
    return absl::StrFormat("grid_cold_reads_w%d",
                           static_cast<int>(kGridReuseWindows[term - kGridColdReads0]));
  }
  const auto& p = kGridMakespanParams[term - kGridMakespan0];
  return absl::StrFormat("grid_makespan_r%d_o%d", static_cast<int>(std::lround(p[0] * 100)),
                         static_cast<int>(std::lround(p[1] * 100)));
}

int SplitKvCount(int parallel_ctas, int num_slots, int num_key_blocks, int max_splits) {
  if (parallel_ctas >= 0.8 * num_slots) return 1;
  const int limit = std::min({max_splits, num_slots, num_key_blocks});
  // A split count is worth looking at only if it changes the key blocks per split.
  auto distinct = [&](int s) {
    return s == 1 || CeilDiv(num_key_blocks, s) != CeilDiv(num_key_blocks, s - 1);
  };
  auto efficiency = [&](int s) {
    const double waves = static_cast<double>(parallel_ctas) * s / num_slots;
    return waves / std::ceil(waves);
  };
  double best = 0;
  for (int s = 1; s <= limit; ++s) {
    if (distinct(s)) best = std::max(best, efficiency(s));
  }
  for (int s = 1; s <= limit; ++s) {
    if (distinct(s) && efficiency(s) >= 0.85 * best) return s;
  }
  return 1;
}

double SimulateMakespan(absl::Span<const double> works, int num_sms, int ctas_per_sm,
                        double alone_rate, double overhead, double exit_cost,
                        std::vector<double>* starts) {
  const size_t n = works.size();
  if (starts != nullptr) starts->assign(n, 0.0);
  if (n == 0 || num_sms <= 0) return 0;
  const int per_sm = std::clamp(ctas_per_sm, 1, kMaxCtasPerSm);
  auto cost = [&](size_t i) { return works[i] < 0 ? exit_cost : works[i] + overhead; };
  auto rate = [&](int k) { return k == 1 ? alone_rate : 1.0 / k; };
  // Per SM: the remaining work of its resident CTAs, when it was last brought up to date, and a
  // version that invalidates its older entries in the event heap.
  std::vector<std::array<double, kMaxCtasPerSm>> rem(num_sms);
  std::vector<int> count(num_sms, 0);
  std::vector<double> since(num_sms, 0.0);
  std::vector<uint32_t> version(num_sms, 0);
  std::vector<SmEvent> heap;
  heap.reserve(2 * static_cast<size_t>(num_sms));
  auto schedule = [&](int s, double now) {
    ++version[s];
    if (count[s] == 0) return;
    double first = rem[s][0];
    for (int k = 1; k < count[s]; ++k) first = std::min(first, rem[s][k]);
    heap.push_back({now + first / rate(count[s]), s, version[s]});
    std::push_heap(heap.begin(), heap.end(), std::greater<>());
  };
  size_t next = 0;
  for (int slot = 0; slot < per_sm; ++slot) {  // the first wave goes breadth-first over SMs
    for (int s = 0; s < num_sms && next < n; ++s) rem[s][count[s]++] = cost(next++);
  }
  for (int s = 0; s < num_sms; ++s) schedule(s, 0.0);
  double now = 0;
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const SmEvent e = heap.back();
    heap.pop_back();
    if (e.version != version[e.sm]) continue;
    const int s = e.sm;
    const double done = (e.time - since[s]) * rate(count[s]);
    int finished = 0;
    for (int k = 0; k < count[s]; ++k) {
      rem[s][k] -= done;
      if (rem[s][k] < rem[s][finished]) finished = k;
    }
    since[s] = now = e.time;
    rem[s][finished] = rem[s][--count[s]];
    if (next < n) {
      if (starts != nullptr) (*starts)[next] = now;
      rem[s][count[s]++] = cost(next++);
    }
    schedule(s, now);
  }
  return now;
}

namespace {

// One launch's CTAs, in launch order. CTAs that read the same key range can share one fetch
// into L2: consecutive runs of `row_blocks` CTAs read one range, and there are `num_ranges`
// ranges, repeated per head in the head-major verify launch.
struct CtaList {
  std::vector<double> works;  // each CTA's key-block work (negative: it exits at once)
  int64_t row_blocks = 1;
  int64_t num_ranges = 0;
  double combine_work = 0;  // split-KV combine work (grid term kGridCombine)
};

double KeyBlocks(const KernelGrid& grid, const RequestLoad& r) {
  return static_cast<double>(CeilDiv(std::max<int64_t>(r.ctx_tokens, 1), grid.block_n));
}

// Head-major launch with every q_i = 1: heads become rows; the keys of each request may be
// split over several CTAs (`SplitKvCount`), followed by a combine kernel.
CtaList SplitKvCtas(const KernelGrid& grid, absl::Span<const RequestLoad> batch, int64_t max_ctx) {
  const int64_t b = static_cast<int64_t>(batch.size());
  CtaList ctas;
  ctas.row_blocks = CeilDiv(grid.heads, grid.block_m);
  const int64_t max_blocks = CeilDiv(std::max<int64_t>(max_ctx, 1), grid.block_n);
  const int splits =
      SplitKvCount(static_cast<int>(b * ctas.row_blocks), grid.num_sms * grid.ctas_per_sm,
                   static_cast<int>(max_blocks), grid.max_splits);
  const int64_t per_split = CeilDiv(max_blocks, splits);
  ctas.works.reserve(static_cast<size_t>(b * splits * ctas.row_blocks));
  ctas.num_ranges = b * splits;
  for (int64_t i = 0; i < b; ++i) {
    const double blocks = KeyBlocks(grid, batch[i]);
    for (int sp = 0; sp < splits; ++sp) {
      const double w = std::min(blocks, static_cast<double>((sp + 1) * per_split)) -
                       static_cast<double>(sp * per_split);
      for (int64_t m = 0; m < ctas.row_blocks; ++m) ctas.works.push_back(w > 0 ? w : -1.0);
    }
  }
  if (splits > 1) ctas.combine_work = static_cast<double>(b * splits);
  return ctas;
}

// Head-major verify launch: one CTA per (head, request, row block); row blocks of the longest
// request's queries.
CtaList HeadMajorCtas(const KernelGrid& grid, absl::Span<const RequestLoad> batch, int32_t max_q) {
  const int64_t b = static_cast<int64_t>(batch.size());
  CtaList ctas;
  ctas.row_blocks = CeilDiv(max_q, grid.block_m);
  ctas.num_ranges = b;
  ctas.works.reserve(static_cast<size_t>(grid.heads * b * ctas.row_blocks));
  for (int h = 0; h < grid.heads; ++h) {
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t m = 0; m < ctas.row_blocks; ++m) {
        ctas.works.push_back(m * grid.block_m < batch[i].query_tokens ? KeyBlocks(grid, batch[i])
                                                                      : -1.0);
      }
    }
  }
  return ctas;
}

// Packed rows: heads x q_i rows per request, request by request.
CtaList PackedRowCtas(const KernelGrid& grid, absl::Span<const RequestLoad> batch, int32_t max_q) {
  const int64_t b = static_cast<int64_t>(batch.size());
  CtaList ctas;
  ctas.row_blocks = CeilDiv(static_cast<int64_t>(grid.heads) * max_q, grid.block_m);
  ctas.num_ranges = b;
  ctas.works.reserve(static_cast<size_t>(b * ctas.row_blocks));
  for (int64_t i = 0; i < b; ++i) {
    const int64_t rows = static_cast<int64_t>(grid.heads) * batch[i].query_tokens;
    for (int64_t m = 0; m < ctas.row_blocks; ++m) {
      ctas.works.push_back(m * grid.block_m < rows ? KeyBlocks(grid, batch[i]) : -1.0);
    }
  }
  return ctas;
}

CtaList BuildCtaList(const KernelGrid& grid, absl::Span<const RequestLoad> batch,
                     bool single_query_launch) {
  int64_t max_ctx = 0;
  int32_t max_q = 1;
  for (const RequestLoad& r : batch) {
    max_ctx = std::max(max_ctx, r.ctx_tokens);
    max_q = std::max(max_q, r.query_tokens);
  }
  if (grid.layout == KernelGrid::Layout::kHeadMajor) {
    return single_query_launch ? SplitKvCtas(grid, batch, max_ctx) : HeadMajorCtas(grid, batch, max_q);
  }
  return PackedRowCtas(grid, batch, max_q);
}

// Key blocks each reuse window's CTAs fetch from HBM, into out[kGridColdReads0 + w]. `starts`:
// each CTA's start time. Starts never decrease in launch order, so one pass per window finds
// each key range's fetches: a CTA fetches when it starts more than the window after its range's
// last fetch.
void FillColdReads(const CtaList& ctas, const std::vector<double>& starts, GridTerms* out) {
  std::vector<double> last_fetch(static_cast<size_t>(ctas.num_ranges));
  auto range_of = [&](size_t cta) {
    return (cta / static_cast<size_t>(ctas.row_blocks)) % static_cast<size_t>(ctas.num_ranges);
  };
  for (int w = 0; w < kNumGridReuseWindows; ++w) {
    std::fill(last_fetch.begin(), last_fetch.end(), -std::numeric_limits<double>::infinity());
    double cold = 0;
    for (size_t c = 0; c < ctas.works.size(); ++c) {
      if (ctas.works[c] <= 0) continue;
      double& last = last_fetch[range_of(c)];
      if (starts[c] - last > kGridReuseWindows[w]) {
        cold += ctas.works[c];
        last = starts[c];
      }
    }
    (*out)[kGridColdReads0 + w] = cold;
  }
}

}  // namespace

GridTerms SimulateGrid(const KernelGrid& grid, absl::Span<const RequestLoad> batch,
                       bool single_query_launch, unsigned terms) {
  GridTerms out{};
  if (!grid.enabled() || batch.empty()) return out;
  const CtaList ctas = BuildCtaList(grid, batch, single_query_launch);
  const std::vector<double>& works = ctas.works;
  out[kGridCtas] = static_cast<double>(works.size());
  for (double w : works) out[kGridWork] += std::max(w, 0.0);
  out[kGridCombine] = ctas.combine_work;
  constexpr double kExitCost = 0.2;  // key blocks' worth of a CTA that exits at once
  constexpr unsigned kColdReadBits = ((1u << kNumGridReuseWindows) - 1) << kGridColdReads0;
  const bool cold_reads = (terms & kColdReadBits) != 0;
  std::vector<double> starts;
  for (int j = 0; j < kNumGridMakespans; ++j) {
    const bool keep_starts = cold_reads && j == kColdReadsMakespan;
    if ((terms >> (kGridMakespan0 + j) & 1u) == 0 && !keep_starts) continue;
    out[kGridMakespan0 + j] =
        SimulateMakespan(works, grid.num_sms, grid.ctas_per_sm, kGridMakespanParams[j][0],
                         kGridMakespanParams[j][1], kExitCost, keep_starts ? &starts : nullptr);
  }
  if (cold_reads) FillColdReads(ctas, starts, &out);
  return out;
}

GridSlopes VerifyGridSlopes(const KernelGrid& grid) {
  GridSlopes s;
  if (grid.layout != KernelGrid::Layout::kPackedRows) return s;
  const double ctas_per_token = static_cast<double>(grid.heads) / grid.block_m;
  const double blocks_per_pair = ctas_per_token / grid.block_n;
  s.per_token[kGridCtas] = ctas_per_token;
  s.per_pair[kGridWork] = blocks_per_pair;
  for (int j = 0; j < kNumGridMakespans; ++j) {
    // In the bulk of the launch every SM runs at full throughput: new work spreads over all.
    s.per_token[kGridMakespan0 + j] = ctas_per_token * kGridMakespanParams[j][1] / grid.num_sms;
    s.per_pair[kGridMakespan0 + j] = blocks_per_pair / grid.num_sms;
  }
  return s;
}

}  // namespace dpbalance
