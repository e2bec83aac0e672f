// flash_fwd_split_kv_tf32: each key block of K and V split once for the whole grid of the float32
// forward (sm_90a; docs/perf-log.md tf32-fwd-split-once). flash_fwd_tf32_wgmma_ws's producer
// warpgroup splits every key block again in every query-block CTA that visits it (seqlen_q / 128
// times over), as the backward's dQ and dK/dV producers did before flash_bwd_split_kv_tf32 and
// flash_bwd_split_q_tf32. Here a CTA splits one block into shared memory with the producer's own
// step (split_key_block_fwd_tf32) and copies the bytes out as they are, swizzle and all, to the
// kv_split image (kv_fwd_image_offset); with PRESPLIT the forward's producer fills a stage with one
// bulk copy of them.
//
// Grid (ceil(seqlen_k / BLOCK_N), nheads_kv, batch or sequences), 128 threads. The image costs 2x
// K and V in float32 (hi and lo).
#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "split_image.cuh"
#include "wgmma.cuh"
#include "wgmma_tf32.cuh"
#include "wgmma_tf32_fwd_steps.cuh"

namespace cf {

template <int D_TILE, int BLOCK_N, bool PACKED, int PRODUCTS = 3>
__global__ void __launch_bounds__(128)
flash_fwd_split_kv_tf32(const __grid_constant__ FwdParams p) {
    static_assert(BLOCK_N % 32 == 0 && D_TILE % 32 == 0, "whole panels");
    split_key_block_into_image<Tf32FwdKeyBlockTiles<D_TILE, BLOCK_N>, BLOCK_N, PACKED>(
        p,
        [&](u32 tiles, const GlobalRows& k, const GlobalRows& v, int rows) {
            split_key_block_fwd_tf32<D_TILE, BLOCK_N, 128, PRODUCTS>(tiles, k, v, rows, p.headdim, p.headdim_v,
                                                                     threadIdx.x);
        },
        [&](const SequenceRows& seq, int head_kv, int j) {
            return kv_fwd_image_offset<PACKED, D_TILE, BLOCK_N>(p, seq, head_kv, j);
        });
}

}  // namespace cf
