// Split-once images (perf log tf32-split-once, -dkdv, tf32-fwd-split-once): a kernel splits each
// block of K and V (or Q and dO) into tf32 hi and lo tiles once for the whole grid and writes their
// bytes, swizzle and all, to a workspace; the kernels that read the block copy those bytes into a
// stage with one bulk copy instead of splitting it again in every CTA. Where a block lies in the
// image, and the store that writes it.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"

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

}  // namespace cf
