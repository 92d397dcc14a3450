// A downstream project: find_package(dpbalance), link dpbalance::dpbalance, plan one step.
// It includes every installed header (the public API), with spdlog and Eigen poisoned.
#include <cstdio>

#include "dpbalance/acceptance.h"
#include "dpbalance/allgather.h"
#include "dpbalance/balancer.h"
#include "dpbalance/cost_model.h"
#include "dpbalance/inprocess_allgather.h"
#include "dpbalance/kernel_grid.h"
#include "dpbalance/metrics.h"
#include "dpbalance/nccl_allgather.h"
#include "dpbalance/planner.h"
#include "dpbalance/plugin/dpbalance_inspect_v1.h"
#include "dpbalance/plugin/dpbalance_plugin.h"
#include "dpbalance/plugin/dpbalance_plugin_v1.h"
#include "dpbalance/plugin/dpbalance_router_v1.h"
#include "dpbalance/routing.h"
#include "dpbalance/summary.h"
#include "dpbalance/tpot_slo.h"

int main() {
  dpbalance::BalancerConfig c;
  c.planner.num_ranks = 1;
  c.log_every_steps = 0;
  auto group = dpbalance::InProcessGroup::Create(1, sizeof(dpbalance::RankSummary));
  auto b = dpbalance::Balancer::Create(c, 0, *(*group)->Join(0));
  if (!b.ok()) return 1;
  std::vector<dpbalance::BalancerRequest> batch(3);
  for (auto& r : batch) {
    r.ctx_tokens = 1000;
    r.k_cap = 7;
  }
  std::vector<int32_t> v(3);
  const dpbalance::PlanOutcome o = (*b)->Plan(batch, -1, absl::MakeSpan(v));
  std::printf("balanced=%d depth=%d\n", o.balanced, o.draft_depth);
  return o.balanced ? 0 : 1;
}
