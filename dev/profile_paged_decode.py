"""One decode step over a contiguous cache, then the same keys in pages of 16 tokens, at the same
split count: the two launches ncu compares (issue 17's paged bar, perf log "decode-fixed-cost").

    ncu --clock-control none -k regex:flash_fwd_kvcache --section SpeedOfLight \\
        --section WarpStateStats --section SchedulerStats python dev/profile_paged_decode.py

bf16, d128, one query token, 8 x 32/8 heads at 32k keys, 2 splits unless told. Needs a GPU.
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=(8, 32, 8, 32768), metavar=("B", "HQ", "HKV", "L"))
    ap.add_argument("--splits", type=int, default=2)
    args = ap.parse_args(argv)
    import cupy

    from cupyflash.bench.kvcache_decode import _decode_inputs
    from cupyflash.kernels import kvcache_mma
    from cupyflash.masks import mask_for

    batch, hq, hkv, length = args.shape
    q, k, v, o, lse, seqlens, layouts = _decode_inputs(batch, hq, hkv, length, 128, np.random.default_rng(0))
    for name, (kc, vc, table, page, paged) in layouts.items():
        splits = kvcache_mma.forward(q, kc, vc, o, lse, seqlens_k=seqlens, block_table=table, page_size=page,
                                     paged=paged, max_seqlen_k=length, softmax_scale=0.088, mask=mask_for(False),
                                     num_splits=args.splits)
        cupy.cuda.Device().synchronize()
        print(f"{name}: {splits} splits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
