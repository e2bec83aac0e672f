// flash_bwd_dq_convert: dq = scale * dq_accum in the input dtype, after the float32 atomic dQ adds
// (DqAdd::atomic) of the tensor-core backward kernels (the mma.sync family: mma_bwd_layouts.cuh).
#include "common.cuh"
#include "dq_add.cuh"
#include "mma.cuh"
#include "params.cuh"

namespace cf {

// One thread per 8 columns of one (batch, row, head): two 16-byte loads, one 16-byte store.
template <typename T>
__global__ void __launch_bounds__(256)
flash_bwd_dq_convert(const __grid_constant__ BwdParams p) {
    const int seqlen_q = p.seqlen_q, nheads = p.nheads, headdim = p.headdim;
    const i64 n_chunks = ((i64)p.batch * seqlen_q) * (nheads * (headdim / 8));  // nheads headdim / 8 < 2^31
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_chunks) return;
    const RowChunk at(idx, seqlen_q, nheads, headdim);
    const int batch = at.batch, row = at.row, head = at.head, chunk = at.chunk;
    const float scale = p.scale;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum.row<const float>(batch, row, head) + chunk * 8);
    const float4 lo = __ldg(src), hi = __ldg(src + 1);  // the read-only path (bwd_args in mma_bwd.cuh)
    const u32 r[4] = {pack2<T>(lo.x * scale, lo.y * scale), pack2<T>(lo.z * scale, lo.w * scale),
                      pack2<T>(hi.x * scale, hi.y * scale), pack2<T>(hi.z * scale, hi.w * scale)};
    st_global_v4(p.dq.row<T>(batch, row, head) + chunk * 8, r);
}

}  // namespace cf
