/* dpbalance router ABI, version 1. Released: never edit; add dpbalance_router_v2.h beside it.
 *
 * For an engine's DP router, the process that sends each new request to one DP rank (SGLang's
 * data-parallel controller, vLLM's DP load balancer): the request-level strategies A-E of
 * docs/design.md ("Routing"), the same `Router` code the replay runs. The library that exports
 * `dpbalancePlugin_v1` also exports `dpbalanceRouter_v1`, a const struct of function pointers.
 *
 *     create(&args, &router)                       once; flags as below
 *     route(router, loads, n, input, output, &rank) for every new request
 *     observe_finished(router, output_tokens)     for every finished request (E's mean output)
 *     destroy(router)
 *
 * Results: dpbSuccess with *rank in 0..num_ranks-1; dpbFallback with *rank = -1 when no rank has
 * the KV capacity or batch room for the request (it waits, as in the replay); anything else
 * (dpbInvalidArgument, dpbInternalError) with *rank = -1 means "route by the engine's own rule",
 * and the log names the value. Nothing throws or blocks. A router is not thread-safe (C keeps a
 * window of recent lengths, E a running mean): one per routing thread.
 *
 * Flags: DPB_ROUTING (A, B, C, D or E; default E), DPB_Z, DPB_GROUPS, DPB_GROUP_CHOICE,
 * DPB_SPLIT_PERCENTILE, DPB_SPLIT_WINDOW, DPB_ROUTE_QUERY_TOKENS, DPB_ROUTE_INITIAL_OUTPUT, and
 * DPB_COST_MODEL (E prices with the planner's model), overridden by `config` as for the plugin
 * (docs/flags.md). E reads each rank's sums and its longest context; a model's kernel-grid
 * terms, which need every request of the rank, are not used for routing.
 */
#ifndef DPBALANCE_ROUTER_V1_H_
#define DPBALANCE_ROUTER_V1_H_

#include <stddef.h>
#include <stdint.h>

#include "dpbalance/plugin/dpbalance_plugin_v1.h" /* dpbResult_t */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int32_t num_ranks;     /* DP size */
  const char* config;    /* flags, may be NULL */
} dpbRouterArgs_v1_t;

/* One rank's load as the router sees it, now. */
typedef struct {
  int32_t num_requests;     /* requests on the rank */
  int32_t max_requests;     /* its batch cap; 0: none */
  int64_t ctx_tokens;       /* sum of its requests' current contexts (token usage) */
  int64_t max_ctx_tokens;   /* its longest context (a fitted model's critical-path terms); 0: unknown */
  int64_t reserved_tokens;  /* KV reserved: contexts + the outputs still to come */
  int64_t capacity_tokens;  /* KV capacity */
} dpbRankLoad_v1_t;

typedef struct {
  const char* name;
  dpbResult_t (*create)(const dpbRouterArgs_v1_t* args, void** router);
  /* `loads[0..num_ranks)`, rank order; `output_tokens` is the request's KV footprint beyond its
   * input (engines reserve max_tokens). */
  dpbResult_t (*route)(void* router, const dpbRankLoad_v1_t* loads, int32_t num_ranks,
                       int64_t input_tokens, int64_t output_tokens, int32_t* rank);
  dpbResult_t (*observe_finished)(void* router, int64_t output_tokens);
  dpbResult_t (*destroy)(void* router);
} dpbalanceRouter_v1_t;

#define DPB_ROUTER_SYMBOL_V1 "dpbalanceRouter_v1"

#ifdef __cplusplus
}
#endif

#endif /* DPBALANCE_ROUTER_V1_H_ */
