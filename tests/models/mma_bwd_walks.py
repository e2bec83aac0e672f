"""The mask walks of the mma.sync backward kernels (flash_bwd_dkdv_mma and its v2 and split
forms, flash_bwd_dq_mma and its v2 form): which query blocks a dK/dV CTA visits, which key
blocks a dQ CTA visits, which blocks are partial, and the element test, all asked of the mask
policy (cupyflash.masks, the twin of kernels_cu/mask.cuh) as the kernels ask it."""
from __future__ import annotations

from cupyflash import masks

from .mirrors import mirrors

DKDV_KERNELS = ("flash_bwd_dkdv_mma", "flash_bwd_dkdv_mma_v2", "flash_bwd_dkdv_mma_split")
DQ_KERNELS = ("flash_bwd_dq_mma", "flash_bwd_dq_mma_v2")
WGMMA_DKDV_KERNELS = ("flash_bwd_wgmma", "flash_bwd_wgmma_dsplit")


def _each(kernels, *statements):
    """@mirrors of the same statements in each of ``kernels``."""
    def register(obj):
        for kernel in kernels:
            mirrors(kernel, *statements)(obj)
        return obj
    return register


def visible(m, n, seqlen_q, seqlen_k, mask):
    """mask.cuh's visible(i, j), elementwise: the policy's bounds (cupyflash.masks) in the kernel's form."""
    lo, hi = mask.offsets(seqlen_q, seqlen_k)
    ok = (m < seqlen_q) & (n < seqlen_k)
    if mask.HAS_RIGHT:
        ok = ok & (n <= m + hi)
    if mask.HAS_LEFT:
        ok = ok & (n >= m + lo)
    return ok


@mirrors("common.cuh", "if (masked) f(Flag<true>());", "else f(Flag<false>());")
@_each(DKDV_KERNELS[1:], "const bool partial = mask.partial(m0_sub, M_SUB, n0, BLOCK_N);",
       "masked_or_not(partial, [&](auto masked) {")
@_each(DKDV_KERNELS[:1], "const bool partial = mask.band_partial(m0_sub, M_SUB, n0, BLOCK_N);",
       "masked_or_not(partial, [&](auto masked) {")
@_each(DQ_KERNELS[:1], "const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);")
@_each(DQ_KERNELS[1:], "const bool partial = mask.band_partial(m0, BLOCK_M, n0, BLOCK_N);")
def block_partial(m0, bm, n0, bn, seqlen_q, seqlen_k, mask):
    """Whether the element mask applies in the block (the dK/dV kernels run their masked
    instance, masked_or_not, exactly there; the dQ kernels test ``partial`` per element). For a
    band these are the band's answers; with a user mask's block map, partial() also answers
    partial where the map does not hold the block whole, and band_partial() (the two kernels at
    their register limit, which keep the predicate everywhere) does not."""
    return mask.partial(m0, bm, n0, bn, seqlen_q, seqlen_k)


# block_walk.cuh's QueryBlockWalk, which every dK/dV kernel builds (the wgmma ones: wgmma_walk)
QUERY_BLOCK_WALK = ("first(mask.query_begin(n0) / BLOCK_M)",
                    "end(SKIP_EMPTY && mask.query_end(n0, block_n) <= mask.query_begin(n0) ? first "
                    ": (mask.query_end(n0, block_n) + BLOCK_M - 1) / BLOCK_M)",
                    "blocks(max(0, end - first))",
                    "const QueryBlockWalk<BLOCK_M> walk(mask, n0, BLOCK_N, group);")


# flash_bwd_dkdv_mma_v2 and _split build it in their CTA (mma_bwd_key_cta.cuh's MmaKeyCta), from
# its n0; flash_bwd_dkdv_mma still in its own body (mma-bwd-cta in docs/perf-log.md says why).
@_each(DKDV_KERNELS[1:], *QUERY_BLOCK_WALK[:3], "walk(mask, n0, BLOCK_N, group) {}")
@_each(DKDV_KERNELS[:1], *QUERY_BLOCK_WALK)
def query_block_range(mask, n0, block_n, block_m, seqlen_q, seqlen_k, skip_empty=False):
    """(first, blocks) of a dK/dV CTA's walk: the query blocks that see some key of its block
    (``skip_empty``, QueryBlockWalk's SKIP_EMPTY: none for an empty query range)."""
    begin, end = mask.query_begin(n0, seqlen_q, seqlen_k), mask.query_end(n0, block_n, seqlen_q, seqlen_k)
    m_block_first = begin // block_m
    m_block_end = m_block_first if skip_empty and end <= begin else -(-end // block_m)
    return m_block_first, max(0, m_block_end - m_block_first)


# The wgmma ones build it in wgmma_bwd.cuh's WgmmaKeyBlock, which both include; the order is its
# WgmmaKeyWalk's.
@_each(WGMMA_DKDV_KERNELS, *QUERY_BLOCK_WALK[:3], "walk(mask, at.n0, BLOCK_N, group),",
       "q_blocks((seq.seqlen_q + BLOCK_M - 1) / BLOCK_M) {}",
       "return ORDERED ? walk.block_down_from(q_blocks - 1, it) : walk.block(it);")
def wgmma_walk(mask, n0, block_n, block_m, seqlen_q, seqlen_k, group, head_kv, ordered):
    """(query head, query block) of each iteration of a wgmma dK/dV CTA: query_block_range's
    blocks for each head of the group, ascending, or with the ordered dQ adds from the sequence's
    last query block down (those kernels refuse a left bound, so the walk ends there)."""
    first, blocks = query_block_range(mask, n0, block_n, block_m, seqlen_q, seqlen_k)
    q_blocks = -(-seqlen_q // block_m)
    return [(head_kv * group + it // blocks, q_blocks - 1 - it % blocks if ordered else first + it % blocks)
            for it in range(group * blocks)]


# The float64 dK/dV kernels walk QueryBlockWalk's iterations as their steps: flash_bwd_dkdv_dmma
# in its body, flash_bwd_dkdv_dmma_pairs in its DmmaKeyBlock.
@_each(("flash_bwd_dkdv_dmma",), "const QueryBlockWalk<BLOCK_M> walk(mask, n0, BLOCK_N, group);",
       "const int steps = walk.iters;",
       "const int head = walk.head(head_kv, step), m0 = walk.row(step);")
@_each(("flash_bwd_dkdv_dmma_pairs",), "walk(mask, n0, BLOCK_N, p.group) {}", "const int steps = cta.walk.iters;",
       "return walk.head(head_kv, step);", "return walk.row(step);")
@mirrors("block_walk.cuh", "iters(group_ * blocks),", "m_first(first * BLOCK_M) {}",
         "int head(int head_kv, int it) const { return head_kv * group + it / blocks; }",
         "int row(int it) const { return m_first + it % blocks * BLOCK_M; }")
def dmma_walk(mask, n0, block_n, block_m, seqlen_q, seqlen_k, group, head_kv):
    """(query head, first query row) of each step of a float64 dK/dV CTA: query_block_range's
    blocks for each head of the group in turn, ascending."""
    first, blocks = query_block_range(mask, n0, block_n, block_m, seqlen_q, seqlen_k)
    m_first = first * block_m
    return [(head_kv * group + it // blocks, m_first + it % blocks * block_m) for it in range(group * blocks)]


# flash_bwd_dkdv_simt walks the rows of the same blocks, head by head: from QueryBlockWalk's
# m_first while below its unrounded end m_end.
@_each(("flash_bwd_dkdv_simt",), "const QueryBlockWalk<BLOCK_M> walk(mask, n0, BLOCK_N, group);",
       "for (int head = head_kv * group; head < (head_kv + 1) * group; ++head) {",
       "for (int m0 = walk.m_first; m0 < walk.m_end; m0 += BLOCK_M) {")
@mirrors("block_walk.cuh", "m_end(mask.query_end(n0, block_n)),", "m_first(first * BLOCK_M) {}")
def simt_walk(mask, n0, block_n, block_m, seqlen_q, seqlen_k, group, head_kv):
    """(query head, first query row) of each query block a SIMT dK/dV CTA visits, in its order."""
    m_first = mask.query_begin(n0, seqlen_q, seqlen_k) // block_m * block_m
    m_end = mask.query_end(n0, block_n, seqlen_q, seqlen_k)
    return [(head, m0) for head in range(head_kv * group, (head_kv + 1) * group)
            for m0 in range(m_first, m_end, block_m)]


@_each(DQ_KERNELS,  # in their CTA, mma_bwd_query_cta.cuh's MmaQueryCta
       "keys(mask, m0, min(BLOCK_M, seq_.seqlen_q - m0)) {}")
def key_block_range(mask, m0, block_m, block_n, seqlen_q, seqlen_k):
    """[keys.first, keys.end) of a dQ CTA: the key blocks some existing row of its block sees
    (KeyBlockRange of those rows)."""
    first, end, _, _ = key_range(mask, m0, min(block_m, seqlen_q - m0), block_n, seqlen_q, seqlen_k)
    return first, end


@mirrors("block_walk.cuh",
         "const int key_begin = mask.key_begin(m0);",
         "first = key_begin / BLOCK_N;",
         "const int key_end = mask.key_end(m0, rows);",
         "end = SKIP_EMPTY && key_end <= key_begin ? first : (key_end + BLOCK_N - 1) / BLOCK_N;",
         "blocks = end > first ? end - first : 0;")
def key_blocks(key_begin: int, key_end: int, block_n: int, skip_empty: bool) -> tuple[int, int, int]:
    """KeyBlockRange's (first, end, blocks) from the policy's key range [key_begin, key_end)."""
    first = key_begin // block_n
    end = first if skip_empty and key_end <= key_begin else -(-key_end // block_n)
    return first, end, max(0, end - first)


@mirrors("block_walk.cuh", "n_end = key_end;")
def key_range(mask, m0, rows, block_n, seqlen_q, seqlen_k, skip_empty=False) -> tuple[int, int, int, int]:
    """KeyBlockRange of query rows [m0, m0 + rows): key_blocks' (first, end, blocks) and n_end,
    the policy's key end unrounded (the kernels that walk while j * BLOCK_N < n_end)."""
    key_begin, key_end = mask.key_begin(m0, seqlen_q, seqlen_k), mask.key_end(m0, rows, seqlen_q, seqlen_k)
    return (*key_blocks(key_begin, key_end, block_n, skip_empty), key_end)


# The policy twin's per-row bounds that the models above use are mask.cuh's.
mirrors("mask.cuh", "return RIGHT ? min(seqlen_k, i + 1 + hi_off) : seqlen_k;")(masks.Mask.row_key_end)
mirrors("mask.cuh", "return RIGHT ? j - hi_off : 0;")(masks.Mask.row_query_begin)
mirrors("mask.cuh", "return LEFT && dj - di < o.lo_slack;")(masks.Mask.hidden_left)


def assert_walks_skip_blocks(mask, sq, sk, block_m, block_n):
    """The case exercises the window's walks: some key block visits fewer query blocks than exist
    (dK/dV), or some query block starts its key walk past block 0 (dQ)."""
    q_blocks, k_blocks = -(-sq // block_m), -(-sk // block_n)
    assert (any(len(mask.query_blocks(j * block_n, block_n, block_m, sq, sk)) < q_blocks for j in range(k_blocks)) or
            any(mask.key_begin(i * block_m, sq, sk) >= block_n for i in range(q_blocks)))
