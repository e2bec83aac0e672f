// merge_attention_states: the result of attention over two disjoint key sets A and B from the
// results over each, by the LSE rule (what ring attention does after every step, and what a
// split-KV decode does with its splits):
//
//   lse = log(exp(lse_a) + exp(lse_b))
//   o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b
//
// computed in the accumulator type (float32; float64 for float64) against m = max(lse_a, lse_b),
// so that the larger term is exactly 1 and neither exponential overflows. The NumPy twin is
// cupyflash/merge.py (merge_attention_states_numpy), the same steps in the same order.
//
// Rows that saw no key: a side with lse = -inf has weight exactly 0 and its o is not read (a
// result that saw no key is 0 by convention, and whatever its buffer holds stays out); both sides
// -inf give o = 0, lse = -inf. A side with a finite lse is read even where its weight underflows
// to 0, so a NaN in it reaches o, as it would in a single pass over both key sets. A NaN lse makes
// lse and o NaN.
//
// One warp per (batch, head, row); lanes stride over the head dimension. Every lane reads the two
// lse values before any lane writes, and lane 0 writes the new lse after a __syncwarp, so o may be
// o_a and lse may be lse_a (the ring accumulates in place).
#include "common.cuh"
#include "params.cuh"

namespace cf {

constexpr int MERGE_ROWS_PER_BLOCK = 4;  // cupyflash/kernels/merge.py's ROWS_PER_BLOCK

template <typename TA, typename TB>
__global__ void __launch_bounds__(32 * MERGE_ROWS_PER_BLOCK)
merge_attention_states(const __grid_constant__ MergeParams p) {
    typedef typename acc_of<TA>::type A;  // o has o_a's type (a float32 accumulator with a 16-bit o_b)
    const i64 row_id = (i64)blockIdx.x * MERGE_ROWS_PER_BLOCK + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row_id >= (i64)p.batch * p.nheads * p.seqlen) return;
    const int row = (int)(row_id % p.seqlen);
    const int head = (int)((row_id / p.seqlen) % p.nheads);
    const int batch = (int)(row_id / ((i64)p.seqlen * p.nheads));

    const A lse_a = *p.lse_a.at<A>(batch, head, row);
    const A lse_b = *p.lse_b.at<A>(batch, head, row);
    // Not max_(): fmax drops a NaN, and a NaN lse must reach the result. If either is NaN the
    // comparison is false and m may be the other one, but that side's exponential below is NaN.
    const A m = lse_a > lse_b ? lse_a : lse_b;
    // Both -inf: 0 as the reference makes both exponentials exp(-inf) = 0 instead of NaN.
    // +inf (an overflowed lse): 0 too, which gives lse = +inf and a NaN o (inf / inf).
    const A m_ref = isfinite(m) ? m : A(0);
    const A log2e = A(1.4426950408889634), ln2 = A(0.6931471805599453);
    const A e_a = exp2_((lse_a - m_ref) * log2e);
    const A e_b = exp2_((lse_b - m_ref) * log2e);
    const A sum = e_a + e_b;  // in [1, 2] when m is finite
    const A lse = m_ref + log2_(sum) * ln2;  // log(0) = -inf when both sides are -inf
    // A side that saw no key is not read; both -inf leaves o = 0 (w_a, w_b are 0 / 0 then, unused).
    const bool read_a = lse_a != neg_inf<A>(), read_b = lse_b != neg_inf<A>();
    const A w_a = e_a / sum, w_b = e_b / sum;

    const TA* o_a = p.o_a.row<const TA>(batch, row, head);
    const TB* o_b = p.o_b.row<const TB>(batch, row, head);
    TA* o = p.o.row<TA>(batch, row, head);
    for (int d = lane; d < p.headdim; d += 32) {
        A x = A(0);
        if (read_a) x = w_a * to_acc(o_a[d]);
        if (read_b) x += w_b * to_acc(o_b[d]);
        store_as(o + d, x);
    }
    __syncwarp();  // every lane has read lse_a before lane 0 overwrites it (lse may be lse_a)
    if (lane == 0) *p.lse.at<A>(batch, head, row) = lse;
}

}  // namespace cf
