#include "dpbalance/dspark.h"

#include <algorithm>
#include <cmath>

#include <Eigen/Dense>

#include "absl/strings/str_format.h"
#include "dpbalance/median.h"

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

namespace {

// One profiler step on a cost model: every one of `num_ranks` ranks runs `loads`, `tokens` query
// tokens each, the draft at its full depth.
double ProfiledStepUs(const CostModel& attention, const GlobalCost& global, int num_ranks,
                      int k_max, bool per_rank_draft, const std::vector<RequestLoad>& loads,
                      int64_t tokens) {
  const double attn = attention.AttentionUs(attention.Aggregate(loads));
  const double own_draft = per_rank_draft ? global.draft_per_step_us * k_max : 0.0;
  return attn + own_draft +
         global.StepUs(static_cast<double>(num_ranks) * static_cast<double>(tokens),
                       per_rank_draft ? 0 : k_max);
}

// _interp_clamped: linear between probes, the end values outside them.
double InterpClamped(absl::Span<const int64_t> xs, absl::Span<const double> ys, int64_t x) {
  if (x <= xs.front()) return ys.front();
  if (x >= xs.back()) return ys.back();
  const size_t hi = static_cast<size_t>(std::upper_bound(xs.begin(), xs.end(), x) - xs.begin());
  const size_t lo = hi - 1;
  return ys[lo] + static_cast<double>(x - xs[lo]) / static_cast<double>(xs[hi] - xs[lo]) * (ys[hi] - ys[lo]);
}

absl::Status CheckProbes(const char* name, absl::Span<const int64_t> probes, absl::Span<const double> values) {
  if (probes.empty() || probes.size() != values.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "dspark additive table: %d %s probes and %d values (need the same number, >= 1)",
        probes.size(), name, values.size()));
  }
  for (size_t i = 0; i < probes.size(); ++i) {
    if (i > 0 && probes[i] <= probes[i - 1]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "dspark additive table: %s probe %d is %d, not above the one before it", name, i, probes[i]));
    }
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "dspark additive table: %s value %d is %g (must be finite)", name, i, values[i]));
    }
  }
  return absl::OkStatus();
}

// Python's round() of m / 64, times 64: halves to even.
int64_t MBin(int64_t m) {
  constexpr int64_t kWidth = 64;
  const int64_t q = m / kWidth, r = m % kWidth;
  int64_t bin = q;
  if (2 * r > kWidth || (2 * r == kWidth && q % 2 == 1)) bin = q + 1;
  return bin * kWidth;
}

}  // namespace

absl::StatusOr<SpsTable> ProfileSps(const CostModel& attention, const GlobalCost& global,
                                    int num_ranks, int max_batch, int k_max, bool per_rank_draft) {
  return ProfileSpsAt(attention, global, num_ranks, max_batch, k_max, per_rank_draft,
                      kProfileContextTokens);
}

absl::StatusOr<SpsTable> ProfileSpsAt(const CostModel& attention, const GlobalCost& global,
                                      int num_ranks, int max_batch, int k_max, bool per_rank_draft,
                                      int64_t context_tokens) {
  const int window = k_max + 1;
  std::vector<int64_t> tokens;
  std::vector<double> rates;
  std::vector<RequestLoad> loads;
  for (int32_t bs : ProfilerBatchSizes(max_batch)) {
    loads.assign(bs, RequestLoad{context_tokens, window});
    tokens.push_back(int64_t{bs} * window);
    rates.push_back(1e6 / ProfiledStepUs(attention, global, num_ranks, k_max, per_rank_draft, loads,
                                         tokens.back()));
  }
  return SpsTable::Create(std::move(tokens), std::move(rates));
}

absl::StatusOr<AdditiveSpsTable> AdditiveSpsTable::Create(double bias_s, std::vector<int64_t> bs_probes,
                                                          std::vector<double> alpha_s,
                                                          std::vector<int64_t> m_probes,
                                                          std::vector<double> theta_s) {
  if (!(std::isfinite(bias_s) && bias_s > 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("dspark additive table: bias_seconds = %g (must be finite and > 0)", bias_s));
  }
  if (absl::Status s = CheckProbes("bs", bs_probes, alpha_s); !s.ok()) return s;
  if (absl::Status s = CheckProbes("m", m_probes, theta_s); !s.ok()) return s;
  AdditiveSpsTable t;
  t.bias_s_ = bias_s;
  t.bs_probes_ = std::move(bs_probes);
  t.alpha_s_ = std::move(alpha_s);
  t.m_probes_ = std::move(m_probes);
  t.theta_s_ = std::move(theta_s);
  return t;
}

double AdditiveSpsTable::StepSeconds(int64_t num_requests, int64_t budget) const {
  return bias_s_ + InterpClamped(bs_probes_, alpha_s_, num_requests) +
         InterpClamped(m_probes_, theta_s_, num_requests + budget);
}

absl::StatusOr<AdditiveSpsTable> FitAdditive(absl::Span<const SpsCell> cells) {
  if (cells.size() < 4) {
    return absl::InvalidArgumentError(
        absl::StrFormat("dspark additive fit: %d cells (needs >= 4)", cells.size()));
  }
  std::vector<int64_t> bs_levels, m_levels;
  for (const SpsCell& c : cells) {
    if (!(std::isfinite(c.step_s) && c.step_s > 0) || c.bs <= 0 || c.m < c.bs) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "dspark additive fit: cell bs %d, M %d, %g s (needs bs > 0, M >= bs, a positive time)",
          c.bs, c.m, c.step_s));
    }
    bs_levels.push_back(c.bs);
    m_levels.push_back(MBin(c.m));
  }
  for (std::vector<int64_t>* v : {&bs_levels, &m_levels}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  const size_t cols = 1 + (bs_levels.size() - 1) + (m_levels.size() - 1);
  Eigen::MatrixXd x = Eigen::MatrixXd::Zero(static_cast<Eigen::Index>(cells.size()),
                                            static_cast<Eigen::Index>(cols));
  Eigen::VectorXd y(static_cast<Eigen::Index>(cells.size()));
  for (size_t i = 0; i < cells.size(); ++i) {
    const auto row = static_cast<Eigen::Index>(i);
    x(row, 0) = 1;
    const size_t b = static_cast<size_t>(
        std::lower_bound(bs_levels.begin(), bs_levels.end(), cells[i].bs) - bs_levels.begin());
    const size_t m = static_cast<size_t>(
        std::lower_bound(m_levels.begin(), m_levels.end(), MBin(cells[i].m)) - m_levels.begin());
    if (b > 0) x(row, static_cast<Eigen::Index>(b)) = 1;
    if (m > 0) x(row, static_cast<Eigen::Index>(bs_levels.size() - 1 + m)) = 1;
    y(row) = cells[i].step_s;
  }
  const Eigen::VectorXd beta = x.completeOrthogonalDecomposition().solve(y);
  std::vector<double> alpha(bs_levels.size(), 0.0), theta(m_levels.size(), 0.0);
  for (size_t b = 1; b < bs_levels.size(); ++b) alpha[b] = beta(static_cast<Eigen::Index>(b));
  for (size_t m = 1; m < m_levels.size(); ++m) {
    theta[m] = beta(static_cast<Eigen::Index>(bs_levels.size() - 1 + m));
  }
  return AdditiveSpsTable::Create(beta(0), std::move(bs_levels), std::move(alpha),
                                  std::move(m_levels), std::move(theta));
}

absl::StatusOr<AdditiveSpsTable> ProfileAdditiveSps(const CostModel& attention, const GlobalCost& global,
                                                    int num_ranks, int max_batch, int k_max,
                                                    bool per_rank_draft, int64_t context_tokens,
                                                    absl::Span<const double> fracs) {
  std::vector<SpsCell> cells;
  std::vector<RequestLoad> loads;
  for (int32_t bs : ProfilerBatchSizes(max_batch)) {
    for (double frac : fracs) {
      if (!(frac > 0 && frac <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("dspark additive profile: frac %g outside (0, 1]", frac));
      }
      const int64_t extra = static_cast<int64_t>(frac * bs * k_max);
      loads.assign(bs, RequestLoad{context_tokens, 1});
      for (int64_t e = 0; e < extra; ++e) loads[static_cast<size_t>(e % bs)].query_tokens += 1;
      const double step_us = ProfiledStepUs(attention, global, num_ranks, k_max, per_rank_draft,
                                            loads, bs + extra);
      cells.push_back({bs, bs + extra, step_us * 1e-6});
    }
  }
  return FitAdditive(cells);
}

int64_t AdditiveBudget(int64_t num_requests, absl::Span<const Candidate> candidates,
                       const AdditiveSpsTable& table) {
  return VerifyTokenBudget(num_requests, candidates, [&](int64_t b, const Candidate*) {
    return 1.0 / table.StepSeconds(num_requests, b);
  });
}

OnlineSps::OnlineSps(SpsTable initial, OnlineSpsOptions options)
    : initial_(std::move(initial)),
      options_(options),
      samples_(initial_.tokens().size()),
      next_(initial_.tokens().size(), 0) {}

std::optional<SpsTable> OnlineSps::Observe(int64_t batch_tokens, double step_s) {
  if (step_s > 0 && step_s <= options_.max_step_s) {
    const absl::Span<const int64_t> edges = initial_.tokens();
    const auto it = std::upper_bound(edges.begin(), edges.end(), batch_tokens);
    const size_t bin = it == edges.begin() ? 0 : static_cast<size_t>(it - edges.begin()) - 1;
    std::vector<double>& ring = samples_[bin];
    if (ring.size() < static_cast<size_t>(options_.window)) {
      ring.push_back(step_s);
    } else {
      ring[next_[bin]] = step_s;
      next_[bin] = (next_[bin] + 1) % ring.size();
    }
  }
  if (++steps_ < options_.rebuild_interval) return std::nullopt;
  steps_ = 0;
  std::optional<SpsTable> table = Rebuild();
  if (table) {
    ++rebuilds_;
    current_ = table;
  }
  return table;
}

std::optional<SpsTable> OnlineSps::Rebuild() const {
  const absl::Span<const int64_t> edges = initial_.tokens();
  std::vector<double> rates(edges.size());
  std::vector<double> weights(edges.size());
  bool any = false;
  for (size_t i = 0; i < edges.size(); ++i) {
    const std::vector<double>& ring = samples_[i];
    if (ring.size() >= static_cast<size_t>(options_.min_bin_samples)) {
      rates[i] = 1.0 / Median(ring);
      any = true;
    } else {
      rates[i] = initial_.StepsPerSecond(edges[i]);
    }
    weights[i] = static_cast<double>(std::max<size_t>(ring.size(), 1));
  }
  if (!any) return std::nullopt;
  // Pool adjacent violators: blocks of (mean, weight, bins), merged while a block's rate rises
  // above the one before it.
  struct Block {
    double mean, weight;
    size_t bins;
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i < rates.size(); ++i) {
    blocks.push_back({rates[i], weights[i], 1});
    while (blocks.size() >= 2 && blocks.back().mean > blocks[blocks.size() - 2].mean) {
      const Block last = blocks.back();
      blocks.pop_back();
      Block& prev = blocks.back();
      prev.mean = (prev.mean * prev.weight + last.mean * last.weight) / (prev.weight + last.weight);
      prev.weight += last.weight;
      prev.bins += last.bins;
    }
  }
  std::vector<double> out;
  for (const Block& b : blocks) out.insert(out.end(), b.bins, b.mean);
  for (size_t i = 1; i < out.size(); ++i) out[i] = std::min(out[i], out[i - 1] * (1 - 1e-3));
  absl::StatusOr<SpsTable> table =
      SpsTable::Create(std::vector<int64_t>(edges.begin(), edges.end()), std::move(out));
  if (!table.ok()) return std::nullopt;  // a rate that underflows: keep the current table
  return *std::move(table);
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
