#include "dpbalance/inprocess_allgather.h"

#include <chrono>
#include <cstring>
#include <map>

#include "absl/strings/str_format.h"

namespace dpbalance {

class InProcessAllGather final : public AllGather {
 public:
  InProcessAllGather(std::shared_ptr<InProcessGroup> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int num_ranks() const override { return g_->num_ranks(); }
  int rank() const override { return rank_; }
  size_t record_bytes() const override { return g_->record_bytes(); }
  bool healthy() const override { return !g_->broken(); }
  std::string name() const override { return "inproc"; }
  absl::Status Gather(absl::Span<const uint8_t> send, absl::Span<uint8_t> recv,
                      absl::Duration timeout) override {
    if (absl::Status s = CheckSpans(send, recv); !s.ok()) return s;
    return g_->Gather(rank_, send, recv, timeout);
  }

 private:
  std::shared_ptr<InProcessGroup> g_;
  int rank_;
};

InProcessGroup::InProcessGroup(int n, size_t bytes)
    : num_ranks_(n), record_bytes_(bytes), joined_(n, false) {
  buffer_[0].resize(n * bytes);
  buffer_[1].resize(n * bytes);
}

absl::StatusOr<std::shared_ptr<InProcessGroup>> InProcessGroup::Create(int num_ranks,
                                                                       size_t record_bytes) {
  if (num_ranks < 1 || record_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "in-process all-gather: %d ranks of %d-byte records", num_ranks, record_bytes));
  }
  return std::shared_ptr<InProcessGroup>(new InProcessGroup(num_ranks, record_bytes));
}

absl::StatusOr<std::shared_ptr<InProcessGroup>> InProcessGroup::Named(const std::string& name,
                                                                      int num_ranks,
                                                                      size_t record_bytes) {
  static std::mutex registry_mu;
  static std::map<std::string, std::weak_ptr<InProcessGroup>> registry;
  std::lock_guard<std::mutex> lock(registry_mu);
  if (auto it = registry.find(name); it != registry.end()) {
    if (std::shared_ptr<InProcessGroup> g = it->second.lock()) {
      if (g->num_ranks() != num_ranks || g->record_bytes() != record_bytes) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "in-process group '%s' has %d ranks of %d bytes; asked for %d of %d", name,
            g->num_ranks(), g->record_bytes(), num_ranks, record_bytes));
      }
      return g;
    }
  }
  absl::StatusOr<std::shared_ptr<InProcessGroup>> g = Create(num_ranks, record_bytes);
  if (g.ok()) registry[name] = *g;
  return g;
}

absl::StatusOr<std::unique_ptr<AllGather>> InProcessGroup::Join(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank < 0 || rank >= num_ranks_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("in-process all-gather: rank %d outside 0..%d", rank, num_ranks_ - 1));
  }
  if (joined_[rank]) {
    return absl::AlreadyExistsError(absl::StrFormat("in-process all-gather: rank %d joined twice", rank));
  }
  joined_[rank] = true;
  return std::unique_ptr<AllGather>(new InProcessAllGather(shared_from_this(), rank));
}

bool InProcessGroup::broken() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

absl::Status InProcessGroup::Gather(int rank, absl::Span<const uint8_t> send,
                                    absl::Span<uint8_t> recv, absl::Duration timeout) {
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
  std::unique_lock<std::mutex> lock(mu_);
  if (broken_) return absl::UnavailableError("in-process all-gather: group broken by an earlier timeout");
  const uint64_t gen = generation_;
  std::vector<uint8_t>& buf = buffer_[gen & 1];
  std::memcpy(buf.data() + rank * record_bytes_, send.data(), record_bytes_);
  if (++arrived_ == num_ranks_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
  } else if (!cv_.wait_until(lock, deadline, [&] { return generation_ != gen || broken_; })) {
    broken_ = true;  // the others may be anywhere: nobody may trust this group again
    cv_.notify_all();
    return absl::DeadlineExceededError(absl::StrFormat(
        "in-process all-gather: rank %d waited %s for the other ranks", rank,
        absl::FormatDuration(timeout)));
  }
  if (generation_ == gen) {  // woken by a break, not by completion
    return absl::UnavailableError("in-process all-gather: group broken while waiting");
  }
  // The buffer of generation `gen` is only rewritten two generations later, which needs this
  // rank to arrive again, so copying it out under the lock is safe.
  std::memcpy(recv.data(), buf.data(), recv.size());
  return absl::OkStatus();
}

}  // namespace dpbalance
