// Fuzzes the trace readers (integration/replay/trace.h): LoadTrace on arbitrary bytes as a
// Mooncake JSONL or Azure CSV file. Input: byte 0 picks the format (auto, mooncake, azure) and
// the spreading seed; the rest is the file. Any input must give a status or requests, never a
// crash; loaded requests must satisfy the header's contract (lengths valid).
//
// Findings, fixed in the readers and kept as seeds (corpus/trace_fuzz/regress_*):
//  K1 Mooncake: a length that is a JSON float outside int64 (e.g. "input_length": 1e300) was
//     converted with get<int64_t>() -- UBSan float-cast-overflow in nlohmann's from_json.
//  K2 Azure: a year or month near INT_MIN ("-2147483648-11-16 ...") overflowed `y - 1900` /
//     `mo - 1` in ParseAzureTime -- UBSan signed-integer-overflow (trace.cc).
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

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
