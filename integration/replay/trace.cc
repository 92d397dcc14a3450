#include "trace.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <fstream>
#include <map>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace dpbalance::replay {
namespace {

absl::Status LineError(const std::string& path, int line, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrFormat("%s:%d: %s", path, line, what));
}

absl::Status CheckLengths(const std::string& path, int line, int64_t in, int64_t out) {
  if (in < 0) return LineError(path, line, absl::StrFormat("input length %d is negative", in));
  if (out < 0) return LineError(path, line, absl::StrFormat("output length %d is negative", out));
  if (out == 0) return LineError(path, line, "output length 0: a decode request emits >= 1 token");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TraceRequest>> LoadMooncake(std::ifstream& in, const std::string& path,
                                                       uint64_t seed) {
  std::vector<TraceRequest> out;
  std::string text;
  int line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (absl::StripAsciiWhitespace(text).empty()) continue;
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return LineError(path, line, "not a JSON object");
    for (const char* key : {"timestamp", "input_length", "output_length"}) {
      if (!j.contains(key) || !j[key].is_number()) {
        return LineError(path, line, absl::StrCat("missing or non-numeric '", key, "'"));
      }
    }
    TraceRequest r;
    r.arrival_ms = j["timestamp"].get<double>();
    r.input_tokens = j["input_length"].get<int64_t>();
    r.output_tokens = j["output_length"].get<int64_t>();
    if (absl::Status s = CheckLengths(path, line, r.input_tokens, r.output_tokens); !s.ok()) return s;
    out.push_back(r);
  }
  // Spread arrivals inside each quantisation bucket (the gap to the next distinct timestamp).
  std::mt19937_64 rng(seed);
  std::map<double, std::vector<size_t>> buckets;
  for (size_t i = 0; i < out.size(); ++i) buckets[out[i].arrival_ms].push_back(i);
  for (auto it = buckets.begin(); it != buckets.end(); ++it) {
    auto next = std::next(it);
    const double width = next == buckets.end() ? 0.0 : next->first - it->first;
    std::uniform_real_distribution<double> u(0, width);
    for (size_t i : it->second) out[i].arrival_ms = it->first + u(rng);
  }
  return out;
}

// "2023-11-16 18:15:46.6805900" -> seconds since the epoch (UTC).
bool ParseAzureTime(std::string_view s, double* seconds) {
  std::tm tm{};
  double frac = 0;
  int y, mo, d, h, mi;
  double sec;
  if (std::sscanf(std::string(s).c_str(), "%d-%d-%d %d:%d:%lf", &y, &mo, &d, &h, &mi, &sec) != 6) {
    return false;
  }
  tm.tm_year = y - 1900;
  tm.tm_mon = mo - 1;
  tm.tm_mday = d;
  tm.tm_hour = h;
  tm.tm_min = mi;
  tm.tm_sec = 0;
  frac = sec;
  *seconds = static_cast<double>(timegm(&tm)) + frac;
  return true;
}

absl::StatusOr<std::vector<TraceRequest>> LoadAzure(std::ifstream& in, const std::string& path) {
  std::vector<TraceRequest> out;
  std::string text;
  int line = 0;
  if (!std::getline(in, text)) return LineError(path, 1, "empty file (expected a CSV header)");
  ++line;
  const std::string header(absl::StripAsciiWhitespace(text));
  if (header != "TIMESTAMP,ContextTokens,GeneratedTokens") {
    return LineError(path, 1, absl::StrCat("header '", header,
                                           "' is not 'TIMESTAMP,ContextTokens,GeneratedTokens'"));
  }
  double t0 = -1;
  while (std::getline(in, text)) {
    ++line;
    const std::string row(absl::StripAsciiWhitespace(text));
    if (row.empty()) continue;
    std::vector<std::string> f = absl::StrSplit(row, ',');
    if (f.size() != 3) return LineError(path, line, absl::StrFormat("%d fields, expected 3", f.size()));
    double t;
    if (!ParseAzureTime(f[0], &t)) return LineError(path, line, absl::StrCat("bad timestamp '", f[0], "'"));
    TraceRequest r;
    if (!absl::SimpleAtoi(f[1], &r.input_tokens)) {
      return LineError(path, line, absl::StrCat("ContextTokens '", f[1], "' is not an integer"));
    }
    if (!absl::SimpleAtoi(f[2], &r.output_tokens)) {
      return LineError(path, line, absl::StrCat("GeneratedTokens '", f[2], "' is not an integer"));
    }
    if (absl::Status s = CheckLengths(path, line, r.input_tokens, r.output_tokens); !s.ok()) return s;
    if (t0 < 0) t0 = t;
    r.arrival_ms = (t - t0) * 1000.0;
    out.push_back(r);
  }
  return out;
}

}  // namespace

absl::StatusOr<TraceFormat> ParseTraceFormat(const std::string& name) {
  if (name == "auto") return TraceFormat::kAuto;
  if (name == "mooncake") return TraceFormat::kMooncakeJsonl;
  if (name == "azure") return TraceFormat::kAzureCsv;
  return absl::InvalidArgumentError(
      absl::StrCat("--trace_format: unknown format '", name, "' (expected auto, mooncake or azure)"));
}

absl::StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path, TraceFormat format,
                                                    uint64_t seed) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("trace file '", path, "' cannot be opened"));
  if (format == TraceFormat::kAuto) {
    const int c = in.peek();
    if (c == '{') {
      format = TraceFormat::kMooncakeJsonl;
    } else if (c == 'T') {
      format = TraceFormat::kAzureCsv;
    } else if (c == EOF) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": empty trace"));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":1: cannot detect the format (neither a Mooncake JSON line nor an Azure CSV "
                "header); pass --trace_format"));
    }
  }
  absl::StatusOr<std::vector<TraceRequest>> r =
      format == TraceFormat::kMooncakeJsonl ? LoadMooncake(in, path, seed) : LoadAzure(in, path);
  if (r.ok() && r->empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no requests"));
  return r;
}

}  // namespace dpbalance::replay
