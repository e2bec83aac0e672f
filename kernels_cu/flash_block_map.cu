// flash_block_map: the block map of a user's mask modifier M (modifier.cuh's BlockMapParams),
// from the predicate itself, on the GPU (cupyflash.modifiers.create_block_mask).
//
// One CTA per (query granule, head, batch entry) of the map; its 256 threads are the 16 x 16
// pairs of one (query granule, key granule) block at a time, walking the key granules in order:
// __syncthreads_or says whether the block holds a kept pair. The first and the last such key
// granule are the row granule's key range; each such block also widens its key granule's query
// range (atomicMin / atomicMax, so the result does not depend on the order the CTAs run in).
// Every pair is evaluated once: 2^28 predicate calls for a 16k x 16k map, a few hundred
// microseconds, once per map (the user keeps the BlockMask across calls).
#pragma once

#include "common.cuh"
#include "modifier.cuh"
#include "score.cuh"

namespace cf {

constexpr int BLOCK_MAP_GRANULE = 16;  // cupyflash/modifiers.py: BlockMask.GRANULE

template <class M>
__global__ void __launch_bounds__(BLOCK_MAP_GRANULE * BLOCK_MAP_GRANULE)
flash_block_map(const __grid_constant__ BlockMapParams p) {
    constexpr int G = BLOCK_MAP_GRANULE;
    const int r = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int q = r * G + threadIdx.x / G;
    const i64 map_row = (i64(batch) * p.map_heads + head);
    int first = p.key_granules, end = 0;
    for (int c = 0; c < p.key_granules; ++c) {
        const int kv = c * G + threadIdx.x % G;
        const bool kept = q < p.seqlen_q && kv < p.seqlen_k && M::mask(batch, head, q, kv, p.t);
        if (__syncthreads_or(kept)) {
            first = min(first, c);
            end = c + 1;
            if (threadIdx.x == 0) {
                int* range = p.query_blocks + (map_row * p.key_granules + c) * 2;
                atomicMin(range, r);
                atomicMax(range + 1, r + 1);
            }
        }
    }
    if (threadIdx.x == 0) {
        int* range = p.key_blocks + (map_row * p.query_granules + r) * 2;
        range[0] = first;
        range[1] = end;
    }
}

}  // namespace cf
