"""The shipped tolerance rule (cupyflash.testing.tolerance) under the names the tests use."""
from __future__ import annotations

from cupyflash.testing.tolerance import (  # noqa: F401
    GRADIENT_FACTOR,
    OUTPUT_FACTOR,
    RTOL,
    SIXTEEN_BIT,
    UNIT_ROUNDOFF,
    assert_attention_close,
    assert_close,
    bound,
    flash_rounding_baseline,
    max_abs,
    max_abs_error,
    output_rounding_allowance,
    references_and_baselines,
    rel_fro_error,
    worse_baseline,
)
