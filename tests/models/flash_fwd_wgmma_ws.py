"""Model of kernels_cu/flash_fwd_wgmma_ws.cu (perf log wgmma-fwd-ws-v0): its shared-memory layout
(Q, STAGES stages of K and of V, the barriers), the register split between the producer and the
consumer warpgroups, the rows each consumer owns (its S operand, its softmax rows, its O staging
rows), and the producer / consumer protocol over the stage ring and the consumers' turns, run in
any interleaving. The per-block products are flash_fwd_wgmma's (models/flash_fwd_wgmma.py)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from .flash_bwd_dkdv_tf32_wgmma_ws import Mbarrier
from .flash_fwd_wgmma import fwd_pv_steps, row_block_k_major_steps
from .mirrors import WGMMA_LAYOUT_STATEMENT, mirrors
from .mma import swizzled_offset
from .smem import RAW_SMEM, aligned_base
from .wgmma import GROUP, THREAD_IN_GROUP, Step, panel_offset

WS = "flash_fwd_wgmma_ws"  # the kernel (models.mirrors finds its file)

# Beyond the wgmma kernels' layout statements: what places a consumer's rows (cwg, strip_row0, the
# products' and store_o's tile arguments), the stage ring's and the turns' waits and arrivals, the
# register split and the static_asserts on the layout. Every one must have a mirror here.
WS_LAYOUT_STATEMENT = re.compile(
    WGMMA_LAYOUT_STATEMENT.pattern +
    r"|\b(?:const int (?:cwg|strip_row0)\b|static_assert\(|wgmma_rows_times_rows<|wgmma_p_times_v<|store_o<|"
    r"named_barrier_sync\(|warpgroup_registers_\w+<|const StageRing<|const ConsumerTurns<|ring\.\w+\(|"
    r"turns\.\w+\(|mbarrier_\w+\(base|copy_block\(|issue_pv\(|cp_async_wait<)")


@mirrors(WS,
         "static constexpr int BLOCK_M = 128;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q = 0;",
         "static constexpr u32 K = Q + BLOCK_M * D_TILE * 2;",
         "static constexpr u32 V = K + STAGES * KV_TILE;",
         "static constexpr u32 FULL = V + STAGES * KV_TILE, EMPTY = FULL + 8 * STAGES, Q_FULL = EMPTY + 8 * STAGES;",
         "static constexpr u32 BYTES = Q_FULL + 8;",
         "constexpr int BLOCK_M = L::BLOCK_M, N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;",
         "static_assert(BLOCK_N % 64 == 0 && BLOCK_N <= 256 && D_TILE % 64 == 0, \"64-row/column panels\");",
         "static_assert(STAGES >= 2, \"stages\");",
         "static_assert(L::BYTES + 1024 <= 227 * 1024, \"shared memory\");")
def ws_smem(d_tile: int, block_n: int, stages: int) -> SimpleNamespace:
    """FwdWgmmaWsSmem<D_TILE, BLOCK_N, STAGES>: byte offsets from the aligned base. Named as
    models/flash_fwd_wgmma.py's fwd_smem names them, so that its k-step models take either."""
    assert block_n % 64 == 0 and block_n <= 256 and d_tile % 64 == 0 and stages >= 2  # the static_asserts
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_N=block_n, STAGES=stages, BLOCK_M=128, Q_PANEL=128 * 128,
                        KV_PANEL=block_n * 128, KV_TILE=block_n * d_tile * 2, Q=0,
                        N_FRAGS=block_n // 8, D_FRAGS=d_tile // 8)
    L.K = L.Q + L.BLOCK_M * d_tile * 2
    L.V = L.K + stages * L.KV_TILE
    L.FULL = L.V + stages * L.KV_TILE
    L.EMPTY = L.FULL + 8 * stages
    L.Q_FULL = L.EMPTY + 8 * stages
    L.BYTES = L.Q_FULL + 8
    return L


@mirrors(WS,
         "constexpr int LAUNCH_REGISTERS = 65536 / 384 / 8 * 8;",
         "constexpr int PRODUCER_REGISTERS = 24, CONSUMER_REGISTERS = 240;",
         "static_assert(128 * PRODUCER_REGISTERS + 256 * CONSUMER_REGISTERS <= 384 * LAUNCH_REGISTERS, \"registers\");",
         "__launch_bounds__(384, 1)",
         "warpgroup_registers_dec<PRODUCER_REGISTERS>();",
         "warpgroup_registers_inc<CONSUMER_REGISTERS>();")
def register_split() -> SimpleNamespace:
    """Registers per thread: what one CTA of 384 threads is launched with (the register file's 64K
    over the threads, in setmaxnreg's steps of 8), and what setmaxnreg leaves the producer
    warpgroup (128 threads) and raises each of the two consumer warpgroups to."""
    return SimpleNamespace(THREADS=384, LAUNCH=65536 // 384 // 8 * 8, PRODUCER=24, CONSUMER=240)


@mirrors(WS,
         "const u32 q_tile = base + L::Q;",
         "const u32 stage = (i % STAGES) * L::KV_TILE;",
         "cp_async_panels<BLOCK_N, D_TILE, 128>(base + L::K + stage, k_rows + n0 * k_ss, seqlen_k - n0, p.headdim,"
         " k_ss, ptid);",
         "cp_async_panels<BLOCK_N, D_TILE, 128>(base + L::V + stage, v_rows + n0 * v_ss, seqlen_k - n0,"
         " p.headdim_v, v_ss, ptid);",
         "cp_async_panels<BLOCK_M, D_TILE, 128>(q_tile, p.q.row<const T>(seq.batch, seq.q_begin + m0, head),"
         " seqlen_q - m0, p.headdim, p.q.row_stride, ptid);")
def ws_tiles(L, i: int) -> SimpleNamespace:
    """Tile addresses of walk block i (key block j_begin + i): K and V both in stage i % STAGES.
    The producer copies each with its 128 threads (cp_async_panels' NTHREADS)."""
    base = aligned_base(RAW_SMEM)
    stage = (i % L.STAGES) * L.KV_TILE
    return SimpleNamespace(q=base + L.Q, k=base + L.K + stage, v=base + L.V + stage)


@mirrors(WS, "template <typename T, int D_TILE, class Mask, int BLOCK_N, int STAGES, bool PINGPONG>")
def ws_template_arguments(ctype: str, d_tile: int, mask_cpp: str, block_n: int, stages: int, pingpong: bool) -> str:
    """The kernel's template arguments, in its order, as a launcher's expression writes them."""
    return f"{ctype}, {d_tile}, {mask_cpp}, {block_n}, {stages}, {'true' if pingpong else 'false'}"


@mirrors(WS,
         "const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32;",
         "const int cwg = wg - 1;",
         "const int strip_row0 = 64 * cwg + 16 * ((tid / 32) % 4);")
def consumer_rows(tid: int) -> tuple[int, int]:
    """(cwg, strip_row0) of consumer thread tid (128..383): its consumer warpgroup (0 or 1) and
    its warp's first row of the block's 128 (the warp's 16 rows: softmax, dropout, store_o)."""
    wg = tid // 128
    cwg = wg - 1
    return cwg, 64 * cwg + 16 * ((tid // 32) % 4)


@mirrors(WS,
         "wgmma_rows_times_rows<T, BLOCK_N, D_TILE, L::Q_PANEL, L::KV_PANEL>("
         "reinterpret_cast<float(&)[N_FRAGS * 4]>(s), q_tile + cwg * 64 * 128, base + L::K + (i % STAGES) * L::KV_TILE);")
def ws_s_steps(L, tiles, cwg: int) -> list[Step]:
    """S = Q K^T of consumer cwg: Q's rows 64 cwg .. 64 cwg + 63 (wgmma.cuh's k-steps, as
    flash_fwd_wgmma's warpgroup wg = cwg)."""
    return row_block_k_major_steps(L, tiles.q, tiles.k, cwg)


# O += P V of walk block i: flash_fwd_wgmma's product on the stage's V (tiles.v)
mirrors(WS,
        "wgmma_p_times_v<T, D_TILE, BLOCK_N, L::KV_PANEL>(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc), p_frag[0],"
        " base + L::V + (i % STAGES) * L::KV_TILE);")(fwd_pv_steps)
mirrors(WS, "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);")(aligned_base)
mirrors("mma.cuh", "return static_cast<u32>((row * (DIM / 8) + (chunk ^ (row & 7))) * 16);")(swizzled_offset)


@mirrors(WS,
         "store_o<T, D_TILE, Mask::Score::HAS_SINK, Mask::Score::FIXED_MAX>("
         "o_acc, row_stats, q_tile, strip_row0, m0, seqlen_q, p.headdim_v,"
         " p.o.row<T>(seq.batch, seq.q_begin + m0, head), p.o.row_stride,"
         " static_cast<float*>(p.lse) + seq.stat(p, head, m0), lane, sink_log2<Mask, float>(p, head));")
@mirrors("online_softmax.cuh",
         "constexpr int CHUNK_ELEMS = 16 / sizeof(T), ROW_DIM = F32 ? 2 * D_TILE : D_TILE;",
         "const int row = strip_row0 + 16 * i + 8 * h + (lane >> 2);",
         "st_shared_b32(stage_tile + swizzled_offset<D_TILE>(row, f) + 4 * (lane & 3),",
         "constexpr int CHUNKS = D_TILE / CHUNK_ELEMS;",
         "for (int it = 0; it < WARP_ROWS * CHUNKS / 32; ++it) {",
         "const int row = strip_row0 + idx / CHUNKS, chunk = idx % CHUNKS;",
         "ld_shared_v4(r, stage_tile + swizzled_offset<ROW_DIM>(row, chunk));")
def o_staging_bytes(L, cwg: int) -> set[int]:
    """Byte offsets from the Q tile that consumer cwg's store_o (16-bit, one strip a warp) writes
    O to and reads it back from: its warps' rows, each of D_TILE columns, swizzled."""
    touched = set()
    lanes = np.arange(32)
    for tid in range(128 * (cwg + 1), 128 * (cwg + 2), 32):
        _, strip_row0 = consumer_rows(tid)
        for h in range(2):  # the fragment stores: 4 bytes a lane
            row = strip_row0 + 8 * h + GROUP[:32]
            for f in range(L.D_FRAGS):
                for a in swizzled_offset(L.D_TILE, row, f) + 4 * THREAD_IN_GROUP[:32]:
                    touched.update(range(int(a), int(a) + 4))
        chunks = L.D_TILE // 8
        for it in range(16 * chunks // 32):  # the 16-byte reads
            idx = lanes + 32 * it
            for a in swizzled_offset(L.D_TILE, strip_row0 + idx // chunks, idx % chunks):
                touched.update(range(int(a), int(a) + 16))
    return touched


def q_operand_bytes(L, cwg: int) -> set[int]:
    """Byte offsets from the Q tile of the rows consumer cwg's S = Q K^T reads (64-column panels
    of all 128 rows, cp_async_panels' layout)."""
    return {int(panel_offset(L.BLOCK_M, r, c)) + b for r in range(64 * cwg, 64 * cwg + 64)
            for c in range(L.D_TILE // 8) for b in range(16)}


# Named barrier 4 keeps either consumer from staging O over Q rows the other may still read.
mirrors(WS, "named_barrier_sync(4, 256);")(q_operand_bytes)


@mirrors("mbarrier.cuh",  # StageRing's parities, ConsumerTurns' barriers
         "mbarrier_wait(empty + 8 * (i % STAGES), ((i / STAGES) & 1) ^ 1);",
         "mbarrier_arrive(full + 8 * (i % STAGES));",
         "mbarrier_wait(full + 8 * (i % STAGES), (i / STAGES) & 1);",
         "mbarrier_arrive(empty + 8 * (i % STAGES));",
         "if constexpr (ON) named_barrier_sync(mine, 256);",
         "if constexpr (ON) named_barrier_arrive(other, 256);")
@mirrors(WS,
         "const StageRing<STAGES> ring{base + L::FULL, base + L::EMPTY};",
         "ring.init(128, 256);",
         "mbarrier_init(base + L::Q_FULL, 128);",
         "produce_blocks(ring, n_blocks, 0, copy_block, [&](int i) {",
         "for (int i = first_uncopied; i < STAGES - 1; ++i) {",
         "if (i < n_blocks) copy_block(i);",
         "copy_block(i);",
         "cp_async_wait<STAGES - 2>();",
         "if (i == 0) mbarrier_arrive(base + L::Q_FULL);",
         "mbarrier_arrive(base + L::Q_FULL);",
         "ring.arrive_full(i);",
         "if (i + STAGES - 1 < n_blocks) {",
         "ring.wait_empty(i + STAGES - 1);",
         "copy_block(i + STAGES - 1);",
         "const ConsumerTurns<PINGPONG> turns{2u + cwg, 2u + (1 - cwg)};",
         "if (cwg == 1) turns.pass();",
         "mbarrier_wait(base + L::Q_FULL, 0);",
         "ring.wait_full(i);",
         "turns.wait();",
         "if constexpr (WITH_PV) issue_pv(i - 1);",
         "issue_pv(i - 1);",
         "turns.pass();",
         "if constexpr (WITH_PV) ring.arrive_empty(i - 1);",
         "ring.arrive_empty(i - 1);",
         "issue_pv(n_blocks - 1);",
         "if (cwg == 0) turns.wait();")
def run_ring(n_blocks: int, stages: int, choose, pingpong: bool = True, release_lag: int = 1) -> list:
    """The producer's and the two consumers' programs (one actor a warpgroup: a barrier's 128
    producer arrivals count as one, the 256 consumer arrivals of an empty barrier as two) stepped as
    choose(ready) picks among the actors whose next wait succeeds. A copy is in flight from its
    cp.async to the wait that lands it; a product reads its blocks from its issue to its
    wgmma_wait, and raises if a stage does not hold a landed copy of the block at either end (a
    stage rewritten under a product). A turn passed twice before it is taken (bar.arrive's 128
    threads twice: the barrier would complete without its bar.sync) raises, and so do turns left
    unmatched at the end and a state where nobody can move (deadlock). ``release_lag``: the
    kernel releases block i - 1's stage after block i's products (1). Returns the steps taken."""
    full = [Mbarrier(1) for _ in range(stages)]
    empty = [Mbarrier(2) for _ in range(stages)]
    q_full = Mbarrier(1)
    arrived, synced = {2: 0, 3: 0}, {2: 0, 3: 0}  # the turns' named barriers
    holds, landed = [None] * stages, set()

    def producer():
        if n_blocks == 0:
            return
        yield "copy", "Q"  # commit group 0: Q and block 0
        for i in range(stages - 1):
            if i < n_blocks:
                yield "copy", i
        for i in range(n_blocks):
            yield "land", i  # cp_async_wait<STAGES - 2>: groups 0 .. i, this thread's copies
            if i == 0:
                yield "arrive", q_full
            yield "arrive", full[i % stages]
            if i + stages - 1 < n_blocks:
                b = i + stages - 1
                yield "wait", (empty[b % stages], ((b // stages) & 1) ^ 1)
                yield "copy", b

    def consumer(cwg):
        if n_blocks == 0:
            return
        mine, other = 2 + cwg, 2 + (1 - cwg)
        if cwg == 1 and pingpong:
            yield "pass", other
        yield "wait", (q_full, 0)
        for i in range(n_blocks):
            yield "wait", (full[i % stages], (i // stages) & 1)
            if pingpong:
                yield "turn", mine
            reads = ["Q", i] + ([i - 1] if i > 0 else [])  # S_i: Q and K_i; P V of block i - 1: V_{i-1}
            yield "issue", reads
            if pingpong:
                yield "pass", other
            yield "complete", reads  # wgmma_wait<0>
            if i - release_lag >= 0:
                yield "arrive", empty[(i - release_lag) % stages]
        if pingpong:
            yield "turn", mine
        yield "issue", [n_blocks - 1]
        if pingpong:
            yield "pass", other
            if cwg == 0:
                yield "turn", mine
        yield "complete", [n_blocks - 1]

    programs = {"producer": producer(), "consumer 0": consumer(0), "consumer 1": consumer(1)}
    pending = {name: next(program, None) for name, program in programs.items()}
    steps = []

    def ready(step):
        kind, arg = step
        if kind == "wait":
            return arg[0].ready(arg[1])
        return kind != "turn" or arrived[arg] > synced[arg]

    while any(step is not None for step in pending.values()):
        options = [name for name, step in pending.items() if step is not None and ready(step)]
        if not options:
            raise RuntimeError(f"deadlock: {pending}")
        name = choose(options)
        kind, arg = pending[name]
        if kind == "copy" and arg != "Q":
            holds[arg % stages] = arg
        elif kind == "land":
            landed.update(["Q", *range(arg + 1)])
        elif kind == "arrive":
            arg.arrive()
        elif kind in ("issue", "complete"):
            for b in arg:
                if b not in landed or (b != "Q" and holds[b % stages] != b):
                    raise RuntimeError(f"{name} reads block {b} at its {kind}: stage holds {holds}, landed {landed}")
        elif kind == "pass":
            if arrived[arg] > synced[arg]:
                raise RuntimeError(f"{name} passes turn {arg} twice before it is taken")
            arrived[arg] += 1
        elif kind == "turn":
            synced[arg] += 1
        steps.append((name, kind, arg if kind in ("copy", "issue", "complete") else None))
        pending[name] = next(programs[name], None)
    if arrived != synced:
        raise RuntimeError(f"turns left unmatched: arrived {arrived}, taken {synced}")
    return steps
