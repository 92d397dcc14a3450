// dpbalance/allgather.h — the one collective dpbalance needs: all-gather of fixed-size records.
//
// Contract
// - `Gather(send, recv, timeout)`: `send` is this rank's record (record_bytes()); `recv` gets
//   num_ranks() records in rank order. Returns OK, or DeadlineExceeded when the other ranks did
//   not arrive in time, or another error; never blocks longer than about `timeout`.
// - After an error the backend may be unusable (`healthy()` false); callers then stop calling
//   it (the balancer disables itself), so no rank is ever left inside a collective.
// - One instance per rank; not thread-safe (a rank calls it from its step thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace dpbalance {

class AllGather {
 public:
  virtual ~AllGather() = default;
  virtual int num_ranks() const = 0;
  virtual int rank() const = 0;
  virtual size_t record_bytes() const = 0;
  virtual absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv,
                              absl::Duration timeout) = 0;
  virtual bool healthy() const = 0;
  virtual std::string name() const = 0;
  // True for a collective on a communicator shared with the engine that a timeout does not
  // cancel (NCCL on the engine's comm): calls pair up across ranks by their order, so every rank
  // must make exactly one call per step for as long as any rank does. A rank that stopped would
  // leave its peers' next call unmatched, and the engine's next collective on that communicator
  // would pair with it. The balancer therefore keeps calling such a backend once per step even
  // when disabled (docs/design.md, "Collectives").
  virtual bool ordered() const { return false; }

 protected:
  // Shared argument check for every backend.
  absl::Status CheckSpans(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv) const;
};

// Engine callback: performs the all-gather with the engine's own group. Returns 0 on success.
// `recv` holds num_ranks * record_bytes bytes in rank order.
using AllGatherCallback = int (*)(void* user, const void* send, void* recv, size_t record_bytes,
                                  int32_t timeout_ms);

absl::StatusOr<std::unique_ptr<AllGather>> MakeCallbackAllGather(int num_ranks, int rank,
                                                                  size_t record_bytes,
                                                                  AllGatherCallback fn,
                                                                  void* user);

// Engine callback with sizes (plugin ABI v2): `recv_bytes` = num_ranks * send_bytes is the
// capacity of `recv`, which the callback must not write past. Returns the bytes it wrote into
// `recv` (checked: exactly recv_bytes) or < 0 on failure or timeout.
using SizedAllGatherCallback = int64_t (*)(void* user, const void* send, size_t send_bytes,
                                           void* recv, size_t recv_bytes, int32_t timeout_ms);

absl::StatusOr<std::unique_ptr<AllGather>> MakeSizedCallbackAllGather(int num_ranks, int rank,
                                                                       size_t record_bytes,
                                                                       SizedAllGatherCallback fn,
                                                                       void* user);

}  // namespace dpbalance
