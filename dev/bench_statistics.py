"""The float32 / float64 backward with saved against recomputed statistics (issue 18's saturated
softmax): time of flash_attn_backward, one run, CUDA events, the median of N calls.

    python dev/bench_statistics.py [--json OUT]

The recomputed statistics add flash_bwd_stats_simt, a walk over each row's keys that forms S and
dP once more: two of the backward's seven product passes, so about 1.3x the saved backward's time
is the prediction.
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def time_ms(run, repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``run`` (CUDA events), after one untimed call."""
    import cupy

    run()
    samples = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        run()
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(samples))


def main() -> None:
    import cupy

    import cupyflash

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for dtype in (np.float32, np.float64):
        for headdim in (64, 128):
            for seqlen in (1024, 4096):
                for causal in (False, True):
                    batch, nheads = max(1, 16384 // seqlen), 16
                    rng = cupy.random.default_rng(0)
                    q, k, v, do = (rng.standard_normal((batch, seqlen, nheads, headdim), dtype=dtype) for _ in range(4))
                    o, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
                    times = {}
                    for statistics in ("saved", "recomputed"):
                        times[statistics] = time_ms(
                            lambda: cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal,
                                                                  statistics=statistics), args.repeats)
                    flops = 4 * batch * nheads * seqlen * seqlen * headdim * 2.5 / (2 if causal else 1)
                    row = dict(dtype=np.dtype(dtype).name, headdim=headdim, seqlen=seqlen, causal=causal,
                               saved_ms=times["saved"], recomputed_ms=times["recomputed"],
                               saved_tflops=flops / times["saved"] / 1e9,
                               recomputed_tflops=flops / times["recomputed"] / 1e9,
                               ratio=times["recomputed"] / times["saved"])
                    rows.append(row)
                    print(f"{row['dtype']} d{headdim} {seqlen} {'causal' if causal else 'full':6} saved "
                          f"{row['saved_ms']:8.2f} ms ({row['saved_tflops']:5.2f} TFLOP/s)  recomputed "
                          f"{row['recomputed_ms']:8.2f} ms ({row['recomputed_tflops']:5.2f})  x{row['ratio']:.2f}",
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
