"""The per-step time of a decode loop from Python: a 32-layer model's attention calls, each
appending one token to its layer's KV cache and attending over it (issue 17's decode-loop item).

    python -m cupyflash.bench.decode_loop [--json FILE] [--quick]

A step is, for every layer, flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
cache_seqlens=seqlens, causal=True), then seqlens += 1 on the device. Three ways to run it:

    checked       the default call: cache_seqlens read back to the host for the checks, one
                  synchronisation per call (32 per step);
    no_host_sync  the same calls inside cupyflash.no_host_sync(): nothing read back, the launches
                  queue ahead of the GPU (flash-attn's behaviour);
    graph         the step captured once in a cupy.cuda.Graph and replayed (cupyflash.capture).

Reported per step: wall time from Python over ``steps`` consecutive steps (launch overhead
included, the GPU drained at the end) and, for the graph, the device time of a replay (CUDA
events); the K+V bytes a step reads over that time; and the floor of the step, those bytes at the
same run's device-to-device copy bandwidth. bf16, d128, 32 query heads over 8 kv heads.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

LAYERS = 32
HEADS, HEADS_KV, HEADDIM = 32, 8, 128
# (batch, cached tokens at the first step, cache capacity per sequence, page size or None)
CASES = ((1, 4096, 8192, None), (8, 4096, 8192, None), (8, 4096, 8192, 16), (64, 1024, 2048, None))


def _copy_tbps(cupy, stream, nbytes=1 << 30) -> float:
    src = cupy.empty(nbytes, cupy.uint8)
    src.fill(0x5A)
    dst = cupy.empty_like(src)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(8):
        start.record(stream)
        dst.data.copy_from_device_async(src.data, nbytes, stream)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return 2 * nbytes / float(np.median(times[2:])) / 1e9


class _Model:
    """The caches, the step's inputs and the lengths of one case, on the device."""

    def __init__(self, cupy, batch, cached, capacity, page, rng):
        import ml_dtypes

        bf16 = ml_dtypes.bfloat16
        self.cupy, self.batch, self.page = cupy, batch, page
        if page is None:
            shape = (batch, capacity, HEADS_KV, HEADDIM)
            self.table = None
        else:
            pages = batch * capacity // page
            shape = (pages, page, HEADS_KV, HEADDIM)
            self.table = cupy.asarray(rng.permutation(pages).reshape(batch, capacity // page).astype(np.int32))
        # Random values once per layer pair of caches (normal draws of 8 GB would dominate the run).
        self.caches = []
        for _ in range(LAYERS):
            pair = []
            for _ in range(2):
                c = cupy.empty(shape, bf16)
                c.view(cupy.uint16)[...] = cupy.random.randint(0x3C00, 0x3F80, size=shape, dtype=cupy.uint16)
                pair.append(c)
            self.caches.append(pair)
        self.q = cupy.asarray(rng.standard_normal((LAYERS, batch, 1, HEADS, HEADDIM)).astype(bf16))
        self.kv = cupy.asarray(rng.standard_normal((LAYERS, 2, batch, 1, HEADS_KV, HEADDIM)).astype(bf16))
        self.start = cached
        self.seqlens = cupy.full(batch, cached, np.int32)

    def step(self):
        from .. import flash_attn_with_kvcache

        out = None
        for layer in range(LAYERS):
            k_cache, v_cache = self.caches[layer]
            out = flash_attn_with_kvcache(self.q[layer], k_cache, v_cache, self.kv[layer, 0], self.kv[layer, 1],
                                          cache_seqlens=self.seqlens, block_table=self.table, causal=True)
        self.seqlens += 1
        return out

    def reset(self):
        self.seqlens.fill(self.start)

    def step_bytes(self, length: int) -> int:
        """K + V bytes the step's calls read at sequences of ``length`` tokens."""
        return LAYERS * 2 * self.batch * length * HEADS_KV * HEADDIM * 2


def _wall_ms(cupy, run, steps: int) -> float:
    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    cupy.cuda.get_current_stream().synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def measure(cases=CASES, steps: int = 40) -> dict:
    import cupy

    from .. import no_host_sync
    from .environment import collect

    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    with stream:
        copy = _copy_tbps(cupy, stream)
        for batch, cached, capacity, page in cases:
            model = _Model(cupy, batch, cached, capacity, page, rng)
            model.step()  # compiles and loads every kernel the step launches
            row = {"batch": batch, "cached": cached, "capacity": capacity, "page_size": page, "layers": LAYERS,
                   "heads": HEADS, "heads_kv": HEADS_KV, "headdim": HEADDIM, "steps": steps}
            model.reset()
            row["checked_ms"] = _wall_ms(cupy, model.step, steps)
            model.reset()
            with no_host_sync():
                row["no_host_sync_ms"] = _wall_ms(cupy, model.step, steps)
            model.reset()
            stream.begin_capture()
            try:
                model.step()
            finally:
                graph = stream.end_capture()
            model.reset()
            row["graph_ms"] = _wall_ms(cupy, lambda: graph.launch(stream), steps)
            model.reset()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            device = []
            for _ in range(steps):
                start.record(stream)
                graph.launch(stream)
                end.record(stream)
                end.synchronize()
                device.append(cupy.cuda.get_elapsed_time(start, end))
            row["graph_device_ms"] = float(np.median(device))
            mean_length = cached + steps / 2 + 1
            nbytes = model.step_bytes(int(mean_length))
            row["step_bytes"] = nbytes
            row["graph_device_tbps"] = nbytes / row["graph_device_ms"] / 1e9
            row["floor_ms"] = nbytes / copy / 1e9
            rows.append(row)
            del model, graph
            cupy.get_default_memory_pool().free_all_blocks()
    return {"copy_tbps": copy, "rows": rows, "environment": collect()}


def table(result: dict) -> str:
    lines = [f"Decode loop, {LAYERS} layers, bf16 d{HEADDIM}, {HEADS}/{HEADS_KV} heads, one token per step; "
             f"copy {result['copy_tbps']:.2f} TB/s",
             "",
             "| batch | cached | cache | checked ms/step | no_host_sync ms/step | graph ms/step | graph device ms "
             "| K+V TB/s | floor ms |",
             "|---:|---:|:---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        cache = "contiguous" if r["page_size"] is None else f"paged {r['page_size']}"
        lines.append(f"| {r['batch']} | {r['cached']} | {cache} | {r['checked_ms']:.3f} | {r['no_host_sync_ms']:.3f} "
                     f"| {r['graph_ms']:.3f} | {r['graph_device_ms']:.3f} | {r['graph_device_tbps']:.2f} "
                     f"| {r['floor_ms']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="the first two cases, 10 steps")
    args = parser.parse_args(argv)
    result = measure(CASES[:2], steps=10) if args.quick else measure()
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
