"""Model of kernels_cu/flash_fwd_wgmma.cu: the shared-memory tiles and stages, the descriptors of
every k-step, and one CTA emulated product by product."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from .fragments import pack_a_frags
from .mirrors import mirrors
from .smem import RAW_SMEM, aligned_base, new_smem
from .wgmma import Step, acc_to_matrix, cp_async_panels, smem_desc, wgmma

FWD = "flash_fwd_wgmma"  # the kernel (models.mirrors finds its file)



@mirrors(FWD,
         "static constexpr int K_STAGES = 2, V_STAGES = 3;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 V_TILE = BLOCK_N * DV_TILE * 2;",
         "static constexpr u32 Q = 0;",
         "static constexpr u32 K = Q + BLOCK_M * D_TILE * 2;",
         "static constexpr u32 V = K + K_STAGES * KV_TILE;",
         "static constexpr u32 BYTES = V + V_STAGES * V_TILE;",
         "constexpr int NWG = BLOCK_M / 64, NTHREADS = NWG * 128;",
         "constexpr int N_FRAGS = BLOCK_N / 8, D_FRAGS = DV_TILE / 8;",
         "static_assert(L::BYTES + 1024 <= 227 * 1024, \"shared memory\");")
def fwd_smem(d_tile: int, block_m: int, block_n: int, dv_tile: int | None = None) -> SimpleNamespace:
    """FwdWgmmaSmem<D_TILE, BLOCK_M, BLOCK_N, DV_TILE> (DV_TILE: D_TILE unless given)."""
    dv_tile = d_tile if dv_tile is None else dv_tile
    L = SimpleNamespace(D_TILE=d_tile, DV_TILE=dv_tile, BLOCK_M=block_m, BLOCK_N=block_n, K_STAGES=2, V_STAGES=3,
                        Q_PANEL=block_m * 128, KV_PANEL=block_n * 128, KV_TILE=block_n * d_tile * 2,
                        V_TILE=block_n * dv_tile * 2, Q=0)
    L.K = L.Q + block_m * d_tile * 2
    L.V = L.K + L.K_STAGES * L.KV_TILE
    L.BYTES = L.V + L.V_STAGES * L.V_TILE
    L.NWG = block_m // 64
    L.NTHREADS = L.NWG * 128
    return L


@mirrors(FWD,
         "const u32 q_tile = base + L::Q;",
         "const u32 k_tile = base + L::K + (j % L::K_STAGES) * L::KV_TILE;",
         "const u32 v_tile = base + L::V + (j % L::V_STAGES) * L::V_TILE;",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::K + (j % L::K_STAGES) * L::KV_TILE,"
         " k_rows + n0 * k_ss, seqlen_k - n0, headdim, k_ss, tid);",
         "cp_async_panels<BLOCK_N, DV_TILE, NTHREADS>(base + L::V + (j % L::V_STAGES) * L::V_TILE,"
         " v_rows + n0 * v_ss, seqlen_k - n0, p.headdim_v, v_ss, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(q_tile, p.q.row<const T>(batch, seq.q_begin + m0, head), seqlen_q - m0,"
         " headdim, p.q.row_stride, tid);")
def fwd_tiles(L, j: int) -> SimpleNamespace:
    """Tile addresses of key block j (stages: K j % 2, V j % 3)."""
    base = aligned_base(RAW_SMEM)
    return SimpleNamespace(q=base + L.Q, k=base + L.K + (j % L.K_STAGES) * L.KV_TILE,
                           v=base + L.V + (j % L.V_STAGES) * L.V_TILE)


@mirrors(FWD,
         "wgmma_rows_times_rows<T, BLOCK_N, D_TILE, L::Q_PANEL, L::KV_PANEL>(",
         "reinterpret_cast<float(&)[N_FRAGS * 4]>(s), q_tile + wg * 64 * 128, k_tile);")
def fwd_s_steps(L, tiles, wg: int) -> list[Step]:
    """S = Q K^T of warpgroup wg (its 64 query rows x BLOCK_N keys), k-steps over the head dim."""
    return row_block_k_major_steps(L, tiles.q, tiles.k, wg)


@mirrors("wgmma.cuh",
         "for (int kk = 0; kk < D_TILE / 16; ++kk) {",
         "const u32 a_off = (kk / 4) * A_PANEL + (kk % 4) * 32;",
         "const u32 b_off = (kk / 4) * B_PANEL + (kk % 4) * 32;",
         "Wgmma<T, N>::template ss<0, 0>(acc, smem_desc(a_tile + a_off, 16, 1024), smem_desc(b_tile + b_off, 16, 1024),"
         " kk > 0);")
def row_block_k_major_steps(L, a_tile: int, b_tile: int, wg: int) -> list[Step]:
    """The k-steps over the head dim of a 64-row x BLOCK_N product with both operands K-major: A
    the warpgroup's 64 rows of a BLOCK_M tile (Q or dO; wgmma.cuh's wgmma_rows_times_rows from
    a_tile + wg * 64 * 128), B a BLOCK_N tile (K or V). S = Q K^T in the forward, S and dP in
    flash_bwd_dq_wgmma (each kernel's mirror names its own call)."""
    steps = []
    for kk in range(L.D_TILE // 16):
        a_off = (kk // 4) * L.Q_PANEL + wg * 64 * 128 + (kk % 4) * 32
        b_off = (kk // 4) * L.KV_PANEL + (kk % 4) * 32
        steps.append(Step(smem_desc(a_tile + a_off, 16, 1024), 0, smem_desc(b_tile + b_off, 16, 1024), 0))
    return steps


@mirrors(FWD,
         "wgmma_p_times_v<T, DV_TILE, BLOCK_N, L::KV_PANEL>(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc), p_frag[0],"
         " v_tile);")
@mirrors("wgmma.cuh",
         "for (int kk = 0; kk < BLOCK_N / 16; ++kk)",
         "Wgmma<T, DV>::template rs<1>(acc, p[kk], smem_desc(v_tile + kk * 2048, B_PANEL, 1024), 1);")
def fwd_pv_steps(L, tiles) -> list[Step]:
    """O += P V (wgmma.cuh's wgmma_p_times_v): A = P from registers (k-step kk: p_frag[kk]), B = V
    MN-major, k-steps over the keys."""
    return [Step(None, None, smem_desc(tiles.v + kk * 2048, L.KV_PANEL, 1024), 1) for kk in range(L.BLOCK_N // 16)]


def fwd_emulated(q, k, v, L, headdim: int, elementwise, headdim_v: int | None = None):
    """One CTA (query rows 0..BLOCK_M) over every key block: S_j = Q K_j^T, P_j = elementwise(S_j)
    on the accumulators (the softmax's row math is online_softmax.cuh's, tested in
    tests/kernels/test_flash_fwd_mma.py), O += P_j V_j. Returns O (BLOCK_M x DV_TILE)."""
    smem = new_smem()
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    cp_async_panels(smem, fwd_tiles(L, 0).q, L.BLOCK_M, L.D_TILE, L.NTHREADS, q, seqlen_q, headdim)
    o_acc = [np.zeros((128, L.DV_TILE // 8, 4)) for _ in range(L.NWG)]
    for j in range(math.ceil(seqlen_k / L.BLOCK_N)):
        n0 = j * L.BLOCK_N
        tiles = fwd_tiles(L, j)
        cp_async_panels(smem, tiles.k, L.BLOCK_N, L.D_TILE, L.NTHREADS, k[n0:], seqlen_k - n0, headdim)
        cp_async_panels(smem, tiles.v, L.BLOCK_N, L.DV_TILE, L.NTHREADS, v[n0:], seqlen_k - n0,
                        headdim if headdim_v is None else headdim_v)
        for wg in range(L.NWG):
            s = np.empty((128, L.BLOCK_N // 8, 4))
            for kk, step in enumerate(fwd_s_steps(L, tiles, wg)):
                wgmma(s, smem, step, accumulate=kk > 0)
            p = pack_a_frags(elementwise(s))
            for kk, step in enumerate(fwd_pv_steps(L, tiles)):
                wgmma(o_acc[wg], smem, step, accumulate=True, a_regs=p[:, kk])
    return np.concatenate([acc_to_matrix(o) for o in o_acc])



mirrors(FWD, "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);")(aligned_base)
mirrors("wgmma.cuh", "return (smem_u32(smem_raw) + 1023) & ~1023u;")(aligned_base)  # the helper itself


FWD_BLOCK_M = 128
# (D_TILE, BLOCK_N) with BLOCK_M = 128 that pass the kernel's shared-memory static_assert: all of
# {64, 128, 256} x {64, 128} but d256 with 128-key blocks (Q, two K and three V stages: 384 KiB).
FWD_SHAPES = [(d, bn) for d in (64, 128, 256) for bn in (64, 128)
              if fwd_smem(d, FWD_BLOCK_M, bn).BYTES + 1024 <= 227 * 1024]


def _loads(d_tile: int, block_m: int, block_n: int) -> bool:
    """cp_async_panels' static_assert for every tile the kernel copies: its threads cover whole
    8-row steps of 16-byte chunks (a 64-row, one-warpgroup CTA cannot copy 256-wide rows)."""
    threads, chunks = block_m // 64 * 128, d_tile // 8
    step = threads // chunks if threads % chunks == 0 else 0
    return step > 0 and step % 8 == 0 and block_m % step == 0 and block_n % step == 0


# (D_TILE, BLOCK_M, BLOCK_N) of every configuration that fits and compiles: the shipped BLOCK_M of
# 128 and one warpgroup's 64 (dev/mma_fwd.py's candidate for sliding windows).
FWD_CONFIGS = [(d, bm, bn) for d in (64, 128, 256) for bm in (64, 128) for bn in (64, 128)
               if fwd_smem(d, bm, bn).BYTES + 1024 <= 227 * 1024 and _loads(d, bm, bn)]
