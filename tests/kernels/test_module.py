"""Host-side helpers of cupyflash/kernels/_module.py that every kernel family's launcher uses."""
import numpy as np
import pytest

from cupyflash.kernels import _module


class _Grad:
    def __init__(self, shape):
        self.shape, self.filled = shape, None

    def fill(self, value):
        self.filled = value


@pytest.mark.parametrize("q_shape,k_shape,empty,zeroed", [
    ((2, 5, 4, 8), (2, 7, 2, 8), False, False),
    ((0, 5, 4, 8), (0, 7, 2, 8), True, False),   # no batch: nothing to write
    ((2, 5, 0, 8), (2, 7, 0, 8), True, False),   # no heads
    ((2, 0, 4, 8), (2, 7, 2, 8), True, True),    # no queries: dk, dv are 0
    ((2, 5, 4, 8), (2, 0, 2, 8), True, True),    # no keys: dq is 0
])
def test_backward_is_empty_zeroes_the_gradients_of_zero_length_sequences(q_shape, k_shape, empty, zeroed):
    q, k = np.empty(q_shape), np.empty(k_shape)
    grads = [_Grad(q_shape), _Grad(k_shape), _Grad(k_shape)]
    assert _module.backward_is_empty(q, k, *grads) is empty
    assert all(g.filled == (0 if zeroed else None) for g in grads)


def test_row_strides_are_int64_elements_of_batch_seq_head():
    a = np.empty((3, 5, 4, 16), dtype=np.float16)[:, ::2]
    strides = _module.row_strides(a)
    assert strides == (5 * 4 * 16, 2 * 4 * 16, 16) and all(type(s) is np.int64 for s in strides)
