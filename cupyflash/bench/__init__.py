"""Benchmarks of cupyflash against PyTorch SDPA (FlashAttention-2, cuDNN, mem-efficient).

``python -m cupyflash bench --help`` for the command line; docs/benchmarks.md for the method.
Imports nothing heavy: CuPy, PyTorch and matplotlib are loaded when a run needs them, so
``--help``, ``--list`` and ``--from-json`` (render a saved report) work on a machine without a
GPU.

Modules: ``shapes`` (cases, FLOPs, presets), ``impls`` (what is compared), ``inputs``,
``runners`` (cupyflash) and ``torch_sdpa`` (the anchors) as timed regions, ``timing`` (CUDA
events), ``standard`` (materialised attention: memory baseline and float64 check),
``harness`` (the sweep), ``memory``, ``decode``, ``environment``, ``results`` (JSON),
``table`` (text, Markdown), ``plot``, ``progress``, ``cli``.
"""
from .cli import main

__all__ = ["main"]
