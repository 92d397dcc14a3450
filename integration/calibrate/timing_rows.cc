#include "timing_rows.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace dpbalance::calibrate {
namespace {

// A row's token counts (ctx, q, ntok) must be integers in range before any arithmetic: 2^24 =
// 16,777,216 tokens is 8x the longest context served today (2M), and q is stored as int32.
constexpr int64_t kMaxRowTokens = int64_t{1} << 24;
// A measured time above 10 s is no decode kernel (the data's slowest attention row is 240 ms):
// a unit error (us or ns written as ms) or a corrupt row.
constexpr double kMaxKernelMs = 1e4;

// `v` as an integer token count in lo..kMaxRowTokens, or an error naming `what` and the value.
absl::StatusOr<int64_t> TokenCount(const nlohmann::json& v, int64_t lo, const std::string& what) {
  if (!v.is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s = %s is not an integer", what, v.dump()));
  }
  if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(kMaxRowTokens)
                             : v.get<int64_t>() > kMaxRowTokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s = %s exceeds %d tokens (2^24, 8x the longest context served today)", what, v.dump(), kMaxRowTokens));
  }
  const int64_t x = v.get<int64_t>();
  if (x < lo) return absl::InvalidArgumentError(absl::StrFormat("%s = %d must be >= %d", what, x, lo));
  return x;
}

}  // namespace

absl::StatusOr<Target> ParseTarget(const std::string& name) {
  if (name == "attn") return Target::kAttention;
  if (name == "gemm") return Target::kGemm;
  if (name == "step") return Target::kStep;
  return absl::InvalidArgumentError(absl::StrCat("--target '", name, "' is not attn, gemm or step"));
}

absl::StatusOr<std::vector<TimingRow>> LoadTimingRows(const std::string& path, Target target,
                                                      const KernelGrid& grid, GridSimulation sim) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("timing file '", path, "' cannot be opened"));
  std::vector<TimingRow> rows;
  std::string text;
  int line = 0;
  auto err = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrFormat("%s:%d: %s", path, line, what));
  };
  while (std::getline(in, text)) {
    ++line;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return err("not a JSON object");
    if (!j.contains("ctx") || !j["ctx"].is_array() || !j.contains("q") || !j["q"].is_array()) {
      return err("missing arrays 'ctx' and 'q'");
    }
    if (j["ctx"].size() != j["q"].size() || j["ctx"].empty()) {
      return err(absl::StrFormat("'ctx' has %d entries and 'q' %d", j["ctx"].size(), j["q"].size()));
    }
    TimingRow r;
    std::vector<RequestLoad> batch;
    for (size_t i = 0; i < j["ctx"].size(); ++i) {
      absl::StatusOr<int64_t> ctx = TokenCount(j["ctx"][i], 0, absl::StrFormat("ctx[%d]", i));
      if (!ctx.ok()) return err(std::string(ctx.status().message()));
      absl::StatusOr<int64_t> q = TokenCount(j["q"][i], 1, absl::StrFormat("q[%d]", i));
      if (!q.ok()) return err(std::string(q.status().message()));
      batch.push_back({*ctx, static_cast<int32_t>(*q)});
      r.sample.agg.Add(batch.back());
    }
    FillGridState(grid, batch, ~0u, ~0u, r.sample.agg.multi_query ? 2u : 1u, &r.sample.agg, sim);
    auto ms = [&](const char* key) -> absl::StatusOr<double> {
      if (!j.contains(key) || !j[key].is_number()) return err(absl::StrCat("missing number '", key, "'"));
      const double v = j[key].get<double>();
      if (!(v > 0 && v <= kMaxKernelMs)) {
        return err(absl::StrFormat("%s = %g must be > 0 and <= %g ms (10 s: no decode kernel takes longer)",
                                   key, v, kMaxKernelMs));
      }
      return v;
    };
    double us = 0;
    if (target != Target::kGemm) {
      absl::StatusOr<double> a = ms("attn_ms");
      if (!a.ok()) return a.status();
      us += *a * 1000;
    }
    if (target != Target::kAttention) {
      absl::StatusOr<double> g = ms("gemm_ms");
      if (!g.ok()) return g.status();
      us += *g * 1000;
    }
    r.sample.measured_us = us;
    for (const char* key : {"variant", "mode"}) {  // optional labels
      if (j.contains(key) && !j[key].is_string()) return err(absl::StrCat("'", key, "' is not a string"));
    }
    r.variant = j.value("variant", "");
    r.mode = j.value("mode", "");
    rows.push_back(std::move(r));
  }
  if (rows.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no timing rows"));
  return rows;
}

absl::StatusOr<std::vector<TimingSample>> LoadGemmSweep(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("GEMM sweep '", path, "' cannot be opened"));
  std::vector<TimingSample> out;
  std::string text;
  int line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("ntok") || !j["ntok"].is_number_integer() ||
        !j.contains("ms") || !j["ms"].is_number()) {
      return absl::InvalidArgumentError(absl::StrFormat("%s:%d: expected {\"ntok\": int, \"ms\": number}", path, line));
    }
    absl::StatusOr<int64_t> ntok_or = TokenCount(j["ntok"], 1, "ntok");
    if (!ntok_or.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("%s:%d: %s", path, line, ntok_or.status().message()));
    }
    const int64_t ntok = *ntok_or;
    const double ms = j["ms"].get<double>();
    if (!(ms > 0 && ms <= kMaxKernelMs)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s:%d: ms = %g must be > 0 and <= %g (10 s: no GEMM of a decode step takes longer)",
                          path, line, ms, kMaxKernelMs));
    }
    TimingSample s;
    s.agg.num_requests = 1;
    s.agg.query_tokens = static_cast<double>(ntok);
    s.measured_us = ms * 1000;
    out.push_back(s);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no rows"));
  return out;
}

}  // namespace dpbalance::calibrate
