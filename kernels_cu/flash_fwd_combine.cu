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
// One warp per (batch, head, query) row. The lanes hold the splits' lse (lane l: splits l, l + 32,
// ...), reduce them, and turn them into weights; then each lane sums 4 consecutive columns of o
// over the splits in split order (float32 partials, read once), rounded to T once. The partials'
// loads go out SPLIT_LOADS at a time, each split's weight from its lane by a shuffle: the first
// form read each split's lse and then its o in turn, two dependent L2 round trips per split
// (8.3 us for 16 splits of 32 rows on the H200, as long as 7% of the 128k decode step it ends;
// docs/perf-log.md, "decode-v3").
#include "common.cuh"
#include "params.cuh"

namespace cf {

constexpr int COMBINE_ROWS_PER_BLOCK = 4;  // cupyflash/kernels/kvcache_mma.py's COMBINE_ROWS
constexpr int COMBINE_MAX_SPLITS = 128;    // kvcache_mma.py's MAX_SPLITS
constexpr int SPLITS_PER_LANE = COMBINE_MAX_SPLITS / 32;
constexpr int SPLIT_LOADS = 8;  // partial rows in flight per lane; divides 32, so a group's lanes share one slot

// x[i] of a per-lane array, i uniform over the warp, without an indexed (local-memory) access.
template <int N>
__device__ __forceinline__ float pick(const float (&x)[N], int i) {
    float r = x[0];
#pragma unroll
    for (int j = 1; j < N; ++j) r = i == j ? x[j] : r;
    return r;
}

template <typename T>
__global__ void __launch_bounds__(32 * COMBINE_ROWS_PER_BLOCK)
flash_fwd_combine(const __grid_constant__ CombineParams p) {
    const i64 rows = (i64)p.batch * p.nheads * p.seqlen_q;  // of one split
    const i64 row_id = (i64)blockIdx.x * COMBINE_ROWS_PER_BLOCK + threadIdx.x / 32;  // (batch, head, query)
    const int lane = threadIdx.x % 32;
    if (p.num_splits > COMBINE_MAX_SPLITS) __trap();
    if (row_id >= rows) return;
    const int query = (int)(row_id % p.seqlen_q);
    const int head = (int)((row_id / p.seqlen_q) % p.nheads);
    const int batch = (int)(row_id / ((i64)p.seqlen_q * p.nheads));
    const int num_splits = p.num_splits;
    const float log2e = 1.4426950408889634f, ln2 = 0.6931471805599453f;
    const float* lse_s = p.lse_partial + row_id;

    float lse_of[SPLITS_PER_LANE];  // split lane + 32 i
#pragma unroll
    for (int i = 0; i < SPLITS_PER_LANE; ++i) {
        const int s = lane + 32 * i;
        lse_of[i] = s < num_splits ? __ldg(lse_s + s * rows) : neg_inf<float>();
    }
    float top = p.sink != nullptr ? __ldg(p.sink + head) : neg_inf<float>();
#pragma unroll
    for (int i = 0; i < SPLITS_PER_LANE; ++i) top = fmaxf(top, lse_of[i]);
    top = group_max<32>(top);
    T* o = p.o.row<T>(batch, query, head);
    if (top == neg_inf<float>()) {  // no key, no sink
        for (int d = lane; d < p.headdim; d += 32) store_as(o + d, 0.f);
        if (lane == 0) p.lse[row_id] = neg_inf<float>();
        return;
    }
    float sum = lane == 0 && p.sink != nullptr ? exp2f((__ldg(p.sink + head) - top) * log2e) : 0.f;
#pragma unroll
    for (int i = 0; i < SPLITS_PER_LANE; ++i) sum += lse_of[i] == neg_inf<float>() ? 0.f : exp2f((lse_of[i] - top) * log2e);
    sum = group_sum<32>(sum);
    const float lse = top + __log2f(sum) * ln2;
    float weight[SPLITS_PER_LANE];  // of split lane + 32 i; 0 where that split saw no key
#pragma unroll
    for (int i = 0; i < SPLITS_PER_LANE; ++i) weight[i] = lse_of[i] == neg_inf<float>() ? 0.f : exp2f((lse_of[i] - lse) * log2e);

    // Every lane takes part in every pass (the shuffles need the whole warp); a lane past the
    // head dim loads and stores nothing.
    for (int d0 = 0; d0 < p.headdim; d0 += 128) {
        const int d = d0 + 4 * lane;
        const bool column_in = d < p.headdim;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        const float* column = p.o_partial + row_id * p.headdim + d;
        for (int s0 = 0; s0 < num_splits; s0 += SPLIT_LOADS) {
            const float lse_slot = pick(lse_of, s0 / 32), weight_slot = pick(weight, s0 / 32);
            float w[SPLIT_LOADS];
            bool seen[SPLIT_LOADS];
            float4 x[SPLIT_LOADS];
#pragma unroll
            for (int u = 0; u < SPLIT_LOADS; ++u) {
                const int s = s0 + u;
                w[u] = __shfl_sync(0xffffffffu, weight_slot, s % 32);
                // A split past the last or one that saw no key of the row: its o is not read (the
                // kernel left it unwritten).
                seen[u] = s < num_splits && __shfl_sync(0xffffffffu, lse_slot, s % 32) != neg_inf<float>();
                x[u] = seen[u] && column_in ? __ldg(reinterpret_cast<const float4*>(column + s * rows * p.headdim))
                                            : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < SPLIT_LOADS; ++u) {
                if (!seen[u]) continue;
                acc.x += w[u] * x[u].x;
                acc.y += w[u] * x[u].y;
                acc.z += w[u] * x[u].z;
                acc.w += w[u] * x[u].w;
            }
        }
        if (!column_in) continue;
        store_as(o + d, acc.x);
        store_as(o + d + 1, acc.y);
        store_as(o + d + 2, acc.z);
        store_as(o + d + 3, acc.w);
    }
    if (lane == 0) p.lse[row_id] = lse;
}

}  // namespace cf
