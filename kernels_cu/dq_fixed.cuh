// The kernels around a backward whose dQ adds are fixed-point (DqAdd::fixed, dq_add.cuh), fp16/bf16,
// each in a file named after it (flash_bwd_kv_bounds.cu, ...):
//
//   flash_bwd_kv_bounds         max |K| and max |V| per (batch, kv head) over the finite
//                               entries, as float bits (atomicMax on the bits of non-negative
//                               floats is max on the floats).
//   flash_bwd_preprocess_fixed  D_i = dO_i . O_i and the row's fixed-point scale 2^E_i from the
//                               bound max|K| (||dO_i||_1 max|V| + |D_i|).
//   flash_bwd_dq_convert_fixed  dq = scale * dq_accum 2^-E_i in the input dtype (NaN for a row the
//                               backward kernel marked by a NaN scale).
//
// The row kernels give each row LANES = D_TILE / 8 consecutive lanes, 8 columns (16 bytes) each.
// load_chunk below is that 16-byte read.
#pragma once

#include "common.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"

namespace cf {

// Loads 8 consecutive elements (16 bytes, aligned: the mma family's guarantee) as floats; zero
// past the head dim.
template <typename T>
__device__ __forceinline__ void load_chunk(float (&x)[8], const T* row, int col, int headdim) {
    if (col >= headdim) {
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = 0.f;
        return;
    }
    const uint4 raw = *reinterpret_cast<const uint4*>(row + col);
    const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const float2 pair = unpack2<T>(words[w]);
        x[2 * w] = pair.x;
        x[2 * w + 1] = pair.y;
    }
}

}  // namespace cf
