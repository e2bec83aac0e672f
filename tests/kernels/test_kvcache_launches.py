"""kvcache_mma.forward's launches, without a GPU: the plan's KV-cache kernel with its grid and one
CacheFwdParams (the call's arrays, strides, lengths, block table, page divisor, window, scale and
split layout), then with splits the combine with one CombineParams over the partials the call
allocated."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cupyflash.kernels import kvcache_mma
from cupyflash.kernels.params import CACHE_FWD_PARAMS, COMBINE_PARAMS, fast_divmod
from cupyflash.masks import mask_for
from launch_fakes import FakeArray, LaunchRecorder

B, SQ, H, HKV, D = 3, 2, 8, 2, 128


def rows_of(field, a):
    item = a.itemsize
    return (int(field["data"]), int(field["batch_stride"]), int(field["row_stride"]), int(field["head_stride"])) == (
        a.data.ptr, a.strides[0] // item, a.strides[1] // item, a.strides[2] // item)


@pytest.mark.parametrize("paged, page_size", [(False, 1000), (True, 16), (True, 17)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_cache_forward_launches(paged, page_size, num_splits, monkeypatch):
    recorder = LaunchRecorder(monkeypatch, [kvcache_mma])
    dtype = ml_dtypes.bfloat16
    q, o = FakeArray((B, SQ, H, D), dtype), FakeArray((B, SQ, H, D), dtype)
    pages = 40 if paged else B
    k, v = FakeArray((pages, page_size, HKV, D), dtype), FakeArray((pages, page_size, HKV, D), dtype)
    lse = FakeArray((B, H, SQ), np.float32)
    seqlens = FakeArray((B,), np.int32)
    table = FakeArray((B, 13 if paged else 1), np.int32)
    mask = mask_for(True, (100, -1))
    max_len = 190
    splits = kvcache_mma.forward(q, k, v, o, lse, seqlens_k=seqlens, block_table=table, page_size=page_size,
                                 paged=paged, max_seqlen_k=max_len, softmax_scale=0.125, mask=mask,
                                 num_splits=num_splits)
    allocated = {a.data.ptr: a for a in recorder.allocations}
    launches = recorder.take()
    planned = kvcache_mma.plan(dtype, D, mask, batch=B, seqlen_q=SQ, group=H // HKV, nheads_kv=HKV,
                               max_seqlen_k=max_len, paged=paged, num_splits=num_splits)
    assert splits == planned.num_splits == num_splits
    assert len(launches) == (1 if splits == 1 else 2)
    cache = launches[0]
    assert cache.spec == planned.spec and cache.grid == planned.grid
    assert cache.grid == (math.ceil(SQ * H // HKV / 16) * splits, HKV, B)
    [p] = cache.args[0]
    assert cache.args[0].dtype == CACHE_FWD_PARAMS
    for name, a in (("q", q), ("k", k), ("v", v), ("o", o)):
        assert rows_of(p[name], a), name
    assert int(p["lse"]) == lse.data.ptr
    assert (int(p["batch"]), int(p["seqlen_q"]), int(p["seqlen_k"]), int(p["nheads"]), int(p["nheads_kv"]),
            int(p["group"]), int(p["headdim"])) == (B, SQ, max_len, H, HKV, H // HKV, D)
    assert (int(p["window_left"]), int(p["window_right"])) == (100, 0)
    assert float(p["scale"]) == np.float32(0.125)
    assert int(p["seqlens_k"]) == seqlens.data.ptr and int(p["block_table"]) == table.data.ptr
    assert int(p["block_table_stride"]) == table.shape[1]
    assert tuple(p["page"].item()) == tuple(int(x) for x in fast_divmod(page_size))
    assert (int(p["num_splits"]), int(p["split_keys"])) == (splits, planned.split_keys)
    if splits == 1:
        assert int(p["o_partial"]) == int(p["lse_partial"]) == 0
        return
    o_part, lse_part = allocated[int(p["o_partial"])], allocated[int(p["lse_partial"])]
    assert o_part.shape == (splits, B, H, SQ, D) and lse_part.shape == (splits, B, H, SQ)
    assert o_part.dtype == lse_part.dtype == np.float32
    combine = launches[1]
    assert combine.spec == kvcache_mma.combine_specialization(dtype)
    assert combine.grid == (math.ceil(B * H * SQ / kvcache_mma.COMBINE_ROWS), 1, 1)
    [c] = combine.args[0]
    assert combine.args[0].dtype == COMBINE_PARAMS
    assert (int(c["o_partial"]), int(c["lse_partial"])) == (o_part.data.ptr, lse_part.data.ptr)
    assert rows_of(c["o"], o) and int(c["lse"]) == lse.data.ptr and int(c["sink"]) == 0
    assert (int(c["num_splits"]), int(c["batch"]), int(c["seqlen_q"]), int(c["nheads"]), int(c["headdim"])) == (
        splits, B, SQ, H, D)


def test_cache_forward_refuses_layouts_the_kernel_cannot_take(monkeypatch):
    LaunchRecorder(monkeypatch, [kvcache_mma])
    dtype = np.float16
    q, o = FakeArray((1, 1, 4, 64), dtype), FakeArray((1, 1, 4, 64), dtype)
    k = v = FakeArray((1, 64, 4, 64), dtype)
    lse = FakeArray((1, 4, 1), np.float32)
    seqlens, table = FakeArray((1,), np.int32), FakeArray((1, 1), np.int32)
    bad = FakeArray((1, 64, 4, 64), dtype)
    bad.data.ptr += 8  # not 16-byte aligned
    with pytest.raises(ValueError, match="16-byte aligned"):
        kvcache_mma.forward(q, bad, v, o, lse, seqlens_k=seqlens, block_table=table, page_size=64, paged=False,
                            max_seqlen_k=64, softmax_scale=0.1, mask=mask_for(False), num_splits=1)
    with pytest.raises(ValueError, match="int32"):
        kvcache_mma.forward(q, k, v, o, lse, seqlens_k=FakeArray((1,), np.int64), block_table=table, page_size=64,
                            paged=False, max_seqlen_k=64, softmax_scale=0.1, mask=mask_for(False), num_splits=1)


@pytest.mark.parametrize("page_size", [1, 16, 17, 4096])
def test_append_launch(page_size, monkeypatch):
    """kvcache_append.append: one launch over (sequence, new token) x kv head with one AppendParams
    of the call's arrays, the table and its row stride, and the page divisor."""
    from cupyflash.kernels import kvcache_append
    from cupyflash.kernels.params import APPEND_PARAMS

    recorder = LaunchRecorder(monkeypatch, [kvcache_append])
    dtype = ml_dtypes.bfloat16
    new = 3
    k_new, v_new = FakeArray((B, new, HKV, D), dtype), FakeArray((B, new, HKV, D), dtype)
    k, v = FakeArray((50, page_size, HKV, D), dtype), FakeArray((50, page_size, HKV, D), dtype)
    seqlens, lengths_out = FakeArray((B,), np.int32), FakeArray((B,), np.int32)
    table = FakeArray((B, 7), np.int32)
    kvcache_append.append(k_new, v_new, k, v, cache_seqlens=seqlens, block_table=table, page_size=page_size,
                          seqlens_k=lengths_out)
    [launch] = recorder.take()
    assert launch.spec == kvcache_append.specialization(2) and launch.grid == (B * new, HKV, 1)
    assert launch.args[0].dtype == APPEND_PARAMS
    [p] = launch.args[0]
    for name, a in (("k_new", k_new), ("v_new", v_new), ("k", k), ("v", v)):
        assert rows_of(p[name], a), name
    assert (int(p["cache_seqlens"]), int(p["block_table"]), int(p["seqlens_k"])) == (
        seqlens.data.ptr, table.data.ptr, lengths_out.data.ptr)
    assert int(p["block_table_stride"]) == 7
    assert tuple(p["page"].item()) == tuple(int(x) for x in fast_divmod(page_size))
    assert (int(p["batch"]), int(p["seqlen_new"]), int(p["nheads_kv"]), int(p["headdim"])) == (B, new, HKV, D)


def test_combine_constants_match_the_kernel():
    """The combine's rows per block (its grid) and its most splits (its lanes' lse registers)
    are the constants of flash_fwd_combine.cu that kvcache_mma mirrors."""
    import re

    from cupyflash.kernels._module import kernels_dir

    source = (kernels_dir() / "flash_fwd_combine.cu").read_text()

    def constant(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", source).group(1))

    assert constant("COMBINE_ROWS_PER_BLOCK") == kvcache_mma.COMBINE_ROWS
    assert constant("COMBINE_MAX_SPLITS") == kvcache_mma.MAX_SPLITS
    assert kvcache_mma.MAX_SPLITS % 32 == 0 and 32 % constant("SPLIT_LOADS") == 0
