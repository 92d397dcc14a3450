/* Prints the C ABI v2 struct layouts (offset and size of every field, and each struct's size) so
 * contract_test.py can check the Python adapter's ctypes mirror against the compiler, as
 * abi_layout.cc does for v1. */
#include <cstddef>
#include <cstdio>

#include "dpbalance/plugin/dpbalance_plugin_v2.h"

#define FIELD(s, f) printf("%s %s %zu %zu\n", #s, #f, offsetof(s, f), sizeof(static_cast<s*>(nullptr)->f))
#define SIZE(s) printf("%s sizeof %zu %zu\n", #s, sizeof(s), sizeof(s))
#define ENUM(e) printf("enum %s %d %d\n", #e, static_cast<int>(e), static_cast<int>(e))

int main() {
  FIELD(dpbInitArgs_v2_t, struct_size);
  FIELD(dpbInitArgs_v2_t, dp_size);
  FIELD(dpbInitArgs_v2_t, dp_rank);
  FIELD(dpbInitArgs_v2_t, attn_tp_size);
  FIELD(dpbInitArgs_v2_t, attn_tp_rank);
  FIELD(dpbInitArgs_v2_t, config);
  FIELD(dpbInitArgs_v2_t, backend);
  FIELD(dpbInitArgs_v2_t, allgather_fn);
  FIELD(dpbInitArgs_v2_t, allgather_user);
  FIELD(dpbInitArgs_v2_t, nccl_comm);
  FIELD(dpbInitArgs_v2_t, cuda_stream);
  FIELD(dpbInitArgs_v2_t, nccl_unique_id);
  FIELD(dpbInitArgs_v2_t, cuda_device);
  FIELD(dpbInitArgs_v2_t, token_tiers);
  FIELD(dpbInitArgs_v2_t, num_token_tiers);
  FIELD(dpbInitArgs_v2_t, granularity);
  SIZE(dpbInitArgs_v2_t);
  FIELD(dpbRequest_v2_t, id);
  FIELD(dpbRequest_v2_t, id_bytes);
  FIELD(dpbRequest_v2_t, ctx_tokens);
  FIELD(dpbRequest_v2_t, k_min);
  FIELD(dpbRequest_v2_t, k_cap);
  FIELD(dpbRequest_v2_t, draft_confidence);
  FIELD(dpbRequest_v2_t, num_confidence);
  SIZE(dpbRequest_v2_t);
  FIELD(dpbStep_v2_t, kind);
  FIELD(dpbStep_v2_t, requests);
  FIELD(dpbStep_v2_t, num_requests);
  FIELD(dpbStep_v2_t, kv_free_tokens);
  FIELD(dpbStep_v2_t, extra_tokens);
  SIZE(dpbStep_v2_t);
  FIELD(dpbPlanResult_v2_t, verify_len);
  FIELD(dpbPlanResult_v2_t, rank_tokens);
  FIELD(dpbPlanResult_v2_t, rank_flags);
  FIELD(dpbPlanResult_v2_t, draft_depth);
  FIELD(dpbPlanResult_v2_t, verify_budget);
  FIELD(dpbPlanResult_v2_t, padded_tokens);
  FIELD(dpbPlanResult_v2_t, any_rank_flags);
  FIELD(dpbPlanResult_v2_t, balanced);
  FIELD(dpbPlanResult_v2_t, plan_id);
  SIZE(dpbPlanResult_v2_t);
  FIELD(dpbAccepted_v2_t, id);
  FIELD(dpbAccepted_v2_t, id_bytes);
  FIELD(dpbAccepted_v2_t, verify_len);
  FIELD(dpbAccepted_v2_t, accepted);
  FIELD(dpbAccepted_v2_t, finished);
  SIZE(dpbAccepted_v2_t);
  FIELD(dpbReport_v2_t, plan_id);
  FIELD(dpbReport_v2_t, attention_us);
  FIELD(dpbReport_v2_t, step_us);
  FIELD(dpbReport_v2_t, accepted);
  FIELD(dpbReport_v2_t, num_accepted);
  SIZE(dpbReport_v2_t);
  FIELD(dpbStats_v2_t, v1);
  FIELD(dpbStats_v2_t, missing_reports);
  FIELD(dpbStats_v2_t, tp_mismatches);
  FIELD(dpbStats_v2_t, exchange_failures);
  FIELD(dpbStats_v2_t, max_exchange_ms);
  SIZE(dpbStats_v2_t);
  FIELD(dpbalancePlugin_v2_t, abi_version);
  FIELD(dpbalancePlugin_v2_t, name);
  FIELD(dpbalancePlugin_v2_t, init);
  FIELD(dpbalancePlugin_v2_t, plan);
  FIELD(dpbalancePlugin_v2_t, report);
  FIELD(dpbalancePlugin_v2_t, stats);
  FIELD(dpbalancePlugin_v2_t, finalize);
  SIZE(dpbalancePlugin_v2_t);
  /* the constants the adapter spells out */
  ENUM(DPB_PLUGIN_ABI_VERSION_2);
  ENUM(dpbStepDecode);
  ENUM(dpbStepIdle);
  ENUM(dpbStepExtend);
  ENUM(dpbStepNoVerify);
  ENUM(dpbGranularityRequest);
  ENUM(dpbGranularityBudget);
  ENUM(DPB_RANK_PLANNED);
  ENUM(DPB_RANK_EXTEND);
  ENUM(DPB_RANK_NO_VERIFY);
  ENUM(DPB_RANK_IDLE);
  ENUM(DPB_RANK_UNKNOWN);
  return 0;
}
