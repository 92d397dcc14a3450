// Fuzzes the trace readers (integration/replay/trace.h): LoadTrace on arbitrary bytes as a
// Mooncake JSONL or Azure CSV file. Input: byte 0 picks the format (auto, mooncake, azure) and
// the spreading seed; the rest is the file. Any input must give a status or requests, never a
// crash; loaded requests must satisfy the header's contract (lengths valid).
//
// Known findings, reported to integration/'s owner and not fixed here (integration/ is theirs),
// are skipped so that fuzzing goes on past them; DPB_FUZZ_KNOWN=1 runs them too (to check a fix):
//  K1 Mooncake: a length that is a JSON float outside int64 (e.g. "input_length": 1e300) is
//     converted with get<int64_t>() -- UBSan float-cast-overflow in nlohmann's from_json.
//  K2 Azure: a year or month near INT_MIN ("-2147483648-11-16 ...") overflows `y - 1900` /
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

// True when a line of `text` would reach K1 or K2 (see the top): a Mooncake line with a float
// length outside int64, or a CSV row whose year or month sscanf's to below INT_MIN + 1900.
bool HitsKnownFinding(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object()) {
      for (const char* key : {"input_length", "output_length"}) {
        if (!j.contains(key) || !j[key].is_number_float()) continue;
        const double v = j[key].get<double>();
        if (!(v > -9.2e18 && v < 9.2e18)) return true;
      }
    }
    int y = 0, mo = 0;
    const std::string row(absl::StripAsciiWhitespace(line));
    if (std::sscanf(row.c_str(), "%d-%d", &y, &mo) == 2 && (y < INT_MIN + 1900 || mo == INT_MIN)) {
      return true;
    }
  }
  return false;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static dpbalance::fuzz::ScratchFile file("trace");
  if (size < 1) return 0;
  const TraceFormat format = kFormats[data[0] % 3];
  const uint64_t seed = data[0] / 3;
  static const bool run_known = std::getenv("DPB_FUZZ_KNOWN") != nullptr;
  if (!run_known && HitsKnownFinding(std::string(reinterpret_cast<const char*>(data) + 1, size - 1))) {
    return 0;
  }
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
