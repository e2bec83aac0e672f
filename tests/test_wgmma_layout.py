"""NumPy model of the Hopper wgmma kernels' shared-memory layout and descriptors (CPU, no GPU).

What the tensor cores read is written down once, from the PTX ISA ("Matrix Descriptor Format" of
wgmma, the canonical 128-byte-swizzle layouts of "Shared Memory Matrix Layout", and the register
fragments of wgmma .m64nNk16): decode_descriptor, swizzle_128b, operand_addresses / operand and
wgmma. The index math of kernels_cu/wgmma.cuh (panel_offset, smem_desc, cp_async_panels) and of
flash_fwd_wgmma.cu, flash_bwd_wgmma.cu, flash_bwd_wgmma_dsplit.cu and flash_bwd_dq_wgmma.cu (tile
offsets and stages, descriptor start / LBO / SBO per k-step, accumulator repacking, fragment
stores) is mirrored in Python and checked against it: every operand a product reads must be the
intended slice of a logical tile, and one block of each kernel, emulated product by product in
float64, must reproduce plain matmuls. A layout bug then fails here as an O(1) mismatch instead
of on an H200.

Each mirror names the C++ statements it copies (@mirrors); test_mirrors_match_the_kernel_sources
checks that they are still in the sources and that no layout statement of the wgmma code is left
unmirrored, so an edit of that arithmetic fails here until the mirror (and with it these checks)
follows it.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
from launch_fakes import FakeArray

from cupyflash import masks, reference

KERNELS_CU = Path(__file__).resolve().parent.parent / "kernels_cu"

# One warpgroup: thread t of the group is lane t % 32 of its warp t // 32.
THREADS = np.arange(128)
WARP_IN_WG = THREADS // 32
LANE = THREADS % 32
GROUP = LANE // 4  # g: row of a lane's fragment elements within its 8-row half
THREAD_IN_GROUP = LANE % 4  # t: column pair of a lane's fragment elements
ROW_LO = 16 * WARP_IN_WG + GROUP  # rows of a thread's accumulator / A-fragment elements: ROW_LO, ROW_LO + 8

SMEM_WINDOW = 1 << 18  # bytes of shared window that smem_desc keeps (addr & 0x3FFFF)
RAW_SMEM = 400  # where dynamic shared memory starts: any value; the kernels align up to 1024

K_MAJOR, MN_MAJOR = "K-major", "MN-major"

# ---------------------------------------------------------------------------------------------
# Mirror registry: the C++ statements each Python mirror copies (checked against the sources)
# ---------------------------------------------------------------------------------------------

MIRRORED: list[tuple[str, str, str]] = []  # (file in kernels_cu, C++ statement, mirror's name)


def mirrors(source: str, *statements: str):
    def register(obj):
        MIRRORED.extend((source, s, obj.__name__) for s in statements)
        return obj
    return register


# ---------------------------------------------------------------------------------------------
# PTX semantics (ground truth)
# ---------------------------------------------------------------------------------------------

class Descriptor(NamedTuple):
    start: int  # byte address of the matrix's first element (before the swizzle)
    lbo: int  # leading dimension byte offset
    sbo: int  # stride dimension byte offset
    base_offset: int
    swizzle: int  # 0: none, 1: 128-byte, 2: 64-byte, 3: 32-byte


SWIZZLE_128B = 1
_DESCRIPTOR_FIELDS = ((0, 14), (16, 14), (32, 14), (49, 3), (62, 2))  # (lowest bit, width)


def decode_descriptor(desc: int) -> Descriptor:
    """The 64-bit wgmma shared-memory matrix descriptor: start address bits 0-13, LBO bits 16-29,
    SBO bits 32-45 (all three in 16-byte units), base offset bits 49-51, swizzle mode bits 62-63;
    every other bit is reserved (0)."""
    desc = int(desc)
    assert 0 <= desc < 1 << 64
    used = sum(((1 << width) - 1) << lo for lo, width in _DESCRIPTOR_FIELDS)
    assert desc & ~used == 0, f"reserved descriptor bits set: {desc & ~used:#x}"
    start, lbo, sbo, base_offset, swizzle = (desc >> lo & ((1 << width) - 1) for lo, width in _DESCRIPTOR_FIELDS)
    return Descriptor(start << 4, lbo << 4, sbo << 4, base_offset, swizzle)


def swizzle_128b(addr):
    """The 128-byte swizzle on a final byte address: the 16-byte chunk within a 128-byte row
    (bits 4-6) is XORed with the row's index within its 1024-byte pattern (bits 7-9). The
    pattern repeats at 1024-byte boundaries of the address, hence the kernels' aligned base."""
    return addr ^ (((addr >> 7) & 7) << 4)


def operand_addresses(desc: int, major: str, rows: int) -> np.ndarray:
    """Byte address of element (row, k) of a rows x 16 operand (16-bit elements, one k-step)
    described by `desc`, 128-byte swizzle. Rows are M for A and N for B (B[k][n] = element (n, k)).

    K-major (k contiguous): 8-row core groups of 128-byte rows, groups SBO apart; the 16 k of a
    row are 32 contiguous bytes (LBO is unused with this swizzle).
    MN-major (rows contiguous): 64-row atoms of 128 bytes, atoms LBO apart; k rows 128 bytes
    apart within an 8-k group, groups SBO apart."""
    d = decode_descriptor(desc)
    assert d.swizzle == SWIZZLE_128B and d.base_offset == 0
    r = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    if major == K_MAJOR:
        addr = d.start + (r % 8) * 128 + (r // 8) * d.sbo + 2 * k
    else:
        assert major == MN_MAJOR
        addr = d.start + (r % 64) * 2 + (r // 64) * d.lbo + (k % 8) * 128 + (k // 8) * d.sbo
    return swizzle_128b(addr)


def operand(smem: np.ndarray, desc: int, major: str, rows: int) -> np.ndarray:
    """The rows x 16 matrix the tensor cores read through `desc` (smem: one slot per 2 bytes)."""
    return smem[operand_addresses(desc, major, rows) // 2]


def acc_to_matrix(d: np.ndarray) -> np.ndarray:
    """The 64 x N matrix held by a warpgroup's accumulators d[thread, j, e]: warp w holds rows
    16w..16w+15 as the m16n8 C fragments of column blocks j (e: (g, 2t), (g, 2t+1), (g+8, 2t),
    (g+8, 2t+1))."""
    m = np.full((64, 8 * d.shape[1]), np.nan)
    cols = 8 * np.arange(d.shape[1])[None, :] + 2 * THREAD_IN_GROUP[:, None]
    rows = ROW_LO[:, None]
    for e in range(4):
        m[rows + 8 * (e >> 1), cols + (e & 1)] = d[:, :, e]
    assert not np.isnan(m).any()
    return m


def acc_from_matrix(m: np.ndarray) -> np.ndarray:
    cols = 8 * np.arange(m.shape[1] // 8)[None, :] + 2 * THREAD_IN_GROUP[:, None]
    rows = ROW_LO[:, None]
    return np.stack([m[rows + 8 * (e >> 1), cols + (e & 1)] for e in range(4)], axis=2)


def a_fragment_matrix(a: np.ndarray) -> np.ndarray:
    """The 64 x 16 A operand of wgmma held in registers a[thread, reg, half] (half 0: low 16
    bits): warp w's rows 16w.. as the m16n8k16 A fragment, reg 0 (g, 2t), 1 (g+8, 2t),
    2 (g, 2t+8), 3 (g+8, 2t+8), each with columns +0 and +1 in its halves."""
    m = np.full((64, 16), np.nan)
    for reg in range(4):
        for half in range(2):
            m[ROW_LO + 8 * (reg & 1), 2 * THREAD_IN_GROUP + 8 * (reg >> 1) + half] = a[:, reg, half]
    assert not np.isnan(m).any()
    return m


class Step(NamedTuple):
    """One wgmma k-step: descriptors and TRANS flags (1: MN-major) as a kernel passes them;
    a is None where A comes from registers."""
    a: int | None
    trans_a: int | None
    b: int
    trans_b: int


def major(trans: int) -> str:
    return MN_MAJOR if trans else K_MAJOR


def wgmma(d: np.ndarray, smem: np.ndarray, step: Step, accumulate: bool, a_regs=None) -> None:
    """wgmma.mma_async m64nNk16 (N = 8 d.shape[1]): D = A B (+ D where scale-d is set)."""
    n = 8 * d.shape[1]
    a = a_fragment_matrix(a_regs) if step.a is None else operand(smem, step.a, major(step.trans_a), 64)
    b = operand(smem, step.b, major(step.trans_b), n).T  # 16 x N
    d[...] = (d if accumulate else 0.0) + acc_from_matrix(a @ b)


def bank_conflict_free(byte_addrs, width: int) -> bool:
    """Whether one wavefront of accesses of `width` bytes (32 lanes of b32, 8 lanes of 16 bytes)
    touches each of the 32 four-byte banks at most once."""
    banks = [(int(a) // 4 + w) % 32 for a in byte_addrs for w in range(width // 4)]
    return len(set(banks)) == len(banks)


# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/wgmma.cuh and of the small helpers the kernels use
# ---------------------------------------------------------------------------------------------

@mirrors("wgmma.cuh",
         "return static_cast<u32>((chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));")
def panel_offset(rows: int, row, chunk):
    return (chunk >> 3) * (rows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4)


@mirrors("wgmma.cuh",
         "return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(lbo_bytes >> 4) << 16) |"
         " (static_cast<u64>(sbo_bytes >> 4) << 32) | (1ull << 62);")
def smem_desc(addr: int, lbo_bytes: int, sbo_bytes: int) -> int:
    return ((addr & 0x3FFFF) >> 4) | ((lbo_bytes >> 4) << 16) | ((sbo_bytes >> 4) << 32) | (1 << 62)


@mirrors("wgmma.cuh",
         "constexpr int CHUNKS = DIM / 8;",
         "constexpr int ROW_STEP = NTHREADS / CHUNKS;",
         "const int row0 = thread / CHUNKS, chunk = thread % CHUNKS;",
         "const int rows_left = chunk * 8 < headdim ? rows_valid - row0 : 0;",
         "const T* src = gmem + row0 * stride + chunk * 8;",
         "const i64 src_step = ROW_STEP * stride;",
         "const u32 dst0 = smem_tile + panel_offset<ROWS>(row0, chunk);",
         "const bool valid = i * ROW_STEP < rows_left;",
         "cp_async_16(dst0 + i * ROW_STEP * 128, valid ? src : gmem, valid);")
def cp_async_panels(smem, smem_tile: int, rows: int, dim: int, nthreads: int, gmem: np.ndarray,
                    rows_valid: int, headdim: int, log=None) -> None:
    """Every thread's cp.async copies; gmem[r] is global row r of the tile (headdim columns).
    Invalid copies zero-fill (src-size 0). `log` (optional) collects (thread, dst, i) per copy."""
    chunks = dim // 8
    row_step = nthreads // chunks
    assert nthreads % chunks == 0 and rows % row_step == 0 and row_step % 8 == 0  # the static_assert
    for thread in range(nthreads):
        row0, chunk = thread // chunks, thread % chunks
        rows_left = rows_valid - row0 if chunk * 8 < headdim else 0
        dst0 = smem_tile + panel_offset(rows, row0, chunk)
        for i in range(rows // row_step):
            dst = dst0 + i * row_step * 128
            valid = i * row_step < rows_left
            row = row0 + i * row_step
            smem[dst // 2: dst // 2 + 8] = gmem[row, 8 * chunk: 8 * chunk + 8] if valid else 0.0
            if log is not None:
                log.append((thread, dst, i))


def aligned_base(raw: int) -> int:
    return (raw + 1023) & ~1023


for _kernel in ("flash_fwd_wgmma.cu", "flash_bwd_wgmma.cu", "flash_bwd_wgmma_dsplit.cu", "flash_bwd_dq_wgmma.cu"):
    mirrors(_kernel, "const u32 base = (raw + 1023) & ~1023u;")(aligned_base)


@mirrors("mma_bwd.cuh",
         "a[kk][0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);",
         "a[kk][1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);",
         "a[kk][2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);",
         "a[kk][3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);")
def pack_a_frags(c: np.ndarray) -> np.ndarray:
    """a[thread, kk, reg, half] from accumulators c[thread, j, e] (pack2: first value low). The
    16-bit rounding is left out: the model computes in float64. online_softmax.cuh's pack_p is
    the same packing (one strip)."""
    a = np.empty((c.shape[0], c.shape[1] // 2, 4, 2))
    for kk in range(c.shape[1] // 2):
        a[:, kk, 0] = c[:, 2 * kk, 0:2]
        a[:, kk, 1] = c[:, 2 * kk, 2:4]
        a[:, kk, 2] = c[:, 2 * kk + 1, 0:2]
        a[:, kk, 3] = c[:, 2 * kk + 1, 2:4]
    return a


mirrors("online_softmax.cuh",
        "p[i][kk][0] = pack2<T>(s[i][2 * kk][0], s[i][2 * kk][1]);",
        "p[i][kk][1] = pack2<T>(s[i][2 * kk][2], s[i][2 * kk][3]);",
        "p[i][kk][2] = pack2<T>(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);",
        "p[i][kk][3] = pack2<T>(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);")(pack_a_frags)


def st_shared_b32(smem, addr: np.ndarray, pair: np.ndarray) -> None:
    smem[addr // 2] = pair[:, 0]
    smem[addr // 2 + 1] = pair[:, 1]


def ld_shared_b32(smem, addr: np.ndarray) -> np.ndarray:
    return np.stack([smem[addr // 2], smem[addr // 2 + 1]], axis=1)


@mirrors("mma_bwd.cuh", "return lse == neg_inf<float>() ? 0.f : lse * 1.4426950408889634f;")
def lse_base_log2(lse):
    return np.where(lse == -np.inf, 0.0, lse * 1.4426950408889634)


def new_smem() -> np.ndarray:
    """The shared window, one float64 slot per 16-bit element; NaN marks a slot never written."""
    return np.full(SMEM_WINDOW // 2, np.nan)


def store_panels(smem, tile: int, values: np.ndarray) -> None:
    """A logical ROWS x COLS tile stored chunk by chunk at panel_offset (what cp_async_panels and
    the fragment stores build)."""
    rows, cols = values.shape
    for r in range(rows):
        for c in range(cols // 8):
            o = (tile + panel_offset(rows, r, c)) // 2
            smem[o: o + 8] = values[r, 8 * c: 8 * c + 8]


def load_panels(smem, tile: int, rows: int, cols: int) -> np.ndarray:
    return np.array([[smem[(tile + panel_offset(rows, r, c)) // 2 + i] for c in range(cols // 8) for i in range(8)]
                     for r in range(rows)])


# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/flash_fwd_wgmma.cu
# ---------------------------------------------------------------------------------------------

FWD = "flash_fwd_wgmma.cu"


@mirrors(FWD,
         "static constexpr int K_STAGES = 2, V_STAGES = 3;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q = 0;",
         "static constexpr u32 K = Q + BLOCK_M * D_TILE * 2;",
         "static constexpr u32 V = K + K_STAGES * KV_TILE;",
         "static constexpr u32 BYTES = V + V_STAGES * KV_TILE;",
         "constexpr int NWG = BLOCK_M / 64, NTHREADS = NWG * 128;",
         "constexpr int N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;",
         "static_assert(L::BYTES + 1024 <= 227 * 1024, \"shared memory\");")
def fwd_smem(d_tile: int, block_m: int, block_n: int) -> SimpleNamespace:
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_M=block_m, BLOCK_N=block_n, K_STAGES=2, V_STAGES=3,
                        Q_PANEL=block_m * 128, KV_PANEL=block_n * 128, KV_TILE=block_n * d_tile * 2, Q=0)
    L.K = L.Q + block_m * d_tile * 2
    L.V = L.K + L.K_STAGES * L.KV_TILE
    L.BYTES = L.V + L.V_STAGES * L.KV_TILE
    L.NWG = block_m // 64
    L.NTHREADS = L.NWG * 128
    return L


@mirrors(FWD,
         "const u32 raw = smem_u32(smem_raw);",
         "const u32 q_tile = base + L::Q;",
         "const u32 k_tile = base + L::K + (j % L::K_STAGES) * L::KV_TILE;",
         "const u32 v_tile = base + L::V + (j % L::V_STAGES) * L::KV_TILE;",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::K + (j % L::K_STAGES) * L::KV_TILE,"
         " k_rows + n0 * k_ss, seqlen_k - n0, headdim, k_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::V + (j % L::V_STAGES) * L::KV_TILE,"
         " v_rows + n0 * v_ss, seqlen_k - n0, headdim, v_ss, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(q_tile, q + row_offset(batch, m0, head, q_sb, q_ss, q_sh),"
         " seqlen_q - m0, headdim, q_ss, tid);")
def fwd_tiles(L, j: int) -> SimpleNamespace:
    """Tile addresses of key block j (stages: K j % 2, V j % 3)."""
    base = aligned_base(RAW_SMEM)
    return SimpleNamespace(q=base + L.Q, k=base + L.K + (j % L.K_STAGES) * L.KV_TILE,
                           v=base + L.V + (j % L.V_STAGES) * L.KV_TILE)


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
         "Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc), p[0][kk],"
         " smem_desc(v_tile + kk * 2048, L::KV_PANEL, 1024), 1);")
def fwd_pv_steps(L, tiles) -> list[Step]:
    """O += P V: A = P from registers (k-step kk: p[kk]), B = V MN-major, k-steps over the keys."""
    return [Step(None, None, smem_desc(tiles.v + kk * 2048, L.KV_PANEL, 1024), 1) for kk in range(L.BLOCK_N // 16)]


def fwd_emulated(q, k, v, L, headdim: int, elementwise):
    """One CTA (query rows 0..BLOCK_M) over every key block: S_j = Q K_j^T, P_j = elementwise(S_j)
    on the accumulators (the softmax's row math is online_softmax.cuh's, tested in
    test_mma_layout.py), O += P_j V_j. Returns O (BLOCK_M x D_TILE)."""
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


# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/flash_bwd_wgmma.cu
# ---------------------------------------------------------------------------------------------

BWD = "flash_bwd_wgmma.cu"


@mirrors(BWD,
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;",
         "static constexpr u32 KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128;",
         "static constexpr u32 DS_PANEL = BLOCK_N * 128;",
         "static constexpr u32 K = 0;",
         "static constexpr u32 V = K + KV_TILE;",
         "static constexpr u32 Q = V + KV_TILE;",
         "static constexpr u32 DO = Q + 2 * Q_TILE;",
         "static constexpr u32 DST = DO + 2 * Q_TILE;",
         "static constexpr u32 LSE = DST + BLOCK_N * BLOCK_M * 2;",
         "static constexpr u32 DELTA = LSE + 2 * BLOCK_M * 4;",
         "static constexpr u32 STAGE_ROW = DQ_ADD == DqAdd::fixed ? DQ_STAGE_ROW"
         " : DQ_ADD == DqAdd::fixed_panels ? 512 : 0;",
         "static constexpr u32 DQ_STAGE = DELTA + 2 * BLOCK_M * 4;",
         "static constexpr u32 BYTES = DQ_STAGE + BLOCK_N / 64 * 64 * STAGE_ROW;",
         "constexpr int NWG = BLOCK_N / 64, NTHREADS = NWG * 128, NWARPS = NWG * 4;",
         "constexpr int SJ = BLOCK_M / 8;",
         "constexpr int DJ = D_TILE / 8;",
         "constexpr int QK = BLOCK_M / 16;",
         "constexpr int DQ_PANELS = (BLOCK_M / 64) * (D_TILE / 64);")
def bwd_smem(d_tile: int, block_m: int, block_n: int, dq_add: str = "atomic") -> SimpleNamespace:
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_M=block_m, BLOCK_N=block_n, KV_TILE=block_n * d_tile * 2,
                        Q_TILE=block_m * d_tile * 2, KV_PANEL=block_n * 128, Q_PANEL=block_m * 128,
                        DS_PANEL=block_n * 128, K=0)
    L.V = L.K + L.KV_TILE
    L.Q = L.V + L.KV_TILE
    L.DO = L.Q + 2 * L.Q_TILE
    L.DST = L.DO + 2 * L.Q_TILE
    L.LSE = L.DST + block_n * block_m * 2
    L.DELTA = L.LSE + 2 * block_m * 4
    L.STAGE_ROW = {"fixed": DQ_STAGE_ROW, "fixed_panels": 512}.get(dq_add, 0)
    L.DQ_STAGE = L.DELTA + 2 * block_m * 4
    L.BYTES = L.DQ_STAGE + block_n // 64 * 64 * L.STAGE_ROW
    L.NWG = block_n // 64
    L.NTHREADS = L.NWG * 128
    L.DQ_PANELS = (block_m // 64) * (d_tile // 64)
    return L


@mirrors(BWD,
         "const u32 raw = smem_u32(smem_raw);",
         "const u32 s_k = base + L::K, s_v = base + L::V, s_dst = base + L::DST;",
         "const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::Q + stage * L::Q_TILE,"
         " q + row_offset(batch, m0, head, q_sb, q_ss, q_sh), seqlen_q - m0, headdim, q_ss, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::DO + stage * L::Q_TILE,"
         " dout + row_offset(batch, m0, head, do_sb, do_ss, do_sh), seqlen_q - m0, headdim, do_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(s_k, k + row_offset(batch, n0, head_kv, k_sb, k_ss, k_sh),"
         " seqlen_k - n0, headdim, k_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(s_v, v + row_offset(batch, n0, head_kv, v_sb, v_ss, v_sh),"
         " seqlen_k - n0, headdim, v_ss, tid);")
def bwd_tiles(L, stage: int) -> SimpleNamespace:
    base = aligned_base(RAW_SMEM)
    return SimpleNamespace(k=base + L.K, v=base + L.V, dst=base + L.DST,
                           q=base + L.Q + stage * L.Q_TILE, do=base + L.DO + stage * L.Q_TILE)


@mirrors(BWD,
         "const u32 k_off = (kk / 4) * L::KV_PANEL + wg * 64 * 128 + (kk % 4) * 32;",
         "const u32 v_off = (kk / 4) * L::KV_PANEL + wg * 64 * 128 + (kk % 4) * 32;",
         "const u32 q_off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32;",
         "Wgmma<T, BLOCK_M>::template ss<0, 0>(reinterpret_cast<float(&)[SJ * 4]>(s_acc),"
         " smem_desc(s_k + k_off, 16, 1024), smem_desc(s_q + q_off, 16, 1024), kk > 0);",
         "Wgmma<T, BLOCK_M>::template ss<0, 0>(reinterpret_cast<float(&)[SJ * 4]>(dp_acc),"
         " smem_desc(s_v + v_off, 16, 1024), smem_desc(s_do + q_off, 16, 1024), kk > 0);")
def bwd_st_steps(L, key_tile: int, query_tile: int, wg: int) -> list[Step]:
    """S^T = K_g Q^T (key_tile K, query_tile Q) or dP^T = V_g dO^T (V, dO): warpgroup wg's 64 key
    rows x BLOCK_M queries, k-steps over the head dim; both operands K-major."""
    steps = []
    for kk in range(L.D_TILE // 16):
        a_off = (kk // 4) * L.KV_PANEL + wg * 64 * 128 + (kk % 4) * 32
        q_off = (kk // 4) * L.Q_PANEL + (kk % 4) * 32
        steps.append(Step(smem_desc(key_tile + a_off, 16, 1024), 0, smem_desc(query_tile + q_off, 16, 1024), 0))
    return steps


@mirrors(BWD,
         "Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[DJ * 4]>(dv_acc), p_frag[kk],"
         " smem_desc(s_do + kk * 2048, L::Q_PANEL, 1024), 1);",
         "Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[DJ * 4]>(dk_acc), ds_frag[kk],"
         " smem_desc(s_q + kk * 2048, L::Q_PANEL, 1024), 1);")
def bwd_dkdv_steps(L, query_tile: int) -> list[Step]:
    """dV_g += P^T dO (query_tile dO) or dK_g += dS^T Q (Q): A from registers, B MN-major,
    k-steps over the queries."""
    return [Step(None, None, smem_desc(query_tile + kk * 2048, L.Q_PANEL, 1024), 1) for kk in range(L.BLOCK_M // 16)]


@mirrors(BWD,
         "for (int panel = wg; panel < DQ_PANELS; panel += NWG)",
         "const int qp = panel / (D_TILE / 64), dp = panel % (D_TILE / 64);")
def bwd_dq_panels(L, wg: int) -> list[tuple[int, int]]:
    """The (query panel, head-dim panel) pairs of dQ that warpgroup wg computes."""
    return [(panel // (L.D_TILE // 64), panel % (L.D_TILE // 64)) for panel in range(wg, L.DQ_PANELS, L.NWG)]


@mirrors(BWD,
         "Wgmma<T, 64>::template ss<1, 1>(reinterpret_cast<float(&)[32]>(dq_acc),"
         " smem_desc(s_dst + qp * L::DS_PANEL + kk * 2048, L::DS_PANEL, 1024),"
         " smem_desc(s_k + dp * L::KV_PANEL + kk * 2048, L::KV_PANEL, 1024), kk > 0);")
def bwd_dq_steps(L, tiles, qp: int, dp: int) -> list[Step]:
    """dQ panel (qp, dp) = dS K_j: A = dS, the MN-major view of dS^T panel qp; B = K head-dim
    panel dp, MN-major; k-steps over the keys."""
    return [Step(smem_desc(tiles.dst + qp * L.DS_PANEL + kk * 2048, L.DS_PANEL, 1024), 1,
                 smem_desc(tiles.k + dp * L.KV_PANEL + kk * 2048, L.KV_PANEL, 1024), 1)
            for kk in range(L.BLOCK_N // 16)]


@mirrors(BWD,
         "const int key_row = 64 * wg + 16 * warp_in_wg + lane / 4;",
         "const int chunk = 2 * kk + h;",
         "st_shared_b32(s_dst + panel_offset<BLOCK_N>(key_row, chunk) + 4 * (lane % 4), ds_frag[kk][2 * h]);",
         "st_shared_b32(s_dst + panel_offset<BLOCK_N>(key_row + 8, chunk) + 4 * (lane % 4), ds_frag[kk][2 * h + 1]);")
def bwd_ds_t_stores(L, tiles, wg: int) -> list[tuple[np.ndarray, int, int]]:
    """Step 5's st.shared.b32 in issue order: (address per thread, kk, register of ds_frag[kk])."""
    key_row = 64 * wg + ROW_LO
    word = 4 * THREAD_IN_GROUP
    stores = []
    for kk in range(L.BLOCK_M // 16):
        for h in range(2):
            chunk = 2 * kk + h
            stores.append((tiles.dst + panel_offset(L.BLOCK_N, key_row, chunk) + word, kk, 2 * h))
            stores.append((tiles.dst + panel_offset(L.BLOCK_N, key_row + 8, chunk) + word, kk, 2 * h + 1))
    return stores


def _acc_columns(nj: int) -> np.ndarray:
    """Column (query) of accumulator element (j, e) of each thread: 8j + 2t + e % 2."""
    return 8 * np.arange(nj)[None, :, None] + 2 * THREAD_IN_GROUP[:, None, None] + (np.arange(4) & 1)[None, None, :]


@mirrors("flash_bwd_wgmma.cu",
         "const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + 8 * j + 2 * (lane % 4));",
         "const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};",
         "const float p = exp2_approx(fmaf(s_acc[j][e], scale_log2, -base_log2[e & 1]));")
def p_transposed(s_acc, s_lse, scale_log2):
    """Step 3 (P^T from S^T; full blocks, so no entry is hidden)."""
    return np.exp2(s_acc * scale_log2 - lse_base_log2(s_lse[_acc_columns(s_acc.shape[1])]))


@mirrors("flash_bwd_wgmma.cu",
         "const float2 d2 = *reinterpret_cast<const float2*>(s_delta + 8 * j + 2 * (lane % 4));",
         "const float p16[4] = {lo.x, lo.y, hi.x, hi.y};",
         "dp_acc[j][e] = p16[e] == 0.f ? 0.f : p16[e] * (dp_acc[j][e] - ((e & 1) ? d2.y : d2.x));")
def ds_transposed(dp_acc, p16, s_delta):
    """Step 4: dS^T = P^T o (dP^T - D), with P^T from its 16-bit copy p16[thread, j, e]."""
    return np.where(p16 == 0.0, 0.0, p16 * (dp_acc - s_delta[_acc_columns(dp_acc.shape[1])]))


@mirrors("flash_bwd_wgmma.cu",
         "const float2 lo = unpack2<T>(p_frag[j / 2][2 * (j % 2)]), hi = unpack2<T>(p_frag[j / 2][2 * (j % 2) + 1]);")
def unpack_p16(p_frag, sj: int) -> np.ndarray:
    """p16[thread, j, e] = {lo.x, lo.y, hi.x, hi.y} of column block j from the packed A fragments."""
    p16 = np.empty((128, sj, 4))
    for j in range(sj):
        lo, hi = p_frag[:, j // 2, 2 * (j % 2)], p_frag[:, j // 2, 2 * (j % 2) + 1]
        p16[:, j] = np.concatenate([lo, hi], axis=1)
    return p16


@mirrors("flash_bwd_wgmma.cu",
         "const int m_lo = m0 + 64 * qp + 16 * warp_in_wg + lane / 4, m_hi = m_lo + 8;",
         "const int col = 64 * dp + 8 * j + 2 * (lane % 4);",
         "if (m_lo < seqlen_q) red_add_f32x2(dqa + m_lo * dqa_ss + col, dq_acc[j][0], dq_acc[j][1]);",
         "if (m_hi < seqlen_q) red_add_f32x2(dqa + m_hi * dqa_ss + col, dq_acc[j][2], dq_acc[j][3]);")
def bwd_add_dq_panel(dq_accum, dq_acc, m0: int, qp: int, dp: int, headdim: int) -> None:
    m_lo = m0 + 64 * qp + ROW_LO
    for j in range(8):
        col = 64 * dp + 8 * j + 2 * THREAD_IN_GROUP
        _red_add_pairs(dq_accum, m_lo, col, dq_acc[:, j, 0:2], headdim)
        _red_add_pairs(dq_accum, m_lo + 8, col, dq_acc[:, j, 2:4], headdim)


@mirrors("dq_add.cuh", "constexpr u32 DQ_STAGE_ROW = 64 * 8 + 64;")
def _stage_row_bytes():
    return 64 * 8 + 64


DQ_STAGE_ROW = _stage_row_bytes()


@mirrors(BWD,
         "const u32 s_stage = base + L::DQ_STAGE + wg * 64 * DQ_STAGE_ROW;",
         "const int r_lo = 16 * warp_in_wg + lane / 4;",
         "const u32 at = s_stage + r_lo * DQ_STAGE_ROW + 64 * j + 16 * (lane % 4);",
         "st_shared_v2_b64(at, to_fixed(dq_acc[j][0], scale_lo, dq_limit, bad_lo),"
         " to_fixed(dq_acc[j][1], scale_lo, dq_limit, bad_lo));",
         "st_shared_v2_b64(at + 8 * DQ_STAGE_ROW, to_fixed(dq_acc[j][2], scale_hi, dq_limit, bad_hi),"
         " to_fixed(dq_acc[j][3], scale_hi, dq_limit, bad_hi));",
         "if (lane < 16) bulk_wait_read_all();",
         "if (lane < 16) {",
         "const int row = 16 * warp_in_wg + lane, m = m0 + 64 * qp + row;",
         "bulk_reduce_add_s64(static_cast<long long*>(dq_accum) + dqa_head + m * dqa_ss + 64 * dp,"
         " s_stage + row * DQ_STAGE_ROW, 64 * 8);")
def bwd_dq_stage_stores(L, wg: int):
    """Fixed-point dQ: the 16-byte stores of warpgroup wg's 128 threads into its staging tile, as
    [(addresses (128,), accumulator row (128,), accumulator column (128,))] per (j, half) store,
    and, per panel row r, the warp that issues its bulk reduction and the shared address it reads
    (lanes 0-15 of warp r / 16)."""
    s_stage = aligned_base(RAW_SMEM) + L.DQ_STAGE + wg * 64 * DQ_STAGE_ROW
    r_lo = 16 * WARP_IN_WG + LANE // 4
    stores = []
    for j in range(8):
        at = s_stage + r_lo * DQ_STAGE_ROW + 64 * j + 16 * (LANE % 4)
        col = 8 * j + 2 * (LANE % 4)  # the pair col, col + 1 of dq_acc[j][0..1] (half 0) / [2..3]
        stores.append((at, r_lo, col))
        stores.append((at + 8 * DQ_STAGE_ROW, r_lo + 8, col))
    issuers = [(warp, lane) for warp in range(4) for lane in range(16)]
    sources = {16 * warp + lane: (warp, s_stage + (16 * warp + lane) * DQ_STAGE_ROW) for warp, lane in issuers}
    return stores, sources


@mirrors(BWD,
         "const i64 dqa_head = (i64)batch * dqa_sb + (i64)head * (PANEL_MAJOR ? D_TILE / 64 : 1) * dqa_sh;",
         "const u32 s_warp = base + L::DQ_STAGE + (wg * 64 + 16 * warp_in_wg) * L::STAGE_ROW;",
         "if (lane == 0) bulk_wait_read_all();",
         "const int flip = (lane / 4) & 1;",
         "for (int e = 0; e < 4; ++e) x[e] = flip ? dq_acc[j ^ 1][e] : dq_acc[j][e];",
         "const u32 at = s_warp + (lane / 4) * L::STAGE_ROW + 64 * (j ^ flip) + 16 * (lane % 4);",
         "st_shared_v2_b64(at, to_fixed(x[0], scale_lo, dq_limit, bad_lo), to_fixed(x[1], scale_lo, dq_limit, bad_lo));",
         "st_shared_v2_b64(at + 8 * L::STAGE_ROW, to_fixed(x[2], scale_hi, dq_limit, bad_hi),"
         " to_fixed(x[3], scale_hi, dq_limit, bad_hi));",
         "const int m = m0 + 64 * qp + 16 * warp_in_wg;",
         "if (m < seqlen_q) bulk_reduce_add_s64(static_cast<long long*>(dq_accum) + dqa_head + dp * dqa_sh"
         " + m * dqa_ss, s_warp, 16 * L::STAGE_ROW);")
def bwd_dq_panel_stage(L, wg: int, qp: int, dp: int, m0: int, batch: int, head: int, strides, seqlen_q: int):
    """Panel-major fixed point: warpgroup wg's 16-byte stores into its staging, as [(addresses
    (128,), accumulator row (128,), accumulator column (128,))] per (j, half), where the (j ^ 1)
    order of odd rows takes its values from dq_acc[j ^ 1]; and the bulk reductions the warps issue
    (none for a warp whose first row is past seqlen_q): {warp: (shared source, bytes, dq_accum
    element offset)}."""
    sb, ss, sh = strides
    dqa_head = batch * sb + head * (L.D_TILE // 64) * sh
    s_warp = aligned_base(RAW_SMEM) + L.DQ_STAGE + (wg * 64 + 16 * WARP_IN_WG) * L.STAGE_ROW
    flip = (LANE // 4) & 1
    stores = []
    for j in range(8):
        src_j = np.where(flip == 1, j ^ 1, j)  # the dq_acc block each thread's x[] comes from
        at = s_warp + (LANE // 4) * L.STAGE_ROW + 64 * (j ^ flip) + 16 * (LANE % 4)
        col = 8 * src_j + 2 * (LANE % 4)
        stores.append((at, ROW_LO, col))
        stores.append((at + 8 * L.STAGE_ROW, ROW_LO + 8, col))
    bulks = {w: (s_warp[32 * w], 16 * L.STAGE_ROW, dqa_head + dp * sh + (m0 + 64 * qp + 16 * w) * ss)
             for w in range(4) if m0 + 64 * qp + 16 * w < seqlen_q}
    return stores, bulks


def _red_add_pairs(out, rows, cols, pairs, headdim):
    for r, c, (x, y) in zip(rows, cols, pairs):
        if c < headdim and r < out.shape[0]:
            out[r, c] += x
            out[r, c + 1] += y


@mirrors("flash_bwd_wgmma.cu",
         "const int n = n0 + key_row + 8 * h;",
         "const int col = 8 * j + 2 * (lane % 4);",
         "*reinterpret_cast<u32*>(dk_row + col) = pack2<T>(dk_acc[j][2 * h] * scale, dk_acc[j][2 * h + 1] * scale);",
         "*reinterpret_cast<u32*>(dv_row + col) = pack2<T>(dv_acc[j][2 * h], dv_acc[j][2 * h + 1]);")
def store_dkdv(out, acc, key_row, col0: int, mult: float, headdim: int) -> None:
    """Epilogue: row key_row + 8h, columns col0 + 8j + 2t of dK (mult = scale) or dV (1)."""
    for h in range(2):
        for j in range(acc.shape[1]):
            col = col0 + 8 * j + 2 * THREAD_IN_GROUP
            for r, c, (x, y) in zip(key_row + 8 * h, col, acc[:, j, 2 * h: 2 * h + 2]):
                if c < headdim and r < out.shape[0]:
                    out[r, c: c + 2] = x * mult, y * mult


def bwd_emulated(q, k, v, do, lse, delta, L, headdim: int, scale: float):
    """One CTA of flash_bwd_wgmma (key block 0, one head, non-causal, every query block of full
    BLOCK_M rows): steps 1-8 and the epilogue. Returns dK, dV and dq_accum."""
    assert q.shape[0] % L.BLOCK_M == 0 and k.shape[0] == L.BLOCK_N  # no hidden entries: no masks
    seqlen_q = q.shape[0]
    scale_log2 = scale * math.log2(math.e)
    smem = new_smem()
    tiles0 = bwd_tiles(L, 0)
    cp_async_panels(smem, tiles0.k, L.BLOCK_N, L.D_TILE, L.NTHREADS, k, L.BLOCK_N, headdim)
    cp_async_panels(smem, tiles0.v, L.BLOCK_N, L.D_TILE, L.NTHREADS, v, L.BLOCK_N, headdim)
    dk_acc = [np.zeros((128, L.D_TILE // 8, 4)) for _ in range(L.NWG)]
    dv_acc = [np.zeros((128, L.D_TILE // 8, 4)) for _ in range(L.NWG)]
    dq_accum = np.zeros((seqlen_q, headdim))
    for it in range(seqlen_q // L.BLOCK_M):
        stage, m0 = it & 1, it * L.BLOCK_M
        tiles = bwd_tiles(L, stage)
        cp_async_panels(smem, tiles.q, L.BLOCK_M, L.D_TILE, L.NTHREADS, q[m0:], seqlen_q - m0, headdim)
        cp_async_panels(smem, tiles.do, L.BLOCK_M, L.D_TILE, L.NTHREADS, do[m0:], seqlen_q - m0, headdim)
        s_lse, s_delta = lse[m0: m0 + L.BLOCK_M], delta[m0: m0 + L.BLOCK_M]
        for wg in range(L.NWG):
            s_acc, dp_acc = np.empty((128, L.BLOCK_M // 8, 4)), np.empty((128, L.BLOCK_M // 8, 4))
            for kk, step in enumerate(bwd_st_steps(L, tiles.k, tiles.q, wg)):
                wgmma(s_acc, smem, step, accumulate=kk > 0)
            for kk, step in enumerate(bwd_st_steps(L, tiles.v, tiles.do, wg)):
                wgmma(dp_acc, smem, step, accumulate=kk > 0)
            p_frag = pack_a_frags(p_transposed(s_acc, s_lse, scale_log2))
            ds_frag = pack_a_frags(ds_transposed(dp_acc, unpack_p16(p_frag, L.BLOCK_M // 8), s_delta))
            for addr, kk, reg in bwd_ds_t_stores(L, tiles, wg):
                st_shared_b32(smem, addr, ds_frag[:, kk, reg])
            for kk, step in enumerate(bwd_dkdv_steps(L, tiles.do)):
                wgmma(dv_acc[wg], smem, step, accumulate=True, a_regs=p_frag[:, kk])
            for kk, step in enumerate(bwd_dkdv_steps(L, tiles.q)):
                wgmma(dk_acc[wg], smem, step, accumulate=True, a_regs=ds_frag[:, kk])
        # __syncthreads: dS^T complete
        for wg in range(L.NWG):
            for qp, dp in bwd_dq_panels(L, wg):
                dq_acc = np.empty((128, 8, 4))
                for kk, step in enumerate(bwd_dq_steps(L, tiles, qp, dp)):
                    wgmma(dq_acc, smem, step, accumulate=kk > 0)
                bwd_add_dq_panel(dq_accum, dq_acc, m0, qp, dp, headdim)
    dk, dv = np.full((L.BLOCK_N, headdim), np.nan), np.full((L.BLOCK_N, headdim), np.nan)
    for wg in range(L.NWG):
        store_dkdv(dk, dk_acc[wg], 64 * wg + ROW_LO, 0, scale, headdim)
        store_dkdv(dv, dv_acc[wg], 64 * wg + ROW_LO, 0, 1.0, headdim)
    return dk, dv, dq_accum


# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/flash_bwd_wgmma_dsplit.cu
# ---------------------------------------------------------------------------------------------

DSPLIT = "flash_bwd_wgmma_dsplit.cu"


@mirrors(DSPLIT,
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;",
         "static constexpr u32 KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128;",
         "static constexpr u32 K = 0;",
         "static constexpr u32 V = K + KV_TILE;",
         "static constexpr u32 Q = V + KV_TILE;",
         "static constexpr u32 DO = Q + 2 * Q_TILE;",
         "static constexpr u32 PT = DO + 2 * Q_TILE;",
         "static constexpr u32 DST = PT + BLOCK_N * BLOCK_M * 2;",
         "static constexpr u32 LSE = DST + BLOCK_N * BLOCK_M * 2;",
         "static constexpr u32 DELTA = LSE + 2 * BLOCK_M * 4;",
         "static constexpr u32 BYTES = DELTA + 2 * BLOCK_M * 4;",
         "constexpr int NTHREADS = 256, NWARPS = 8;",
         "constexpr int HALF = D_TILE / 2;",
         "constexpr int SJ = BLOCK_M / 8;",
         "constexpr int HJ = HALF / 8;",
         "static_assert(BLOCK_N == 64 && BLOCK_M == 64, \"one 64-row wgmma per product and warpgroup\");",
         "static_assert(D_TILE == 256, \"the head-dim halves are 128 columns: two panels\");")
def dsplit_smem(d_tile: int, block_m: int, block_n: int) -> SimpleNamespace:
    assert block_m == block_n == 64 and d_tile == 256
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_M=block_m, BLOCK_N=block_n, KV_TILE=block_n * d_tile * 2,
                        Q_TILE=block_m * d_tile * 2, KV_PANEL=block_n * 128, Q_PANEL=block_m * 128, K=0)
    L.V = L.K + L.KV_TILE
    L.Q = L.V + L.KV_TILE
    L.DO = L.Q + 2 * L.Q_TILE
    L.PT = L.DO + 2 * L.Q_TILE
    L.DST = L.PT + block_n * block_m * 2
    L.LSE = L.DST + block_n * block_m * 2
    L.DELTA = L.LSE + 2 * block_m * 4
    L.BYTES = L.DELTA + 2 * block_m * 4
    L.NWG, L.NTHREADS, L.HALF = 2, 256, d_tile // 2
    return L


@mirrors(DSPLIT,
         "const u32 raw = smem_u32(smem_raw);",
         "const u32 s_k = base + L::K, s_v = base + L::V, s_pt = base + L::PT, s_dst = base + L::DST;",
         "const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::Q + stage * L::Q_TILE,"
         " q + row_offset(batch, m0, head, q_sb, q_ss, q_sh), seqlen_q - m0, headdim, q_ss, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::DO + stage * L::Q_TILE,"
         " dout + row_offset(batch, m0, head, do_sb, do_ss, do_sh), seqlen_q - m0, headdim, do_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(s_k, k + row_offset(batch, n0, head_kv, k_sb, k_ss, k_sh),"
         " seqlen_k - n0, headdim, k_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(s_v, v + row_offset(batch, n0, head_kv, v_sb, v_ss, v_sh),"
         " seqlen_k - n0, headdim, v_ss, tid);")
def dsplit_tiles(L, stage: int) -> SimpleNamespace:
    base = aligned_base(RAW_SMEM)
    return SimpleNamespace(k=base + L.K, v=base + L.V, pt=base + L.PT, dst=base + L.DST,
                           q=base + L.Q + stage * L.Q_TILE, do=base + L.DO + stage * L.Q_TILE)


@mirrors(DSPLIT,
         "const u32 a_tile = wg == 0 ? s_k : s_v, b_tile = wg == 0 ? s_q : s_do;",
         "Wgmma<T, BLOCK_M>::template ss<0, 0>( reinterpret_cast<float(&)[SJ * 4]>(acc),"
         " smem_desc(a_tile + (kk / 4) * L::KV_PANEL + (kk % 4) * 32, 16, 1024),"
         " smem_desc(b_tile + (kk / 4) * L::Q_PANEL + (kk % 4) * 32, 16, 1024), kk > 0);")
def dsplit_step1(L, tiles, wg: int) -> list[Step]:
    """Warpgroup 0: S^T = K Q^T; warpgroup 1: dP^T = V dO^T (all 64 keys, K-major operands)."""
    a_tile, b_tile = (tiles.k, tiles.q) if wg == 0 else (tiles.v, tiles.do)
    return [Step(smem_desc(a_tile + (kk // 4) * L.KV_PANEL + (kk % 4) * 32, 16, 1024), 0,
                 smem_desc(b_tile + (kk // 4) * L.Q_PANEL + (kk % 4) * 32, 16, 1024), 0)
            for kk in range(L.D_TILE // 16)]


@mirrors(DSPLIT,
         "Wgmma<T, HALF>::template ss<0, 1>(reinterpret_cast<float(&)[HJ * 4]>(dv_acc),"
         " smem_desc(s_pt + kk * 32, 16, 1024),"
         " smem_desc(s_do + 2 * wg * L::Q_PANEL + kk * 2048, L::Q_PANEL, 1024), 1);",
         "Wgmma<T, HALF>::template ss<0, 1>(reinterpret_cast<float(&)[HJ * 4]>(dk_acc),"
         " smem_desc(s_dst + kk * 32, 16, 1024),"
         " smem_desc(s_q + 2 * wg * L::Q_PANEL + kk * 2048, L::Q_PANEL, 1024), 1);")
def dsplit_dkdv_steps(L, keys_by_queries_tile: int, query_tile: int, wg: int) -> list[Step]:
    """dV_g += P^T dO_g (P^T tile, dO) or dK_g += dS^T Q_g (dS^T tile, Q): A K-major from shared
    memory (a 16-query k-step is 32 bytes into the one panel), B = head-dim half wg (two
    panels: 2 wg Q_PANEL in, LBO one panel), MN-major."""
    return [Step(smem_desc(keys_by_queries_tile + kk * 32, 16, 1024), 0,
                 smem_desc(query_tile + 2 * wg * L.Q_PANEL + kk * 2048, L.Q_PANEL, 1024), 1)
            for kk in range(L.BLOCK_M // 16)]


@mirrors(DSPLIT,
         "Wgmma<T, HALF>::template ss<1, 1>(reinterpret_cast<float(&)[HJ * 4]>(dq_acc),"
         " smem_desc(s_dst + kk * 2048, L::KV_PANEL, 1024),"
         " smem_desc(s_k + 2 * wg * L::KV_PANEL + kk * 2048, L::KV_PANEL, 1024), kk > 0);")
def dsplit_dq_steps(L, tiles, wg: int) -> list[Step]:
    """dQ_g = dS K_g: A = the MN-major view of dS^T, B = K head-dim half wg, MN-major."""
    return [Step(smem_desc(tiles.dst + kk * 2048, L.KV_PANEL, 1024), 1,
                 smem_desc(tiles.k + 2 * wg * L.KV_PANEL + kk * 2048, L.KV_PANEL, 1024), 1)
            for kk in range(L.BLOCK_N // 16)]


@mirrors(DSPLIT,
         "const int key_row = 16 * warp_in_wg + lane / 4;",
         "return tile + panel_offset<BLOCK_N>(key_row + 8 * h, j) + 4 * (lane % 4);",
         "st_shared_b32(pair_addr(s_pt, j, 0), pack2<T>(acc[j][0], acc[j][1]));",
         "st_shared_b32(pair_addr(s_pt, j, 1), pack2<T>(acc[j][2], acc[j][3]));",
         "asm volatile(\"ld.shared.b32 %0, [%1];\\n\" : \"=r\"(p2[0]) : \"r\"(pair_addr(s_pt, j, 0)));",
         "asm volatile(\"ld.shared.b32 %0, [%1];\\n\" : \"=r\"(p2[1]) : \"r\"(pair_addr(s_pt, j, 1)));",
         "st_shared_b32(pair_addr(s_dst, j, 0), pack2<T>(acc[j][0], acc[j][1]));",
         "st_shared_b32(pair_addr(s_dst, j, 1), pack2<T>(acc[j][2], acc[j][3]));")
def dsplit_pair_addr(L, tile: int, j: int, h: int) -> np.ndarray:
    """Address of each thread's 16-bit pair of accumulator column block j, row half h (word
    lane % 4 of chunk j of row key_row + 8h) in a [BLOCK_N][BLOCK_M] panel tile."""
    return tile + panel_offset(L.BLOCK_N, ROW_LO + 8 * h, j) + 4 * THREAD_IN_GROUP


@mirrors(DSPLIT,
         "const int m_lo = m0 + 16 * warp_in_wg + lane / 4, m_hi = m_lo + 8;",
         "const int col = HALF * wg + 8 * j + 2 * (lane % 4);")
def dsplit_add_dq(dq_accum, dq_acc, m0: int, wg: int, L, headdim: int) -> None:
    m_lo = m0 + ROW_LO
    for j in range(L.HALF // 8):
        col = L.HALF * wg + 8 * j + 2 * THREAD_IN_GROUP
        _red_add_pairs(dq_accum, m_lo, col, dq_acc[:, j, 0:2], headdim)
        _red_add_pairs(dq_accum, m_lo + 8, col, dq_acc[:, j, 2:4], headdim)


def dsplit_emulated(q, k, v, do, lse, delta, L, headdim: int, scale: float):
    """One CTA of flash_bwd_wgmma_dsplit (key block 0, non-causal, full query blocks)."""
    assert q.shape[0] % L.BLOCK_M == 0 and k.shape[0] == L.BLOCK_N
    seqlen_q = q.shape[0]
    scale_log2 = scale * math.log2(math.e)
    smem = new_smem()
    tiles0 = dsplit_tiles(L, 0)
    cp_async_panels(smem, tiles0.k, L.BLOCK_N, L.D_TILE, L.NTHREADS, k, L.BLOCK_N, headdim)
    cp_async_panels(smem, tiles0.v, L.BLOCK_N, L.D_TILE, L.NTHREADS, v, L.BLOCK_N, headdim)
    dk_acc = [np.zeros((128, L.HALF // 8, 4)) for _ in range(2)]
    dv_acc = [np.zeros((128, L.HALF // 8, 4)) for _ in range(2)]
    dq_accum = np.zeros((seqlen_q, headdim))
    sj = L.BLOCK_M // 8
    for it in range(seqlen_q // L.BLOCK_M):
        stage, m0 = it & 1, it * L.BLOCK_M
        tiles = dsplit_tiles(L, stage)
        cp_async_panels(smem, tiles.q, L.BLOCK_M, L.D_TILE, L.NTHREADS, q[m0:], seqlen_q - m0, headdim)
        cp_async_panels(smem, tiles.do, L.BLOCK_M, L.D_TILE, L.NTHREADS, do[m0:], seqlen_q - m0, headdim)
        s_lse, s_delta = lse[m0: m0 + L.BLOCK_M], delta[m0: m0 + L.BLOCK_M]
        acc = [np.empty((128, sj, 4)) for _ in range(2)]  # wg 0: S^T, wg 1: dP^T
        for wg in range(2):
            for kk, step in enumerate(dsplit_step1(L, tiles, wg)):
                wgmma(acc[wg], smem, step, accumulate=kk > 0)
        p_t = p_transposed(acc[0], s_lse, scale_log2)  # step 2, warpgroup 0
        for j in range(sj):
            st_shared_b32(smem, dsplit_pair_addr(L, tiles.pt, j, 0), p_t[:, j, 0:2])
            st_shared_b32(smem, dsplit_pair_addr(L, tiles.pt, j, 1), p_t[:, j, 2:4])
        # __syncthreads: P^T complete; step 3
        for wg in range(2):
            for step in dsplit_dkdv_steps(L, tiles.pt, tiles.do, wg):
                wgmma(dv_acc[wg], smem, step, accumulate=True)
        p16 = np.empty((128, sj, 4))  # step 4, warpgroup 1
        for j in range(sj):
            pairs = [ld_shared_b32(smem, dsplit_pair_addr(L, tiles.pt, j, h)) for h in range(2)]
            p16[:, j] = np.concatenate(pairs, axis=1)  # {lo.x, lo.y, hi.x, hi.y}
        ds_t = ds_transposed(acc[1], p16, s_delta)
        for j in range(sj):
            st_shared_b32(smem, dsplit_pair_addr(L, tiles.dst, j, 0), ds_t[:, j, 0:2])
            st_shared_b32(smem, dsplit_pair_addr(L, tiles.dst, j, 1), ds_t[:, j, 2:4])
        # __syncthreads: dS^T complete; steps 5 and 6
        for wg in range(2):
            for step in dsplit_dkdv_steps(L, tiles.dst, tiles.q, wg):
                wgmma(dk_acc[wg], smem, step, accumulate=True)
            dq_acc = np.empty((128, L.HALF // 8, 4))
            for kk, step in enumerate(dsplit_dq_steps(L, tiles, wg)):
                wgmma(dq_acc, smem, step, accumulate=kk > 0)
            dsplit_add_dq(dq_accum, dq_acc, m0, wg, L, headdim)
    dk, dv = np.full((L.BLOCK_N, headdim), np.nan), np.full((L.BLOCK_N, headdim), np.nan)
    for wg in range(2):
        store_dkdv(dk, dk_acc[wg], ROW_LO, L.HALF * wg, scale, headdim)
        store_dkdv(dv, dv_acc[wg], ROW_LO, L.HALF * wg, 1.0, headdim)
    return dk, dv, dq_accum


mirrors(DSPLIT,
        "const int col = HALF * wg + 8 * j + 2 * (lane % 4);",
        "*reinterpret_cast<u32*>(dk_row + col) = pack2<T>(dk_acc[j][2 * h] * scale, dk_acc[j][2 * h + 1] * scale);",
        "*reinterpret_cast<u32*>(dv_row + col) = pack2<T>(dv_acc[j][2 * h], dv_acc[j][2 * h + 1]);",
        "const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + 8 * j + 2 * (lane % 4));",
        "const float p = exp2_approx(fmaf(acc[j][e], scale_log2, -base_log2[e & 1]));",
        "const float2 d2 = *reinterpret_cast<const float2*>(s_delta + 8 * j + 2 * (lane % 4));",
        "const float2 lo = unpack2<T>(p2[0]), hi = unpack2<T>(p2[1]);",
        "acc[j][e] = p16[e] == 0.f ? 0.f : p16[e] * (acc[j][e] - ((e & 1) ? d2.y : d2.x));")(dsplit_emulated)

# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/flash_bwd_dq_wgmma.cu
# ---------------------------------------------------------------------------------------------

DQW = "flash_bwd_dq_wgmma.cu"


@mirrors(DQW,
         "static constexpr int V_STAGES = 2;",
         "static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;",
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2, KV_TILE = BLOCK_N * D_TILE * 2;",
         "static constexpr u32 Q = 0;",
         "static constexpr u32 DO = Q + Q_TILE;",
         "static constexpr u32 K = DO + Q_TILE;",
         "static constexpr u32 V = K + K_STAGES * KV_TILE;",
         "static constexpr u32 BYTES = V + V_STAGES * KV_TILE;",
         "constexpr int NWG = BLOCK_M / 64, NTHREADS = NWG * 128;",
         "constexpr int N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;",
         "constexpr bool DQ_ACROSS_BARRIER = K_STAGES >= 3;",
         "static_assert(BLOCK_M % 64 == 0 && BLOCK_N % 16 == 0 && D_TILE % 64 == 0,"
         " \"64-row panels, 16-key k-steps\");",
         "static_assert(K_STAGES == 2 || K_STAGES == 3, \"two or three K stages\");",
         "static_assert(L::BYTES + 1024 <= 227 * 1024, \"shared memory\");")
def dqw_smem(d_tile: int, block_m: int, block_n: int, k_stages: int) -> SimpleNamespace:
    """DqWgmmaSmem and the kernel's derived constants (the shared-memory static_assert is checked
    by test_smem_layouts_are_panel_aligned_and_match_python)."""
    assert block_m % 64 == 0 and block_n % 16 == 0 and d_tile % 64 == 0 and k_stages in (2, 3)
    L = SimpleNamespace(D_TILE=d_tile, BLOCK_M=block_m, BLOCK_N=block_n, K_STAGES=k_stages, V_STAGES=2,
                        Q_PANEL=block_m * 128, KV_PANEL=block_n * 128, Q_TILE=block_m * d_tile * 2,
                        KV_TILE=block_n * d_tile * 2, Q=0)
    L.DO = L.Q + L.Q_TILE
    L.K = L.DO + L.Q_TILE
    L.V = L.K + L.K_STAGES * L.KV_TILE
    L.BYTES = L.V + L.V_STAGES * L.KV_TILE
    L.NWG = block_m // 64
    L.NTHREADS = L.NWG * 128
    L.N_FRAGS, L.D_FRAGS = block_n // 8, d_tile // 8
    L.DQ_ACROSS_BARRIER = k_stages >= 3
    return L


@mirrors(DQW,
         "const u32 raw = smem_u32(smem_raw);",
         "const u32 s_q = base + L::Q, s_do = base + L::DO;",
         "const u32 k_tile = base + L::K + (j % K_STAGES) * L::KV_TILE;",
         "const u32 v_tile = base + L::V + (j % L::V_STAGES) * L::KV_TILE;")
def dqw_tiles(L, j: int) -> SimpleNamespace:
    """The tiles the products of key block j read (stages: K j % K_STAGES, V j % 2)."""
    base = aligned_base(RAW_SMEM)
    return SimpleNamespace(q=base + L.Q, do=base + L.DO, k=base + L.K + (j % L.K_STAGES) * L.KV_TILE,
                           v=base + L.V + (j % L.V_STAGES) * L.KV_TILE)


@mirrors(DQW,
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(s_q, q + row_offset(batch, m0, head, q_sb, q_ss, q_sh),"
         " seqlen_q - m0, headdim, q_ss, tid);",
         "cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(s_do, dout + row_offset(batch, m0, head, do_sb, do_ss, do_sh),"
         " seqlen_q - m0, headdim, do_ss, tid);")
def dqw_load_q_do(smem, L, q, do, m0: int, headdim: int) -> None:
    """The query block's Q and dO (rows m0.. of q and do), once per CTA."""
    tiles = dqw_tiles(L, 0)
    seqlen_q = q.shape[0]
    for tile, g in ((tiles.q, q), (tiles.do, do)):
        cp_async_panels(smem, tile, L.BLOCK_M, L.D_TILE, L.NTHREADS, g[m0:], seqlen_q - m0, headdim)


@mirrors(DQW,
         "const int n0 = j * BLOCK_N;",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::K + (j % K_STAGES) * L::KV_TILE,"
         " k_rows + n0 * k_ss, seqlen_k - n0, headdim, k_ss, tid);",
         "cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::V + (j % L::V_STAGES) * L::KV_TILE,"
         " v_rows + n0 * v_ss, seqlen_k - n0, headdim, v_ss, tid);")
def dqw_load_kv_block(smem, L, j: int, k, v, headdim: int) -> None:
    """load_kv_block(j): K_j and V_j (rows n0.. of k and v) into their stages. The destinations are
    the lambda's own expressions, not dqw_tiles': the two must agree."""
    base = aligned_base(RAW_SMEM)
    n0 = j * L.BLOCK_N
    seqlen_k = k.shape[0]
    cp_async_panels(smem, base + L.K + (j % L.K_STAGES) * L.KV_TILE, L.BLOCK_N, L.D_TILE, L.NTHREADS,
                    k[n0:], seqlen_k - n0, headdim)
    cp_async_panels(smem, base + L.V + (j % L.V_STAGES) * L.KV_TILE, L.BLOCK_N, L.D_TILE, L.NTHREADS,
                    v[n0:], seqlen_k - n0, headdim)


@mirrors(DQW,
         "for (int kk = 0; kk < D_TILE / 16; ++kk) {",
         "const u32 q_off = (kk / 4) * L::Q_PANEL + wg * 64 * 128 + (kk % 4) * 32;",
         "const u32 k_off = (kk / 4) * L::KV_PANEL + (kk % 4) * 32;",
         "Wgmma<T, BLOCK_N>::template ss<0, 0>(reinterpret_cast<float(&)[N_FRAGS * 4]>(s_acc),"
         " smem_desc(s_q + q_off, 16, 1024), smem_desc(k_tile + k_off, 16, 1024), kk > 0);")
def dqw_s_steps(L, tiles, wg: int) -> list[Step]:
    """S = Q K_j^T of warpgroup wg (its 64 query rows x BLOCK_N keys), k-steps over the head dim;
    both operands K-major."""
    return row_block_k_major_steps(L, tiles.q, tiles.k, wg)


@mirrors(DQW,
         "for (int kk = 0; kk < D_TILE / 16; ++kk) {",
         "const u32 q_off = (kk / 4) * L::Q_PANEL + wg * 64 * 128 + (kk % 4) * 32;",
         "const u32 v_off = (kk / 4) * L::KV_PANEL + (kk % 4) * 32;",
         "Wgmma<T, BLOCK_N>::template ss<0, 0>(reinterpret_cast<float(&)[N_FRAGS * 4]>(dp_acc),"
         " smem_desc(s_do + q_off, 16, 1024), smem_desc(v_tile + v_off, 16, 1024), kk > 0);")
def dqw_dp_steps(L, tiles, wg: int) -> list[Step]:
    """dP = dO V_j^T of warpgroup wg: S's shape and offsets with dO and V_j."""
    return row_block_k_major_steps(L, tiles.do, tiles.v, wg)


@mirrors(DQW,
         "for (int kk = 0; kk < BLOCK_N / 16; ++kk)",
         "Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[D_FRAGS * 4]>(dq_acc), ds_frag[kk],"
         " smem_desc(k_tile + kk * 2048, L::KV_PANEL, 1024), 1);")
def dqw_dq_steps(L, tiles) -> list[Step]:
    """dQ += dS K_j: A = dS from registers (k-step kk: ds_frag[kk]), B = K_j MN-major (B[key][d]:
    16 keys of 2048 bytes per k-step, the D_TILE columns in 64-column atoms one panel apart)."""
    return [Step(None, None, smem_desc(tiles.k + kk * 2048, L.KV_PANEL, 1024), 1) for kk in range(L.BLOCK_N // 16)]


@mirrors(DQW,
         "const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32, lane = tid % 32;",
         "const int row_lo = m0 + 16 * warp + lane / 4;",
         "const int m = row_lo + 8 * h;",
         "const i64 stat = ((i64)batch * nheads + head) * seqlen_q + m;",
         "base_log2[h] = m < seqlen_q ? lse_base_log2(lse[stat]) : 0.f;",
         "delta_row[h] = m < seqlen_q ? delta[stat] : 0.f;")
def dqw_thread_rows(m0: int, wg: int, lse, delta, seqlen_q: int, batch: int, head: int, nheads: int):
    """Warpgroup wg's threads: lane, row_lo, and base_log2[thread, h], delta_row[thread, h] (lse and
    delta flat, (batch, nheads, seqlen_q))."""
    tid = 128 * wg + THREADS
    warp, lane = tid // 32, tid % 32
    row_lo = m0 + 16 * warp + lane // 4
    base_log2, delta_row = np.empty((128, 2)), np.empty((128, 2))
    for h in range(2):
        m = row_lo + 8 * h
        stat = (batch * nheads + head) * seqlen_q + m
        inside = m < seqlen_q
        base_log2[:, h] = np.where(inside, lse_base_log2(lse[np.where(inside, stat, 0)]), 0.0)
        delta_row[:, h] = np.where(inside, delta[np.where(inside, stat, 0)], 0.0)
    return lane, row_lo, base_log2, delta_row


@mirrors("mask.cuh",
         "return i < seqlen_q && j < seqlen_k && (!RIGHT || j <= i + hi_off) && (!LEFT || j >= i + lo_off);",
         "return m0 + rows > seqlen_q || n0 + cols > seqlen_k || (RIGHT && n0 + cols - 1 > m0 + hi_off) ||",
         "(LEFT && n0 < m0 + rows - 1 + lo_off);")
@mirrors("mask.cuh",
         "return i < seqlen_q && j < seqlen_k && (!RIGHT || j <= i + hi_off) && (!LEFT || j >= i + lo_off);")
class MaskPolicy(NamedTuple):
    """The kernels' mask policy (mask.cuh) for one problem, from its Python twin cupyflash.masks:
    element test and partial-block test in the kernel's form."""
    mask: masks.Mask
    seqlen_q: int
    seqlen_k: int

    def __call__(self, m, n):
        lo, hi = self.mask.offsets(self.seqlen_q, self.seqlen_k)
        ok = (m < self.seqlen_q) & (n < self.seqlen_k)
        if self.mask.HAS_RIGHT:
            ok = ok & (n <= m + hi)
        if self.mask.HAS_LEFT:
            ok = ok & (n >= m + lo)
        return ok

    def partial(self, m0: int, bm: int, n0: int, bn: int) -> bool:
        return self.mask.partial(m0, bm, n0, bn, self.seqlen_q, self.seqlen_k)


@mirrors(DQW,
         "const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);",
         "const int key0 = n0 + 2 * (lane % 4);",
         "const float p = exp2_approx(fmaf(s_acc[f][e], scale_log2, -base_log2[e >> 1]));",
         "s_acc[f][e] = partial && !mask.visible(row_lo + 8 * (e >> 1), key0 + 8 * f + (e & 1)) ? 0.f : p;",
         "dp_acc[f][e] = s_acc[f][e] == 0.f ? 0.f : s_acc[f][e] * (dp_acc[f][e] - delta_row[e >> 1]);")
def dqw_p_and_ds(L, s_acc, dp_acc, visible, m0: int, n0: int, lane, row_lo, base_log2, delta_row, scale_log2):
    """Steps 3-4 on the accumulators [thread, f, e]: P (0 where hidden), then dS = P o (dP - D)."""
    partial = visible.partial(m0, L.BLOCK_M, n0, L.BLOCK_N)
    key0 = n0 + 2 * (lane % 4)
    f, e = np.arange(L.N_FRAGS)[None, :, None], np.arange(4)
    p = np.exp2(s_acc * scale_log2 - base_log2[:, None, e >> 1])
    p = np.where(partial & ~visible(row_lo[:, None, None] + 8 * (e >> 1), key0[:, None, None] + 8 * f + (e & 1)),
                 0.0, p)
    ds = np.where(p == 0.0, 0.0, p * (dp_acc - delta_row[:, None, e >> 1]))
    return p, ds


@mirrors(DQW,
         "if (m >= seqlen_q) continue;",
         "T* dq_row = dq + row_offset(batch, m, head, dq_sb, dq_ss, dq_sh);",
         "const int col = 8 * f + 2 * (lane % 4);",
         "if (col < headdim)",
         "*reinterpret_cast<u32*>(dq_row + col) = pack2<T>(dq_acc[f][2 * h] * scale, dq_acc[f][2 * h + 1] * scale);")
def dqw_store_dq(dq, dq_acc, lane, row_lo, scale: float, headdim: int) -> None:
    """Epilogue: rows row_lo + 8h (below seqlen_q = dq.shape[0]), columns 8f + 2 (lane % 4), +1."""
    for h in range(2):
        m = row_lo + 8 * h
        for f in range(dq_acc.shape[1]):
            col = 8 * f + 2 * (lane % 4)
            for r, c, (x, y) in zip(m, col, dq_acc[:, f, 2 * h: 2 * h + 2]):
                if r < dq.shape[0] and c < headdim:
                    dq[r, c: c + 2] = x * scale, y * scale


@mirrors(DQW,
         "const Mask mask(seqlen_q, seqlen_k, window_left, window_right);",
         "const int j_begin = mask.key_begin(m0) / BLOCK_N;",
         "const int n_end = mask.key_end(m0, BLOCK_M);",
         "if (j_begin * BLOCK_N < n_end) load_kv_block(j_begin);",
         "for (int j = j_begin; j * BLOCK_N < n_end; ++j) {",
         "if ((j + 1) * BLOCK_N < n_end) load_kv_block(j + 1);",
         "pack_a_frags<T, BLOCK_N>(ds_frag, dp_acc);")
def dqw_emulated(q, k, v, do, lse, delta, L, headdim: int, scale: float, causal: bool, m0: int,
                 batch: int, head: int, nheads: int, log_blocks=None, window_size=(-1, -1)):
    """One CTA of flash_bwd_dq_wgmma (query block m0 of one head): Q and dO once, then every key
    block it visits: S, dP, P, dS through registers, dQ += dS K_j; the epilogue's rows and columns.
    Block j + 1's copies land before block j's products read (cp.async is instantaneous here), so
    a stage clash shows up as wrong operands. Returns dq (seqlen_q x headdim, NaN where this CTA
    wrote nothing) and fills log_blocks (optional) with the key blocks visited."""
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    scale_log2 = scale * math.log2(math.e)
    mask = masks.mask_for(causal, window_size)
    visible = MaskPolicy(mask, seqlen_q, seqlen_k)
    j_begin = mask.key_begin(m0, seqlen_q, seqlen_k) // L.BLOCK_N
    n_end = mask.key_end(m0, L.BLOCK_M, seqlen_q, seqlen_k)
    smem = new_smem()
    dqw_load_q_do(smem, L, q, do, m0, headdim)
    if j_begin * L.BLOCK_N < n_end:
        dqw_load_kv_block(smem, L, j_begin, k, v, headdim)
    rows = [dqw_thread_rows(m0, wg, lse, delta, seqlen_q, batch, head, nheads) for wg in range(L.NWG)]
    dq_acc = [np.zeros((128, L.D_FRAGS, 4)) for _ in range(L.NWG)]
    j = j_begin
    while j * L.BLOCK_N < n_end:
        if (j + 1) * L.BLOCK_N < n_end:
            dqw_load_kv_block(smem, L, j + 1, k, v, headdim)
        if log_blocks is not None:
            log_blocks.append(j)
        n0 = j * L.BLOCK_N
        tiles = dqw_tiles(L, j)
        for wg in range(L.NWG):
            lane, row_lo, base_log2, delta_row = rows[wg]
            s_acc, dp_acc = np.empty((128, L.N_FRAGS, 4)), np.empty((128, L.N_FRAGS, 4))
            for kk, step in enumerate(dqw_s_steps(L, tiles, wg)):
                wgmma(s_acc, smem, step, accumulate=kk > 0)
            for kk, step in enumerate(dqw_dp_steps(L, tiles, wg)):
                wgmma(dp_acc, smem, step, accumulate=kk > 0)
            _, ds = dqw_p_and_ds(L, s_acc, dp_acc, visible, m0, n0, lane, row_lo, base_log2, delta_row, scale_log2)
            ds_frag = pack_a_frags(ds)
            for kk, step in enumerate(dqw_dq_steps(L, tiles)):
                wgmma(dq_acc[wg], smem, step, accumulate=True, a_regs=ds_frag[:, kk])
        j += 1
    dq = np.full((seqlen_q, headdim), np.nan)
    for wg in range(L.NWG):
        lane, row_lo = rows[wg][:2]
        dqw_store_dq(dq, dq_acc[wg], lane, row_lo, scale, headdim)
    return dq


# ---------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------

FWD_BLOCK_M = 128
# (D_TILE, BLOCK_N) with BLOCK_M = 128 that pass the kernel's shared-memory static_assert: all of
# {64, 128, 256} x {64, 128} but d256 with 128-key blocks (Q, two K and three V stages: 384 KiB).
FWD_SHAPES = [(d, bn) for d in (64, 128, 256) for bn in (64, 128)
              if fwd_smem(d, FWD_BLOCK_M, bn).BYTES + 1024 <= 227 * 1024]
BWD_CONFIGS = [(128, 64, 128), (64, 128, 128)]  # (D_TILE, BLOCK_M, BLOCK_N) of flash_bwd_wgmma
DSPLIT_CONFIG = (256, 64, 64)
# (D_TILE, BLOCK_M, BLOCK_N, K_STAGES) of flash_bwd_dq_wgmma: mma_bwd.DQ_WGMMA_CONFIG and the tuner's
# DQ_WGMMA_CANDIDATES (test_smem_layouts_are_panel_aligned_and_match_python checks it is both).
DQW_CONFIGS = [(64, 128, 128, 2), (64, 128, 64, 2), (128, 128, 64, 2), (256, 128, 32, 2), (256, 128, 32, 3)]
# (ROWS, DIM, NTHREADS) of every cp_async_panels the kernels issue: the forward's Q (BLOCK_M 128),
# K and V; flash_bwd_wgmma's and dsplit's; flash_bwd_dq_wgmma's Q, dO (BLOCK_M) and K, V (BLOCK_N).
CP_ASYNC_TILES = sorted({(r, d, 256) for r in (64, 128) for d in (64, 128, 256)} |
                        {(rows, dt, dqw_smem(dt, bm, bn, ks).NTHREADS)
                         for dt, bm, bn, ks in DQW_CONFIGS for rows in (bm, bn)})


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng([7, *key])


# ---------------------------------------------------------------------------------------------
# 0. The mirrors are the kernels' code; the descriptor encoder is the PTX format
# ---------------------------------------------------------------------------------------------

_LAYOUT_STATEMENT = re.compile(
    r"\b(?:return static_cast|static constexpr \w+ \w+|constexpr int \w+|const u32 \w+|"
    r"const int (?:row0|rows_left|key_row|qp|m_lo|chunk|col)\b|Wgmma<T|st_shared_b32\(|cp_async_16\(|"
    r"cp_async_panels<|return tile)")


def _code(path: Path) -> str:
    return re.sub(r"//[^\n]*", "", path.read_text())


def _squash(text: str) -> str:
    return "".join(text.split())


def _layout_statements(code: str) -> list[str]:
    """Every statement of `code` that computes a shared-memory address, a tile or descriptor
    offset, or issues a wgmma or a fragment store (from its first token to its semicolon)."""
    found, pos = [], 0
    while (m := _LAYOUT_STATEMENT.search(code, pos)) is not None:
        end = code.index(";", m.start()) + 1
        found.append(code[m.start(): end])
        pos = end
    return found


@pytest.mark.parametrize("source", ["wgmma.cuh", FWD, BWD, DSPLIT, DQW])
def test_mirrors_match_the_kernel_sources(source):
    """Every C++ statement a mirror names is in the source (whitespace aside), and every layout
    statement of the wgmma code is mirrored: an edit there fails here until the mirror follows."""
    code = _squash(_code(KERNELS_CU / source))
    named = {_squash(s) for f, s, _ in MIRRORED if f == source}
    missing = [(s, who) for f, s, who in MIRRORED if f == source and _squash(s) not in code]
    assert not missing, f"mirrored statements no longer in {source}: {missing}"
    if source == "wgmma.cuh":  # the layout helpers only, not the Wgmma specializations' asm
        text = _code(KERNELS_CU / source)
        text = text[text.index("panel_offset(int row"): text.index("struct Wgmma;")]
        text = text[: text.index("fence_proxy_async_shared")] + text[text.index("cp_async_panels("):]
    else:
        text = _code(KERNELS_CU / source)
    unmirrored = [s for s in _layout_statements(text) if _squash(s) not in named]
    assert not unmirrored, f"layout statements of {source} without a mirror here: {unmirrored}"


def test_other_mirrored_helpers_are_in_their_sources():
    for f in {f for f, _, _ in MIRRORED} - {"wgmma.cuh", FWD, BWD, DSPLIT, DQW}:
        code = _squash(_code(KERNELS_CU / f))
        missing = [(s, who) for g, s, who in MIRRORED if g == f and _squash(s) not in code]
        assert not missing, f"mirrored statements no longer in {f}: {missing}"


def test_smem_desc_encodes_the_ptx_descriptor_fields():
    rng = _rng(0)
    for _ in range(500):
        addr = int(rng.integers(0, 1 << 24)) & ~15  # bits above the shared window are dropped
        lbo, sbo = (int(x) * 16 for x in rng.integers(0, 1 << 14, size=2))
        d = decode_descriptor(smem_desc(addr, lbo, sbo))
        assert d == Descriptor(addr & 0x3FFFF, lbo, sbo, 0, SWIZZLE_128B)
    # the offsets the kernels pass fit the 14-bit fields and are whole 16-byte units
    for lbo in (16, 1024, *(rows * 128 for rows in (64, 128))):
        assert lbo % 16 == 0 and lbo >> 4 < 1 << 14


@pytest.mark.parametrize("configs", ["fwd", "bwd", "dq"])
def test_smem_layouts_are_panel_aligned_and_match_python(configs):
    """Every tile (and stage) a descriptor or panel_offset addresses starts 1024-byte aligned, the
    128-byte swizzle's pattern; BYTES plus the alignment slack is what the launcher requests; the
    configurations the launchers use are the ones modelled here."""
    from cupyflash.kernels import mma_bwd, mma_fwd

    if configs == "fwd":
        from cupyflash import plans
        from cupyflash.bench import tune

        tunable = [(dt, c) for (_, _, dt), c in plans.FORWARD_TILES.items()]  # and dev/'s, for the tuner
        tunable += [(dt, c) for dt in mma_fwd.D_TILES for _, c in tune.load_dev_forward().entries(dt)]
        launched = {(dt, c.block_m, c.block_n) for dt, c in tunable if isinstance(c, mma_fwd.WgmmaFwdConfig)}
        assert launched <= {(d, FWD_BLOCK_M, bn) for d, bn in FWD_SHAPES}
        assert len(FWD_SHAPES) == 5 and (256, 128) not in FWD_SHAPES
        for dt, bm, bn in launched:
            L = fwd_smem(dt, bm, bn)
            assert all(x % 1024 == 0 for x in (L.Q, L.K, L.V, L.KV_TILE, L.Q_PANEL, L.KV_PANEL))
            assert L.BYTES + 1024 == mma_fwd.wgmma_smem_bytes(dt, mma_fwd.WgmmaFwdConfig(bm, bn)) <= 227 * 1024
    elif configs == "dq":
        launched = {(dt, *cfg) for dt, cfg in mma_bwd.DQ_WGMMA_CONFIG.items()}
        launched |= {(dt, *cfg) for dt, cfgs in mma_bwd.DQ_WGMMA_CANDIDATES.items() for cfg in cfgs}
        assert launched == set(DQW_CONFIGS) and len(DQW_CONFIGS) == 5
        assert {ks for _, _, _, ks in DQW_CONFIGS} == {2, 3}
        for dt, bm, bn, ks in DQW_CONFIGS:
            L = dqw_smem(dt, bm, bn, ks)
            tiles = [L.Q, L.DO, *(L.K + s * L.KV_TILE for s in range(ks)), *(L.V + s * L.KV_TILE for s in range(2))]
            assert all(x % 1024 == 0 for x in (*tiles, L.Q_TILE, L.KV_TILE, L.Q_PANEL, L.KV_PANEL))
            sizes = [L.Q_TILE, L.Q_TILE, *[L.KV_TILE] * (ks + 2)]  # back to back, no overlap, all inside
            assert [t + n for t, n in zip(tiles, sizes)] == [*tiles[1:], L.BYTES]
            assert L.BYTES + 1024 == mma_bwd.dq_wgmma_smem_bytes(dt, bm, bn, ks) <= 227 * 1024
            spec = mma_bwd.dq_wgmma_spec("bfloat16", dt, False, (bm, bn, ks))
            assert (spec.threads, spec.smem_bytes) == (L.NTHREADS, L.BYTES + 1024)
    else:
        assert {(dt, *cfg) for dt, cfg in mma_bwd.WGMMA_CONFIG.items()} == {*BWD_CONFIGS, DSPLIT_CONFIG}
        for dt, bm, bn in BWD_CONFIGS:
            L = bwd_smem(dt, bm, bn)
            assert all(x % 1024 == 0 for x in (L.K, L.V, L.Q, L.DO, L.DST, L.Q_TILE, L.KV_PANEL, L.Q_PANEL))
            assert L.DQ_PANELS % L.NWG == 0  # the kernel's static_assert
            assert L.BYTES + 1024 == mma_bwd.wgmma_smem_bytes(dt, bm, bn) <= 227 * 1024
        L = dsplit_smem(*DSPLIT_CONFIG)
        assert all(x % 1024 == 0 for x in (L.K, L.V, L.Q, L.DO, L.PT, L.DST, L.Q_TILE, L.KV_PANEL, L.Q_PANEL))
        assert L.BYTES + 1024 == mma_bwd.wgmma_smem_bytes(*DSPLIT_CONFIG) <= 227 * 1024
    assert aligned_base(RAW_SMEM) % 1024 == 0 and 0 <= aligned_base(RAW_SMEM) - RAW_SMEM < 1024


# ---------------------------------------------------------------------------------------------
# 1. panel_offset: a bijection onto the tile, the canonical layout, conflict-free fragment stores
# ---------------------------------------------------------------------------------------------

PANEL_TILES = [(64, 64), (64, 128), (128, 128), (64, 256), (128, 64)]


@pytest.mark.parametrize("rows, cols", PANEL_TILES)
def test_panel_offset_is_a_bijection_onto_the_tile(rows, cols):
    off = panel_offset(rows, np.arange(rows)[:, None], np.arange(cols // 8)[None, :])
    assert sorted(off.ravel().tolist()) == list(range(0, rows * cols * 2, 16))
    # a chunk stays in its 64-column panel and its row's 128 bytes of that panel
    chunk = np.arange(cols // 8)[None, :]
    assert np.all(off // (rows * 128) == chunk // 8)
    assert np.all(off % (rows * 128) // 128 == np.arange(rows)[:, None])


@pytest.mark.parametrize("rows, cols", PANEL_TILES)
def test_panel_tile_is_the_canonical_layout_in_both_orientations(rows, cols):
    """Element (r, c) of a panel tile is where the hardware reads it through the descriptors the
    kernels build: K-major (rows are M or N, columns the reduction: start = panel + 32 bytes per
    16-column step, SBO 1024) and MN-major (rows are the reduction: start = 2048 bytes per
    16-row step, LBO one panel, SBO 1024)."""
    tile = aligned_base(RAW_SMEM) + 3 * 1024
    element = np.arange(rows)[:, None], np.arange(cols)[None, :]
    want = tile + panel_offset(rows, element[0], element[1] // 8) + 2 * (element[1] % 8)
    for kk in range(cols // 16):  # K-major: all rows, columns 16kk..16kk+15
        start = tile + (kk // 4) * rows * 128 + (kk % 4) * 32
        got = operand_addresses(smem_desc(start, 16, 1024), K_MAJOR, rows)
        assert np.array_equal(got, want[:, 16 * kk: 16 * kk + 16])
    for kk in range(rows // 16):  # MN-major: rows 16kk..16kk+15 as k, all columns as MN
        got = operand_addresses(smem_desc(tile + kk * 2048, rows * 128, 1024), MN_MAJOR, cols)
        assert np.array_equal(got, want[16 * kk: 16 * kk + 16].T)


@pytest.mark.parametrize("rows, cols", PANEL_TILES)
def test_accumulator_pair_stores_are_bank_conflict_free(rows, cols):
    """A warp's st.shared.b32 of one C-fragment register pair: lanes write rows row0 + lane / 4
    (or + 8), columns 8j + 2 (lane % 4), +1; the 32 lanes must hit 32 distinct banks."""
    for row0 in range(0, rows, 16):
        for j in range(cols // 8):
            for half in (0, 8):
                lane = np.arange(32)
                addr = panel_offset(rows, row0 + half + lane // 4, j) + 4 * (lane % 4)
                assert bank_conflict_free(addr, 4), (row0, j, half)


@pytest.mark.parametrize("d_tile, block_m, block_n", BWD_CONFIGS)
def test_bwd_ds_t_stores_are_bank_conflict_free_and_fill_the_tile(d_tile, block_m, block_n):
    L = bwd_smem(d_tile, block_m, block_n)
    tiles = bwd_tiles(L, 0)
    written = []
    for wg in range(L.NWG):
        for addr, _, _ in bwd_ds_t_stores(L, tiles, wg):
            for warp in range(4):
                assert bank_conflict_free(addr[32 * warp: 32 * warp + 32], 4)
            written.extend(addr.tolist())
    # the warpgroups' stores cover the BLOCK_N x BLOCK_M dS^T tile, each 4-byte word once
    assert sorted(written) == list(range(tiles.dst, tiles.dst + block_n * block_m * 2, 4))


@pytest.mark.parametrize("d_tile, block_m, block_n", BWD_CONFIGS)
def test_bwd_fixed_dq_staging_rows_are_the_panel_rows_in_order(d_tile, block_m, block_n):
    """Fixed-point dQ staging: every accumulator element (row, col) of the 64 x 64 panel lands at
    column col of staging row row, so the 512 bytes each bulk reduction reads are one dQ row in
    column order; a row is written only by the warp that issues its reduction (the kernel syncs
    warps with themselves only); the tiles sit inside the layout, past the other tiles, 16-byte
    aligned (the bulk copy's requirement); each quarter-warp's 16-byte stores hit every bank once
    (4 wavefronts per warp store, the minimum for 512 bytes)."""
    from cupyflash.kernels import mma_bwd

    L = bwd_smem(d_tile, block_m, block_n, "fixed")
    assert L.BYTES + 1024 == mma_bwd.wgmma_smem_bytes(d_tile, block_m, block_n, "fixed") <= 227 * 1024
    assert mma_bwd.DQ_STAGE_ROW == DQ_STAGE_ROW
    base = aligned_base(RAW_SMEM)
    for wg in range(L.NWG):
        stores, sources = bwd_dq_stage_stores(L, wg)
        cell, writer = {}, {}
        for at, rows, cols in stores:
            for warp in range(4):
                for phase in range(4):
                    lanes = slice(32 * warp + 8 * phase, 32 * warp + 8 * phase + 8)
                    assert bank_conflict_free(at[lanes], 16)
            for a, r, c, warp in zip(at, rows, cols, WARP_IN_WG):
                cell[int(a)], cell[int(a) + 8] = (int(r), int(c)), (int(r), int(c) + 1)
                writer.setdefault(int(r), set()).add(int(warp))
        assert len(cell) == 64 * 64 and sorted(sources) == list(range(64))
        for r, (warp, src) in sources.items():
            assert writer[r] == {warp}
            assert src % 16 == 0 and base + L.DQ_STAGE <= src and src + 512 <= base + L.BYTES
            assert [cell[int(src) + 8 * c] for c in range(64)] == [(r, c) for c in range(64)]
    assert L.DQ_STAGE >= L.DELTA + 2 * block_m * 4 and L.DQ_STAGE % 16 == 0  # past D; bulk-copy aligned


@pytest.mark.parametrize("d_tile, block_m, block_n", BWD_CONFIGS)
def test_bwd_panel_major_dq_staging_is_the_global_panel_byte_for_byte(d_tile, block_m, block_n):
    """fixed_panels: each warp's bulk reduction reads 8 KiB of staging that holds, in order, the
    int64 values of dq_accum's panel-major rows it adds to: staging byte 8 c + 512 r of warp w is
    accumulator element (16 w + r, c) of the panel, and the destination is that element's place in
    a (batch, nheads * d_tile / 64, rows, 64) array (the layout of cupyflash.kernels.dq_fixed.
    accum_panels, whose strides panel_strides turns into the kernel's); each cell is written once,
    by the issuing warp; quarter-warp stores are conflict-free; the sources are 16-byte aligned and
    inside the layout; in every query block, the last one cut short by seqlen_q included, each row
    below seqlen_q is added by exactly one reduction and every destination lies inside the buffer
    (whole query blocks of rows)."""
    from cupyflash.kernels import dq_fixed, mma_bwd

    L = bwd_smem(d_tile, block_m, block_n, "fixed_panels")
    assert L.BYTES + 1024 == mma_bwd.wgmma_smem_bytes(d_tile, block_m, block_n, "fixed_panels") <= 227 * 1024
    batch, nheads, seqlen_q = 2, 3, 3 * block_m - 5

    rows = -(-seqlen_q // block_m) * block_m
    accum = FakeArray((batch, nheads * (d_tile // 64), rows, 64), np.int64)  # accum_panels' layout
    strides = tuple(int(x) for x in dq_fixed.panel_strides(accum))
    base = aligned_base(RAW_SMEM)
    b, h = 1, 2
    added = {}  # (panel dp, row) -> number of reductions that add it
    for m0, wg in ((m0, wg) for m0 in range(0, seqlen_q, block_m) for wg in range(L.NWG)):
        panel = wg  # one panel per warpgroup per iteration
        qp, dp = panel // (d_tile // 64), panel % (d_tile // 64)
        stores, bulks = bwd_dq_panel_stage(L, wg, qp, dp, m0, b, h, strides, seqlen_q)
        cell = {}
        for at, rows, cols in stores:
            for warp in range(4):
                for phase in range(4):
                    lanes = slice(32 * warp + 8 * phase, 32 * warp + 8 * phase + 8)
                    assert bank_conflict_free(at[lanes], 16)
            for a, r, c, w in zip(at, rows, cols, WARP_IN_WG):
                for k in (0, 1):
                    assert int(a) + 8 * k not in cell
                    cell[int(a) + 8 * k] = (int(r), int(c) + k, int(w))
        assert len(cell) == 64 * 64
        for w, (src, nbytes, dst) in bulks.items():
            assert src % 16 == 0 and base + L.DQ_STAGE <= src and src + nbytes <= base + L.BYTES
            assert dst + nbytes // 8 <= int(np.prod(accum.shape))  # padding rows, not past the buffer
            for r in range(16):
                key = (dp, m0 + 64 * qp + 16 * w + r)
                added[key] = added.get(key, 0) + 1
            for r in range(16):
                for c in range(64):
                    row, col, writer = cell[src + 512 * r + 8 * c]
                    assert (row, col, writer) == (16 * w + r, c, w)
                    # destination of element (m, 64 dp + c) of head h, batch b, panel-major
                    m = m0 + 64 * qp + row
                    want = np.ravel_multi_index((b, h * (d_tile // 64) + dp, m, c), accum.shape)
                    assert dst + 64 * r + c == want
    for dp in range(d_tile // 64):
        assert all(added.get((dp, m)) == 1 for m in range(seqlen_q))


def test_dsplit_pair_stores_are_bank_conflict_free_and_fill_the_tile():
    L = dsplit_smem(*DSPLIT_CONFIG)
    tiles = dsplit_tiles(L, 0)
    for tile in (tiles.pt, tiles.dst):
        written = []
        for j in range(L.BLOCK_M // 8):
            for h in range(2):
                addr = dsplit_pair_addr(L, tile, j, h)
                for warp in range(4):
                    assert bank_conflict_free(addr[32 * warp: 32 * warp + 32], 4)
                written.extend(addr.tolist())
        assert sorted(written) == list(range(tile, tile + L.BLOCK_N * L.BLOCK_M * 2, 4))


# ---------------------------------------------------------------------------------------------
# 2. cp_async_panels
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, dim, nthreads", CP_ASYNC_TILES)
def test_cp_async_panels_writes_each_slot_once_at_panel_offset(rows, dim, nthreads):
    rng = _rng(1, rows, dim)
    tile = aligned_base(RAW_SMEM) + 2048
    for rows_valid, headdim in ((rows, dim), (rows - 5, dim - 8), (3, 8)):
        g = rng.standard_normal((rows_valid, headdim))
        smem = new_smem()
        log = []
        cp_async_panels(smem, tile, rows, dim, nthreads, g, rows_valid, headdim, log)
        slots = [dst for _, dst, _ in log]
        assert sorted(slots) == list(range(tile, tile + rows * dim * 2, 16))  # each slot once
        assert np.isnan(smem[: tile // 2]).all() and np.isnan(smem[(tile + rows * dim * 2) // 2:]).all()
        want = np.zeros((rows, dim))
        want[:rows_valid, :headdim] = g  # zero fill past rows_valid and headdim
        assert np.array_equal(load_panels(smem, tile, rows, dim), want)
        # a quarter warp's 8 16-byte copies of one issue cover the 32 banks
        by_issue = {}
        for thread, dst, i in log:
            by_issue.setdefault((thread // 8, i), []).append(dst)
        assert all(bank_conflict_free(addrs, 16) for addrs in by_issue.values())


# ---------------------------------------------------------------------------------------------
# 3. The operands every product reads are the intended slices of the logical tiles
# ---------------------------------------------------------------------------------------------

def _check_operand(smem, desc, trans, rows, want):
    got = operand(smem, desc, major(trans), rows)
    assert got.shape == want.shape and np.array_equal(got, want)


def test_packed_accumulators_are_the_a_operand_of_the_next_product():
    """pack_a_frags / pack_p: the accumulator columns 16kk..16kk+15 of a warpgroup's 64 x N
    product, packed, are the register A operand of k-step kk (wgmma .rs)."""
    m = _rng(2).standard_normal((64, 128))
    a = pack_a_frags(acc_from_matrix(m))
    assert np.array_equal(acc_to_matrix(acc_from_matrix(m)), m)
    for kk in range(8):
        assert np.array_equal(a_fragment_matrix(a[:, kk]), m[:, 16 * kk: 16 * kk + 16])


@pytest.mark.parametrize("d_tile, block_n", FWD_SHAPES)
def test_fwd_operands_are_q_k_and_v_slices(d_tile, block_n):
    L = fwd_smem(d_tile, FWD_BLOCK_M, block_n)
    rng = _rng(3, d_tile, block_n)
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
                _check_operand(smem, step.a, step.trans_a, 64, q[64 * wg: 64 * wg + 64, 16 * kk: 16 * kk + 16])
                _check_operand(smem, step.b, step.trans_b, block_n, k[:, 16 * kk: 16 * kk + 16])
        for kk, step in enumerate(fwd_pv_steps(L, tiles)):  # O += P V: B[key][d] = V, rows: the D_TILE dims
            _check_operand(smem, step.b, step.trans_b, d_tile, v[16 * kk: 16 * kk + 16].T)


@pytest.mark.parametrize("d_tile, block_m, block_n", BWD_CONFIGS)
def test_bwd_operands_are_the_intended_slices(d_tile, block_m, block_n):
    L = bwd_smem(d_tile, block_m, block_n)
    rng = _rng(4, d_tile)
    smem = new_smem()
    tiles0 = bwd_tiles(L, 0)
    k, v = rng.standard_normal((2, block_n, d_tile))
    cp_async_panels(smem, tiles0.k, block_n, d_tile, L.NTHREADS, k, block_n, d_tile)
    cp_async_panels(smem, tiles0.v, block_n, d_tile, L.NTHREADS, v, block_n, d_tile)
    ds_t = rng.standard_normal((block_n, block_m))  # [key][query]
    store_panels(smem, tiles0.dst, ds_t)
    for stage in (0, 1):
        tiles = bwd_tiles(L, stage)
        q, do = rng.standard_normal((2, block_m, d_tile))
        cp_async_panels(smem, tiles.q, block_m, d_tile, L.NTHREADS, q, block_m, d_tile)
        cp_async_panels(smem, tiles.do, block_m, d_tile, L.NTHREADS, do, block_m, d_tile)
        for wg in range(L.NWG):
            keys = slice(64 * wg, 64 * wg + 64)
            # S^T = K_g Q^T and dP^T = V_g dO^T: A = key rows of the warpgroup, B = the queries
            for key_side, query_side, tk, tq in ((k, q, tiles.k, tiles.q), (v, do, tiles.v, tiles.do)):
                for kk, step in enumerate(bwd_st_steps(L, tk, tq, wg)):
                    cols = slice(16 * kk, 16 * kk + 16)
                    _check_operand(smem, step.a, step.trans_a, 64, key_side[keys, cols])
                    _check_operand(smem, step.b, step.trans_b, block_m, query_side[:, cols])
        # dV += P^T dO and dK += dS^T Q: B[query][d] = dO or Q
        for query_side, tile in ((do, tiles.do), (q, tiles.q)):
            for kk, step in enumerate(bwd_dkdv_steps(L, tile)):
                _check_operand(smem, step.b, step.trans_b, d_tile, query_side[16 * kk: 16 * kk + 16].T)
    # dQ panel (qp, dp) += dS K: A[query][key] = dS = (dS^T)^T, B[key][d] = K, both MN-major
    covered = []
    for wg in range(L.NWG):
        for qp, dp in bwd_dq_panels(L, wg):
            covered.append((qp, dp))
            for kk, step in enumerate(bwd_dq_steps(L, tiles0, qp, dp)):
                _check_operand(smem, step.a, step.trans_a, 64, ds_t[16 * kk: 16 * kk + 16, 64 * qp: 64 * qp + 64].T)
                _check_operand(smem, step.b, step.trans_b, 64, k[16 * kk: 16 * kk + 16, 64 * dp: 64 * dp + 64].T)
    assert sorted(covered) == [(qp, dp) for qp in range(block_m // 64) for dp in range(d_tile // 64)]


def test_dsplit_operands_are_the_intended_slices():
    L = dsplit_smem(*DSPLIT_CONFIG)
    rng = _rng(5)
    smem = new_smem()
    tiles0 = dsplit_tiles(L, 0)
    k, v = rng.standard_normal((2, L.BLOCK_N, L.D_TILE))
    cp_async_panels(smem, tiles0.k, L.BLOCK_N, L.D_TILE, L.NTHREADS, k, L.BLOCK_N, L.D_TILE)
    cp_async_panels(smem, tiles0.v, L.BLOCK_N, L.D_TILE, L.NTHREADS, v, L.BLOCK_N, L.D_TILE)
    p_t, ds_t = rng.standard_normal((2, L.BLOCK_N, L.BLOCK_M))  # [key][query]
    store_panels(smem, tiles0.pt, p_t)
    store_panels(smem, tiles0.dst, ds_t)
    for stage in (0, 1):
        tiles = dsplit_tiles(L, stage)
        q, do = rng.standard_normal((2, L.BLOCK_M, L.D_TILE))
        cp_async_panels(smem, tiles.q, L.BLOCK_M, L.D_TILE, L.NTHREADS, q, L.BLOCK_M, L.D_TILE)
        cp_async_panels(smem, tiles.do, L.BLOCK_M, L.D_TILE, L.NTHREADS, do, L.BLOCK_M, L.D_TILE)
        for wg, (key_side, query_side) in enumerate(((k, q), (v, do))):  # S^T (wg 0), dP^T (wg 1)
            for kk, step in enumerate(dsplit_step1(L, tiles, wg)):
                cols = slice(16 * kk, 16 * kk + 16)
                _check_operand(smem, step.a, step.trans_a, 64, key_side[:, cols])
                _check_operand(smem, step.b, step.trans_b, L.BLOCK_M, query_side[:, cols])
        for wg in range(2):
            half = slice(L.HALF * wg, L.HALF * wg + L.HALF)
            # dV_g += P^T dO_g: A[key][query] = P^T (K-major), B[query][d] = dO half g; dK_g likewise
            for a_side, query_side, a_tile, q_tile in ((p_t, do, tiles.pt, tiles.do), (ds_t, q, tiles.dst, tiles.q)):
                for kk, step in enumerate(dsplit_dkdv_steps(L, a_tile, q_tile, wg)):
                    rows = slice(16 * kk, 16 * kk + 16)
                    _check_operand(smem, step.a, step.trans_a, 64, a_side[:, rows])
                    _check_operand(smem, step.b, step.trans_b, L.HALF, query_side[rows, half].T)
    for wg in range(2):  # dQ_g = dS K_g: A[query][key] = (dS^T)^T, B[key][d] = K half g
        half = slice(L.HALF * wg, L.HALF * wg + L.HALF)
        for kk, step in enumerate(dsplit_dq_steps(L, tiles0, wg)):
            rows = slice(16 * kk, 16 * kk + 16)
            _check_operand(smem, step.a, step.trans_a, 64, ds_t[rows].T)
            _check_operand(smem, step.b, step.trans_b, L.HALF, k[rows, half].T)


@pytest.mark.parametrize("d_tile, block_m, block_n, k_stages", DQW_CONFIGS)
def test_dq_wgmma_operands_are_q_do_k_and_v_slices(d_tile, block_m, block_n, k_stages):
    """flash_bwd_dq_wgmma over K_STAGES + 2 key blocks (every K and V stage, each one reused) in the
    kernel's order: block j + 1's copies land before block j's products read, and, with K_STAGES
    3, before dS K_{j-1} (left running across the barrier) has read K_{j-1}. S = Q K_j^T reads the
    warpgroup's 64 Q rows and all BLOCK_N keys of K_j's stage over the head-dim k-steps (both
    K-major), dP = dO V_j^T likewise with dO and V_j's stage, dQ += dS K_j reads K_j MN-major: 16
    keys per k-step as the reduction, all D_TILE columns as N."""
    L = dqw_smem(d_tile, block_m, block_n, k_stages)
    rng = _rng(10, d_tile, block_n, k_stages)
    smem = new_smem()
    q, do = rng.standard_normal((2, block_m, d_tile))
    dqw_load_q_do(smem, L, q, do, 0, d_tile)
    blocks = k_stages + 2
    k, v = rng.standard_normal((2, blocks * block_n, d_tile))
    dqw_load_kv_block(smem, L, 0, k, v, d_tile)
    for j in range(blocks):
        if j + 1 < blocks:
            dqw_load_kv_block(smem, L, j + 1, k, v, d_tile)
        # the products that may read now: block j's, and dS K_{j-1} where it runs across the barrier
        for i in ([j - 1, j] if L.DQ_ACROSS_BARRIER and j > 0 else [j]):
            tiles = dqw_tiles(L, i)
            k_i, v_i = (x[i * block_n: (i + 1) * block_n] for x in (k, v))
            for wg in range(L.NWG) if i == j else ():  # S, dP: A = 64 query rows of wg, B = the BLOCK_N keys
                rows = slice(64 * wg, 64 * wg + 64)
                for query_side, key_side, steps in ((q, k_i, dqw_s_steps(L, tiles, wg)),
                                                    (do, v_i, dqw_dp_steps(L, tiles, wg))):
                    assert len(steps) == d_tile // 16
                    for kk, step in enumerate(steps):
                        cols = slice(16 * kk, 16 * kk + 16)
                        _check_operand(smem, step.a, step.trans_a, 64, query_side[rows, cols])
                        _check_operand(smem, step.b, step.trans_b, block_n, key_side[:, cols])
            steps = dqw_dq_steps(L, tiles)  # B[key][d] = K_j
            assert len(steps) == block_n // 16 and all(step.a is None for step in steps)
            for kk, step in enumerate(steps):
                _check_operand(smem, step.b, step.trans_b, d_tile, k_i[16 * kk: 16 * kk + 16].T)


def _store_rows_unswizzled(smem, tile: int, values: np.ndarray) -> None:
    """Panels of plain 128-byte rows: panel_offset without the XOR."""
    rows, cols = values.shape
    flat = np.concatenate([values[:, 64 * p: 64 * p + 64].ravel() for p in range(cols // 64)])
    smem[tile // 2: tile // 2 + flat.size] = flat


def _fwd_operands_survive(base_shift=0, lbo_sbo_swapped=False, k_step_bytes=32, swizzle=True) -> bool:
    """Whether the forward's Q (K-major) and V (MN-major) operands still come out right after a
    deliberate layout mistake (d128, 128-key blocks)."""
    L = fwd_smem(128, FWD_BLOCK_M, 128)
    q, v = _rng(6).standard_normal((2, 128, 128))
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


# ---------------------------------------------------------------------------------------------
# 4. One block of each kernel, product by product, against plain matmuls
# ---------------------------------------------------------------------------------------------

def _assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d_tile, block_n", FWD_SHAPES)
def test_fwd_block_emulation_matches_numpy(d_tile, block_n):
    """Four key blocks (every K and V stage, a V stage reused), the last one partial, with Q rows
    and head dimension short of the tile (zero fill): O = f(Q K^T) V for an elementwise f."""
    L = fwd_smem(d_tile, FWD_BLOCK_M, block_n)
    rng = _rng(7, d_tile, block_n)
    headdim, seqlen_q, seqlen_k = d_tile - 8, L.BLOCK_M - 3, 4 * block_n - 5
    q, k, v = (rng.standard_normal((n, headdim)) / headdim ** 0.25 for n in (seqlen_q, seqlen_k, seqlen_k))
    o = fwd_emulated(q, k, v, L, headdim, np.tanh)
    want = np.zeros((L.BLOCK_M, d_tile))
    want[:seqlen_q, :headdim] = np.tanh(q @ k.T) @ v
    _assert_close(o, want)


def _bwd_inputs(rng, seqlen_q, seqlen_k, headdim):
    q, do = (rng.standard_normal((seqlen_q, headdim)) / headdim ** 0.25 for _ in range(2))
    k, v = (rng.standard_normal((seqlen_k, headdim)) / headdim ** 0.25 for _ in range(2))
    lse, delta = rng.standard_normal((2, seqlen_q))
    return q, k, v, do, lse, delta


def _bwd_reference(q, k, v, do, lse, delta, scale):
    p_t = np.exp2(k @ q.T * scale * math.log2(math.e) - lse[None, :] * math.log2(math.e))
    ds_t = p_t * (v @ do.T - delta[None, :])
    return scale * ds_t @ q, p_t @ do, ds_t.T @ k  # dK, dV, dq_accum (unscaled: dq_convert scales)


@pytest.mark.parametrize("d_tile, block_m, block_n", BWD_CONFIGS)
def test_bwd_block_emulation_matches_numpy(d_tile, block_m, block_n):
    """flash_bwd_wgmma, one key block over two query blocks (both stages): S^T, dP^T, P^T, dS^T
    through registers and shared memory, dV, dK, dQ and the epilogue's rows and columns."""
    L = bwd_smem(d_tile, block_m, block_n)
    headdim = d_tile - 8
    q, k, v, do, lse, delta = _bwd_inputs(_rng(8, d_tile), 2 * block_m, block_n, headdim)
    scale = headdim ** -0.5
    dk, dv, dq = bwd_emulated(q, k, v, do, lse, delta, L, headdim, scale)
    for got, want in zip((dk, dv, dq), _bwd_reference(q, k, v, do, lse, delta, scale)):
        _assert_close(got, want)


def test_dsplit_block_emulation_matches_numpy():
    """flash_bwd_wgmma_dsplit, one key block over two query blocks: P^T and dS^T exchanged through
    shared memory, each warpgroup's head-dim half of dV, dK and dQ."""
    L = dsplit_smem(*DSPLIT_CONFIG)
    headdim = L.D_TILE - 8
    q, k, v, do, lse, delta = _bwd_inputs(_rng(9), 2 * L.BLOCK_M, L.BLOCK_N, headdim)
    scale = headdim ** -0.5
    dk, dv, dq = dsplit_emulated(q, k, v, do, lse, delta, L, headdim, scale)
    for got, want in zip((dk, dv, dq), _bwd_reference(q, k, v, do, lse, delta, scale)):
        _assert_close(got, want)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d_tile, block_m, block_n, k_stages", DQW_CONFIGS)
def test_dq_wgmma_p_and_ds_are_exact_zeros_where_hidden(d_tile, block_m, block_n, k_stages, causal):
    """Steps 3-4 on accumulators whose hidden entries (rows past seqlen_q, keys past seqlen_k, above
    the causal diagonal) hold +inf scores and NaN dP: P and dS are exact zeros there and the
    formula elsewhere, entry (f, e) of a thread being row row_lo + 8 (e / 2), key n0 + 8 f +
    2 (lane % 4) + e % 2 (the accumulator layout). The blocks are partial by rows only, by keys
    only, by the diagonal only (causal) and by all three."""
    L = dqw_smem(d_tile, block_m, block_n, k_stages)
    rng = _rng(12, d_tile, block_n, int(causal))
    seqlen_q, seqlen_k, scale_log2 = 2 * block_m - 3, 2 * block_m + 2, 0.3
    visible = MaskPolicy(masks.mask_for(causal), seqlen_q, seqlen_k)
    lse, delta = rng.standard_normal((2, seqlen_q))
    last = (seqlen_k - 1) // block_n * block_n
    seen = set()
    for m0, n0 in ((0, 0), (0, last), (block_m, block_m), (block_m, last)):
        for wg in range(L.NWG):
            m, n = m0 + 64 * wg + np.arange(64)[:, None], n0 + np.arange(block_n)[None, :]
            vis = visible(m, n)
            seen |= set(vis.ravel().tolist())
            s, dp = rng.standard_normal((2, 64, block_n))
            s[~vis], dp[~vis] = np.inf, np.nan
            lane, row_lo, base_log2, delta_row = dqw_thread_rows(m0, wg, lse, delta, seqlen_q, 0, 0, 1)
            p, ds = dqw_p_and_ds(L, acc_from_matrix(s), acc_from_matrix(dp), visible, m0, n0, lane, row_lo,
                                 base_log2, delta_row, scale_log2)
            inside = m < seqlen_q
            row_base = np.where(inside, lse_base_log2(lse[np.minimum(m, seqlen_q - 1)]), 0.0)
            row_delta = np.where(inside, delta[np.minimum(m, seqlen_q - 1)], 0.0)
            want_p = np.where(vis, np.exp2(np.where(vis, s, 0.0) * scale_log2 - row_base), 0.0)
            want_ds = np.where(vis, want_p * (np.where(vis, dp, 0.0) - row_delta), 0.0)
            assert np.array_equal(acc_to_matrix(p), want_p) and np.array_equal(acc_to_matrix(ds), want_ds)
    assert seen == {False, True}


def _dq_reference(q, k, v, do, lse, delta, scale, causal, window_size=(-1, -1)):
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    visible = reference.visible_keys(seqlen_q, seqlen_k, causal, window_size)
    p = np.where(visible, np.exp(q @ k.T * scale - lse[:, None]), 0.0)
    return scale * (p * (do @ v.T - delta[:, None])) @ k


@pytest.mark.parametrize("mode", ["full", "causal", "causal-short-k", "window"])
@pytest.mark.parametrize("d_tile, block_m, block_n, k_stages", DQW_CONFIGS)
def test_dq_wgmma_block_emulation_matches_numpy(d_tile, block_m, block_n, k_stages, mode):
    """flash_bwd_dq_wgmma, both query blocks of one head (the second short of BLOCK_M rows) over
    the key blocks each visits (the last one partial; every K and V stage, reused), head dim short
    of the tile, lse and D read at (batch 1, head 2) of three heads: dQ = scale (P o (dO V^T - D)) K,
    P = exp(S scale - lse), 0 where hidden. causal-short-k: seqlen_k < seqlen_q, so query block 0
    visits no key block (dQ = 0) and rows that see no key have lse = -inf."""
    L = dqw_smem(d_tile, block_m, block_n, k_stages)
    headdim, causal = d_tile - 8, mode.startswith("causal")
    # window: the second query block's walk starts past key block 0 (stages by absolute index).
    window = (block_n + 5, 3) if mode == "window" else (-1, -1)
    seqlen_q = 2 * block_m - 3
    seqlen_k = seqlen_q - block_m - 10 if mode == "causal-short-k" else seqlen_q + block_n + 7
    rng = _rng(11, d_tile, block_n, k_stages)
    q, k, v, do, _, _ = _bwd_inputs(rng, seqlen_q, seqlen_k, headdim)
    nheads, batch, head = 3, 1, 2
    lse, delta = rng.standard_normal((2, 2, nheads, seqlen_q))
    if causal:  # rows that see no key: the forward's lse = -inf
        lse[batch, head, np.arange(seqlen_q) + seqlen_k - seqlen_q < 0] = -np.inf
    scale = headdim ** -0.5
    dq, visited = np.full((seqlen_q, headdim), np.nan), []
    for m0 in range(0, seqlen_q, block_m):  # one CTA each: it writes its own rows, all of them
        visited.append([])
        cta = dqw_emulated(q, k, v, do, lse.ravel(), delta.ravel(), L, headdim, scale, causal, m0,
                           batch, head, nheads, visited[-1], window_size=window)
        rows = slice(m0, m0 + block_m)
        assert np.isnan(np.delete(cta, np.arange(seqlen_q)[rows], axis=0)).all() and not np.isnan(cta[rows]).any()
        dq[rows] = cta[rows]
    _assert_close(dq, _dq_reference(q, k, v, do, lse[batch, head], delta[batch, head], scale, causal, window))
    if mode == "window":
        assert visited[-1][0] > 0 and visited[-1] == list(range(visited[-1][0], visited[-1][-1] + 1))
        return
    assert len(visited[-1]) == math.ceil(seqlen_k / block_n) >= (k_stages + 1 if mode != "causal-short-k" else 1)
    assert (len(visited[0]) < len(visited[-1])) == causal and (visited[0] == []) == (mode == "causal-short-k")
