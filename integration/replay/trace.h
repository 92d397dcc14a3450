// integration/replay/trace.h — loading public serving traces (Mooncake JSONL, Azure CSV).
//
// Contract: `LoadTrace` returns every request in file order, or an error naming the file, the
// line and the offending value. Arrival times are milliseconds from the first request.
// Every number is checked before use: lengths are integers in 0..kMaxRequestTokens (output >= 1),
// timestamps finite, >= 0 and real calendar times. A missing file is NotFound, a bad row
// InvalidArgument.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dpbalance::replay {

// The longest request a trace may hold, input or output, in tokens: 2^24 = 16,777,216, 8x the
// longest context window served today (2M tokens). A longer length is a corrupt row, and would
// stall a replay or the reference engine for minutes on one request.
inline constexpr int64_t kMaxRequestTokens = int64_t{1} << 24;

struct TraceRequest {
  double arrival_ms = 0;
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  // Optional (Mooncake JSONL key "acceptance"): the request's own conditional acceptance rates
  // a_1..a_n, each in [0, 1] (n <= 8), as measured live; the replay then draws its accept counts
  // from them instead of the instance profile with a random shift. Empty: not given.
  std::vector<double> acceptance;
  // Optional (key "offered"): s_1..s_n, the chance the drafter offers at least j drafts in a step
  // (an ngram drafter finds no match on some steps), each in [0, 1], non-increasing, as measured
  // live; the replay draws each step's offered count from it and caps every row's verify length
  // there (positions past s_n: none offered). Empty: every draft offered.
  std::vector<double> offered;
};

enum class TraceFormat { kAuto, kMooncakeJsonl, kAzureCsv };
absl::StatusOr<TraceFormat> ParseTraceFormat(const std::string& name);  // auto|mooncake|azure

// Mooncake timestamps are quantised into ~3 s buckets; `seed` spreads arrivals uniformly
// inside each bucket (only open-loop replay looks at arrival times).
absl::StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path, TraceFormat format,
                                                    uint64_t seed);

}  // namespace dpbalance::replay
