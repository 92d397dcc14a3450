// Fuzzes the timing-row reader (integration/calibrate/timing_rows.h): LoadTimingRows (attn, gemm,
// step; with and without a kernel grid) and LoadGemmSweep on arbitrary bytes as a JSON-lines
// file. Input: byte 0 picks the reader, target and grid; the rest is the file.
//
// Finding, fixed in LoadTimingRows and kept as a seed (corpus/timing_rows_fuzz/regress_K3_*):
//  K3 a row whose optional "variant" or "mode" is not a string: j.value("variant", "") threw
//     nlohmann::type_error out of LoadTimingRows (std::terminate in the calibrate tool).
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "nlohmann/json.hpp"

#include "dpbalance/kernel_grid.h"
#include "fuzz_util.h"
#include "timing_rows.h"

namespace {
using dpbalance::KernelGrid;
using dpbalance::calibrate::Target;

constexpr Target kTargets[] = {Target::kAttention, Target::kGemm, Target::kStep};
constexpr const char* kGrids[] = {"none", "fa2-gqa-h200", "fa2-packed-h200"};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static dpbalance::fuzz::ScratchFile file("timing");
  if (size < 1) return 0;
  const uint8_t pick = data[0];
  const std::string& path = file.Write(data + 1, size - 1);
  if (pick % 10 == 9) {  // one in ten: the projection-GEMM sweep
    (void)dpbalance::calibrate::LoadGemmSweep(path);
    return 0;
  }
  const KernelGrid grid = *KernelGrid::Named(kGrids[(pick / 3) % 3]);
  (void)dpbalance::calibrate::LoadTimingRows(path, kTargets[pick % 3], grid);
  return 0;
}
