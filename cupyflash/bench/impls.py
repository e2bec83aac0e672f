"""The implementations a benchmark compares: cupyflash backends and PyTorch SDPA anchors."""
from __future__ import annotations

from dataclasses import dataclass


class Rejected(Exception):
    """The implementation does not support this case (reported as "—", not as a failure)."""


@dataclass(frozen=True)
class Impl:
    label: str  # table column
    family: str  # "cupyflash" or "torch"
    backend: str  # cupyflash backend name, or the SDPBackend member name
    description: str


# Label of the standard (materialised) attention, the baseline of --memory.
STANDARD = "standard"

# Backends timed on the device. "numpy" runs on the host, which CUDA events cannot time.
HOST_BACKENDS = ("numpy",)
# A pseudo-backend: "auto" with precision="tf32" (float32's one-product tensor-core forward).
TF32 = "tf32"

TORCH_ANCHORS = (
    Impl("FA2", "torch", "FLASH_ATTENTION",
         "torch SDPA under SDPBackend.FLASH_ATTENTION (FlashAttention-2)"),
    Impl("cuDNN", "torch", "CUDNN_ATTENTION",
         "torch SDPA under SDPBackend.CUDNN_ATTENTION (cuDNN fused flash attention)"),
    Impl("mem-eff", "torch", "EFFICIENT_ATTENTION",
         "torch SDPA under SDPBackend.EFFICIENT_ATTENTION (memory-efficient attention)"),
)


def cupyflash_impls(backends) -> list[Impl]:
    """One implementation per cupyflash backend; "auto" is labelled plain "cupyflash", the
    others "cupyflash[backend]"."""
    impls = []
    for backend in backends:
        if backend in HOST_BACKENDS:
            raise ValueError(f"backend {backend!r} runs on the host; the benchmark times device "
                             "work with CUDA events")
        label = "cupyflash" if backend == "auto" else f"cupyflash[{backend}]"
        options = "backend='auto', precision='tf32'" if backend == TF32 else f"backend={backend!r}"
        impls.append(Impl(label, "cupyflash", backend, f"cupyflash.flash_attn_func / flash_attn_backward, {options}"))
    if len({i.label for i in impls}) != len(impls):
        raise ValueError(f"backend listed twice: {list(backends)}")
    return impls


def torch_anchors(names=None) -> list[Impl]:
    """The SDPA anchors whose labels are in ``names`` (all when None), in the standard order."""
    if names is None:
        return list(TORCH_ANCHORS)
    known = {a.label.lower(): a for a in TORCH_ANCHORS}
    unknown = [n for n in names if n.lower() not in known]
    if unknown:
        raise ValueError(f"unknown anchor(s) {unknown}; choose from "
                         f"{', '.join(a.label for a in TORCH_ANCHORS)}")
    wanted = {n.lower() for n in names}
    return [a for a in TORCH_ANCHORS if a.label.lower() in wanted]


def known_impl(label: str, family: str, backend: str) -> Impl:
    """The implementation a saved result names. The JSON keeps label, family and backend but
    not the description, which is taken from the implementation of that name if this version
    knows one, else left empty."""
    known = {a.label: a for a in TORCH_ANCHORS}
    if family == "cupyflash" and backend not in HOST_BACKENDS:
        known.update({i.label: i for i in cupyflash_impls([backend])})
    impl = known.get(label)
    if impl is not None and (impl.family, impl.backend) == (family, backend):
        return impl
    return Impl(label, family, backend, "")
