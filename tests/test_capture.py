"""cupyflash.capture on the CPU: when device values may be read, how a call decides it, and that host
index arrays stay checked in full inside no_host_sync() (reading them costs no synchronisation).
The device paths, and CUDA-graph capture itself: tests/test_capture_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import capture


def test_reads_are_allowed_outside_no_host_sync_and_not_inside():
    assert capture.reads_allowed()
    with cupyflash.no_host_sync():
        assert not capture.reads_allowed()
        with cupyflash.no_host_sync():  # nests
            assert not capture.reads_allowed()
        assert not capture.reads_allowed()
    assert capture.reads_allowed()


def test_nothing_captures_without_a_capture():
    assert not capture.capturing()
    assert not capture.under_capture()


def test_a_call_decides_once_and_inner_calls_inherit_it():
    seen = []

    @capture.graph_safe
    def inner():
        seen.append(("inner", capture.reads_allowed()))

    @capture.graph_safe
    def outer():
        seen.append(("outer", capture.reads_allowed()))
        inner()

    outer()
    with cupyflash.no_host_sync():
        outer()
    assert seen == [("outer", True), ("inner", True), ("outer", False), ("inner", False)]
    assert capture.reads_allowed()  # the call's decision ends with it


def test_a_call_that_raises_leaves_no_decision_behind():
    @capture.graph_safe
    def failing():
        raise RuntimeError("boom")

    with cupyflash.no_host_sync(), pytest.raises(RuntimeError):
        failing()
    assert capture.reads_allowed()


def test_host_cu_seqlens_are_checked_in_full_inside_no_host_sync():
    x = np.zeros((20, 2, 16), np.float32)
    with cupyflash.no_host_sync():
        with pytest.raises(ValueError, match="non-decreasing"):
            cupyflash.flash_attn_varlen_func(x, x, x, np.array([0, 12, 5, 20], np.int32),
                                             np.array([0, 12, 5, 20], np.int32), 20, 20, backend="numpy")
        with pytest.raises(ValueError, match="more than max_seqlen_q"):
            cupyflash.flash_attn_varlen_func(x, x, x, np.array([0, 12, 20], np.int32),
                                             np.array([0, 12, 20], np.int32), 8, 20, backend="numpy")
        o = cupyflash.flash_attn_varlen_func(x + 1, x, x, np.array([0, 12, 20], np.int32),
                                             np.array([0, 12, 20], np.int32), 12, 12, backend="numpy")
    assert o.shape == x.shape


def test_host_kvcache_indices_are_checked_in_full_inside_no_host_sync():
    q = np.zeros((2, 1, 2, 16), np.float32)
    cache = np.zeros((2, 8, 1, 16), np.float32)
    with cupyflash.no_host_sync(), pytest.raises(ValueError, match="exceeds"):
        cupyflash.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=np.array([3, 9], np.int32), backend="numpy")


def test_under_capture_host_arrays_and_the_numpy_backend_are_refused(monkeypatch):
    monkeypatch.setattr(capture, "capturing", lambda: True)
    with pytest.raises(ValueError, match="q is a host array"):
        capture.refuse_host_arrays(["q"], "auto")
    with pytest.raises(ValueError, match="q, k are host arrays"):
        capture.refuse_host_arrays(["q", "k"], "cuda")
    with pytest.raises(ValueError, match="backend='numpy'"):
        capture.refuse_host_arrays([], "numpy")
    with pytest.raises(ValueError, match="cannot be captured"):
        capture.refuse_host_upload("cu_seqlens_q")
    capture.refuse_host_arrays([], "auto")  # device arrays, a GPU backend: nothing to refuse


def test_outside_capture_nothing_is_refused():
    capture.refuse_host_arrays(["q"], "numpy")
    capture.refuse_host_upload("cache_seqlens")


def test_a_call_under_capture_decides_reads_and_capture_once(monkeypatch):
    """Under capture a call sees reads disallowed and capture on, whatever the stream says later
    in the call; with a graph-aware allocator it keeps that allocator (no pool of its own)."""
    seen = []

    @capture.graph_safe
    def call():
        seen.append((capture.reads_allowed(), capture.under_capture()))

    monkeypatch.setattr(capture, "capturing", lambda: True)
    with capture.graph_aware_allocator():
        pools = len(capture._GRAPH_POOLS)
        call()
        assert len(capture._GRAPH_POOLS) == pools
    assert seen == [(False, True)]
