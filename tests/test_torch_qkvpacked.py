"""cupyflash.torch's packed layouts (flash-attn's flash_attn_qkvpacked_func, flash_attn_kvpacked_func
and their varlen forms) on CPU tensors (the NumPy twin): each is the unpacked call, its gradient one
tensor shaped like the packed input equal to the unpacked call's gradients stacked, gradcheck in
float64, return_attn_probs, the shape errors. On CUDA tensors: tests/test_torch_gpu.py.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupyflash.torch import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,  # noqa: E402
                             flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                             flash_attn_varlen_qkvpacked_func)


def _random(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def _grads(out, inputs, seed):
    do = _random(*out.shape, seed=seed, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, do)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_is_the_unpacked_call(dtype, causal):
    qkv = _random(2, 6, 3, 2, 8, seed=1, dtype=dtype).requires_grad_()
    o, lse, s_dmask = flash_attn_qkvpacked_func(qkv, causal=causal, softcap=2.0, return_attn_probs=True)
    (dqkv,) = _grads(o, (qkv,), 2)
    parts = [qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3)]
    o_want, lse_want, _ = flash_attn_func(*parts, causal=causal, softcap=2.0, return_attn_probs=True)
    want = _grads(o_want, parts, 2)
    assert dqkv.shape == qkv.shape and s_dmask.numel() == 0
    torch.testing.assert_close(o, o_want, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_want, rtol=0, atol=0)
    for i in range(3):
        torch.testing.assert_close(dqkv[:, :, i], want[i], rtol=0, atol=0)


def test_qkvpacked_gradcheck():
    qkv = _random(1, 4, 3, 2, 4, seed=3).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: flash_attn_qkvpacked_func(x, causal=True), (qkv,))


def test_kvpacked_with_gqa_and_a_sink():
    q = _random(2, 5, 4, 8, seed=4).requires_grad_()
    kv = _random(2, 7, 2, 2, 8, seed=5).requires_grad_()
    sink = _random(4, seed=6, dtype=torch.float32).requires_grad_()
    o = flash_attn_kvpacked_func(q, kv, causal=True, window_size=(3, 0), sink=sink)
    dq, dkv, dsink = _grads(o, (q, kv, sink), 7)
    k, v = (kv.detach()[:, :, i].clone().requires_grad_() for i in range(2))
    o_want = flash_attn_func(q, k, v, causal=True, window_size=(3, 0), sink=sink)
    dq_want, dk_want, dv_want, dsink_want = _grads(o_want, (q, k, v, sink), 7)
    torch.testing.assert_close(o, o_want, rtol=0, atol=0)
    assert dkv.shape == kv.shape
    for got, want in [(dq, dq_want), (dkv[:, :, 0], dk_want), (dkv[:, :, 1], dv_want), (dsink, dsink_want)]:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_varlen_qkvpacked_gradcheck_and_the_unpacked_call():
    lengths = [3, 0, 4]
    cu = _cu(lengths)
    qkv = _random(7, 3, 2, 4, seed=8).requires_grad_()
    o = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=True)
    (dqkv,) = _grads(o, (qkv,), 9)
    parts = [qkv.detach()[:, i].clone().requires_grad_() for i in range(3)]
    o_want = flash_attn_varlen_func(*parts, cu, cu, max(lengths), max(lengths), causal=True)
    torch.testing.assert_close(o, o_want, rtol=0, atol=0)
    for i, want in enumerate(_grads(o_want, parts, 9)):
        torch.testing.assert_close(dqkv[:, i], want, rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda x: flash_attn_varlen_qkvpacked_func(x, cu, max(lengths), causal=True),
                                    (qkv,))


def test_varlen_kvpacked_with_gqa():
    lengths_q, lengths_k = [2, 5], [4, 6]
    q = _random(7, 4, 8, seed=10).requires_grad_()
    kv = _random(10, 2, 2, 8, seed=11).requires_grad_()
    args = (_cu(lengths_q), _cu(lengths_k), max(lengths_q), max(lengths_k))
    o = flash_attn_varlen_kvpacked_func(q, kv, *args)
    dq, dkv = _grads(o, (q, kv), 12)
    k, v = (kv.detach()[:, i].clone().requires_grad_() for i in range(2))
    o_want = flash_attn_varlen_func(q, k, v, *args)
    dq_want, dk_want, dv_want = _grads(o_want, (q, k, v), 12)
    torch.testing.assert_close(o, o_want, rtol=0, atol=0)
    for got, want in [(dq, dq_want), (dkv[:, 0], dk_want), (dkv[:, 1], dv_want)]:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("call, shape, message", [
    (flash_attn_qkvpacked_func, (2, 4, 2, 2, 8), r"qkv must be \(batch, seqlen, 3"),
    (lambda kv: flash_attn_kvpacked_func(torch.zeros(2, 4, 2, 8), kv), (2, 4, 2, 8), r"kv must be \(batch, seqlen_k, 2"),
    (lambda qkv: flash_attn_varlen_qkvpacked_func(qkv, _cu([4]), 4), (4, 2, 2, 8), r"qkv must be \(total, 3"),
    (lambda kv: flash_attn_varlen_kvpacked_func(torch.zeros(4, 2, 8), kv, _cu([4]), _cu([4]), 4, 4), (4, 3, 2, 8),
     r"kv must be \(total_k, 2"),
])
def test_wrong_packed_shapes_are_refused(call, shape, message):
    with pytest.raises(ValueError, match=message):
        call(torch.zeros(shape))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        call(np.zeros(shape))
