"""Communicators of the ring: what the schedule in ``ring.py`` needs, and three implementations.

The schedule needs one operation: *exchange* — send some arrays to the next rank of the ring and
receive arrays of the same shapes from the previous one — started without blocking, and waited
on later, so that the transfer of the next step's K/V runs while this step's attention computes.

    pending = comm.start_exchange(send=[k, v], recv=[k_next, v_next])
    ...                                  # compute; send buffers are only read, recv not touched
    pending.wait()                       # recv holds the previous rank's arrays; send is free

Rules every implementation keeps, and the schedule relies on: every rank starts the same
exchanges in the same order; the k-th exchange of rank r receives what the k-th exchange of rank
r - 1 sent; send buffers must not be written, nor recv buffers read, before ``wait``; buffers are
C-contiguous. On a GPU, ``start_exchange`` orders the transfer after the work already queued on
the current stream (the compute stream), and ``wait`` makes the current stream wait for the
transfer: nothing blocks the host.

- ``NcclRingComm``: NCCL through CuPy's bindings (``cupy.cuda.nccl``): ``send`` / ``recv`` inside
  ``groupStart`` / ``groupEnd`` on a communication stream of its own. One process per GPU
  (``launch.py`` starts them); or built inside a torch.distributed job (``from_torch``).
- ``LocalRing``: P ranks as Python objects in one process, each run on a thread of its own by
  ``LocalRing.run``. With NumPy arrays it is the CPU simulation (transfers are copies made when
  both sides have arrived). With CuPy arrays it is a one-GPU ring: each rank computes on its own
  stream and transfers are device-to-device copies on a second stream per rank, ordered by CUDA
  events exactly as NCCL's transfers are. The ring code cannot tell these from NCCL.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

__all__ = ["RingComm", "Pending", "LocalRing", "LocalRingComm", "NcclRingComm", "RingAborted"]


class RingAborted(RuntimeError):
    """Raised on the ranks of a LocalRing that were waiting when another rank failed."""


class Pending:
    """An exchange in flight; ``wait()`` completes it (idempotent)."""

    def wait(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class RingComm:
    """The interface of the ring schedule's communicator: ``rank``, ``size``, ``xp`` (the array
    module of the arrays it moves: numpy or cupy) and ``start_exchange``."""

    rank: int
    size: int
    xp = np

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.size

    def start_exchange(self, send: Sequence, recv: Sequence) -> Pending:  # pragma: no cover
        raise NotImplementedError


def _check_buffers(send, recv, where: str) -> None:
    if len(send) != len(recv):
        raise ValueError(f"{where}: {len(send)} send buffers but {len(recv)} recv buffers")
    for s, r in zip(send, recv):
        if s.shape != r.shape or s.dtype != r.dtype:
            raise ValueError(f"{where}: send {s.shape} {s.dtype} and recv {r.shape} {r.dtype} differ; every rank "
                             "must hold shards of one shape")
        if not (s.flags.c_contiguous and r.flags.c_contiguous):
            raise ValueError(f"{where}: exchange buffers must be C-contiguous")


def _cupy():
    import cupy

    return cupy


# --- in one process: the NumPy simulation and the one-GPU ring ------------------------------------


class _Done(Pending):
    """A LocalRing exchange: on NumPy the copy is made; waiting takes the receiver's word that it
    has read our send buffers. On CuPy both are CUDA events that the current stream waits for."""

    def __init__(self, comm: "LocalRingComm", token: int, received):
        self._comm, self._token, self._received = comm, token, received
        self._waited = False

    def wait(self) -> None:
        if self._waited:
            return
        consumed = self._comm._world._take(("read", self._comm.rank, self._token))
        if self._comm.xp is not np:
            stream = _cupy().cuda.get_current_stream()
            stream.wait_event(self._received)
            stream.wait_event(consumed)
        self._waited = True


class LocalRingComm(RingComm):
    """Rank ``rank`` of a LocalRing; made by LocalRing, used by the ring code as any RingComm."""

    def __init__(self, world: "LocalRing", rank: int):
        self._world, self.rank, self.size, self.xp = world, rank, world.size, world.xp
        self._exchanges = 0
        if self.xp is not np:
            cupy = _cupy()
            with cupy.cuda.Device(world.device):
                self.compute_stream = cupy.cuda.Stream(non_blocking=True)
                self.copy_stream = cupy.cuda.Stream(non_blocking=True)

    def _event(self, stream):
        event = _cupy().cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def start_exchange(self, send, recv) -> Pending:
        send, recv = list(send), list(recv)
        _check_buffers(send, recv, f"rank {self.rank}")
        token = self._exchanges
        self._exchanges += 1
        ready = None if self.xp is np else self._event(_cupy().cuda.get_current_stream())
        world = self._world
        world._post(("data", self.next_rank, token), (send, ready))
        source, source_ready = world._take(("data", self.rank, token))
        _check_buffers(source, recv, f"rank {self.rank} receiving from rank {self.prev_rank}")
        if self.xp is np:
            for s, r in zip(source, recv):
                np.copyto(r, s)
            received = None
        else:
            cupy = _cupy()
            stream = self.copy_stream
            stream.wait_event(source_ready)  # the sender's data is written
            stream.wait_event(ready)  # our recv buffers are no longer read by our compute
            for s, r in zip(source, recv):
                cupy.cuda.runtime.memcpyAsync(r.data.ptr, s.data.ptr, r.nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
            received = self._event(stream)
        # The previous rank may write its send buffers again once our copy has read them.
        world._post(("read", self.prev_rank, token), received)
        return _Done(self, token, received)


class LocalRing:
    """P ranks in one process. ``xp=numpy``: the CPU simulation; ``xp=cupy``: P "ranks" on one
    GPU (``device``), each with its own compute and copy streams. ``run(fn)`` calls ``fn(comm)``
    for every rank at once, one thread each (on CuPy inside ``with comm.compute_stream``), and
    returns the results in rank order once every rank's stream has finished."""

    def __init__(self, size: int, xp=np, *, device: int = 0, timeout: float = 600.0):
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"LocalRing: size must be a positive int, got {size!r}")
        self.size, self.xp, self.device, self.timeout = int(size), xp, device, timeout
        self._cond = threading.Condition()
        self._mail: dict = {}
        self._failed = False
        self.comms = [LocalRingComm(self, r) for r in range(self.size)]

    def _post(self, key, value) -> None:
        with self._cond:
            self._mail[key] = value
            self._cond.notify_all()

    def _take(self, key):
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._mail or self._failed, timeout=self.timeout):
                self._failed = True
                self._cond.notify_all()
                raise RingAborted(f"LocalRing: no message {key} within {self.timeout} s (do all ranks start the "
                                  "same exchanges?)")
            if key not in self._mail:
                raise RingAborted("LocalRing: another rank failed")
            return self._mail.pop(key)

    def _abort(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def run(self, fn):
        """[fn(comm) for each rank], run concurrently; the first rank's error (by rank, a real
        one before the RingAborted of the ranks it left waiting) is raised."""
        from .. import testing

        poison = testing.poison_enabled()  # thread-local: the ranks' threads inherit the caller's
        results: list = [None] * self.size
        errors: list = [None] * self.size

        def rank_main(comm):
            try:
                with testing.poisoned_outputs(poison):
                    if self.xp is np:
                        results[comm.rank] = fn(comm)
                    else:
                        with _cupy().cuda.Device(self.device):
                            with comm.compute_stream:
                                results[comm.rank] = fn(comm)
                            comm.compute_stream.synchronize()
            except BaseException as exc:  # noqa: BLE001 - reported by run() below
                errors[comm.rank] = exc
                self._abort()

        if self.xp is not np:
            # The ranks' streams do not synchronize with the caller's (non-blocking streams): its
            # queued work, such as the copies of the shards to the GPU, must be done first.
            _cupy().cuda.get_current_stream().synchronize()
        threads = [threading.Thread(target=rank_main, args=(c,), name=f"ring-rank-{c.rank}") for c in self.comms]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = self._failed
        # Ready for another run: no message left over, counters back to 0.
        self._mail.clear()
        self._failed = False
        for comm in self.comms:
            comm._exchanges = 0
        real = [e for e in errors if e is not None and not isinstance(e, RingAborted)]
        if real or any(errors):
            raise (real or [e for e in errors if e is not None])[0]
        if failed:  # pragma: no cover - a rank aborted without raising
            raise RingAborted("LocalRing: a rank failed")
        return results


# --- NCCL ---------------------------------------------------------------------------------------


def nccl_module():
    """cupy.cuda.nccl, or a RuntimeError saying how to install NCCL."""
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        raise RuntimeError("NCCL is not loadable by CuPy: pip install nvidia-nccl-cu13 (or -cu12 for CUDA 12)")
    return nccl


class _StreamDone(Pending):
    def __init__(self, event, buffers):
        self._event, self._buffers = event, buffers  # the buffers stay alive until waited on

    def wait(self) -> None:
        if self._event is not None:
            _cupy().cuda.get_current_stream().wait_event(self._event)
            self._event, self._buffers = None, None


class NcclRingComm(RingComm):
    """A ring over an NCCL communicator (``cupy.cuda.nccl.NcclCommunicator``), one GPU per rank.

    Transfers run on a communication stream of this object's, after the work queued so far on
    the current stream; arrays are sent as bytes (no reduction, so the type does not matter).

    Build it from a unique id shared by every rank (``from_unique_id``: rank 0 calls
    ``cupy.cuda.nccl.get_unique_id()`` and passes the tuple to the others by any means — the
    launcher uses pipes), or inside a torch.distributed job (``from_torch``).
    """

    def __init__(self, nccl_comm, rank: int, size: int):
        cupy = _cupy()
        self.xp = cupy
        self._comm, self.rank, self.size = nccl_comm, int(rank), int(size)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    @classmethod
    def from_unique_id(cls, unique_id, rank: int, size: int) -> "NcclRingComm":
        """Rank ``rank`` of ``size``, on the current CuPy device. Every rank calls this with the
        same ``unique_id`` (collective: it returns once all ranks have joined)."""
        nccl = nccl_module()
        return cls(nccl.NcclCommunicator(int(size), unique_id, int(rank)), rank, size)

    @classmethod
    def from_torch(cls, group=None) -> "NcclRingComm":
        """A ring over the ranks of a torch.distributed process group (default: the world), on
        torch's current CUDA device. Collective over ``group``: its rank 0 makes an NCCL unique
        id and broadcasts it with ``torch.distributed.broadcast_object_list`` (any backend),
        then every rank joins a new NCCL communicator. torch keeps its own communicator; this
        one is CuPy's, over the same GPUs. Not tested here (no torch job with GPUs)."""
        import cupy
        import torch
        import torch.distributed as dist

        rank, size = dist.get_rank(group), dist.get_world_size(group)
        unique_id = [nccl_module().get_unique_id() if rank == 0 else None]
        source = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(unique_id, src=source, group=group)
        cupy.cuda.Device(torch.cuda.current_device()).use()
        return cls.from_unique_id(unique_id[0], rank, size)

    def start_exchange(self, send, recv) -> Pending:
        send, recv = list(send), list(recv)
        _check_buffers(send, recv, f"rank {self.rank}")
        if self.size == 1:  # its own neighbour: a copy
            for s, r in zip(send, recv):
                r[...] = s
            return _StreamDone(None, None)
        nccl = nccl_module()
        cupy = _cupy()
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(ready)
        nccl.groupStart()
        try:
            for s, r in zip(send, recv):
                self._comm.send(s.data.ptr, s.nbytes, nccl.NCCL_UINT8, self.next_rank, self.stream.ptr)
                self._comm.recv(r.data.ptr, r.nbytes, nccl.NCCL_UINT8, self.prev_rank, self.stream.ptr)
        finally:
            nccl.groupEnd()
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return _StreamDone(done, (send, recv))

    def close(self) -> None:
        """Releases the NCCL communicator (collective on some NCCL versions: call on every rank)."""
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
