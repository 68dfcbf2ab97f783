// Run-time -> compile-time switches of the CUDA kernels: the storage dtype and the key head dim. The value head dim
// is tiled at run time (64-wide tiles), so it needs no switch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

// dtype code: 0 bfloat16, 1 float16, 2 float32 (the storage type St of inputs and intermediates)
#define GD_DTYPE_SWITCH(CODE, ST, ...)                                                 \
  [&] {                                                                               \
    if ((CODE) == 0) {                                                                \
      using ST = __nv_bfloat16;                                                       \
      return __VA_ARGS__();                                                           \
    } else if ((CODE) == 1) {                                                         \
      using ST = __half;                                                              \
      return __VA_ARGS__();                                                           \
    } else if ((CODE) == 2) {                                                         \
      using ST = float;                                                               \
      return __VA_ARGS__();                                                           \
    }                                                                                 \
    throw std::runtime_error("gated_delta CUDA: unsupported dtype code " + std::to_string(CODE)); \
  }()

#define GD_HEADK_SWITCH(KVAL, KC, ...)                                                \
  [&] {                                                                               \
    if ((KVAL) == 64) {                                                               \
      constexpr int KC = 64;                                                          \
      return __VA_ARGS__();                                                           \
    } else if ((KVAL) == 128) {                                                       \
      constexpr int KC = 128;                                                         \
      return __VA_ARGS__();                                                           \
    } else if ((KVAL) == 256) {                                                       \
      constexpr int KC = 256;                                                         \
      return __VA_ARGS__();                                                           \
    }                                                                                 \
    throw std::runtime_error("gated_delta CUDA: head dim K must be 64, 128 or 256, got " + std::to_string(KVAL)); \
  }()
