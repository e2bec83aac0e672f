// The tile steps of the float32 tensor-core forward (flash_fwd_tf32.cu) on a warp's strips of 16
// query rows: S = Q K^T and O += P V from swizzled float32 shared tiles (tf32.cuh), and the
// epilogue O / l in float32.
#pragma once

#include "online_softmax.cuh"
#include "tf32.cuh"

namespace cf {

// S = Q K^T: one k-step per 8 columns of the head dim. Q's A fragments (the warp's rows of the
// shared Q tile, q_rows its first) are split once per k-step and serve every key fragment; K's
// non-transposed ldmatrix gives B = K^T, one x4 load covering keys 8f..8f+15.
// PRESPLIT: K's tile holds hi already and k_lo_tile lo (split_tile), read by two ldmatrix.
// STEP_SUMS: each k-step's products summed apart and added by FADD (tf32.cuh, mma_tf32), the k-step
// loop kept rolled: unrolled, ptxas overlaps the k-steps and their sums' registers spill (no
// register array is indexed by the k-step, so rolling it costs no local memory).
template <int PRODUCTS, int D_TILE, bool PRESPLIT = false, bool STEP_SUMS = false, int M_STRIPS, int N_FRAGS>
__device__ __forceinline__ void mma_qk_tf32(float (&s)[M_STRIPS][N_FRAGS][4], u32 q_rows,
                                            const FragmentAddress<2 * D_TILE>& a_addr, u32 k_tile,
                                            const FragmentAddress<2 * D_TILE>& k_addr, u32 k_lo_tile = 0) {
    zero_acc(s);
    auto k_step = [&](int kk) {
        u32 a_hi[M_STRIPS][4], a_lo[M_STRIPS][4];
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i) {
            u32 a[4];
            ldmatrix_x4(a, a_addr(q_rows, i, kk));
            split_tf32<PRODUCTS>(a, a_hi[i], a_lo[i]);
        }
#pragma unroll
        for (int f = 0; f < N_FRAGS; f += 2) {
            u32 b[4], b_hi[4], b_lo[4];
            if constexpr (PRESPLIT) {
                ldmatrix_x4(b_hi, k_addr(k_tile, f / 2, kk));
                if constexpr (Tf32Operand<PRODUCTS>::SPLIT) ldmatrix_x4(b_lo, k_addr(k_lo_tile, f / 2, kk));
            } else {
                ldmatrix_x4(b, k_addr(k_tile, f / 2, kk));
                split_tf32<PRODUCTS>(b, b_hi, b_lo);
            }
#pragma unroll
            for (int i = 0; i < M_STRIPS; ++i) {
                mma_tf32<PRODUCTS, STEP_SUMS>(s[i][f], a_hi[i], a_lo[i], b_hi[0], b_hi[1], b_lo[0], b_lo[1]);
                mma_tf32<PRODUCTS, STEP_SUMS>(s[i][f + 1], a_hi[i], a_lo[i], b_hi[2], b_hi[3], b_lo[2], b_lo[3]);
            }
        }
    };
    if constexpr (STEP_SUMS && Tf32Operand<PRODUCTS>::SPLIT) {
#pragma unroll 1
        for (int kk = 0; kk < D_TILE / 8; ++kk) k_step(kk);
    } else {
#pragma unroll
        for (int kk = 0; kk < D_TILE / 8; ++kk) k_step(kk);
    }
}

// O += P V: one k-step per key fragment of S. The A fragment of k-step kk is S fragment kk itself
// with its k index permuted, k = t <-> key 2t and k = t + 4 <-> key 2t + 1 (the accumulator's
// own columns, so P never moves between lanes); B takes the same permutation: b0 = V[2t][n],
// b1 = V[2t + 1][n], two float32 reads from the row-major V tile (ldmatrix's .trans splits
// 32-bit values). The reads of a warp hit 32 distinct banks: its rows 2t + e (e fixed) sit at
// swizzle phases 2t + e, its columns 8c + g in chunks 2c + g / 4.
// PRESPLIT: V's tile holds hi already and v_lo_tile lo (split_tile). STEP_SUMS as mma_qk_tf32's.
template <int PRODUCTS, int D_TILE, bool PRESPLIT = false, bool STEP_SUMS = false, int M_STRIPS, int N_FRAGS,
          int D_FRAGS>
__device__ __forceinline__ void mma_pv_tf32(float (&o)[M_STRIPS][D_FRAGS][4],
                                            const float (&s)[M_STRIPS][N_FRAGS][4],
                                            const unsigned char* v_tile, int lane,
                                            const unsigned char* v_lo_tile = nullptr) {
    constexpr int ROW_BYTES = D_TILE * 4;
    const int g = lane >> 2, t = lane & 3;
    // Byte offset of V[2t + e][8c + g] within an 8-key group: the row, the lane's column within
    // its chunk, and (XOR-ed with the chunk pair of c, below) its swizzled chunk.
    u32 row_base[2], chunk_x16[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int row = 2 * t + e;
        row_base[e] = static_cast<u32>(row * ROW_BYTES + 4 * (g & 3));
        chunk_x16[e] = static_cast<u32>(((g >> 2) ^ row) * 16);
    }
#pragma unroll
    for (int kk = 0; kk < N_FRAGS; ++kk) {
        u32 a_hi[M_STRIPS][4], a_lo[M_STRIPS][4];
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i) {
            const float p[4] = {s[i][kk][0], s[i][kk][2], s[i][kk][1], s[i][kk][3]};
#pragma unroll
            for (int e = 0; e < 4; ++e) split_tf32<PRODUCTS>(p[e], a_hi[i][e], a_lo[i][e]);
        }
#pragma unroll
        for (int c = 0; c < D_FRAGS; ++c) {
            u32 b_hi[2], b_lo[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 offset = row_base[e] + static_cast<u32>(kk * 8 * ROW_BYTES + (c >> 2) * 128) +
                                   (chunk_x16[e] ^ static_cast<u32>((2 * c & 7) * 16));
                if constexpr (PRESPLIT) {
                    b_hi[e] = *reinterpret_cast<const u32*>(v_tile + offset);
                    b_lo[e] = Tf32Operand<PRODUCTS>::SPLIT ? *reinterpret_cast<const u32*>(v_lo_tile + offset) : 0u;
                } else {
                    split_tf32<PRODUCTS>(*reinterpret_cast<const float*>(v_tile + offset), b_hi[e], b_lo[e]);
                }
            }
#pragma unroll
            for (int i = 0; i < M_STRIPS; ++i)
                mma_tf32<PRODUCTS, STEP_SUMS>(o[i][c], a_hi[i], a_lo[i], b_hi[0], b_hi[1], b_lo[0], b_lo[1]);
        }
    }
}

// O = rescale O + O_block, one FFMA (rounded to nearest) per accumulator: the key block's P V summed
// in accumulators of its own (FRESH_O), so that the tensor core's accumulation never runs over
// more than one block's keys (dev/tf32_accumulation_probe.py).
template <int M_STRIPS, int D_FRAGS, typename Rescale>
__device__ __forceinline__ void merge_block(float (&o)[M_STRIPS][D_FRAGS][4], const Rescale& rescale,
                                            const float (&block)[M_STRIPS][D_FRAGS][4], int lane) {
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float r = rescale.row(i, h, lane);
#pragma unroll
            for (int f = 0; f < D_FRAGS; ++f)
#pragma unroll
                for (int e = 0; e < 2; ++e) o[i][f][2 * h + e] = fmaf(o[i][f][2 * h + e], r, block[i][f][2 * h + e]);
        }
}

// PRESPLIT's one split of a landed K or V tile for every warp: each thread takes the 16-byte
// chunks it copied itself (cp_async_tile's mapping, so no barrier is needed first), replaces them
// by hi and, for three products, writes lo at the same offset of lo_tile. Per thread and tile
// ROWS D_TILE / (4 NTHREADS) chunks, against every warp splitting every fragment it reads.
template <int PRODUCTS, int ROWS, int D_TILE, int NTHREADS>
__device__ __forceinline__ void split_tile(u32 tile, u32 lo_tile, int thread) {
    constexpr int CHUNKS = 2 * D_TILE / 8;
    constexpr int ROW_STEP = NTHREADS / CHUNKS;
    static_assert(NTHREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0, "cp_async_tile's mapping");
    const int row0 = thread / CHUNKS, chunk = thread % CHUNKS;
#pragma unroll
    for (int i = 0; i < ROWS / ROW_STEP; ++i) {
        const u32 offset = swizzled_offset<2 * D_TILE>(row0 + i * ROW_STEP, chunk);
        u32 x[4], hi[4], lo[4];
        ld_shared_v4(x, tile + offset);
        split_tf32<PRODUCTS>(x, hi, lo);
        st_shared_v4(tile + offset, hi);
        if constexpr (Tf32Operand<PRODUCTS>::SPLIT) st_shared_v4(lo_tile + offset, lo);
    }
}

}  // namespace cf
