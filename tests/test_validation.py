"""Every bad input is rejected before any launch with a message naming the argument."""
import math

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash import flash_attn_backward, flash_attn_func


def arrays(b=1, sq=5, sk=7, h=2, hkv=2, d=8, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    return q, k, v


def fwd_case(**changes):
    q, k, v = arrays()
    kwargs = {}
    for key, value in changes.items():
        if key in ("q", "k", "v"):
            locals_ = {"q": q, "k": k, "v": v}
            locals_[key] = value(locals_[key]) if callable(value) else value
            q, k, v = locals_["q"], locals_["k"], locals_["v"]
        else:
            kwargs[key] = value
    return lambda: flash_attn_func(q, k, v, backend="numpy", **kwargs)


FORWARD_ERRORS = [
    ("int dtype", fwd_case(q=lambda x: x.astype(np.int32)), TypeError, "q has dtype int32"),
    ("complex dtype", fwd_case(q=lambda x: x.astype(np.complex64)), TypeError, "q has dtype complex64"),
    ("mismatched k dtype", fwd_case(k=lambda x: x.astype(np.float64)), TypeError, "k has dtype float64"),
    ("mismatched v dtype", fwd_case(v=lambda x: x.astype(np.float16)), TypeError, "v has dtype float16"),
    ("q 3-d", fwd_case(q=lambda x: x[0]), ValueError, "q must have 4 dimensions"),
    ("k 5-d", fwd_case(k=lambda x: x[None]), ValueError, "k must have 4 dimensions"),
    ("v 2-d", fwd_case(v=lambda x: x[0, :, 0]), ValueError, "v must have 4 dimensions"),
    ("k/v shape mismatch", fwd_case(v=lambda x: x[:, :3]), ValueError, "k and v must have the same shape"),
    ("batch mismatch", fwd_case(q=lambda x: np.concatenate([x, x])), ValueError, "same batch size"),
    ("headdim mismatch", fwd_case(q=lambda x: x[..., :4]), ValueError, "same headdim"),
    ("headdim zero", fwd_case(q=lambda x: x[..., :0], k=lambda x: x[..., :0], v=lambda x: x[..., :0]),
     ValueError, "headdim must be between 1 and 256"),
    ("headdim 257", lambda: flash_attn_func(*arrays(d=257), backend="numpy"), ValueError,
     "headdim must be between 1 and 256"),
    ("nheads not multiple", lambda: flash_attn_func(*arrays(h=3, hkv=2), backend="numpy"), ValueError,
     "positive multiple"),
    ("nheads_kv zero", lambda: flash_attn_func(*arrays(h=2, hkv=0), backend="numpy"), ValueError,
     "positive multiple"),
    ("scale nan", fwd_case(softmax_scale=math.nan), ValueError, "softmax_scale must be finite and > 0"),
    ("scale inf", fwd_case(softmax_scale=math.inf), ValueError, "softmax_scale must be finite and > 0"),
    ("scale zero", fwd_case(softmax_scale=0.0), ValueError, "softmax_scale must be finite and > 0"),
    ("scale negative", fwd_case(softmax_scale=-0.5), ValueError, "softmax_scale must be finite and > 0"),
    ("scale string", fwd_case(softmax_scale="0.1"), TypeError, "softmax_scale must be a real number"),
    ("scale bool", fwd_case(softmax_scale=True), TypeError, "softmax_scale must be a real number"),
    ("scale array", fwd_case(softmax_scale=np.ones(2)), TypeError, "softmax_scale must be a real number"),
    ("causal not bool", fwd_case(causal="yes"), TypeError, "causal must be a bool"),
    ("return_lse not bool", fwd_case(return_lse=1), TypeError, "return_lse must be a bool"),
    ("unknown backend", lambda: flash_attn_func(*arrays(), backend="triton"), ValueError,
     "backend must be one of"),
    ("q is a list", fwd_case(q=lambda x: x.tolist()), TypeError, "q must be an array"),
    ("k is None", fwd_case(k=None), TypeError, "k must be an array"),
    ("v is a scalar", fwd_case(v=1.0), TypeError, "v must be an array"),
]


@pytest.mark.parametrize("label,call,error,message", FORWARD_ERRORS, ids=[c[0] for c in FORWARD_ERRORS])
def test_forward_rejects(label, call, error, message):
    with pytest.raises(error, match=message):
        call()


def backward_inputs(dtype=np.float32):
    q, k, v = arrays(dtype=dtype)
    o, lse = flash_attn_func(q, k, v, return_lse=True, backend="numpy")
    do = np.random.default_rng(1).standard_normal(q.shape).astype(dtype)
    return dict(do=do, q=q, k=k, v=v, o=o, lse=lse)


BACKWARD_ERRORS = [
    ("do wrong shape", "do", lambda x: x[:, :3], ValueError, "do must have the shape of q"),
    ("o wrong shape", "o", lambda x: x[..., :4], ValueError, "o must have the shape of q"),
    ("do wrong dtype", "do", lambda x: x.astype(np.float64), TypeError, "do has dtype float64"),
    ("o wrong dtype", "o", lambda x: x.astype(np.float16), TypeError, "o has dtype float16"),
    ("lse wrong shape", "lse", lambda x: x[:, :, :2], ValueError, "lse must have shape"),
    ("lse transposed", "lse", lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2)), ValueError, "lse must have shape"),
    ("lse wrong dtype", "lse", lambda x: x.astype(np.float64), TypeError, "lse must have dtype float32"),
    ("lse not array", "lse", lambda x: "lse", TypeError, "lse must be an array"),
]


@pytest.mark.parametrize("label,name,change,error,message", BACKWARD_ERRORS, ids=[c[0] for c in BACKWARD_ERRORS])
def test_backward_rejects(label, name, change, error, message):
    inputs = backward_inputs()
    inputs[name] = change(inputs[name])
    with pytest.raises(error, match=message):
        flash_attn_backward(inputs.pop("do"), **{k: inputs[k] for k in ("q", "k", "v", "o", "lse")},
                            backend="numpy")


def test_backward_rejects_deterministic_not_bool():
    inputs = backward_inputs()
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attn_backward(inputs["do"], inputs["q"], inputs["k"], inputs["v"], inputs["o"], inputs["lse"],
                            backend="numpy", deterministic=None)


def test_vjp_rejects_return_lse():
    with pytest.raises(TypeError, match="return_lse"):
        cupyflash.flash_attn_vjp(*arrays(), return_lse=True, backend="numpy")


def test_gpu_backend_without_device_says_so():
    if cupyflash.gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        flash_attn_func(*arrays(), backend="simt")


def test_non_contiguous_last_dim_is_copied_not_rejected():
    q, k, v = arrays(d=8)
    wide = np.random.default_rng(3).standard_normal((1, 5, 2, 16)).astype(np.float32)
    q_strided = wide[..., ::2]  # last-dim stride 2 elements
    assert q_strided.strides[-1] != q_strided.itemsize
    out = flash_attn_func(q_strided, k, v, backend="numpy")
    expected = flash_attn_func(np.ascontiguousarray(q_strided), k, v, backend="numpy")
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_each_supported_dtype_is_accepted(dtype):
    o, lse = flash_attn_func(*arrays(dtype=dtype), return_lse=True, backend="numpy")
    assert o.dtype == np.dtype(dtype)
    assert lse.dtype == (np.float64 if dtype is np.float64 else np.float32)


def test_at_least_25_rejections_are_tested():
    assert len(FORWARD_ERRORS) + len(BACKWARD_ERRORS) + 2 >= 25


def test_arrays_on_different_gpus_are_rejected():
    """The device check itself (a machine with one GPU cannot build the real case)."""
    from types import SimpleNamespace

    from cupyflash import _arrays

    on = lambda device: SimpleNamespace(device=SimpleNamespace(id=device))
    _arrays.same_device({"q": on(0), "k": on(0), "v": on(0)})
    with pytest.raises(ValueError, match="same GPU; got q on device 0, k on device 1, v on device 0"):
        _arrays.same_device({"q": on(0), "k": on(1), "v": on(0)})


@pytest.mark.gpu
def test_arrays_on_two_real_gpus_are_rejected():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = arrays()
    with cupy.cuda.Device(0):
        q0 = cupy.asarray(q)
    with cupy.cuda.Device(1):
        k1, v1 = cupy.asarray(k), cupy.asarray(v)
    with pytest.raises(ValueError, match="same GPU"):
        flash_attn_func(q0, k1, v1)
