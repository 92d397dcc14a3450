/* Prints the C ABI v1 struct layouts (plugin, router and inspection) (offset and size of every field, and each struct's
 * size) so python_adapter_test.py can check the ctypes mirror against the compiler. */
#include <cstddef>
#include <cstdio>

#include "dpbalance/plugin/dpbalance_inspect_v1.h"
#include "dpbalance/plugin/dpbalance_inspect_v2.h"
#include "dpbalance/plugin/dpbalance_plugin_v1.h"
#include "dpbalance/plugin/dpbalance_router_v1.h"

#define FIELD(s, f) printf("%s %s %zu %zu\n", #s, #f, offsetof(s, f), sizeof(static_cast<s*>(nullptr)->f))
#define SIZE(s) printf("%s sizeof %zu %zu\n", #s, sizeof(s), sizeof(s))

int main() {
  FIELD(dpbInitArgs_v1_t, num_ranks);
  FIELD(dpbInitArgs_v1_t, rank);
  FIELD(dpbInitArgs_v1_t, config);
  FIELD(dpbInitArgs_v1_t, backend);
  FIELD(dpbInitArgs_v1_t, allgather_fn);
  FIELD(dpbInitArgs_v1_t, allgather_user);
  FIELD(dpbInitArgs_v1_t, nccl_comm);
  FIELD(dpbInitArgs_v1_t, cuda_stream);
  FIELD(dpbInitArgs_v1_t, nccl_unique_id);
  FIELD(dpbInitArgs_v1_t, cuda_device);
  SIZE(dpbInitArgs_v1_t);
  FIELD(dpbRequest_v1_t, request_id);
  FIELD(dpbRequest_v1_t, ctx_tokens);
  FIELD(dpbRequest_v1_t, k_min);
  FIELD(dpbRequest_v1_t, k_cap);
  FIELD(dpbRequest_v1_t, draft_confidence);
  FIELD(dpbRequest_v1_t, num_confidence);
  SIZE(dpbRequest_v1_t);
  FIELD(dpbAccepted_v1_t, request_id);
  FIELD(dpbAccepted_v1_t, verify_len);
  FIELD(dpbAccepted_v1_t, accepted);
  FIELD(dpbAccepted_v1_t, finished);
  SIZE(dpbAccepted_v1_t);
  FIELD(dpbStats_v1_t, steps);
  FIELD(dpbStats_v1_t, balanced_steps);
  FIELD(dpbStats_v1_t, fallbacks);
  FIELD(dpbStats_v1_t, enabled);
  FIELD(dpbStats_v1_t, bubble_fraction);
  FIELD(dpbStats_v1_t, bubble_us);
  FIELD(dpbStats_v1_t, predicted_error);
  FIELD(dpbStats_v1_t, tokens_per_step);
  FIELD(dpbStats_v1_t, goodput_tok_per_s);
  FIELD(dpbStats_v1_t, ab_on_epochs);
  FIELD(dpbStats_v1_t, ab_off_epochs);
  FIELD(dpbStats_v1_t, ab_on_bubble);
  FIELD(dpbStats_v1_t, ab_on_bubble_ci95);
  FIELD(dpbStats_v1_t, ab_on_goodput);
  FIELD(dpbStats_v1_t, ab_on_goodput_ci95);
  FIELD(dpbStats_v1_t, ab_off_bubble);
  FIELD(dpbStats_v1_t, ab_off_bubble_ci95);
  FIELD(dpbStats_v1_t, ab_off_goodput);
  FIELD(dpbStats_v1_t, ab_off_goodput_ci95);
  SIZE(dpbStats_v1_t);
  FIELD(dpbalancePlugin_v1_t, name);
  FIELD(dpbalancePlugin_v1_t, init);
  FIELD(dpbalancePlugin_v1_t, plan);
  FIELD(dpbalancePlugin_v1_t, report);
  FIELD(dpbalancePlugin_v1_t, stats);
  FIELD(dpbalancePlugin_v1_t, finalize);
  SIZE(dpbalancePlugin_v1_t);
  FIELD(dpbRouterArgs_v1_t, num_ranks);
  FIELD(dpbRouterArgs_v1_t, config);
  SIZE(dpbRouterArgs_v1_t);
  FIELD(dpbRankLoad_v1_t, num_requests);
  FIELD(dpbRankLoad_v1_t, max_requests);
  FIELD(dpbRankLoad_v1_t, ctx_tokens);
  FIELD(dpbRankLoad_v1_t, max_ctx_tokens);
  FIELD(dpbRankLoad_v1_t, reserved_tokens);
  FIELD(dpbRankLoad_v1_t, capacity_tokens);
  SIZE(dpbRankLoad_v1_t);
  FIELD(dpbalanceRouter_v1_t, name);
  FIELD(dpbalanceRouter_v1_t, create);
  FIELD(dpbalanceRouter_v1_t, route);
  FIELD(dpbalanceRouter_v1_t, observe_finished);
  FIELD(dpbalanceRouter_v1_t, destroy);
  SIZE(dpbalanceRouter_v1_t);
  FIELD(dpbStepInfo_v1_t, plan_id);
  FIELD(dpbStepInfo_v1_t, predicted_attention_us);
  FIELD(dpbStepInfo_v1_t, measured_attention_us);
  FIELD(dpbStepInfo_v1_t, planned_barrier_us);
  FIELD(dpbStepInfo_v1_t, extend);
  SIZE(dpbStepInfo_v1_t);
  FIELD(dpbalanceInspect_v1_t, name);
  FIELD(dpbalanceInspect_v1_t, check_flags);
  FIELD(dpbalanceInspect_v1_t, last_step);
  SIZE(dpbalanceInspect_v1_t);
  FIELD(dpbStepTerms_v1_t, ffn_fixed_us);
  FIELD(dpbStepTerms_v1_t, ffn_per_token_us);
  FIELD(dpbStepTerms_v1_t, draft_us);
  FIELD(dpbStepTerms_v1_t, step_overhead_us);
  FIELD(dpbStepTerms_v1_t, online);
  FIELD(dpbStepTerms_v1_t, per_token_learnt);
  FIELD(dpbStepTerms_v1_t, draft_learnt);
  FIELD(dpbStepTerms_v1_t, reserved);
  FIELD(dpbStepTerms_v1_t, rows);
  FIELD(dpbStepTerms_v1_t, fits);
  FIELD(dpbStepTerms_v1_t, resets);
  SIZE(dpbStepTerms_v1_t);
  FIELD(dpbalanceInspect_v2_t, name);
  FIELD(dpbalanceInspect_v2_t, check_flags);
  FIELD(dpbalanceInspect_v2_t, last_step);
  FIELD(dpbalanceInspect_v2_t, step_terms);
  SIZE(dpbalanceInspect_v2_t);
  return 0;
}
