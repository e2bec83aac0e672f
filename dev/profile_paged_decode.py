"""One decode step over a contiguous cache, then the same keys in pages, at one split count: the
launches ncu compares (issue 17's paged bar, perf log "decode-v3").

    ncu --clock-control none -k regex:flash_fwd_kvcache --section SpeedOfLight \\
        --section WarpStateStats --section SchedulerStats python dev/profile_paged_decode.py
    ncu --clock-control none -k regex:flash_fwd_kvcache --set full --import-source yes \\
        -o paged python dev/profile_paged_decode.py --layouts paged16-in-order paged256

Layouts: contiguous, paged16 (pages of 16 behind a random table), paged16-in-order (the same
pages in order: the contiguous cache's addresses), paged256 (pages of 256, random). The open
question of decode-v3: pages of 16 in order run 14% slower than pages of 256 at one CTA per SM
with the same code. bf16, d128, one query token, 8 x 32/8 heads at 32k keys, 2 splits unless
told. Needs a GPU.
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=(8, 32, 8, 32768), metavar=("B", "HQ", "HKV", "L"))
    ap.add_argument("--splits", type=int, default=2)
    ap.add_argument("--layouts", nargs="+", default=["contiguous", "paged16"],
                    choices=["contiguous", "paged16", "paged16-in-order", "paged256"])
    args = ap.parse_args(argv)
    import cupy

    from cupyflash.bench.kvcache_decode import _decode_inputs, _paged
    from cupyflash.kernels import kvcache_mma
    from cupyflash.masks import mask_for

    batch, hq, hkv, length = args.shape
    rng = np.random.default_rng(0)
    q, k, v, o, lse, seqlens, layouts = _decode_inputs(batch, hq, hkv, length, 128, rng)
    if "paged16-in-order" in args.layouts:
        pages = batch * length // 16
        layouts["paged16-in-order"] = (k.reshape((pages, 16) + k.shape[2:]), v.reshape((pages, 16) + v.shape[2:]),
                                       cupy.arange(pages, dtype=np.int32).reshape(batch, length // 16), 16, True)
    if "paged256" in args.layouts:
        pk, pv, table = _paged(k, v, 256, rng)
        layouts["paged256"] = (pk, pv, table, 256, True)
    for name in args.layouts:
        kc, vc, table, page, paged = layouts[name]
        splits = kvcache_mma.forward(q, kc, vc, o, lse, seqlens_k=seqlens, block_table=table, page_size=page,
                                     paged=paged, max_seqlen_k=length, softmax_scale=0.088, mask=mask_for(False),
                                     num_splits=args.splits)
        cupy.cuda.Device().synchronize()
        print(f"{name}: {splits} splits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
