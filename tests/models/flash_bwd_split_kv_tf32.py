"""Model of kernels_cu/flash_bwd_split_kv_tf32.cu and of what flash_bwd_dq_tf32_wgmma_ws's PRESPLIT
producer does with its output (perf log tf32-split-once): every key block of every sequence and kv
head split into Tf32KeyBlockTiles in a 1024-aligned shared buffer and copied out byte for byte to
its place in the kv_split image (kv_image_offset); the dQ kernel's producer copies a block's bytes
from there into a stage, where the consumer's products read them through the same descriptors as
when the producer split the block itself.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .wgmma_tf32_bwd_steps import key_block_tiles, kv_image_offset, split_key_block, split_key_blocks_into_image

KERNEL = "flash_bwd_split_kv_tf32"
DQ_KERNEL = "flash_bwd_dq_tf32_wgmma_ws"
NTHREADS = 128


@mirrors(KERNEL,
         "const u32 tiles = aligned_dynamic_smem<Tiles::BYTES>(smem_raw);",
         "const int j = blockIdx.x, n0 = j * BLOCK_N, head_kv = blockIdx.y;",
         "if (PACKED && n0 >= seq.seqlen_k) return;",
         "split_key_block_tf32<D_TILE, BLOCK_N, 128, PRODUCTS>(tiles, k, v, rows, p.headdim, p.headdim_v,",
         "return kv_image_offset<PACKED, D_TILE, BLOCK_N>(p, seq, head_kv, j);",
         "store_image_block<Tiles::BYTES, 128>(tiles, image + offset(seq, head_kv, j), threadIdx.x);")
def write_image(d_tile: int, block_n: int, k, v, headdim: int, headdim_v: int, cu_seqlens_k=None,
                image_bytes: int | None = None) -> np.ndarray:
    """The kv_split image (uint32 words, 0xFFFFFFFF where no CTA wrote) after every CTA of the grid
    (ceil(seqlen_k / block_n) or the longest sequence's blocks, kv heads, batch or sequences) ran.
    k, v: (batch, seqlen_k, nheads_kv, dim) float32; a packed batch is batch 1 with cu_seqlens_k."""
    nheads_kv, seqlen_k = k.shape[2], k.shape[1]
    return split_key_blocks_into_image(
        block_n, key_block_tiles(d_tile, block_n)["BYTES"], k, v, cu_seqlens_k, image_bytes or 0,
        lambda smem, kb, vb, keys: split_key_block(smem, 0, d_tile, block_n, NTHREADS, kb, vb, keys, headdim, headdim_v),
        lambda packed, index, batch, begin, head_kv, j: kv_image_offset(packed, d_tile, block_n, nheads_kv, seqlen_k,
                                                                        index, batch, begin, head_kv, j))


@mirrors(DQ_KERNEL,
         "ring.init(PRESPLIT ? 1 : 128, 128);",
         "const i64 block = kv_image_offset<Mask::PACKED, D_TILE, BLOCK_N>(p, seq, head_kv, j_begin + i);",
         "mbarrier_arrive_expect_tx(ring.full_barrier(i), L::Tiles::BYTES);",
         "cp_async_bulk_to_shared(base + stage_of(i), image + block, L::Tiles::BYTES, ring.full_barrier(i));")
def copy_into_stage(smem: np.ndarray, stage: int, image: np.ndarray, block: int, d_tile: int, block_n: int) -> None:
    """The PRESPLIT producer's copy of the image's block at byte ``block`` into the stage at byte
    ``stage`` of the dQ kernel's shared memory: Tf32KeyBlockTiles' BYTES as they are. Its barrier
    (count 1: the one thread's arrival, which also expects the bytes) completes once they have
    landed; the ring's protocol is otherwise StageRing's (models/flash_bwd_dkdv_tf32_wgmma_ws.py
    run_ring), one producer thread instead of 128 arriving threads."""
    n = key_block_tiles(d_tile, block_n)["BYTES"] // 4
    smem[stage // 4: stage // 4 + n] = image[block // 4: block // 4 + n]


__all__ = ["KERNEL", "write_image", "copy_into_stage"]
