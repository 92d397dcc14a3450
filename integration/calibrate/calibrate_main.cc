// dpbalance-calibrate: fits the runtime's cost model to measured timings and evaluates it.
//
//   dpbalance-calibrate --train FILE [--train FILE ...] [--test FILE ...] [--json OUT]
//                       [--out MODEL] [--target attn|gemm|step] [--cv K] [--seed N]
//                       [--kernel none|fa2-gqa-h200|fa2-packed-h200]
//
// --kernel names the measured kernel's launch (kernel_grid.h): its simulated grid terms join
// the feature family, and the written model carries the name so the runtime simulates the same.
//
// Prints and (--json) writes {"rows":N,"mape":x,"p90_ape":x,"max_ape":x} for the test rows
// (errors as fractions), plus K-fold cross-validated figures on the training rows for our model
// and for the published (1, B, C) form refitted to the same rows.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "dpbalance/calibration.h"
#include "nlohmann/json.hpp"
#include "timing_rows.h"

namespace dpbalance::calibrate {
namespace {

// The published form's features only: 1, sum q (B), sum q*ctx (C), one coefficient each for
// every batch (the published form has no kernel-path regimes).
absl::StatusOr<CostModel> FitPublishedForm(absl::Span<const TimingSample> rows) {
  FitOptions o;
  o.name = "published-form-refit";
  o.features = {FeatureIndex(Regime::kBase, CostTerm::kConstant),
                FeatureIndex(Regime::kBase, CostTerm::kQueryTokens),
                FeatureIndex(Regime::kBase, CostTerm::kQueryKeyPairs)};
  return FitCostModel(rows, o);
}

using Fitter = std::function<absl::StatusOr<CostModel>(absl::Span<const TimingSample>)>;

// K-fold cross-validation: every row predicted by the model fitted without its fold.
// `out_of_fold` (optional) receives those predictions, in row order.
absl::StatusOr<ErrorStats> CrossValidate(const std::vector<TimingSample>& rows, int k, uint64_t seed,
                                         Fitter fit, std::vector<double>* out_of_fold = nullptr) {
  std::vector<size_t> idx(rows.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::shuffle(idx.begin(), idx.end(), std::mt19937_64(seed));
  std::vector<double> predicted(rows.size());
  for (int f = 0; f < k; ++f) {
    std::vector<TimingSample> train;
    for (size_t i = 0; i < idx.size(); ++i) {
      if (static_cast<int>(i % k) != f) train.push_back(rows[idx[i]]);
    }
    absl::StatusOr<CostModel> m = fit(train);
    if (!m.ok()) return m.status();
    for (size_t i = f; i < idx.size(); i += k) predicted[idx[i]] = m->AttentionUs(rows[idx[i]].agg);
  }
  std::vector<double> ape(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    ape[i] = std::abs(predicted[i] - rows[i].measured_us) / rows[i].measured_us;
  }
  if (out_of_fold) *out_of_fold = std::move(predicted);
  return SummarizeErrors(std::move(ape));
}

nlohmann::json ToJson(const ErrorStats& e) {
  return {{"rows", e.rows}, {"mape", e.mape}, {"p90_ape", e.p90_ape}, {"max_ape", e.max_ape}};
}

int Usage(const char* why) {
  std::fprintf(stderr,
               "dpbalance-calibrate: %s\nusage: dpbalance-calibrate --train FILE [--train FILE ...] "
               "[--test FILE ...] [--json OUT] [--out MODEL] [--target attn|gemm|step] [--cv K] [--seed N] [--dump FILE] [--gemm SWEEP] [--kernel none|fa2-gqa-h200|fa2-packed-h200]\n",
               why);
  return 2;
}

int Main(int argc, char** argv) {
  std::vector<std::string> train_files, test_files;
  std::string json_out, model_out, dump_out, gemm_file, target_name = "attn", kernel_name = "none";
  int folds = 5;
  uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      Usage("fits the cost model to measured timings");
      return 0;
    }
    if (i + 1 >= argc) return Usage(absl::StrFormat("flag %s needs a value", a).c_str());
    const std::string v = argv[++i];
    if (a == "--train") train_files.push_back(v);
    else if (a == "--test") test_files.push_back(v);
    else if (a == "--json") json_out = v;
    else if (a == "--out") model_out = v;
    else if (a == "--dump") dump_out = v;
    else if (a == "--gemm") gemm_file = v;
    else if (a == "--target") target_name = v;
    else if (a == "--kernel") kernel_name = v;
    else if (a == "--cv") {
      if (!absl::SimpleAtoi(v, &folds) || folds < 0 || folds == 1) return Usage("--cv must be 0 or >= 2");
    } else if (a == "--seed") {
      if (!absl::SimpleAtoi(v, &seed)) return Usage("--seed must be an integer");
    } else {
      return Usage(absl::StrFormat("unknown flag '%s'", a).c_str());
    }
  }
  if (!gemm_file.empty()) {
    // The per-token projection GEMMs: flat, then linear past a knee the fit finds.
    absl::StatusOr<std::vector<TimingSample>> sweep = LoadGemmSweep(gemm_file);
    if (!sweep.ok()) {
      std::fprintf(stderr, "dpbalance-calibrate: %s\n", std::string(sweep.status().message()).c_str());
      return 1;
    }
    FitOptions o;
    o.name = "projection-gemm";
    o.features = {FeatureIndex(Regime::kBase, CostTerm::kConstant),
                  FeatureIndex(Regime::kBase, CostTerm::kQueryTokens)};
    for (int k = 0; k < 6; ++k) o.features.push_back(FeatureIndex(Regime::kBase, CostTerm::kKnee0, k));
    absl::StatusOr<CostModel> g = FitCostModel(*sweep, o);
    if (!g.ok()) {
      std::fprintf(stderr, "dpbalance-calibrate: %s\n", std::string(g.status().message()).c_str());
      return 1;
    }
    const ErrorStats e = EvaluateModel(*g, *sweep);
    std::printf("GEMM sweep %s: %zu rows, in-sample mape %.4f max %.4f; nonzero coefficients:\n",
                gemm_file.c_str(), e.rows, e.mape, e.max_ape);
    for (int f = 0; f < kNumCostFeatures; ++f) {
      if (g->weights_us()[f] > 0) std::printf("  %-30s %.6g\n", FeatureName(f).c_str(), g->weights_us()[f]);
    }
    if (train_files.empty()) return 0;
  }
  if (train_files.empty()) return Usage("at least one --train FILE (or --gemm FILE) is required");
  absl::StatusOr<Target> target = ParseTarget(target_name);
  if (!target.ok()) return Usage(std::string(target.status().message()).c_str());
  absl::StatusOr<KernelGrid> grid = KernelGrid::Named(kernel_name);
  if (!grid.ok()) return Usage(absl::StrCat("--kernel: ", grid.status().message()).c_str());
  FitOptions fit_options;
  fit_options.grid = *grid;
  const Fitter fit_ours = [&](absl::Span<const TimingSample> rows) {
    return FitCostModel(rows, fit_options);
  };
  auto load = [&](const std::vector<std::string>& files, std::vector<TimingSample>* out) -> bool {
    for (const std::string& f : files) {
      absl::StatusOr<std::vector<TimingRow>> rows = LoadTimingRows(f, *target, *grid);
      if (!rows.ok()) {
        std::fprintf(stderr, "dpbalance-calibrate: %s\n", std::string(rows.status().message()).c_str());
        return false;
      }
      for (const TimingRow& r : *rows) out->push_back(r.sample);
    }
    return true;
  };
  std::vector<TimingSample> train, test;
  if (!load(train_files, &train) || !load(test_files, &test)) return 1;

  absl::StatusOr<CostModel> model = fit_ours(train);
  if (!model.ok()) {
    std::fprintf(stderr, "dpbalance-calibrate: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  nlohmann::json out;
  std::printf("fitted on %zu rows; nonzero coefficients (us per unit):\n", train.size());
  for (int f = 0; f < kNumCostFeatures; ++f) {
    if (model->weights_us()[f] > 0) {
      std::printf("  %-30s %.6g\n", FeatureName(f).c_str(), model->weights_us()[f]);
    }
  }
  const ErrorStats fit_err = EvaluateModel(*model, train);
  std::printf("training rows: mape %.4f p90 %.4f max %.4f\n", fit_err.mape, fit_err.p90_ape, fit_err.max_ape);
  if (folds >= 2) {
    std::vector<double> oof;
    absl::StatusOr<ErrorStats> ours = CrossValidate(train, folds, seed, fit_ours, &oof);
    if (ours.ok() && !dump_out.empty()) {  // per-row out-of-fold predictions, for diagnosis
      std::ofstream f(dump_out);
      for (size_t i = 0; i < train.size(); ++i) {
        const BatchAggregates& g = train[i].agg;
        f << absl::StrFormat("%g %g %g %g %g %d %g %g\n", g.num_requests, g.query_tokens, g.key_tokens,
                             g.max_key_tokens, g.query_key_pairs, g.multi_query ? 1 : 0, train[i].measured_us, oof[i]);
      }
    }
    absl::StatusOr<ErrorStats> pub = CrossValidate(train, folds, seed, FitPublishedForm);
    if (!ours.ok() || !pub.ok()) {
      std::fprintf(stderr, "dpbalance-calibrate: cross-validation failed\n");
      return 1;
    }
    std::printf("%d-fold CV, ours:                 mape %.4f p90 %.4f max %.4f\n", folds, ours->mape,
                ours->p90_ape, ours->max_ape);
    std::printf("%d-fold CV, published form refit: mape %.4f p90 %.4f max %.4f\n", folds, pub->mape,
                pub->p90_ape, pub->max_ape);
    out["cv"] = {{"folds", folds}, {"ours", ToJson(*ours)}, {"published_form_refit", ToJson(*pub)}};
  }
  if (!test.empty()) {
    const ErrorStats e = EvaluateModel(*model, test);
    std::printf("{\"rows\":%zu,\"mape\":%.6f,\"p90_ape\":%.6f,\"max_ape\":%.6f}\n", e.rows, e.mape, e.p90_ape, e.max_ape);
    const nlohmann::json t = ToJson(e);
    for (auto it = t.begin(); it != t.end(); ++it) out[it.key()] = it.value();
  }
  if (!json_out.empty()) {
    std::ofstream f(json_out);
    if (!f) return Usage(absl::StrFormat("cannot write --json '%s'", json_out).c_str());
    f << out.dump(2) << "\n";
  }
  if (!model_out.empty()) {
    std::ofstream f(model_out);
    if (!f) return Usage(absl::StrFormat("cannot write --out '%s'", model_out).c_str());
    f << model->ToJson() << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace dpbalance::calibrate

int main(int argc, char** argv) { return dpbalance::calibrate::Main(argc, argv); }
