"""Packed variable-length batches: flash_attn_varlen_func, flash_attn_varlen_backward,
flash_attn_varlen_vjp (flash-attn 2.8's names, layout and semantics).

Layout: the sequences of a batch are packed one after the other along the first axis, no padding.
q, o, do, dq: (total_q, nheads, headdim); k, v, dk, dv: (total_k, nheads_kv, headdim);
``cu_seqlens_q`` (batch + 1,) int32 with sequence b's queries at rows cu_seqlens_q[b] ..
cu_seqlens_q[b + 1] - 1 (likewise ``cu_seqlens_k``); lse: (nheads, total_q), flash-attn's varlen
layout. Each sequence is its own attention problem: its own bottom-right causal alignment and
window (diag = seqlen_k[b] - seqlen_q[b]); sequences never see each other's keys.

On the GPU one launch per kernel covers the whole batch: the kernels read cu_seqlens themselves
(the Packed mask policies of kernels_cu/mask.cuh, their Params' cu_seqlens_q / cu_seqlens_k), a
CTA column per sequence over its longest one, so no padding is computed and no copy made. The
cumulative lengths are read back to the host once per call, for the checks (a synchronisation
for device arrays), except inside cupyflash.no_host_sync() and CUDA-graph capture
(cupyflash.capture): there device cu_seqlens are used as given and the grid is sized by
max_seqlen_q / max_seqlen_k. The NumPy backend runs the NumPy twin per sequence on views
(``per_sequence``), as do batches beyond the grid's 65535 sequences or heads.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import numpy as np

from . import _arrays as A
from . import api, capture, dispatch
from .dropout import NO_DROPOUT, check_dropout, draw_seed_once
from .scores import NO_VARIANT, check_variant, sink_grad
from .backward_plans import check_statistics, own_forward_statistics
from ._dtypes import lse_dtype
from .masks import check_window
from .modifiers import check_modifiers

__all__ = ["flash_attn_varlen_func", "flash_attn_varlen_backward", "flash_attn_varlen_vjp"]


# --- argument checks (everything here runs before any launch) -----------------------------------

def check_softcap(softcap) -> None:
    """softcap's type, checked with the other options before any array is looked at (its value is
    checked by scores.check_variant with the arrays)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number; got {type(softcap).__name__}")


def check_count(value, name: str) -> int:
    """A non-negative int (Python or NumPy integer, not a bool)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return int(value)


def int32_index(x, name: str, ndim: int):
    """An int32 index array of ``ndim`` dimensions (NumPy, CuPy or DLPack), dtype and rank checked,
    as a NumPy or a CuPy array (nothing read)."""
    kind = A.array_kind(x, name)
    array = A.take_array(x, name, kind)
    if np.dtype(array.dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32 (as flash-attn's); got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(array.shape)}")
    return array


def host_int32(x, name: str, ndim: int) -> np.ndarray:
    """int32_index's array on the host (a device array is read back: a synchronisation)."""
    array = int32_index(x, name, ndim)
    return array if isinstance(array, np.ndarray) else array.get()


def unread(*arrays) -> bool:
    """Whether these index arrays (int32_index's) stay unread: some of them is on the device and
    the call may not read it back (cupyflash.capture)."""
    return any(a is not None and not isinstance(a, np.ndarray) for a in arrays) and not capture.reads_allowed()


def device_int32(array, name: str):
    """An index array (int32_index's) on the device, C-contiguous: a device array as it is (or a
    contiguous copy, made on the device), a host one copied (not under capture)."""
    cupy = A._cupy()
    if isinstance(array, np.ndarray):
        capture.refuse_host_upload(name)
        return cupy.asarray(np.ascontiguousarray(array, dtype=np.int32))
    return cupy.ascontiguousarray(array)


def check_cu_seqlens(cu_seqlens: np.ndarray, name: str, total: int, total_name: str) -> np.ndarray:
    """The sequence lengths (int64) of a checked cumulative-length array."""
    if cu_seqlens.shape[0] == 0:
        raise ValueError(f"{name} must have batch + 1 entries (just [0] for an empty batch); got none")
    if cu_seqlens[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0] = {int(cu_seqlens[0])}")
    lengths = np.diff(cu_seqlens.astype(np.int64))
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must be non-decreasing (every sequence length >= 0); got {name}[{b + 1}] = "
                         f"{int(cu_seqlens[b + 1])} < {name}[{b}] = {int(cu_seqlens[b])}")
    if int(cu_seqlens[-1]) != total:
        raise ValueError(f"{name}[-1] = {int(cu_seqlens[-1])} must equal the number of tokens of {total_name} "
                         f"({total_name}.shape[0] = {total})")
    return lengths


def check_max_seqlen(lengths: np.ndarray, max_seqlen, name: str, what: str) -> int:
    max_seqlen = check_count(max_seqlen, name)
    if lengths.size and int(lengths.max()) > max_seqlen:
        b = int(np.argmax(lengths))
        raise ValueError(f"sequence {b} has {int(lengths[b])} {what}, more than {name} = {max_seqlen}")
    return max_seqlen


def check_packed_shapes(q, k, v) -> tuple[int, int, int, int, int]:
    """(total_q, total_k, nheads, nheads_kv, headdim) of packed q, k, v (headdim q's and k's)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_tokens, nheads, headdim), the packed layout; "
                             f"got shape {tuple(x.shape)}")
    # headdims (v's may differ) and GQA as the dense API checks them, on one-sequence views.
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same (total_tokens, nheads); got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    A.check_qkv_shapes(q[None], k[None], v[None])
    total_q, nheads, headdim = q.shape
    total_k, nheads_kv, _ = k.shape
    return total_q, total_k, nheads, nheads_kv, headdim


class Sequences(NamedTuple):
    """A call's checked cumulative lengths. ``cu_q``, ``cu_k``: host int64 copies, or None where
    they stay on the device unread (cupyflash.capture: only their dtype and shape are checked);
    ``given_q``, ``given_k``: the arrays as given (NumPy or CuPy); ``longest_q``, ``longest_k``: the
    longest sequences, read, or the call's max_seqlen_q / max_seqlen_k where unread."""
    count: int
    cu_q: np.ndarray | None
    cu_k: np.ndarray | None
    given_q: object
    given_k: object
    longest_q: int
    longest_k: int

    @property
    def read(self) -> bool:
        return self.cu_q is not None


def check_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q: int, total_k: int) -> Sequences:
    """cu_seqlens_q and cu_seqlens_k checked: in full where they are read, dtype and shape only
    where they stay on the device (cupyflash.capture)."""
    given_q = int32_index(cu_seqlens_q, "cu_seqlens_q", 1)
    given_k = int32_index(cu_seqlens_k, "cu_seqlens_k", 1)
    if given_q.shape != given_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got "
                         f"{given_q.shape[0]} and {given_k.shape[0]}")
    count = given_q.shape[0] - 1
    if unread(given_q, given_k):
        if count < 0:
            raise ValueError("cu_seqlens_q must have batch + 1 entries (just [0] for an empty batch); got none")
        longest_q, longest_k = check_count(max_seqlen_q, "max_seqlen_q"), check_count(max_seqlen_k, "max_seqlen_k")
        for given, name, total, total_name, longest, what in (
                (given_q, "cu_seqlens_q", total_q, "q", max_seqlen_q, "query tokens"),
                (given_k, "cu_seqlens_k", total_k, "k", max_seqlen_k, "key tokens")):
            if isinstance(given, np.ndarray):  # a host array beside a device one: checked in full
                check_max_seqlen(check_cu_seqlens(given, name, total, total_name), longest, f"max_seqlen_{name[-1]}",
                                 what)
        if count > 0 and ((total_q and not longest_q) or (total_k and not longest_k)):
            raise ValueError(f"max_seqlen_q = {longest_q}, max_seqlen_k = {longest_k} with {total_q} query and "
                             f"{total_k} key tokens: the longest sequence sizes the grid, so it must be given")
        return Sequences(count, None, None, given_q, given_k, longest_q, longest_k)
    cu_q, cu_k = (x if isinstance(x, np.ndarray) else x.get() for x in (given_q, given_k))
    lengths_q = check_cu_seqlens(cu_q, "cu_seqlens_q", total_q, "q")
    lengths_k = check_cu_seqlens(cu_k, "cu_seqlens_k", total_k, "k")
    check_max_seqlen(lengths_q, max_seqlen_q, "max_seqlen_q", "query tokens")
    check_max_seqlen(lengths_k, max_seqlen_k, "max_seqlen_k", "key tokens")
    longest = lambda lengths: int(lengths.max()) if lengths.size else 0
    return Sequences(count, cu_q.astype(np.int64), cu_k.astype(np.int64), given_q, given_k, longest(lengths_q),
                     longest(lengths_k))


def sequence_modifiers(score_mod, mask_mod, block_mask, sequences: Sequences, nheads: int, max_seqlen_q,
                       max_seqlen_k, which: str):
    """A varlen call's user modifiers (cupyflash.modifiers.check_modifiers) with each sequence as
    batch entry b of a dense call of max_seqlen_q x max_seqlen_k: b is the sequence, q_idx and kv_idx
    count from its first row, and a mask's block map is made (or a block_mask must have been made)
    for (sequences, nheads, max_seqlen_q, max_seqlen_k)."""
    if score_mod is None and mask_mod is None and block_mask is None:
        return None
    return check_modifiers(score_mod, mask_mod, block_mask, batch=sequences.count, nheads=nheads,
                           seqlen_q=check_count(max_seqlen_q, "max_seqlen_q"),
                           seqlen_k=check_count(max_seqlen_k, "max_seqlen_k"), on_gpu=which != "numpy")


def device_arrays(**arrays) -> dict:
    """The device arrays among index arguments, for the one-device check."""
    return {name: x for name, x in arrays.items() if x is not None and A.array_kind(x, name) == "cupy"}


# --- one sequence through the dense API's compute paths -------------------------------------------

def dense_forward(which: str, q, k, v, scale: float, causal: bool, window, variant=NO_VARIANT) -> tuple:
    """(o, lse) of (batch, seqlen, heads, headdim) arrays already on the compute side, through the
    dense API's paths (its chunks over batch and heads included); zeros and -inf (the sink, with
    one) where nothing is to be computed. ``variant``: a scores.Variant of this batch, its arrays
    on the compute side."""
    batch, seqlen_q, nheads, _ = q.shape
    xp = np if which == "numpy" else A._cupy()
    if batch * seqlen_q * nheads * k.shape[1] == 0:
        return api.seeing_no_key(q, v, variant, xp)
    if which == "numpy":
        from . import numpy_backend

        return api._forward_in_chunks(
            lambda q, k, v, variant: numpy_backend.forward(q, k, v, softmax_scale=scale, causal=causal,
                                                           window_size=window, variant=variant),
            q, k, v, variant)
    return api._forward_in_chunks(lambda q, k, v, variant: api._forward_gpu(which, q, k, v, scale, causal, window,
                                                                            variant), q, k, v, variant)


def dense_backward(which: str, do, q, k, v, o, lse, scale: float, causal: bool, window, deterministic: bool,
                   variant=NO_VARIANT):
    """(dq, dk, dv) of the dense API's backward paths; zeros where nothing is to be computed (dsink
    is the caller's: scores.sink_grad over all its rows)."""
    xp = np if which == "numpy" else A._cupy()
    if q.shape[0] * q.shape[1] * q.shape[2] * k.shape[1] == 0:
        return tuple(xp.zeros(x.shape, x.dtype) for x in (q, k, v))
    if which == "numpy":
        from . import numpy_backend

        return api._backward_in_chunks(
            lambda *chunk: numpy_backend.backward(*chunk[:6], softmax_scale=scale, causal=causal, window_size=window,
                                                  variant=chunk[6]),
            do, q, k, v, o, lse, variant)
    return api._backward_in_chunks(
        lambda *chunk: api._backward_gpu(which, *chunk, scale, causal, window, deterministic), do, q, k, v, o, lse,
        variant)


# --- the whole packed batch in one launch per kernel (GPU) ----------------------------------------

def issue_order(sequences: Sequences) -> np.ndarray | None:
    """The order a packed launch issues its sequences in: the most (query, key) pairs first, ties in
    batch order; None where that is batch order or the lengths stay unread (cupyflash.capture).

    The grid issues its z slots (sequences) in order and every SM takes the next CTA as one
    finishes, so a long sequence late in the batch leaves its CTAs for last, a tail the other SMs
    wait out; issued first, its long CTAs overlap the short sequences' (dev/varlen_wave_model.py).
    The kernels run sequence order[z] in slot z (mask.cuh's cta_sequence); results do not change."""
    if not sequences.read or sequences.count < 2:
        return None
    pairs = np.diff(sequences.cu_q) * np.diff(sequences.cu_k)
    order = np.argsort(-pairs, kind="stable").astype(np.int32)
    return None if np.array_equal(order, np.arange(sequences.count)) else order


def packed_batch(sequences: Sequences):
    """The kernels' kernels.params.PackedBatch: the caller's cumulative lengths on the device as
    C-contiguous int32 (copied there from host arrays), the grid sized by the longest sequences,
    and issue_order's permutation (copied there) where it is not batch order."""
    from .kernels.params import PackedBatch

    order = issue_order(sequences)
    return PackedBatch(device_int32(sequences.given_q, "cu_seqlens_q"),
                       device_int32(sequences.given_k, "cu_seqlens_k"), sequences.longest_q, sequences.longest_k,
                       None if order is None else device_int32(order, "the sequence order"))


def packs(which: str, sequences: Sequences, nheads: int, total_q: int, total_k: int) -> bool:
    """Whether the batch runs packed: a GPU family, something to compute, and a grid that fits.
    Where it does not and the lengths stay unread, the per-sequence path cannot run: the error."""
    fits = sequences.count <= api.MAX_GRID_YZ and nheads <= api.MAX_GRID_YZ
    if which != "numpy" and total_q * nheads * total_k > 0 and fits:
        return True
    if not sequences.read and total_q * nheads * total_k > 0:
        why = "backend 'numpy'" if which == "numpy" else f"{sequences.count} sequences and {nheads} heads"
        raise ValueError(f"cupyflash.no_host_sync() / CUDA-graph capture: with {why} the batch runs sequence by "
                         "sequence, which needs cu_seqlens on the host; pass NumPy cu_seqlens, or call outside "
                         "no_host_sync() and capture (the GPU kernels take up to 65535 sequences and heads)")
    return False


def packed_forward(which: str, q, k, v, scale: float, causal: bool, window, variant, packed) -> tuple:
    """(o, lse (nheads, total_q)) of packed (total, heads, dim) CuPy arrays, one launch."""
    total_q, nheads, _ = q.shape
    headdim_v = v.shape[2]
    lse = api._empty((1, nheads, total_q), lse_dtype(q.dtype))
    kernels = dispatch.family(which, "fwd")
    q, k, v = q[None], k[None], v[None]
    if which == "mma":
        q, k, v = (api._mma_ready(x, dispatch.mma_headdim(x.shape[3])) for x in (q, k, v))
    o = api._empty(q.shape[:3] + v.shape[3:], q.dtype)
    kernels.forward(q, k, v, o, lse, softmax_scale=scale, causal=causal, window_size=window, variant=variant,
                    packed=packed)
    return o[0, ..., :headdim_v], lse[0]


def packed_backward(which: str, do, q, k, v, o, lse, scale: float, causal: bool, window, deterministic: bool,
                    variant, packed) -> tuple:
    """(dq, dk, dv) of packed CuPy arrays (lse (nheads, total_q)), one launch per kernel."""
    import cupy

    widths = (q.shape[2], k.shape[2], v.shape[2])
    kernels = dispatch.family(which, "bwd")
    do, q, k, v, o = (x[None] for x in (do, q, k, v, o))
    if which == "mma":
        do, q, k, v, o = (api._mma_ready(x, dispatch.mma_headdim(x.shape[3])) for x in (do, q, k, v, o))
    dq, dk, dv = (api._empty(x.shape, x.dtype) for x in (q, k, v))
    kernels.backward(do, q, k, v, o, cupy.ascontiguousarray(lse[None]), dq, dk, dv, softmax_scale=scale,
                     causal=causal, deterministic=deterministic, window_size=window, variant=variant, packed=packed)
    return tuple(g[0, ..., :width] for g, width in zip((dq, dk, dv), widths))


def sequence_variant(variant, b: int):
    """The variant of sequence ``b`` as a batch of one (its row of (batch, nheads) ALiBi slopes;
    with dropout, the mask of the batch's sequence b: cupyflash.dropout's first_sequence; with user
    modifiers, b as the sequence's index: Modifiers.first_sequence. Only the NumPy twin takes the
    last two: ``per_sequence_variant``)."""
    if not variant.dropout.on and variant.mods is None:
        return variant.sliced(slice(b, b + 1), slice(None))
    one = dataclasses.replace(variant, dropout=NO_DROPOUT, mods=None).sliced(slice(b, b + 1), slice(None))
    dropout = dataclasses.replace(variant.dropout, first_sequence=b) if variant.dropout.on else NO_DROPOUT
    mods = None if variant.mods is None else variant.mods.for_sequence(b)
    return dataclasses.replace(one, dropout=dropout, mods=mods)


def per_sequence_variant(which: str, variant, work: int) -> None:
    """Refuse dropout and user modifiers where a GPU batch would run sequence by sequence (more
    sequences or heads than one launch takes) with ``work`` (query rows x heads x keys) to do: the
    kernels number a launch's sequences from 0, so each would draw sequence 0's mask and see b = 0.
    The NumPy twin takes each sequence's own (sequence_variant); a batch with nothing to compute
    needs neither."""
    if which == "numpy" or not work:
        return
    if variant.dropout.on:
        raise NotImplementedError("cupyflash: dropout in a varlen batch takes at most 65535 sequences and 65535 "
                                  "query heads (one launch: the mask is a function of the sequence's index)")
    if variant.mods is not None:
        raise NotImplementedError("cupyflash: user modifiers in a varlen batch take at most 65535 sequences and "
                                  "65535 query heads (one launch: b is the sequence's index); split the call")


def _finish(results, which: str, host_out: bool):
    """Results back to the caller's side, as the dense API returns them."""
    return api._to_device(results) if which == "numpy" and not host_out else api._to_host(results, host_out)


# --- the public functions ---------------------------------------------------------------------------

def _check_options(backend, causal, window_size, flag, flag_name, softcap):
    """The options both directions take, checked in this order: (backend, causal, window, the
    bool ``flag_name``, on_gpu); softcap's type (its value with the arrays: scores.check_variant)."""
    backend = A.check_backend(backend)
    causal = A.check_flag(causal, "causal")
    window = check_window(window_size)
    flag = A.check_flag(flag, flag_name)
    check_softcap(softcap)
    return backend, causal, window, flag, api._on_gpu(backend)


@capture.graph_safe
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sink=None,
                           score_mod=None, mask_mod=None, block_mask=None, dropout_p=0.0, seed=None, offset=0,
                           return_lse=False, backend="auto", precision=None, block_table=None):
    """Exact attention over a packed batch of sequences of different lengths (flash-attn 2.8's
    flash_attn_varlen_func).

    q, k: (total_q, nheads, headdim), (total_k, nheads_kv, headdim); v: (total_k, nheads_kv,
    headdim_v), v's head dim free as in flash_attn_func; nheads % nheads_kv == 0 (GQA/MQA). cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32, starting at 0, non-decreasing,
    ending at total_q / total_k; sequence b is queries cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1
    and keys cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1, and no sequence is longer than
    max_seqlen_q / max_seqlen_k. Empty sequences are allowed (no query: nothing; no key: o = 0,
    lse = -inf). ``causal`` and ``window_size`` are flash_attn_func's, applied per sequence with
    its own bottom-right alignment, as are ``softcap``, ``alibi_slopes`` ((nheads,) or (batch,
    nheads) float32: row b for sequence b), ``sink`` ((nheads,) float32), ``dropout_p``, ``seed``
    and ``offset`` (sequence b's mask is that of batch entry b of a dense call with its lengths:
    cupyflash.dropout.dropout_mask(1, ..., first_sequence=b)) and ``precision`` (float32's
    products: cupyflash.precision). The user modifiers ``score_mod``, ``mask_mod`` and ``block_mask``
    are flash_attn_func's with each sequence as a batch entry: b is the sequence, q_idx and kv_idx
    count from its first query and key, and a block_mask is made for (batch, nheads, max_seqlen_q,
    max_seqlen_k) (create_block_mask; a mask_mod alone gets one made per call). Returns o
    (total_q, nheads, headdim_v), or (o, lse) with lse (nheads, total_q), float32 (float64 for float64).
    ``block_table`` (batch, max_blocks_per_seq) int32 (flash-attn's paged varlen, forward only): k, v
    are then pages (num_blocks, page_size, nheads_kv, headdim) of a paged KV cache, sequence b's
    keys its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions through block_table[b]
    (kvcache.paged_varlen_forward; no user modifiers or dropout with it).

    On the GPU one launch covers every sequence (the kernels read cu_seqlens); cu_seqlens are
    read to the host once for the checks (one synchronisation for device arrays), except inside
    cupyflash.no_host_sync() and CUDA-graph capture, which use device cu_seqlens unread and size
    the grid by max_seqlen_q / max_seqlen_k (cupyflash.capture).
    """
    if block_table is not None:
        from .kvcache import paged_varlen_forward

        return paged_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                    softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                    softcap=softcap, alibi_slopes=alibi_slopes, sink=sink, return_lse=return_lse,
                                    backend=backend, precision=precision,
                                    unsupported=dict(score_mod=score_mod is not None, mask_mod=mask_mod is not None,
                                                     block_mask=block_mask is not None, dropout_p=dropout_p != 0))
    backend, causal, window, return_lse, on_gpu = _check_options(backend, causal, window_size, return_lse,
                                                                 "return_lse", softcap)
    arrays, host_out = api._take({"q": q, "k": k, "v": v})
    api._refuse_host_under_capture(arrays, backend)
    dtype = A.check_dtype(arrays)
    total_q, total_k, nheads, _, headdim = check_packed_shapes(*arrays.values())
    sequences = check_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k)
    which = dispatch.choose(backend, dtype, max(headdim, arrays["v"].shape[2]), "fwd")
    mods = sequence_modifiers(score_mod, mask_mod, block_mask, sequences, nheads, max_seqlen_q, max_seqlen_k, which)
    variant = check_variant(softcap, alibi_slopes, sink, sequences.count, nheads, mods,
                            dropout=check_dropout(dropout_p, seed, offset), precision=precision)
    scale = A.resolve_scale(softmax_scale, headdim)
    A.same_device({**arrays, **device_arrays(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)})
    if total_q * nheads * total_k:
        A.check_scores_fit(arrays["q"], arrays["k"], scale)
    q, k, v = api._move(arrays, on_gpu).values()

    xp = np if which == "numpy" else A._cupy()
    variant = variant.to(xp)
    if packs(which, sequences, nheads, total_q, total_k):
        o, lse = packed_forward(which, q, k, v, scale, causal, window, variant, packed_batch(sequences))
        o, lse = _finish((o, lse), which, host_out)
        return (o, lse) if return_lse else o
    if not sequences.read:  # nothing to compute: every query row (if any) sees no key
        o, lse = api.seeing_no_key(q[None], v[None], variant, xp)
        o, lse = _finish((o[0], lse[0]), which, host_out)
        return (o, lse) if return_lse else o
    per_sequence_variant(which, variant, total_q * nheads * total_k)
    cu_q, cu_k = sequences.cu_q, sequences.cu_k
    o = api._empty(q.shape[:2] + v.shape[2:], dtype, xp=xp)
    lse = api._empty((nheads, total_q), lse_dtype(dtype), xp=xp)
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                                             cu_k[1:].tolist())):
        if q1 == q0:
            continue
        o_b, lse_b = dense_forward(which, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal, window,
                                   sequence_variant(variant, b))
        o[q0:q1] = o_b[0]
        lse[:, q0:q1] = lse_b[0]
    o, lse = _finish((o, lse), which, host_out)
    return (o, lse) if return_lse else o


def check_varlen_backward_arrays(do, o, lse, out_shape, dtype) -> None:
    """Shapes and dtypes of the varlen backward's extra inputs; ``out_shape`` the forward output's
    (q's tokens and heads, v's headdim)."""
    total_q, nheads, _ = out_shape
    for name, x in (("do", do), ("o", o)):
        if tuple(x.shape) != tuple(out_shape):
            raise ValueError(f"{name} must have the output's shape (q's tokens and heads, v's headdim) "
                             f"{tuple(out_shape)}; got {tuple(x.shape)}")
        if np.dtype(x.dtype) != dtype:
            raise TypeError(f"{name} must have the dtype of q ({dtype}); got {x.dtype}")
    if tuple(lse.shape) != (nheads, total_q):
        raise ValueError(f"lse must have shape (nheads, total_q) = {(nheads, total_q)}, flash-attn's varlen "
                         f"layout; got {tuple(lse.shape)}")
    if np.dtype(lse.dtype) != lse_dtype(dtype):
        raise TypeError(f"lse must have dtype {lse_dtype(dtype)} for {dtype} inputs; got {lse.dtype}")


@capture.graph_safe
def flash_attn_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               sink=None, score_mod=None, mask_mod=None, block_mask=None, dropout_p=0.0, seed=None,
                               offset=0, backend="auto", deterministic=True, precision=None, statistics="saved"):
    """Gradients (dq, dk, dv) of flash_attn_varlen_func from its o and lse (nheads, total_q); with a
    ``sink``, (dq, dk, dv, dsink), dsink summed over every sequence's rows.

    dq is shaped like q, dk and dv like k and v; for GQA they sum over the query heads sharing a
    kv head. Keys of a sequence without queries, and queries of a sequence without keys, get zero
    gradients. The options must be the forward's (with ``dropout_p`` > 0, its ``seed`` and
    ``offset``: there is no default seed; the user modifiers too, the chain rule through a score_mod
    by its traced derivative); ``deterministic``, ``precision`` and ``statistics`` are
    flash_attn_backward's.
    On the GPU one launch per backward kernel covers every sequence, as in the forward.
    """
    backend, causal, window, deterministic, on_gpu = _check_options(backend, causal, window_size, deterministic,
                                                                    "deterministic", softcap)
    arrays, host_out = api._take({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    api._refuse_host_under_capture(arrays, backend)
    dtype = A.check_dtype({name: arrays[name] for name in ("q", "k", "v", "do", "o")})
    total_q, total_k, nheads, _, headdim = check_packed_shapes(arrays["q"], arrays["k"], arrays["v"])
    check_varlen_backward_arrays(arrays["do"], arrays["o"], arrays["lse"],
                                 arrays["q"].shape[:2] + arrays["v"].shape[2:], dtype)
    sequences = check_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k)
    which = dispatch.choose(backend, dtype, max(headdim, arrays["v"].shape[2]), "bwd")
    mods = sequence_modifiers(score_mod, mask_mod, block_mask, sequences, nheads, max_seqlen_q, max_seqlen_k, which)
    variant = check_variant(softcap, alibi_slopes, sink, sequences.count, nheads, mods,
                            dropout=check_dropout(dropout_p, seed, offset, need_seed=True), precision=precision,
                            statistics=check_statistics(statistics, dtype))
    scale = A.resolve_scale(softmax_scale, headdim)
    A.same_device({**arrays, **device_arrays(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)})
    if total_q * nheads * total_k:
        A.check_scores_fit(arrays["q"], arrays["k"], scale)
    do, q, k, v, o, lse = api._move(arrays, on_gpu).values()

    xp = np if which == "numpy" else A._cupy()
    variant = variant.to(xp)
    if packs(which, sequences, nheads, total_q, total_k):
        grads = packed_backward(which, do, q, k, v, o, lse, scale, causal, window, deterministic, variant,
                                packed_batch(sequences))
    elif not sequences.read:  # nothing to compute: no query row sees a key
        grads = tuple(xp.zeros(x.shape, x.dtype) for x in (q, k, v))
    else:
        per_sequence_variant(which, variant, total_q * nheads * total_k)
        grads = per_sequence_backward(which, do, q, k, v, o, lse, sequences.cu_q, sequences.cu_k, scale, causal,
                                      window, deterministic, variant)
    if variant.sink is not None:  # every row of the packed batch at once: D and lse per row
        grads += (sink_grad(variant.sink, do[None], o[None], lse[None], xp=xp),)
    return _finish(grads, which, host_out)


def per_sequence_backward(which, do, q, k, v, o, lse, cu_q, cu_k, scale, causal, window, deterministic, variant):
    """(dq, dk, dv) by one dense backward per sequence on views (the NumPy twin's path)."""
    xp = np if which == "numpy" else A._cupy()
    dq, dk, dv = (api._empty(x.shape, x.dtype, xp=xp) for x in (q, k, v))
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                                             cu_k[1:].tolist())):
        queries, keys = slice(q0, q1), slice(k0, k1)
        dq_b, dk_b, dv_b = dense_backward(which, do[None, queries], q[None, queries], k[None, keys], v[None, keys],
                                          o[None, queries], lse[None, :, queries], scale, causal, window, deterministic,
                                          sequence_variant(variant, b))
        dq[queries], dk[keys], dv[keys] = dq_b[0], dk_b[0], dv_b[0]
    return dq, dk, dv


def flash_attn_varlen_vjp(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
    """(o, vjp) with vjp(do) -> (dq, dk, dv) for a packed batch: flash_attn_varlen_func and its
    backward without a framework. ``options`` are flash_attn_varlen_func's (softmax_scale, causal,
    window_size, softcap, alibi_slopes, sink, score_mod, mask_mod, block_mask, dropout_p, seed,
    offset, backend, precision); ``deterministic`` and ``statistics`` go to the backward
    (statistics as flash_attn_vjp's). With dropout and no seed, one is drawn here for both
    directions; a mask_mod's block map is made once, here, for both."""
    deterministic = options.pop("deterministic", True)
    statistics = options.pop("statistics", None)
    if "return_lse" in options:
        raise TypeError("flash_attn_varlen_vjp does not take return_lse (the lse is kept for the backward)")
    draw_seed_once(options)
    if options.get("mask_mod") is not None and options.get("block_mask") is None:
        from .modifiers import BlockMask

        device = "cpu" if options.get("backend") == "numpy" or not dispatch.gpu_available() else "cuda"
        options["block_mask"] = BlockMask(options.pop("mask_mod"), np.shape(cu_seqlens_q)[0] - 1, np.shape(q)[1],
                                          check_count(max_seqlen_q, "max_seqlen_q"),
                                          check_count(max_seqlen_k, "max_seqlen_k"), device=device)
    sequences = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, lse = flash_attn_varlen_func(q, k, v, *sequences, return_lse=True, **options)

    statistics = statistics or own_forward_statistics(o.dtype)

    def vjp(do):
        return flash_attn_varlen_backward(do, q, k, v, o, lse, *sequences, deterministic=deterministic,
                                          statistics=statistics, **options)

    return o, vjp
