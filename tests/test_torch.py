"""cupyflash.torch on CPU tensors (the NumPy twin): gradcheck in float64, the lse's gradient, GQA,
causal, strided inputs, any subset of inputs requiring grad, bfloat16, fake/meta shapes, the
custom operators' opcheck, torch.compile(fullgraph=True) through AOTAutograd, the SDPA-shaped
helper, and the errors. The same paths on a GPU: tests/test_torch_gpu.py.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyflash  # noqa: E402
from cupyflash import reference  # noqa: E402
from cupyflash.backward_plans import own_forward_statistics  # noqa: E402
from cupyflash.torch import flash_attn_func, scaled_dot_product_attention  # noqa: E402


def qkv(batch=1, seqlen_q=5, seqlen_k=7, nheads=4, nheads_kv=2, headdim=8, dtype=torch.float64,
        requires_grad=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, headdim)] + [(batch, seqlen_k, nheads_kv, headdim)] * 2
    return [torch.randn(s, generator=generator, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
            for s in shapes]


# --- values and gradients -------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(5, 7), (7, 3)])  # (7, 3) causal: rows that see no key
def test_forward_matches_the_float64_reference(causal, seqlen_q, seqlen_k):
    q, k, v = qkv(seqlen_q=seqlen_q, seqlen_k=seqlen_k, requires_grad=False)
    o, lse, s_dmask = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    o_ref, lse_ref = reference.attention(q.numpy(), k.numpy(), v.numpy(), causal=causal)
    assert o.dtype == torch.float64 and o.is_contiguous() and o.shape == q.shape
    np.testing.assert_allclose(o.numpy(), o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), lse_ref, rtol=1e-12, atol=1e-12)
    assert s_dmask.numel() == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads, nheads_kv", [(2, 2), (4, 2), (3, 1)])
def test_gradcheck_float64(causal, nheads, nheads_kv):
    q, k, v = qkv(nheads=nheads, nheads_kv=nheads_kv, seqlen_q=6, seqlen_k=4)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_through_the_lse(causal):
    """The lse returned by return_attn_probs is differentiable (ring attention merges partial
    results by their lse). seqlen_q <= seqlen_k: a row that sees no key has lse = -inf, whose
    finite differences are NaN."""
    q, k, v = qkv(seqlen_q=4, seqlen_k=6)

    def out_and_lse(q, k, v):
        o, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        return o, lse

    assert torch.autograd.gradcheck(out_and_lse, (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: out_and_lse(q, k, v)[1], (q, k, v))


@pytest.mark.parametrize("causal, window_size", [(False, (2, 1)), (True, (1, -1)), (False, (0, 0)), (False, (-1, 2))])
def test_gradcheck_with_a_window(causal, window_size):
    """Sliding windows through the custom operators (the window is part of their schema), with the
    lse's gradient; the output against the float64 reference. Every row sees a key (seqlen_q <=
    seqlen_k and the window covers the diagonal's neighbourhood), so finite differences exist."""
    q, k, v = qkv(seqlen_q=5, seqlen_k=7)

    def out_and_lse(q, k, v):
        o, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window_size, return_attn_probs=True)
        return o, lse

    assert torch.autograd.gradcheck(out_and_lse, (q, k, v))
    expected = reference.attention(*(x.detach().numpy() for x in (q, k, v)), causal=causal, window_size=window_size)
    expected = expected[0] if isinstance(expected, tuple) else expected
    np.testing.assert_allclose(flash_attn_func(q, k, v, causal=causal, window_size=window_size).detach().numpy(),
                               expected, rtol=1e-12, atol=1e-12)


def test_window_size_errors_name_the_argument():
    q, k, v = qkv(requires_grad=False)
    for bad in [(4,), (-2, 0), (1.5, 2)]:
        with pytest.raises(ValueError, match="window_size"):
            flash_attn_func(q, k, v, window_size=bad)


def test_gradcheck_strided_inputs_and_a_scale():
    """Views with gaps between heads and rows (a slice of a packed qkv, a transposed tensor)."""
    generator = torch.Generator().manual_seed(1)
    qkv_packed = torch.randn(1, 5, 3, 4, 6, generator=generator, dtype=torch.float64)
    bhsd = torch.randn(1, 2, 5, 6, generator=generator, dtype=torch.float64)
    q = qkv_packed[:, :, 0].requires_grad_()
    k = bhsd.transpose(1, 2).requires_grad_()
    v = qkv_packed[:, :, 2, :2].requires_grad_()
    assert not q.is_contiguous() and not v.is_contiguous() and not k.is_contiguous()
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=0.7, causal=True),
                                    (q, k, v))


@pytest.mark.parametrize("needs_grad", [(True, False, False), (False, True, False), (False, False, True),
                                        (False, True, True)])
def test_any_subset_of_inputs_requires_grad(needs_grad):
    tensors = qkv(requires_grad=False)
    for t, needs in zip(tensors, needs_grad):
        t.requires_grad_(needs)
    flash_attn_func(*tensors, causal=True).square().sum().backward()
    full = [t.detach().clone().requires_grad_() for t in tensors]
    flash_attn_func(*full, causal=True).square().sum().backward()
    for t, f, needs in zip(tensors, full, needs_grad):
        if needs:
            assert torch.equal(t.grad, f.grad)
        else:
            assert t.grad is None


@pytest.mark.parametrize("compiled", [False, True])
def test_an_unused_lse_adds_no_work_to_the_backward(monkeypatch, compiled):
    """The lse's gradient term costs a forward and a backward; without a gradient flowing into
    the lse it must not run, eagerly or in a graph traced by AOTAutograd."""
    forwards = []
    forward = cupyflash.api.flash_attn_func
    monkeypatch.setattr(cupyflash.api, "flash_attn_func", lambda *a, **kw: forwards.append(1) or forward(*a, **kw))

    def loss(q, k, v):
        return flash_attn_func(q, k, v, causal=True).sum()

    fn = torch.compile(loss, fullgraph=True, backend="aot_eager") if compiled else loss
    fn(*qkv()).backward()
    assert len(forwards) == 1


def test_gradients_equal_cupyflash_backward_bitwise():
    q, k, v = qkv(nheads=4, nheads_kv=1, seqlen_q=9, seqlen_k=9, dtype=torch.float32)
    o = flash_attn_func(q, k, v, causal=True, deterministic=True)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5))
    o.backward(do)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    o_ref, lse_ref = cupyflash.flash_attn_func(*arrays, causal=True, return_lse=True, backend="numpy")
    # the autograd recomputes the float32 backward's statistics (its o and lse are its own)
    grads = cupyflash.flash_attn_backward(do.numpy(), *arrays, o_ref, lse_ref, causal=True, backend="numpy",
                                          statistics="recomputed")
    assert np.array_equal(o.detach().numpy(), o_ref)
    for t, g in zip((q, k, v), grads):
        assert np.array_equal(t.grad.numpy(), g)


def test_deterministic_reaches_the_backward(monkeypatch):
    seen = []
    backward = cupyflash.api.flash_attn_backward

    def recording(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return backward(*args, **kwargs)

    monkeypatch.setattr(cupyflash.api, "flash_attn_backward", recording)
    for deterministic in (True, False):
        flash_attn_func(*qkv(), deterministic=deterministic).sum().backward()
    assert seen == [True, False]


def test_bfloat16_and_float16_cpu_tensors():
    q, k, v = qkv(seqlen_q=16, seqlen_k=16, headdim=16, dtype=torch.float32, requires_grad=False)
    expected = flash_attn_func(q, k, v, causal=True)
    for dtype in (torch.bfloat16, torch.float16):
        low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        o = flash_attn_func(*low, causal=True)
        assert o.dtype == dtype
        # same bits as cupyflash's NumPy twin on the ml_dtypes / float16 arrays
        arrays = [t.detach().float().numpy().astype(cupyflash._dtypes.SUPPORTED[str(dtype)[6:]]) for t in low]
        o_numpy = cupyflash.flash_attn_func(*arrays, causal=True, backend="numpy")
        assert np.array_equal(o.float().detach().numpy(), o_numpy.astype(np.float32))
        torch.testing.assert_close(o.float(), expected, rtol=0.05, atol=0.05)
        o.float().square().sum().backward()
        assert all(t.grad.dtype == dtype and torch.isfinite(t.grad.float()).all() for t in low)


def test_empty_sequences():
    q, k, v = qkv(seqlen_q=0, seqlen_k=3)
    o = flash_attn_func(q, k, v)
    assert o.shape == q.shape
    o.sum().backward()
    assert k.grad.shape == k.shape and not k.grad.any()
    q, k, v = qkv(seqlen_q=3, seqlen_k=0)
    o, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert not o.any() and torch.isneginf(lse).all()


# --- tracing: fake tensors, opcheck, torch.compile ------------------------------------------------

@pytest.mark.parametrize("dtype, lse_dtype", [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_meta_and_fake_tensors_have_the_shapes(dtype, lse_dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes = [(2, 33, 8, 64), (2, 17, 2, 64), (2, 17, 2, 64)]

    def check(tensors):
        o, lse, _ = flash_attn_func(*tensors, causal=True, return_attn_probs=True)
        assert (o.shape, o.dtype, lse.shape, lse.dtype) == (shapes[0], dtype, (2, 8, 33), lse_dtype)
        assert o.device == tensors[0].device
        dq, dk, dv, dsink = torch.ops.cupyflash.flash_attn_backward(o, *tensors, o, lse, 0.125, True, 3, 0, True)
        assert [g.shape for g in (dq, dk, dv)] == shapes and dk.dtype == dtype and dsink.shape == (0,)

    check([torch.empty(s, dtype=dtype, device="meta") for s in shapes])
    with FakeTensorMode():
        check([torch.empty(s, dtype=dtype) for s in shapes])


def test_opcheck_of_both_operators():
    q, k, v = qkv(requires_grad=True)
    # (softmax_scale, causal, window_left, window_right, deterministic): a window (3, 0)
    report = torch.library.opcheck(torch.ops.cupyflash.flash_attn_forward.default, (q, k, v, 0.4, True, 3, 0, True))
    assert set(report.values()) == {"SUCCESS"}, report
    o, lse = torch.ops.cupyflash.flash_attn_forward(*(t.detach() for t in (q, k, v)), 0.4, True, 3, 0, True)
    args = (torch.randn_like(o), *(t.detach() for t in (q, k, v)), o, lse, 0.4, True, 3, 0, True)
    report = torch.library.opcheck(torch.ops.cupyflash.flash_attn_backward.default, args)
    assert set(report.values()) == {"SUCCESS"}, report


class TinyAttention(torch.nn.Module):
    def __init__(self, width=16, nheads=4, nheads_kv=2):
        super().__init__()
        self.nheads, self.nheads_kv, self.headdim = nheads, nheads_kv, width // nheads
        generator = torch.Generator().manual_seed(3)
        self.wq = torch.nn.Parameter(torch.randn(width, width, generator=generator, dtype=torch.float64) / 4)
        self.wkv = torch.nn.Parameter(torch.randn(width, 2 * nheads_kv * self.headdim, generator=generator,
                                                  dtype=torch.float64) / 4)

    def forward(self, x, return_lse=False):
        batch, seqlen, _ = x.shape
        q = (x @ self.wq).view(batch, seqlen, self.nheads, self.headdim)
        kv = (x @ self.wkv).view(batch, seqlen, 2, self.nheads_kv, self.headdim)
        o, lse, _ = flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=True, return_attn_probs=True)
        out = o.reshape(batch, seqlen, -1)
        return (out, lse) if return_lse else out


@pytest.mark.parametrize("return_lse", [False, True])
def test_torch_compile_fullgraph_matches_eager(return_lse):
    """Dynamo (fullgraph) and AOTAutograd trace the operators through their fake kernels; the
    aot_eager backend runs the traced graphs without Inductor's C++ compile, which on a 2-core CPU
    takes longer than this suite allows (Inductor itself is tested on the GPU)."""
    module = TinyAttention()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def loss(fn):
        module.zero_grad()
        if return_lse:
            out, lse = fn(x, return_lse=True)
            value = out.square().sum() + lse.sum()
        else:
            value = fn(x).square().sum()
        value.backward()
        return value.detach(), [p.grad.clone() for p in module.parameters()]

    eager = loss(module)
    compiled = loss(torch.compile(module, fullgraph=True, backend="aot_eager"))
    assert torch.equal(compiled[0], eager[0])
    assert all(torch.equal(a, b) for a, b in zip(compiled[1], eager[1]))


# --- scaled_dot_product_attention -----------------------------------------------------------------

@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("nheads_kv", [4, 2])
def test_sdpa_helper_matches_torch(is_causal, nheads_kv):
    generator = torch.Generator().manual_seed(6)
    shapes = [(2, 4, 7, 8), (2, nheads_kv, 7, 8), (2, nheads_kv, 7, 8)]
    ours = [torch.randn(s, generator=generator, dtype=torch.float64, requires_grad=True) for s in shapes]
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    from test_torch_sdpa_mask import compare_with_torch_sdpa

    compare_with_torch_sdpa(ours, theirs, generator, is_causal=is_causal, scale=0.3, enable_gqa=nheads_kv != 4)


def test_sdpa_helper_takes_the_precision():
    """precision reaches the call: "tf32" rounds float32 operands to tf32 (the NumPy twin as the
    kernel), "ieee" (the default) does not, and a bad value is refused by name."""
    generator = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn((1, 2, 9, 16), generator=generator) for _ in range(3))
    o_default = scaled_dot_product_attention(q, k, v, is_causal=True)
    o_ieee = scaled_dot_product_attention(q, k, v, is_causal=True, precision="ieee")
    o_tf32 = scaled_dot_product_attention(q, k, v, is_causal=True, precision="tf32")
    want_tf32 = cupyflash.flash_attn_func(*(x.transpose(1, 2).numpy() for x in (q, k, v)), causal=True,
                                          backend="numpy", precision="tf32")
    assert torch.equal(o_default, o_ieee)
    np.testing.assert_array_equal(o_tf32.transpose(1, 2).numpy(), want_tf32)
    assert (o_tf32 - o_ieee).abs().max() > 1e-5
    with pytest.raises(ValueError, match="precision"):
        scaled_dot_product_attention(q, k, v, precision="fp32")


def test_sdpa_helper_takes_dropout():
    """dropout_p reaches the call as flash_attn_func's (cupyflash's own mask, the seed drawn from
    torch's default generator; SDPA's own mask is torch's and not reproduced), in the forward and
    the backward."""
    generator = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn((1, 2, 9, 16), generator=generator, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    torch.manual_seed(4)
    o = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(4)
    o_want = flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), dropout_p=0.3).transpose(1, 2)
    assert torch.equal(o, o_want) and not torch.equal(o, scaled_dot_product_attention(q, k, v))
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    grads_want = torch.autograd.grad(o_want.sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_want))


def test_sdpa_helper_errors():
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, k)
    with pytest.raises(NotImplementedError, match="top-left"):
        scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    with pytest.raises(ValueError, match="attn_mask and is_causal cannot be combined"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="query must be a 4-d tensor"):
        scaled_dot_product_attention(q[0], q, q)


# --- errors ---------------------------------------------------------------------------------------

# --- dropout ----------------------------------------------------------------------------------------

def _drawn_seed(torch_seed: int) -> int:
    """The seed cupyflash.torch draws for a dropout call after torch.manual_seed(torch_seed)."""
    torch.manual_seed(torch_seed)
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_cupyflash_with_the_seed_torch_draws(causal):
    q, k, v, _, _ = _variant_inputs(5)
    do = torch.randn_like(q)
    seed = _drawn_seed(11)
    torch.manual_seed(11)
    out = flash_attn_func(q, k, v, dropout_p=0.25, causal=causal)
    out.backward(do)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    o, lse = cupyflash.flash_attn_func(*arrays, dropout_p=0.25, seed=seed, causal=causal, return_lse=True)
    grads = cupyflash.flash_attn_backward(do.numpy(), *arrays, o, lse, dropout_p=0.25, seed=seed, causal=causal,
                                          statistics=own_forward_statistics(arrays[0].dtype))
    assert np.array_equal(out.detach().numpy(), o)
    for t, g in zip((q, k, v), grads):
        assert np.array_equal(t.grad.numpy(), g)
    keep = cupyflash.dropout_mask(2, 4, 9, 11, 0.25, seed)
    o_ref, _ = reference.attention(*arrays, causal=causal, dropout_p=0.25, dropout_mask=keep)
    assert np.allclose(o, o_ref, atol=1e-12)


def test_dropout_is_reproducible_under_manual_seed_and_differs_without():
    q, k, v = qkv()
    torch.manual_seed(3)
    a = flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    b = flash_attn_func(q, k, v, dropout_p=0.5)
    c = flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_an_lse_gradient_with_dropout_is_refused():
    q, k, v, _, _ = _variant_inputs(6)
    _, lse, _ = flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        lse.sum().backward()


# --- variants: softcap, ALiBi, sinks ----------------------------------------------------------------

def _variant_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 9, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 11, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 11, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    slopes = torch.rand(2, 4, generator=g).to(torch.float32)
    sink = torch.randn(4, generator=g).to(torch.float32).requires_grad_(True)
    return q, k, v, slopes, sink


@pytest.mark.parametrize("causal", [False, True])
def test_variants_match_the_reference_with_autograd(causal):
    """softcap, ALiBi and a sink through the torch front end: outputs and every gradient (dsink
    included) against cupyflash.reference in float64."""
    q, k, v, slopes, sink = _variant_inputs()
    out = flash_attn_func(q, k, v, causal=causal, softcap=3.0, alibi_slopes=slopes, sink=sink)
    do = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out.backward(do)
    arrays = [x.detach().numpy() for x in (q, k, v)]
    kw = dict(causal=causal, softcap=3.0, alibi_slopes=slopes.numpy(), sink=sink.detach().numpy())
    o_ref, _ = reference.attention(*arrays, **kw)
    dq, dk, dv, dsink = reference.attention_backward(do.numpy(), *arrays, **kw)
    np.testing.assert_allclose(out.detach().numpy(), o_ref, atol=1e-10)
    for got, want in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
        np.testing.assert_allclose(got.numpy(), want, atol=1e-9)
    np.testing.assert_allclose(sink.grad.numpy(), dsink, rtol=1e-5, atol=1e-6)  # dsink is float32


def test_gradcheck_through_the_lse_with_alibi_and_a_sink():
    """The lse's own gradient with ALiBi and a sink: gradcheck over q, k, v and the sink's effect
    (sink as float64 logits cast to float32 inside would break gradcheck's precision, so the sink
    is fixed and its gradient is checked against the reference instead)."""
    q, k, v, slopes, sink = _variant_inputs(2)
    sink = sink.detach()

    def f(q, k, v):
        o, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, sink=sink, return_attn_probs=True)
        return o, lse

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_the_sink_gradient_through_the_lse():
    q, k, v, slopes, sink = _variant_inputs(3)
    o, lse, _ = flash_attn_func(q, k, v, sink=sink, return_attn_probs=True)
    lse.sum().backward()
    # d(sum lse)/dsink_h = sum over rows of exp(sink_h - lse): the sink's share of each row
    share = torch.exp(sink.detach().double()[None, :, None] - lse.detach()).sum(dim=(0, 2))
    np.testing.assert_allclose(sink.grad.numpy(), share.numpy(), rtol=1e-5)


def test_an_lse_gradient_with_softcap_is_refused():
    q, k, v, _, _ = _variant_inputs()
    o, lse, _ = flash_attn_func(q, k, v, softcap=2.0, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="softcap"):
        lse.sum().backward()


def test_errors_name_the_argument():
    q, k, v = qkv(requires_grad=False)
    with pytest.raises(TypeError, match="v has dtype torch.float32 but q has torch.float64"):
        flash_attn_func(q, k, v.float())
    with pytest.raises(TypeError, match="q has dtype torch.int32"):
        flash_attn_func(q.int(), k.int(), v.int())
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attn_func(q, k.numpy(), v)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match="k and v must have the same shape but for the head dim"):
        flash_attn_func(q, k, v[:, :3])
    with pytest.raises(ValueError, match="positive multiple"):
        flash_attn_func(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="same batch size and headdim"):
        flash_attn_func(q[..., :4], k, v)
    with pytest.raises(ValueError, match="q, k, v must share one device"):
        flash_attn_func(q, k.to("meta"), v.to("meta"))
    with pytest.raises(TypeError, match="softmax_scale must be a Python number"):
        flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.5))


def test_torch_compile_dynamic_sequence_lengths():
    """One graph for several sequence lengths: the fake kernels compute with symbolic shapes."""
    fn = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True,
                       backend="aot_eager", dynamic=True)
    for seqlen in (5, 9, 13):
        q, k, v = qkv(seqlen_q=seqlen, seqlen_k=seqlen + 2, dtype=torch.float32)
        out = fn(q, k, v)
        out.sum().backward()
        assert torch.equal(out, flash_attn_func(q, k, v, causal=True))


# --- ring attention ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(5, 2), softcap=3.0), dict(),
                                  dict(causal=True, softcap=4.0, alibi_slopes=torch.tensor([0.5, 0.1, 0.3, 0.02]))],
                         ids=["causal", "window_softcap", "full", "causal_softcap_alibi"])
def test_ring_autograd_matches_the_whole_sequence(mask, layout):
    """Three simulated ranks (LocalRing over NumPy, one thread each) run forward and backward through
    the torch autograd on their shards, with a sink; unsharded, out and the gradients (the sink's
    shares summed) equal flash_attn_func's autograd over the whole sequence (float64, CPU)."""
    from cupyflash.distributed import LocalRing, contiguous_shard, contiguous_unshard, zigzag_shard, zigzag_unshard
    from cupyflash.torch import ring_flash_attn_func

    shard, unshard = (zigzag_shard, zigzag_unshard) if layout == "zigzag" else (contiguous_shard, contiguous_unshard)
    size, seqlen = 3, 36
    gen = torch.Generator().manual_seed(11)
    q, do = (torch.randn(2, seqlen, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, seqlen, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    sink = torch.randn(4, generator=gen).float()
    shards = [[torch.from_numpy(np.ascontiguousarray(s)) for s in shard(x.numpy(), size)] for x in (q, k, v, do)]

    def rank_main(comm):
        q_r, k_r, v_r, do_r = (s[comm.rank].clone().requires_grad_(i < 3) for i, s in enumerate(shards))
        sink_r = sink.clone().requires_grad_(True)
        out = ring_flash_attn_func(q_r, k_r, v_r, comm=comm, sink=sink_r, layout=layout, **mask)
        (out * do_r).sum().backward()
        return out.detach().numpy(), q_r.grad.numpy(), k_r.grad.numpy(), v_r.grad.numpy(), sink_r.grad.numpy()

    per_rank = LocalRing(size).run(rank_main)
    ring = [unshard([r[i] for r in per_rank]) for i in range(4)] + [sum(r[4] for r in per_rank)]
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)] + [sink.clone().requires_grad_(True)]
    out = flash_attn_func(*leaves[:3], sink=leaves[3], **mask)
    (out * do).sum().backward()
    whole = [out.detach().numpy()] + [x.grad.numpy() for x in leaves]
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), ring, whole):
        np.testing.assert_allclose(a, b, rtol=1e-5 if name == "dsink" else 1e-10, atol=1e-6 if name == "dsink" else 1e-12,
                                   err_msg=name)


def test_ring_autograd_refuses_what_the_ring_cannot_do():
    from cupyflash.distributed import LocalRing
    from cupyflash.torch import ring_flash_attn_func

    q = torch.randn(1, 8, 2, 8, dtype=torch.float64)
    comm = LocalRing(1).comms[0]
    with pytest.raises(NotImplementedError, match="dropout_p"):
        ring_flash_attn_func(q, q, q, dropout_p=0.1, comm=comm)
    with pytest.raises(ValueError, match="alibi_slopes"):
        ring_flash_attn_func(q, q, q, alibi_slopes=torch.ones(3), comm=comm)
    with pytest.raises(ValueError, match="CPU tensors need a comm"):
        ring_flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match="comm or group"):
        ring_flash_attn_func(q, q, q, comm=comm, group=object())
