"""NumPy models of the kernels' index math, one module per kernel (CPU, no GPU).

Each model mirrors the C++ statements it copies (mirrors.mirrors, checked against kernels_cu/ by
each kernel's test file), and is checked there against the PTX semantics it builds on (wgmma.py)
and against plain float64 matmuls: a layout bug then fails as an O(1) mismatch instead of on a GPU.
"""
