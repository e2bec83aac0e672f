"""Helpers for testing cupyflash and code built on it.

``poisoned_outputs()`` makes every GPU output buffer start as NaN instead of uninitialised memory,
so an element a kernel forgets to write fails a comparison instead of passing by luck.
"""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def poison_enabled() -> bool:
    return getattr(_state, "poison", False)


@contextlib.contextmanager
def poisoned_outputs(enabled: bool = True):
    previous = poison_enabled()
    _state.poison = enabled
    try:
        yield
    finally:
        _state.poison = previous
