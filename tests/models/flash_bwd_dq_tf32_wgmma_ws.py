"""Model of kernels_cu/flash_bwd_dq_tf32_wgmma_ws.cu (perf log tf32-wgmma-dq-ws): its shared-memory
layout, the tiles its two warpgroups' splits fill (Q and dO by all 256 threads before the roles
split, a key block's K, K^T and V by the producer's 128 into a stage), and the three products the
consumer forms from them, emulated by models/wgmma_tf32_bwd_steps.py. Its producer / consumer
protocol is StageRing's, the dK/dV producer kernel's (models/flash_bwd_dkdv_tf32_wgmma_ws.py
run_protocol), whose four ring statements this kernel also mirrors here.
"""
from __future__ import annotations

import numpy as np

from .flash_bwd_dq_tf32_wgmma import products_at
from .mirrors import mirrors
from .wgmma_tf32 import split_tf32_panels
from .wgmma_tf32_bwd_steps import key_block_tiles, split_key_block

KERNEL = "flash_bwd_dq_tf32_wgmma_ws"
BLOCK_M = 64
CTA_ROWS = BLOCK_M  # the rows a CTA keeps (models/wgmma_tf32_bwd_steps.py emulate)
STAGE_INDEX = 1  # the stage the emulated key block lands in (the second: its offsets past STAGE0)


@mirrors(KERNEL,
         "static constexpr int BLOCK_M = 64;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4, KV_TILE = BLOCK_N * D_TILE * 4;",
         "static constexpr u32 Q_HI = 0, DO_HI = 2 * Q_TILE;",
         "static constexpr u32 K = Tiles::K, KT = Tiles::KT, V = Tiles::V;",
         "static constexpr u32 STAGE = (6 * KV_TILE + 1023) / 1024 * 1024;",
         "static constexpr u32 STAGE0 = 4 * Q_TILE;",
         "static constexpr u32 RAW = STAGE0 + STAGES * STAGE;",
         "static constexpr u32 FULL = RAW + RAW_STAGES * 2 * KV_TILE, EMPTY = FULL + 8 * STAGES;",
         "static constexpr u32 BYTES = EMPTY + 8 * STAGES;",
         "constexpr int BLOCK_M = L::BLOCK_M, SV = BLOCK_N / 2;",
         "const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);",
         "auto stage_of = [&](int i) { return L::STAGE0 + (i % STAGES) * L::STAGE; };",
         "const u32 stage = base + stage_of(i), staged = raw.stage(j);",
         "const u32 stage = base + stage_of(i);")
def ws_smem(d_tile: int, block_n: int, stages: int, raw_stages: int, stage: int = 0) -> dict:
    """DqTf32WgmmaWsSmem's offsets in bytes from the aligned base, and stage `stage`'s tiles as
    absolute offsets (K_HI .. V_LO: stage_of(i) + X, each lo tile KV_TILE past its hi tile)."""
    q_tile, kv_tile = BLOCK_M * d_tile * 4, block_n * d_tile * 4
    tiles = key_block_tiles(d_tile, block_n)
    layout = {"Q_TILE": q_tile, "KV_TILE": kv_tile, "Q_HI": 0, "DO_HI": 2 * q_tile, "K": tiles["K"],
              "KT": tiles["KT"], "V": tiles["V"]}
    layout["Q_LO"], layout["DO_LO"] = q_tile, 3 * q_tile
    layout["STAGE"] = (6 * kv_tile + 1023) // 1024 * 1024
    layout["STAGE0"] = 4 * q_tile
    layout["RAW"] = layout["STAGE0"] + stages * layout["STAGE"]
    layout["FULL"] = layout["RAW"] + raw_stages * 2 * kv_tile
    layout["EMPTY"] = layout["FULL"] + 8 * stages
    layout["BYTES"] = layout["EMPTY"] + 8 * stages
    at = layout["STAGE0"] + (stage % stages) * layout["STAGE"]
    for tile in ("K", "KT", "V"):
        layout[tile + "_HI"] = at + layout[tile]
        layout[tile + "_LO"] = at + layout[tile] + kv_tile
    return layout


@mirrors(KERNEL,
         "split_tf32_panels<BLOCK_M, D_TILE, 256, PRODUCTS>(",
         "base + L::Q_HI, base + L::Q_HI + L::Q_TILE,",
         "base + L::DO_HI, base + L::DO_HI + L::Q_TILE,",
         "split_key_block_tf32<D_TILE, BLOCK_N, 128, PRODUCTS>(stage, StagedRows<D_TILE>{staged},",
         "StagedRows<D_TILE>{staged + raw.TILE},")
def load_tiles(d_tile: int, block_n: int, q, do, k, v, queries_valid: int, keys_valid: int, headdim: int,
               headdim_v: int, stages: int = 2, raw_stages: int = 1) -> np.ndarray:
    """Shared memory after both splits: Q and dO by 256 threads, one key block's K (natural and
    transposed) and V by the producer's 128 into stage STAGE_INDEX; every other word 0xFFFFFFFF."""
    layout = ws_smem(d_tile, block_n, stages, raw_stages, STAGE_INDEX)
    smem = np.full(layout["BYTES"] // 4, 0xFFFFFFFF, np.uint32)
    for tile, valid, hd, x in (("Q", queries_valid, headdim, q), ("DO", queries_valid, headdim_v, do)):
        split_tf32_panels(3, smem, smem, layout[tile + "_HI"], layout[tile + "_LO"], BLOCK_M, d_tile, 256, x, valid, hd)
    split_key_block(smem, layout["K_HI"], d_tile, block_n, 128, k, v, keys_valid, headdim, headdim_v)
    return smem


@mirrors(KERNEL,
         "Tf32RowsTimesRows<BLOCK_M, BLOCK_N, PRODUCTS>{base + L::Q_HI, base + L::Q_HI + L::Q_TILE, stage + L::K,",
         "stage + L::K + L::KV_TILE},",
         "{base + L::DO_HI, base + L::DO_HI + L::Q_TILE, stage + L::V, stage + L::V + L::KV_TILE});",
         "tf32_acc_times_tile<D_TILE, BLOCK_N / 8, PRODUCTS, SUMS_APART>(dq_acc, s, stage + L::KT,",
         "stage + L::KT + L::KV_TILE, NoTurns());")
def products(smem, d_tile: int, block_n: int, stages: int = 2, raw_stages: int = 1) -> dict:
    """S = Q K^T and dP = dO V^T from the stage's tiles, then dQ from S's accumulator (S rounded
    to float32 stands for dS) times the stage's K^T."""
    return products_at(smem, d_tile, block_n, ws_smem(d_tile, block_n, stages, raw_stages, STAGE_INDEX))


@mirrors(KERNEL,
         "const StageRing<STAGES> ring{base + L::FULL, base + L::EMPTY};",
         "ring.wait_empty(i);", "ring.arrive_full(i);", "ring.wait_full(i);", "ring.arrive_empty(i);",
         "q_row[h] = m0 + 16 * warp + g + 8 * h;",
         "const int h = e >> 1, key = n0 + 8 * (f0 + f) + 2 * t + (e & 1), v = 4 * f + e;")
def protocol_and_positions() -> str:
    """The ring's statements are the dK/dV producer kernel's with the walk index i
    (models/flash_bwd_dkdv_tf32_wgmma_ws.py run_protocol checks that protocol), and the element
    step's (row, key) of each value is flash_bwd_dq_tf32_wgmma's (models/flash_bwd_dq_tf32_wgmma.py
    element_positions), warp being the consumer warpgroup's own."""
    return KERNEL


@mirrors(KERNEL,
         "for (int i = consumer; i < n_blocks; i += CONSUMERS) {",
         "for (int i = 0; i < n_blocks; ++i) {",
         "named_barrier_sync(2, 256);",
         "if (consumer == 1) return;")
def run_protocol_consumers(iters: int, stages: int, consumers: int, choose) -> list:
    """The producer's loop and each consumer's (consumer c: blocks c, c + consumers, ...), one
    thread each, stepped as choose(options) picks among the sides whose next wait succeeds, on
    the StageRing barriers: models/flash_bwd_dkdv_tf32_wgmma_ws.py's run_ring (PTX's parity rule).
    A write over a block no consumer has finished, a read of a stage not holding the block, or a
    state where nobody can move before all are through, raises. Returns ("write" | "read", block)
    events. The hand-over after the loops is not modelled here (a read is one event, not a
    duration): its safety rests on the first named barrier, which both consumers reach only after
    their last products were waited for, and on the producer writing no stage past the last block."""
    from .flash_bwd_dkdv_tf32_wgmma_ws import run_ring

    return run_ring(iters, stages, consumers, choose)


__all__ = ["KERNEL", "BLOCK_M", "CTA_ROWS", "ws_smem", "load_tiles", "products", "run_protocol_consumers"]
