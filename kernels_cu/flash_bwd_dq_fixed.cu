// flash_bwd_dq_fixed: the kernels around a backward whose dQ adds are fixed-point (DqAdd::fixed,
// dq_add.cuh), fp16/bf16.
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
#include "common.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "dq_add.cuh"

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

// Grid (ceil(seqlen_k / ROWS), nheads_kv, batch), 256 threads; kv_bound (batch, nheads_kv, 2)
// zeroed before the launch: [0] = max |K|, [1] = max |V|, as float bits.
template <typename T, int D_TILE>
__global__ void __launch_bounds__(256)
flash_bwd_kv_bounds(const T* __restrict__ k, const T* __restrict__ v, u32* __restrict__ kv_bound,
                    int seqlen_k, int nheads_kv, int headdim,
                    i64 k_sb, i64 k_ss, i64 k_sh, i64 v_sb, i64 v_ss, i64 v_sh) {
    constexpr int LANES = D_TILE / 8, ROWS_PER_PASS = 256 / LANES, ROWS = 128;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int col = 8 * (threadIdx.x % LANES);
    u32 k_max = 0, v_max = 0;
    for (int r = threadIdx.x / LANES; r < ROWS; r += ROWS_PER_PASS) {
        // Rows past the end read as zeros (no early exit: the whole warp takes part in the sums).
        const int n = blockIdx.x * ROWS + r;
        const bool valid = n < seqlen_k;
        const int n_read = valid ? n : 0, col_read = valid ? col : headdim;
        float x[8];
        load_chunk(x, k + row_offset(batch, n_read, head, k_sb, k_ss, k_sh), col_read, headdim);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float a = fabsf(x[e]);
            if (a <= 3.402823466e38f) k_max = max(k_max, __float_as_uint(a));
        }
        load_chunk(x, v + row_offset(batch, n_read, head, v_sb, v_ss, v_sh), col_read, headdim);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float a = fabsf(x[e]);
            if (a <= 3.402823466e38f) v_max = max(v_max, __float_as_uint(a));
        }
    }
    k_max = group_max<32>(k_max);
    v_max = group_max<32>(v_max);
    if (threadIdx.x % 32 == 0) {
        u32* out = kv_bound + ((i64)batch * nheads_kv + head) * 2;
        atomicMax(out, k_max);
        atomicMax(out + 1, v_max);
    }
}

// Grid (ceil(seqlen_q / (256 / LANES)), nheads, batch), 256 threads: one row per LANES lanes.
template <typename T, int D_TILE>
__global__ void __launch_bounds__(256)
flash_bwd_preprocess_fixed(const T* __restrict__ dout, const T* __restrict__ out, const u32* __restrict__ kv_bound,
                           float* __restrict__ delta,
                           float* __restrict__ dq_scale, int seqlen_q, int nheads, int group, int headdim,
                           i64 do_sb, i64 do_ss, i64 do_sh, i64 o_sb, i64 o_ss, i64 o_sh) {
    constexpr int LANES = D_TILE / 8, ROWS = 256 / LANES;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int row = blockIdx.x * ROWS + threadIdx.x / LANES, col = 8 * (threadIdx.x % LANES);
    const bool valid = row < seqlen_q;  // no early return: the whole warp takes part in the sums
    float d_o[8], o[8];
    load_chunk(d_o, dout + row_offset(batch, valid ? row : 0, head, do_sb, do_ss, do_sh), valid ? col : headdim, headdim);
    load_chunk(o, out + row_offset(batch, valid ? row : 0, head, o_sb, o_ss, o_sh), valid ? col : headdim, headdim);
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

// One thread per 8 columns of one (batch, row, head): four 16-byte loads, one 16-byte store.
// Column c of a row is at (c / 64) panel strides dqa_sp + c % 64 from the row's start: dqa_sp = 64
// for rows of D_TILE columns, the panel size for a panel-major dq_accum (DqAdd::fixed_panels).
template <typename T>
__global__ void __launch_bounds__(256)
flash_bwd_dq_convert_fixed(const long long* __restrict__ dq_accum, const float* __restrict__ dq_scale,
                           T* __restrict__ dq, int seqlen_q, int nheads, int headdim, i64 n_chunks,
                           i64 dqa_sb, i64 dqa_ss, i64 dqa_sh, i64 dqa_sp, i64 dq_sb, i64 dq_ss, i64 dq_sh,
                           float scale) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_chunks) return;
    const int chunks_per_row = headdim / 8;
    const int chunk = (int)(idx % chunks_per_row);
    const i64 row_id = idx / chunks_per_row;  // (batch, row, head) in C order
    const int head = (int)(row_id % nheads);
    const int row = (int)((row_id / nheads) % seqlen_q);
    const int batch = (int)(row_id / ((i64)nheads * seqlen_q));
    // 2^-E_i is exact (a power of two, subnormal at most); applying it before the softmax scale
    // keeps the product normal. A NaN scale makes the row NaN.
    const float unscale = 1.f / dq_scale[((i64)batch * nheads + head) * seqlen_q + row];
    const longlong2* src = reinterpret_cast<const longlong2*>(
        dq_accum + row_offset(batch, row, head, dqa_sb, dqa_ss, dqa_sh) + (chunk / 8) * dqa_sp + (chunk % 8) * 8);
    u32 r[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const longlong2 pair = src[w];
        r[w] = pack2<T>(from_fixed(pair.x) * unscale * scale, from_fixed(pair.y) * unscale * scale);
    }
    st_global_v4(dq + row_offset(batch, row, head, dq_sb, dq_ss, dq_sh) + chunk * 8, r);
}

}  // namespace cf
