// Built when NCCL is not available: the backend reports itself missing, clearly.
#include "dpbalance/nccl_allgather.h"

namespace dpbalance {

absl::StatusOr<std::unique_ptr<AllGather>> MakeNcclAllGather(const NcclAllGatherOptions&) {
  return absl::UnimplementedError(
      "NCCL all-gather: this dpbalance build has no NCCL backend (configure with DPB_WITH_NCCL=ON)");
}
bool NcclBackendCompiled() { return false; }
int CudaDeviceCount() { return 0; }

}  // namespace dpbalance
