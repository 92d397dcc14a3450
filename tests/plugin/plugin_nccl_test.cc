// The plugin as an engine on a GPU uses it: dlopen, the C ABI, and the NCCL backend over the
// engine's own communicator and stream (borrowed: the engine keeps using and destroys them), or
// over a communicator the plugin makes from a unique id. One rank (NCCL refuses two on one GPU).
// Skips where the build has no NCCL or no GPU is visible; scripts/gpu_check.sh runs it there.
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "dpbalance/plugin/dpbalance_plugin.h"
#include "gtest/gtest.h"

#ifdef DPB_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace {

#ifdef DPB_HAVE_NCCL
bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Runs `steps` plan + report steps on one rank; returns the stats after them.
dpbStats_t RunSteps(const dpbalancePlugin_t* plugin, void* ctx, int steps) {
  for (int step = 0; step < steps; ++step) {
    std::vector<dpbRequest_t> reqs;
    for (int i = 0; i < 16; ++i) reqs.push_back({i, 2000 + 500 * i + step, 0, 7, nullptr, 0});
    std::vector<int32_t> v(reqs.size(), -1);
    int32_t depth = -1;
    EXPECT_EQ(plugin->plan(ctx, reqs.data(), static_cast<int32_t>(reqs.size()), -1, v.data(), &depth),
              dpbSuccess)
        << "step " << step;
    std::vector<dpbAccepted_t> acc;
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_GE(v[i], 0);
      EXPECT_LE(v[i], depth);
      acc.push_back({reqs[i].request_id, v[i], v[i] / 2, 0});
    }
    EXPECT_EQ(plugin->report(ctx, 9000.0, 30000.0, acc.data(), static_cast<int32_t>(acc.size())), dpbSuccess);
  }
  dpbStats_t s{};
  EXPECT_EQ(plugin->stats(ctx, &s), dpbSuccess);
  return s;
}

// TEST_DPBALANCE_PLUGIN names the library where the build tree is not there (the GPU machine runs
// a copy carried in .gpu/, scripts/prepare_gpu_carry.sh).
const dpbalancePlugin_t* Load() {
  const char* path = std::getenv("TEST_DPBALANCE_PLUGIN");
  void* lib = dlopen(path != nullptr ? path : DPB_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (lib == nullptr) return nullptr;
  return static_cast<const dpbalancePlugin_t*>(dlsym(lib, DPB_PLUGIN_SYMBOL));
}

class PluginNccl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
    plugin_ = Load();
    ASSERT_NE(plugin_, nullptr) << dlerror();
  }
  // One rank on device 0 over NCCL; the caller adds the communicator or the unique id.
  static dpbInitArgs_t Args() {
    dpbInitArgs_t a{};
    a.num_ranks = 1;
    a.rank = 0;
    a.config = "log_every=0;timeout_ms=10000";
    a.backend = dpbBackendNccl;
    a.cuda_device = 0;
    return a;
  }
  const dpbalancePlugin_t* plugin_ = nullptr;
};

TEST_F(PluginNccl, EngineCommunicatorIsBorrowedAndStaysUsable) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comm;
  ASSERT_EQ(ncclCommInitRank(&comm, 1, id, 0), ncclSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  dpbInitArgs_t a = Args();
  a.nccl_comm = comm;
  a.cuda_stream = stream;
  void* ctx = nullptr;
  ASSERT_EQ(plugin_->init(&a, &ctx), dpbSuccess);
  const dpbStats_t s = RunSteps(plugin_, ctx, 50);
  EXPECT_EQ(s.steps, 50);
  EXPECT_EQ(s.balanced_steps, 50);
  EXPECT_EQ(s.fallbacks, 0);
  EXPECT_EQ(s.enabled, 1);
  EXPECT_EQ(plugin_->finalize(ctx), dpbSuccess);

  // The engine's communicator and stream are still its own: an all-gather on them works after the
  // plugin is gone, and the engine destroys them.
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 64), cudaSuccess);
  EXPECT_EQ(ncclAllGather(static_cast<char*>(buf) + 32, buf, 32, ncclUint8, comm, stream), ncclSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ncclResult_t async = ncclSuccess;
  EXPECT_EQ(ncclCommGetAsyncError(comm, &async), ncclSuccess);
  EXPECT_EQ(async, ncclSuccess);
  cudaFree(buf);
  EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST_F(PluginNccl, OwnCommunicatorFromAUniqueId) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  dpbInitArgs_t a = Args();
  a.nccl_unique_id = &id;
  void* ctx = nullptr;
  ASSERT_EQ(plugin_->init(&a, &ctx), dpbSuccess);
  const dpbStats_t s = RunSteps(plugin_, ctx, 50);
  EXPECT_EQ(s.balanced_steps, 50);
  EXPECT_EQ(s.fallbacks, 0);
  EXPECT_EQ(plugin_->finalize(ctx), dpbSuccess);
}

#else
TEST(PluginNccl, NeedsAnNcclBuild) { GTEST_SKIP() << "built without NCCL"; }
#endif

}  // namespace
