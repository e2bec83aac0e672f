"""The float64 backward: the DMMA plan (cupyflash.kernels.dmma.backward: flash_bwd_dkdv_dmma,
flash_bwd_dq_dmma, flash_bwd_stats_dmma) against the SIMT kernels float64 ran before it and
PyTorch's math backend in float64, one run, CUDA events, the median of N calls; each DMMA result
checked against the SIMT one first.

    python dev/bench_dmma_bwd.py [--json OUT] [--repeats N] [--configs] [--headdims 64 128]

Both statistics modes: "saved" (flash_attn_backward's default: D from the saved o) and
"recomputed" (flash_attn_vjp's and torch autograd's for float64: flash_bwd_stats_*). FLOPs are
counted as the backward's five products, 10 B H Sq Sk d (half of it causal). ``--configs`` also
times the other DMMA tiles of the tests (dmma-bwd-v0's candidates).

Issue 18's bar: >= 3x today's SIMT float64 backward, and reported against PyTorch's math backend.
Prediction (docs/perf-log.md, dmma-bwd-v0): about 25 TFLOP/s, 5-6x the SIMT backward.
"""
from __future__ import annotations

import argparse
import json

from bench_statistics import time_ms  # dev/ is the script's directory

from cupyflash.backward_plans import Tf32WgmmaBwdConfig, tf32x3_backward_config

CANDIDATES = {
    # dK/dV (queries per step, warps, m-tiles), dQ (keys per step, warps, m-tiles), wide
    "wide_bm32": ((32, 2, 2, 32, 2, 2, True), (16, 32, 64)),
    "wide_w2": ((16, 2, 2, 16, 2, 2, True), (16, 32, 64)),
    "narrow_d128_w4": ((16, 4, 1, 16, 4, 1, False), (128,)),
    # dmma-bwd-v0's sm_90 d128 row, before the warp pairs (dmma-bwd-v1) became the row
    "v0_d128": ((16, 8, 1, 16, 8, 1, False), (128,)),
    "pairs_d64": ((16, 8, 2, 16, 4, 2, True, True), (64,)),
}


# float32 on the wgmma candidates (perf log tf32-wgmma-bwd-v0): dK / dV on flash_bwd_dkdv_tf32_wgmma(_ws),
# dQ on flash_bwd_dq_tf32_wgmma(_ws) (or the tf32x3 kernel), the statistics on the tf32x3 kernel;
# head dims up to 64, sm_90
WGMMA_CANDIDATES = {
    "wgmma": Tf32WgmmaBwdConfig(),  # TF32_WGMMA_BACKWARD_CONFIGS' row: apart sums, raw rows two blocks ahead
    "wgmma_chained": Tf32WgmmaBwdConfig(32, 2, False, 32, 2),  # the same tiles, every product chained
    # (64-row blocks, chained, dK/dV unstaged, Tf32WgmmaBwdConfig(64, 0, False, 64, 1), never timed,
    # left the list when split_tf32 began to keep NaN: one compare and select more, 16 bytes spilled)
    "wgmma_sync": Tf32WgmmaBwdConfig(32, 0, True, 32, 0),  # the split reads global memory itself
    "wgmma_dkdv": Tf32WgmmaBwdConfig(dq_block_n=0),  # dQ on the tf32x3 kernel: the dK/dV kernel alone
    # dQ in the dK/dV kernel by atomics (10 product units, not 14): the count's road to issue 18's bar
    "wgmma_fused": Tf32WgmmaBwdConfig(fused_dq=True),
    "wgmma_fused_chained": Tf32WgmmaBwdConfig(32, 2, False, fused_dq=True),
    # precision "tf32" (one product a product): issue 18 asks its TFLOP/s and error reported
    "wgmma_tf32": Tf32WgmmaBwdConfig(32, 2, False, precision="tf32"),
    "wgmma_fused_tf32": Tf32WgmmaBwdConfig(32, 2, False, fused_dq=True, precision="tf32"),
    # dK/dV by a producer warpgroup and a consumer (perf log tf32-wgmma-bwd-v1), dQ on one warpgroup
    # (the tenth session's route)
    "wgmma_producer": Tf32WgmmaBwdConfig(32, 1, producer=True),
    "wgmma_producer_chained": Tf32WgmmaBwdConfig(32, 1, False, producer=True),
    # dQ by a producer warpgroup too (perf log tf32-wgmma-dq-ws), raw K / V one block ahead (the
    # route's row since the eleventh session) and two
    "wgmma_producer_dq": Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True),
    "wgmma_producer_dq_r2": Tf32WgmmaBwdConfig(32, 1, producer=True, dq_producer=True),
    # two dQ consumers taking turns at the key blocks (a second warp a scheduler in the first's gaps)
    "wgmma_producer_dq_c2": Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True,
                                               dq_consumers=2),
    # the key blocks split once for the grid (flash_bwd_split_kv_tf32), the dQ producer one thread's
    # bulk copies (perf log tf32-split-once); two and three stages
    "wgmma_presplit": Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=0, dq_producer=True, dq_presplit=True),
    "wgmma_presplit_s3": Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=0, dq_producer=True, dq_stages=3,
                                            dq_presplit=True),
    "wgmma_presplit_c2": Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=0, dq_producer=True, dq_consumers=2,
                                            dq_presplit=True),
    # the query blocks split once too (flash_bwd_split_q_tf32, perf log tf32-split-once-dkdv)
    "wgmma_presplit_both_c2": Tf32WgmmaBwdConfig(32, 0, producer=True, presplit=True, dq_raw_stages=0, dq_producer=True,
                                                 dq_consumers=2, dq_presplit=True),
    "wgmma_presplit_both": Tf32WgmmaBwdConfig(32, 0, producer=True, presplit=True, dq_raw_stages=0, dq_producer=True,
                                              dq_presplit=True),
}


def per_kernel_ms(run, repeats: int) -> dict:
    """The median time of each kernel ``run`` launches (CUDA events around every launch of
    simt.run_backward), by its role: the statistics or D kernel, dK/dV, dQ. Which kernel holds a
    backward's time, before asking ncu why."""
    import cupy
    import numpy as np

    from cupyflash.kernels import simt

    real, samples = simt.launch, {}

    def timed(spec, *args, **kwargs):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        real(spec, *args, **kwargs)
        stop.record()
        words = spec.name.split("_")  # flash_bwd_<role>_...: split_q and split_kv kept apart
        role = "_".join(words[2:4]) if words[2] == "split" else words[2]
        samples.setdefault(role, []).append((start, stop))

    simt.launch = timed
    try:
        run()
        samples.clear()
        for _ in range(repeats):
            run()
    finally:
        simt.launch = real
    cupy.cuda.get_current_stream().synchronize()
    return {role: float(np.median([cupy.cuda.get_elapsed_time(a, b) for a, b in events]))
            for role, events in samples.items()}


# float32 at the d128 tile (perf log tf32-wgmma-bwd-pair): dK / dV on the pair's kernel, dQ on the
# tf32x3 kernel or on the pair's dQ kernel (raw K and V one block ahead)
WGMMA_D128_CANDIDATES = {"wgmma_pair": Tf32WgmmaBwdConfig(32, 0, dq_block_n=0, pair=True),
                         "wgmma_pair_dq": Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=1, pair=True, dq_pair=True),
                         # perf log tf32-pair-prefetch: the dK/dV pair's next query block into L1
                         "wgmma_pair_dq_pf": Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=1, pair=True, dq_pair=True,
                                                                prefetch=True)}


def warm_candidates(headdims, processes: int) -> None:
    """Every kernel the float32 rows launch (the candidates' plans, both masks and statistics),
    compiled into CuPy's disk cache by the kernel-cache warmer's process pool."""
    import multiprocessing
    import sys
    import time
    from concurrent.futures import ProcessPoolExecutor
    from pathlib import Path

    import numpy

    from cupyflash.backward_plans import dmma_backward_plan, tf32_wgmma_backward_plan
    from cupyflash.masks import mask_for
    from cupyflash.scores import PLAIN

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from warm_kernel_cache import _compile

    specs = {}
    for headdim in (h for h in headdims if h <= 128):
        for causal in (False, True):
            mask = mask_for(causal, (-1, -1), PLAIN, False).backward()
            for statistics in ("saved", "recomputed"):
                plans = [tf32_wgmma_backward_plan(headdim, mask, config, statistics)
                         for config in (WGMMA_CANDIDATES if headdim <= 64 else WGMMA_D128_CANDIDATES).values()]
                plans.append(dmma_backward_plan(headdim, mask, tf32x3_backward_config(headdim), statistics,
                                                dtype=numpy.float32))
                for plan in plans:
                    for launch in plan.launches:
                        specs[launch.spec.name] = launch.spec
    names = sorted(specs)
    chunks = [c for c in (names[i::processes] for i in range(processes)) if c]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = [e for _, errs in pool.map(_compile, chunks, [list(specs.values())] * len(chunks)) for e in errs]
    print(f"warm: {len(names)} kernels in {time.time() - t0:.0f} s, {len(errors)} errors", flush=True)
    for line in errors:
        print("    " + line, flush=True)


def main() -> None:
    import cupy
    import torch

    from cupyflash.kernels._module import device_arch

    from cupyflash.backward_plans import DmmaBwdConfig
    from cupyflash.kernels import dmma, simt
    from cupyflash.scores import Variant

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configs", action="store_true")
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--per-kernel", action="store_true",
                        help="also time each kernel of every plan (events around each launch): "
                             "<statistics>_<config>_<role>_ms in the JSON, role preprocess / stats / dkdv / dq")
    parser.add_argument("--warm", type=int, default=0, metavar="N",
                        help="first compile the float32 candidates' kernels in N processes (NVRTC is serial in "
                             "one process, and each wgmma candidate is two or three kernels a mask)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                        help="float32: the tf32x3 experiment (perf log tf32-bwd-v0) and, at head dims up to 64 on "
                             "sm_90, its wgmma dK/dV candidates (tf32-wgmma-bwd-v0) against the SIMT float32 "
                             "backward and PyTorch's mem-efficient float32 backward")
    parser.add_argument("--candidates", nargs="+", choices=sorted({**WGMMA_CANDIDATES, **WGMMA_D128_CANDIDATES}),
                        metavar="NAME",
                        help="time only these of the float32 wgmma candidates (default: all of them; a call "
                             "with every candidate at --per-kernel takes most of a 600 s device call)")
    args = parser.parse_args()
    if args.candidates:
        for table in (WGMMA_CANDIDATES, WGMMA_D128_CANDIDATES):
            for name in set(table) - set(args.candidates):
                del table[name]
    fp32 = args.dtype == "float32"
    if fp32 and args.warm and device_arch() == "90":
        warm_candidates(args.headdims, args.warm)
    rows = []
    for headdim in args.headdims:
        for seqlen in (1024, 4096):
            for causal in (False, True):
                batch, nheads = max(1, 8192 // seqlen), 16
                rng = cupy.random.default_rng(0)
                q, k, v, do = (rng.standard_normal((batch, seqlen, nheads, headdim)).astype(args.dtype)
                               for _ in range(4))
                scale = headdim ** -0.5
                o = cupy.empty_like(q)
                lse = cupy.empty((batch, nheads, seqlen), q.dtype)
                (simt.forward if fp32 else dmma.forward)(q, k, v, o, lse, softmax_scale=scale, causal=causal)
                grads = [cupy.empty_like(x) for x in (q, k, v)]
                flops = 10 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
                row = dict(headdim=headdim, seqlen=seqlen, causal=causal, batch=batch, nheads=nheads)
                for statistics in ("saved", "recomputed"):
                    variant = Variant(statistics=statistics)

                    def run(backward, **options):
                        return lambda: backward(do, q, k, v, o, lse, *grads, softmax_scale=scale, causal=causal,
                                                variant=variant, **options)

                    run(simt.backward)()
                    want = [g.copy() for g in grads]
                    times = {"simt": time_ms(run(simt.backward), args.repeats)}
                    configs = {"dmma": tf32x3_backward_config(headdim) if fp32 else None}
                    if fp32 and device_arch() == "90":  # tf32-wgmma-bwd-v0's dK/dV; at d128 the pair's
                        configs.update(WGMMA_CANDIDATES if headdim <= 64 else WGMMA_D128_CANDIDATES)
                    if args.configs and not fp32:
                        configs.update({name: DmmaBwdConfig(*tiles) for name, (tiles, dts) in CANDIDATES.items()
                                        if dmma.d_tile(headdim) in dts})
                    for name, config in configs.items():
                        for g in grads:
                            g[...] = cupy.nan
                        fused = getattr(config, "fused_dq", False)  # dQ by atomics: not deterministic
                        run(dmma.backward, config=config, deterministic=not fused)()
                        error = max(float(cupy.abs(g - w).max() / (1 + cupy.abs(w).max())) for g, w in zip(grads, want))
                        row[f"{statistics}_{name}_rel_err_vs_simt"] = error
                        times[name] = time_ms(run(dmma.backward, config=config, deterministic=not fused),
                                              args.repeats)
                        if args.per_kernel:
                            for role, ms in per_kernel_ms(run(dmma.backward, config=config, deterministic=not fused),
                                                          args.repeats).items():
                                row[f"{statistics}_{name}_{role}_ms"] = ms
                    for name, ms in times.items():
                        row[f"{statistics}_{name}_tflops"] = flops / ms / 1e9
                    row[f"{statistics}_dmma_over_simt"] = times["simt"] / times["dmma"]
                qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
                dot = torch.from_dlpack(do).transpose(1, 2)
                backend = torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION if fp32 else torch.nn.attention.SDPBackend.MATH
                with torch.nn.attention.sdpa_kernel(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    ms = time_ms(lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True), args.repeats)
                torch_name = "torch_mem_efficient" if fp32 else "torch_math"
                row[f"{torch_name}_tflops"] = flops / ms / 1e9
                row[f"dmma_over_{torch_name}"] = row["saved_dmma_tflops"] / row[f"{torch_name}_tflops"]
                rows.append(row)
                extra = "  ".join(f"{key[:-7]} {value:.2f}" for key, value in row.items()
                                  if key.endswith("_tflops") and key.split("_")[1] not in ("simt", "dmma")
                                  and not key.startswith("torch"))
                print(f"d{headdim} {seqlen} {'causal' if causal else 'full':6} saved: simt {row['saved_simt_tflops']:5.2f} "
                      f"dmma {row['saved_dmma_tflops']:5.2f} ({row['saved_dmma_over_simt']:.2f}x, err "
                      f"{row['saved_dmma_rel_err_vs_simt']:.1e})  recomputed: simt {row['recomputed_simt_tflops']:5.2f} "
                      f"dmma {row['recomputed_dmma_tflops']:5.2f} ({row['recomputed_dmma_over_simt']:.2f}x)  "
                      f"{torch_name} {row[torch_name + '_tflops']:5.2f} TFLOP/s  {extra}", flush=True)
                if args.per_kernel:
                    roles = {}
                    for key, value in row.items():
                        if key.startswith("saved_") and key.endswith("_ms"):
                            stem = key[len("saved_"):-len("_ms")]
                            role = next((r for r in ("split_kv", "split_q") if stem.endswith("_" + r)),
                                        stem.rsplit("_", 1)[1])
                            name = stem[: -len(role) - 1]
                            roles.setdefault(name, []).append(f"{role} {value:.3f}")
                    print("    saved, ms a kernel: " + "  ".join(f"{name}: {', '.join(parts)}"
                                                           for name, parts in roles.items()), flush=True)
                bound = 1e-4 if fp32 else 1e-11  # float32: two float32 backwards' own rounding apart

                def bound_of(key):  # precision "tf32": 10-bit operands
                    return 2.0 ** -9 if "_tf32_rel_err" in key else bound

                wrong = [key for key, value in row.items()
                         if key.endswith("_rel_err_vs_simt") and not value <= bound_of(key)]
                if wrong:
                    print(f"    WRONG (relative error vs SIMT above {bound}, 2^-9 for tf32): {wrong}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
