// dpbalance/step_terms.h — the instance step's non-attention terms (GlobalCost), learned online.
//
// Contract
// - The planner prices a step as the slowest rank's attention plus GlobalCost::StepUs: the MoE
//   FFN and EP communication (fixed, and per instance token), the draft (per draft step) and a
//   per-step overhead. The flags give those terms; they are the H200's by default, wrong on any
//   other machine, and the goodput objective multiplies every attention saving by them.
//   `OnlineStepTerms` learns them from measured steps, the flags serving as its prior.
// - A row is one exchanged step of the instance: its engine cycle (plan call to next plan call,
//   the median over ranks), minus the slowest rank's measured attention, minus the largest
//   plugin time per step among the ranks (own_us), against the step's FFN tokens and draft
//   depth. Every rank builds the same rows from the same gathered records, so every rank fits
//   the same terms (the Balancer compares digests every step, and all ranks reset together to the
//   prior when they differ: the agreed draft depth depends on these terms).
// - Fit: over the last `window` rows, least squares of other_us on [1, ffn_tokens, depth] with
//   non-negative coefficients and a ridge towards the prior worth `prior_rows` rows of what the
//   window tells about each term (it steadies the first fits and pulls each term by about
//   prior_rows / rows of its distance from the prior); rows whose
//   residual lies beyond `outlier_sigmas` robust sigmas (1.4826 x MAD, at least 1% of the median
//   row) of the first pass are dropped and the fit repeated (an idle gap before a plan, a stall,
//   a GC pause).
//   A feature the window does not vary (every row at one depth: the per-step draft cost is then
//   inseparable from the fixed term) keeps its prior value; the fixed term takes the rest.
// - Learned: ffn_fixed_us (the engine's constant per step: FFN at zero tokens, EP, scheduling,
//   sampling), ffn_per_token_us, draft_per_step_us (only when `learn_draft`), step_overhead_us =
//   the median of the rows' plugin time (what dpbalance itself adds to a step). padded_tokens is
//   the prior's.
// - Deterministic: the same rows in the same order give the same bits on every rank.
//   Not thread-safe (one per Balancer).
#pragma once

#include <cstdint>
#include <vector>

#include "dpbalance/cost_model.h"

namespace dpbalance {

struct StepTermsRow {
  double ffn_tokens = 0;  // tokens the FFN term is charged for (GlobalCost::StepUs's argument)
  int draft_depth = 0;    // draft steps priced globally (0 when the depth is per rank)
  double other_us = 0;    // cycle - slowest attention - plugin time
  double plugin_us = 0;   // the largest plugin time per step among the ranks (own_us)
};

class OnlineStepTerms {
 public:
  struct Options {
    int window = 512;            // rows the fit sees (the newest)
    int refit_every = 16;        // rows between fits
    int min_rows = 16;           // rows before the first fit (until then: the prior)
    double prior_rows = 0.5;     // the prior's weight, in rows at the mean row
    double outlier_sigmas = 4;   // a row this many robust sigmas off the first pass is dropped
    int min_varied_rows = 8;     // a feature is learnt when at least this many rows
    double min_varied_share = 0.05;  // (and this share of the window) differ from its mode
  };
  OnlineStepTerms(const GlobalCost& prior, bool learn_draft, Options options);
  OnlineStepTerms(const GlobalCost& prior, bool learn_draft)
      : OnlineStepTerms(prior, learn_draft, Options{}) {}

  // One measured step; rows with a non-finite field or negative tokens, depth or plugin time are
  // ignored (returns false). Returns true when a fit ran and changed the terms.
  bool Observe(const StepTermsRow& row);
  // The terms the planner prices with now (the prior until the first fit).
  const GlobalCost& terms() const { return terms_; }
  const GlobalCost& prior() const { return prior_; }
  // A digest of terms()'s bits, never 0: ranks send it and compare.
  uint32_t Digest() const { return digest_; }
  // Back to the prior, every row forgotten (the ranks' digests differed).
  void Reset();

  int64_t rows() const { return rows_seen_; }          // rows observed since the last reset
  // Whether the fit has seen enough rows to stand on (4 x min_rows since the last reset): the
  // Balancer lets quiet mode skip exchanges, which add no rows, only then.
  bool settled() const { return rows_seen_ >= 4 * static_cast<int64_t>(options_.min_rows); }
  int64_t fits() const { return fits_; }               // fits run since the last reset
  int64_t resets() const { return resets_; }
  int64_t outliers() const { return last_outliers_; }  // rows the latest fit dropped
  double residual_sigma_us() const { return sigma_us_; }  // the latest fit's robust sigma
  // Which terms the latest fit learnt (the rest kept the prior).
  bool learnt_per_token() const { return learnt_per_token_; }
  bool learnt_draft() const { return learnt_draft_; }

 private:
  void Fit();
  void Publish();

  GlobalCost prior_, terms_;
  bool learn_draft_;
  Options options_;
  std::vector<StepTermsRow> ring_;  // the newest `window` rows, oldest at next_ once full
  size_t next_ = 0;
  int64_t rows_seen_ = 0, since_fit_ = 0, fits_ = 0, resets_ = 0, last_outliers_ = 0;
  double sigma_us_ = 0;
  bool learnt_per_token_ = false, learnt_draft_ = false;
  uint32_t digest_ = 1;
};

}  // namespace dpbalance
