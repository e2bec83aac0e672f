"""One mma backward call between cudaProfilerStart and cudaProfilerStop, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python -m cupyflash.bench.profile_bwd --headdim 128 --seqlen 16384 --version v7

The shape is the bench's (batch * seqlen = 16k, nheads * headdim = 2048), bf16. The call is made
once before the profiled one, so compilation and first-touch costs stay out of the profile.
"""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash.bench.profile_bwd", description=__doc__)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--version", default=None, help="a version of dev/mma_bwd.py (default: the plan)")
    parser.add_argument("--nondeterministic", action="store_true", help="deterministic=False (atomic dQ)")
    args = parser.parse_args(argv)

    import cupy

    from ..kernels import mma_bwd
    from .tune import _bwd_inputs
    from .._dtypes import SUPPORTED

    batch, nheads = 16384 // args.seqlen, 2048 // args.headdim
    (do, q, k, v, o, lse, dq, dk, dv), = _bwd_inputs(batch, args.seqlen, nheads, args.headdim,
                                                     SUPPORTED["bfloat16"], args.causal, n_sets=1)
    kwargs = dict(softmax_scale=args.headdim ** -0.5, causal=args.causal, version=args.version,
                  deterministic=not args.nondeterministic)
    mma_bwd.backward(do, q, k, v, o, lse, dq, dk, dv, **kwargs)
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    mma_bwd.backward(do, q, k, v, o, lse, dq, dk, dv, **kwargs)
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
