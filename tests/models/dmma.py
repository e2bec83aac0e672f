"""Model of the float64 tensor-core forward's tile steps (kernels_cu/flash_fwd_dmma.cu): the PTX
semantics of mma.sync.m8n8k4 .f64 (ground truth, from the PTX ISA's "Matrix Fragments for
mma.m8n8k4" with .f64: one register of A, one of B, two of C and D per lane), and one warp's
S = Q K^T and O += P V with the kernel's lane indexing, so that a wrong index in the kernel's
formulas shows on the CPU. Values are float64, the products exact as NumPy forms them.
"""
from __future__ import annotations

import numpy as np

LANES = np.arange(32)
G, T = LANES // 4, LANES % 4  # groupID and threadID_in_group


# --- PTX semantics (ground truth) ----------------------------------------------------------------

def a_matrix(a: np.ndarray) -> np.ndarray:
    """The 8 x 4 A operand (.row) held by a[lane]: row groupID, column threadID_in_group."""
    m = np.full((8, 4), np.nan)
    m[G, T] = a
    return m


def b_matrix(b: np.ndarray) -> np.ndarray:
    """The 4 x 8 B operand (.col) held by b[lane]: row threadID_in_group, column groupID."""
    m = np.full((4, 8), np.nan)
    m[T, G] = b
    return m


def c_matrix(c: np.ndarray) -> np.ndarray:
    """The 8 x 8 C (or D) held by c[lane, 2]: row groupID, columns 2 threadID_in_group + i."""
    m = np.full((8, 8), np.nan)
    m[G, 2 * T] = c[:, 0]
    m[G, 2 * T + 1] = c[:, 1]
    return m


def c_fragments(m: np.ndarray) -> np.ndarray:
    """c[lane, 2] of the 8 x 8 matrix m, the inverse of c_matrix."""
    return np.stack([m[G, 2 * T], m[G, 2 * T + 1]], axis=1)


def mma_m8n8k4(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """d[lane, 2] = A B + C on the fragments (mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64)."""
    return c_fragments(a_matrix(a) @ b_matrix(b) + c_matrix(c))


# --- one warp of flash_fwd_dmma (the kernel's indexing) ------------------------------------------

def warp_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """s[nt, lane, 2]: S = Q K^T of the warp's 8 rows q (8 x D) against k (BLOCK_N x D), with the
    kernel's fragments: q_frag[ks] = Q[g][4 ks + t], K's b = K[8 nt + g][4 ks + t]."""
    d, block_n = q.shape[1], k.shape[0]
    s = np.zeros((block_n // 8, 32, 2))
    for nt in range(block_n // 8):
        for ks in range(d // 4):
            s[nt] = mma_m8n8k4(q[G, 4 * ks + T], k[8 * nt + G, 4 * ks + T], s[nt])
    return s


def warp_pv(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """o[dn, lane, 2]: O = P V for p[nt, lane, 2] in S's accumulator layout (P[g][8 nt + 2t + e])
    and v (BLOCK_N x D), with the kernel's two k-steps per n-tile: a = p[nt][e], V's
    b = V[8 nt + 2t + e][8 dn + g]."""
    block_n, d = v.shape
    o = np.zeros((d // 8, 32, 2))
    for nt in range(block_n // 8):
        for e in range(2):
            for dn in range(d // 8):
                o[dn] = mma_m8n8k4(p[nt, :, e], v[8 * nt + 2 * T + e, 8 * dn + G], o[dn])
    return o


def rows_of(frags: np.ndarray) -> np.ndarray:
    """The 8 x (8 n) matrix of n accumulator tiles frags[n, lane, 2]."""
    return np.concatenate([c_matrix(f) for f in frags], axis=1)


# --- sm_90's m16n8k8 .f64 (WIDE: two m-tiles, two k-steps in one product) ------------------------
# Ground truth from the PTX ISA's "Matrix Fragments for mma.m16n8k8" with .f64 (CuTe's
# SM90_16x8x8_F64F64F64F64_TN layouts say the same): A 16 x 8, a[lane, i] at row groupID + 8 (i % 2),
# column threadID_in_group + 4 (i // 2); B 8 x 8, b[lane, i] at row threadID_in_group + 4 i, column
# groupID; C, D 16 x 8, c[lane, i] at row groupID + 8 (i // 2), column 2 threadID_in_group + i % 2.

def mma_m16n8k8(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """d[lane, 4] = A B + C on the fragments (mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64)."""
    am, bm, cm = np.full((16, 8), np.nan), np.full((8, 8), np.nan), np.full((16, 8), np.nan)
    for i in range(4):
        am[G + 8 * (i % 2), T + 4 * (i // 2)] = a[:, i]
        cm[G + 8 * (i // 2), 2 * T + i % 2] = c[:, i]
    for i in range(2):
        bm[T + 4 * i, G] = b[:, i]
    d = am @ bm + cm
    return np.stack([d[G + 8 * (i // 2), 2 * T + i % 2] for i in range(4)], axis=1)


def wide(c0: np.ndarray, c1: np.ndarray, a00, a10, a01, a11, b0, b1):
    """dmma_m16n8k8 as the kernel calls it: (c0, c1) = m-tiles 0 and 1's [lane, 2] accumulators,
    a[mt][step] and b[step] the four m8n8k4 products' operands; returns the new (c0, c1)."""
    d = mma_m16n8k8(np.stack([a00, a10, a01, a11], axis=1), np.stack([b0, b1], axis=1),
                    np.concatenate([c0, c1], axis=1))
    return d[:, :2], d[:, 2:]


def warp_scores_wide(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """s[mt, nt, lane, 2] of the warp's 16 rows q (m-tile mt: rows 8 mt + g) with WIDE's products:
    a[mt][h] = Q[8 mt + g][4 (ks + h) + t], b = K[8 nt + g][4 ks + t (+ 4)]."""
    d, block_n = q.shape[1], k.shape[0]
    s = np.zeros((2, block_n // 8, 32, 2))
    for ks in range(0, d // 4, 2):
        a = [[q[8 * mt + G, 4 * (ks + h) + T] for h in range(2)] for mt in range(2)]
        for nt in range(block_n // 8):
            frag = k[8 * nt + G, 4 * ks + T], k[8 * nt + G, 4 * ks + 4 + T]
            s[0, nt], s[1, nt] = wide(s[0, nt], s[1, nt], a[0][0], a[1][0], a[0][1], a[1][1], *frag)
    return s


def warp_pv_wide(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """o[mt, dn, lane, 2] = P V for p[mt, nt, lane, 2] in S's layout, WIDE: one product per
    (nt, dn), A = (p[0][nt][0], p[1][nt][0], p[0][nt][1], p[1][nt][1]) (k = t is key 2t, k = t + 4
    key 2t + 1), b = V[8 nt + 2t (+ 1)][8 dn + g]."""
    block_n, d = v.shape
    o = np.zeros((2, d // 8, 32, 2))
    for nt in range(block_n // 8):
        for dn in range(d // 8):
            o[0, dn], o[1, dn] = wide(o[0, dn], o[1, dn], p[0, nt, :, 0], p[1, nt, :, 0], p[0, nt, :, 1],
                                      p[1, nt, :, 1], v[8 * nt + 2 * T, 8 * dn + G], v[8 * nt + 2 * T + 1, 8 * dn + G])
    return o
