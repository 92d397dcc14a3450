// dpbalance/median.h (internal): the median of a sample, shared by the online cost model
// (calibration.cc) and SGLang's online SPS profiler (dspark.cc).
#pragma once

#include <algorithm>
#include <vector>

namespace dpbalance {

// The median of `v` (not empty); of an even count, the mean of the middle two (numpy.median).
inline double Median(std::vector<double> v) {
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  const double upper = v[mid];
  if (v.size() % 2 == 1) return upper;
  return 0.5 * (upper + *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid)));
}

}  // namespace dpbalance
