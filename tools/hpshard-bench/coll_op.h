// The collectives hpshard-bench measures, their names and the nccl-tests bandwidth
// formulas (docs/benchmarks.md, /work/shared/PERFORMANCE.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace hps::bench {

enum class CollOp : int32_t { kAllReduce, kAllGather, kReduceScatter, kBroadcast };

inline constexpr CollOp kAllCollOps[] = {CollOp::kAllReduce, CollOp::kAllGather,
                                         CollOp::kReduceScatter, CollOp::kBroadcast};

inline std::string_view coll_op_name(CollOp op) {
  switch (op) {
    case CollOp::kAllReduce: return "all_reduce";
    case CollOp::kAllGather: return "all_gather";
    case CollOp::kReduceScatter: return "reduce_scatter";
    case CollOp::kBroadcast: return "broadcast";
  }
  return "?";
}

inline std::optional<CollOp> coll_op_from_name(std::string_view name) {
  for (CollOp op : kAllCollOps) {
    if (coll_op_name(op) == name) return op;
  }
  return std::nullopt;
}

// Whether the op's call count is per rank (all-gather, reduce-scatter: S = count × ranks).
inline bool count_is_per_rank(CollOp op) {
  return op == CollOp::kAllGather || op == CollOp::kReduceScatter;
}

// nccl-tests' busbw factor: busbw = algbw × factor.
inline double bus_factor(CollOp op, int32_t ranks) {
  const double n = ranks;
  switch (op) {
    case CollOp::kAllReduce: return 2.0 * (n - 1.0) / n;
    case CollOp::kAllGather:
    case CollOp::kReduceScatter: return (n - 1.0) / n;
    case CollOp::kBroadcast: return 1.0;
  }
  return 1.0;
}

// algbw in GB/s (1e9 bytes, as nccl-tests) of `bytes` moved in `seconds`.
inline double algbw_gbps(size_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

}  // namespace hps::bench
