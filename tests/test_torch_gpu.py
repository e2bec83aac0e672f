"""cupyflash.torch on CUDA tensors: gradcheck in float64, gradients bitwise equal to
cupyflash.flash_attn_backward, zero-copy inputs, outputs from torch's caching allocator, torch's
current stream, a short training loop, torch.compile(fullgraph=True) with Inductor, and the
packed-batch and kv-cache front ends against cupyflash's own calls.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyflash  # noqa: E402
import cupyflash._dtypes  # noqa: E402
from cupyflash.torch import flash_attn_func, scaled_dot_product_attention  # noqa: E402
from cupyflash.backward_plans import own_forward_statistics  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA device")]


def qkv(batch=2, seqlen_q=200, seqlen_k=300, nheads=8, nheads_kv=2, headdim=64, dtype=torch.bfloat16,
        requires_grad=True, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, headdim)] + [(batch, seqlen_k, nheads_kv, headdim)] * 2
    return [torch.randn(s, generator=generator, device="cuda", dtype=torch.float32).to(dtype)
            .requires_grad_(requires_grad) for s in shapes]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads, nheads_kv, seqlen_q, seqlen_k", [(2, 2, 5, 7), (4, 2, 7, 3), (3, 1, 6, 6)])
def test_gradcheck_float64(causal, nheads, nheads_kv, seqlen_q, seqlen_k):
    q, k, v = qkv(batch=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_kv=nheads_kv, headdim=8,
                  dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), (q, k, v))
    if seqlen_q <= seqlen_k:  # every row sees a key, so the lse is finite
        assert torch.autograd.gradcheck(
            lambda q, k, v: flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[1], (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads_kv", [8, 2])
def test_outputs_and_gradients_equal_cupyflash_bitwise(dtype, headdim, causal, nheads_kv):
    import cupy

    q, k, v = qkv(headdim=headdim, nheads_kv=nheads_kv, dtype=dtype)
    o, lse, _ = flash_attn_func(q, k, v, causal=causal, deterministic=True, return_attn_probs=True)
    do = torch.randn_like(o)
    o.backward(do)
    arrays = [cupy.from_dlpack(t.detach()) for t in (q, k, v)]
    o_ref, lse_ref = cupyflash.flash_attn_func(*arrays, causal=causal, return_lse=True)
    grads = cupyflash.flash_attn_backward(cupy.from_dlpack(do), *arrays, o_ref, lse_ref, causal=causal,
                                          deterministic=True, statistics=own_forward_statistics(arrays[0].dtype))
    assert torch.equal(o.detach(), torch.from_dlpack(o_ref))
    assert torch.equal(lse.detach(), torch.from_dlpack(lse_ref))
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert torch.equal(t.grad, torch.from_dlpack(g)), f"d{name} differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_outputs_and_gradients_equal_cupyflash_bitwise(dtype, causal):
    """dropout_p on CUDA tensors: the seed torch's generator gives, the same kernels as cupyflash's."""
    import cupy

    q, k, v = qkv(headdim=64, nheads_kv=2, dtype=dtype)
    torch.manual_seed(21)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    torch.manual_seed(21)
    o = flash_attn_func(q, k, v, dropout_p=0.2, causal=causal, deterministic=True)
    do = torch.randn_like(o)
    o.backward(do)
    arrays = [cupy.from_dlpack(t.detach()) for t in (q, k, v)]
    kw = dict(dropout_p=0.2, seed=seed, causal=causal)
    o_ref, lse_ref = cupyflash.flash_attn_func(*arrays, return_lse=True, **kw)
    grads = cupyflash.flash_attn_backward(cupy.from_dlpack(do), *arrays, o_ref, lse_ref, deterministic=True,
                                          statistics=own_forward_statistics(arrays[0].dtype), **kw)
    assert torch.equal(o.detach(), torch.from_dlpack(o_ref))
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert torch.equal(t.grad, torch.from_dlpack(g)), f"d{name} differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal, window_size", [(False, (64, 32)), (True, (100, -1)), (False, (0, 0))])
def test_window_outputs_and_gradients_equal_cupyflash_bitwise(dtype, causal, window_size):
    """window_size through the custom operators reaches the same kernels as cupyflash's API."""
    import cupy

    q, k, v = qkv(headdim=64, nheads_kv=2, dtype=dtype)
    o, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window_size, deterministic=True,
                                return_attn_probs=True)
    do = torch.randn_like(o)
    o.backward(do)
    arrays = [cupy.from_dlpack(t.detach()) for t in (q, k, v)]
    options = dict(causal=causal, window_size=window_size)
    o_ref, lse_ref = cupyflash.flash_attn_func(*arrays, return_lse=True, **options)
    grads = cupyflash.flash_attn_backward(cupy.from_dlpack(do), *arrays, o_ref, lse_ref, deterministic=True,
                                          statistics=own_forward_statistics(arrays[0].dtype), **options)
    assert torch.equal(o.detach(), torch.from_dlpack(o_ref))
    assert torch.equal(lse.detach(), torch.from_dlpack(lse_ref))
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert torch.equal(t.grad, torch.from_dlpack(g)), f"d{name} differs"


@pytest.mark.parametrize("causal, window_size", [(False, (2, 1)), (True, (1, -1))])
def test_gradcheck_float64_with_a_window(causal, window_size):
    q, k, v = qkv(batch=1, seqlen_q=5, seqlen_k=7, nheads=2, nheads_kv=1, headdim=8, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn_func(q, k, v, causal=causal, window_size=window_size), (q, k, v))


def test_inputs_zero_copy_and_outputs_from_torchs_allocator():
    from cupyflash.torch import _as_array, _cupy_on_torch_stream

    q, k, v = qkv(requires_grad=False)
    with _cupy_on_torch_stream(q.device):
        assert _as_array(q).data.ptr == q.data_ptr()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    o, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    held = torch.cuda.memory_allocated() - before
    assert held >= o.numel() * o.element_size() + lse.numel() * lse.element_size()
    del o, lse
    assert torch.cuda.memory_allocated() == before


def test_runs_on_torchs_current_stream():
    """Inputs written after a long kernel on a side stream, attention on that stream, no
    synchronisation in between, the result read after the stream's end. (Launching on another
    stream would still be ordered here by DLPack's stream handshake, at the cost of events; the
    CUDA-graph capture below is what fails on any launch off torch's current stream.)"""
    side = torch.cuda.Stream()
    expected_q, k, v = qkv(requires_grad=False)
    expected = flash_attn_func(expected_q, k, v)
    big = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        q = torch.zeros_like(expected_q)
        for _ in range(4):
            big = big @ big / 8192
        q.copy_(expected_q + big[0, 0].to(q.dtype) * 0)
        o = flash_attn_func(q, k, v)
    side.synchronize()
    assert torch.equal(o, expected)


def test_captures_into_a_cuda_graph():
    """Capture fails on a host synchronisation, a copy to the host, or a launch on any stream other
    than the capturing one (torch's current stream): forward and backward capture and replay."""
    static = qkv(requires_grad=False)
    for t in static:
        t.requires_grad_()
    do = torch.randn_like(static[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: kernels compiled and loaded
        torch.autograd.grad(flash_attn_func(*static, causal=True, deterministic=True), static, do)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(*static, causal=True, deterministic=True)
        grads = torch.autograd.grad(out, static, do)
    fresh = qkv(requires_grad=False, seed=1)
    with torch.no_grad():
        for t, f in zip(static, fresh):
            t.copy_(f)
    graph.replay()
    for t in fresh:
        t.requires_grad_()
    expected = flash_attn_func(*fresh, causal=True, deterministic=True)
    assert torch.equal(out, expected)
    for g, e in zip(grads, torch.autograd.grad(expected, fresh, do)):
        assert torch.equal(g, e)


def test_sdpa_helper_matches_torch_sdpa():
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in qkv(seqlen_k=200, nheads_kv=2))
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o_ref = torch.nn.functional.scaled_dot_product_attention(*(t.float() for t in ref), is_causal=True,
                                                             enable_gqa=True)
    torch.testing.assert_close(o.float(), o_ref, rtol=2e-2, atol=2e-2)


class Block(torch.nn.Module):
    def __init__(self, width=256, nheads=4, nheads_kv=2):
        super().__init__()
        self.nheads, self.nheads_kv, self.headdim = nheads, nheads_kv, width // nheads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, (nheads + 2 * nheads_kv) * self.headdim)
        self.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        batch, seqlen, _ = x.shape
        h = self.qkv(self.norm1(x)).view(batch, seqlen, self.nheads + 2 * self.nheads_kv, self.headdim)
        q, k, v = h.split([self.nheads, self.nheads_kv, self.nheads_kv], dim=2)  # strided views
        x = x + self.proj(flash_attn_func(q, k, v, causal=True).reshape(batch, seqlen, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=97, width=256, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.Sequential(*(Block(width) for _ in range(layers)))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def test_training_loop_bf16_loss_decreases():
    torch.manual_seed(0)
    model = TinyLM().cuda().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 97, (4, 129), device="cuda")
    losses = []
    for _ in range(10):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.7 * losses[0], losses


def test_torch_compile_fullgraph_inductor_matches_eager():
    torch.manual_seed(0)
    model = TinyLM().cuda()
    tokens = torch.randint(0, 97, (2, 128), device="cuda")

    def step(fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fn(tokens)
        logits.float().square().mean().backward()
        return logits.detach().float(), [p.grad.clone() for p in model.parameters()]

    eager = step(model)
    compiled_model = torch.compile(model, fullgraph=True)
    compiled = step(compiled_model)
    compiled = step(compiled_model)  # the second call runs the cached graphs
    torch.testing.assert_close(compiled[0], eager[0], rtol=3e-2, atol=3e-2)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * b.abs().max().item())


# --- packed batches and kv caches -----------------------------------------------------------------

def _packed_cuda_batch(dtype, seed: int):
    """A packed batch on the GPU with an empty query run and GQA (8 query heads, 2 kv heads, d64):
    (lengths_q, lengths_k, cu_q, cu_k, the generator, (q, k, v)) with q, k, v requiring grad."""
    lengths_q, lengths_k = [130, 0, 77, 301], [129, 64, 200, 301]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    qkv = tuple(torch.randn(shape, generator=generator, device="cuda").to(dtype).requires_grad_(True)
                for shape in ((sum(lengths_q), 8, 64), (sum(lengths_k), 2, 64), (sum(lengths_k), 2, 64)))
    return lengths_q, lengths_k, cu_q, cu_k, generator, qkv


@pytest.mark.parametrize("with_sink", [False, True], ids=["plain", "sink"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_outputs_and_gradients_equal_cupyflash_bitwise(dtype, causal, with_sink):
    """cupyflash.torch.flash_attn_varlen_func reaches cupyflash.flash_attn_varlen_func and its
    backward: equal bit for bit on a packed batch with an empty sequence, GQA, device cu_seqlens;
    with a sink, dsink too."""
    import cupy

    from cupyflash.torch import flash_attn_varlen_func

    lengths_q, lengths_k, cu_q, cu_k, generator, (q, k, v) = _packed_cuda_batch(dtype, 5)
    sink = torch.randn(8, generator=generator, device="cuda").requires_grad_(True) if with_sink else None
    o, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                       deterministic=True, return_attn_probs=True, sink=sink)
    do = torch.randn_like(o)
    o.backward(do)
    arrays = [cupy.from_dlpack(t.detach()) for t in (q, k, v)]
    sequences = (cupy.from_dlpack(cu_q), cupy.from_dlpack(cu_k), max(lengths_q), max(lengths_k))
    options = dict(causal=causal, sink=None if sink is None else cupy.from_dlpack(sink.detach()))
    o_ref, lse_ref = cupyflash.flash_attn_varlen_func(*arrays, *sequences, return_lse=True, **options)
    grads = cupyflash.flash_attn_varlen_backward(cupy.from_dlpack(do), *arrays, o_ref, lse_ref, *sequences,
                                                 deterministic=True, statistics=own_forward_statistics(arrays[0].dtype),
                                                 **options)
    assert torch.equal(o.detach(), torch.from_dlpack(o_ref)) and torch.equal(lse.detach(), torch.from_dlpack(lse_ref))
    for name, t, g in zip(["q", "k", "v", "sink"], (q, k, v, sink), grads):
        assert torch.equal(t.grad, torch.from_dlpack(g)), f"d{name} differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_varlen_user_modifiers_equal_cupyflash_bitwise(dtype):
    """cupyflash.torch.flash_attn_varlen_func with score_mod and mask_mod (torch tensors on the
    device) reaches cupyflash.flash_attn_varlen_func and its backward with the same modifiers: out
    and dq, dk, dv equal bit for bit."""
    import cupy

    import modifier_zoo as zoo
    from cupyflash.torch import flash_attn_varlen_func

    lengths_q, lengths_k, cu_q, cu_k, generator, (q, k, v) = _packed_cuda_batch(dtype, 7)
    rng = np.random.default_rng(7)
    slopes = torch.tensor(rng.uniform(0.005, 0.05, (4, 8)).astype(np.float32), device="cuda")
    doc_q = torch.tensor(zoo.document_ids(rng, 4, max(lengths_q), 3), device="cuda")
    doc_k = torch.tensor(zoo.document_ids(rng, 4, max(lengths_k), 3), device="cuda")
    o = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True, deterministic=True,
                               score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=slopes),
                               mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=doc_q, doc_k=doc_k))
    do = torch.randn_like(o)
    o.backward(do)
    arrays = [cupy.from_dlpack(t.detach()) for t in (q, k, v)]
    sequences = (cupy.from_dlpack(cu_q), cupy.from_dlpack(cu_k), max(lengths_q), max(lengths_k))
    options = dict(causal=True, score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=cupy.from_dlpack(slopes)),
                   mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=cupy.from_dlpack(doc_q),
                                              doc_k=cupy.from_dlpack(doc_k)))
    o_ref, lse_ref = cupyflash.flash_attn_varlen_func(*arrays, *sequences, return_lse=True, **options)
    grads = cupyflash.flash_attn_varlen_backward(cupy.from_dlpack(do), *arrays, o_ref, lse_ref, *sequences,
                                                 deterministic=True, **options)
    assert torch.equal(o.detach(), torch.from_dlpack(o_ref))
    for name, t, g in zip(["q", "k", "v"], (q, k, v), grads):
        assert torch.equal(t.grad, torch.from_dlpack(g)), f"d{name} differs"


@pytest.mark.parametrize("page_size", [None, 16, 5])
def test_kvcache_appends_in_place_on_the_device(page_size):
    """flash_attn_with_kvcache on CUDA tensors: the new tokens land in torch's cache tensors (the
    same memory, through DLPack), byte for byte where the reference puts them and nowhere else,
    and the output equals cupyflash.flash_attn_with_kvcache's on copies of the caches."""
    import cupy
    import numpy as np

    from cupyflash import reference
    from cupyflash.torch import flash_attn_with_kvcache

    batch, capacity, nheads, nheads_kv, headdim = 3, 64, 8, 2, 128
    generator = torch.Generator(device="cuda").manual_seed(9)

    def randn(*shape):
        return torch.randn(shape, generator=generator, device="cuda").to(torch.bfloat16)

    if page_size is None:
        k_cache, v_cache = randn(batch, capacity, nheads_kv, headdim), randn(batch, capacity, nheads_kv, headdim)
        block_table = None
    else:
        pages = batch * -(-capacity // page_size)
        k_cache, v_cache = randn(pages, page_size, nheads_kv, headdim), randn(pages, page_size, nheads_kv, headdim)
        block_table = torch.randperm(pages, device="cuda").to(torch.int32).view(batch, -1)
    q = randn(batch, 3, nheads, headdim)
    k_new, v_new = randn(batch, 3, nheads_kv, headdim), randn(batch, 3, nheads_kv, headdim)
    seqlens = torch.tensor([0, 17, 60], dtype=torch.int32, device="cuda")
    k_copy, v_copy = (cupy.from_dlpack(c.clone()) for c in (k_cache, v_cache))
    before = [c.clone() for c in (k_cache, v_cache)]
    pointers = [c.data_ptr() for c in (k_cache, v_cache)]
    o = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=block_table,
                                causal=True)
    assert [c.data_ptr() for c in (k_cache, v_cache)] == pointers
    index = dict(cache_seqlens=seqlens.cpu().numpy(),
                 block_table=None if block_table is None else block_table.cpu().numpy())
    for got, old, new in zip((k_cache, v_cache), before, (k_new, v_new)):
        want = reference.kvcache_appended(old.cpu().view(torch.int16).numpy(), new.cpu().view(torch.int16).numpy(),
                                          **index)
        np.testing.assert_array_equal(got.cpu().view(torch.int16).numpy(), want)
    o_ref = cupyflash.flash_attn_with_kvcache(
        cupy.from_dlpack(q), k_copy, v_copy, cupy.from_dlpack(k_new), cupy.from_dlpack(v_new),
        cache_seqlens=cupy.from_dlpack(seqlens), block_table=None if block_table is None else cupy.from_dlpack(block_table),
        causal=True)
    assert torch.equal(o, torch.from_dlpack(o_ref))


@pytest.mark.parametrize("page_size", [None, 16])
def test_kvcache_decode_step_captures_into_a_torch_cuda_graph(page_size):
    """A decode step (append one token, attend) captured with torch.cuda.graph and replayed while
    cache_seqlens grows on the device: each replay equals the same call made eagerly inside
    cupyflash.no_host_sync() on a mirror of the caches (the captured path, cupyflash.capture),
    and the caches agree byte for byte."""
    from cupyflash.torch import flash_attn_with_kvcache

    batch, capacity, nheads, nheads_kv, headdim = 4, 256, 16, 4, 128
    generator = torch.Generator(device="cuda").manual_seed(11)

    def randn(*shape):
        return torch.randn(shape, generator=generator, device="cuda").to(torch.bfloat16)

    if page_size is None:
        shape, block_table = (batch, capacity, nheads_kv, headdim), None
    else:
        pages = batch * capacity // page_size
        shape = (pages, page_size, nheads_kv, headdim)
        block_table = torch.randperm(pages, device="cuda", generator=generator).to(torch.int32).view(batch, -1)
    k_cache, v_cache = randn(*shape), randn(*shape)
    mirror = [c.clone() for c in (k_cache, v_cache)]
    q = randn(batch, 1, nheads, headdim)
    k_new, v_new = randn(batch, 1, nheads_kv, headdim), randn(batch, 1, nheads_kv, headdim)
    seqlens = torch.tensor([0, 7, 100, 200], dtype=torch.int32, device="cuda")
    seqlens_mirror = seqlens.clone()

    def step(caches, lengths):
        o = flash_attn_with_kvcache(q, caches[0], caches[1], k_new, v_new, cache_seqlens=lengths,
                                    block_table=block_table, causal=True)
        lengths += 1
        return o

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, on both
        step((k_cache, v_cache), seqlens)
        with cupyflash.no_host_sync():
            step(mirror, seqlens_mirror)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step((k_cache, v_cache), seqlens)
    for trial in range(3):
        for t in (q, k_new, v_new):
            t.copy_(randn(*t.shape))
        graph.replay()
        with cupyflash.no_host_sync():
            expected = step(mirror, seqlens_mirror)
        torch.cuda.synchronize()
        assert torch.equal(out, expected), trial
        assert torch.equal(seqlens, seqlens_mirror)
    for c, m in zip((k_cache, v_cache), mirror):
        assert torch.equal(c.view(torch.int16), m.view(torch.int16))


def test_varlen_forward_captures_into_a_torch_cuda_graph():
    """flash_attn_varlen_func with device cu_seqlens under torch.cuda.graph: no read-back (which
    capture forbids), replays over new inputs and new sequence boundaries equal eager calls."""
    from cupyflash.torch import flash_attn_varlen_func

    generator = torch.Generator(device="cuda").manual_seed(12)
    total, heads, dim = 700, 4, 64
    q, k, v = (torch.randn((total, heads, dim), generator=generator, device="cuda").to(torch.bfloat16)
               for _ in range(3))
    cu = torch.tensor([0, 300, 301, 700], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn_varlen_func(q, k, v, cu, cu, 512, 512, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_varlen_func(q, k, v, cu, cu, 512, 512, causal=True)
    for cuts in ([0, 300, 301, 700], [0, 0, 512, 700]):
        cu.copy_(torch.tensor(cuts, dtype=torch.int32))
        q.copy_(torch.randn((total, heads, dim), generator=generator, device="cuda").to(torch.bfloat16))
        graph.replay()
        expected = flash_attn_varlen_func(q, k, v, cu, cu, 512, 512, causal=True)
        assert torch.equal(out, expected), cuts


def test_kvcache_with_an_int_length_captures_into_a_torch_cuda_graph():
    """An int cache_seqlens under torch.cuda.graph becomes a device tensor (nothing may come from
    the host inside the capture): replays over new queries equal eager calls."""
    from cupyflash.torch import flash_attn_with_kvcache

    generator = torch.Generator(device="cuda").manual_seed(13)
    k_cache, v_cache = (torch.randn((2, 128, 2, 64), generator=generator, device="cuda").to(torch.bfloat16)
                        for _ in range(2))
    q = torch.randn((2, 1, 8, 64), generator=generator, device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), cupyflash.no_host_sync():  # the captured path's kernels: a device length
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.full((2,), 50, dtype=torch.int32,
                                                                              device="cuda"))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=50)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, generator=generator, device="cuda").to(torch.bfloat16))
        graph.replay()
        with cupyflash.no_host_sync():
            expected = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.full(
                (2,), 50, dtype=torch.int32, device="cuda"))
        assert torch.equal(out, expected)


def test_ring_forward_on_cuda_tensors_with_a_local_ring():
    """cupyflash.torch.ring_flash_attn_func on CUDA tensors, two simulated ranks on this GPU
    (LocalRing over CuPy), forward only (their backward is refused: the ranks share one autograd
    thread): the unsharded output equals flash_attn_func's on the whole sequence within bfloat16's
    rounding of the ring's steps."""
    import cupy

    from cupyflash.distributed import LocalRing, zigzag_shard, zigzag_unshard
    from cupyflash.torch import ring_flash_attn_func

    q, k, v = qkv(batch=2, seqlen_q=512, seqlen_k=512, nheads=8, nheads_kv=2, headdim=64, requires_grad=False)
    shards = [[torch.from_numpy(np.ascontiguousarray(s)).cuda()
               for s in zigzag_shard(x.float().cpu().numpy(), 2)] for x in (q, k, v)]
    shards = [[s.to(torch.bfloat16) for s in per] for per in shards]

    def rank_main(comm):
        with torch.no_grad():
            out = ring_flash_attn_func(*(s[comm.rank] for s in shards), causal=True, window_size=(100, 0), comm=comm)
        torch.cuda.synchronize()
        return out.float().cpu().numpy()

    ring = zigzag_unshard(LocalRing(2, cupy).run(rank_main))
    whole = flash_attn_func(q, k, v, causal=True, window_size=(100, 0)).float().cpu().numpy()
    assert np.abs(ring - whole).max() <= 4e-2 * (1 + np.abs(whole).max())
    comm = LocalRing(2, cupy).comms[0]
    with pytest.raises(NotImplementedError, match="one thread"):
        ring_flash_attn_func(*(s[0].clone().requires_grad_(True) for s in shards), causal=True, comm=comm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qkvpacked_equals_the_unpacked_call_on_cuda(dtype):
    """The strided views of a packed qkv go to the kernels as they are: output and the stacked
    gradient equal the call on contiguous parts bitwise."""
    from cupyflash.torch import flash_attn_qkvpacked_func

    generator = torch.Generator(device="cuda").manual_seed(7)
    packed = torch.randn((2, 300, 3, 4, 64), generator=generator, device="cuda").to(dtype).requires_grad_()
    o = flash_attn_qkvpacked_func(packed, causal=True, deterministic=True)
    do = torch.randn_like(o)
    (dqkv,) = torch.autograd.grad(o, (packed,), do)
    parts = [packed.detach()[:, :, i].contiguous().requires_grad_() for i in range(3)]
    o_want = flash_attn_func(*parts, causal=True, deterministic=True)
    want = torch.autograd.grad(o_want, parts, do)
    assert torch.isfinite(o).all() and torch.equal(o, o_want)
    assert dqkv.shape == packed.shape
    for i in range(3):
        assert torch.equal(dqkv[:, :, i], want[i]), f"d{'qkv'[i]} differs"


@pytest.mark.parametrize("mask_kind", ["bool_padding", "float_bias"])
def test_sdpa_attn_mask_on_cuda(mask_kind):
    """SDPA's attn_mask through the modifiers on the kernels: a bool padding mask (batch, 1, 1,
    seqlen_k) and a float bias (seqlen_q, seqlen_k) with -inf entries, bf16, against torch's SDPA in
    float64 under the tolerance rule (torch's own bf16 SDPA the baseline), outputs and gradients
    finite."""
    from cupyflash.testing.tolerance import OUTPUT_FACTOR, assert_close

    generator = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn((2, 8, 300, 64), generator=generator, device="cuda").to(torch.bfloat16)
               .requires_grad_() for _ in range(3))
    if mask_kind == "bool_padding":
        mask = torch.ones((2, 1, 1, 300), dtype=torch.bool, device="cuda")
        mask[1, ..., 170:] = False
    else:
        mask = torch.randn((300, 300), generator=generator, device="cuda")
        mask[torch.rand((300, 300), generator=generator, device="cuda") > 0.9] = -float("inf")
    o = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(o.float().sum(), (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    as_dtype = (lambda m, dtype: m) if mask.dtype == torch.bool else (lambda m, dtype: m.to(dtype))
    o64 = sdpa(*(x.detach().double() for x in (q, k, v)), attn_mask=as_dtype(mask, torch.float64))
    o16 = sdpa(*(x.detach() for x in (q, k, v)), attn_mask=as_dtype(mask, torch.bfloat16))
    assert_close("o", o.detach().float().cpu().numpy(), o64.cpu().numpy(), o16.float().cpu().numpy(),
                 dtype=np.dtype(cupyflash._dtypes.bfloat16), factor=OUTPUT_FACTOR)
    assert all(torch.isfinite(g).all() for g in grads)
