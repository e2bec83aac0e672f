"""A score variant's forward in several source trees on one machine (softcap-mufu, docs/perf-log.md):
each tree is a copy of this checkout with one experiment patch applied, and runs in its own process
(its own kernels_cu/, its own cupyflash). Run from the checkout's root:

    PYTHONPATH=. python dev/bench_variant_trees.py . TREE [TREE ...] [--json OUT.json]
        [--pick FILE --margin 0.03 [--pick-config "ws s3 pp"]]

"." is this checkout (labelled "main"), each other tree is labelled by its folder's name. First every tree compiles its kernels, side by side (NVRTC is CPU work); then
each tree's process checks every configuration's softcap output against a float64 reference (the
error at most twice that of standard attention computed in bf16, cupyflash.reference) and times
plain and softcap 30 at 8k causal d128 (2 x 16 heads, bf16, median of 20) in the producer forward
with and without the consumers' turns, and the backward the plan runs ("api bwd", through
cupyflash.flash_attn_backward; its softcap is not checked here: the GPU suite's tests are); the trees take turns over ROUNDS rounds, so a drift of the
card's clock touches every tree alike. Each row: its tree, configuration, variant, the median of its
rounds, and softcap / plain within the tree. --pick writes to FILE the label of the tree whose
softcap is fastest in the shipped configuration (ws s3 pp; --pick-config "api bwd": the backward) if every check of that tree passed and it
beats main's by the margin; FILE is left empty otherwise (scripts/gpu_check.sh trees).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROUNDS = 3
# the head dim: 128 unless --headdim (passed to the workers as CUPYFLASH_TREES_HEADDIM) says otherwise
BATCH, SEQLEN, NHEADS = 2, 8192, 16
HEADDIM = int(os.environ.get("CUPYFLASH_TREES_HEADDIM", "128"))
SOFTCAP = 30.0


def configs():
    from cupyflash.kernels.mma_fwd import WgmmaFwdConfig
    return {"ws s3 pp": WgmmaFwdConfig(128, 128, producer=True, stages=3),
            "ws s3": WgmmaFwdConfig(128, 128, producer=True, stages=3, pingpong=False)}


def _inputs(seqlen: int, seed: int):
    import numpy as np
    from cupyflash._dtypes import SUPPORTED
    dtype = SUPPORTED["bfloat16"]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BATCH, seqlen, NHEADS, HEADDIM)).astype(dtype) for _ in range(3)]


def _run(config, variant, q, k, v, causal=True):
    import cupy
    import numpy as np
    from cupyflash.kernels import mma_fwd
    o = cupy.full(q.shape, np.nan, q.dtype)  # NaN-poisoned: a row the kernel skips shows
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), np.nan, np.float32)
    mma_fwd.forward(q, k, v, o, lse, softmax_scale=q.shape[-1] ** -0.5, causal=causal, config=config,
                    variant=variant)
    return o


def worker(mode: str) -> None:
    """One tree's process: 'compile', 'check' or 'time'; prints one JSON line per result."""
    import cupy
    import numpy as np
    from cupyflash.kernels._module import kernels_dir
    from cupyflash.scores import Variant
    here = Path.cwd().resolve()
    assert kernels_dir().resolve().parent == here, f"kernels from {kernels_dir()}, not this tree"
    variants = {"plain": None, "softcap 30": Variant(softcap=SOFTCAP)}
    if mode == "compile":
        q, k, v = (cupy.asarray(x) for x in _inputs(256, 1))
        for config in configs().values():
            for variant in variants.values():
                _run(config, variant, q, k, v)
        cupy.cuda.Device().synchronize()
        print(json.dumps({"compiled": True}))
    elif mode == "check":
        from cupyflash import reference
        for seqlen, causal in ((384, True), (1000, False)):
            q, k, v = _inputs(seqlen, seqlen)
            exact, _ = reference.attention(q, k, v, causal=causal, softcap=SOFTCAP)
            standard, _ = reference.standard_attention(q, k, v, causal=causal, softcap=SOFTCAP, dtype=q.dtype)
            bound = 2 * np.abs(standard.astype(np.float64) - exact).max()
            for name, config in configs().items():
                o = _run(config, variants["softcap 30"], *(cupy.asarray(x) for x in (q, k, v)), causal=causal)
                err = float(np.abs(cupy.asnumpy(o).astype(np.float64) - exact).max())  # NaN fails below
                print(json.dumps({"check": name, "seqlen": seqlen, "causal": causal, "error": err,
                                  "bound": float(bound), "passed": bool(err <= bound)}))
    else:
        sys.path.insert(0, str(here / "dev"))
        from bench_statistics import time_ms
        q, k, v = (cupy.asarray(x) for x in _inputs(SEQLEN, 0))
        for name, config in configs().items():
            for vname, variant in variants.items():
                ms = time_ms(lambda: _run(config, variant, q, k, v), 20)
                print(json.dumps({"config": name, "variant": vname, "ms": ms}))
        del q, k, v
        # the backward the plan runs (cupyflash.flash_attn_backward, the bench's call)
        from cupyflash.bench import variants as V
        sets = V._inputs(BATCH, SEQLEN, NHEADS, (HEADDIM, HEADDIM), 1, 0)
        for vname, bench_variant in (("plain", V.Variant("causal", True)),
                                     ("softcap 30", V.Variant("causal softcap 30", True, softcap=SOFTCAP))):
            _, bwd = V._cupyflash_runs(bench_variant, sets)
            ms = time_ms(lambda: bwd(0), 20)
            print(json.dumps({"config": "api bwd", "variant": vname, "ms": ms}))


def _spawn(tree: Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", mode], cwd=tree,
                            env=env, stdout=subprocess.PIPE, text=True)


def _lines(proc: subprocess.Popen, tree: Path) -> list[dict]:
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{tree}: worker failed ({proc.returncode})")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main(argv: list[str]) -> None:
    global HEADDIM
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help='"." (this checkout, "main") and the experiment copies')
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pick", type=Path, help="write the winning tree's label here (empty: none)")
    parser.add_argument("--margin", type=float, default=0.0)
    parser.add_argument("--pick-config", default="ws s3 pp")
    parser.add_argument("--headdim", type=int, choices=(64, 128), default=HEADDIM,
                        help="the problem's head dim (default 128; 64: d64's kernels, e.g. a backward patch there)")
    args = parser.parse_args(argv)
    os.environ["CUPYFLASH_TREES_HEADDIM"] = str(args.headdim)  # the workers' (their environment is this one's)
    HEADDIM = args.headdim
    if args.pick and "." not in args.trees:
        parser.error('--pick compares against this checkout: name "." among the trees')
    trees = [Path(t).resolve() for t in args.trees]
    labels = {t: "main" if a == "." else t.name for a, t in zip(args.trees, trees)}
    for tree, proc in [(t, _spawn(t, "compile")) for t in trees]:
        _lines(proc, tree)
        print(f"{labels[tree]}: compiled", flush=True)
    passed = {}
    for tree, proc in [(t, _spawn(t, "check")) for t in trees]:
        for line in _lines(proc, tree):
            print(f"{labels[tree]}: check {line['check']} {line['seqlen']} causal={line['causal']}: error "
                  f"{line['error']:.2e}, bound {line['bound']:.2e}, {'passed' if line['passed'] else 'FAILED'}",
                  flush=True)
            passed[labels[tree]] = passed.get(labels[tree], True) and line["passed"]
    times: dict[tuple, list[float]] = {}
    for _ in range(ROUNDS):
        for tree in trees:
            for line in _lines(_spawn(tree, "time"), tree):
                times.setdefault((labels[tree], line["config"], line["variant"]), []).append(line["ms"])
    rows = []
    for (label, config, variant), ms in times.items():
        flops = 4 * BATCH * NHEADS * SEQLEN * SEQLEN * HEADDIM * 0.5 * (2.5 if config == "api bwd" else 1)
        med = statistics.median(ms)
        plain = statistics.median(times[(label, config, "plain")])
        rows.append({"tree": label, "config": config, "variant": variant, "ms": med, "rounds": ms,
                     "tflops": flops / med / 1e9, "of_plain": plain / med, "checks_passed": passed[label]})
        print(f"{label:40s} {config:9s} {variant:11s} {med:.3f} ms {flops / med / 1e9:6.1f} TFLOP/s "
              f"{plain / med:.3f} of plain  rounds {' '.join(f'{x:.3f}' for x in ms)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.pick:
        softcap = {r["tree"]: r["ms"] for r in rows if r["config"] == args.pick_config and r["variant"] == "softcap 30"}
        best = min((t for t in softcap if t != "main" and passed[t]), key=softcap.get, default=None)
        chosen = best if best and softcap[best] <= (1 - args.margin) * softcap["main"] else ""
        args.pick.write_text(chosen)
        print(f"picked: {chosen or 'none'}", flush=True)
    if not all(passed.values()):
        raise SystemExit("a tree's softcap output failed the 16-bit rule")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    else:
        main(sys.argv[1:])
