"""Masked, windowed and score-modified attention (softcap, ALiBi, sinks) against PyTorch
FlexAttention, TFLOP/s over the visible pairs.

``python -m cupyflash.bench.variants`` times, on the same inputs and in one process:

* cupyflash with ``causal`` / ``window_size`` (when this version of cupyflash has the argument);
* FlexAttention, ``torch.compile(flex_attention)`` with a ``mask_mod`` and ``create_block_mask``
  (the anchor torch users have for windows and document masks);
* cuDNN through SDPA, for the cases SDPA can express (full and causal).

FLOPs count only the visible (query, key) pairs: 4 * B * H * pairs * D forward (2 * B * H *
pairs * (D_qk + D_v) for the variants with a head dim of v of its own, "192/128"), 2.5x that
backward, so a window that is skipped block by block shows as the same TFLOP/s as the causal
kernel, and one masked element by element shows as a drop. The pairs are counted from the
definition (flash-attn 2.8: query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right),
not from cupyflash's masks.

A second table gives the window's speed-up over full causal attention at the same shape (the
issue's bar: at 16k, window (1024, 0) and (512, 512) at least 8x faster forward and backward),
and a document mask's over the same sequence without a mask.

The issues' bars are ratios to the plain kernel in one run, and one baseline row timed once
moves every ratio with it (the plain causal forward came out 12-15% slow in two whole runs of
2026-12-07 against the other calls of the same sessions). ``--paired N`` times cupyflash's own baseline (plain causal for a
causal or windowed variant, plain full otherwise) again beside each variant, alternated N times
(variant, baseline, variant, ...), and a third table gives the ratios of the medians with their
spread over the rounds (``paired_table``).

User modifiers (cupyflash.modifiers): the variants marked "(score_mod)" run softcap and ALiBi as
cupyflash score modifiers (FlexAttention runs the same functions), "documents N" a mask_mod of
documents of N tokens packed into the sequence, with its block map made once before timing (as
FlexAttention's create_block_mask).
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
from dataclasses import asdict, dataclass

import numpy as np

from .timing import FULL_POLICY, time_region


@dataclass(frozen=True)
class Variant:
    name: str
    causal: bool
    window: tuple[int, int] = (-1, -1)  # flash-attn's (left, right); -1 = unbounded
    softcap: float = 0.0  # c tanh(z / c) (0: none)
    alibi: bool = False  # ALiBi with the geometric slopes 2^(-8 (h + 1) / nheads)
    sink: bool = False  # a sink logit per head (gpt-oss)
    modifier: bool = False  # softcap / ALiBi as a cupyflash score_mod instead of the argument
    documents: int = 0  # a mask_mod of packed documents of this many tokens (0: none)
    dropout: float = 0.0  # dropout_p (cupyflash only: FlexAttention has no dropout)
    dims: tuple[int, int] | None = None  # (headdim of q and k, of v) in place of the run's headdim

    def headdims(self, headdim: int) -> tuple[int, int]:
        return self.dims or (headdim, headdim)

    def bounds(self) -> tuple[int, int]:
        """(left, right) with causal folded in; -1 = unbounded."""
        left, right = self.window
        if self.causal:
            right = 0 if right < 0 else min(right, 0)
        return left, right


VARIANTS = (
    Variant("full", False),
    Variant("causal", True),
    Variant("causal window 1024", True, (1024, 0)),
    Variant("window (512, 512)", False, (512, 512)),
    Variant("causal softcap 30", True, softcap=30.0),
    Variant("causal alibi", True, alibi=True),
    Variant("causal sink", True, sink=True),
    Variant("causal dropout 0.1", True, dropout=0.1),
    Variant("dropout 0.1", False, dropout=0.1),
    Variant("causal softcap 30 (score_mod)", True, softcap=30.0, modifier=True),
    Variant("causal alibi (score_mod)", True, alibi=True, modifier=True),
    Variant("documents 2048", False, documents=2048),
    Variant("causal documents 2048", True, documents=2048),
    Variant("causal 192/128", True, dims=(192, 128)),
    Variant("causal 192/192", True, dims=(192, 192)),
    Variant("192/128", False, dims=(192, 128)),
)


def document_ids(seqlen: int, length: int) -> np.ndarray:
    """(1, seqlen) int32: token t belongs to document t // length."""
    return (np.arange(seqlen, dtype=np.int32) // length)[None]


def pairs_of(variant: "Variant", seqlen: int) -> int:
    """Visible pairs of ``variant`` at seqlen_q = seqlen_k = ``seqlen``: the band's, within each
    document for a document mask."""
    if not variant.documents:
        return visible_pairs(seqlen, seqlen, *variant.bounds())
    lengths = [min(variant.documents, seqlen - start) for start in range(0, seqlen, variant.documents)]
    return sum(visible_pairs(n, n, *variant.bounds()) for n in lengths)


def alibi_slopes(nheads: int) -> np.ndarray:
    """ALiBi's slopes for ``nheads`` heads (the geometric sequence of its paper), float32."""
    return (2.0 ** (-8.0 * (np.arange(nheads) + 1) / nheads)).astype(np.float32)


def visible_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """Number of (i, j) with j in [i + sk - sq - left, i + sk - sq + right] ∩ [0, sk)."""
    i = np.arange(seqlen_q, dtype=np.int64)
    diag = i + seqlen_k - seqlen_q
    lo = np.zeros_like(i) if left < 0 else np.maximum(diag - left, 0)
    hi = np.full_like(i, seqlen_k - 1) if right < 0 else np.minimum(diag + right, seqlen_k - 1)
    return int(np.maximum(hi - lo + 1, 0).sum())


@dataclass
class Row:
    variant: str
    seqlen: int
    impl: str
    mode: str
    ms: float | None
    tflops: float | None
    note: str = ""


@dataclass
class PairedRow:
    """A variant's cupyflash times (ms) and its baseline's, alternated in one call: variant_ms[r]
    was timed before baseline_ms[r]; flops of each, for the TFLOP/s ratio."""
    variant: str
    seqlen: int
    baseline: str
    mode: str
    variant_ms: list
    baseline_ms: list
    variant_flops: float
    baseline_flops: float


def baseline_of(variant: Variant) -> Variant | None:
    """The plain kernel a variant's bar compares it with: causal for a causal or windowed variant
    (issue 15 compares windows with causal attention), full otherwise; None for the plain rows
    themselves and for a head dim of v of its own (no plain row at those dims)."""
    if variant.dims is not None or variant == Variant(variant.name, variant.causal):
        return None
    if variant.causal or variant.window != (-1, -1):
        return Variant("causal", True)
    return Variant("full", False)


def _cupyflash_has_window() -> bool:
    import cupyflash

    return "window_size" in inspect.signature(cupyflash.flash_attn_func).parameters


def _inputs(batch, seqlen, nheads, headdims, n_sets, seed):
    """``n_sets`` of (q, k, v, do), bf16; headdims (of q and k, of v and do)."""
    import cupy
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16)
    sets = []
    for index in range(n_sets):
        rng = cupy.random.default_rng(seed * 1000 + index)
        sets.append(tuple(rng.standard_normal((batch, seqlen, nheads, d), dtype=np.float32).astype(dtype)
                          for d in (headdims[0], headdims[0], headdims[1], headdims[1])))  # q, k, v, do
    return sets


def _time(run, n_sets, stream) -> float:
    run(0)  # compiles
    return time_region(run, n_sets, policy=FULL_POLICY, stream=stream).median_ms


def _cupyflash_runs(variant: Variant, sets):
    import cupy

    import cupyflash

    kwargs = {"causal": variant.causal}
    if variant.window != (-1, -1):
        if not _cupyflash_has_window():
            return None, None
        kwargs["window_size"] = variant.window
    if variant.dropout:
        if "dropout_p" not in inspect.signature(cupyflash.flash_attn_func).parameters:
            return None, None
        kwargs.update(dropout_p=variant.dropout, seed=1234)
    if sets[0][0].shape[3] != sets[0][2].shape[3] and "headdim_v" not in (cupyflash.flash_attn_func.__doc__ or ""):
        return None, None  # a version without a head dim of its own for v
    if variant.modifier or variant.documents:
        if "score_mod" not in inspect.signature(cupyflash.flash_attn_func).parameters:
            return None, None
        from cupyflash import modifiers as M

        if variant.softcap:
            cap = variant.softcap
            kwargs["score_mod"] = cupyflash.ScoreMod(lambda score, b, h, q_idx, kv_idx: cap * M.tanh(score / cap))
        elif variant.alibi:
            kwargs["score_mod"] = cupyflash.ScoreMod(
                lambda score, b, h, q_idx, kv_idx, slopes: score - slopes[h] * abs(q_idx - kv_idx),
                slopes=cupy.asarray(alibi_slopes(sets[0][0].shape[2])))
        if variant.documents:
            seqlen = sets[0][0].shape[1]
            doc = cupy.asarray(document_ids(seqlen, variant.documents))
            mask = cupyflash.MaskMod(lambda b, h, q_idx, kv_idx, doc: doc[0, q_idx] == doc[0, kv_idx], doc=doc)
            kwargs["block_mask"] = cupyflash.create_block_mask(mask, None, None, seqlen, seqlen)
    elif variant.softcap or variant.alibi or variant.sink:
        if "softcap" not in inspect.signature(cupyflash.flash_attn_func).parameters:
            return None, None
        nheads = sets[0][0].shape[2]
        if variant.softcap:
            kwargs["softcap"] = variant.softcap
        if variant.alibi:
            kwargs["alibi_slopes"] = cupy.asarray(alibi_slopes(nheads))
        if variant.sink:
            kwargs["sink"] = cupy.random.default_rng(1).standard_normal(nheads, dtype=np.float32)
    saved = [cupyflash.flash_attn_func(q, k, v, return_lse=True, **kwargs) for q, k, v, _ in sets]

    def fwd(i):
        q, k, v, _ = sets[i]
        cupyflash.flash_attn_func(q, k, v, **kwargs)

    def bwd(i):
        q, k, v, do = sets[i]
        o, lse = saved[i]
        cupyflash.flash_attn_backward(do, q, k, v, o, lse, **kwargs)

    return fwd, bwd


def _flex_runs(torch, variant: Variant, sets, seqlen):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if variant.dropout:
        return None, None

    left, right = variant.bounds()

    doc = torch.from_numpy(document_ids(seqlen, variant.documents or seqlen)[0]).cuda()

    def mask_mod(b, h, q_idx, kv_idx):
        visible = q_idx >= 0  # all-true of the right type
        if left >= 0:
            visible = visible & (q_idx - kv_idx <= left)
        if right >= 0:
            visible = visible & (kv_idx - q_idx <= right)
        if variant.documents:
            visible = visible & (doc[q_idx] == doc[kv_idx])
        return visible

    if variant.sink:
        return None, None  # flex_attention has no sink term
    score_mod = None
    if variant.softcap:
        cap = variant.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
    elif variant.alibi:
        slopes = torch.from_numpy(alibi_slopes(sets[0][0].shape[2])).cuda()

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()

    block_mask = None
    if (left, right) != (-1, -1) or variant.documents:
        block_mask = create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    views = [[torch.from_dlpack(x).transpose(1, 2) for x in s] for s in sets]
    leaves = [[t.detach().requires_grad_(True) for t in v[:3]] + [v[3]] for v in views]

    def fwd(i):
        q, k, v, _ = views[i]
        compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

    outs = [compiled(q, k, v, score_mod=score_mod, block_mask=block_mask) for q, k, v, _ in leaves]

    def bwd(i):
        q, k, v, do = leaves[i]
        q.grad = k.grad = v.grad = None
        outs[i].backward(do, retain_graph=True)

    return fwd, bwd


def _cudnn_runs(torch, variant: Variant, sets):
    if variant.window != (-1, -1) or variant.softcap or variant.alibi or variant.sink or variant.documents or \
            variant.dropout:
        return None, None
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    views = [[torch.from_dlpack(x).transpose(1, 2) for x in s] for s in sets]
    leaves = [[t.detach().requires_grad_(True) for t in v[:3]] + [v[3]] for v in views]

    def attention(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=variant.causal)

    def fwd(i):
        q, k, v, _ = views[i]
        attention(q, k, v)

    outs = [attention(q, k, v) for q, k, v, _ in leaves]

    def bwd(i):
        q, k, v, do = leaves[i]
        q.grad = k.grad = v.grad = None
        outs[i].backward(do, retain_graph=True)

    return fwd, bwd


def run(batch: int, nheads: int, headdim: int, seqlens, variants, impls, seed: int = 0, paired: int = 0,
        paired_rows: list | None = None) -> list[Row]:
    """The rows of every (seqlen, variant, impl, mode). With ``paired`` > 0, each cupyflash
    variant that has a baseline (baseline_of) is timed ``paired`` times more, each after a timing
    of the baseline on the same inputs, and the times go to ``paired_rows`` (PairedRow)."""
    import cupy
    import torch

    # Every variant compiles flex_attention again (new score_mod, new block mask, inputs with and
    # without grad): past dynamo's default limit of 8 recompiles it would silently run the unfused
    # eager implementation (measured: 6 TFLOP/s for softcap and ALiBi).
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    stream = cupy.cuda.Stream(non_blocking=True)
    torch_stream = torch.cuda.ExternalStream(stream.ptr)
    rows = []
    for seqlen in seqlens:
        n_sets = 2
        with stream, torch.cuda.stream(torch_stream):
            inputs = {}  # by (headdim of q and k, of v)
            for variant in variants:
                dims = variant.headdims(headdim)
                if dims not in inputs:
                    inputs[dims] = _inputs(batch, seqlen, nheads, dims, n_sets, seed)
                sets = inputs[dims]
                pairs = pairs_of(variant, seqlen)
                # 2 pairs d_qk for S = Q K^T, 2 pairs d_v for O = P V (4 pairs headdim when equal)
                flops = {"fwd": 2.0 * batch * nheads * pairs * (dims[0] + dims[1])}
                flops["bwd"] = 2.5 * flops["fwd"]
                for impl in impls:
                    try:
                        if impl == "cupyflash":
                            fwd, bwd = _cupyflash_runs(variant, sets)
                        elif impl == "flex":
                            fwd, bwd = _flex_runs(torch, variant, sets, seqlen)
                        else:
                            fwd, bwd = _cudnn_runs(torch, variant, sets)
                    except Exception as exc:  # an anchor that cannot run this case is reported
                        fwd = bwd = None
                        note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    else:
                        note = "" if fwd is not None else "not supported"
                    main_ms = {}
                    for mode, fn in (("fwd", fwd), ("bwd", bwd)):
                        if fn is None:
                            rows.append(Row(variant.name, seqlen, impl, mode, None, None, note))
                            continue
                        ms = main_ms[mode] = _time(fn, n_sets, stream)
                        rows.append(Row(variant.name, seqlen, impl, mode, ms,
                                        flops[mode] / (ms * 1e-3) / 1e12))
                        print(f"  {variant.name:<22} {seqlen:>6} {impl:<10} {mode} {ms:9.3f} ms "
                              f"{rows[-1].tflops:7.1f} TFLOP/s", file=sys.stderr, flush=True)
                    base = baseline_of(variant)
                    if impl == "cupyflash" and paired > 0 and base is not None and fwd is not None:
                        base_runs = dict(zip(("fwd", "bwd"), _cupyflash_runs(base, sets)))
                        base_pairs = pairs_of(base, seqlen)
                        for mode, fn in (("fwd", fwd), ("bwd", bwd)):
                            if fn is None or base_runs[mode] is None:
                                continue
                            times = {"variant": [main_ms[mode]], "baseline": []}
                            for _ in range(paired):
                                times["baseline"].append(_time(base_runs[mode], n_sets, stream))
                                times["variant"].append(_time(fn, n_sets, stream))
                            base_flops = flops[mode] * base_pairs / pairs
                            row = PairedRow(variant.name, seqlen, base.name, mode, times["variant"],
                                            times["baseline"], flops[mode], base_flops)
                            if paired_rows is not None:
                                paired_rows.append(row)
                            print(f"  {variant.name:<22} {seqlen:>6} paired {mode} "
                                  f"{paired_ratio(row)[0]:.3f} of {base.name}", file=sys.stderr, flush=True)
            del sets, inputs
    return rows


def table(rows: list[Row]) -> str:
    """Markdown: one line per (variant, seqlen, mode), one column per implementation, then the
    ratio of cupyflash to each anchor."""
    impls = list(dict.fromkeys(r.impl for r in rows))
    keyed = {(r.variant, r.seqlen, r.mode, r.impl): r for r in rows}
    anchors = [i for i in impls if i != "cupyflash"]
    head = ["variant", "seqlen", "mode"] + [f"{i} TFLOP/s" for i in impls]
    head += [f"cupyflash / {a}" for a in anchors]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, seqlen, mode in dict.fromkeys((r.variant, r.seqlen, r.mode) for r in rows):
        cells = [variant, str(seqlen), mode]
        values = {i: keyed.get((variant, seqlen, mode, i)) for i in impls}
        cells += ["—" if v is None or v.tflops is None else f"{v.tflops:.1f}" for v in values.values()]
        ours = values.get("cupyflash")
        for a in anchors:
            theirs = values.get(a)
            ok = ours is not None and ours.tflops and theirs is not None and theirs.tflops
            cells.append(f"{ours.tflops / theirs.tflops:.2f}" if ok else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speedups(rows: list[Row], impl: str = "cupyflash") -> str:
    """Time of the unwindowed attention (causal; full for a non-causal document mask) over the time
    of each windowed or document-masked variant, same seqlen."""
    ms = {(r.variant, r.seqlen, r.mode): r.ms for r in rows if r.impl == impl and r.ms}
    lines = ["| variant | seqlen | baseline | fwd speed-up | bwd speed-up |",
             "|---|---|---|---|---|"]
    for (variant, seqlen) in dict.fromkeys((r.variant, r.seqlen) for r in rows):
        if "window" not in variant and "documents" not in variant:
            continue
        baseline = "causal" if "window" in variant or variant.startswith("causal") else "full"
        cells = [variant, str(seqlen), baseline]
        for mode in ("fwd", "bwd"):
            base, here = ms.get((baseline, seqlen, mode)), ms.get((variant, seqlen, mode))
            cells.append(f"{base / here:.1f}x" if base and here else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median(xs) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def paired_ratio(row: PairedRow) -> tuple[float, float, float]:
    """(ratio of the medians' TFLOP/s, lowest and highest ratio of a round's adjacent pair): the
    variant's TFLOP/s over its baseline's. Round r pairs variant_ms[r + 1] with baseline_ms[r],
    timed one after the other (variant_ms[0] is the main table's row, timed before the rounds)."""
    flops_ratio = row.variant_flops / row.baseline_flops  # TFLOP/s ratio = flops ratio x time ratio
    ratio = flops_ratio * _median(row.baseline_ms) / _median(row.variant_ms)
    rounds = [flops_ratio * b / v for v, b in zip(row.variant_ms[1:], row.baseline_ms)]
    return ratio, min(rounds), max(rounds)


def paired_table(paired_rows: list) -> str:
    """Markdown: each variant against its own baseline timed beside it (``--paired``): TFLOP/s
    ratio of the medians (and the rounds' spread), and time speed-up (the baseline's median time
    over the variant's: windows' and document masks' bars)."""
    lines = ["| variant | seqlen | baseline | mode | rounds | of baseline (TFLOP/s) | rounds' range | time speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for row in paired_rows:
        ratio, lo, hi = paired_ratio(row)
        speedup = _median(row.baseline_ms) / _median(row.variant_ms)
        lines.append(f"| {row.variant} | {row.seqlen} | {row.baseline} | {row.mode} | {len(row.baseline_ms)} | "
                     f"{ratio:.3f} | {lo:.3f}-{hi:.3f} | {speedup:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyflash.bench.variants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, nargs="+", default=[8192])
    p.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS],
                   help=f"any of: {', '.join(repr(v.name) for v in VARIANTS)}")
    p.add_argument("--impls", nargs="+", default=["cupyflash", "flex", "cudnn"])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="time cupyflash's baseline beside each variant, alternated N times (default 0: not)")
    args = p.parse_args(argv)
    if args.paired < 0:
        p.error("--paired must be 0 or more")
    by_name = {v.name: v for v in VARIANTS}
    unknown = [n for n in args.variants if n not in by_name]
    if unknown:
        p.error(f"unknown variants {unknown}")
    paired_rows: list[PairedRow] = []
    rows = run(args.batch, args.nheads, args.headdim, args.seqlen,
               [by_name[n] for n in args.variants], args.impls, paired=args.paired, paired_rows=paired_rows)
    print(table(rows))
    print()
    print(speedups(rows))
    if paired_rows:
        print()
        print(paired_table(paired_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "nheads": args.nheads, "headdim": args.headdim,
                       "rows": [asdict(r) for r in rows], "paired": [asdict(r) for r in paired_rows]}, f, indent=1)
    measured = [r for r in rows if r.impl == "cupyflash" and r.ms]
    print(f"variants bench: {len(rows)} timings, {len(measured)} of cupyflash")
    return 0


if __name__ == "__main__":
    sys.exit(main())
