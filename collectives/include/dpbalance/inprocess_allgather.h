// dpbalance/inprocess_allgather.h — all-gather between ranks that are threads of one process
// (tests, the reference engine, the plugin's `inproc` backend).
//
// Contract: create one `InProcessGroup` for num_ranks ranks, then one handle per rank with
// `Join(rank)`. Gather is a barrier with a deadline: if a rank does not arrive in time, every
// waiting rank gets DeadlineExceeded and the group is marked broken; later calls fail at once.
// The group must outlive its handles (handles hold a shared_ptr to it).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dpbalance/allgather.h"

namespace dpbalance {

class InProcessGroup : public std::enable_shared_from_this<InProcessGroup> {
 public:
  static absl::StatusOr<std::shared_ptr<InProcessGroup>> Create(int num_ranks, size_t record_bytes);
  // A handle for `rank`; each rank joins once.
  absl::StatusOr<std::unique_ptr<AllGather>> Join(int rank);

  // Process-wide registry by name (the plugin's `inproc` backend: ranks find their group by the
  // DPB_GROUP flag). Returns the existing group if the name is taken with the same shape.
  static absl::StatusOr<std::shared_ptr<InProcessGroup>> Named(const std::string& name,
                                                               int num_ranks, size_t record_bytes);

  int num_ranks() const { return num_ranks_; }
  size_t record_bytes() const { return record_bytes_; }
  bool broken() const;

 private:
  friend class InProcessAllGather;
  InProcessGroup(int n, size_t bytes);
  absl::Status Gather(int rank, absl::Span<const uint8_t> send, absl::Span<uint8_t> recv,
                      absl::Duration timeout);

  const int num_ranks_;
  const size_t record_bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> buffer_[2];  // double buffer, indexed by generation parity
  std::vector<bool> joined_;
  uint64_t generation_ = 0;
  int arrived_ = 0;
  bool broken_ = false;
};

}  // namespace dpbalance
