"""``python -m cupyflash tune``: time every candidate tile configuration of the tensor-core
forward kernel (the plan the current device launches, and from a source checkout every version
and candidate of the repository's ``dev/mma_fwd.py``) on the papers' shapes, after checking each
against the float64 reference on a small odd shape. A winner becomes a row of
``cupyflash.plans.FORWARD_TILES`` by hand, and a new numbered version in dev/, with the numbers in
docs/perf-log.md.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np


def _time_ms(fn, input_sets, repeats: int) -> float:
    import cupy

    for inputs in input_sets:
        fn(*inputs)  # compile and warm up
    times = []
    for i in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        inputs = input_sets[i % len(input_sets)]
        start.record()
        fn(*inputs)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def _inputs(batch, seqlen, nheads, headdim, dtype, n_sets=3, seed=0):
    import cupy

    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(n_sets):
        q, k, v = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim)).astype(dtype))
                   for _ in range(3))
        o = cupy.empty_like(q)
        lse = cupy.empty((batch, nheads, seqlen), dtype=np.float32)
        sets.append((q, k, v, o, lse))
    return sets


def _check(config, headdim, dtype, causal, window=(-1, -1)) -> float:
    """Max error of the configuration on an odd shape, relative to 2x the error of standard
    attention in the same dtype (<= 1 passes)."""
    import cupy

    from .. import reference
    from ..kernels import mma_fwd

    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 333, 4, headdim)).astype(dtype)
    k, v = (rng.standard_normal((2, 301, 2, headdim)).astype(dtype) for _ in range(2))
    o = cupy.full(q.shape, np.nan, dtype=dtype)
    lse = cupy.full((2, 4, 333), np.nan, dtype=np.float32)
    mma_fwd.forward(*(cupy.asarray(x) for x in (q, k, v)), o, lse, softmax_scale=headdim ** -0.5,
                    causal=causal, config=config, window_size=window)
    ref, _ = reference.attention(q, k, v, causal=causal, window_size=window)
    std, _ = reference.standard_attention(q, k, v, causal=causal, window_size=window, dtype=dtype)
    err = np.abs(o.get().astype(np.float64) - ref).max()
    allowed = 2 * np.abs(std.astype(np.float64) - ref).max() + 1e-4
    return float(err / allowed) if np.isfinite(err) else float("inf")


def _visible_pairs(seqlen: int, causal: bool, window) -> float:
    """(query, key) pairs one head of a seqlen x seqlen problem computes: seqlen^2 / 2 causal (the
    papers' count), the band's own pairs with a window (query i sees keys i - left .. i + right)."""
    if tuple(window) == (-1, -1):
        return seqlen * seqlen * (0.5 if causal else 1.0)
    left, right = window
    right = 0 if causal else right
    i = np.arange(seqlen)
    first = np.zeros(seqlen, np.int64) if left < 0 else np.maximum(i - left, 0)
    last = np.full(seqlen, seqlen - 1, np.int64) if right < 0 else np.minimum(i + right, seqlen - 1)
    return float(np.maximum(last - first + 1, 0).sum())


def dev_dir() -> Path | None:
    """dev/ (the superseded versions) of the source checkout this module runs from, or None when it
    runs from an installation (a wheel has no dev/)."""
    from .. import _dev

    return _dev.dev_dir()


def load_dev_forward(folder: Path | None = None):
    """dev/mma_fwd.py of ``folder`` (default: this checkout's dev/) as a module, or None when it
    is not there."""
    from .. import _dev

    return _dev.load("mma_fwd", folder)


def _configs(dt: int, dtype, dev, window=(-1, -1)) -> list[tuple[str, object]]:
    """[(label, config)] to time for head-dim tile ``dt``, each configuration once: the current
    device's plan ("default"; with a ``window``, the plan of that window, which has its own row on
    some devices), then dev/'s versions (labelled by version) and candidates ("cand") where ``dev``
    (the loaded dev/mma_fwd.py, or None) has them."""
    from ..kernels import mma_fwd
    from ..masks import mask_for

    entries = [("default", mma_fwd.plan(dtype, dt, mask_for(False, window)).tiles)]
    entries += dev.entries(dt) if dev is not None else []
    labels: dict = {}
    for label, config in entries:
        labels.setdefault(config, []).append(label)
    return [("+".join(names), config) for config, names in labels.items()]


def _describe(config) -> str:
    """A configuration's fields, without the class name."""
    text = repr(config)
    return text[text.index("("):]


def _time_forward(config, headdim, seqlen, causal, dtype, repeats, inputs, window=(-1, -1)) -> float:
    from ..kernels import mma_fwd

    batch, nheads = 16384 // seqlen, 2048 // headdim
    key = (headdim, seqlen)
    if key not in inputs:  # the same inputs for every configuration and both masks
        inputs.clear()
        inputs[key] = _inputs(batch, seqlen, nheads, headdim, dtype)
    return _time_ms(lambda q, k, v, o, lse: mma_fwd.forward(
        q, k, v, o, lse, softmax_scale=headdim ** -0.5, causal=causal, config=config, window_size=window),
        inputs[key], repeats)


# ---------------------------------------------------------------------------------------------
# Backward (--direction bwd): the device's plan, deterministic and not, then every version and
# candidate of dev/mma_bwd.py, checked against float64 first.
# ---------------------------------------------------------------------------------------------

def load_dev_backward(folder: Path | None = None):
    """dev/mma_bwd.py of ``folder`` (default: this checkout's dev/) as a module, or None."""
    from .. import _dev

    return _dev.load("mma_bwd", folder)


def _bwd_candidates(headdim, dev=None):
    """(label, backward keyword arguments) of every backward variant worth timing: the plan of
    the current device, then ``dev``'s (the loaded dev/mma_bwd.py, or None) entries."""
    from ..kernels import mma_bwd
    from ..kernels.mma_fwd import current_arch

    dt = mma_bwd.d_tile(headdim)
    out = []
    for deterministic in (True, False):
        kernels = mma_bwd.plan("bfloat16", dt, False, deterministic).kernels
        out.append((f"default {kernels.dkdv}{kernels.dkdv_tiles} {kernels.dq_add} dq"
                    + (f" + {kernels.dq}{kernels.dq_tiles}" if kernels.dq else ""),
                    dict(deterministic=deterministic)))
    return out + (dev.entries(dt, current_arch()) if dev is not None else [])


def _bwd_inputs(batch, seqlen, nheads, headdim, dtype, causal, n_sets=2, seed=0, window=(-1, -1)):
    """(do, q, k, v, o, lse, dq, dk, dv) with o, lse from the forward kernel (with ``window``)."""
    import cupy

    from ..kernels import mma_fwd

    sets = []
    for q, k, v, o, lse in _inputs(batch, seqlen, nheads, headdim, dtype, n_sets, seed):
        mma_fwd.forward(q, k, v, o, lse, softmax_scale=headdim ** -0.5, causal=causal, window_size=window)
        do = cupy.asarray(np.random.default_rng(seed + 7).standard_normal(q.shape).astype(dtype))
        sets.append((do, q, k, v, o, lse, cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)))
    return sets


def _check_bwd(kwargs, headdim, dtype, causal, window=(-1, -1)) -> float:
    """Max over dq, dk, dv of the error on an odd GQA shape relative to 2x the error of standard
    attention's backward in the same dtype (<= 1 passes), with ``window`` (flash-attn's
    window_size); inf when a deterministic variant gives different bits on a second run."""
    import cupy

    from .. import reference
    from ..kernels import mma_bwd

    rng = np.random.default_rng(2)
    q, do = (rng.standard_normal((2, 333, 4, headdim)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((2, 301, 2, headdim)).astype(dtype) for _ in range(2))
    scale = headdim ** -0.5
    o_ref, lse_ref = reference.attention(q, k, v, softmax_scale=scale, causal=causal, window_size=window)
    grads = [cupy.full(x.shape, np.nan, dtype=dtype) for x in (q, k, v)]
    mma_bwd.backward(*(cupy.asarray(x) for x in (do, q, k, v)), cupy.asarray(o_ref.astype(dtype)),
                     cupy.asarray(lse_ref.astype(np.float32)), *grads, softmax_scale=scale, causal=causal,
                     window_size=window, **kwargs)
    if kwargs.get("deterministic", True):  # a second run must give the same bits
        again = [cupy.full(x.shape, np.nan, dtype=dtype) for x in (q, k, v)]
        mma_bwd.backward(*(cupy.asarray(x) for x in (do, q, k, v)), cupy.asarray(o_ref.astype(dtype)),
                         cupy.asarray(lse_ref.astype(np.float32)), *again, softmax_scale=scale, causal=causal,
                         window_size=window, **kwargs)
        if any(not bool(cupy.array_equal(a, b, equal_nan=True)) for a, b in zip(grads, again)):
            return float("inf")
    refs = reference.attention_backward(do, q, k, v, softmax_scale=scale, causal=causal, window_size=window)
    stds = reference.standard_attention_backward(do, q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                                 dtype=dtype)
    worst = 0.0
    for got, ref, std in zip(grads, refs, stds):
        err = np.abs(got.get().astype(np.float64) - ref).max()
        allowed = 2 * np.abs(np.asarray(std).astype(np.float64) - ref).max() + 1e-4
        worst = max(worst, float(err / allowed) if np.isfinite(err) else float("inf"))
    return worst


def _time_backward(kwargs, headdim, seqlen, causal, dtype, repeats, inputs, window=(-1, -1)) -> float:
    from ..kernels import mma_bwd

    batch, nheads = 16384 // seqlen, 2048 // headdim
    # o and lse depend on the mask
    sets = _bwd_inputs(batch, seqlen, nheads, headdim, dtype, causal, window=window)
    return _time_ms(lambda do, q, k, v, o, lse, dq, dk, dv: mma_bwd.backward(
        do, q, k, v, o, lse, dq, dk, dv, softmax_scale=headdim ** -0.5, causal=causal, window_size=window,
        **kwargs), sets, repeats)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

DESCRIPTION = """\
Time every candidate tile configuration of the tensor-core forward kernel (the current device's
plan, and every version and candidate of dev/mma_fwd.py, which only a source checkout has) on the
papers' shapes, after checking each against the float64 reference on a small odd shape (check: the
error relative to 2x that of standard attention in the same dtype; ok <= 1). A winner becomes a
row of cupyflash.plans.FORWARD_TILES by hand, and a new version in dev/, with the numbers in
docs/perf-log.md. Without dev/ (an installed wheel) only the plan is timed, and the tuner says so.

--direction bwd times the backward's plan (deterministic and not), then every version and
candidate of dev/mma_bwd.py, the same way. Needs a GPU. Exit status: 0 every variant timed passed
its check, 1 some variant failed it, 2 bad arguments, 3 no usable GPU."""


def configure(parser) -> None:
    from .. import cli
    from .._arrays import MAX_HEADDIM
    from .._dtypes import dtype_argument

    parser.add_argument("--headdim", type=cli.integer(1, MAX_HEADDIM), nargs="+",
                        default=[64, 128, 256])
    parser.add_argument("--seqlen", type=cli.integer(1), nargs="+", default=[4096, 16384])
    parser.add_argument("--dtype", default="bfloat16", type=dtype_argument(("bfloat16", "float16")),
                        help="bf16 or fp16 (default bf16)")
    parser.add_argument("--repeats", type=cli.integer(1), default=20)
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="time only the variants whose label contains one of these strings")
    parser.add_argument("--direction", default="fwd", choices=["fwd", "bwd"],
                        help="bwd: the backward's plan and every version and candidate of dev/mma_bwd.py")
    parser.add_argument("--dev", metavar="DIR", default=None,
                        help="the dev/ folder of the versions (default: this source checkout's)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                        help="every case with this window_size (TFLOP/s over the visible pairs; the ordered "
                             "dQ adds take no window: those backward entries are skipped)")


def _variants(direction: str, headdims, dtype=None, dev=None, window=(-1, -1)) -> list[tuple[int, str, str, object]]:
    """(headdim, label, description, variant) of every variant to check and time; ``dev``: the
    loaded dev/mma_fwd.py, or None; ``window``: --window, whose plan is the forward's "default" row."""
    if direction == "bwd":
        return [(d, label, "", kwargs) for d in headdims for label, kwargs in _bwd_candidates(d, dev)]
    from ..kernels import mma_fwd

    return [(d, label, _describe(config), config) for d in headdims
            for label, config in _configs(mma_fwd.d_tile(d), dtype, dev, window)]


def _dev_for(args):
    """dev/mma_fwd.py (or dev/mma_bwd.py with --direction bwd), or None after saying on stderr why
    it is not there."""
    backward = args.direction == "bwd"
    name = "mma_bwd.py" if backward else "mma_fwd.py"
    folder = Path(args.dev) if args.dev else dev_dir()
    dev = (load_dev_backward if backward else load_dev_forward)(folder) if folder is not None else None
    if dev is None:
        where = (f"{folder} has no {name}" if folder is not None else
                 "this installation has no dev/ folder (a wheel ships only the library)")
        print(f"cupyflash tune: note: {where}; timing the shipped plan only. The superseded "
              f"{'backward' if backward else 'forward'} versions and candidates are in a source checkout's "
              f"dev/{name} (or pass --dev DIR).", file=sys.stderr)
    return dev


def run(args) -> int:
    from .. import cli
    from .._dtypes import SUPPORTED
    from .harness import gpu_unavailable_reason
    from .progress import Progress

    reason = gpu_unavailable_reason()
    if reason is not None:
        cli.summary("tune", f"no usable CUDA device ({reason}); nothing timed", file=sys.stderr)
        return cli.EXIT_UNAVAILABLE
    dtype = SUPPORTED[args.dtype]
    backward = args.direction == "bwd"
    dev = _dev_for(args)
    variants = [v for v in _variants(args.direction, args.headdim, dtype, dev, tuple(args.window))
                if not args.only or any(text in v[1] for text in args.only)]
    if not variants:
        raise cli.UsageError(f"no {args.direction} variant matches --only {' '.join(args.only)}")
    window = tuple(args.window)
    check, time_one = (_check_bwd, _time_backward) if backward else (_check, _time_forward)
    extra = {} if window == (-1, -1) else {"window": window}
    width = 44 if backward else 8 + 1 + 100  # label, or label and configuration
    flop_factor = 2.5 if backward else 1.0  # backward = 2.5 x the forward's 4 B H S^2 D

    progress = Progress(len(variants), enabled=not args.quiet)
    progress.write(f"{'d':>4} {'seqlen':>6} {'causal':>6}  {'variant':{width}} {'check':>6} "
                   f"{'ms':>8} {'TFLOP/s':>8}")
    failed, skipped, best, inputs = [], [], {}, {}
    try:
        for headdim, label, detail, variant in variants:
            name = f"{label:8} {detail:100}" if not backward else f"{label:44}"
            try:
                ratio = max(check(variant, headdim, dtype, causal, **extra) for causal in (False, True))
            except Exception as e:  # a candidate that does not fit this GPU
                progress.write(f"{headdim:>4} {'':>6} {'':>6}  {name} skipped: {e}")
                skipped.append(label)
                progress.step(f"d{headdim} {label}: skipped")
                continue
            ok = "ok" if ratio <= 1 else f"x{ratio:.1f}"
            if ratio > 1:
                failed.append(f"d{headdim} {label}")
            fastest = 0.0
            for seqlen in args.seqlen:
                for causal in (False, True):
                    ms = time_one(variant, headdim, seqlen, causal, dtype, args.repeats, inputs, **extra)
                    batch, nheads = 16384 // seqlen, 2048 // headdim
                    flops = flop_factor * 4 * batch * nheads * headdim * _visible_pairs(seqlen, causal, window)
                    tflops = flops / ms / 1e9
                    fastest = max(fastest, tflops)
                    progress.write(f"{headdim:>4} {seqlen:>6} {str(causal):>6}  {name} {ok:>6} "
                                   f"{ms:8.3f} {tflops:8.1f}")
                    shape = (headdim, seqlen, causal)
                    if ratio <= 1 and tflops > best.get(shape, ("", 0.0))[1]:
                        best[shape] = (label, tflops)
            progress.step(f"d{headdim} {label}: check {ok}, up to {fastest:.1f} TFLOP/s")
    finally:
        progress.close()
        inputs.clear()
    if best:
        print("fastest variant that passed its check:")
        for (headdim, seqlen, causal), (label, tflops) in sorted(best.items()):
            print(f"  d{headdim} seqlen {seqlen} causal {str(causal):5}  {label}  {tflops:.1f} TFLOP/s")
    timed = len(variants) - len(skipped)
    text = (f"{timed} {args.direction} variants timed, {len(failed)} failed the float64 check, "
            f"{len(skipped)} skipped (do not fit this GPU)")
    if failed:
        cli.summary("tune", f"FAIL: {text}: {', '.join(failed)}")
        return cli.EXIT_FAILED
    cli.summary("tune", text)
    return cli.EXIT_OK


def main(argv=None) -> int:
    from .. import cli

    return cli.alias("tune", argv)


if __name__ == "__main__":
    sys.exit(main())
