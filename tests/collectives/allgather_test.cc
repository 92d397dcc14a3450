#include <atomic>
#include <cstring>
#include <thread>

#include "dpbalance/allgather.h"
#include "dpbalance/inprocess_allgather.h"
#include "dpbalance/nccl_allgather.h"
#include "gtest/gtest.h"
#ifdef DPB_HAVE_NCCL
#include <nccl.h>
#endif

namespace dpbalance {
namespace {

TEST(InProcessAllGather, GathersInRankOrderForManySizes) {
  for (int n : {1, 2, 3, 8, 64}) {
    auto group = *InProcessGroup::Create(n, 16);
    std::vector<std::thread> threads;
    std::atomic<int> bad{0};
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        auto comm = *group->Join(r);
        std::vector<uint8_t> send(16), recv(16 * n);
        for (int step = 0; step < 50; ++step) {
          std::memset(send.data(), 0, 16);
          std::memcpy(send.data(), &r, sizeof(r));
          std::memcpy(send.data() + 4, &step, sizeof(step));
          if (!comm->Gather(send, absl::MakeSpan(recv), absl::Seconds(20)).ok()) ++bad;
          for (int i = 0; i < n; ++i) {
            int got_rank, got_step;
            std::memcpy(&got_rank, recv.data() + 16 * i, 4);
            std::memcpy(&got_step, recv.data() + 16 * i + 4, 4);
            if (got_rank != i || got_step != step) ++bad;
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(bad.load(), 0) << "n=" << n;
  }
}

TEST(InProcessAllGather, AMissingRankTimesOutAndBreaksTheGroupWithoutHanging) {
  auto group = *InProcessGroup::Create(3, 8);
  auto a = *group->Join(0);
  auto b = *group->Join(1);
  auto c = *group->Join(2);  // never calls Gather
  std::vector<uint8_t> send(8), recv(24);
  absl::Status sa;
  std::thread t([&] { sa = a->Gather(send, absl::MakeSpan(recv), absl::Milliseconds(100)); });
  const absl::Status sb = b->Gather(send, absl::MakeSpan(recv), absl::Milliseconds(100));
  t.join();
  EXPECT_FALSE(sa.ok());
  EXPECT_FALSE(sb.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(sa) || absl::IsDeadlineExceeded(sb));
  EXPECT_FALSE(a->healthy());
  // Later calls fail at once, including the late rank's.
  EXPECT_FALSE(c->Gather(send, absl::MakeSpan(recv), absl::Seconds(100)).ok());
}

TEST(InProcessAllGather, BadArgumentsAreErrors) {
  EXPECT_FALSE(InProcessGroup::Create(0, 8).ok());
  auto group = *InProcessGroup::Create(2, 8);
  EXPECT_FALSE(group->Join(2).ok());
  auto a = *group->Join(0);
  EXPECT_FALSE(group->Join(0).ok());  // joined twice
  std::vector<uint8_t> send(7), recv(16);
  EXPECT_TRUE(absl::IsInvalidArgument(a->Gather(send, absl::MakeSpan(recv), absl::Seconds(1))));
  EXPECT_FALSE(InProcessGroup::Named("x", 2, 8).ok() && InProcessGroup::Named("x", 3, 8).ok());
}

int EchoGather(void* user, const void* send, void* recv, size_t bytes, int32_t) {
  const int n = *static_cast<int*>(user);
  if (n < 0) return 7;
  for (int i = 0; i < n; ++i) std::memcpy(static_cast<uint8_t*>(recv) + i * bytes, send, bytes);
  return 0;
}

TEST(CallbackAllGather, CallsTheEngineAndReportsItsErrors) {
  int n = 4;
  auto cb = *MakeCallbackAllGather(4, 1, 8, EchoGather, &n);
  std::vector<uint8_t> send = {1, 2, 3, 4, 5, 6, 7, 8}, recv(32);
  ASSERT_TRUE(cb->Gather(send, absl::MakeSpan(recv), absl::Seconds(1)).ok());
  EXPECT_EQ(recv[31], 8);
  int broken = -1;
  auto bad = *MakeCallbackAllGather(4, 1, 8, EchoGather, &broken);
  absl::Status s = bad->Gather(send, absl::MakeSpan(recv), absl::Seconds(1));
  EXPECT_NE(s.message().find("returned 7"), std::string::npos);
  EXPECT_FALSE(bad->healthy());
  EXPECT_FALSE(MakeCallbackAllGather(4, 1, 8, nullptr, nullptr).ok());
}

// The NCCL backend is compiled wherever the toolkit is; it runs where a GPU is.
TEST(NcclAllGather, OneRankEndToEndOnAGpu) {
#ifndef DPB_HAVE_NCCL
  GTEST_SKIP() << "built without NCCL";
#else
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  NcclAllGatherOptions o;
  o.num_ranks = 1;
  o.record_bytes = 512;
  o.unique_id = &id;
  o.device = 0;
  absl::StatusOr<std::unique_ptr<AllGather>> g = MakeNcclAllGather(o);
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<uint8_t> send(512), recv(512);
  for (int step = 0; step < 20; ++step) {
    for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<uint8_t>(i * 7 + step);
    ASSERT_TRUE((*g)->Gather(send, absl::MakeSpan(recv), absl::Seconds(10)).ok());
    EXPECT_EQ(recv, send);
  }
#endif
}

TEST(NcclAllGather, WithoutAGpuItFailsCleanly) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present";
  NcclAllGatherOptions o;
  o.num_ranks = 1;
  o.record_bytes = 8;
  absl::StatusOr<std::unique_ptr<AllGather>> g = MakeNcclAllGather(o);
  EXPECT_FALSE(g.ok());
}

}  // namespace
}  // namespace dpbalance
