"""Timing of ring attention against one GPU on the whole sequence (issue 19's bars).

    python -m cupyflash.distributed.bench --ranks 2 --seqlen 131072          # 2 GPUs over NCCL
    python -m cupyflash.distributed.bench --ranks 2 --seqlen 16384 --local   # one GPU, P "ranks"
    python -m cupyflash.distributed.bench --ranks 2 --window 4096 0           # a causal window

For each rank: forward + backward of the ring with the overlap (the next K/V and the dK/dV in
flight during each step), without it (``overlap=False``: each transfer waited for before the
step computes), and with no transfer at all (every step on the rank's own K/V: wrong results,
the compute alone); and, on rank 0, flash_attn_func + flash_attn_backward on the whole sequence.
Reported: the medians, the slowest rank's; scaling efficiency T_1 / (P · T_ring) (the one-GPU
time at the same per-GPU work, divided by the ring time); speedup T_1 / T_ring; the fraction of
the communication that the overlap hides, (T_serial - T_overlap) / (T_serial - T_compute); and
the largest difference of each rank's o, dq, dk, dv from the whole-sequence result's rows.

``--local`` runs the P ranks on one GPU (LocalRing over CuPy): they share its SMs, so it measures
the schedule's overhead and exercises the overlap machinery, not scaling.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from .._dtypes import SUPPORTED, parse_dtype_name
from .comm import Pending, RingComm


class _NoTransfer(RingComm):
    """A ring that talks to no other rank: each exchange copies the rank's own buffers into its
    receive buffers on the current stream (every step attends to the rank's own K/V again: the
    compute alone, plus a device copy per step; the results are wrong)."""

    class _Nothing(Pending):
        def wait(self) -> None:
            pass

    def __init__(self, comm):
        self.rank, self.size, self.xp = comm.rank, comm.size, comm.xp

    def start_exchange(self, send, recv) -> Pending:
        for s, r in zip(send, recv):
            r[...] = s
        return self._Nothing()


def _inputs(config, cupy):
    """q, k, v, do of the whole sequence, the same on every rank (one seed)."""
    rng = cupy.random.default_rng(config["seed"])
    dtype = SUPPORTED[config["dtype"]]
    shapes = [(config["batch"], config["seqlen"], h, config["headdim"])
              for h in (config["heads"], config["kv_heads"], config["kv_heads"], config["heads"])]
    return [rng.standard_normal(shape, dtype=np.float32).astype(dtype) for shape in shapes]


def _median_time(fn, repeats, barrier, cupy):
    """Median seconds of fn() on the current stream over ``repeats`` runs, after one warm-up,
    each run started together with the other ranks (``barrier``)."""
    fn()
    times = []
    for _ in range(repeats):
        barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


def _rank_bench(comm, config):
    """What every rank measures; returns a dict of plain numbers."""
    import cupy

    from .. import flash_attn_backward, flash_attn_func
    from .ring import ring_flash_attn_backward, ring_flash_attn_func
    from .sharding import contiguous_shard, zigzag_shard

    size, rank = comm.size, comm.rank
    masked = config["causal"] or tuple(config.get("window_size", (-1, -1))) != (-1, -1)
    layout = "zigzag" if masked else "contiguous"
    shard = zigzag_shard if layout == "zigzag" else contiguous_shard
    whole = _inputs(config, cupy)
    q, k, v, do = (cupy.ascontiguousarray(shard(x, size, rank)) for x in whole)
    variant = dict(window_size=tuple(config.get("window_size", (-1, -1))), softcap=config.get("softcap", 0.0))
    if config.get("alibi"):  # the ALiBi paper's slopes, 2^(-8 (h + 1) / heads)
        heads = config["heads"]
        variant["alibi_slopes"] = cupy.asarray(2.0 ** (-8.0 * np.arange(1, heads + 1) / heads), dtype=np.float32)
    options = dict(causal=config["causal"], layout=layout, **variant)
    marker, marker_in = cupy.zeros(1, np.float32), cupy.zeros(1, np.float32)

    def barrier():
        comm.start_exchange([marker], [marker_in]).wait()
        cupy.cuda.get_current_stream().synchronize()

    def ring(ring_comm, overlap):
        def run():
            o, lse = ring_flash_attn_func(q, k, v, comm=ring_comm, return_lse=True, overlap=overlap, **options)
            return o, ring_flash_attn_backward(do, q, k, v, o, lse, comm=ring_comm, overlap=overlap, **options)
        return run

    out = {"rank": rank}
    for name, ring_comm, overlap in (("overlap", comm, True), ("serial", comm, False),
                                     ("compute", _NoTransfer(comm), True)):
        out[name] = _median_time(ring(ring_comm, overlap), config["repeats"], barrier, cupy)
    o, (dq, dk, dv) = ring(comm, True)()
    if rank == 0 or config["check_every_rank"]:
        def single():
            o1, lse1 = flash_attn_func(*whole[:3], causal=config["causal"], return_lse=True, **variant)
            return o1, flash_attn_backward(whole[3], *whole[:3], o1, lse1, causal=config["causal"], **variant)
        if rank == 0:
            out["single"] = _median_time(single, config["repeats"], lambda: None, cupy)
        o1, (dq1, dk1, dv1) = single()
        for name, mine, ref in (("o", o, o1), ("dq", dq, dq1), ("dk", dk, dk1), ("dv", dv, dv1)):
            ref = shard(ref, size, rank).astype(np.float32)
            diff = cupy.abs(mine.astype(np.float32) - ref)
            out[f"{name}_max_abs_diff"] = float(diff.max())
            out[f"{name}_rel_fro_diff"] = float(cupy.linalg.norm(diff) / cupy.linalg.norm(ref))
    return out


def _local_bench(config):
    """The ranks of a LocalRing on one GPU, each as _rank_bench (their barrier is an exchange)."""
    import cupy

    from .comm import LocalRing

    return LocalRing(config["ranks"], cupy).run(lambda comm: _rank_bench(comm, config))


def summary(results, ranks: int) -> dict:
    slowest = {name: max(r[name] for r in results) for name in ("overlap", "serial", "compute")}
    single = results[0]["single"]
    hidden = ((slowest["serial"] - slowest["overlap"]) / (slowest["serial"] - slowest["compute"])
              if slowest["serial"] > slowest["compute"] else float("nan"))
    return {"ring_s": slowest["overlap"], "ring_serial_s": slowest["serial"], "ring_compute_s": slowest["compute"],
            "single_s": single, "efficiency": single / (ranks * slowest["overlap"]),
            "speedup": single / slowest["overlap"], "communication_hidden": hidden}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash.distributed.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=131072, help="the whole sequence (default 2 x 64k)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--full", action="store_true", help="no causal mask (default: causal, zigzag)")
    parser.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                        help="flash-attn's window_size on the whole sequence (default: none)")
    parser.add_argument("--softcap", type=float, default=0.0)
    parser.add_argument("--alibi", action="store_true", help="ALiBi slopes (the ALiBi paper's, per head)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--local", action="store_true", help="every rank on one GPU (LocalRing)")
    parser.add_argument("--check-every-rank", action="store_true",
                        help="every rank compares its rows with the whole sequence (default: rank 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the results there")
    args = parser.parse_args(argv)
    config = dict(ranks=args.ranks, seqlen=args.seqlen, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                  headdim=args.headdim, dtype=parse_dtype_name(args.dtype), causal=not args.full,
                  repeats=args.repeats, seed=0, check_every_rank=args.check_every_rank, window_size=list(args.window),
                  softcap=args.softcap, alibi=args.alibi)
    started = time.monotonic()
    if args.local:
        results = _local_bench(config)
    else:
        from .launch import launch

        results = launch(_rank_bench, args.ranks, args=(config,), timeout=3600)
    report = {"config": config, "local": args.local, "ranks": results, "summary": summary(results, args.ranks),
              "wall_s": time.monotonic() - started}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    s = report["summary"]
    print(f"ring {s['ring_s'] * 1e3:.1f} ms (serial {s['ring_serial_s'] * 1e3:.1f}, compute "
          f"{s['ring_compute_s'] * 1e3:.1f}), one GPU {s['single_s'] * 1e3:.1f} ms: efficiency "
          f"{s['efficiency']:.3f}, speedup {s['speedup']:.2f}x, communication hidden {s['communication_hidden']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
