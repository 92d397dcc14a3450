#include "dpbalance/cost_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "hash.h"

namespace dpbalance {
namespace {

constexpr std::array<std::string_view, kNumPlainTerms> kScalarTermNames = {
    "constant", "num_requests", "query_tokens", "query_key_pairs", "key_tokens",
    "max_query_key_pairs", "max_key_tokens"};

// The terms read straight off the aggregates, in CostTerm order.
std::array<double, kNumPlainTerms> PlainTerms(const BatchAggregates& a) {
  return {a.num_requests > 0 ? 1.0 : 0.0,
          a.num_requests,
          a.query_tokens,
          a.query_key_pairs,
          a.key_tokens,
          a.max_query_key_pairs,
          a.max_key_tokens};
}

std::string TermName(int t) {
  if (t < kNumPlainTerms) return std::string(kScalarTermNames[t]);
  if (t >= static_cast<int>(CostTerm::kGrid0)) {
    return GridTermName(t - static_cast<int>(CostTerm::kGrid0));
  }
  if (t < static_cast<int>(CostTerm::kWavePairs0)) {
    return absl::StrCat("wave_keys_w", kWaveWidths[t - static_cast<int>(CostTerm::kWaveKeys0)]);
  }
  if (t < static_cast<int>(CostTerm::kKnee0)) {
    return absl::StrCat("wave_pairs_w", kWaveWidths[t - static_cast<int>(CostTerm::kWavePairs0)]);
  }
  return absl::StrCat("knee_", kKneeTokens[t - static_cast<int>(CostTerm::kKnee0)]);
}

constexpr int kGridBase = static_cast<int>(CostTerm::kGrid0);

// Published V1/V2 coefficients: docs/cost-model.md, "The published forms".
constexpr double kV1BatchWeight = 0.72482;
constexpr double kV1MixWeight = 0.27518;
constexpr double kV1CtxScale = 1.30219 / 100000.0;
constexpr double kV2Fixed = 4.32158;
constexpr double kV2BatchWeight = 0.336;
constexpr double kV2MixWeight = 0.1238;
constexpr double kV2CtxScale = 2.89453 / 100000.0;
constexpr double kUsPerMs = 1000.0;

}  // namespace

std::string FeatureName(int f) {
  static constexpr const char* kPrefix[3] = {"", "multi_", "single_"};
  return kPrefix[f / kNumCostTerms] + TermName(f % kNumCostTerms);
}

absl::StatusOr<CostModel> CostModel::Create(const Weights& weights_us, std::string name,
                                            const KernelGrid& grid) {
  for (int f = 0; f < kNumCostFeatures; ++f) {
    const double w = weights_us[f];
    if (!std::isfinite(w) || w < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("cost model '%s': coefficient %s = %g must be finite and >= 0", name,
                          FeatureName(f), w));
    }
  }
  CostModel m;
  m.weights_us_ = weights_us;
  m.name_ = std::move(name);
  m.grid_ = grid;
  m.grid_slopes_ = VerifyGridSlopes(grid);
  m.IndexActiveTerms();
  return m;
}

// Per-rank form of V1/V2 with one barrier: the two max() terms of the published formula applied
// to one rank are a plain sum, linear in (Q, C). Units: published cost read as ms.
CostModel CostModel::PublishedV1() {
  Weights w{};  // base terms only: the published form has no kernel paths
  w[FeatureIndex(Regime::kBase, CostTerm::kQueryTokens)] = (kV1BatchWeight + kV1MixWeight) * kUsPerMs;
  w[FeatureIndex(Regime::kBase, CostTerm::kQueryKeyPairs)] = kV1MixWeight * kV1CtxScale * kUsPerMs;
  CostModel m = *Create(w, "published-v1");
  m.published_form_ = PublishedForm::kV1;
  return m;
}

CostModel CostModel::PublishedV2() {
  Weights w{};
  w[FeatureIndex(Regime::kBase, CostTerm::kConstant)] = kV2Fixed * kUsPerMs;
  w[FeatureIndex(Regime::kBase, CostTerm::kQueryTokens)] = (kV2BatchWeight + kV2MixWeight) * kUsPerMs;
  w[FeatureIndex(Regime::kBase, CostTerm::kQueryKeyPairs)] = kV2MixWeight * kV2CtxScale * kUsPerMs;
  CostModel m = *Create(w, "published-v2");
  m.published_form_ = PublishedForm::kV2;
  return m;
}

double CostModel::TermValue(const BatchAggregates& a, int t) const {
  constexpr int kWaveKeys0 = static_cast<int>(CostTerm::kWaveKeys0);
  constexpr int kWavePairs0 = static_cast<int>(CostTerm::kWavePairs0);
  constexpr int kKnee0 = static_cast<int>(CostTerm::kKnee0);
  if (t < kNumPlainTerms) return PlainTerms(a)[t];
  if (t >= kGridBase) {
    if (!a.grid.valid) return 0.0;
    const int j = t - kGridBase;
    if (!a.multi_query) return a.grid.at_ref[0][j];
    return a.grid.at_ref[1][j] + (a.query_tokens - a.grid.ref_tokens) * grid_slopes_.per_token[j] +
           (a.query_key_pairs - a.grid.ref_pairs) * grid_slopes_.per_pair[j];
  }
  if (t < kWavePairs0) return std::max(a.key_tokens / kWaveWidths[t - kWaveKeys0], a.max_key_tokens);
  if (t < kKnee0) return std::max(a.query_key_pairs / kWaveWidths[t - kWavePairs0], a.max_key_tokens);
  return std::max(0.0, a.query_tokens - kKneeTokens[t - kKnee0]);
}

CostModel::Weights CostModel::Features(const BatchAggregates& a) const {
  // Base terms count for every batch; the extras only on their kernel path.
  Weights x{};
  const int extra = (a.multi_query ? 1 : 2) * kNumCostTerms;
  // Grid terms are features only of models that simulate a grid (an online refit of a model
  // without one must not learn them: its planner never fills them).
  const int terms = grid_.enabled() ? kNumCostTerms : kGridBase;
  for (int t = 0; t < terms; ++t) {
    x[t] = TermValue(a, t);
    x[extra + t] = x[t];
  }
  return x;
}

void CostModel::IndexActiveTerms() {
  for (int multi = 0; multi < 2; ++multi) {
    Path& p = paths_[multi];
    p = Path{};
    grid_mask_[multi] = 0;
    const int extra = static_cast<int>(multi ? Regime::kMultiQuery : Regime::kSingleQuery);
    for (int t = 0; t < kNumCostTerms; ++t) {
      const double w = weights_us_[t] + weights_us_[extra * kNumCostTerms + t];
      if (t < kNumPlainTerms) {
        p.plain[t] = w;
      } else if (w != 0) {
        if (t >= kGridBase) grid_mask_[multi] |= 1u << (t - kGridBase);
        p.hinge[p.num_hinges] = static_cast<uint8_t>(t);
        p.hinge_w[p.num_hinges++] = w;
      }
    }
  }
}

double CostModel::AttentionUs(const BatchAggregates& a) const {
  const Path& p = paths_[a.multi_query ? 1 : 0];
  const std::array<double, kNumPlainTerms> x = PlainTerms(a);
  static_assert(kNumPlainTerms == 7);  // one expression: the planner calls this per item
  double us = p.plain[0] * x[0] + p.plain[1] * x[1] + p.plain[2] * x[2] + p.plain[3] * x[3] +
              p.plain[4] * x[4] + p.plain[5] * x[5] + p.plain[6] * x[6];
  for (int i = 0; i < p.num_hinges; ++i) us += p.hinge_w[i] * TermValue(a, p.hinge[i]);
  return us;
}

double CostModel::AttentionUs(absl::Span<const RequestLoad> batch) const {
  return AttentionUs(Aggregate(batch));
}

BatchAggregates CostModel::Aggregate(absl::Span<const RequestLoad> batch) const {
  BatchAggregates agg;
  for (const RequestLoad& r : batch) agg.Add(r);
  FillGrid(batch, &agg, agg.multi_query ? 2u : 1u);  // only the launch this batch runs
  return agg;
}

void CostModel::FillGrid(absl::Span<const RequestLoad> batch, BatchAggregates* agg,
                         unsigned paths) const {
  if (!uses_grid()) return;
  // Each launch simulates only what its own path weighs (a makespan costs O(CTAs log SMs)).
  FillGridState(grid_, batch, grid_mask_[0], grid_mask_[1], paths, agg, grid_sim_);
}

CostModel CostModel::WithGridSimulation(GridSimulation sim) const {
  CostModel m = *this;
  m.grid_sim_ = sim;
  return m;
}

void FillGridState(const KernelGrid& grid, absl::Span<const RequestLoad> batch,
                   unsigned single_mask, unsigned multi_mask, unsigned paths,
                   BatchAggregates* agg, GridSimulation sim) {
  GridState& g = agg->grid;
  g = GridState{};
  if (!grid.enabled()) return;
  g.valid = true;
  g.ref_tokens = agg->query_tokens;
  g.ref_pairs = agg->query_key_pairs;
  if (paths == 3u && PathsShareLaunch(grid)) {  // one launch: simulate it once for both
    const GridTerms both = SimulateGrid(grid, batch, /*single_query_launch=*/false,
                                        single_mask | multi_mask, sim);
    g.at_ref[0] = KeepGridTerms(both, single_mask);
    g.at_ref[1] = KeepGridTerms(both, multi_mask);
    return;
  }
  if (paths & 1u) {
    g.at_ref[0] = SimulateGrid(grid, batch, /*single_query_launch=*/true, single_mask, sim);
  }
  if (paths & 2u) {
    g.at_ref[1] = SimulateGrid(grid, batch, /*single_query_launch=*/false, multi_mask, sim);
  }
}

CostModel CostModel::Scaled(double factor) const {
  CostModel m = *this;
  for (double& w : m.weights_us_) w *= factor;
  m.IndexActiveTerms();
  return m;
}

CostModel CostModel::WithCvMape(double cv_mape) const {
  CostModel m = *this;
  m.cv_mape_ = cv_mape;
  return m;
}

std::string CostModel::ToJson() const {
  nlohmann::json j;
  j["format"] = "dpbalance-cost-model";
  j["version"] = 1;
  j["name"] = name_;
  j["units"] = "us";
  if (grid_.enabled()) j["kernel_grid"] = grid_.Name();
  // A planner's sampled pricing of a reference model is written as the model it prices.
  if (grid_.enabled() && grid_sim_ == GridSimulation::kFast) {
    j["grid_simulation"] = std::string(GridSimulationName(grid_sim_));
  }
  if (cv_mape_ > 0) j["cv_mape"] = cv_mape_;
  for (int f = 0; f < kNumCostFeatures; ++f) j["weights_us"][FeatureName(f)] = weights_us_[f];
  return j.dump(2);
}

absl::StatusOr<CostModel> CostModel::FromJson(std::string_view text, std::string_view source_view) {
  const std::string source(source_view);  // this Abseil's StrCat takes absl::string_view only
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  if (j.value("format", "") != "dpbalance-cost-model" || j.value("version", 0) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": expected format 'dpbalance-cost-model' version 1, got '",
        j.value("format", ""), "' version ", j.value("version", 0)));
  }
  if (!j.contains("weights_us") || !j["weights_us"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": missing object 'weights_us'"));
  }
  KernelGrid grid;
  if (j.contains("kernel_grid")) {
    if (!j["kernel_grid"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": kernel_grid is not a string"));
    }
    absl::StatusOr<KernelGrid> g = KernelGrid::Named(j["kernel_grid"].get<std::string>());
    if (!g.ok()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", g.status().message()));
    grid = *g;
  }
  GridSimulation sim = GridSimulation::kReference;  // what every fit before the option used
  if (j.contains("grid_simulation")) {
    const nlohmann::json& v = j["grid_simulation"];
    absl::StatusOr<GridSimulation> named = absl::InvalidArgumentError("not a string");
    if (v.is_string()) named = GridSimulationNamed(v.get<std::string>());
    // "sampled" is how a planner prices a reference model, not a rule a fit was made under.
    if (!named.ok() || *named == GridSimulation::kSampledHeads) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": grid_simulation is ", v.dump(), ", expected \"reference\" or \"fast\""));
    }
    sim = *named;
  }
  Weights w{};
  for (auto it = j["weights_us"].begin(); it != j["weights_us"].end(); ++it) {
    int pos = -1;
    for (int f = 0; f < kNumCostFeatures; ++f) {
      if (FeatureName(f) == it.key()) pos = f;
    }
    if (pos < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": unknown feature 'weights_us.", it.key(), "'"));
    }
    if (!it.value().is_number()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": weights_us.", it.key(), " is not a number"));
    }
    w[pos] = it.value().get<double>();
  }
  double cv_mape = 0;
  if (j.contains("cv_mape")) {
    const nlohmann::json& v = j["cv_mape"];
    if (!v.is_number() || !(v.get<double>() >= 0 && v.get<double>() <= 10)) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": cv_mape is ", v.dump(), ", expected a fraction in 0..10"));
    }
    cv_mape = v.get<double>();
  }
  absl::StatusOr<CostModel> m = Create(w, absl::StrCat(j.value("name", "fitted"), "(", source, ")"), grid);
  if (!m.ok()) return m.status();
  return m->WithGridSimulation(sim).WithCvMape(cv_mape);
}

absl::StatusOr<CostModel> CostModel::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cost model file '", path, "' cannot be read"));
  std::stringstream ss;
  ss << in.rdbuf();
  return FromJson(ss.str(), path);
}

absl::StatusOr<CostModel> CostModel::FromSpec(std::string_view spec_view) {
  const std::string spec(spec_view);  // this absl's StrCat takes no std::string_view
  const size_t plus = spec.find('+');
  const std::string form = spec.substr(0, plus);
  if (form != "v1" && form != "v2") {
    if (plus != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cost model '", spec, "': a grid goes after v1 or v2 (e.g. v2+fa2-packed-h200)"));
    }
    return FromFile(spec);
  }
  CostModel m = form == "v1" ? PublishedV1() : PublishedV2();
  if (plus == std::string::npos) return m;
  absl::StatusOr<KernelGrid> grid = KernelGrid::Named(spec.substr(plus + 1));
  if (!grid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cost model '", spec, "': ", std::string(grid.status().message())));
  }
  return m.WithSeededGrid(*grid);
}

CostModel CostModel::WithSeededGrid(const KernelGrid& grid) const {
  Weights w = weights_us_;
  for (Regime r : {Regime::kSingleQuery, Regime::kMultiQuery}) {
    for (int j = 0; j < kNumGridMakespans; ++j) {
      const int base = FeatureIndex(Regime::kBase, CostTerm::kGrid0) + kGridMakespan0 + j;
      double& x = w[FeatureIndex(r, CostTerm::kGrid0) + kGridMakespan0 + j];
      if (x == 0 && w[base] == 0) x = kGridSeedUs;
    }
  }
  absl::StatusOr<CostModel> m = Create(w, absl::StrCat(name_, "+", grid.Name()), grid);
  return m.ok() ? *std::move(m) : *this;  // the weights were valid and the seeds are positive
}

absl::Status GlobalCost::Validate() const {
  const std::pair<const char*, double> fields[] = {{"ffn_fixed_us", ffn_fixed_us},
                                                   {"ffn_per_token_us", ffn_per_token_us},
                                                   {"step_overhead_us", step_overhead_us},
                                                   {"draft_per_step_us", draft_per_step_us}};
  for (const auto& [name, v] : fields) {
    if (!std::isfinite(v) || v < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("global cost: %s = %g must be finite and >= 0", name, v));
    }
  }
  return absl::OkStatus();
}

uint64_t GlobalCost::Hash() const {
  internal::Fnv1a h;
  h.Value(ffn_fixed_us);
  h.Value(ffn_per_token_us);
  h.Value(step_overhead_us);
  h.Value(draft_per_step_us);
  h.Value(padded_tokens);
  return h.digest();
}

double PublishedRankCost(PublishedForm form, const BatchAggregates& a) {
  const BatchAggregates one[] = {a};
  return PublishedInstanceCost(form, one);
}

PublishedTerms PublishedTermsOf(PublishedForm form, const BatchAggregates& a) {
  const double ctx_scale = form == PublishedForm::kV1 ? kV1CtxScale : kV2CtxScale;
  return {a.query_tokens, a.query_tokens + ctx_scale * a.query_key_pairs};
}

double PublishedCostOfMaxima(PublishedForm form, const PublishedTerms& m) {
  if (form == PublishedForm::kV1) return kV1BatchWeight * m.batch + kV1MixWeight * m.mix;
  return kV2Fixed + kV2BatchWeight * m.batch + kV2MixWeight * m.mix;
}

double PublishedInstanceCost(PublishedForm form, absl::Span<const BatchAggregates> ranks) {
  PublishedTerms maxima;
  for (const BatchAggregates& a : ranks) {
    const PublishedTerms t = PublishedTermsOf(form, a);
    maxima.batch = std::max(maxima.batch, t.batch);
    maxima.mix = std::max(maxima.mix, t.mix);
  }
  return PublishedCostOfMaxima(form, maxima);
}

}  // namespace dpbalance
