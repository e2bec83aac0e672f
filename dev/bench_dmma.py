"""The float64 forward: the DMMA candidate (cupyflash.kernels.dmma, flash_fwd_dmma) against the SIMT
kernel that float64 runs today and PyTorch's math backend in float64, one run, CUDA events, the
median of N calls; each candidate output checked against the SIMT one first.

    python dev/bench_dmma.py [--json OUT] [--repeats N] [--candidates]

``--candidates`` times dev/dmma_fwd.py's versions and candidates beside the plan's tiles (each
output checked against the SIMT kernel's first; a "max |o - o_simt|" above 1e-12 marks it wrong).

Issue 18's bar: >= 3x today's SIMT float64 forward, and reported against PyTorch's math backend.
Prediction (docs/perf-log.md, dmma-fwd-v0): shared memory bound at about half the FP64 tensor
cores' 67 TFLOP/s at d64 (one 8-byte B load per lane per DMMA; V's loads 2-way conflicted).
"""
from __future__ import annotations

import argparse
import json

from bench_statistics import time_ms  # dev/ is the script's directory
from dmma_fwd import CANDIDATES, VERSIONS


def main() -> None:
    import cupy
    import torch

    import cupyflash
    from cupyflash.kernels import dmma

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--candidates", action="store_true")
    args = parser.parse_args()
    entries = {**VERSIONS, **CANDIDATES} if args.candidates else {}
    rows = []
    for headdim in (64, 128):
        for seqlen in (1024, 4096):
            for causal in (False, True):
                batch, nheads = max(1, 8192 // seqlen), 16
                rng = cupy.random.default_rng(0)
                q, k, v = (rng.standard_normal((batch, seqlen, nheads, headdim)) for _ in range(3))
                scale = headdim ** -0.5
                o = cupy.empty_like(q)
                lse = cupy.empty((batch, nheads, seqlen))
                dmma.forward(q, k, v, o, lse, softmax_scale=scale, causal=causal)
                o_simt = cupyflash.flash_attn_func(q, k, v, causal=causal, backend="simt")
                error = float(cupy.abs(o - o_simt).max())
                times = {
                    "simt": time_ms(lambda: cupyflash.flash_attn_func(q, k, v, causal=causal, backend="simt"), args.repeats),
                    "dmma": time_ms(lambda: dmma.forward(q, k, v, o, lse, softmax_scale=scale, causal=causal), args.repeats),
                }
                checks = {}
                for name, configs in entries.items():
                    if headdim not in configs:
                        continue
                    config = configs[headdim]
                    o[...] = cupy.nan
                    dmma.forward(q, k, v, o, lse, softmax_scale=scale, causal=causal, config=config)
                    wrong = float(cupy.abs(o - o_simt).max())
                    checks[f"{name}_max_abs_vs_simt"] = wrong
                    times[name] = time_ms(lambda: dmma.forward(q, k, v, o, lse, softmax_scale=scale, causal=causal,
                                                               config=config), args.repeats)
                    print(f"    {name:24} {4 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1) / times[name] / 1e9:6.2f} TFLOP/s  "
                          f"max |o - o_simt| {wrong:.1e}", flush=True)
                qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                    times["torch_math"] = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qt, kt, vt, is_causal=causal), args.repeats)
                flops = 4 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
                row = dict(headdim=headdim, seqlen=seqlen, causal=causal, max_abs_vs_simt=error, **checks,
                           **{f"{name}_tflops": flops / ms / 1e9 for name, ms in times.items()})
                row["dmma_over_simt"] = times["simt"] / times["dmma"]
                row["dmma_over_torch_math"] = times["torch_math"] / times["dmma"]
                rows.append(row)
                print(f"d{headdim} {seqlen} {'causal' if causal else 'full':6} simt {row['simt_tflops']:6.2f} "
                      f"dmma {row['dmma_tflops']:6.2f} torch-math {row['torch_math_tflops']:6.2f} TFLOP/s  "
                      f"dmma/simt {row['dmma_over_simt']:.2f}  |o - o_simt| {error:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
