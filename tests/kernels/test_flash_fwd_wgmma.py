"""flash_fwd_wgmma (models/flash_fwd_wgmma.py): its mirrors are the kernel's statements, every
operand a product reads is the intended slice of Q, K or V, the model rejects plausible layout
mistakes, and one CTA emulated product by product is O = f(Q K^T) V."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.kernels import mma_fwd
from models.blocks import assert_float64_close, seeded_rng
from models.flash_fwd_wgmma import (FWD, FWD_BLOCK_M, FWD_CONFIGS, fwd_emulated, fwd_pv_steps, fwd_s_steps,
                                    fwd_smem, fwd_tiles)
from models.mirrors import missing_statements, unmirrored_statements
from models.smem import new_smem, store_panels
from models.wgmma import K_MAJOR, MN_MAJOR, assert_operand, cp_async_panels, operand, smem_desc


@pytest.mark.parametrize("source", [FWD])
def test_mirrors_match_the_kernel_sources(source):
    """Every C++ statement a mirror names is in the source (whitespace aside), and every layout
    statement of the kernel is mirrored: an edit there fails here until the mirror follows."""
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"
    unmirrored = unmirrored_statements(source)
    assert not unmirrored, f"layout statements of {source} without a mirror here: {unmirrored}"


@pytest.mark.parametrize("d_tile, block_m, block_n", FWD_CONFIGS)
def test_fwd_operands_are_q_k_and_v_slices(d_tile, block_m, block_n):
    L = fwd_smem(d_tile, block_m, block_n)
    rng = seeded_rng(3, d_tile, block_n)
    smem = new_smem()
    q = rng.standard_normal((L.BLOCK_M, d_tile))
    cp_async_panels(smem, fwd_tiles(L, 0).q, L.BLOCK_M, d_tile, L.NTHREADS, q, L.BLOCK_M, d_tile)
    for j in range(3):  # K stages 0, 1 and V stages 0, 1, 2
        tiles = fwd_tiles(L, j)
        k, v = rng.standard_normal((2, block_n, d_tile))
        cp_async_panels(smem, tiles.k, block_n, d_tile, L.NTHREADS, k, block_n, d_tile)
        cp_async_panels(smem, tiles.v, block_n, d_tile, L.NTHREADS, v, block_n, d_tile)
        for wg in range(L.NWG):  # S = Q K^T: A = Q rows 64 wg.., B = K (rows: the BLOCK_N keys)
            for kk, step in enumerate(fwd_s_steps(L, tiles, wg)):
                assert_operand(smem, step.a, step.trans_a, 64, q[64 * wg: 64 * wg + 64, 16 * kk: 16 * kk + 16])
                assert_operand(smem, step.b, step.trans_b, block_n, k[:, 16 * kk: 16 * kk + 16])
        for kk, step in enumerate(fwd_pv_steps(L, tiles)):  # O += P V: B[key][d] = V, rows: the D_TILE dims
            assert_operand(smem, step.b, step.trans_b, d_tile, v[16 * kk: 16 * kk + 16].T)


def _store_rows_unswizzled(smem, tile: int, values: np.ndarray) -> None:
    """Panels of plain 128-byte rows: panel_offset without the XOR."""
    rows, cols = values.shape
    flat = np.concatenate([values[:, 64 * p: 64 * p + 64].ravel() for p in range(cols // 64)])
    smem[tile // 2: tile // 2 + flat.size] = flat


def _fwd_operands_survive(base_shift=0, lbo_sbo_swapped=False, k_step_bytes=32, swizzle=True) -> bool:
    """Whether the forward's Q (K-major) and V (MN-major) operands still come out right after a
    deliberate layout mistake (d128, 128-key blocks)."""
    L = fwd_smem(128, FWD_BLOCK_M, 128)
    q, v = seeded_rng(6).standard_normal((2, 128, 128))
    smem = new_smem()
    tiles = fwd_tiles(L, 0)
    q_tile, v_tile = tiles.q + base_shift, tiles.v + base_shift
    store = store_panels if swizzle else _store_rows_unswizzled
    store(smem, q_tile, q)
    store(smem, v_tile, v)
    lbo, sbo = (1024, L.KV_PANEL) if lbo_sbo_swapped else (L.KV_PANEL, 1024)
    ok = True
    for kk in range(8):
        desc_q = smem_desc(q_tile + (kk // 4) * L.Q_PANEL + (kk % 4) * k_step_bytes, 16, 1024)
        ok &= np.array_equal(operand(smem, desc_q, K_MAJOR, 64), q[:64, 16 * kk: 16 * kk + 16])
        desc_v = smem_desc(v_tile + kk * 2048, lbo, sbo)
        ok &= np.array_equal(operand(smem, desc_v, MN_MAJOR, 128), v[16 * kk: 16 * kk + 16].T)
    return ok


@pytest.mark.parametrize("mistake", [dict(), dict(base_shift=128), dict(base_shift=512), dict(base_shift=16),
                                     dict(lbo_sbo_swapped=True), dict(k_step_bytes=16), dict(swizzle=False)],
                         ids=["none", "base+128", "base+512", "base+16", "lbo-sbo-swapped", "k-step-16B", "no-xor"])
def test_model_rejects_plausible_layout_mistakes(mistake):
    """The model has teeth: an unaligned tile, LBO and SBO swapped, a wrong k-step advance or a
    tile stored without the XOR all change the operands (the unmodified layout passes)."""
    assert _fwd_operands_survive(**mistake) == (not mistake)


@pytest.mark.parametrize("d_tile, block_m, block_n", FWD_CONFIGS)
def test_fwd_block_emulation_matches_numpy(d_tile, block_m, block_n):
    """Four key blocks (every K and V stage, a V stage reused), the last one partial, with Q rows
    and head dimension short of the tile (zero fill): O = f(Q K^T) V for an elementwise f."""
    L = fwd_smem(d_tile, block_m, block_n)
    rng = seeded_rng(7, d_tile, block_n)
    headdim, seqlen_q, seqlen_k = d_tile - 8, L.BLOCK_M - 3, 4 * block_n - 5
    q, k, v = (rng.standard_normal((n, headdim)) / headdim ** 0.25 for n in (seqlen_q, seqlen_k, seqlen_k))
    o = fwd_emulated(q, k, v, L, headdim, np.tanh)
    want = np.zeros((L.BLOCK_M, d_tile))
    want[:seqlen_q, :headdim] = np.tanh(q @ k.T) @ v
    assert_float64_close(o, want)


@pytest.mark.parametrize("d_tile, dv_tile, block_n", [(256, 128, 64), (256, 64, 64), (128, 64, 128), (128, 64, 64)])
def test_fwd_block_emulation_with_v_in_a_narrower_tile(d_tile, dv_tile, block_n):
    """v's own head dim in its own tile (DV_TILE < D_TILE: MLA's 192 / 128 at 256 / 128): S over
    the D_TILE columns of Q and K, O over DV_TILE, V stages of V_TILE bytes after the K stages."""
    L = fwd_smem(d_tile, FWD_BLOCK_M, block_n, dv_tile)
    assert L.BYTES + 1024 == mma_fwd.wgmma_smem_bytes(d_tile, mma_fwd.WgmmaFwdConfig(FWD_BLOCK_M, block_n),
                                                      dv_tile) <= 227 * 1024
    assert all(x % 1024 == 0 for x in (L.V, L.V_TILE))
    rng = seeded_rng(8, d_tile, dv_tile, block_n)
    headdim, headdim_v, seqlen_q, seqlen_k = d_tile - 64, dv_tile - 8, L.BLOCK_M - 3, 4 * block_n - 5
    q, k = (rng.standard_normal((n, headdim)) / headdim ** 0.25 for n in (seqlen_q, seqlen_k))
    v = rng.standard_normal((seqlen_k, headdim_v))
    o = fwd_emulated(q, k, v, L, headdim, np.tanh, headdim_v)
    want = np.zeros((L.BLOCK_M, dv_tile))
    want[:seqlen_q, :headdim_v] = np.tanh(q @ k.T) @ v
    assert_float64_close(o, want)

