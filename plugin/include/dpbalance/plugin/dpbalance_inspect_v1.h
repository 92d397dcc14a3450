/* dpbalance inspection ABI, version 1. Released: never edit; add dpbalance_inspect_v2.h beside it.
 *
 * For a host that runs the plugin (dpbalance_plugin_v2.h, or v1) and wants two things beside it.
 * The library that exports `dpbalancePlugin_v2` also exports `dpbalanceInspect_v1`, a const
 * struct of function pointers:
 *
 *   check_flags(config, dp_size, error, error_bytes, settings, settings_bytes)
 *       at the engine's start, in every rank's process, before any rank plans: the DPB_* flags
 *       of the environment and `config` (the same string the host will give init) parsed and
 *       checked exactly as init does (every flag's value, DPB_COST_MODEL's file, DPB_METRICS_FILE's
 *       directory, the planner's settings for dp_size ranks), so a bad value is known before the
 *       engine says it is ready. Starts nothing: no balancer, exchange, thread or file.
 *   last_step(context, &info)
 *       after each report: what the plugin predicted for the plan that report named, beside the
 *       measured time, so the host can export the prediction error per step (a histogram)
 *       instead of BalancerStats' running mean.
 *
 * Results: dpbSuccess; dpbInvalidArgument with the reason written to `error` (check_flags) or for
 * a NULL argument. Nothing throws or blocks.
 */
#ifndef DPBALANCE_INSPECT_V1_H_
#define DPBALANCE_INSPECT_V1_H_

#include <stddef.h>
#include <stdint.h>

#include "dpbalance/plugin/dpbalance_plugin_v1.h" /* dpbResult_t */

#ifdef __cplusplus
extern "C" {
#endif

/* The step of the latest report of one plugin context. Times in microseconds. */
typedef struct {
  int64_t plan_id;                /* the plan the report named (ABI v2 plan_id); -1: no report yet */
  double predicted_attention_us;  /* this rank's predicted attention for it; < 0: none (the plan
                                     was not balanced, or is no longer known) */
  double measured_attention_us;   /* the attention time the report gave; < 0: no report yet */
  double planned_barrier_us;      /* the barrier the ranks agreed on for it; < 0: none */
  int32_t extend;                 /* nonzero: the step ran prefill tokens beside the plan, so
                                     its measured time includes work the prediction did not price */
} dpbStepInfo_v1_t;

typedef struct {
  const char* name;
  /* `config`: "key=value;..." as for init, may be NULL. `dp_size`: the DP ranks (>= 1).
   * `error`: error_bytes bytes for a NUL-terminated message, "" on success (cut to fit; NULL or
   * 0 bytes: not written). `settings`: the same for the settings in effect on success, as
   * space-separated name=value pairs (mode, k_max, default_k, cost_model, draft_us,
   * ffn_fixed_us, ffn_per_token_us, step_overhead_us, online, tpot_slo_ms, log_every,
   * metrics_file). */
  dpbResult_t (*check_flags)(const char* config, int32_t dp_size, char* error, size_t error_bytes,
                             char* settings, size_t settings_bytes);
  /* `context`: from either ABI's init. */
  dpbResult_t (*last_step)(void* context, dpbStepInfo_v1_t* out);
} dpbalanceInspect_v1_t;

#define DPB_INSPECT_SYMBOL_V1 "dpbalanceInspect_v1"

#ifdef __cplusplus
}
#endif

#endif /* DPBALANCE_INSPECT_V1_H_ */
