#include "dpbalance/kernel_grid.h"

#include <algorithm>
#include <array>
#include <bit>
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

// An event of the event-by-event simulation: SM `sm` frees a slot at `time`. Under
// TieRule::kSpread simultaneous events go every SM's first before any SM's second, then the
// lower SM first: a launch whose CTAs free slots at the same time spreads the next CTAs over
// SMs, breadth-first, as the first wave does. `rank`: how many events of this SM come before it
// at the same time. Under kHeapOrder only the time is compared, and ties fall as EventHeap
// leaves them.
struct SmEvent {
  double time;
  int32_t rank;
  int32_t sm;
};

// The event queue of the simulation: a binary min-heap in an array, in a fixed order of
// operations that decides which of several events of one time comes out first (TieRule::
// kHeapOrder; under kSpread the order is total and this is just a heap).
// - Pop: the last entry leaves its place; a hole runs from the root down to a leaf, each step
//   into the child that comes first (the right one when neither does), then the last entry goes
//   into the hole and up while its parent comes after it.
// - Push: a new entry goes at the end and up while its parent comes after it.
// This is the order the published fits were calibrated with: it is what libstdc++'s
// std::pop_heap / std::push_heap did when the simulation used them (to 2026-12), so a build with
// another standard library (whose heap breaks ties otherwise) prices those models the same;
// kernel_grid_test checks it against std::pop_heap / std::push_heap where those are libstdc++'s.
template <bool kSpread>
class EventHeap {
 public:
  explicit EventHeap(size_t capacity) : time_(capacity), tag_(capacity) {}
  SmEvent top() const {
    if constexpr (kSpread) {
      return {time_[0], static_cast<int32_t>(tag_[0] >> 32), static_cast<int32_t>(tag_[0] & 0xffffffffu)};
    } else {
      return {time_[0], 0, static_cast<int32_t>(tag_[0])};
    }
  }
  void Push(const SmEvent& e) { SiftUp(size_++, e.time, TagOf(e)); }  // at most `capacity` entries
  void Pop() {
    const size_t len = --size_;  // entries left
    if (len > 0) {
      const double last_time = time_[len];
      const Tag last_tag = tag_[len];
      size_t hole = 0, child = 0;
      // Two levels at a time while both of the hole's children have two children: the
      // grandchild under each child is picked before the child is known (the same moves as one
      // level at a time, with half the chain of dependent loads).
      while (2 * child + 2 < (len - 1) / 2) {
        const size_t right = 2 * child + 2;
        const bool left = After(right, right - 1);
        const size_t under_left = 2 * right - (After(2 * right, 2 * right - 1) ? 1 : 0);
        const size_t under_right = 2 * right + 2 - (After(2 * right + 2, 2 * right + 1) ? 1 : 0);
        const size_t c = left ? right - 1 : right;
        const size_t g = left ? under_left : under_right;
        Move(hole, c);
        Move(c, g);
        hole = child = g;
      }
      while (child < (len - 1) / 2) {
        child = 2 * child + 2;
        child -= After(child, child - 1);
        Move(hole, child);
        hole = child;
      }
      if ((len & 1) == 0 && child == (len - 2) / 2) {  // a last parent with one child
        child = 2 * child + 1;
        Move(hole, child);
        hole = child;
      }
      SiftUp(hole, last_time, last_tag);
    }
  }

 private:
  // Under kSpread (rank, sm) as one number that orders as the pair does (both are never
  // negative); under kHeapOrder the SM alone (the rank is never compared there).
  using Tag = std::conditional_t<kSpread, uint64_t, uint32_t>;
  static Tag TagOf(const SmEvent& e) {
    if constexpr (kSpread) {
      return uint64_t{static_cast<uint32_t>(e.rank)} << 32 | static_cast<uint32_t>(e.sm);
    } else {
      return static_cast<uint32_t>(e.sm);
    }
  }
  // Whether entry i comes after entry j.
  bool After(size_t i, size_t j) const { return Later(time_[i], tag_[i], time_[j], tag_[j]); }
  static bool Later(double ta, Tag ga, double tb, Tag gb) {
    if constexpr (kSpread) {
      if (ta != tb) return ta > tb;
      return ga > gb;
    } else {
      return ta > tb;
    }
  }
  void Move(size_t to, size_t from) {
    time_[to] = time_[from];
    tag_[to] = tag_[from];
  }
  void SiftUp(size_t hole, double t, Tag g) {
    while (hole > 0) {
      const size_t parent = (hole - 1) / 2;
      if (!Later(time_[parent], tag_[parent], t, g)) break;
      Move(hole, parent);
      hole = parent;
    }
    time_[hole] = t;
    tag_[hole] = g;
  }
  // The entries' times and tags in two arrays: under kHeapOrder the descent reads only times, and
  // an entry's move is an 8-byte and a 4-byte copy.
  std::vector<double> time_;
  std::vector<Tag> tag_;
  size_t size_ = 0;
};

// A slot of the list phase: when it frees, its rank (as SmEvent's: slots of its SM freeing at
// the same time before it) and which slot it is (sm * ctas_per_sm + k). Slots free in
// (time, rank, SM) order, SimulateMakespan's tie rule; an SM's slots never tie on both.
struct SlotFree {
  double time;
  int32_t rank;
  int32_t id;
  bool operator<(const SlotFree& o) const {
    if (time != o.time) return time < o.time;
    return rank != o.rank ? rank < o.rank : id < o.id;
  }
};

// Sorts the first k (<= kMaxCtasPerSm) entries of `v` ascending.
void SortSmall(std::array<double, kMaxCtasPerSm>& v, int k) {
  for (int i = 1; i < k; ++i) {
    const double x = v[i];
    int j = i;
    for (; j > 0 && v[j - 1] > x; --j) v[j] = v[j - 1];
    v[j] = x;
  }
}

// Per-CTA rate with k CTAs resident on an SM.
inline double ShareRate(int k, double alone_rate) { return k == 1 ? alone_rate : 1.0 / k; }

// When an SM whose k resident CTAs (ascending `left`, work still to do at time `t`, all
// running) is done if nothing joins it: processor sharing, the last at the alone rate.
double DrainSm(double t, const double* left, int k, double alone_rate) {
  double done = 0;
  for (int m = 0; m < k; ++m) {
    t += (left[m] - done) / ShareRate(k - m, alone_rate);
    done = left[m];
  }
  return t;
}

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

absl::StatusOr<GridSimulation> GridSimulationNamed(std::string_view name) {
  if (name == "reference") return GridSimulation::kReference;
  if (name == "fast") return GridSimulation::kFast;
  if (name == "sampled") return GridSimulation::kSampledHeads;
  return absl::InvalidArgumentError(absl::StrCat(
      "grid simulation '", std::string(name), "' is not one of reference, fast, sampled"));
}

std::string_view GridSimulationName(GridSimulation sim) {
  switch (sim) {
    case GridSimulation::kFast:
      return "fast";
    case GridSimulation::kSampledHeads:
      return "sampled";
    case GridSimulation::kReference:
      break;
  }
  return "reference";
}

int SampledHeads(const KernelGrid& grid, int64_t ctas_per_head) {
  const int64_t slots =
      static_cast<int64_t>(std::max(grid.num_sms, 1)) * std::max(grid.ctas_per_sm, 1);
  const int64_t heads = std::max(grid.heads, 1);
  // A launch of a few waves is simulated whole: sampling would save little of it.
  if (ctas_per_head <= 0 || heads * ctas_per_head <= 2 * kSampledWaves * slots) {
    return static_cast<int>(heads);
  }
  return static_cast<int>(std::min(heads, CeilDiv(kSampledWaves * slots, ctas_per_head)));
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

namespace {

// SimulateMakespan's event-by-event simulation, resumable: RunListPhase stops once every CTA has
// started, and Drain then finishes it under any alone rate. Until then every SM holds
// ctas_per_sm CTAs (when there are at least that many per SM), each at rate 1 / ctas_per_sm,
// so the alone rate has not been read: the finish is the same as a run from the start.
template <bool kSpread>
class EventSim {
 public:
  EventSim(absl::Span<const double> works, int num_sms, int per_sm, double alone_rate,
           double overhead, double exit_cost, std::vector<double>* starts)
      : works_(works), n_(works.size()), per_sm_(per_sm), alone_rate_(alone_rate), overhead_(overhead),
        exit_cost_(exit_cost), starts_(starts), rem_(num_sms), count_(num_sms, 0),
        since_(num_sms, 0.0), heap_(static_cast<size_t>(num_sms)) {
    for (int slot = 0; slot < per_sm; ++slot) {  // the first wave goes breadth-first over SMs
      for (int s = 0; s < num_sms && next_ < n_; ++s) rem_[s][count_[s]++] = Cost(next_++);
    }
    if (next_ < n_) {  // the events matter only while CTAs wait to start
      for (int s = 0; s < num_sms; ++s) Schedule(s, 0.0, -1);
    }
  }
  // Handles events until every CTA has started. Each SM has one event in the heap: when its
  // next CTA finishes.
  void RunListPhase() {
    if (per_sm_ == 2) {
      RunListPhaseOfPairs();
      return;
    }
    while (next_ < n_) {
      const SmEvent e = heap_.top();
      heap_.Pop();
      const int s = e.sm;
      FinishFirst(rem_[s], count_[s], since_[s], e.time);
      now_ = e.time;
      if (starts_ != nullptr) (*starts_)[next_] = now_;
      rem_[s][count_[s]++] = Cost(next_++);
      Schedule(s, now_, e.rank);
    }
  }
  // RunListPhase with two CTAs per SM (the H200 grids'), written out: the same arithmetic (each
  // runs at 1.0 / 2 = 0.5, and x / 0.5 is x * 2 exactly), on two named values.
  void RunListPhaseOfPairs() {
    while (next_ < n_) {
      const SmEvent e = heap_.top();
      heap_.Pop();
      const int s = e.sm;
      std::array<double, kMaxCtasPerSm>& rem = rem_[s];
      const double done = (e.time - since_[s]) * 0.5;
      const double a = rem[0] - done, b = rem[1] - done;
      since_[s] = now_ = e.time;
      if (starts_ != nullptr) (*starts_)[next_] = now_;
      rem[0] = b < a ? a : b;  // the one still running (either, if they end together)
      rem[1] = Cost(next_++);
      const double t = now_ + std::min(rem[0], rem[1]) * 2.0;
      heap_.Push({t, t == now_ ? e.rank + 1 : 0, s});
    }
  }
  // The makespan, once every CTA has started, with `alone_rate` from here on: no CTA joins any
  // SM any more, so each drains on its own, by the arithmetic RunListPhase would use (so the
  // result is the same to the bit as running the events in time order to the end).
  double Drain(double alone_rate) {
    alone_rate_ = alone_rate;
    double end = now_;
    for (size_t s = 0; s < rem_.size(); ++s) {
      std::array<double, kMaxCtasPerSm> rem = rem_[s];
      double since = since_[s];
      for (int count = count_[s]; count > 0;) {
        FinishFirst(rem, count, since, NextFinish(rem, count, since));
      }
      end = std::max(end, since);
    }
    return end;
  }

 private:
  double Cost(size_t i) const { return works_[i] < 0 ? exit_cost_ : works_[i] + overhead_; }
  double Rate(int k) const { return k == 1 ? alone_rate_ : 1.0 / k; }
  // When the first of an SM's `count` resident CTAs (work `rem` left at `since`) finishes.
  double NextFinish(const std::array<double, kMaxCtasPerSm>& rem, int count, double since) const {
    double first = rem[0];
    for (int k = 1; k < count; ++k) first = std::min(first, rem[k]);
    return since + first / Rate(count);
  }
  // Brings the SM up to `t`, when its first CTA finishes, and removes that CTA.
  void FinishFirst(std::array<double, kMaxCtasPerSm>& rem, int& count, double& since,
                   double t) const {
    const double done = (t - since) * Rate(count);
    int finished = 0;
    for (int k = 0; k < count; ++k) {
      rem[k] -= done;
      if (rem[k] < rem[finished]) finished = k;
    }
    since = t;
    rem[finished] = rem[--count];
  }
  // `rank`: the rank of the event of SM s just handled at `now` (-1: none); `now` is the SM's
  // `since`.
  void Schedule(int s, double now, int rank) {
    const double t = NextFinish(rem_[s], count_[s], now);
    heap_.Push({t, t == now ? rank + 1 : 0, s});
  }

  absl::Span<const double> works_;
  size_t n_, next_ = 0;
  int per_sm_;
  double alone_rate_, overhead_, exit_cost_;
  std::vector<double>* starts_;
  // Per SM: the remaining work of its resident CTAs, and when it was last brought up to date.
  std::vector<std::array<double, kMaxCtasPerSm>> rem_;
  std::vector<int> count_;
  std::vector<double> since_;
  EventHeap<kSpread> heap_;
  double now_ = 0;
};

}  // namespace

double SimulateMakespan(absl::Span<const double> works, int num_sms, int ctas_per_sm,
                        double alone_rate, double overhead, double exit_cost,
                        std::vector<double>* starts, TieRule ties) {
  const size_t n = works.size();
  if (starts != nullptr) starts->assign(n, 0.0);
  if (n == 0 || num_sms <= 0) return 0;
  const int per_sm = std::clamp(ctas_per_sm, 1, kMaxCtasPerSm);
  if (ties == TieRule::kSpread) {
    EventSim<true> sim(works, num_sms, per_sm, alone_rate, overhead, exit_cost, starts);
    sim.RunListPhase();
    return sim.Drain(alone_rate);
  }
  EventSim<false> sim(works, num_sms, per_sm, alone_rate, overhead, exit_cost, starts);
  sim.RunListPhase();
  return sim.Drain(alone_rate);
}

void ReferenceMakespans(absl::Span<const double> works, int num_sms, int ctas_per_sm,
                        absl::Span<const std::array<double, 2>> params, unsigned mask,
                        double exit_cost, double* out, int starts_of,
                        std::vector<double>* starts) {
  const size_t n = works.size();
  if (starts != nullptr) starts->assign(n, 0.0);
  const int num = static_cast<int>(params.size());
  for (int j = 0; j < num; ++j) {
    if (mask >> j & 1u) out[j] = 0;
  }
  if (n == 0 || num_sms <= 0) return;
  const int per_sm = std::clamp(ctas_per_sm, 1, kMaxCtasPerSm);
  // The list phase does not read the alone rate if there is none (one wave) or every SM stays
  // full in it; then every bank entry of one overhead shares it and only drains on its own.
  const bool share = per_sm > 1 || n <= static_cast<size_t>(num_sms) * per_sm;
  unsigned left_to_do = mask & ((num >= 32 ? 0u : 1u << num) - 1u);
  if (starts_of >= 0 && starts != nullptr) left_to_do |= 1u << starts_of;
  while (left_to_do != 0) {
    const int lead = std::countr_zero(left_to_do);
    unsigned group = 1u << lead;
    for (int j = lead + 1; share && j < num; ++j) {
      if ((left_to_do >> j & 1u) && params[j][1] == params[lead][1]) group |= 1u << j;
    }
    left_to_do &= ~group;
    const bool keep_starts = starts != nullptr && starts_of >= 0 && (group >> starts_of & 1u);
    EventSim<false> listed(works, num_sms, per_sm, params[lead][0], params[lead][1], exit_cost,
                           keep_starts ? starts : nullptr);
    listed.RunListPhase();
    for (int j = lead; j < num; ++j) {
      if (group >> j & 1u) out[j] = listed.Drain(params[j][0]);
    }
  }
}

namespace {

// The list phase of SimulateMakespans with two CTAs per SM when every cost is a whole number of
// quarter blocks (whole key blocks, the bank's overheads, no 0.2-block exits): each slot then
// holds its CTA for a whole number of half-block time units, and a ring of per-unit buckets
// (a calendar queue: O(1) per CTA plus one look per time unit) replaces the heap. Every time is
// exact in double, so the result equals the heap's to the bit. Returns false (nothing written)
// where it does not apply. `starts` (optional, size n) and `free_at` (size 2 x num_sms, by slot
// id) as in SimulateMakespans.
bool CalendarListPhase(const std::vector<double>& cost, int num_sms, int per_sm, double* starts,
                       double* free_at) {
  if (per_sm != 2) return false;
  const size_t n = cost.size(), slots = 2 * static_cast<size_t>(num_sms);
  thread_local std::vector<int64_t> units;
  units.resize(n);
  int64_t longest = 0;
  for (size_t i = 0; i < n; ++i) {
    const double u = cost[i] * 4;  // time units (1/2 block) a slot is held: cost / (1/2) / (1/2)
    if (!(u >= 1 && u < (1 << 22)) || u != std::floor(u)) return false;
    units[i] = static_cast<int64_t>(u);
    longest = std::max(longest, units[i]);
  }
  size_t ring = 64;
  while (ring <= static_cast<size_t>(longest)) ring <<= 1;  // every pending time within a lap
  if (ring > 8 * n + 4096) return false;  // a scan this long costs more than the heap
  const size_t mask = ring - 1, word_mask = ring / 64 - 1;
  // The ring's buckets are all empty between calls (only the slots' own buckets are cleared at
  // the end), so a call costs no pass over the ring; a bitmap of the non-empty buckets lets the
  // scan skip 64 empty time units at once.
  thread_local std::vector<int32_t> bucket, next;
  thread_local std::vector<uint64_t> busy;
  thread_local std::vector<int64_t> due;
  if (bucket.size() < ring) {
    bucket.assign(ring, -1);
    busy.assign(ring / 64, 0);
  }
  thread_local std::vector<int32_t> order;
  next.resize(slots);
  order.resize(slots);
  due.assign(slots, -1);
  // Buckets list their slots in (rank, SM) order (SlotFree's): a slot whose SM's other slot is
  // already due at the same time comes after every SM's first.
  const int32_t num_slots = static_cast<int32_t>(slots);
  auto insert = [&](int32_t id, int64_t t) {
    due[id] = t;
    const int32_t key = order[id] = (due[id ^ 1] == t ? num_slots : 0) + id;
    const size_t at = static_cast<size_t>(t) & mask;
    int32_t* link = &bucket[at];
    if (*link < 0) busy[at >> 6] |= uint64_t{1} << (at & 63);
    while (*link >= 0 && order[*link] < key) link = &next[*link];
    next[id] = *link;
    *link = id;
  };
  for (size_t i = 0; i < slots; ++i) {
    insert(static_cast<int32_t>((i % num_sms) * 2 + i / num_sms), units[i]);
  }
  int64_t now = 0;
  for (size_t i = slots; i < n; ++i) {
    // The earliest non-empty bucket at or after `now` (all pending times lie in one lap).
    uint64_t bits = busy[(static_cast<size_t>(now) >> 6) & word_mask] & (~uint64_t{0} << (now & 63));
    while (bits == 0) {
      now = (now | 63) + 1;
      bits = busy[(static_cast<size_t>(now) >> 6) & word_mask];
    }
    now = (now & ~int64_t{63}) + std::countr_zero(bits);
    const size_t at = static_cast<size_t>(now) & mask;
    const int32_t id = bucket[at];
    bucket[at] = next[id];
    if (bucket[at] < 0) busy[at >> 6] &= ~(uint64_t{1} << (at & 63));
    if (starts != nullptr) starts[i] = 0.5 * static_cast<double>(now);
    insert(id, now + units[i]);
  }
  for (size_t id = 0; id < slots; ++id) {
    free_at[id] = 0.5 * static_cast<double>(due[id]);
    const size_t at = static_cast<size_t>(due[id]) & mask;
    bucket[at] = -1;
    busy[at >> 6] = 0;
  }
  return true;
}

// SimulateMakespans's one-wave case: CTA i on SM i % num_sms, every SM draining from time 0
// (starts stay 0); out[j] for each bank entry j in `entries`.
void OneWaveMakespans(const std::vector<double>& cost, int num_sms,
                      absl::Span<const std::array<double, 2>> params, unsigned entries,
                      double* out) {
  const size_t n = cost.size();
  for (int j = 0; j < static_cast<int>(params.size()); ++j) {
    if ((entries >> j & 1u) == 0) continue;
    double makespan = 0;
    for (size_t s = 0; s < std::min<size_t>(n, num_sms); ++s) {
      std::array<double, kMaxCtasPerSm> left;
      int k = 0;
      for (size_t i = s; i < n; i += num_sms) left[k++] = cost[i];
      SortSmall(left, k);
      makespan = std::max(makespan, DrainSm(0.0, left.data(), k, params[j][0]));
    }
    out[j] = makespan;
  }
}

// SimulateMakespans's list phase on a heap, for any CTAs per SM (CalendarListPhase's general
// case): each slot runs its CTA at the full-SM share `rate`; the CTAs, in order, go to the slot
// that frees first (ties to the lower SM), the first wave breadth-first over SMs. `starts`
// (optional) and `free_at` (num_sms x per_sm, by slot id) as in CalendarListPhase.
void HeapListPhase(const std::vector<double>& cost, int num_sms, int per_sm, double rate,
                   double* starts, double* free_at) {
  const size_t n = cost.size(), slots = static_cast<size_t>(num_sms) * per_sm;
  thread_local std::vector<SlotFree> heap;
  heap.resize(slots);
  std::fill(free_at, free_at + slots, -1.0);  // each slot's due time
  // Slots of the SM of slot `id` already due at `t` (the rank of a slot due then).
  auto rank_at = [&](int32_t id, double t) {
    const int32_t first = id - id % per_sm;
    int32_t r = 0;
    for (int32_t o = first; o < first + per_sm; ++o) r += o != id && free_at[o] == t;
    return r;
  };
  for (size_t i = 0; i < slots; ++i) {
    const int32_t sm = static_cast<int32_t>(i % num_sms), k = static_cast<int32_t>(i / num_sms);
    const int32_t id = sm * per_sm + k;
    const double t = cost[i] / rate;
    heap[i] = {t, rank_at(id, t), id};
    free_at[id] = t;
  }
  // A 4-ary min-heap by hand (replace-top is the hot operation; (time, rank, id) is a total
  // order, so any heap pops the same sequence).
  auto sift_down = [&](size_t h) {
    const SlotFree v = heap[h];
    for (;;) {
      const size_t c0 = 4 * h + 1;
      if (c0 >= slots) break;
      size_t c = c0;
      const size_t end = std::min(c0 + 4, slots);
      for (size_t k = c0 + 1; k < end; ++k) {
        if (heap[k] < heap[c]) c = k;
      }
      if (!(heap[c] < v)) break;
      heap[h] = heap[c];
      h = c;
    }
    heap[h] = v;
  };
  for (size_t h = (slots + 2) / 4; h-- > 0;) sift_down(h);
  for (size_t i = slots; i < n; ++i) {
    const double now = heap[0].time;
    if (starts != nullptr) starts[i] = now;
    const double t = now + cost[i] / rate;
    heap[0].time = free_at[heap[0].id] = t;
    heap[0].rank = rank_at(heap[0].id, t);
    sift_down(0);
  }
}

// SimulateMakespans's tail: no CTA joins any more, so each SM drains on its own from its slots'
// due times `free_at` (work left at its first finish, in the share `rate` it ran at); out[j] for
// each bank entry j in `entries`.
void TailMakespans(const std::vector<double>& free_at, int num_sms, int per_sm, double rate,
                   absl::Span<const std::array<double, 2>> params, unsigned entries, double* out) {
  for (int j = 0; j < static_cast<int>(params.size()); ++j) {
    if ((entries >> j & 1u) == 0) continue;
    double makespan = 0;
    for (int s = 0; s < num_sms; ++s) {
      std::array<double, kMaxCtasPerSm> left;
      const double* f = &free_at[static_cast<size_t>(s) * per_sm];
      std::copy(f, f + per_sm, left.begin());
      SortSmall(left, per_sm);
      const double first = left[0];
      for (int m = 0; m < per_sm; ++m) left[m] = (left[m] - first) * rate;
      makespan = std::max(makespan, DrainSm(first, left.data() + 1, per_sm - 1, params[j][0]));
    }
    out[j] = makespan;
  }
}

}  // namespace

void SimulateMakespans(absl::Span<const double> works, int num_sms, int ctas_per_sm,
                       absl::Span<const std::array<double, 2>> params, unsigned mask,
                       double exit_cost, double* out, int starts_of,
                       std::vector<double>* starts) {
  // Step 1: the first wave starts at 0; the bank entries asked for start at 0.
  const size_t n = works.size();
  const int per_sm = std::clamp(ctas_per_sm, 1, kMaxCtasPerSm);
  const size_t slots = static_cast<size_t>(std::max(num_sms, 0)) * per_sm;
  if (starts != nullptr) {  // the list phase writes the rest
    starts->resize(n);
    std::fill_n(starts->begin(), slots == 0 ? n : std::min(n, slots), 0.0);
  }
  const int num = static_cast<int>(params.size());
  for (int j = 0; j < num; ++j) {
    if (mask >> j & 1u) out[j] = 0;
  }
  if (n == 0 || num_sms <= 0) return;
  thread_local std::vector<double> cost;
  thread_local std::vector<double> free_at;
  unsigned left_to_do = mask & ((num >= 32 ? 0u : 1u << num) - 1u);
  if (starts_of >= 0 && starts != nullptr) left_to_do |= 1u << starts_of;
  while (left_to_do != 0) {
    // Step 2: the entries that share one list phase. It depends on the overhead only, unless one
    // CTA per SM runs alone all along: one pass serves every bank entry that shares it.
    const int lead = std::countr_zero(left_to_do);
    const double overhead = params[lead][1];
    unsigned group = 0;
    for (int j = lead; j < num; ++j) {
      if ((left_to_do >> j & 1u) && params[j][1] == overhead &&
          (per_sm > 1 || params[j][0] == params[lead][0])) {
        group |= 1u << j;
      }
    }
    left_to_do &= ~group;
    cost.resize(n);
    for (size_t i = 0; i < n; ++i) cost[i] = works[i] < 0 ? exit_cost : works[i] + overhead;
    // Step 3: one wave is only the drains.
    if (n <= slots) {
      OneWaveMakespans(cost, num_sms, params, group & mask, out);
      continue;
    }
    // Step 4: several waves. Until the queue empties every SM holds per_sm CTAs, so each slot
    // runs its CTA at the full-SM share: list scheduling, by calendar where its times are whole
    // half blocks, else on a heap.
    const double rate = ShareRate(per_sm, params[lead][0]);
    const bool keep_starts = starts != nullptr && starts_of >= 0 && (group >> starts_of & 1u);
    double* starts_out = keep_starts ? starts->data() : nullptr;
    free_at.resize(slots);
    if (!CalendarListPhase(cost, num_sms, per_sm, starts_out, free_at.data())) {
      HeapListPhase(cost, num_sms, per_sm, rate, starts_out, free_at.data());
    }
    // Step 5: the tail, each SM on its own.
    TailMakespans(free_at, num_sms, per_sm, rate, params, group & mask, out);
  }
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
  // A sampled head-major verify launch lists its first `heads_built` heads; `heads_left_out`
  // more repeat them. Every other launch lists all its CTAs (1 and 0).
  int64_t heads_built = 1;
  int64_t heads_left_out = 0;
};

double KeyBlocks(const KernelGrid& grid, const RequestLoad& r) {
  return static_cast<double>(CeilDiv(std::max<int64_t>(r.ctx_tokens, 1), grid.block_n));
}

// Head-major launch with every q_i = 1: heads become rows; the keys of each request may be
// split over several CTAs (`SplitKvCount`), followed by a combine kernel.
void SplitKvCtas(const KernelGrid& grid, absl::Span<const RequestLoad> batch, int64_t max_ctx,
                 CtaList& ctas) {
  const int64_t b = static_cast<int64_t>(batch.size());
  ctas.works.clear();
  ctas.combine_work = 0;
  ctas.heads_built = 1;
  ctas.heads_left_out = 0;
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
}

// Head-major verify launch: one CTA per (head, request, row block); row blocks of the longest
// request's queries. Only the first `heads_built` heads (every head: grid.heads).
void HeadMajorCtas(const KernelGrid& grid, absl::Span<const RequestLoad> batch, int32_t max_q,
                   int heads_built, CtaList& ctas) {
  const int64_t b = static_cast<int64_t>(batch.size());
  ctas.works.clear();
  ctas.combine_work = 0;
  ctas.row_blocks = CeilDiv(max_q, grid.block_m);
  ctas.num_ranges = b;
  ctas.works.reserve(static_cast<size_t>(grid.heads * b * ctas.row_blocks));
  for (int64_t i = 0; i < b; ++i) {  // the first head; every head repeats it
    for (int64_t m = 0; m < ctas.row_blocks; ++m) {
      ctas.works.push_back(m * grid.block_m < batch[i].query_tokens ? KeyBlocks(grid, batch[i])
                                                                    : -1.0);
    }
  }
  const size_t per_head = ctas.works.size();
  ctas.heads_built = std::max(heads_built, 1);
  ctas.heads_left_out = std::max(grid.heads, 1) - ctas.heads_built;
  ctas.works.resize(per_head * static_cast<size_t>(ctas.heads_built));
  for (size_t at = per_head; at < ctas.works.size(); at += per_head) {
    std::copy_n(ctas.works.begin(), per_head, ctas.works.begin() + static_cast<ptrdiff_t>(at));
  }
}

// Packed rows: heads x q_i rows per request, request by request.
void PackedRowCtas(const KernelGrid& grid, absl::Span<const RequestLoad> batch, int32_t max_q,
                   CtaList& ctas) {
  const int64_t b = static_cast<int64_t>(batch.size());
  ctas.works.clear();
  ctas.combine_work = 0;
  ctas.heads_built = 1;
  ctas.heads_left_out = 0;
  ctas.row_blocks = CeilDiv(static_cast<int64_t>(grid.heads) * max_q, grid.block_m);
  ctas.num_ranges = b;
  ctas.works.reserve(static_cast<size_t>(b * ctas.row_blocks));
  for (int64_t i = 0; i < b; ++i) {
    const int64_t rows = static_cast<int64_t>(grid.heads) * batch[i].query_tokens;
    for (int64_t m = 0; m < ctas.row_blocks; ++m) {
      ctas.works.push_back(m * grid.block_m < rows ? KeyBlocks(grid, batch[i]) : -1.0);
    }
  }
}

// Fills `ctas` (its buffers reused across calls). `sample_heads`: a head-major verify launch
// is built for its first SampledHeads heads only.
void BuildCtaList(const KernelGrid& grid, absl::Span<const RequestLoad> batch,
                 bool single_query_launch, bool sample_heads, CtaList& ctas) {
  int64_t max_ctx = 0;
  int32_t max_q = 1;
  for (const RequestLoad& r : batch) {
    max_ctx = std::max(max_ctx, r.ctx_tokens);
    max_q = std::max(max_q, r.query_tokens);
  }
  if (grid.layout == KernelGrid::Layout::kHeadMajor) {
    if (single_query_launch) {
      SplitKvCtas(grid, batch, max_ctx, ctas);
      return;
    }
    const int64_t per_head =
        static_cast<int64_t>(batch.size()) * CeilDiv(max_q, grid.block_m);
    const int heads = sample_heads ? SampledHeads(grid, per_head) : std::max(grid.heads, 1);
    HeadMajorCtas(grid, batch, max_q, heads, ctas);
    return;
  }
  PackedRowCtas(grid, batch, max_q, ctas);
}

// The heads a sampled head-major launch left out: `heads` more repeats of the list, each
// starting `head_time` after the one before (its work spread over every slot).
struct HeadsLeftOut {
  int64_t heads = 0;
  double head_time = 0;
};

// Key blocks each reuse window's CTAs fetch from HBM, into out[kGridColdReads0 + w]. `starts`:
// each CTA's start time. Starts never decrease in launch order, so one pass per window finds
// each key range's fetches: a CTA fetches when it starts more than the window after its range's
// last fetch. `left_out`: heads after the list's that were not simulated; each range then
// fetches again whenever its next head starts more than the window after its last fetch, its
// heads starting head_time apart from its last simulated one (one fetch per head: the range's
// other CTAs of that head start with it).
void FillColdReads(const CtaList& ctas, const std::vector<double>& starts,
                   const HeadsLeftOut& left_out, GridTerms* out) {
  thread_local std::vector<std::array<double, kNumGridReuseWindows>> last_fetch;
  last_fetch.assign(static_cast<size_t>(ctas.num_ranges),
                    [] {
                      std::array<double, kNumGridReuseWindows> a;
                      a.fill(-std::numeric_limits<double>::infinity());
                      return a;
                    }());
  std::array<double, kNumGridReuseWindows> cold{};
  const size_t row_blocks = static_cast<size_t>(ctas.row_blocks);
  const size_t num_ranges = static_cast<size_t>(ctas.num_ranges);
  size_t range = 0, in_range = 0;  // range_of(c) = (c / row_blocks) % num_ranges, kept by steps
  for (size_t c = 0; c < ctas.works.size(); ++c) {
    const double work = ctas.works[c];
    if (work > 0) {
      std::array<double, kNumGridReuseWindows>& last = last_fetch[range];
      for (int w = 0; w < kNumGridReuseWindows; ++w) {
        if (starts[c] - last[w] > kGridReuseWindows[w]) {
          cold[w] += work;
          last[w] = starts[c];
        }
      }
    }
    if (++in_range == row_blocks) {
      in_range = 0;
      if (++range == num_ranges) range = 0;
    }
  }
  if (left_out.heads <= 0 || left_out.head_time <= 0) {
    for (int w = 0; w < kNumGridReuseWindows; ++w) (*out)[kGridColdReads0 + w] = cold[w];
    return;
  }
  // Heads repeat, so each range's last live CTA is in the last head listed (its last
  // num_ranges x row_blocks CTAs); a range with none exits at once in every head.
  thread_local std::vector<double> last_start, range_work;
  last_start.assign(num_ranges, 0.0);
  range_work.assign(num_ranges, 0.0);
  const size_t last_head = ctas.works.size() - num_ranges * row_blocks;
  for (size_t c = last_head; c < ctas.works.size(); ++c) {
    const size_t r = (c - last_head) / row_blocks;
    if (ctas.works[c] > 0) {
      last_start[r] = starts[c];
      range_work[r] = ctas.works[c];
    }
  }
  for (size_t r = 0; r < num_ranges; ++r) {
    if (range_work[r] <= 0) continue;  // every CTA of the range exits at once
    for (int w = 0; w < kNumGridReuseWindows; ++w) {
      // Head n after the last simulated one starts at last_start + n * head_time: the first to
      // start more than the window after the last fetch fetches, then every `every`-th head.
      const double window = kGridReuseWindows[w];
      const double ahead = (last_fetch[r][w] + window - last_start[r]) / left_out.head_time;
      const double first = std::max(1.0, std::floor(ahead) + 1);
      if (first > static_cast<double>(left_out.heads)) continue;
      const double every = std::floor(window / left_out.head_time) + 1;
      const double fetches =
          1 + std::floor((static_cast<double>(left_out.heads) - first) / every);
      cold[w] += fetches * range_work[r];
    }
  }
  for (int w = 0; w < kNumGridReuseWindows; ++w) (*out)[kGridColdReads0 + w] = cold[w];
}

// The grid terms of the cold reads (SimulateGrid computes all of them if any is asked for).
constexpr unsigned kColdReadBits = ((1u << kNumGridReuseWindows) - 1) << kGridColdReads0;
bool WantsColdReads(unsigned terms) { return (terms & kColdReadBits) != 0; }
// Which makespans SimulateGrid simulates for `terms` (bit j: makespan j): those asked for, and
// the one whose start times the cold reads use, with them (as it always was).
unsigned SimulatedMakespans(unsigned terms) {
  return (terms >> kGridMakespan0 & ((1u << kNumGridMakespans) - 1)) |
         (WantsColdReads(terms) ? 1u << kColdReadsMakespan : 0u);
}

// The makespans of `works` under `params` (mask: which), by the rule SimulateGrid's `sim` names
// for a launch listed whole (kFast: SimulateMakespans; else ReferenceMakespans).
void LaunchMakespans(GridSimulation sim, absl::Span<const double> works, const KernelGrid& grid,
                     absl::Span<const std::array<double, 2>> params, unsigned mask,
                     double exit_cost, double* out, int starts_of = -1,
                     std::vector<double>* starts = nullptr) {
  if (sim == GridSimulation::kFast) {
    SimulateMakespans(works, grid.num_sms, grid.ctas_per_sm, params, mask, exit_cost, out,
                      starts_of, starts);
  } else {
    ReferenceMakespans(works, grid.num_sms, grid.ctas_per_sm, params, mask, exit_cost, out,
                       starts_of, starts);
  }
}

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Which slot each CTA of a launch's first wave gets is the hardware's choice, and it changes
// from launch to launch of one configuration: one decode launch of the H200 rows timed 4.9-5.2
// ms in three passes and 6.9-7.4 ms in three others (the median of each pass's seven calls;
// docs/cost-model.md, "The decode launch's placement"). The first wave still goes
// breadth-first (one CTA on every SM before any SM gets a second), so what changes is which
// first-round CTA each later CTA shares its SM with. A decode launch's makespans are therefore
// the mean over kFirstWavePlacements placements: the launch order, and fixed pseudo-random
// permutations of its first num_sms CTAs (the same on every machine and build: splitmix64 from
// the placement's index). Cold reads keep the launch order's start times. A single-query launch
// is always listed whole (BuildCtaList samples heads of verify launches only), so every
// placement runs under kGridMakespanParams, as SimulateGrid ran the launch order.
void AverageFirstWavePlacements(const KernelGrid& grid, const std::vector<double>& works,
                                unsigned makespans, GridSimulation sim, double exit_cost,
                                GridTerms* out) {
  // A launch of at most num_sms CTAs runs one CTA per SM whatever the order.
  const size_t first = std::min(works.size(), static_cast<size_t>(std::max(grid.num_sms, 1)));
  if (works.size() <= first || makespans == 0) return;
  thread_local std::vector<double> placed;
  placed.assign(works.begin(), works.end());  // only the first round is permuted, and restored
  std::array<double, kNumGridMakespans> sum{};
  for (int j = 0; j < kNumGridMakespans; ++j) sum[j] = (*out)[kGridMakespan0 + j];
  for (int p = 1; p < kFirstWavePlacements; ++p) {
    std::copy_n(works.begin(), first, placed.begin());
    uint64_t state = static_cast<uint64_t>(p);
    for (size_t i = first - 1; i > 0; --i) {  // Fisher-Yates over the first round
      std::swap(placed[i], placed[SplitMix64(state) % (i + 1)]);
    }
    std::array<double, kNumGridMakespans> m{};
    LaunchMakespans(sim, placed, grid, kGridMakespanParams, makespans, exit_cost, m.data());
    for (int j = 0; j < kNumGridMakespans; ++j) sum[j] += m[j];
  }
  for (int j = 0; j < kNumGridMakespans; ++j) {
    if (makespans >> j & 1u) (*out)[kGridMakespan0 + j] = sum[j] / kFirstWavePlacements;
  }
}

}  // namespace

GridTerms SimulateGrid(const KernelGrid& grid, absl::Span<const RequestLoad> batch,
                       bool single_query_launch, unsigned terms, GridSimulation sim) {
  GridTerms out{};
  if (!grid.enabled() || batch.empty()) return out;
  thread_local CtaList ctas;
  BuildCtaList(grid, batch, single_query_launch, sim == GridSimulation::kSampledHeads, ctas);
  const std::vector<double>& works = ctas.works;
  constexpr double kExitCost = 0.2;  // key blocks' worth of a CTA that exits at once
  const int64_t heads_built = ctas.heads_built, heads_left_out = ctas.heads_left_out;
  std::array<double, kNumGridMakespans> head_cost{};  // one head's CTAs' cost, per makespan
  double head_live = 0;                               // one head's CTAs that do not exit at once
  if (heads_left_out == 0) {
    out[kGridCtas] = static_cast<double>(works.size());
    for (double w : works) out[kGridWork] += std::max(w, 0.0);
  } else {
    const size_t per_head = works.size() / static_cast<size_t>(heads_built);
    double head_work = 0;
    for (size_t i = 0; i < per_head; ++i) {
      head_work += std::max(works[i], 0.0);
      head_live += works[i] < 0 ? 0 : 1;
      for (int j = 0; j < kNumGridMakespans; ++j) {
        head_cost[j] += works[i] < 0 ? kExitCost : works[i] + kGridMakespanParams[j][1];
      }
    }
    const double all_heads = static_cast<double>(heads_built + heads_left_out);
    out[kGridCtas] = static_cast<double>(per_head) * all_heads;
    out[kGridWork] = head_work * all_heads;  // whole key blocks: what the sum over all gives
  }
  out[kGridCombine] = ctas.combine_work;
  const bool cold_reads = WantsColdReads(terms);
  thread_local std::vector<double> starts;
  const unsigned makespans = SimulatedMakespans(terms);
  // A sampled launch runs one list phase, at the cold reads' overhead; each makespan is its drain
  // under that makespan's alone rate, moved below by the makespan's own per-CTA overhead.
  const double sampled_overhead = kGridMakespanParams[kColdReadsMakespan][1];
  if (sim != GridSimulation::kFast && heads_left_out > 0) {
    std::array<std::array<double, 2>, kNumGridMakespans> one_overhead = kGridMakespanParams;
    for (std::array<double, 2>& p : one_overhead) p[1] = sampled_overhead;
    ReferenceMakespans(works, grid.num_sms, grid.ctas_per_sm, one_overhead, makespans,
                       kExitCost, &out[kGridMakespan0], cold_reads ? kColdReadsMakespan : -1,
                       cold_reads ? &starts : nullptr);
  } else {
    LaunchMakespans(sim, works, grid, kGridMakespanParams, makespans, kExitCost,
                    &out[kGridMakespan0], cold_reads ? kColdReadsMakespan : -1,
                    cold_reads ? &starts : nullptr);
  }
  if (single_query_launch && grid.layout == KernelGrid::Layout::kHeadMajor) {
    AverageFirstWavePlacements(grid, works, makespans, sim, kExitCost, &out);
  }
  HeadsLeftOut left_out;
  if (heads_left_out > 0) {
    // While CTAs wait every SM is full: it works at full throughput (at the alone rate with one
    // CTA per SM), so each head left out adds its cost spread over the SMs, before the tail the
    // simulated heads end with.
    const double sms = std::max(grid.num_sms, 1);
    // What the SMs get through per unit of time under makespan j while they are full.
    auto throughput = [&](int j) {
      return sms * (grid.ctas_per_sm > 1 ? 1.0 : kGridMakespanParams[j][0]);
    };
    auto head_time = [&](int j) { return head_cost[j] / throughput(j); };
    for (int j = 0; j < kNumGridMakespans; ++j) {
      if (makespans >> j & 1u) {
        const double overhead_change = kGridMakespanParams[j][1] - sampled_overhead;
        out[kGridMakespan0 + j] +=
            static_cast<double>(heads_left_out) * head_time(j) +
            overhead_change * head_live * static_cast<double>(heads_built) / throughput(j);
      }
    }
    left_out = {heads_left_out, head_time(kColdReadsMakespan)};
  }
  if (cold_reads) FillColdReads(ctas, starts, left_out, &out);
  return out;
}

GridTerms KeepGridTerms(const GridTerms& computed, unsigned terms) {
  GridTerms out = computed;
  const unsigned makespans = SimulatedMakespans(terms);
  for (int j = 0; j < kNumGridMakespans; ++j) {
    if ((makespans >> j & 1u) == 0) out[kGridMakespan0 + j] = 0;
  }
  if (!WantsColdReads(terms)) {
    for (int w = 0; w < kNumGridReuseWindows; ++w) out[kGridColdReads0 + w] = 0;
  }
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
