// Tile steps shared by the tensor-core backward kernels (the two-kernel family of
// mma_bwd_layouts.cuh, flash_bwd_fused_mma.cu): backward-only PTX, swizzled tile geometry for tiles
// of any width, warp-tile products whose operands come from shared memory or registers,
// accumulator staging and stores. The mask is the policy's (mask.cuh).
#pragma once

#include "common.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"

namespace cf {
// ---------------------------------------------------------------------------------------------
// Run-time arguments (bwd_args)
// ---------------------------------------------------------------------------------------------
//
// Every kernel takes one BwdParams (params.cuh) and copies the fields it uses into locals at its
// top, its tensors as TensorRows values: fields read where the loops use them changed the address
// arithmetic built on them (flash_bwd_dq_mma_v2 d128: 40 more instructions, 6 more registers);
// copied at the top they are values, like the kernel arguments they replace, still read from the
// constant bank. (flash_bwd_dq_mma_v2 reads its key-block addresses from `p`
// at each load on purpose: held across the loop they cost its causal d128 instance 8 bytes of
// spills.) Plain C++ loads of read-only data (lse and D in the dQ kernels, dq_accum in the
// convert) go through ldg / __ldg: a pointer from the struct does not get the read-only path
// (LDG.CONSTANT) that a const __restrict__ kernel argument got.
//
// What a copy cannot restore: NVVM's uniformity analysis treats every value loaded from the
// struct as divergent (a scalar kernel argument was uniform), so it no longer duplicates a loop
// on a condition built from them, such as a block's `partial`. masked_or_not below makes the two
// instances of each masking step explicit instead.

// ---------------------------------------------------------------------------------------------
// Copies used only by the backward (cp_async_4: mma.cuh)
// ---------------------------------------------------------------------------------------------

// Copies lse and D of query rows m0..m0 + BLOCK_M - 1 (stat0: index of row m0 in the (batch, head,
// seqlen_q) arrays) into stage `stage` of the [2][BLOCK_M]-float arrays at lse_slots and
// delta_slots by 4-byte cp.async; rows from seqlen_q on are zero-filled (their source address
// stays that of row m0, which exists).
template <int BLOCK_M, int NTHREADS>
__device__ __forceinline__ void cp_async_row_stats(u32 lse_slots, u32 delta_slots, int stage, const float* lse,
                                                   const float* delta, i64 stat0, int m0, int seqlen_q, int thread) {
    for (int i = thread; i < 2 * BLOCK_M; i += NTHREADS) {
        const int r = i % BLOCK_M;
        const bool is_lse = i < BLOCK_M;
        cp_async_4((is_lse ? lse_slots : delta_slots) + (stage * BLOCK_M + r) * 4,
                   (is_lse ? lse : delta) + stat0 + (m0 + r < seqlen_q ? r : 0), m0 + r < seqlen_q);
    }
}

// p[0] += a, p[1] += b in global memory, no return value (a fire-and-forget reduction in L2).
__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + 1), "f"(b) : "memory");
#endif
}

// threadIdx.x read by a volatile instruction, which the compiler cannot hoist out of a loop.
// Fragment addresses derived from it inside a loop body are recomputed every iteration (a few
// integer instructions) instead of being held in registers across the loop, where they would
// push the accumulators into local memory.
__device__ __forceinline__ int thread_index_uncached() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
    return t;
}

// ---------------------------------------------------------------------------------------------
// Tile geometry
// ---------------------------------------------------------------------------------------------

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile with COLS 16-bit columns.
// Rows of 128 bytes or more use mma.cuh's swizzle. 64-byte rows (COLS == 32, the dS tile of the
// head-dim-256 kernel) put two rows in one 128-byte line; XOR with (row / 2) % 4 sends the 8 rows
// an ldmatrix phase reads to 8 distinct bank groups (row % 2 picks the half-line).
template <int COLS>
__device__ __forceinline__ u32 tile_offset(int row, int chunk) {
    if constexpr (COLS >= 64) {
        return swizzled_offset<COLS>(row, chunk);
    } else {
        static_assert(COLS == 32, "dS tile rows are 32 or a multiple of 64 columns");
        return static_cast<u32>((row * 4 + (chunk ^ ((row >> 1) & 3))) * 16);
    }
}

// Offset of (row + rows, chunk + chunks) from `lane_off`, the offset of (row, chunk), for steps
// known at compile time after unrolling. Valid when rows % 8 == 0 (the swizzle phase of a row
// repeats every 8 rows) and the low 3 bits of chunk and chunks are disjoint (then adding chunks
// is an XOR in the swizzled bits and an add above them). Every fragment address of an unrolled
// loop is then one XOR with an immediate plus an immediate offset, instead of a recomputed
// swizzle: otherwise the compiler hoists all of them out of the main loop, into registers.
template <int COLS>
__device__ __forceinline__ u32 tile_step(u32 lane_off, int rows, int chunks) {
    if constexpr (COLS >= 64) {
        return (lane_off ^ static_cast<u32>((chunks & 7) * 16)) + rows * (COLS * 2) + (chunks >> 3) * 128;
    } else {
        return lane_off + rows * (COLS * 2);  // chunks == 0 here
    }
}

// ldmatrix.x4 supplies 4 8x8 matrices; lane l gives row l % 8 of matrix l / 8. Two lane->address
// patterns cover every operand below (derivation in tests/test_mma_layout.py):
//   pattern X: row l % 16, chunk l / 16        A (16 x 16) of a row-major [m][k] tile, non-trans;
//                                              B of two n-blocks from a [k][n] tile, .trans
//   pattern Y: row l % 8 + 8 (l / 16),         B of two n-blocks from an [n][k] tile, non-trans;
//              chunk (l / 8) % 2               A (16 x 16) from a [k][m] tile, .trans
// For B the registers come out as {b0, b1} of n-block 0, then {b0, b1} of n-block 1.
__device__ __forceinline__ int ldm_row_x(int lane) { return lane & 15; }
__device__ __forceinline__ int ldm_chunk_x(int lane) { return lane >> 4; }
__device__ __forceinline__ int ldm_row_y(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__device__ __forceinline__ int ldm_chunk_y(int lane) { return (lane >> 3) & 1; }

// ---------------------------------------------------------------------------------------------
// Warp tile products. A warp owns a 16-row accumulator acc[N / 8][4]: acc[j] is the m16n8 C
// fragment of columns 8j..8j+7. Tiles are shared-memory byte addresses; row and column origins
// are multiples of 16 rows and of 64 columns (k0) or of N (column origins of B), as tile_step
// requires.
// ---------------------------------------------------------------------------------------------


// The C fragments of a 16 x K accumulator, rounded to 16 bits, as the A fragments of its K / 16
// k-steps: {c0 c1 | c2 c3} of column block 2kk are a0, a1; those of block 2kk + 1 are a2, a3.
template <typename T, int K>
__device__ __forceinline__ void pack_a_frags(u32 (&a)[K / 16][4], const float (&c)[K / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        a[kk][0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
        a[kk][1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
        a[kk][2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[kk][3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
}

// Writes a warp's 16-row accumulator, times `mult`, as 16-bit values into rows row0..+16,
// columns col0.. of a swizzled [.][DIM] tile (staging for coalesced 16-byte global stores).
template <typename T, int N, int DIM>
__device__ __forceinline__ void stage_acc(u32 tile, int row0, int col0, const float (&acc)[N / 8][4],
                                          float mult, int lane) {
    const int r = row0 + lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const int chunk = (col0 + 8 * j) / 8;
        st_shared_b32(tile + tile_offset<DIM>(r, chunk) + 2 * c, pack2<T>(acc[j][0] * mult, acc[j][1] * mult));
        st_shared_b32(tile + tile_offset<DIM>(r + 8, chunk) + 2 * c, pack2<T>(acc[j][2] * mult, acc[j][3] * mult));
    }
}

// Copies rows 0..ROWS of a swizzled [ROWS][DIM] tile to a (seqlen, dim) slice (`gmem` at tile row
// 0, row stride `stride`), 16 bytes per thread and step; rows >= rows_valid and columns >= headdim
// are not written.
template <int ROWS, int DIM, int NTHREADS, typename T>
__device__ __forceinline__ void store_tile(T* gmem, u32 tile, int rows_valid, int headdim, i64 stride,
                                           int thread) {
    constexpr int CHUNKS = DIM / 8;
    static_assert((ROWS * CHUNKS) % NTHREADS == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / NTHREADS; ++i) {
        const int idx = thread + i * NTHREADS;
        const int row = idx / CHUNKS, chunk = idx % CHUNKS;
        if (row < rows_valid && chunk * 8 < headdim) {
            u32 r[4];
            ld_shared_v4(r, tile + tile_offset<DIM>(row, chunk));
            st_global_v4(gmem + row * stride + chunk * 8, r);
        }
    }
}

// Head-dim split (WARPS_D = 2): adds the partner warp's (warp ^ 1) partial sums to acc. Each lane
// reads the slot of the same lane of the partner, so the swap needs no index math. S^T and dP^T
// use separate slots and alternate: a warp rewrites its S^T slot only after passing the dP^T
// barrier, which the partner reaches only after reading that S^T slot (and likewise for dP^T).
template <int N>
__device__ __forceinline__ void swap_partial_sums(float (&acc)[N][4], u32 xchg, u32 warp_bytes, int warp,
                                                  int pair, int lane) {
    const u32 mine = xchg + warp * warp_bytes + lane * 16;
    const u32 theirs = xchg + (warp ^ 1) * warp_bytes + lane * 16;
#pragma unroll
    for (int j = 0; j < N; ++j)
        st_shared_v4(mine + j * 512, __float_as_uint(acc[j][0]), __float_as_uint(acc[j][1]),
                     __float_as_uint(acc[j][2]), __float_as_uint(acc[j][3]));
    named_barrier_sync(1 + pair, 64);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        u32 x[4];
        ld_shared_v4(x, theirs + j * 512);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] += __uint_as_float(x[e]);
    }
}

// lse in log2 units. A row that sees no key has lse = -inf; 0 as its base keeps exp2 finite
// (all of its entries are masked anyway).
__device__ __forceinline__ float lse_base_log2(float lse) {
    return lse == neg_inf<float>() ? 0.f : lse * 1.4426950408889634f;
}

// The k-step loop of the mma_*_groups products: acc[g] += A_g B over K in k-steps of 16, G row
// groups of A against N columns of B; a_of(kk, a) gives the G A fragments of k-step kk (each
// feeding N / 8 mma), b_of(kk, nn, b) the B fragment of k-step kk and columns 16 nn.. (loaded
// once for all G groups). K_UNROLL k-steps are unrolled (all by default); fewer keep the compiler
// from loading the fragments of many k-steps ahead, which costs registers.
template <typename T, int G, int N, int K, int K_UNROLL = K / 16, class AOf, class BOf>
__device__ __forceinline__ void mma_groups(float (&acc)[G][N / 8][4], const AOf& a_of, const BOf& b_of) {
    static_assert(N % 16 == 0 && K % 16 == 0, "warp tile shape");
#pragma unroll K_UNROLL
    for (int kk = 0; kk < K / 16; ++kk) {
        u32 a[G][4];
        a_of(kk, a);
#pragma unroll
        for (int nn = 0; nn < N / 16; ++nn) {
            u32 b[4];
            b_of(kk, nn, b);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                mma_16816<T>(acc[g][2 * nn], a[g], b[0], b[1]);
                mma_16816<T>(acc[g][2 * nn + 1], a[g], b[2], b[3]);
            }
        }
    }
}

// acc[g] += A_g B^T for A_g = rows a_row0 + 16 g of a row-major [.][DIM_A] tile, B rows of a
// row-major [.][DIM_B] tile, both from column k0 (S^T = K Q^T, dP^T = V dO^T).
template <typename T, int G, int N, int K, int DIM_A, int DIM_B, int K_UNROLL = K / 16>
__device__ __forceinline__ void mma_ABt_groups(float (&acc)[G][N / 8][4], u32 tile_a, int a_row0, u32 tile_b,
                                               int k0, int lane) {
    const u32 a_lane = tile_offset<DIM_A>(a_row0 + ldm_row_x(lane), k0 / 8 + ldm_chunk_x(lane));
    const u32 b_lane = tile_offset<DIM_B>(ldm_row_y(lane), k0 / 8 + ldm_chunk_y(lane));
    mma_groups<T, G, N, K, K_UNROLL>(acc, [&](int kk, u32(&a)[G][4]) {
#pragma unroll
        for (int g = 0; g < G; ++g) ldmatrix_x4(a[g], tile_a + tile_step<DIM_A>(a_lane, 16 * g, 2 * kk));
    }, [&](int kk, int nn, u32(&b)[4]) { ldmatrix_x4(b, tile_b + tile_step<DIM_B>(b_lane, 16 * nn, 2 * kk)); });
}

// The B side of the other mma_*_groups products: B rows 0..K, columns b_col0..+N of a row-major
// [K][DIM_B] tile (transposed ldmatrix), each fragment loaded once for all G row groups;
// a_of(kk, a) gives the G A fragments of k-step kk.
template <typename T, int G, int N, int K, int DIM_B, class AOf>
__device__ __forceinline__ void mma_groups_times_b(float (&acc)[G][N / 8][4], const AOf& a_of, u32 tile_b, int b_col0,
                                                   int lane) {
    const u32 b_lane = tile_offset<DIM_B>(ldm_row_x(lane), b_col0 / 8 + ldm_chunk_x(lane));
    mma_groups<T, G, N, K>(acc, a_of, [&](int kk, int nn, u32(&b)[4]) {
        ldmatrix_x4_trans(b, tile_b + tile_step<DIM_B>(b_lane, 16 * kk, 2 * nn));
    });
}

// acc[g] += A_g B with A_g as register fragments a[g][K / 16], B as mma_groups_times_b's.
template <typename T, int G, int N, int K, int DIM_B>
__device__ __forceinline__ void mma_AB_regs_groups(float (&acc)[G][N / 8][4], const u32 (&a)[G][K / 16][4],
                                                   u32 tile_b, int b_col0, int lane) {
    mma_groups_times_b<T, G, N, K, DIM_B>(acc, [&](int kk, u32(&frag)[G][4]) {
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int r = 0; r < 4; ++r) frag[g][r] = a[g][kk][r];
    }, tile_b, b_col0, lane);
}

// acc[g] += A_g B with A_g = rows a_row0 + 16 g, columns 0..K of a row-major [.][DIM_A] tile
// (non-transposed ldmatrix), B as mma_groups_times_b's: the fused kernel's dV += P^T dO and
// dK += dS^T Q with P^T and dS^T staged in shared memory.
template <typename T, int G, int N, int K, int DIM_A, int DIM_B>
__device__ __forceinline__ void mma_AB_groups(float (&acc)[G][N / 8][4], u32 tile_a, int a_row0, u32 tile_b,
                                              int b_col0, int lane) {
    const u32 a_lane = tile_offset<DIM_A>(a_row0 + ldm_row_x(lane), ldm_chunk_x(lane));
    mma_groups_times_b<T, G, N, K, DIM_B>(acc, [&](int kk, u32(&a)[G][4]) {
#pragma unroll
        for (int g = 0; g < G; ++g) ldmatrix_x4(a[g], tile_a + tile_step<DIM_A>(a_lane, 16 * g, 2 * kk));
    }, tile_b, b_col0, lane);
}

// acc[g] += A_g^T B with A_g^T = columns a_col0 + 16 g of a row-major [K][DIM_A] tile (transposed
// ldmatrix), B as mma_groups_times_b's: dQ += dS K with dS stored as dS^T. mma_AtB for G row
// groups.
template <typename T, int G, int N, int K, int DIM_A, int DIM_B>
__device__ __forceinline__ void mma_AtB_groups(float (&acc)[G][N / 8][4], u32 tile_a, int a_col0, u32 tile_b,
                                               int b_col0, int lane) {
    const u32 a_lane = tile_offset<DIM_A>(ldm_row_y(lane), a_col0 / 8 + ldm_chunk_y(lane));
    mma_groups_times_b<T, G, N, K, DIM_B>(acc, [&](int kk, u32(&a)[G][4]) {
#pragma unroll
        for (int g = 0; g < G; ++g) ldmatrix_x4_trans(a[g], tile_a + tile_step<DIM_A>(a_lane, 16 * kk, 2 * g));
    }, tile_b, b_col0, lane);
}

// acc += A B^T: A rows a_row0..+16 of a row-major [.][DIM_A] tile, B rows 0..N of a row-major
// [N][DIM_B] tile, reduced over columns k0..k0+K of both (S = Q K^T, S^T = K Q^T, dP = dO V^T).
// One row group of mma_ABt_groups (below).
template <typename T, int N, int K, int DIM_A, int DIM_B>
__device__ __forceinline__ void mma_ABt(float (&acc)[N / 8][4], u32 tile_a, int a_row0, u32 tile_b,
                                        int k0, int lane) {
    mma_ABt_groups<T, 1, N, K, DIM_A, DIM_B>(reinterpret_cast<float(&)[1][N / 8][4]>(acc), tile_a, a_row0, tile_b,
                                             k0, lane);
}

// acc += A B: A (16 x K) as register fragments a[K / 16], B rows 0..K, columns b_col0..+N of a
// row-major [K][DIM_B] tile (dV += P^T dO, dK += dS^T Q, dQ += dS K). One row group of
// mma_AB_regs_groups.
template <typename T, int N, int K, int DIM_B>
__device__ __forceinline__ void mma_AB_regs(float (&acc)[N / 8][4], const u32 (&a)[K / 16][4],
                                            u32 tile_b, int b_col0, int lane) {
    mma_AB_regs_groups<T, 1, N, K, DIM_B>(reinterpret_cast<float(&)[1][N / 8][4]>(acc),
                                          reinterpret_cast<const u32(&)[1][K / 16][4]>(a), tile_b, b_col0, lane);
}

// acc += A^T B: A^T rows = columns a_col0..+16 of a row-major [K][DIM_A] tile, B rows 0..K,
// columns b_col0..+N of a row-major [K][DIM_B] tile (dQ += dS K with dS stored as dS^T). One row
// group of mma_AtB_groups.
template <typename T, int N, int K, int DIM_A, int DIM_B>
__device__ __forceinline__ void mma_AtB(float (&acc)[N / 8][4], u32 tile_a, int a_col0, u32 tile_b,
                                        int b_col0, int lane) {
    mma_AtB_groups<T, 1, N, K, DIM_A, DIM_B>(reinterpret_cast<float(&)[1][N / 8][4]>(acc), tile_a, a_col0, tile_b,
                                             b_col0, lane);
}

// The two 16-bit values of a packed pair (lo in bits 0..15) as floats: the inverse of pack2.
template <typename T>
__device__ __forceinline__ float2 unpack2(u32 v);

template <>
__device__ __forceinline__ float2 unpack2<bf16_t>(u32 v) {
    float2 r;
    r.x = __uint_as_float(v << 16);
    r.y = __uint_as_float(v & 0xffff0000u);
    return r;
}

template <>
__device__ __forceinline__ float2 unpack2<half_t>(u32 v) {
    float2 r;
    asm("{\n.reg .f16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.f32.f16 %0, lo;\ncvt.f32.f16 %1, hi;\n}\n"
        : "=f"(r.x), "=f"(r.y)
        : "r"(v));
    return r;
}

// Packs a warp's 16-row accumulator to 16-bit pairs in C-fragment order: p[j][0] holds c0, c1 of
// column block j (row g), p[j][1] holds c2, c3 (row g + 8).
template <typename T, int N>
__device__ __forceinline__ void pack_c_frags(u32 (&p)[N / 8][2], const float (&acc)[N / 8][4]) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        p[j][0] = pack2<T>(acc[j][0], acc[j][1]);
        p[j][1] = pack2<T>(acc[j][2], acc[j][3]);
    }
}

// stage_acc for an accumulator already packed by pack_c_frags.
template <int N, int DIM>
__device__ __forceinline__ void stage_packed(u32 tile, int row0, int col0, const u32 (&p)[N / 8][2], int lane) {
    const int r = row0 + lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const int chunk = (col0 + 8 * j) / 8;
        st_shared_b32(tile + tile_offset<DIM>(r, chunk) + 2 * c, p[j][0]);
        st_shared_b32(tile + tile_offset<DIM>(r + 8, chunk) + 2 * c, p[j][1]);
    }
}

}  // namespace cf
