// tests/fuzz/plugin_request_fuzz.h — what the two plugin ABI targets draw the same way.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <vector>

namespace dpbalance::fuzz {

// Anything in the type sometimes, a plausible value mostly.
inline int32_t ConsumeInt32(FuzzedDataProvider& in, int32_t lo, int32_t hi) {
  return in.ConsumeIntegralInRange(0, 7) == 0 ? in.ConsumeIntegral<int32_t>() : in.ConsumeIntegralInRange(lo, hi);
}

// A request's context, cap, floor and (sometimes) draft confidences, anywhere in their C types;
// `confidences` keeps the array alive through the call.
template <typename Request>
void ConsumeRequest(FuzzedDataProvider& in, Request& r, std::vector<float>& confidences) {
  r.ctx_tokens = in.ConsumeBool() ? in.ConsumeIntegral<int64_t>() : in.ConsumeIntegralInRange<int64_t>(0, 1 << 20);
  r.k_cap = ConsumeInt32(in, 0, 9);
  r.k_min = ConsumeInt32(in, 0, 9);
  if (in.ConsumeBool()) {
    confidences.resize(in.ConsumeIntegralInRange(0, 12));
    for (float& c : confidences) {
      c = in.ConsumeBool() ? in.ConsumeProbability<float>() : in.ConsumeFloatingPoint<float>();
    }
    r.draft_confidence = confidences.data();
    r.num_confidence = static_cast<int32_t>(confidences.size());
  }
}

}  // namespace dpbalance::fuzz
