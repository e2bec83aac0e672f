"""``python -m cupyflash.sanitize``: every kernel family under NVIDIA compute-sanitizer.

Runs a small workload (forward and backward of each family at odd shapes: sequence lengths that
are not tile multiples, head dimensions 1, 40, 72 and 200, causal and not, GQA) once under each of
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


def workload(families=("simt", "mma"), quick=False) -> int:
    """Forward + backward of each family over odd shapes; returns the number of shapes run.
    ``quick``: one dtype per family and causal only (racecheck is slow)."""
    import cupy
    import numpy as np

    from . import api
    from ._dtypes import SUPPORTED

    rng = np.random.default_rng(0)
    calls = 0
    for backend in families:
        dtypes = ("float32", "float64", "bfloat16") if backend == "simt" else ("float16", "bfloat16")
        for dtype_name in dtypes[-1:] if quick else dtypes:
            dtype = SUPPORTED[dtype_name]
            for headdim in HEADDIMS:
                for causal in (True,) if quick else (False, True):
                    q, do = (cupy.asarray(rng.standard_normal((1, 77, 4, headdim)).astype(dtype)) for _ in range(2))
                    k, v = (cupy.asarray(rng.standard_normal((1, 130, 2, headdim)).astype(dtype)) for _ in range(2))
                    o, lse = api.flash_attn_func(q, k, v, causal=causal, return_lse=True, backend=backend)
                    api.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend=backend)
                    if backend == "mma":
                        api.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend=backend,
                                                deterministic=False)
                    calls += 1
    cupy.cuda.runtime.deviceSynchronize()
    return calls


def _sanitizer() -> str | None:
    exe = shutil.which("compute-sanitizer")
    if exe:
        return exe
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "compute-sanitizer"), os.X_OK):
            return os.path.join(root, "bin", "compute-sanitizer")
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash.sanitize", description=__doc__)
    parser.add_argument("--tool", action="append", choices=TOOLS, help="default: all four")
    parser.add_argument("--family", action="append", choices=("simt", "mma"), help="default: both")
    parser.add_argument("--quick", action="store_true",
                        help="one dtype per family (bfloat16), causal only: the slow tools finish sooner")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    families = tuple(args.family or ("simt", "mma"))
    if args.worker:
        print(f"workload: {workload(families, args.quick)} shapes")
        return 0
    exe = _sanitizer()
    if exe is None:
        print("compute-sanitizer not found (PATH or $CUDA_HOME/bin)", file=sys.stderr)
        return 2
    # Warm CuPy's kernel cache outside the sanitizer so that the tools see launches, not NVRTC.
    worker = ["--worker", *sum((["--family", f] for f in families), []), *(["--quick"] if args.quick else [])]
    subprocess.run([sys.executable, "-m", "cupyflash.sanitize", *worker], check=True)
    failed = []
    for tool in args.tool or TOOLS:
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
