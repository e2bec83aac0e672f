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
