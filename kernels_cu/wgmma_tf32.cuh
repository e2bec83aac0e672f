// float32 operand tiles for wgmma's tf32 form (sm_90a), split for precision "ieee" on their way
// into shared memory: the producer side of docs/perf-log.md's tf32-wgmma-v0 (step 1 of its plan;
// used by the candidate flash_fwd_tf32_wgmma.cu, which no plan routes to and no GPU has run yet).
//
// wgmma .tf32 reads both shared-memory operands K-major only (it has no transpose: ptxas rejects
// the imm-trans operands on .tf32, dev/wgmma_tf32_probe.py). S = Q K^T and dP = dO V^T read Q, K,
// dO and V as stored, [row][d]; O += P V, dV += P^T dO, dK += dS^T Q and dQ += dS K reduce over
// the sequence, so their B operands (V, dO, Q, K) are wanted as [d][row]. Neither cp.async nor TMA
// transposes, and every operand has to be split anyway (hi = tf32(x), lo = tf32(x - hi),
// tf32.cuh's split_tf32): the loaders here read float4s from global memory into registers, split
// them, and store hi and lo chunks, transposed where the product needs it.
//
// Tile layout: wgmma.cuh's panels with 4-byte elements. A tile of R rows and C float32 columns is
// C / 32 panels of R rows x 128 bytes, panel after panel; 16-byte chunk c (columns 4c .. 4c + 3)
// of panel row r sits at chunk position c ^ (r % 8): panel_offset<R>(r, c) unchanged. In bytes
// this is the 16-bit panel, so the K-major descriptor is too (SBO 1024 bytes, 128-byte swizzle,
// 1024-byte aligned panels); a tf32 k-step (m64nNk8: 8 columns, 32 bytes) advances the start
// address by 32 bytes within a panel, the next panel after 4 steps.
#pragma once

#include "mbarrier.cuh"
#include "tf32.cuh"
#include "wgmma.cuh"

namespace cf {

// 4 float32 operands as their bits (the loaders move and split bits: tf32.cuh's split_tf32 on
// u32 arrays), read-only for the kernel's lifetime (the non-coherent path); zeros where !valid.
__device__ __forceinline__ uint4 ldg_bits4(const float* p, bool valid) {
    return valid ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
}

// Where a loader reads its float32 rows: the (seqlen, dim) slice in global memory (GlobalRows),
// or a raw copy of it that cp.async staged in shared memory (StagedRows). load4(row, column,
// valid): the 4 values from (row, column) as bits, zeros where !valid (nothing read).
struct GlobalRows {
    const float* rows;
    i64 stride;  // elements
    __device__ __forceinline__ uint4 load4(int row, int column, bool valid) const {
        return ldg_bits4(rows + row * stride + column, valid);
    }
};

// A raw tile of ROWS x DIM float32 values in shared memory, 16-byte chunk c of row r at chunk
// position c ^ ((r / 4) % 8): the transposed loader's 8 lanes of a load phase read 8 row groups
// (rows 4 j + r, j = 0..7) of one chunk, which land at 8 distinct positions (bank groups); the
// K-major loader's read 8 consecutive chunks of one row, distinct under any XOR of the row.
template <int DIM>
__device__ __forceinline__ u32 staged_offset(int row, int chunk) {
    static_assert(DIM % 32 == 0, "at least 8 chunks a row");
    return static_cast<u32>((row * (DIM / 4) + (chunk ^ ((row >> 2) & 7))) * 16);
}

template <int DIM>
struct StagedRows {
    u32 tile;
    __device__ __forceinline__ uint4 load4(int row, int column, bool valid) const {
        u32 r[4] = {0u, 0u, 0u, 0u};
        if (valid) ld_shared_v4(r, tile + staged_offset<DIM>(row, column >> 2));
        return make_uint4(r[0], r[1], r[2], r[3]);
    }
};

// Issues the cp.async copies of rows 0 .. ROWS - 1 of a (seqlen, dim) float32 slice (row stride
// `stride` elements) into a StagedRows<DIM> tile: rows >= rows_valid and chunks past the head dim
// are left alone (the loaders do not read them). One commit group is the caller's.
template <int ROWS, int DIM, int NTHREADS>
__device__ __forceinline__ void cp_async_staged_rows(u32 tile, const float* gmem, int rows_valid, int headdim,
                                                     i64 stride, int thread) {
    constexpr int CHUNKS = DIM / 4;
    static_assert((ROWS * CHUNKS) % NTHREADS == 0, "chunks that divide evenly among the threads");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / NTHREADS; ++i) {
        const int q = thread + i * NTHREADS, row = q / CHUNKS, chunk = q % CHUNKS;
        if (row < rows_valid && 4 * chunk < headdim)
            cp_async_16(tile + staged_offset<DIM>(row, chunk), gmem + row * stride + 4 * chunk, true);
    }
}

// A ROWS x DIM tile of a (seqlen, dim) float32 slice (read through `src`) as hi and lo
// panel tiles of ROWS rows and DIM columns (K-major for S = Q K^T and dP = dO V^T). Each thread
// takes one 16-byte chunk column and ROWS / ROW_STEP rows of it; 8 consecutive threads store 8
// chunks of one row, whose swizzled positions are distinct (no bank conflict). Rows >= rows_valid
// and columns >= headdim are zero-filled. Needs headdim, stride and the slice's address in
// multiples of 4 floats (16-byte loads); PRODUCTS 1 stores lo as zeros.
template <int ROWS, int DIM, int NTHREADS, int PRODUCTS, class Source>
__device__ __forceinline__ void split_tf32_panels(u32 hi_tile, u32 lo_tile, const Source& src, int rows_valid,
                                                  int headdim, int thread) {
    constexpr int CHUNKS = DIM / 4;
    constexpr int ROW_STEP = NTHREADS / CHUNKS;
    static_assert(DIM % 32 == 0 && NTHREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0,
                  "whole panels, and tile chunks that divide evenly among the threads");
    const int row0 = thread / CHUNKS, chunk = thread % CHUNKS;
    const bool column_valid = 4 * chunk < headdim;
#pragma unroll
    for (int i = 0; i < ROWS / ROW_STEP; ++i) {
        const int row = row0 + i * ROW_STEP;
        const bool valid = column_valid && row < rows_valid;
        const uint4 v = src.load4(row, 4 * chunk, valid);
        const u32 x[4] = {v.x, v.y, v.z, v.w};
        u32 hi[4], lo[4];
        split_tf32<PRODUCTS>(x, hi, lo);
        const u32 offset = panel_offset<ROWS>(row, chunk);
        st_shared_v4(hi_tile + offset, hi);
        st_shared_v4(lo_tile + offset, lo);
    }
}

// The same slice transposed: hi and lo panel tiles of DIM rows (the head dim) and ROWS columns
// (the sequence), the B operand of a product that reduces over the sequence (O += P V: B[k][n] =
// V[k][n] stored [n][k]). A thread's unit is 4 sequence rows x 4 columns: four 16-byte loads, a
// 4 x 4 transpose in registers (no instruction: the values are renamed), and four 16-byte stores
// of 4 sequence values each. A warp takes 8 consecutive row groups (32 rows) of 4 consecutive
// column groups (16 columns), lane 8 i + j row group j of column group i: each load instruction
// reads 64 contiguous bytes of 8 rows (whole 32-byte sectors), and the 8 lanes of a store phase
// (one i, so one tile row) store 8 consecutive chunks of that row, at 8 distinct swizzled
// positions. Zero fill and alignment as split_tf32_panels.
//
// KEY_PAIRS: within each group of 8 sequence positions, column slots 0-3 hold positions 0, 2, 4, 6
// and slots 4-7 positions 1, 3, 5, 7. That is the order in which P, an accumulator of the
// product before (thread (g, t) of a warp holds columns 2t and 2t + 1 of rows g and g + 8),
// serves as wgmma's register A operand (ALayout of m64nNk8 for 32-bit types: a0 (g, t), a1
// (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)) with no data movement: registers {d0, d2, d1, d3}
// of the accumulator's k-step are A's, the keys relabelled, and V's tile is relabelled to match.
// The lanes of a pair (row groups 2G and 2G + 1 of the same columns) trade two values per column
// by a shuffle; each then stores the one chunk of its parity (chunk index = its row group, as
// without KEY_PAIRS), so the store phases stay conflict-free.
template <int ROWS, int DIM, int NTHREADS, int PRODUCTS, bool KEY_PAIRS = false, class Source>
__device__ __forceinline__ void split_tf32_panels_transposed(u32 hi_tile, u32 lo_tile, const Source& src,
                                                             int rows_valid, int headdim, int thread) {
    constexpr int ROW_BLOCKS = ROWS / 32, COLUMN_BLOCKS = DIM / 16;  // a warp's unit: 32 rows x 16 columns
    constexpr int WARPS = NTHREADS / 32;
    constexpr int WARP_UNITS = ROW_BLOCKS * COLUMN_BLOCKS;
    static_assert(ROWS % 32 == 0 && DIM % 16 == 0 && NTHREADS % 32 == 0 && WARP_UNITS % WARPS == 0,
                  "whole panels, and warp units that divide evenly among the warps");
    const int warp = thread / 32, lane = thread % 32;
#pragma unroll
    for (int u = 0; u < WARP_UNITS / WARPS; ++u) {
        const int unit = warp + u * WARPS;
        const int row_group = 8 * (unit % ROW_BLOCKS) + lane % 8;        // rows 4 row_group .. + 3
        const int column_group = 4 * (unit / ROW_BLOCKS) + lane / 8;     // columns 4 column_group .. + 3
        const int row = 4 * row_group, column = 4 * column_group;
        const bool column_valid = column < headdim;
        u32 x[4][4];  // x[r][e]: row + r, column + e
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const bool valid = column_valid && row + r < rows_valid;
            const uint4 v = src.load4(row + r, column, valid);
            x[r][0] = v.x, x[r][1] = v.y, x[r][2] = v.z, x[r][3] = v.w;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            u32 column_values[4] = {x[0][e], x[1][e], x[2][e], x[3][e]};
            if constexpr (KEY_PAIRS) {
                // The even lane of a pair holds positions 0-3 of its 8-group and keeps 0, 2 (slots 0,
                // 1), taking 4, 6 (slots 2, 3) from its partner; the odd one holds 4-7, keeps 5, 7
                // (slots 2, 3) and takes 1, 3 (slots 0, 1).
                const bool even = (lane & 1) == 0;
                const u32 give0 = even ? x[1][e] : x[0][e], give1 = even ? x[3][e] : x[2][e];
                const u32 take0 = __shfl_xor_sync(0xffffffffu, give0, 1);
                const u32 take1 = __shfl_xor_sync(0xffffffffu, give1, 1);
                column_values[0] = even ? x[0][e] : take0;
                column_values[1] = even ? x[2][e] : take1;
                column_values[2] = even ? take0 : x[1][e];
                column_values[3] = even ? take1 : x[3][e];
            }
            u32 hi[4], lo[4];
            split_tf32<PRODUCTS>(column_values, hi, lo);
            const u32 offset = panel_offset<DIM>(column + e, row_group);
            st_shared_v4(hi_tile + offset, hi);
            st_shared_v4(lo_tile + offset, lo);
        }
    }
}

// A walk's blocks of two float32 row slices (K and V, or Q and dO), each block split into panel
// tiles before its products: RAW_STAGES > 0, the raw rows of the blocks RAW_STAGES ahead staged
// by cp.async (StagedRows: stage j % RAW_STAGES of two ROWS x D_TILE tiles from `raw`); 0, the
// split reads global memory itself (GlobalRows).
template <int ROWS, int D_TILE, int NTHREADS, int RAW_STAGES>
struct Tf32RawStages {
    static constexpr u32 TILE = ROWS * D_TILE * 4;
    static constexpr int STAGES = RAW_STAGES > 0 ? RAW_STAGES : 1;
    u32 raw;

    __device__ __forceinline__ u32 stage(int j) const { return raw + (j % STAGES) * 2 * TILE; }

    // Block j's raw rows (rows row0 .. of the slices a and b, which have `rows` rows, a_cols and
    // b_cols columns) into its stage, with `extra`'s copies (the dK/dV kernel's row statistics),
    // as one commit group: empty where !valid (past the walk's end), so that every block waits
    // for the same count.
    struct NoExtra {
        __device__ __forceinline__ void operator()() const {}
    };
    template <class Extra = NoExtra>
    __device__ __forceinline__ void copy(int j, bool valid, int row0, const float* a, i64 a_stride, int a_cols,
                                         const float* b, i64 b_stride, int b_cols, int rows, int thread,
                                         const Extra& extra = Extra()) const {
        if (valid) {
            if constexpr (RAW_STAGES > 0) {
                cp_async_staged_rows<ROWS, D_TILE, NTHREADS>(stage(j), a + row0 * a_stride, rows - row0, a_cols,
                                                             a_stride, thread);
                cp_async_staged_rows<ROWS, D_TILE, NTHREADS>(stage(j) + TILE, b + row0 * b_stride, rows - row0,
                                                             b_cols, b_stride, thread);
            }
            extra();
        }
        cp_async_commit();
    }

    // The first RAW_STAGES blocks' copies, copy_block(first + s) each (nothing ahead at 0).
    template <class CopyBlock>
    __device__ __forceinline__ void copy_first(int first, const CopyBlock& copy_block) const {
        if constexpr (RAW_STAGES > 0)
#pragma unroll
            for (int s = 0; s < RAW_STAGES; ++s) copy_block(first + s);
    }

    // Block j's tiles as split(a_source, b_source) stores them, whole for wgmma on return. The
    // barrier before the split: every warp is past the previous block's products (waited for),
    // whose tiles it overwrites, and block j's copies (every thread's) have landed; the fence and
    // barrier after: its stores handed to the async proxy, and every thread done with the stage,
    // which copy_ahead(j + RAW_STAGES) then refills. RAW_STAGES 0: copy_ahead(j) issues block j's
    // extras before the split reads a and b (global memory), and they are waited for.
    template <class Split, class CopyAhead>
    __device__ __forceinline__ void land(int j, GlobalRows a, GlobalRows b, const Split& split,
                                         const CopyAhead& copy_ahead) const {
        if constexpr (RAW_STAGES > 0) {
            cp_async_wait<RAW_STAGES - 1>();
            __syncthreads();
            split(StagedRows<D_TILE>{stage(j)}, StagedRows<D_TILE>{stage(j) + TILE});
            fence_proxy_async_shared();
            __syncthreads();
            copy_ahead(j + RAW_STAGES);
        } else {
            __syncthreads();
            copy_ahead(j);
            split(a, b);
            cp_async_wait<0>();
            fence_proxy_async_shared();
            __syncthreads();
        }
    }
};

// A slice split into its K-major tiles (hi, lo) and its transposed KEY_PAIRS tiles (t_hi, t_lo):
// the backward's Q and dO, the dQ kernel's K, each read by one product as rows and by another as
// the dimension it reduces (wgmma .tf32 has no transposed operand).
template <int ROWS, int DIM, int NTHREADS, int PRODUCTS, class Source>
__device__ __forceinline__ void split_tf32_panels_both(u32 hi, u32 lo, u32 t_hi, u32 t_lo, const Source& src,
                                                       int rows_valid, int headdim, int thread) {
    split_tf32_panels<ROWS, DIM, NTHREADS, PRODUCTS>(hi, lo, src, rows_valid, headdim, thread);
    split_tf32_panels_transposed<ROWS, DIM, NTHREADS, PRODUCTS, true>(t_hi, t_lo, src, rows_valid, headdim, thread);
}

// A warpgroup's A operand staged raw in shared memory and split a k-step at a time into registers
// (tf32_product_sums' PREPARE), where split once into registers it does not fit: the forward's Q at
// d128 (tf32-wgmma-d128), the backward pair's K and V (flash_bwd_dkdv_tf32_wgmma_pair). Each warp
// copies its 16 rows as they are (stage_q_rows) in swizzled_offset_f32's layout and reads back only
// those. A fragment's 32 loads hit 32 banks: lanes g = 0..7 read rows whose (row & 7) is g, so the
// swizzle puts one k-step column's chunk at 8 distinct positions.
template <int D_TILE, int PRODUCTS>
struct StagedQ {
    static constexpr bool ACTIVE = true;
    static constexpr u32 ROW_BYTES = D_TILE * 4;
    static_assert(D_TILE == 64 || D_TILE == 128, "rows of 256 or 512 bytes: the chunk XOR stays within a row");
    const unsigned char* tile;  // the staged rows (64 a warpgroup, D_TILE float32 each), shared memory
    u32 lane_offset;            // swizzled_offset_f32(strip_row0 + g, t) with chunk 0: row, g's XOR, 4 t

    __device__ __forceinline__ StagedQ(const unsigned char* tile_, int strip_row0, int lane)
        : tile(tile_), lane_offset((strip_row0 + lane / 4) * ROW_BYTES + (lane / 4 % 8) * 16 + 4 * (lane % 4)) {}

    // A's hi and lo of k-step kk (load_q_fragments' layout). Element (row, 8 kk + t + 4 h) sits at
    // swizzled_offset_f32, whose chunk (2 kk + h) ^ (row & 7) in 16-byte units is lane_offset's
    // g bits XOR (2 kk + h) 16: one LOP3 a load from the one base, which ptxas rematerialises
    // rather than hoisting 4 D_TILE / 8 addresses out of the key loop (as it did for the offsets
    // written whole: 36 bytes spilled at d64, 196 at d128).
    __device__ __forceinline__ void split(int kk, u32 (&hi)[4], u32 (&lo)[4]) const {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const u32 offset = (lane_offset ^ static_cast<u32>((2 * kk + (r >> 1)) * 16)) + (r & 1) * 8 * ROW_BYTES;
            split_tf32<PRODUCTS, Tf32Lo::AS_IS>(*reinterpret_cast<const float*>(tile + offset), hi[r], lo[r]);
        }
    }
};

// The warp's 16 rows of the operand (from strip_row0) copied raw into StagedQ's tile, zeros past the
// rows and head dim given (headdim, stride and the rows' address in multiples of 4 floats). Lane l
// takes row l % 16, two chunks a step: not the forward's store_o order, whose copy-out would
// otherwise share these 16 addresses with this loop and keep them live (spilled) across the key loop.
template <int D_TILE>
__device__ __forceinline__ void stage_q_rows(unsigned char* tile, const float* q_rows, int rows_valid, int headdim,
                                             i64 stride, int strip_row0, int lane) {
    constexpr int CHUNKS = D_TILE / 4;
#pragma unroll
    for (int i = 0; i < CHUNKS / 2; ++i) {
        const int row = strip_row0 + lane % 16, chunk = 2 * i + lane / 16;
        const uint4 v = ldg_bits4(q_rows + row * stride + 4 * chunk, row < rows_valid && 4 * chunk < headdim);
        *reinterpret_cast<uint4*>(tile + swizzled_offset_f32<D_TILE>(row, 4 * chunk)) = v;
    }
    __syncwarp();
}

// ---------------------------------------------------------------------------------------------
// wgmma m64nNk8, float32 accumulators, tf32 operands (the low 13 bits of each float32 register or
// shared-memory word ignored). WgmmaTf32<N>::ss: A and B from shared memory (K-major); ::rs: A
// from registers. Written by cupyflash/kernels/wgmma_wrappers.py.
// ---------------------------------------------------------------------------------------------

template <int N>
struct WgmmaTf32;

// BEGIN generated by cupyflash/kernels/wgmma_wrappers.py: do not edit by hand
template <>
struct WgmmaTf32<32> {
    // D (+)= A B, A and B from shared memory (K-major descriptors).
    static __device__ __forceinline__ void ss(float (&d)[16], u64 desc_a, u64 desc_b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
            : "l"(desc_a), "l"(desc_b), "r"(accumulate)
            : "memory");
    }
    // D (+)= A B, A from registers (a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4) of the
    // warp's 16 rows).
    static __device__ __forceinline__ void rs(float (&d)[16], const u32 (&a)[4], u64 desc_b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)
            : "memory");
    }
};

template <>
struct WgmmaTf32<64> {
    // D (+)= A B, A and B from shared memory (K-major descriptors).
    static __device__ __forceinline__ void ss(float (&d)[32], u64 desc_a, u64 desc_b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(desc_a), "l"(desc_b), "r"(accumulate)
            : "memory");
    }
    // D (+)= A B, A from registers (a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4) of the
    // warp's 16 rows).
    static __device__ __forceinline__ void rs(float (&d)[32], const u32 (&a)[4], u64 desc_b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)
            : "memory");
    }
};

template <>
struct WgmmaTf32<128> {
    // D (+)= A B, A and B from shared memory (K-major descriptors).
    static __device__ __forceinline__ void ss(float (&d)[64], u64 desc_a, u64 desc_b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(desc_a), "l"(desc_b), "r"(accumulate)
            : "memory");
    }
    // D (+)= A B, A from registers (a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4) of the
    // warp's 16 rows).
    static __device__ __forceinline__ void rs(float (&d)[64], const u32 (&a)[4], u64 desc_b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)
            : "memory");
    }
};

template <>
struct WgmmaTf32<256> {
    // D (+)= A B, A and B from shared memory (K-major descriptors).
    static __device__ __forceinline__ void ss(float (&d)[128], u64 desc_a, u64 desc_b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
            : "l"(desc_a), "l"(desc_b), "r"(accumulate)
            : "memory");
    }
    // D (+)= A B, A from registers (a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4) of the
    // warp's 16 rows).
    static __device__ __forceinline__ void rs(float (&d)[128], const u32 (&a)[4], u64 desc_b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)
            : "memory");
    }
};
// END generated

// The K-major descriptor of k-step `step` (8 tf32 columns) of a panel tile of ROWS rows at
// `tile`: 32 bytes per step within a panel, ROWS x 128 bytes per panel of 4 steps.
template <int ROWS>
__device__ __forceinline__ u64 tf32_k_step_desc(u32 tile, int step) {
    return smem_desc(tile + (step >> 2) * (ROWS * 128) + (step & 3) * 32, 16, 1024);
}

// The same from the tile's own descriptor (tf32_k_step_desc(tile, 0)): its 14-bit start field
// (address >> 4) plus the k-step's offset >> 4, the other fields as they are. The field cannot
// carry out (shared-memory addresses stay below 2^18), so one 32-bit add a k-step replaces the
// mask, shift and OR of the address form, which the uniform datapath issued per descriptor
// (docs/perf-log.md tf32-desc-advance).
template <int ROWS>
__device__ __forceinline__ u64 tf32_k_step_desc_after(u64 tile_desc, int step) {
    const u32 bytes = (step >> 2) * (ROWS * 128) + (step & 3) * 32;
    return (tile_desc & 0xFFFFFFFF00000000ull) | static_cast<u32>(static_cast<u32>(tile_desc) + (bytes >> 4));
}

// tf32_product_sums' prepare when the A operands are ready before it (no per-k-step step).
struct NoPrepare {
    __device__ __forceinline__ void operator()(int) const {}
};

// A product summed over K_STEPS k-steps of 8 into `s` (NV accumulator values a thread), waited
// for: issue(kk, small, hh, hh_accumulates) issues k-step kk, its small products (SPLIT: lo hi,
// hi lo) into `small`, which they start at k-step 0, and hi hi into `hh`. Chained (!APART): all
// of it into `s`. APART (precision "ieee"): the tensor cores' accumulation truncates, and its
// error grows with the number of products chained into one accumulator (tf32-fwd-v1's probe: 3
// products a k-step into one accumulator, 2x float32 FMA's error at 128 terms, 16x at 8192). So
// the small products go into an accumulator of their own, added by one FADD (the probe's "small
// products apart": FMA's error at 128 terms), and hi hi is restarted every HH_CHAIN k-steps: its
// chained truncations were most of what the apart form still missed on a few keys
// (dev/emulate_split_tf32.py: a tensor-core sum truncated to float32 reproduces the H200's
// errors; restarting every 2 k-steps brings the failing two- and three-key draws to 3.4e-6 /
// 2.9e-6, under the 2x bound, and the 1k error from 1.66x to 1.23x standard's). Two chains in
// flight; each is added to `s` by FADDs once waited for. Same products, three times the
// registers. turns.wait() before the first issue, turns.pass() after the last.
//
// PREPARE (A operands formed per k-step, tf32-wgmma-d128: Q staged raw in shared memory, split
// into registers as it is needed): prepare(kk) writes the A registers k-step kk issues with, in
// slot kk % 4, before the fence of its commit group of two k-steps, since wgmma reads its register
// operands until it completes; the group two before has been waited for by then, so four slots
// suffice. Without APART the groups share `s` (one accumulator, the same products in the same
// order).
//
// HH_CHAIN: the k-steps of one hi hi chain, 2 (one commit group) unless the caller asks for 4 (two
// groups; tf32-hh-chain-4: at d128's 16 k-steps half the chains' FADDs, emulated at 1.0x standard
// float32's error where chains of 2 are at 0.88x, the bound 2x). The commit groups stay of two
// k-steps either way, so the A slots and the waits are the same.
template <int NV, int K_STEPS, bool SPLIT, bool APART, bool PREPARE = false, int HH_CHAIN = 2, class Issue,
          class Turns, class Prepare = NoPrepare>
__device__ __forceinline__ void tf32_product_sums(float (&s)[NV], const Issue& issue, const Turns& turns,
                                                  const Prepare& prepare = Prepare()) {
    static_assert(!APART || SPLIT, "apart sums are the split products'");
    static_assert(HH_CHAIN == 2 || HH_CHAIN == 4, "chains of one or two commit groups");
    constexpr int GROUP = 2, GROUPS = (K_STEPS + GROUP - 1) / GROUP;
    constexpr int PER_CHAIN = HH_CHAIN / GROUP, CHAINS = (GROUPS + PER_CHAIN - 1) / PER_CHAIN;
    auto prepare_group = [&](int g) {
#pragma unroll
        for (int t = 0; t < GROUP; ++t)
            if (g * GROUP + t < K_STEPS) prepare(g * GROUP + t);
    };
    if constexpr (APART) {
        float small[NV], hh[2][NV];
        auto add_chain = [&](float(&chain)[NV], bool first) {
            pin_registers(chain);
#pragma unroll
            for (int e = 0; e < NV; ++e) s[e] = first ? chain[e] : s[e] + chain[e];
        };
        turns.wait();
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            const int c = g / PER_CHAIN;  // the group's chain
            if constexpr (PREPARE) prepare_group(g);
            wgmma_fence();
#pragma unroll
            for (int t = 0; t < GROUP; ++t) {
                const int kk = g * GROUP + t;
                if (kk < K_STEPS) issue(kk, small, hh[c & 1], kk % HH_CHAIN > 0);
            }
            wgmma_commit();
            if (g > 0 && g % PER_CHAIN == 0) {  // the chain before is complete: into s
                wgmma_wait<1>();
                add_chain(hh[(c - 1) & 1], c == 1);
            } else if (g > 0 && PREPARE) {
                wgmma_wait<1>();  // group g - 1, whose A slots group g + 1 takes, has completed
            }
        }
        turns.pass();
        wgmma_wait<0>();
        add_chain(hh[(CHAINS - 1) & 1], CHAINS == 1);
        pin_registers(small);
#pragma unroll
        for (int e = 0; e < NV; ++e) s[e] += small[e];
    } else if constexpr (PREPARE) {
        turns.wait();
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            if (g > 1) wgmma_wait<1>();  // group g - 2, whose A slots group g takes, has completed
            prepare_group(g);
            wgmma_fence();
#pragma unroll
            for (int t = 0; t < GROUP; ++t)
                if (g * GROUP + t < K_STEPS) issue(g * GROUP + t, s, s, SPLIT ? 1 : g * GROUP + t > 0);
            wgmma_commit();
        }
        turns.pass();
        wgmma_wait<0>();
        pin_registers(s);
    } else {
        turns.wait();
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) issue(kk, s, s, SPLIT ? 1 : kk > 0);
        wgmma_commit();
        turns.pass();
        wgmma_wait<0>();
        pin_registers(s);
    }
}

// acc += A B over K_FRAGS k-steps of 8, waited for: A from registers, the accumulator values `a`
// of the product before (frag f: its 8-column block f, a[4 f .. 4 f + 3]), B from a K-major panel
// tile of N rows (hi and lo) whose k order is KEY_PAIRS' (split_tf32_panels_transposed). The
// accumulator's {d0, d2, d1, d3} of a column block are A's {(g, t), (g + 8, t), (g, t + 4),
// (g + 8, t + 4)} with column 2t as slot t and 2t + 1 as slot t + 4: no data movement, the
// columns relabelled and the B tile relabelled to match. Each value is split once (PRODUCTS 3:
// lo hi + hi lo + hi hi, the small terms first). FRESH: the products into a zeroed accumulator
// of their own, added to acc by one FADD a value (one call's chain truncated, not every call's:
// tf32-fwd-v2's FRESH_O).
template <int N, int K_FRAGS, int PRODUCTS, bool FRESH, bool WEIGHTS = false, class Turns>
__device__ __forceinline__ void tf32_acc_times_tile(float (&acc)[N / 2], const float (&a)[K_FRAGS * 4], u32 b_hi_tile,
                                                    u32 b_lo_tile, const Turns& turns) {
    constexpr bool SPLIT = Tf32Operand<PRODUCTS>::SPLIT;
    u32 a_hi[K_FRAGS][4], a_lo[K_FRAGS][4];
#pragma unroll
    for (int f = 0; f < K_FRAGS; ++f) {
        const float x[4] = {a[4 * f], a[4 * f + 2], a[4 * f + 1], a[4 * f + 3]};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if constexpr (WEIGHTS)  // the forward's P (Tf32Lo::FINITE: its NaN is its row's l's)
                split_tf32<PRODUCTS, Tf32Lo::FINITE>(x[e], a_hi[f][e], a_lo[f][e]);
            else
                split_tf32<PRODUCTS>(x[e], a_hi[f][e], a_lo[f][e]);
        }
    }
    float fresh[FRESH ? N / 2 : 1];
    float(&out)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(FRESH ? fresh : acc);
    const u64 b_hi_desc = tf32_k_step_desc<N>(b_hi_tile, 0), b_lo_desc = tf32_k_step_desc<N>(b_lo_tile, 0);
    turns.wait();
    wgmma_fence();
#pragma unroll
    for (int f = 0; f < K_FRAGS; ++f) {
        const u64 b_hi = tf32_k_step_desc_after<N>(b_hi_desc, f);
        if constexpr (SPLIT) {
            WgmmaTf32<N>::rs(out, a_lo[f], b_hi, FRESH ? f > 0 : 1);
            WgmmaTf32<N>::rs(out, a_hi[f], tf32_k_step_desc_after<N>(b_lo_desc, f), 1);
        }
        WgmmaTf32<N>::rs(out, a_hi[f], b_hi, FRESH && !SPLIT ? f > 0 : 1);  // the only product: it starts `fresh`
    }
    wgmma_commit();
    turns.pass();
    wgmma_wait<0>();
    pin_registers(out);
    if constexpr (FRESH) {
#pragma unroll
        for (int e = 0; e < N / 2; ++e) acc[e] += fresh[e];
    }
}

}  // namespace cf
