"""Model of kernels_cu/flash_fwd_split_kv_tf32.cu and of what flash_fwd_tf32_wgmma_ws's PRESPLIT
producer does with its output (perf log tf32-fwd-split-once): every key block of every sequence and
kv head split into Tf32FwdKeyBlockTiles (K hi, K lo, V^T hi, V^T lo: the producer's stage) in a
1024-aligned shared buffer and copied out word for word to its place in the kv_split image
(kv_fwd_image_offset); the producer copies a block's bytes from there into a stage, where the
consumers' products read them as when the producer split the block itself.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .wgmma_tf32 import fwd_key_block_tiles, split_tf32_panels, split_tf32_panels_transposed
from .wgmma_tf32_bwd_steps import image_block, split_key_blocks_into_image

KERNEL = "flash_fwd_split_kv_tf32"
WS_KERNEL = "flash_fwd_tf32_wgmma_ws"
STEPS = "wgmma_tf32_fwd_steps.cuh"
NTHREADS = 128


@mirrors(STEPS,
         "split_tf32_panels<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(tiles + T::K_HI, tiles + T::K_LO, k, keys_valid, headdim,",
         "split_tf32_panels_transposed<BLOCK_N, D_TILE, NTHREADS, PRODUCTS, true>(tiles + T::V_HI, tiles + T::V_LO, v,")
def split_key_block_fwd(smem, tiles: int, d_tile: int, block_n: int, threads: int, k, v, keys_valid: int,
                        headdim: int, headdim_v: int) -> None:
    """split_key_block_fwd_tf32 into the words of ``smem`` from byte ``tiles``: K natural, V
    transposed in KEY_PAIRS order (models/wgmma_tf32.py's splits, three products)."""
    t = fwd_key_block_tiles(d_tile, block_n)
    split_tf32_panels(3, smem, smem, tiles + t["K_HI"], tiles + t["K_LO"], block_n, d_tile, threads, k, keys_valid,
                      headdim)
    split_tf32_panels_transposed(3, smem, smem, tiles + t["V_HI"], tiles + t["V_LO"], block_n, d_tile, threads, v,
                                 keys_valid, headdim_v, key_pairs=True)


@mirrors(STEPS,
         "return image_block<PACKED, BLOCK_N>(seq, seq.k_begin, p.seqlen_k, p.nheads_kv, head_kv, j) *",
         "Tf32FwdKeyBlockTiles<D_TILE, BLOCK_N>::BYTES;")
def kv_fwd_image_offset(packed: bool, d_tile: int, block_n: int, nheads_kv: int, seqlen_k: int, index: int,
                        batch: int, k_begin: int, head_kv: int, j: int) -> int:
    """Where key block j of a sequence's kv head lies in the forward's kv_split image, in bytes."""
    return (image_block(packed, block_n, index, batch, k_begin, seqlen_k, nheads_kv, head_kv, j)
            * fwd_key_block_tiles(d_tile, block_n)["BYTES"])


@mirrors(KERNEL,
         "const u32 tiles = aligned_dynamic_smem<Tiles::BYTES>(smem_raw);",
         "const int j = blockIdx.x, n0 = j * BLOCK_N, head_kv = blockIdx.y;",
         "if (PACKED && n0 >= seq.seqlen_k) return;",
         "split_key_block_fwd_tf32<D_TILE, BLOCK_N, 128, PRODUCTS>(tiles, k, v, rows, p.headdim, p.headdim_v,",
         "return kv_fwd_image_offset<PACKED, D_TILE, BLOCK_N>(p, seq, head_kv, j);",
         "store_image_block<Tiles::BYTES, 128>(tiles, image + offset(seq, head_kv, j), threadIdx.x);")
def write_image(d_tile: int, block_n: int, k, v, headdim: int, headdim_v: int, cu_seqlens_k=None,
                image_bytes: int = 0) -> np.ndarray:
    """The forward's kv_split image (uint32 words, 0xFFFFFFFF where no CTA wrote) after every CTA of
    the grid ran. k, v: (batch, seqlen_k, nheads_kv, dim) float32; a packed batch is batch 1 with
    cu_seqlens_k."""
    nheads_kv, seqlen_k = k.shape[2], k.shape[1]
    return split_key_blocks_into_image(
        block_n, fwd_key_block_tiles(d_tile, block_n)["BYTES"], k, v, cu_seqlens_k, image_bytes,
        lambda smem, kb, vb, keys: split_key_block_fwd(smem, 0, d_tile, block_n, NTHREADS, kb, vb, keys, headdim,
                                                       headdim_v),
        lambda packed, index, batch, begin, head_kv, j: kv_fwd_image_offset(packed, d_tile, block_n, nheads_kv,
                                                                            seqlen_k, index, batch, begin, head_kv, j))


@mirrors(WS_KERNEL,
         "ring.init(PRESPLIT ? 1 : 128, 256);",
         "const i64 block = kv_fwd_image_offset<Mask::PACKED, D_TILE, BLOCK_N>(p, seq, head_kv, j);",
         "mbarrier_arrive_expect_tx(ring.full_barrier(i), L::STAGE);",
         "cp_async_bulk_to_shared(base + (i % STAGES) * L::STAGE, image + block, L::STAGE, ring.full_barrier(i));",
         "split_key_block_fwd_tf32<D_TILE, BLOCK_N, 128, PRODUCTS>(stage, StagedRows<D_TILE>{raw},",
         "StagedRows<D_TILE>{raw + raw_stages.TILE},")
def copy_into_stage(smem: np.ndarray, stage: int, image: np.ndarray, block: int, d_tile: int, block_n: int) -> None:
    """The PRESPLIT producer's copy of the image's block at byte ``block`` into the stage at byte
    ``stage``: Tf32FwdKeyBlockTiles' BYTES as they are (the stage's full barrier, count 1, completes
    with the bytes); without PRESPLIT the producer splits its staged raw rows into the stage with
    the same helper."""
    n = fwd_key_block_tiles(d_tile, block_n)["BYTES"] // 4
    smem[stage // 4: stage // 4 + n] = image[block // 4: block // 4 + n]


__all__ = ["KERNEL", "WS_KERNEL", "split_key_block_fwd", "kv_fwd_image_offset", "write_image", "copy_into_stage"]
