"""User-written score and mask modifiers, compiled into the kernels at run time.

A researcher writes a modifier once, as a Python function of the (scaled) score and the indices:

    def relative_bias(score, b, h, q_idx, kv_idx, table):
        return score + table[h, q_idx - kv_idx + 4095]

    def same_document(b, h, q_idx, kv_idx, doc):
        return doc[q_idx] == doc[kv_idx]

    o = cupyflash.flash_attn_func(q, k, v, causal=True,
                                  score_mod=cupyflash.ScoreMod(relative_bias, table=table),
                                  mask_mod=cupyflash.MaskMod(same_document, doc=doc_ids))

and cupyflash derives what it needs from it by *tracing*: it calls the function once with symbolic
stand-ins (``Expr``) for the score, the indices and the tensors, which record an expression graph.
From the graph come
  * the CUDA text the kernels include (``ScoreMod.cuda``), one ``score`` / ``mask`` device function
    whose struct name carries the graph's hash (so the hash is part of every specialization's
    name and of CuPy's cache key: a second process reuses the compiled kernel);
  * a NumPy form (``evaluate``), in the kernels' own types (float32 scores in the float32
    accumulator kernels, int32 indices, C's truncating casts), for the NumPy twin;
  * the derivative d score_mod / d score (symbolic, ``Expr.grad``) for the backward's chain rule:
    1 when the modifier only adds terms that do not depend on the score (a bias), which the
    kernels then do not apply at all.
The float64 reference does not use the graph for values: it calls the user's function itself on
NumPy float64 arrays (``reference_scores``), so the tracer is checked against the definition.

What a modifier may use: + - * / // % ** (constant exponent), unary -, abs(), comparisons, & | ~
on conditions, ``where(cond, a, b)``, ``minimum``, ``maximum``, ``exp``, ``log``, ``tanh``,
``sqrt``, ``sigmoid``, ``floor`` (this module's, which also run on NumPy arrays; NumPy's ufuncs
work on the stand-ins too: ``np.tanh(score)``), Python numbers, and its tensors indexed by integer
expressions (``table[h, q_idx - kv_idx + 4095]``; one index per dimension). Python's ``if``,
``and``, ``or`` and ``int()`` cannot see symbolic values: they raise a TypeError naming the
alternative (``where``, ``&``, ``|``). Integer arithmetic is C's int32 (``//`` and ``%`` floor,
as in Python); tensors are read as int32 (int32, int64, bool) or as the score's type (float32,
float64). Indices must stay inside the tensors: the NumPy form checks it and says which read left
its tensor, the kernels do not (a read outside is undefined, as in C). The kernels clamp q_idx and
kv_idx into the sequences before calling a modifier, so keys past the end never reach it.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import math
import sys
import threading
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["Expr", "ScoreMod", "MaskMod", "BlockMask", "Modifiers", "create_block_mask", "ModifierError", "kernel_report", "where", "minimum", "maximum", "exp", "log", "tanh", "sqrt",
           "sigmoid", "floor", "TENSOR_DTYPES", "MAX_TENSORS", "MAX_TENSOR_DIMS", "source_for"]

MAX_TENSORS = 4       # kernels_cu/modifier.cuh's ModArgs
MAX_TENSOR_DIMS = 4

# Tensor dtypes a modifier may read, with their C type and the kind of value a read gives.
TENSOR_DTYPES = {
    np.dtype(np.float32): ("float", "f"),
    np.dtype(np.float64): ("double", "f"),
    np.dtype(np.int32): ("int", "i"),
    np.dtype(np.int64): ("long long", "i"),
    np.dtype(np.bool_): ("unsigned char", "b"),
}

_KIND_NAMES = {"f": "a float", "i": "an integer", "b": "a condition"}


class ModifierError(TypeError):
    """A modifier cannot be traced or used: the message says what to write instead."""


# --- the expression graph ----------------------------------------------------------------------
class Expr:
    """A node of a traced modifier: an operation, its operands and the kind of its value ("f" a
    float in the kernel's accumulator type, "i" an int32, "b" a condition). Nodes are hash-consed
    per trace, so equal subexpressions are one node (one line of CUDA)."""

    __slots__ = ("op", "args", "kind", "value", "where", "_trace", "__weakref__")
    __array_priority__ = 1000  # NumPy scalars on the left defer to the Expr's operators

    def __init__(self, trace, op, args, kind, value=None, where=None):
        self._trace, self.op, self.args, self.kind, self.value = trace, op, args, kind, value
        self.where = where  # (file, line) of the user's code that made it, for NVRTC's messages

    # Python's control flow cannot follow a symbolic value.
    def __bool__(self):
        raise ModifierError(
            "cupyflash: a modifier cannot branch on a traced value with Python's if / and / or / not: "
            "write cupyflash.modifiers.where(cond, a, b) for if, & for and, | for or, ~ for not")

    def __index__(self):
        raise ModifierError("cupyflash: a traced index cannot become a Python int (int(), range(), a "
                            "slice); index a modifier's tensors with it directly: table[q_idx - kv_idx]")

    __int__ = __index__

    def __float__(self):
        raise ModifierError("cupyflash: a traced value cannot become a Python float; keep it symbolic")

    def __iter__(self):
        raise ModifierError("cupyflash: a traced value is a scalar; it cannot be iterated")

    def __hash__(self):
        return id(self)

    def __repr__(self):
        return f"Expr({self.op}, kind={self.kind})"

    # arithmetic
    def __add__(self, o): return _binary("add", self, o)
    def __radd__(self, o): return _binary("add", o, self)
    def __sub__(self, o): return _binary("sub", self, o)
    def __rsub__(self, o): return _binary("sub", o, self)
    def __mul__(self, o): return _binary("mul", self, o)
    def __rmul__(self, o): return _binary("mul", o, self)
    def __truediv__(self, o): return _binary("div", self, o)
    def __rtruediv__(self, o): return _binary("div", o, self)
    def __floordiv__(self, o): return _binary("floordiv", self, o)
    def __rfloordiv__(self, o): return _binary("floordiv", o, self)
    def __mod__(self, o): return _binary("mod", self, o)
    def __rmod__(self, o): return _binary("mod", o, self)
    def __pow__(self, o): return _power(self, o)
    def __rpow__(self, o): return exp(log(_const(self._trace, o)) * self)
    def __neg__(self): return _unary("neg", self)
    def __pos__(self): return self
    def __abs__(self): return _unary("abs", self)
    # comparisons and conditions
    def __lt__(self, o): return _compare("lt", self, o)
    def __le__(self, o): return _compare("le", self, o)
    def __gt__(self, o): return _compare("lt", o, self)
    def __ge__(self, o): return _compare("le", o, self)
    def __eq__(self, o): return _compare("eq", self, o)
    def __ne__(self, o): return _compare("ne", self, o)
    def __and__(self, o): return _logic("and", self, o)
    def __rand__(self, o): return _logic("and", o, self)
    def __or__(self, o): return _logic("or", self, o)
    def __ror__(self, o): return _logic("or", o, self)
    def __invert__(self):
        if self.kind != "b":
            raise ModifierError("cupyflash: ~ negates a condition; bitwise operations on integers are not supported")
        return _node(self._trace, "not", (self,), "b")

    # NumPy's functions on a stand-in: np.tanh(score), np.where(c, a, b), np.maximum(a, b) ...
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fn = _UFUNCS.get(ufunc.__name__) if method == "__call__" and not kwargs else None
        if fn is None:
            raise ModifierError(f"cupyflash: NumPy's {ufunc.__name__} is not supported in a modifier "
                                f"(supported: {', '.join(sorted(_UFUNCS))})")
        return fn(*inputs)

    def __array_function__(self, func, types, args, kwargs):
        if func is np.where and not kwargs and len(args) == 3:
            return where(*args)
        if func in (np.clip,) and not kwargs and len(args) == 3:
            return minimum(maximum(args[0], args[1]), args[2])
        raise ModifierError(f"cupyflash: NumPy's {func.__name__} is not supported in a modifier")


class _Trace:
    """One tracing: the hash-consing table of its nodes, and where in the user's function each
    was made (the frame of ``code`` on the stack; ``at``: a location to use instead, set while the
    derivative of a node is built)."""

    def __init__(self, code=None):
        self.nodes: dict = {}
        self.code = code
        self.at = None

    def node(self, op, args, kind, value=None):
        key = (op, tuple(id(a) for a in args), kind, value)
        found = self.nodes.get(key)
        if found is None:
            found = self.nodes[key] = Expr(self, op, tuple(args), kind, value, self._where())
        return found

    def _where(self):
        if self.at is not None or self.code is None:
            return self.at
        frame = sys._getframe(2)
        while frame is not None and frame.f_code is not self.code:
            frame = frame.f_back
        return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def _node(trace, op, args, kind, value=None) -> Expr:
    return trace.node(op, args, kind, value)


def _trace_of(*xs):
    for x in xs:
        if isinstance(x, Expr):
            return x._trace
    return None


def _const(trace, x) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, (bool, np.bool_)):
        return _node(trace, "const", (), "b", bool(x))
    if isinstance(x, (int, np.integer)):
        x = int(x)
        if not -2**31 <= x < 2**31:
            raise ModifierError(f"cupyflash: the integer {x} does not fit the kernels' int32")
        return _node(trace, "const", (), "i", x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return _node(trace, "const", (), "f", x)
    raise ModifierError(f"cupyflash: a modifier can combine traced values with Python numbers, not with "
                        f"{type(x).__name__} (pass arrays as the modifier's tensors)")


def _as_float(e: Expr) -> Expr:
    if e.kind == "f":
        return e
    if e.kind == "b":
        raise ModifierError("cupyflash: a condition is not a number; use where(cond, a, b)")
    if e.op == "const":
        return _node(e._trace, "const", (), "f", float(e.value))
    return _node(e._trace, "float", (e,), "f")


def _number(e: Expr, what: str) -> Expr:
    if e.kind == "b":
        raise ModifierError(f"cupyflash: {what} takes numbers, not conditions; use where(cond, a, b)")
    return e


def _fold(op, a: float, b: float) -> float:
    """Constant folding of float operations, in double (ints keep C's semantics: not folded)."""
    with np.errstate(all="ignore"):
        x, y = np.float64(a), np.float64(b)
        return float({"add": x + y, "sub": x - y, "mul": x * y, "div": x / y}[op])


def _binary(op, x, y) -> Expr:
    trace = _trace_of(x, y)
    a, b = _number(_const(trace, x), op), _number(_const(trace, y), op)
    if op == "div":
        a, b = _as_float(a), _as_float(b)
    elif op in ("floordiv", "mod"):
        if a.kind == "f" or b.kind == "f":
            a, b = _as_float(a), _as_float(b)
    elif a.kind != b.kind:
        a, b = _as_float(a), _as_float(b)
    kind = a.kind
    # Simplifications that keep the value exact (they let the derivative of a bias fold to 1); 0 * x
    # stays (x may be inf): the derivative's own products drop their zero terms (_grad's mul).
    if a.op == "const" and b.op == "const" and kind == "f" and op in ("add", "sub", "mul", "div"):
        return _node(trace, "const", (), "f", float(_fold(op, a.value, b.value)))
    if op == "add":
        if _is(b, 0): return a
        if _is(a, 0): return b
    if op == "sub" and _is(b, 0):
        return a
    if op == "mul":
        if _is(b, 1): return a
        if _is(a, 1): return b
    if op == "div" and _is(b, 1):
        return a
    return _node(trace, op, (a, b), kind)


def _is(e: Expr, value) -> bool:
    return e.op == "const" and e.kind in ("f", "i") and e.value == value


def _power(x, y) -> Expr:
    trace = _trace_of(x, y)
    base = _number(_const(trace, x), "**")
    if isinstance(y, Expr):
        return exp(log(_as_float(base)) * y)
    if not isinstance(y, (int, float, np.integer, np.floating)) or isinstance(y, (bool, np.bool_)):
        raise ModifierError("cupyflash: ** takes a number as its exponent")
    y = float(y)
    if y == int(y) and 0 <= y <= 8 and base.kind == "i":
        out = _const(trace, 1)
        for _ in range(int(y)):
            out = out * base
        return out
    if y == 1:
        return _as_float(base)
    return _node(trace, "pow", (_as_float(base),), "f", y)


def _unary(op, x) -> Expr:
    e = _number(_const(_trace_of(x), x), op)
    if op == "neg":
        if e.op == "const":
            return _node(e._trace, "const", (), e.kind, -e.value)
        return _node(e._trace, "neg", (e,), e.kind)
    if op == "abs":
        return _node(e._trace, "abs", (e,), e.kind)
    e = _as_float(e)
    if e.op == "const" and op in _FLOAT_FNS:
        return _node(e._trace, "const", (), "f", float(_FLOAT_FNS[op](np.float64(e.value))))
    return _node(e._trace, op, (e,), "f")


def _compare(op, x, y) -> Expr:
    trace = _trace_of(x, y)
    a, b = _const(trace, x), _const(trace, y)
    if a.kind == "b" or b.kind == "b":
        if op in ("eq", "ne") and a.kind == b.kind == "b":
            return _node(trace, op, (a, b), "b")
        raise ModifierError("cupyflash: conditions compare only with == and != to other conditions")
    if a.kind != b.kind:
        a, b = _as_float(a), _as_float(b)
    return _node(trace, op, (a, b), "b")


def _logic(op, x, y) -> Expr:
    trace = _trace_of(x, y)
    a, b = _const(trace, x), _const(trace, y)
    if a.kind != "b" or b.kind != "b":
        raise ModifierError(f"cupyflash: {'&' if op == 'and' else '|'} combines conditions (comparisons); "
                            "bitwise operations on integers are not supported")
    return _node(trace, op, (a, b), "b")


def _float_fn(op):
    def fn(x):
        if isinstance(x, Expr):
            return _unary(op, x)
        return _FLOAT_FNS[op](x)
    fn.__name__ = op
    fn.__doc__ = f"{op}(x): elementwise on NumPy arrays, symbolic on a modifier's traced values."
    return fn


def _sigmoid_np(x):
    return 1 / (1 + np.exp(-np.asarray(x)))


_FLOAT_FNS = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt, "sigmoid": _sigmoid_np,
              "floor": np.floor}
exp, log, tanh, sqrt, sigmoid, floor = (_float_fn(name) for name in ("exp", "log", "tanh", "sqrt", "sigmoid", "floor"))


def where(cond, a, b):
    """a where cond holds, else b: NumPy's where on arrays, a select in a traced modifier."""
    trace = _trace_of(cond, a, b)
    if trace is None:
        return np.where(cond, a, b)
    c, x, y = _const(trace, cond), _const(trace, a), _const(trace, b)
    if c.kind != "b":
        raise ModifierError("cupyflash: where's first argument must be a condition (a comparison)")
    if x.kind == "b" or y.kind == "b":
        if x.kind == y.kind == "b":
            return _node(trace, "where", (c, x, y), "b")
        raise ModifierError("cupyflash: where's branches must both be numbers or both conditions")
    if x.kind != y.kind:
        x, y = _as_float(x), _as_float(y)
    if c.op == "const":
        return x if c.value else y
    if x is y:
        return x
    return _node(trace, "where", (c, x, y), x.kind)


def _extremum(op, np_fn):
    def fn(a, b):
        trace = _trace_of(a, b)
        if trace is None:
            return np_fn(a, b)
        x, y = _number(_const(trace, a), op), _number(_const(trace, b), op)
        if x.kind != y.kind:
            x, y = _as_float(x), _as_float(y)
        return _node(trace, op, (x, y), x.kind)
    fn.__name__ = {"min": "minimum", "max": "maximum"}[op]
    fn.__doc__ = f"NumPy's {fn.__name__} on arrays, symbolic on a modifier's traced values."
    return fn


minimum, maximum = _extremum("min", np.minimum), _extremum("max", np.maximum)

_UFUNCS = {"add": lambda a, b: _binary("add", a, b), "subtract": lambda a, b: _binary("sub", a, b),
           "multiply": lambda a, b: _binary("mul", a, b), "true_divide": lambda a, b: _binary("div", a, b),
           "divide": lambda a, b: _binary("div", a, b), "floor_divide": lambda a, b: _binary("floordiv", a, b),
           "remainder": lambda a, b: _binary("mod", a, b), "negative": lambda a: _unary("neg", a),
           "absolute": lambda a: _unary("abs", a), "exp": exp, "log": log, "tanh": tanh, "sqrt": sqrt,
           "floor": floor, "minimum": minimum, "maximum": maximum, "fmin": minimum, "fmax": maximum,
           "less": lambda a, b: _compare("lt", a, b), "less_equal": lambda a, b: _compare("le", a, b),
           "greater": lambda a, b: _compare("lt", b, a), "greater_equal": lambda a, b: _compare("le", b, a),
           "equal": lambda a, b: _compare("eq", a, b), "not_equal": lambda a, b: _compare("ne", a, b),
           "logical_and": lambda a, b: _logic("and", a, b), "logical_or": lambda a, b: _logic("or", a, b),
           "logical_not": lambda a: ~_const(_trace_of(a), a), "power": lambda a, b: _power(a, b)}


class _TensorArg:
    """The stand-in of a modifier's tensor while tracing: indexing it records a read."""

    def __init__(self, trace, slot: int, name: str, dtype: np.dtype, shape: tuple):
        self._trace, self.slot, self.name, self.dtype, self.shape = trace, slot, name, dtype, shape
        self.ndim = len(shape)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != self.ndim:
            raise ModifierError(f"cupyflash: tensor {self.name!r} has {self.ndim} dimension(s) {self.shape}; "
                                f"read it with exactly {self.ndim} index(es), got {len(index)}")
        parts = []
        for i in index:
            if isinstance(i, slice) or i is Ellipsis or i is None:
                raise ModifierError(f"cupyflash: tensor {self.name!r} is read one element at a time: "
                                    "slices, ... and None are not supported")
            e = _const(self._trace, i)
            if e.kind != "i":
                raise ModifierError(f"cupyflash: tensor {self.name!r} is indexed by integers, got {_KIND_NAMES[e.kind]} "
                                    "(floor() and a cast are not implied)")
            parts.append(e)
        return _node(self._trace, "load", tuple(parts), TENSOR_DTYPES[self.dtype][1], self.slot)

    def __array__(self, *args, **kwargs):
        raise ModifierError(f"cupyflash: tensor {self.name!r} is read by indexing it with the indices "
                            "(table[h, q_idx]); whole-array operations are not supported in a modifier")


# --- derivative ---------------------------------------------------------------------------------
def _grad(out: Expr, wrt: Expr) -> Expr:
    """d out / d wrt, symbolically (reverse over the graph would share more; the graphs are small)."""
    trace = out._trace
    memo: dict = {}
    zero, one = _node(trace, "const", (), "f", 0.0), _node(trace, "const", (), "f", 1.0)

    def mul(x: Expr, y: Expr) -> Expr:
        # A term of the chain rule whose derivative factor is 0 is 0, whatever the other factor
        # (0 * inf would be NaN, but the term does not exist).
        return zero if _is(x, 0) or _is(y, 0) else x * y

    def div(x: Expr, y: Expr) -> Expr:
        return zero if _is(x, 0) else x / y

    def d(e: Expr) -> Expr:
        if e is wrt:
            return one
        if e.kind != "f" or e.op in ("const", "load", "float"):
            return zero
        if id(e) in memo:
            return memo[id(e)]
        outer, trace.at = trace.at, e.where  # the derivative's nodes are the line's that made e
        try:
            r = _d(e)
        finally:
            trace.at = outer
        memo[id(e)] = r
        return r

    def _d(e: Expr) -> Expr:
        a = e.args
        op = e.op
        if op == "add":
            r = d(a[0]) + d(a[1])
        elif op == "sub":
            r = d(a[0]) - d(a[1])
        elif op == "mul":
            r = mul(d(a[0]), a[1]) + mul(a[0], d(a[1]))
        elif op == "div":
            r = div(d(a[0]), a[1]) - div(mul(a[0], d(a[1])), a[1] * a[1])
        elif op == "neg":
            r = -d(a[0])
        elif op == "abs":
            r = zero if _is(d(a[0]), 0) else where(a[0] < 0, -d(a[0]), d(a[0]))
        elif op == "exp":
            r = mul(d(a[0]), e)
        elif op == "log":
            r = div(d(a[0]), a[0])
        elif op == "tanh":
            r = mul(d(a[0]), 1.0 - e * e)
        elif op == "sqrt":
            r = div(d(a[0]), 2.0 * e)
        elif op == "sigmoid":
            r = mul(d(a[0]), e * (1.0 - e))
        elif op == "pow":
            r = mul(d(a[0]), 2.0 * a[0] if e.value == 2 else e.value * _power(a[0], e.value - 1))
        elif op in ("floor", "floordiv"):
            r = zero
        elif op == "mod":
            r = d(a[0])  # x mod c has slope 1 in x where it is continuous
        elif op in ("min", "max"):
            first = a[0] <= a[1] if op == "min" else a[1] <= a[0]
            da, db = d(a[0]), d(a[1])
            r = da if da is db else where(first, da, db)
        elif op == "where":
            da, db = d(a[1]), d(a[2])
            r = da if da is db else where(a[0], da, db)
        else:
            raise AssertionError(op)
        return r

    return d(out)


# --- CUDA text ----------------------------------------------------------------------------------
_CPP_OPS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "eq": "==", "ne": "!=",
            "and": "&&", "or": "||"}


def _topological(roots) -> list:
    order, seen = [], set()

    def visit(e):
        if id(e) in seen:
            return
        seen.add(id(e))
        for a in e.args:
            visit(a)
        order.append(e)

    for r in roots:
        visit(r)
    return order


def _c_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _float_literal(x: float) -> str:
    if math.isnan(x):
        return "A(NAN)"
    if math.isinf(x):
        return "A(INFINITY)" if x > 0 else "A(-INFINITY)"
    return f"A({x!r})"


def _cpp_body(roots: dict, tensors: list) -> tuple[list, dict]:
    """CUDA statements that compute ``roots`` (name -> Expr): (lines, name -> variable)."""
    names: dict = {}
    lines = []
    ctype = {"f": "A", "i": "int", "b": "bool"}
    at = None
    count = 0
    for e in _topological(roots.values()):
        op, a = e.op, [names.get(id(x)) for x in e.args]
        if op in ("score", "b", "h", "q_idx", "kv_idx"):
            names[id(e)] = op
            continue
        if op == "const":
            names[id(e)] = (_float_literal(e.value) if e.kind == "f" else
                            ("true" if e.value else "false") if e.kind == "b" else f"({e.value})")
            continue
        if op == "div":  # always float (_binary): the kernels' FAST form where they take one
            text = f"cf::mod_div<FAST>({a[0]}, {a[1]})"
        elif op in _CPP_OPS:
            text = f"{a[0]} {_CPP_OPS[op]} {a[1]}"
        elif op == "neg":
            text = f"-{a[0]}"
        elif op == "not":
            text = f"!{a[0]}"
        elif op == "abs":
            text = f"cf::abs_({a[0]})" if e.kind == "f" else f"::abs({a[0]})"
        elif op == "float":
            text = f"A({a[0]})"
        elif op in ("exp", "log", "tanh", "sqrt", "sigmoid", "floor"):
            text = f"cf::mod_{op}<FAST>({a[0]})"
        elif op == "pow":
            text = f"cf::mod_pow({a[0]}, {_float_literal(e.value)})"
        elif op in ("floordiv", "mod"):
            text = f"cf::mod_{op}({a[0]}, {a[1]})"
        elif op in ("min", "max"):
            text = f"cf::mod_{op}({a[0]}, {a[1]})"
        elif op == "where":
            text = f"{a[0]} ? {a[1]} : {a[2]}"
        elif op == "load":
            slot = e.value
            cty = TENSOR_DTYPES[tensors[slot].dtype][0]
            index = ", ".join(a)
            load = f"cf::mod_load<{cty}>(t, {slot}, {index})"
            text = {"f": f"A({load})", "i": f"int({load})", "b": f"({load} != 0)"}[e.kind]
        else:
            raise AssertionError(op)
        var = f"v{count}"
        count += 1
        if e.where is not None and e.where != at:  # NVRTC's messages name the user's line
            at = e.where
            lines.append(f'#line {at[1]} "{_c_string(at[0])}"')
        lines.append(f"        const {ctype[e.kind]} {var} = {text};")
        names[id(e)] = var
    return lines, {k: names[id(v)] for k, v in roots.items()}


# --- NumPy form ---------------------------------------------------------------------------------
def _evaluate(roots: dict, env: dict, tensors: list, acc) -> dict:
    """The graph on NumPy arrays: floats in ``acc`` (the kernel's accumulator), ints in int32 with
    C's wrap-around, reads bounds-checked."""
    acc = np.dtype(acc)
    values: dict = {}
    with np.errstate(all="ignore"):
        for e in _topological(roots.values()):
            op = e.op
            if op in env:
                v = env[op]
            elif op == "const":
                v = {"f": acc.type, "i": np.int32, "b": np.bool_}[e.kind](e.value)
            else:
                a = [values[id(x)] for x in e.args]
                v = _np_op(e, a, tensors, acc)
            if e.kind == "f":
                v = np.asarray(v).astype(acc, copy=False)
            elif e.kind == "i":
                v = np.asarray(v).astype(np.int32, copy=False)
            values[id(e)] = v
    return {k: values[id(v)] for k, v in roots.items()}


def _np_op(e: Expr, a: list, tensors: list, acc):
    op = e.op
    if op == "add": return a[0] + a[1]
    if op == "sub": return a[0] - a[1]
    if op == "mul": return a[0] * a[1]
    if op == "div": return a[0] / a[1]
    if op == "floordiv":
        if e.kind == "i":
            return np.floor_divide(a[0], np.where(a[1] == 0, 1, a[1]))
        return np.floor(a[0] / a[1])
    if op == "mod":
        if e.kind == "i":
            return np.mod(a[0], np.where(a[1] == 0, 1, a[1]))
        return a[0] - a[1] * np.floor(a[0] / a[1])
    if op == "neg": return -a[0]
    if op == "not": return ~a[0]
    if op == "abs": return np.abs(a[0])
    if op == "float": return a[0].astype(acc)
    if op in _FLOAT_FNS: return _FLOAT_FNS[op](a[0])
    if op == "pow": return np.power(a[0], acc.type(e.value))
    if op == "min": return np.minimum(a[0], a[1])
    if op == "max": return np.maximum(a[0], a[1])
    if op == "lt": return a[0] < a[1]
    if op == "le": return a[0] <= a[1]
    if op == "eq": return a[0] == a[1]
    if op == "ne": return a[0] != a[1]
    if op == "and": return a[0] & a[1]
    if op == "or": return a[0] | a[1]
    if op == "where": return np.where(a[0], a[1], a[2])
    if op == "load":
        t = tensors[e.value]
        index = np.broadcast_arrays(*a)
        for axis, (ix, size) in enumerate(zip(index, t.shape)):
            bad = (ix < 0) | (ix >= size)
            if bad.any():
                raise IndexError(f"cupyflash: the modifier read {t.name}{list(t.shape)} at index {int(ix[bad].flat[0])} "
                                 f"of dimension {axis} (size {size})")
        value = np.asarray(t.array)[tuple(index)]
        kind = e.kind
        return value.astype(acc) if kind == "f" else value.astype(np.int32) if kind == "i" else value != 0
    raise AssertionError(op)


# --- the modifiers ------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _Tensor:
    name: str
    array: object  # NumPy or CuPy, as the user gave it (moved by the API)
    dtype: np.dtype
    shape: tuple


_lock = threading.Lock()
_SOURCES: dict = {}  # struct name -> CUDA text: the kernels' module appends the ones it names


def source_for(expression: str) -> str:
    """CUDA text of the modifier structs a kernel's template expression names ("" for none)."""
    with _lock:
        return "".join(text for name, text in _SOURCES.items() if name in expression)


def _check_tensors(fn, leading: int, tensors: dict, what: str) -> list:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise ModifierError(f"cupyflash: the {what} must be a Python function") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < leading or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        names = "score, b, h, q_idx, kv_idx" if leading == 5 else "b, h, q_idx, kv_idx"
        raise ModifierError(f"cupyflash: a {what} is written fn({names}, <tensors by name>); {fn.__name__} "
                            f"takes ({', '.join(p.name for p in params)})")
    wanted = [p.name for p in positional[leading:]] + [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    missing = [n for n in wanted if n not in tensors]
    extra = [n for n in tensors if n not in wanted]
    if missing or extra:
        raise ModifierError(f"cupyflash: {fn.__name__} reads tensors {wanted}; "
                            + (f"missing: {missing} (pass them by name: {'ScoreMod' if leading == 5 else 'MaskMod'}"
                               f"({fn.__name__}, {missing[0]}=...))" if missing else "")
                            + ("; " if missing and extra else "")
                            + (f"given but not parameters: {extra}" if extra else ""))
    if len(wanted) > MAX_TENSORS:
        raise ModifierError(f"cupyflash: a modifier reads at most {MAX_TENSORS} tensors, {fn.__name__} takes {len(wanted)}")
    out = []
    for name in wanted:
        array = tensors[name]
        if not hasattr(array, "shape") or not hasattr(array, "dtype"):
            raise ModifierError(f"cupyflash: tensor {name!r} must be a NumPy or CuPy array (or DLPack), got {type(array).__name__}")
        from . import _arrays as A

        array = A.take_array(array, name, A.array_kind(array, name))
        dtype = np.dtype(array.dtype)
        if dtype not in TENSOR_DTYPES:
            raise ModifierError(f"cupyflash: tensor {name!r} has dtype {dtype}; a modifier reads "
                                f"{', '.join(str(d) for d in TENSOR_DTYPES)}")
        if not 1 <= array.ndim <= MAX_TENSOR_DIMS:
            raise ModifierError(f"cupyflash: tensor {name!r} must have 1 to {MAX_TENSOR_DIMS} dimensions, "
                                f"got shape {tuple(array.shape)}")
        out.append(_Tensor(name, array, dtype, tuple(int(s) for s in array.shape)))
    return out


class _Modifier:
    """What ScoreMod and MaskMod share: tracing, the CUDA text and its hash."""

    LEADING = 0
    WHAT = ""

    def __init__(self, fn, **tensors):
        if isinstance(fn, _Modifier):
            raise ModifierError(f"cupyflash: {type(self).__name__} takes the function, not another modifier")
        if not callable(fn):
            raise ModifierError(f"cupyflash: {type(self).__name__} takes a Python function, got {type(fn).__name__}")
        self.fn = fn
        self.tensors = _check_tensors(fn, self.LEADING, tensors, self.WHAT)
        self.trace = _Trace(getattr(fn, "__code__", None))
        self.vars = {name: _node(self.trace, name, (), "f" if name == "score" else "i")
                     for name in ("score", "b", "h", "q_idx", "kv_idx")}
        stand_ins = [_TensorArg(self.trace, slot, t.name, t.dtype, t.shape) for slot, t in enumerate(self.tensors)]
        leading = [self.vars[n] for n in ("score", "b", "h", "q_idx", "kv_idx")[5 - self.LEADING:]]
        try:
            out = fn(*leading, **{t.name: s for t, s in zip(self.tensors, stand_ins)})
        except ModifierError:
            raise
        self.out = self._check_output(_const(self.trace, out))

    def _check_output(self, out):
        return out

    @property
    def tensor_signature(self) -> str:
        return ",".join(f"{t.dtype}[{'x'.join(map(str, t.shape))}]" for t in self.tensors)

    def cpp(self, roots: dict, offset: int = 0) -> tuple[list, dict]:
        """_cpp_body of ``roots`` (this modifier's graphs), its tensors in slots from ``offset``,
        made once per modifier: a call builds its Modifiers anew, the code is the modifier's."""
        cache = self.__dict__.setdefault("_cpp_cache", {})
        key = (tuple(roots), offset)
        if key not in cache:
            shifted = {k: _shift_slots(self, v, offset) for k, v in roots.items()}
            cache[key] = _cpp_body(shifted, [None] * offset + self.tensors)
        return cache[key]

    def with_arrays(self, arrays):
        """The same modifier reading ``arrays`` (the API's moved copies) in place of its own."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.tensors = [_Tensor(t.name, a, t.dtype, t.shape) for t, a in zip(self.tensors, arrays)]
        return clone

    def __repr__(self):
        return f"{type(self).__name__}({getattr(self.fn, '__name__', self.fn)}, {self.tensor_signature or 'no tensors'})"


class ScoreMod(_Modifier):
    """A score modifier ``fn(score, b, h, q_idx, kv_idx, **tensors) -> new score``: ``score`` is the
    scaled score z = softmax_scale q_i . k_j of query ``q_idx`` and key ``kv_idx`` (indices in
    their sequences), ``b`` the batch entry and ``h`` the query head; ``tensors`` the arrays it
    reads, by parameter name. Its derivative in the score is traced too (the backward's chain rule)."""

    LEADING = 5
    WHAT = "score modifier"

    def _check_output(self, out):
        if out.kind == "b":
            raise ModifierError(f"cupyflash: {self.fn.__name__} returns a condition; a score modifier returns the new "
                                "score (a mask predicate is a MaskMod)")
        out = _as_float(out)
        self.dout = _grad(out, self.vars["score"])
        return out

    @property
    def has_grad(self) -> bool:
        """Whether the derivative is not exactly 1 (a bias's is 1: the backward skips it)."""
        return not _is(self.dout, 1)


class MaskMod(_Modifier):
    """A mask predicate ``fn(b, h, q_idx, kv_idx, **tensors) -> condition``: whether query ``q_idx``
    sees key ``kv_idx`` (in addition to causal / window_size, which still apply)."""

    LEADING = 4
    WHAT = "mask modifier"

    def _check_output(self, out):
        if out.kind != "b":
            raise ModifierError(f"cupyflash: {self.fn.__name__} returns {_KIND_NAMES[out.kind]}; a mask modifier returns "
                                "a condition (True: the key is visible), e.g. doc[q_idx] == doc[kv_idx]")
        return out


def _reads(out: Expr) -> set:
    """The index variables (b, h, q_idx, kv_idx) a graph depends on."""
    return {e.op for e in _topological([out]) if e.op in ("b", "h", "q_idx", "kv_idx")}


class BlockMask:
    """The block map of a mask modifier for one problem shape: which keys each granule of
    ``GRANULE`` query rows may see, and which queries each granule of keys, from the predicate
    itself (FlexAttention's BlockMask is the model). Made once (``create_block_mask``, on the GPU
    where there is one) and passed to every call with that mask as ``block_mask=``, forward and
    backward; the kernels then skip the blocks it leaves out, so a document mask costs what its
    visible blocks cost. ``batch`` / ``nheads`` None make one map for all batch entries / heads,
    which the mask must then not read (b / h): checked from its trace.

    The map holds, per (batch, head) of the map and query granule, the key granules [first, end)
    that hold a pair the mask keeps (``key_ranges``), and per key granule the query granules
    (``query_ranges``), as made; the kernels read them folded (modifier.cuh, mask.cuh's WithScore).
    It also holds where the mask keeps whole blocks: per query granule the longest run [first,
    end) of key granules whose every pair the mask keeps (``key_runs``; pairs past a sequence's end
    count as kept), per key granule the longest run of such query granules (``query_runs``). A
    kernel block inside the runs skips the predicate (FlexAttention's full blocks): a document
    mask's blocks off the documents' edges cost what the plain kernel's cost.
    The map is of the mask's tensors as they are when it is made: change them, make a new map (an
    old map would skip blocks, and the predicate on blocks it holds whole, that the new tensors
    change)."""

    GRANULE = 16  # kernels_cu/flash_block_map.cu: BLOCK_MAP_GRANULE

    def __init__(self, mask_mod, batch, nheads, seqlen_q: int, seqlen_k: int, *, device: str = "auto"):
        mask_mod = mask_mod if isinstance(mask_mod, MaskMod) else MaskMod(mask_mod)
        reads = _reads(mask_mod.out)
        for what, value, var in (("batch", batch, "b"), ("nheads", nheads, "h")):
            if value is None and var in reads:
                raise ModifierError(f"cupyflash: {mask_mod.fn.__name__} reads {var}, so its block map needs "
                                    f"{what} (None makes one map for all)")
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"cupyflash: create_block_mask's {what} must be an int >= 1 or None, got {value!r}")
        for what, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"cupyflash: create_block_mask's {what} must be an int >= 0, got {value!r}")
        self.mask_mod = mask_mod
        self.batch, self.nheads = batch, nheads
        # A mask that reads no b (h) has one map for all batch entries (heads), whatever was asked.
        self.map_batch = 1 if batch is None or "b" not in reads else int(batch)
        self.map_heads = 1 if nheads is None or "h" not in reads else int(nheads)
        self.seqlen_q, self.seqlen_k = int(seqlen_q), int(seqlen_k)
        self.query_granules = -(-self.seqlen_q // self.GRANULE)
        self.key_granules = -(-self.seqlen_k // self.GRANULE)
        if device == "auto":
            from . import dispatch

            device = "cuda" if dispatch.gpu_available() else "cpu"
        if device == "cuda":
            self.key_ranges, self.query_ranges, self.key_runs, self.query_runs = self._make_on_gpu()
        elif device == "cpu":
            self.key_ranges, self.query_ranges, self.key_runs, self.query_runs = self._make_on_host()
        else:
            raise ValueError(f"cupyflash: create_block_mask's device must be 'auto', 'cuda' or 'cpu', got {device!r}")
        self._tables: dict = {}

    def __repr__(self):
        return (f"BlockMask({self.mask_mod!r}, batch={self.batch}, nheads={self.nheads}, seqlen_q={self.seqlen_q}, "
                f"seqlen_k={self.seqlen_k}, visible granule pairs {self.density():.3f}, "
                f"in whole runs {self.full_density():.3f})")

    def _shape(self):
        return self.map_batch, self.map_heads

    def _make_on_host(self):
        """The tables by evaluating the mask's NumPy form, GRANULE query rows at a time."""
        G, (mb, mh) = self.GRANULE, self._shape()
        Rg, Cg = self.query_granules, self.key_granules
        any_pair = np.zeros((mb, mh, Rg, Cg), bool)
        whole = np.zeros((mb, mh, Rg, Cg), bool)  # every pair kept (past the ends: kept)
        b = np.arange(mb, dtype=np.int32)[:, None, None, None]
        h = np.arange(mh, dtype=np.int32)[None, :, None, None]
        kv = np.arange(self.seqlen_k, dtype=np.int32)[None, None, None, :]
        mods = Modifiers(None, _MaskOnly(self.mask_mod)).to(np)
        for r in range(Rg):
            q = np.arange(r * G, min((r + 1) * G, self.seqlen_q), dtype=np.int32)[None, None, :, None]
            keep = np.broadcast_to(mods.visible(b, h, q, kv), (mb, mh, q.shape[2], self.seqlen_k))
            padded = np.zeros((mb, mh, Cg * G), bool)
            padded[..., :self.seqlen_k] = keep.any(axis=2)
            any_pair[:, :, r] = padded.reshape(mb, mh, Cg, G).any(axis=-1)
            padded = np.ones((mb, mh, Cg * G), bool)
            padded[..., :self.seqlen_k] = keep.all(axis=2)
            whole[:, :, r] = padded.reshape(mb, mh, Cg, G).all(axis=-1)
        return (_ranges(any_pair, axis=3), _ranges(any_pair, axis=2), _longest_runs(whole, axis=3),
                _longest_runs(whole, axis=2))

    def _make_on_gpu(self):
        """Both tables by kernels_cu/flash_block_map.cu on the current device."""
        import cupy

        from .kernels._module import launch
        from .kernels.params import BLOCK_MAP_PARAMS, set_mod_tensors

        mb, mh = self._shape()
        Rg, Cg = self.query_granules, self.key_granules
        key = cupy.zeros((mb, mh, Rg, 4), np.int32)  # modifier.cuh's BLOCK_MAP_ROW
        query = cupy.zeros((mb, mh, Cg, 4), np.int32)
        query[..., 0], query[..., 1] = Rg, 0
        if Rg and Cg:
            mods = Modifiers(None, _MaskOnly(self.mask_mod)).to(cupy)
            params = np.zeros(1, BLOCK_MAP_PARAMS)
            set_mod_tensors(params["t"], mods.tensors)
            params["key_blocks"], params["query_blocks"] = np.uint64(key.data.ptr), np.uint64(query.data.ptr)
            params["map_batch"], params["map_heads"] = mb, mh
            params["seqlen_q"], params["seqlen_k"] = self.seqlen_q, self.seqlen_k
            params["query_granules"], params["key_granules"] = Rg, Cg
            spec = block_map_spec(mods)
            launch(spec, (Rg, mh, mb), (params,))
            params["by_keys"] = np.int32(1)
            launch(spec, (Cg, mh, mb), (params,))
        else:
            key[..., 0], key[..., 1] = Cg, 0
        key, query = key.get(), query.get()
        return key[..., :2].copy(), query[..., :2].copy(), key[..., 2:].copy(), query[..., 2:].copy()

    def density(self) -> float:
        """The fraction of (query granule, key granule) pairs inside the key ranges."""
        if not self.query_granules or not self.key_granules:
            return 0.0
        width = np.maximum(self.key_ranges[..., 1] - self.key_ranges[..., 0], 0)
        return float(width.sum() / (width.size * self.key_granules))

    def full_density(self) -> float:
        """The fraction of (query granule, key granule) pairs inside the key runs (whole blocks)."""
        if not self.query_granules or not self.key_granules:
            return 0.0
        width = self.key_runs[..., 1] - self.key_runs[..., 0]
        return float(width.sum() / (width.size * self.key_granules))

    def check_call(self, batch: int, nheads: int, seqlen_q: int, seqlen_k: int) -> None:
        """A clear error where the map was made for another problem shape."""
        ok = (self.seqlen_q == seqlen_q and self.seqlen_k == seqlen_k and self.batch in (None, batch)
              and self.nheads in (None, nheads))
        if not ok:
            raise ValueError(f"cupyflash: block_mask was made for batch={self.batch}, nheads={self.nheads}, "
                             f"seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}; the call has batch={batch}, "
                             f"nheads={nheads}, seqlen_q={seqlen_q}, seqlen_k={seqlen_k}")

    def tables(self, group: int, xp):
        """(key table, query table) as the kernels read them: folded (the key table's first a
        suffix minimum over query granules, its end a prefix maximum; the query table's the same
        over key granules), then the whole runs (``key_runs``, ``query_runs``) at MAP_LEVELS levels:
        level k's the intersection over the aligned group of 2^k granules (modifier.cuh's
        MAP_ENTRY, ten ints a granule); the query table per kv head (the union of the ranges over
        each group of ``group`` query heads, the intersection of the runs); int32 C-contiguous
        arrays of module ``xp``."""
        cache_key = (group, xp.__name__)
        if cache_key not in self._tables:
            key = np.concatenate([_folded(self.key_ranges), _run_levels(self.key_runs)], axis=-1)
            query_runs = self.query_runs
            query = _folded(self.query_ranges)
            if self.map_heads > 1 and group > 1:
                mb, mh, n, _ = query.shape
                grouped = query.reshape(mb, mh // group, group, n, 2)
                query = np.stack([grouped[..., 0].min(axis=2), grouped[..., 1].max(axis=2)], axis=-1)
                query_runs = _intersection(query_runs.reshape(mb, mh // group, group, n, 2), axis=2)
            query = np.concatenate([query, _run_levels(query_runs)], axis=-1)
            tables = tuple(np.ascontiguousarray(t, dtype=np.int32) for t in (key, query))
            if xp is not np:
                tables = tuple(xp.asarray(t) for t in tables)
            self._tables[cache_key] = tables
        return self._tables[cache_key]



def _ranges(any_pair: np.ndarray, axis: int) -> np.ndarray:
    """[first, end) of the True entries along ``axis`` (3: key granules per query granule, 2: query
    granules per key granule), first = the axis' length and end = 0 where there is none."""
    n = any_pair.shape[axis]
    if n == 0:
        shape = any_pair.shape[:axis] + any_pair.shape[axis + 1:]
        return np.stack([np.zeros(shape, np.int32), np.zeros(shape, np.int32)], axis=-1)
    has = any_pair.any(axis=axis)
    first = np.where(has, np.argmax(any_pair, axis=axis), n)
    last = n - np.argmax(np.flip(any_pair, axis=axis), axis=axis)
    out = np.stack([first, np.where(has, last, 0)], axis=-1).astype(np.int32)
    return out


def _longest_runs(whole: np.ndarray, axis: int) -> np.ndarray:
    """[first, end) of the longest run of True entries along ``axis`` (3: key granules per query
    granule, 2: query granules per key granule), the first of equal length; [0, 0) where there is
    none (flash_block_map.cu's GranuleRun)."""
    lines = np.moveaxis(whole, axis, -1)
    shape = lines.shape[:-1]
    first, length = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    current = np.zeros(shape, np.int32)
    for g in range(lines.shape[-1]):
        current = np.where(lines[..., g], current + 1, 0)
        longer = current > length
        length = np.where(longer, current, length)
        first = np.where(longer, g + 1 - current, first)
    return np.stack([first, first + length], axis=-1).astype(np.int32)


MAP_LEVELS = 4  # kernels_cu/modifier.cuh: tiles of 1, 2, 4 and 8 granules read a run with one load


def _intersection(runs: np.ndarray, axis: int) -> np.ndarray:
    """The intersection of [first, end) runs (the last axis) along ``axis`` of the others, an empty
    one as [first, first)."""
    first = runs[..., 0].max(axis=axis)
    return np.stack([first, np.maximum(runs[..., 1].min(axis=axis), first)], axis=-1)


def _run_levels(runs: np.ndarray) -> np.ndarray:
    """(..., granules, 2) runs -> (..., granules, 2 * MAP_LEVELS): at each granule, level k's run is
    the intersection of the runs of the aligned group of 2^k granules that holds it (the granules
    past the end are not in a group)."""
    n = runs.shape[-2]
    levels = []
    for k in range(MAP_LEVELS):
        size = 1 << k
        padded = np.concatenate([runs, np.broadcast_to(np.array([0, 1 << 30], np.int64), runs.shape[:-2] + (-n % size, 2))],
                                axis=-2) if n % size else runs
        groups = _intersection(padded.reshape(runs.shape[:-2] + (-(-n // size), size, 2)), axis=-1)
        levels.append(np.repeat(groups, size, axis=-2)[..., :n, :])
    return np.concatenate(levels, axis=-1).astype(np.int32)


def _folded(ranges: np.ndarray) -> np.ndarray:
    """first as a suffix minimum and end as a prefix maximum along the granule axis (-2)."""
    first = np.flip(np.minimum.accumulate(np.flip(ranges[..., 0], axis=-1), axis=-1), axis=-1)
    end = np.maximum.accumulate(ranges[..., 1], axis=-1)
    return np.stack([first, end], axis=-1) if ranges.shape[-2] else ranges.copy()


class _MaskOnly:
    """A stand-in BlockMask for a mask modifier alone (the map's own kernel and NumPy form)."""

    def __init__(self, mask_mod):
        self.mask_mod = mask_mod


def block_map_spec(mods: "Modifiers"):
    """The specialization of kernels_cu/flash_block_map.cu for a mask alone (Modifiers(None, _MaskOnly))."""
    from .kernels._module import Specialization

    mods.register()
    return Specialization(f"flash_block_map_{mods.name}", "flash_block_map.cu", f"cf::flash_block_map<{mods.cpp}>",
                          BlockMask.GRANULE ** 2, 0)


def specializations() -> list:
    """The compile check's: the block map kernel of the example mask (example_modifiers)."""
    return [block_map_spec(Modifiers(None, example_modifiers().block_mask))]


def create_block_mask(mask_mod, batch, nheads, seqlen_q: int, seqlen_k: int, *, device: str = "auto") -> BlockMask:
    """The BlockMask of ``mask_mod`` (a MaskMod, or a function of (b, h, q_idx, kv_idx) reading no
    tensors) for calls of this shape; ``batch`` / ``nheads`` None: one map for all (the mask must
    not read b / h). ``device``: 'auto' (the GPU where there is one), 'cuda' or 'cpu'."""
    return BlockMask(mask_mod, batch, nheads, seqlen_q, seqlen_k, device=device)


@dataclass(frozen=True, eq=False)
class Modifiers:
    """The user modifiers of one call: a ScoreMod and a BlockMask (holding its MaskMod), either may
    be None. The kernels' compile-time part is ``cuda`` (its hash in ``name``); the run-time part
    the tensors (score's first, then the mask's) and the block map."""

    score_mod: ScoreMod | None = None
    block_mask: object = None  # BlockMask (or _MaskOnly: no map, the map's own kernel)
    # The b of batch entry 0 (the NumPy twin's): a packed batch's sequence b run alone as a dense
    # batch of one (cupyflash.varlen.sequence_variant) is still sequence b to the modifiers. The
    # kernels number a launch's batch entries from 0 and never take it.
    first_sequence: int = 0
    # The score's float division, tanh, exp and sigmoid in fast forms (kernels_cu/modifier.cuh's
    # FAST), in the kernels that take them (the 16-bit producer kernels): a struct of its own, which
    # the plans try first there and keep where it compiles without spills (perf log
    # modifier-fast-math). The accurate struct otherwise.
    fast_math: bool = False

    def for_sequence(self, b: int) -> "Modifiers":
        """The same modifiers for a dense batch of one that is sequence ``b`` of a packed call."""
        moved = replace(self, first_sequence=b)
        moved.__dict__["cuda"] = self.cuda  # same struct: same text, same name
        return moved

    @property
    def mask_mod(self) -> MaskMod | None:
        return None if self.block_mask is None else self.block_mask.mask_mod

    @property
    def tensors(self) -> list:
        return (self.score_mod.tensors if self.score_mod else []) + (self.mask_mod.tensors if self.mask_mod else [])

    @property
    def has_score(self) -> bool:
        return self.score_mod is not None

    @property
    def has_mask(self) -> bool:
        return self.mask_mod is not None

    @property
    def has_grad(self) -> bool:
        return self.score_mod is not None and self.score_mod.has_grad

    @property
    def has_map(self) -> bool:
        """Whether a block map comes with the mask (a BlockMask; not a mask applied element by
        element only, as the KV-cache kernel takes it)."""
        return self.block_mask is not None and not isinstance(self.block_mask, _MaskOnly)

    @property
    def has_fast_forms(self) -> bool:
        """Whether the score modifier uses a function or division that has a fast form (FAST) and
        reads no tensors: the plans try the fast struct for those alone. The compile check's example
        modifier, which reads a table and document ids, spilled in its fast form on every producer
        kernel (perf log modifier-fast-math), and deciding so without compiling keeps the
        specialization lists (the compile check's, the warm cache's) free of NVRTC runs."""
        return self.score_mod is not None and not self.tensors and "<FAST>(" in self._cuda_body()

    def with_fast_math(self) -> "Modifiers":
        """The same modifiers on their fast math (``fast_math``): another struct, the same tensors."""
        return replace(self, fast_math=True)

    @functools.cached_property
    def cuda(self) -> str:
        """The struct the kernels include (kernels_cu/modifier.cuh's contract), named by the hash of
        its own text."""
        body = self._cuda_body()
        # The name hashes the code, not where it was written: moving the function in its file
        # keeps its kernels (the #line directives only name lines in NVRTC's messages).
        code = "\n".join(line for line in body.splitlines() if not line.startswith("#line"))
        digest = hashlib.sha1(code.encode()).hexdigest()[:12]
        return body.replace("CFU_NAME", f"mod_{digest}")

    @property
    def name(self) -> str:
        """The struct's name (mod_<hash>): in specialization names and template arguments."""
        return self.cuda.split("struct ", 1)[1].split(" ", 1)[0]

    @property
    def cpp(self) -> str:
        return f"cfu::{self.name}"

    def _cuda_body(self) -> str:
        lines = ["namespace cfu {", "struct CFU_NAME {",
                 f"    static constexpr bool HAS_SCORE = {str(self.has_score).lower()};",
                 f"    static constexpr bool HAS_MASK = {str(self.has_mask).lower()};",
                 f"    static constexpr bool HAS_GRAD = {str(self.has_grad).lower()};",
                 f"    static constexpr bool FAST_MATH = {str(self.fast_math).lower()};"]
        if self.score_mod is not None:
            body, out = self.score_mod.cpp({"out": self.score_mod.out, "dout": self.score_mod.dout})
            lines += ["    template <typename A, bool FAST = false>",
                      "    __device__ __forceinline__ static A score(A score, int b, int h, int q_idx, int kv_idx,",
                      "                                              const cf::ModArgs& t, A& dscore) {",
                      *body, f"        dscore = {out['dout']};", f"        return {out['out']};", "    }"]
        if self.mask_mod is not None:
            offset = len(self.score_mod.tensors) if self.score_mod else 0
            body, out = self.mask_mod.cpp({"keep": self.mask_mod.out}, offset)
            body = [line.replace("<FAST>(", "<false>(") for line in body]  # a predicate: accurate math
            lines += ["    __device__ __forceinline__ static bool mask(int b, int h, int q_idx, int kv_idx,",
                      "                                                const cf::ModArgs& t) {",
                      *body, f"        return {out['keep']};", "    }"]
        lines += ["};", "}  // namespace cfu", ""]
        return "\n".join(lines)

    def register(self) -> None:
        """Make the kernels' module include this struct (cupyflash.kernels._module)."""
        with _lock:
            _SOURCES.setdefault(self.name, self.cuda)

    def to(self, xp) -> "Modifiers":
        """The same modifiers with their tensors as arrays of module ``xp``."""
        from . import _arrays as A

        def move(mod):
            if mod is None:
                return None
            convert = (lambda a, n: A.to_numpy(a, n)) if xp is np else (lambda a, n: A.to_cupy(a, n))
            return mod.with_arrays([convert(t.array, t.name) for t in mod.tensors])

        moved = Modifiers(move(self.score_mod), None)
        if self.block_mask is not None:
            block_mask = _MaskOnly(move(self.mask_mod)) if isinstance(self.block_mask, _MaskOnly) else \
                _MovedBlockMask(self.block_mask, move(self.mask_mod))
            moved = Modifiers(moved.score_mod, block_mask)
        moved = replace(moved, first_sequence=self.first_sequence, fast_math=self.fast_math)
        moved.__dict__["cuda"] = self.cuda  # same struct: same text, same name
        return moved

    # NumPy forms ---------------------------------------------------------------------------
    def scores(self, z, b, h, q_idx, kv_idx, acc):
        """(z', dz'/dz) of the score modifier on NumPy arrays in ``acc`` (z itself and None
        without one; dz'/dz None where it is 1)."""
        if self.score_mod is None:
            return z, None
        env = {"score": z, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
        out = _evaluate({"out": self.score_mod.out, "dout": self.score_mod.dout}, env, self.score_mod.tensors, acc)
        return out["out"], (out["dout"] if self.score_mod.has_grad else None)

    def visible(self, b, h, q_idx, kv_idx):
        """The mask predicate on NumPy index arrays (True everywhere without one)."""
        if self.mask_mod is None:
            return np.ones(np.broadcast(np.asarray(b), np.asarray(h), np.asarray(q_idx), np.asarray(kv_idx)).shape, bool)
        env = {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
        return _evaluate({"keep": self.mask_mod.out}, env, self.mask_mod.tensors, np.float64)["keep"]


class _MovedBlockMask:
    """A BlockMask whose mask reads moved copies of its tensors (Modifiers.to): the same map."""

    def __init__(self, block_mask, mask_mod):
        self._inner, self.mask_mod = block_mask, mask_mod

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _shift_slots(mod: _Modifier, root: Expr, offset: int) -> Expr:
    """``root`` (a graph of ``mod``'s) with its tensor reads moved by ``offset`` slots (a mask's
    tensors come after the score's)."""
    if offset == 0:
        return root
    memo: dict = {}

    def copy(e):
        if id(e) in memo:
            return memo[id(e)]
        args = tuple(copy(a) for a in e.args)
        value = e.value + offset if e.op == "load" else e.value
        outer, mod.trace.at = mod.trace.at, e.where  # the copy keeps the user's line
        try:
            out = e if (not args and e.op != "load") else mod.trace.node(e.op, args, e.kind, value)
        finally:
            mod.trace.at = outer
        memo[id(e)] = out
        return out

    return copy(root)


# --- the compile check's modifiers ----------------------------------------------------------------
def _example_score(score, b, h, q_idx, kv_idx, bias):
    """A capped score plus a bias per (head, query) read from a table."""
    return 20.0 * tanh(score / 20.0) + bias[h, q_idx % 32]


def _example_mask(b, h, q_idx, kv_idx, doc):
    """Pairs of one document of a packed sequence."""
    return doc[b, q_idx] == doc[b, kv_idx]


def example_modifiers() -> Modifiers:
    """Modifiers the compile check builds into every kernel the plans launch (masks.VARIANT_KINDS):
    a score with a derivative and a table read, and a mask with a block map. Their tensors are
    placeholders: a kernel's code does not depend on the values or the shapes."""
    score_mod = ScoreMod(_example_score, bias=np.zeros((1, 32), np.float32))
    mask_mod = MaskMod(_example_mask, doc=np.zeros((1, 16), np.int32))
    return Modifiers(score_mod, _MaskOnly(mask_mod))


# --- the API's checks ---------------------------------------------------------------------------
def check_modifiers(score_mod, mask_mod, block_mask, *, batch: int, nheads: int, seqlen_q: int,
                    seqlen_k: int, on_gpu: bool) -> Modifiers | None:
    """A call's score_mod / mask_mod / block_mask as Modifiers (None without any), or a clear
    error. A bare function is a modifier that reads no tensors; a mask_mod without a block_mask
    gets its block map made here, for this call (keep a BlockMask to reuse one)."""
    if score_mod is None and mask_mod is None and block_mask is None:
        return None
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        if isinstance(score_mod, MaskMod):
            raise ModifierError("cupyflash: score_mod got a MaskMod; pass it as mask_mod")
        score_mod = ScoreMod(score_mod)
    if mask_mod is not None and not isinstance(mask_mod, MaskMod):
        if isinstance(mask_mod, ScoreMod):
            raise ModifierError("cupyflash: mask_mod got a ScoreMod; pass it as score_mod")
        mask_mod = MaskMod(mask_mod)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"cupyflash: block_mask must be a cupyflash.BlockMask (create_block_mask), got "
                            f"{type(block_mask).__name__}")
        if mask_mod is not None and mask_mod is not block_mask.mask_mod and mask_mod.fn is not block_mask.mask_mod.fn:
            raise ValueError("cupyflash: mask_mod and block_mask.mask_mod differ; pass the block_mask alone "
                             "(it carries its mask)")
        block_mask.check_call(batch, nheads, seqlen_q, seqlen_k)
    elif mask_mod is not None:
        block_mask = BlockMask(mask_mod, batch, nheads, seqlen_q, seqlen_k, device="cuda" if on_gpu else "cpu")
    return Modifiers(score_mod, block_mask)


def check_element_modifiers(score_mod, mask_mod) -> Modifiers | None:
    """A call's score_mod / mask_mod without a block map (flash_attn_with_kvcache: its mask is
    applied element by element), as check_modifiers checks them; None without either."""
    if score_mod is None and mask_mod is None:
        return None
    mods = check_modifiers(score_mod, None, None, batch=0, nheads=0, seqlen_q=0, seqlen_k=0, on_gpu=False)
    if mask_mod is not None and not isinstance(mask_mod, MaskMod):
        if isinstance(mask_mod, ScoreMod):
            raise ModifierError("cupyflash: mask_mod got a ScoreMod; pass it as score_mod")
        mask_mod = MaskMod(mask_mod)
    return Modifiers(None if mods is None else mods.score_mod, None if mask_mod is None else _MaskOnly(mask_mod))


# --- what a modifier costs the kernels, before any GPU run -----------------------------------------
def kernel_report(score_mod=None, mask_mod=None, *, dtype="bfloat16", headdim: int = 128, causal: bool = False,
                  window_size=(-1, -1), archs=("80", "90"), deterministic: bool = True) -> list[dict]:
    """The kernels the plans launch with these modifiers (forward, dK/dV, dQ) for each arch, with
    ptxas's registers and spill bytes: compiled by NVRTC on the CPU (no GPU needed; cached on disk
    by cupyflash.kernels.compile_check). A modifier's code runs on every score in the kernels'
    registers; this says where it pushed a kernel to spill, and which tiles the plans chose
    instead (plans.without_spills). One dict per kernel: arch, role, name, registers, spill_bytes."""
    from . import backward_plans, plans
    from .kernels import compile_check
    from .masks import mask_for
    from .scores import Score

    mods = check_modifiers(score_mod, mask_mod, None, batch=1, nheads=1, seqlen_q=1, seqlen_k=1, on_gpu=False)
    if mods is None:
        raise ValueError("kernel_report needs a score_mod or a mask_mod")
    mask = mask_for(causal, window_size, Score(user=mods))
    rows = []
    for arch in archs:
        smem = 232448 if arch == "90" else 166912  # opt-in bytes per block: H100 / H200, A100
        launches = [("fwd", plans.plan_forward(arch, dtype, headdim, mask, smem).spec)]
        launches += [(launch.role, launch.spec) for launch in
                     backward_plans.plan_backward(arch, dtype, headdim, mask.backward(), smem, deterministic).launches
                     if launch.role in ("dkdv", "dq")]
        for role, spec in launches:
            result = compile_check.check(spec.arch or arch, [spec])[0]
            rows.append({"arch": spec.arch or arch, "role": role, "name": spec.name, "registers": result.registers,
                         "spill_bytes": result.spill_bytes})
    return rows
