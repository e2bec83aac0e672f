// flash_fwd_combine: o and lse of a split-KV forward (flash_fwd_kvcache_mma with num_splits > 1)
// from its splits' partial results, by the LSE rule over all of them at once:
//
//   M = max(lse_1, ..., lse_S, sink)     lse = M + log(sum_s exp(lse_s - M) + exp(sink - M))
//   o = sum_s exp(lse_s - lse) o_s
//
// (merge_attention_states.cu is the two-sided form.) The sink's term (score.cuh), absent from
// every split, joins here once; without a sink it is exp(-inf) = 0. A split whose lse is -inf saw
// no key of the row: its o_s is not read (the kernel leaves it unwritten). A row no split saw
// gets o = 0 and lse = -inf, or lse = sink with a sink, as the single-pass kernels give.
//
// One warp per (batch, head, query) row: the lanes reduce the splits' lse, then each lane sums 4
// consecutive columns of o over the splits (float32 partials, read once), rounded to T once.
#include "common.cuh"
#include "params.cuh"

namespace cf {

constexpr int COMBINE_ROWS_PER_BLOCK = 4;  // cupyflash/kernels/kvcache_mma.py's COMBINE_ROWS

template <typename T>
__global__ void __launch_bounds__(32 * COMBINE_ROWS_PER_BLOCK)
flash_fwd_combine(const __grid_constant__ CombineParams p) {
    const i64 rows = (i64)p.batch * p.nheads * p.seqlen_q;  // of one split
    const i64 row_id = (i64)blockIdx.x * COMBINE_ROWS_PER_BLOCK + threadIdx.x / 32;  // (batch, head, query)
    const int lane = threadIdx.x % 32;
    if (row_id >= rows) return;
    const int query = (int)(row_id % p.seqlen_q);
    const int head = (int)((row_id / p.seqlen_q) % p.nheads);
    const int batch = (int)(row_id / ((i64)p.seqlen_q * p.nheads));
    const float log2e = 1.4426950408889634f, ln2 = 0.6931471805599453f;
    const float* lse_s = p.lse_partial + row_id;

    float top = p.sink != nullptr ? __ldg(p.sink + head) : neg_inf<float>();
    for (int s = lane; s < p.num_splits; s += 32) top = fmaxf(top, __ldg(lse_s + s * rows));
    top = group_max<32>(top);
    T* o = p.o.row<T>(batch, query, head);
    if (top == neg_inf<float>()) {  // no key, no sink
        for (int d = lane; d < p.headdim; d += 32) store_as(o + d, 0.f);
        if (lane == 0) p.lse[row_id] = neg_inf<float>();
        return;
    }
    float sum = lane == 0 && p.sink != nullptr ? exp2f((__ldg(p.sink + head) - top) * log2e) : 0.f;
    for (int s = lane; s < p.num_splits; s += 32) sum += exp2f((__ldg(lse_s + s * rows) - top) * log2e);
    sum = group_sum<32>(sum);
    const float lse = top + __log2f(sum) * ln2;

    for (int d = 4 * lane; d < p.headdim; d += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < p.num_splits; ++s) {
            const float l = __ldg(lse_s + s * rows);
            if (l == neg_inf<float>()) continue;
            const float w = exp2f((l - lse) * log2e);
            const float4 x = __ldg(reinterpret_cast<const float4*>(p.o_partial + (s * rows + row_id) * p.headdim + d));
            acc.x += w * x.x;
            acc.y += w * x.y;
            acc.z += w * x.z;
            acc.w += w * x.w;
        }
        store_as(o + d, acc.x);
        store_as(o + d + 1, acc.y);
        store_as(o + d + 2, acc.z);
        store_as(o + d + 3, acc.w);
    }
    if (lane == 0) p.lse[row_id] = lse;
}

}  // namespace cf
