// integration/calibrate/timing_rows.h — loading measured kernel timings (the JSON-lines format
// of integration/calibrate/data/*.train.jsonl, described in its README.md and docs/cost-model.md:
// one rank's batch per row, `ctx[]`, `q[]`, `attn_ms`, optional `gemm_ms`). Errors name the file,
// the line and the value.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "dpbalance/calibration.h"

namespace dpbalance::calibrate {

enum class Target { kAttention, kGemm, kStep };  // attn_ms, gemm_ms, attn_ms + gemm_ms
absl::StatusOr<Target> ParseTarget(const std::string& name);

struct TimingRow {
  TimingSample sample;
  std::string variant, mode;
};

// With a `grid`, each row's aggregates carry its simulated grid terms for its own kernel path
// (the only path its features read), simulated as `sim` says.
absl::StatusOr<std::vector<TimingRow>> LoadTimingRows(const std::string& path, Target target,
                                                      const KernelGrid& grid = KernelGrid{},
                                                      GridSimulation sim = GridSimulation::kReference);

// The projection-GEMM sweep (`{"ntok": N, "ms": t}` per line): one sample per token count, as
// a batch of `ntok` query tokens (the GEMMs see tokens, not requests or contexts).
absl::StatusOr<std::vector<TimingSample>> LoadGemmSweep(const std::string& path);

}  // namespace dpbalance::calibrate
