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
// tiles c, c + gridDim.x, c + 2 gridDim.x, ... . Tile t is query block query_block(t / (H B)) of
// head t % H and batch (t / H) % B: every head's and batch's block of one rank goes out together,
// and with a right bound (causal) the ranks go from the heaviest query blocks (most keys) down,
// as Mask::query_block orders a grid's x. Handed out round-robin, costs that fall steadily give
// each CTA tiles of every weight; what a CTA can lose to another is about one tile.
template <class Mask>
struct ForwardTileOrder {
    int m_blocks, nheads, batch;

    __device__ __forceinline__ int count() const { return m_blocks * nheads * batch; }
    __device__ __forceinline__ int m_block(int t) const { return Mask::query_block(t / (nheads * batch), m_blocks); }
    __device__ __forceinline__ int head(int t) const { return t % nheads; }
    __device__ __forceinline__ int batch_of(int t) const { return (t / nheads) % batch; }
};

}  // namespace cf
