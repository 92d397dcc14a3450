// Internal: FNV-1a 64-bit hashing of plain values (configs must hash identically on every rank).
#pragma once

#include <cstdint>
#include <cstddef>

namespace dpbalance::internal {

class Fnv1a {
 public:
  void Bytes(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) {
      h_ ^= p[i];
      h_ *= 1099511628211ull;
    }
  }
  template <typename T>
  void Value(const T& v) {
    Bytes(&v, sizeof(T));
  }
  uint64_t digest() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

}  // namespace dpbalance::internal
