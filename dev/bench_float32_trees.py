"""The float32 forward and backward through the API (precision "ieee", the default) in several source
trees on one machine, the trees taking turns: an A/B of a float32 kernel patch (perf log
tf32-desc-advance, tf32-staged-q-lo-trunc). Each tree is a copy of this checkout (an exported
tree with the patches under test applied) and runs in its own process with its own kernels_cu/
and cupyflash. Run from the checkout's root:

    python dev/bench_float32_trees.py TREE [TREE ...] [--headdims 64 128] [--seqlens 1024 8192]
        [--rounds 2] [--json OUT]

Shapes: the bench convention (batch x seqlen = 16k tokens, nheads x headdim = 2048), causal or not;
TFLOP/s = 4 B H S^2 D (x 0.5 causal) forward, 2.5x that backward, over the median of 10 calls
(CUDA events). First every tree compiles its kernels and checks one output against the float64
reference (an error at most twice standard float32 attention's, NaN-poisoned outputs), side by
side; then ROUNDS rounds in which every tree times every case once, so a drift of the card's clock
touches every tree alike. The table: each case's median over rounds per tree, and each tree's
ratio to the first tree's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TOKENS, WIDTH = 16384, 2048


def _shape(seqlen: int, headdim: int) -> tuple:
    return (TOKENS // seqlen, seqlen, WIDTH // headdim, headdim)


def _inputs(shape, seed: int):
    import cupy
    import numpy as np
    rng = cupy.random.default_rng(seed)
    return tuple(rng.standard_normal(shape, dtype=np.float32) for _ in range(4))  # q, k, v, do


def _forward(q, k, v, causal):
    import cupyflash
    return cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)


def worker(mode: str, cases: list) -> None:
    """One tree's process: 'check' (compile every case's kernels, one small problem checked) or
    'time'; one JSON line per result."""
    import cupy
    import numpy as np

    import cupyflash
    from cupyflash.kernels._module import kernels_dir
    here = Path.cwd().resolve()
    assert kernels_dir().resolve().parent == here, f"kernels from {kernels_dir()}, not this tree"
    if mode == "check":
        from cupyflash import reference
        for headdim in sorted({c[0] for c in cases}):
            for causal in (False, True):
                rng = np.random.default_rng(headdim + causal)
                q, k, v = (rng.standard_normal((1, 300, 2, headdim)).astype(np.float32) for _ in range(3))
                exact, _ = reference.attention(q, k, v, causal=causal)
                standard, _ = reference.standard_attention(q, k, v, causal=causal, dtype=np.float32)
                bound = 2 * float(np.abs(standard.astype(np.float64) - exact).max()) + 2.0 ** -21
                o, _ = _forward(*(cupy.asarray(x) for x in (q, k, v)), causal)
                err = float(np.abs(cupy.asnumpy(o).astype(np.float64) - exact).max())  # NaN fails below
                print(json.dumps({"check": [headdim, causal], "error": err, "bound": bound,
                                  "passed": bool(err <= bound)}), flush=True)
        for headdim, seqlen, causal in cases:  # compile (and warm) every case's kernels
            q, k, v, do = _inputs(_shape(seqlen, headdim), 1)
            o, lse = _forward(q, k, v, causal)
            cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
        cupy.cuda.Device().synchronize()
        print(json.dumps({"compiled": True}), flush=True)
        return
    sys.path.insert(0, str(here / "dev"))
    from bench_statistics import time_ms
    for headdim, seqlen, causal in cases:
        q, k, v, do = _inputs(_shape(seqlen, headdim), 0)
        o, lse = _forward(q, k, v, causal)
        fwd = time_ms(lambda: _forward(q, k, v, causal), 10)
        bwd = time_ms(lambda: cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal), 10)
        print(json.dumps({"case": [headdim, seqlen, causal], "fwd_ms": fwd, "bwd_ms": bwd}), flush=True)
        del q, k, v, do, o, lse
        cupy.get_default_memory_pool().free_all_blocks()


def _spawn(tree: Path, mode: str, cases) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree), CUPYFLASH_CACHE_DIR=str(tree / ".bench-cache"))
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", mode,
                             "--cases", json.dumps(cases)], cwd=tree, env=env, stdout=subprocess.PIPE, text=True)


def _lines(proc: subprocess.Popen, tree: Path) -> list:
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{tree}: worker failed ({proc.returncode})")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def tflops(headdim: int, seqlen: int, causal: bool, ms: float, factor: float = 1.0) -> float:
    batch, _, nheads, _ = _shape(seqlen, headdim)
    return factor * 4 * batch * nheads * seqlen * seqlen * headdim * (0.5 if causal else 1.0) / (ms * 1e-3) / 1e12


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", type=Path)
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, [tuple(c) for c in json.loads(args.cases)])
        return 0
    trees = [t.resolve() for t in args.trees]
    cases = [(d, s, c) for d in args.headdims for s in args.seqlens for c in (False, True)]
    checks = {t: _lines(p, t) for t, p in [(t, _spawn(t, "check", cases)) for t in trees]}
    failed = False
    for tree, lines in checks.items():
        for line in lines:
            if "check" in line:
                failed |= not line["passed"]
                print(f"{tree.name}: check d{line['check'][0]} causal={line['check'][1]}: error "
                      f"{line['error']:.3e} bound {line['bound']:.3e} {'ok' if line['passed'] else 'FAILED'}")
    times = {t: {} for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            for line in _lines(_spawn(tree, "time", cases), tree):
                times[tree].setdefault(tuple(line["case"]), []).append((line["fwd_ms"], line["bwd_ms"]))
    first = trees[0]
    print("| d | seqlen | causal | " + " | ".join(f"{t.name} fwd / bwd TFLOP/s" for t in trees)
          + " | " + " | ".join(f"{t.name} / {first.name} fwd, bwd" for t in trees[1:]) + " |")
    print("|---" * (3 + 2 * len(trees) - 1) + "|")
    rows = []
    for case in cases:
        med = {t: (statistics.median(x[0] for x in times[t][case]), statistics.median(x[1] for x in times[t][case]))
               for t in trees}
        cells = [f"{tflops(*case, med[t][0]):.1f} / {tflops(*case, med[t][1], 2.5):.1f}" for t in trees]
        ratios = [f"{med[first][0] / med[t][0]:.3f}, {med[first][1] / med[t][1]:.3f}" for t in trees[1:]]
        print(f"| {case[0]} | {case[1]} | {'yes' if case[2] else 'no'} | " + " | ".join(cells + ratios) + " |")
        rows.append({"case": case, **{t.name: {"fwd_ms": med[t][0], "bwd_ms": med[t][1],
                                               "rounds": times[t][case]} for t in trees}})
    if args.json:
        args.json.write_text(json.dumps({"checks": {t.name: c for t, c in checks.items()}, "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
