"""cupyflash: exact FlashAttention as CuPy raw kernels, callable from NumPy-style code.

    import cupyflash
    o = cupyflash.flash_attn_func(q, k, v, causal=True)            # (batch, seqlen, heads, dim)
    o, vjp = cupyflash.flash_attn_vjp(q, k, v); dq, dk, dv = vjp(do)
    o = cupyflash.flash_attn_func(q, k, v, score_mod=fn, mask_mod=cupyflash.MaskMod(pred, doc=ids))
"""
from . import kernels, numpy_backend, reference
from .api import flash_attn_backward, flash_attn_func, flash_attn_vjp
from .capture import no_host_sync
from .dispatch import gpu_available
from .dropout import dropout_mask
from .kvcache import flash_attn_with_kvcache
from .modifiers import BlockMask, MaskMod, ScoreMod, create_block_mask
from .packed import (flash_attn_kvpacked_func, flash_attn_kvpacked_vjp, flash_attn_qkvpacked_func,
                     flash_attn_qkvpacked_vjp, flash_attn_varlen_kvpacked_func, flash_attn_varlen_kvpacked_vjp,
                     flash_attn_varlen_qkvpacked_func, flash_attn_varlen_qkvpacked_vjp)
from .varlen import flash_attn_varlen_backward, flash_attn_varlen_func, flash_attn_varlen_vjp

__version__ = "0.1.0"


def __getattr__(name):
    # cupyflash.torch imports torch, so it loads on first use rather than with the package.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["flash_attn_func", "flash_attn_backward", "flash_attn_vjp", "flash_attn_varlen_func",
           "flash_attn_varlen_backward", "flash_attn_varlen_vjp", "flash_attn_with_kvcache",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_qkvpacked_vjp", "flash_attn_kvpacked_vjp",
           "flash_attn_varlen_qkvpacked_vjp", "flash_attn_varlen_kvpacked_vjp", "reference",
           "numpy_backend", "gpu_available", "dropout_mask", "no_host_sync", "ScoreMod", "MaskMod", "BlockMask", "create_block_mask", "__version__"]
