// dpbalance/radix_sort.h (internal): the planner's sorts of 64-bit keys by their high halves
// (Decide's knot events by cost, Summarize's items by gain per microsecond).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace dpbalance {

inline uint64_t SortKey(uint64_t key) { return key; }
template <typename T>
uint64_t SortKey(const T& x) {
  return x.key;
}

// Sorts `v` (distinct 64-bit keys, SortKey) by the keys' high 32 bits, ties in their order in
// `v`: a stable radix sort, one pass a byte (none for a byte every key shares), without a
// comparison sort's mispredicted branches. Below `radix_from` elements, std::sort by the whole
// key instead (the same order where `v` already is in the order of the low halves). `tmp` is
// scratch.
template <typename T>
void SortByHighHalf(std::vector<T>& v, std::vector<T>& tmp, size_t radix_from) {
  const size_t n = v.size();
  if (n < radix_from || n < 2) {
    std::sort(v.begin(), v.end(), [](const T& a, const T& b) { return SortKey(a) < SortKey(b); });
    return;
  }
  std::array<std::array<uint32_t, 256>, 4> count{};
  for (const T& x : v) {
    for (int b = 0; b < 4; ++b) ++count[b][(SortKey(x) >> (32 + 8 * b)) & 0xff];
  }
  tmp.resize(n);
  T* src = v.data();
  T* dst = tmp.data();
  for (int b = 0; b < 4; ++b) {
    const int shift = 32 + 8 * b;
    std::array<uint32_t, 256>& at = count[b];
    if (at[(SortKey(src[0]) >> shift) & 0xff] == n) continue;
    uint32_t sum = 0;
    for (uint32_t& c : at) sum += std::exchange(c, sum);
    for (size_t i = 0; i < n; ++i) dst[at[(SortKey(src[i]) >> shift) & 0xff]++] = src[i];
    std::swap(src, dst);
  }
  if (src != v.data()) std::copy(src, src + n, v.data());
}

}  // namespace dpbalance
