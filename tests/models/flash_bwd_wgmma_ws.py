"""Models of the two producer backward kernels (perf log wgmma-bwd-ws-v0): kernels_cu/
flash_bwd_wgmma_ws.cu (dK, dV) and kernels_cu/flash_bwd_dq_wgmma_ws.cu (dQ). For each: its
shared-memory layout, the register split between the producer warpgroup and the two consumer
warpgroups, the rows each consumer owns, the tiles its products read, and the producer / consumer
protocol over the stage ring, the consumers' two turns a step and the epilogue's named barrier,
run in any interleaving.

Both kernels share one protocol. The producer copies the tiles a CTA reads throughout once (dK/dV:
K and V; dQ: Q and dO), then each walked block into stage i % STAGES (dK/dV: query block i's Q, dO,
lse and D; dQ: key block i's K and V), STAGES - 1 blocks ahead, arriving on the stage's full
barrier once the copies have landed and waiting on its empty barrier before refilling it. Each
consumer, per block: waits until the stage is full, takes its turn, issues the first two products
(dK/dV: S^T and dP^T, reading K, V and the stage's Q and dO; dQ: S and dP, reading Q, dO and the
stage's K and V), passes the turn, forms P and dS (dK/dV reads the stage's lse and D there), takes
its turn again, issues the second products (dK/dV: dV and dK, reading the stage's dO and Q; dQ:
dS K, reading the stage's K), passes, waits for them and only then releases the stage. Consumer 1
passes once first and consumer 0 takes one more turn at the end, so every pass meets its wait.
The epilogue stages the results over tiles the products read (dK/dV: K and V, which S^T and dP^T
read; dQ: Q, which S reads), behind named barrier 4; then each consumer stores the 64 rows it staged
itself, behind a barrier of its own warpgroup, so no staged word passes between the consumers. The
products themselves are flash_bwd_wgmma's and flash_bwd_dq_wgmma's (models/flash_bwd_wgmma.py,
models/flash_bwd_dq_wgmma.py)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from .flash_bwd_dkdv_tf32_wgmma_ws import Mbarrier
from .flash_bwd_wgmma import bwd_dkdv_steps, bwd_st_steps
from .flash_fwd_wgmma import row_block_k_major_steps
from .flash_fwd_wgmma_ws import WS_LAYOUT_STATEMENT
from .mirrors import mirrors
from .mma_bwd import stage_acc, store_tile
from .smem import RAW_SMEM, aligned_base, new_smem
from .wgmma import Step, smem_desc

BWD_WS = "flash_bwd_wgmma_ws"  # the dK/dV kernel (models.mirrors finds its file)
DQ_WS = "flash_bwd_dq_wgmma_ws"  # the dQ kernel

# Beyond the forward producer kernel's layout statements (flash_fwd_wgmma_ws's WS_LAYOUT_STATEMENT:
# the layout, the static_asserts, the register split, the ring's and the turns' calls, the copies):
# the stage index, the producer's early return, the product waits that the release follows, the
# commit groups and the proxy fence that the ring's full barrier hands on, and the epilogue's
# staging. Every statement these start must have a mirror here.
_WS_BACKWARD = (r"|\b(?:const int stage\b|if \((?:iters|n_blocks) == 0\) return|wgmma_wait<|cp_async_commit\(|"
                r"fence_proxy_async_shared\(|stage_acc<|const int warp_row0\b)")
# dK/dV: the stage's lse and D slots (which the element steps read between the first products and
# the second), the producer's query-block copies (wgmma_bwd.cuh's WgmmaKeyBlock) and the dK, dV
# store.
BWD_WS_LAYOUT_STATEMENT = re.compile(
    WS_LAYOUT_STATEMENT.pattern + _WS_BACKWARD +
    r"|\b(?:const float\* s_(?:lse|delta)\b|load_query_block\(|load_key_block_and_first\(|store_key_block_grads<)")
# dQ: the consumer's rows (its lse and D are read from global memory, not from a stage), the walk's
# length and the dQ store.
DQ_WS_LAYOUT_STATEMENT = re.compile(
    WS_LAYOUT_STATEMENT.pattern + _WS_BACKWARD + r"|\b(?:const int (?:row_lo|n_blocks)\b|store_tile<)")


# ---- shared memory ----

@mirrors(BWD_WS,
         "static constexpr int BLOCK_N = 128;",
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;",
         "static constexpr u32 KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128;",
         "static constexpr u32 K = 0;",
         "static constexpr u32 V = K + KV_TILE;",
         "static constexpr u32 Q = V + KV_TILE;",
         "static constexpr u32 DO = Q + STAGES * Q_TILE;",
         "static constexpr u32 DST = DO + STAGES * Q_TILE;",
         "static constexpr u32 LSE = DST + BLOCK_N * BLOCK_M * 2;",
         "static constexpr u32 DELTA = LSE + STAGES * BLOCK_M * 4;",
         "static constexpr u32 FULL = DELTA + STAGES * BLOCK_M * 4, EMPTY = FULL + 8 * STAGES;",
         "static constexpr u32 BYTES = EMPTY + 8 * STAGES;",
         "typedef BwdWgmmaWsSmem<D_TILE, BLOCK_M, STAGES> L;",
         "constexpr int BLOCK_N = L::BLOCK_N;",
         "constexpr int SJ = BLOCK_M / 8;",
         "constexpr int DJ = D_TILE / 8;",
         "constexpr int QK = BLOCK_M / 16;",
         "static_assert((BLOCK_M == 64 || BLOCK_M == 128) && (D_TILE == 64 || D_TILE == 128), "
         "\"query blocks of 64 or 128 rows, head-dim tiles 64 and 128\");",
         "static_assert(STAGES >= 2, \"stages\");",
         "static_assert(L::BYTES + 1024 <= 227 * 1024, \"shared memory\");")
def bwd_ws_smem(d_tile: int, block_m: int, stages: int) -> SimpleNamespace:
    """BwdWgmmaWsSmem<D_TILE, BLOCK_M, STAGES> and the kernel's derived constants: byte offsets from
    the aligned base. K and V once; STAGES stages of Q and of dO; the dS^T tile (where a score
    policy's derivative waits between the element steps); STAGES slots of lse and of D (floats);
    the full and empty barriers. The shared-memory static_assert is the tests' to check."""
    assert block_m in (64, 128) and d_tile in (64, 128) and stages >= 2  # the other static_asserts
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_M=block_m, STAGES=stages, BLOCK_N=128)
    L.KV_TILE = L.BLOCK_N * d_tile * 2
    L.Q_TILE = block_m * d_tile * 2
    L.KV_PANEL = L.BLOCK_N * 128
    L.Q_PANEL = block_m * 128
    L.K = 0
    L.V = L.K + L.KV_TILE
    L.Q = L.V + L.KV_TILE
    L.DO = L.Q + stages * L.Q_TILE
    L.DST = L.DO + stages * L.Q_TILE
    L.LSE = L.DST + L.BLOCK_N * block_m * 2
    L.DELTA = L.LSE + stages * block_m * 4
    L.FULL = L.DELTA + stages * block_m * 4
    L.EMPTY = L.FULL + 8 * stages
    L.BYTES = L.EMPTY + 8 * stages
    L.SJ, L.DJ, L.QK = block_m // 8, d_tile // 8, block_m // 16
    return L


@mirrors(DQ_WS,
         "static constexpr int BLOCK_M = 128;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2, KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q = 0;",
         "static constexpr u32 DO = Q + Q_TILE;",
         "static constexpr u32 K = DO + Q_TILE;",
         "static constexpr u32 V = K + STAGES * KV_TILE;",
         "static constexpr u32 FULL = V + STAGES * KV_TILE, EMPTY = FULL + 8 * STAGES;",
         "static constexpr u32 BYTES = EMPTY + 8 * STAGES;",
         "typedef DqWgmmaWsSmem<D_TILE, BLOCK_N, STAGES> L;",
         "constexpr int BLOCK_M = L::BLOCK_M, N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;",
         "static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 128 && (D_TILE == 64 || D_TILE == 128), "
         "\"16-key k-steps up to 128 keys, head-dim tiles 64 and 128\");",
         "static_assert(STAGES >= 2, \"stages\");",
         "static_assert(L::BYTES + 1024 <= 227 * 1024, \"shared memory\");")
def dq_ws_smem(d_tile: int, block_n: int, stages: int) -> SimpleNamespace:
    """DqWgmmaWsSmem<D_TILE, BLOCK_N, STAGES> and the kernel's derived constants: Q and dO of 128
    rows once, STAGES stages of K and of V, the full and empty barriers. Named as
    models/flash_fwd_wgmma.py's layouts name them, so that its k-step models take it."""
    assert block_n % 16 == 0 and block_n <= 128 and d_tile in (64, 128) and stages >= 2  # the other static_asserts
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_N=block_n, STAGES=stages, BLOCK_M=128)
    L.Q_PANEL, L.KV_PANEL = L.BLOCK_M * 128, block_n * 128
    L.Q_TILE, L.KV_TILE = L.BLOCK_M * d_tile * 2, block_n * d_tile * 2
    L.Q = 0
    L.DO = L.Q + L.Q_TILE
    L.K = L.DO + L.Q_TILE
    L.V = L.K + stages * L.KV_TILE
    L.FULL = L.V + stages * L.KV_TILE
    L.EMPTY = L.FULL + 8 * stages
    L.BYTES = L.EMPTY + 8 * stages
    L.N_FRAGS, L.D_FRAGS = block_n // 8, d_tile // 8
    return L


_ALIGNED_BASE = "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);"


@mirrors(BWD_WS,
         _ALIGNED_BASE,
         "unsigned char* const smem = smem_raw + (base - smem_u32(smem_raw));",
         "const u32 s_k = base + L::K, s_v = base + L::V, s_dst = base + L::DST;",
         "const int stage = it % STAGES;",
         "const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;",
         "const float* s_lse = reinterpret_cast<const float*>(smem + L::LSE) + stage * BLOCK_M;",
         "const float* s_delta = reinterpret_cast<const float*>(smem + L::DELTA) + stage * BLOCK_M;",
         # the producer's copies: WgmmaKeyBlock's (wgmma_bwd.cuh), by its 128 threads, into the
         # stage it names (cp_async_query_panels: base + L::Q + stage * L::Q_TILE and so on)
         "typedef WgmmaKeyBlock<T, Mask, L, BLOCK_M, BLOCK_N, D_TILE, 128, false> KeyBlock;",
         "load_query_block(it, stage, args, base, seq, tid);",
         "load_key_block_and_first(p, seq, s_k, s_v, args, tid, load_query_block);",
         "load_query_block(i, i % STAGES);")
def bwd_ws_tiles(L, it: int) -> SimpleNamespace:
    """Shared-memory addresses of what walk step `it` reads (stage it % STAGES): K and V, the dS^T
    tile, the stage's Q and dO tiles and its lse and D slots (byte addresses of float 0 of the
    slot). The producer copies query block i into stage i % STAGES: the stage the consumers read it
    from."""
    base = aligned_base(RAW_SMEM)
    stage = it % L.STAGES
    return SimpleNamespace(k=base + L.K, v=base + L.V, dst=base + L.DST,
                           q=base + L.Q + stage * L.Q_TILE, do=base + L.DO + stage * L.Q_TILE,
                           lse=base + L.LSE + 4 * stage * L.BLOCK_M, delta=base + L.DELTA + 4 * stage * L.BLOCK_M)


@mirrors(DQ_WS,
         _ALIGNED_BASE,
         "const u32 s_q = base + L::Q, s_do = base + L::DO;",
         "const u32 k_tile = base + L::K + (i % STAGES) * L::KV_TILE;",
         "const u32 v_tile = base + L::V + (i % STAGES) * L::KV_TILE;",
         "const u32 stage = (i % STAGES) * L::KV_TILE;",
         "cp_async_panels<BLOCK_N, D_TILE, 128>(base + L::K + stage, k_rows + n0 * k_ss, seqlen_k - n0, p.headdim,"
         " k_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, 128>(base + L::V + stage, v_rows + n0 * v_ss, seqlen_k - n0,"
         " p.headdim_v, v_ss, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, 128>(s_q, p.q.row<const T>(batch, seq.q_begin + m0, head), seqlen_q - m0,"
         " p.headdim, p.q.row_stride, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, 128>(s_do, p.dout.row<const T>(batch, seq.q_begin + m0, head),"
         " seqlen_q - m0, p.headdim_v, p.dout.row_stride, tid);",
         "const int n_blocks = max(0, (n_end + BLOCK_N - 1) / BLOCK_N - j_begin);")
def dq_ws_tiles(L, i: int) -> SimpleNamespace:
    """Shared-memory addresses of what walk block i (key block j_begin + i, n_blocks of them)
    reads: Q and dO, and K and V in stage i % STAGES. The producer copies each with its 128
    threads (cp_async_panels' NTHREADS) to exactly the consumers' addresses."""
    base = aligned_base(RAW_SMEM)
    stage = (i % L.STAGES) * L.KV_TILE
    return SimpleNamespace(q=base + L.Q, do=base + L.DO, k=base + L.K + stage, v=base + L.V + stage)


@mirrors(BWD_WS, "template <typename T, int D_TILE, class Mask, int BLOCK_M, int STAGES, bool PINGPONG>")
def bwd_ws_template_arguments(ctype: str, d_tile: int, mask_cpp: str, block_m: int, stages: int,
                              pingpong: bool) -> str:
    """flash_bwd_wgmma_ws's template arguments, in its order, as a launcher's expression writes them."""
    return f"{ctype}, {d_tile}, {mask_cpp}, {block_m}, {stages}, {'true' if pingpong else 'false'}"


@mirrors(DQ_WS, "template <typename T, int D_TILE, class Mask, int BLOCK_N, int STAGES, bool PINGPONG>")
def dq_ws_template_arguments(ctype: str, d_tile: int, mask_cpp: str, block_n: int, stages: int,
                             pingpong: bool) -> str:
    """flash_bwd_dq_wgmma_ws's template arguments, in its order."""
    return f"{ctype}, {d_tile}, {mask_cpp}, {block_n}, {stages}, {'true' if pingpong else 'false'}"


# ---- registers and rows ----

_REGISTER_SPLIT = ("constexpr int LAUNCH_REGISTERS = 65536 / 384 / 8 * 8;",
                   "constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;",
                   "static_assert(128 * PRODUCER_REGISTERS + 256 * CONSUMER_REGISTERS <= 384 * LAUNCH_REGISTERS,"
                   " \"registers\");",
                   "__launch_bounds__(384, 1)",
                   "warpgroup_registers_dec<PRODUCER_REGISTERS>();",
                   "warpgroup_registers_inc<CONSUMER_REGISTERS>();")


@mirrors(BWD_WS, *_REGISTER_SPLIT)
@mirrors(DQ_WS, *_REGISTER_SPLIT)
def register_split() -> SimpleNamespace:
    """Registers per thread, the same in both kernels: what one CTA of 384 threads is launched with
    (the register file's 64K over the threads, in setmaxnreg's steps of 8), what setmaxnreg leaves
    the producer warpgroup (128 threads) and raises each of the two consumer warpgroups to."""
    return SimpleNamespace(THREADS=384, LAUNCH=65536 // 384 // 8 * 8, PRODUCER=40, CONSUMER=232)


_THREAD = "const int tid = threadIdx.x, wg = tid / 128;"


@mirrors(BWD_WS,
         _THREAD,
         "const int cwg = wg - 1;",
         "const int t = thread_index_uncached(), warp_in_wg = (t / 32) % 4, lane = t % 32;",
         "const int warp_in_wg = (tid / 32) % 4, lane = tid % 32;",
         "const int key_row = 64 * cwg + 16 * warp_in_wg + lane / 4;",
         "const int row0 = 64 * cwg, warp_row0 = row0 + 16 * warp_in_wg;")
def bwd_ws_key_rows(tid: int) -> tuple[int, list[int], int]:
    """(cwg, key rows, warp_row0) of dK/dV consumer thread tid (128..383): its consumer warpgroup,
    the two rows of the key block it holds S^T, dP^T (and its dS^T stash) for (key_row and
    key_row + 8), and its warp's first row of the dK, dV staging."""
    wg = tid // 128
    cwg, warp_in_wg, lane = wg - 1, (tid // 32) % 4, tid % 32
    key_row = 64 * cwg + 16 * warp_in_wg + lane // 4
    return cwg, [key_row, key_row + 8], 64 * cwg + 16 * warp_in_wg


@mirrors(DQ_WS,
         _THREAD,
         "const int cwg = wg - 1, ctid = tid - 128, cwarp = ctid / 32, lane = tid % 32;",
         "const int row_lo = m0 + 16 * cwarp + lane / 4;")
def dq_ws_query_rows(tid: int) -> tuple[int, list[int], int]:
    """(cwg, query rows, first staging row) of dQ consumer thread tid (128..383), rows counted from
    the block's m0: its two rows of S, dP, lse and D (row_lo and row_lo + 8) and its warp's first
    row of the dQ staging (16 cwarp)."""
    wg = tid // 128
    cwg, ctid, lane = wg - 1, tid - 128, tid % 32
    cwarp = ctid // 32
    row_lo = 16 * cwarp + lane // 4
    return cwg, [row_lo, row_lo + 8], 16 * cwarp


@mirrors(BWD_WS,
         "store_key_block_grads<T, 64, D_TILE, 128>(p.dk, p.dv, s_k + row0 * D_TILE * 2, s_v + row0 * D_TILE * 2, seq,"
         " key_block.head_kv, key_block.n0 + row0, seq.seqlen_k, args.headdim, args.headdim_v, tid % 128);")
@mirrors(DQ_WS,
         "const int row0 = 64 * cwg;",
         "store_tile<64, D_TILE, 128>(p.dq.row<T>(batch, seq.q_begin + m0 + row0, head), s_q + row0 * D_TILE * 2,"
         " seqlen_q - m0 - row0, p.headdim, p.dq.row_stride, tid % 128);")
def epilogue_store(kernel: str, d_tile: int, rows_valid: int, headdim: int) -> np.ndarray:
    """The epilogue of ``kernel`` on one staged tile (dK/dV: the K tile, the V tile alike; dQ: the Q
    tile), the block's rows 0 .. rows_valid - 1 in the sequence and headdim columns: every
    consumer warp stages its accumulator (mma_bwd.cuh's stage_acc; here each element holds
    1000 row + column of the block, the rows its thread holds: bwd_ws_key_rows / dq_ws_query_rows),
    then each consumer stores from the tile's row row0 = 64 cwg on with its 128 threads
    (store_tile<64, D_TILE, 128>, rows_valid - row0 valid rows, headdim columns) into the block's
    rows row0 ... A consumer's store sees only the words it staged itself (the other consumer's are
    NaN for it), so a word that passes between the consumers comes out NaN. Returns the block's
    (128, headdim) output, NaN where nothing was written."""
    rows_of = bwd_ws_key_rows if kernel == BWD_WS else dq_ws_query_rows
    tile = 0
    staged_by = []
    for cwg in (0, 1):
        smem = new_smem()
        for warp_tid in range(128 * (cwg + 1), 128 * (cwg + 2), 32):
            _, _, strip0 = rows_of(warp_tid)
            acc = np.empty((32, d_tile // 8, 4))
            for lane in range(32):
                row = strip0 + lane // 4
                for j in range(d_tile // 8):
                    col = 8 * j + 2 * (lane % 4)
                    acc[lane, j] = [1000 * row + col, 1000 * row + col + 1,
                                    1000 * (row + 8) + col, 1000 * (row + 8) + col + 1]
            stage_acc(smem, tile, d_tile, strip0, 0, acc, 1.0)
        staged_by.append(smem)
    out = np.full((128, headdim), np.nan)
    for cwg in (0, 1):
        row0 = 64 * cwg
        store_tile(out[row0:], staged_by[cwg], tile + row0 * d_tile * 2, 64, d_tile, 128, rows_valid - row0,
                   headdim)
    return out


# ---- the products' operands ----

# The dK/dV consumer's products, wgmma_bwd.cuh's (models/flash_bwd_wgmma.py mirrors their bodies).
_ISSUE_ST_DPT = "issue_st_dpt<T, L, BLOCK_M, D_TILE>(s_acc, dp_acc, s_k, s_v, s_q, s_do, cwg);"
_ISSUE_DV_DK = "issue_dv_dk<T, L, D_TILE>(dv_acc, dk_acc, p_frag, ds_frag, s_do, s_q);"
# the dQ kernel's (wgmma_bwd.cuh's issue_s_dp and issue_ds_k, flash_bwd_dq_wgmma's products)
_ISSUE_S_DP = ("issue_s_dp<T, BLOCK_N, D_TILE, L::Q_PANEL, L::KV_PANEL>(s_acc, dp_acc, s_q + cwg * 64 * 128,"
               " s_do + cwg * 64 * 128, k_tile, v_tile);")
_ISSUE_DS_K = "issue_ds_k<T, D_TILE, BLOCK_N, L::KV_PANEL>(dq_acc, ds_frag, k_tile);"


@mirrors(BWD_WS, _ISSUE_ST_DPT)
def bwd_ws_st_steps(L, tiles, cwg: int) -> tuple[list[Step], list[Step]]:
    """(S^T = K_g Q^T, dP^T = V_g dO^T) of consumer cwg: its 64 key rows 64 cwg .. of K and V (the
    tiles copied once) by the stage's BLOCK_M queries; flash_bwd_wgmma's k-steps with its
    warpgroup wg = cwg."""
    return bwd_st_steps(L, tiles.k, tiles.q, cwg), bwd_st_steps(L, tiles.v, tiles.do, cwg)


@mirrors(BWD_WS, _ISSUE_DV_DK)
def bwd_ws_dkdv_steps(L, tiles) -> tuple[list[Step], list[Step]]:
    """(dV_g += P^T dO, dK_g += dS^T Q): A from registers, B the stage's dO and Q, MN-major, k-steps
    over the queries (flash_bwd_wgmma's)."""
    return bwd_dkdv_steps(L, tiles.do), bwd_dkdv_steps(L, tiles.q)


@mirrors(DQ_WS, _ISSUE_S_DP)
def dq_ws_s_dp_steps(L, tiles, cwg: int) -> tuple[list[Step], list[Step]]:
    """(S = Q K_i^T, dP = dO V_i^T) of consumer cwg: its 64 query rows 64 cwg .. of Q and dO by the
    stage's BLOCK_N keys, both operands K-major (wgmma.cuh's wgmma_rows_times_rows)."""
    return row_block_k_major_steps(L, tiles.q, tiles.k, cwg), row_block_k_major_steps(L, tiles.do, tiles.v, cwg)


@mirrors(DQ_WS, _ISSUE_DS_K)
def dq_ws_dq_steps(L, tiles) -> list[Step]:
    """dQ += dS K_i: A = dS from registers, B = the stage's K MN-major (16 keys, 2048 bytes, a
    k-step; the D_TILE columns in 64-column panels KV_PANEL apart)."""
    return [Step(None, None, smem_desc(tiles.k + kk * 2048, L.KV_PANEL, 1024), 1) for kk in range(L.BLOCK_N // 16)]


# ---- the protocol ----

# What the ring runner's programs step through, kernel by kernel: the statements of the producer's
# prologue and loop, of a consumer's step and of the epilogue, several of them as whole runs of
# consecutive statements, so that their order is the kernel's too.
_RING = ("const StageRing<STAGES> ring{base + L::FULL, base + L::EMPTY};",
         "ring.init(128, 256);",
         "cp_async_wait<STAGES - 2>();",
         "fence_proxy_async_shared();",
         "ring.arrive_full(i);",
         "ring.wait_empty(i + STAGES - 1);",
         "cp_async_commit();",
         "const ConsumerTurns<PINGPONG> turns{2u + cwg, 2u + (1 - cwg)};",
         "if (cwg == 1) turns.pass();",
         "turns.wait();",
         "turns.pass();",
         "wgmma_wait<1>();",
         "wgmma_wait<0>();",
         "if (cwg == 0) turns.wait();",
         "named_barrier_sync(4, 256);")


def _ring(acc: str, accs: list[str], it: str, first: str, second: str) -> list[str]:
    """The statements above, and those whose order matters written as runs: the producer's loop
    (cp_async_ring.cuh's produce_blocks: land block i, hand it on, refill the stage of block i - 1
    once it is free), a consumer's first products (S and dP; S^T and dP^T) in one turn then S's
    wait, and the end of its step (the second products in the other turn, their wait, then the
    release). ``first`` and ``second``: the statement that ends each issue (wgmma_bwd.cuh's issue
    functions, which commit)."""
    pins = " ".join(f"pin_registers(reinterpret_cast<float(&)[{acc} * 4]>({a}));" for a in accs)
    return [*_RING,
            "for (int i = 0; i < n_blocks; ++i) { cp_async_wait<STAGES - 2>(); fence_proxy_async_shared(); "
            "landed(i); ring.arrive_full(i); if (i + STAGES - 1 < n_blocks) { ring.wait_empty(i + STAGES - 1);",
            "for (int i = first_uncopied; i < STAGES - 1; ++i) { if (i < n_blocks) copy_block(i); cp_async_commit(); }",
            f"{first} turns.pass(); wgmma_wait<1>();",
            f"{second} turns.pass(); wgmma_wait<0>(); {pins} ring.arrive_empty({it}); }} "
            f"if (cwg == 0) turns.wait();"]


@mirrors("mbarrier.cuh",  # StageRing's parities, ConsumerTurns' barriers
         "mbarrier_wait(empty + 8 * (i % STAGES), ((i / STAGES) & 1) ^ 1);",
         "mbarrier_arrive(full + 8 * (i % STAGES));",
         "mbarrier_wait(full + 8 * (i % STAGES), (i / STAGES) & 1);",
         "mbarrier_arrive(empty + 8 * (i % STAGES));",
         "if constexpr (ON) named_barrier_sync(mine, 256);",
         "if constexpr (ON) named_barrier_arrive(other, 256);")
@mirrors(BWD_WS,
         *_ring("DJ", ["dv_acc", "dk_acc"], "it", _ISSUE_ST_DPT, _ISSUE_DV_DK),
         "if (iters == 0) return;",
         "produce_blocks(ring, iters, 1, [&](int i) { load_query_block(i, i % STAGES); }, [](int) {});",
         "for (int it = 0; it < iters; ++it) {",
         "const int stage = it % STAGES; ring.wait_full(it);",
         "ring.wait_full(it);",
         "ring.arrive_empty(it);",
         # the epilogue: dK, dV staged over K and V after named barrier 4, then each consumer's own
         # rows stored after its warpgroup's barrier
         "named_barrier_sync(4, 256); stage_acc<T, D_TILE, D_TILE>(s_k, warp_row0, 0, dk_acc, args.scale, lane);"
         " stage_acc<T, D_TILE, D_TILE>(s_v, warp_row0, 0, dv_acc, dv_scale, lane); named_barrier_sync(5 + cwg, 128);"
         " store_key_block_grads<T, 64, D_TILE, 128>(p.dk, p.dv, s_k + row0 * D_TILE * 2, s_v + row0 * D_TILE * 2,"
         " seq, key_block.head_kv, key_block.n0 + row0, seq.seqlen_k, args.headdim, args.headdim_v, tid % 128);",
         "stage_acc<T, D_TILE, D_TILE>(s_k, warp_row0, 0, dk_acc, args.scale, lane);",
         "stage_acc<T, D_TILE, D_TILE>(s_v, warp_row0, 0, dv_acc, dv_scale, lane);",
         "named_barrier_sync(5 + cwg, 128);")
@mirrors(DQ_WS,
         *_ring("D_FRAGS", ["dq_acc"], "i", _ISSUE_S_DP, _ISSUE_DS_K),
         "if (n_blocks == 0) return;",
         "copy_block(i + STAGES - 1);",
         "produce_blocks(ring, n_blocks, 0, copy_block, [](int) {});",
         "copy_block(i);",
         "ring.wait_full(i);",
         "ring.arrive_empty(i);",
         # the epilogue: dQ staged over Q after named barrier 4, then each consumer's own rows stored
         # after its warpgroup's barrier
         "named_barrier_sync(4, 256); stage_acc<T, D_TILE, D_TILE>(s_q, 16 * cwarp, 0, dq_acc, scale, lane);"
         " named_barrier_sync(5 + cwg, 128);",
         "stage_acc<T, D_TILE, D_TILE>(s_q, 16 * cwarp, 0, dq_acc, scale, lane);",
         "named_barrier_sync(5 + cwg, 128);")
def run_ws_ring(kernel: str, n_blocks: int, stages: int, choose, pingpong: bool = True, release_after: int = 2,
                first_pass: bool = True, last_wait: bool = True, epilogue_barrier: bool = True) -> list:
    """The producer's and the two consumers' programs of ``kernel`` (BWD_WS or DQ_WS) over a walk of
    n_blocks blocks, one actor a warpgroup (a full barrier's 128 producer arrivals count as one, an
    empty barrier's 256 consumer arrivals as two), stepped as choose(ready) picks among the actors
    whose next step can go. A copy into a stage rewrites it from its cp.async on and lands at the
    cp_async_wait that covers its commit group; a product reads its tiles from its issue to its
    wgmma_wait, and the element step of dK/dV reads the stage's lse and D where it runs: each of
    those raises unless every tile it reads has landed and its stage still holds that block (a
    stage rewritten under a read, or read before it landed). A turn passed twice before it is taken
    (bar.arrive's 128 threads twice: the barrier would complete without its bar.sync) raises, and
    so do turns left unmatched at the end and a state where nobody can move (deadlock). The
    epilogue: each consumer stages its results over the tiles it names (dK/dV: K and V; dQ: Q),
    which a read of them after that raises, then stores its own rows (epilogue_store: the rows it
    staged, after a barrier of its own warpgroup); named barrier 4 before the staging. Tiles are
    whole here: a consumer's staging rows overlap the other's operand rows only past d64 (a row of D_TILE
    columns spans both consumers' rows of a 64-column panel), so at d64 the model is stricter than
    the bytes need.

    The kernels' protocol with its defaults; the others take a piece away, for the tests to see
    that the model notices: ``release_after`` 1 releases a stage after the first products (and the
    element step) instead of after the second; first_pass=False drops consumer 1's first pass,
    last_wait=False consumer 0's last turn, epilogue_barrier=False named barrier 4. Returns
    the steps taken, (actor, kind, what) with what the tile or tiles of a copy, issue, complete or
    read."""
    assert kernel in (BWD_WS, DQ_WS) and release_after in (1, 2)
    dkdv = kernel == BWD_WS
    once = ("K", "V") if dkdv else ("Q", "dO")  # copied once, with block 0 (commit group 0)
    # What the first products read (S^T: K, Q_i; dP^T: V, dO_i / S: Q, K_i; dP: dO, V_i): the once
    # tiles by name, the stage's by its block; the second products read only the stage.
    first_s, first_dp = [once[0], "i"], [once[1], "i"]
    staged_over = ("K", "V") if dkdv else ("Q",)
    full = [Mbarrier(1) for _ in range(stages)]
    empty = [Mbarrier(2) for _ in range(stages)]
    arrived, synced = {2: 0, 3: 0}, {2: 0, 3: 0}  # the turns' named barriers
    barrier4 = [0]  # arrivals at the epilogue's named barrier 4
    holds, landed = [None] * stages, set()

    def producer():
        if n_blocks == 0:
            return  # if (iters == 0) return; / if (n_blocks == 0) return;
        for tile in once:
            yield "copy", tile
        for i in range(stages - 1):  # commit groups 0 .. STAGES - 2: blocks 0 .. STAGES - 2
            if i < n_blocks:
                yield "copy", i
        for i in range(n_blocks):
            yield "land", i  # cp_async_wait<STAGES - 2>: groups 0 .. i, this thread's copies
            yield "arrive", full[i % stages]
            if i + stages - 1 < n_blocks:
                b = i + stages - 1
                yield "wait", (empty[b % stages], ((b // stages) & 1) ^ 1)
                yield "copy", b

    def consumer(cwg):
        mine, other = 2 + cwg, 2 + (1 - cwg)
        if cwg == 1 and pingpong and first_pass:
            yield "pass", other
        for i in range(n_blocks):
            s_reads, dp_reads = ([i if r == "i" else r for r in reads] for reads in (first_s, first_dp))
            yield "wait", (full[i % stages], (i // stages) & 1)
            if pingpong:
                yield "turn", mine
            yield "issue", s_reads + dp_reads
            if pingpong:
                yield "pass", other
            yield "complete", s_reads  # wgmma_wait<1>: S (S^T) done
            if dkdv:
                yield "read", [i]  # step 3: the stage's lse
            yield "complete", dp_reads  # wgmma_wait<0>: dP (dP^T) done
            if dkdv:
                yield "read", [i]  # step 4: the stage's D
            if release_after == 1:
                yield "arrive", empty[i % stages]
            if pingpong:
                yield "turn", mine
            yield "issue", [i]  # dV and dK: the stage's dO and Q / dQ: the stage's K
            if pingpong:
                yield "pass", other
            yield "complete", [i]  # wgmma_wait<0>
            if release_after == 2:
                yield "arrive", empty[i % stages]
        if cwg == 0 and pingpong and last_wait:
            yield "turn", mine
        if epilogue_barrier:
            yield "bar4", 0
            yield "bar4 wait", 0
        yield "stage", staged_over
        yield "store", staged_over  # its own rows, after its warpgroup's barrier (5 + cwg)

    programs = {"producer": producer(), "consumer 0": consumer(0), "consumer 1": consumer(1)}
    pending = {name: next(program, None) for name, program in programs.items()}
    steps = []

    def ready(step):
        kind, arg = step
        if kind == "wait":
            return arg[0].ready(arg[1])
        if kind == "turn":
            return arrived[arg] > synced[arg]
        if kind == "bar4 wait":
            return barrier4[arg] == 2
        return True

    while any(step is not None for step in pending.values()):
        options = [name for name, step in pending.items() if step is not None and ready(step)]
        if not options:
            raise RuntimeError(f"deadlock: {pending}")
        name = choose(options)
        kind, arg = pending[name]
        if kind == "copy":
            if isinstance(arg, int):
                holds[arg % stages] = arg
        elif kind == "land":
            landed.update([*once, *range(arg + 1)])
        elif kind == "arrive":
            arg.arrive()
        elif kind in ("issue", "complete", "read"):
            for b in arg:
                if b not in landed or (isinstance(b, int) and holds[b % stages] != b):
                    raise RuntimeError(f"{name} reads block {b} at its {kind}: stages hold {holds}, "
                                       f"landed {sorted(map(str, landed))}")
        elif kind == "pass":
            if arrived[arg] > synced[arg]:
                raise RuntimeError(f"{name} passes turn {arg} twice before it is taken")
            arrived[arg] += 1
        elif kind == "turn":
            synced[arg] += 1
        elif kind == "bar4":
            barrier4[arg] += 1
        elif kind == "stage":
            landed.difference_update(arg)  # the tiles hold results from here on
        steps.append((name, kind, arg if kind in ("copy", "issue", "complete", "read") else None))
        pending[name] = next(programs[name], None)
    if arrived != synced:
        raise RuntimeError(f"turns left unmatched: arrived {arrived}, taken {synced}")
    return steps
