"""Model of kernels_cu/flash_bwd_dkdv_tf32_wgmma_ws.cu (perf log tf32-wgmma-bwd-v1): its
shared-memory layout, and its producer / consumer protocol over the stages' full and empty
mbarriers (phase parities as mbarrier.cuh defines them) run as two sequences of steps in any
interleaving. The products each stage feeds are the dK/dV kernel's (tf32_dkdv_query_block, whose
emulation is models/flash_bwd_dkdv_tf32_wgmma.py's).
"""
from __future__ import annotations

from .mirrors import mirrors

KERNEL = "flash_bwd_dkdv_tf32_wgmma_ws"
STAT_SLOTS = 4


@mirrors(KERNEL,
         "static constexpr int BLOCK_N = 64;",
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 4, Q_TILE = BLOCK_M * D_TILE * 4;",
         "static constexpr u32 K_HI = 0, V_HI = 2 * KV_TILE;",
         "static constexpr u32 Q = Tiles::Q, DO = Tiles::DO, QT = Tiles::QT, DOT = Tiles::DOT, STATS = Tiles::STATS;",
         "static constexpr u32 STAGE = (Tiles::BYTES + 1023) / 1024 * 1024;",
         "static constexpr u32 STAGE0 = 4 * KV_TILE;",
         "static constexpr u32 RAW = STAGE0 + STAGES * STAGE;",
         "static constexpr u32 FULL = RAW + RAW_STAGES * 2 * Q_TILE, EMPTY = FULL + 8 * STAGES;",
         "static constexpr u32 BYTES = EMPTY + 8 * STAGES;",
         "constexpr int BLOCK_N = L::BLOCK_N, SV = BLOCK_M / 2;",
         "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);",
         "const u32 stage = base + stage_of(it), staged = raw.stage(it);",
         "const u32 stage = base + stage_of(it);",
         "auto stage_of = [&](int it) { return L::STAGE0 + (it % STAGES) * L::STAGE; };")
def ws_smem(d_tile: int, block_m: int, stages: int, raw_stages: int) -> dict:
    """BwdTf32WgmmaWsSmem's offsets in bytes from the aligned base (stage s's tile X at
    STAGE0 + s STAGE + X)."""
    from .wgmma_tf32_bwd_steps import query_block_tiles

    kv_tile, q_tile = 64 * d_tile * 4, block_m * d_tile * 4
    tiles = query_block_tiles(d_tile, block_m)
    layout = {"KV_TILE": kv_tile, "Q_TILE": q_tile, "K_HI": 0, "V_HI": 2 * kv_tile,
              **{name: tiles[name] for name in ("Q", "DO", "QT", "DOT", "STATS")}}
    layout["STAGE"] = (tiles["BYTES"] + 1023) // 1024 * 1024
    layout["STAGE0"] = 4 * kv_tile
    layout["RAW"] = layout["STAGE0"] + stages * layout["STAGE"]
    layout["FULL"] = layout["RAW"] + raw_stages * 2 * q_tile
    layout["EMPTY"] = layout["FULL"] + 8 * stages
    layout["BYTES"] = layout["EMPTY"] + 8 * stages
    return layout


class Mbarrier:
    """A barrier of `count` arrivals a phase (mbarrier.cuh): its current phase is the number of
    completed ones, and a wait for parity P succeeds while the current phase's parity is not P
    (PTX try_wait.parity): a fresh barrier lets parity 1 through at once."""

    def __init__(self, count: int):
        self.count, self.arrived, self.completed = count, 0, 0

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.completed = 0, self.completed + 1

    def ready(self, parity: int) -> bool:
        return (self.completed & 1) != parity


@mirrors("mbarrier.cuh",  # StageRing, also flash_fwd_tf32_wgmma_ws's
         "mbarrier_wait(empty + 8 * (i % STAGES), ((i / STAGES) & 1) ^ 1);",
         "mbarrier_arrive(full + 8 * (i % STAGES));",
         "mbarrier_wait(full + 8 * (i % STAGES), (i / STAGES) & 1);",
         "mbarrier_arrive(empty + 8 * (i % STAGES));")
@mirrors(KERNEL,
         "const StageRing<STAGES> ring{base + L::FULL, base + L::EMPTY};",
         "ring.wait_empty(it);", "ring.arrive_full(it);", "ring.wait_full(it);", "ring.arrive_empty(it);")
def run_protocol(iters: int, stages: int, choose) -> list:
    """The producer's and the consumer's loops (one thread of each: the barriers count their
    warpgroup's 128 arrivals as one) stepped as choose(options) picks among the sides whose next
    wait succeeds ("producer", "consumer"). Each stage holds the iteration last written to it; a
    write over an iteration the consumer has not finished, or a read of a stage that does not hold
    the consumer's iteration, raises, and so does a state where neither side can move before both
    are through (deadlock). Returns the sequence of ("write", it) and ("read", it)."""
    return run_ring(iters, stages, 1, choose)


def run_ring(iters: int, stages: int, consumers: int, choose) -> list:
    """StageRing's protocol with ``consumers`` consumers taking turns at the iterations (consumer c:
    c, c + consumers, ...; one consumer is named "consumer" among the options, more by their
    index), each stage use one phase of its barriers whoever consumes it."""
    full = [Mbarrier(1) for _ in range(stages)]
    empty = [Mbarrier(1) for _ in range(stages)]
    holds = [None] * stages
    finished = set()
    events: list = []
    producer, nexts = 0, list(range(consumers))
    labels = ["consumer"] if consumers == 1 else list(range(consumers))
    while producer < iters or any(n < iters for n in nexts):
        options = []
        if producer < iters and empty[producer % stages].ready(((producer // stages) & 1) ^ 1):
            options.append("producer")
        for c, it in enumerate(nexts):
            if it < iters and full[it % stages].ready((it // stages) & 1):
                options.append(labels[c])
        if not options:
            raise RuntimeError(f"deadlock at producer {producer}, consumers at {nexts}")
        side = choose(options)
        if side == "producer":
            s = producer % stages
            if holds[s] is not None and holds[s] not in finished:
                raise RuntimeError(f"iteration {producer} overwrites {holds[s]} before the consumer is done")
            holds[s] = producer
            events.append(("write", producer))
            full[s].arrive()
            producer += 1
        else:
            c = labels.index(side)
            it = nexts[c]
            s = it % stages
            if holds[s] != it:
                raise RuntimeError(f"iteration {it} reads stage {s} holding {holds[s]}")
            events.append(("read", it))
            finished.add(it)
            empty[s].arrive()
            nexts[c] += consumers
    return events


__all__ = ["KERNEL", "ws_smem", "Mbarrier", "run_protocol", "run_ring"]
