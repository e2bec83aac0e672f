"""User modifiers the tests draw from: score modifiers (a bias table, a tanh cap, ALiBi written as a
score_mod, T5-style buckets) and mask modifiers (causal, a sliding window, documents of a packed
sequence, prefix-LM, a strided pattern whose visible keys do not move forward with the query),
each made for one problem's sizes, with its tensors drawn from a seed.

Every score modifier here has dz'/dz in [0, 1] (biases, caps): the tolerance rule's allowance
for the output's rounding in the backward assumes it (cupyflash.testing.tolerance)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import cupyflash as cf
from cupyflash import modifiers as M


# The code of a modifier (its hash, its kernels) must not depend on a problem's sizes, or every
# drawn problem compiles new kernels: tables have a fixed width, read at fixed offsets.
MAX_DISTANCE = 1023  # |q_idx - kv_idx| the relative-bias table covers (seqlens up to 1024)


def relative_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + MAX_DISTANCE]


def tanh_cap(score, b, h, q_idx, kv_idx):
    return 7.5 * M.tanh(score / 7.5)


def alibi(score, b, h, q_idx, kv_idx, slopes):
    return score - slopes[h] * abs(q_idx - kv_idx)


def sequence_bias(score, b, h, q_idx, kv_idx, slopes):
    """ALiBi with a slope per (batch entry, head): in a packed batch b is the sequence."""
    return score - slopes[b, h] * abs(q_idx - kv_idx)


def t5_buckets(score, b, h, q_idx, kv_idx, table):
    distance = M.minimum(abs(q_idx - kv_idx) // 4, 15)
    return score + table[h, distance] * M.where(q_idx >= kv_idx, 1.0, 0.5)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= 9) & (kv_idx - q_idx <= 3)


def documents(b, h, q_idx, kv_idx, doc_q, doc_k):
    return doc_q[b, q_idx] == doc_k[b, kv_idx]


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 5) | (q_idx >= kv_idx)


def strided(b, h, q_idx, kv_idx):
    """Every third key and the diagonal: a pattern whose visible keys do not move forward with the
    query (the block map's ranges are wider than its blocks)."""
    return ((q_idx - kv_idx) % 3 == 0) | (q_idx == kv_idx)


def per_head_window(b, h, q_idx, kv_idx, width):
    return abs(q_idx - kv_idx) <= width[h]


SCORES = ("relative_bias", "tanh_cap", "alibi", "t5_buckets")
MASKS = ("causal", "sliding_window", "documents", "prefix_lm", "strided", "per_head_window")


def make_score_mod(name: str, problem, seed: int):
    rng = np.random.default_rng(seed)
    nheads = problem.nheads
    if max(problem.seqlen_q, problem.seqlen_k) > MAX_DISTANCE + 1:
        raise ValueError(f"the zoo's relative bias covers sequences up to {MAX_DISTANCE + 1}")
    if name == "relative_bias":
        return cf.ScoreMod(relative_bias, table=rng.standard_normal((nheads, 2 * MAX_DISTANCE + 1)).astype(np.float32))
    if name == "tanh_cap":
        return cf.ScoreMod(tanh_cap)
    if name == "alibi":
        return cf.ScoreMod(alibi, slopes=rng.uniform(0.0, 0.5, nheads).astype(np.float32))
    if name == "t5_buckets":
        return cf.ScoreMod(t5_buckets, table=rng.standard_normal((nheads, 16)).astype(np.float32))
    raise ValueError(name)


def document_ids(rng, batch: int, length: int, documents: int) -> np.ndarray:
    """(batch, length) int32 non-decreasing document ids (a packed batch), ``documents`` at most."""
    ids = np.sort(rng.integers(0, max(documents, 1), (batch, length)), axis=1)
    return ids.astype(np.int32)


def make_mask_mod(name: str, problem, seed: int):
    rng = np.random.default_rng(seed)
    if name == "documents":
        # the same packing for queries and keys where the lengths agree (self-attention)
        doc_k = document_ids(rng, problem.batch, problem.seqlen_k, 4)
        doc_q = doc_k if problem.seqlen_q == problem.seqlen_k else document_ids(rng, problem.batch, problem.seqlen_q, 4)
        return cf.MaskMod(documents, doc_q=doc_q, doc_k=doc_k)
    if name == "per_head_window":
        return cf.MaskMod(per_head_window, width=rng.integers(0, 12, problem.nheads).astype(np.int32))
    return cf.MaskMod(globals()[name])


# The (score, mask) pairs the GPU tests draw: each pair is its own kernels, compiled for every
# dtype, head-dim tile and band a test meets, so the GPU suite keeps to a few that between them use
# every part of the contract (a derivative, a table read per pair, masks with tensors, per head, and
# whose ranges are wider than their blocks; a score alone and a mask alone: the causal and ALiBi
# tests of tests/test_modifiers_gpu.py). scripts/warm_kernel_cache.py
# --zoo compiles their kernels on every core first.
GPU_COMBOS = (("relative_bias", "documents"), ("tanh_cap", "strided"), ("t5_buckets", "per_head_window"))


@st.composite
def modifiers_for(draw, problem, scores=SCORES + (None,), masks=MASKS + (None,), combos=None):
    """(score_mod, mask_mod) for ``problem``: one of ``scores`` and one of ``masks`` (None: that
    one absent), not both absent; or one pair of ``combos``."""
    if combos is not None:
        score, mask = draw(st.sampled_from(combos), label="modifiers")
    else:
        score = draw(st.sampled_from(scores), label="score_mod")
        mask = draw(st.sampled_from([m for m in masks if m is not None or score is not None]), label="mask_mod")
    seed = draw(st.integers(0, 2**32 - 1), label="modifier_seed")
    return (None if score is None else make_score_mod(score, problem, seed),
            None if mask is None else make_mask_mod(mask, problem, seed + 1))


def gpu_combo_modifiers():
    """The Modifiers of GPU_COMBOS with placeholder tensors (a kernel's name and code depend on the
    tensors' dtypes and dimensions, not on their values or sizes)."""
    from cupyflash.modifiers import Modifiers, _MaskOnly

    problem = cf.testing.AttentionProblem(batch=1, seqlen_q=16, seqlen_k=16, nheads_kv=1, group=1, headdim=8,
                                          causal=False, softmax_scale=None, magnitude=1.0, dtype=np.float32, seed=0)
    out = []
    for score, mask in GPU_COMBOS:
        score_mod = None if score is None else make_score_mod(score, problem, 0)
        mask_mod = None if mask is None else make_mask_mod(mask, problem, 0)
        out.append(Modifiers(score_mod, None if mask_mod is None else _MaskOnly(mask_mod)))
    return out
