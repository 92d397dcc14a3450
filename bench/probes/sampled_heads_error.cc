// How far the planner's sampled pricing of a head-major verify launch (GridSimulation::
// kSampledHeads) is from the reference simulation, on batches of the bundled Mooncake trace
// priced by the published gqa fit (docs/cost-model.md, "Sampled heads").
//
// Usage: dpbalance_sampled_heads_probe [BATCHES]   (default 60 per batch size)
// For 8, 16, 32, 64 and 256 requests a rank, BATCHES batches each: requests drawn from the trace,
// each at its prompt plus a uniform part of its output, verifying 3 drafts (4 query tokens). Prints
// the verify-path attention's relative error under kSampledHeads and under kFast (another tie
// rule), and, for scale, how far the reference itself moves when one request of the batch grows
// by 64 tokens (one key block): mean |error|, mean error (bias) and the largest |error|.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "dpbalance/cost_model.h"
#include "dpbalance/kernel_grid.h"
#include "trace.h"

namespace dpbalance {
namespace {

struct Errors {
  double sum = 0, sum_abs = 0, max_abs = 0;
  int n = 0;
  void Add(double e) {
    sum += e;
    sum_abs += std::fabs(e);
    max_abs = std::max(max_abs, std::fabs(e));
    ++n;
  }
  void Print(const char* what) const {
    std::printf("  %-34s mean |e| %5.2f%%  bias %+5.2f%%  max %5.2f%%\n", what, 100 * sum_abs / n,
                100 * sum / n, 100 * max_abs);
  }
};

int Main(int argc, char** argv) {
  const int batches = argc > 1 ? std::atoi(argv[1]) : 60;
  if (batches <= 0) {
    std::fprintf(stderr, "BATCHES = '%s' must be a positive integer\n", argv[1]);
    return 2;
  }
  const std::string trace =
      std::string(DPB_SOURCE_DIR) + "/integration/replay/data/mooncake_conversation.jsonl";
  const std::string model_file = std::string(DPB_SOURCE_DIR) + "/docs/generated/model_gqa.json";
  absl::StatusOr<std::vector<replay::TraceRequest>> rows =
      replay::LoadTrace(trace, replay::TraceFormat::kMooncakeJsonl, 0);
  if (!rows.ok() || rows->empty()) {
    std::fprintf(stderr, "no requests read from %s: %s\n", trace.c_str(),
                 rows.ok() ? "empty" : std::string(rows.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<CostModel> model = CostModel::FromFile(model_file);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const CostModel sampled = model->WithGridSimulation(GridSimulation::kSampledHeads);
  const CostModel fast = model->WithGridSimulation(GridSimulation::kFast);
  std::printf("%s, %zu requests; model %s; %d batches per size\n", trace.c_str(), rows->size(),
              model_file.c_str(), batches);
  std::mt19937_64 rng(61);
  for (int requests : {8, 16, 32, 64, 256}) {
    Errors e_sampled, e_fast, e_block;
    for (int b = 0; b < batches; ++b) {
      std::vector<RequestLoad> batch;
      for (int i = 0; i < requests; ++i) {
        const replay::TraceRequest& r = (*rows)[rng() % rows->size()];
        const int64_t done =
            static_cast<int64_t>(rng() % static_cast<uint64_t>(r.output_tokens + 1));
        batch.push_back({r.input_tokens + done + 4, 4});
      }
      const double ref = model->AttentionUs(batch);
      e_sampled.Add(sampled.AttentionUs(batch) / ref - 1);
      e_fast.Add(fast.AttentionUs(batch) / ref - 1);
      std::vector<RequestLoad> grown = batch;
      grown[rng() % grown.size()].ctx_tokens += 64;
      e_block.Add(model->AttentionUs(grown) / ref - 1);
    }
    std::printf("%d requests (%d CTAs per head, %d of 128 heads simulated when sampled):\n",
                requests, requests, SampledHeads(model->kernel_grid(), requests));
    e_sampled.Print("sampled heads vs reference");
    e_fast.Print("fast (spread ties) vs reference");
    e_block.Print("reference, one request +64 tokens");
  }
  return 0;
}

}  // namespace
}  // namespace dpbalance

int main(int argc, char** argv) { return dpbalance::Main(argc, argv); }
