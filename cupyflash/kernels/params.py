"""The kernels' run-time arguments: NumPy twins of ``kernels_cu/params.cuh``'s structs.

Every kernel takes one argument, its direction's ``FwdParams`` or ``BwdParams``, passed by value
(``__grid_constant__``). Here each is a NumPy structured dtype with the same fields in the same
order and ``align=True``, so NumPy's offsets are the C++ compiler's; ``layout_asserts`` writes
static_asserts of every offset and size, which tests/kernels/test_params.py (and the compile
check) compile under NVRTC on CPU. A launcher fills one scalar per call (``forward_params``,
``backward_params``) and passes it to every kernel of the call; fields a kernel does not read stay
zero (null pointers).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .constants import LOG2E

__all__ = ["PackedBatch", "TENSOR_ROWS", "MOD_ARGS", "BLOCK_MAP_PARAMS", "VARIANT_ARGS", "DROPOUT_ARGS", "set_modifiers", "set_mod_tensors", "FWD_PARAMS", "BWD_PARAMS", "set_variant", "forward_params", "backward_params", "set_rows",
           "set_packed", "pointer", "layout_asserts"]

TENSOR_ROWS = np.dtype([("data", np.uint64), ("batch_stride", np.int64), ("row_stride", np.int64),
                        ("head_stride", np.int64)], align=True)

_SHAPE_FIELDS = [("batch", np.int32), ("seqlen_q", np.int32), ("seqlen_k", np.int32), ("nheads", np.int32),
                 ("nheads_kv", np.int32), ("group", np.int32), ("headdim", np.int32),
                 ("headdim_v", np.int32), ("window_left", np.int32), ("window_right", np.int32)]

# The user modifiers' tensors and block map (modifier.cuh's ModArgs): zeros without modifiers.
MOD_ARGS = np.dtype([("data", np.uint64, (4,)), ("strides", np.int64, (4, 4)),
                     ("key_blocks", np.uint64), ("query_blocks", np.uint64),
                     ("key_blocks_batch_stride", np.int64), ("key_blocks_head_stride", np.int64),
                     ("query_blocks_batch_stride", np.int64), ("query_blocks_head_stride", np.int64),
                     ("block_m", np.int32), ("block_n", np.int32)], align=True)

# A call's dropout (dropout.cuh's DropoutArgs): zeros without one.
DROPOUT_ARGS = np.dtype([("seed", np.uint64), ("offset", np.uint32), ("threshold", np.uint32),
                         ("scale", np.float32), ("scale_f64", np.float64)], align=True)

# A call's variant values (score.cuh): null pointers and zeros for the plain softmax.
VARIANT_ARGS = np.dtype([("alibi_slopes", np.uint64), ("sink", np.uint64), ("alibi_batch_stride", np.int64),
                         ("softcap", np.float32), ("softcap_f64", np.float64), ("mods", MOD_ARGS),
                         ("dropout", DROPOUT_ARGS)], align=True)

# flash_block_map's argument (modifier.cuh's BlockMapParams).
BLOCK_MAP_PARAMS = np.dtype([("t", MOD_ARGS), ("key_blocks", np.uint64), ("query_blocks", np.uint64),
                             ("map_batch", np.int32), ("map_heads", np.int32), ("seqlen_q", np.int32),
                             ("seqlen_k", np.int32), ("query_granules", np.int32), ("key_granules", np.int32),
                             ("by_keys", np.int32)],
                            align=True)

_SCALE_FIELDS = [("scale_log2", np.float32), ("scale", np.float32), ("scale_log2_f64", np.float64),
                 ("scale_f64", np.float64), ("variant", VARIANT_ARGS)]

# A packed batch's cumulative lengths (mask.cuh's Packed policies) and the order its grid issues the
# sequences in (null: batch order); all null for a dense batch.
_SEQUENCE_FIELDS = [("cu_seqlens_q", np.uint64), ("cu_seqlens_k", np.uint64), ("sequence_order", np.uint64)]

FWD_PARAMS = np.dtype([*((name, TENSOR_ROWS) for name in ("q", "k", "v", "o")), ("lse", np.uint64),
                       *_SHAPE_FIELDS, *_SCALE_FIELDS, *_SEQUENCE_FIELDS, ("kv_split", np.uint64)], align=True)

BWD_PARAMS = np.dtype([*((name, TENSOR_ROWS) for name in ("q", "k", "v", "o", "dout", "dq", "dk", "dv",
                                                           "dq_accum")),
                       ("dq_accum_panel_stride", np.int64), ("lse", np.uint64), ("delta", np.uint64),
                       ("dq_semaphore", np.uint64), ("dq_row_scale", np.uint64), ("kv_bound", np.uint64),
                       *_SHAPE_FIELDS, *_SCALE_FIELDS, *_SEQUENCE_FIELDS,
                       ("weight", np.uint64), ("dp_ref", np.uint64), ("lse_to_log2", np.float32),
                       ("lse_to_log2_f64", np.float64), ("kv_split", np.uint64),
                       ("q_split", np.uint64)],
                      align=True)

_CPP_NAMES = {FWD_PARAMS: "cf::FwdParams", BWD_PARAMS: "cf::BwdParams", VARIANT_ARGS: "cf::VariantArgs",
              MOD_ARGS: "cf::ModArgs", DROPOUT_ARGS: "cf::DropoutArgs", BLOCK_MAP_PARAMS: "cf::BlockMapParams"}


class PackedBatch(NamedTuple):
    """A packed (varlen) batch as the launchers take it: the tensors are (1, total, heads, dim)
    views of the packed arrays, lse (1, nheads, total_q); sequence b is rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1 of q (keys likewise). The grids cover max_seqlen_q (max_seqlen_k) rows
    per sequence; the kernels read the lengths themselves (mask.cuh's cta_sequence)."""

    cu_seqlens_q: object  # CuPy int32 (sequences + 1,)
    cu_seqlens_k: object
    max_seqlen_q: int
    max_seqlen_k: int
    # CuPy int32 (sequences,): grid slot z runs sequence sequence_order[z] (varlen.issue_order: the
    # most pairs first); None: batch order. Only the CTAs' issue order changes, not any result.
    sequence_order: object = None

    @property
    def sequences(self) -> int:
        return int(self.cu_seqlens_q.shape[0]) - 1


def set_packed(params, packed: PackedBatch | None) -> None:
    """The cumulative lengths and issue order of a packed batch into ``params`` (None: a dense
    batch, null)."""
    if packed is None:
        return
    order = packed.sequence_order
    if order is not None and order.shape != (packed.sequences,):
        raise ValueError(f"cupyflash: sequence_order must hold one entry per sequence ({packed.sequences}); "
                         f"got shape {order.shape}")
    for name, a in (("cu_seqlens_q", packed.cu_seqlens_q), ("cu_seqlens_k", packed.cu_seqlens_k),
                    ("sequence_order", order)):
        if a is None:  # the order only: batch order
            continue
        if isinstance(a, np.ndarray) or a.dtype != np.int32 or not a.flags.c_contiguous:
            raise ValueError(f"cupyflash: the kernels read {name} as a C-contiguous int32 CuPy array")
        params[name] = pointer(a)


def pointer(a) -> np.uint64:
    """The device address of a CuPy array (0 for None)."""
    return np.uint64(0 if a is None else a.data.ptr)


def set_rows(params, name: str, a, strides: tuple | None = None) -> None:
    """Field ``name`` of ``params`` = (address, batch, row, head strides in elements) of the
    (B, S, H, D) array ``a``; ``strides`` overrides the strides (a panel-major dq_accum)."""
    field = params[name]
    field["data"] = pointer(a)
    if strides is None:
        strides = tuple(s // a.itemsize for s in a.strides[:3])
    field["batch_stride"], field["row_stride"], field["head_stride"] = (np.int64(s) for s in strides)


def set_cache_rows(params, k_cache, v_cache, row_pages: bool) -> None:
    """The caches' fields "k" and "v": their rows; with ``row_pages`` a table entry (a "page") is a
    row of the cache, so that a page may start at any position of a cache row (cache_leftpad): the
    batch strides become the row strides, and entry e addresses row e of the cache's rows laid end
    to end (cupyflash.kvcache.row_page_ratio)."""
    for name, a in (("k", k_cache), ("v", v_cache)):
        set_rows(params, name, a)
        if row_pages:
            params[name]["batch_stride"] = params[name]["row_stride"]


def _set_shape(params, q, k, v, mask) -> None:
    """The shape fields; headdim is k's (q's, unless a launcher padded q: mma_bwd.backward)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    params["batch"], params["seqlen_q"], params["seqlen_k"] = batch, seqlen_q, seqlen_k
    params["nheads"], params["nheads_kv"], params["group"] = nheads, nheads_kv, nheads // nheads_kv
    params["headdim"], params["headdim_v"] = k.shape[3], v.shape[3]
    params["window_left"], params["window_right"] = mask.window_args()


def _set_scales(params, softmax_scale: float) -> None:
    """softmax_scale * log2(e) (and softmax_scale, backward) in double and rounded once to the
    nearest float32: the float kernels read the float fields as they are (params.cuh)."""
    scale_log2 = np.float64(softmax_scale) * LOG2E
    params["scale_log2"], params["scale_log2_f64"] = np.float32(scale_log2), scale_log2
    params["scale"], params["scale_f64"] = np.float32(softmax_scale), np.float64(softmax_scale)


def set_variant(params, variant) -> None:
    """The variant's values into ``params`` (a cupyflash.scores.Variant whose arrays are
    C-contiguous float32 CuPy arrays, Variant.to(cupy); None: the plain softmax). The pointers
    address the variant's own arrays, which the caller holds until the launch is queued."""
    if variant is None or variant.plain:
        return
    field = params["variant"]
    field["softcap"], field["softcap_f64"] = np.float32(variant.softcap), np.float64(variant.softcap)
    for name in ("alibi_slopes", "sink"):
        a = getattr(variant, name)
        if a is None:
            continue
        if isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError(f"cupyflash: the kernels read {name} as a C-contiguous float32 CuPy array")
        field[name] = pointer(a)
    if variant.alibi_slopes is not None:
        field["alibi_batch_stride"] = np.int64(variant.alibi_slopes.shape[1] if variant.alibi_slopes.ndim == 2 else 0)
    if variant.mods is not None:
        if variant.mods.first_sequence:  # the kernels' batch entries count from their launch's 0
            raise ValueError("cupyflash: a kernel launch takes user modifiers with first_sequence 0 (the NumPy twin's "
                             "per-sequence views only take others)")
        set_modifiers(field["mods"], variant.mods, params)
    if variant.dropout.on:
        if variant.dropout.first_sequence:  # the kernels' sequences count from their launch's 0
            raise ValueError("cupyflash: a kernel launch takes dropout with first_sequence 0 (the NumPy twin's "
                             "per-sequence views only take others)")
        d = field["dropout"]
        d["seed"], d["offset"] = np.uint64(variant.dropout.seed), np.uint32(variant.dropout.offset)
        d["threshold"] = np.uint32(variant.dropout.threshold)
        d["scale"], d["scale_f64"] = np.float32(variant.dropout.scale), np.float64(variant.dropout.scale)


def set_mod_tensors(mod_args, tensors) -> None:
    """The addresses and strides (in elements) of a modifier's CuPy tensors into a ModArgs field."""
    for slot, t in enumerate(tensors):
        a = t.array
        if isinstance(a, np.ndarray):
            raise ValueError(f"cupyflash: the kernels read the modifier's tensor {t.name!r} as a CuPy array")
        mod_args["data"][0, slot] = pointer(a)
        for d, stride in enumerate(a.strides):
            mod_args["strides"][0, slot, d] = np.int64(stride // a.itemsize)


def set_modifiers(mod_args, mods, params) -> None:
    """A call's modifiers (cupyflash.modifiers.Modifiers, tensors on the GPU) into the ModArgs field
    of ``params``: the tensors, and the block map's folded tables for the call's GQA group."""
    set_mod_tensors(mod_args, mods.tensors)
    if not mods.has_map:  # none, or a mask applied element by element (UserScore's BLOCK_MAP false)
        return
    import cupy

    group = int(params["group"][0])
    key, query = mods.block_mask.tables(group, cupy)
    mod_args["key_blocks"], mod_args["query_blocks"] = pointer(key), pointer(query)
    for name, table in (("key_blocks", key), ("query_blocks", query)):
        mb, mh = table.shape[:2]
        mod_args[f"{name}_batch_stride"] = np.int64(table.strides[0] // 4 if mb > 1 else 0)
        mod_args[f"{name}_head_stride"] = np.int64(table.strides[1] // 4 if mh > 1 else 0)
    mod_args["block_m"] = mod_args["block_n"] = np.int32(mods.block_mask.GRANULE)


def check_block_map(mask, variant) -> None:
    """A user mask's block map is there exactly where the specialization reads one (UserScore's
    BLOCK_MAP, scores.Score.block_map): a map-reading kernel handed a mask without one would read
    its tables at address 0."""
    mods = None if variant is None else variant.mods
    if mods is not None and mods.has_mask and mask.score.block_map != mods.has_map:
        raise ValueError(f"cupyflash: the kernel {'reads' if mask.score.block_map else 'takes no'} block map, and "
                         f"the call's mask_mod {'has none' if mask.score.block_map else 'has one'}")


def forward_params(q, k, v, o, lse, *, softmax_scale: float, mask, variant=None, packed=None) -> np.ndarray:
    """FwdParams of one forward call (a size-1 array of FWD_PARAMS: CuPy passes its bytes by value);
    ``packed`` a PackedBatch (its arrays (1, total, heads, dim)) or None."""
    check_block_map(mask, variant)
    params = np.zeros(1, FWD_PARAMS)
    for name, a in (("q", q), ("k", k), ("v", v), ("o", o)):
        set_rows(params, name, a)
    params["lse"] = pointer(lse)
    _set_shape(params, q, k, v, mask)
    _set_scales(params, softmax_scale)
    set_variant(params, variant)
    set_packed(params, packed)
    return params


def backward_params(do, q, k, v, o, lse, dq, dk, dv, *, softmax_scale: float, mask, delta=None,
                    variant=None, packed=None) -> np.ndarray:
    """BwdParams of one backward call; the launcher adds the buffers of its plan (delta, dq_accum,
    dq_semaphore, dq_row_scale, kv_bound) with ``set_rows`` / ``pointer`` as it allocates them."""
    check_block_map(mask, variant)
    params = np.zeros(1, BWD_PARAMS)
    for name, a in (("q", q), ("k", k), ("v", v), ("o", o), ("dout", do), ("dq", dq), ("dk", dk), ("dv", dv)):
        set_rows(params, name, a)
    params["lse"], params["delta"] = pointer(lse), pointer(delta)
    set_lse_unit(params, LOG2E)
    _set_shape(params, q, k, v, mask)
    _set_scales(params, softmax_scale)
    set_variant(params, variant)
    set_packed(params, packed)
    return params


def set_lse_unit(params: np.ndarray, to_log2: float) -> None:
    """How the SIMT backward turns params' lse into log2 units: LOG2E for a saved (natural log)
    lse, 1.0 for flash_bwd_stats_simt's top scores (params.cuh's BwdParams)."""
    params["lse_to_log2"], params["lse_to_log2_f64"] = np.float32(to_log2), np.float64(to_log2)


def _fields(dtype: np.dtype, prefix: str = ""):
    """(C++ member path, offset, size) of every leaf field of ``dtype``."""
    for name in dtype.names:
        sub, offset = dtype.fields[name][:2]
        if sub.names:
            for path, inner, size in _fields(sub, f"{prefix}{name}."):
                yield path, offset + inner, size
        else:
            yield f"{prefix}{name}", offset, sub.itemsize


def layout_asserts() -> str:
    """params.cuh followed by C++ static_asserts that params.cuh's structs have exactly these dtypes' layouts (sizes,
    alignment, every field's offset and size). Equal total sizes and fields that tile the struct
    leave no member unchecked."""
    from ._module import kernel_source

    lines = [kernel_source("params.cuh")]
    for dtype, cpp in _CPP_NAMES.items():
        lines.append(f'static_assert(sizeof({cpp}) == {dtype.itemsize}, "{cpp}: size");')
        lines.append(f'static_assert(alignof({cpp}) == {dtype.alignment}, "{cpp}: alignment");')
        for path, offset, size in _fields(dtype):
            lines.append(f'static_assert(__builtin_offsetof({cpp}, {path}) == {offset}, "{cpp}::{path}: offset");')
            lines.append(f'static_assert(sizeof((({cpp}*)0)->{path}) == {size}, "{cpp}::{path}: size");')
    return "\n".join(lines) + "\n"


# merge_attention_states (kernels_cu/merge_attention_states.cu): a (batch, nheads, seqlen) lse with
# its strides in elements, and the merge's one argument.
LSE_ROWS = np.dtype([("data", np.uint64), ("batch_stride", np.int64), ("head_stride", np.int64),
                     ("row_stride", np.int64)], align=True)

MERGE_PARAMS = np.dtype([*((name, TENSOR_ROWS) for name in ("o_a", "o_b", "o")),
                         *((name, LSE_ROWS) for name in ("lse_a", "lse_b", "lse")),
                         ("batch", np.int32), ("seqlen", np.int32), ("nheads", np.int32), ("headdim", np.int32)],
                        align=True)

_CPP_NAMES[MERGE_PARAMS] = "cf::MergeParams"
__all__ += ["LSE_ROWS", "MERGE_PARAMS"]


# flash_fwd_kvcache_mma and flash_fwd_combine (kernels_cu/params.cuh's FastDivmod, CacheFwdParams,
# CombineParams).
FAST_DIVMOD = np.dtype([("divisor", np.int32), ("multiplier", np.uint32), ("shift", np.uint32)], align=True)

CACHE_FWD_PARAMS = np.dtype([*((name, TENSOR_ROWS) for name in ("q", "k", "v", "o")), ("lse", np.uint64),
                             *_SHAPE_FIELDS, *_SCALE_FIELDS,
                             ("seqlens_k", np.uint64), ("block_table", np.uint64), ("block_table_stride", np.int64),
                             ("page", FAST_DIVMOD), ("num_splits", np.int32), ("split_keys", np.int32),
                             ("o_partial", np.uint64), ("lse_partial", np.uint64)], align=True)

COMBINE_PARAMS = np.dtype([("o_partial", np.uint64), ("lse_partial", np.uint64), ("o", TENSOR_ROWS),
                           ("lse", np.uint64), ("sink", np.uint64), ("num_splits", np.int32), ("batch", np.int32),
                           ("seqlen_q", np.int32), ("nheads", np.int32), ("headdim", np.int32)], align=True)

APPEND_PARAMS = np.dtype([*((name, TENSOR_ROWS) for name in ("k_new", "v_new", "k", "v")),
                          ("cache_seqlens", np.uint64), ("block_table", np.uint64), ("block_table_stride", np.int64),
                          ("seqlens_k", np.uint64), ("page", FAST_DIVMOD), ("batch", np.int32),
                          ("seqlen_new", np.int32), ("nheads_kv", np.int32), ("headdim", np.int32),
                          ("headdim_v", np.int32)], align=True)

ROTARY_PARAMS = np.dtype([("x", TENSOR_ROWS), ("out", TENSOR_ROWS), ("cos", np.uint64), ("sin", np.uint64),
                          ("starts", np.uint64), ("batch", np.int32), ("tokens", np.int32), ("heads", np.int32),
                          ("headdim", np.int32), ("half", np.int32), ("per_token", np.int32)], align=True)

_CPP_NAMES.update({FAST_DIVMOD: "cf::FastDivmod", CACHE_FWD_PARAMS: "cf::CacheFwdParams",
                   COMBINE_PARAMS: "cf::CombineParams", APPEND_PARAMS: "cf::AppendParams",
                   ROTARY_PARAMS: "cf::RotaryParams"})
__all__ += ["FAST_DIVMOD", "CACHE_FWD_PARAMS", "COMBINE_PARAMS", "APPEND_PARAMS", "ROTARY_PARAMS", "fast_divmod"]


def fast_divmod(divisor: int) -> tuple:
    """(divisor, multiplier, shift) of FastDivmod: n / divisor = umulhi(n, multiplier) >> shift for
    0 <= n < 2^31 (divisor > 1; divisor 1 is taken as n itself)."""
    divisor = int(divisor)
    if not 1 <= divisor < 2**31:
        raise ValueError(f"cupyflash: divisor out of range: {divisor}")
    if divisor == 1:
        return np.int32(1), np.uint32(0), np.uint32(0)
    log2 = (divisor - 1).bit_length()  # ceil(log2(divisor))
    multiplier = -(-(1 << (31 + log2)) // divisor)
    return np.int32(divisor), np.uint32(multiplier), np.uint32(log2 - 1)
