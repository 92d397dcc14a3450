#include "dpbalance/allgather.h"

#include "absl/strings/str_format.h"

namespace dpbalance {

absl::Status AllGather::CheckSpans(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv) const {
  if (send.size() != record_bytes() || recv.size() != record_bytes() * num_ranks()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s all-gather: send %d bytes / recv %d bytes, expected %d / %d", name(), send.size(),
        recv.size(), record_bytes(), record_bytes() * num_ranks()));
  }
  return absl::OkStatus();
}

namespace {

// The engine's callback, in either ABI's form. The v2 (sized) callback is told the receive
// capacity and says how much it wrote, so a group that disagrees on its size (a rank with another
// num_ranks) is an error, not an overflow; the v1 callback returns 0 for a full receive.
class CallbackAllGather final : public AllGather {
 public:
  CallbackAllGather(int n, int rank, size_t bytes, AllGatherCallback v1, SizedAllGatherCallback v2,
                    void* user)
      : n_(n), rank_(rank), bytes_(bytes), v1_(v1), v2_(v2), user_(user) {}
  int num_ranks() const override { return n_; }
  int rank() const override { return rank_; }
  size_t record_bytes() const override { return bytes_; }
  bool healthy() const override { return healthy_; }
  std::string name() const override { return "callback"; }
  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv,
                      absl::Duration timeout) override {
    if (absl::Status s = CheckSpans(send, recv); !s.ok()) return s;
    const auto timeout_ms = static_cast<int32_t>(absl::ToInt64Milliseconds(timeout));
    // v1 returns 0 for a full receive and anything else for a failure; v2 the bytes written.
    const int64_t rc = v2_ != nullptr
                           ? v2_(user_, send.data(), send.size(), recv.data(), recv.size(), timeout_ms)
                           : v1_(user_, send.data(), recv.data(), bytes_, timeout_ms);
    if (v2_ != nullptr ? rc < 0 : rc != 0) {
      healthy_ = false;
      return absl::UnavailableError(
          absl::StrFormat("engine all-gather callback returned %d on rank %d", rc, rank_));
    }
    if (v2_ != nullptr && static_cast<uint64_t>(rc) != recv.size()) {
      // The group is not the one this rank was configured with (or the callback lost records):
      // lockstep can no longer be assumed.
      healthy_ = false;
      return absl::DataLossError(absl::StrFormat(
          "engine all-gather callback wrote %d bytes on rank %d, expected %d (%d ranks x %d "
          "bytes): the ranks disagree on the group size or the callback lost records",
          rc, rank_, recv.size(), n_, bytes_));
    }
    return absl::OkStatus();
  }

 private:
  int n_, rank_;
  size_t bytes_;
  AllGatherCallback v1_;
  SizedAllGatherCallback v2_;
  void* user_;
  bool healthy_ = true;
};

absl::StatusOr<std::unique_ptr<AllGather>> MakeCallback(int num_ranks, int rank, size_t record_bytes,
                                                        AllGatherCallback v1,
                                                        SizedAllGatherCallback v2, void* user) {
  if (v1 == nullptr && v2 == nullptr) {
    return absl::InvalidArgumentError("callback all-gather: function is null");
  }
  if (num_ranks < 1 || rank < 0 || rank >= num_ranks || record_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "callback all-gather: rank %d of %d ranks, %d-byte records", rank, num_ranks, record_bytes));
  }
  return std::unique_ptr<AllGather>(new CallbackAllGather(num_ranks, rank, record_bytes, v1, v2, user));
}

}  // namespace

absl::StatusOr<std::unique_ptr<AllGather>> MakeSizedCallbackAllGather(int num_ranks, int rank,
                                                                       size_t record_bytes,
                                                                       SizedAllGatherCallback fn,
                                                                       void* user) {
  return MakeCallback(num_ranks, rank, record_bytes, nullptr, fn, user);
}

absl::StatusOr<std::unique_ptr<AllGather>> MakeCallbackAllGather(int num_ranks, int rank,
                                                                  size_t record_bytes,
                                                                  AllGatherCallback fn,
                                                                  void* user) {
  return MakeCallback(num_ranks, rank, record_bytes, fn, nullptr, user);
}

}  // namespace dpbalance
