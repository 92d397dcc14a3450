#include "timing_rows.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace dpbalance::calibrate {

absl::StatusOr<Target> ParseTarget(const std::string& name) {
  if (name == "attn") return Target::kAttention;
  if (name == "gemm") return Target::kGemm;
  if (name == "step") return Target::kStep;
  return absl::InvalidArgumentError(absl::StrCat("--target '", name, "' is not attn, gemm or step"));
}

absl::StatusOr<std::vector<TimingRow>> LoadTimingRows(const std::string& path, Target target,
                                                      const KernelGrid& grid) {
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
      if (!j["ctx"][i].is_number_integer() || !j["q"][i].is_number_integer()) {
        return err(absl::StrFormat("ctx[%d] / q[%d] is not an integer", i, i));
      }
      const int64_t ctx = j["ctx"][i].get<int64_t>();
      const int64_t q = j["q"][i].get<int64_t>();
      if (ctx < 0 || q < 1) return err(absl::StrFormat("ctx[%d] = %d, q[%d] = %d out of range", i, ctx, i, q));
      batch.push_back({ctx, static_cast<int32_t>(q)});
      r.sample.agg.Add(batch.back());
    }
    FillGridState(grid, batch, ~0u, ~0u, r.sample.agg.multi_query ? 2u : 1u, &r.sample.agg);
    auto ms = [&](const char* key) -> absl::StatusOr<double> {
      if (!j.contains(key) || !j[key].is_number()) return err(absl::StrCat("missing number '", key, "'"));
      const double v = j[key].get<double>();
      if (!(v > 0)) return err(absl::StrFormat("%s = %g is not positive", key, v));
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
    const int64_t ntok = j["ntok"].get<int64_t>();
    const double ms = j["ms"].get<double>();
    if (ntok < 1 || !(ms > 0)) {
      return absl::InvalidArgumentError(absl::StrFormat("%s:%d: ntok %d / ms %g out of range", path, line, ntok, ms));
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
