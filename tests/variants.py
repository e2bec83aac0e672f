"""Hypothesis strategies for the score variants (cupyflash.scores): softcap, ALiBi slopes and
attention sinks, as the keyword arguments of flash_attn_func (NumPy float32 arrays)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

# Caps seen in models (Gemma 2: 50 on attention, 30 on logits) and small ones, where tanh bends
# most of the scores.
FAVOURITE_CAPS = (0.5, 1.0, 5.0, 30.0, 50.0)


@st.composite
def variant_kwargs(draw, batch: int, nheads: int, at_least_one: bool = True):
    """{softcap, alibi_slopes, sink} with each variant on or off (at least one on by default):
    slopes as ALiBi's geometric 2^(-8 (h + 1) / nheads) or random in [0, 1], per head or per
    (batch, head); sink logits normal with std up to 4 (a sink that dominates some rows and not
    others)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    while True:
        on = [draw(st.booleans()) for _ in range(3)]
        if any(on) or not at_least_one:
            break
    kwargs = {}
    if on[0]:
        kwargs["softcap"] = draw(st.one_of(st.sampled_from(FAVOURITE_CAPS), st.floats(0.25, 100.0)))
    if on[1]:
        shape = draw(st.sampled_from(((nheads,), (batch, nheads))))
        if draw(st.booleans()):
            slopes = np.broadcast_to(2.0 ** (-8.0 * (np.arange(nheads) + 1) / max(nheads, 1)), shape)
        else:
            slopes = rng.uniform(0.0, 1.0, size=shape)
        kwargs["alibi_slopes"] = np.ascontiguousarray(slopes, dtype=np.float32)
    if on[2]:
        kwargs["sink"] = (rng.standard_normal(nheads) * draw(st.floats(0.0, 4.0))).astype(np.float32)
    return kwargs
