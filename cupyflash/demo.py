"""``python -m cupyflash demo``: forward and backward on random data, checked against the float64
reference, with errors and times. Runs on the GPU when one is usable, else on the NumPy backend."""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from . import api, cli, dispatch, reference
from ._arrays import BACKENDS, MAX_HEADDIM
from ._dtypes import SUPPORTED, dtype_argument, is_16bit

DESCRIPTION = """\
Forward and backward of cupyflash on random data, each output checked against the float64
reference. Runs on the GPU when one is usable, else on the NumPy backend (the kernels' twin).

The verdict follows the library's tolerance rule: in float16/bfloat16 each output may be off the
float64 reference by at most 2x (gradients: 3x) the error of standard attention computed in the
same dtype, plus the float32 rounding floor; in float32/float64 by the dtype's relative bound.
Exit status: 0 PASS, 1 FAIL, 2 bad arguments, 3 the requested backend cannot run here."""

EPILOG = """\
examples:
  python -m cupyflash demo
  python -m cupyflash demo --dtype fp16 --seqlen 4096 --headdim 128 --causal
  python -m cupyflash demo --nheads 8 --nheads-kv 2 --backend simt --dtype fp32"""

# Relative rounding floor (times 1 + max|reference|): float32 results of scores of standard
# deviation ~1 at head dims <= 256, measured in tests/tolerance.py with a 5x margin; 16-bit
# dtypes compute in float32 and get its floor under the baseline rule.
RTOL = {"float32": 1e-4, "float64": 1e-12}
OUTPUT_FACTOR = 2.0
GRADIENT_FACTOR = 3.0  # flash-attn's rule for gradients


def _int_in(low: int, high: int | None = None):
    """An argparse ``type=``: an integer in [low, high]; argparse names the flag on error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", type=dtype_argument(), default="bfloat16",
                        help="bf16, fp16, fp32 or fp64 (default bf16)")
    parser.add_argument("--batch", type=_int_in(1), default=2, help="at least 1 (default 2)")
    parser.add_argument("--seqlen", type=_int_in(1), default=None,
                        help="default 1024 on a GPU, 256 on the NumPy backend")
    parser.add_argument("--nheads", type=_int_in(1), default=8, help="query heads (default 8)")
    parser.add_argument("--nheads-kv", type=_int_in(1), default=None,
                        help="kv heads (GQA/MQA), a divisor of --nheads (default: --nheads)")
    parser.add_argument("--headdim", type=_int_in(1, MAX_HEADDIM), default=64,
                        help=f"1 to {MAX_HEADDIM} (default 64)")
    parser.add_argument("--causal", action="store_true", help="mask keys after each query")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto: tensor cores for 16-bit, SIMT otherwise, NumPy without a GPU")
    parser.add_argument("--seed", type=int, default=0, help="of the random inputs (default 0)")


@dataclass
class Check:
    """One output against the float64 reference: max abs error and the error allowed."""
    name: str
    error: float
    allowed: float
    rule: str

    @property
    def ok(self) -> bool:
        return self.error <= self.allowed  # False for a NaN error

    @property
    def ratio(self) -> float:
        return self.error / self.allowed if self.allowed > 0 else math.inf


def _max_abs_error(actual, ref) -> float:
    """max|actual - ref| where ref is finite; inf when actual is not finite there, or differs
    from ref where ref is +-inf (the lse of a query that sees no key)."""
    actual, ref = np.asarray(actual, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    finite = np.isfinite(ref)
    if np.any(actual[~finite] != ref[~finite]) or not np.all(np.isfinite(actual[finite])):
        return math.inf
    diff = np.abs(actual[finite] - ref[finite])
    return float(diff.max()) if diff.size else 0.0


def _max_abs(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(np.abs(x).max()) if x.size else 0.0


def check(name, actual, ref, baseline, *, dtype_name: str, factor: float, scale: float) -> Check:
    """``actual`` against the float64 ``ref``: in 16-bit dtypes within ``factor`` times the error
    of ``baseline`` (standard attention in that dtype) plus the float32 floor RTOL * (1 + scale),
    in float32/float64 within the floor alone."""
    floor = RTOL["float64" if dtype_name == "float64" else "float32"] * (1.0 + scale)
    if is_16bit(SUPPORTED[dtype_name]):
        base = _max_abs_error(baseline, ref)
        allowed, rule = factor * base + floor, f"{factor:g} x standard {base:.2e} + {floor:.1e}"
    else:
        allowed, rule = floor, f"{RTOL[dtype_name]:g} x (1 + {scale:.3g})"
    return Check(name, _max_abs_error(actual, ref), allowed, rule)


def verdict(q, k, v, do, o, lse, grads, *, dtype_name: str, causal: bool) -> list[Check]:
    """The checks of o, lse, dq, dk, dv (NumPy arrays) against the float64 reference."""
    dtype = SUPPORTED[dtype_name]
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal)
    grads_ref = reference.attention_backward(do, q, k, v, causal=causal)
    o_std, lse_std = reference.standard_attention(q, k, v, causal=causal, dtype=dtype)
    grads_std = reference.standard_attention_backward(do, q, k, v, causal=causal, dtype=dtype)
    checks = [check("o", o, o_ref, o_std, dtype_name=dtype_name, factor=OUTPUT_FACTOR,
                    scale=_max_abs(o_ref)),
              check("lse", lse, lse_ref, lse_std, dtype_name=dtype_name, factor=OUTPUT_FACTOR,
                    scale=_max_abs(lse_ref))]
    grad_scale = max(_max_abs(g) for g in grads_ref)  # dq, dk may cancel to 0, their terms not
    for name, g, ref, std in zip(("dq", "dk", "dv"), grads, grads_ref, grads_std):
        checks.append(check(name, g, ref, std, dtype_name=dtype_name, factor=GRADIENT_FACTOR,
                            scale=grad_scale))
    return checks


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
    rng = np.random.default_rng(args.seed)
    q, do = (rng.standard_normal((args.batch, seqlen, args.nheads, args.headdim)).astype(dtype)
             for _ in range(2))
    k, v = (rng.standard_normal((args.batch, seqlen, nheads_kv, args.headdim)).astype(dtype)
            for _ in range(2))
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
    checks = verdict(q, k, v, do, o, lse, grads, dtype_name=args.dtype, causal=args.causal)
    print("max abs error against the float64 reference:")
    for c in checks:
        print(f"  {c.name:4} {c.error:9.2e}   allowed {c.allowed:9.2e} ({c.rule})   "
              f"{'ok' if c.ok else 'FAIL'}")
    failed = [c.name for c in checks if not c.ok]
    if failed:
        cli.summary("demo", f"FAIL: {', '.join(failed)} beyond the {args.dtype} tolerance")
        return cli.EXIT_FAILED
    worst = max(checks, key=lambda c: c.ratio)
    cli.summary("demo", f"PASS: o, lse, dq, dk, dv within the {args.dtype} tolerance (worst: "
                        f"{worst.name} at {worst.ratio:.2f} of its allowed error)")
    return cli.EXIT_OK


def main(argv=None) -> int:
    return cli.alias("demo", argv)
