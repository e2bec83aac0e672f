// flash_fwd_dmma: the float64 forward on the FP64 tensor cores (DMMA, mma.sync m8n8k4 .f64,
// sm_80+), issue 18; the float64 forward's plan row (cupyflash/kernels/dmma.py launches it).
//
// Why: the SIMT float64 forward reaches 3-6 TFLOP/s on the H200, whose FP64 tensor cores peak near
// 67. Everything is float64 end to end: the products are exact-rounded double FMAs, as the SIMT
// kernel's, only in another order.
//
// Layout. A warp owns 8 query rows (BLOCK_M = 8 NWARPS) and walks the key blocks of BLOCK_N keys
// as flash_fwd_simt does, through the same policies (mask.cuh's visibility and key range, the
// score policy's transform, dropout, the sink epilogue). m8n8k4 fragments, lane = 4 g + t:
//   A (8 x 4, row):  a = A[g][t]                 B (4 x 8, col): b = B[t][g]
//   C (8 x 8):       c0 = C[g][2t], c1 = C[g][2t + 1]
// S = Q K^T: A from Q (held in registers, D_TILE / 4 k-steps), B from K (b = K[key g][d t]).
// O += P V: thread (g, t) holds P[g][8j + 2t] and P[g][8j + 2t + 1] of each 8-key n-tile j as
// S's accumulator, not the A fragment's P[g][8j + t]; the keys of a sum can go in any order, so
// the product takes two k-steps per n-tile, keys {8j + 2t} then {8j + 2t + 1}, and B reads V's
// rows in that order (b = V[8j + 2t (+1)][8 dn + g]): P never leaves its lanes.
// A row's four values per n-tile lie in its quad (lanes 4g .. 4g + 3): row max and sum reduce over
// lane bits 0 and 1.
//
// Loads (perf log dmma-fwd-v1). One K and one V tile, filled by cp.async as flash-attn 2 staggers
// them: V's copy runs under S = Q K^T and the softmax, the next K's under O += P V. The v0 kernel
// loaded both synchronously between two barriers, and with one block of 8 warps per SM nothing hid
// that latency.
#include "block_walk.cuh"
#include "common.cuh"
#include "mask.cuh"
#include "dmma.cuh"
#include "mma.cuh"
#include "params.cuh"

namespace cf {

// M_TILES: 8-row m-tiles per warp (perf log dmma-fwd-v2). Two share each K and V B fragment, so a
// DMMA costs half a shared-memory load; their Q A fragments then come from shared memory per
// k-step (Q_IN_REGS false), shared by the step's n-tiles, or stay in registers (d64 fits).
// MIN_BLOCKS: blocks per SM asked of ptxas (__launch_bounds__). WIDE (sm_90, M_TILES 2): each pair
// of k-steps of both m-tiles as one m16n8k8 product (dmma_m16n8k8) instead of four m8n8k4.
template <int D_TILE, class Mask, int BLOCK_N, int NWARPS, int M_TILES = 1, bool Q_IN_REGS = true,
          int MIN_BLOCKS = 1, bool WIDE = false>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
flash_fwd_dmma(const __grid_constant__ FwdParams p) {
    typedef double A;
    constexpr int WARP_ROWS = 8 * M_TILES;
    constexpr int BLOCK_M = WARP_ROWS * NWARPS;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int K_STEPS = D_TILE / 4;   // of S = Q K^T
    constexpr int S_TILES = BLOCK_N / 8;  // 8-key n-tiles of S (and k-step pairs of P V)
    constexpr int O_TILES = D_TILE / 8;   // 8-column n-tiles of O
    // Q and K rows padded by 4 doubles (LD = 4 mod 16): the eight rows g of one Q or K fragment
    // load then start 8 banks apart and the warp's 32 doubles take the minimum two wavefronts.
    // V's by 2 (LD_V = 2 mod 8 in doubles): its fragment reads rows 2t and 2t + 1, which start 4
    // double slots apart, so again every slot is read twice (with LD rows 2t and 2t + 2 collide:
    // 4 wavefronts, perf log dmma-fwd-v0).
    constexpr int LD = D_TILE + 4;
    constexpr int LD_V = D_TILE + 2;
    static_assert(D_TILE % 8 == 0 && BLOCK_N % 8 == 0, "m8n8k4 tiles");
    static_assert(!WIDE || M_TILES == 2, "m16n8k8 takes two 8-row m-tiles");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!WIDE, "m16n8k8 .f64 needs sm_90");
#endif

    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* q_tile = reinterpret_cast<A*>(smem_raw);  // [BLOCK_M][LD], pre-scaled by scale_log2
    A* k_tile = q_tile + BLOCK_M * LD;             // [BLOCK_N][LD]
    A* v_tile = k_tile + BLOCK_N * LD;             // [BLOCK_N][LD_V]
    constexpr unsigned SMEM_BYTES = sizeof(A) * ((BLOCK_M + BLOCK_N) * LD + BLOCK_N * LD_V);
    if (dynamic_smem_bytes() < SMEM_BYTES) __trap();

    const Log2ForwardCta<Mask, A> cta(p, BLOCK_M);
    if (cta.past_end()) return;
    const SequenceRows& seq = cta.seq;
    const Mask& mask = cta.mask;
    const auto& score = cta.score;
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const A scale_log2 = cta.scale_log2;
    const int head = cta.head, head_kv = cta.head_kv, batch = seq.batch, m0 = cta.m0;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int w0 = warp * WARP_ROWS;  // the warp's first row in the block
    // this thread's rows of S, P and O: row g of each m-tile
    int q_row[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) q_row[mt] = m0 + w0 + 8 * mt + g;

    const A* __restrict__ k_base = p.k.row<const A>(batch, seq.k_begin, head_kv);
    const A* __restrict__ v_base = p.v.row<const A>(batch, seq.k_begin, head_kv);
    const KeyBlockRange<BLOCK_N> keys(mask, m0, BLOCK_M);
    const int n_begin = keys.first * BLOCK_N, n_end = keys.n_end;
    const DropoutOf<Mask> dropout(p, seq.index, head);
    // the first K tile's copy in flight while Q is loaded (scaled: not a plain copy)
    if (n_begin < n_end) {
        cp_async_rows_scalar<BLOCK_N, D_TILE, LD, NTHREADS>(k_tile, k_base, n_begin, seqlen_k, p.headdim, p.k.row_stride);
        cp_async_commit();
    }
    load_tile_rows<BLOCK_M, D_TILE, LD, NTHREADS>(q_tile, p.q.row<const A>(batch, seq.q_begin, head), m0, seqlen_q,
                                                  p.headdim, p.q.row_stride, scale_log2);
    __syncthreads();

    // Q's A fragments, one per m-tile and k-step, for the whole walk (Q_IN_REGS); otherwise read
    // from q_tile at each k-step.
    const A* q_frag_row = q_tile + (w0 + g) * LD + t;  // m-tile mt, k-step ks: [8 mt LD + 4 ks]
    A q_frag[Q_IN_REGS ? M_TILES : 1][Q_IN_REGS ? K_STEPS : 1];
    if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int ks = 0; ks < K_STEPS; ++ks) q_frag[mt][ks] = q_frag_row[8 * mt * LD + 4 * ks];
    }

    A o_acc[M_TILES][O_TILES][2];
    A m_i[M_TILES], l_i[M_TILES];  // l_i: this lane's share of the row sum until the end
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        m_i[mt] = neg_inf<A>(), l_i[mt] = A(0);
#pragma unroll
        for (int dn = 0; dn < O_TILES; ++dn) o_acc[mt][dn][0] = o_acc[mt][dn][1] = A(0);
    }

    for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        // K(n0) has landed, and every warp is done with V(n0 - BLOCK_N): V(n0) may overwrite it
        cp_async_wait<0>();
        __syncthreads();
        cp_async_rows_scalar<BLOCK_N, D_TILE, LD_V, NTHREADS>(v_tile, v_base, n0, seqlen_k, p.headdim_v, p.v.row_stride);
        cp_async_commit();

        // S = Q K^T (log2 units): each K fragment serves the warp's M_TILES m-tiles
        A s[M_TILES][S_TILES][2];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt) s[mt][nt][0] = s[mt][nt][1] = A(0);
        constexpr int KS_PER_STEP = WIDE ? 2 : 1;  // k-steps of 4 per product
#pragma unroll
        for (int ks = 0; ks < K_STEPS; ks += KS_PER_STEP) {
            A a[M_TILES][KS_PER_STEP];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int h = 0; h < KS_PER_STEP; ++h)
                    a[mt][h] = Q_IN_REGS ? q_frag[Q_IN_REGS ? mt : 0][Q_IN_REGS ? ks + h : 0]
                                         : q_frag_row[8 * mt * LD + 4 * (ks + h)];
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt) {
                const A* k_frag = k_tile + (8 * nt + g) * LD + 4 * ks + t;
                if constexpr (WIDE) {
                    dmma_m16n8k8<WIDE>(s[0][nt], s[M_TILES - 1][nt], a[0][0], a[M_TILES - 1][0], a[0][KS_PER_STEP - 1],
                                       a[M_TILES - 1][KS_PER_STEP - 1], k_frag[0], k_frag[4]);
                } else {
                    const A b = k_frag[0];
#pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) dmma_m8n8k4(s[mt][nt], a[mt][0], b, s[mt][nt]);
                }
            }
        }

#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            // the score policy and the mask, then the online softmax's new maximum
            A tile_max = neg_inf<A>();
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = n0 + 8 * nt + 2 * t + e;
                    if constexpr (!ScoreOf<Mask, A>::IDENTITY)
                        s[mt][nt][e] = score.transform(s[mt][nt][e], score.origin(q_row[mt], key), 0, 0);
                    if (mask.hides(q_row[mt], key)) s[mt][nt][e] = neg_inf<A>();
                    tile_max = fmax(tile_max, s[mt][nt][e]);
                }
            }
            const A m_new = fmax(m_i[mt], group_max<4>(tile_max));
            // A row with every key masked so far keeps m = -inf: subtracting 0 keeps 2^-inf = 0.
            const A base = m_new == neg_inf<A>() ? A(0) : m_new;
            const A rescale = exp2(m_i[mt] - base);
            m_i[mt] = m_new;
            l_i[mt] *= rescale;
#pragma unroll
            for (int dn = 0; dn < O_TILES; ++dn) o_acc[mt][dn][0] *= rescale, o_acc[mt][dn][1] *= rescale;

            // P = 2^(S - m), summed before dropout (dropout.cuh: l and lse stay the softmax's)
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const A p_ij = exp2(s[mt][nt][e] - base);
                    l_i[mt] += p_ij;
                    const bool dropped = DropoutOf<Mask>::ENABLED && !dropout.keep(q_row[mt], n0 + 8 * nt + 2 * t + e);
                    s[mt][nt][e] = dropped ? A(0) : p_ij;
                }
            }
        }

        // V(n0) has landed, and every warp is done with K(n0): the next K may overwrite it
        cp_async_wait<0>();
        __syncthreads();
        if (n0 + BLOCK_N < n_end) {
            cp_async_rows_scalar<BLOCK_N, D_TILE, LD, NTHREADS>(k_tile, k_base, n0 + BLOCK_N, seqlen_k, p.headdim,
                                                             p.k.row_stride);
            cp_async_commit();
        }

        // O += P V, keys of n-tile nt in two k-steps: {8 nt + 2t}, then {8 nt + 2t + 1}; each V
        // fragment serves the warp's M_TILES m-tiles
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt) {
            const A* v_rows = v_tile + (8 * nt + 2 * t) * LD_V + g;  // keys 8 nt + 2t and 8 nt + 2t + 1
            if constexpr (WIDE) {
                // one product per O n-tile: k = t is key 2t, k = t + 4 key 2t + 1 (A's a0..a3
                // from S's c0..c3 in the order c0, c2, c1, c3)
#pragma unroll
                for (int dn = 0; dn < O_TILES; ++dn)
                    dmma_m16n8k8<WIDE>(o_acc[0][dn], o_acc[M_TILES - 1][dn], s[0][nt][0], s[M_TILES - 1][nt][0],
                                       s[0][nt][1], s[M_TILES - 1][nt][1], v_rows[8 * dn], v_rows[LD_V + 8 * dn]);
            } else {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
#pragma unroll
                    for (int dn = 0; dn < O_TILES; ++dn) {
                        const A b = v_rows[e * LD_V + 8 * dn];
#pragma unroll
                        for (int mt = 0; mt < M_TILES; ++mt) dmma_m8n8k4(o_acc[mt][dn], s[mt][nt][e], b, o_acc[mt][dn]);
                    }
                }
            }
        }
    }

    // store O = O / l and lse = (m + log2 l) ln 2; a row that saw no key gives 0 and -inf
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        const A l_row = group_sum<4>(l_i[mt]);
        if (q_row[mt] >= seqlen_q) continue;
        A inv_l, lse_row;
        if constexpr (Mask::Score::HAS_SINK) {
            finish_row_with_sink(m_i[mt], l_row, sink_log2<Mask, A>(p, head), inv_l, lse_row);
        } else {
            inv_l = l_row > A(0) ? A(1) / l_row : A(0);
            lse_row = l_row > A(0) ? (m_i[mt] + log2(l_row)) * A(0.6931471805599453094172321) : neg_inf<A>();
        }
        if constexpr (DropoutOf<Mask>::ENABLED) inv_l *= dropout_scale_in<A>(p);
        A* o_row = p.o.row<A>(batch, seq.q_begin + q_row[mt], head);
#pragma unroll
        for (int dn = 0; dn < O_TILES; ++dn) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * dn + 2 * t + e;
                if (col < p.headdim_v) o_row[col] = o_acc[mt][dn][e] * inv_l;
            }
        }
        if (t == 0) static_cast<A*>(p.lse)[seq.stat(p, head, q_row[mt])] = lse_row;
    }
}

}  // namespace cf
