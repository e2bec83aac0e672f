"""Where a split-KV decode step's time goes: a fixed cost and a streaming rate, fitted from
several cache lengths of one shape, for cupyflash's step, its two kernels apart, and cuDNN.

    python dev/decode_fixed_cost.py [--json FILE]

For each shape (batch x query heads / kv heads, bf16, d128, one query token) and each cache
length L, the device time (CUDA events, median, bench.timing.time_region) of
- the whole step (flash_attn_with_kvcache's kernel and the split combine, the heuristic's splits),
- its first kernel alone and the combine alone (the launches of one recorded step, replayed),
- the step over paged caches: 16-token pages at the paged heuristic's split count, and at the
  contiguous step's count 16-token pages behind a random table, the same pages in order, and
  256-token pages behind a random table,
- cuDNN through SDPA (enable_gqa).
A least-squares line time = fixed + bytes / rate over the lengths separates what a step pays
once (launch, pipeline fill, the last CTAs' tail, the combine) from what it pays per K+V byte.
Needs a GPU; the issue-17 question it answers is perf log "decode-fixed-cost".
"""
from __future__ import annotations

import argparse
import json

import numpy as np

# (batch, query heads, kv heads): cache lengths (the bar's shapes are 1 x 32/8 at 128k and 8 x 32/8 at 32k)
SHAPES = {(1, 32, 8): (32768, 65536, 131072, 262144), (8, 32, 8): (4096, 8192, 16384, 32768)}
HEADDIM = 128


def _fit(xs, ys):
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def measure(shapes=SHAPES) -> list:
    import cupy
    import ml_dtypes

    from cupyflash.bench.kvcache_decode import POLICY, _paged
    from cupyflash.bench.timing import time_region
    from cupyflash.kernels import kvcache_mma
    from cupyflash.masks import mask_for

    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    dtype = ml_dtypes.bfloat16
    mask = mask_for(False)
    rows = []
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    with stream:
        for (batch, hq, hkv), lengths in shapes.items():
            for length in lengths:
                kv_bytes = 2 * batch * length * hkv * HEADDIM * 2
                q, k, v = (cupy.random.standard_normal(shape, np.float32).astype(dtype)
                           for shape in ((batch, 1, hq, HEADDIM), (batch, length, hkv, HEADDIM),
                                         (batch, length, hkv, HEADDIM)))
                o, lse = cupy.empty_like(q), cupy.empty((batch, hq, 1), np.float32)
                seqlens = cupy.full(batch, length, np.int32)
                table = cupy.arange(batch, dtype=np.int32).reshape(batch, 1)
                scale = 1.0 / np.sqrt(HEADDIM)
                row = {"batch": batch, "nheads": hq, "nheads_kv": hkv, "kv_len": length, "kv_bytes": kv_bytes}

                def step(_, kc=k, vc=v, tab=table, page=length, paged=False):
                    return kvcache_mma.forward(q, kc, vc, o, lse, seqlens_k=seqlens, block_table=tab, page_size=page,
                                               paged=paged, max_seqlen_k=length, softmax_scale=scale, mask=mask)
                row["step_us"] = time_region(step, 1, policy=POLICY, stream=stream).median_ms * 1e3

                # One step's launches, recorded with the buffers they point at kept alive, then
                # each replayed alone.
                launches, kept = [], []
                real_launch, real_empty, real_full = kvcache_mma.launch, cupy.empty, cupy.full
                kvcache_mma.launch = lambda spec, grid, args: (launches.append((spec, grid, args)),
                                                                real_launch(spec, grid, args))
                cupy.empty = lambda *a, **kw: kept.append(real_empty(*a, **kw)) or kept[-1]
                cupy.full = lambda *a, **kw: kept.append(real_full(*a, **kw)) or kept[-1]
                try:
                    row["num_splits"] = step(0)
                finally:
                    kvcache_mma.launch, cupy.empty, cupy.full = real_launch, real_empty, real_full
                for name, (spec, grid, args) in zip(("main_us", "combine_us"), launches):
                    row[name] = time_region(lambda _: real_launch(spec, grid, args), 1, policy=POLICY,
                                            stream=stream).median_ms * 1e3
                row["main_ctas"] = int(np.prod(launches[0][1]))

                # Paged caches: the paged heuristic's splits, then at the contiguous step's split
                # count in three layouts: pages of 16 behind a random table, the same pages in
                # order (a page-16 step that reads memory as the contiguous one does: what is
                # left is the per-row lookup), and pages of 256 behind a random table.
                splits = row["num_splits"]

                def paged_step(i, kc, vc, tab, page, num_splits=0):
                    return kvcache_mma.forward(q, kc, vc, o, lse, seqlens_k=seqlens, block_table=tab, page_size=page,
                                               paged=True, max_seqlen_k=length, softmax_scale=scale, mask=mask,
                                               num_splits=num_splits)
                pk, pv, ptab = _paged(k, v, 16, rng)
                row["paged16_step_us"] = time_region(lambda i: paged_step(i, pk, pv, ptab, 16), 1, policy=POLICY,
                                                     stream=stream).median_ms * 1e3
                row["paged16_same_splits_us"] = time_region(lambda i: paged_step(i, pk, pv, ptab, 16, splits), 1,
                                                            policy=POLICY, stream=stream).median_ms * 1e3
                del pk, pv, ptab
                in_order = cupy.arange(batch * length // 16, dtype=np.int32).reshape(batch, length // 16)
                ok, ov = (c.reshape((batch * length // 16, 16) + c.shape[2:]) for c in (k, v))
                row["paged16_in_order_us"] = time_region(lambda i: paged_step(i, ok, ov, in_order, 16, splits), 1,
                                                         policy=POLICY, stream=stream).median_ms * 1e3
                pk, pv, ptab = _paged(k, v, 256, rng)
                row["paged256_same_splits_us"] = time_region(lambda i: paged_step(i, pk, pv, ptab, 256, splits), 1,
                                                             policy=POLICY, stream=stream).median_ms * 1e3
                del pk, pv, ptab
                if torch is not None:
                    ts = torch.cuda.ExternalStream(stream.ptr)
                    with torch.cuda.stream(ts), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
                        gqa = {"enable_gqa": True} if hq != hkv else {}
                        F.scaled_dot_product_attention(tq, tk, tv, **gqa)
                        row["cudnn_us"] = time_region(lambda _: F.scaled_dot_product_attention(tq, tk, tv, **gqa), 1,
                                                      policy=POLICY, stream=stream).median_ms * 1e3
                print(json.dumps(row), flush=True)
                rows.append(row)
                del q, k, v, launches, kept
                cupy.get_default_memory_pool().free_all_blocks()
    return rows


def report(rows) -> str:
    out = []
    for shape in sorted({(r["batch"], r["nheads"], r["nheads_kv"]) for r in rows}):
        sel = [r for r in rows if (r["batch"], r["nheads"], r["nheads_kv"]) == shape]
        out.append(f"{shape[0]} x {shape[1]}/{shape[2]}: fixed cost (us) and streaming rate (TB/s) over "
                   f"L = {', '.join(str(r['kv_len']) for r in sel)}")
        for key in ("step_us", "main_us", "combine_us", "paged16_step_us", "paged16_same_splits_us",
                    "paged16_in_order_us", "paged256_same_splits_us", "cudnn_us"):
            if not all(key in r for r in sel):
                continue
            fixed, per_byte = _fit([r["kv_bytes"] for r in sel], [r[key] for r in sel])
            rate = 1e-6 / per_byte if per_byte > 0 else float("inf")
            times = " ".join(f"{r[key]:.1f}" for r in sel)
            out.append(f"  {key:16s} fixed {fixed:6.1f}  rate {rate:5.2f}   times {times}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = measure()
    print(report(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
