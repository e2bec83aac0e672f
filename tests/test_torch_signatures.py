"""Porting from flash-attn is changing the import: cupyflash.torch's flash-attn functions take
flash-attn 2.8's parameters in flash-attn's order with flash-attn's defaults (written out here from
flash_attn/flash_attn_interface.py), so positional calls mean the same; cupyflash's own extras
come after them (keyword-only where flash-attn has a positional tail).
"""
import inspect

import pytest

pytest.importorskip("torch")

import cupyflash.torch as cf  # noqa: E402

_VARIANTS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
             ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_NO_DEFAULT = inspect.Parameter.empty

FLASH_ATTN_2_8 = {
    "flash_attn_func": [("q", _NO_DEFAULT), ("k", _NO_DEFAULT), ("v", _NO_DEFAULT)] + _VARIANTS,
    "flash_attn_qkvpacked_func": [("qkv", _NO_DEFAULT)] + _VARIANTS,
    "flash_attn_kvpacked_func": [("q", _NO_DEFAULT), ("kv", _NO_DEFAULT)] + _VARIANTS,
    "flash_attn_varlen_func": [(name, _NO_DEFAULT) for name in
                               ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
                              + _VARIANTS + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [(name, _NO_DEFAULT) for name in ("qkv", "cu_seqlens", "max_seqlen")]
                                        + _VARIANTS,
    "flash_attn_varlen_kvpacked_func": [(name, _NO_DEFAULT) for name in
                                        ("q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
                                       + _VARIANTS,
    "flash_attn_with_kvcache": [("q", _NO_DEFAULT), ("k_cache", _NO_DEFAULT), ("v_cache", _NO_DEFAULT), ("k", None),
                                ("v", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                                ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
                                ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                                ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
                                ("num_splits", 0), ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_2_8))
def test_flash_attn_parameters_in_order_with_their_defaults(name):
    parameters = list(inspect.signature(getattr(cf, name)).parameters.values())
    want = FLASH_ATTN_2_8[name]
    got = [(p.name, p.default) for p in parameters[: len(want)]]
    assert got == want
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert all(p.kind in positional for p in parameters[: len(want)])
    # anything of cupyflash's own comes after flash-attn's, never between them
    for extra in parameters[len(want):]:
        assert extra.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD) or \
            extra.default is not _NO_DEFAULT, extra
