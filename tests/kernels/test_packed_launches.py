"""Packed (varlen) batches' launches, without a GPU: the launchers on stand-in arrays (launch_fakes)
with a kernels.params.PackedBatch. Each attention kernel gets the Packed mask policy (its name and
template argument), a grid of one CTA column per sequence covering the longest one, and the
call's cu_seqlens in its Params; the row-wise kernels (D, the dQ convert) cover the packed rows as
one batch; a dense call leaves cu_seqlens null. Whether the kernels then read the right rows is
the GPU tests' (tests/test_varlen_gpu.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash import backward_plans, masks, plans
from cupyflash.kernels import mma_bwd, mma_fwd, simt
from cupyflash.kernels.params import PackedBatch
from cupyflash.scores import Score
from launch_fakes import FakeArray, LaunchRecorder, assert_one_struct

LENGTHS_Q = [5, 0, 130, 1, 64]
LENGTHS_K = [9, 3, 130, 0, 200]
H, HKV = 4, 2
TOTAL_Q, TOTAL_K = sum(LENGTHS_Q), sum(LENGTHS_K)


def packed_batch() -> PackedBatch:
    cu_q, cu_k = (FakeArray((len(LENGTHS_Q) + 1,), np.int32) for _ in range(2))
    return PackedBatch(cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K))


def test_packed_batch_counts_sequences():
    assert packed_batch().sequences == len(LENGTHS_Q)


def test_the_packed_policy_is_its_own_specialization():
    mask = masks.mask_for(True, packed=True)
    assert mask.packed and mask.name == "causal_packed" and mask.cpp == "cf::Packed<cf::Causal>"
    alibi = masks.mask_for(False, (8, 0), Score(alibi=True), packed=True)
    assert alibi.name == "local_alibi_packed"
    assert alibi.cpp == "cf::Packed<cf::WithScore<cf::Local, cf::ScoreMod<false, true, false>>>"
    assert alibi.backward().packed and alibi.as_packed(False) == masks.mask_for(False, (8, 0), Score(alibi=True))
    assert not masks.mask_for(True).packed
    # user modifiers take packed batches too: each sequence is batch entry b, indices from its first row
    user = next(m for m in masks.VARIANT_KINDS if m.score.user is not None).as_packed()
    assert user.packed and user.name.endswith("_packed") and user.score.user is not None
    assert user.cpp.startswith("cf::Packed<cf::WithScore<cf::NoMask, cf::UserScore<cfu::mod_")
    assert user.name in {m.name for m in masks.PACKED_KINDS}  # the compile check builds it


def _record_forward(monkeypatch, family: str, dtype, d: int, packed):
    recorder = LaunchRecorder(monkeypatch)
    q, o = (FakeArray((1, TOTAL_Q, H, d), dtype) for _ in range(2))
    k, v = (FakeArray((1, TOTAL_K, HKV, d), dtype) for _ in range(2))
    lse = FakeArray((1, H, TOTAL_Q), np.float64 if dtype == np.float64 else np.float32)
    module = mma_fwd if family == "mma" else simt
    module.forward(q, k, v, o, lse, softmax_scale=0.125, causal=True, packed=packed)
    [launch] = recorder.take()
    return launch, assert_one_struct(launch, "fwd")


@pytest.mark.parametrize("arch,smem", [("90", 227 * 1024), ("80", 163 * 1024), (None, None)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_packed_forward_launches_one_grid_over_the_sequences(arch, smem, d, monkeypatch):
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: arch)
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem)
    packed = packed_batch()
    launch, p = _record_forward(monkeypatch, "mma", np.float16, d, packed)
    planned = mma_fwd.plan(np.float16, d, masks.mask_for(True, packed=True))
    assert launch.spec == planned.spec and "_causal_packed_" in launch.spec.name
    assert "cf::Packed<cf::Causal>" in launch.spec.expression
    assert launch.grid == (math.ceil(max(LENGTHS_Q) / planned.block_m), H, len(LENGTHS_Q))
    assert int(p["cu_seqlens_q"]) == packed.cu_seqlens_q.data.ptr
    assert int(p["cu_seqlens_k"]) == packed.cu_seqlens_k.data.ptr
    # the tensors are one batch of the packed rows: lse's (1, nheads, total_q) is flash-attn's layout
    assert (int(p["batch"]), int(p["seqlen_q"]), int(p["seqlen_k"])) == (1, TOTAL_Q, TOTAL_K)


def test_a_dense_forward_leaves_the_lengths_null(monkeypatch):
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "90")
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    launch, p = _record_forward(monkeypatch, "mma", np.float16, 128, None)
    assert "packed" not in launch.spec.name and "Packed" not in launch.spec.expression
    assert int(p["cu_seqlens_q"]) == int(p["cu_seqlens_k"]) == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_packed_simt_forward(dtype, monkeypatch):
    packed = packed_batch()
    launch, p = _record_forward(monkeypatch, "simt", dtype, 96, packed)
    tiles = plans.simt_tiles(dtype, 96)
    assert "_causal_packed_" in launch.spec.name
    assert launch.grid == (math.ceil(max(LENGTHS_Q) / tiles.block_m), H, len(LENGTHS_Q))
    assert int(p["cu_seqlens_q"]) == packed.cu_seqlens_q.data.ptr


def test_the_packed_d128_tile_without_spills_on_large_smem_devices():
    """The LARGE_SMEM d128 row spills 80 bytes packed at sm_80 (the sequence's bounds in registers):
    a packed batch takes the PORTABLE row there, a dense one keeps its own."""
    dense = plans.plan_forward("100", np.float16, 128, masks.mask_for(True), 227 * 1024, family="mma")
    packed = plans.plan_forward("100", np.float16, 128, masks.mask_for(True, packed=True), 227 * 1024, family="mma")
    assert packed.block_m == plans.FORWARD_TILES[("mma", plans.PORTABLE, 128)].block_m
    assert "_bn32_" in packed.spec.name and "_bn64_" in dense.spec.name


def _record_backward(monkeypatch, family: str, dtype, d: int, deterministic: bool):
    recorder = LaunchRecorder(monkeypatch)
    q, o, do, dq = (FakeArray((1, TOTAL_Q, H, d), dtype) for _ in range(4))
    k, v, dk, dv = (FakeArray((1, TOTAL_K, HKV, d), dtype) for _ in range(4))
    lse = FakeArray((1, H, TOTAL_Q), np.float64 if dtype == np.float64 else np.float32)
    packed = packed_batch()
    module = mma_bwd if family == "mma" else simt
    module.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.125, causal=True, deterministic=deterministic,
                    packed=packed)
    return recorder.take(), packed


@pytest.mark.parametrize("arch,smem", [("90", 227 * 1024), ("80", 163 * 1024), (None, None)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [True, False])
def test_packed_backward_launches(arch, smem, d, deterministic, monkeypatch):
    """D over every packed row, the dK/dV kernel a column of key blocks per sequence, dQ by its own
    kernel (a column of query blocks per sequence) or by atomics and the convert over every row;
    every launch the same struct with the call's cu_seqlens."""
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: arch)
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem)
    launches, packed = _record_backward(monkeypatch, "mma", np.float16, d, deterministic)
    mask = masks.mask_for(True, packed=True).backward()
    planned = mma_bwd.plan(np.float16, d, mask, deterministic)
    assert planned.dq_add in ("none", "atomic")
    assert [launch.spec for launch in launches] == [launch.spec for launch in planned.launches]
    for launch, role in zip(launches, planned.launches):
        p = assert_one_struct(launch, "bwd")
        assert int(p["cu_seqlens_q"]) == packed.cu_seqlens_q.data.ptr
        assert int(p["cu_seqlens_k"]) == packed.cu_seqlens_k.data.ptr
        assert (int(p["batch"]), int(p["seqlen_q"]), int(p["seqlen_k"])) == (1, TOTAL_Q, TOTAL_K)
        if role.role == "dkdv":
            assert "_packed_" in launch.spec.name
            assert launch.grid == (math.ceil(max(LENGTHS_K) / role.per_block), HKV, len(LENGTHS_K))
        elif role.role == "dq":
            assert "_packed_" in launch.spec.name
            assert launch.grid == (math.ceil(max(LENGTHS_Q) / role.per_block), H, len(LENGTHS_Q))
        else:  # preprocess, convert: row-wise over the packed rows
            assert "packed" not in launch.spec.name
            assert launch.grid == role.grid(1, TOTAL_Q, TOTAL_K, H, HKV, d)


def test_packed_simt_backward(monkeypatch):
    launches, packed = _record_backward(monkeypatch, "simt", np.float32, 64, True)
    roles = [launch.role for launch in backward_plans.plan_backward(
        None, np.float32, 64, masks.mask_for(True, packed=True).backward(), None, True, family="simt").launches]
    assert roles == ["preprocess", "dkdv", "dq"]
    tiles = plans.simt_tiles(np.float32, 64)
    assert launches[1].grid == (math.ceil(max(LENGTHS_K) / tiles.block_n), HKV, len(LENGTHS_K))
    assert launches[2].grid == (math.ceil(max(LENGTHS_Q) / tiles.block_m), H, len(LENGTHS_Q))
    assert all(int(launch.params["cu_seqlens_q"]) == packed.cu_seqlens_q.data.ptr for launch in launches)


def test_packed_backward_refuses_dq_adds_laid_out_per_dense_block(monkeypatch):
    """The ordered and fixed-point dQ adds (dev/ versions) keep counters and row scales per dense
    query block: a packed batch is refused before any launch."""
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "90")
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    recorder = LaunchRecorder(monkeypatch)
    q, o, do, dq = (FakeArray((1, TOTAL_Q, H, 128), np.float16) for _ in range(4))
    k, v, dk, dv = (FakeArray((1, TOTAL_K, HKV, 128), np.float16) for _ in range(4))
    lse = FakeArray((1, H, TOTAL_Q), np.float32)
    for version in ("v6", "v7", "v9"):  # ordered, fixed, fixed_panels at d128
        with pytest.raises(ValueError, match="packed batch"):
            mma_bwd.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.125, causal=True, deterministic=True,
                             version=version, packed=packed_batch())
    assert recorder.take() == []


@pytest.mark.parametrize("deterministic", [True, False])
def test_packed_mma_sync_backward_takes_the_rows_without_spills(deterministic):
    """On mma.sync a packed batch runs the dQ-kernel rows whatever ``deterministic`` says (the
    atomic-dQ kernels spill packed), at d256 with a score the dQ kernel's BLOCK_N 16 tiles, and at
    d128 with a user modifier flash_bwd_dq_mma_v2's BLOCK_N 16 tiles."""
    for dt in (64, 128, 256):
        for mask in masks.PACKED_KINDS:
            plan = backward_plans.plan_backward("80", np.float16, dt, mask.backward(), 163 * 1024, deterministic)
            dense = backward_plans.plan_backward("80", np.float16, dt, mask.as_packed(False).backward(), 163 * 1024,
                                                 True)
            assert plan.dq_add == "none"
            want = (backward_plans.PACKED_DQ_D256_TILES if dt == 256 and not mask.score.plain else
                    backward_plans.PACKED_USER_DQ_D128_TILES if dt == 128 and mask.score.user is not None else
                    dense.kernels.dq_tiles)
            assert plan.kernels.dq_tiles == want
    # sm_90: d64 and d128 run the producer pair either way (v15), packed too, a packed causal batch
    # at d128 as well (v16)
    on_sm90 = backward_plans.plan_backward("90", np.float16, 64, masks.NoMask(packed=True).backward(), 227 * 1024,
                                           False)
    assert (on_sm90.dq_add, on_sm90.kernels.dkdv, on_sm90.kernels.dq) == ("none", "wgmma_ws", "dq_wgmma_ws")
    causal_on_sm90 = backward_plans.plan_backward("90", np.float16, 128, masks.PACKED_KINDS[0].backward(),
                                                  227 * 1024, False)
    assert (causal_on_sm90.dq_add, causal_on_sm90.kernels.dkdv, causal_on_sm90.kernels.dq) == (
        "none", "wgmma_ws", "dq_wgmma_ws")
