"""``python -m cupyflash demo``: forward and backward on random data, checked against the float64
reference, with errors and times. Runs on the GPU when one is usable, else on the NumPy backend."""
from __future__ import annotations

import argparse
import time

import numpy as np

from . import api, dispatch, reference
from ._dtypes import SUPPORTED


def _rel_error(x, ref) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash demo", description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=list(SUPPORTED))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=None, help="default 1024 on a GPU, 256 on the NumPy backend")
    parser.add_argument("--nheads", type=int, default=8)
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)

    on_gpu = dispatch.gpu_available()
    seqlen = args.seqlen or (1024 if on_gpu else 256)
    dtype = SUPPORTED[args.dtype]
    rng = np.random.default_rng()
    shape = (args.batch, seqlen, args.nheads, args.headdim)
    q, k, v, do = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    where = dispatch.choose("auto", dtype, args.headdim, "fwd")
    print(f"cupyflash demo: {'GPU' if on_gpu else 'no GPU found'}; running on the {where} backend")
    print(f"shape (batch, seqlen, heads, dim) = {shape}, dtype {args.dtype}, causal {args.causal}")

    if on_gpu:
        import cupy

        q_d, k_d, v_d, do_d = (cupy.asarray(x) for x in (q, k, v, do))
        o, vjp = api.flash_attn_vjp(q_d, k_d, v_d, causal=args.causal)  # warm-up: compiles the kernels
        vjp(do_d)
        cupy.cuda.Stream.null.synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        o, vjp = api.flash_attn_vjp(q_d, k_d, v_d, causal=args.causal)
        mid = cupy.cuda.Event()
        mid.record()
        dq, dk, dv = vjp(do_d)
        end.record()
        end.synchronize()
        fwd_ms = cupy.cuda.get_elapsed_time(start, mid)
        bwd_ms = cupy.cuda.get_elapsed_time(mid, end)
        o, dq, dk, dv = (x.get() for x in (o, dq, dk, dv))
    else:
        t0 = time.perf_counter()
        o, vjp = api.flash_attn_vjp(q, k, v, causal=args.causal)
        t1 = time.perf_counter()
        dq, dk, dv = vjp(do)
        t2 = time.perf_counter()
        fwd_ms, bwd_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3

    o_ref, _ = reference.attention(q, k, v, causal=args.causal)
    grads_ref = reference.attention_backward(do, q, k, v, causal=args.causal)
    print(f"forward  {fwd_ms:9.3f} ms   backward {bwd_ms:9.3f} ms")
    print("relative Frobenius error vs float64 reference:")
    for name, x, ref in (("o", o, o_ref), ("dq", dq, grads_ref[0]), ("dk", dk, grads_ref[1]),
                         ("dv", dv, grads_ref[2])):
        print(f"  {name:3} {_rel_error(x, ref):.3e}")
    return 0
