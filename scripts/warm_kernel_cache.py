"""Compile every specialization this device can run into CuPy's disk cache, on every CPU core.

NVRTC compiles are CPU-bound and a test run or a bench otherwise meets them one at a time on
first use; warmed here in parallel, later processes (pytest groups, the bench) load cubins from
the cache. Run from the tree to warm (PYTHONPATH=<tree>):

    python scripts/warm_kernel_cache.py [--processes N] [--match REGEX]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _compile(names: list[str]) -> tuple[int, list[str]]:
    from cupyflash.kernels import _module, compile_check

    by_name = {s.name: s for s in compile_check.all_specializations()}
    errors = []
    for name in names:
        try:
            _module.get_function(by_name[name])
        except ValueError as exc:  # compiled (and cached), but needs more shared memory than this GPU has
            if "shared memory" not in str(exc):
                errors.append(f"{name}: {exc}")
        except Exception as exc:  # reported, not fatal: the tests will meet it again
            errors.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return len(names), errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--match", default="")
    args = parser.parse_args(argv)
    from cupyflash.kernels import _module, compile_check

    pattern = re.compile(args.match)
    specs = [s for s in compile_check.all_specializations() if pattern.search(s.name) and _module.runs_on_device(s)]
    names = sorted({s.name for s in specs})
    chunks = [names[i::args.processes * 4] for i in range(args.processes * 4)]
    t0 = time.time()
    compiled, errors = 0, []
    # spawn, not fork: the parent has initialised CUDA (runs_on_device), which a forked child cannot use
    with ProcessPoolExecutor(max_workers=args.processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for n, errs in pool.map(_compile, [c for c in chunks if c]):
            compiled += n
            errors += errs
    for line in errors:
        print(line)
    print(f"warm_kernel_cache: {compiled} specializations in {time.time() - t0:.0f} s, {len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
