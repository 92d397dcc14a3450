#include "dpbalance/nccl_allgather.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_format.h"

namespace dpbalance {
namespace {

absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrFormat("NCCL all-gather: %s failed: %s", what, cudaGetErrorString(e)));
}
absl::Status NcclError(ncclResult_t r, const char* what) {
  return absl::InternalError(absl::StrFormat("NCCL all-gather: %s failed: %s", what, ncclGetErrorString(r)));
}

class NcclAllGather final : public AllGather {
 public:
  explicit NcclAllGather(const NcclAllGatherOptions& o)
      : n_(o.num_ranks), rank_(o.rank), bytes_(o.record_bytes),
        comm_(static_cast<ncclComm_t>(o.comm)), stream_(static_cast<cudaStream_t>(o.stream)),
        own_comm_(o.comm == nullptr), own_stream_(o.stream == nullptr) {}

  ~NcclAllGather() override {
    if (event_) cudaEventDestroy(event_);
    if (dev_) cudaFree(dev_);
    if (host_send_) cudaFreeHost(host_send_);
    if (host_recv_) cudaFreeHost(host_recv_);
    if (own_stream_ && stream_) cudaStreamDestroy(stream_);
    if (own_comm_ && comm_) {
      if (healthy_) {
        ncclCommFinalize(comm_);
        WaitComm(absl::Seconds(10)).IgnoreError();
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
  }

  absl::Status Init(const NcclAllGatherOptions& o) {
    if (o.device >= 0) {
      if (cudaError_t e = cudaSetDevice(o.device); e != cudaSuccess) return CudaError(e, "cudaSetDevice");
    }
    if (own_comm_) {
      if (o.unique_id == nullptr) {
        return absl::InvalidArgumentError("NCCL all-gather: neither a communicator nor a unique id");
      }
      ncclUniqueId id;
      std::memcpy(&id, o.unique_id, sizeof(id));
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;  // non-blocking: every wait below is ours, with a deadline
      ncclResult_t r = ncclCommInitRankConfig(&comm_, n_, id, rank_, &config);
      if (r != ncclSuccess && r != ncclInProgress) return NcclError(r, "ncclCommInitRankConfig");
      if (absl::Status s = WaitComm(o.init_timeout); !s.ok()) {
        healthy_ = false;
        return s;
      }
    }
    if (own_stream_) {
      if (cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); e != cudaSuccess) {
        return CudaError(e, "cudaStreamCreate");
      }
    }
    if (cudaError_t e = cudaMallocHost(&host_send_, bytes_); e != cudaSuccess) return CudaError(e, "cudaMallocHost");
    if (cudaError_t e = cudaMallocHost(&host_recv_, bytes_ * n_); e != cudaSuccess) return CudaError(e, "cudaMallocHost");
    if (cudaError_t e = cudaMalloc(&dev_, bytes_ * (n_ + 1)); e != cudaSuccess) return CudaError(e, "cudaMalloc");
    if (cudaError_t e = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming); e != cudaSuccess) {
      return CudaError(e, "cudaEventCreate");
    }
    return absl::OkStatus();
  }

  int num_ranks() const override { return n_; }
  int rank() const override { return rank_; }
  size_t record_bytes() const override { return bytes_; }
  bool healthy() const override { return healthy_; }
  std::string name() const override { return "nccl"; }
  bool ordered() const override { return !own_comm_; }

  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv,
                      absl::Duration timeout) override {
    if (absl::Status s = CheckSpans(send, recv); !s.ok()) return s;
    if (!healthy_) return absl::UnavailableError("NCCL all-gather: unusable after an earlier failure");
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
    std::memcpy(host_send_, send.data(), bytes_);
    uint8_t* dev_send = static_cast<uint8_t*>(dev_) + bytes_ * n_;  // after the gather buffer
    cudaError_t e = cudaMemcpyAsync(dev_send, host_send_, bytes_, cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return Fail(CudaError(e, "cudaMemcpyAsync H2D"));
    ncclResult_t r = ncclAllGather(dev_send, dev_, bytes_, ncclUint8, comm_, stream_);
    if (r != ncclSuccess && r != ncclInProgress) return Fail(NcclError(r, "ncclAllGather"));
    e = cudaMemcpyAsync(host_recv_, dev_, bytes_ * n_, cudaMemcpyDeviceToHost, stream_);
    if (e != cudaSuccess) return Fail(CudaError(e, "cudaMemcpyAsync D2H"));
    if ((e = cudaEventRecord(event_, stream_)) != cudaSuccess) return Fail(CudaError(e, "cudaEventRecord"));
    // Poll the event: spin briefly (the exchange takes tens of microseconds), then yield.
    for (int spins = 0;; ++spins) {
      e = cudaEventQuery(event_);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) return Fail(CudaError(e, "cudaEventQuery"));
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress) {
        return Fail(NcclError(async, "collective (async error)"));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return Fail(absl::DeadlineExceededError(absl::StrFormat(
            "NCCL all-gather: rank %d timed out after %s", rank_, absl::FormatDuration(timeout))));
      }
      if (spins > 2000) std::this_thread::yield();
    }
    std::memcpy(recv.data(), host_recv_, bytes_ * n_);
    return absl::OkStatus();
  }

 private:
  absl::Status Fail(absl::Status s) {
    // On the engine's communicator a timed-out all-gather stays queued and completes when the
    // late peers join it; the next call queues behind it, so the calls stay paired across ranks
    // and the backend stays usable (ordered()). Every other failure ends it.
    if (!own_comm_ && absl::IsDeadlineExceeded(s)) return s;
    healthy_ = false;
    if (own_comm_ && comm_) {
      ncclCommAbort(comm_);  // NCCL's way out of a stuck collective; the comm is gone after it
      comm_ = nullptr;
    }
    return s;
  }

  absl::Status WaitComm(absl::Duration timeout) {
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
    while (true) {
      ncclResult_t state = ncclSuccess;
      if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
        return NcclError(r, "ncclCommGetAsyncError");
      }
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return NcclError(state, "communicator");
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError("NCCL all-gather: communicator not ready in time");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  int n_, rank_;
  size_t bytes_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  bool own_comm_, own_stream_;
  bool healthy_ = true;
  void* host_send_ = nullptr;
  void* host_recv_ = nullptr;
  void* dev_ = nullptr;
  cudaEvent_t event_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AllGather>> MakeNcclAllGather(const NcclAllGatherOptions& o) {
  if (o.num_ranks < 1 || o.rank < 0 || o.rank >= o.num_ranks || o.record_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "NCCL all-gather: rank %d of %d ranks, %d-byte records", o.rank, o.num_ranks, o.record_bytes));
  }
  if (CudaDeviceCount() == 0) {
    return absl::FailedPreconditionError("NCCL all-gather: no CUDA device is visible");
  }
  auto g = std::make_unique<NcclAllGather>(o);
  if (absl::Status s = g->Init(o); !s.ok()) return s;
  return std::unique_ptr<AllGather>(std::move(g));
}

bool NcclBackendCompiled() { return true; }

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace dpbalance
