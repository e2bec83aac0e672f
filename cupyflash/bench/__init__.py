"""Benchmarks of cupyflash against PyTorch SDPA (FlashAttention-2, cuDNN, mem-efficient).

``python -m cupyflash bench --help`` for the command line; docs/benchmarks.md for the method.
Imports nothing heavy: CuPy, PyTorch and matplotlib are loaded when a run needs them, so
``--help`` and ``--list`` work on a machine without a GPU.

Modules: ``shapes`` (cases, FLOPs, presets), ``timing`` (CUDA events), ``inputs``,
``runners`` (cupyflash) and ``torch_sdpa`` (anchors) as timed regions, ``standard``
(materialised attention: memory baseline and float64 check), ``harness`` (the sweep),
``memory``, ``decode``, ``results`` (JSON), ``table`` (text, Markdown), ``plot``, ``cli``.
"""
from .cli import main

__all__ = ["main"]
