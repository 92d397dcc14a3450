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

// A length above kMaxRequestTokens (trace.h says why).
absl::Status TooLong(const std::string& path, int line, const std::string& key, const std::string& value) {
  return LineError(path, line,
                   absl::StrFormat("%s %s exceeds %d tokens (2^24, 8x the longest context served "
                                   "today: a corrupt row)",
                                   key, value, kMaxRequestTokens));
}

// A Mooncake length: a JSON integer (or a float with an integral value) in 0..kMaxRequestTokens.
absl::StatusOr<int64_t> JsonLength(const nlohmann::json& v, const std::string& path, int line,
                                   const std::string& key) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(kMaxRequestTokens)) return TooLong(path, line, key, v.dump());
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < 0) return LineError(path, line, absl::StrFormat("%s %d is negative", key, i));
    if (i > kMaxRequestTokens) return TooLong(path, line, key, v.dump());
    return i;
  }
  const double d = v.get<double>();  // a JSON float
  if (!std::isfinite(d) || d != std::floor(d)) {
    return LineError(path, line, absl::StrFormat("%s %s is not an integer number of tokens", key, v.dump()));
  }
  if (d < 0) return LineError(path, line, absl::StrFormat("%s %s is negative", key, v.dump()));
  if (d > static_cast<double>(kMaxRequestTokens)) return TooLong(path, line, key, v.dump());
  return static_cast<int64_t>(d);
}

// The latest timestamp a trace may hold, ms: ~317 years, far past any trace; a larger one is a
// corrupt row (and would make the arrival spreading meaningless).
constexpr double kMaxTimestampMs = 1e13;

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
    if (!(r.arrival_ms >= 0 && r.arrival_ms <= kMaxTimestampMs)) {
      return LineError(path, line, absl::StrFormat("timestamp %s is not in 0..%g ms",
                                                   j["timestamp"].dump(), kMaxTimestampMs));
    }
    absl::StatusOr<int64_t> in_tokens = JsonLength(j["input_length"], path, line, "input_length");
    if (!in_tokens.ok()) return in_tokens.status();
    absl::StatusOr<int64_t> out_tokens = JsonLength(j["output_length"], path, line, "output_length");
    if (!out_tokens.ok()) return out_tokens.status();
    r.input_tokens = *in_tokens;
    r.output_tokens = *out_tokens;
    if (absl::Status s = CheckLengths(path, line, r.input_tokens, r.output_tokens); !s.ok()) return s;
    if (j.contains("acceptance")) {  // a request's measured conditional acceptance rates
      const nlohmann::json& a = j["acceptance"];
      if (!a.is_array() || a.size() > 8) {
        return LineError(path, line, absl::StrCat("'acceptance' ", a.dump(),
                                                  " is not a list of at most 8 rates"));
      }
      for (const nlohmann::json& v : a) {
        if (!v.is_number() || !(v.get<double>() >= 0 && v.get<double>() <= 1)) {
          return LineError(path, line, absl::StrCat("'acceptance' rate ", v.dump(), " is not in [0, 1]"));
        }
        r.acceptance.push_back(v.get<double>());
      }
    }
    if (j.contains("offered")) {  // the chance the drafter offers at least j drafts in a step
      const nlohmann::json& o = j["offered"];
      if (!o.is_array() || o.size() > 8) {
        return LineError(path, line, absl::StrCat("'offered' ", o.dump(), " is not a list of at most 8 chances"));
      }
      for (const nlohmann::json& v : o) {
        const double p = v.is_number() ? v.get<double>() : -1;
        if (!(p >= 0 && p <= 1) || (!r.offered.empty() && p > r.offered.back())) {
          return LineError(path, line, absl::StrCat("'offered' chance ", v.dump(),
                                                    " is not in [0, 1] or rises (", o.dump(), ")"));
        }
        r.offered.push_back(p);
      }
    }
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

// "2023-11-16 18:15:46.6805900" -> seconds since the epoch (UTC); false unless the whole field
// is a real calendar time (month 1..12, day within the month, 00:00:00 to 23:59:60.999...).
bool ParseAzureTime(std::string_view s, double* seconds) {
  std::tm tm{};
  int y, mo, d, h, mi, consumed = 0;
  double sec;
  const std::string text(s);
  if (std::sscanf(text.c_str(), "%d-%d-%d %d:%d:%lf%n", &y, &mo, &d, &h, &mi, &sec, &consumed) != 6 ||
      consumed != static_cast<int>(text.size())) {
    return false;
  }
  static constexpr int kDaysInMonth[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  if (y < 1970 || y > 9999 || mo < 1 || mo > 12 || d < 1 || d > kDaysInMonth[mo - 1] || h < 0 ||
      h > 23 || mi < 0 || mi > 59 || !(sec >= 0 && sec < 61)) {
    return false;
  }
  const bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
  if (mo == 2 && d == 29 && !leap) return false;
  tm.tm_year = y - 1900;
  tm.tm_mon = mo - 1;
  tm.tm_mday = d;
  tm.tm_hour = h;
  tm.tm_min = mi;
  tm.tm_sec = 0;
  *seconds = static_cast<double>(timegm(&tm)) + sec;
  return true;
}

// An Azure length field: a decimal integer in 0..kMaxRequestTokens.
absl::StatusOr<int64_t> CsvLength(const std::string& field, const std::string& path, int line,
                                  const std::string& key) {
  int64_t v;
  if (!absl::SimpleAtoi(field, &v)) {
    double d;
    if (absl::SimpleAtod(field, &d) && std::isfinite(d) && d >= 0 && d <= kMaxRequestTokens) {
      return LineError(path, line, absl::StrCat(key, " '", field, "' is not an integer number of tokens"));
    }
    if (absl::SimpleAtod(field, &d) && d > kMaxRequestTokens) return TooLong(path, line, key, field);
    return LineError(path, line, absl::StrCat(key, " '", field, "' is not an integer"));
  }
  if (v > kMaxRequestTokens) return TooLong(path, line, key, field);
  return v;
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
    if (!ParseAzureTime(f[0], &t)) {
      return LineError(path, line, absl::StrCat("TIMESTAMP '", f[0],
                                                "' is not a calendar time 'YYYY-MM-DD hh:mm:ss[.frac]'"));
    }
    TraceRequest r;
    absl::StatusOr<int64_t> in_tokens = CsvLength(f[1], path, line, "ContextTokens");
    if (!in_tokens.ok()) return in_tokens.status();
    absl::StatusOr<int64_t> out_tokens = CsvLength(f[2], path, line, "GeneratedTokens");
    if (!out_tokens.ok()) return out_tokens.status();
    r.input_tokens = *in_tokens;
    r.output_tokens = *out_tokens;
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
