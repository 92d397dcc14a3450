/* dpbalance inspection ABI, version 2. Released: never edit; add dpbalance_inspect_v3.h beside it.
 * Version 1's two functions (dpbalance_inspect_v1.h), unchanged, and one more:
 *   step_terms(context, &terms)
 *       the step terms the plugin prices with now (the MoE FFN and EP time per step, fixed and per
 *       instance token, the draft time per draft step, the per-step overhead): learnt online from
 *       the engine's step cycle when DPB_LEARN_STEP_TERMS=1 (the default), with the DPB_FFN_*,
 *       DPB_DRAFT_US and DPB_STEP_OVERHEAD_US flags as the fit's prior; otherwise the flags.
 * The library exports `dpbalanceInspect_v2` beside `dpbalanceInspect_v1`.
 */
#ifndef DPBALANCE_INSPECT_V2_H_
#define DPBALANCE_INSPECT_V2_H_

#include <stddef.h>
#include <stdint.h>

#include "dpbalance/plugin/dpbalance_inspect_v1.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Microseconds. */
typedef struct {
  double ffn_fixed_us;       /* per step, whatever its tokens (FFN at zero tokens, EP, scheduling) */
  double ffn_per_token_us;   /* per instance query token */
  double draft_us;           /* per draft step of the agreed depth */
  double step_overhead_us;   /* per step: learnt, dpbalance's own time per exchanged step */
  int32_t online;            /* nonzero: learnt online (the rest of this struct says how far) */
  int32_t per_token_learnt;  /* nonzero: the latest fit learnt ffn_per_token_us (else: the flag) */
  int32_t draft_learnt;      /* nonzero: the latest fit learnt draft_us (else: the flag, or less) */
  int32_t reserved;          /* 0 */
  int64_t rows;              /* measured steps fitted since the last reset */
  int64_t fits;
  int64_t resets;            /* the ranks' terms differed and all went back to the flags */
} dpbStepTerms_v1_t;

typedef struct {
  const char* name;
  dpbResult_t (*check_flags)(const char* config, int32_t dp_size, char* error, size_t error_bytes,
                             char* settings, size_t settings_bytes);
  dpbResult_t (*last_step)(void* context, dpbStepInfo_v1_t* out);
  dpbResult_t (*step_terms)(void* context, dpbStepTerms_v1_t* out);
} dpbalanceInspect_v2_t;

#define DPB_INSPECT_SYMBOL_V2 "dpbalanceInspect_v2"

#ifdef __cplusplus
}
#endif

#endif /* DPBALANCE_INSPECT_V2_H_ */
