/* dpbalance plugin ABI, version 1. Released: never edit; add dpbalance_plugin_v2.h beside it.
 *
 * Self-contained C header (stdint.h/stddef.h only). The shared library exports exactly one
 * symbol, `dpbalancePlugin_v1`, a const struct of function pointers. Every function returns a
 * dpbResult_t; anything but dpbSuccess means "use the engine's default verify length for this
 * step" -- the plugin never crashes or blocks the engine because of its own failure, and `plan`
 * always fills `verify_len` (with the default length when not balancing).
 *
 * Per decode step, on every DP rank, before the target model's verify forward:
 *     plan(ctx, requests, n, kv_free_tokens, verify_len, &draft_depth)
 *     ... verify forward, MoE layers, accept/reject ...
 *     report(ctx, attention_us, step_us, accepted, n)
 * All ranks must call plan once per step, in lockstep (as the MoE layers already force).
 *
 * Flags: the `config` string ("key=value;key=value", keys as in docs/flags.md without the DPB_
 * prefix, lower case) overrides DPB_* environment variables. Unknown or malformed flags make
 * init fail with dpbInvalidArgument, naming the flag in the log.
 */
#ifndef DPBALANCE_PLUGIN_V1_H_
#define DPBALANCE_PLUGIN_V1_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  dpbSuccess = 0,
  dpbFallback = 1,         /* default verify lengths were returned (see the log) */
  dpbInvalidArgument = 2,  /* bad argument or flag */
  dpbInternalError = 3,
  dpbDisabled = 4          /* balancing is off on this rank (mismatch, repeated failures) */
} dpbResult_t;

/* How ranks exchange their 512-byte summaries. */
typedef enum {
  dpbBackendFromFlags = 0, /* DPB_BACKEND */
  dpbBackendInProcess = 1, /* ranks are threads of one process, grouped by DPB_GROUP */
  dpbBackendCallback = 2,  /* allgather_fn below (e.g. the engine's gloo CPU group) */
  dpbBackendNccl = 3       /* nccl_comm + cuda_stream, or a comm created from nccl_unique_id */
} dpbBackend_t;

/* Returns 0 on success. `recv` holds num_ranks * record_bytes bytes, rank order. */
typedef int (*dpbAllGatherFn_v1_t)(void* user, const void* send, void* recv, size_t record_bytes,
                                   int32_t timeout_ms);

typedef struct {
  int32_t num_ranks;               /* DP size */
  int32_t rank;                    /* this rank, 0..num_ranks-1 */
  const char* config;              /* flags, may be NULL */
  dpbBackend_t backend;
  dpbAllGatherFn_v1_t allgather_fn; /* dpbBackendCallback */
  void* allgather_user;
  void* nccl_comm;                 /* ncclComm_t, borrowed; NULL: create from nccl_unique_id */
  void* cuda_stream;               /* cudaStream_t, borrowed; NULL: the plugin's own */
  const void* nccl_unique_id;      /* 128-byte ncclUniqueId for the plugin's own communicator */
  int32_t cuda_device;             /* device for the plugin's own communicator, -1: current */
} dpbInitArgs_v1_t;

typedef struct {
  int64_t request_id;              /* stable for the request's lifetime */
  int64_t ctx_tokens;              /* tokens in KV before this step */
  int32_t k_min;                   /* floor on verify length (e.g. an SLO) */
  int32_t k_cap;                   /* cap: min(draft depth, tokens the request may still emit - 1) */
  const float* draft_confidence;   /* optional: per-position acceptance confidence, or NULL */
  int32_t num_confidence;
} dpbRequest_v1_t;

typedef struct {
  int64_t request_id;
  int32_t verify_len;              /* drafts verified this step */
  int32_t accepted;                /* drafts accepted (0..verify_len) */
  int32_t finished;                /* nonzero: the request left the batch */
} dpbAccepted_v1_t;

typedef struct {
  int64_t steps, balanced_steps, fallbacks;
  int32_t enabled;
  double bubble_fraction;          /* instance, measured: 1 - mean/max attention time */
  double bubble_us;                /* mean idle per rank per step, measured */
  double predicted_error;          /* mean |predicted - measured| / measured attention, this rank */
  double tokens_per_step;          /* instance */
  double goodput_tok_per_s;        /* instance */
  int64_t ab_on_epochs, ab_off_epochs;
  double ab_on_bubble, ab_on_bubble_ci95, ab_on_goodput, ab_on_goodput_ci95;
  double ab_off_bubble, ab_off_bubble_ci95, ab_off_goodput, ab_off_goodput_ci95;
} dpbStats_v1_t;

typedef struct {
  const char* name;
  dpbResult_t (*init)(const dpbInitArgs_v1_t* args, void** context);
  /* Fills verify_len[0..num_requests) and *draft_depth (the depth every rank agreed on).
   * kv_free_tokens: tokens of KV capacity this rank has left for extra verify tokens; negative
   * means unlimited. */
  dpbResult_t (*plan)(void* context, const dpbRequest_v1_t* requests, int32_t num_requests,
                      int64_t kv_free_tokens, int32_t* verify_len, int32_t* draft_depth);
  dpbResult_t (*report)(void* context, double attention_us, double step_us,
                        const dpbAccepted_v1_t* accepted, int32_t num_accepted);
  dpbResult_t (*stats)(void* context, dpbStats_v1_t* out);
  dpbResult_t (*finalize)(void* context);
} dpbalancePlugin_v1_t;

#ifdef __cplusplus
}
#endif

#endif /* DPBALANCE_PLUGIN_V1_H_ */
