"""Where an attention kernel's time goes besides its steps, CTA by CTA (perf log
doc-mask-bwd-fixed-cost, tf32-split-once-dkdv, cta-timeline):

    python dev/cta_timeline.py 128 16384 [fwd] [causal] [window=L,R] [documents=N] [dtype=float32]
                               [softcap=C] [varlen] [--kernels REGEX] [--json PATH]

The workload is scripts/ncu_workload.py's: batch * seqlen = 16384 tokens, nheads * headdim = 2048,
fresh normal inputs; the backward (deterministic), or with ``fwd`` the forward (a sliding window
with ``window=L,R``: issue 15's window forward). ``varlen``: the varlen bench's packed batch instead
(cupyflash.bench.varlen: lengths 128..8k log-uniform filling 16k tokens, its 16 heads; the seqlen
argument is unused), through flash_attn_varlen_func / _backward: issue 17's packed causal rows
against a dense 16k run. It runs once as the library runs it (compiling, and
noting which kernels launch with which grid). Then every launched kernel whose name matches
``--kernels`` is compiled again with CF_CTA_TIMELINE (kernels_cu/cta_timeline.cuh) and put in the
library's place, and the backward runs again. For each such kernel this prints, over its CTAs:

- prologue: cycles from the CTA's entry to its first step's start (K / V and the first block in);
- a step: cycles from the first step's start to the walk's end, over the walk's steps;
- epilogue: cycles from the walk's end to the exit (the accumulators out);
- gap: on each SM, ns from one CTA's exit to the next CTA's entry (the launch of a CTA);
- the same by walk length (quartiles), so a step's cost can be read against the walk's length.

Fixed cost a CTA = prologue + epilogue + gap, against the steps' cycles: the share of the kernel
that is not steps. Caveats: the gap assumes one CTA an SM (true of these kernels' backward rows,
256 threads and 175+ registers; two co-resident CTAs give negative gaps); %globaltimer may tick
in steps of about a microsecond on some parts (look at the gaps' spread before trusting one);
flash_bwd_wgmma's first step is marked after Walk::land, which also issues the next block's
copies; EXIT is the recording thread's, not the CTA's last warp's. The marks cost a few instructions each, at most four a CTA; the library's
kernels have none (their machine code is unchanged without the define: dev/compare_sass.py).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# of these, only the marked files' (below): the backward's dK / dV and dQ, the forwards' wgmma kernels
DEFAULT_KERNELS = r"^flash_(bwd_(wgmma|dq_wgmma|dkdv_tf32_wgmma_ws)|fwd_wgmma(_ws)?)_"
SLOTS = 8  # cta_timeline.cuh's CF_CTA_TIMELINE_SLOTS: sm, steps, ns at entry / exit, clock at 4 marks
ENTRY, FIRST_STEP, WALKED, EXIT = 4, 5, 6, 7  # the clocks' slots


def timeline_source(source: str, ctas: int) -> str:
    """A kernel module's source with the timeline on, for ``ctas`` CTAs."""
    return f"#define CF_CTA_TIMELINE 1\n#define CF_CTA_TIMELINE_CTAS {ctas}\n" + source


def summarize(rows: np.ndarray) -> dict:
    """The statistics above from the (ctas, SLOTS) int64 rows of one launch; a CTA that returned
    before its walk (no exit recorded) counts in ``early`` only."""
    done = rows[(rows[:, 3] > 0) & (rows[:, EXIT] > 0)]
    early = int(len(rows) - len(done))
    if not len(done):
        return {"ctas": int(len(rows)), "early": early}
    steps = done[:, 1]
    walked = (steps > 0) & (done[:, FIRST_STEP] > 0)  # an empty walk marks no first step
    prologue = (done[:, FIRST_STEP] - done[:, ENTRY])[walked]
    walk = done[:, WALKED] - done[:, FIRST_STEP]
    epilogue = done[:, EXIT] - done[:, WALKED]
    life_ns = done[:, 3] - done[:, 2]
    life_cycles = done[:, EXIT] - done[:, ENTRY]
    ghz = float(life_cycles.sum() / max(life_ns.sum(), 1))
    # The gap: a CTA's entry after the SM's last exit before it (the place it took was freed then).
    # With one CTA an SM that is the previous CTA's exit; with more, a CTA that entered beside a
    # running one, with no exit before it, has no gap. `resident`: the most CTAs alive on one SM.
    gaps, resident = [], 1
    for sm in np.unique(done[:, 0]):
        on_sm = done[done[:, 0] == sm]
        on_sm = on_sm[np.argsort(on_sm[:, 2], kind="stable")]
        entries, exits = on_sm[:, 2], on_sm[:, 3]
        for i in range(1, len(on_sm)):
            before = exits[:i][exits[:i] <= entries[i]]
            if len(before):
                gaps.append(int(entries[i] - before.max()))
        alive = 0  # exits before entries at the same ns
        for _, change in sorted([(t, 1) for t in entries] + [(t, -1) for t in exits]):
            alive += change
            resident = max(resident, alive)
    gaps = np.array(gaps if gaps else [0], np.float64)
    per_step = walk[walked] / steps[walked]
    out = {
        "ctas": int(len(rows)), "early": early, "ghz": ghz,
        "span_ns": int(done[:, 3].max() - done[:, 2].min()),
        "steps_mean": float(steps.mean()),
        "prologue_cycles": float(np.median(prologue)) if len(prologue) else 0.0,
        "step_cycles": float(np.median(per_step)) if len(per_step) else 0.0,
        "epilogue_cycles": float(np.median(epilogue)),
        "resident": int(resident),
        "gap_ns": float(np.median(gaps)),
        "gap_cycles": float(np.median(gaps) * ghz),
    }
    out["fixed_cycles"] = out["prologue_cycles"] + out["epilogue_cycles"] + out["gap_cycles"]
    steps_cycles = out["steps_mean"] * out["step_cycles"]
    out["fixed_share"] = out["fixed_cycles"] / max(out["fixed_cycles"] + steps_cycles, 1.0)
    if walked.sum() >= 4:
        edges = np.quantile(steps[walked], [0, 0.25, 0.5, 0.75, 1.0])
        quartiles = []
        for q, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            pick = (steps[walked] >= lo) & ((steps[walked] <= hi) if q == 3 else (steps[walked] < hi))
            if not pick.any():
                continue
            quartiles.append({"steps": [int(lo), int(hi)], "ctas": int(pick.sum()),
                              "step_cycles": float(np.median(per_step[pick])),
                              "prologue_cycles": float(np.median(prologue[pick])),
                              "epilogue_cycles": float(np.median(epilogue[walked][pick]))})
        out["by_walk"] = quartiles
    return out


def report(name: str, s: dict) -> str:
    if "ghz" not in s:
        return f"{name}: {s['ctas']} CTAs, none reached its exit"
    lines = [f"{name}: {s['ctas']} CTAs ({s['early']} left early), {s['span_ns'] / 1e3:.1f} us, "
             f"{s['ghz']:.2f} GHz, {s['steps_mean']:.1f} steps a CTA",
             f"  prologue {s['prologue_cycles']:.0f}, a step {s['step_cycles']:.0f}, epilogue "
             f"{s['epilogue_cycles']:.0f}, gap {s['gap_ns']:.0f} ns ({s['gap_cycles']:.0f} cycles), median; "
             f"fixed {s['fixed_cycles']:.0f} cycles a CTA = {100 * s['fixed_share']:.1f}% of its time"
             + (f" ({s['resident']} CTAs an SM at most: other CTAs' steps run under it)" if s.get("resident", 1) > 1
                else "")]
    for q in s.get("by_walk", []):
        lines.append(f"  walks of {q['steps'][0]}-{q['steps'][1]} steps ({q['ctas']} CTAs): a step "
                     f"{q['step_cycles']:.0f}, prologue {q['prologue_cycles']:.0f}, epilogue {q['epilogue_cycles']:.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("headdim", type=int)
    parser.add_argument("seqlen", type=int)
    parser.add_argument("options", nargs="*", help="causal, documents=N, dtype=D, softcap=C (ncu_workload's), "
                                                    "fwd, window=L,R, varlen")
    parser.add_argument("--kernels", default=DEFAULT_KERNELS, help="regex of the kernels to time")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import cupy

    import cupyflash
    from cupyflash._dtypes import SUPPORTED
    from cupyflash.kernels import _module

    words = dict(o.split("=", 1) for o in args.options if "=" in o)
    batch, nheads = 16384 // args.seqlen, 2048 // args.headdim
    rng = np.random.default_rng(0)
    dtype = SUPPORTED[words.get("dtype", "bfloat16")]
    shape = (batch, args.seqlen, nheads, args.headdim)
    packed = None
    if "varlen" in args.options:  # the varlen bench's batch: (total, heads, d) and its cu_seqlens
        from cupyflash.bench import varlen as varlen_bench

        lengths = varlen_bench.draw_lengths()
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        packed = (cu, cu, max(lengths), max(lengths))
        shape = (int(cu[-1]), varlen_bench.NHEADS, args.headdim)
        print(f"varlen: {len(lengths)} sequences of {min(lengths)}..{max(lengths)} tokens, {int(cu[-1])} in all")
    q, k, v, do = (cupy.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(4))
    options = dict(causal="causal" in args.options, softcap=float(words.get("softcap", 0.0)))
    if "window" in words:
        options["window_size"] = tuple(int(x) for x in words["window"].split(","))
    forward_only = "fwd" in args.options
    if int(words.get("documents", 0)):
        from cupyflash.bench.variants import document_ids

        doc = cupy.asarray(document_ids(args.seqlen, int(words["documents"])))
        mask = cupyflash.MaskMod(lambda b, h, q_idx, kv_idx, doc: doc[0, q_idx] == doc[0, kv_idx], doc=doc)
        options["block_mask"] = cupyflash.create_block_mask(mask, None, None, args.seqlen, args.seqlen)
    def forward():
        if packed is not None:
            return cupyflash.flash_attn_varlen_func(q, k, v, *packed, return_lse=True, **options)
        return cupyflash.flash_attn_func(q, k, v, return_lse=True, **options)

    o, lse = forward()

    def run():  # the pass timed: the forward, or the backward
        if forward_only:
            forward()
        elif packed is not None:
            cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *packed, **options)
        else:
            cupyflash.flash_attn_backward(do, q, k, v, o, lse, **options)

    # once first: the backward's kernel modules are imported at its first call, and the rebinding
    # below reaches only the modules imported by then (the sixteenth session's H100 run noted no
    # backward launch at all without this)
    run()
    cupy.cuda.runtime.deviceSynchronize()
    launched = {}
    library_launch = _module.launch

    def noting_launch(spec, grid, launch_args):
        launched.setdefault(spec.name, (spec, tuple(int(g) for g in grid)))
        return library_launch(spec, grid, launch_args)

    # the kernel modules bound launch by name (from ._module import launch): rebind it in each
    bound = [m for m in list(sys.modules.values())
             if getattr(m, "__name__", "").startswith("cupyflash.") and m is not _module
             and getattr(m, "launch", None) is library_launch]
    for m in bound:
        m.launch = noting_launch
    try:
        run()
        cupy.cuda.runtime.deviceSynchronize()
    finally:
        for m in bound:
            m.launch = library_launch

    device = cupy.cuda.Device().id
    timed, replaced = {}, {}
    for name, (spec, grid) in launched.items():
        # a kernel whose file does not include cta_timeline.cuh has no marks (e.g. the d256 dsplit)
        if not re.search(args.kernels, name) or "MARK_ENTRY" not in _module.kernel_source(spec.source_file):
            continue
        ctas = grid[0] * grid[1] * grid[2]
        arch = (f"-arch=sm_{spec.arch}",) if spec.arch else ()
        module = cupy.RawModule(code=timeline_source(_module.module_source(spec.source_file, (spec.expression,)), ctas),
                                options=_module.NVRTC_OPTIONS + arch, name_expressions=(spec.expression,))
        fn = module.get_function(spec.expression)
        if spec.smem_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = spec.smem_bytes
        replaced[(name, device)] = _module._functions.get((name, device))
        _module._functions[(name, device)] = fn  # the library launches this one now
        memory = module.get_global("cf_cta_timeline")
        rows = cupy.ndarray((ctas, SLOTS), cupy.int64, memory)
        rows.fill(0)
        timed[name] = rows
    try:
        if not timed:
            raise SystemExit(f"cta_timeline: no launched kernel with marks matches {args.kernels!r}: {sorted(launched)}")
        run()
        cupy.cuda.runtime.deviceSynchronize()
    finally:  # the library's own functions back, for whatever runs next in this process
        for key, fn in replaced.items():
            if fn is None:
                _module._functions.pop(key, None)
            else:
                _module._functions[key] = fn

    results = {}
    for name, rows in timed.items():
        results[name] = summarize(rows.get())
        print(report(name, results[name]))
    if args.json:
        args.json.write_text(json.dumps({"workload": [args.headdim, args.seqlen, *args.options], "kernels": results},
                                        indent=1))


if __name__ == "__main__":
    main()
