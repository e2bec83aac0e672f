// flash_bwd_split_q_tf32: each query block of Q and dO split once for the whole grid of the
// float32 backward's dK/dV kernel (sm_90a; docs/perf-log.md tf32-split-once-dkdv), with its rows'
// statistics. flash_bwd_dkdv_tf32_wgmma_ws splits every query block again in every key-block CTA
// that visits it (seqlen_k / 64 times over), as the dQ kernel split every key block before
// flash_bwd_split_kv_tf32 (tf32-split-once: that split was the dQ kernel's bound). Here a CTA
// splits one block into shared memory with the producer's own step (split_query_block_tf32),
// writes the statistics beside it (query_row_stats), and copies the bytes out as they are, swizzle
// and all, to the q_split image (q_image_offset); with PRESPLIT the dK/dV kernel's producer fills a
// stage with one bulk copy of them.
//
// Grid (ceil(seqlen_q / BLOCK_M), nheads, batch or sequences), 128 threads, after D (or the
// recomputed statistics) is formed. The image costs 4x Q and dO in float32 (hi and lo, each twice).
#include "common.cuh"
#include "dmma_bwd_steps.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "wgmma.cuh"
#include "wgmma_tf32.cuh"
#include "wgmma_tf32_bwd_steps.cuh"

namespace cf {

template <int D_TILE, int BLOCK_M, bool PACKED, int PRODUCTS = 3>
__global__ void __launch_bounds__(128)
flash_bwd_split_q_tf32(const __grid_constant__ BwdParams p) {
    typedef Tf32QueryBlockTiles<D_TILE, BLOCK_M> T;
    static_assert(BLOCK_M % 32 == 0 && BLOCK_M <= 128 && D_TILE % 32 == 0 && T::BYTES % 16 == 0,
                  "whole panels and chunks; a statistics row a thread");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<T::BYTES>(smem_raw);
    float* const smem_f = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)));

    // every query row of the sequence, whatever the mask: some key block's walk may need any of them
    const SequenceRows seq = cta_sequence<SequencesOnly<PACKED>>(p, blockIdx.z);
    const int i = blockIdx.x, m0 = i * BLOCK_M, head = blockIdx.y;
    if (PACKED && m0 >= seq.seqlen_q) return;  // past a shorter sequence's end
    const GlobalRows q{p.q.row<const float>(seq.batch, seq.q_begin + m0, head), p.q.row_stride};
    const GlobalRows dout{p.dout.row<const float>(seq.batch, seq.q_begin + m0, head), p.dout.row_stride};
    split_query_block_tf32<D_TILE, BLOCK_M, 128, PRODUCTS>(base, q, dout, seq.seqlen_q - m0, p.headdim, p.headdim_v,
                                                           threadIdx.x);
    if (threadIdx.x < BLOCK_M) {
        const bool valid = m0 + threadIdx.x < seq.seqlen_q;
        query_row_stats<BLOCK_M>(smem_f + T::STATS / 4, p, seq.stat(p, head, valid ? m0 + threadIdx.x : 0), valid,
                                 threadIdx.x);
    }
    __syncthreads();

    // The block out to its place in the image, as its bytes lie in shared memory
    unsigned char* const image = static_cast<unsigned char*>(p.q_split);
    store_image_block<T::BYTES, 128>(base, image + q_image_offset<PACKED, D_TILE, BLOCK_M>(p, seq, head, i),
                                     threadIdx.x);
}

}  // namespace cf
