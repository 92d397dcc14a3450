#include "dpbalance/dspark.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace dpbalance::dspark {

std::vector<int32_t> ProfilerBatchSizes(int max_batch) {
  // build_request_count_sweep(max_batch_size=256) in dspark_sps_profiler.py (0cdfa2f8).
  constexpr int32_t kSweep[] = {1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64,
                                80, 96, 112, 128, 160, 192, 224, 256};
  std::vector<int32_t> sizes;
  for (int32_t bs : kSweep) {
    if (bs < max_batch) sizes.push_back(bs);
  }
  if (max_batch >= 1) sizes.push_back(max_batch);  // the sweep's maximum is always profiled
  return sizes;
}

absl::StatusOr<SpsTable> SpsTable::Create(std::vector<int64_t> tokens, std::vector<double> steps_per_s) {
  if (tokens.empty() || tokens.size() != steps_per_s.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "dspark sps table: %d token probes and %d rates (need the same number, >= 1)",
        tokens.size(), steps_per_s.size()));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] <= 0 || (i > 0 && tokens[i] <= tokens[i - 1])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "dspark sps table: probe %d has %d tokens (probes must be positive and ascend)", i, tokens[i]));
    }
    if (!(std::isfinite(steps_per_s[i]) && steps_per_s[i] > 0)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "dspark sps table: probe %d (%d tokens) has %g steps/s (must be finite and > 0)", i,
          tokens[i], steps_per_s[i]));
    }
  }
  return SpsTable(std::move(tokens), std::move(steps_per_s));
}

double SpsTable::StepsPerSecond(int64_t tokens) const {
  // bisect_right - 1, clamped to the table: the largest probe <= tokens.
  const auto it = std::upper_bound(tokens_.begin(), tokens_.end(), tokens);
  const size_t idx = it == tokens_.begin() ? 0 : static_cast<size_t>(it - tokens_.begin()) - 1;
  return steps_per_s_[idx];
}

absl::StatusOr<SpsTable> ProfileSps(const CostModel& attention, const GlobalCost& global,
                                    int num_ranks, int max_batch, int k_max, bool per_rank_draft) {
  const int window = k_max + 1;
  std::vector<int64_t> tokens;
  std::vector<double> rates;
  std::vector<RequestLoad> loads;
  for (int32_t bs : ProfilerBatchSizes(max_batch)) {
    loads.assign(bs, RequestLoad{kProfileContextTokens, window});
    const double attn = attention.AttentionUs(attention.Aggregate(loads));
    const double own_draft = per_rank_draft ? global.draft_per_step_us * k_max : 0.0;
    const double step_us = attn + own_draft +
                           global.StepUs(static_cast<double>(num_ranks) * bs * window,
                                         per_rank_draft ? 0 : k_max);
    tokens.push_back(int64_t{bs} * window);
    rates.push_back(1e6 / step_us);
  }
  return SpsTable::Create(std::move(tokens), std::move(rates));
}

void OrderCandidates(absl::Span<const int32_t> caps,
                     absl::FunctionRef<double(int32_t req, int32_t pos)> survival,
                     std::vector<Candidate>& out) {
  out.clear();
  for (int32_t i = 0; i < static_cast<int32_t>(caps.size()); ++i) {
    for (int32_t j = 1; j <= caps[i]; ++j) {
      const double s = survival(i, j);
      if (!(s >= kSurvivalEps)) break;  // survival never rises along a request
      out.push_back({s, i, j});
    }
  }
  std::sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    if (a.survival != b.survival) return a.survival > b.survival;
    if (a.pos != b.pos) return a.pos < b.pos;
    return a.req < b.req;
  });
}

int64_t VerifyTokenBudget(int64_t num_requests, absl::Span<const Candidate> candidates,
                          absl::FunctionRef<double(int64_t b, const Candidate* added)> steps_per_s) {
  double expected = static_cast<double>(num_requests);  // tau*(0): every request's bonus token
  double best = expected * steps_per_s(0, nullptr);
  int64_t best_b = 0;
  for (size_t b = 0; b < candidates.size(); ++b) {
    expected += candidates[b].survival;
    const double theta = expected * steps_per_s(static_cast<int64_t>(b) + 1, &candidates[b]);
    if (theta > best) {  // torch.argmax: the first maximum
      best = theta;
      best_b = static_cast<int64_t>(b) + 1;
    }
  }
  return best_b;
}

int64_t SpsBudget(int64_t num_requests, absl::Span<const Candidate> candidates, const SpsTable& sps) {
  return VerifyTokenBudget(num_requests, candidates, [&](int64_t b, const Candidate*) {
    return sps.StepsPerSecond(num_requests + b);
  });
}

int64_t LocalTier(int64_t num_requests, int64_t budget, int window) {
  return std::min(num_requests + budget, num_requests * window);
}

int64_t AgreedTier(absl::Span<const int32_t> tiers, int64_t max_local_tier, int64_t max_requests,
                   int window) {
  const int64_t floor = std::min(max_local_tier, max_requests * window);
  for (int32_t t : tiers) {
    if (t >= floor) return t;  // round_up_grid: bisect_left
  }
  return floor;
}

int64_t FillBudget(int64_t tier, int64_t num_requests, int window) {
  return std::max<int64_t>(0, std::min(tier, num_requests * window) - num_requests);
}

void AssignTopK(absl::Span<const Candidate> candidates, int64_t budget, absl::Span<int32_t> verify_len) {
  std::fill(verify_len.begin(), verify_len.end(), 0);
  const size_t take = static_cast<size_t>(std::clamp<int64_t>(budget, 0, static_cast<int64_t>(candidates.size())));
  for (size_t c = 0; c < take; ++c) {
    int32_t& len = verify_len[candidates[c].req];
    len = std::max(len, candidates[c].pos);
  }
}

int64_t Padding::run_tokens() const {
  int64_t total = last_row_tokens;
  for (int32_t t : pad_tokens) total += t;
  return total;
}

Padding PadToTier(int64_t tier, int64_t num_requests, int64_t real_tokens, int64_t max_slots, int window) {
  Padding p;
  const int64_t leftover = tier - real_tokens;
  if (leftover <= 0) return p;
  const int64_t free_slots = std::min(tier, max_slots) - num_requests;
  if (free_slots <= 0) {
    if (num_requests > 0) {
      p.last_row_tokens = leftover;
      return p;
    }
  }
  const int64_t slots = std::max<int64_t>(free_slots, 1);
  const int64_t each = leftover / slots, rem = leftover % slots;
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t want = each + (s < rem ? 1 : 0);
    const int64_t run = std::min<int64_t>(want, window);
    if (run > 0) p.pad_tokens.push_back(static_cast<int32_t>(run));
  }
  return p;
}

}  // namespace dpbalance::dspark
