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
    typedef Tf32FwdKeyBlockTiles<D_TILE, BLOCK_N> T;
    static_assert(BLOCK_N % 32 == 0 && D_TILE % 32 == 0 && T::BYTES % (16 * 128) == 0, "whole panels and chunks");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<T::BYTES>(smem_raw);

    // every key of the sequence, whatever the mask: some query block's walk may need any of them
    const SequenceRows seq = cta_sequence<SequencesOnly<PACKED>>(p, blockIdx.z);
    const int j = blockIdx.x, n0 = j * BLOCK_N, head_kv = blockIdx.y;
    if (PACKED && n0 >= seq.seqlen_k) return;  // past a shorter sequence's end
    const GlobalRows k{p.k.row<const float>(seq.batch, seq.k_begin + n0, head_kv), p.k.row_stride};
    const GlobalRows v{p.v.row<const float>(seq.batch, seq.k_begin + n0, head_kv), p.v.row_stride};
    split_key_block_fwd_tf32<D_TILE, BLOCK_N, 128, PRODUCTS>(base, k, v, seq.seqlen_k - n0, p.headdim, p.headdim_v,
                                                             threadIdx.x);
    __syncthreads();

    // The block out to its place in the image, as its bytes lie in shared memory
    unsigned char* const image = static_cast<unsigned char*>(p.kv_split);
    store_image_block<T::BYTES, 128>(base, image + kv_fwd_image_offset<PACKED, D_TILE, BLOCK_N>(p, seq, head_kv, j),
                                     threadIdx.x);
}

}  // namespace cf
