// flash_block_map: the block map of a user's mask modifier M (modifier.cuh's BlockMapParams),
// from the predicate itself, on the GPU (cupyflash.modifiers.create_block_mask).
//
// One CTA per (granule, head, batch entry) of the map; its 256 threads are the 16 x 16 pairs of
// one (query granule, key granule) block at a time, walking the other axis' granules in order:
// __syncthreads_or says whether the block holds a kept pair, __syncthreads_and whether it keeps
// every pair (pairs past a sequence's end count as kept: the band hides them). With by_keys 0 the
// CTA is a query granule's: the first and the last key granule with a kept pair are its key
// range, each such block also widens its key granule's query range (atomicMin / atomicMax, so
// the result does not depend on the order the CTAs run in), and the longest run of whole key
// granules is its key run. With by_keys 1 it is a key granule's and finds its query run alone.
// Every pair is evaluated once a launch, two launches a map: 2^29 predicate calls for a 16k x 16k
// map, well under a millisecond, once per map (the user keeps the BlockMask across calls).
#pragma once

#include "common.cuh"
#include "modifier.cuh"
#include "score.cuh"

namespace cf {

constexpr int BLOCK_MAP_GRANULE = MAP_GRANULE;

// The longest run of whole granules along a walk, the first of equal length.
struct GranuleRun {
    int first = 0, length = 0, current = 0;

    __device__ __forceinline__ void step(int g, bool whole) {
        current = whole ? current + 1 : 0;
        if (current > length) {
            length = current;
            first = g + 1 - current;
        }
    }
};

template <class M>
__global__ void __launch_bounds__(BLOCK_MAP_GRANULE * BLOCK_MAP_GRANULE)
flash_block_map(const __grid_constant__ BlockMapParams p) {
    constexpr int G = BLOCK_MAP_GRANULE;
    const int r = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const i64 map_row = (i64(batch) * p.map_heads + head);
    const int fixed = r * G + threadIdx.x / G;  // this thread's query (by_keys: key) index
    GranuleRun run;
    if (p.by_keys) {
        for (int c = 0; c < p.query_granules; ++c) {
            const int q = c * G + threadIdx.x % G;
            const bool outside = fixed >= p.seqlen_k || q >= p.seqlen_q;
            run.step(c, __syncthreads_and(outside || M::mask(batch, head, q, fixed, p.t)));
        }
        if (threadIdx.x == 0) {
            int* entry = p.query_blocks + (map_row * p.key_granules + r) * BLOCK_MAP_ROW;
            entry[2] = run.first;
            entry[3] = run.first + run.length;
        }
        return;
    }
    int first = p.key_granules, end = 0;
    for (int c = 0; c < p.key_granules; ++c) {
        const int kv = c * G + threadIdx.x % G;
        const bool outside = fixed >= p.seqlen_q || kv >= p.seqlen_k;
        const bool kept = !outside && M::mask(batch, head, fixed, kv, p.t);
        run.step(c, __syncthreads_and(outside || kept));
        if (__syncthreads_or(kept)) {
            first = min(first, c);
            end = c + 1;
            if (threadIdx.x == 0) {
                int* range = p.query_blocks + (map_row * p.key_granules + c) * BLOCK_MAP_ROW;
                atomicMin(range, r);
                atomicMax(range + 1, r + 1);
            }
        }
    }
    if (threadIdx.x == 0) {
        int* entry = p.key_blocks + (map_row * p.query_granules + r) * BLOCK_MAP_ROW;
        entry[0] = first;
        entry[1] = end;
        entry[2] = run.first;
        entry[3] = run.first + run.length;
    }
}

}  // namespace cf
