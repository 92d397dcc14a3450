#include "dpbalance/balancer.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <thread>

#include "absl/time/clock.h"
#include "dpbalance/inprocess_allgather.h"
#include "gtest/gtest.h"

namespace dpbalance {
namespace {

BalancerConfig Config(int ranks) {
  BalancerConfig c;
  c.planner.num_ranks = ranks;
  c.planner.k_max = 7;
  c.planner.default_k = 1;
  c.timeout = absl::Seconds(20);
  c.log_every_steps = 0;
  return c;
}

std::vector<BalancerRequest> Batch(std::mt19937_64& rng, int n, int64_t id0) {
  std::lognormal_distribution<double> ctx(std::log(6000), 1.2);
  std::vector<BalancerRequest> b(n);
  for (int i = 0; i < n; ++i) {
    b[i].request_id = id0 + i;
    b[i].ctx_tokens = static_cast<int64_t>(ctx(rng));
    b[i].k_cap = 7;
  }
  return b;
}

struct RankLog {
  std::vector<int> depth;
  std::vector<bool> balanced;
  std::vector<bool> failed;  // the outcome carried an error
  bool enabled = true;
  BalancerStats stats;
};

using AttentionOf = std::function<double(int, const std::vector<BalancerRequest>&,
                                         const std::vector<int32_t>&)>;

// Runs `steps` steps on `ranks` threads; `tweak(rank, config)` may change one rank's config,
// `batch_of(rank, step, rng)` builds its batch, `attention_of(rank, batch, lens)` is the
// attention time it reports (default: 20 ms + 0.1 ms x rank).
std::vector<RankLog> RunRanks(int ranks, int steps, std::function<void(int, BalancerConfig&)> tweak,
                              std::function<std::vector<BalancerRequest>(int, int, std::mt19937_64&)> batch_of,
                              std::function<bool(int, int)> skip = nullptr,
                              AttentionOf attention_of = nullptr,
                              std::function<std::unique_ptr<AllGather>(int, std::unique_ptr<AllGather>)> wrap =
                                  nullptr) {
  auto group = *InProcessGroup::Create(ranks, sizeof(RankSummary));
  std::vector<RankLog> logs(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      BalancerConfig c = Config(ranks);
      if (tweak) tweak(r, c);
      if (ranks > 16) c.timeout = absl::Seconds(60);
      std::unique_ptr<AllGather> comm = *group->Join(r);
      if (wrap) comm = wrap(r, std::move(comm));
      auto b = Balancer::Create(c, r, std::move(comm));
      ASSERT_TRUE(b.ok()) << b.status();
      std::mt19937_64 rng(r);
      for (int s = 0; s < steps; ++s) {
        if (skip && skip(r, s)) break;
        std::vector<BalancerRequest> batch = batch_of(r, s, rng);
        std::vector<int32_t> v(batch.size(), -1);
        const PlanOutcome o = (*b)->Plan(batch, -1, absl::MakeSpan(v));
        logs[r].depth.push_back(o.draft_depth);
        logs[r].balanced.push_back(o.balanced);
        logs[r].failed.push_back(!o.status.ok());
        for (size_t i = 0; i < batch.size(); ++i) {
          EXPECT_GE(v[i], 0);
          EXPECT_LE(v[i], std::max(0, batch[i].k_cap));
          // Balanced or not, no request verifies more tokens than the rank drafts.
          EXPECT_LE(v[i], o.draft_depth) << "rank " << r << " step " << s;
        }
        std::vector<BalancerAccepted> acc;
        for (size_t i = 0; i < batch.size(); ++i) acc.push_back({batch[i].request_id, v[i], v[i] / 2, false});
        const double attn = attention_of ? attention_of(r, batch, v) : 20000 + 100 * r;
        if (v.size() == batch.size()) (*b)->Report(attn, attn + 40000, acc).IgnoreError();
      }
      logs[r].enabled = (*b)->enabled();
      logs[r].stats = (*b)->Stats();
    });
  }
  for (auto& t : threads) t.join();
  return logs;
}

auto Normal = [](int r, int s, std::mt19937_64& rng) { return Batch(rng, 8 + r % 5, 1000 * r + s % 3); };

// DPB_MODE=dspark_fill (SGLang DSpark with tier fill, the baseline arm) through the balancer:
// every rank derives the same tier from the one exchange and fills its lengths up to it; a
// request's first two steps count survival 1 in the budget (no lagged survivals yet), so the
// ranks' first tier is the full window of the largest batch and later ones, once accept counts
// say drafts fail, are lower.
TEST(Balancer, DsparkFillAgreesOnOneTierFromTheExchange) {
  constexpr int kRanks = 4, kSteps = 8;
  auto group = *InProcessGroup::Create(kRanks, sizeof(RankSummary));
  std::vector<std::vector<int64_t>> tiers(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      BalancerConfig c = Config(kRanks);
      c.planner.mode = PlanMode::kDsparkFill;
      c.planner.token_tiers = {8, 16, 24, 32, 40, 48, 56, 64, 80, 96};
      auto b = *Balancer::Create(c, r, *group->Join(r));
      std::mt19937_64 rng(r);
      const std::vector<BalancerRequest> batch = Batch(rng, 4 + r, 100 * r);  // the same ids each step
      for (int s = 0; s < kSteps; ++s) {
        std::vector<int32_t> v(batch.size(), -1);
        StepTotals totals;
        const PlanOutcome o = b->Plan(StepInput{batch, -1, 0, 0}, absl::MakeSpan(v), &totals);
        ASSERT_TRUE(o.balanced) << o.status;
        int64_t own = 0;
        for (int32_t len : v) own += 1 + len;
        EXPECT_LE(own, totals.padded_tokens);
        for (int64_t t : totals.rank_tokens) EXPECT_EQ(t, totals.padded_tokens);  // every rank runs it
        tiers[r].push_back(totals.padded_tokens);
        std::vector<BalancerAccepted> acc;
        for (size_t i = 0; i < batch.size(); ++i) acc.push_back({batch[i].request_id, v[i], 0, false});
        b->Report(20000, 60000, acc).IgnoreError();  // every draft rejected
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 1; r < kRanks; ++r) EXPECT_EQ(tiers[r], tiers[0]);
  EXPECT_EQ(tiers[0][0], 7 * 8);  // the largest batch (7 requests) at its full window
  EXPECT_LT(tiers[0].back(), tiers[0][0]);
}

TEST(Balancer, RanksAgreeOnDepthForRankCountsOneToSixtyFour) {
  for (int ranks : {1, 2, 5, 16, 64}) {
    const auto logs = RunRanks(ranks, 6, nullptr, Normal);
    for (int s = 0; s < 6; ++s) {
      for (int r = 0; r < ranks; ++r) {
        EXPECT_TRUE(logs[r].balanced[s]) << "ranks " << ranks << " rank " << r << " step " << s;
        EXPECT_EQ(logs[r].depth[s], logs[0].depth[s]);
      }
    }
    EXPECT_EQ(logs[0].stats.fallbacks, 0);
  }
}

// One rank, the same 8 requests every step, none of whose drafts is ever accepted: the goodput
// plan learns that and stops verifying them. Returns how many request-steps verified fewer
// than the default length (1).
int64_t ShortenedRequestSteps(double tpot_slo_us) {
  auto group = *InProcessGroup::Create(1, sizeof(RankSummary));
  BalancerConfig c = Config(1);
  c.tpot_slo_us = tpot_slo_us;
  auto b = Balancer::Create(c, 0, *group->Join(0));
  EXPECT_TRUE(b.ok()) << b.status();
  std::vector<BalancerRequest> batch(8);
  for (int i = 0; i < 8; ++i) batch[i] = {.request_id = i, .ctx_tokens = 1000 + 700 * i, .k_cap = 7};
  int64_t shortened = 0;
  for (int s = 0; s < 30; ++s) {
    std::vector<int32_t> v(batch.size());
    EXPECT_TRUE((*b)->Plan(batch, -1, absl::MakeSpan(v)).balanced);
    std::vector<BalancerAccepted> acc;
    for (size_t i = 0; i < batch.size(); ++i) {
      shortened += v[i] < 1;
      acc.push_back({batch[i].request_id, v[i], 0, false});
    }
    EXPECT_TRUE((*b)->Report(20000, 60000, acc).ok());
  }
  EXPECT_EQ((*b)->Stats().fallbacks, 0);
  return shortened;
}

TEST(Balancer, TpotSloKeepsLateRequestsAtTheDefaultsPaceOnly) {
  // 60 ms steps: under a 1 ms SLO every request is late beyond reach, so each is floored at the
  // shortest length that keeps its pace at the default (TpotSlo::Floor). Its drafts are never
  // accepted: once the estimate knows it, that is the bare token, and the plan shortens as
  // without an SLO (it used to hold them at the default, verifying drafts that never pay);
  // before that the floor holds some steps. Under an SLO no request can miss, the plan is the
  // same as without one.
  const int64_t free = ShortenedRequestSteps(0);
  EXPECT_GT(free, 0) << "the plan never shortened a request: the test would prove nothing";
  const int64_t late = ShortenedRequestSteps(1000);
  EXPECT_GT(late, free / 2);
  EXPECT_LE(late, free);
  EXPECT_EQ(ShortenedRequestSteps(1e12), free);
}

// The default guard through the balancer: the plan that stops verifying never-accepted drafts
// (above) predicts far less than 11x the default plan's goodput, so with min_plan_gain = 10 every
// step keeps the default length and the stats count each as kept; without the guard none is.
TEST(Balancer, DefaultGuardKeepsDefaultLengthsAndCountsTheSteps) {
  for (double margin : {0.0, 10.0}) {
    auto group = *InProcessGroup::Create(1, sizeof(RankSummary));
    BalancerConfig c = Config(1);
    c.planner.min_plan_gain = margin;
    auto b = *Balancer::Create(c, 0, *group->Join(0));
    std::vector<BalancerRequest> batch(8);
    for (int i = 0; i < 8; ++i) batch[i] = {.request_id = i, .ctx_tokens = 1000 + 700 * i, .k_cap = 7};
    int64_t changed = 0;
    for (int s = 0; s < 30; ++s) {
      std::vector<int32_t> v(batch.size());
      ASSERT_TRUE(b->Plan(batch, -1, absl::MakeSpan(v)).balanced);
      std::vector<BalancerAccepted> acc;
      for (size_t i = 0; i < batch.size(); ++i) {
        changed += v[i] != 1;
        acc.push_back({batch[i].request_id, v[i], 0, false});
      }
      ASSERT_TRUE(b->Report(20000, 60000, acc).ok());
    }
    const BalancerStats st = b->Stats();
    EXPECT_EQ(st.balanced_steps, 30);
    if (margin > 0) {
      EXPECT_EQ(changed, 0);
      EXPECT_EQ(st.kept_default_steps, 30);
    } else {
      EXPECT_GT(changed, 0);
      EXPECT_EQ(st.kept_default_steps, 0);
    }
  }
}

TEST(Balancer, ARankWithGarbageFallsBackAloneWithoutStallingOthers) {
  auto garbage = [](int r, int /*s*/, std::mt19937_64& rng) {
    auto b = Batch(rng, 10, 100 * r);
    if (r == 2) b[3].ctx_tokens = -5;  // invalid on rank 2
    return b;
  };
  const auto logs = RunRanks(4, 5, nullptr, garbage);
  for (int s = 0; s < 5; ++s) {
    EXPECT_FALSE(logs[2].balanced[s]);
    EXPECT_TRUE(logs[0].balanced[s]);
    EXPECT_TRUE(logs[3].balanced[s]);
    // One draft depth for the whole instance, deep enough for the fallback rank's defaults.
    for (int r = 1; r < 4; ++r) EXPECT_EQ(logs[r].depth[s], logs[0].depth[s]);
    EXPECT_GE(logs[2].depth[s], 1);  // default_k = 1 in Config()
  }
  EXPECT_EQ(logs[2].stats.fallbacks, 5);
}

// Passes every exchange through, then rewrites `victim`'s record in the gathered bytes (on every
// rank, so all still decide from identical bytes) to claim that its floors allow any depth. That
// is a summary that understates its own floors, as a planner bug would: the agreed depth can then
// fall below the victim's floors, and its Assign alone fails after the exchange.
class UnderstatedFloors : public AllGather {
 public:
  UnderstatedFloors(std::unique_ptr<AllGather> inner, int victim) : inner_(std::move(inner)), victim_(victim) {}
  int num_ranks() const override { return inner_->num_ranks(); }
  int rank() const override { return inner_->rank(); }
  size_t record_bytes() const override { return inner_->record_bytes(); }
  bool healthy() const override { return inner_->healthy(); }
  std::string name() const override { return "understated-floors(" + inner_->name() + ")"; }
  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv, absl::Duration timeout) override {
    absl::Status s = inner_->Gather(send, recv, timeout);
    if (s.ok()) {
      auto* all = reinterpret_cast<RankSummary*>(recv.data());
      if (all[victim_].magic == kSummaryMagic) all[victim_].min_depth = 0;
    }
    return s;
  }

 private:
  std::unique_ptr<AllGather> inner_;
  int victim_;
};

TEST(Balancer, ARankWhoseAssignFailsStillDraftsTheAgreedDepth) {
  // Rank 1's requests must verify 6 tokens (k_min), default_k is 5, and its record says its
  // floors allow depth 0: whenever the instance agrees on a depth below 6, rank 1's Assign fails.
  // Below 5, its default lengths must also be cut to the agreed depth.
  static constexpr int kVictim = 1;
  auto batch_of = [](int r, int s, std::mt19937_64& rng) {
    auto b = Batch(rng, 10, 100 * r + s % 3);
    if (r == kVictim) {
      for (BalancerRequest& q : b) q.k_min = 6;
    }
    return b;
  };
  const auto logs = RunRanks(
      4, 8, [](int, BalancerConfig& c) { c.planner.default_k = 5; }, batch_of, nullptr, nullptr,
      [](int, std::unique_ptr<AllGather> comm) -> std::unique_ptr<AllGather> {
        return std::make_unique<UnderstatedFloors>(std::move(comm), kVictim);
      });
  int failed_steps = 0, below_default = 0;
  for (int s = 0; s < 8; ++s) {
    for (int r = 0; r < 4; ++r) {
      if (r != kVictim) {
        EXPECT_TRUE(logs[r].balanced[s]) << "rank " << r << " step " << s;
      }
      // One draft depth for the instance, whatever failed where (RunRanks also checks that no
      // verify length exceeds it).
      EXPECT_EQ(logs[r].depth[s], logs[0].depth[s]) << "rank " << r << " step " << s;
    }
    if (logs[kVictim].failed[s]) {
      ++failed_steps;
      EXPECT_FALSE(logs[kVictim].balanced[s]);
      below_default += logs[0].depth[s] < 5;
    }
  }
  // The test proves something only if the failure happened with an agreed depth below the
  // default: only there do the default lengths exceed the agreed depth, so a fallback that kept
  // the default depth and lengths would be caught.
  EXPECT_GT(below_default, 0) << failed_steps << " failed steps, none below the default depth";
  EXPECT_EQ(logs[kVictim].stats.fallbacks, failed_steps);
}

// Passes every exchange through, but lets the test choose each call's timeout and hold a call
// until the test releases it: `before(rank, call, timeout)` runs first and returns the timeout
// the inner backend gets (call 0 is the handshake, call s + 1 step s); `after(rank, call)` runs
// when the inner call returned. Timeouts that matter are then forced, not raced against sleeps.
// A backend that passes everything to `inner_`; subclasses wrap Gather.
class Forwarding : public AllGather {
 public:
  explicit Forwarding(std::unique_ptr<AllGather> inner) : inner_(std::move(inner)) {}
  int num_ranks() const override { return inner_->num_ranks(); }
  int rank() const override { return inner_->rank(); }
  size_t record_bytes() const override { return inner_->record_bytes(); }
  bool healthy() const override { return inner_->healthy(); }
  bool ordered() const override { return inner_->ordered(); }
  std::string name() const override { return "wrapped(" + inner_->name() + ")"; }

 protected:
  std::unique_ptr<AllGather> inner_;
};

class Hooked : public Forwarding {
 public:
  using Before = std::function<absl::Duration(int, int64_t, absl::Duration)>;
  using After = std::function<void(int, int64_t)>;
  Hooked(std::unique_ptr<AllGather> inner, Before before, After after = nullptr)
      : Forwarding(std::move(inner)), before_(std::move(before)), after_(std::move(after)) {}
  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv, absl::Duration timeout) override {
    const int64_t call = calls_++;
    absl::Status s = inner_->Gather(send, recv, before_(rank(), call, timeout));
    if (after_) after_(rank(), call);
    return s;
  }

 private:
  Before before_;
  After after_;
  int64_t calls_ = 0;
};

// Sleeps `delay` before each exchange on one rank and keeps every gathered record's own_us.
class SlowAndRecording : public Forwarding {
 public:
  SlowAndRecording(std::unique_ptr<AllGather> inner, absl::Duration delay,
                   std::vector<std::vector<uint16_t>>* own_us, absl::Duration first_extra = absl::ZeroDuration())
      : Forwarding(std::move(inner)), delay_(delay), first_extra_(first_extra), own_us_(own_us) {}
  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv, absl::Duration timeout) override {
    absl::SleepFor(delay_ + (calls_ == 1 ? first_extra_ : absl::ZeroDuration()));  // call 1: step 0
    absl::Status s = inner_->Gather(send, recv, timeout);
    if (s.ok() && calls_++ > 0) {  // call 0 is the handshake's hello, not records
      std::vector<uint16_t> row;
      for (size_t r = 0; r < recv.size() / sizeof(RankSummary); ++r) {
        RankSummary rec;
        std::memcpy(&rec, recv.data() + r * sizeof(RankSummary), sizeof(rec));
        row.push_back(rec.own_us);
      }
      own_us_->push_back(row);
    }
    return s;
  }

 private:
  absl::Duration delay_, first_extra_;
  std::vector<std::vector<uint16_t>>* own_us_;
  int64_t calls_ = 0;
};

// Every record carries its sender's own time per step (RankSummary::own_us, the median of its
// last 32 plan calls, exchange included): unknown (0) on the first step, then at least the 3 ms
// that rank 1 spends before each exchange, on both ranks (rank 0 waits for rank 1 there), and
// every rank reads the same values. Rank 1's first exchange waits 150 ms more (a peer's
// start-up): from step 3 on (three calls timed, the median past it) no record carries it,
// where a mean would charge it for the rest of the window. Stats report the rank's own median.
TEST(Balancer, RecordsCarryEachRanksOwnTimePerStep) {
  std::vector<std::vector<std::vector<uint16_t>>> seen(2);
  std::vector<RankLog> logs = RunRanks(
      2, 12, nullptr, Normal, nullptr, nullptr,
      [&](int r, std::unique_ptr<AllGather> inner) -> std::unique_ptr<AllGather> {
        return std::make_unique<SlowAndRecording>(std::move(inner), absl::Milliseconds(r == 1 ? 3 : 0), &seen[r],
                                                  absl::Milliseconds(r == 1 ? 150 : 0));
      });
  ASSERT_EQ(seen[0].size(), 12u);
  ASSERT_EQ(seen[1].size(), 12u);
  for (int step = 0; step < 12; ++step) {
    EXPECT_EQ(seen[0][step], seen[1][step]) << "step " << step << ": the ranks read different bytes";
    for (int r = 0; r < 2; ++r) {
      if (step == 0) {
        EXPECT_EQ(seen[0][step][r], 0) << "no plan call timed yet";
      } else {
        EXPECT_GE(seen[0][step][r], 2900) << "step " << step << " rank " << r;
        if (step >= 3) {
          EXPECT_LT(seen[0][step][r], 30000) << "step " << step << " rank " << r;
        }
      }
    }
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_GE(logs[r].stats.own_us, 2900) << r;
    EXPECT_TRUE(logs[r].enabled);
  }
}

// Counts arrivals and lets a thread wait for a number of them.
class Latch {
 public:
  void Arrive() {
    std::lock_guard<std::mutex> l(mu_);
    ++n_;
    cv_.notify_all();
  }
  void WaitFor(int n) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return n_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_ = 0;
};

// A model of NCCL on the engine's communicator (AllGather::ordered): calls pair up across ranks
// by their order; a call that times out leaves its record queued, and that collective completes
// whenever the last rank makes its matching call. `Unmatched()` counts collectives some rank
// never joined: on the engine's communicator each would pair with the engine's own next one.
class OrderedGroup {
 public:
  explicit OrderedGroup(int ranks) : ranks_(ranks) {}
  std::unique_ptr<AllGather> Join(int rank);
  int Unmatched() {
    std::lock_guard<std::mutex> l(mu_);
    int n = 0;
    for (const auto& [seq, c] : colls_) n += c.arrived < ranks_;
    return n;
  }

 private:
  friend class OrderedMember;
  struct Collective {
    int arrived = 0;
    std::vector<uint8_t> bytes;
  };
  const int ranks_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, Collective> colls_;
};

class OrderedMember : public AllGather {
 public:
  OrderedMember(OrderedGroup* g, int rank) : g_(g), rank_(rank) {}
  int num_ranks() const override { return g_->ranks_; }
  int rank() const override { return rank_; }
  size_t record_bytes() const override { return sizeof(RankSummary); }
  bool healthy() const override { return true; }
  bool ordered() const override { return true; }
  std::string name() const override { return "ordered-model"; }
  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv, absl::Duration timeout) override {
    const size_t bytes = record_bytes();
    std::unique_lock<std::mutex> l(g_->mu_);
    OrderedGroup::Collective& c = g_->colls_[calls_++];
    c.bytes.resize(bytes * g_->ranks_);
    std::memcpy(c.bytes.data() + bytes * rank_, send.data(), bytes);
    ++c.arrived;
    g_->cv_.notify_all();
    if (!g_->cv_.wait_for(l, absl::ToChronoNanoseconds(timeout), [&] { return c.arrived == g_->ranks_; })) {
      return absl::DeadlineExceededError("ordered model: timed out (the record stays queued)");
    }
    std::memcpy(recv.data(), c.bytes.data(), c.bytes.size());
    return absl::OkStatus();
  }

 private:
  OrderedGroup* g_;
  int rank_;
  int64_t calls_ = 0;
};

std::unique_ptr<AllGather> OrderedGroup::Join(int rank) { return std::make_unique<OrderedMember>(this, rank); }

// The engine's own sync carries the records and overwrites one rank's row itself: on the steps
// `rows(step)` names, with the idle row (an idle rank, SGLang's fallback row) or with zeros (a
// rank without a working plugin). Call 0 is the handshake, call s + 1 step s.
class EngineRows : public AllGather {
 public:
  using Rows = std::function<const RankSummary*(int64_t step)>;
  EngineRows(std::unique_ptr<AllGather> inner, int row, Rows rows)
      : inner_(std::move(inner)), row_(row), rows_(std::move(rows)) {}
  int num_ranks() const override { return inner_->num_ranks(); }
  int rank() const override { return inner_->rank(); }
  size_t record_bytes() const override { return inner_->record_bytes(); }
  bool healthy() const override { return inner_->healthy(); }
  std::string name() const override { return "engine-rows(" + inner_->name() + ")"; }
  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv, absl::Duration timeout) override {
    const int64_t call = calls_++;
    absl::Status s = inner_->Gather(send, recv, timeout);
    if (const RankSummary* r = call > 0 ? rows_(call - 1) : nullptr; s.ok() && r != nullptr) {
      std::memcpy(recv.data() + row_ * sizeof(RankSummary), r, sizeof(RankSummary));
    }
    return s;
  }

 private:
  std::unique_ptr<AllGather> inner_;
  int row_;
  Rows rows_;
  int64_t calls_ = 0;
};

// Issue #34: an idle rank's row (IdleRowRecord) is a rank with zero cost that plans nothing: the
// others keep balancing, see its total as 0 tokens and its flags as idle, and no rank counts a
// failure; the rank whose row it is runs its defaults. An all-zero row (a rank without a working
// plugin) still pauses balancing on every rank for that step, its total unknown.
TEST(Balancer, AnIdleRowPlansNothingWhileAZeroRowStillPausesEveryRank) {
  constexpr int kRanks = 4, kSteps = 24, kRow = 3;
  const RankSummary idle = IdleRowRecord(), zeros{};
  auto rows = [&](int64_t step) -> const RankSummary* {
    if (step >= 5 && step < 10) return &idle;
    if (step >= 15 && step < 20) return &zeros;
    return nullptr;
  };
  auto group = *InProcessGroup::Create(kRanks, sizeof(RankSummary));
  std::vector<std::vector<PlanOutcome>> outcomes(kRanks);
  std::vector<std::vector<StepTotals>> totals(kRanks);
  std::vector<BalancerStats> stats(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto b = Balancer::Create(Config(kRanks), r, std::make_unique<EngineRows>(*group->Join(r), kRow, rows));
      ASSERT_TRUE(b.ok()) << b.status();
      std::mt19937_64 rng(r);
      for (int s = 0; s < kSteps; ++s) {
        const std::vector<BalancerRequest> batch = Normal(r, s, rng);
        std::vector<int32_t> v(batch.size());
        StepTotals t;
        StepInput in;
        in.batch = batch;
        outcomes[r].push_back((*b)->Plan(in, absl::MakeSpan(v), &t));
        totals[r].push_back(t);
        std::vector<BalancerAccepted> acc;
        for (size_t i = 0; i < batch.size(); ++i) acc.push_back({batch[i].request_id, v[i], v[i] / 2, false});
        (*b)->Report(20000 + 100 * r, 60000, acc).IgnoreError();
      }
      stats[r] = (*b)->Stats();
    });
  }
  for (auto& t : threads) t.join();
  for (int s = 0; s < kSteps; ++s) {
    const bool idle_row = s >= 5 && s < 10, zero_row = s >= 15 && s < 20;
    for (int r = 0; r < kRanks; ++r) {
      const std::string where = "rank " + std::to_string(r) + " step " + std::to_string(s);
      const PlanOutcome& o = outcomes[r][s];
      EXPECT_EQ(o.draft_depth, outcomes[0][s].draft_depth) << where;
      if (zero_row || (idle_row && r == kRow)) {
        EXPECT_FALSE(o.balanced) << where;
        EXPECT_FALSE(o.status.ok()) << where;
      } else {
        EXPECT_TRUE(o.balanced) << where << ": " << o.status;
      }
      const StepTotals& t = totals[r][s];
      ASSERT_TRUE(t.known) << where;
      if (idle_row && r != kRow) {
        EXPECT_EQ(t.rank_tokens[kRow], 0) << where;
        EXPECT_EQ(t.rank_flags[kRow], kSummaryIdle) << where;
      }
      if (zero_row && r != kRow) {
        EXPECT_EQ(t.rank_tokens[kRow], -1) << where;
      }
    }
  }
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(stats[r].enabled) << "rank " << r << ": " << stats[r].disabled_reason;
    // Balanced: every step but the paused ones (and the idle row's own, for that rank).
    EXPECT_EQ(stats[r].balanced_steps, kSteps - 5 - (r == kRow ? 5 : 0)) << "rank " << r;
    EXPECT_GT(stats[r].goodput_tok_per_s, 0) << "rank " << r;
  }
}

TEST(Balancer, OnAnOrderedBackendADisabledRankStillJoinsEveryStep) {
  // At step 2 rank 3 calls late: its call is held until ranks 0-2 have timed out (their step-2
  // call gets a 1 ms timeout, every other call the config's 20 s). With
  // max_consecutive_failures = 1 they disable themselves on the spot; rank 3's late call then
  // completes that collective, so rank 3 balances step 2 and calls again at step 3.
  OrderedGroup group(4);
  Latch timed_out;
  constexpr int64_t kStep2Call = 3;  // call 0 is the handshake
  auto before = [&timed_out](int r, int64_t call, absl::Duration timeout) {
    if (call != kStep2Call) return timeout;
    if (r < 3) return absl::Milliseconds(1);
    timed_out.WaitFor(3);
    return timeout;
  };
  auto after = [&timed_out](int r, int64_t call) {
    if (call == kStep2Call && r < 3) timed_out.Arrive();
  };
  const auto logs = RunRanks(
      4, 8, [](int, BalancerConfig& c) { c.max_consecutive_failures = 1; }, Normal, nullptr, nullptr,
      [&](int r, std::unique_ptr<AllGather>) -> std::unique_ptr<AllGather> {
        return std::make_unique<Hooked>(group.Join(r), before, after);
      });
  // Every collective was joined by every rank: none is left to pair with the engine's own.
  EXPECT_EQ(group.Unmatched(), 0);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(logs[r].failed[2]) << "rank " << r << " did not time out";
  EXPECT_TRUE(logs[3].balanced[2]);
  // Rank 3 saw the others' zero records at step 3 and disabled itself too; after that every
  // rank drafts the default depth.
  for (int r = 0; r < 4; ++r) {
    EXPECT_FALSE(logs[r].enabled) << "rank " << r;
    for (int s = 3; s < 8; ++s) EXPECT_EQ(logs[r].depth[s], 1) << "rank " << r << " step " << s;
  }
}

using BatchOf = std::function<std::vector<BalancerRequest>(int, int, std::mt19937_64&)>;

// Quiet mode's runs: 4 ranks on the ordered backend model, quiet mode after 3 with spans up to 8,
// DefaultGuard with a margin no plan beats (every decision keeps the defaults). `calls` gets
// each rank's collective calls (the handshake's included), `unmatched` the collectives some
// rank never joined.
std::vector<RankLog> RunQuietRanks(int steps, BatchOf batch_of, std::vector<int>* calls, int* unmatched,
                                   bool learn_step_terms = false) {
  constexpr int kRanks = 4;
  OrderedGroup group(kRanks);
  std::vector<std::atomic<int>> n(kRanks);
  auto pass = [](int, int64_t, absl::Duration t) { return t; };
  auto count = [&n](int r, int64_t) { ++n[r]; };
  auto logs = RunRanks(
      kRanks, steps,
      [learn_step_terms](int, BalancerConfig& c) {
        c.planner.min_plan_gain = 10;
        c.quiet = {.after = 3, .max_steps = 8};
        c.learn_step_terms = learn_step_terms;  // the spans' arithmetic: from the first steps
      },
      std::move(batch_of), nullptr, nullptr,
      [&](int r, std::unique_ptr<AllGather>) -> std::unique_ptr<AllGather> {
        return std::make_unique<Hooked>(group.Join(r), pass, count);
      });
  *unmatched = group.Unmatched();
  calls->assign(n.begin(), n.end());
  return logs;
}

// Quiet mode (quiet.h) with every decision at the defaults: the ranks exchange at steps 0-3, 7,
// 14, 23, 32, 41, 50, 59 and skip the other 49 steps, every rank the same ones: no collective is
// left unmatched and every rank made the same calls. Every step runs the defaults.
TEST(Balancer, QuietModeSkipsTheSameStepsOnEveryRankWhileTheDefaultIsKept) {
  constexpr int kSteps = 60;
  std::vector<int> calls;
  int unmatched = -1;
  const auto logs = RunQuietRanks(kSteps, Normal, &calls, &unmatched);
  EXPECT_EQ(unmatched, 0);
  for (size_t r = 0; r < logs.size(); ++r) {
    EXPECT_EQ(calls[r], 1 + 11) << "rank " << r << ": the handshake and 11 exchanges";
    EXPECT_EQ(logs[r].stats.quiet_steps, 49) << r;
    EXPECT_EQ(logs[r].stats.quiet_spans, 8) << r;
    EXPECT_EQ(logs[r].stats.fallbacks, 0) << r;
    EXPECT_TRUE(logs[r].enabled);
    for (int s = 0; s < kSteps; ++s) EXPECT_EQ(logs[r].depth[s], 1) << "rank " << r << " step " << s;
  }
}

// With the step terms learnt online (the default), no rank proposes a quiet span before the fit
// has 64 rows (a quiet step adds none): the ranks exchange at steps 0-67 (the 64th row comes
// with step 65's exchange, then 3 kept decisions), then as above from there: 68-69 skipped, 70,
// 74-77 skipped ... the same on every rank, no collective unmatched.
TEST(Balancer, QuietModeWaitsForTheStepTermsToSettle) {
  constexpr int kSteps = 100;
  std::vector<int> calls;
  int unmatched = -1;
  const auto logs = RunQuietRanks(kSteps, Normal, &calls, &unmatched, /*learn_step_terms=*/true);
  EXPECT_EQ(unmatched, 0);
  for (size_t r = 0; r < logs.size(); ++r) {
    EXPECT_GE(logs[r].stats.step_terms_rows, 64) << r;
    EXPECT_GT(logs[r].stats.quiet_steps, 0) << r;
    // At least the 66 exchanges before any span, then fewer than one exchange a step.
    EXPECT_GE(calls[r], 1 + 66) << r;
    EXPECT_EQ(calls[r] - 1 + logs[r].stats.quiet_steps, kSteps) << r;
    EXPECT_EQ(calls[r], calls[0]) << r;
  }
}

// Quiet mode starts only from what the exchange says. Plans that beat the default: no span at
// all. A rank whose input fails at a probe (step 14; rank 2, a negative context) sends a record
// without its proposal: nobody goes quiet after it, every rank exchanges at step 15 too and the
// spans start again from the first length (exchanges 0-3, 7, 14, 15, 19, 26, 35, 44, 53). The
// failing rank counts one fallback; the ranks still skip the same steps.
TEST(Balancer, QuietModeStopsForAChangedPlanOrARankThatFailsItsInput) {
  constexpr int kRanks = 4, kSteps = 60;
  const auto changed = RunRanks(kRanks, kSteps, [](int, BalancerConfig& c) { c.quiet = {.after = 3}; }, Normal);
  for (const RankLog& l : changed) {
    EXPECT_EQ(l.stats.quiet_steps, 0);
    EXPECT_EQ(l.stats.balanced_steps, kSteps);
  }
  auto fails_at_14 = [](int r, int s, std::mt19937_64& rng) {
    auto b = Batch(rng, 8 + r % 5, 1000 * r + s % 3);
    if (r == 2 && (s == 14 || s == 5)) b[0].ctx_tokens = -5;  // step 5 is quiet: nothing reads it
    return b;
  };
  std::vector<int> calls;
  int unmatched = -1;
  const auto logs = RunQuietRanks(kSteps, fails_at_14, &calls, &unmatched);
  EXPECT_EQ(unmatched, 0);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(calls[r], 1 + 12) << "rank " << r;
    EXPECT_EQ(logs[r].stats.quiet_steps, 48) << r;
    EXPECT_EQ(logs[r].stats.fallbacks, r == 2 ? 1 : 0) << r;
    EXPECT_EQ(logs[r].failed[14], r == 2) << r;
    EXPECT_TRUE(logs[r].enabled);
  }
}

// A rank whose init failed (Balancer::Refuse) still joins the handshake: its peers disable at
// once, naming it and why, instead of waiting out their 20 s timeout.
TEST(Balancer, ARefusingRankDisablesItsPeersAtOnceNamingWhy) {
  constexpr int kRanks = 4;
  auto group = *InProcessGroup::Create(kRanks, sizeof(RankSummary));
  std::vector<std::string> reasons(kRanks);
  std::vector<double> waited_s(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      const auto start = std::chrono::steady_clock::now();
      if (r == 2) {
        EXPECT_TRUE(Balancer::Refuse(*group->Join(r), kRanks, 1, 1, absl::Seconds(20),
                                     "rank 2: flag 'k_max' in the config string: 'nine'").ok());
      } else {
        auto b = Balancer::Create(Config(kRanks), r, *group->Join(r));
        ASSERT_TRUE(b.ok()) << b.status();
        EXPECT_FALSE((*b)->enabled());
        reasons[r] = (*b)->Stats().disabled_reason;
      }
      waited_s[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  }
  for (auto& t : threads) t.join();
  for (int r : {0, 1, 3}) {
    EXPECT_NE(reasons[r].find("rank 2 failed its init: rank 2: flag 'k_max'"), std::string::npos)
        << "rank " << r << ": " << reasons[r];
    EXPECT_LT(waited_s[r], 5) << "rank " << r;  // the timeout is 20 s
  }
}

TEST(Balancer, MismatchedConfigsDisableEveryRankConsistently) {
  const auto logs = RunRanks(4, 3, [](int r, BalancerConfig& c) { if (r == 1) c.planner.k_max = 5; }, Normal);
  for (const RankLog& l : logs) {
    EXPECT_FALSE(l.enabled);
    EXPECT_NE(l.stats.disabled_reason.find("config hash"), std::string::npos) << l.stats.disabled_reason;
    for (bool b : l.balanced) EXPECT_FALSE(b);
  }
}

// The handshake compares the whole balancer config hash, so a difference that leaves every
// batch valid (another default length, A/B epochs or online calibration on one rank) still
// disables every rank before the first step, with the reason naming the hashes.
TEST(Balancer, HandshakeCatchesConfigsThatDifferOnlyWhereBatchesStayValid) {
  const std::function<void(BalancerConfig&)> tweaks[] = {
      [](BalancerConfig& c) { c.planner.default_k = 2; },
      [](BalancerConfig& c) { c.ab_epoch_steps = 4; },
      [](BalancerConfig& c) { c.online_calibration = !c.online_calibration; },
      [](BalancerConfig& c) { c.quiet.after = 4; },
  };
  for (size_t t = 0; t < std::size(tweaks); ++t) {
    const auto logs = RunRanks(4, 3, [&](int r, BalancerConfig& c) { if (r == 2) tweaks[t](c); }, Normal);
    for (size_t r = 0; r < logs.size(); ++r) {
      const RankLog& l = logs[r];
      EXPECT_FALSE(l.enabled) << "tweak " << t << " rank " << r;
      EXPECT_NE(l.stats.disabled_reason.find("handshake"), std::string::npos) << l.stats.disabled_reason;
      EXPECT_NE(l.stats.disabled_reason.find("config hash"), std::string::npos) << l.stats.disabled_reason;
      for (bool b : l.balanced) EXPECT_FALSE(b) << "tweak " << t << " rank " << r;
    }
  }
}

TEST(Balancer, ARankThatStopsCausesTimeoutsThenEveryoneDisablesNoHang) {
  // Rank 2 vanishes at step 2. The others' calls from step 2 on get a 50 ms timeout (which they
  // must reach: rank 2 never calls again); steps 0 and 1 keep the config's 20 s, so a slow
  // machine cannot time them out.
  auto short_from_step2 = [](int, int64_t call, absl::Duration timeout) {
    return call >= 3 ? absl::Milliseconds(50) : timeout;  // call 0 is the handshake
  };
  const auto logs = RunRanks(
      3, 6, nullptr, Normal, [](int r, int s) { return r == 2 && s >= 2; }, nullptr,
      [&](int, std::unique_ptr<AllGather> inner) -> std::unique_ptr<AllGather> {
        return std::make_unique<Hooked>(std::move(inner), short_from_step2);
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(logs[r].balanced[0]);
    EXPECT_FALSE(logs[r].balanced[2]);
    EXPECT_FALSE(logs[r].enabled);  // the broken group disabled them: later steps cost nothing
    EXPECT_EQ(logs[r].stats.fallbacks, 1);
  }
}

// Ranks whose measured attention is `factor` x what the V2 model predicts for their plan, with
// the model held fixed (no online refit: as a model that cannot express the kernel's shape).
double BarrierOverPlan(double factor, int steps = 30) {
  const auto v2_times = [factor](int, const std::vector<BalancerRequest>& batch,
                                 const std::vector<int32_t>& lens) {
    std::vector<RequestLoad> loads;
    for (size_t i = 0; i < batch.size(); ++i) loads.push_back({batch[i].ctx_tokens, 1 + lens[i]});
    return factor * CostModel::PublishedV2().AttentionUs(loads);
  };
  const auto logs = RunRanks(4, steps, [](int, BalancerConfig& c) { c.online_calibration = false; },
                             Normal, nullptr, v2_times);
  for (const RankLog& l : logs) EXPECT_DOUBLE_EQ(l.stats.barrier_over_plan, logs[0].stats.barrier_over_plan);
  return logs[0].stats.barrier_over_plan;
}

TEST(Balancer, BarrierOverPlanMeasuresHowFarTheSlowestRankRunsPastThePlan) {
  // Every rank's plan fits under the agreed barrier, and the slowest one about meets it.
  const double exact = BarrierOverPlan(1.0);
  EXPECT_LE(exact, 1.0 + 1e-6);
  EXPECT_GT(exact, 0.8);
  // A model that underestimates every rank by 1/1.3: the barrier runs ~30% over plan.
  EXPECT_NEAR(BarrierOverPlan(1.3) / exact, 1.3, 1e-6);
  // After 200 balanced steps that far over plan, each rank says once what to do about it.
  ::testing::internal::CaptureStderr();
  BarrierOverPlan(1.3, 230);
  const std::string err = ::testing::internal::GetCapturedStderr();
  size_t said = 0;
  for (size_t at = err.find("over the planned one"); at != std::string::npos;
       at = err.find("over the planned one", at + 1)) {
    ++said;
  }
  EXPECT_EQ(said, 4u) << err;
  EXPECT_NE(err.find("DPB_COST_MODEL=v2+fa2-packed-h200"), std::string::npos) << err;
  ::testing::internal::CaptureStderr();
  BarrierOverPlan(1.0, 230);
  EXPECT_EQ(::testing::internal::GetCapturedStderr().find("over the planned one"), std::string::npos);
}

TEST(Balancer, ABEpochsAlternateByStepAndMeasureBothArms) {
  const auto logs = RunRanks(2, 40, [](int, BalancerConfig& c) { c.ab_epoch_steps = 5; }, Normal);
  for (int s = 0; s < 40; ++s) EXPECT_EQ(logs[0].balanced[s], (s / 5) % 2 == 0) << s;
  EXPECT_GE(logs[0].stats.arm_on.epochs, 3);
  EXPECT_GE(logs[0].stats.arm_off.epochs, 3);
  // Reported attention 20000 vs 20100 us: bubble 1 - 20050/20100.
  EXPECT_NEAR(logs[0].stats.bubble_fraction, 1 - 20050.0 / 20100.0, 1e-6);
  EXPECT_GT(logs[0].stats.goodput_tok_per_s, 0);
  EXPECT_GT(logs[0].stats.predicted_error, 0);
}

TEST(Balancer, BadArgumentsAtCreateAreErrors) {
  {
    auto group = *InProcessGroup::Create(1, sizeof(RankSummary));
    BalancerConfig c = Config(1);
    c.tpot_slo_us = -1;
    const auto b = Balancer::Create(c, 0, *group->Join(0));
    ASSERT_FALSE(b.ok());
    EXPECT_NE(b.status().message().find("tpot_slo_us -1"), std::string::npos) << b.status();
  }
  auto group = *InProcessGroup::Create(2, sizeof(RankSummary));
  EXPECT_FALSE(Balancer::Create(Config(3), 0, *group->Join(0)).ok());  // 3 ranks vs 2
  EXPECT_FALSE(Balancer::Create(Config(2), 0, nullptr).ok());
  BalancerConfig c = Config(2);
  c.max_consecutive_failures = 0;
  EXPECT_FALSE(Balancer::Create(c, 1, *group->Join(1)).ok());
}

TEST(Balancer, WritesJsonLinesMetricsEveryLogPeriod) {
  const std::string path = ::testing::TempDir() + "/dpb_metrics.jsonl";
  std::remove(path.c_str());
  auto group = *InProcessGroup::Create(1, sizeof(RankSummary));
  BalancerConfig c = Config(1);
  c.log_every_steps = 5;
  c.metrics_file = path;
  auto b = *Balancer::Create(c, 0, *group->Join(0));
  std::mt19937_64 rng(2);
  for (int s = 0; s < 12; ++s) {
    auto batch = Batch(rng, 6, 0);
    std::vector<int32_t> v(batch.size());
    b->Plan(batch, -1, absl::MakeSpan(v));
    std::vector<BalancerAccepted> acc;
    for (size_t i = 0; i < batch.size(); ++i) acc.push_back({batch[i].request_id, v[i], 0, false});
    ASSERT_TRUE(b->Report(30000, 60000, acc).ok());
  }
  std::ifstream in(path);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    EXPECT_NE(line.find("\"bubble_fraction\""), std::string::npos) << line;
    EXPECT_NE(line.find("\"goodput_tok_per_s\""), std::string::npos);
    EXPECT_NE(line.find("\"barrier_over_plan\""), std::string::npos);
    EXPECT_NE(line.find("\"ab\""), std::string::npos);
  }
  EXPECT_EQ(lines, 2);  // steps 5 and 10
}

}  // namespace

// An engine one step behind plans step t+1 before it reports step t (Report(step, ...)). Each
// report must be priced against its own plan: measured times here are exactly the model's
// prediction for the reported plan's lengths, so a correctly paired report has no model error,
// and a report paired with the other outstanding plan (a different batch) would.
TEST(BalancerReports, OneStepLateReportsArePairedWithTheirOwnPlans) {
  auto group = *InProcessGroup::Create(1, sizeof(RankSummary));
  BalancerConfig c = Config(1);
  c.online_calibration = false;  // the model stays the one the test prices with
  auto b = *Balancer::Create(c, 0, *group->Join(0));
  const CostModel model = c.model;
  std::mt19937_64 rng(5);
  struct Pending {
    uint64_t step;
    double us;
  };
  std::vector<Pending> pending;
  for (int step = 0; step < 30; ++step) {
    const std::vector<BalancerRequest> batch = Batch(rng, 2 + step % 5 * 6, 1000 * step);
    std::vector<int32_t> v(batch.size());
    const PlanOutcome o = b->Plan(batch, -1, absl::MakeSpan(v));
    ASSERT_TRUE(o.balanced);
    std::vector<RequestLoad> loads;
    for (size_t i = 0; i < batch.size(); ++i) loads.push_back({batch[i].ctx_tokens, 1 + v[i]});
    pending.push_back({o.step, model.AttentionUs(model.Aggregate(loads))});
    if (pending.size() == 2) {  // report the older one, after planning the newer
      EXPECT_TRUE(b->Report(pending[0].step, pending[0].us, pending[0].us + 1000, {}).ok());
      pending.erase(pending.begin());
    }
  }
  const BalancerStats s = b->Stats();
  EXPECT_LT(s.predicted_error, 1e-5);
  // A report for a plan that is gone (reported, or older than the last two) is priced against
  // nothing: the error stays as it was.
  EXPECT_TRUE(b->Report(0, 1, 2, {}).ok());
  EXPECT_LT(b->Stats().predicted_error, 1e-5);
}

// An engine one step behind plans step t+1 while step t runs: the request it passes is as last
// seen. Request 100 may emit 3 more tokens and accepts each draft with probability 0.5 (the
// others always). Once step t is planned, what step t+1 can still get from it is less: the
// pending step emits at least one of its 3 tokens, and a draft pays only if that step neither
// rejected it nor finished the request. So while step t is unreported its plan at t+1 must be
// shorter than the same engine gets when it plans on the state as seen (kPredictNone), which
// repeats step t's; once the report is in, both plan the same. A warm-up step (other ids,
// reported) first, so that the planner's state from a previous decision is the same at t and
// t+1.
std::vector<int32_t> LaggedPlans(uint32_t lag_predict) {
  auto group = *InProcessGroup::Create(1, sizeof(RankSummary));
  BalancerConfig c = Config(1);
  c.online_calibration = false;
  c.lag_predict = lag_predict;
  auto b = *Balancer::Create(c, 0, *group->Join(0));
  const std::vector<float> sure(7, 1.0f), half(7, 0.5f);
  auto batch_of = [&](int64_t id0) {
    std::vector<BalancerRequest> batch(4);
    for (int i = 0; i < 4; ++i) {
      batch[i] = BalancerRequest{id0 + i, 3000, 0, i == 0 ? 2 : 7, absl::MakeConstSpan(i == 0 ? half : sure)};
    }
    return batch;
  };
  std::vector<int32_t> v(4);
  const PlanOutcome warm = b->Plan(batch_of(200), -1, absl::MakeSpan(v));
  EXPECT_TRUE(b->Report(warm.step, 20000, 40000, {}).ok());
  std::vector<BalancerRequest> batch = batch_of(100);
  std::vector<int32_t> first;  // request 100's length at steps t, t+1 (t unreported), t+2
  const PlanOutcome t = b->Plan(batch, -1, absl::MakeSpan(v));
  first.push_back(v[0]);
  const std::vector<BalancerAccepted> acc = {{100, v[0], 0, false}};
  b->Plan(batch, -1, absl::MakeSpan(v));  // t+1, planned before t is reported
  first.push_back(v[0]);
  // Both reported; the engine has seen step t (no draft accepted: it may emit 2 more) and
  // passes what step t+1 left as its state, as an engine would after t+1's results.
  EXPECT_TRUE(b->Report(t.step, 20000, 40000, acc).ok());
  EXPECT_TRUE(b->Report(t.step + 1, 20000, 40000, {}).ok());
  batch[0].k_cap = 1;
  b->Plan(batch, -1, absl::MakeSpan(v));  // t+2: nothing pending
  first.push_back(v[0]);
  return first;
}

TEST(BalancerReports, OneStepBehindPlansOnWhatThePendingStepLeaves) {
  const std::vector<int32_t> predicted = LaggedPlans(kPredictAll);
  const std::vector<int32_t> as_seen = LaggedPlans(kPredictNone);
  ASSERT_GE(as_seen[0], 1);                // its first draft pays as seen
  EXPECT_EQ(predicted[0], as_seen[0]);     // nothing pending: the state passed is the state
  EXPECT_EQ(as_seen[1], as_seen[0]);       // as seen, t+1 repeats t's plan
  EXPECT_LT(predicted[1], as_seen[1]);     // predicted, less is left to verify
  EXPECT_LE(predicted[1], 1);              // and never past the cap the pending step leaves
  EXPECT_EQ(predicted[2], as_seen[2]);     // all reported: the same plan either way
}

// A step that also ran prefill (extend) was measured over work its plan never priced: 100x the
// prediction there must neither refit the model nor count as model error. The same report on a
// decode step does both, so the test can fail.
TEST(BalancerReports, ExtendStepsNeitherRefitNorCountAsModelError) {
  auto group = *InProcessGroup::Create(1, sizeof(RankSummary));
  BalancerConfig c = Config(1);
  c.online_calibration = true;
  auto b = *Balancer::Create(c, 0, *group->Join(0));
  std::mt19937_64 rng(9);
  auto run = [&](bool extend) {
    const std::vector<BalancerRequest> batch = Batch(rng, 8, 4000);
    std::vector<int32_t> v(batch.size());
    StepInput in;
    in.batch = batch;
    if (extend) {
      in.kind = kSummaryExtend;
      in.extra_tokens = 2048;
    }
    const PlanOutcome o = b->Plan(in, absl::MakeSpan(v), nullptr);
    EXPECT_TRUE(o.balanced);
    std::vector<RequestLoad> loads;
    for (size_t i = 0; i < batch.size(); ++i) loads.push_back({batch[i].ctx_tokens, 1 + v[i]});
    const double predicted = b->model().AttentionUs(b->model().Aggregate(loads));
    EXPECT_TRUE(b->Report(o.step, 100 * predicted, 100 * predicted + 1000, {}).ok());
  };
  const CostModel::Weights before = b->model().weights_us();
  for (int step = 0; step < 20; ++step) run(/*extend=*/true);
  EXPECT_EQ(b->Stats().predicted_error, 0);
  EXPECT_EQ(b->model().weights_us(), before);
  // Decode steps refit (the cold start moves the level off the starting model at its third
  // observation: OnlineCostModel).
  for (int step = 0; step < 3; ++step) run(/*extend=*/false);
  EXPECT_GT(b->Stats().predicted_error, 0.9);  // |p - 100 p| / 100 p
  EXPECT_NE(b->model().weights_us(), before);
}

// The step terms learnt online (step_terms.h), through the balancer on a fake engine clock:
// every step's cycle is the slowest rank's attention plus 6 ms plus 35 us per instance token
// (no draft cost), far from the flags' H200 prior (20 ms + 2 us/token). Every rank learns the
// same terms from the exchange, bit for bit; when one record's digest is corrupted in flight
// (every rank sees it), all reset together and learn again.
thread_local absl::Time fake_engine_now;
absl::Time FakeEngineNow() { return fake_engine_now; }

class DigestFlip : public Forwarding {
 public:
  DigestFlip(std::unique_ptr<AllGather> inner, int64_t at) : Forwarding(std::move(inner)), at_(at) {}
  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv, absl::Duration timeout) override {
    absl::Status s = inner_->Gather(send, recv, timeout);
    if (s.ok() && calls_++ == at_) reinterpret_cast<RankSummary*>(recv.data())[1].step_terms_digest ^= 0x10;
    return s;
  }

 private:
  int64_t at_, calls_ = 0;
};

// An engine whose per-step sync runs after its scheduler planned (vLLM: the record rides
// `coordinate_batch_across_dp` in the forward): each plan call gets back the records gathered in
// the previous step's sync, its own among them. The handshake is not lagged.
class Lagged : public Forwarding {
 public:
  explicit Lagged(std::unique_ptr<AllGather> inner) : Forwarding(std::move(inner)) {}
  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv, absl::Duration timeout) override {
    absl::Status s = inner_->Gather(send, recv, timeout);
    if (!s.ok() || calls_++ == 0) return s;  // the handshake
    std::vector<uint8_t> now(recv.begin(), recv.end());
    if (previous_.empty()) previous_.assign(recv.size(), 0);  // nothing gathered yet: zero records
    std::copy(previous_.begin(), previous_.end(), recv.begin());
    previous_ = std::move(now);
    return s;
  }

 private:
  int64_t calls_ = 0;
  std::vector<uint8_t> previous_;
};

void LearnStepTermsOnAFakeEngine(bool lagged) {
  constexpr int kRanks = 3, kSteps = 500;
  constexpr double kFixedUs = 6000, kPerTokenUs = 35;
  auto group = *InProcessGroup::Create(kRanks, sizeof(RankSummary));
  std::vector<BalancerStats> stats(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      BalancerConfig c = Config(kRanks);
      c.clock = FakeEngineNow;
      c.planner.global.draft_per_step_us = 0;  // a drafter that runs no model (ngram)
      fake_engine_now = absl::UnixEpoch();
      std::unique_ptr<AllGather> comm = *group->Join(r);
      if (lagged) comm = std::make_unique<Lagged>(std::move(comm));
      auto b = *Balancer::Create(c, r, std::make_unique<DigestFlip>(std::move(comm), 250));
      std::mt19937_64 rng(r);
      for (int s = 0; s < kSteps; ++s) {
        std::vector<BalancerRequest> batch = Batch(rng, 3 + (5 * s + 3 * r) % 11, 1000 * r + s % 3);
        std::vector<int32_t> v(batch.size(), -1);
        StepTotals totals;
        b->Plan(StepInput{batch, -1, 0, 0}, absl::MakeSpan(v), &totals);
        if (lagged && s == 0) continue;  // nothing gathered yet: every rank falls back
        ASSERT_TRUE(totals.known);
        int64_t tokens = 0;
        for (int64_t t : totals.rank_tokens) tokens += t;
        const double attention = 9000 + 500 * ((r + s) % kRanks);  // the slowest: 10 ms every step
        std::vector<BalancerAccepted> acc;
        for (size_t i = 0; i < batch.size(); ++i) acc.push_back({batch[i].request_id, v[i], v[i] / 2, false});
        ASSERT_TRUE(b->Report(attention, attention, acc).ok());
        fake_engine_now += absl::Microseconds(10000 + kFixedUs + kPerTokenUs * static_cast<double>(tokens));
      }
      stats[r] = b->Stats();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    const GlobalCost& g = stats[r].step_terms;
    SCOPED_TRACE(r);
    EXPECT_TRUE(stats[r].step_terms_online);
    EXPECT_EQ(stats[r].step_terms_resets, 1);  // the corrupted digest, seen by every rank
    EXPECT_GT(stats[r].step_terms_rows, 200);
    EXPECT_GT(stats[r].step_terms_fits, 10);
    EXPECT_TRUE(stats[r].step_terms_per_token_learnt);
    // The plan calls take no time on the fake clock: no overhead, the whole constant is fixed.
    EXPECT_EQ(g.step_overhead_us, 0);
    EXPECT_NEAR(g.ffn_fixed_us, kFixedUs, 0.03 * kFixedUs);
    EXPECT_NEAR(g.ffn_per_token_us, kPerTokenUs, 0.03 * kPerTokenUs);
    EXPECT_NEAR(g.draft_per_step_us, 0, 30);  // learnt where the agreed depth varied: none
    EXPECT_EQ(std::memcmp(&g, &stats[0].step_terms, sizeof(GlobalCost)), 0) << "ranks priced differently";
  }
}

TEST(Balancer, LearnsTheStepTermsFromTheEngineCycleOnEveryRankAlike) { LearnStepTermsOnAFakeEngine(false); }

// The same one step late: each rank's measurement is paired with the gathered records that
// carried it (Balancer::ArrivedMeasured), not with the rank's latest report, so the rows and the
// fit are as exact as without the lag.
TEST(Balancer, LearnsTheStepTermsWhenTheExchangeArrivesOneStepLate) { LearnStepTermsOnAFakeEngine(true); }

}  // namespace dpbalance
