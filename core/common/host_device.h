// HPS_HOST_DEVICE marks a function written once for both kernel tables: compiled for the
// host by the C++ compiler (the CPU kernels, kernels/cpu/) and for the device by nvcc (the
// CUDA kernels, kernels/cuda/), so a rule of the arithmetic (an optimizer's update of an
// element, the loss-scaling verdict, the clip coefficient, the exact squares' digits) has
// one definition. Such a function uses only what both sides have: fundamental types,
// <cmath>'s global functions (sqrt, sqrtf, pow, ldexp) and memcpy.
#pragma once

#if defined(__CUDACC__)
#define HPS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HPS_HOST_DEVICE inline
#endif
