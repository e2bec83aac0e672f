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
#include "params.cuh"

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

// Grid (ceil(seqlen_k / ROWS), nheads_kv, batch), 256 threads; p.kv_bound (batch, nheads_kv, 2)
// zeroed before the launch: [0] = max |K|, [1] = max |V|, as float bits.
template <typename T, int D_TILE>
__global__ void __launch_bounds__(256)
flash_bwd_kv_bounds(const __grid_constant__ BwdParams p) {
    constexpr int LANES = D_TILE / 8, ROWS_PER_PASS = 256 / LANES, ROWS = 128;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int seqlen_k = p.seqlen_k, headdim = p.headdim;
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
        const int n_read = valid ? n : 0, col_read = valid ? col : headdim;
        float x[8];
        load_chunk(x, k_rows + n_read * k_ss, col_read, headdim);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float a = fabsf(x[e]);
            if (a <= 3.402823466e38f) k_max = max(k_max, __float_as_uint(a));
        }
        load_chunk(x, v_rows + n_read * v_ss, col_read, headdim);
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

// Grid (ceil(seqlen_q / (256 / LANES)), nheads, batch), 256 threads: one row per LANES lanes.
template <typename T, int D_TILE>
__global__ void __launch_bounds__(256)
flash_bwd_preprocess_fixed(const __grid_constant__ BwdParams p) {
    constexpr int LANES = D_TILE / 8, ROWS = 256 / LANES;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int seqlen_q = p.seqlen_q, nheads = p.nheads, group = p.group, headdim = p.headdim;
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
    const int chunks_per_row = headdim / 8;
    const int chunk = (int)(idx % chunks_per_row);
    const i64 row_id = idx / chunks_per_row;  // (batch, row, head) in C order
    const int head = (int)(row_id % nheads);
    const int row = (int)((row_id / nheads) % seqlen_q);
    const int batch = (int)(row_id / ((i64)nheads * seqlen_q));
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
