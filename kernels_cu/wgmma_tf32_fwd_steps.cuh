// The tf32 wgmma forward's per-block steps, shared by flash_fwd_tf32_wgmma.cu (one warpgroup a
// CTA, v0 / v1) and flash_fwd_tf32_wgmma_ws.cu (a producer and two consumer warpgroups, v2):
// docs/perf-log.md tf32-wgmma-v0 .. v2. A warpgroup owns 64 query rows; its warp w holds rows
// strip_row0 = 16 w (+ its warpgroup's offset in the CTA) of every accumulator.
#pragma once

#include "common.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "online_softmax.cuh"
#include "tf32_fwd_steps.cuh"
#include "wgmma_tf32.cuh"

namespace cf {

// A's registers of S = Q K^T for every k-step (Q_REGS), split once: a[kk][r] is Q's (row, column)
// (row g + 8 (r & 1), column 8 kk + t + 4 (r >> 1) of the warp's 16 rows, g = lane / 4, t =
// lane % 4: the tf32 register fragment), zero past the rows and head dim given.
template <int D_TILE, int PRODUCTS>
__device__ __forceinline__ void load_q_fragments(u32 (&hi)[D_TILE / 8][4], u32 (&lo)[D_TILE / 8][4],
                                                 const float* q_rows, int rows_valid, int headdim, i64 stride,
                                                 int strip_row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < D_TILE / 8; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = strip_row0 + lane / 4 + 8 * (r & 1), column = 8 * kk + lane % 4 + 4 * (r >> 1);
            const float x = row < rows_valid && column < headdim ? __ldg(q_rows + row * stride + column) : 0.f;
            split_tf32<PRODUCTS>(x, hi[kk][r], lo[kk][r]);
        }
}

// Turns at the tensor cores for a block's two issues (S's products, then P V's): `wait` before a
// warpgroup issues, `pass` once it has. ConsumerTurns<true> (v2 PINGPONG): two consumer
// warpgroups alternate on two named barriers, so the products of one are issued, and run, while
// the other does its softmax; left alone (NoTurns, v0 .. v2: both calls nothing) the two are
// released by the same full barrier each block and reach their softmax together, the tensor
// cores idle meanwhile (tf32-wgmma-v2 measured 62% of the three-product ceiling).
template <bool ON>
struct ConsumerTurns {
    u32 mine = 0, other = 0;  // named barrier ids: this warpgroup's turn, the other's
    __device__ __forceinline__ void wait() const {
        if constexpr (ON) named_barrier_sync(mine, 256);
    }
    __device__ __forceinline__ void pass() const {
        if constexpr (ON) named_barrier_arrive(other, 256);
    }
};
using NoTurns = ConsumerTurns<false>;

// One key block for a warpgroup: S = Q K_j^T as tf32 wgmma (A = Q from registers with Q_REGS,
// else from the warpgroup's 64-row Q hi / lo tiles; B = K_j's tiles), the online softmax and dropout
// on its registers, P split into wgmma's register A operand, O += P V_j (B = V_j^T's KEY_PAIRS
// tiles); both products waited for, so the caller may reuse the tiles. BLOCK_M: the CTA's rows
// (the mask's partial-block question is the CTA's).
//
// SUMS_APART (precision "ieee"): the tensor cores' accumulation truncates, and its error grows with
// the number of products chained into one accumulator (tf32-fwd-v1's probe: 3 products a k-step
// into one accumulator, 2x float32 FMA's error at 128 terms, 16x at 8192). So S's two small
// products (lo hi, hi lo) go into an accumulator of their own, added to hi hi's by one FADD
// (the probe's "small products apart": FMA's error at 128 terms), hi hi itself in chains of two
// k-steps added by FADDs; and each block's P V goes into a fresh accumulator (one block's keys
// chained, not the sequence's), added to the rescaled O by one FADD a value (tf32-fwd-v2's
// FRESH_O). Same products, more registers: S's width three times over, and O's.
template <int D_TILE, int BLOCK_M, int BLOCK_N, int PRODUCTS, bool Q_REGS, bool SUMS_APART = false, class Mask,
          class Score, class Stats, class Drop, int QK, class Turns = NoTurns>
__device__ __forceinline__ void tf32_wgmma_forward_block(float (&o_acc)[1][D_TILE / 8][4], Stats& row_stats,
                                                         const u32 (&q_hi)[QK][4], const u32 (&q_lo)[QK][4],
                                                         u32 q_hi_tile, u32 q_lo_tile, u32 k_hi_tile, u32 k_lo_tile,
                                                         u32 v_hi_tile, u32 v_lo_tile, const Mask& mask,
                                                         const Score& score, const Drop& dropout, float scale_log2,
                                                         int m0, int n0, int strip_row0, int lane,
                                                         const Turns& turns = Turns()) {
    constexpr int N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;
    constexpr bool SPLIT = Tf32Operand<PRODUCTS>::SPLIT, APART = SPLIT && SUMS_APART;
    static_assert(!Q_REGS || QK == D_TILE / 8, "Q's registers: one A fragment per k-step");
    constexpr int K_STEPS = D_TILE / 8;
    float s[1][N_FRAGS][4];
    float(&s_flat)[N_FRAGS * 4] = reinterpret_cast<float(&)[N_FRAGS * 4]>(s);
    float s_small[APART ? N_FRAGS * 4 : 1];  // lo hi + hi lo, apart from hi hi (SUMS_APART)
    float(&small)[N_FRAGS * 4] = *reinterpret_cast<float(*)[N_FRAGS * 4]>(APART ? s_small : s_flat);
    // One k-step of S: the small products (SPLIT) into `small`, which starts at k-step 0 (its own
    // accumulator, or S's before hi hi goes in), and hi hi into `hh`.
    auto s_k_step = [&](int kk, float(&hh)[N_FRAGS * 4], int hh_accumulates) {
        const u64 k_hi = tf32_k_step_desc<BLOCK_N>(k_hi_tile, kk);
        if constexpr (Q_REGS) {
            if constexpr (SPLIT) {
                WgmmaTf32<BLOCK_N>::rs(small, q_lo[kk], k_hi, kk > 0);
                WgmmaTf32<BLOCK_N>::rs(small, q_hi[kk], tf32_k_step_desc<BLOCK_N>(k_lo_tile, kk), 1);
            }
            WgmmaTf32<BLOCK_N>::rs(hh, q_hi[kk], k_hi, hh_accumulates);
        } else {
            const u64 q_hi_desc = tf32_k_step_desc<64>(q_hi_tile, kk);
            if constexpr (SPLIT) {
                WgmmaTf32<BLOCK_N>::ss(small, tf32_k_step_desc<64>(q_lo_tile, kk), k_hi, kk > 0);
                WgmmaTf32<BLOCK_N>::ss(small, q_hi_desc, tf32_k_step_desc<BLOCK_N>(k_lo_tile, kk), 1);
            }
            WgmmaTf32<BLOCK_N>::ss(hh, q_hi_desc, k_hi, hh_accumulates);
        }
    };
    if constexpr (APART) {
        // hi hi restarted every HH_CHAIN k-steps: its chained truncations were most of what the
        // apart form still missed on a few keys (dev/emulate_split_tf32.py: a tensor-core sum
        // truncated to float32 reproduces the H200's errors; restarting every 2 k-steps brings
        // the failing two- and three-key draws to 3.4e-6 / 2.9e-6, under the 2x bound, and the
        // 1k error from 1.66x to 1.23x standard's). Two chains in flight; each is added to S by
        // FADDs once waited for.
        constexpr int HH_CHAIN = 2, CHAINS = (K_STEPS + HH_CHAIN - 1) / HH_CHAIN;
        float hh[2][N_FRAGS * 4];
        auto add_chain = [&](float(&chain)[N_FRAGS * 4], bool first) {
            pin_registers(chain);
#pragma unroll
            for (int e = 0; e < N_FRAGS * 4; ++e) s_flat[e] = first ? chain[e] : s_flat[e] + chain[e];
        };
        turns.wait();
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
            wgmma_fence();
#pragma unroll
            for (int t = 0; t < HH_CHAIN; ++t)
                if (c * HH_CHAIN + t < K_STEPS) s_k_step(c * HH_CHAIN + t, hh[c & 1], t > 0);
            wgmma_commit();
            if (c > 0) {
                wgmma_wait<1>();
                add_chain(hh[(c - 1) & 1], c == 1);
            }
        }
        turns.pass();
        wgmma_wait<0>();
        add_chain(hh[(CHAINS - 1) & 1], CHAINS == 1);
        pin_registers(s_small);
#pragma unroll
        for (int e = 0; e < N_FRAGS * 4; ++e) s_flat[e] += s_small[e];
    } else {
        turns.wait();
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) s_k_step(kk, s_flat, SPLIT ? 1 : kk > 0);
        wgmma_commit();
        turns.pass();
        wgmma_wait<0>();
        pin_registers(s_flat);
    }

    scale_and_mask(s, scale_log2, mask.keys_partial(m0, BLOCK_M, n0, BLOCK_N), mask, score, m0 + strip_row0, n0,
                   lane);
    float m_new[1][2];
    row_max(m_new, s, row_stats, lane);
    softmax_rescale(s, o_acc, row_stats, m_new, lane);
    if constexpr (Drop::ENABLED)  // after the row sums: l and lse stay the softmax's
        for_s_frags(s, dropout, m0 + strip_row0 + lane / 4, n0 + 2 * (lane % 4), DropToZero{});

    // P as the register A operand, one 8-key step per accumulator column block: its registers
    // {d0, d2, d1, d3} are A's {(g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)} with key 2t as
    // slot t and key 2t + 1 as slot t + 4, the order of V's KEY_PAIRS tile.
    u32 p_hi[N_FRAGS][4], p_lo[N_FRAGS][4];
#pragma unroll
    for (int f = 0; f < N_FRAGS; ++f) {
        const float a[4] = {s[0][f][0], s[0][f][2], s[0][f][1], s[0][f][3]};
#pragma unroll
        for (int e = 0; e < 4; ++e) split_tf32<PRODUCTS>(a[e], p_hi[f][e], p_lo[f][e]);
    }
    float(&o_flat)[D_FRAGS * 4] = reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc);
    float o_block[APART ? D_FRAGS * 4 : 1];  // this block's P V, fresh (SUMS_APART)
    float(&pv)[D_FRAGS * 4] = *reinterpret_cast<float(*)[D_FRAGS * 4]>(APART ? o_block : o_flat);
    turns.wait();
    wgmma_fence();
#pragma unroll
    for (int f = 0; f < N_FRAGS; ++f) {
        const u64 v_hi = tf32_k_step_desc<D_TILE>(v_hi_tile, f);
        if constexpr (SPLIT) {
            WgmmaTf32<D_TILE>::rs(pv, p_lo[f], v_hi, APART ? f > 0 : 1);
            WgmmaTf32<D_TILE>::rs(pv, p_hi[f], tf32_k_step_desc<D_TILE>(v_lo_tile, f), 1);
        }
        WgmmaTf32<D_TILE>::rs(pv, p_hi[f], v_hi, 1);
    }
    wgmma_commit();
    turns.pass();
    wgmma_wait<0>();
    pin_registers(pv);
    if constexpr (APART) {
#pragma unroll
        for (int e = 0; e < D_FRAGS * 4; ++e) o_flat[e] += o_block[e];
    }
}

}  // namespace cf
