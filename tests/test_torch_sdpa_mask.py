"""cupyflash.torch.scaled_dot_product_attention's attn_mask on CPU tensors (the NumPy twin): bool
masks (through a mask_mod and its block map) and float masks (a score_mod adding them), in every
broadcast shape SDPA takes, with -inf entries and rows the mask hides entirely, GQA, against
torch's own SDPA in float64, outputs and gradients; the errors. On CUDA: tests/test_torch_gpu.py.
"""
import pytest

torch = pytest.importorskip("torch")

from cupyflash.torch import scaled_dot_product_attention  # noqa: E402

B, H, SQ, SK, D = 2, 4, 7, 9, 8
MASK_SHAPES = [(B, H, SQ, SK), (B, 1, 1, SK), (SQ, SK), (1, H, SQ, SK), (B, 1, SQ, 1), (1, SK), (H, SQ, SK)]


def _inputs(seed, nheads_kv=H):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(B, H, SQ, D), (B, nheads_kv, SK, D), (B, nheads_kv, SK, D)]
    ours = [torch.randn(s, generator=generator, dtype=torch.float64, requires_grad=True) for s in shapes]
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    return ours, theirs, generator


def compare_with_torch_sdpa(ours, theirs, generator, **options):
    """Our SDPA helper and torch's on copies of the same float64 leaves: outputs, and the gradients
    of one random cotangent."""
    o = scaled_dot_product_attention(*ours, **options)
    o_torch = torch.nn.functional.scaled_dot_product_attention(*theirs, **options)
    torch.testing.assert_close(o, o_torch, rtol=1e-12, atol=1e-12)
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64)
    o.backward(do)
    o_torch.backward(do)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)
    return o


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bool_masks_match_torch(shape):
    ours, theirs, generator = _inputs(1)
    mask = torch.rand(shape, generator=generator) > 0.35
    compare_with_torch_sdpa(ours, theirs, generator, attn_mask=mask, scale=0.4)


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float_masks_match_torch(shape):
    ours, theirs, generator = _inputs(2)
    bias = torch.randn(shape, generator=generator, dtype=torch.float64)
    bias[torch.rand(shape, generator=generator) > 0.8] = -float("inf")
    compare_with_torch_sdpa(ours, theirs, generator, attn_mask=bias)


def test_rows_the_mask_hides_give_zero_as_torch_does():
    ours, theirs, generator = _inputs(3, nheads_kv=2)
    mask = torch.rand((B, H, SQ, SK), generator=generator) > 0.3
    mask[0, :, 2] = False
    mask[1, 3, :] = False
    o = compare_with_torch_sdpa(ours, theirs, generator, attn_mask=mask, enable_gqa=True)
    assert torch.equal(o[0, :, 2], torch.zeros_like(o[0, :, 2]))


def test_a_float32_mask_with_float32_inputs():
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn((1, 2, 5, 16), generator=generator) for _ in range(3))
    bias = torch.randn((5, 5), generator=generator)
    o = scaled_dot_product_attention(q, k, v, attn_mask=bias)
    o_torch = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                               attn_mask=bias.double())
    torch.testing.assert_close(o.double(), o_torch, rtol=1e-5, atol=1e-5)


def test_errors():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="2 to 4 dimensions"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(1, 1, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="2 to 4 dimensions"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool or floating"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.int32))
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor"):
        scaled_dot_product_attention(q, q, q, attn_mask=[[True]])
    with pytest.raises(NotImplementedError, match="attn_mask.detach"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(5, 5, requires_grad=True))
    with torch.no_grad():
        scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(5, 5, requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_finite_minimum_masks_as_torch_does(dtype):
    """torch.finfo(dtype).min as the masked value (the usual padding convention): a row it hides
    entirely averages the values, as torch's SDPA does, where an overflow to -inf would give 0; a row
    mixing it with -inf sees no key but those."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn((1, 2, 5, 8), generator=generator, dtype=dtype) for _ in range(3))
    bias = torch.zeros((5, 5), dtype=dtype)
    bias[2] = torch.finfo(dtype).min
    bias[3, :2], bias[3, 2:] = -float("inf"), torch.finfo(dtype).min
    bias[4, 1] = torch.finfo(dtype).min
    o = scaled_dot_product_attention(q, k, v, attn_mask=bias)
    o_torch = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(o, o_torch, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o[0, :, 2], v[0].mean(dim=1), rtol=1e-5, atol=1e-5)
