// Fuzzes the trace readers (integration/replay/trace.h): LoadTrace on arbitrary bytes as a
// Mooncake JSONL or Azure CSV file. Input: byte 0 picks the format (auto, mooncake, azure) and
// the spreading seed; the rest is the file. Any input must give a status or requests, never a
// crash; loaded requests must satisfy the header's contract (lengths valid, arrivals finite).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "fuzz_util.h"
#include "trace.h"

namespace {
using dpbalance::replay::TraceFormat;
using dpbalance::replay::TraceRequest;

constexpr TraceFormat kFormats[] = {TraceFormat::kAuto, TraceFormat::kMooncakeJsonl,
                                    TraceFormat::kAzureCsv};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static dpbalance::fuzz::ScratchFile file("trace");
  if (size < 1) return 0;
  const TraceFormat format = kFormats[data[0] % 3];
  const uint64_t seed = data[0] / 3;
  const std::string& path = file.Write(data + 1, size - 1);
  absl::StatusOr<std::vector<TraceRequest>> r = dpbalance::replay::LoadTrace(path, format, seed);
  if (!r.ok()) return 0;
  for (const TraceRequest& q : *r) {
    // LoadTrace's contract (CheckLengths): no negative input, at least one output token.
    if (q.input_tokens < 0 || q.output_tokens < 1) {
      std::fprintf(stderr, "LoadTrace returned input %lld output %lld\n",
                   static_cast<long long>(q.input_tokens), static_cast<long long>(q.output_tokens));
      std::abort();
    }
  }
  return 0;
}
