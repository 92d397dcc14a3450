// A downstream project: find_package(dpbalance), link dpbalance::dpbalance, plan one step.
#include <cstdio>

#include "dpbalance/balancer.h"
#include "dpbalance/inprocess_allgather.h"

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
