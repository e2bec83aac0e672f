// Split-once images (perf log tf32-split-once, -dkdv, tf32-fwd-split-once): a kernel splits each
// block of K and V (or Q and dO) into tf32 hi and lo tiles once for the whole grid and writes their
// bytes, swizzle and all, to a workspace; the kernels that read the block copy those bytes into a
// stage with one bulk copy instead of splitting it again in every CTA. Where a block lies in the
// image, and the store that writes it.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "wgmma_tf32.cuh"

namespace cf {

// Which block of a split-once image (kv_split, q_split) holds block j of BLOCK rows of sequence
// `seq`'s head `head`, its rows from `begin` in a packed batch. A dense batch: (batch, head, block)
// in C order, ceil(seqlen / BLOCK) blocks a head (the call's seqlen). A packed batch: (slot, head)
// in C order, sequence b's blocks from slot begin / BLOCK + b: each sequence's first slot is past
// the one before's last, since floor(r0 / n) + ceil(len / n) <= floor((r0 + len) / n) + 1, and the
// last slot is below total / BLOCK + sequences (backward_plans.kv_split_bytes, q_split_bytes).
template <bool PACKED, int BLOCK>
__device__ __forceinline__ i64 image_block(const SequenceRows& seq, int begin, int seqlen, int nheads, int head,
                                           int j) {
    if constexpr (PACKED) return (i64)(begin / BLOCK + seq.index + j) * nheads + head;
    else return ((i64)seq.batch * nheads + head) * ((seqlen + BLOCK - 1) / BLOCK) + j;
}

// A split block's bytes, from shared memory at `tiles` to its place `dst` in a split-once image as
// they are, swizzle and all: 16 bytes a thread and step, consecutive threads on consecutive chunks.
template <u32 BYTES, int NTHREADS>
__device__ __forceinline__ void store_image_block(u32 tiles, unsigned char* dst, int thread) {
    uint4* const image = reinterpret_cast<uint4*>(dst);
#pragma unroll 4
    for (int c = thread; c < static_cast<int>(BYTES / 16); c += NTHREADS) {
        u32 r[4];
        ld_shared_v4(r, tiles + 16 * c);
        image[c] = make_uint4(r[0], r[1], r[2], r[3]);
    }
}

// The body of both directions' key-block split kernels (flash_fwd_split_kv_tf32,
// flash_bwd_split_kv_tf32), 128 threads: the CTA of key block blockIdx.x, kv head blockIdx.y and
// batch or sequence blockIdx.z splits its block into shared memory with `split(tiles, k, v, rows)`
// (the direction's own step and layout, Tiles) and writes those bytes to the block's place in the
// image, `image + offset(seq, head_kv, j)`. Every key of the sequence, whatever the mask: some
// query block's walk may need any of them.
template <class Tiles, int BLOCK_N, bool PACKED, class Params, class Split, class Offset>
__device__ __forceinline__ void split_key_block_into_image(const Params& p, Split split, Offset offset) {
    static_assert(Tiles::BYTES % (16 * 128) == 0, "whole 16-byte chunks for every thread");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 tiles = aligned_dynamic_smem<Tiles::BYTES>(smem_raw);

    const SequenceRows seq = cta_sequence<SequencesOnly<PACKED>>(p, blockIdx.z);
    const int j = blockIdx.x, n0 = j * BLOCK_N, head_kv = blockIdx.y;
    if (PACKED && n0 >= seq.seqlen_k) return;  // past a shorter sequence's end
    const GlobalRows k{p.k.template row<const float>(seq.batch, seq.k_begin + n0, head_kv), p.k.row_stride};
    const GlobalRows v{p.v.template row<const float>(seq.batch, seq.k_begin + n0, head_kv), p.v.row_stride};
    split(tiles, k, v, seq.seqlen_k - n0);
    __syncthreads();

    // The block out to its place in the image, as its bytes lie in shared memory
    unsigned char* const image = static_cast<unsigned char*>(p.kv_split);
    store_image_block<Tiles::BYTES, 128>(tiles, image + offset(seq, head_kv, j), threadIdx.x);
}

}  // namespace cf
