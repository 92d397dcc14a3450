// Fuzzes the summary-record decoder: arbitrary bytes as the gathered RankSummary records that
// Planner::Decide reads off the wire (runtime/include/dpbalance/summary.h, planner.h), then
// Assign with the decision. Decide must return a status or a decision, never crash, for any
// bytes; with a decision, Assign must keep every verify length within its request's floor and cap
// (mode off: exactly the engine's default length).
//
// Input (FuzzedDataProvider): the planner config (ranks, mode, depths, tiers, slack), this
// rank's batch (Summarize gives the genuine record), then per rank one of: raw bytes; raw bytes
// with a valid header (magic, version, config hash, rank); this rank's record with a few bytes
// overwritten; this rank's record. The last two reach the sweep, the first two the checks.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dpbalance/planner.h"
#include "dpbalance/summary.h"

namespace {
using namespace dpbalance;

PlannerConfig ConsumeConfig(FuzzedDataProvider& in) {
  PlannerConfig c;
  c.num_ranks = in.ConsumeIntegralInRange(1, 8);
  constexpr PlanMode kModes[] = {PlanMode::kGoodput, PlanMode::kFill, PlanMode::kLocal, PlanMode::kOff};
  c.mode = kModes[in.ConsumeIntegralInRange(0, 3)];
  c.k_max = in.ConsumeIntegralInRange(0, kMaxDraftLen);
  c.default_k = in.ConsumeIntegralInRange(0, c.k_max);
  c.agreed_draft_depth = in.ConsumeBool();
  c.uniform_per_rank = in.ConsumeBool();
  constexpr double kSlacks[] = {-1, 0, 0.03, 0.5};
  c.max_step_slack = kSlacks[in.ConsumeIntegralInRange(0, 3)];
  if (in.ConsumeBool()) c.token_tiers = {8, 32, 128, 512};
  c.global.padded_tokens = in.ConsumeBool();
  if (in.ConsumeBool()) c.global.draft_per_step_us = 0;
  return c;
}

std::vector<PlanRequest> ConsumeBatch(FuzzedDataProvider& in, const PlannerConfig& c) {
  std::vector<PlanRequest> batch(in.ConsumeIntegralInRange(0, 12));
  for (PlanRequest& r : batch) {
    r.ctx_tokens = in.ConsumeIntegralInRange<int64_t>(0, 1 << 20);
    r.k_cap = in.ConsumeIntegralInRange(0, c.k_max);
    r.k_min = in.ConsumeIntegralInRange(0, r.k_cap);
    std::vector<double> rates(in.ConsumeIntegralInRange(0, kMaxDraftLen));
    for (double& a : rates) a = in.ConsumeProbability<double>();
    if (absl::StatusOr<AcceptanceCurve> a = AcceptanceCurve::FromConditional(rates); a.ok()) {
      r.acceptance = *a;
    }
  }
  return batch;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const PlannerConfig config = ConsumeConfig(in);
  absl::StatusOr<Planner> planner =
      Planner::Create(config, in.ConsumeBool() ? CostModel::PublishedV2() : CostModel::PublishedV1());
  if (!planner.ok()) return 0;
  const int rank_idx = in.ConsumeIntegralInRange(0, config.num_ranks - 1);
  const std::vector<PlanRequest> batch = ConsumeBatch(in, config);
  const int64_t kv_free_tokens = in.ConsumeBool() ? -1 : in.ConsumeIntegralInRange<int64_t>(0, 256);
  RankSummary own;
  if (!planner->Summarize(rank_idx, batch, kv_free_tokens, &own).ok()) return 0;

  // Local mode reads each record's own rank index, and takes any number of records.
  const size_t num_records = config.mode == PlanMode::kLocal
                                 ? in.ConsumeIntegralInRange<size_t>(1, 8)
                                 : static_cast<size_t>(config.num_ranks);
  std::vector<RankSummary> gathered(num_records);
  for (size_t r = 0; r < num_records; ++r) {
    RankSummary& s = gathered[r];
    const int kind = in.ConsumeIntegralInRange(0, 3);
    if (kind <= 1) {
      std::memset(&s, 0, sizeof(s));
      const std::vector<uint8_t> raw = in.ConsumeBytes<uint8_t>(sizeof(s));
      if (!raw.empty()) std::memcpy(&s, raw.data(), raw.size());
      if (kind == 1) {
        s.magic = kSummaryMagic;
        s.version = kSummaryVersion;
        s.config_hash = planner->config_hash();
        s.rank_idx = static_cast<uint16_t>(r);
      }
    } else {
      s = own;
      s.rank_idx = static_cast<uint16_t>(r);
      if (kind == 2) {
        auto* bytes = reinterpret_cast<uint8_t*>(&s);
        for (int edits = in.ConsumeIntegralInRange(1, 8); edits > 0; --edits) {
          bytes[in.ConsumeIntegralInRange<size_t>(0, sizeof(s) - 1)] = in.ConsumeIntegral<uint8_t>();
        }
      }
    }
  }

  absl::StatusOr<GlobalDecision> d = planner->Decide(gathered);
  if (!d.ok()) return 0;
  std::vector<int32_t> verify_len(batch.size(), -1);
  if (!planner->Assign(*d, absl::MakeSpan(verify_len)).ok()) return 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    // Mode off is the engine's default length, floors not applied (planner.h); else every
    // length lies within its request's floor and cap.
    const bool off = config.mode == PlanMode::kOff;
    const int32_t lo = off ? DefaultVerifyLen(config.default_k, batch[i].k_cap) : batch[i].k_min;
    const int32_t hi = off ? lo : batch[i].k_cap;
    if (verify_len[i] < lo || verify_len[i] > hi) {
      std::fprintf(stderr, "Assign (mode %s): request %zu verify_len %d outside [%d, %d]\n",
                   std::string(PlanModeName(config.mode)).c_str(), i, verify_len[i], lo, hi);
      std::abort();
    }
  }
  return 0;
}
