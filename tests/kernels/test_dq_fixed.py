"""Fixed-point dQ (kernels_cu/dq_add.cuh, cupyflash/kernels/dq_fixed.py).

CPU: the per-row bound that sets the fixed-point scale holds for every partial sum of dQ_i, in
any key-block order, on exact (float64) attention problems; the scale and limit arithmetic.
GPU (marker ``gpu``, sm_90 only: the fixed-point kernel is wgmma): rows whose gradients differ by
10^30 in magnitude each keep their own precision; non-finite inputs make exactly the rows NaN that
float adds make NaN; an lse far below the forward's (a broken bound) makes rows NaN instead of
wrapping the int64 sums."""
from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyflash import reference
from launch_fakes import FakeArray
from models.mirrors import code, squash

KERNELS_CU = Path(__file__).resolve().parents[2] / "kernels_cu"
DQ_FIXED_BITS = 48
BF16 = np.dtype(ml_dtypes.bfloat16)


def _source() -> str:
    return (KERNELS_CU / "dq_add.cuh").read_text()


def _source_constant(name: str) -> int:
    return int(re.search(rf"constexpr int {name} = (\d+);", _source()).group(1))


# The statements of dq_fixed_scale and fixed_limit that the mirrors below follow.
MIRRORED = (
    "if (bound == __int_as_float(0x7f800000)) return __int_as_float(0x7fffffff);",
    "if (!(bound <= 3.402823466e38f)) bound = 1.f;",
    "const int e = max((int)((__float_as_uint(bound) >> 23) & 0xff), 1) - 126;",
    "const int exponent = min(127, max(-126, DQ_FIXED_BITS - e));",
    "return __uint_as_float((u32)(exponent + 127) << 23);",
    "const int log2_n = 32 - __clz(max(n_contributions, 1) - 1);",
    "return __uint_as_float((u32)(127 + max(DQ_FIXED_BITS + 1, 62 - log2_n)) << 23);",
    "bad |= !(fabsf(y) < limit);",
)


def dq_fixed_scale(bound: float) -> float:
    """Mirror of dq_fixed_scale in dq_add.cuh (float32 bit arithmetic)."""
    if bound == float("inf"):
        return float("nan")
    bound = np.float32(bound if bound <= float(np.finfo(np.float32).max) else 1.0)  # NaN: 1
    e = max(int((np.float32(bound).view(np.uint32) >> 23) & 0xFF), 1) - 126
    exponent = min(127, max(-126, DQ_FIXED_BITS - e))
    return float(np.uint32((exponent + 127) << 23).view(np.float32))


def fixed_limit(n_contributions: int) -> float:
    """Mirror of fixed_limit in dq_add.cuh."""
    log2_n = (max(n_contributions, 1) - 1).bit_length()
    return 2.0 ** max(DQ_FIXED_BITS + 1, 62 - log2_n)


def test_mirrors_follow_the_source():
    assert _source_constant("DQ_FIXED_BITS") == DQ_FIXED_BITS
    code = "".join(_source().split())
    missing = [m for m in MIRRORED if "".join(m.split()) not in code]
    assert not missing, missing


@pytest.mark.parametrize("bound", [0.0, 1e-45, 1e-38, 3e-30, 0.75, 1.0, 1.5, 2.0 ** 20, 3e20, 3.4e38,
                                   float("nan")])
def test_scale_is_a_power_of_two_that_puts_the_bound_just_below_2_to_the_fixed_bits(bound):
    s = dq_fixed_scale(bound)
    mantissa, _ = np.frexp(s)
    assert mantissa == 0.5 and np.isfinite(s)  # an exact power of two, so x * s is exact
    if np.isnan(bound):
        return  # any finite scale: the row's NaN contributions mark it
    if bound > 0 and s < 2.0 ** 127:  # not clamped: the bound uses half to all of the range
        assert 2.0 ** (DQ_FIXED_BITS - 1) <= bound * s < 2.0 ** DQ_FIXED_BITS
    assert bound * s < 2.0 ** DQ_FIXED_BITS  # headroom 2^(63 - 48) over every partial sum


def test_an_infinite_bound_has_no_scale():
    assert np.isnan(dq_fixed_scale(float("inf")))


@pytest.mark.parametrize("n", [1, 2, 3, 127, 128, 129, 2**13, 2**13 + 1, 2**20])
def test_limit_keeps_every_sum_of_one_add_per_key_block_inside_int64(n):
    limit = fixed_limit(n)
    assert limit >= 2.0 ** (DQ_FIXED_BITS + 1)  # a correct bound never reaches it
    if n <= 2**13:
        assert n * limit <= 2.0 ** 62  # n values below the limit cannot wrap an int64 sum


def _exact_dq_terms(q, k, v, do, causal):
    """dS (B, H, Sq, Sk) and K per query head, float64, from the reference forward."""
    scale = q.shape[-1] ** -0.5
    o, lse = reference.attention(q, k, v, softmax_scale=scale, causal=causal)
    group = q.shape[2] // k.shape[2]
    kh = np.repeat(k, group, axis=2).transpose(0, 2, 1, 3)
    vh = np.repeat(v, group, axis=2).transpose(0, 2, 1, 3)
    qh, doh = q.transpose(0, 2, 1, 3), do.transpose(0, 2, 1, 3)
    s = qh @ kh.transpose(0, 1, 3, 2) * scale
    visible = reference.visible_keys(q.shape[1], k.shape[1], causal)
    p = np.exp(np.where(visible, s - lse[..., None], -np.inf))  # rows with no visible key: lse = -inf
    dp = doh @ vh.transpose(0, 1, 3, 2)
    delta = np.sum(doh * o.transpose(0, 2, 1, 3), axis=-1)
    return p * (dp - delta[..., None]), kh, doh, delta


@settings(max_examples=30)
@given(seed=st.integers(0, 2**32 - 1), causal=st.booleans(), sq=st.integers(1, 70), sk=st.integers(1, 70),
       group=st.sampled_from([1, 2]), spread=st.floats(0, 6))
def test_the_row_bound_holds_for_every_partial_sum_in_any_order(seed, causal, sq, sk, group, spread):
    """|sum over any subset of key blocks of dS_ij K_j| <= max|K| (||dO_i||_1 max|V| + |D_i|): the
    bound dq_add.cuh sets the scale from. Rows and keys of very different magnitudes."""
    rng = np.random.default_rng(seed)
    d = 16
    q = rng.standard_normal((1, sq, 2 * group, d))
    k, v = (rng.standard_normal((1, sk, 2, d)) * 10.0 ** rng.uniform(-spread, spread, (1, sk, 2, 1))
            for _ in range(2))
    do = rng.standard_normal((1, sq, 2 * group, d)) * 10.0 ** rng.uniform(-spread, spread, (1, sq, 2 * group, 1))
    ds, kh, doh, delta = _exact_dq_terms(q, k, v, do, causal)
    k_max = np.abs(kh).max(axis=(2, 3))[..., None]  # per (batch, head)
    v_max = np.abs(np.repeat(v, group, axis=2)).max(axis=(1, 3))[..., None]  # (B, H, 1)
    bound = k_max * (np.abs(doh).sum(axis=-1) * v_max + np.abs(delta))  # (B, H, Sq)
    blocks = [range(j, min(j + 8, sk)) for j in range(0, sk, 8)]
    for order in (blocks, blocks[::-1], [blocks[i] for i in rng.permutation(len(blocks))]):
        partial = np.zeros(q.transpose(0, 2, 1, 3).shape)
        for block in order:
            cols = list(block)
            partial += ds[..., cols] @ kh[:, :, cols]
            assert np.all(np.abs(partial) <= bound[..., None] * (1 + 1e-12) + 1e-300)


def _source_line(statement: str) -> bool:
    """Whether the convert kernel (found by name in kernels_cu/) holds ``statement``."""
    return squash(statement) in squash(code("flash_bwd_dq_convert_fixed", includes=True))


@pytest.mark.parametrize("panel_major", [False, True], ids=["rows", "panels"])
@pytest.mark.parametrize("dt", [64, 128, 256])
def test_convert_reads_each_element_where_the_backward_added_it(panel_major, dt):
    """flash_bwd_dq_convert_fixed's offset (b sb + m ss + h sh + (c / 64) sp + c % 64, from the
    BwdParams fields dq_accum and dq_accum_panel_stride, as mma_bwd.backward fills them: set_rows
    with dq_fixed.panel_strides and dq_fixed.panel_stride for a panel-major dq_accum, the rows'
    strides and 64 otherwise) is element (b, m, h, c)'s place in dq_accum: (batch, seqlen, nheads,
    dt) C order, or accum_panels' (batch, nheads * dt / 64, rows, 64)."""
    from cupyflash.kernels import dq_fixed, params

    assert _source_line("const i64 dqa_sb = p.dq_accum.batch_stride, dqa_ss = p.dq_accum.row_stride,"
                        " dqa_sh = p.dq_accum.head_stride;")
    assert _source_line("const i64 dqa_sp = p.dq_accum_panel_stride;")
    assert _source_line("dq_accum + row_offset(batch, row, head, dqa_sb, dqa_ss, dqa_sh)"
                        " + (chunk / 8) * dqa_sp + (chunk % 8) * 8);")
    batch, seqlen, nheads, block_m = 2, 77, 3, 64
    rows = -(-seqlen // block_m) * block_m
    shape = (batch, nheads * dt // 64, rows, 64) if panel_major else (batch, seqlen, nheads, dt)
    accum = FakeArray(shape, np.int64)
    p = np.zeros(1, params.BWD_PARAMS)
    if panel_major:
        params.set_rows(p, "dq_accum", accum, dq_fixed.panel_strides(accum, nheads))
        p["dq_accum_panel_stride"] = dq_fixed.panel_stride(accum)
    else:
        params.set_rows(p, "dq_accum", accum)
        p["dq_accum_panel_stride"] = 64
    f = p[0]["dq_accum"]
    sb, ss, sh, sp = (int(x) for x in (f["batch_stride"], f["row_stride"], f["head_stride"],
                                        p[0]["dq_accum_panel_stride"]))
    assert int(f["data"]) == accum.data.ptr
    b, m, h, c = np.meshgrid(np.arange(batch), np.arange(seqlen), np.arange(nheads), np.arange(dt), indexing="ij")
    got = b * sb + m * ss + h * sh + (c // 8 // 8) * sp + (c // 8 % 8) * 8 + c % 8
    if panel_major:
        want = np.ravel_multi_index((b, h * (dt // 64) + c // 64, m, c % 64), shape)
    else:
        want = np.ravel_multi_index((b, m, h, c), shape)
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# GPU: the deterministic backward on sm_90 with fixed-point dQ (v7's row-wise reductions, v9's
# panel-major ones), at d64 and d128
# ---------------------------------------------------------------------------------------------

@pytest.fixture(params=["v7", "v9"])
def fixed_kernel_launches(request, monkeypatch):
    """The deterministic backward of version v7 / v9 with its fixed-point kernel at d64 as well;
    skips off sm_90 (where both are v5); yields the names of that version's fixed-point wgmma
    kernels launched, to assert that the test reached them."""
    from cupyflash.bench import tune
    from cupyflash.kernels import mma_bwd, mma_fwd

    if mma_fwd.current_arch() != "90":
        pytest.skip("the fixed-point dQ kernel is sm_90's (wgmma)")
    dev = tune.load_dev_backward()  # the versions are dev/mma_bwd.py's (a source checkout)
    monkeypatch.setattr(mma_bwd, "DEV_VERSION", request.param)
    monkeypatch.setattr(dev, "WGMMA_FIXED_D_TILES", mma_bwd.WGMMA_FIXED_KERNEL_D_TILES)
    monkeypatch.setattr(dev, "WGMMA_PANEL_D_TILES", mma_bwd.WGMMA_FIXED_KERNEL_D_TILES)
    suffix = {"v7": "_dqfixed", "v9": "_dqfixed_panels"}[request.param]
    names, launch = [], mma_bwd.launch

    def spy(spec, grid, args):
        if spec.name.endswith(suffix):
            names.append(spec.name)
        launch(spec, grid, args)

    monkeypatch.setattr(mma_bwd, "launch", spy)
    yield names


def _rng():
    """A fresh generator and its seed (for the failure message)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def _grads(q, k, v, do, causal, deterministic, lse_shift=0.0):
    import cupyflash
    from cupyflash.testing import poisoned_outputs

    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="mma")
        return cupyflash.flash_attn_backward(do, q, k, v, o, lse + lse_shift, causal=causal, backend="mma",
                                             deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,decades", [(BF16, 30), (np.float16, 3)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
def test_rows_of_very_different_magnitude_keep_their_precision(dtype, decades, d, fixed_kernel_launches):
    """dO rows scaled by 10^-decades/2 .. 10^decades/2: each dQ row, relative to its own size, is as
    close to float64 as the float adds' (a scale shared by all rows would flush the small ones)."""
    import cupy

    rng, seed = _rng()
    q, k, v = (rng.standard_normal((2, 301, 4, d)).astype(dtype) for _ in range(3))
    row_scale = 10.0 ** rng.uniform(-decades / 2, decades / 2, (2, 301, 4, 1))
    do = (rng.standard_normal((2, 301, 4, d)) * row_scale).astype(dtype)
    dev = [cupy.asarray(x) for x in (q, k, v, do)]
    dq_fixed = _grads(*dev, causal=False, deterministic=True)[0].get().astype(np.float64)
    dq_float = _grads(*dev, causal=False, deterministic=False)[0].get().astype(np.float64)
    dq_ref = reference.attention_backward(do, q, k, v, causal=False)[0]
    size = np.abs(dq_ref).max(axis=-1)
    err_fixed = np.abs(dq_fixed - dq_ref).max(axis=-1) / size
    err_float = np.abs(dq_float - dq_ref).max(axis=-1) / size
    assert fixed_kernel_launches
    assert np.all(err_fixed <= 2 * err_float + 2.0 ** -9), (seed, float(np.max(err_fixed - 2 * err_float)))


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["do_row", "q_row", "k_row", "v_row"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_nan_inputs_poison_the_same_dq_rows_as_float_adds(where, causal, d, fixed_kernel_launches):
    """A NaN in one row of dO, Q, K or V: the rows of dQ that come out NaN are exactly those the
    float atomic adds make NaN (with causal masking, rows that never see a NaN key stay finite);
    the finite rows agree with the float adds."""
    import cupy

    rng, seed = _rng()
    shape = (1, 200, 2, d)
    q, k, v, do = (rng.standard_normal(shape).astype(BF16) for _ in range(4))
    target = {"do_row": do, "q_row": q, "k_row": k, "v_row": v}[where]
    target[0, 120, 1, 7] = np.nan
    dev = [cupy.asarray(x) for x in (q, k, v, do)]
    dq_fixed = _grads(*dev, causal=causal, deterministic=True)[0].get().astype(np.float64)
    dq_float = _grads(*dev, causal=causal, deterministic=False)[0].get().astype(np.float64)
    nan_fixed, nan_float = np.isnan(dq_fixed).any(axis=-1), np.isnan(dq_float).any(axis=-1)
    assert fixed_kernel_launches and nan_float.any()
    np.testing.assert_array_equal(nan_fixed, nan_float, err_msg=f"seed {seed}")
    finite = ~nan_float
    np.testing.assert_allclose(dq_fixed[finite], dq_float[finite], rtol=2.0 ** -6, atol=1e-2, err_msg=f"seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_an_lse_far_below_the_forwards_gives_nan_rows_or_the_float_rows_never_wrapped_ones(d, fixed_kernel_launches):
    """lse - 30: each P_ij = 2^(x + 43) is clamped at 1 by the recompute (softmax_bwd.cuh), so a row's
    P sums to up to seqlen_k instead of 1 and its contributions may pass the sum-safe limit. Every
    row of dQ is then either NaN (the guard) or the float atomic path's row for the same lse: int64
    sums that wrapped would give finite garbage instead."""
    import cupy

    rng, seed = _rng()
    q, k, v, do = (cupy.asarray(rng.standard_normal((1, 300, 2, d)).astype(BF16)) for _ in range(4))
    dq = _grads(q, k, v, do, causal=False, deterministic=True, lse_shift=-30.0)[0].get().astype(np.float64)
    assert fixed_kernel_launches
    dq_float = _grads(q, k, v, do, causal=False, deterministic=False, lse_shift=-30.0)[0].get().astype(np.float64)
    guarded = np.isnan(dq).any(axis=-1)
    assert not np.isinf(dq).any(), f"seed {seed}"
    kept = ~guarded & np.isfinite(dq_float).all(axis=-1)
    np.testing.assert_allclose(dq[kept], dq_float[kept], rtol=2.0 ** -6, atol=1e-2 * np.abs(dq_float[kept]).max(),
                               err_msg=f"seed {seed}")
