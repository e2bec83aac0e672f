"""``python -m cupyflash sanitize``: every kernel family under NVIDIA compute-sanitizer.

Runs a small workload (forward and backward of each family at odd shapes: sequence lengths that
are not tile multiples, head dimensions 1, 40, 72 and 200, full, causal and a sliding window,
GQA; the variants: softcap, ALiBi, a sink, dropout, a user score_mod and mask_mod, and with the
mma family v's own head dim and a packed batch; and with the mma family the KV-cache kernels: a
decode step over a left-padded contiguous cache and over a paged one with split keys, rotary
embeddings, the append kernel of the unread path) once under each of
memcheck, racecheck, initcheck and synccheck, and reports each tool's verdict. Needs a GPU and
compute-sanitizer on the PATH (or in $CUDA_HOME/bin).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
HEADDIMS = (1, 40, 72, 200)
# (causal, window_size): with 77 queries and 130 keys the window (19, 70) skips key blocks before
# it, and its blocks are partial on either bound
MASKS = ((False, (-1, -1)), (True, (-1, -1)), (False, (19, 70)))


def workload(families=("simt", "mma"), quick=False) -> int:
    """Forward + backward of each family over odd shapes; returns the number of shapes run.
    ``quick``: one dtype per family, causal and the window only (racecheck is slow); the mma
    family's float32 forward (the tf32 kernel) in both precisions and, up to d128, float32's default
    backward (tf32x3 on the DMMA backward's kernels, both statistics), its float64 forward (the DMMA
    kernel, forward and backward) and the SIMT float32 backward with recomputed statistics either way."""
    import cupy
    import numpy as np

    from . import api
    from ._dtypes import SUPPORTED

    rng = np.random.default_rng(0)
    calls = 0
    for backend in families:
        dtypes = ("float32", "float64", "bfloat16") if backend == "simt" else ("float16", "bfloat16")
        quick_dtypes = ("float32", "bfloat16") if backend == "simt" else dtypes[-1:]
        for dtype_name in quick_dtypes if quick else dtypes:
            dtype = SUPPORTED[dtype_name]
            for headdim in HEADDIMS:
                for causal, window in MASKS[1:] if quick else MASKS:
                    q, do = (cupy.asarray(rng.standard_normal((1, 77, 4, headdim)).astype(dtype)) for _ in range(2))
                    k, v = (cupy.asarray(rng.standard_normal((1, 130, 2, headdim)).astype(dtype)) for _ in range(2))
                    o, lse = api.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True,
                                                 backend=backend)
                    api.flash_attn_backward(do, q, k, v, o, lse, causal=causal, window_size=window, backend=backend)
                    if backend == "simt" and dtype_name != "bfloat16":  # flash_bwd_stats_simt
                        api.flash_attn_backward(do, q, k, v, o, lse, causal=causal, window_size=window,
                                                backend=backend, statistics="recomputed")
                    if backend == "mma":
                        api.flash_attn_backward(do, q, k, v, o, lse, causal=causal, window_size=window,
                                                backend=backend, deterministic=False)
                    calls += 1
        if backend == "mma":  # float32 on tensor cores: the tf32 forward in both precisions, and up to
            # d128 its default backward, tf32x3 on the DMMA backward's kernels (both statistics)
            for headdim in HEADDIMS:
                for causal, window in MASKS[1:] if quick else MASKS:
                    q = cupy.asarray(rng.standard_normal((1, 77, 4, headdim)).astype(np.float32))
                    k, v = (cupy.asarray(rng.standard_normal((1, 130, 2, headdim)).astype(np.float32)) for _ in range(2))
                    for precision in ("ieee", "tf32"):
                        o, lse = api.flash_attn_func(q, k, v, causal=causal, window_size=window, backend=backend,
                                                     precision=precision, return_lse=True)
                    if headdim <= 128:
                        do = cupy.asarray(rng.standard_normal((1, 77, 4, headdim)).astype(np.float32))
                        for statistics in ("saved", "recomputed"):
                            api.flash_attn_backward(do, q, k, v, o, lse, causal=causal, window_size=window,
                                                    backend=backend, statistics=statistics)
                    calls += 1
            # float64 on tensor cores (DMMA) up to d128, forward and backward (both statistics)
            for headdim in (h for h in HEADDIMS if h <= 128):
                for causal, window in MASKS[1:] if quick else MASKS:
                    q, do = (cupy.asarray(rng.standard_normal((1, 77, 4, headdim))) for _ in range(2))
                    k, v = (cupy.asarray(rng.standard_normal((1, 130, 2, headdim))) for _ in range(2))
                    o, lse = api.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True,
                                                 backend=backend)
                    for statistics in ("saved", "recomputed"):
                        api.flash_attn_backward(do, q, k, v, o, lse, causal=causal, window_size=window,
                                                backend=backend, statistics=statistics)
                    calls += 1
        if backend == "mma":
            calls += _kvcache_workload(rng, ("bfloat16",) if quick else ("float16", "bfloat16"))
        calls += _variants_workload(rng, backend, quick)
    cupy.cuda.runtime.deviceSynchronize()
    return calls


def _capped_score(score, b, h, q_idx, kv_idx, bias):
    """A user score_mod: a tanh cap plus a bias per (head, query) read from a table."""
    from .modifiers import tanh

    return 20.0 * tanh(score / 20.0) + bias[h, q_idx % 8]


def _same_document(b, h, q_idx, kv_idx, doc):
    """A user mask_mod: the pairs of one document (ids per batch entry and position)."""
    return doc[b, q_idx] == doc[b, kv_idx]


# The variants' calls (issue 16's kernels and code paths): each a forward and its backward at one
# odd shape (77 queries, 130 keys, GQA 4 / 2), with the window where the variant composes with it.
VARIANT_CALLS = (
    ("softcap", dict(causal=True, softcap=30.0)),
    ("alibi + window", dict(window_size=(19, 70), alibi="slopes")),
    ("sink", dict(causal=True, sink="logits")),
    ("softcap + alibi + sink", dict(softcap=5.0, alibi="slopes", sink="logits")),
    ("dropout", dict(causal=True, dropout_p=0.2, seed=7)),
    ("score_mod + mask_mod", dict(score_mod="capped", mask_mod="documents")),
)


def _variants_workload(rng, family: str, quick: bool, backend: str | None = None, to_device=None) -> int:
    """Issue 16's variants on ``family``'s kernels: VARIANT_CALLS at head dims 40 and 72 (one
    dtype per family; quick: d72 only), then on the mma family v's own head dim (192 / 128, MLA's
    pair) causal with softcap, and a packed batch (flash_attn_varlen_func) of three ragged
    sequences, causal, with ALiBi and dropout. ``backend`` (default: the family) and
    ``to_device`` (default: cupy.asarray) let the CPU tests run the same calls on the NumPy twin."""
    import numpy as np

    if to_device is None:
        import cupy

        to_device = cupy.asarray
    backend = backend or family

    from . import api
    from ._dtypes import SUPPORTED
    from .modifiers import MaskMod, ScoreMod
    from .varlen import flash_attn_varlen_backward, flash_attn_varlen_func

    dtype = SUPPORTED["float32" if family == "simt" else "bfloat16"]
    heads, heads_kv, seqlen_q, seqlen_k = 4, 2, 77, 130

    def arguments(spec: dict) -> dict:
        kwargs = dict(spec)
        if kwargs.get("alibi") == "slopes":
            del kwargs["alibi"]
            kwargs["alibi_slopes"] = to_device(rng.uniform(0.01, 0.5, heads).astype(np.float32))
        if kwargs.get("sink") == "logits":
            kwargs["sink"] = to_device(rng.standard_normal(heads).astype(np.float32))
        if kwargs.get("score_mod") == "capped":
            kwargs["score_mod"] = ScoreMod(_capped_score, bias=to_device(
                rng.standard_normal((heads, 8)).astype(np.float32)))
        if kwargs.get("mask_mod") == "documents":
            doc = np.sort(rng.integers(0, 3, (1, max(seqlen_q, seqlen_k))), axis=1).astype(np.int32)
            kwargs["mask_mod"] = MaskMod(_same_document, doc=to_device(doc))
        return kwargs

    def tensor(*shape):
        return to_device(rng.standard_normal(shape).astype(dtype))

    calls = 0
    for headdim in (72,) if quick else (40, 72):
        for _, spec in VARIANT_CALLS:
            kwargs = arguments(spec)
            q, do = tensor(1, seqlen_q, heads, headdim), tensor(1, seqlen_q, heads, headdim)
            k, v = tensor(1, seqlen_k, heads_kv, headdim), tensor(1, seqlen_k, heads_kv, headdim)
            o, lse = api.flash_attn_func(q, k, v, return_lse=True, backend=backend, **kwargs)
            api.flash_attn_backward(do, q, k, v, o, lse, backend=backend, **kwargs)
            calls += 1
    if family != "mma":
        return calls
    # v's own head dim: q, k 192 and v 128, causal with softcap
    q, k = tensor(1, seqlen_q, heads, 192), tensor(1, seqlen_k, heads_kv, 192)
    v, do = tensor(1, seqlen_k, heads_kv, 128), tensor(1, seqlen_q, heads, 128)
    o, lse = api.flash_attn_func(q, k, v, causal=True, softcap=30.0, return_lse=True, backend=backend)
    api.flash_attn_backward(do, q, k, v, o, lse, causal=True, softcap=30.0, backend=backend)
    # a packed batch: sequences of 33, 0 and 130 queries over 50, 9 and 130 keys
    lengths_q, lengths_k = np.array([33, 0, 130]), np.array([50, 9, 130])
    cu_q, cu_k = (to_device(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lengths_q, lengths_k))
    q, do = tensor(int(lengths_q.sum()), heads, 72), tensor(int(lengths_q.sum()), heads, 72)
    k, v = tensor(int(lengths_k.sum()), heads_kv, 72), tensor(int(lengths_k.sum()), heads_kv, 72)
    kwargs = arguments(dict(causal=True, alibi="slopes", dropout_p=0.1, seed=3))
    packed = (cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()))
    o, lse = flash_attn_varlen_func(q, k, v, *packed, return_lse=True, backend=backend, **kwargs)
    flash_attn_varlen_backward(do, q, k, v, o, lse, *packed, backend=backend, **kwargs)
    return calls + 2


def _kvcache_workload(rng, dtype_names) -> int:
    """flash_attn_with_kvcache's kernels: the KV-cache kernel with split keys and the combine, the
    rotary kernel, the append kernel (the unread path, device lengths), over a left-padded
    contiguous cache and a paged one of 16-key pages; head dim 72 (a tile with a partial chunk)."""
    import cupy
    import numpy as np

    from ._dtypes import SUPPORTED
    from .capture import no_host_sync
    from .kvcache import flash_attn_with_kvcache

    batch, capacity, heads_kv, group, headdim, new = 3, 96, 2, 4, 72, 2
    ends = np.array([5, 40, 70], np.int32)
    calls = 0
    for dtype_name in dtype_names:
        dtype = SUPPORTED[dtype_name]
        theta = rng.uniform(0, 2 * np.pi, (capacity, headdim // 4))
        cos, sin = (cupy.asarray(f(theta).astype(dtype)) for f in (np.cos, np.sin))
        q = cupy.asarray(rng.standard_normal((batch, new, heads_kv * group, headdim)).astype(dtype))
        k, v = (cupy.asarray(rng.standard_normal((batch, new, heads_kv, headdim)).astype(dtype)) for _ in range(2))
        for paged in (False, True):
            if paged:
                pages = batch * capacity // 16
                layout = dict(block_table=rng.permutation(pages).reshape(batch, capacity // 16).astype(np.int32))
                shape = (pages, 16, heads_kv, headdim)
            else:
                layout = dict(cache_leftpad=np.array([0, 3, 60], np.int32))
                shape = (batch, capacity, heads_kv, headdim)
            caches = [cupy.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(2)]
            options = dict(rotary_cos=cos, rotary_sin=sin, causal=True, num_splits=3)
            flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=ends, **layout, **options)
            with no_host_sync():  # device index arrays: the append kernel, lengths unread
                flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=cupy.asarray(ends),
                                        **{name: cupy.asarray(x) for name, x in layout.items()}, **options)
            calls += 2
    return calls


def _sanitizer() -> str | None:
    exe = shutil.which("compute-sanitizer")
    if exe:
        return exe
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "compute-sanitizer"), os.X_OK):
            return os.path.join(root, "bin", "compute-sanitizer")
    return None


DESCRIPTION = __doc__.split("\n", 2)[2].strip() + """

Exit status: 0 every tool clean, 1 a tool reported errors, 2 bad arguments, 3 no GPU or no
compute-sanitizer."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tool", action="append", choices=TOOLS, help="repeatable (default: all four)")
    parser.add_argument("--family", action="append", choices=("simt", "mma"), help="default: both")
    parser.add_argument("--quick", action="store_true",
                        help="one dtype per family (bfloat16), causal and the window only: the slow tools finish sooner")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def run(args) -> int:
    from . import cli, dispatch

    families = tuple(dict.fromkeys(args.family or ("simt", "mma")))
    if args.worker:
        print(f"workload: {workload(families, args.quick)} shapes")
        return cli.EXIT_OK
    exe = _sanitizer()
    if exe is None or not dispatch.gpu_available():
        missing = "compute-sanitizer (PATH or $CUDA_HOME/bin)" if exe is None else "usable CUDA device"
        cli.summary("sanitize", f"cannot run: no {missing}; nothing checked", file=sys.stderr)
        return cli.EXIT_UNAVAILABLE
    # Warm CuPy's kernel cache outside the sanitizer so that the tools see launches, not NVRTC.
    worker = ["--worker", *sum((["--family", f] for f in families), []), *(["--quick"] if args.quick else [])]
    warm = subprocess.run([sys.executable, "-m", "cupyflash.sanitize", *worker])
    if warm.returncode != 0:
        cli.summary("sanitize", f"FAIL: the workload itself failed (exit {warm.returncode}); "
                                "no tool run")
        return cli.EXIT_FAILED
    tools = list(dict.fromkeys(args.tool or TOOLS))
    failed = []
    for tool in tools:
        extra = ["--racecheck-report", "all"] if tool == "racecheck" else []
        command = [exe, "--tool", tool, "--error-exitcode", "99", *extra, sys.executable, "-m",
                   "cupyflash.sanitize", *worker]
        result = subprocess.run(command, capture_output=True, text=True)
        summary = [line for line in result.stdout.splitlines() if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line]
        verdict = "clean" if result.returncode == 0 else f"FAILED (exit {result.returncode})"
        print(f"{tool:10} {verdict:20} {' | '.join(summary)}", flush=True)
        if result.returncode != 0:
            failed.append(tool)
            sys.stdout.write(result.stdout[-4000:] + result.stderr[-2000:])
    what = f"{', '.join(families)} kernels{' (--quick)' if args.quick else ''}"
    if failed:
        cli.summary("sanitize", f"FAIL: {', '.join(failed)} reported errors on the {what}; "
                                f"{len(tools) - len(failed)} of {len(tools)} tools clean")
        return cli.EXIT_FAILED
    cli.summary("sanitize", f"{len(tools)} of {len(tools)} tools clean on the {what}")
    return cli.EXIT_OK


def main(argv=None) -> int:
    from . import cli

    return cli.alias("sanitize", argv)


if __name__ == "__main__":
    sys.exit(main())
