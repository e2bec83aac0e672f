// flash_fwd_mma: exact attention forward on tensor cores (mma.sync m16n8k16, fp32 accumulate),
// float16 / bfloat16, head dimension up to D_TILE (64, 128 or 256), FlashAttention-2 work split.
//
// One block owns BLOCK_M query rows of one (batch, head). Each of its WARPS warps owns
// M_STRIPS = BLOCK_M / (16 WARPS) strips of 16 rows and keeps their S, P and O in registers; the
// warps never exchange data. The block walks the key blocks j = 0, 1, ... of its (batch, kv head)
// with K_j and V_j in a ring of STAGES shared-memory stages that cp.async refills while the
// block computes on an earlier one:
//   S = Q K_j^T (log2 units)         m_new = max(m, rowmax S)     rescale = exp2(m - m_new)
//   P = exp2(S - m_new)              l = rescale l + rowsum P     O = rescale O + P V_j
// and finally writes O / l and lse = (m + log2 l) ln 2.
//
// Register budget: at D_TILE 128 with 2 strips of 16 rows and BLOCK_N = 64 the O and S
// accumulators alone take 192 of the 255 registers, and ptxas fills the rest with ldmatrix
// prefetch. ROW_STATE picks how much lives across the key loop besides them (RowState below):
// ALL_LANES keeps m and l on every lane of a row's quad and the loop invariants in registers, as
// FlashAttention-2 does; ONE_LANE keeps m and l in one lane of the quad, re-reads the K/V source
// (pointers, strides) from shared memory and recomputes the block's row and key bounds from
// special registers where used. ONE_LANE is what lets the d128 128 x 64 tile run without spills;
// at d64 its extra shuffles per key block cost more than the registers it frees are worth.
#include "block_walk.cuh"
#include "mma.cuh"
#include "mma_fwd_steps.cuh"
#include "online_softmax.cuh"
#include "params.cuh"

namespace cf {

// Shared memory, mirrored by cupyflash/plans.py (smem_bytes):
//   [Q: BLOCK_M x D_TILE] [stage 0: K, V: BLOCK_N x D_TILE each] [stage 1] ... [KvSource]
// every tile swizzled (swizzled_offset). The Q tile is reused to stage O in the epilogue.
template <int D_TILE, int BLOCK_M, int BLOCK_N, int STAGES>
struct FwdSmemLayout {
    static constexpr u32 Q_BYTES = BLOCK_M * D_TILE * 2;
    static constexpr u32 KV_TILE_BYTES = BLOCK_N * D_TILE * 2;
    static constexpr u32 STAGE_BYTES = 2 * KV_TILE_BYTES;
    static constexpr u32 KV_SOURCE = Q_BYTES + STAGES * STAGE_BYTES;  // KvSource, 32 bytes
    static constexpr u32 BYTES = KV_SOURCE + 32;
    static __device__ __forceinline__ u32 k_tile(u32 base, int stage) {
        return base + Q_BYTES + stage * STAGE_BYTES;
    }
    static __device__ __forceinline__ u32 v_tile(u32 base, int stage) {
        return k_tile(base, stage) + KV_TILE_BYTES;
    }
    static __device__ __forceinline__ u32 kv_source(u32 base) { return base + KV_SOURCE; }
};

// Where the K and V tiles of the block's (batch, kv head) come from: row 0 of the head and the
// row strides. Lean kernels (RowState::ONE_LANE) read it from shared memory each time they issue
// copies: kept in registers, these loop invariants would be spilled (d128 with 128 x 64 tiles
// needs all 255 registers for the accumulators and the ldmatrix pipeline).
template <typename T>
struct KvSource {
    const T* k;
    const T* v;
    i64 k_stride;
    i64 v_stride;

    __device__ __forceinline__ void store(u32 addr) const {
        asm volatile("st.shared.v2.u64 [%0], {%1, %2};\n" ::"r"(addr), "l"(k), "l"(v) : "memory");
        asm volatile("st.shared.v2.u64 [%0], {%1, %2};\n" ::"r"(addr + 16), "l"(k_stride),
                     "l"(v_stride) : "memory");
    }
    // volatile: a fresh read in every iteration, never hoisted out of the loop.
    static __device__ __forceinline__ KvSource load(u32 addr) {
        KvSource r;
        asm volatile("ld.shared.v2.u64 {%0, %1}, [%2];\n" : "=l"(r.k), "=l"(r.v) : "r"(addr) : "memory");
        asm volatile("ld.shared.v2.u64 {%0, %1}, [%2];\n" : "=l"(r.k_stride), "=l"(r.v_stride)
                     : "r"(addr + 16) : "memory");
        return r;
    }
};

// Special registers. FRESH: read afresh where used (volatile: not hoisted out of the key loop), so
// that what derives from them is recomputed there instead of occupying registers across the loop;
// otherwise ordinary reads, which the compiler keeps or rematerialises as it sees fit.
template <bool FRESH>
__device__ __forceinline__ int nctaid_x() {
    int r = gridDim.x;
    if constexpr (FRESH) asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(r));
    return r;
}
template <bool FRESH>
__device__ __forceinline__ int ctaid_x() {
    int r = blockIdx.x;
    if constexpr (FRESH) asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(r));
    return r;
}
template <bool FRESH>
__device__ __forceinline__ int tid_x() {
    int r = threadIdx.x;
    if constexpr (FRESH) asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(r));
    return r;
}

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int WARPS, bool Q_IN_REGS,
          int STAGES, int MIN_BLOCKS, RowState ROW_STATE>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
flash_fwd_mma(const __grid_constant__ FwdParams p) {
    constexpr int NTHREADS = WARPS * 32;
    constexpr int M_STRIPS = BLOCK_M / (16 * WARPS);
    constexpr int N_FRAGS = BLOCK_N / 8;
    constexpr int D_FRAGS = D_TILE / 8;
    constexpr int Q_STEPS = Q_IN_REGS ? D_TILE / 16 : 1;
    typedef FwdSmemLayout<D_TILE, BLOCK_M, BLOCK_N, STAGES> Smem;
    static_assert(M_STRIPS >= 1 && BLOCK_M == 16 * WARPS * M_STRIPS, "BLOCK_M: whole 16-row strips per warp");
    static_assert(BLOCK_N % 16 == 0 && D_TILE % 64 == 0 && STAGES >= 2, "tile shape");
    // The one-lane row state is for tiles short of registers; they also re-read the loop
    // invariants (KvSource, bounds from special registers) in every key block. Tiles that can
    // afford m and l on every lane keep the invariants in registers too: at d64 (sm_90) that
    // saves 9 of ~900 instructions per key block, 27 when causal, on top of the row state's 29.
    constexpr bool REREAD_INVARIANTS = ROW_STATE == RowState::ONE_LANE;

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < Smem::BYTES) __trap();
    const u32 smem_base = smem_u32(smem);
    const u32 q_tile = smem_base;

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, headdim = p.headdim;
    const float scale_log2 = p.scale_log2;
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    const ScoreOf<Mask, float, Tanh::EXP_RCP> score(score_problem<Mask>(p, seq), seq.index, blockIdx.y, p.scale);
    auto first_row = [&]() {  // of the block, in the policy's order (heaviest first)
        constexpr bool FRESH = REREAD_INVARIANTS;
        return Mask::query_block(ctaid_x<FRESH>(), nctaid_x<FRESH>()) * BLOCK_M;
    };
    // Keys [j_begin BLOCK_N, n_end) hold those some row of the block sees (mask.cuh). n_end(), the
    // mask's unrounded end, is asked where used (from first_row(), which the one-lane kernels read
    // afresh); j_begin is KeyBlockRange's first block, from a range of its own: computed through
    // n_end's lambda, NVRTC reorders the one-lane causal-dropout kernels' code.
    auto n_end = [&]() { return mask.key_end(first_row(), BLOCK_M); };
    const int j_begin = KeyBlockRange<BLOCK_N>(mask, first_row(), BLOCK_M).first;
    const int head = blockIdx.y, batch = seq.batch;
    const int head_kv = head / p.group;
    const int m0 = first_row();
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int strip_row0 = warp * 16 * M_STRIPS;  // first row of the warp's strips within the block

    const T* __restrict__ q_rows = p.q.row<const T>(batch, seq.q_begin + m0, head);
    const T* __restrict__ k_rows = p.k.row<const T>(batch, seq.k_begin, head_kv);
    const T* __restrict__ v_rows = p.v.row<const T>(batch, seq.k_begin, head_kv);

    auto load_kv_tile = [&](const KvSource<T>& src, int block, int stage) {
        const int n0 = block * BLOCK_N;
        const int thread = tid_x<REREAD_INVARIANTS>();
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(Smem::k_tile(smem_base, stage),
                                                 src.k + n0 * src.k_stride, seqlen_k - n0, headdim,
                                                 src.k_stride, thread);
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(Smem::v_tile(smem_base, stage),
                                                 src.v + n0 * src.v_stride, seqlen_k - n0, p.headdim_v,
                                                 src.v_stride, thread);
    };

    // Published for the key loop; its first __syncthreads() orders the store before any read.
    const KvSource<T> kv_source{k_rows, v_rows, p.k.row_stride, p.v.row_stride};
    if (REREAD_INVARIANTS && threadIdx.x == 0) kv_source.store(Smem::kv_source(smem_base));
    auto kv_source_in_loop = [&]() {
        if constexpr (REREAD_INVARIANTS) return KvSource<T>::load(Smem::kv_source(smem_base));
        else return kv_source;
    };

    // Commit groups: Q, then one per key block (empty past the last), so that before block j
    // exactly STAGES - 2 younger groups may still be in flight.
    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(q_tile, q_rows, seqlen_q - m0, headdim, p.q.row_stride, threadIdx.x);
    cp_async_commit();
#pragma unroll
    // Stages belong to absolute block indices (block j in j % STAGES), whichever block comes first.
#pragma unroll
    for (int ahead = 0; ahead < STAGES - 1; ++ahead) {
        const int j = j_begin + ahead;
        if (j * BLOCK_N < n_end()) load_kv_tile(kv_source, j, j % STAGES);
        cp_async_commit();
    }

    // ldmatrix address providers: A-pattern for Q and (transposed) V, B-pattern for K.
    const FragmentAddress<D_TILE> a_addr(lane & 15, lane >> 4);
    const FragmentAddress<D_TILE> k_addr(((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1);
    const u32 q_strips = q_tile + strip_row0 * D_TILE * 2;  // the warp's rows of the Q tile

    u32 q_frag[M_STRIPS][Q_STEPS][4];
    if constexpr (Q_IN_REGS) {
        cp_async_wait<STAGES - 1>();
        __syncthreads();
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
            for (int kk = 0; kk < Q_STEPS; ++kk) ldmatrix_x4(q_frag[i][kk], a_addr(q_strips, i, kk));
    }

    float o_acc[M_STRIPS][D_FRAGS][4];
    RowStats<ROW_STATE, M_STRIPS> row_stats;  // running max m and sum l of the lane's rows
    const DropoutOf<Mask> dropout(p, seq.index, head);
    zero_acc(o_acc);

    for (int j = j_begin; j * BLOCK_N < n_end(); ++j) {
        const int stage = j % STAGES;
        // K_j, V_j have landed for every thread, and every warp is done with block j - 1, whose
        // stage the loads below refill.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int ahead = j + STAGES - 1;
            if (ahead * BLOCK_N < n_end())
                load_kv_tile(kv_source_in_loop(), ahead, ahead % STAGES);
            cp_async_commit();
        }

        float s[M_STRIPS][N_FRAGS][4];
        mma_qk<T, D_TILE>(s, q_frag, q_strips, a_addr, Smem::k_tile(smem_base, stage), k_addr);
        const int n0 = j * BLOCK_N;
        const bool masked = mask.keys_partial(first_row(), BLOCK_M, n0, BLOCK_N);
        scale_and_mask(s, scale_log2, masked, mask, score, first_row() + strip_row0, n0, lane);
        float m_new[M_STRIPS][2];
        row_max(m_new, s, row_stats, lane);
        softmax_rescale(s, o_acc, row_stats, m_new, lane);
        if constexpr (DropoutOf<Mask>::ENABLED)  // after the row sums: l and lse stay the softmax's
            for_s_frags(s, dropout, first_row() + strip_row0 + lane / 4, n0 + 2 * (lane % 4), DropToZero{});
        u32 p_frag[M_STRIPS][N_FRAGS / 2][4];
        pack_p<T>(p_frag, s);
        mma_pv<T, D_TILE>(o_acc, p_frag, Smem::v_tile(smem_base, stage), a_addr);
    }

    if constexpr (DropoutOf<Mask>::ENABLED) scale_acc(o_acc, p.variant.dropout.scale);

    // The Q tile is reused for O. If the block saw no key block, copies into it (issued by any
    // thread) may still be in flight.
    cp_async_wait<0>();
    __syncthreads();
    store_o<T, D_TILE, Mask::Score::HAS_SINK>(
        o_acc, row_stats, q_tile, strip_row0, m0, seqlen_q, p.headdim_v, p.o.row<T>(batch, seq.q_begin + m0, head),
        p.o.row_stride, static_cast<float*>(p.lse) + seq.stat(p, head, m0), lane,
        sink_log2<Mask, float>(p, head));
}

}  // namespace cf
