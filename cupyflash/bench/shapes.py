"""Benchmark cases: the FlashAttention papers' shapes, FLOP counts, and the sweep presets.

The papers fix the number of tokens (batch * seqlen = 16384) and the model width
(nheads * headdim = 2048), so every case moves the same number of Q/K/V bytes and only the
shape of the work changes with seqlen and headdim.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
MODES = ("fwd", "bwd", "fwd+bwd")

# Work of one pass relative to the forward: the backward does five matmuls of the forward's
# size where the forward does two, so 2.5x; fwd+bwd is their sum.
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}

PAPER_TOKENS = 16384
PAPER_MODEL_DIM = 2048


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                    *, causal: bool, mode: str = "fwd") -> float:
    """FLOPs by the FlashAttention papers' convention: 4*B*H*Sq*Sk*D for the forward (two
    matmuls, 2 FLOPs per multiply-add), halved when causal, times 2.5 for the backward.

    The causal halving is the convention, not the exact count of unmasked pairs (which is
    (S+1)/(2S) of the square for Sq == Sk); it keeps numbers comparable with published ones.
    """
    if mode not in MODE_FLOP_FACTOR:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    if causal:
        flops *= 0.5
    return flops * MODE_FLOP_FACTOR[mode]


def paper_shape(seqlen: int, headdim: int, *, tokens: int = PAPER_TOKENS,
                model_dim: int = PAPER_MODEL_DIM) -> tuple[int, int]:
    """(batch, nheads) with batch * seqlen = tokens (at least one sequence) and
    nheads * headdim = model_dim."""
    if seqlen < 1 or headdim < 1:
        raise ValueError(f"seqlen and headdim must be positive, got {seqlen}, {headdim}")
    if model_dim % headdim:
        raise ValueError(f"model width {model_dim} is not a multiple of headdim {headdim}")
    return max(1, tokens // seqlen), model_dim // headdim


@dataclass(frozen=True)
class Case:
    """One timed problem: an attention call of one shape, dtype, mask and direction."""

    dtype: str  # key of DTYPES
    headdim: int
    seqlen_q: int
    seqlen_k: int
    batch: int
    nheads: int
    nheads_kv: int
    causal: bool
    mode: str  # one of MODES

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.nheads, self.seqlen_q, self.seqlen_k,
                               self.headdim, causal=self.causal, mode=self.mode)

    @property
    def shape_key(self) -> tuple:
        """What the input arrays depend on (not the mask, not the direction)."""
        return (self.dtype, self.headdim, self.seqlen_q, self.seqlen_k, self.batch,
                self.nheads, self.nheads_kv)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V, what a decode step must read."""
        return 2 * self.batch * self.seqlen_k * self.nheads_kv * self.headdim * ITEMSIZE[self.dtype]

    def label(self) -> str:
        seq = (f"s{self.seqlen_q}" if self.seqlen_q == self.seqlen_k
               else f"sq{self.seqlen_q} sk{self.seqlen_k}")
        heads = (f"h{self.nheads}" if self.nheads == self.nheads_kv
                 else f"h{self.nheads}/{self.nheads_kv}")
        mask = "causal" if self.causal else "full"
        return f"{self.dtype} d{self.headdim} {seq} b{self.batch} {heads} {mask} {self.mode}"


@dataclass(frozen=True)
class Grid:
    """Head dims x sequence lengths swept for one dtype."""

    headdims: tuple[int, ...]
    seqlens: tuple[int, ...]


SEQLENS_FULL = (512, 1024, 2048, 4096, 8192, 16384)

# The default sweep mirrors the anchors we have: bf16 everywhere, fp16 at d128 as the papers
# report it, fp32 where only the mem-efficient backend (and cupyflash's SIMT kernels) exist.
FULL = {
    "bf16": Grid((64, 128, 256), SEQLENS_FULL),
    "fp16": Grid((128,), SEQLENS_FULL),
    "fp32": Grid((64, 128), (1024, 4096, 8192)),
}
QUICK_GRID = Grid((128,), (1024, 4096))
QUICK_DTYPES = ("bf16",)


@dataclass(frozen=True)
class SweepSpec:
    """What to sweep, after presets and command-line overrides are merged."""

    grids: dict  # dtype -> Grid, in run order
    causal: tuple[bool, ...] = (False, True)
    modes: tuple[str, ...] = ("fwd", "bwd")
    tokens: int = PAPER_TOKENS
    model_dim: int = PAPER_MODEL_DIM
    batch: int | None = None  # overrides the paper shape when set
    nheads: int | None = None
    nheads_kv: int | None = None


def make_sweep(*, quick: bool = False, dtypes=None, headdims=None, seqlens=None,
               causal=(False, True), modes=("fwd", "bwd"), tokens: int = PAPER_TOKENS,
               model_dim: int = PAPER_MODEL_DIM, batch=None, nheads=None,
               nheads_kv=None) -> SweepSpec:
    """Merge a preset (full or quick) with explicit choices; an explicit axis replaces the
    preset's value of that axis for every dtype."""
    if dtypes is None:
        dtypes = QUICK_DTYPES if quick else tuple(FULL)
    grids = {}
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        base = QUICK_GRID if quick else FULL[dtype]
        grids[dtype] = Grid(tuple(headdims) if headdims else base.headdims,
                            tuple(seqlens) if seqlens else base.seqlens)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    return SweepSpec(grids=grids, causal=tuple(causal), modes=tuple(modes), tokens=tokens,
                     model_dim=model_dim, batch=batch, nheads=nheads, nheads_kv=nheads_kv)


def shape_of(spec: SweepSpec, seqlen: int, headdim: int) -> tuple[int, int, int]:
    """(batch, nheads, nheads_kv) of one grid point."""
    if spec.batch is not None and spec.nheads is not None:
        batch, nheads = spec.batch, spec.nheads
    else:
        batch, nheads = paper_shape(seqlen, headdim, tokens=spec.tokens, model_dim=spec.model_dim)
        batch = spec.batch if spec.batch is not None else batch
        nheads = spec.nheads if spec.nheads is not None else nheads
    nheads_kv = spec.nheads_kv if spec.nheads_kv is not None else nheads
    if nheads % nheads_kv:
        raise ValueError(f"nheads {nheads} is not a multiple of nheads_kv {nheads_kv}")
    return batch, nheads, nheads_kv


def expand(spec: SweepSpec) -> list[Case]:
    """Every case of the sweep, grouped so that cases sharing inputs are adjacent:
    dtype > headdim > seqlen > causal > mode."""
    cases = []
    for dtype, grid in spec.grids.items():
        for headdim in grid.headdims:
            for seqlen in grid.seqlens:
                batch, nheads, nheads_kv = shape_of(spec, seqlen, headdim)
                for causal in spec.causal:
                    for mode in spec.modes:
                        cases.append(Case(dtype, headdim, seqlen, seqlen, batch, nheads,
                                          nheads_kv, causal, mode))
    return cases


def group_by_shape(cases: list[Case]) -> list[list[Case]]:
    """Consecutive runs of cases with the same inputs (see Case.shape_key)."""
    groups: list[list[Case]] = []
    for case in cases:
        if groups and groups[-1][0].shape_key == case.shape_key:
            groups[-1].append(case)
        else:
            groups.append([case])
    return groups


# Decode: one new query token against a long KV cache. The first two are the brief's default
# (Llama-like 32 query heads, MHA and 4:1 GQA); the third is a long single-sequence cache.
DECODE_CASES = (
    (8, 32, 32, 32768),
    (8, 32, 8, 32768),
    (1, 32, 8, 131072),
)


def decode_cases(dtype: str = "bf16", headdim: int = 128, shapes=DECODE_CASES) -> list[Case]:
    """Forward-only cases with seqlen_q = 1. Not causal: with bottom-right alignment the single
    query sees every key anyway, and torch's is_causal would align it top-left."""
    return [Case(dtype, headdim, 1, kv_len, batch, hq, hkv, False, "fwd")
            for batch, hq, hkv, kv_len in shapes]


def memory_cases(seqlens, *, dtype: str = "bf16", headdim: int = 128, batch: int = 1,
                 model_dim: int = PAPER_MODEL_DIM, causal: bool = True) -> list[Case]:
    """Forward+backward cases of one sequence per batch, nheads * headdim = model_dim."""
    nheads = paper_shape(1, headdim, model_dim=model_dim)[1]
    return [Case(dtype, headdim, s, s, batch, nheads, nheads, causal, "fwd+bwd") for s in seqlens]


def parse_size(text: str) -> int:
    """'4096', '4k' or '4K' -> 4096; '1m' -> 1048576."""
    text = text.strip().lower()
    scale = 1
    if text.endswith("k"):
        scale, text = 1024, text[:-1]
    elif text.endswith("m"):
        scale, text = 1024 * 1024, text[:-1]
    try:
        value = int(text) * scale
    except ValueError:
        raise ValueError(f"not a size: {text!r}") from None
    if value < 1:
        raise ValueError(f"size must be positive, got {value}")
    return value


def format_size(n: int) -> str:
    """4096 -> '4k', 1000 -> '1000'."""
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)
