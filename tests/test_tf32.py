"""precision= (cupyflash.precision) on the CPU: the argument on every entry point, its errors, the
NumPy twin's "tf32" (one product on tf32 operands: at most 2x standard float16 attention's error,
never float32's accuracy) and "ieee" (float32's products), and other dtypes ignoring it.
The kernels' own checks: tests/kernels/test_flash_fwd_tf32.py (CPU) and tests/test_tf32_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import reference
from cupyflash.precision import check_precision, round_tf32
from cupyflash.testing.tolerance import max_abs_error


def _inputs(dtype=np.float32, shape=(1, 97, 2, 48), seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(4))


def test_check_precision():
    assert check_precision(None) == "ieee" and check_precision("ieee") == "ieee" and check_precision("tf32") == "tf32"
    for bad in ("highest", "fp32", "TF32", 3, True):
        with pytest.raises(ValueError, match="precision must be one of"):
            check_precision(bad)


def test_every_entry_point_checks_precision():
    q, k, v, do = _inputs()
    o, lse = cupyflash.flash_attn_func(q, k, v, backend="numpy", return_lse=True)
    calls = [
        lambda p: cupyflash.flash_attn_func(q, k, v, backend="numpy", precision=p),
        lambda p: cupyflash.flash_attn_backward(do, q, k, v, o, lse, backend="numpy", precision=p),
        lambda p: cupyflash.flash_attn_vjp(q, k, v, backend="numpy", precision=p),
        lambda p: cupyflash.flash_attn_varlen_func(q[0], k[0], v[0], np.array([0, 97], np.int32),
                                                   np.array([0, 97], np.int32), 97, 97, backend="numpy", precision=p),
        lambda p: cupyflash.flash_attn_with_kvcache(q[:, :3], k, v, backend="numpy", precision=p),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="precision must be one of"):
            call("highest")
        call("tf32")
        call(None)


def test_twin_tf32_rounds_operands_and_is_a_16bit_accuracy():
    q, k, v, _ = _inputs(seed=1)
    ieee = cupyflash.flash_attn_func(q, k, v, backend="numpy")
    tf32 = cupyflash.flash_attn_func(q, k, v, backend="numpy", precision="tf32")
    o_ref, _ = reference.attention(q, k, v)
    o_f16, _ = reference.standard_attention(q, k, v, dtype=np.float16)
    err_tf32, err_ieee = max_abs_error(tf32, o_ref), max_abs_error(ieee, o_ref)
    assert err_tf32 <= 2 * max_abs_error(o_f16, o_ref)
    assert err_tf32 > 100 * err_ieee  # not float32's accuracy: the rounding happened
    # the operands alone rounded (P too): within float32 summation of the twin's own result
    rounded = cupyflash.flash_attn_func(round_tf32(q), round_tf32(k), round_tf32(v), backend="numpy")
    assert 0 < max_abs_error(rounded, o_ref) and max_abs_error(tf32, rounded) < err_tf32


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_dtypes_ignore_precision(dtype):
    q, k, v, _ = _inputs(dtype)
    assert np.array_equal(cupyflash.flash_attn_func(q, k, v, backend="numpy"),
                          cupyflash.flash_attn_func(q, k, v, backend="numpy", precision="tf32"))


def test_round_tf32():
    x = np.array([1.0, 1.0 + 2.0 ** -11, 1.0 + 2.0 ** -12, -(1.0 + 2.0 ** -11), np.inf, -np.inf, np.nan], np.float32)
    r = round_tf32(x)
    assert r[:6].tolist() == [1.0, 1.0 + 2.0 ** -10, 1.0, -(1.0 + 2.0 ** -10), np.inf, -np.inf] and np.isnan(r[6])
    assert not (r[:4].view(np.uint32) & np.uint32(0x1FFF)).any()


def test_torch_functions_pass_precision_through():
    torch = pytest.importorskip("torch")
    from cupyflash import torch as cf_torch

    q, k, v, _ = _inputs(seed=3)
    want_tf32 = cupyflash.flash_attn_func(q, k, v, backend="numpy", precision="tf32")
    want_ieee = cupyflash.flash_attn_func(q, k, v, backend="numpy")
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    got_tf32 = cf_torch.flash_attn_func(tq, tk, tv, precision="tf32")
    assert np.array_equal(got_tf32.detach().numpy(), want_tf32)
    assert np.array_equal(cf_torch.flash_attn_func(tq, tk, tv).detach().numpy(), want_ieee)
    got_tf32.sum().backward()  # the backward takes the precision too (float32 on CUDA cores: "ieee")
    assert tq.grad is not None and np.isfinite(tq.grad.numpy()).all()
    cu = torch.tensor([0, 97], dtype=torch.int32)
    varlen_tf32 = cf_torch.flash_attn_varlen_func(tq[0], tk[0], tv[0], cu, cu, 97, 97, precision="tf32")
    assert np.array_equal(varlen_tf32.detach().numpy(), want_tf32[0])
    cache = cf_torch.flash_attn_with_kvcache(tq.detach(), tk.detach().clone(), tv.detach().clone(),
                                             cache_seqlens=97, precision="tf32")
    # the KV-cache twin (its own tiling) rounds the same operands: float32 summation apart
    assert max_abs_error(cache.numpy(), want_tf32) < 1e-5 < max_abs_error(cache.numpy(), want_ieee)
    for call in (lambda: cf_torch.flash_attn_func(tq, tk, tv, precision="fp32"),
                 lambda: cf_torch.flash_attn_varlen_func(tq[0], tk[0], tv[0], cu, cu, 97, 97, precision="fp32"),
                 lambda: cf_torch.flash_attn_with_kvcache(tq.detach(), tk.detach(), tv.detach(), precision="fp32")):
        with pytest.raises(ValueError, match="precision must be one of"):
            call()
