// Walks and tile orders, from the mask policy's ranges (mask.cuh): which blocks a CTA visits, in
// which order, and for which head of a GQA group. The policy says which queries see a key block;
// a walk turns that into the iterations of a kernel's main loop, the same way in every kernel of
// a kind (QueryBlockWalk: every dK/dV kernel, mma.sync, fused and wgmma), and a tile order hands
// the tiles of a persistent grid out (ForwardTileOrder: flash_fwd_wgmma's persistent instances).
#pragma once

#include "common.cuh"

namespace cf {

// A dK/dV CTA owns key block n0 of one kv head and visits, for each of the `group` query heads
// that share that kv head, the query blocks whose rows see some key of its block: blocks
// [first, end) of BLOCK_M rows, from the mask's query range of the key block (blocks outside it
// are never loaded). Iteration it is query head head(head_kv, it) and query block block(it),
// the blocks ascending within each head; the ordered dQ adds walk each head's blocks from the
// last one down instead (block_down_from).
template <int BLOCK_M>
struct QueryBlockWalk {
    int group;   // query heads per kv head
    int first;   // the first query block that sees the key block
    int end;     // one past the last
    int blocks;  // end - first, or 0
    int iters;   // (query head, query block) pairs: group * blocks

    template <class Mask>
    __device__ __forceinline__ QueryBlockWalk(const Mask& mask, int n0, int block_n, int group_)
        : group(group_),
          first(mask.query_begin(n0) / BLOCK_M),
          end((mask.query_end(n0, block_n) + BLOCK_M - 1) / BLOCK_M),
          blocks(max(0, end - first)),
          iters(group_ * blocks) {}

    __device__ __forceinline__ int head(int head_kv, int it) const { return head_kv * group + it / blocks; }
    __device__ __forceinline__ int block(int it) const { return first + it % blocks; }
    // Iteration it's block counted down from `last` (the ordered dQ adds: a dQ block's key blocks
    // add in key order, so every key block visits the last query blocks first).
    __device__ __forceinline__ int block_down_from(int last, int it) const { return last - it % blocks; }
};

// The query-block tiles of a dense forward in the order a persistent grid takes them: CTA c runs
// tiles c, c + gridDim.x, c + 2 gridDim.x, ... . Tile t is the grid's block t in launch order
// (x fastest): query block query_block(t % M) of head (t / M) % H and batch t / (M H), so the
// CTAs at work at one time share a head's K and V in L2, as the grid's do, and under a right bound
// each head's heaviest query blocks go first. (Rank-major, every head's block of one rank
// together, measured 12-17% slower than the grid at d128 on an H200; its 132 CTAs at work read
// 16 heads' K and V at once where the grid's read one or two.)
template <class Mask>
struct ForwardTileOrder {
    int m_blocks, nheads, batch;

    __device__ __forceinline__ int count() const { return m_blocks * nheads * batch; }
    __device__ __forceinline__ int m_block(int t) const { return Mask::query_block(t % m_blocks, m_blocks); }
    __device__ __forceinline__ int head(int t) const { return (t / m_blocks) % nheads; }
    __device__ __forceinline__ int batch_of(int t) const { return t / (m_blocks * nheads); }
};

}  // namespace cf
