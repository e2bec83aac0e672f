"""Whether NVRTC can be loaded here, and the skip marker of tests that compile with it."""
import pytest

from cupyflash.kernels import compile_check

try:
    compile_check._nvrtc()
    HAVE_NVRTC = True
except (FileNotFoundError, OSError):
    HAVE_NVRTC = False

needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason="NVRTC not installed (pip install '.[cuda13]')")
