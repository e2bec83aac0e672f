"""Decode bandwidth of flash_attn_with_kvcache's kernel (issue 17's bar), against cuDNN and
FlashAttention-2 through torch SDPA and a device-to-device copy, all in one run:

    python -m cupyflash.bench.kvcache_decode [--json FILE] [--plot PNG] [--quick]
    python -m cupyflash.bench.kvcache_decode --from-json FILE [--plot PNG]   (no GPU needed)
    python -m cupyflash.bench.kvcache_decode --tune   (the tile candidates)
    python -m cupyflash.bench.kvcache_decode --splits (num_splits swept where cuDNN is ahead)

One query token per sequence, bf16, d128, every sequence at the full length. For each shape
(batch x query heads / kv heads at kv_len): cupyflash's kernel over a contiguous cache and over
paged caches of 16 and 256 tokens per page (the same keys behind a random block table), the
split count its heuristic picks; SDPA's cuDNN and flash backends on (B, H, S, D) views of a
(B, S, H, D) cache, enable_gqa for GQA. The figure of merit is K+V bytes over the device time
of the kernels of one step (the cupyflash split combine included); the copy counts bytes read
plus written. The end-to-end time of flash_attn_with_kvcache from Python (argument checks,
index arrays read to the host, launches) is reported next to it.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from .timing import RepeatPolicy, time_region

SHAPES = ((8, 32, 32, 32768), (8, 32, 8, 32768), (1, 32, 8, 131072), (64, 32, 8, 4096))
HEADDIM = 128
POLICY = RepeatPolicy(warmup=3, target_s=0.2, min_repeats=10, max_repeats=50)


def _copy_tbps(stream, nbytes=2 * 2**30) -> float:
    import cupy

    src = cupy.empty(nbytes, cupy.uint8)
    src.fill(0xA5)
    dst = cupy.empty_like(src)
    timing = time_region(lambda _: dst.data.copy_from_device_async(src.data, nbytes, stream), 1, policy=POLICY,
                         stream=stream)
    return 2 * nbytes / timing.median_ms / 1e9


def _paged(k, v, page_size, rng):
    """The same keys and values as pools of pages behind one random block table: (k pages, v pages,
    table)."""
    import cupy

    batch, length = k.shape[:2]
    per_seq = -(-length // page_size)
    order = cupy.asarray(rng.permutation(batch * per_seq))
    pools = []
    for cache in (k, v):
        padded = cupy.zeros((batch, per_seq * page_size) + cache.shape[2:], cache.dtype)
        padded[:, :length] = cache
        pool = cupy.empty((batch * per_seq, page_size) + cache.shape[2:], cache.dtype)
        pool[order] = padded.reshape((batch * per_seq, page_size) + cache.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], order.reshape(batch, per_seq).astype(np.int32)


def measure(shapes=SHAPES, headdim=HEADDIM, quick=False) -> dict:
    import cupy
    import ml_dtypes

    from ..kernels import kvcache_mma
    from ..masks import mask_for
    from .. import flash_attn_with_kvcache

    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    dtype = ml_dtypes.bfloat16
    rows = []
    with stream:
        copy = _copy_tbps(stream)
        torch = None
        try:
            import torch
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:
            torch = None
        for batch, hq, hkv, length in shapes:
            row = {"batch": batch, "nheads": hq, "nheads_kv": hkv, "kv_len": length, "headdim": headdim}
            kv_bytes = 2 * batch * length * hkv * headdim * 2
            q = cupy.asarray(rng.standard_normal((batch, 1, hq, headdim), np.float32)).astype(dtype)
            k = cupy.asarray(rng.standard_normal((batch, length, hkv, headdim), np.float32)).astype(dtype)
            v = cupy.asarray(rng.standard_normal((batch, length, hkv, headdim), np.float32)).astype(dtype)
            o = cupy.empty_like(q)
            lse = cupy.empty((batch, hq, 1), np.float32)
            seqlens = cupy.full(batch, length, np.int32)
            scale = 1.0 / np.sqrt(headdim)
            mask = mask_for(False)
            layouts = {"contiguous": (k, v, cupy.arange(batch, dtype=np.int32).reshape(batch, 1), length, False)}
            for page in (16, 256):
                pk, pv, table = _paged(k, v, page, rng)
                layouts[f"paged{page}"] = (pk, pv, table, page, True)
            for name, (kc, vc, table, page_size, paged) in layouts.items():
                splits = []

                def run(_):
                    splits.append(kvcache_mma.forward(q, kc, vc, o, lse, seqlens_k=seqlens, block_table=table,
                                                      page_size=page_size, paged=paged, max_seqlen_k=length,
                                                      softmax_scale=scale, mask=mask))
                timing = time_region(run, 1, policy=POLICY, stream=stream)
                row[f"cupyflash_{name}_tbps"] = kv_bytes / timing.median_ms / 1e9
                row[f"cupyflash_{name}_ms"] = timing.median_ms
                row[f"num_splits_{name}"] = splits[-1]
                del kc, vc
            row["num_splits"] = row["num_splits_contiguous"]  # the table's column
            # the whole API call from Python, contiguous cache (host checks and syncs included)
            cache_seqlens = cupy.full(batch, length, np.int32)
            flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens)
            stream.synchronize()
            n = 5 if quick else 20
            t0 = time.perf_counter()
            for _ in range(n):
                flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens)
            stream.synchronize()
            row["api_ms"] = (time.perf_counter() - t0) / n * 1e3
            if torch is not None:
                ts = torch.cuda.ExternalStream(stream.ptr)
                with torch.cuda.stream(ts):
                    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
                    kwargs = {"enable_gqa": True} if hq != hkv else {}
                    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                        try:
                            with sdpa_kernel([backend]):
                                F.scaled_dot_product_attention(tq, tk, tv, **kwargs)

                                def run_torch(_):
                                    F.scaled_dot_product_attention(tq, tk, tv, **kwargs)
                                timing = time_region(run_torch, 1, policy=POLICY, stream=stream)
                            row[f"{label}_tbps"] = kv_bytes / timing.median_ms / 1e9
                        except Exception as exc:  # a backend that rejects the shape
                            row[f"{label}_tbps"] = None
                            row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            del q, k, v, layouts
            cupy.get_default_memory_pool().free_all_blocks()
    return {"copy_tbps": copy, "rows": rows}


TUNE_TILES = ((1, 1, 32, 4), (1, 4, 64, 2), (1, 4, 64, 3), (1, 2, 32, 4), (1, 8, 128, 2), (1, 4, 128, 2),
              (1, 2, 64, 3))


def _compile_one(spec):
    from ..kernels._module import get_function

    get_function(spec)


def _compile_all(specs) -> None:
    """Into CuPy's disk cache on every core (NVRTC is CPU-bound), before anything is timed."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_one, specs))


def _decode_inputs(batch, hq, hkv, length, headdim, rng):
    """One decode step's bf16 q, k, v, its o and lse buffers, every sequence's length, and the
    layouts the sweeps time: {name: (k cache, v cache, table, page size, paged)}, a contiguous
    cache and the same keys in pages of 16 tokens."""
    import cupy
    import ml_dtypes

    q = cupy.asarray(rng.standard_normal((batch, 1, hq, headdim), np.float32)).astype(ml_dtypes.bfloat16)
    k = cupy.asarray(rng.standard_normal((batch, length, hkv, headdim), np.float32)).astype(q.dtype)
    v = cupy.asarray(rng.standard_normal((batch, length, hkv, headdim), np.float32)).astype(q.dtype)
    o, lse = cupy.empty_like(q), cupy.empty((batch, hq, 1), np.float32)
    seqlens = cupy.full(batch, length, np.int32)
    pk, pv, table = _paged(k, v, 16, rng)
    layouts = {"contiguous": (k, v, cupy.arange(batch, dtype=np.int32).reshape(batch, 1), length, False),
               "paged16": (pk, pv, table, 16, True)}
    return q, k, v, o, lse, seqlens, layouts


def tune(shapes=SHAPES, headdim=HEADDIM, candidates=TUNE_TILES) -> list:
    """K+V bandwidth of each candidate CacheTiles over a contiguous cache and a page-16 cache,
    the heuristic's split count for each: [(tiles, shape, layout, splits, TB/s)]."""
    import cupy
    import ml_dtypes

    from ..kernels import kvcache_mma
    from ..masks import mask_for

    _compile_all([kvcache_mma.specialization(ml_dtypes.bfloat16, headdim, mask_for(False), kvcache_mma.CacheTiles(*t),
                                             paged, split)
                  for t in candidates for paged in (False, True) for split in (False, True)])
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    out = []
    with stream:
        for batch, hq, hkv, length in shapes:
            kv_bytes = 2 * batch * length * hkv * headdim * 2
            q, k, v, o, lse, seqlens, layouts = _decode_inputs(batch, hq, hkv, length, headdim, rng)
            for t in candidates:
                tiles = kvcache_mma.CacheTiles(*t)
                for name, (kc, vc, tab, page, paged) in layouts.items():
                    splits = []

                    def run(_):
                        splits.append(kvcache_mma.forward(q, kc, vc, o, lse, seqlens_k=seqlens, block_table=tab,
                                                          page_size=page, paged=paged, max_seqlen_k=length,
                                                          softmax_scale=0.088, mask=mask_for(False), tiles=tiles))
                    try:
                        timing = time_region(run, 1, policy=POLICY, stream=stream)
                    except Exception as exc:
                        print(f"{t} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    tbps = kv_bytes / timing.median_ms / 1e9
                    out.append((t, (batch, hq, hkv, length), name, splits[-1], tbps))
                    print(f"{t} {batch}x{hq}/{hkv}@{length} {name}: splits {splits[-1]} {tbps:.2f} TB/s", flush=True)
            del q, k, v, layouts
            cupy.get_default_memory_pool().free_all_blocks()
    return out


def _split_counts(row: dict) -> str:
    """The split counts of the row's three layouts; a row of older JSON kept one count, the last
    layout's (page 256), and says so."""
    counts = [row.get(f"num_splits_{n}") for n in ("contiguous", "paged16", "paged256")]
    return f"- / - / {row['num_splits']}" if None in counts else " / ".join(map(str, counts))


def table(result: dict) -> str:
    copy = result["copy_tbps"]
    lines = [f"device-to-device copy: {copy:.2f} TB/s (read + write)", "",
             "| shape (B x Hq/Hkv @ L) | splits (contig / p16 / p256) | cupyflash contiguous | paged 16 | paged 256 | cuDNN | FA2 | "
             "×cuDNN | % copy | paged16/contig | paged256/contig | API call ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c, p16, p256 = (r[f"cupyflash_{n}_tbps"] for n in ("contiguous", "paged16", "paged256"))
        cudnn, fa2 = r.get("cudnn_tbps"), r.get("fa2_tbps")
        fmt = lambda x: "—" if x is None else f"{x:.2f}"
        lines.append(f"| {r['batch']} x {r['nheads']}/{r['nheads_kv']} @ {r['kv_len']} | {_split_counts(r)} | "
                     f"{c:.2f} | {p16:.2f} | {p256:.2f} | {fmt(cudnn)} | {fmt(fa2)} | "
                     f"{'—' if not cudnn else f'{c / cudnn:.2f}'} | {100 * c / copy:.0f}% | {p16 / c:.3f} | "
                     f"{p256 / c:.3f} | {r['api_ms']:.3f} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Bars of K+V read bandwidth per shape: cupyflash (contiguous, pages of 16 and 256), cuDNN,
    FA2, with the copy bandwidth as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    series = [("cupyflash contiguous", "cupyflash_contiguous_tbps"), ("cupyflash paged 16", "cupyflash_paged16_tbps"),
              ("cupyflash paged 256", "cupyflash_paged256_tbps"), ("cuDNN (SDPA)", "cudnn_tbps"),
              ("FA2 (SDPA)", "fa2_tbps")]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, (label, key) in enumerate(series):
        values = [r.get(key) or 0.0 for r in rows]
        ax.bar([x + (i - len(series) / 2 + 0.5) * width for x in range(len(rows))], values, width, label=label)
    ax.axhline(result["copy_tbps"], color="black", linestyle="--", linewidth=1,
               label=f"device copy {result['copy_tbps']:.2f} TB/s (read + write)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['batch']} x {r['nheads']}/{r['nheads_kv']}\n{r['kv_len'] // 1024}k keys" for r in rows])
    ax.set_ylabel("K+V read bandwidth, TB/s")
    ax.set_title(f"Decode, one query token, bf16, d{rows[0]['headdim']} (H200)")
    ax.set_ylim(0, 1.2 * max(result["copy_tbps"], max(r.get("cupyflash_contiguous_tbps") or 0 for r in rows)))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SPLIT_SHAPES = ((8, 32, 8, 32768), (1, 32, 8, 131072))
SPLIT_COUNTS = (0, 2, 4, 6, 8, 12, 16, 24, 32, 33, 48, 64, 96, 128)


def split_sweep(shapes=SPLIT_SHAPES, counts=SPLIT_COUNTS, headdim=HEADDIM) -> list:
    """K+V bandwidth of the KV-cache kernel over a contiguous cache and a page-16 cache at each
    requested num_splits (0: the heuristic's), cuDNN's through SDPA in the same run:
    [(shape, layout, requested, splits run, TB/s)]."""
    import cupy

    from ..kernels import kvcache_mma
    from ..masks import mask_for

    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    out = []
    with stream:
        for batch, hq, hkv, length in shapes:
            kv_bytes = 2 * batch * length * hkv * headdim * 2
            q, k, v, o, lse, seqlens, layouts = _decode_inputs(batch, hq, hkv, length, headdim, rng)
            for name, (kc, vc, tab, page, paged) in layouts.items():
                for requested in counts:
                    splits = []

                    def run(_):
                        splits.append(kvcache_mma.forward(q, kc, vc, o, lse, seqlens_k=seqlens, block_table=tab,
                                                          page_size=page, paged=paged, max_seqlen_k=length,
                                                          softmax_scale=0.088, mask=mask_for(False),
                                                          num_splits=requested))
                    timing = time_region(run, 1, policy=POLICY, stream=stream)
                    tbps = kv_bytes / timing.median_ms / 1e9
                    out.append(((batch, hq, hkv, length), name, requested, splits[-1], tbps))
                    print(f"{batch}x{hq}/{hkv} {length} {name}: num_splits={requested} ran {splits[-1]}: "
                          f"{tbps:.2f} TB/s", flush=True)
            del layouts
            try:
                import torch
                import torch.nn.functional as F
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
                    timing = time_region(lambda _: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True), 1,
                                         policy=POLICY, stream=stream)
                print(f"{batch}x{hq}/{hkv} {length}: cuDNN {kv_bytes / timing.median_ms / 1e9:.2f} TB/s", flush=True)
            except Exception as exc:  # no torch, or cuDNN refuses
                print(f"cuDNN: {type(exc).__name__}: {str(exc)[:120]}")
            del q, k, v
            cupy.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tune", action="store_true", help="the candidate tiles (TUNE_TILES) instead")
    parser.add_argument("--splits", action="store_true",
                        help="num_splits swept on the shapes below cuDNN (SPLIT_SHAPES, SPLIT_COUNTS) instead")
    parser.add_argument("--from-json", help="print the table (and --plot) of an earlier run's --json file")
    parser.add_argument("--plot", help="write the bandwidth bars here (PNG)")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        print(table(result))
        if args.plot:
            plot(result, args.plot)
        return 0
    if args.tune:
        tune()
        return 0
    if args.splits:
        split_sweep()
        return 0
    result = measure(quick=args.quick)
    print(table(result))
    if args.plot:
        plot(result, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
