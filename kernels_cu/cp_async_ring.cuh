// The cp.async producer of the 16-bit warp-specialized kernels (flash_fwd_wgmma_ws,
// flash_bwd_wgmma_ws, flash_bwd_dq_wgmma_ws): the producer warpgroup walks n_blocks blocks through
// a StageRing, block i into stage i % STAGES as commit group i, STAGES - 1 groups in flight. The
// kernel says what a block is (copy_block) and what else the first landing releases (landed).
#pragma once

#include "common.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace cf {

// Blocks 0 .. first_uncopied - 1 were copied and committed by the caller (group 0 also carries the
// tiles the kernel reads once: Q; Q and dO; K and V). copy_block(i) issues block i's copies,
// landed(i) runs once they are visible to wgmma and before full(i) is given.
template <int STAGES, class CopyBlock, class Landed>
__device__ __forceinline__ void produce_blocks(const StageRing<STAGES>& ring, int n_blocks, int first_uncopied,
                                               const CopyBlock& copy_block, const Landed& landed) {
#pragma unroll
    for (int i = first_uncopied; i < STAGES - 1; ++i) {
        if (i < n_blocks) copy_block(i);
        cp_async_commit();
    }
    for (int i = 0; i < n_blocks; ++i) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of block i have landed
        fence_proxy_async_shared();   // ... for the async proxy that wgmma reads through
        landed(i);
        ring.arrive_full(i);
        // Block i + STAGES - 1 into the stage of block i - 1, once the consumers release it
        // (after block i's products: so full(i) must be given first).
        if (i + STAGES - 1 < n_blocks) {
            ring.wait_empty(i + STAGES - 1);
            copy_block(i + STAGES - 1);
        }
        cp_async_commit();
    }
}

}  // namespace cf
