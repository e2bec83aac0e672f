"""One attention problem: shapes, dtype, mask, scale, input magnitude and the seed of its inputs.

Plain data, no Hypothesis: ``strategies.attention_problems`` draws these, and a failing example
that Hypothesis prints can be rebuilt by hand from its repr.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields

import ml_dtypes
import numpy as np

DTYPES = tuple(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))
DTYPE_NAMES = {dtype.name: dtype for dtype in DTYPES}


def as_dtype(dtype) -> np.dtype:
    """np.dtype of ``dtype``, accepting the names 'float16', 'bfloat16', 'float32', 'float64'."""
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    dtype = np.dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {', '.join(DTYPE_NAMES)}")
    return dtype


def mask_options(softmax_scale, causal, window_size) -> dict:
    """softmax_scale, causal and, only when a window is set, window_size: keywords of
    ``cupyflash.reference``'s functions and of flash-attn's."""
    options = dict(softmax_scale=softmax_scale, causal=causal)
    if tuple(window_size) != (-1, -1):
        options["window_size"] = tuple(window_size)
    return options


class ProblemData:
    """What every problem dataclass here shares (each declares nheads_kv, group, headdim,
    causal, softmax_scale, dtype and window_size): a repr that rebuilds it, its head count,
    scale and keywords. The dataclasses take ``repr=False`` so that this repr is kept."""

    def __repr__(self) -> str:
        # dtype by name, so that the repr is the call that rebuilds the problem.
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["dtype"] = self.dtype.name
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in values.items())})"

    def _repr_pretty_(self, printer, cycle):
        # Hypothesis prints falsifying examples with this (IPython's protocol) when it exists.
        printer.text(repr(self))

    @property
    def nheads(self) -> int:
        return self.nheads_kv * self.group

    @property
    def scale(self) -> float:
        """The softmax scale in effect."""
        return 1.0 / math.sqrt(self.headdim) if self.softmax_scale is None else self.softmax_scale

    @property
    def kwargs(self) -> dict:
        """softmax_scale, causal and (when set) window_size."""
        return mask_options(self.softmax_scale, self.causal, self.window_size)


@dataclass(frozen=True, repr=False)
class AttentionProblem(ProblemData):
    """q (batch, seqlen_q, nheads, headdim); k, v (batch, seqlen_k, nheads_kv, headdim), v (and
    o, do) with ``headdim_v`` columns where that is set; nheads = nheads_kv * group query heads (group > 1: GQA, nheads_kv = 1: MQA). Masks are
    aligned bottom-right: with diagonal = i + seqlen_k - seqlen_q, ``causal`` lets query i see
    key j iff j <= diagonal; ``window_size = (left, right)`` (flash-attn's local attention)
    iff diagonal - left <= j <= diagonal + right, a side of -1 being unbounded (causal sets
    right = 0)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads_kv: int
    group: int  # query heads per kv head
    headdim: int
    causal: bool
    softmax_scale: float | None  # None: the default 1 / sqrt(headdim)
    magnitude: float  # standard deviation of every input
    dtype: np.dtype
    seed: int
    window_size: tuple[int, int] = (-1, -1)
    headdim_v: int | None = None  # v's own head dim (None: headdim)

    def __post_init__(self):
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        object.__setattr__(self, "window_size", tuple(int(side) for side in self.window_size))
        object.__setattr__(self, "headdim_v", self.headdim if self.headdim_v is None else int(self.headdim_v))

    @property
    def kwargs(self) -> dict:
        """softmax_scale, causal and, when a window is set, window_size: the keywords of
        ``cupyflash.reference.attention`` and of flash_attn_func for this problem."""
        return mask_options(self.softmax_scale, self.causal, self.window_size)

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_q, self.nheads, self.headdim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_k, self.nheads_kv, self.headdim)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_k, self.nheads_kv, self.headdim_v)

    @property
    def o_shape(self) -> tuple[int, int, int, int]:
        """Of o and do: q's rows, v's head dim."""
        return (self.batch, self.seqlen_q, self.nheads, self.headdim_v)

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.nheads, self.seqlen_q)

    @property
    def cost(self) -> int:
        """batch * nheads * seqlen_q * seqlen_k * max(headdim, headdim_v): the work of one forward,
        up to a constant."""
        return self.batch * self.nheads * self.seqlen_q * self.seqlen_k * max(self.headdim, self.headdim_v)

    def arrays(self):
        """(q, k, v, do): NumPy arrays of ``dtype``, standard normal times ``magnitude``, drawn
        from ``seed`` (the same four arrays every call)."""
        rng = np.random.default_rng(self.seed)
        return tuple(
            (rng.standard_normal(shape) * self.magnitude).astype(self.dtype)
            for shape in (self.q_shape, self.kv_shape, self.v_shape, self.o_shape)
        )


def as_numpy(x, name: str = "array") -> np.ndarray:
    """A NumPy copy or view of ``x``: NumPy arrays as they are, CuPy arrays through ``.get()``,
    torch tensors (any device, bfloat16 included) through the host, anything else through
    ``np.asarray``."""
    if isinstance(x, np.ndarray):
        return x
    module = type(x).__module__.split(".")[0]
    if module == "cupy":
        return x.get()
    if module == "torch":
        torch = sys.modules["torch"]
        tensor = x.detach().cpu()
        if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16 of its own; same bits
            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    try:
        return np.asarray(x)
    except Exception as exc:
        raise TypeError(f"{name}: cannot make a NumPy array of a {type(x).__name__}: {exc}") from exc
