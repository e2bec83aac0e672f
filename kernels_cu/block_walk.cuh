// The walk of a backward CTA over the blocks of the other side, from the mask policy's ranges
// (mask.cuh): which blocks it visits, in which order, and for which head of a GQA group. The
// policy says which queries see a key block; the walk turns that into the iterations of the
// kernel's main loop, the same way in every dK/dV kernel (mma.sync, fused, wgmma).
#pragma once

#include "common.cuh"

namespace cf {

// A dK/dV CTA owns key block n0 of one kv head and visits, for each of the `group` query heads
// that share that kv head, the query blocks whose rows see some key of its block: blocks
// [first, end) of BLOCK_M rows, from the mask's query range of the key block (blocks outside it
// are never loaded). Iteration it is query head head(head_kv, it) and query block block(it),
// the blocks ascending within each head; the ordered dQ adds walk each head's blocks from the
// last one down instead (block_down_from).
// SKIP_EMPTY: an empty query range walks no block, as KeyBlockRange's below (a kernel that copies
// each block's split image: flash_bwd_dkdv_tf32_wgmma_ws's PRESPLIT).
template <int BLOCK_M, bool SKIP_EMPTY = false>
struct QueryBlockWalk {
    int group;   // query heads per kv head
    int first;   // the first query block that sees the key block
    int end;     // one past the last
    int blocks;  // end - first, or 0
    int iters;   // (query head, query block) pairs: group * blocks
    // The walk in rows, for the kernels that count query rows rather than blocks (the float64 and
    // SIMT dK/dV kernels). m_first: the first block's first row, first * BLOCK_M. m_end: the query
    // range's end, not rounded (KeyBlockRange's n_end): the last block's rows at or past it see no
    // key of the block, and a walk of rows m0 = m_first, m_first + BLOCK_M, ... while m0 < m_end
    // stops at end without the rounding (flash_bwd_dkdv_simt). Initialized last, from the calls
    // first and end make: a kernel that reads neither keeps its code.
    int m_end;
    int m_first;

    template <class Mask>
    __device__ __forceinline__ QueryBlockWalk(const Mask& mask, int n0, int block_n, int group_)
        : group(group_),
          first(mask.query_begin(n0) / BLOCK_M),
          end(SKIP_EMPTY && mask.query_end(n0, block_n) <= mask.query_begin(n0)
                  ? first
                  : (mask.query_end(n0, block_n) + BLOCK_M - 1) / BLOCK_M),
          blocks(max(0, end - first)),
          iters(group_ * blocks),
          m_end(mask.query_end(n0, block_n)),
          m_first(first * BLOCK_M) {}

    __device__ __forceinline__ int head(int head_kv, int it) const { return head_kv * group + it / blocks; }
    __device__ __forceinline__ int block(int it) const { return first + it % blocks; }
    // Iteration it's first query row, block(it) * BLOCK_M counted from m_first, which the
    // constructor computes outside the kernel's loop: as (first + it % blocks) * BLOCK_M in the
    // loop, flash_bwd_dkdv_dmma took up to 6 more registers (sm_80, d64, a window with ALiBi).
    __device__ __forceinline__ int row(int it) const { return m_first + it % blocks * BLOCK_M; }
    // Iteration it's block counted down from `last` (the ordered dQ adds: a dQ block's key blocks
    // add in key order, so every key block visits the last query blocks first).
    __device__ __forceinline__ int block_down_from(int last, int it) const { return last - it % blocks; }
};

// A dQ CTA's key blocks: [first, end) of BLOCK_N keys, from the mask's key range of query rows
// [m0, m0 + rows). With SKIP_EMPTY an empty range gives no block. Rounded to blocks, an empty
// range [b, b) with b not a block multiple is one block, and b may lie past the sequence's end
// (a packed batch's block map is made for the longest sequence: a shorter one's granule without
// keys points past its end). A kernel that loads the block's rows itself walks it harmlessly
// (zero rows); one that copies the block's split image (flash_bwd_dq_tf32_wgmma_ws's PRESPLIT)
// would read another sequence's block, or past the image.
template <int BLOCK_N, bool SKIP_EMPTY = false>
struct KeyBlockRange {
    int first, end, blocks;
    // The range's end in keys, not rounded: the last block's keys at or past it are hidden, and a
    // kernel that walks blocks while j * BLOCK_N < n_end stops at end without the rounding.
    int n_end;

    template <class Mask>
    __device__ __forceinline__ KeyBlockRange(const Mask& mask, int m0, int rows) {
        // first before key_end: the order the kernels computed them in before they took this
        // range, which NVRTC's code keeps (another order moves registers in flash_bwd_dq_wgmma)
        const int key_begin = mask.key_begin(m0);
        first = key_begin / BLOCK_N;
        const int key_end = mask.key_end(m0, rows);
        round_end(key_begin, key_end);
    }
    // From the key range [key_begin, key_end) the kernel asked the mask for itself, for kernels
    // whose machine code keeps where and in which order they ask, which the constructor above
    // would change (flash_fwd_tf32 asks for the end first; flash_fwd_tf32_wgmma rounds the end
    // only where its staging needs it).
    __device__ __forceinline__ KeyBlockRange(int key_begin, int key_end) {
        first = key_begin / BLOCK_N;
        round_end(key_begin, key_end);
    }

  private:
    // Both constructors' end: one rounding, whichever asked the mask.
    __device__ __forceinline__ void round_end(int key_begin, int key_end) {
        end = SKIP_EMPTY && key_end <= key_begin ? first : (key_end + BLOCK_N - 1) / BLOCK_N;
        blocks = end > first ? end - first : 0;
        n_end = key_end;
    }
};

}  // namespace cf
