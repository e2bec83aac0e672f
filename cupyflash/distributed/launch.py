"""A process launcher for tests and examples, without torch: one process per GPU.

    from cupyflash.distributed import launch

    def work(comm, q_shards):                 # module level: the processes import it by name
        return ring_flash_attn_func(q_shards[comm.rank], ...)

    results = launch(work, 2, args=(q_shards,))   # [rank 0's result, rank 1's result]

``launch`` starts ``nprocs`` processes with multiprocessing's "spawn" (a CUDA context must not be
forked), one pipe each. Rank r uses GPU ``devices[r]`` (default r). Rank 0 makes the NCCL unique
id and sends it up its pipe; the parent passes it down the others'; every rank then joins the
NCCL communicator and calls ``fn(comm, *args)``. Results come back through the pipes, CuPy arrays
as NumPy (anything else must pickle). If a rank fails, the others are terminated and its
traceback is raised as a RuntimeError.

``make_comm(unique_id, rank, size)`` and ``make_unique_id()`` replace the NCCL defaults (module-
level callables): the CPU tests use them to check the plumbing without a GPU.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
import traceback

__all__ = ["launch", "nccl_unique_id", "nccl_comm"]


def nccl_unique_id():
    """A new NCCL unique id (a tuple of ints; picklable)."""
    from .comm import nccl_module

    return nccl_module().get_unique_id()


def nccl_comm(unique_id, rank: int, size: int):
    """The NcclRingComm of ``rank`` on the current device (collective)."""
    from .comm import NcclRingComm

    return NcclRingComm.from_unique_id(unique_id, rank, size)


def _to_host(x):
    """x with CuPy arrays replaced by NumPy ones (inside tuples, lists, dicts)."""
    if isinstance(x, (tuple, list)):
        return type(x)(_to_host(e) for e in x)
    if isinstance(x, dict):
        return {key: _to_host(e) for key, e in x.items()}
    if type(x).__module__.split(".")[0] == "cupy" and hasattr(x, "get"):
        return x.get()
    return x


def _rank_main(rank, size, device, conn, fn, args, make_comm, make_unique_id):
    try:
        if device is not None:
            import cupy

            cupy.cuda.Device(device).use()
        if rank == 0:
            unique_id = make_unique_id()
            conn.send(("unique_id", unique_id))
        else:
            tag, unique_id = conn.recv()
            assert tag == "unique_id", tag
        comm = make_comm(unique_id, rank, size)
        result = fn(comm, *args)
        if device is not None:
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        conn.send(("result", _to_host(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        conn.close()


def launch(fn, nprocs: int, args=(), *, devices=None, timeout: float = 600.0, make_comm=nccl_comm,
           make_unique_id=nccl_unique_id, use_gpu: bool = True):
    """[fn(comm, *args) of rank 0, ..., of rank nprocs - 1], each in a process of its own.

    ``devices``: the GPU of each rank (default: rank r on GPU r); ``use_gpu=False`` selects none
    (the CPU tests). ``timeout``: seconds for the whole run, after which every rank is terminated.
    """
    if nprocs < 1:
        raise ValueError(f"launch: nprocs must be >= 1, got {nprocs}")
    devices = list(range(nprocs)) if devices is None else list(devices)
    if len(devices) != nprocs:
        raise ValueError(f"launch: {nprocs} ranks but {len(devices)} devices")
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(nprocs)]
    processes = [context.Process(target=_rank_main, name=f"cupyflash-rank-{rank}",
                                 args=(rank, nprocs, devices[rank] if use_gpu else None, child, fn, tuple(args),
                                       make_comm, make_unique_id))
                 for rank, (_, child) in enumerate(pipes)]
    for process in processes:
        process.start()
    for _, child in pipes:
        child.close()  # the parent keeps only its ends: a rank that dies shows as EOF
    results: list = [None] * nprocs
    deadline = time.monotonic() + timeout
    try:
        ours = [parent for parent, _ in pipes]
        waiting = set(range(nprocs))
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"launch: ranks {sorted(waiting)} did not finish within {timeout} s")
            ready = multiprocessing.connection.wait([ours[r] for r in waiting], timeout=remaining)
            for conn in ready:
                rank = ours.index(conn)
                try:
                    tag, payload = conn.recv()
                except EOFError:
                    raise RuntimeError(f"launch: rank {rank} exited without a result "
                                       f"(exit code {processes[rank].exitcode})") from None
                if tag == "unique_id":  # rank 0's, for everyone else
                    for other in range(1, nprocs):
                        ours[other].send(("unique_id", payload))
                elif tag == "error":
                    raise RuntimeError(f"launch: {payload}")
                else:
                    results[rank] = payload
                    waiting.discard(rank)
    except BaseException:
        for process in processes:
            if process.is_alive():
                process.terminate()
        raise
    finally:
        for process in processes:
            process.join(timeout=30)
        for parent, _ in pipes:
            parent.close()
    return results
