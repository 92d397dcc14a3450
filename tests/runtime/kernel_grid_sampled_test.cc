// kSampledHeads on real batches (kernel_grid_test.cc has its exact cases): batches drawn from
// the bundled Mooncake trace, priced by the published gqa fit.
#include <cmath>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include "dpbalance/cost_model.h"
#include "dpbalance/kernel_grid.h"
#include "gtest/gtest.h"
#include "trace.h"

namespace dpbalance {
namespace {

// Batches as a decode rank of the bundled Mooncake trace holds them: requests drawn from the
// trace, each at its prompt plus part of its output, verifying 3 drafts (4 query tokens).
std::vector<std::vector<RequestLoad>> MooncakeBatches(int requests, int count, uint64_t seed) {
  absl::StatusOr<std::vector<replay::TraceRequest>> rows =
      replay::LoadTrace(DPB_TEST_TRACE, replay::TraceFormat::kMooncakeJsonl, 0);
  if (!rows.ok() || rows->empty()) return {};
  std::vector<std::vector<RequestLoad>> batches(count);
  std::mt19937_64 rng(seed);
  for (std::vector<RequestLoad>& b : batches) {
    for (int i = 0; i < requests; ++i) {
      const replay::TraceRequest& r = (*rows)[rng() % rows->size()];
      const int64_t done = static_cast<int64_t>(rng() % static_cast<uint64_t>(r.output_tokens + 1));
      b.push_back({r.input_tokens + done + 4, 4});
    }
  }
  return batches;
}

// A sampled head-major verify launch counts every CTA and key block exactly and prices real
// batches about as the reference does: the published gqa fit's verify-path attention within a
// few per cent on average (up to ~13% on a batch of 32), not far from how the reference itself
// moves when one request grows by one key block (docs/cost-model.md measures both). A sampled
// launch whose left-out heads were not added back would be 4-30x off.
TEST(SampledHeads, PriceMooncakeBatchesAboutAsTheReferenceDoes) {
  absl::StatusOr<CostModel> model = CostModel::FromFile(DPB_GQA_MODEL);
  ASSERT_TRUE(model.ok()) << model.status();
  const CostModel sampled = model->WithGridSimulation(GridSimulation::kSampledHeads);
  const KernelGrid& grid = model->kernel_grid();
  for (const auto& [requests, count, mean_bound, max_bound] :
       {std::tuple{32, 24, 0.04, 0.12}, std::tuple{256, 4, 0.01, 0.02}}) {
    const std::vector<std::vector<RequestLoad>> batches = MooncakeBatches(requests, count, 61);
    ASSERT_EQ(batches.size(), static_cast<size_t>(count)) << DPB_TEST_TRACE;
    double sum_error = 0, sum_abs = 0;
    for (const std::vector<RequestLoad>& batch : batches) {
      const GridTerms ref = SimulateGrid(grid, batch, false);
      const GridTerms got = SimulateGrid(grid, batch, false, ~0u, GridSimulation::kSampledHeads);
      EXPECT_EQ(got[kGridCtas], ref[kGridCtas]);
      EXPECT_EQ(got[kGridWork], ref[kGridWork]);
      for (int t = kGridMakespan0; t < kNumGridTerms; ++t) {
        EXPECT_NEAR(got[t] / ref[t], 1.0, 0.25) << requests << " " << GridTermName(t);
      }
      const double error = sampled.AttentionUs(batch) / model->AttentionUs(batch) - 1;
      EXPECT_LT(std::fabs(error), max_bound) << requests << " requests";
      sum_error += error;
      sum_abs += std::fabs(error);
    }
    EXPECT_LT(sum_abs / count, mean_bound) << requests << " requests";
    EXPECT_LT(std::fabs(sum_error / count), 0.02) << requests << " requests";  // no lean
  }
}

}  // namespace
}  // namespace dpbalance
