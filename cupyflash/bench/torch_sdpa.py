"""PyTorch ``scaled_dot_product_attention`` anchors, in the same process on the same data.

The CuPy inputs are shared zero-copy through DLPack and seen in SDPA's (B, H, S, D) layout
through ``transpose(1, 2)`` views, so no timed copy is added. Torch runs on CuPy's stream
(wrapped as a ``torch.cuda.ExternalStream``): the events, the spin kernel and both libraries'
work are ordered by one stream, with no cross-library synchronisation needed.

Backward regions are ``out.backward(do, retain_graph=True)`` on an output computed beforehand.
The gradients of q, k, v are set to None (host-side, no device work) before each backward,
so autograd hands over the fresh gradient tensors instead of adding into old ones: no
accumulation kernel is timed.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass

from .impls import Rejected
from .shapes import Case

_REJECTIONS = (RuntimeError, NotImplementedError, ValueError, TypeError)
_MAX_REASON = 600


def load_torch():
    """(torch, "") when torch with a CUDA device and ``sdpa_kernel`` is usable, else
    (None, the reason)."""
    try:
        import torch
    except Exception as exc:  # a broken install can raise more than ImportError
        return None, f"torch not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA device"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
    except ImportError:
        return None, f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel (>= 2.3)"
    return torch, ""


def rejection_reason(exc: BaseException, caught_warnings=()) -> str:
    """The error's first line plus torch's explanations, which it emits as warnings
    ("Flash attention kernel not used because: ...")."""
    message = str(exc).strip()
    parts = [f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}"]
    for w in caught_warnings:
        text = " ".join(str(w.message).split())
        if text and text not in parts:
            parts.append(text)
    reason = "; ".join(parts)
    return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 1] + "…"


@dataclass
class _Views:
    q: object
    k: object
    v: object
    do: object


class TorchBridge:
    """Torch on CuPy's current device and on a given CuPy stream."""

    def __init__(self, torch, cupy_stream):
        import cupy

        self.torch = torch
        device = torch.device("cuda", cupy.cuda.Device().id)
        torch.cuda.set_device(device)
        self.stream = torch.cuda.ExternalStream(cupy_stream.ptr, device=device)

    def views(self, inputs, requires_grad: bool) -> _Views:
        """(B, H, S, D) views of one InputSet; q, k, v become autograd leaves if asked."""
        def view(array, leaf):
            t = self.torch.from_dlpack(array).transpose(1, 2)
            return t.requires_grad_(True) if leaf else t

        return _Views(view(inputs.q, requires_grad), view(inputs.k, requires_grad),
                      view(inputs.v, requires_grad), view(inputs.do, False))

    @contextmanager
    def active(self, backend_name: str):
        """Torch's current stream is CuPy's, and SDPA may only use ``backend_name``."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name, None)
        if backend is None:
            raise Rejected(f"SDPBackend.{backend_name} does not exist in torch "
                           f"{self.torch.__version__}")
        with self.torch.cuda.stream(self.stream), sdpa_kernel([backend]):
            yield


def _sdpa_kwargs(case: Case, softmax_scale) -> dict:
    if case.causal and case.seqlen_q != case.seqlen_k:
        # SDPA's is_causal keeps the top-left triangle; cupyflash aligns bottom-right.
        raise Rejected("torch SDPA is_causal aligns the mask top-left; it computes a different "
                       "problem when seqlen_q != seqlen_k")
    kwargs = {"is_causal": case.causal, "scale": softmax_scale}
    if case.nheads != case.nheads_kv:
        kwargs["enable_gqa"] = True
    return kwargs


@contextmanager
def sdpa_runner(bridge: TorchBridge, backend_name: str, case: Case, inputs, *,
                softmax_scale=None):
    """Yields ``run(i)`` like ``runners.cupyflash_runner`` (see there for the regions)."""
    import torch.nn.functional as F

    kwargs = _sdpa_kwargs(case, softmax_scale)
    with bridge.active(backend_name):
        views = [bridge.views(s, requires_grad=case.mode != "fwd") for s in inputs]

        def attention(t):
            return F.scaled_dot_product_attention(t.q, t.k, t.v, **kwargs)

        def clear_grads(t):
            t.q.grad = t.k.grad = t.v.grad = None

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if case.mode == "fwd":
                    def run(i):
                        attention(views[i])
                elif case.mode == "bwd":
                    outs = [attention(t) for t in views]

                    def run(i):
                        clear_grads(views[i])
                        outs[i].backward(views[i].do, retain_graph=True)
                else:
                    def run(i):
                        clear_grads(views[i])
                        attention(views[i]).backward(views[i].do)
                run(0)
            except _REJECTIONS as exc:
                raise Rejected(rejection_reason(exc, caught)) from exc
        yield run


def sdpa_peak_bytes(bridge: TorchBridge, backend_name: str, case: Case, inputs, *,
                    softmax_scale=None) -> int:
    """Peak bytes torch's allocator held beyond its baseline during one forward+backward
    (outputs, gradients, saved tensors and workspaces; the shared inputs are CuPy's)."""
    import torch.nn.functional as F

    torch = bridge.torch
    kwargs = _sdpa_kwargs(case, softmax_scale)
    with bridge.active(backend_name):
        t = bridge.views(inputs, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                F.scaled_dot_product_attention(t.q, t.k, t.v, **kwargs).backward(t.do)
            except _REJECTIONS as exc:
                raise Rejected(rejection_reason(exc, caught)) from exc
        t.q.grad = t.k.grad = t.v.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        F.scaled_dot_product_attention(t.q, t.k, t.v, **kwargs).backward(t.do)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        t.q.grad = t.k.grad = t.v.grad = None
    torch.cuda.empty_cache()
    return int(peak)
