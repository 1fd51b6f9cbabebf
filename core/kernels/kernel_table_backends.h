// The tables kernels_for() chooses from (one per backend folder).
#pragma once

#include "core/common/config.h"
#include "core/kernels/kernel_table.h"

namespace hps {
namespace cpu {
const Kernels& kernel_table();  // kernels/cpu/kernel_table.cc
}
#if HPS_HAVE_CUDA
namespace cuda {
const Kernels& kernel_table();  // kernels/cuda/kernel_table.cu
}
#endif
}  // namespace hps
