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
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/marshalling.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "dpbalance/calibration.h"
#include "cli.h"
#include "nlohmann/json.hpp"
#include "timing_rows.h"

namespace dpbalance::calibrate {

// A repeatable path flag (--train A --train B): Abseil parses each occurrence into a fresh value,
// so the occurrences so far are kept per flag (Tag) and each parse returns all of them, in order.
template <int Tag>
struct PathList {
  std::vector<std::string> paths;
};
template <int Tag>
std::vector<std::string>& PathsSoFar() {
  static std::vector<std::string> paths;
  return paths;
}
template <int Tag>
bool AbslParseFlag(absl::string_view text, PathList<Tag>* out, std::string* /*error*/) {
  if (text.empty()) {  // the default (Abseil checks it parses); --train= names no file
    out->paths.clear();
    return true;
  }
  PathsSoFar<Tag>().emplace_back(text);
  out->paths = PathsSoFar<Tag>();
  return true;
}
template <int Tag>
std::string AbslUnparseFlag(const PathList<Tag>& list) {
  return absl::StrJoin(list.paths, ",");
}
using TrainFiles = PathList<0>;
using TestFiles = PathList<1>;

}  // namespace dpbalance::calibrate

ABSL_FLAG(dpbalance::calibrate::TrainFiles, train, {}, "timing rows to fit on; repeatable");
ABSL_FLAG(dpbalance::calibrate::TestFiles, test, {}, "held-out timing rows; repeatable");
ABSL_FLAG(std::string, json, "", "write the test and cross-validation errors as JSON");
ABSL_FLAG(std::string, out, "", "write the fitted model");
ABSL_FLAG(std::string, dump, "", "write each training row's aggregates, measured and out-of-fold time");
ABSL_FLAG(std::string, gemm, "", "fit the projection GEMMs of a sweep");
ABSL_FLAG(std::string, target, "attn", "attn, gemm or step");
ABSL_FLAG(std::string, kernel, "none", "none, fa2-gqa-h200 or fa2-packed-h200");
ABSL_FLAG(std::string, grid_sim, "reference", "reference or fast: the grid simulation the fit uses");
ABSL_FLAG(int, cv, 5, "K-fold cross-validation (0: none; else 2..training rows)");
ABSL_FLAG(uint64_t, seed, 1, "fold shuffle seed");
ABSL_FLAG(double, loss_power, 1, "the fit minimises sum |relative error|^P, P in [1, 3]");

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

constexpr char kUsage[] =
    "usage: dpbalance-calibrate --train FILE [--train FILE ...] [--test FILE ...] [--json OUT] "
    "[--out MODEL] [--target attn|gemm|step] [--cv K] [--seed N] [--dump FILE] [--gemm SWEEP] "
    "[--kernel none|fa2-gqa-h200|fa2-packed-h200] [--grid_sim reference|fast] [--loss_power P]\n";

// --help: what the tool does and every flag, on stdout.
void PrintHelp() {
  std::printf(
      "dpbalance-calibrate: fits the cost model to measured attention timings and evaluates it.\n"
      "%s\n"
      "  --train FILE   timing rows to fit on (JSON lines: ctx[], q[], attn_ms, optional gemm_ms;\n"
      "                 integration/calibrate/data/); repeatable\n"
      "  --test FILE    held-out timing rows: prints {\"rows\",\"mape\",\"p90_ape\",\"max_ape\"};\n"
      "                 repeatable\n"
      "  --target T     what the model predicts: attn (attn_ms, default), gemm (gemm_ms) or\n"
      "                 step (attn_ms + gemm_ms)\n"
      "  --kernel K     the measured kernel's launch (none, fa2-gqa-h200, fa2-packed-h200): its\n"
      "                 simulated grid terms join the features and the model carries its name\n"
      "  --grid_sim S   how the grid is simulated: reference (default; the published fits) or\n"
      "                 fast (another tie rule, docs/cost-model.md); the model file says which,\n"
      "                 and a planner prices it that way\n"
      "  --cv K         K-fold cross-validation on the training rows, ours and the published\n"
      "                 form refit (0: none; default 5)\n"
      "  --seed N       fold shuffle seed (default 1)\n"
      "  --loss_power P the fit minimises sum |relative error|^P over the rows, P in [1, 3]:\n"
      "                 1 (default) what MAPE measures; 2 least squares, a shorter tail\n"
      "  --json OUT     write the test and cross-validation errors as JSON\n"
      "  --out MODEL    write the fitted model (a cost-model JSON the replay and plugin load)\n"
      "  --dump FILE    write each training row's aggregates, measured and out-of-fold time\n"
      "  --gemm SWEEP   fit the projection GEMMs of a sweep ({\"ntok\": N, \"ms\": t} per line)\n"
      "  --help, -h     this text\n",
      kUsage);
}

// Exit codes: integration/common/cli.h (0 ok, 1 internal, 2 bad flag, 3 bad input file).
int Usage(const std::string& why) {
  std::fprintf(stderr, "dpbalance-calibrate: %s\n%s", why.c_str(), kUsage);
  return cli::kUsageError;
}

int Fail(const absl::Status& s, cli::ExitCode code) { return cli::Fail("dpbalance-calibrate", s, code); }

struct Options {
  std::vector<std::string> train_files, test_files;
  std::string json_out, model_out, dump_out, gemm_file, target_name = "attn", kernel_name = "none",
      grid_sim_name = "reference";
  int folds = 5;
  uint64_t seed = 1;
  double loss_power = 1;

  static Options FromFlags() {
    Options o;
    o.train_files = absl::GetFlag(FLAGS_train).paths;
    o.test_files = absl::GetFlag(FLAGS_test).paths;
    o.json_out = absl::GetFlag(FLAGS_json);
    o.model_out = absl::GetFlag(FLAGS_out);
    o.dump_out = absl::GetFlag(FLAGS_dump);
    o.gemm_file = absl::GetFlag(FLAGS_gemm);
    o.target_name = absl::GetFlag(FLAGS_target);
    o.kernel_name = absl::GetFlag(FLAGS_kernel);
    o.grid_sim_name = absl::GetFlag(FLAGS_grid_sim);
    o.folds = absl::GetFlag(FLAGS_cv);
    o.seed = absl::GetFlag(FLAGS_seed);
    o.loss_power = absl::GetFlag(FLAGS_loss_power);
    return o;
  }
};

// The flag checks that need no file: --cv's range (its upper bound, the row count, comes after
// loading), --target, --kernel and the outputs' writability.
absl::Status CheckFlags(const Options& options) {
  if (options.folds < 0 || options.folds == 1) {
    return absl::InvalidArgumentError(absl::StrFormat("--cv = %d must be 0 (none) or >= 2", options.folds));
  }
  if (!(options.loss_power >= 1 && options.loss_power <= 3)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--loss_power = %g must be a number in [1, 3]", options.loss_power));
  }
  if (absl::StatusOr<Target> t = ParseTarget(options.target_name); !t.ok()) return t.status();
  if (absl::StatusOr<KernelGrid> g = KernelGrid::Named(options.kernel_name); !g.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--kernel = '", options.kernel_name, "': ", g.status().message()));
  }
  if (absl::StatusOr<GridSimulation> s = GridSimulationNamed(options.grid_sim_name); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--grid_sim: ", s.status().message()));
  } else if (*s == GridSimulation::kSampledHeads) {
    return absl::InvalidArgumentError(
        "--grid_sim = 'sampled': that is how a planner prices a reference fit; a fit is made "
        "under reference or fast");
  }
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--json", options.json_out},
                                   {"--out", options.model_out},
                                   {"--dump", options.dump_out}}) {
    if (absl::Status s = cli::CheckWritable(flag, path); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void PrintCoefficients(const CostModel& model) {
  for (int f = 0; f < kNumCostFeatures; ++f) {
    if (model.weights_us()[f] > 0) std::printf("  %-30s %.6g\n", FeatureName(f).c_str(), model.weights_us()[f]);
  }
}

// --gemm: the per-token projection GEMMs, flat, then linear past a knee the fit finds.
absl::Status FitGemmSweep(const std::string& path) {
  absl::StatusOr<std::vector<TimingSample>> sweep = LoadGemmSweep(path);
  if (!sweep.ok()) return sweep.status();
  FitOptions o;
  o.name = "projection-gemm";
  o.features = {FeatureIndex(Regime::kBase, CostTerm::kConstant),
                FeatureIndex(Regime::kBase, CostTerm::kQueryTokens)};
  for (int k = 0; k < 6; ++k) o.features.push_back(FeatureIndex(Regime::kBase, CostTerm::kKnee0, k));
  absl::StatusOr<CostModel> gemm_model = FitCostModel(*sweep, o);
  if (!gemm_model.ok()) return gemm_model.status();
  const ErrorStats e = EvaluateModel(*gemm_model, *sweep);
  std::printf("GEMM sweep %s: %zu rows, in-sample mape %.4f max %.4f; nonzero coefficients:\n",
              path.c_str(), e.rows, e.mape, e.max_ape);
  PrintCoefficients(*gemm_model);
  return absl::OkStatus();
}

// The samples of every row of `files`, in order.
absl::StatusOr<std::vector<TimingSample>> LoadSamples(const std::vector<std::string>& files,
                                                      Target target, const KernelGrid& grid,
                                                      GridSimulation sim) {
  std::vector<TimingSample> samples;
  for (const std::string& f : files) {
    absl::StatusOr<std::vector<TimingRow>> rows = LoadTimingRows(f, target, grid, sim);
    if (!rows.ok()) return rows.status();
    for (const TimingRow& r : *rows) samples.push_back(r.sample);
  }
  return samples;
}

// --dump: each training row's aggregates, measured time and out-of-fold prediction.
void DumpOutOfFold(const std::string& path, const std::vector<TimingSample>& train,
                   const std::vector<double>& out_of_fold) {
  std::ofstream f(path);
  for (size_t i = 0; i < train.size(); ++i) {
    const BatchAggregates& g = train[i].agg;
    f << absl::StrFormat("%g %g %g %g %g %d %g %g\n", g.num_requests, g.query_tokens, g.key_tokens,
                         g.max_key_tokens, g.query_key_pairs, g.multi_query ? 1 : 0, train[i].measured_us,
                         out_of_fold[i]);
  }
}

// K-fold cross-validation of our fit and of the published form refit; prints both and adds
// them to `out` as "cv".
absl::Status CrossValidateBoth(const std::vector<TimingSample>& train, const Options& options,
                               const Fitter& fit_ours, nlohmann::json& out) {
  std::vector<double> out_of_fold;
  absl::StatusOr<ErrorStats> ours = CrossValidate(train, options.folds, options.seed, fit_ours, &out_of_fold);
  if (ours.ok() && !options.dump_out.empty()) DumpOutOfFold(options.dump_out, train, out_of_fold);
  absl::StatusOr<ErrorStats> published = CrossValidate(train, options.folds, options.seed, FitPublishedForm);
  if (!ours.ok() || !published.ok()) return absl::InternalError("cross-validation failed");
  std::printf("%d-fold CV, ours:                 mape %.4f p90 %.4f max %.4f\n", options.folds, ours->mape,
              ours->p90_ape, ours->max_ape);
  std::printf("%d-fold CV, published form refit: mape %.4f p90 %.4f max %.4f\n", options.folds,
              published->mape, published->p90_ape, published->max_ape);
  out["cv"] = {{"folds", options.folds}, {"ours", ToJson(*ours)}, {"published_form_refit", ToJson(*published)}};
  return absl::OkStatus();
}

// Fits the attention model on --train, cross-validates it, evaluates it on --test and writes
// --json and --out.
int FitAttention(const Options& options) {
  absl::StatusOr<Target> target = ParseTarget(options.target_name);      // checked in CheckFlags
  absl::StatusOr<KernelGrid> grid = KernelGrid::Named(options.kernel_name);
  if (!target.ok() || !grid.ok()) return Usage("--target or --kernel");
  FitOptions fit_options;
  fit_options.grid = *grid;
  fit_options.loss_power = options.loss_power;
  const Fitter fit_ours = [&](absl::Span<const TimingSample> rows) {
    return FitCostModel(rows, fit_options);
  };
  const GridSimulation sim = *GridSimulationNamed(options.grid_sim_name);  // checked in CheckFlags
  absl::StatusOr<std::vector<TimingSample>> train = LoadSamples(options.train_files, *target, *grid, sim);
  if (!train.ok()) return Fail(train.status(), cli::kBadData);
  absl::StatusOr<std::vector<TimingSample>> test = LoadSamples(options.test_files, *target, *grid, sim);
  if (!test.ok()) return Fail(test.status(), cli::kBadData);
  // K folds of a fit each: more folds than rows leaves empty folds and costs K fits for nothing.
  if (options.folds > static_cast<int64_t>(train->size())) {
    return Usage(absl::StrFormat("--cv = %d must be 0 or in 2..%d (the training rows of %s)", options.folds,
                                 train->size(), absl::StrJoin(options.train_files, ", ")));
  }

  absl::StatusOr<CostModel> model = fit_ours(*train);
  if (!model.ok()) return Fail(model.status(), cli::kBadData);
  nlohmann::json out;
  std::printf("fitted on %zu rows; nonzero coefficients (us per unit):\n", train->size());
  PrintCoefficients(*model);
  const PathSupport paths = KernelPathSupport(*train);
  std::printf("kernel paths: single-query %zu rows (largest %.0f key tokens), multi-query %zu rows (%.0f): %s\n",
              paths.rows[0], paths.max_key_tokens[0], paths.rows[1], paths.max_key_tokens[1],
              paths.split ? "each path fitted its own extras"
                          : "one formula prices both (one path's rows are too few or too small to fit it "
                            "apart; docs/cost-model.md, \"Kernel paths\")");
  out["kernel_paths"] = {{"single_query_rows", paths.rows[0]},
                         {"multi_query_rows", paths.rows[1]},
                         {"split", paths.split}};
  const ErrorStats fit_err = EvaluateModel(*model, *train);
  std::printf("training rows: mape %.4f p90 %.4f max %.4f\n", fit_err.mape, fit_err.p90_ape, fit_err.max_ape);
  if (options.folds >= 2) {
    if (absl::Status s = CrossValidateBoth(*train, options, fit_ours, out); !s.ok()) {
      return Fail(s, cli::kInternalError);
    }
  }
  if (!test->empty()) {
    const ErrorStats e = EvaluateModel(*model, *test);
    std::printf("{\"rows\":%zu,\"mape\":%.6f,\"p90_ape\":%.6f,\"max_ape\":%.6f}\n", e.rows, e.mape, e.p90_ape, e.max_ape);
    const nlohmann::json t = ToJson(e);
    for (auto it = t.begin(); it != t.end(); ++it) out[it.key()] = it.value();
  }
  if (!options.json_out.empty()) {
    std::ofstream f(options.json_out);
    if (!f) return Usage(absl::StrFormat("cannot write --json '%s'", options.json_out));
    f << out.dump(2) << "\n";
  }
  if (!options.model_out.empty()) {
    std::ofstream f(options.model_out);
    if (!f) return Usage(absl::StrFormat("cannot write --out '%s'", options.model_out));
    // Its rows' rule, priced the same way; with --cv, its out-of-fold error (the plugin's guard).
    const double cv_mape = out.contains("cv") ? out["cv"]["ours"]["mape"].get<double>() : 0.0;
    f << model->WithGridSimulation(sim).WithCvMape(cv_mape).ToJson() << "\n";
  }
  return 0;
}

int Main() {
  const Options options = Options::FromFlags();
  if (absl::Status s = CheckFlags(options); !s.ok()) return Usage(std::string(s.message()));
  if (options.train_files.empty() && options.gemm_file.empty()) {
    return Usage("at least one --train FILE (or --gemm FILE) is required");
  }
  if (!options.gemm_file.empty()) {
    if (absl::Status s = FitGemmSweep(options.gemm_file); !s.ok()) return Fail(s, cli::kBadData);
    if (options.train_files.empty()) return 0;
  }
  return FitAttention(options);
}

}  // namespace
}  // namespace dpbalance::calibrate

int main(int argc, char** argv) {
  // --help / -h: the tool's own text (every flag with its argument), not Abseil's listing.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h" || a == "-help") {
      dpbalance::calibrate::PrintHelp();
      return 0;
    }
  }
  absl::SetProgramUsageMessage(dpbalance::calibrate::kUsage);
  dpbalance::cli::ParseFlags("dpbalance-calibrate", argc, argv);
  return dpbalance::calibrate::Main();
}
