// flash_bwd_dq_convert_fixed: dq = scale * dq_accum 2^-E_i in the input dtype, after a backward
// whose dQ adds are fixed-point (the kernels around it: dq_fixed.cuh).
#include "common.cuh"
#include "dq_add.cuh"
#include "mma.cuh"
#include "params.cuh"

namespace cf {

// One thread per 8 columns of one (batch, row, head): four 16-byte loads, one 16-byte store;
// grid ceil(batch seqlen_q nheads headdim / 8 / 256). Column c of a row is at (c / 64) panel
// strides p.dq_accum_panel_stride + c % 64 from the row's start: 64 for rows of D_TILE columns,
// the panel size for a panel-major dq_accum (DqAdd::fixed_panels, whose head stride is a head's
// D_TILE / 64 panels).
template <typename T>
__global__ void __launch_bounds__(256)
flash_bwd_dq_convert_fixed(const __grid_constant__ BwdParams p) {
    const int seqlen_q = p.seqlen_q, nheads = p.nheads, headdim = p.headdim;
    const long long* __restrict__ dq_accum = static_cast<const long long*>(p.dq_accum.data);
    const i64 dqa_sb = p.dq_accum.batch_stride, dqa_ss = p.dq_accum.row_stride, dqa_sh = p.dq_accum.head_stride;
    const i64 dqa_sp = p.dq_accum_panel_stride;
    const float* __restrict__ dq_scale = p.dq_row_scale;
    const float scale = p.scale;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const RowChunk at(idx, seqlen_q, nheads, headdim);
    const int batch = at.batch, row = at.row, head = at.head, chunk = at.chunk;
    if (batch >= p.batch) return;  // idx past the batch * seqlen_q * nheads * headdim / 8 chunks
    // 2^-E_i is exact (a power of two, subnormal at most); applying it before the softmax scale
    // keeps the product normal. A NaN scale makes the row NaN. The inputs are read-only here:
    // __ldg, the read-only path that const __restrict__ kernel parameters gave.
    const float unscale = 1.f / __ldg(dq_scale + ((i64)batch * nheads + head) * seqlen_q + row);
    const longlong2* src = reinterpret_cast<const longlong2*>(
        dq_accum + row_offset(batch, row, head, dqa_sb, dqa_ss, dqa_sh) + (chunk / 8) * dqa_sp + (chunk % 8) * 8);
    u32 r[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const longlong2 pair = __ldg(src + w);
        r[w] = pack2<T>(from_fixed(pair.x) * unscale * scale, from_fixed(pair.y) * unscale * scale);
    }
    st_global_v4(p.dq.row<T>(batch, row, head) + chunk * 8, r);
}

}  // namespace cf
