// flash_bwd_split_kv_tf32: each key block of K and V split once for the whole grid of the float32
// backward's dQ kernel (sm_90a; docs/perf-log.md tf32-split-once). flash_bwd_dq_tf32_wgmma_ws
// splits every key block again in every query-block CTA (seqlen_q / 64 times over), and its
// producer warpgroup's split, one warp a scheduler of dependent shared-memory loads and stores,
// was one of the two suspects that held the kernel at 3,640 clocks a block (perf log
// tf32-wgmma-dq-ws). Here a CTA splits one block into shared memory with the same helper
// (split_key_block_tf32) and copies the bytes out as they are, swizzle and all, to the kv_split
// image (kv_image_offset); with PRESPLIT the dQ kernel's producer fills a stage with one bulk copy
// of them instead of splitting.
//
// Grid (ceil(seqlen_k / BLOCK_N), nheads_kv, batch or sequences), 128 threads. The image costs
// 3x K and V in float32 (hi and lo; K twice); each of its bytes is read once per query block.
#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "split_image.cuh"
#include "wgmma.cuh"
#include "wgmma_tf32.cuh"
#include "wgmma_tf32_bwd_steps.cuh"

namespace cf {

template <int D_TILE, int BLOCK_N, bool PACKED, int PRODUCTS = 3>
__global__ void __launch_bounds__(128)
flash_bwd_split_kv_tf32(const __grid_constant__ BwdParams p) {
    static_assert(BLOCK_N % 32 == 0 && D_TILE % 32 == 0, "whole panels");
    split_key_block_into_image<Tf32KeyBlockTiles<D_TILE, BLOCK_N>, BLOCK_N, PACKED>(
        p,
        [&](u32 tiles, const GlobalRows& k, const GlobalRows& v, int rows) {
            split_key_block_tf32<D_TILE, BLOCK_N, 128, PRODUCTS>(tiles, k, v, rows, p.headdim, p.headdim_v,
                                                                 threadIdx.x);
        },
        [&](const SequenceRows& seq, int head_kv, int j) {
            return kv_image_offset<PACKED, D_TILE, BLOCK_N>(p, seq, head_kv, j);
        });
}

}  // namespace cf
