// dpbalance/nccl_allgather.h — all-gather of summary records over NCCL.
//
// Contract
// - Borrowed mode: `comm` (an ncclComm_t) and `stream` (a cudaStream_t) are the engine's; they
//   must outlive this object. dpbalance never aborts a borrowed communicator. On a timeout it
//   returns DeadlineExceeded and stays usable: the all-gather stays queued and completes when the
//   late ranks join it, and the next call queues behind it (ordered(): every rank calls once per
//   step, which the balancer keeps doing even when disabled). Any other error makes it unhealthy.
// - Owned mode: `comm` is null and `unique_id` points to the 128-byte ncclUniqueId the engine
//   distributed; a non-blocking communicator is created (bounded by `init_timeout`) on `device`
//   and aborted on a collective timeout, so no rank ever hangs in it.
// - Buffers (pinned host, device) and an event are allocated once; a step does one H2D copy,
//   ncclAllGather, one D2H copy, and polls the event against the deadline.
// - Types are void* so this header needs neither CUDA nor NCCL; without NCCL at build time
//   MakeNcclAllGather returns Unimplemented.
#pragma once

#include <memory>

#include "dpbalance/allgather.h"

namespace dpbalance {

struct NcclAllGatherOptions {
  int num_ranks = 1;
  int rank = 0;
  size_t record_bytes = 0;
  void* comm = nullptr;              // ncclComm_t (borrowed) or null
  void* stream = nullptr;            // cudaStream_t (borrowed) or null: a stream of our own
  const void* unique_id = nullptr;   // ncclUniqueId (owned mode)
  int device = -1;                   // CUDA device for owned mode (-1: current)
  absl::Duration init_timeout = absl::Seconds(60);
};

absl::StatusOr<std::unique_ptr<AllGather>> MakeNcclAllGather(const NcclAllGatherOptions& options);
// True when this build has the NCCL backend compiled in.
bool NcclBackendCompiled();
// Number of CUDA devices visible (0 when no driver/GPU or no CUDA in this build).
int CudaDeviceCount();

}  // namespace dpbalance
