#include "dpbalance/quiet.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace dpbalance {
namespace {
constexpr int kMaxAfter = QuietConfig::kMaxAfter;
constexpr int kMaxLevel = kSummaryQuietMask >> kSummaryQuietShift;  // 15
}  // namespace

absl::Status QuietConfig::Validate() const {
  if (after < 0 || after > kMaxAfter || max_steps < 1 || max_steps > kMaxSpan) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "quiet: after = %d must be in 0..%d and max_steps = %d in 1..%d", after, kMaxAfter,
        max_steps, kMaxSpan));
  }
  return absl::OkStatus();
}

QuietSchedule::QuietSchedule(QuietConfig config) : config_(config) {
  while (max_level_ < kMaxLevel && SpanSteps(max_level_) < config_.max_steps) ++max_level_;
}

int QuietSchedule::SpanSteps(int level) const {
  if (config_.after <= 0 || level <= 0) return 0;
  // after << (level - 1), without overflow: after <= 1000 and the cap is 4096.
  int64_t span = config_.after;
  for (int l = 1; l < level && span < config_.max_steps; ++l) span *= 2;
  return static_cast<int>(std::min<int64_t>(span, config_.max_steps));
}

bool QuietSchedule::SkipStep() {
  if (left_ <= 0) return false;
  --left_;
  ++quiet_steps_;
  return true;
}

uint16_t QuietSchedule::ProposalFlags() const {
  return static_cast<uint16_t>(level_ << kSummaryQuietShift) & kSummaryQuietMask;
}

void QuietSchedule::AfterExchange(absl::Span<const RankSummary> records, bool kept_default) {
  int agreed = records.empty() ? 0 : kMaxLevel;
  for (const RankSummary& r : records) agreed = std::min(agreed, Level(r.flags));
  AfterAgreement(agreed, kept_default);
}

void QuietSchedule::AfterAgreement(int agreed, bool kept_default) {
  if (!on()) return;
  if (!kept_default) {
    Reset();
    return;
  }
  agreed = std::clamp(agreed, 0, kMaxLevel);
  streak_ = std::min(streak_ + 1, kMaxAfter);
  if (agreed >= 1) {  // every rank was ready: the same span everywhere, then a probe
    left_ = SpanSteps(agreed);
    ++spans_;
    level_ = std::min(agreed + 1, max_level_);
  } else {
    level_ = streak_ >= config_.after ? 1 : 0;
  }
}

void QuietSchedule::Reset() {
  streak_ = 0;
  level_ = 0;
}

}  // namespace dpbalance
