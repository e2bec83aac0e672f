"""Hypothesis strategies for sliding windows (flash-attn 2.8's ``window_size=(left, right)``)."""
from __future__ import annotations

from hypothesis import strategies as st

# Window sides worth drawing often: 0 and 1 (the diagonal and its neighbours), tile sizes and
# their neighbours (a window edge on a block edge), and -1 (unbounded).
FAVOURITE_SIDES = (-1, 0, 1, 2, 15, 16, 17, 31, 32, 63, 64, 65, 127, 128, 129)


def window_side(max_side: int = 400):
    """One side of a window: -1 (unbounded) or 0..max_side (beyond every sequence here too)."""
    return st.one_of(st.sampled_from(FAVOURITE_SIDES), st.integers(-1, max_side))


@st.composite
def window_size(draw, max_side: int = 400):
    """(left, right), half the time with one side unbounded."""
    left, right = draw(window_side(max_side)), draw(window_side(max_side))
    one_sided = draw(st.sampled_from(("both", "left only", "right only")))
    if one_sided == "left only":
        right = -1
    elif one_sided == "right only":
        left = -1
    return left, right
