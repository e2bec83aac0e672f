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
         "static constexpr int Q_STAGES = PERSISTENT ? 2 : 1, K_STAGES = 2, V_STAGES = 3;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;",
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q = 0;",
         "static constexpr u32 K = Q + Q_STAGES * Q_TILE;",
         "static constexpr u32 V = K + K_STAGES * KV_TILE;",
         "static constexpr u32 BYTES = V + V_STAGES * KV_TILE;",
         "static constexpr int MIN_BLOCKS = PERSISTENT && 2 * (BYTES + 2048) <= 228 * 1024 ? 2 : 1;",
         "constexpr int NWG = BLOCK_M / 64, NTHREADS = NWG * 128;",
         "constexpr int N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;",
         "static_assert(L::BYTES + 1024 <= 227 * 1024, \"shared memory\");")
def fwd_smem(d_tile: int, block_m: int, block_n: int, persistent: bool = False) -> SimpleNamespace:
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_M=block_m, BLOCK_N=block_n, Q_STAGES=2 if persistent else 1,
                        K_STAGES=2, V_STAGES=3, Q_PANEL=block_m * 128, KV_PANEL=block_n * 128,
                        Q_TILE=block_m * d_tile * 2, KV_TILE=block_n * d_tile * 2, Q=0)
    L.K = L.Q + L.Q_STAGES * L.Q_TILE
    L.V = L.K + L.K_STAGES * L.KV_TILE
    L.BYTES = L.V + L.V_STAGES * L.KV_TILE
    L.MIN_BLOCKS = 2 if persistent and 2 * (L.BYTES + 2048) <= 228 * 1024 else 1
    L.NWG = block_m // 64
    L.NTHREADS = L.NWG * 128
    return L


@mirrors(FWD,
         "const u32 raw = smem_u32(smem_raw);",
         "const u32 q_tile = base + L::Q + q_stage * L::Q_TILE;",
         "const u32 k_tile = base + L::K + (c % L::K_STAGES) * L::KV_TILE;",
         "const u32 v_tile = base + L::V + (c % L::V_STAGES) * L::KV_TILE;",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::K + (c % L::K_STAGES) * L::KV_TILE, k_head + n0 * k_ss,"
         " keys - n0, headdim, k_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::V + (c % L::V_STAGES) * L::KV_TILE, v_head + n0 * v_ss,"
         " keys - n0, headdim, v_ss, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(q_tile, p.q.row<const T>(batch, seq.q_begin + m0, head),"
         " seqlen_q - m0, headdim, p.q.row_stride, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::Q + (q_stage ^ 1) * L::Q_TILE, p.q.row<const T>(nb, nm0, nh),"
         " p.seqlen_q - nm0, headdim, p.q.row_stride, tid);")
def fwd_tiles(L, c: int, q_stage: int = 0) -> SimpleNamespace:
    """Tile addresses of iteration c (stages: K c % 2, V c % 3; the grid's kernel counts c = j, the
    key block; the persistent one counts iterations across tiles) with Q in stage q_stage."""
    base = aligned_base(RAW_SMEM)
    return SimpleNamespace(q=base + L.Q + q_stage * L.Q_TILE, k=base + L.K + (c % L.K_STAGES) * L.KV_TILE,
                           v=base + L.V + (c % L.V_STAGES) * L.KV_TILE)


@mirrors(FWD,
         "const u32 q_off = (kk / 4) * L::Q_PANEL + wg * 64 * 128 + (kk % 4) * 32;",
         "const u32 k_off = (kk / 4) * L::KV_PANEL + (kk % 4) * 32;",
         "Wgmma<T, BLOCK_N>::template ss<0, 0>(reinterpret_cast<float(&)[N_FRAGS * 4]>(s),"
         " smem_desc(q_tile + q_off, 16, 1024), smem_desc(k_tile + k_off, 16, 1024), kk > 0);")
def fwd_s_steps(L, tiles, wg: int) -> list[Step]:
    """S = Q K^T of warpgroup wg (its 64 query rows x BLOCK_N keys), k-steps over the head dim."""
    return row_block_k_major_steps(L, tiles.q, tiles.k, wg)


def row_block_k_major_steps(L, a_tile: int, b_tile: int, wg: int) -> list[Step]:
    """The k-steps over the head dim of a 64-row x BLOCK_N product with both operands K-major: A
    the warpgroup's 64 rows of a BLOCK_M tile (Q or dO), B a BLOCK_N tile (K or V). The offsets of
    S = Q K^T in the forward, and of S and dP in flash_bwd_dq_wgmma (each mirror names its own
    statements)."""
    steps = []
    for kk in range(L.D_TILE // 16):
        a_off = (kk // 4) * L.Q_PANEL + wg * 64 * 128 + (kk % 4) * 32
        b_off = (kk // 4) * L.KV_PANEL + (kk % 4) * 32
        steps.append(Step(smem_desc(a_tile + a_off, 16, 1024), 0, smem_desc(b_tile + b_off, 16, 1024), 0))
    return steps


@mirrors(FWD,
         "Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc), p_frag[0][kk],"
         " smem_desc(v_tile + kk * 2048, L::KV_PANEL, 1024), 1);")
def fwd_pv_steps(L, tiles) -> list[Step]:
    """O += P V: A = P from registers (k-step kk: p_frag[kk]), B = V MN-major, k-steps over the keys."""
    return [Step(None, None, smem_desc(tiles.v + kk * 2048, L.KV_PANEL, 1024), 1) for kk in range(L.BLOCK_N // 16)]


def fwd_emulated(q, k, v, L, headdim: int, elementwise):
    """One CTA (query rows 0..BLOCK_M) over every key block: S_j = Q K_j^T, P_j = elementwise(S_j)
    on the accumulators (the softmax's row math is online_softmax.cuh's, tested in
    tests/kernels/test_flash_fwd_mma.py), O += P_j V_j. Returns O (BLOCK_M x D_TILE)."""
    smem = new_smem()
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    cp_async_panels(smem, fwd_tiles(L, 0).q, L.BLOCK_M, L.D_TILE, L.NTHREADS, q, seqlen_q, headdim)
    o_acc = [np.zeros((128, L.D_TILE // 8, 4)) for _ in range(L.NWG)]
    for j in range(math.ceil(seqlen_k / L.BLOCK_N)):
        n0 = j * L.BLOCK_N
        tiles = fwd_tiles(L, j)
        cp_async_panels(smem, tiles.k, L.BLOCK_N, L.D_TILE, L.NTHREADS, k[n0:], seqlen_k - n0, headdim)
        cp_async_panels(smem, tiles.v, L.BLOCK_N, L.D_TILE, L.NTHREADS, v[n0:], seqlen_k - n0, headdim)
        for wg in range(L.NWG):
            s = np.empty((128, L.BLOCK_N // 8, 4))
            for kk, step in enumerate(fwd_s_steps(L, tiles, wg)):
                wgmma(s, smem, step, accumulate=kk > 0)
            p = pack_a_frags(elementwise(s))
            for kk, step in enumerate(fwd_pv_steps(L, tiles)):
                wgmma(o_acc[wg], smem, step, accumulate=True, a_regs=p[:, kk])
    return np.concatenate([acc_to_matrix(o) for o in o_acc])



mirrors(FWD, "const u32 base = (raw + 1023) & ~1023u;")(aligned_base)


FWD_BLOCK_M = 128
# (D_TILE, BLOCK_N) with BLOCK_M = 128 that pass the kernel's shared-memory static_assert: all of
# {64, 128, 256} x {64, 128} but d256 with 128-key blocks (Q, two K and three V stages: 384 KiB).
FWD_SHAPES = [(d, bn) for d in (64, 128, 256) for bn in (64, 128)
              if fwd_smem(d, FWD_BLOCK_M, bn).BYTES + 1024 <= 227 * 1024]


# --- the persistent pipeline: which copy fills which stage, and who still reads it --------------

@mirrors(FWD,
         "const int stage_shift = PERSISTENT && first_stage >= 0 ? first_stage - j_begin : 0;",
         "const int c = j + stage_shift;",
         "if ((j + 1) * BLOCK_N < n_end) load_kv_block(k_rows, v_rows, j + 1, c + 1, seqlen_k);",
         "else if (has_next) prefetch_next(c + 1);",
         "if (has_next) prefetch_next(j_begin + stage_shift);",
         "first_stage = j_begin + stage_shift;",
         "first_stage = (n_end + BLOCK_N - 1) / BLOCK_N + stage_shift;",
         "q_stage ^= 1;")
def persistent_schedule(tiles, k_stages: int = 2, v_stages: int = 3):
    """The events of one persistent CTA over ``tiles`` ((j_begin, j_end): the key blocks of each
    tile, j_end == j_begin for rows that see no key), in the kernel's program order: ("copy",
    buffer, what) for a cp.async issue, ("wait_copies",) for cp_async_wait<0> + barrier,
    ("read", buffer, what) for a product that reads a buffer and is waited for in the same
    iteration (S = Q K^T), ("read_async", buffer, what) for one waited for at the next wait
    (P V: the next iteration's or the epilogue's), ("wait_products",), and ("write", buffer, what)
    for the epilogue's O staging into its Q stage. A buffer is ("Q", s), ("K", s) or ("V", s); what
    is (tile, block) or (tile, "Q")."""
    events = []
    first_stage, q_stage = -1, 0

    def copy_first(t, c):  # the tile's Q into the other Q stage (a later tile), its first K, V
        j_begin, j_end = tiles[t]
        events.append(("copy", ("Q", q_stage ^ 1 if c is not None else q_stage), (t, "Q")))
        if j_end > j_begin:
            c = j_begin if c is None else c
            events.append(("copy", ("K", c % k_stages), (t, j_begin)))
            events.append(("copy", ("V", c % v_stages), (t, j_begin)))

    for t, (j_begin, j_end) in enumerate(tiles):
        has_next = t + 1 < len(tiles)
        stage_shift = first_stage - j_begin if first_stage >= 0 else 0
        if first_stage < 0:
            copy_first(t, None)  # the first tile's prologue
        if j_end == j_begin:  # no key: O = 0
            events.append(("wait_copies",))
            if has_next:
                copy_first(t + 1, j_begin + stage_shift)
            events.append(("write", ("Q", q_stage), (t, "O")))
            first_stage = j_begin + stage_shift
        else:
            for j in range(j_begin, j_end):
                c = j + stage_shift
                events.append(("wait_copies",))
                if j + 1 < j_end:
                    events.append(("copy", ("K", (c + 1) % k_stages), (t, j + 1)))
                    events.append(("copy", ("V", (c + 1) % v_stages), (t, j + 1)))
                elif has_next:
                    copy_first(t + 1, c + 1)
                events.append(("read", ("Q", q_stage), (t, "Q")))
                events.append(("read", ("K", c % k_stages), (t, j)))
                events.append(("wait_products",))  # S_j and P V_{j-1}
                events.append(("read_async", ("V", c % v_stages), (t, j)))
            events.append(("wait_products",))  # the last P V
            events.append(("write", ("Q", q_stage), (t, "O")))  # after the barrier: no S reads Q
            first_stage = j_end + stage_shift
        q_stage ^= 1
    return events


def check_schedule(events) -> None:
    """Every read finds what it wants in its buffer, its copy landed (a wait since the issue),
    and no copy or write lands on a buffer while a product that reads it is in flight or before a
    read of its old contents that is still to come."""
    contents, landed = {}, {}
    in_flight = []  # (buffer, what) of the products not yet waited for
    for event in events:
        kind = event[0]
        if kind == "copy":
            _, buffer, what = event
            assert buffer not in [b for b, _ in in_flight], f"copy of {what} into {buffer} while a product reads it"
            contents[buffer], landed[buffer] = what, False
        elif kind == "wait_copies":
            landed = {b: True for b in landed}
        elif kind in ("read", "read_async"):
            _, buffer, what = event
            assert contents.get(buffer) == what, f"{what} read from {buffer}, which holds {contents.get(buffer)}"
            assert landed[buffer], f"{what} read from {buffer} before its copy landed"
            in_flight.append((buffer, what))
        elif kind == "wait_products":
            in_flight = []
        elif kind == "write":
            _, buffer, what = event
            assert buffer not in [b for b, _ in in_flight], f"{what} staged in {buffer} while a product reads it"
            contents[buffer] = what
    # later reads of overwritten contents are caught as wrong contents above
