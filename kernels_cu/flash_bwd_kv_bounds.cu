// flash_bwd_kv_bounds: max |K| and max |V| per (batch, kv head), the bounds of a fixed-point dQ
// backward's row scales (the kernels around it: dq_fixed.cuh).
#include "common.cuh"
#include "dq_fixed.cuh"
#include "params.cuh"

namespace cf {

// Grid (ceil(seqlen_k / ROWS), nheads_kv, batch), 256 threads; p.kv_bound (batch, nheads_kv, 2)
// zeroed before the launch: [0] = max |K|, [1] = max |V|, as float bits.
template <typename T, int D_TILE>
__global__ void __launch_bounds__(256)
flash_bwd_kv_bounds(const __grid_constant__ BwdParams p) {
    constexpr int LANES = D_TILE / 8, ROWS_PER_PASS = 256 / LANES, ROWS = 128;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int seqlen_k = p.seqlen_k, headdim = p.headdim, headdim_v = p.headdim_v;
    const T* __restrict__ k_rows = p.k.head_rows<const T>(batch, head);
    const T* __restrict__ v_rows = p.v.head_rows<const T>(batch, head);
    const i64 k_ss = p.k.row_stride, v_ss = p.v.row_stride;
    u32* __restrict__ kv_bound = p.kv_bound;
    const int col = 8 * (threadIdx.x % LANES);
    u32 k_max = 0, v_max = 0;
    for (int r = threadIdx.x / LANES; r < ROWS; r += ROWS_PER_PASS) {
        // Rows past the end read as zeros (no early exit: the whole warp takes part in the sums).
        const int n = blockIdx.x * ROWS + r;
        const bool valid = n < seqlen_k;
        const int n_read = valid ? n : 0;
        float x[8];
        load_chunk(x, k_rows + n_read * k_ss, valid ? col : headdim, headdim);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float a = fabsf(x[e]);
            if (a <= 3.402823466e38f) k_max = max(k_max, __float_as_uint(a));
        }
        load_chunk(x, v_rows + n_read * v_ss, valid ? col : headdim_v, headdim_v);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float a = fabsf(x[e]);
            if (a <= 3.402823466e38f) v_max = max(v_max, __float_as_uint(a));
        }
    }
    k_max = group_max<32>(k_max);
    v_max = group_max<32>(v_max);
    if (threadIdx.x % 32 == 0) {
        u32* out = kv_bound + ((i64)batch * p.nheads_kv + head) * 2;
        atomicMax(out, k_max);
        atomicMax(out + 1, v_max);
    }
}

}  // namespace cf
