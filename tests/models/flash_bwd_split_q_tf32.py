"""Model of kernels_cu/flash_bwd_split_q_tf32.cu and of what flash_bwd_dkdv_tf32_wgmma_ws's PRESPLIT
producer does with its output (perf log tf32-split-once-dkdv): every query block of every sequence
and query head split into Tf32QueryBlockTiles, its rows' statistics beside the tiles, in a
1024-aligned shared buffer, and copied out byte for byte to its place in the q_split image
(q_image_offset); the dK/dV kernel's producer copies a block's bytes from there into a stage, whose
products and element step read them as when the producer split the block itself.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .wgmma_tf32_bwd_steps import (STAT_SLOTS, q_image_offset, query_block_tiles, split_grid, split_query_block,
                                   store_image_block)

KERNEL = "flash_bwd_split_q_tf32"
DKDV_KERNEL = "flash_bwd_dkdv_tf32_wgmma_ws"
NTHREADS = 128


@mirrors(KERNEL,
         "const u32 base = aligned_dynamic_smem<T::BYTES>(smem_raw);",
         "const int i = blockIdx.x, m0 = i * BLOCK_M, head = blockIdx.y;",
         "if (PACKED && m0 >= seq.seqlen_q) return;",
         "split_query_block_tf32<D_TILE, BLOCK_M, 128, PRODUCTS>(base, q, dout, seq.seqlen_q - m0, p.headdim, p.headdim_v,",
         "query_row_stats<BLOCK_M>(smem_f + T::STATS / 4, p, seq.stat(p, head, valid ? m0 + threadIdx.x : 0), valid,",
         "store_image_block<T::BYTES, 128>(base, image + q_image_offset<PACKED, D_TILE, BLOCK_M>(p, seq, head, i),",
         "threadIdx.x);")
def write_image(d_tile: int, block_m: int, q, dout, stats, headdim: int, headdim_v: int, cu_seqlens_q=None,
                image_bytes: int = 0) -> np.ndarray:
    """The q_split image (uint32 words, 0xFFFFFFFF where no CTA wrote) after every CTA of the grid
    ran. q, dout: (batch, seqlen_q, nheads, dim) float32 (a packed batch: batch 1 with
    cu_seqlens_q); stats: (STAT_SLOTS, batch, nheads, seqlen_q) float32, the call's lse, D,
    weight and dp_ref buffers as the kernels index them (seq.stat)."""
    batch, seqlen_q, nheads = q.shape[:3]
    tiles = query_block_tiles(d_tile, block_m)
    image = np.full(image_bytes // 4, 0xFFFFFFFF, np.uint32)
    for packed, index, batch_of, q_begin, length, head, i, rows in split_grid(batch, seqlen_q, nheads, block_m,
                                                                              cu_seqlens_q):
        smem = np.full(tiles["BYTES"] // 4, 0xFFFFFFFF, np.uint32)
        qb, ob = (np.zeros((block_m, x.shape[3]), np.float32) for x in (q, dout))
        qb[: rows.stop - rows.start] = q[batch_of, rows, head]
        ob[: rows.stop - rows.start] = dout[batch_of, rows, head]
        st = np.zeros((STAT_SLOTS, block_m), np.float32)
        st[:, : rows.stop - rows.start] = stats[:, batch_of, head, rows]
        split_query_block(smem, 0, d_tile, block_m, NTHREADS, qb, ob, length - i * block_m, headdim, headdim_v, st)
        at = q_image_offset(packed, d_tile, block_m, nheads, seqlen_q, index, batch_of, q_begin, head, i)
        store_image_block(image, at, smem, 0, smem.size * 4)
    return image


@mirrors(DKDV_KERNEL,
         "ring.init(PRESPLIT ? 1 : 128, 128);",
         "const i64 block = q_image_offset<Mask::PACKED, D_TILE, BLOCK_M>(p, seq, walk.head(head_kv, it),",
         "walk.block(it));",
         "mbarrier_arrive_expect_tx(ring.full_barrier(it), L::Tiles::BYTES);",
         "cp_async_bulk_to_shared(base + stage_of(it), image + block, L::Tiles::BYTES, ring.full_barrier(it));",
         "split_query_block_tf32<D_TILE, BLOCK_M, 128, PRODUCTS>(stage, StagedRows<D_TILE>{staged},",
         "StagedRows<D_TILE>{staged + raw.TILE},",
         "query_row_stats<BLOCK_M>(smem_f + (stage_of(it) + L::STATS) / 4, p,",
         "seq.stat(p, head, valid ? m0 + wg_tid : 0), valid, wg_tid);")
def copy_into_stage(smem: np.ndarray, stage: int, image: np.ndarray, block: int, d_tile: int, block_m: int) -> None:
    """The PRESPLIT producer's copy of the image's block at byte ``block`` into the stage at byte
    ``stage``: Tf32QueryBlockTiles' BYTES (tiles and statistics) as they are, its barrier of count 1
    completing once they have landed. Without PRESPLIT the producer forms the same bytes itself
    (split_query_block_tf32 and query_row_stats: the statements above)."""
    n = query_block_tiles(d_tile, block_m)["BYTES"] // 4
    smem[stage // 4: stage // 4 + n] = image[block // 4: block // 4 + n]


__all__ = ["KERNEL", "write_image", "copy_into_stage"]
