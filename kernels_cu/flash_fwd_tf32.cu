// flash_fwd_tf32: exact attention forward for float32 on tensor cores (mma.sync m16n8k8 .tf32,
// fp32 accumulate, sm_80+), head dimension up to D_TILE (64, 128 or 256), FlashAttention-2 work
// split; flash_fwd_mma's structure on float32 tiles.
//
// PRODUCTS = 3 (precision "ieee"): every product of S = Q K^T and O += P V is three tf32
// products of split operands (tf32.cuh), each as precise as a float32 product (their accumulation
// in the tensor core is less so: docs/perf-log.md, "tf32-fwd-v1"); PRODUCTS = 1 (precision
// "tf32"): one, on operands rounded to tf32. The online softmax and everything the mask and score
// policies add (mask.cuh, score.cuh, dropout.cuh) are the 16-bit kernels' tile steps, unchanged:
// the m16n8k8 accumulators have the m16n8k16 layout.
//
// One block owns BLOCK_M query rows of one (batch, head); each of its WARPS warps owns
// M_STRIPS = BLOCK_M / (16 WARPS) strips of 16 rows with their S, P and O in registers. K_j and
// V_j stream through a ring of STAGES shared-memory stages that cp.async refills. The operands
// are split where they are read: Q and K after their ldmatrix, P in registers, V after its
// reads (tf32_fwd_steps.cuh).
//
// FRESH_O (a candidate, dev/tf32_accumulation_probe.py; not a shipped row): each key block's P V
// goes into accumulators of its own, merged into O by one FFMA with the rescale, instead of the
// tensor core adding every block's products into O itself. D_TILE / 2 more registers per thread.
// PRESPLIT (the "ieee" rows at d64 / d128 since tf32-fwd-v2): each landed K and V tile split once,
// by the threads that copied it, into hi in place and lo in tiles of their own (split_tile),
// instead of every warp splitting every fragment it reads; twice the K/V shared memory for three
// products.
// STEP_SUMS (three products; a candidate too): every k-step's products summed apart and added by
// FADD, rounded to nearest, where the tensor core's own accumulation is not (tf32.cuh, mma_tf32):
// into S (one k-step in flight: spill-free), and into O unless FRESH_O sums each key block apart
// instead (O's steps in flight spill 24-116 bytes).
#include "block_walk.cuh"
#include "online_softmax.cuh"
#include "params.cuh"
#include "tf32_fwd_steps.cuh"

namespace cf {

// Shared memory, mirrored by cupyflash/plans.py (tf32_smem_bytes):
//   [Q: BLOCK_M x D_TILE] [stage 0: K, V (, K lo, V lo): BLOCK_N x D_TILE each] [stage 1] ...
// float32, every tile swizzled (swizzled_offset_f32); the lo tiles with LO_TILES (PRESPLIT with
// three products). The Q tile is reused to stage O.
template <int D_TILE, int BLOCK_M, int BLOCK_N, int STAGES, bool LO_TILES = false>
struct Tf32FwdSmem {
    static constexpr u32 Q_BYTES = BLOCK_M * D_TILE * 4;
    static constexpr u32 KV_TILE_BYTES = BLOCK_N * D_TILE * 4;
    static constexpr u32 STAGE_BYTES = (LO_TILES ? 4 : 2) * KV_TILE_BYTES;
    static constexpr u32 BYTES = Q_BYTES + STAGES * STAGE_BYTES;
    static __device__ __forceinline__ u32 k_tile(int stage) { return Q_BYTES + stage * STAGE_BYTES; }
    static __device__ __forceinline__ u32 v_tile(int stage) { return k_tile(stage) + KV_TILE_BYTES; }
    static __device__ __forceinline__ u32 k_lo_tile(int stage) { return k_tile(stage) + 2 * KV_TILE_BYTES; }
    static __device__ __forceinline__ u32 v_lo_tile(int stage) { return k_tile(stage) + 3 * KV_TILE_BYTES; }
};

// cp.async of a ROWS x D_TILE float32 tile: mma.cuh's copy of 16-bit tiles at twice the width
// (a float32 row is a row of twice as many 16-bit values; headdim a multiple of 4).
template <int ROWS, int D_TILE, int NTHREADS>
__device__ __forceinline__ void cp_async_tile_f32(u32 smem_tile, const float* gmem, int rows_valid, int headdim,
                                                  i64 stride, int thread) {
    cp_async_tile<ROWS, 2 * D_TILE, NTHREADS>(smem_tile, reinterpret_cast<const half_t*>(gmem), rows_valid,
                                              2 * headdim, 2 * stride, thread);
}

template <int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES, int PRODUCTS,
          bool FRESH_O = false, bool PRESPLIT = false, bool STEP_SUMS = false>
__global__ void __launch_bounds__(WARPS * 32, 1)
flash_fwd_tf32(const __grid_constant__ FwdParams p) {
    constexpr int NTHREADS = WARPS * 32;
    constexpr int M_STRIPS = BLOCK_M / (16 * WARPS);
    constexpr int N_FRAGS = BLOCK_N / 8;
    constexpr int D_FRAGS = D_TILE / 8;
    typedef Tf32FwdSmem<D_TILE, BLOCK_M, BLOCK_N, STAGES, PRESPLIT && Tf32Operand<PRODUCTS>::SPLIT> Smem;
    static_assert(M_STRIPS >= 1 && BLOCK_M == 16 * WARPS * M_STRIPS, "BLOCK_M: whole 16-row strips per warp");
    static_assert(BLOCK_N % 16 == 0 && D_TILE % 32 == 0 && STAGES >= 2, "tile shape");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < Smem::BYTES) __trap();
    const u32 smem_base = smem_u32(smem);
    const u32 q_tile = smem_base;

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    // The score transforms' fast forms (softcap's rational tanh) for one tf32 product only: "ieee"
    // keeps float32's (score.cuh).
    constexpr Tanh TANH = Tf32Operand<PRODUCTS>::SPLIT ? Tanh::ACCURATE : Tanh::RATIONAL;
    const ScoreOf<Mask, float, TANH> score(score_problem<Mask>(p, seq), seq.index, blockIdx.y, p.scale);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;  // in the policy's order
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    // Keys [j_begin BLOCK_N, n_end) hold those some row of the block sees (mask.cuh), in blocks
    // from KeyBlockRange. The end is asked before the begin, as this kernel always did: NVRTC's
    // code keeps the order, and the range's own (begin first) reorders the window kernels'.
    const int n_end = mask.key_end(m0, BLOCK_M);
    const int j_begin = KeyBlockRange<BLOCK_N>(mask.key_begin(m0), n_end).first;
    const int head = blockIdx.y, head_kv = head / p.group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int strip_row0 = warp * 16 * M_STRIPS;  // first row of the warp's strips within the block

    const float* __restrict__ q_rows = p.q.row<const float>(seq.batch, seq.q_begin + m0, head);
    const float* __restrict__ k_rows = p.k.row<const float>(seq.batch, seq.k_begin, head_kv);
    const float* __restrict__ v_rows = p.v.row<const float>(seq.batch, seq.k_begin, head_kv);
    auto load_kv_tile = [&](int block, int stage) {
        const int n0 = block * BLOCK_N;
        cp_async_tile_f32<BLOCK_N, D_TILE, NTHREADS>(smem_base + Smem::k_tile(stage), k_rows + n0 * p.k.row_stride,
                                                     seqlen_k - n0, p.headdim, p.k.row_stride, threadIdx.x);
        cp_async_tile_f32<BLOCK_N, D_TILE, NTHREADS>(smem_base + Smem::v_tile(stage), v_rows + n0 * p.v.row_stride,
                                                     seqlen_k - n0, p.headdim_v, p.v.row_stride, threadIdx.x);
    };

    // Commit groups: Q, then one per key block (empty past the last), so that before block j
    // exactly STAGES - 2 younger groups may still be in flight.
    cp_async_tile_f32<BLOCK_M, D_TILE, NTHREADS>(q_tile, q_rows, seqlen_q - m0, p.headdim, p.q.row_stride,
                                                 threadIdx.x);
    cp_async_commit();
    // Stages belong to absolute block indices (block j in j % STAGES), whichever block comes first.
#pragma unroll
    for (int ahead = 0; ahead < STAGES - 1; ++ahead) {
        const int j = j_begin + ahead;
        if (j * BLOCK_N < n_end) load_kv_tile(j, j % STAGES);
        cp_async_commit();
    }

    // ldmatrix address providers (float32 rows seen as 16-bit rows of twice the width, tf32.cuh):
    // A-pattern for Q, B-pattern for K.
    const FragmentAddress<2 * D_TILE> a_addr(lane & 15, lane >> 4);
    const FragmentAddress<2 * D_TILE> k_addr(((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1);
    const u32 q_strips = q_tile + strip_row0 * D_TILE * 4;  // the warp's rows of the Q tile

    float o_acc[M_STRIPS][D_FRAGS][4];
    RowStats<RowState::ALL_LANES, M_STRIPS> row_stats;  // running max m and sum l of the lane's rows
    const DropoutOf<Mask> dropout(p, seq.index, head);
    zero_acc(o_acc);

    for (int j = j_begin; j * BLOCK_N < n_end; ++j) {
        const int stage = j % STAGES;
        // K_j, V_j have landed for every thread, and every warp is done with block j - 1, whose
        // stage the loads below refill.
        cp_async_wait<STAGES - 2>();
        if constexpr (PRESPLIT) {  // this thread's own copies of block j have landed
            split_tile<PRODUCTS, BLOCK_N, D_TILE, NTHREADS>(smem_base + Smem::k_tile(stage),
                                                            smem_base + Smem::k_lo_tile(stage), threadIdx.x);
            split_tile<PRODUCTS, BLOCK_N, D_TILE, NTHREADS>(smem_base + Smem::v_tile(stage),
                                                            smem_base + Smem::v_lo_tile(stage), threadIdx.x);
        }
        __syncthreads();
        {
            const int ahead = j + STAGES - 1;
            if (ahead * BLOCK_N < n_end) load_kv_tile(ahead, ahead % STAGES);
            cp_async_commit();
        }

        float s[M_STRIPS][N_FRAGS][4];
        mma_qk_tf32<PRODUCTS, D_TILE, PRESPLIT, STEP_SUMS>(s, q_strips, a_addr, smem_base + Smem::k_tile(stage), k_addr,
                                                smem_base + Smem::k_lo_tile(stage));
        const int n0 = j * BLOCK_N;
        const bool masked = D_TILE <= 128 ? mask.keys_partial(m0, BLOCK_M, n0, BLOCK_N)
                                           : mask.band_keys_partial(m0, BLOCK_M, n0, BLOCK_N);
        // a user mask's whole blocks skip its predicate up to d128 (at d256 the second copy of
        // the transform spills: perf log mask-whole-blocks)
        scale_and_mask<Mask, decltype(score), M_STRIPS, N_FRAGS, D_TILE <= 128>(s, p.scale_log2, masked, mask, score,
                                                                               m0 + strip_row0, n0, lane);
        float m_new[M_STRIPS][2];
        row_max(m_new, s, row_stats, lane);
        const auto rescale = softmax_rescale<!FRESH_O>(s, o_acc, row_stats, m_new, lane);
        if constexpr (DropoutOf<Mask>::ENABLED)  // after the row sums: l and lse stay the softmax's
            for_s_frags(s, dropout, m0 + strip_row0 + lane / 4, n0 + 2 * (lane % 4), DropToZero{});
        if constexpr (FRESH_O) {
            float o_block[M_STRIPS][D_FRAGS][4];
            zero_acc(o_block);
            mma_pv_tf32<PRODUCTS, D_TILE, PRESPLIT>(o_block, s, smem + Smem::v_tile(stage), lane,
                                                    smem + Smem::v_lo_tile(stage));
            merge_block(o_acc, rescale, o_block, lane);
        } else {
            mma_pv_tf32<PRODUCTS, D_TILE, PRESPLIT, STEP_SUMS>(o_acc, s, smem + Smem::v_tile(stage), lane,
                                                    smem + Smem::v_lo_tile(stage));
        }
    }

    if constexpr (DropoutOf<Mask>::ENABLED) scale_acc(o_acc, p.variant.dropout.scale);

    // The Q tile is reused for O. If the block saw no key block, copies into it (issued by any
    // thread) may still be in flight.
    cp_async_wait<0>();
    __syncthreads();
    store_o<float, D_TILE, Mask::Score::HAS_SINK>(
        o_acc, row_stats, q_tile, strip_row0, m0, seqlen_q, p.headdim_v,
        p.o.row<float>(seq.batch, seq.q_begin + m0, head), p.o.row_stride,
        static_cast<float*>(p.lse) + seq.stat(p, head, m0), lane, sink_log2<Mask, float>(p, head));
}

}  // namespace cf
