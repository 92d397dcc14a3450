/* dpbalance plugin ABI, version 2. Released with 0.2: never edit; add a v3 header beside it.
 *
 * Self-contained C header (stdint.h/stddef.h only, plus the v1 header for the shared result and
 * backend enums). The shared library exports `dpbalancePlugin_v2` beside `dpbalancePlugin_v1`;
 * both are served by one implementation. What v2 adds, for engines as they are today
 * (docs/engines.md):
 *   - every DP rank's token total for the step and the agreed padded tier, computed identically
 *     on every rank from the one exchange, so the engine fills its own DP sync's token counts and
 *     padding from `plan`'s result with no second collective;
 *   - a verify-token budget per rank (granularity dpbGranularityBudget) for engines that spread
 *     the budget over their requests by their own confidence scores;
 *   - opaque request ids (the engines' strings), attention-TP groups (several processes per DP
 *     rank that must get the same plan), steps without verify work (idle, extend/prefill, skipped
 *     verify) that still join the exchange, and callback collectives that pass both sizes.
 *
 * Per engine step, on every process of every DP rank, in lockstep (the exchange is a collective):
 *     plan(ctx, &step, &result)     before the verify forward (see "Lookahead" below)
 *     ... verify forward, MoE layers, accept/reject ...
 *     report(ctx, &report)          after the accept counts are known
 * `plan` runs the exchange on every call whatever the step kind, so ranks never fall out of step.
 * Each `plan` returns a plan_id; `report` names the plan it reports. Up to two plans may be
 * outstanding, for engines that schedule step t+1 before step t's results are in (SGLang's
 * overlap scheduler, vLLM's async scheduling): their report of step t comes after the plan of
 * step t+1. Reports may come in any order (each settles only the plan it names: SGLang reports
 * a step where every rank was idle at once, while the batch before it is still in flight); a
 * plan that would leave three outstanding drops the oldest (counted as missing_reports; its
 * measurements are unknown to every rank); a report for a plan that is not outstanding is
 * refused (dpbInvalidArgument) and changes nothing.
 *
 * Failure contract (as v1): anything but dpbSuccess means "use the engine's default verify
 * lengths"; `plan` always fills result->verify_len (the defaults min(default_k, k_cap) when not
 * balancing) and never blocks longer than DPB_TIMEOUT_MS in the exchange. When the exchange
 * itself failed, rank_tokens[] of the other ranks is -1 (unknown) and the engine must run its own
 * sync for the step.
 *
 * Token totals: without tiers, rank_tokens[r] = sum over rank r's requests of (1 + verify_len)
 * plus rank r's extra_tokens, exactly (rank r's own result adds up to it): what an engine that
 * packs the ranks' tokens (SGLang's SUM_LEN) needs. With tiers (token_tiers or DPB_TIERS with
 * DPB_PADDED=1: an engine that pads every rank to one size, SGLang's MAX_LEN under CUDA graphs,
 * vLLM) every planned rank that verifies runs the agreed tier: rank_tokens[r] is the tier plus
 * its extra_tokens, the rank's own verify work (sum of 1 + verify_len) stays within the tier, the
 * tier's spare tokens go to verify work where it pays, and padding rows make up the rest. A rank
 * not planned this step (defaults, fallback) says its exact total either way. padded_tokens is
 * the smallest configured tier >= max_r rank_tokens[r] (the max itself without tiers or above
 * the largest tier): the per-rank size for the engine's DP padding.
 *
 * Attention TP: with attn_tp_size > 1 the group is dp_size * attn_tp_size processes in the order
 * (dp_rank, attn_tp_rank), as SGLang's (dp, attn_tp, W) gather. Every process of one DP rank gets
 * the same plan because all of them compute it from identical inputs: the same batch and accept
 * counts (the engine passes them to every member), and the measured times of the member with
 * attn_tp_rank 0 (carried in the exchange), never their own. Each record carries a digest of its
 * planning inputs; if the members of a DP rank disagree, that DP rank falls back to the defaults
 * on all its members in the same step (counted as tp_mismatches).
 *
 * Lookahead: an engine that drafts step t+1 at the end of step t (vLLM) or sees ctx one step late
 * (SGLang's overlap scheduler) calls plan with what it has when it fixes the verify lengths:
 * ctx_tokens as known then (possibly one step old) and k_cap = the drafts available. The plan is
 * then for that stale view; docs/engines.md and the replay's --stale_steps give its cost.
 */
#ifndef DPBALANCE_PLUGIN_V2_H_
#define DPBALANCE_PLUGIN_V2_H_

#include <stddef.h>
#include <stdint.h>

#include "dpbalance/plugin/dpbalance_plugin_v1.h" /* dpbResult_t, dpbBackend_t */

#ifdef __cplusplus
extern "C" {
#endif

#define DPB_PLUGIN_ABI_VERSION_2 2

/* Gathers `send` (send_bytes) from every process of the group into `recv` in group order.
 * recv_bytes = group size * send_bytes is the capacity of `recv`: the callback must never write
 * past it. Returns the number of bytes written into `recv` (the plugin checks it equals
 * recv_bytes), or a negative value on failure or timeout (timeout_ms). */
typedef int64_t (*dpbAllGatherFn_v2_t)(void* user, const void* send, size_t send_bytes, void* recv,
                                       size_t recv_bytes, int32_t timeout_ms);

typedef enum {
  dpbGranularityRequest = 0, /* the plugin sets each request's verify length */
  dpbGranularityBudget = 1   /* the plugin sets this rank's verify-token budget; the engine spreads
                                it over its requests by their draft confidence, best first */
} dpbGranularity_t;

typedef struct {
  uint32_t struct_size;             /* sizeof(dpbInitArgs_v2_t) */
  int32_t dp_size;                  /* DP ranks */
  int32_t dp_rank;                  /* 0..dp_size-1 */
  int32_t attn_tp_size;             /* processes per DP rank that call the plugin (>= 1) */
  int32_t attn_tp_rank;             /* 0..attn_tp_size-1; 0 measures for the DP rank */
  const char* config;               /* flags "key=value;...", may be NULL (docs/flags.md) */
  dpbBackend_t backend;
  dpbAllGatherFn_v2_t allgather_fn; /* dpbBackendCallback */
  void* allgather_user;
  void* nccl_comm;                  /* dpbBackendNccl: as v1 */
  void* cuda_stream;
  const void* nccl_unique_id;
  int32_t cuda_device;
  const int32_t* token_tiers;       /* per-rank token sizes the engine captured, ascending; NULL:
                                       DPB_TIERS. Enables padded planning (DPB_PADDED=1). */
  int32_t num_token_tiers;
  dpbGranularity_t granularity;
} dpbInitArgs_v2_t;

typedef struct {
  const void* id;                   /* opaque request id (e.g. the engine's string), stable for
                                       the request's lifetime; not copied past the call */
  int32_t id_bytes;                 /* 1..4096 */
  int64_t ctx_tokens;               /* tokens in KV before this step, as the engine knows them */
  int32_t k_min;                    /* floor on verify length */
  int32_t k_cap;                    /* cap: drafts available, <= tokens the request may still emit - 1 */
  const float* draft_confidence;    /* optional per-position confidence, or NULL */
  int32_t num_confidence;
} dpbRequest_v2_t;

typedef enum {
  dpbStepDecode = 0,   /* decode requests to verify (num_requests may be 0) */
  dpbStepIdle = 1,     /* no work on this rank (a dummy batch); num_requests must be 0 */
  dpbStepExtend = 2,   /* prefill or mixed: extra_tokens of prefill, plus any decode requests */
  dpbStepNoVerify = 3  /* the engine skips verify this step: every verify_len is 0 */
} dpbStepKind_t;

typedef struct {
  dpbStepKind_t kind;
  const dpbRequest_v2_t* requests;
  int32_t num_requests;
  int64_t kv_free_tokens;           /* KV tokens left for extra verify tokens; < 0: unlimited */
  int64_t extra_tokens;             /* query tokens this rank runs beside verify (prefill), >= 0 */
} dpbStep_v2_t;

/* rank_flags bits */
#define DPB_RANK_PLANNED 1u   /* the rank's record was usable and it was planned */
#define DPB_RANK_EXTEND 2u    /* the rank runs prefill tokens this step */
#define DPB_RANK_NO_VERIFY 4u /* the rank skips verify this step */
#define DPB_RANK_IDLE 8u      /* the rank has no work */
#define DPB_RANK_UNKNOWN 16u  /* nothing is known of the rank this step (exchange failed) */

typedef struct {
  /* caller-owned outputs, sized by the caller: */
  int32_t* verify_len;              /* [num_requests] */
  int64_t* rank_tokens;             /* [dp_size] or NULL: each DP rank's token total, -1 unknown */
  uint32_t* rank_flags;             /* [dp_size] or NULL: DPB_RANK_* */
  /* filled by plan: */
  int32_t draft_depth;              /* the agreed draft depth */
  int32_t verify_budget;            /* this rank's verify tokens: sum of verify_len */
  int64_t padded_tokens;            /* agreed per-rank padded size (see "Token totals") */
  uint32_t any_rank_flags;          /* OR of every rank's flags (e.g. some rank extends) */
  int32_t balanced;                 /* nonzero: balanced lengths; zero: defaults */
  int64_t plan_id;                  /* this plan, for its report */
} dpbPlanResult_v2_t;

typedef struct {
  const void* id;
  int32_t id_bytes;
  int32_t verify_len;               /* drafts verified this step */
  int32_t accepted;                 /* 0..verify_len */
  int32_t finished;                 /* nonzero: the request left the batch */
} dpbAccepted_v2_t;

typedef struct {
  int64_t plan_id;                  /* the plan this reports (dpbPlanResult_v2_t.plan_id) */
  double attention_us;              /* measured attention time of the step on this process */
  double step_us;                   /* measured step time */
  const dpbAccepted_v2_t* accepted;
  int32_t num_accepted;
} dpbReport_v2_t;

typedef struct {
  dpbStats_v1_t v1;                 /* as v1 */
  int64_t missing_reports;          /* plans never reported (dropped from the outstanding two) */
  int64_t tp_mismatches;            /* steps where this DP rank's attn-TP members disagreed */
  int64_t exchange_failures;        /* exchanges that failed or timed out */
  double max_exchange_ms;           /* longest exchange (handshake included) */
} dpbStats_v2_t;

typedef struct {
  uint32_t abi_version;             /* DPB_PLUGIN_ABI_VERSION_2 */
  const char* name;
  dpbResult_t (*init)(const dpbInitArgs_v2_t* args, void** context);
  dpbResult_t (*plan)(void* context, const dpbStep_v2_t* step, dpbPlanResult_v2_t* result);
  dpbResult_t (*report)(void* context, const dpbReport_v2_t* report);
  dpbResult_t (*stats)(void* context, dpbStats_v2_t* out);
  dpbResult_t (*finalize)(void* context);
} dpbalancePlugin_v2_t;

#ifdef __cplusplus
}
#endif

#endif /* DPBALANCE_PLUGIN_V2_H_ */
