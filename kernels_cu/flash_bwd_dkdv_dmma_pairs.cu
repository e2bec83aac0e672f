// flash_bwd_dkdv_dmma_pairs: flash_bwd_dkdv_dmma with warp pairs, a candidate for d128 (perf log
// dmma-bwd-v1): the keys of a pair's 16 rows on sm_90's m16n8k8 products, one warp accumulating
// their dV and its partner their dK.
//
// Why: one warp holding both dK and dV of 16 keys at d128 takes 256 registers for them, so
// flash_bwd_dkdv_dmma runs d128 with 8-key warps on m8n8k4, each B fragment serving one m-tile.
// Here each warp holds one of the two (128 registers) and forms half of the products: the dV warp
// S^T = K Q^T, P^T and dV += P^T dO; the dK warp dP^T = V dO^T, dS^T and dK += dS^T Q. dS needs
// P, which the dV warp hands over through shared memory (each lane its own entries, in the
// accumulator layout both warps share) under a named barrier of the pair (both warps wait): P
// times ds'/ds where the score policy has a derivative, 0 where hidden. The dK warp forms the
// mask's and dropout's verdicts itself (the same calls). Everything else is flash_bwd_dkdv_dmma's
// (its walk, below as DmmaKeyBlock; the steps of dmma_bwd_steps.cuh), and its scores are those of
// the other float64 kernels to the bit.
#include "block_walk.cuh"
#include "common.cuh"
#include "dmma_bwd_steps.cuh"
#include "mask.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// The CTA's walk (flash_bwd_dkdv_dmma's, as a struct the candidate can share when it becomes a
// plan row): one key block walking the query blocks that see a key of it for each query head of
// its GQA group in turn (block_walk.cuh's QueryBlockWalk: step s is its iteration s); K and V
// copied once, each step's Q, dO and row statistics into one of two stages ([2][STAGE] doubles:
// Q and dO [BLOCK_M][LD], then [STAT_SLOTS][BLOCK_M] as copied: dmma_bwd_steps.cuh's StatSlot).

template <class Mask, int D_TILE, int BLOCK_M, int BLOCK_N, int NTHREADS>
struct DmmaKeyBlock {
    static constexpr int LD = D_TILE + 4;
    static constexpr int STAGE = 2 * BLOCK_M * LD + STAT_SLOTS * BLOCK_M;  // doubles
    SequenceRows seq;
    Mask mask;
    int n0, head_kv;
    QueryBlockWalk<BLOCK_M> walk;

    __device__ __forceinline__ DmmaKeyBlock(const BwdParams& p)
        : seq(cta_sequence<Mask>(p, blockIdx.z)),
          mask(cta_mask<Mask, CtaRows::KEYS>(p, seq.index, seq.seqlen_q, seq.seqlen_k)),
          n0(blockIdx.x * BLOCK_N),
          head_kv(blockIdx.y),
          walk(mask, n0, BLOCK_N, p.group) {}

    // Past a shorter sequence's end. A sequence without queries still stores dK = dV = 0.
    __device__ __forceinline__ bool past_end() const { return Mask::PACKED && n0 >= seq.seqlen_k; }

    // K and V, then the walk's first step, in one committed group
    __device__ __forceinline__ void load_first(const BwdParams& p, double* k_tile, double* v_tile, double* stages) {
        cp_async_rows_scalar<BLOCK_N, D_TILE, LD, NTHREADS>(k_tile, p.k.row<const double>(seq.batch, seq.k_begin, head_kv),
                                                         n0, seq.seqlen_k, p.headdim, p.k.row_stride);
        cp_async_rows_scalar<BLOCK_N, D_TILE, LD, NTHREADS>(v_tile, p.v.row<const double>(seq.batch, seq.k_begin, head_kv),
                                                         n0, seq.seqlen_k, p.headdim_v, p.v.row_stride);
        if (walk.iters > 0) load_step(p, stages, 0, 0);
        cp_async_commit();
    }
    __device__ __forceinline__ int head(int step) const { return walk.head(head_kv, step); }
    __device__ __forceinline__ int m0(int step) const { return walk.row(step); }

    __device__ __forceinline__ void load_step(const BwdParams& p, double* stages, int step, int stage) const {
        const int h = head(step), m = m0(step);
        double* q_stage = stages + stage * STAGE;
        cp_async_rows_scalar<BLOCK_M, D_TILE, LD, NTHREADS>(q_stage, p.q.row<const double>(seq.batch, seq.q_begin, h), m,
                                                         seq.seqlen_q, p.headdim, p.q.row_stride);
        cp_async_rows_scalar<BLOCK_M, D_TILE, LD, NTHREADS>(q_stage + BLOCK_M * LD,
                                                         p.dout.row<const double>(seq.batch, seq.q_begin, h), m,
                                                         seq.seqlen_q, p.headdim_v, p.dout.row_stride);
        if (threadIdx.x < BLOCK_M) {
            const double* lse = static_cast<const double*>(p.lse);
            const double* weight = static_cast<const double*>(p.weight);
            const double* dp_ref = static_cast<const double*>(p.dp_ref);
            const int i = threadIdx.x;
            const bool valid = m + i < seq.seqlen_q;
            const i64 stat = seq.stat(p, h, valid ? m + i : 0);
            const u32 dst = smem_u32(q_stage + 2 * BLOCK_M * LD + i);
            cp_async_8(dst + 8 * STAT_LSE * BLOCK_M, lse + stat, valid);
            cp_async_8(dst + 8 * STAT_DELTA * BLOCK_M, static_cast<const double*>(p.delta) + stat, valid);
            cp_async_8(dst + 8 * STAT_WEIGHT * BLOCK_M, weight != nullptr ? weight + stat : lse + stat,
                       valid && weight != nullptr);
            cp_async_8(dst + 8 * STAT_DP_REF * BLOCK_M, dp_ref != nullptr ? dp_ref + stat : lse + stat,
                       valid && dp_ref != nullptr);
        }
    }
};

// Query row qi of a stage's statistics: P = 2^(x - top) weight, dS = P ((dP - dp_ref) - delta);
// top = -inf for a row with no visible key or past the end (valid false).
struct StageRow {
    double top, weight, dp_ref, delta;
};
__device__ __forceinline__ StageRow stage_row(const BwdParams& p, const double* stat_tile, int block_m, int qi,
                                              bool valid) {
    return {valid ? stat_tile[STAT_LSE * block_m + qi] * double(p.lse_to_log2_f64) : neg_inf<double>(),
            p.weight != nullptr ? stat_tile[STAT_WEIGHT * block_m + qi] : 1.0,
            p.dp_ref != nullptr ? stat_tile[STAT_DP_REF * block_m + qi] : 0.0, stat_tile[STAT_DELTA * block_m + qi]};
}

template <int D_TILE, class Mask, int BLOCK_M, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dkdv_dmma_pairs(const __grid_constant__ BwdParams p) {
    typedef double A;
    constexpr int PAIRS = NWARPS / 2;
    constexpr int BLOCK_N = 16 * PAIRS;  // keys: 16 per pair
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int Q_TILES = BLOCK_M / 8;
    constexpr int LD = D_TILE + 4;
    constexpr int HANDED = Q_TILES * 2 * 2;  // P entries a lane hands its partner per step
    typedef DmmaKeyBlock<Mask, D_TILE, BLOCK_M, BLOCK_N, NTHREADS> Cta;
    constexpr int STAGE = Cta::STAGE;
    static_assert(NWARPS % 2 == 0 && PAIRS <= 15, "warp pairs, one named barrier each");
    static_assert(D_TILE % 8 == 0 && BLOCK_M % 8 == 0 && BLOCK_M <= NTHREADS, "m16n8k8 tiles");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(D_TILE < 0, "m16n8k8 .f64 needs sm_90");
#endif

    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* k_tile = reinterpret_cast<A*>(smem_raw);  // [BLOCK_N][LD]
    A* v_tile = k_tile + BLOCK_N * LD;             // [BLOCK_N][LD]
    A* stages = v_tile + BLOCK_N * LD;             // [2][STAGE] (DmmaKeyBlock)
    A* handed = stages + 2 * STAGE;                // [PAIRS][HANDED][32]
    constexpr unsigned SMEM_BYTES = sizeof(A) * (2 * BLOCK_N * LD + 2 * STAGE + PAIRS * HANDED * 32);
    if (dynamic_smem_bytes() < SMEM_BYTES) __trap();

    Cta cta(p);
    if (cta.past_end()) return;
    const SequenceRows& seq = cta.seq;
    const Mask& mask = cta.mask;
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, n0 = cta.n0, head_kv = cta.head_kv;
    const A scale_log2 = scale_log2_in<A>(p), scale = scale_in<A>(p);
    const A drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<A>(p) : A(1);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int pair = warp / 2;
    const bool dk_warp = warp % 2 == 1;  // warp-uniform: the pair's dK (odd) or dV (even) warp
    const int w0 = pair * 16;
    A* hand = handed + pair * HANDED * 32 + lane;
    cta.load_first(p, k_tile, v_tile, stages);
    const int steps = cta.walk.iters;

    A acc[D_TILE / 8][2][2];  // dK or dV of the pair's keys, rows g and g + 8
#pragma unroll
    for (int dn = 0; dn < D_TILE / 8; ++dn) acc[dn][0][0] = acc[dn][0][1] = acc[dn][1][0] = acc[dn][1][1] = A(0);

    for (int step = 0; step < steps; ++step) {
        const int stage = step & 1;
        // this step's tiles have landed, every warp is done with the previous step's stage (and
        // the dK warps with what their partners handed them): both may be overwritten
        cp_async_wait<0>();
        __syncthreads();
        if (step + 1 < steps) {
            cta.load_step(p, stages, step + 1, stage ^ 1);
            cp_async_commit();
        }
        const int head = cta.head(step), m0 = cta.m0(step);
        const A* q_tile = stages + stage * STAGE;
        const A* do_tile = q_tile + BLOCK_M * LD;
        const A* stat_tile = do_tile + BLOCK_M * LD;
        const ScoreOf<Mask, A> score(score_problem<Mask>(p, seq), seq.index, head, scale);
        const DropoutOf<Mask> dropout(p, seq.index, head);

        // S^T = K Q^T (the dV warp) or dP^T = V dO^T (the dK warp)
        A c[Q_TILES][2][2];
        dmma_rows_times_rows<D_TILE, Q_TILES, LD, 2, true>(c, (dk_warp ? v_tile : k_tile) + (w0 + g) * LD + t,
                                                           (dk_warp ? do_tile : q_tile) + g * LD + t);
        if (!dk_warp) {
            // P^T (times Z under dropout) into c; P (times ds'/ds) handed to the partner
#pragma unroll
            for (int j = 0; j < Q_TILES; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int qi = 8 * j + 2 * t + e, q_row = m0 + qi;
                    const StageRow row = stage_row(p, stat_tile, BLOCK_M, qi, q_row < seqlen_q);
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        const ScoreEntry x = score_entry(c[j][mt][e], A(0), q_row, n0 + w0 + 8 * mt + g,
                                                         row.top == neg_inf<A>(), mask, score, dropout, drop_scale);
                        const A p_ij = x.hidden ? A(0) : recomputed_p_exact(x.s, scale_log2, row.top, row.weight);
                        hand[((j * 2 + mt) * 2 + e) * 32] = Mask::Score::HAS_GRAD ? p_ij * x.dsds : p_ij;
                        c[j][mt][e] = x.kept ? p_ij : A(0);
                    }
                }
            // bar.sync, not bar.arrive: with the dV warp only arriving, compute-sanitizer's racecheck
            // reported the next step's Q / dO copies (issued after __syncthreads) racing with the
            // other pairs' dK += dS^T Q reads of the stage; waiting here costs nothing measurable
            // (perf log dmma-bwd-v1, racecheck)
            named_barrier_sync(1 + pair, 64);
        } else {
            named_barrier_sync(1 + pair, 64);
            // dS^T = P (dP - D) into c
#pragma unroll
            for (int j = 0; j < Q_TILES; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int qi = 8 * j + 2 * t + e, q_row = m0 + qi;
                    const StageRow row = stage_row(p, stat_tile, BLOCK_M, qi, q_row < seqlen_q);
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        const int key = n0 + w0 + 8 * mt + g;
                        const bool hidden = row.top == neg_inf<A>() || mask.hides(q_row, key);
                        const A dp_ij = !DropoutOf<Mask>::ENABLED ? c[j][mt][e]
                                        : dropout.keep(q_row, key) ? c[j][mt][e] * drop_scale : A(0);
                        const A ds = hand[((j * 2 + mt) * 2 + e) * 32] * ((dp_ij - row.dp_ref) - row.delta);
                        c[j][mt][e] = hidden ? A(0) : ds;
                    }
                }
        }

        // dV += P^T dO (the dV warp) or dK += dS^T Q (the dK warp)
        dmma_acc_times_rows<D_TILE, Q_TILES, LD, 2, true>(acc, c, (dk_warp ? q_tile : do_tile) + 2 * t * LD + g);
    }
    cp_async_wait<0>();  // K and V's copies, where no query block was walked

#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const int key = n0 + w0 + 8 * mt + g;
        if (key >= seqlen_k) continue;
        A* out = dk_warp ? p.dk.row<A>(seq.batch, seq.k_begin + key, head_kv)
                         : p.dv.row<A>(seq.batch, seq.k_begin + key, head_kv);
        const int width = dk_warp ? p.headdim : p.headdim_v;
        const A factor = dk_warp ? scale : drop_scale;
#pragma unroll
        for (int dn = 0; dn < D_TILE / 8; ++dn)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * dn + 2 * t + e;
                if (col < width) out[col] = acc[dn][mt][e] * factor;
            }
    }
}

}  // namespace cf
