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

class CallbackAllGather final : public AllGather {
 public:
  CallbackAllGather(int n, int rank, size_t bytes, AllGatherCallback fn, void* user)
      : n_(n), rank_(rank), bytes_(bytes), fn_(fn), user_(user) {}
  int num_ranks() const override { return n_; }
  int rank() const override { return rank_; }
  size_t record_bytes() const override { return bytes_; }
  bool healthy() const override { return healthy_; }
  std::string name() const override { return "callback"; }
  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv,
                      absl::Duration timeout) override {
    if (absl::Status s = CheckSpans(send, recv); !s.ok()) return s;
    const int rc = fn_(user_, send.data(), recv.data(), bytes_,
                       static_cast<int32_t>(absl::ToInt64Milliseconds(timeout)));
    if (rc != 0) {
      healthy_ = false;
      return absl::UnavailableError(
          absl::StrFormat("engine all-gather callback returned %d on rank %d", rc, rank_));
    }
    return absl::OkStatus();
  }

 private:
  int n_, rank_;
  size_t bytes_;
  AllGatherCallback fn_;
  void* user_;
  bool healthy_ = true;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AllGather>> MakeCallbackAllGather(int num_ranks, int rank,
                                                                  size_t record_bytes,
                                                                  AllGatherCallback fn,
                                                                  void* user) {
  if (fn == nullptr) return absl::InvalidArgumentError("callback all-gather: function is null");
  if (num_ranks < 1 || rank < 0 || rank >= num_ranks || record_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "callback all-gather: rank %d of %d ranks, %d-byte records", rank, num_ranks, record_bytes));
  }
  return std::unique_ptr<AllGather>(new CallbackAllGather(num_ranks, rank, record_bytes, fn, user));
}

}  // namespace dpbalance
