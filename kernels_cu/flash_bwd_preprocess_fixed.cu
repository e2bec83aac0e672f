// flash_bwd_preprocess_fixed: D_i and the fixed-point scale 2^E_i of each row, for a backward whose
// dQ adds are fixed-point (the kernels around it: dq_fixed.cuh).
#include "common.cuh"
#include "dq_add.cuh"
#include "dq_fixed.cuh"
#include "params.cuh"

namespace cf {

// Grid (ceil(seqlen_q / (256 / LANES)), nheads, batch), 256 threads: one row per LANES lanes.
template <typename T, int D_TILE>
__global__ void __launch_bounds__(256)
flash_bwd_preprocess_fixed(const __grid_constant__ BwdParams p) {
    constexpr int LANES = D_TILE / 8, ROWS = 256 / LANES;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int seqlen_q = p.seqlen_q, nheads = p.nheads, group = p.group, headdim = p.headdim_v;  // of dO and O
    const T* __restrict__ do_rows = p.dout.head_rows<const T>(batch, head);
    const T* __restrict__ o_rows = p.o.head_rows<const T>(batch, head);
    const i64 do_ss = p.dout.row_stride, o_ss = p.o.row_stride;
    const u32* __restrict__ kv_bound = p.kv_bound;
    float* __restrict__ delta = static_cast<float*>(p.delta);
    float* __restrict__ dq_scale = p.dq_row_scale;
    const int row = blockIdx.x * ROWS + threadIdx.x / LANES, col = 8 * (threadIdx.x % LANES);
    const bool valid = row < seqlen_q;  // no early return: the whole warp takes part in the sums
    float d_o[8], o[8];
    load_chunk(d_o, do_rows + (valid ? row : 0) * do_ss, valid ? col : headdim, headdim);
    load_chunk(o, o_rows + (valid ? row : 0) * o_ss, valid ? col : headdim, headdim);
    float dot = 0.f, do_l1 = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        dot = fmaf(d_o[e], o[e], dot);
        do_l1 += fabsf(d_o[e]);
    }
    dot = group_sum<LANES>(dot);
    do_l1 = group_sum<LANES>(do_l1);
    if (!valid || threadIdx.x % LANES != 0) return;
    const u32* bound = kv_bound + ((i64)batch * (nheads / group) + head / group) * 2;
    const i64 idx = ((i64)batch * nheads + head) * seqlen_q + row;
    const float k_max = __uint_as_float(bound[0]), v_max = __uint_as_float(bound[1]);
    delta[idx] = dot;
    dq_scale[idx] = dq_fixed_scale(k_max * fmaf(do_l1, v_max, fabsf(dot)));
}

}  // namespace cf
