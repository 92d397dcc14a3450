// dpbalance-nccl-bench: our per-step overhead with the NCCL exchange vs a bare ncclAllGather.
//
// Runs on one GPU, one rank (NCCL refuses two ranks on one GPU). Three timings, medians of
// --iters steps after warm-up:
//   bare   : memcpy into pinned memory, H2D, ncclAllGather of 512 B, D2H, stream sync
//            (the engine-side minimum for exchanging one summary);
//   gather : dpbalance's NcclAllGather::Gather of the same 512 B (event polling, deadline);
//   plan   : Balancer::Plan end to end (summarise 64 requests, NCCL exchange, decide, assign);
//   plan, in-process: the same Plan over the in-process all-gather of one rank, timed first and
//            without a GPU: the planner's compute on this CPU, which plan - gather should match.
// Target: plan <= 1.2 x bare + 5 us. A plain executable (no Google Benchmark) so it
// runs on the bare GPU machine; the numbers are medians over thousands of steps.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "dpbalance/balancer.h"
#include "dpbalance/inprocess_allgather.h"
#include "dpbalance/nccl_allgather.h"

namespace {

using Clock = std::chrono::steady_clock;

double MedianUs(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Fail(const char* what) {
  std::fprintf(stderr, "dpbalance-nccl-bench: %s\n", what);
  return 1;
}

// Median of Balancer::Plan over `gather` (one rank, 64 requests, k_max 7); -1 if it fails or
// falls back.
double PlanMedianUs(std::unique_ptr<dpbalance::AllGather> gather, int iters) {
  dpbalance::BalancerConfig c;
  c.planner.num_ranks = 1;
  c.log_every_steps = 0;
  c.timeout = absl::Seconds(5);
  auto b = dpbalance::Balancer::Create(c, 0, std::move(gather));
  if (!b.ok() || !(*b)->enabled()) return -1;
  std::mt19937_64 rng(1);
  std::lognormal_distribution<double> ctx(std::log(7000), 1.2);
  std::vector<dpbalance::BalancerRequest> batch(64);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].request_id = static_cast<int64_t>(i);
    batch[i].ctx_tokens = static_cast<int64_t>(ctx(rng));
    batch[i].k_cap = 7;
  }
  std::vector<int32_t> v(batch.size());
  std::vector<double> plan;
  for (int i = 0; i < iters + 100; ++i) {
    const auto t0 = Clock::now();
    const dpbalance::PlanOutcome out = (*b)->Plan(batch, -1, absl::MakeSpan(v));
    if (i >= 100) plan.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    if (!out.balanced) return -1;
  }
  return MedianUs(plan);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 2000;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0) iters = std::max(10, std::atoi(argv[i + 1]));
  }
  constexpr size_t kBytes = sizeof(dpbalance::RankSummary);
  auto group = dpbalance::InProcessGroup::Create(1, kBytes);
  if (!group.ok()) return Fail("in-process group");
  auto local = (*group)->Join(0);
  if (!local.ok()) return Fail("in-process join");
  const double mi = PlanMedianUs(*std::move(local), iters);
  if (mi < 0) return Fail("in-process plan fell back");
  std::printf("Balancer::Plan, 64 requests, in-process: median %.1f us (the planner's compute)\n", mi);
  if (dpbalance::CudaDeviceCount() == 0) return Fail("no CUDA device");
  std::vector<uint8_t> send(kBytes, 7), recv(kBytes);

  // Bare NCCL: the engine-side minimum for one 512-byte exchange with a host round trip.
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) return Fail("ncclGetUniqueId");
  cudaSetDevice(0);
  ncclComm_t comm;
  if (ncclCommInitRank(&comm, 1, id, 0) != ncclSuccess) return Fail("ncclCommInitRank");
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  void *hs, *hr, *dev;
  cudaMallocHost(&hs, kBytes);
  cudaMallocHost(&hr, kBytes);
  cudaMalloc(&dev, 2 * kBytes);
  std::vector<double> bare;
  for (int i = 0; i < iters + 100; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(hs, send.data(), kBytes);
    cudaMemcpyAsync(static_cast<uint8_t*>(dev) + kBytes, hs, kBytes, cudaMemcpyHostToDevice, stream);
    ncclAllGather(static_cast<uint8_t*>(dev) + kBytes, dev, kBytes, ncclUint8, comm, stream);
    cudaMemcpyAsync(hr, dev, kBytes, cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    std::memcpy(recv.data(), hr, kBytes);
    if (i >= 100) bare.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  ncclCommDestroy(comm);

  // Our gather alone (owned communicator from a fresh unique id).
  ncclUniqueId id2;
  ncclGetUniqueId(&id2);
  dpbalance::NcclAllGatherOptions o;
  o.num_ranks = 1;
  o.record_bytes = kBytes;
  o.unique_id = &id2;
  o.device = 0;
  auto g = dpbalance::MakeNcclAllGather(o);
  if (!g.ok()) return Fail(std::string(g.status().message()).c_str());
  std::vector<double> gather;
  for (int i = 0; i < iters + 100; ++i) {
    const auto t0 = Clock::now();
    if (!(*g)->Gather(send, absl::MakeSpan(recv), absl::Seconds(5)).ok()) return Fail("gather");
    if (i >= 100) gather.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  g->reset();

  // Balancer::Plan end to end over NCCL: 64 requests, k_max 7.
  ncclUniqueId id3;
  ncclGetUniqueId(&id3);
  o.unique_id = &id3;
  auto g3 = dpbalance::MakeNcclAllGather(o);
  if (!g3.ok()) return Fail(std::string(g3.status().message()).c_str());
  const double mp = PlanMedianUs(*std::move(g3), iters);
  if (mp < 0) return Fail("plan fell back");
  const double mb = MedianUs(bare), mg = MedianUs(gather);
  std::printf("bare ncclAllGather 512 B (host round trip): median %.1f us\n", mb);
  std::printf("dpbalance NcclAllGather::Gather:           median %.1f us\n", mg);
  std::printf("Balancer::Plan, 64 requests, NCCL:          median %.1f us\n", mp);
  std::printf("Plan over NCCL - in-process Plan:    %.1f us (the exchange inside Plan)\n", mp - mi);
  std::printf("target plan <= 1.2 x bare + 5 us = %.1f us: %s\n", 1.2 * mb + 5,
              mp <= 1.2 * mb + 5 ? "met" : "NOT met");
  return 0;
}
