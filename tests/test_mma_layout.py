"""NumPy emulation of the tensor-core kernels' index math (runs on CPU, no GPU).

The PTX semantics of ldmatrix and mma.sync.m16n8k16 are written down once here, from the PTX ISA
("Warp-level matrix load instruction: ldmatrix", "Matrix Fragments for mma.m16n8k16"). The index
math of kernels_cu/mma.cuh and of the kernels (swizzle, per-lane ldmatrix addresses, cp.async
tile copies, accumulator -> A-fragment repacking, masks, epilogue) is mirrored line by line in
Python and checked against those semantics and against plain float64 attention. A bug in a
fragment layout then shows up here as an O(1) error instead of on the GPU.

Forward-kernel tests are named ``test_fwd_*``, backward-kernel tests ``test_bwd_*``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from launch_fakes import FakeArray, kernel_parameter_types
from models.mirrors import MIRRORED, mirrors, missing_statements
from cupyflash import masks, reference
from cupyflash.bench.tune import load_dev_backward

DEV_BWD = load_dev_backward()  # the backward's versions and candidates: dev/mma_bwd.py

LANES = np.arange(32)
GROUP = LANES // 4  # g: row (A, C) or column (B) of a lane's fragment elements
THREAD_IN_GROUP = LANES % 4  # t


# ---------------------------------------------------------------------------------------------
# PTX semantics (ground truth)
# ---------------------------------------------------------------------------------------------

def ldmatrix_x4(smem: np.ndarray, addr: np.ndarray, trans: bool = False) -> np.ndarray:
    """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 on a shared memory of 16-bit slots.

    ``addr``: byte address supplied by each of the 32 lanes (lanes 8i..8i+7 give the rows of
    matrix i). Returns regs[lane, i, half]: half 0 is the low 16 bits of register i."""
    assert addr.shape == (32,) and np.all(addr % 16 == 0)
    regs = np.empty((32, 4, 2), dtype=smem.dtype)
    for i in range(4):
        row_start = addr[8 * i: 8 * i + 8] // 2  # element index of each matrix row
        for half in range(2):
            if not trans:  # lane l: row l/4, columns 2(l%4), 2(l%4)+1
                regs[:, i, half] = smem[row_start[GROUP] + 2 * THREAD_IN_GROUP + half]
            else:  # lane l: rows 2(l%4), 2(l%4)+1, column l/4
                regs[:, i, half] = smem[row_start[2 * THREAD_IN_GROUP + half] + GROUP]
    return regs


def a_matrix(a: np.ndarray) -> np.ndarray:
    """The 16 x 16 A operand held by per-lane fragments a[lane, reg, half]."""
    m = np.full((16, 16), np.nan)
    g, t = GROUP, THREAD_IN_GROUP
    for half in range(2):
        m[g, 2 * t + half] = a[:, 0, half]
        m[g + 8, 2 * t + half] = a[:, 1, half]
        m[g, 2 * t + 8 + half] = a[:, 2, half]
        m[g + 8, 2 * t + 8 + half] = a[:, 3, half]
    assert not np.isnan(m).any()
    return m


def b_matrix(b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """The 16 x 8 (k x n) B operand held by per-lane fragments b0[lane, half], b1[lane, half]."""
    m = np.full((16, 8), np.nan)
    g, t = GROUP, THREAD_IN_GROUP
    for half in range(2):
        m[2 * t + half, g] = b0[:, half]
        m[2 * t + 8 + half, g] = b1[:, half]
    assert not np.isnan(m).any()
    return m


def c_from_matrix(d: np.ndarray) -> np.ndarray:
    """Per-lane accumulator fragments c[lane, 4] of a 16 x 8 matrix."""
    g, t = GROUP, THREAD_IN_GROUP
    return np.stack([d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]], axis=1)


def mma_16816(acc: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> None:
    """acc[lane, 4] += A B for mma.sync.aligned.m16n8k16.row.col (fp32 accumulate)."""
    acc += c_from_matrix(a_matrix(a) @ b_matrix(b0, b1))


def quad_reduce(x: np.ndarray, op) -> np.ndarray:
    """shfl_xor over offsets 2 and 1 (cf::group_max<4> / group_sum<4>) on per-lane values."""
    for offset in (2, 1):
        x = op(x, x[LANES ^ offset])
    return x


# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/mma.cuh
# ---------------------------------------------------------------------------------------------

def swizzled_offset(dim: int, row, chunk):
    assert dim % 64 == 0
    return (row * (dim // 8) + (chunk ^ (row & 7))) * 16


class FragmentAddress:
    def __init__(self, dim: int, lane_row, lane_chunk):
        self.row_bytes = 2 * dim
        self.row_offset = lane_row * self.row_bytes
        self.chunk_xor = (lane_chunk ^ (lane_row & 7)) * 16

    def __call__(self, tile: int, r: int, c: int):
        return (tile + self.row_offset + (self.chunk_xor ^ ((2 * c & 7) * 16))
                + r * 16 * self.row_bytes + (c >> 2) * 128)


def a_operand_address(dim: int, strip_row0: int = 0) -> FragmentAddress:
    """A from a row-major tile (Q), and B = V read with .trans: lane_row = lane % 16, chunk = lane / 16."""
    return FragmentAddress(dim, strip_row0 + (LANES & 15), LANES >> 4)


def k_operand_address(dim: int) -> FragmentAddress:
    """B = K^T from a row-major [key][dim] tile."""
    return FragmentAddress(dim, ((LANES >> 4) << 3) + (LANES & 7), (LANES >> 3) & 1)


def cp_async_tile(smem, smem_tile: int, rows: int, dim: int, nthreads: int, gmem: np.ndarray,
                  row_start: int, rows_valid: int, headdim: int, written=None) -> None:
    """Every thread's copies of cf::cp_async_tile; gmem is the (seqlen, headdim) slice and the
    tile starts at its row row_start. ``written`` (optional) counts writes per 16-byte slot."""
    chunks = dim // 8
    row_step = nthreads // chunks
    assert nthreads % chunks == 0 and rows % row_step == 0
    for thread in range(nthreads):
        row0, chunk = thread // chunks, thread % chunks
        rows_left = rows_valid - row0 if chunk * 8 < headdim else 0
        for i in range(rows // row_step):
            valid = i * row_step < rows_left
            if row_step % 8 == 0:
                dst = smem_tile + swizzled_offset(dim, row0, chunk) + i * row_step * dim * 2
            else:
                dst = smem_tile + swizzled_offset(dim, row0 + i * row_step, chunk)
            row = row_start + row0 + i * row_step
            smem[dst // 2: dst // 2 + 8] = gmem[row, chunk * 8: chunk * 8 + 8] if valid else 0
            if written is not None:
                written[dst // 16] += 1


# ---------------------------------------------------------------------------------------------
# Tests of the shared helpers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [64, 128, 256])
def test_fwd_swizzle_is_a_bijection_within_rows(dim):
    rows = np.arange(64)[:, None]
    chunks = np.arange(dim // 8)[None, :]
    off = swizzled_offset(dim, rows, chunks)
    assert sorted(off.ravel().tolist()) == list(range(0, 64 * dim * 2, 16))
    assert np.all(off // (2 * dim) == rows)  # a chunk never leaves its row


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_fwd_ldmatrix_phases_are_bank_conflict_free(dim):
    # ldmatrix serves 8 lanes' 16-byte rows per phase: their 8 chunks must cover all 32 banks.
    for fa in (a_operand_address(dim), k_operand_address(dim)):
        for r in range(2):
            for c in range(dim // 16):
                addr = fa(0, r, c)
                for phase in range(4):
                    banks = {(a // 4 + w) % 32 for a in addr[8 * phase: 8 * phase + 8] for w in range(4)}
                    assert len(banks) == 32


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_fwd_fragment_address_matches_swizzle(dim):
    for lane_row, lane_chunk in ((LANES & 15, LANES >> 4), (((LANES >> 4) << 3) + (LANES & 7), (LANES >> 3) & 1)):
        for strip in (0, 16, 48):
            fa = FragmentAddress(dim, strip + lane_row, lane_chunk)
            for r in range(4):
                for c in range(dim // 16):
                    want = swizzled_offset(dim, strip + 16 * r + lane_row, 2 * c + lane_chunk)
                    assert np.array_equal(fa(1024, r, c), 1024 + want)


@pytest.mark.parametrize("rows, dim, nthreads", [(64, 64, 128), (32, 128, 128), (128, 128, 128),
                                                 (32, 256, 256), (128, 256, 256), (64, 256, 128)])
def test_fwd_cp_async_tile_writes_each_slot_once(rows, dim, nthreads):
    rng = np.random.default_rng(0)
    for rows_valid, headdim in ((rows, dim), (rows - 5, dim - 8), (3, 8)):
        g = rng.standard_normal((rows, dim))
        smem = np.full(rows * dim, np.nan)
        written = np.zeros(rows * dim // 8, dtype=int)
        cp_async_tile(smem, 0, rows, dim, nthreads, g, 0, rows_valid, headdim, written)
        assert np.all(written == 1)
        want = np.where((np.arange(rows)[:, None] < rows_valid) & (np.arange(dim)[None, :] < headdim), g, 0)
        got = np.empty((rows, dim))
        for r in range(rows):
            for c in range(dim // 8):
                o = swizzled_offset(dim, r, c) // 2
                got[r, 8 * c: 8 * c + 8] = smem[o: o + 8]
        assert np.array_equal(got, want)


def _load_tile(rows, dim, values):
    smem = np.zeros(rows * dim)
    cp_async_tile(smem, 0, rows, dim, 128 if dim < 256 else 256, values, 0, rows, dim)
    return smem


@pytest.mark.parametrize("dim", [64, 128])
def test_fwd_qk_fragments_give_q_k_transposed(dim):
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((16, dim)), rng.standard_normal((32, dim))
    sq, sk = _load_tile(16, dim, q), _load_tile(32, dim, k)
    a_addr, k_addr = a_operand_address(dim), k_operand_address(dim)
    s = np.zeros((32, 4, 4))  # 4 fragments of 8 keys
    for kk in range(dim // 16):
        a = ldmatrix_x4(sq, a_addr(0, 0, kk))
        for f in range(0, 4, 2):
            b = ldmatrix_x4(sk, k_addr(0, f // 2, kk))
            mma_16816(s[:, f], a, b[:, 0], b[:, 1])
            mma_16816(s[:, f + 1], a, b[:, 2], b[:, 3])
    want = q @ k.T
    for f in range(4):
        np.testing.assert_allclose(s[:, f], c_from_matrix(want[:, 8 * f: 8 * f + 8]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [64, 128])
def test_fwd_pv_fragments_repack_accumulators(dim):
    rng = np.random.default_rng(2)
    p, v = rng.standard_normal((16, 32)), rng.standard_normal((32, dim))
    sv = _load_tile(32, dim, v)
    s = np.stack([c_from_matrix(p[:, 8 * f: 8 * f + 8]) for f in range(4)], axis=1)  # (32, 4, 4)
    packed = _pack_p(s[:, None])[:, 0]  # (32, 2, 4, 2)
    v_addr = a_operand_address(dim)
    o = np.zeros((32, dim // 8, 4))
    for kk in range(2):
        for f in range(0, dim // 8, 2):
            b = ldmatrix_x4(sv, v_addr(0, kk, f // 2), trans=True)
            mma_16816(o[:, f], packed[:, kk], b[:, 0], b[:, 1])
            mma_16816(o[:, f + 1], packed[:, kk], b[:, 2], b[:, 3])
    want = p @ v
    for f in range(dim // 8):
        np.testing.assert_allclose(o[:, f], c_from_matrix(want[:, 8 * f: 8 * f + 8]), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/flash_fwd_mma.cu (one warp's registers as arrays with a leading lane axis)
# ---------------------------------------------------------------------------------------------

def _pack_p(s):
    """pack_p: s[lane, strip, fragment, 4] -> A fragments [lane, strip, kstep, reg, half]."""
    lanes, strips, n_frags, _ = s.shape
    p = np.empty((lanes, strips, n_frags // 2, 4, 2))
    for kk in range(n_frags // 2):
        p[:, :, kk, 0] = s[:, :, 2 * kk, 0:2]
        p[:, :, kk, 1] = s[:, :, 2 * kk, 2:4]
        p[:, :, kk, 2] = s[:, :, 2 * kk + 1, 0:2]
        p[:, :, kk, 3] = s[:, :, 2 * kk + 1, 2:4]
    return p


def _quad_sum_scatter(x):
    """quad_sum_scatter: x[lane, rows] partial row sums -> per lane the quad's sum of row t % rows."""
    rows = x.shape[1]
    odd = (LANES & 1).astype(bool)
    a0 = np.where(odd, x[:, 1], x[:, 0])
    a0 = a0 + np.where(odd, x[:, 0], x[:, 1])[LANES ^ 1]
    if rows == 2:
        return a0 + a0[LANES ^ 2]
    a1 = np.where(odd, x[:, 3], x[:, 2])
    a1 = a1 + np.where(odd, x[:, 2], x[:, 3])[LANES ^ 1]
    high = (LANES & 2).astype(bool)
    return np.where(high, a1, a0) + np.where(high, a0, a1)[LANES ^ 2]


def _row_holder(r):
    """Lane of each lane's quad that holds the running max and sum of row r = 2 strip + half."""
    return (LANES & ~3) | r


def _exp2_base(m_new):
    return np.where(m_new == -np.inf, 0.0, m_new)


class _RowStatsAllLanes:
    """RowStats<RowState::ALL_LANES>: every lane holds m and its partial l of each row (i, h)."""

    def __init__(self, strips):
        self.m = np.full((32, strips, 2), -np.inf)
        self.l = np.zeros((32, strips, 2))

    def old_max(self, i, h):
        return self.m[:, i, h]

    def take_max(self, m_new):
        rescale = np.exp2(self.m - _exp2_base(m_new))
        self.m = m_new.copy()
        return rescale

    @staticmethod
    def rescale_row(rescale, i, h):
        return rescale[:, i, h]

    def add_sums(self, rescale, row_sum):
        self.l = self.l * rescale + row_sum

    def get(self, i, h):
        return self.m[:, i, h], quad_reduce(self.l[:, i, h], np.add)


class _RowStatsOneLane:
    """RowStats<RowState::ONE_LANE>: lane t of a quad holds m and the full l of row t % (2 strips)."""

    def __init__(self, strips):
        self.own = THREAD_IN_GROUP % (2 * strips)
        self.m = np.full(32, -np.inf)
        self.l = np.zeros(32)

    def old_max(self, i, h):
        return np.where(self.own == 2 * i + h, self.m, -np.inf)

    def take_max(self, m_new):
        own_m_new = m_new[LANES, self.own // 2, self.own % 2]
        rescale = np.exp2(self.m - _exp2_base(own_m_new))
        self.m = own_m_new
        return rescale

    @staticmethod
    def rescale_row(rescale, i, h):
        return rescale[_row_holder(2 * i + h)]

    def add_sums(self, rescale, row_sum):
        self.l = self.l * rescale + _quad_sum_scatter(row_sum.reshape(32, -1))  # row r = 2 i + h

    def get(self, i, h):
        holder = _row_holder(2 * i + h)
        return self.m[holder], self.l[holder]


ROW_STATS = {"all_lanes": _RowStatsAllLanes, "one_lane": _RowStatsOneLane}


def _fwd_block(q, k, v, o, lse, *, batch, head, m_block, group, scale_log2, mask,
               d_tile, block_m, block_n, warps, stages, q_in_regs, row_state):
    """One thread block of flash_fwd_mma, in float64 (no 16-bit rounding); ``mask`` is the
    kernel's policy (cupyflash.masks, the twin of mask.cuh)."""
    seqlen_q, seqlen_k, headdim = q.shape[1], k.shape[1], q.shape[3]
    nthreads, strips = 32 * warps, block_m // (16 * warps)
    n_frags, d_frags = block_n // 8, d_tile // 8
    q_bytes, kv_tile_bytes = block_m * d_tile * 2, block_n * d_tile * 2
    smem = np.full((q_bytes + stages * 2 * kv_tile_bytes) // 2, np.nan)  # 16-bit slots
    k_tile = lambda stage: q_bytes + stage * 2 * kv_tile_bytes
    v_tile = lambda stage: k_tile(stage) + kv_tile_bytes

    head_kv = head // group
    m0 = m_block * block_m
    n_end = mask.key_end(m0, block_m, seqlen_q, seqlen_k)
    j_begin = mask.key_begin(m0, seqlen_q, seqlen_k) // block_n
    lo_off, hi_off = mask.offsets(seqlen_q, seqlen_k)
    qs, ks, vs = q[batch, :, head], k[batch, :, head_kv], v[batch, :, head_kv]

    def load_kv_tile(block, stage):
        n0 = block * block_n
        cp_async_tile(smem, k_tile(stage), block_n, d_tile, nthreads, ks, n0, seqlen_k - n0, headdim)
        cp_async_tile(smem, v_tile(stage), block_n, d_tile, nthreads, vs, n0, seqlen_k - n0, headdim)

    cp_async_tile(smem, 0, block_m, d_tile, nthreads, qs, m0, seqlen_q - m0, headdim)
    for ahead in range(stages - 1):
        j = j_begin + ahead
        if j * block_n < n_end:
            load_kv_tile(j, j % stages)

    a_addr, k_addr = a_operand_address(d_tile), k_operand_address(d_tile)
    state = []
    for warp in range(warps):
        strip_row0 = warp * 16 * strips
        q_strips = strip_row0 * d_tile * 2
        q_frag = None
        if q_in_regs:
            q_frag = [[ldmatrix_x4(smem, a_addr(q_strips, i, kk)) for kk in range(d_tile // 16)]
                      for i in range(strips)]
        state.append(dict(strip_row0=strip_row0, q_strips=q_strips, q_frag=q_frag,
                          o=np.zeros((32, strips, d_frags, 4)), stats=ROW_STATS[row_state](strips)))

    for j in range(j_begin, (n_end + block_n - 1) // block_n):  # j * block_n < n_end
        stage = j % stages
        ahead = j + stages - 1
        if ahead * block_n < n_end:
            load_kv_tile(ahead, ahead % stages)
        n0 = j * block_n
        masked = mask.keys_partial(m0, block_m, n0, block_n, seqlen_q, seqlen_k)
        for w in state:
            # mma_qk
            s = np.zeros((32, strips, n_frags, 4))
            for kk in range(d_tile // 16):
                a = [w["q_frag"][i][kk] if q_in_regs else ldmatrix_x4(smem, a_addr(w["q_strips"], i, kk))
                     for i in range(strips)]
                for f in range(0, n_frags, 2):
                    b = ldmatrix_x4(smem, k_addr(k_tile(stage), f // 2, kk))
                    for i in range(strips):
                        mma_16816(s[:, i, f], a[i], b[:, 0], b[:, 1])
                        mma_16816(s[:, i, f + 1], a[i], b[:, 2], b[:, 3])
            # scale_and_mask
            s *= scale_log2
            if masked:
                for i in range(strips):
                    for h in range(2):
                        row = m0 + w["strip_row0"] + 16 * i + 8 * h + GROUP
                        key_end = np.minimum(seqlen_k, row + 1 + hi_off) if mask.HAS_RIGHT else seqlen_k
                        key_begin = row + lo_off if mask.HAS_LEFT else 0
                        for f in range(n_frags):
                            for e in range(2):
                                key = n0 + 8 * f + 2 * THREAD_IN_GROUP + e
                                hidden = (key >= key_end) | (key < key_begin)
                                s[:, i, f, 2 * h + e] = np.where(hidden, -np.inf, s[:, i, f, 2 * h + e])
            # row_max
            stats = w["stats"]
            m_new = np.empty((32, strips, 2))
            for i in range(strips):
                for h in range(2):
                    x = np.maximum(stats.old_max(i, h), s[:, i, :, 2 * h: 2 * h + 2].max(axis=(1, 2)))
                    m_new[:, i, h] = quad_reduce(x, np.maximum)
            # softmax_rescale
            rescale = stats.take_max(m_new)
            row_sum = np.empty((32, strips, 2))
            for i in range(strips):
                for h in range(2):
                    p = np.exp2(s[:, i, :, 2 * h: 2 * h + 2] - _exp2_base(m_new[:, i, h])[:, None, None])
                    s[:, i, :, 2 * h: 2 * h + 2] = p
                    row_sum[:, i, h] = p.sum(axis=(1, 2))
                    w["o"][:, i, :, 2 * h: 2 * h + 2] *= stats.rescale_row(rescale, i, h)[:, None, None]
            stats.add_sums(rescale, row_sum)
            # pack_p, mma_pv
            p = _pack_p(s)
            for kk in range(n_frags // 2):
                for f in range(0, d_frags, 2):
                    b = ldmatrix_x4(smem, a_addr(v_tile(stage), kk, f // 2), trans=True)
                    for i in range(strips):
                        mma_16816(w["o"][:, i, f], p[:, i, kk], b[:, 0], b[:, 1])
                        mma_16816(w["o"][:, i, f + 1], p[:, i, kk], b[:, 2], b[:, 3])

    # store_o, staging through the Q tile
    for w in state:
        strip_row0 = w["strip_row0"]
        for i in range(strips):
            for h in range(2):
                m_row, l_row = w["stats"].get(i, h)
                inv_l = np.where(l_row > 0, 1.0 / np.where(l_row > 0, l_row, 1.0), 0.0)
                row = strip_row0 + 16 * i + 8 * h + GROUP
                writes = (THREAD_IN_GROUP == 0) & (m0 + row < seqlen_q)
                with np.errstate(divide="ignore"):
                    value = np.where(l_row > 0, (m_row + np.log2(l_row)) * math.log(2), -np.inf)
                lse[batch, head, (m0 + row)[writes]] = value[writes]
                for f in range(d_frags):
                    addr = swizzled_offset(d_tile, row, f) + 4 * THREAD_IN_GROUP
                    smem[addr // 2] = w["o"][:, i, f, 2 * h] * inv_l
                    smem[addr // 2 + 1] = w["o"][:, i, f, 2 * h + 1] * inv_l
        chunks = d_tile // 8
        for it in range(16 * strips * chunks // 32):
            idx = LANES + 32 * it
            for lane in range(32):
                row, chunk = strip_row0 + idx[lane] // chunks, idx[lane] % chunks
                if m0 + row < seqlen_q and chunk * 8 < headdim:
                    src = swizzled_offset(d_tile, row, chunk) // 2
                    o[batch, m0 + row, head, chunk * 8: chunk * 8 + 8] = smem[src: src + 8]


def _fwd_emulated(q, k, v, *, causal, scale, d_tile, block_m, block_n, warps, stages=2, q_in_regs=False,
                  row_state="one_lane", window_size=(-1, -1)):
    batch, seqlen_q, nheads, headdim = q.shape
    o = np.full(q.shape, np.nan)
    lse = np.full((batch, nheads, seqlen_q), np.nan)
    for b in range(batch):
        for h in range(nheads):
            for m_block in range(math.ceil(seqlen_q / block_m)):
                _fwd_block(q, k, v, o, lse, batch=b, head=h, m_block=m_block, group=nheads // k.shape[2],
                           scale_log2=scale * math.log2(math.e), mask=masks.mask_for(causal, window_size),
                           d_tile=d_tile,
                           block_m=block_m, block_n=block_n, warps=warps, stages=stages, q_in_regs=q_in_regs,
                           row_state=row_state)
    return o, lse


def _attention_reference(q, k, v, *, causal, scale, window_size=(-1, -1)):
    """float64 attention with the project's conventions (bottom-right causal and windows, empty
    rows -> 0, -inf)."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, group = k.shape[1], nheads // k.shape[2]
    kk = np.repeat(k, group, axis=2)
    vv = np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = np.where(reference.visible_keys(seqlen_q, seqlen_k, causal, window_size), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / np.where(l > 0, l, 1.0), vv)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m[..., 0], -np.inf)
    return o, lse


# The default configurations of cupyflash.kernels.mma_fwd plus the register-resident Q and
# 3-stage variants, in both row-state layouts; small head dims inside each D_TILE exercise the
# zero-filled columns.
_FWD_CASES = [
    # (d_tile, block_m, block_n, warps, stages, q_in_regs, row_state,
    #  headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal)
    (64, 128, 64, 4, 2, False, "all_lanes", 40, 1, 150, 97, 2, 1, False),  # default
    (64, 128, 64, 4, 2, False, "all_lanes", 64, 1, 70, 200, 1, 1, True),
    (64, 128, 64, 4, 2, False, "all_lanes", 64, 2, 200, 137, 1, 1, True),  # row 127 sees exactly key 64
    (64, 128, 64, 4, 2, False, "one_lane", 64, 2, 200, 137, 1, 1, True),
    (64, 128, 64, 4, 2, True, "all_lanes", 48, 1, 130, 190, 2, 1, True),
    (64, 128, 64, 8, 2, True, "one_lane", 56, 1, 130, 130, 1, 1, True),
    (64, 128, 64, 8, 2, False, "all_lanes", 64, 1, 100, 130, 1, 1, True),  # one strip per warp
    (128, 128, 32, 4, 2, False, "one_lane", 96, 1, 140, 75, 2, 2, False),
    (128, 128, 32, 4, 3, False, "one_lane", 128, 1, 200, 60, 1, 1, True),  # seqlen_q > seqlen_k: empty rows
    (128, 128, 64, 4, 2, False, "one_lane", 120, 1, 150, 190, 2, 1, True),  # sm_90 default
    (128, 128, 64, 4, 2, False, "one_lane", 128, 1, 130, 70, 1, 1, True),  # empty rows, 2 strips per warp
    (128, 128, 64, 4, 2, False, "all_lanes", 128, 1, 130, 70, 1, 1, True),
    (256, 128, 32, 8, 2, False, "one_lane", 136, 1, 40, 70, 1, 1, True),
    # Sliding windows (left, right): the walk starts past block 0, rows of a visited block see
    # none of its keys, one-sided and causal windows.
    (64, 128, 64, 4, 2, True, "all_lanes", 64, 1, 300, 300, 1, 1, (70, 0)),
    (64, 128, 64, 4, 2, False, "one_lane", 64, 1, 260, 330, 1, 1, (0, 0)),
    (128, 128, 32, 4, 3, False, "one_lane", 72, 1, 280, 200, 1, 1, (40, 17)),  # 3 stages from block j > 0
    (128, 128, 64, 4, 2, False, "one_lane", 128, 1, 200, 300, 1, 1, (100, -1)),
    (128, 128, 64, 4, 2, False, "all_lanes", 128, 1, 150, 150, 1, 1, (-1, 30)),
]


@pytest.mark.parametrize("case", _FWD_CASES, ids=lambda c: "d{0}_bm{1}_bn{2}_w{3}_s{4}_{5}_{6}_hd{7}".format(
    *c[:5], "qreg" if c[5] else "qsmem", c[6], c[7]) + (
        f"_window{c[-1][0]}_{c[-1][1]}" if isinstance(c[-1], tuple) else "_causal" if c[-1] else ""))
def test_fwd_block_emulation_matches_reference(case):
    (d_tile, block_m, block_n, warps, stages, q_in_regs, row_state,
     headdim, batch, sq, sk, nheads, nheads_kv, causal) = case
    window = causal if isinstance(causal, tuple) else (-1, -1)
    causal = causal is True
    rng = np.random.default_rng(sum(case[:6]) + sum(case[7:9]))
    q = rng.standard_normal((batch, sq, nheads, headdim))
    k = rng.standard_normal((batch, sk, nheads_kv, headdim))
    v = rng.standard_normal((batch, sk, nheads_kv, headdim))
    scale = 1 / math.sqrt(headdim)
    o, lse = _fwd_emulated(q, k, v, causal=causal, scale=scale, d_tile=d_tile, block_m=block_m,
                           block_n=block_n, warps=warps, stages=stages, q_in_regs=q_in_regs,
                           row_state=row_state, window_size=window)
    o_ref, lse_ref = _attention_reference(q, k, v, causal=causal, scale=scale, window_size=window)
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "some output element was never written"
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-10, atol=1e-10)
    if causal and sq > sk:
        empty = sq - sk  # rows that see no key
        assert np.all(o[:, :empty] == 0) and np.all(lse[:, :, :empty] == -np.inf)


@pytest.mark.parametrize("rows", [2, 4])
def test_fwd_quad_sum_scatter_gives_each_row_to_its_holder(rows):
    x = np.random.default_rng(rows).standard_normal((32, rows))
    got = _quad_sum_scatter(x)
    quad_sums = x.reshape(8, 4, rows).sum(axis=1)  # [quad, row]
    np.testing.assert_allclose(got, quad_sums[GROUP, THREAD_IN_GROUP % rows], rtol=1e-12)
    for r in range(rows):  # the lane store_o and the rescale broadcast read holds that row
        np.testing.assert_allclose(got[_row_holder(r)], quad_sums[GROUP, r], rtol=1e-12)


@pytest.mark.parametrize("row_state", sorted(ROW_STATS))
@pytest.mark.parametrize("strips", [1, 2])
def test_fwd_distributed_running_max_and_sum(strips, row_state):
    """The online softmax with m and l of each row kept in either RowStats layout (row_max,
    softmax_rescale, store_o's get) gives the per-row max and sum of exp2 over all key blocks,
    fully masked blocks included, on every lane of the row's quad."""
    rng = np.random.default_rng(strips)
    n_frags, n_blocks = 4, 5
    blocks = rng.standard_normal((n_blocks, 32, strips, n_frags, 4)) * 4
    blocks[0, :, 0, :, 0:2] = -np.inf  # strip 0, half 0: nothing visible in block 0
    blocks[:, :, strips - 1, :, 2:4] = -np.inf  # last strip, half 1: never anything visible
    stats = ROW_STATS[row_state](strips)
    for s in blocks:
        m_new = np.empty((32, strips, 2))
        for i in range(strips):
            for h in range(2):
                x = np.maximum(stats.old_max(i, h), s[:, i, :, 2 * h: 2 * h + 2].max(axis=(1, 2)))
                m_new[:, i, h] = quad_reduce(x, np.maximum)
        rescale = stats.take_max(m_new)
        row_sum = np.exp2(s - _exp2_base(m_new)[:, :, None, :].repeat(2, axis=3)).sum(axis=2)  # [lane, i, 4]
        stats.add_sums(rescale, row_sum[:, :, 0::2] + row_sum[:, :, 1::2])
    for i in range(strips):
        for h in range(2):
            row = blocks[:, :, i, :, 2 * h: 2 * h + 2].transpose(1, 0, 2, 3).reshape(8, 4, -1)  # [quad, lane, keys]
            row = row.reshape(8, -1)
            m_ref = row.max(axis=1)
            with np.errstate(invalid="ignore"):
                l_ref = np.where(np.isfinite(m_ref), np.exp2(row - np.where(np.isfinite(m_ref), m_ref, 0)[:, None]).sum(axis=1), 0.0)
            m_row, l_row = stats.get(i, h)
            np.testing.assert_array_equal(m_row, m_ref[GROUP])
            np.testing.assert_allclose(l_row, l_ref[GROUP], rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# Mirror of kernels_cu/flash_bwd_mma.cu (backward). Registers are arrays with a leading lane
# axis; a CTA is emulated phase by phase (all warps do one step, then the next), in the order
# the kernel's barriers impose. Everything is float64 (no 16-bit rounding), so the emulated
# gradients must match the float64 reference to ~1e-10: any index error is O(1).
# ---------------------------------------------------------------------------------------------

LDM_ROW_X, LDM_CHUNK_X = LANES & 15, LANES >> 4
LDM_ROW_Y, LDM_CHUNK_Y = (LANES & 7) + ((LANES >> 4) << 3), (LANES >> 3) & 1


def bwd_tile_offset(cols: int, row, chunk):
    """tile_offset<COLS>: mma.cuh's swizzle for rows >= 128 bytes, (row / 2) % 4 for 64-byte rows."""
    if cols >= 64:
        return swizzled_offset(cols, row, chunk)
    assert cols == 32
    return (row * 4 + (chunk ^ ((row >> 1) & 3))) * 16


def bwd_tile_step(cols: int, lane_off, rows: int, chunks: int):
    if cols >= 64:
        return (lane_off ^ ((chunks & 7) * 16)) + rows * cols * 2 + (chunks >> 3) * 128
    assert chunks == 0
    return lane_off + rows * cols * 2


def bwd_mma_ABt(acc, smem, n, k, dim_a, dim_b, tile_a, a_row0, tile_b, k0):
    a_lane = bwd_tile_offset(dim_a, a_row0 + LDM_ROW_X, k0 // 8 + LDM_CHUNK_X)
    b_lane = bwd_tile_offset(dim_b, LDM_ROW_Y, k0 // 8 + LDM_CHUNK_Y)
    for kk in range(k // 16):
        a = ldmatrix_x4(smem, tile_a + bwd_tile_step(dim_a, a_lane, 0, 2 * kk))
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + bwd_tile_step(dim_b, b_lane, 16 * nn, 2 * kk))
            mma_16816(acc[:, 2 * nn], a, b[:, 0], b[:, 1])
            mma_16816(acc[:, 2 * nn + 1], a, b[:, 2], b[:, 3])


def bwd_mma_AB_regs(acc, a, smem, n, k, dim_b, tile_b, b_col0):
    b_lane = bwd_tile_offset(dim_b, LDM_ROW_X, b_col0 // 8 + LDM_CHUNK_X)
    for kk in range(k // 16):
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + bwd_tile_step(dim_b, b_lane, 16 * kk, 2 * nn), trans=True)
            mma_16816(acc[:, 2 * nn], a[:, kk], b[:, 0], b[:, 1])
            mma_16816(acc[:, 2 * nn + 1], a[:, kk], b[:, 2], b[:, 3])


def bwd_mma_AtB(acc, smem, n, k, dim_a, dim_b, tile_a, a_col0, tile_b, b_col0):
    a_lane = bwd_tile_offset(dim_a, LDM_ROW_Y, a_col0 // 8 + LDM_CHUNK_Y)
    b_lane = bwd_tile_offset(dim_b, LDM_ROW_X, b_col0 // 8 + LDM_CHUNK_X)
    for kk in range(k // 16):
        a = ldmatrix_x4(smem, tile_a + bwd_tile_step(dim_a, a_lane, 16 * kk, 0), trans=True)
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + bwd_tile_step(dim_b, b_lane, 16 * kk, 2 * nn), trans=True)
            mma_16816(acc[:, 2 * nn], a, b[:, 0], b[:, 1])
            mma_16816(acc[:, 2 * nn + 1], a, b[:, 2], b[:, 3])


def bwd_pack_a_frags(c):
    """pack_a_frags: c[lane, K/8, 4] -> A fragments [lane, K/16, reg, half] (half 0 = lo)."""
    a = np.empty((32, c.shape[1] // 2, 4, 2))
    a[:, :, 0], a[:, :, 1] = c[:, 0::2, 0:2], c[:, 0::2, 2:4]
    a[:, :, 2], a[:, :, 3] = c[:, 1::2, 0:2], c[:, 1::2, 2:4]
    return a


def bwd_store_fragment_pairs(smem, tile, cols, row0, col0, pairs):
    """st_shared_b32 of {lo, hi} at (row0 + lane/4, col0 + 2 (lane%4)); pairs[lane, 2]."""
    addr = tile + bwd_tile_offset(cols, row0 + GROUP, col0 // 8) + 2 * (2 * THREAD_IN_GROUP)
    assert np.all(addr % 4 == 0)
    smem[addr // 2], smem[addr // 2 + 1] = pairs[:, 0], pairs[:, 1]


def bwd_stage_acc(smem, tile, dim, row0, col0, acc, mult):
    for j in range(acc.shape[1]):
        bwd_store_fragment_pairs(smem, tile, dim, row0, col0 + 8 * j, acc[:, j, 0:2] * mult)
        bwd_store_fragment_pairs(smem, tile, dim, row0 + 8, col0 + 8 * j, acc[:, j, 2:4] * mult)


def bwd_store_tile(out_rows, smem, tile, rows, dim, nthreads, rows_valid, headdim):
    """store_tile: out_rows[r] (a (rows_valid, headdim) view) from the swizzled tile."""
    chunks = dim // 8
    assert (rows * chunks) % nthreads == 0
    for i in range(rows * chunks // nthreads):
        for thread in range(nthreads):
            idx = thread + i * nthreads
            row, chunk = idx // chunks, idx % chunks
            if row < rows_valid and chunk * 8 < headdim:
                src = (tile + bwd_tile_offset(dim, row, chunk)) // 2
                out_rows[row, chunk * 8: chunk * 8 + 8] = smem[src: src + 8]


def bwd_dkdv_layout(d_tile, block_m, m_sub, block_n, nwarps, warps_d, atomic_dq):
    """DkdvSmem<...> of flash_bwd_mma.cu, field by field."""
    kv_tile, q_tile = block_n * d_tile * 2, block_m * d_tile * 2
    lay = dict(KV_TILE=kv_tile, Q_TILE=q_tile, K=0)
    lay["V"] = lay["K"] + kv_tile
    lay["Q"] = lay["V"] + kv_tile
    lay["DO"] = lay["Q"] + 2 * q_tile
    lay["DS"] = lay["DO"] + 2 * q_tile
    lay["XCHG"] = lay["DS"] + (block_n * block_m * 2 if atomic_dq else 0)
    lay["XCHG_WARP"] = 2 * (m_sub // 8) * 32 * 16 if warps_d > 1 else 0
    lay["LSE"] = lay["XCHG"] + nwarps * lay["XCHG_WARP"]
    lay["DELTA"] = lay["LSE"] + 2 * block_m * 4
    lay["BYTES"] = lay["DELTA"] + 2 * block_m * 4
    return lay


def bwd_dq_layout(d_tile, block_m, block_n):
    """DqSmem<...> of flash_bwd_mma.cu."""
    q_tile, kv_tile = block_m * d_tile * 2, block_n * d_tile * 2
    lay = dict(Q_TILE=q_tile, KV_TILE=kv_tile, Q=0, DO=q_tile, K=2 * q_tile)
    lay["V"] = lay["K"] + 2 * kv_tile
    lay["BYTES"] = lay["V"] + 2 * kv_tile
    return lay


def _visible(m, n, seqlen_q, seqlen_k, mask):
    """mask.cuh's visible(i, j), elementwise: the policy's bounds (cupyflash.masks) in the kernel's form."""
    lo, hi = mask.offsets(seqlen_q, seqlen_k)
    ok = (m < seqlen_q) & (n < seqlen_k)
    if mask.HAS_RIGHT:
        ok = ok & (n <= m + hi)
    if mask.HAS_LEFT:
        ok = ok & (n >= m + lo)
    return ok


@mirrors("flash_bwd_mma.cu",
         "const bool partial = mask.partial(m0_sub, M_SUB, n0, BLOCK_N);",
         "const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);")
def _partial(m0, bm, n0, bn, seqlen_q, seqlen_k, mask):
    return mask.partial(m0, bm, n0, bn, seqlen_q, seqlen_k)


@mirrors("flash_bwd_mma.cu",
         "const int m_block_first = mask.query_begin(n0) / BLOCK_M;",
         "const int m_block_end = (mask.query_end(n0, BLOCK_N) + BLOCK_M - 1) / BLOCK_M;")
def _query_block_range(mask, n0, block_n, block_m, seqlen_q, seqlen_k):
    """(m_block_first, m_blocks) of a dK/dV CTA: the query blocks that see some key of its block."""
    m_block_first = mask.query_begin(n0, seqlen_q, seqlen_k) // block_m
    m_block_end = -(-mask.query_end(n0, block_n, seqlen_q, seqlen_k) // block_m)
    return m_block_first, max(0, m_block_end - m_block_first)


@mirrors("flash_bwd_mma.cu",
         "const int j_begin = mask.key_begin(m0) / BLOCK_N;",
         "const int j_end = (mask.key_end(m0, min(BLOCK_M, seqlen_q - m0)) + BLOCK_N - 1) / BLOCK_N;")
def _key_block_range(mask, m0, block_m, block_n, seqlen_q, seqlen_k):
    """[j_begin, j_end) of a dQ CTA: the key blocks some existing row of its block sees."""
    j_begin = mask.key_begin(m0, seqlen_q, seqlen_k) // block_n
    j_end = -(-mask.key_end(m0, min(block_m, seqlen_q - m0), seqlen_q, seqlen_k) // block_n)
    return j_begin, j_end


def _lse_base_log2(lse):
    return np.where(lse == -np.inf, 0.0, lse * math.log2(math.e))


# The policy twin's per-row bounds that the models above use are mask.cuh's.
mirrors("mask.cuh", "return RIGHT ? min(seqlen_k, i + 1 + hi_off) : seqlen_k;")(masks.Mask.row_key_end)
mirrors("mask.cuh", "return RIGHT ? j - hi_off : 0;")(masks.Mask.row_query_begin)
mirrors("mask.cuh", "return LEFT && dj - di < o.lo_slack;")(masks.Mask.hidden_left)


@pytest.mark.parametrize("source", ["flash_bwd_mma.cu", "flash_bwd_fused_mma.cu", "mask.cuh"])
def test_bwd_mask_mirrors_match_the_kernel_sources(source):
    """Every mask statement the backward models name is still in its source (whitespace aside):
    an edit of a walk or an element test there fails here until its model follows."""
    assert any(m.source == source for m in MIRRORED)
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"


@mirrors("flash_bwd_mma.cu",
         "const bool hidden = partial && !mask.visible(m0_sub + c + (e & 1), n0 + row0 + lane / 4 + 8 * (e >> 1));")
def _dkdv_block(q, k, v, do, lse, delta, dk, dv, dq_accum, *, batch, head_kv, n_block, group, scale,
                mask, d_tile, block_m, m_sub, block_n, nwarps, warps_d):
    """One CTA of flash_bwd_dkdv_mma (dq_accum is None unless ATOMIC_DQ)."""
    seqlen_q, nheads, headdim = q.shape[1], q.shape[2], q.shape[3]
    seqlen_k = k.shape[1]
    atomic_dq = dq_accum is not None
    nthreads, dw = 32 * nwarps, d_tile // warps_d
    dq_warps_m = block_m // 16
    dq_cols = d_tile // (nwarps // dq_warps_m)
    dq_pass = min(dq_cols, 32)
    assert block_n == 16 * nwarps // warps_d and block_m % m_sub == 0
    lay = bwd_dkdv_layout(d_tile, block_m, m_sub, block_n, nwarps, warps_d, atomic_dq)
    smem = np.full(lay["BYTES"] // 2, np.nan)  # 16-bit tiles, by byte address // 2
    smem32 = np.full(lay["BYTES"] // 4, np.nan)  # float slots (lse, D, partial sums), byte // 4
    scale_log2 = scale * math.log2(math.e)
    n0 = n_block * block_n
    m_block_first, m_blocks = _query_block_range(mask, n0, block_n, block_m, seqlen_q, seqlen_k)
    n_iters = group * m_blocks

    def load_query_block(it, stage):
        head = head_kv * group + it // m_blocks
        m0 = (m_block_first + it % m_blocks) * block_m
        cp_async_tile(smem, lay["Q"] + stage * lay["Q_TILE"], block_m, d_tile, nthreads, q[batch, :, head],
                      m0, seqlen_q - m0, headdim)
        cp_async_tile(smem, lay["DO"] + stage * lay["Q_TILE"], block_m, d_tile, nthreads, do[batch, :, head],
                      m0, seqlen_q - m0, headdim)
        for i in range(2 * block_m):
            r, is_lse = i % block_m, i < block_m
            dst = (lay["LSE"] if is_lse else lay["DELTA"]) + (stage * block_m + r) * 4
            stats = (lse if is_lse else delta)[batch, head]
            smem32[dst // 4] = stats[m0 + r] if m0 + r < seqlen_q else 0.0

    cp_async_tile(smem, lay["K"], block_n, d_tile, nthreads, k[batch, :, head_kv], n0, seqlen_k - n0, headdim)
    cp_async_tile(smem, lay["V"], block_n, d_tile, nthreads, v[batch, :, head_kv], n0, seqlen_k - n0, headdim)
    if n_iters > 0:
        load_query_block(0, 0)

    warps = range(nwarps)
    key_group = [w // warps_d for w in warps]
    d_part = [w % warps_d for w in warps]
    row0 = [16 * g for g in key_group]
    dk_acc = np.zeros((nwarps, 32, dw // 8, 4))
    dv_acc = np.zeros((nwarps, 32, dw // 8, 4))

    def swap_partial_sums(acc, xchg):
        for w in warps:  # all warps store, then the pair barrier, then all read
            for j in range(acc.shape[2]):
                slot = (xchg + w * lay["XCHG_WARP"] + LANES * 16 + j * 512) // 4
                for e in range(4):
                    smem32[slot + e] = acc[w, :, j, e]
        theirs = np.empty_like(acc)
        for w in warps:
            for j in range(acc.shape[2]):
                slot = (xchg + (w ^ 1) * lay["XCHG_WARP"] + LANES * 16 + j * 512) // 4
                for e in range(4):
                    theirs[w, :, j, e] = smem32[slot + e]
        acc += theirs

    for it in range(n_iters):
        stage = it & 1
        if it + 1 < n_iters:
            load_query_block(it + 1, stage ^ 1)
        head = head_kv * group + it // m_blocks
        m0 = (m_block_first + it % m_blocks) * block_m
        s_q, s_do = lay["Q"] + stage * lay["Q_TILE"], lay["DO"] + stage * lay["Q_TILE"]
        s_lse, s_delta = (lay["LSE"] + stage * block_m * 4) // 4, (lay["DELTA"] + stage * block_m * 4) // 4
        for mc0 in range(0, block_m, m_sub):
            s_q_sub, s_do_sub = s_q + mc0 * d_tile * 2, s_do + mc0 * d_tile * 2
            m0_sub = m0 + mc0
            partial = _partial(m0_sub, m_sub, n0, block_n, seqlen_q, seqlen_k, mask)
            # Step 1
            s_acc = np.zeros((nwarps, 32, m_sub // 8, 4))
            for w in warps:
                bwd_mma_ABt(s_acc[w], smem, m_sub, dw, d_tile, d_tile, lay["K"], row0[w], s_q_sub, d_part[w] * dw)
            if warps_d == 2:
                swap_partial_sums(s_acc, lay["XCHG"])
            # Step 2
            hidden = np.zeros((nwarps, 32, m_sub // 8, 4), dtype=bool)
            for w in warps:
                for j in range(m_sub // 8):
                    c = 8 * j + 2 * THREAD_IN_GROUP
                    for e in range(4):
                        base = _lse_base_log2(smem32[s_lse + mc0 + c + (e & 1)])
                        p = np.exp2(s_acc[w, :, j, e] * scale_log2 - base)
                        m = m0_sub + c + (e & 1)
                        n = n0 + row0[w] + GROUP + 8 * (e >> 1)
                        hidden[w, :, j, e] = partial & ~_visible(m, n, seqlen_q, seqlen_k, mask)
                        s_acc[w, :, j, e] = np.where(hidden[w, :, j, e], 0.0, p)
            # Step 3
            for w in warps:
                bwd_mma_AB_regs(dv_acc[w], bwd_pack_a_frags(s_acc[w]), smem, dw, m_sub, d_tile, s_do_sub,
                                d_part[w] * dw)
            # Step 4
            dp_acc = np.zeros((nwarps, 32, m_sub // 8, 4))
            for w in warps:
                bwd_mma_ABt(dp_acc[w], smem, m_sub, dw, d_tile, d_tile, lay["V"], row0[w], s_do_sub, d_part[w] * dw)
            if warps_d == 2:
                swap_partial_sums(dp_acc, lay["XCHG"] + m_sub // 8 * 512)
            # Step 5, 6 and the dS^T store
            for w in warps:
                for j in range(m_sub // 8):
                    c = 8 * j + 2 * THREAD_IN_GROUP
                    for e in range(4):
                        d = smem32[s_delta + mc0 + c + (e & 1)]
                        ds = s_acc[w, :, j, e] * (dp_acc[w, :, j, e] - d)
                        dp_acc[w, :, j, e] = np.where(hidden[w, :, j, e], 0.0, ds)
                ds_frag = bwd_pack_a_frags(dp_acc[w])
                bwd_mma_AB_regs(dk_acc[w], ds_frag, smem, dw, m_sub, d_tile, s_q_sub, d_part[w] * dw)
                if atomic_dq and d_part[w] == 0:
                    for kk in range(m_sub // 16):
                        col = mc0 + 16 * kk
                        bwd_store_fragment_pairs(smem, lay["DS"], block_m, row0[w], col, ds_frag[:, kk, 0])
                        bwd_store_fragment_pairs(smem, lay["DS"], block_m, row0[w] + 8, col, ds_frag[:, kk, 1])
                        bwd_store_fragment_pairs(smem, lay["DS"], block_m, row0[w], col + 8, ds_frag[:, kk, 2])
                        bwd_store_fragment_pairs(smem, lay["DS"], block_m, row0[w] + 8, col + 8, ds_frag[:, kk, 3])
        # Step 7
        if atomic_dq:
            for w in warps:
                q_row0 = 16 * (w % dq_warps_m)
                m_lo = m0 + q_row0 + GROUP
                for col0 in range(dq_cols * (w // dq_warps_m), dq_cols * (w // dq_warps_m + 1), dq_pass):
                    dq_acc = np.zeros((32, dq_pass // 8, 4))
                    bwd_mma_AtB(dq_acc, smem, dq_pass, block_n, block_m, d_tile, lay["DS"], q_row0, lay["K"], col0)
                    for j in range(dq_pass // 8):
                        col = col0 + 8 * j + 2 * THREAD_IN_GROUP
                        for half, m in ((0, m_lo), (1, m_lo + 8)):
                            for lane in np.flatnonzero((col < headdim) & (m < seqlen_q)):
                                dq_accum[batch, m[lane], head, col[lane]] += dq_acc[lane, j, 2 * half]
                                dq_accum[batch, m[lane], head, col[lane] + 1] += dq_acc[lane, j, 2 * half + 1]

    # Epilogue
    for w in warps:
        bwd_stage_acc(smem, lay["K"], d_tile, row0[w], d_part[w] * dw, dk_acc[w], scale)
        bwd_stage_acc(smem, lay["V"], d_tile, row0[w], d_part[w] * dw, dv_acc[w], 1.0)
    bwd_store_tile(dk[batch, n0:, head_kv], smem, lay["K"], block_n, d_tile, nthreads, seqlen_k - n0, headdim)
    bwd_store_tile(dv[batch, n0:, head_kv], smem, lay["V"], block_n, d_tile, nthreads, seqlen_k - n0, headdim)


@mirrors("flash_bwd_mma.cu",
         "if (j_begin < j_end) load_key_block(j_begin, j_begin & 1);",
         "if (j + 1 < j_end) load_key_block(j + 1, stage ^ 1);")
def _dq_block(q, k, v, do, lse, delta, dq, *, batch, head, m_block, group, scale, mask,
              d_tile, block_m, block_n, nwarps):
    """One CTA of flash_bwd_dq_mma."""
    seqlen_q, headdim = q.shape[1], q.shape[3]
    seqlen_k = k.shape[1]
    nthreads = 32 * nwarps
    assert block_m == 16 * nwarps
    lay = bwd_dq_layout(d_tile, block_m, block_n)
    smem = np.full(lay["BYTES"] // 2, np.nan)
    scale_log2 = scale * math.log2(math.e)
    m0 = m_block * block_m
    head_kv = head // group
    j_begin, j_end = _key_block_range(mask, m0, block_m, block_n, seqlen_q, seqlen_k)

    def load_key_block(it, stage):
        n0 = it * block_n
        cp_async_tile(smem, lay["K"] + stage * lay["KV_TILE"], block_n, d_tile, nthreads, k[batch, :, head_kv],
                      n0, seqlen_k - n0, headdim)
        cp_async_tile(smem, lay["V"] + stage * lay["KV_TILE"], block_n, d_tile, nthreads, v[batch, :, head_kv],
                      n0, seqlen_k - n0, headdim)

    cp_async_tile(smem, lay["Q"], block_m, d_tile, nthreads, q[batch, :, head], m0, seqlen_q - m0, headdim)
    cp_async_tile(smem, lay["DO"], block_m, d_tile, nthreads, do[batch, :, head], m0, seqlen_q - m0, headdim)
    if j_begin < j_end:
        load_key_block(j_begin, j_begin & 1)

    warps = range(nwarps)
    stats = []
    for w in warps:
        base, d = [], []
        for half in range(2):
            m = m0 + 16 * w + GROUP + 8 * half
            ok = m < seqlen_q
            base.append(np.where(ok, _lse_base_log2(lse[batch, head, np.where(ok, m, 0)]), 0.0))
            d.append(np.where(ok, delta[batch, head, np.where(ok, m, 0)], 0.0))
        stats.append((base, d))
    dq_acc = np.zeros((nwarps, 32, d_tile // 8, 4))

    for it in range(j_begin, j_end):
        stage = it & 1
        if it + 1 < j_end:
            load_key_block(it + 1, stage ^ 1)
        n0 = it * block_n
        s_k, s_v = lay["K"] + stage * lay["KV_TILE"], lay["V"] + stage * lay["KV_TILE"]
        partial = _partial(m0, block_m, n0, block_n, seqlen_q, seqlen_k, mask)
        for w in warps:
            s_acc = np.zeros((32, block_n // 8, 4))
            dp_acc = np.zeros((32, block_n // 8, 4))
            bwd_mma_ABt(s_acc, smem, block_n, d_tile, d_tile, d_tile, lay["Q"], 16 * w, s_k, 0)
            bwd_mma_ABt(dp_acc, smem, block_n, d_tile, d_tile, d_tile, lay["DO"], 16 * w, s_v, 0)
            base, d = stats[w]
            for j in range(block_n // 8):
                for e in range(4):
                    p = np.exp2(s_acc[:, j, e] * scale_log2 - base[e >> 1])
                    ds = p * (dp_acc[:, j, e] - d[e >> 1])
                    hidden = partial & ~_visible(m0 + 16 * w + GROUP + 8 * (e >> 1),
                                                 n0 + 8 * j + 2 * THREAD_IN_GROUP + (e & 1), seqlen_q, seqlen_k, mask)
                    dp_acc[:, j, e] = np.where(hidden, 0.0, ds)
            bwd_mma_AB_regs(dq_acc[w], bwd_pack_a_frags(dp_acc), smem, d_tile, block_n, d_tile, s_k, 0)

    for w in warps:
        bwd_stage_acc(smem, lay["Q"], d_tile, 16 * w, 0, dq_acc[w], scale)
        rows = dq[batch, m0 + 16 * w:, head]
        bwd_store_tile(rows, smem, lay["Q"] + bwd_tile_offset(d_tile, 16 * w, 0), 16, d_tile, 32,
                       seqlen_q - m0 - 16 * w, headdim)


def _bwd_emulated(q, k, v, do, *, causal, scale, dkdv_config, dq_config=None, window_size=(-1, -1)):
    """dq, dk, dv from the emulated kernels; dq by flash_bwd_dq_mma when dq_config is given, else
    by ATOMIC_DQ and flash_bwd_dq_convert."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    from cupyflash.reference import attention  # sums over visible keys only: NaN-safe

    o, lse = attention(q, k, v, softmax_scale=scale, causal=causal, window_size=window_size)
    mask = masks.mask_for(causal, window_size)
    delta = np.einsum("bqhd,bqhd->bhq", do, o)
    # (d_tile, BLOCK_M, M_SUB, BLOCK_N, NWARPS, WARPS_D), or ("v2", ..., ROW_GROUPS) for v2
    kernel = dkdv_config[0] if isinstance(dkdv_config[0], str) else "v1"  # "v2", "split": + ROW_GROUPS
    d_tile, block_m, m_sub, block_n, nwarps, warps_d = dkdv_config[1:] if kernel != "v1" else dkdv_config
    dq, dk, dv = np.full(q.shape, np.nan), np.full(k.shape, np.nan), np.full(v.shape, np.nan)
    dq_accum = None if dq_config else np.zeros((batch, seqlen_q, nheads, d_tile))
    for b in range(batch):
        for hk in range(nheads_kv):
            for n_block in range(math.ceil(seqlen_k / block_n)):
                kwargs = dict(batch=b, head_kv=hk, n_block=n_block, group=group, scale=scale, mask=mask,
                              d_tile=d_tile, block_m=block_m, m_sub=m_sub, block_n=block_n, nwarps=nwarps)
                if kernel == "split":
                    _dkdv_block_split(q, k, v, do, lse, delta, dk, dv, dq_accum, row_groups=warps_d, **kwargs)
                elif kernel == "v2":
                    _dkdv_block_v2(q, k, v, do, lse, delta, dk, dv, dq_accum, row_groups=warps_d, **kwargs)
                else:
                    _dkdv_block(q, k, v, do, lse, delta, dk, dv, dq_accum, warps_d=warps_d, **kwargs)
    if dq_config:
        # (d_tile, BLOCK_M, BLOCK_N, NWARPS): flash_bwd_dq_mma; one more entry (ROW_GROUPS): v2
        dq_d_tile, dq_bm, dq_bn, dq_warps = dq_config[:4]
        for b in range(batch):
            for h in range(nheads):
                for m_block in range(math.ceil(seqlen_q / dq_bm)):
                    kwargs = dict(batch=b, head=h, m_block=m_block, group=group, scale=scale, mask=mask,
                                  d_tile=dq_d_tile, block_m=dq_bm, block_n=dq_bn, nwarps=dq_warps)
                    if len(dq_config) == 5:
                        _dq_block_v2(q, k, v, do, lse, delta, dq, row_groups=dq_config[4], **kwargs)
                    else:
                        _dq_block(q, k, v, do, lse, delta, dq, **kwargs)
    else:  # flash_bwd_dq_convert: one thread per 8 columns
        assert np.all(dq_accum[..., headdim:] == 0)
        for idx in range(batch * seqlen_q * nheads * (headdim // 8)):
            chunk, row_id = idx % (headdim // 8), idx // (headdim // 8)
            h, m, b = row_id % nheads, (row_id // nheads) % seqlen_q, row_id // (nheads * seqlen_q)
            dq[b, m, h, chunk * 8: chunk * 8 + 8] = dq_accum[b, m, h, chunk * 8: chunk * 8 + 8] * scale
    return dq, dk, dv


# (d_tile, block_m, m_sub, block_n, nwarps, warps_d) of cupyflash.kernels.mma_bwd.DKDV_CONFIG
# and smaller variants of the same code paths (WARPS_D = 2 below head dim 256, 4 warps).
_BWD_CASES = [
    # dkdv config, dq config or None (atomic), headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal
    ((64, 64, 64, 128, 8, 1), (64, 64, 64, 4), 40, 1, 70, 150, 2, 1, False),
    ((64, 64, 64, 128, 8, 1), None, 64, 1, 150, 70, 1, 1, True),  # empty query rows
    ((128, 64, 32, 128, 8, 1), (128, 128, 64, 8), 96, 1, 100, 130, 1, 1, True),
    ((128, 64, 32, 128, 8, 1), None, 128, 1, 90, 90, 2, 2, True),
    ((256, 32, 16, 64, 8, 2), (256, 64, 32, 4), 136, 1, 40, 70, 2, 1, True),
    ((256, 32, 16, 64, 8, 2), None, 256, 1, 45, 33, 1, 1, False),
    ((64, 32, 16, 32, 4, 2), None, 48, 2, 50, 40, 2, 1, True),
    ((64, 64, 32, 64, 4, 1), (64, 64, 32, 4), 24, 1, 33, 97, 3, 1, True),
    # query 63, the last row of query block 0, is the first to see key 0 (causal block skipping)
    ((64, 64, 64, 128, 8, 1), None, 64, 1, 133, 70, 1, 1, True),
    ((128, 64, 32, 128, 8, 1), (128, 128, 64, 8), 64, 1, 191, 256, 1, 1, True),
]


def _bwd_case_id(c):
    dkdv, dq = c[0], c[1]
    if isinstance(dkdv[0], str):
        name = "{}_d{}_bm{}_ms{}_bn{}_w{}_rg{}".format(*dkdv)
    else:
        name = "d{}_bm{}_ms{}_bn{}_w{}_wd{}".format(*dkdv)
    name += "_dq_bm{1}_bn{2}_w{3}".format(*dq) if dq else "_atomic"
    if dq and len(dq) == 5:
        name += f"_rg{dq[4]}"
    return name + "_hd{}_sq{}_sk{}_h{}_{}{}".format(c[2], c[4], c[5], c[6], c[7], "_causal" if c[8] else "")


def _check_bwd_emulation(emulate, headdim, batch, sq, sk, nheads, nheads_kv, causal, window_size=(-1, -1)):
    """emulate(q, k, v, do, scale) -> (dq, dk, dv) on float64 inputs drawn from the shape, against
    the float64 reference at 1e-9; no element may stay NaN (the emulations poison their outputs)."""
    from cupyflash.reference import attention_backward

    rng = np.random.default_rng(headdim + batch + sq + sk + nheads + nheads_kv)
    q = rng.standard_normal((batch, sq, nheads, headdim))
    k = rng.standard_normal((batch, sk, nheads_kv, headdim))
    v = rng.standard_normal((batch, sk, nheads_kv, headdim))
    do = rng.standard_normal((batch, sq, nheads, headdim))
    scale = 1 / math.sqrt(headdim)
    dq, dk, dv = emulate(q, k, v, do, scale)
    dq_ref, dk_ref, dv_ref = attention_backward(do, q, k, v, softmax_scale=scale, causal=causal,
                                                window_size=window_size)
    for name, got, want in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        assert not np.isnan(got).any(), f"{name}: some element was never written"
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=name)
    if causal and sq > sk:
        assert np.all(dq[:, : sq - sk] == 0)  # queries that see no key


@pytest.mark.parametrize("case", _BWD_CASES, ids=_bwd_case_id)
def test_bwd_emulation_matches_reference(case):
    dkdv_config, dq_config, headdim, batch, sq, sk, nheads, nheads_kv, causal = case
    _check_bwd_emulation(lambda q, k, v, do, scale: _bwd_emulated(q, k, v, do, causal=causal, scale=scale,
                                                                  dkdv_config=dkdv_config, dq_config=dq_config),
                         headdim, batch, sq, sk, nheads, nheads_kv, causal)


@pytest.mark.parametrize("cols", [32, 64, 128, 256])
def test_bwd_tile_offset_is_a_bijection_within_rows(cols):
    rows = np.arange(64)[:, None]
    chunks = np.arange(cols // 8)[None, :]
    off = bwd_tile_offset(cols, rows, chunks)
    assert sorted(off.ravel().tolist()) == list(range(0, 64 * cols * 2, 16))
    assert np.all(off // (2 * cols) == rows)


def _conflict_free(byte_addrs, width):
    """Whether accesses of `width` bytes per lane hit each 4-byte bank at most once per wavefront
    (one wavefront = 128 bytes: 8 lanes of ldmatrix rows or 32 lanes of b32 stores)."""
    banks = [(a // 4 + w) % 32 for a in byte_addrs for w in range(width // 4)]
    return len(set(banks)) == len(banks)


@pytest.mark.parametrize("cols", [32, 64, 128, 256])
def test_bwd_ldmatrix_and_fragment_stores_are_bank_conflict_free(cols):
    for row0 in (0, 16, 48):
        for chunk0 in range(0, cols // 8, 2):
            for lane_row, lane_chunk in ((LDM_ROW_X, LDM_CHUNK_X), (LDM_ROW_Y, LDM_CHUNK_Y)):
                addr = bwd_tile_offset(cols, row0 + lane_row, chunk0 + lane_chunk)
                for phase in range(4):
                    assert _conflict_free(addr[8 * phase: 8 * phase + 8], 16)
            for r in (row0, row0 + 8):  # st.shared.b32 of a C fragment pair (dS^T, epilogue)
                assert _conflict_free(bwd_tile_offset(cols, r + GROUP, chunk0) + 4 * THREAD_IN_GROUP, 4)


def test_bwd_tile_step_matches_tile_offset():
    # Every (origin, step) combination the kernels use: origins are multiples of 16 rows and of
    # 64 columns (k0) or of the product width N (column origins of B operands).
    for cols in (32, 64, 128, 256):
        for lane_row, lane_chunk in ((LDM_ROW_X, LDM_CHUNK_X), (LDM_ROW_Y, LDM_CHUNK_Y)):
            for row0 in (0, 16, 32, 112):
                col_origins = [0] if cols == 32 else sorted({0, 32, 64, cols // 2} - {cols})
                for col0 in col_origins:
                    n = min(col0 & -col0 if col0 else cols, cols - col0)  # widest N with col0 % N == 0
                    lane_off = bwd_tile_offset(cols, row0 + lane_row, col0 // 8 + lane_chunk)
                    for rows in (0, 16, 48):
                        for chunks in (range(0, n // 8, 2) if cols >= 64 else [0]):
                            want = bwd_tile_offset(cols, row0 + rows + lane_row, col0 // 8 + chunks + lane_chunk)
                            assert np.array_equal(bwd_tile_step(cols, lane_off, rows, chunks), want)


@pytest.mark.parametrize("dims", [(64, 64), (32, 128), (64, 256)])
def test_bwd_warp_products_match_numpy(dims):
    """mma_ABt, mma_AB_regs, mma_AtB against A @ B on random tiles (one warp)."""
    cols_m, dim = dims
    rng = np.random.default_rng(dim + cols_m)
    rows = 64
    x, y = rng.standard_normal((rows, dim)), rng.standard_normal((rows, dim))
    t = rng.standard_normal((rows, cols_m))
    smem = np.full((2 * rows * dim * 2 + rows * cols_m * 2) // 2, np.nan)
    tile_x, tile_y, tile_t = 0, rows * dim * 2, 2 * rows * dim * 2
    cp_async_tile(smem, tile_x, rows, dim, 128 if dim < 256 else 256, x, 0, rows, dim)
    cp_async_tile(smem, tile_y, rows, dim, 128 if dim < 256 else 256, y, 0, rows, dim)
    for r in range(rows):
        for c in range(cols_m // 8):
            o = (tile_t + bwd_tile_offset(cols_m, r, c)) // 2
            smem[o: o + 8] = t[r, 8 * c: 8 * c + 8]

    def frags(acc, n):
        return np.concatenate([a_rows(acc[:, j]) for j in range(n // 8)], axis=1)

    def a_rows(c):  # C fragment (32, 4) -> the 16 x 8 block
        blk = np.empty((16, 8))
        blk[GROUP, 2 * THREAD_IN_GROUP], blk[GROUP, 2 * THREAD_IN_GROUP + 1] = c[:, 0], c[:, 1]
        blk[GROUP + 8, 2 * THREAD_IN_GROUP], blk[GROUP + 8, 2 * THREAD_IN_GROUP + 1] = c[:, 2], c[:, 3]
        return blk

    k0 = dim // 2 if dim >= 128 else 0
    acc = np.zeros((32, 2, 4))  # rows 16..31 of x times rows 32..47 of y, over columns k0..k0+64
    bwd_mma_ABt(acc, smem, 16, 64, dim, dim, tile_x, 16, tile_y + 32 * dim * 2, k0)
    np.testing.assert_allclose(frags(acc, 16), x[16:32, k0:k0 + 64] @ y[32:48, k0:k0 + 64].T, atol=1e-12)

    a_val = rng.standard_normal((16, 32))
    a = bwd_pack_a_frags(np.stack([c_from_matrix(a_val[:, 8 * j: 8 * j + 8]) for j in range(4)], axis=1))
    acc = np.zeros((32, 4, 4))  # a (16 x 32) times rows 0..31 of x, columns 32..63
    bwd_mma_AB_regs(acc, a, smem, 32, 32, dim, tile_x, 32)
    np.testing.assert_allclose(frags(acc, 32), a_val @ x[:32, 32:64], atol=1e-12)

    acc = np.zeros((32, 2, 4))  # t^T rows 16..31 (columns of t) times rows of y, columns 16..31
    bwd_mma_AtB(acc, smem, 16, rows, cols_m, dim, tile_t, 16, tile_y, 16)
    np.testing.assert_allclose(frags(acc, 16), t[:, 16:32].T @ y[:, 16:32], atol=1e-12)


def test_bwd_smem_layouts_match_python_and_fit():
    from cupyflash.kernels import mma_bwd

    for dt, (bm, ms, bn, nw, wd) in mma_bwd.DKDV_CONFIG.items():
        for atomic in (False, True):
            lay = bwd_dkdv_layout(dt, bm, ms, bn, nw, wd, atomic)
            assert lay["BYTES"] == mma_bwd.dkdv_smem_bytes(dt, bm, ms, bn, nw, wd, atomic)
            assert lay["BYTES"] <= 227 * 1024
            assert all(lay[r] % 128 == 0 for r in ("K", "V", "Q", "DO", "DS", "XCHG", "LSE", "DELTA"))
            assert bn == 16 * nw // wd and bm % ms == 0
    for dt, (bm, bn, nw) in mma_bwd.DQ_CONFIG.items():
        assert bwd_dq_layout(dt, bm, bn)["BYTES"] == mma_bwd.dq_smem_bytes(dt, bm, bn) <= 227 * 1024
        assert bm == 16 * nw


def test_bwd_specializations_are_named_once():
    from cupyflash.kernels import mma_bwd

    specs = mma_bwd.specializations()
    assert len({s.name for s in specs}) == len(specs) == len({s.expression for s in specs})
    assert mma_bwd.supports(np.float16, 8) and mma_bwd.supports(np.float16, 256)
    assert not mma_bwd.supports(np.float16, 260) and not mma_bwd.supports(np.float16, 12)
    assert not mma_bwd.supports(np.float32, 64)


@pytest.fixture
def nan_is_data(monkeypatch):
    """a_matrix and b_matrix take NaN for an unwritten fragment; under this fixture NaN is data."""

    def a_matrix_with_nan_data(a):
        m = np.empty((16, 16))
        g, t = GROUP, THREAD_IN_GROUP
        for half in range(2):
            m[g, 2 * t + half], m[g + 8, 2 * t + half] = a[:, 0, half], a[:, 1, half]
            m[g, 2 * t + 8 + half], m[g + 8, 2 * t + 8 + half] = a[:, 2, half], a[:, 3, half]
        return m

    def b_matrix_with_nan_data(b0, b1):
        m = np.empty((16, 8))
        for half in range(2):
            m[2 * THREAD_IN_GROUP + half, GROUP], m[2 * THREAD_IN_GROUP + 8 + half, GROUP] = b0[:, half], b1[:, half]
        return m

    monkeypatch.setitem(globals(), "a_matrix", a_matrix_with_nan_data)
    monkeypatch.setitem(globals(), "b_matrix", b_matrix_with_nan_data)


@pytest.mark.parametrize("dq_config", [None, (64, 64, 64, 4)], ids=["atomic", "dq_kernel"])
def test_bwd_nan_in_a_value_row_stays_out_of_queries_that_do_not_see_it(dq_config, nan_is_data):
    # dS is zeroed by selection where hidden, so dP = dO . NaN there cannot reach dQ of a query
    # that does not see the key (a product 0 * NaN would).
    from cupyflash.reference import attention_backward


    rng = np.random.default_rng(7)
    q, do = rng.standard_normal((1, 90, 1, 64)), rng.standard_normal((1, 90, 1, 64))
    k, v = rng.standard_normal((1, 90, 1, 64)), rng.standard_normal((1, 90, 1, 64))
    v[0, 40, 0, 3] = np.nan
    dq, dk, dv = _bwd_emulated(q, k, v, do, causal=True, scale=0.125, dkdv_config=(64, 64, 64, 128, 8, 1),
                               dq_config=dq_config)
    dq_ref, dk_ref, dv_ref = attention_backward(do, q, k, v, softmax_scale=0.125, causal=True)
    assert np.isfinite(dq[0, :40]).all() and np.isnan(dq[0, 40:]).all()
    np.testing.assert_allclose(dq, dq_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dk, dk_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dv, dv_ref, rtol=1e-9, atol=1e-9)



@pytest.mark.parametrize("dkdv_config, dq_config", [(("v2", 64, 64, 32, 128, 4, 2), None),
                                                    (("split", 64, 64, 32, 64, 4, 2), None),
                                                    ((64, 64, 64, 128, 8, 1), (64, 64, 32, 2, 2))],
                         ids=["v2_atomic", "split_atomic", "dq_v2"])
def test_bwd_nan_in_a_value_row_stays_out_of_queries_outside_its_window(dkdv_config, dq_config, nan_is_data):
    # The same with the window (5, 5): key 40 is seen by queries 35..45. Past them its entries are
    # hidden by the left bound, which v2 dQ and the v2 / split dK/dV encode as P = 0 and then
    # select dS to 0 by that test: a product 0 * NaN would reach dQ of queries 46..89.
    from cupyflash.reference import attention_backward

    rng = np.random.default_rng(8)
    q, k, v, do = (rng.standard_normal((1, 90, 1, 64)) for _ in range(4))
    v[0, 40, 0, 3] = np.nan
    window = (5, 5)
    dq, _, dv = _bwd_emulated(q, k, v, do, causal=False, scale=0.125, dkdv_config=dkdv_config,
                              dq_config=dq_config, window_size=window)
    # (the reference's dK = dS^T Q multiplies the NaN rows of dS by zeros: NaN for every key)
    dq_ref, _, dv_ref = attention_backward(do, q, k, v, softmax_scale=0.125, window_size=window)
    sees = (np.arange(90) >= 35) & (np.arange(90) <= 45)
    assert np.isfinite(dq[0, ~sees]).all() and np.isnan(dq[0, sees]).all()
    np.testing.assert_allclose(dq, dq_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dv, dv_ref, rtol=1e-9, atol=1e-9)


_LAUNCH_SHAPE = dict(b=2, sq=100, sk=70, h=4, hkv=2)


def _record_backward_launches(monkeypatch, version, d, deterministic, fused=None, window_size=(-1, -1)):
    """backward() (causal, fp16, _LAUNCH_SHAPE) on stand-in arrays: the (spec, grid, args) of
    every launch, in order."""
    cupy = pytest.importorskip("cupy")
    from cupyflash.kernels import dq_fixed, mma_bwd, simt

    launches = []
    monkeypatch.setattr(mma_bwd, "launch", lambda spec, grid, args: launches.append((spec, grid, args)))
    monkeypatch.setattr(dq_fixed, "launch", lambda spec, grid, args: launches.append((spec, grid, args)))
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: FakeArray(shape, dtype), raising=False)
    monkeypatch.setattr(simt, "backward_preprocess",
                        lambda do, o: FakeArray((do.shape[0], do.shape[2], do.shape[1]), np.float32))
    monkeypatch.setattr(cupy, "ascontiguousarray", lambda a, dtype=None: a, raising=False)
    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=None: FakeArray(shape, dtype), raising=False)

    b, sq, sk, h, hkv = (_LAUNCH_SHAPE[x] for x in ("b", "sq", "sk", "h", "hkv"))
    q, o, do = (FakeArray((b, sq, h, d), np.float16) for _ in range(3))
    k, v = FakeArray((b, sk, hkv, d), np.float16), FakeArray((b, sk, hkv, d), np.float16)
    dq, dk, dv = FakeArray(q.shape, np.float16), FakeArray(k.shape, np.float16), FakeArray(k.shape, np.float16)
    lse = FakeArray((b, h, sq), np.float32)
    mma_bwd.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.1, causal=True, deterministic=deterministic,
                     version=version, fused=fused, window_size=window_size)
    return launches


def _assert_arguments_match_signature(spec, grid, args):
    """The argument list matches the C++ parameter list of the spec's kernel in count and in type
    (pointer, int32, int64, float32); the grid is launchable."""
    kinds = {"int": np.int32, "i64": np.int64, "float": np.float32}
    kernel = spec.name
    types = kernel_parameter_types(spec)
    assert len(types) == len(args), kernel
    for t, a in zip(types, args):
        if t.endswith("*"):
            assert isinstance(a, FakeArray), (kernel, t, a)
        else:
            assert type(a) is kinds[t], (kernel, t, type(a))
    assert all(0 < g < 65536 for g in grid)


@pytest.mark.parametrize("version,d", [("v1", 96), ("v2", 96), ("v2", 64), ("v3", 96), ("v3", 200)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_launch_arguments_match_kernel_signatures(deterministic, version, d, monkeypatch):
    """backward() on stand-in arrays, launch() recorded: every argument list must match the C++
    parameter list of its kernel in count and in type (pointer, int32, int64, float32)."""
    from cupyflash.kernels import mma_bwd

    launches = _record_backward_launches(monkeypatch, version, d, deterministic)
    assert len(launches) == 2
    assert launches[0][0] == mma_bwd.dkdv_spec(np.float16, d, True, "none" if deterministic else "atomic",
                                                 DEV_BWD.dkdv_tiles(d, version, not deterministic)[0])
    sk = _LAUNCH_SHAPE["sk"]
    assert launches[0][1][0] == math.ceil(sk / DEV_BWD.dkdv_tiles(d, version, not deterministic)[1][2])
    for spec, grid, args in launches:
        _assert_arguments_match_signature(spec, grid, args)


# ---------------------------------------------------------------------------------------------
# Backward v2: flash_bwd_dq_mma_v2 (ROW_GROUPS 16-row query groups per warp)
# ---------------------------------------------------------------------------------------------

def bwd_dq_layout_v2(d_tile, block_m, block_n):
    """DqSmemV2<...>: v1's tiles, then float lse (log2 units) and D of the block's rows."""
    lay = bwd_dq_layout(d_tile, block_m, block_n)
    lay["LSE"] = lay["BYTES"]
    lay["DELTA"] = lay["LSE"] + block_m * 4
    lay["BYTES"] = lay["DELTA"] + block_m * 4
    return lay


def bwd_mma_ABt_groups(acc, smem, n, k, dim_a, dim_b, tile_a, a_row0, tile_b, k0):
    """mma_ABt_groups: acc[g] += A_g B^T, A_g = rows a_row0 + 16 g; one B fragment for all groups."""
    groups = acc.shape[0]
    a_lane = bwd_tile_offset(dim_a, a_row0 + LDM_ROW_X, k0 // 8 + LDM_CHUNK_X)
    b_lane = bwd_tile_offset(dim_b, LDM_ROW_Y, k0 // 8 + LDM_CHUNK_Y)
    for kk in range(k // 16):
        a = [ldmatrix_x4(smem, tile_a + bwd_tile_step(dim_a, a_lane, 16 * g, 2 * kk)) for g in range(groups)]
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + bwd_tile_step(dim_b, b_lane, 16 * nn, 2 * kk))
            for g in range(groups):
                mma_16816(acc[g, :, 2 * nn], a[g], b[:, 0], b[:, 1])
                mma_16816(acc[g, :, 2 * nn + 1], a[g], b[:, 2], b[:, 3])


def bwd_mma_AB_regs_groups(acc, a, smem, n, k, dim_b, tile_b, b_col0):
    """mma_AB_regs_groups: acc[g] += A_g B, a[g] = A_g's fragments [lane, K/16, reg, half]."""
    b_lane = bwd_tile_offset(dim_b, LDM_ROW_X, b_col0 // 8 + LDM_CHUNK_X)
    for kk in range(k // 16):
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + bwd_tile_step(dim_b, b_lane, 16 * kk, 2 * nn), trans=True)
            for g in range(acc.shape[0]):
                mma_16816(acc[g, :, 2 * nn], a[g][:, kk], b[:, 0], b[:, 1])
                mma_16816(acc[g, :, 2 * nn + 1], a[g][:, kk], b[:, 2], b[:, 3])


@mirrors("flash_bwd_mma.cu",
         "partial && mask.hidden_left(origin, 16 * g + 8 * (e >> 1), 8 * f + (e & 1));",
         "s_acc[g][f][e] = hidden_left ? 0.f : p;",
         "n_lim[g][half] = m < seqlen_q ? mask.row_key_end(m) : 0;",
         "const bool hidden = partial && (n >= n_lim[g][e >> 1] ||",
         "(Mask::HAS_LEFT && s_acc[g][c0 / 8 + f][e] == 0.f));")
def _dq_block_v2(q, k, v, do, lse, delta, dq, *, batch, head, m_block, group, scale, mask,
                 d_tile, block_m, block_n, nwarps, row_groups):
    """One CTA of flash_bwd_dq_mma_v2."""
    seqlen_q, headdim = q.shape[1], q.shape[3]
    seqlen_k = k.shape[1]
    nthreads, G = 32 * nwarps, row_groups
    warp_rows = 16 * G
    assert block_m == warp_rows * nwarps
    dp_cols = 16 if d_tile >= 128 else block_n
    lay = bwd_dq_layout_v2(d_tile, block_m, block_n)
    smem = np.full(lay["LSE"] // 2, np.nan)  # 16-bit tiles; the float statistics are s_lse, s_delta
    scale_log2 = scale * math.log2(math.e)
    m0 = m_block * block_m
    head_kv = head // group
    j_begin, j_end = _key_block_range(mask, m0, block_m, block_n, seqlen_q, seqlen_k)

    def load_key_block(it, stage):
        n0 = it * block_n
        cp_async_tile(smem, lay["K"] + stage * lay["KV_TILE"], block_n, d_tile, nthreads, k[batch, :, head_kv],
                      n0, seqlen_k - n0, headdim)
        cp_async_tile(smem, lay["V"] + stage * lay["KV_TILE"], block_n, d_tile, nthreads, v[batch, :, head_kv],
                      n0, seqlen_k - n0, headdim)

    cp_async_tile(smem, lay["Q"], block_m, d_tile, nthreads, q[batch, :, head], m0, seqlen_q - m0, headdim)
    cp_async_tile(smem, lay["DO"], block_m, d_tile, nthreads, do[batch, :, head], m0, seqlen_q - m0, headdim)
    if j_begin < j_end:
        load_key_block(j_begin, j_begin & 1)
    s_lse, s_delta = np.full(block_m, np.nan), np.full(block_m, np.nan)
    for r in range(block_m):
        m = m0 + r
        s_lse[r] = _lse_base_log2(lse[batch, head, m]) if m < seqlen_q else 0.0
        s_delta[r] = delta[batch, head, m] if m < seqlen_q else 0.0

    dq_acc = np.zeros((nwarps, G, 32, d_tile // 8, 4))
    for it in range(j_begin, j_end):
        stage = it & 1
        if it + 1 < j_end:
            load_key_block(it + 1, stage ^ 1)
        n0 = it * block_n
        s_k, s_v = lay["K"] + stage * lay["KV_TILE"], lay["V"] + stage * lay["KV_TILE"]
        partial = _partial(m0, block_m, n0, block_n, seqlen_q, seqlen_k, mask)
        for w in range(nwarps):
            row0 = warp_rows * w
            lane_row = row0 + GROUP
            s_acc = np.zeros((G, 32, block_n // 8, 4))
            bwd_mma_ABt_groups(s_acc, smem, block_n, d_tile, d_tile, d_tile, lay["Q"], row0, s_k, 0)
            for g in range(G):
                for j in range(block_n // 8):
                    for e in range(4):
                        p = np.exp2(s_acc[g, :, j, e] * scale_log2 - s_lse[lane_row + 16 * g + 8 * (e >> 1)])
                        m, n = m0 + lane_row + 16 * g + 8 * (e >> 1), n0 + 8 * j + 2 * THREAD_IN_GROUP + (e & 1)
                        s_acc[g, :, j, e] = np.where(partial & mask.hidden_left(m, n, seqlen_q, seqlen_k), 0.0, p)
            n_lim = np.zeros((G, 2, 32), dtype=np.int64)
            for g in range(G):
                for half in range(2):
                    m = m0 + lane_row + 16 * g + 8 * half
                    n_lim[g, half] = np.where(m < seqlen_q, mask.row_key_end(m, seqlen_q, seqlen_k), 0)
            ds_frag = np.full((G, 32, block_n // 16, 4, 2), np.nan)
            for c0 in range(0, block_n, dp_cols):
                dp_acc = np.zeros((G, 32, dp_cols // 8, 4))
                bwd_mma_ABt_groups(dp_acc, smem, dp_cols, d_tile, d_tile, d_tile, lay["DO"], row0,
                                   s_v + c0 * d_tile * 2, 0)
                for g in range(G):
                    for j in range(dp_cols // 8):
                        for e in range(4):
                            ds = s_acc[g, :, c0 // 8 + j, e] * (dp_acc[g, :, j, e]
                                                                 - s_delta[lane_row + 16 * g + 8 * (e >> 1)])
                            n = n0 + c0 + 8 * j + 2 * THREAD_IN_GROUP + (e & 1)
                            hidden = partial & ((n >= n_lim[g, e >> 1]) |
                                                (mask.HAS_LEFT & (s_acc[g, :, c0 // 8 + j, e] == 0.0)))
                            dp_acc[g, :, j, e] = np.where(hidden, 0.0, ds)
                    ds_frag[g, :, c0 // 16: (c0 + dp_cols) // 16] = bwd_pack_a_frags(dp_acc[g])
            bwd_mma_AB_regs_groups(dq_acc[w], ds_frag, smem, d_tile, block_n, d_tile, s_k, 0)

    for w in range(nwarps):
        row0 = warp_rows * w
        for g in range(G):
            bwd_stage_acc(smem, lay["Q"], d_tile, row0 + 16 * g, 0, dq_acc[w, g], scale)
        rows = dq[batch, m0 + row0:, head]
        bwd_store_tile(rows, smem, lay["Q"] + bwd_tile_offset(d_tile, row0, 0), warp_rows, d_tile, 32,
                       seqlen_q - m0 - row0, headdim)


# dkdv config as in _BWD_CASES, dq config (d_tile, BLOCK_M, BLOCK_N, NWARPS, ROW_GROUPS) of
# mma_bwd.DQ_CONFIG_V2 / DQ_CANDIDATES_V2 or a smaller variant of the same code path.
_BWD_V2_CASES = [
    ((64, 64, 64, 128, 8, 1), (64, 128, 32, 4, 2), 40, 1, 150, 70, 2, 1, True),  # empty query rows
    ((64, 64, 64, 128, 8, 1), (64, 64, 32, 2, 2), 64, 1, 70, 97, 3, 1, True),
    ((128, 64, 32, 128, 8, 1), (128, 128, 32, 4, 2), 96, 1, 100, 130, 1, 1, True),
    ((128, 64, 32, 128, 8, 1), (128, 64, 32, 2, 2), 128, 2, 45, 75, 2, 2, False),
    ((128, 64, 32, 128, 8, 1), (128, 96, 32, 2, 3), 120, 1, 131, 64, 1, 1, True),
]


@pytest.mark.parametrize("case", _BWD_V2_CASES, ids=_bwd_case_id)
def test_bwd_v2_dq_emulation_matches_reference(case):
    test_bwd_emulation_matches_reference(case)


def test_bwd_v2_fragment_rows_cover_the_warp_tile_once():
    """Each (query row, key) of a warp's 16 G x BLOCK_N tile is owned by exactly one
    (lane, group, C fragment, element), and the dP slices cover the key block exactly once."""
    for d_tile, block_n, G in ((64, 32, 2), (128, 32, 2), (128, 32, 3)):
        dp_cols = 16 if d_tile >= 128 else block_n
        seen = np.zeros((16 * G, block_n), dtype=int)
        for c0 in range(0, block_n, dp_cols):
            for g in range(G):
                for j in range(dp_cols // 8):
                    for e in range(4):
                        rows = 16 * g + GROUP + 8 * (e >> 1)
                        cols = c0 + 8 * j + 2 * THREAD_IN_GROUP + (e & 1)
                        np.add.at(seen, (rows, cols), 1)
        assert np.all(seen == 1)


def test_bwd_v2_tables_match_layouts_and_fit():
    from cupyflash.kernels import mma_bwd

    for dt, configs in ((dt, (c, *DEV_BWD.DQ_CANDIDATES_V2.get(dt, ()))) for dt, c in mma_bwd.DQ_CONFIG_V2.items()):
        for bm, bn, nw, rg in configs:
            lay = bwd_dq_layout_v2(dt, bm, bn)
            assert lay["BYTES"] == mma_bwd.dq_smem_bytes_v2(dt, bm, bn) <= 227 * 1024
            assert bm == 16 * rg * nw and bn % 16 == 0 and lay["LSE"] % 128 == 0
            assert (bm * dt // 8) % (32 * nw) == 0 and (bn * dt // 8) % (32 * nw) == 0  # cp_async_tile
    assert {v.name for v in DEV_BWD.VERSIONS} >= {"v1", "v2"} and DEV_BWD.LAST_VERSION == DEV_BWD.VERSIONS[-1].name
    assert DEV_BWD.dq_tiles(256, "v2") == mma_bwd.DQ_CONFIG[256]
    with pytest.raises(ValueError):
        DEV_BWD.dq_tiles(64, "v99")


# ---------------------------------------------------------------------------------------------
# Backward v2: flash_bwd_dkdv_mma_v2 (ROW_GROUPS 16-row key groups per warp, WARPS_D = 1)
# ---------------------------------------------------------------------------------------------

@mirrors("flash_bwd_mma.cu",
         "m_min[g][half] = n < seqlen_k ? mask.row_query_begin(n) : seqlen_q;")
def _first_query_of_key_rows(groups, key_row0, seqlen_q, seqlen_k, mask):
    """m_min[g, half, lane]: the first query the right bound lets see key key_row0 + 16 g + 8 half
    + lane / 4 (seqlen_q for keys past seqlen_k): the per-row mask of the 2 x 16-row dK/dV
    emulations (the left bound comes from hidden_left)."""
    m_min = np.zeros((groups, 2, 32), dtype=np.int64)
    for g in range(groups):
        for half in range(2):
            n = key_row0 + 16 * g + GROUP + 8 * half
            m_min[g, half] = np.where(n < seqlen_k, mask.row_query_begin(n, seqlen_q, seqlen_k), seqlen_q)
    return m_min


@mirrors("flash_bwd_mma.cu",
         "const bool hidden = partial && (m < m_min[g][e >> 1] || m >= seqlen_q ||",
         "mask.hidden_left(origin, 8 * j + (e & 1), 16 * g + 8 * (e >> 1)));")
def _p_transposed_groups(smem, smem32, tile_k, row0, s_q_sub, s_lse_sub, m0_sub, m_min, partial, groups, m_sub,
                         d_tile, scale_log2, seqlen_q, mask, n0, seqlen_k):
    """S^T = K Q^T of a warp's row groups (mma_ABt_groups), then P^T = exp2(S^T scale - lse), 0
    where hidden: steps 1-2 of flash_bwd_dkdv_mma_v2 and of the dV warp of flash_bwd_dkdv_mma_split."""
    s_acc = np.zeros((groups, 32, m_sub // 8, 4))
    bwd_mma_ABt_groups(s_acc, smem, m_sub, d_tile, d_tile, d_tile, tile_k, row0, s_q_sub, 0)
    for j in range(m_sub // 8):
        c = 8 * j + 2 * THREAD_IN_GROUP
        for g in range(groups):
            for e in range(4):
                base = _lse_base_log2(smem32[s_lse_sub + c + (e & 1)])
                p = np.exp2(s_acc[g, :, j, e] * scale_log2 - base)
                m, n = m0_sub + c + (e & 1), n0 + row0 + 16 * g + GROUP + 8 * (e >> 1)
                hidden = partial & ((m < m_min[g, e >> 1]) | (m >= seqlen_q) |
                                    mask.hidden_left(m, n, seqlen_q, seqlen_k))
                s_acc[g, :, j, e] = np.where(hidden, 0.0, p)
    return s_acc


def _store_ds_transposed(smem, tile_ds, block_m, row0, mc0, ds_frags):
    """dS^T A fragments (ds_frags[g][lane, kk, reg]) of a warp's row groups into the dS^T tile, as
    the atomic-dQ dK/dV kernels store them for step 7."""
    for g, frag in enumerate(ds_frags):
        r = row0 + 16 * g
        for kk in range(frag.shape[1]):
            col = mc0 + 16 * kk
            bwd_store_fragment_pairs(smem, tile_ds, block_m, r, col, frag[:, kk, 0])
            bwd_store_fragment_pairs(smem, tile_ds, block_m, r + 8, col, frag[:, kk, 1])
            bwd_store_fragment_pairs(smem, tile_ds, block_m, r, col + 8, frag[:, kk, 2])
            bwd_store_fragment_pairs(smem, tile_ds, block_m, r + 8, col + 8, frag[:, kk, 3])


@mirrors("flash_bwd_mma.cu",
         "(Mask::HAS_LEFT && s_acc[g][j][e] == 0.f));")
def _dkdv_block_v2(q, k, v, do, lse, delta, dk, dv, dq_accum, *, batch, head_kv, n_block, group, scale,
                   mask, d_tile, block_m, m_sub, block_n, nwarps, row_groups):
    """One CTA of flash_bwd_dkdv_mma_v2 (dq_accum is None unless ATOMIC_DQ)."""
    seqlen_q, headdim = q.shape[1], q.shape[3]
    seqlen_k = k.shape[1]
    atomic_dq = dq_accum is not None
    nthreads, G = 32 * nwarps, row_groups
    warp_rows = 16 * G
    dq_warps_m = block_m // 16
    dq_cols = d_tile // (nwarps // dq_warps_m)
    dq_pass = min(dq_cols, 32)
    assert block_n == warp_rows * nwarps and block_m % m_sub == 0 and m_sub % 16 == 0
    lay = bwd_dkdv_layout(d_tile, block_m, m_sub, block_n, nwarps, 1, atomic_dq)
    smem = np.full(lay["BYTES"] // 2, np.nan)
    smem32 = np.full(lay["BYTES"] // 4, np.nan)
    scale_log2 = scale * math.log2(math.e)
    n0 = n_block * block_n
    m_block_first, m_blocks = _query_block_range(mask, n0, block_n, block_m, seqlen_q, seqlen_k)
    n_iters = group * m_blocks

    def load_query_block(it, stage):
        head = head_kv * group + it // m_blocks
        m0 = (m_block_first + it % m_blocks) * block_m
        cp_async_tile(smem, lay["Q"] + stage * lay["Q_TILE"], block_m, d_tile, nthreads, q[batch, :, head],
                      m0, seqlen_q - m0, headdim)
        cp_async_tile(smem, lay["DO"] + stage * lay["Q_TILE"], block_m, d_tile, nthreads, do[batch, :, head],
                      m0, seqlen_q - m0, headdim)
        for i in range(2 * block_m):
            r, is_lse = i % block_m, i < block_m
            dst = (lay["LSE"] if is_lse else lay["DELTA"]) + (stage * block_m + r) * 4
            stats = (lse if is_lse else delta)[batch, head]
            smem32[dst // 4] = stats[m0 + r] if m0 + r < seqlen_q else 0.0

    cp_async_tile(smem, lay["K"], block_n, d_tile, nthreads, k[batch, :, head_kv], n0, seqlen_k - n0, headdim)
    cp_async_tile(smem, lay["V"], block_n, d_tile, nthreads, v[batch, :, head_kv], n0, seqlen_k - n0, headdim)
    if n_iters > 0:
        load_query_block(0, 0)

    dk_acc = np.zeros((nwarps, G, 32, d_tile // 8, 4))
    dv_acc = np.zeros((nwarps, G, 32, d_tile // 8, 4))
    for it in range(n_iters):
        stage = it & 1
        if it + 1 < n_iters:
            load_query_block(it + 1, stage ^ 1)
        head = head_kv * group + it // m_blocks
        m0 = (m_block_first + it % m_blocks) * block_m
        s_q, s_do = lay["Q"] + stage * lay["Q_TILE"], lay["DO"] + stage * lay["Q_TILE"]
        s_lse, s_delta = (lay["LSE"] + stage * block_m * 4) // 4, (lay["DELTA"] + stage * block_m * 4) // 4
        for mc0 in range(0, block_m, m_sub):
            s_q_sub, s_do_sub = s_q + mc0 * d_tile * 2, s_do + mc0 * d_tile * 2
            m0_sub = m0 + mc0
            partial = _partial(m0_sub, m_sub, n0, block_n, seqlen_q, seqlen_k, mask)
            for w in range(nwarps):
                row0 = warp_rows * w
                m_min = _first_query_of_key_rows(G, n0 + row0, seqlen_q, seqlen_k, mask)
                # Step 1, 2
                s_acc = _p_transposed_groups(smem, smem32, lay["K"], row0, s_q_sub, s_lse + mc0, m0_sub, m_min,
                                             partial, G, m_sub, d_tile, scale_log2, seqlen_q, mask, n0, seqlen_k)
                # Step 3
                bwd_mma_AB_regs_groups(dv_acc[w], [bwd_pack_a_frags(s_acc[g]) for g in range(G)], smem, d_tile,
                                       m_sub, d_tile, s_do_sub, 0)
                # Steps 4, 5 in 16-column slices
                ds_frag = np.full((G, 32, m_sub // 16, 4, 2), np.nan)
                for kk in range(m_sub // 16):
                    dp_acc = np.zeros((G, 32, 2, 4))
                    bwd_mma_ABt_groups(dp_acc, smem, 16, d_tile, d_tile, d_tile, lay["V"], row0,
                                       s_do_sub + 16 * kk * d_tile * 2, 0)
                    for jj in range(2):
                        j = 2 * kk + jj
                        c = 8 * j + 2 * THREAD_IN_GROUP
                        for g in range(G):
                            for e in range(4):
                                d = smem32[s_delta + mc0 + c + (e & 1)]
                                ds = s_acc[g, :, j, e] * (dp_acc[g, :, jj, e] - d)
                                m = m0_sub + c + (e & 1)
                                hidden = partial & ((m < m_min[g, e >> 1]) | (m >= seqlen_q) |
                                                    (mask.HAS_LEFT & (s_acc[g, :, j, e] == 0.0)))
                                dp_acc[g, :, jj, e] = np.where(hidden, 0.0, ds)
                    for g in range(G):
                        ds_frag[g, :, kk] = bwd_pack_a_frags(dp_acc[g])[:, 0]
                # Step 6 and the dS^T store
                bwd_mma_AB_regs_groups(dk_acc[w], ds_frag, smem, d_tile, m_sub, d_tile, s_q_sub, 0)
                if atomic_dq:
                    _store_ds_transposed(smem, lay["DS"], block_m, row0, mc0, [ds_frag[g] for g in range(G)])
        # Step 7
        if atomic_dq:
            for w in range(nwarps):
                q_row0 = 16 * (w % dq_warps_m)
                m_lo = m0 + q_row0 + GROUP
                for col0 in range(dq_cols * (w // dq_warps_m), dq_cols * (w // dq_warps_m + 1), dq_pass):
                    dq_acc = np.zeros((32, dq_pass // 8, 4))
                    bwd_mma_AtB(dq_acc, smem, dq_pass, block_n, block_m, d_tile, lay["DS"], q_row0, lay["K"], col0)
                    for j in range(dq_pass // 8):
                        col = col0 + 8 * j + 2 * THREAD_IN_GROUP
                        for half, m in ((0, m_lo), (1, m_lo + 8)):
                            for lane in np.flatnonzero((col < headdim) & (m < seqlen_q)):
                                dq_accum[batch, m[lane], head, col[lane]] += dq_acc[lane, j, 2 * half]
                                dq_accum[batch, m[lane], head, col[lane] + 1] += dq_acc[lane, j, 2 * half + 1]

    for w in range(nwarps):
        for g in range(G):
            r = warp_rows * w + 16 * g
            bwd_stage_acc(smem, lay["K"], d_tile, r, 0, dk_acc[w, g], scale)
            bwd_stage_acc(smem, lay["V"], d_tile, r, 0, dv_acc[w, g], 1.0)
    bwd_store_tile(dk[batch, n0:, head_kv], smem, lay["K"], block_n, d_tile, nthreads, seqlen_k - n0, headdim)
    bwd_store_tile(dv[batch, n0:, head_kv], smem, lay["V"], block_n, d_tile, nthreads, seqlen_k - n0, headdim)


# ("v2", d_tile, BLOCK_M, M_SUB, BLOCK_N, NWARPS, ROW_GROUPS) of mma_bwd.DKDV_CONFIG_V2 and smaller
# variants (2 warps; BLOCK_M > M_SUB), with the v2 dQ kernel or the atomic dQ.
_BWD_V2_DKDV_CASES = [
    (("v2", 64, 64, 32, 128, 4, 2), (64, 128, 32, 4, 2), 40, 1, 150, 70, 2, 1, True),  # empty query rows
    (("v2", 64, 64, 32, 128, 4, 2), None, 64, 1, 70, 150, 2, 1, True),
    (("v2", 64, 64, 32, 128, 4, 2), None, 56, 2, 45, 33, 2, 2, False),
    (("v2", 64, 32, 32, 64, 2, 2), None, 64, 1, 133, 70, 1, 1, True),  # atomic dQ grid with 2 warps
    (("v2", 128, 32, 16, 64, 2, 2), (128, 64, 32, 2, 2), 72, 1, 50, 90, 3, 1, True),
]


@pytest.mark.parametrize("case", _BWD_V2_DKDV_CASES, ids=_bwd_case_id)
def test_bwd_v2_dkdv_emulation_matches_reference(case):
    test_bwd_emulation_matches_reference(case)


def test_bwd_v2_dkdv_table_matches_layout_and_fits():
    from cupyflash.kernels import mma_bwd

    for dt, (bm, ms, bn, nw, rg) in mma_bwd.DKDV_CONFIG_V2.items():
        for atomic in (False, True):
            lay = bwd_dkdv_layout(dt, bm, ms, bn, nw, 1, atomic)
            assert lay["BYTES"] == mma_bwd.dkdv_smem_bytes(dt, bm, ms, bn, nw, 1, atomic) <= 227 * 1024
            assert bn == 16 * rg * nw and bm % ms == 0 and ms % 16 == 0
            spec = mma_bwd.dkdv_spec(np.float16, dt, False, "atomic" if atomic else "none", "v2")
            assert spec.smem_bytes == lay["BYTES"] and "dkdv_mma_v2" in spec.name
        assert DEV_BWD.dkdv_tiles(dt, "v2", False) == ("v2", (bm, ms, bn, nw, rg))
    assert DEV_BWD.dkdv_tiles(128, "v2", False) == ("v1", mma_bwd.DKDV_CONFIG[128])


# ---------------------------------------------------------------------------------------------
# Backward v3: flash_bwd_dkdv_mma_split (warp pairs: a dV warp and a dK warp per 16 G key rows)
# ---------------------------------------------------------------------------------------------

def bwd_dkdv_split_xchg(d_tile, block_m, m_sub, block_n, nwarps, row_groups, atomic_dq):
    """DkdvSplitSmem<...>: (XCHG, XCHG_SLOT, BYTES)."""
    slot = row_groups * (m_sub // 8) * 32 * 16
    xchg = bwd_dkdv_layout(d_tile, block_m, m_sub, block_n, nwarps, 1, atomic_dq)["BYTES"]
    return xchg, slot, xchg + (nwarps // 2) * 2 * slot


def bwd_split_p_address(xchg, slot_bytes, m_sub, pair, slot, g, j):
    """Byte address of lane l's float4 of P^T fragment (g, j) in the pair's slot, for all lanes."""
    return xchg + pair * 2 * slot_bytes + LANES * 16 + slot * slot_bytes + (g * (m_sub // 8) + j) * 512


@mirrors("flash_bwd_mma.cu",
         "(Mask::HAS_LEFT && __uint_as_float(p[e]) == 0.f));")
def _dkdv_block_split(q, k, v, do, lse, delta, dk, dv, dq_accum, *, batch, head_kv, n_block, group, scale,
                      mask, d_tile, block_m, m_sub, block_n, nwarps, row_groups):
    """One CTA of flash_bwd_dkdv_mma_split; within a sub-block each pair's dV warp runs up to the
    pair barrier (P^T stored), then its dK warp (which reads P^T after the barrier)."""
    seqlen_q, headdim = q.shape[1], q.shape[3]
    seqlen_k = k.shape[1]
    atomic_dq = dq_accum is not None
    nthreads, G, pairs = 32 * nwarps, row_groups, nwarps // 2
    warp_rows = 16 * G
    dq_warps_m = block_m // 16
    dq_cols = d_tile // (nwarps // dq_warps_m)
    dq_pass = min(dq_cols, 32)
    assert block_n == warp_rows * pairs and block_m % m_sub == 0 and m_sub % 16 == 0
    lay = bwd_dkdv_layout(d_tile, block_m, m_sub, block_n, nwarps, 1, atomic_dq)
    xchg, slot_bytes, total = bwd_dkdv_split_xchg(d_tile, block_m, m_sub, block_n, nwarps, G, atomic_dq)
    smem = np.full(total // 2, np.nan)
    smem32 = np.full(total // 4, np.nan)
    scale_log2 = scale * math.log2(math.e)
    n0 = n_block * block_n
    m_block_first, m_blocks = _query_block_range(mask, n0, block_n, block_m, seqlen_q, seqlen_k)
    n_iters = group * m_blocks

    def load_query_block(it, stage):
        head = head_kv * group + it // m_blocks
        m0 = (m_block_first + it % m_blocks) * block_m
        cp_async_tile(smem, lay["Q"] + stage * lay["Q_TILE"], block_m, d_tile, nthreads, q[batch, :, head],
                      m0, seqlen_q - m0, headdim)
        cp_async_tile(smem, lay["DO"] + stage * lay["Q_TILE"], block_m, d_tile, nthreads, do[batch, :, head],
                      m0, seqlen_q - m0, headdim)
        for i in range(2 * block_m):
            r, is_lse = i % block_m, i < block_m
            dst = (lay["LSE"] if is_lse else lay["DELTA"]) + (stage * block_m + r) * 4
            stats = (lse if is_lse else delta)[batch, head]
            smem32[dst // 4] = stats[m0 + r] if m0 + r < seqlen_q else 0.0

    cp_async_tile(smem, lay["K"], block_n, d_tile, nthreads, k[batch, :, head_kv], n0, seqlen_k - n0, headdim)
    cp_async_tile(smem, lay["V"], block_n, d_tile, nthreads, v[batch, :, head_kv], n0, seqlen_k - n0, headdim)
    if n_iters > 0:
        load_query_block(0, 0)

    acc = np.zeros((nwarps, G, 32, d_tile // 8, 4))  # dV for warps < pairs, dK for the others
    slot = 0
    for it in range(n_iters):
        stage = it & 1
        if it + 1 < n_iters:
            load_query_block(it + 1, stage ^ 1)
        head = head_kv * group + it // m_blocks
        m0 = (m_block_first + it % m_blocks) * block_m
        s_q, s_do = lay["Q"] + stage * lay["Q_TILE"], lay["DO"] + stage * lay["Q_TILE"]
        s_lse, s_delta = (lay["LSE"] + stage * block_m * 4) // 4, (lay["DELTA"] + stage * block_m * 4) // 4
        for mc0 in range(0, block_m, m_sub):
            s_q_sub, s_do_sub = s_q + mc0 * d_tile * 2, s_do + mc0 * d_tile * 2
            m0_sub = m0 + mc0
            partial = _partial(m0_sub, m_sub, n0, block_n, seqlen_q, seqlen_k, mask)
            for pair in range(pairs):
                row0 = warp_rows * pair
                m_min = _first_query_of_key_rows(G, n0 + row0, seqlen_q, seqlen_k, mask)
                # dV warp
                s_acc = _p_transposed_groups(smem, smem32, lay["K"], row0, s_q_sub, s_lse + mc0, m0_sub, m_min,
                                             partial, G, m_sub, d_tile, scale_log2, seqlen_q, mask, n0, seqlen_k)
                for j in range(m_sub // 8):
                    for g in range(G):
                        addr = bwd_split_p_address(xchg, slot_bytes, m_sub, pair, slot, g, j)
                        for e in range(4):
                            smem32[addr // 4 + e] = s_acc[g, :, j, e]
                bwd_mma_AB_regs_groups(acc[pair], [bwd_pack_a_frags(s_acc[g]) for g in range(G)], smem, d_tile,
                                       m_sub, d_tile, s_do_sub, 0)
                # dK warp
                dp_acc = np.zeros((G, 32, m_sub // 8, 4))
                bwd_mma_ABt_groups(dp_acc, smem, m_sub, d_tile, d_tile, d_tile, lay["V"], row0, s_do_sub, 0)
                for j in range(m_sub // 8):
                    c = 8 * j + 2 * THREAD_IN_GROUP
                    for g in range(G):
                        addr = bwd_split_p_address(xchg, slot_bytes, m_sub, pair, slot, g, j)
                        for e in range(4):
                            p = smem32[addr // 4 + e]
                            ds = p * (dp_acc[g, :, j, e] - smem32[s_delta + mc0 + c + (e & 1)])
                            m = m0_sub + c + (e & 1)
                            hidden = partial & ((m < m_min[g, e >> 1]) | (m >= seqlen_q) |
                                                (mask.HAS_LEFT & (p == 0.0)))
                            dp_acc[g, :, j, e] = np.where(hidden, 0.0, ds)
                ds_frag = [bwd_pack_a_frags(dp_acc[g]) for g in range(G)]
                bwd_mma_AB_regs_groups(acc[pairs + pair], ds_frag, smem, d_tile, m_sub, d_tile, s_q_sub, 0)
                if atomic_dq:
                    _store_ds_transposed(smem, lay["DS"], block_m, row0, mc0, [ds_frag[g] for g in range(G)])
            slot ^= 1
        if atomic_dq:
            for w in range(nwarps):
                q_row0 = 16 * (w % dq_warps_m)
                m_lo = m0 + q_row0 + GROUP
                for col0 in range(dq_cols * (w // dq_warps_m), dq_cols * (w // dq_warps_m + 1), dq_pass):
                    dq_acc = np.zeros((32, dq_pass // 8, 4))
                    bwd_mma_AtB(dq_acc, smem, dq_pass, block_n, block_m, d_tile, lay["DS"], q_row0, lay["K"], col0)
                    for j in range(dq_pass // 8):
                        col = col0 + 8 * j + 2 * THREAD_IN_GROUP
                        for half, m in ((0, m_lo), (1, m_lo + 8)):
                            for lane in np.flatnonzero((col < headdim) & (m < seqlen_q)):
                                dq_accum[batch, m[lane], head, col[lane]] += dq_acc[lane, j, 2 * half]
                                dq_accum[batch, m[lane], head, col[lane] + 1] += dq_acc[lane, j, 2 * half + 1]

    for w in range(nwarps):
        for g in range(G):
            r = warp_rows * (w % pairs) + 16 * g
            if w >= pairs:
                bwd_stage_acc(smem, lay["K"], d_tile, r, 0, acc[w, g], scale)
            else:
                bwd_stage_acc(smem, lay["V"], d_tile, r, 0, acc[w, g], 1.0)
    bwd_store_tile(dk[batch, n0:, head_kv], smem, lay["K"], block_n, d_tile, nthreads, seqlen_k - n0, headdim)
    bwd_store_tile(dv[batch, n0:, head_kv], smem, lay["V"], block_n, d_tile, nthreads, seqlen_k - n0, headdim)


# ("split", d_tile, BLOCK_M, M_SUB, BLOCK_N, NWARPS, ROW_GROUPS) of mma_bwd.DKDV_CONFIG_SPLIT and
# smaller variants (4 warps, head dim 64, BLOCK_M > M_SUB so that both P^T slots are used).
_BWD_SPLIT_CASES = [
    (("split", 128, 64, 32, 128, 8, 2), (128, 128, 32, 4, 2), 128, 1, 100, 150, 2, 1, True),
    (("split", 128, 64, 32, 128, 8, 2), (128, 128, 64, 8), 96, 1, 190, 70, 1, 1, True),  # empty rows
    (("split", 64, 64, 32, 64, 4, 2), None, 64, 2, 70, 50, 2, 2, False),  # the atomic dQ path too
    (("split", 64, 32, 16, 32, 4, 1), None, 40, 1, 45, 77, 3, 1, True),
    (("split", 256, 32, 32, 64, 8, 1), (256, 64, 32, 4), 200, 1, 40, 70, 2, 1, True),
]


@pytest.mark.parametrize("case", _BWD_SPLIT_CASES, ids=_bwd_case_id)
def test_bwd_v3_split_emulation_matches_reference(case):
    test_bwd_emulation_matches_reference(case)


# Sliding windows (left, right) on every mma.sync backward model: v1 dK/dV (atomic dQ or the v1
# dQ kernel), v2 dK/dV and dQ, the split dK/dV. Each case's walks skip blocks: a dK/dV CTA stops
# short of the last query block, a dQ CTA starts past key block 0 (at an odd block for the stage
# parity where marked); partial blocks sit on both bounds; one-sided windows and rows that see no key.
_BWD_WINDOW_CASES = [
    # dkdv config, dq config or None (atomic), headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv,
    # causal, window_size
    ((64, 64, 32, 64, 4, 1), (64, 64, 32, 4), 40, 1, 200, 200, 1, 1, True, (70, -1)),  # dQ from block 3
    ((64, 32, 16, 32, 4, 2), None, 48, 1, 90, 120, 2, 1, False, (9, 17)),
    (("v2", 64, 64, 32, 128, 4, 2), (64, 128, 32, 4, 2), 64, 1, 150, 260, 1, 1, False, (60, 40)),  # block 1
    (("v2", 64, 32, 32, 64, 2, 2), None, 64, 1, 133, 200, 1, 1, False, (20, -1)),
    (("split", 64, 64, 32, 64, 4, 2), None, 40, 1, 100, 100, 2, 1, False, (0, 0)),
    # rows 0..44 see no key
    (("split", 128, 64, 32, 128, 8, 2), (128, 128, 32, 4, 2), 72, 1, 250, 200, 1, 1, False, (-1, 5)),
]


def _window_case_id(c):
    return _bwd_case_id(c[:9]) + "_window{}_{}".format(*c[9])


def _assert_walks_skip_blocks(mask, sq, sk, block_m, block_n):
    """The case exercises the window's walks: some key block visits fewer query blocks than exist
    (dK/dV), or some query block starts its key walk past block 0 (dQ)."""
    q_blocks, k_blocks = -(-sq // block_m), -(-sk // block_n)
    assert (any(len(mask.query_blocks(j * block_n, block_n, block_m, sq, sk)) < q_blocks for j in range(k_blocks)) or
            any(mask.key_begin(i * block_m, sq, sk) >= block_n for i in range(q_blocks)))


@pytest.mark.parametrize("case", _BWD_WINDOW_CASES, ids=_window_case_id)
def test_bwd_emulation_with_window_matches_reference(case):
    dkdv_config, dq_config, headdim, batch, sq, sk, nheads, nheads_kv, causal, window = case
    mask = masks.mask_for(causal, window)
    assert mask.HAS_LEFT
    dkdv = dkdv_config[1:] if isinstance(dkdv_config[0], str) else dkdv_config
    _assert_walks_skip_blocks(mask, sq, sk, dkdv[1], dkdv[3])
    _check_bwd_emulation(lambda q, k, v, do, scale: _bwd_emulated(q, k, v, do, causal=causal, scale=scale,
                                                                  dkdv_config=dkdv_config, dq_config=dq_config,
                                                                  window_size=window),
                         headdim, batch, sq, sk, nheads, nheads_kv, causal, window_size=window)


def test_bwd_v3_split_exchange_slots_are_disjoint_and_fit():
    from cupyflash.kernels import mma_bwd

    for dt, (bm, ms, bn, nw, rg) in mma_bwd.DKDV_CONFIG_SPLIT.items():
        xchg, slot_bytes, total = bwd_dkdv_split_xchg(dt, bm, ms, bn, nw, rg, False)
        assert total == mma_bwd.dkdv_split_smem_bytes(dt, bm, ms, bn, nw, rg, False) <= 163 * 1024
        assert bn == 16 * rg * nw // 2 and xchg % 128 == 0
        spec = mma_bwd.dkdv_spec(np.float16, dt, True, "none", DEV_BWD.dkdv_tiles(dt, "v3", False)[0])
        assert spec.smem_bytes == total and "dkdv_mma_split" in spec.name
        # the atomic path of v3 is v2's (the split kernel spills with ATOMIC_DQ)
        assert DEV_BWD.dkdv_tiles(dt, "v3", atomic_dq=True)[0] != "split"
        addrs = np.concatenate([bwd_split_p_address(xchg, slot_bytes, ms, p, s, g, j)
                                for p in range(nw // 2) for s in range(2) for g in range(rg) for j in range(ms // 8)])
        assert len(set(addrs.tolist())) == addrs.size and addrs.min() == xchg and addrs.max() + 16 == total


def test_fwd_wgmma_launch_arguments_match_kernel_signature(monkeypatch):
    """forward() on an sm_90 device (stand-in arrays, launch recorded) launches flash_fwd_wgmma with
    an argument list matching its C++ parameters; other devices keep flash_fwd_mma."""
    from cupyflash import plans
    from cupyflash.kernels import mma_fwd

    b, sq, sk, h, hkv = (_LAUNCH_SHAPE[x] for x in ("b", "sq", "sk", "h", "hkv"))
    for arch, smem, kernel in (("90", 227 * 1024, "flash_fwd_wgmma"), ("80", 163 * 1024, "flash_fwd_mma")):
        monkeypatch.setattr(mma_fwd, "current_arch", lambda: arch)
        monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem)
        for d in (64, 96, 200):
            launches = []
            monkeypatch.setattr(mma_fwd, "launch", lambda spec, grid, args: launches.append((spec, grid, args)))
            q, o = FakeArray((b, sq, h, d), np.float16), FakeArray((b, sq, h, d), np.float16)
            q.data = o.data = type("Ptr", (), {"ptr": 0})()
            k, v = FakeArray((b, sk, hkv, d), np.float16), FakeArray((b, sk, hkv, d), np.float16)
            k.data = v.data = q.data
            lse = FakeArray((b, h, sq), np.float32)
            lse.flags = type("Flags", (), {"c_contiguous": True})()
            mma_fwd.forward(q, k, v, o, lse, softmax_scale=0.1, causal=True)
            [(spec, grid, args)] = launches
            plan = plans.plan_forward(arch, np.float16, d, True, smem)
            assert spec.name.startswith(kernel) and spec == plan.spec
            assert grid == (math.ceil(sq / plan.block_m), h, b)
            _assert_arguments_match_signature(spec, grid, args)


# ---------------------------------------------------------------------------------------------
# Backward v4: flash_bwd_fused_mma (flash_bwd_fused_mma.cu). One CTA per key block computes S^T,
# P^T, dP^T and dS^T once per query block, keeps dK and dV in registers, stages P^T and dS^T in
# shared memory and adds dQ into dq_accum, in a fixed key-block order with DQ_ORDERED.
# ---------------------------------------------------------------------------------------------

def bwd_mma_AB_groups(acc, smem, n, k, dim_a, dim_b, tile_a, a_row0, tile_b, b_col0):
    """mma_AB_groups: acc[g] += A_g B, A_g = rows a_row0 + 16 g, columns 0..k of a [.][dim_a] tile
    (pattern X, non-transposed), B = rows 0..k, columns b_col0..+n of a [k][dim_b] tile (pattern X,
    .trans)."""
    groups = acc.shape[0]
    a_lane = bwd_tile_offset(dim_a, a_row0 + LDM_ROW_X, LDM_CHUNK_X)
    b_lane = bwd_tile_offset(dim_b, LDM_ROW_X, b_col0 // 8 + LDM_CHUNK_X)
    for kk in range(k // 16):
        a = [ldmatrix_x4(smem, tile_a + bwd_tile_step(dim_a, a_lane, 16 * g, 2 * kk)) for g in range(groups)]
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + bwd_tile_step(dim_b, b_lane, 16 * kk, 2 * nn), trans=True)
            for g in range(groups):
                mma_16816(acc[g, :, 2 * nn], a[g], b[:, 0], b[:, 1])
                mma_16816(acc[g, :, 2 * nn + 1], a[g], b[:, 2], b[:, 3])


def bwd_mma_AtB_groups(acc, smem, n, k, dim_a, dim_b, tile_a, a_col0, tile_b, b_col0):
    """mma_AtB_groups: acc[g] += A_g^T B, A_g^T = columns a_col0 + 16 g of a [k][dim_a] tile
    (pattern Y, .trans), B = rows 0..k, columns b_col0..+n of a [k][dim_b] tile (pattern X, .trans)."""
    groups = acc.shape[0]
    a_lane = bwd_tile_offset(dim_a, LDM_ROW_Y, a_col0 // 8 + LDM_CHUNK_Y)
    b_lane = bwd_tile_offset(dim_b, LDM_ROW_X, b_col0 // 8 + LDM_CHUNK_X)
    for kk in range(k // 16):
        a = [ldmatrix_x4(smem, tile_a + bwd_tile_step(dim_a, a_lane, 16 * kk, 2 * g), trans=True)
             for g in range(groups)]
        for nn in range(n // 16):
            b = ldmatrix_x4(smem, tile_b + bwd_tile_step(dim_b, b_lane, 16 * kk, 2 * nn), trans=True)
            for g in range(groups):
                mma_16816(acc[g, :, 2 * nn], a[g], b[:, 0], b[:, 1])
                mma_16816(acc[g, :, 2 * nn + 1], a[g], b[:, 2], b[:, 3])


def _store_swizzled(smem, tile, cols, values):
    """values (rows x cols) into a swizzled [rows][cols] tile at byte address `tile`."""
    for r in range(values.shape[0]):
        for c in range(cols // 8):
            o = (tile + bwd_tile_offset(cols, r, c)) // 2
            smem[o: o + 8] = values[r, 8 * c: 8 * c + 8]


def _c_fragments_as_matrix(acc):
    """acc[lane, N/8, 4] (16-row C fragments) -> the 16 x N block."""
    out = np.full((16, 8 * acc.shape[1]), np.nan)
    for j in range(acc.shape[1]):
        cols = 8 * j + 2 * THREAD_IN_GROUP
        out[GROUP, cols], out[GROUP, cols + 1] = acc[:, j, 0], acc[:, j, 1]
        out[GROUP + 8, cols], out[GROUP + 8, cols + 1] = acc[:, j, 2], acc[:, j, 3]
    return out


# (dim_a, dim_b, G, N, row origin of A (AB), column origin of A^T (AtB), column origin of B): the
# fused kernel's operand shapes (P^T, dS^T 64 or 128 wide; Q, dO, K 64, 128, 256 wide) and warp
# origins (key_row0, dq_row0: multiples of KN, QM; d_col0, dq_col0: multiples of DW, DQW).
@pytest.mark.parametrize("dim_a, dim_b, groups, n, a_row0, a_col0, b_col0", [
    (64, 64, 2, 32, 32, 32, 32), (64, 128, 2, 64, 96, 0, 64), (128, 64, 2, 16, 64, 96, 48),
    (64, 256, 2, 64, 0, 32, 192), (64, 256, 1, 128, 112, 48, 128), (128, 128, 2, 32, 32, 64, 96)])
def test_bwd_fused_warp_products_match_numpy(dim_a, dim_b, groups, n, a_row0, a_col0, b_col0):
    """mma_AB_groups and mma_AtB_groups against A @ B on random tiles (one warp)."""
    rng = np.random.default_rng(dim_a + dim_b + n)
    rows = 128  # rows of the A tile of mma_AB_groups (key rows); the reduction length K of both
    t, b = rng.standard_normal((rows, dim_a)), rng.standard_normal((rows, dim_b))
    smem = np.full((rows * dim_a + rows * dim_b), np.nan)
    tile_t, tile_b = 0, rows * dim_a * 2
    _store_swizzled(smem, tile_t, dim_a, t)
    _store_swizzled(smem, tile_b, dim_b, b)

    # mma_AB_groups: rows a_row0 + 16 g of t (K = dim_a columns) times rows 0..dim_a of b
    acc = np.zeros((groups, 32, n // 8, 4))
    bwd_mma_AB_groups(acc, smem, n, dim_a, dim_a, dim_b, tile_t, a_row0, tile_b, b_col0)
    for g in range(groups):
        rows_g = slice(a_row0 + 16 * g, a_row0 + 16 * g + 16)
        np.testing.assert_allclose(_c_fragments_as_matrix(acc[g]), t[rows_g] @ b[:dim_a, b_col0:b_col0 + n],
                                   atol=1e-12)

    # mma_AtB_groups: columns a_col0 + 16 g of t (transposed) times b, reduced over all rows
    acc = np.zeros((groups, 32, n // 8, 4))
    bwd_mma_AtB_groups(acc, smem, n, rows, dim_a, dim_b, tile_t, a_col0, tile_b, b_col0)
    for g in range(groups):
        cols_g = slice(a_col0 + 16 * g, a_col0 + 16 * g + 16)
        np.testing.assert_allclose(_c_fragments_as_matrix(acc[g]), t[:, cols_g].T @ b[:, b_col0:b_col0 + n],
                                   atol=1e-12)


def bwd_fused_layout(d_tile, block_m, block_n):
    """FusedSmem<D_TILE, BLOCK_M, BLOCK_N> of flash_bwd_fused_mma.cu, field by field."""
    kv_tile, q_tile, p_tile = block_n * d_tile * 2, block_m * d_tile * 2, block_n * block_m * 2
    lay = dict(KV_TILE=kv_tile, Q_TILE=q_tile, P_TILE=p_tile, K=0)
    lay["V"] = lay["K"] + kv_tile
    lay["Q"] = lay["V"] + kv_tile
    lay["DO"] = lay["Q"] + 2 * q_tile
    lay["PT"] = lay["DO"] + 2 * q_tile
    lay["DST"] = lay["PT"] + p_tile
    lay["LSE"] = lay["DST"] + p_tile
    lay["DELTA"] = lay["LSE"] + 2 * block_m * 4
    lay["BYTES"] = lay["DELTA"] + 2 * block_m * 4
    return lay


def bwd_fused_tiles(d_tile, config):
    """The constexpr warp-tile sizes of flash_bwd_fused_mma for one configuration (C++ integer
    division, as in the kernel)."""
    block_m, block_n, warps_n, warps_d, dq_warps_m, s_unroll = config[:6]  # [6]: release timing only
    t = dict(BLOCK_M=block_m, BLOCK_N=block_n, WARPS_N=warps_n, WARPS_D=warps_d, DQ_WARPS_M=dq_warps_m,
             S_UNROLL=s_unroll, NWARPS=warps_n * warps_d, KN=block_n // warps_n, SQ=block_m // warps_d,
             DW=d_tile // warps_d, QM=block_m // dq_warps_m)
    t["NTHREADS"] = 32 * t["NWARPS"]
    t["KG"], t["QG"] = t["KN"] // 16, t["QM"] // 16
    t["DQ_WARPS_D"] = t["NWARPS"] // dq_warps_m
    t["DQW"] = d_tile // t["DQ_WARPS_D"]
    t["DQ_PASS"] = min(t["DQW"], 32)
    return t


def bwd_fused_warp_origins(t, warp):
    """Per warp, as the kernel derives them: key_row0, q_col0, d_col0, dq_row0, dq_col0."""
    return dict(key_row0=t["KN"] * (warp // t["WARPS_D"]), q_col0=t["SQ"] * (warp % t["WARPS_D"]),
                d_col0=t["DW"] * (warp % t["WARPS_D"]), dq_row0=t["QM"] * (warp % t["DQ_WARPS_M"]),
                dq_col0=t["DQW"] * (warp // t["DQ_WARPS_M"]))


@mirrors("flash_bwd_fused_mma.cu",
         "const int m_block_first = mask.query_begin(n0) / BLOCK_M;",
         "const int m_block_end = (mask.query_end(n0, BLOCK_N) + BLOCK_M - 1) / BLOCK_M;")
def _fused_loop_bounds(seqlen_q, seqlen_k, block_m, block_n, mask, n_block):
    """The kernel's (m_block_first, q_blocks, m_blocks) for key block n_block (mask: a policy, or
    the causal flag of the ordered-dQ simulations, which take no window)."""
    mask = masks.as_mask(mask)
    m_block_first, m_blocks = _query_block_range(mask, n_block * block_n, block_n, block_m, seqlen_q, seqlen_k)
    return m_block_first, (seqlen_q + block_m - 1) // block_m, m_blocks


def _fused_iterations(seqlen_q, seqlen_k, block_m, block_n, mask, n_block, head_kv, group, ordered):
    """(head, m_block) of each iteration of key block n_block's CTA: m_block_of(it); with
    DQ_ORDERED each head's query blocks from the last to the first."""
    first, q_blocks, m_blocks = _fused_loop_bounds(seqlen_q, seqlen_k, block_m, block_n, mask, n_block)
    return [(head_kv * group + it // m_blocks, q_blocks - 1 - it % m_blocks if ordered else first + it % m_blocks)
            for it in range(group * m_blocks)]


@mirrors("flash_bwd_fused_mma.cu",
         "const typename Mask::Origin origin = mask.origin(query0, key0);",
         "const bool hidden = mask.hidden(origin, query_off, key_off);",
         "s_acc[g][j][e] = partial && hidden ? 0.f : p;")
def _fused_cta(q, k, v, do, lse, delta, dk, dv, dq_accum, semaphore, *, n_block, head_kv, batch, scale, mask,
               d_tile, config, ordered):
    """One CTA (blockIdx = (n_block, head_kv, batch)) of flash_bwd_fused_mma, phase by phase: step 1
    of all warps, (ordered) the releases and the prefetch, steps 2-5 of all warps, the barrier,
    steps 6-9 of all warps. ``semaphore`` is the dq_semaphore array (ordered only); CTAs run one
    after another in blockIdx order, so every wait must find its turn already reached (the
    kernel would spin forever otherwise)."""
    seqlen_q, headdim = q.shape[1], q.shape[3]
    seqlen_k, group = k.shape[1], q.shape[2] // k.shape[2]
    t = bwd_fused_tiles(d_tile, config)
    block_m, block_n, nwarps, nthreads = t["BLOCK_M"], t["BLOCK_N"], t["NWARPS"], t["NTHREADS"]
    KG, SQ, DW, QG, DQW, DQ_PASS = t["KG"], t["SQ"], t["DW"], t["QG"], t["DQW"], t["DQ_PASS"]
    lay = bwd_fused_layout(d_tile, block_m, block_n)
    smem = np.full(lay["BYTES"] // 2, np.nan)  # 16-bit tiles, by byte address // 2
    smem32 = np.full(lay["BYTES"] // 4, np.nan)  # lse and D, by byte address // 4
    scale_log2 = scale * math.log2(math.e)
    n0 = n_block * block_n
    lo_off, hi_off = mask.offsets(seqlen_q, seqlen_k)
    iterations = _fused_iterations(seqlen_q, seqlen_k, block_m, block_n, mask, n_block, head_kv, group, ordered)
    n_iters = len(iterations)

    def load_query_block(it, stage):
        head, m_block = iterations[it]
        m0 = m_block * block_m
        for tile, src in ((lay["Q"], q), (lay["DO"], do)):
            cp_async_tile(smem, tile + stage * lay["Q_TILE"], block_m, d_tile, nthreads, src[batch, :, head],
                          m0, seqlen_q - m0, headdim)
        for i in range(2 * block_m):  # cp_async_4, zero-filled past seqlen_q
            r, is_lse = i % block_m, i < block_m
            dst = (lay["LSE"] if is_lse else lay["DELTA"]) + (stage * block_m + r) * 4
            smem32[dst // 4] = (lse if is_lse else delta)[batch, head, m0 + r] if m0 + r < seqlen_q else 0.0

    cp_async_tile(smem, lay["K"], block_n, d_tile, nthreads, k[batch, :, head_kv], n0, seqlen_k - n0, headdim)
    cp_async_tile(smem, lay["V"], block_n, d_tile, nthreads, v[batch, :, head_kv], n0, seqlen_k - n0, headdim)
    if n_iters > 0:
        load_query_block(0, 0)

    warps = [bwd_fused_warp_origins(t, w) for w in range(nwarps)]
    dk_acc = np.zeros((nwarps, KG, 32, DW // 8, 4))
    dv_acc = np.zeros((nwarps, KG, 32, DW // 8, 4))
    pending_release = None  # ordered: (batch, head, m_block) added last, not yet released

    for it in range(n_iters):
        stage = it & 1
        if not ordered and it + 1 < n_iters:
            load_query_block(it + 1, stage ^ 1)
        head, m_block = iterations[it]
        m0 = m_block * block_m
        s_q, s_do = lay["Q"] + stage * lay["Q_TILE"], lay["DO"] + stage * lay["Q_TILE"]
        s_lse, s_delta = (lay["LSE"] + stage * block_m * 4) // 4, (lay["DELTA"] + stage * block_m * 4) // 4
        partial = _partial(m0, block_m, n0, block_n, seqlen_q, seqlen_k, mask)

        # Step 1
        s_acc = np.zeros((nwarps, KG, 32, SQ // 8, 4))
        for w, o in enumerate(warps):
            bwd_mma_ABt_groups(s_acc[w], smem, SQ, d_tile, d_tile, d_tile, lay["K"], o["key_row0"],
                               s_q + o["q_col0"] * d_tile * 2, 0)
        if ordered:  # release_dq_block by every warp, then the prefetch
            if pending_release is not None:
                semaphore[pending_release] += nwarps
            pending_release = None
            if it + 1 < n_iters:
                load_query_block(it + 1, stage ^ 1)
        for w, o in enumerate(warps):  # steps 2-5, up to the barrier
            key_row0, q_col0 = o["key_row0"], o["q_col0"]
            key0, query0 = n0 + key_row0 + GROUP, m0 + q_col0 + 2 * THREAD_IN_GROUP
            keys_left, queries_left = seqlen_k - key0, seqlen_q - query0
            hi_slack, lo_slack = query0 + hi_off - key0, query0 + lo_off - key0  # the policy's origin
            for j in range(SQ // 8):
                c = q_col0 + 8 * j + 2 * THREAD_IN_GROUP
                base_log2 = [_lse_base_log2(smem32[s_lse + c]), _lse_base_log2(smem32[s_lse + c + 1])]
                for g in range(KG):
                    for e in range(4):
                        p = np.exp2(s_acc[w, g, :, j, e] * scale_log2 - base_log2[e & 1])
                        key_off, query_off = 16 * g + 8 * (e >> 1), 8 * j + (e & 1)
                        hidden = (key_off >= keys_left) | (query_off >= queries_left)
                        if mask.HAS_RIGHT:
                            hidden |= key_off - query_off > hi_slack
                        if mask.HAS_LEFT:
                            hidden |= key_off - query_off < lo_slack
                        s_acc[w, g, :, j, e] = np.where(partial & hidden, 0.0, p)
            for g in range(KG):
                bwd_stage_acc(smem, lay["PT"], block_m, key_row0 + 16 * g, q_col0, s_acc[w, g], 1.0)
            dp_acc = np.zeros((KG, 32, SQ // 8, 4))
            bwd_mma_ABt_groups(dp_acc, smem, SQ, d_tile, d_tile, d_tile, lay["V"], key_row0,
                               s_do + q_col0 * d_tile * 2, 0)
            for j in range(SQ // 8):
                c = q_col0 + 8 * j + 2 * THREAD_IN_GROUP
                d2 = [smem32[s_delta + c], smem32[s_delta + c + 1]]
                for g in range(KG):
                    for e in range(4):
                        p = s_acc[w, g, :, j, e]
                        with np.errstate(invalid="ignore"):  # NaN data (test of the selection)
                            ds = p * (dp_acc[g, :, j, e] - d2[e & 1])
                        dp_acc[g, :, j, e] = np.where(p == 0.0, 0.0, ds)
            for g in range(KG):
                bwd_stage_acc(smem, lay["DST"], block_m, key_row0 + 16 * g, q_col0, dp_acc[g], 1.0)

        sem = (batch, head, m_block)
        for w, o in enumerate(warps):  # steps 6-9, after the barrier
            key_row0, d_col0 = o["key_row0"], o["d_col0"]
            bwd_mma_AB_groups(dv_acc[w], smem, DW, block_m, block_m, d_tile, lay["PT"], key_row0, s_do, d_col0)
            bwd_mma_AB_groups(dk_acc[w], smem, DW, block_m, block_m, d_tile, lay["DST"], key_row0, s_q, d_col0)
            if ordered:
                # Sequential CTAs: key blocks 0..n_block-1 have finished (the count is exact), and
                # this CTA's warps release the block only at the next step 1.
                assert semaphore[sem] == n_block * nwarps, ("would wait forever", sem, n_block, semaphore[sem])
            dq_row0, dq_col0 = o["dq_row0"], o["dq_col0"]
            for pass_col0 in range(dq_col0, dq_col0 + DQW, DQ_PASS):
                dq_acc = np.zeros((QG, 32, DQ_PASS // 8, 4))
                bwd_mma_AtB_groups(dq_acc, smem, DQ_PASS, block_n, block_m, d_tile, lay["DST"], dq_row0, lay["K"],
                                   pass_col0)
                for g in range(QG):
                    m_lo = m0 + dq_row0 + 16 * g + GROUP
                    for j in range(DQ_PASS // 8):
                        col = pass_col0 + 8 * j + 2 * THREAD_IN_GROUP
                        for half, m in ((0, m_lo), (1, m_lo + 8)):
                            adds = (col < headdim) & (m < seqlen_q)  # red_add_f32x2: two columns per lane
                            for e in range(2):
                                dq_accum[batch, m[adds], head, col[adds] + e] += dq_acc[g, adds, j, 2 * half + e]
        if ordered:
            pending_release = sem
    if pending_release is not None:
        semaphore[pending_release] += nwarps

    # Epilogue: dK (times scale) and dV staged through the K and V tiles, then 16-byte stores.
    for w, o in enumerate(warps):
        for g in range(KG):
            bwd_stage_acc(smem, lay["K"], d_tile, o["key_row0"] + 16 * g, o["d_col0"], dk_acc[w, g], scale)
            bwd_stage_acc(smem, lay["V"], d_tile, o["key_row0"] + 16 * g, o["d_col0"], dv_acc[w, g], 1.0)
    bwd_store_tile(dk[batch, n0:, head_kv], smem, lay["K"], block_n, d_tile, nthreads, seqlen_k - n0, headdim)
    bwd_store_tile(dv[batch, n0:, head_kv], smem, lay["V"], block_n, d_tile, nthreads, seqlen_k - n0, headdim)


def _fused_emulated(q, k, v, do, causal, scale, config, ordered=True, window_size=(-1, -1)):
    """dq, dk, dv from the emulated flash_bwd_fused_mma (CTAs in blockIdx order, x fastest) and
    flash_bwd_dq_convert; config is a FUSED_CONFIG entry, the head-dim tile follows from headdim."""
    from cupyflash.kernels.mma_bwd import d_tile as d_tile_of
    from cupyflash.reference import attention  # sums over visible keys only: NaN-safe

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    d_tile, block_m, block_n = d_tile_of(headdim), config[0], config[1]
    o, lse = attention(q, k, v, softmax_scale=scale, causal=causal, window_size=window_size)
    mask = masks.mask_for(causal, window_size)
    assert not (ordered and mask.HAS_LEFT)  # the kernel's static_assert: ordered dQ adds take no window
    with np.errstate(invalid="ignore"):
        delta = np.einsum("bqhd,bqhd->bhq", do, o)
    dq, dk, dv = np.full(q.shape, np.nan), np.full(k.shape, np.nan), np.full(v.shape, np.nan)
    dq_accum = np.zeros((batch, seqlen_q, nheads, d_tile))
    q_blocks = math.ceil(seqlen_q / block_m)
    semaphore = np.zeros((batch, nheads, q_blocks), dtype=np.int64)
    n_blocks = math.ceil(seqlen_k / block_n)
    for b in range(batch):
        for hk in range(nheads_kv):
            for n_block in range(n_blocks):
                _fused_cta(q, k, v, do, lse, delta, dk, dv, dq_accum, semaphore, n_block=n_block, head_kv=hk,
                           batch=b, scale=scale, mask=mask, d_tile=d_tile, config=config, ordered=ordered)
    if ordered:  # every warp of every key block that visits a query block released it once
        nwarps = config[2] * config[3]
        for m_block in range(q_blocks):
            visitors = sum(m_block >= _fused_loop_bounds(seqlen_q, seqlen_k, block_m, block_n, mask, j)[0]
                           for j in range(n_blocks))
            assert np.all(semaphore[:, :, m_block] == visitors * nwarps)
    assert np.all(dq_accum[..., headdim:] == 0)
    for idx in range(batch * seqlen_q * nheads * (headdim // 8)):  # flash_bwd_dq_convert
        chunk, row_id = idx % (headdim // 8), idx // (headdim // 8)
        h, m, b = row_id % nheads, (row_id // nheads) % seqlen_q, row_id // (nheads * seqlen_q)
        dq[b, m, h, chunk * 8: chunk * 8 + 8] = dq_accum[b, m, h, chunk * 8: chunk * 8 + 8] * scale
    return dq, dk, dv


def _fused_configs():
    from cupyflash.kernels import mma_bwd

    return [(dt, c) for dt, c in mma_bwd.FUSED_CONFIG.items()] + [
        (dt, c) for dt, configs in DEV_BWD.FUSED_CANDIDATES.items() for c in configs]


# The FUSED_CONFIG entries and some FUSED_CANDIDATES on a few blocks each: uneven lengths, head
# dims below the tile (zero-filled columns), GQA, causal with seqlen_q above and below seqlen_k.
_BWD_FUSED_CASES = [
    # config, ordered, headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal
    ((64, 128, 4, 2, 2, 4), True, 40, 1, 70, 150, 2, 1, False),
    ((64, 128, 4, 2, 2, 4), True, 64, 1, 150, 70, 1, 1, True),  # empty query rows, one key block
    ((64, 128, 4, 2, 2, 4), False, 56, 2, 133, 198, 1, 1, True),  # key 128: first seen by query 63 (block 0)
    ((64, 128, 4, 2, 2, 4), True, 64, 1, 1, 150, 2, 1, True),  # one query: one block, two key blocks
    ((64, 128, 4, 2, 2, 4), True, 64, 1, 200, 200, 1, 1, True),  # the diagonal meets block boundaries
    ((64, 128, 4, 2, 2, 1), True, 24, 1, 100, 257, 3, 1, True),  # three key blocks for the last query block
    ((128, 128, 4, 2, 4, 1), True, 48, 1, 150, 200, 1, 1, True),
    ((64, 128, 4, 2, 2, 1), True, 96, 1, 100, 130, 1, 1, True),
    ((64, 128, 4, 2, 2, 1), False, 128, 1, 90, 90, 2, 2, False),
    ((64, 64, 2, 4, 2, 1), True, 200, 1, 70, 90, 2, 1, True),
    ((64, 64, 2, 4, 2, 1), False, 256, 1, 45, 33, 1, 1, False),
    ((64, 64, 4, 2, 2, 1), True, 136, 1, 100, 40, 1, 1, True),  # query blocks no key block visits
]


def _fused_case_id(c):
    return "bm{}_bn{}_wn{}_wd{}_dqm{}_u{}".format(*c[0]) + ("_ordered" if c[1] else "_unordered") + \
        "_hd{}_b{}_sq{}_sk{}_h{}_{}".format(*c[2:8]) + ("_causal" if c[8] else "")


@pytest.mark.parametrize("case", _BWD_FUSED_CASES, ids=_fused_case_id)
def test_bwd_fused_emulation_matches_reference(case):
    config, ordered, headdim, batch, sq, sk, nheads, nheads_kv, causal = case
    _check_bwd_emulation(lambda q, k, v, do, scale: _fused_emulated(q, k, v, do, causal, scale, config, ordered),
                         headdim, batch, sq, sk, nheads, nheads_kv, causal)


# The fused kernel with a window: unordered dQ adds only (ordered ones refuse a left bound).
_BWD_FUSED_WINDOW_CASES = [
    # config, ordered, headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal, window_size
    ((64, 128, 4, 2, 2, 4), False, 56, 1, 200, 230, 2, 1, False, (50, 10)),
    ((64, 128, 4, 2, 2, 1), False, 64, 1, 150, 200, 1, 1, True, (30, -1)),
]


@pytest.mark.parametrize("case", _BWD_FUSED_WINDOW_CASES,
                         ids=lambda c: _fused_case_id(c[:9]) + "_window{}_{}".format(*c[9]))
def test_bwd_fused_emulation_with_window_matches_reference(case):
    config, ordered, headdim, batch, sq, sk, nheads, nheads_kv, causal, window = case
    mask = masks.mask_for(causal, window)
    assert mask.HAS_LEFT and not ordered
    _assert_walks_skip_blocks(mask, sq, sk, config[0], config[1])
    _check_bwd_emulation(lambda q, k, v, do, scale: _fused_emulated(q, k, v, do, causal, scale, config, ordered,
                                                                    window_size=window),
                         headdim, batch, sq, sk, nheads, nheads_kv, causal, window_size=window)


def test_bwd_fused_nan_in_a_value_row_stays_out_of_queries_that_do_not_see_it(nan_is_data):
    # dS^T is set to 0 by selection where P^T is 0, so the NaN of dP^T = V dO^T in a hidden key's
    # row cannot reach dQ of the queries that do not see that key.
    from cupyflash.reference import attention_backward


    rng = np.random.default_rng(8)
    q, do = rng.standard_normal((1, 90, 1, 64)), rng.standard_normal((1, 90, 1, 64))
    k, v = rng.standard_normal((1, 90, 1, 64)), rng.standard_normal((1, 90, 1, 64))
    v[0, 40, 0, 3] = np.nan
    with np.errstate(invalid="ignore"):
        dq, dk, dv = _fused_emulated(q, k, v, do, True, 0.125, (64, 128, 4, 2, 2, 4))
        dq_ref, dk_ref, dv_ref = attention_backward(do, q, k, v, softmax_scale=0.125, causal=True)
    assert np.isfinite(dq[0, :40]).all() and np.isnan(dq[0, 40:]).all()
    np.testing.assert_allclose(dq, dq_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dk, dk_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dv, dv_ref, rtol=1e-9, atol=1e-9)


def _conforms_to_tile_step(cols, lane_row, lane_chunk, row0, chunk0, steps):
    """Whether tile_step from the lane offset of (row0, chunk0) gives tile_offset of every
    (row0 + rows, chunk0 + chunks) in `steps`, for all lanes."""
    lane_off = bwd_tile_offset(cols, row0 + lane_row, chunk0 + lane_chunk)
    return all(np.array_equal(bwd_tile_step(cols, lane_off, rows, chunks),
                              bwd_tile_offset(cols, row0 + rows + lane_row, chunk0 + chunks + lane_chunk))
               for rows, chunks in steps)


def test_bwd_fused_configs_satisfy_the_kernel_static_asserts_and_fit():
    """Every FUSED_CONFIG and FUSED_CANDIDATES entry: the static_asserts of flash_bwd_fused_mma and
    of the tile copies, warp tiles that cover each block exactly once, fragment addresses that
    tile_step may step (origins and steps as in the kernel), FusedSmem == fused_smem_bytes."""
    from cupyflash.kernels import mma_bwd

    for dt, config in _fused_configs():
        t = bwd_fused_tiles(dt, config)
        bm, bn, nwarps, nthreads = t["BLOCK_M"], t["BLOCK_N"], t["NWARPS"], t["NTHREADS"]
        what = (dt, config)
        # static_asserts of the kernel
        assert all(t[x] % 16 == 0 and t[x] > 0 for x in ("KN", "SQ", "DW", "QM", "DQW")), what
        assert nwarps % t["DQ_WARPS_M"] == 0 and bm % 64 == 0, what
        lay = bwd_fused_layout(dt, bm, bn)
        assert lay["BYTES"] <= 227 * 1024, what
        # cp_async_tile (Q, dO: BLOCK_M rows; K, V: BLOCK_N rows) and store_tile (dK, dV)
        chunks = dt // 8
        assert nthreads % chunks == 0 and bm % (nthreads // chunks) == 0 and bn % (nthreads // chunks) == 0, what
        assert (bn * chunks) % nthreads == 0, what
        assert 1 <= t["S_UNROLL"] <= dt // 16, what
        assert t["DQW"] % t["DQ_PASS"] == 0, what  # the dQ passes end at the warp's last column
        # the warp tiles of S^T / dP^T, dK / dV and dQ partition their blocks
        cover_s, cover_kv, cover_q = np.zeros((bn, bm), int), np.zeros((bn, dt), int), np.zeros((bm, dt), int)
        for w in range(nwarps):
            o = bwd_fused_warp_origins(t, w)
            cover_s[o["key_row0"]: o["key_row0"] + t["KN"], o["q_col0"]: o["q_col0"] + t["SQ"]] += 1
            cover_kv[o["key_row0"]: o["key_row0"] + t["KN"], o["d_col0"]: o["d_col0"] + t["DW"]] += 1
            cover_q[o["dq_row0"]: o["dq_row0"] + t["QM"], o["dq_col0"]: o["dq_col0"] + t["DQW"]] += 1
        assert np.all(cover_s == 1) and np.all(cover_kv == 1) and np.all(cover_q == 1), what
        # fragment addresses: one lane offset per product, then tile_step (XOR + add) per fragment
        for w in range(nwarps):
            o = bwd_fused_warp_origins(t, w)
            assert o["q_col0"] % 8 == 0  # s_q + q_col0 rows keeps the swizzle phase (row % 8)
            s_steps = [(16 * g, 2 * kk) for g in range(t["KG"]) for kk in range(dt // 16)]
            assert _conforms_to_tile_step(dt, LDM_ROW_X, LDM_CHUNK_X, o["key_row0"], 0, s_steps), (what, w, "K, V")
            q_steps = [(16 * nn, 2 * kk) for nn in range(t["SQ"] // 16) for kk in range(dt // 16)]
            assert _conforms_to_tile_step(dt, LDM_ROW_Y, LDM_CHUNK_Y, 0, 0, q_steps), (what, w, "Q, dO")
            pt_steps = [(16 * g, 2 * kk) for g in range(t["KG"]) for kk in range(bm // 16)]
            assert _conforms_to_tile_step(bm, LDM_ROW_X, LDM_CHUNK_X, o["key_row0"], 0, pt_steps), (what, w, "P^T")
            do_steps = [(16 * kk, 2 * nn) for kk in range(bm // 16) for nn in range(t["DW"] // 16)]
            assert _conforms_to_tile_step(dt, LDM_ROW_X, LDM_CHUNK_X, 0, o["d_col0"] // 8, do_steps), (what, w, "dO")
            ds_steps = [(16 * kk, 2 * g) for kk in range(bn // 16) for g in range(t["QG"])]
            assert _conforms_to_tile_step(bm, LDM_ROW_Y, LDM_CHUNK_Y, 0, o["dq_row0"] // 8, ds_steps), (what, w, "dS^T")
            k_steps = [(16 * kk, 2 * nn) for kk in range(bn // 16) for nn in range(t["DQ_PASS"] // 16)]
            for pass_col0 in range(o["dq_col0"], o["dq_col0"] + t["DQW"], t["DQ_PASS"]):
                assert _conforms_to_tile_step(dt, LDM_ROW_X, LDM_CHUNK_X, 0, pass_col0 // 8, k_steps), (what, w, "K")
        # the layout and its Python mirror; regions 128-byte aligned (lse, D read as float2)
        assert lay["BYTES"] == mma_bwd.fused_smem_bytes(dt, bm, bn), what
        assert all(lay[r] % 128 == 0 for r in ("K", "V", "Q", "DO", "PT", "DST", "LSE", "DELTA")), what
        spec = mma_bwd.fused_spec(np.float16, dt, True, "ordered", config)
        assert spec.smem_bytes == lay["BYTES"] and spec.threads == nthreads, what
    # fused_config: the table's entry where it fits the device's shared memory per block
    for dt in mma_bwd.D_TILES:
        config = mma_bwd.FUSED_CONFIG.get(dt)
        assert DEV_BWD.fused_config(dt, 227 * 1024) == DEV_BWD.fused_config(dt, None) == config
        fits_sm80 = config is not None and mma_bwd.fused_smem_bytes(dt, *config[:2]) <= 163 * 1024
        assert DEV_BWD.fused_config(dt, 163 * 1024) == (config if fits_sm80 else None)


def test_bwd_fused_every_table_geometry_is_emulated():
    """Each warp geometry (head-dim tile, BLOCK_M, BLOCK_N, WARPS_N, WARPS_D, DQ_WARPS_M) of
    FUSED_CONFIG and FUSED_CANDIDATES runs in test_bwd_fused_emulation_matches_reference
    (S_UNROLL changes no index)."""
    from cupyflash.kernels.mma_bwd import d_tile

    emulated = {(d_tile(case[2]), case[0][:5]) for case in _BWD_FUSED_CASES}
    for dt, config in _fused_configs():
        assert (dt, config[:5]) in emulated, (dt, config)


def _simulate_dq_order(seqlen_q, seqlen_k, block_m, block_n, causal, *, resident, rng, descending=False,
                       group=2, nheads_kv=2, nwarps=8):
    """The DQ_ORDERED protocol of flash_bwd_fused_mma on a model of the GPU: CTAs dispatched in
    blockIdx order (x fastest), at most `resident` at a time, each walking its (query head, query
    block) iterations in the kernel's order. An iteration releases the previous query block (NWARPS
    increments: one per warp, at step 1), waits until the block's counter reaches turn * NWARPS
    (step 8; turn = n_block, or last visitor - n_block with `descending`, the counter-example),
    then adds; the last block is released after the loop. Resident CTAs advance in random
    interleavings. Returns {(head, query block): key blocks in the order they added}, or None when
    no resident CTA can advance (deadlock)."""
    n_blocks = (seqlen_k + block_n - 1) // block_n
    visitors = {}
    for j in range(n_blocks):
        for m_block in _fused_iterations(seqlen_q, seqlen_k, block_m, block_n, causal, j, 0, 1, True):
            visitors[m_block[1]] = visitors.get(m_block[1], 0) + 1
    counters, order = {}, {}

    def advance(cta):
        if cta["pending"] is not None:
            counters[cta["pending"]] = counters.get(cta["pending"], 0) + nwarps
            cta["pending"] = None
            return True
        if cta["it"] == len(cta["iters"]):
            cta["done"] = True
            return True
        head, m_block = cta["iters"][cta["it"]]
        turn = visitors[m_block] - 1 - cta["n_block"] if descending else cta["n_block"]
        if counters.get((head, m_block), 0) < turn * nwarps:
            return False
        order.setdefault((head, m_block), []).append(cta["n_block"])
        cta["pending"], cta["it"] = (head, m_block), cta["it"] + 1
        return True

    waiting = [(x, hk) for hk in range(nheads_kv) for x in range(n_blocks)]  # linear blockIdx order
    running = []
    while waiting or running:
        while waiting and len(running) < resident:
            x, hk = waiting.pop(0)
            running.append(dict(n_block=x, it=0, pending=None, done=False, iters=_fused_iterations(
                seqlen_q, seqlen_k, block_m, block_n, causal, x, hk, group, True)))
        progressed = False
        for i in rng.permutation(len(running)):
            while rng.random() < 0.7 and not running[i]["done"] and advance(running[i]):
                progressed = True
        if not progressed and not any(advance(cta) for cta in running if not cta["done"]):
            return None
        running = [cta for cta in running if not cta["done"]]
    return order


def test_bwd_fused_dq_order_is_complete_and_cannot_deadlock():
    """DQ_ORDERED: the key blocks that visit a query block (the kernel's loop bounds) are exactly
    0..last, so waiting for n_block * NWARPS releases waits for all earlier visitors and their turns
    are a permutation of 0..count-1; and the schedule of waits and releases completes with 1 or 3
    resident CTAs, the adds to every query block landing in ascending key-block order. Counter
    check: with the turns descending (key block last first) one resident CTA deadlocks whenever
    two key blocks share a query block."""
    rng = np.random.default_rng(2024)
    cases = [(1, 1, 64, 64, True), (1, 150, 64, 128, True), (150, 1, 64, 128, True), (150, 70, 64, 128, True),
             (70, 150, 64, 128, True), (128, 128, 128, 64, True), (200, 137, 64, 64, False), (1, 300, 128, 64, False),
             # the diagonal on block boundaries (seqlen_k - seqlen_q a multiple of 64)
             (200, 200, 64, 64, True), (300, 300, 128, 64, True), (256, 320, 64, 128, True), (320, 192, 64, 64, True),
             # the last query of a block is the first to see a key block
             (133, 70, 64, 128, True), (133, 198, 64, 128, True), (300, 235, 128, 64, True)]
    for _ in range(150):
        sq, sk = (int(rng.choice([1, rng.integers(2, 64), rng.integers(64, 700)])) for _ in range(2))
        cases.append((sq, sk, int(rng.choice([64, 128])), int(rng.choice([64, 128])), bool(rng.integers(2))))
    for sq, sk, bm, bn, causal in cases:
        what = (sq, sk, bm, bn, causal)
        n_blocks, q_blocks, diag = math.ceil(sk / bn), math.ceil(sq / bm), sk - sq
        visits = [{m for _, m in _fused_iterations(sq, sk, bm, bn, causal, j, 0, 1, True)} for j in range(n_blocks)]
        assert visits == [{m for _, m in _fused_iterations(sq, sk, bm, bn, causal, j, 0, 1, False)}
                          for j in range(n_blocks)], what  # both walks visit the same blocks
        want = {}
        for m_block in range(q_blocks):
            visitors = [j for j in range(n_blocks) if m_block in visits[j]]
            assert visitors == list(range(len(visitors))), what
            # ... and they are the key blocks that some query of the block (existing or not) sees
            reach = (m_block + 1) * bm + diag if causal else sk  # keys 0..reach-1
            assert len(visitors) == min(n_blocks, max(0, math.ceil(reach / bn))), what
            want.update({(h, m_block): visitors for h in range(4) if visitors})
        for resident in (1, 3):
            order = _simulate_dq_order(sq, sk, bm, bn, causal, resident=resident, rng=rng)
            assert order is not None, ("deadlock", what, resident)
            assert order == want, what
        shared = any(len(v) > 1 for v in want.values())
        deadlock = _simulate_dq_order(sq, sk, bm, bn, causal, resident=1, rng=rng, descending=True) is None
        assert deadlock == shared, what


def _assert_fused_launches(launches, d, deterministic, config):
    """flash_bwd_fused_mma with `config`, then flash_bwd_dq_convert, with the arguments of
    _fused_backward and argument lists matching the kernels' parameter lists."""
    from cupyflash.kernels import mma_bwd

    assert [spec for spec, _, _ in launches] == [mma_bwd.fused_spec(np.float16, d, True, "ordered" if deterministic else "atomic", config),
                                                 mma_bwd.convert_spec(np.float16)]
    b, sq, sk, h, hkv = (_LAUNCH_SHAPE[x] for x in ("b", "sq", "sk", "h", "hkv"))
    dt = mma_bwd.d_tile(d)
    bm, bn = config[:2]
    (_, grid, args), (_, _, convert_args) = launches
    assert grid == (math.ceil(sk / bn), hkv, b)
    dq_accum, semaphore = args[8], args[9]
    assert dq_accum.shape == (b, sq, h, dt) and dq_accum.dtype == np.float32
    assert semaphore.dtype == np.int32
    assert semaphore.shape == ((b, h, math.ceil(sq / bm)) if deterministic else (1,))
    assert args[10:15] == (sq, sk, h, h // hkv, d)
    assert args[-7:-4] == tuple(s // 4 for s in dq_accum.strides[:3])  # dq_accum strides in elements
    assert args[-4:-2] == (np.float32(0.1 * mma_bwd.LOG2E), np.float32(0.1))
    assert args[-2:] == (np.int32(-1), np.int32(0))  # the causal policy's window (mask.cuh)
    assert convert_args[0] is dq_accum and convert_args[-1] == np.float32(0.1)
    for spec, grid, args in launches:
        _assert_arguments_match_signature(spec, grid, args)


@pytest.mark.parametrize("smem", [163 * 1024, 227 * 1024])
@pytest.mark.parametrize("d", [64, 96, 200])
@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_windows_on_the_mma_sync_path_launch_local_kernels(deterministic, d, smem, monkeypatch):
    """A window on the sm_80 path (v10 falls back to v5): every launch is a Local specialization
    that specializations() lists (so the compile check covers it), the window is the last two
    arguments, argument lists match the kernels; the same kernels as without a window otherwise,
    except v1's dK/dV kernel for v2's with the atomic dQ (mma_bwd.DKDV_CONFIG_V2's note)."""
    from cupyflash import masks
    from cupyflash.kernels import mma_bwd, mma_fwd

    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "80")
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem)
    listed = {spec.name for spec in mma_bwd.specializations()}
    plain = _record_backward_launches(monkeypatch, "v10", d, deterministic)
    windowed = _record_backward_launches(monkeypatch, "v10", d, deterministic, window_size=(100, 3))
    assert len(windowed) == len(plain)
    for (spec, grid, args), (plain_spec, plain_grid, _) in zip(windowed, plain):
        _assert_arguments_match_signature(spec, grid, args)
        if "convert" in spec.name:
            assert spec == plain_spec
            continue
        assert "_local_" in spec.name and spec.name in listed
        assert args[-2:] == (np.int32(100), np.int32(0))  # causal=True sets the right side to 0
        expected = plain_spec.name.replace("_causal_", "_local_")
        if "dkdv_mma_v2" in expected and "dqatomic" in expected:
            assert spec == mma_bwd.dkdv_spec(np.float16, d, masks.Local(100, 0), "atomic", "v1")
        else:
            assert spec.name == expected and grid == plain_grid


def test_bwd_ordered_dq_adds_take_no_window(monkeypatch):
    """The ordered dQ adds need every key block: a window with v4's deterministic path runs v3's
    kernels, and an explicit ordered fused configuration is refused."""
    from cupyflash import masks
    from cupyflash.kernels import mma_bwd, mma_fwd

    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "80")
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    v4 = _record_backward_launches(monkeypatch, "v4", 96, True, window_size=(64, 64))
    v3 = _record_backward_launches(monkeypatch, "v3", 96, True, window_size=(64, 64))
    assert [spec for spec, _, _ in v4] == [spec for spec, _, _ in v3]
    with pytest.raises(ValueError, match="ordered"):
        mma_bwd.fused_spec(np.float16, 128, masks.Local(64, 64), "ordered")
    with pytest.raises(ValueError, match="ordered"):
        _record_backward_launches(monkeypatch, "v4", 96, True, fused=mma_bwd.FUSED_CONFIG[128], window_size=(64, 64))


@pytest.mark.parametrize("d", [64, 96, 200])
@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_v4_launch_arguments_match_kernel_signatures(deterministic, d, monkeypatch):
    """version="v4" on a GPU with 227 KiB per block: flash_bwd_fused_mma and flash_bwd_dq_convert
    where FUSED_CONFIG has the head-dim tile (v3's kernels elsewhere), and with any table entry
    passed as ``fused``; argument lists match flash_bwd_fused_mma.cu. The counters exist only
    when ordered."""
    from cupyflash.kernels import mma_bwd, mma_fwd

    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    launches = _record_backward_launches(monkeypatch, "v4", d, deterministic)
    config = mma_bwd.FUSED_CONFIG.get(mma_bwd.d_tile(d))
    if config is not None:
        _assert_fused_launches(launches, d, deterministic, config)
    else:
        v3 = _record_backward_launches(monkeypatch, "v3", d, deterministic)
        assert [(spec, grid) for spec, grid, _ in launches] == [(spec, grid) for spec, grid, _ in v3]
    for config in DEV_BWD.FUSED_CANDIDATES.get(mma_bwd.d_tile(d), ()):
        launches = _record_backward_launches(monkeypatch, "v1", d, deterministic, fused=config)
        _assert_fused_launches(launches, d, deterministic, config)


@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_v4_falls_back_to_v3_where_shared_memory_is_short(deterministic, monkeypatch):
    """With sm_80's 163 KiB per block, head dim 256 (the fused kernel's d256 tiles need more) runs
    v3's kernels; other head dims run the fused kernel where their tiles fit."""
    from cupyflash.kernels import mma_bwd, mma_fwd

    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 163 * 1024)
    assert DEV_BWD.fused_config(200, 163 * 1024) is None
    for d in (64, 96, 200):
        v4 = _record_backward_launches(monkeypatch, "v4", d, deterministic)
        if DEV_BWD.fused_config(d, 163 * 1024) is None:
            v3 = _record_backward_launches(monkeypatch, "v3", d, deterministic)
            assert [(spec, grid) for spec, grid, _ in v4] == [(spec, grid) for spec, grid, _ in v3]
            assert not any("fused" in spec.name for spec, _, _ in v4)
            for spec, grid, args in v4:
                _assert_arguments_match_signature(spec, grid, args)
        else:
            _assert_fused_launches(v4, d, deterministic, DEV_BWD.fused_config(d, 163 * 1024))


@pytest.mark.parametrize("version", ["v6", "v7", "v9", "v10"])
@pytest.mark.parametrize("d", [64, 96, 200])
@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_wgmma_versions_launch_the_wgmma_kernel_on_sm90(deterministic, d, version, monkeypatch):
    """version="v6"/"v7"/"v9"/"v10" on an sm_90 device: flash_bwd_wgmma (flash_bwd_wgmma_dsplit at d256).
    Atomic dQ when not deterministic (then flash_bwd_dq_convert); when deterministic, v6 orders
    the float adds (v3's kernels at the head-dim tiles not in WGMMA_ORDERED_D_TILES) and v7 adds
    fixed point (flash_bwd_kv_bounds and flash_bwd_preprocess_fixed before, flash_bwd_dq_convert_fixed
    after; v3's kernels outside WGMMA_FIXED_D_TILES); v9 the same with a panel-major dq_accum
    (dq_fixed.accum_panels) at WGMMA_PANEL_D_TILES; v10 the kernel for dK and dV only (DqAdd::none),
    then flash_bwd_dq_wgmma over the query blocks, writing dq itself (no convert) at
    WGMMA_SPLIT_D_TILES. Argument lists match the kernels' parameters. On sm_80 all are v5."""
    from cupyflash.kernels import dq_fixed, mma_bwd, mma_fwd

    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "90")
    launches = _record_backward_launches(monkeypatch, version, d, deterministic)
    dt = mma_bwd.d_tile(d)
    dq_add = "atomic" if not deterministic else {"v6": "ordered", "v7": "fixed", "v9": "fixed_panels",
                                                  "v10": "none"}[version]
    if version == "v10" and not deterministic and dt in DEV_BWD.WGMMA_SPLIT_ATOMIC_D_TILES:
        dq_add = "none"  # the split kernels beat the float atomics there
    if dq_add == "none":
        assert dt in DEV_BWD.WGMMA_SPLIT_D_TILES
        b, sq, sk, h, hkv = (_LAUNCH_SHAPE[x] for x in ("b", "sq", "sk", "h", "hkv"))
        spec, dq_spec = mma_bwd.wgmma_spec(np.float16, d, True, "none"), mma_bwd.dq_wgmma_spec(np.float16, d, True)
        assert [s for s, _, _ in launches] == [spec, dq_spec]
        assert spec.arch == dq_spec.arch == "90a" and ("dsplit" in spec.name) == (dt == 256)
        (_, grid, args), (_, dq_grid, dq_args) = launches
        assert grid == (math.ceil(sk / mma_bwd.WGMMA_CONFIG[dt][1]), hkv, b)
        assert dq_grid == (math.ceil(sq / mma_bwd.DQ_WGMMA_CONFIG[dt][0]), h, b)
        assert args[6].shape == args[7].shape == (b, sk, hkv, d)  # dk, dv
        assert dq_args[6].shape == (b, sq, h, d) and dq_args[6].dtype == np.float16  # dq itself
        assert dq_args[5] is args[5]  # both kernels read the same D = rowsum(dO o O)
    elif (dq_add == "ordered" and dt not in DEV_BWD.WGMMA_ORDERED_D_TILES) or (
            dq_add == "fixed" and dt not in DEV_BWD.WGMMA_FIXED_D_TILES) or (
            dq_add == "fixed_panels" and dt not in DEV_BWD.WGMMA_PANEL_D_TILES):
        v3 = _record_backward_launches(monkeypatch, "v3", d, deterministic)
        assert [(spec, grid) for spec, grid, _ in launches] == [(spec, grid) for spec, grid, _ in v3]
    else:
        b, sq, sk, h, hkv = (_LAUNCH_SHAPE[x] for x in ("b", "sq", "sk", "h", "hkv"))
        bm, bn = mma_bwd.WGMMA_CONFIG[dt]
        spec = mma_bwd.wgmma_spec(np.float16, d, True, dq_add)
        fixed = dq_add in ("fixed", "fixed_panels")
        if fixed:
            expected = [dq_fixed.kv_bounds_spec(np.float16, dt), dq_fixed.preprocess_spec(np.float16, dt), spec,
                        dq_fixed.convert_spec(np.float16)]
        else:
            expected = [spec, mma_bwd.convert_spec(np.float16)]
        assert [s for s, _, _ in launches] == expected
        assert spec.arch == "90a" and ("dsplit" in spec.name) == (dt == 256)
        (_, grid, args), = [launch for launch in launches if launch[0] == spec]
        assert grid == (math.ceil(sk / bn), hkv, b)
        assert args[9].shape == ((b, h, math.ceil(sq / bm)) if dq_add == "ordered" else (1,))
        if dq_add == "fixed_panels":  # (batch, head x panel, rows in whole query blocks, 64)
            rows = math.ceil(sq / bm) * bm
            assert args[8].shape == (b, h * dt // 64, rows, 64)
            assert tuple(args[-7:-4]) == (h * dt // 64 * rows * 64, 64, rows * 64)  # batch, row, panel
        else:
            assert args[8].shape == (b, sq, h, dt)
        assert args[8].dtype == (np.int64 if fixed else np.float32)
        if fixed:
            assert args[10].shape == (b, h, sq)  # the rows' fixed-point scales
            # the convert reads element (b, m, h, c) at b sb + m ss + h sh + (c / 64) sp + c % 64
            (_, _, conv), = [launch for launch in launches if launch[0] == dq_fixed.convert_spec(np.float16)]
            if dq_add == "fixed_panels":
                rows = math.ceil(sq / bm) * bm
                want = (h * dt // 64 * rows * 64, 64, dt // 64 * rows * 64, rows * 64)
            else:
                want = (sq * h * dt, h * dt, dt, 64)
            assert conv[0] is args[8] and tuple(int(x) for x in conv[7:11]) == want
    for spec, grid, args in launches:
        _assert_arguments_match_signature(spec, grid, args)
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "80")
    ours, v5 = (_record_backward_launches(monkeypatch, v, d, deterministic) for v in (version, "v5"))
    assert [(spec, grid) for spec, grid, _ in ours] == [(spec, grid) for spec, grid, _ in v5]


@pytest.mark.parametrize("smem_optin", [227 * 1024, 163 * 1024], ids=["sm90", "sm80"])
@pytest.mark.parametrize("d", [64, 96, 200])
def test_bwd_v5_launches_v3_when_deterministic_and_v4_otherwise(d, smem_optin, monkeypatch):
    """The default version: deterministic=True launches exactly v3's kernels (the two-kernel path;
    the ordered fused kernel measured slower), deterministic=False exactly what v4 launches."""
    from cupyflash.kernels import mma_bwd, mma_fwd

    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem_optin)
    for deterministic, same_as in ((True, "v3"), (False, "v4")):
        v5 = _record_backward_launches(monkeypatch, "v5", d, deterministic)
        other = _record_backward_launches(monkeypatch, same_as, d, deterministic)
        assert [(spec, grid) for spec, grid, _ in v5] == [(spec, grid) for spec, grid, _ in other]
        assert not (deterministic and any("fused" in spec.name for spec, _, _ in v5))
        for spec, grid, args in v5:
            _assert_arguments_match_signature(spec, grid, args)
