// flash_bwd_preprocess: D_i = rowsum(dO_i * O_i), the row statistic of the SIMT backward
// (flash_bwd_dkdv_simt.cu) and of the tensor-core ones (backward_plans.preprocess_spec); with
// fixed-point dQ adds flash_bwd_preprocess_fixed.cu computes D_i instead.
#include "common.cuh"
#include "params.cuh"

namespace cf {

// One warp per (batch, head, row): lanes stride over the head dimension.
template <typename T>
__global__ void __launch_bounds__(128)
flash_bwd_preprocess(const __grid_constant__ BwdParams p) {
    typedef typename acc_of<T>::type A;
    const int seqlen_q = p.seqlen_q, nheads = p.nheads, headdim = p.headdim_v;  // dO and O: v's width
    A* __restrict__ delta = static_cast<A*>(p.delta);
    const i64 row_id = (i64)blockIdx.x * 4 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const i64 total = (i64)p.batch * nheads * seqlen_q;
    if (row_id >= total) return;
    const int row = (int)(row_id % seqlen_q);
    const int head = (int)((row_id / seqlen_q) % nheads);
    const int batch = (int)(row_id / ((i64)seqlen_q * nheads));
    const T* __restrict__ do_row = p.dout.row<const T>(batch, row, head);
    const T* __restrict__ o_row = p.o.row<const T>(batch, row, head);
    A sum = A(0);
    for (int d = lane; d < headdim; d += 32) sum += to_acc(ldg(do_row + d)) * to_acc(ldg(o_row + d));
    sum = group_sum<32>(sum);
    if (lane == 0) delta[row_id] = sum;  // (batch, head, row) order equals row_id
}

}  // namespace cf
