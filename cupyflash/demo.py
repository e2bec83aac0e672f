"""``python -m cupyflash demo``: forward and backward on random data, checked against the float64
reference, with errors and times. Runs on the GPU when one is usable, else on the NumPy backend."""
from __future__ import annotations

import argparse
import sys
import time

from . import api, cli, dispatch, reference
from ._arrays import BACKENDS, MAX_HEADDIM
from ._dtypes import SUPPORTED, dtype_argument, is_16bit
from .testing import AttentionProblem, assert_attention_close
from .testing.tolerance import max_abs_error, rel_fro_error

DESCRIPTION = """\
Forward and backward of cupyflash on random data, each output checked against the float64
reference. Runs on the GPU when one is usable, else on the NumPy backend (the kernels' twin).

The verdict is the library's tolerance rule (cupyflash.testing.assert_attention_close): in
float16/bfloat16 each output may be off the float64 reference by at most 2x (gradients: 3x) the
error of standard attention computed in the same dtype, plus the float32 rounding floor; in
float32/float64 by the dtype's relative bound.
Exit status: 0 PASS, 1 FAIL, 2 bad arguments, 3 the requested backend cannot run here."""

EPILOG = """\
examples:
  python -m cupyflash demo
  python -m cupyflash demo --dtype fp16 --seqlen 4096 --headdim 128 --causal
  python -m cupyflash demo --nheads 8 --nheads-kv 2 --backend simt --dtype fp32"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", type=dtype_argument(), default="bfloat16",
                        help="bf16, fp16, fp32 or fp64 (default bf16)")
    parser.add_argument("--batch", type=cli.integer(1), default=2, help="at least 1 (default 2)")
    parser.add_argument("--seqlen", type=cli.integer(1), default=None,
                        help="default 1024 on a GPU, 256 on the NumPy backend")
    parser.add_argument("--nheads", type=cli.integer(1), default=8, help="query heads (default 8)")
    parser.add_argument("--nheads-kv", type=cli.integer(1), default=None,
                        help="kv heads (GQA/MQA), a divisor of --nheads (default: --nheads)")
    parser.add_argument("--headdim", type=cli.integer(1, MAX_HEADDIM), default=64,
                        help=f"1 to {MAX_HEADDIM} (default 64)")
    parser.add_argument("--causal", action="store_true", help="mask keys after each query")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto: the plan's family (tensor cores for 16-bit and float32, DMMA for "
                             "float64 up to head dim 128; SIMT otherwise), NumPy without a GPU")
    parser.add_argument("--seed", type=int, default=0, help="of the random inputs (default 0)")


def error_table(q, k, v, do, o, lse, grads, *, causal: bool) -> list[str]:
    """Max abs and relative Frobenius error of each output against the float64 reference."""
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal)
    refs = (o_ref, lse_ref, *reference.attention_backward(do, q, k, v, causal=causal))
    lines = []
    for name, x, ref in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), refs):
        lines.append(f"  {name:4} {max_abs_error(x, ref):9.2e}   {rel_fro_error(x, ref):9.2e}")
    return lines


def verdict(problem, o, lse, grads) -> list[str]:
    """The outputs that fail the library's tolerance rule, each with why (empty: PASS)."""
    try:
        assert_attention_close(problem, o, lse, grads)
    except AssertionError as failure:
        return str(failure).splitlines()[1:]
    return []


def _run_on_gpu(q, k, v, do, options):
    import cupy

    q_d, k_d, v_d, do_d = (cupy.asarray(x) for x in (q, k, v, do))
    o, vjp = api.flash_attn_vjp(q_d, k_d, v_d, **options)  # warm-up: compiles the kernels
    vjp(do_d)
    cupy.cuda.get_current_stream().synchronize()
    start, mid, end = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    o, lse = api.flash_attn_func(q_d, k_d, v_d, return_lse=True, **options)
    mid.record()
    grads = api.flash_attn_backward(do_d, q_d, k_d, v_d, o, lse, **options)
    end.record()
    end.synchronize()
    times = cupy.cuda.get_elapsed_time(start, mid), cupy.cuda.get_elapsed_time(mid, end)
    return o.get(), lse.get(), [g.get() for g in grads], times


def _run_on_host(q, k, v, do, options):
    t0 = time.perf_counter()
    o, lse = api.flash_attn_func(q, k, v, return_lse=True, **options)
    t1 = time.perf_counter()
    grads = api.flash_attn_backward(do, q, k, v, o, lse, **options)
    t2 = time.perf_counter()
    return o, lse, grads, ((t1 - t0) * 1e3, (t2 - t1) * 1e3)


def _device_name() -> str:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def run(args) -> int:
    nheads_kv = args.nheads_kv or args.nheads
    if args.nheads % nheads_kv:
        raise cli.UsageError(f"--nheads {args.nheads} is not a multiple of --nheads-kv {nheads_kv}")
    dtype = SUPPORTED[args.dtype]
    try:
        where = [dispatch.choose(args.backend, dtype, args.headdim, d) for d in ("fwd", "bwd")]
    except RuntimeError as exc:  # a GPU backend requested where there is none
        cli.summary("demo", f"cannot run: {exc}", file=sys.stderr)
        return cli.EXIT_UNAVAILABLE
    except ValueError as exc:  # a backend that does not support this dtype or head dimension
        raise cli.UsageError(str(exc)) from None
    on_gpu = where[0] != "numpy"
    seqlen = args.seqlen or (1024 if on_gpu else 256)
    problem = AttentionProblem(
        batch=args.batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads_kv=nheads_kv,
        group=args.nheads // nheads_kv, headdim=args.headdim, causal=args.causal,
        softmax_scale=None, magnitude=1.0, dtype=dtype, seed=args.seed)
    q, k, v, do = problem.arrays()
    device = f"GPU {_device_name()}" if on_gpu else "no GPU used"
    backends = where[0] if where[0] == where[1] else f"{where[0]} (forward), {where[1]} (backward)"
    print(f"cupyflash demo: {device}; backend {backends}")
    heads = f"{args.nheads}" if nheads_kv == args.nheads else f"{args.nheads}/{nheads_kv}"
    print(f"batch {args.batch}, seqlen {seqlen}, heads {heads}, headdim {args.headdim}, "
          f"{args.dtype}, causal {args.causal}, seed {args.seed}")

    options = dict(causal=args.causal, backend=args.backend)
    o, lse, grads, (fwd_ms, bwd_ms) = (_run_on_gpu if on_gpu else _run_on_host)(q, k, v, do,
                                                                                   options)
    print(f"forward {fwd_ms:9.3f} ms   backward {bwd_ms:9.3f} ms"
          + ("" if on_gpu else "   (NumPy backend)"))
    print(f"  {'':4} {'max abs':>9}   {'rel. Fro.':>9}   error against the float64 reference")
    print("\n".join(error_table(q, k, v, do, o, lse, grads, causal=args.causal)))
    failures = verdict(problem, o, lse, grads)
    rule = ("2x (gradients 3x) the error of standard attention in the same dtype"
            if is_16bit(dtype) else f"the {args.dtype} rounding bound")
    if failures:
        print("\n".join(failures))
        failed = [line.split()[0].rstrip(":") for line in failures]
        cli.summary("demo", f"FAIL: {', '.join(failed)} beyond the tolerance ({rule})")
        return cli.EXIT_FAILED
    cli.summary("demo", f"PASS: o, lse, dq, dk, dv within the tolerance ({rule})")
    return cli.EXIT_OK


def main(argv=None) -> int:
    return cli.alias("demo", argv)
