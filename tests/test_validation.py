"""Every bad input is rejected before any launch with a message naming the argument."""
import math
import re

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
    ("k/v shape mismatch", fwd_case(v=lambda x: x[:, :3]), ValueError, r"k and v must have the same \(batch, seqlen, nheads\)"),
    ("batch mismatch", fwd_case(q=lambda x: np.concatenate([x, x])), ValueError, "same batch size"),
    ("headdim mismatch", fwd_case(q=lambda x: x[..., :4]), ValueError, "same headdim"),
    ("headdim zero", fwd_case(q=lambda x: x[..., :0], k=lambda x: x[..., :0], v=lambda x: x[..., :0]),
     ValueError, "headdim must be between 1 and 256"),
    ("headdim 257", lambda: flash_attn_func(*arrays(d=257), backend="numpy"), ValueError,
     "headdim must be between 1 and 256"),
    ("nheads not multiple", lambda: flash_attn_func(*arrays(h=3, hkv=2), backend="numpy"), ValueError,
     r"nheads of q \(3\) must be a multiple of nheads of k/v \(2\)"),
    ("nheads_kv zero", lambda: flash_attn_func(*arrays(h=2, hkv=0), backend="numpy"), ValueError,
     "k/v may have 0 heads only when q has 0"),
    ("scale nan", fwd_case(softmax_scale=math.nan), ValueError, "softmax_scale must be finite"),
    ("scale inf", fwd_case(softmax_scale=-math.inf), ValueError, "softmax_scale must be finite"),
    ("scale 0-d nan", fwd_case(softmax_scale=np.array(np.nan)), ValueError, "softmax_scale must be finite"),
    ("scale int beyond float", fwd_case(softmax_scale=10**400), ValueError, "softmax_scale must be finite"),
    ("scale string", fwd_case(softmax_scale="0.1"), TypeError, "softmax_scale must be a real number"),
    ("scale bool", fwd_case(softmax_scale=True), TypeError, "softmax_scale must be a real number"),
    ("scale numpy bool", fwd_case(softmax_scale=np.bool_(True)), TypeError, "softmax_scale must be a real number"),
    ("scale complex", fwd_case(softmax_scale=1j), TypeError, "softmax_scale must be a real number"),
    ("scale array", fwd_case(softmax_scale=np.ones(2)), TypeError, "softmax_scale must be a real number"),
    ("scale 0-d complex", fwd_case(softmax_scale=np.array(1 + 0j)), TypeError,
     "softmax_scale must be a real number"),
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
    ("do wrong shape", "do", lambda x: x[:, :3], ValueError, "do must have the output's shape"),
    ("o wrong shape", "o", lambda x: x[..., :4], ValueError, "o must have the output's shape"),
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
    with pytest.raises(RuntimeError, match=r"^backend='simt'.* CUDA device"):
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


# --- zero-size dimensions: empty results of the right shapes, forward and backward ----------------

ZERO_SIZES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
    (1, 5, 7, 0, 1),
    (1, 5, 7, 0, 0),
    (1, 5, 7, 0, 2),
    (0, 5, 7, 2, 1),
    (2, 0, 7, 2, 1),
    (2, 5, 0, 4, 2),
    (2, 0, 0, 2, 2),
]


def check_empty_results(q, k, v, o, lse, grads):
    batch, seqlen_q, nheads, _ = q.shape
    acc = np.float64 if q.dtype == np.float64 else np.float32
    assert o.shape == q.shape and o.dtype == q.dtype and (o == 0).all()
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == acc and (lse == -np.inf).all()
    for grad, x in zip(grads, (q, k, v)):
        assert grad.shape == x.shape and grad.dtype == x.dtype and (grad == 0).all()


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float64])
@pytest.mark.parametrize("b,sq,sk,h,hkv", ZERO_SIZES)
def test_zero_size_dimensions_give_empty_results(b, sq, sk, h, hkv, dtype):
    q, k, v = arrays(b=b, sq=sq, sk=sk, h=h, hkv=hkv, dtype=dtype)
    o, lse = flash_attn_func(q, k, v, return_lse=True, backend="numpy")
    grads = flash_attn_backward(np.ones_like(q), q, k, v, o, lse, backend="numpy")
    check_empty_results(q, k, v, o, lse, grads)
    # The twin itself, called directly, agrees.
    from cupyflash import numpy_backend

    o_twin, lse_twin = numpy_backend.forward(q, k, v, softmax_scale=0.5, causal=True)
    grads_twin = numpy_backend.backward(np.ones_like(q), q, k, v, o_twin, lse_twin, softmax_scale=0.5,
                                        causal=True)
    check_empty_results(q, k, v, o_twin, lse_twin, grads_twin)


# --- array kinds and dtypes --------------------------------------------------------------------

def test_masked_array_is_rejected_naming_the_argument():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"k is a NumPy masked array.*k\.filled\(value\) or k\.data"):
        flash_attn_func(q, np.ma.masked_array(k, mask=k > 1), v, backend="numpy")


@pytest.mark.parametrize("dtype", [">f2", ">f4", ">f8"])
def test_big_endian_arrays_are_converted(dtype):
    q, k, v = arrays(dtype=np.dtype(dtype).newbyteorder("="))
    swapped = [x.astype(dtype) for x in (q, k, v)]
    assert not swapped[0].dtype.isnative
    o, lse = flash_attn_func(*swapped, return_lse=True, backend="numpy")
    o_native, lse_native = flash_attn_func(q, k, v, return_lse=True, backend="numpy")
    assert o.dtype.isnative and o.dtype == o_native.dtype
    np.testing.assert_array_equal(o, o_native)
    np.testing.assert_array_equal(lse, lse_native)
    do = np.ones_like(q)
    for grad, expected in zip(flash_attn_backward(do.astype(dtype), *swapped, o, lse, backend="numpy"),
                              flash_attn_backward(do, q, k, v, o_native, lse_native, backend="numpy")):
        np.testing.assert_array_equal(grad, expected)


UNSUPPORTED_DTYPES = [object, np.str_, np.bool_, np.int64, np.uint8, np.complex128, np.float128
                      if hasattr(np, "float128") else np.longdouble]


@pytest.mark.parametrize("name", ["q", "k", "v", "do", "o"])
@pytest.mark.parametrize("dtype", UNSUPPORTED_DTYPES, ids=lambda d: np.dtype(d).name)
def test_unsupported_dtype_is_named_with_the_supported_ones(name, dtype):
    inputs = backward_inputs()
    inputs[name] = inputs[name].astype(dtype)
    message = (rf"^{name} has dtype {re.escape(str(inputs[name].dtype))}; "
               "expected one of float16, bfloat16, float32, float64$")
    if name in ("q", "k", "v"):
        with pytest.raises(TypeError, match=message):
            flash_attn_func(inputs["q"], inputs["k"], inputs["v"], backend="numpy")
    with pytest.raises(TypeError, match=message):
        flash_attn_backward(*(inputs[n] for n in ("do", "q", "k", "v", "o", "lse")), backend="numpy")


def test_torch_cpu_tensors_of_every_dtype_give_numpy_results():
    torch = pytest.importorskip("torch")
    q, k, v = arrays(dtype=np.float32)
    for torch_dtype, numpy_dtype in ((torch.bfloat16, ml_dtypes.bfloat16), (torch.float16, np.float16),
                                     (torch.float32, np.float32), (torch.float64, np.float64)):
        tensors = [torch.from_numpy(x).to(torch_dtype) for x in (q, k, v)]
        tensors[0] = tensors[0].transpose(1, 2).contiguous().transpose(1, 2)  # not C-contiguous
        expected = [x.astype(numpy_dtype) for x in (q, k, v)]
        o, lse = flash_attn_func(*tensors, return_lse=True, backend="numpy")
        o_numpy, lse_numpy = flash_attn_func(*expected, return_lse=True, backend="numpy")
        assert isinstance(o, np.ndarray) and o.dtype == np.dtype(numpy_dtype)
        np.testing.assert_array_equal(o.view(np.uint8), o_numpy.view(np.uint8))
        np.testing.assert_array_equal(lse, lse_numpy)
        do = torch.ones_like(tensors[0])
        grads = flash_attn_backward(do, *tensors, torch.from_numpy(o.view(np.uint8)).view(torch_dtype)
                                    if numpy_dtype is ml_dtypes.bfloat16 else torch.from_numpy(o),
                                    torch.from_numpy(lse), backend="numpy")
        expected_grads = flash_attn_backward(np.ones_like(expected[0]), *expected, o_numpy, lse_numpy,
                                             backend="numpy")
        for grad, expected_grad in zip(grads, expected_grads):
            np.testing.assert_array_equal(grad.view(np.uint8), expected_grad.view(np.uint8))


def test_torch_tensor_of_an_unsupported_dtype_is_named():
    torch = pytest.importorskip("torch")
    q, k, v = arrays()
    for dtype in (torch.float8_e4m3fn, torch.complex64, torch.int32):
        bad = torch.from_numpy(q).to(dtype)
        with pytest.raises(TypeError, match=r"^v .*expected one of float16, bfloat16, float32, float64"):
            flash_attn_func(q, k, bad, backend="numpy")


def test_torch_tensor_requiring_grad_is_rejected_naming_the_argument():
    torch = pytest.importorskip("torch")
    q, k, v = arrays()
    for dtype in (torch.float32, torch.bfloat16):
        tracked = torch.from_numpy(q).to(dtype).requires_grad_()
        with pytest.raises(TypeError, match=r"q is a torch tensor that requires grad; pass q\.detach\(\)"):
            flash_attn_func(tracked, k, v, backend="numpy")


# --- softmax_scale: any finite real number; scores that can overflow are refused ---------------

@pytest.mark.parametrize("scale", [0, 0.0, -0.5, -3, 2, np.float32(0.25), np.float16(-1.5), np.int64(2),
                                   np.array(0.25), np.array(-2, dtype=np.int32),
                                   np.array(0.5, dtype=ml_dtypes.bfloat16)],
                         ids=lambda s: f"{type(s).__name__}({s})")
def test_any_finite_real_scale_matches_the_reference(scale):
    q, k, v = arrays(dtype=np.float64)
    do = np.random.default_rng(2).standard_normal(q.shape)
    o, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, return_lse=True, backend="numpy")
    o_ref, lse_ref = cupyflash.reference.attention(q, k, v, softmax_scale=float(scale), causal=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    grads = flash_attn_backward(do, q, k, v, o, lse, softmax_scale=scale, causal=True, backend="numpy")
    refs = cupyflash.reference.attention_backward(do, q, k, v, softmax_scale=float(scale), causal=True)
    for grad, ref in zip(grads, refs):
        np.testing.assert_allclose(grad, ref, rtol=1e-10, atol=1e-12)


def test_zero_scale_is_uniform_attention():
    q, k, v = arrays(sq=4, sk=6)
    o, lse = flash_attn_func(q, k, v, softmax_scale=0, return_lse=True, backend="numpy")
    np.testing.assert_allclose(o, np.broadcast_to(v.mean(axis=1, keepdims=True), o.shape), rtol=1e-6)
    np.testing.assert_allclose(lse, np.log(6), rtol=1e-6)


OVERFLOWING_SCALES = [  # (dtype, scale, magnitude of the inputs)
    (np.float32, 1e38, 1.0),
    (ml_dtypes.bfloat16, 1e37, 4.0),
    (np.float32, -1e36, 100.0),
    (np.float16, 1e36, 1000.0),
    (np.float64, 1e306, 10.0),
    (np.float32, 3e38, 0.0),  # scale * log2(e) alone is past float32
]


@pytest.mark.parametrize("dtype,scale,magnitude", OVERFLOWING_SCALES)
def test_scale_that_overflows_the_scores_is_refused(dtype, scale, magnitude):
    q, k, v = (x * magnitude for x in arrays(dtype=np.float64))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    message = rf"^softmax_scale={re.escape(f'{scale:g}')}.*{'float64' if dtype is np.float64 else 'float32'}"
    with pytest.raises(ValueError, match=message):
        flash_attn_func(q, k, v, softmax_scale=scale, backend="numpy")
    o, lse = flash_attn_func(q, k, v, return_lse=True, backend="numpy")
    with pytest.raises(ValueError, match=message):
        flash_attn_backward(np.ones_like(q), q, k, v, o, lse, softmax_scale=scale, backend="numpy")


def test_large_scale_that_fits_gives_a_finite_correct_result():
    # |scores| <= 1e30 * log2(e) * 8 * 1 * 1: near float32's top, yet finite.
    q, k, v = arrays(dtype=np.float64)
    q, k, v = (np.clip(x, -1, 1).astype(np.float32) for x in (q, k, v))
    o, lse = flash_attn_func(q, k, v, softmax_scale=1e30, return_lse=True, backend="numpy")
    o_ref, lse_ref = cupyflash.reference.attention(q, k, v, softmax_scale=1e30)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(o, o_ref, atol=1e-5)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5)


@pytest.mark.parametrize("dtype,headdim,scale,reads", [
    (ml_dtypes.bfloat16, 64, None, False),   # the ordinary call
    (np.float32, 3, None, False),            # 1/sqrt(3) * log2(e) < 1
    (np.float16, 64, 1e6, False),            # float16's range cannot reach float32's top
    (ml_dtypes.bfloat16, 64, -0.5, False),
    (ml_dtypes.bfloat16, 64, 2.0, True),     # amplifies, and bfloat16 reaches float32's top
    (np.float32, 2, None, True),             # 1/sqrt(2) * log2(e) > 1
    (np.float64, 64, 1e3, True),
])
def test_scale_check_reads_the_arrays_only_when_the_dtype_range_allows_overflow(
        monkeypatch, dtype, headdim, scale, reads):
    from cupyflash import _arrays

    read = []
    real_max_abs = _arrays._max_abs
    monkeypatch.setattr(_arrays, "_max_abs", lambda x: read.append(x.shape) or real_max_abs(x))
    flash_attn_func(*arrays(d=headdim, dtype=dtype), softmax_scale=scale, backend="numpy")
    assert bool(read) == reads


def test_max_abs_of_16_bit_arrays_from_their_bits():
    from cupyflash import _arrays

    x = np.array([[0.5, -3.25], [2.0, -0.0]])
    for dtype in (np.float16, ml_dtypes.bfloat16):
        assert _arrays._max_abs(x.astype(dtype)) == 3.25
        assert _arrays._max_abs(x.astype(dtype)[:, ::-1].T) == 3.25
    assert _arrays._max_abs(np.array([-np.inf, 1.0], np.float16)) == math.inf


# --- the modules docs/api.md names ------------------------------------------------------------

def test_every_module_name_in_the_api_docs_resolves():
    """``cupyflash.<name>`` is an attribute after a plain ``import cupyflash`` (in a fresh
    interpreter); names below a subpackage resolve once that subpackage is imported."""
    import pathlib
    import re
    import subprocess
    import sys

    docs = (pathlib.Path(__file__).parents[1] / "docs" / "api.md").read_text()
    names = sorted(set(re.findall(r"\bcupyflash(?:\.[A-Za-z_]\w*)+", docs)))
    assert "cupyflash.numpy_backend" in names
    script = (
        "import importlib, sys\n"
        "import cupyflash\n"
        "for name in sys.argv[1:]:\n"
        "    parts = name.split('.')\n"
        "    if not hasattr(cupyflash, parts[1]):\n"
        "        raise SystemExit(f'{name}: cupyflash has no attribute {parts[1]!r}')\n"
        "    obj, path = getattr(cupyflash, parts[1]), 'cupyflash.' + parts[1]\n"
        "    for part in parts[2:]:\n"
        "        path += '.' + part\n"
        "        if not hasattr(obj, part):\n"
        "            importlib.import_module(path)  # a module below a subpackage\n"
        "        obj = getattr(obj, part)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + result.stdout
