"""TorchEasyRec's ``raw_feature.normalizer``: a numeric feature's value transformed before use.

The forms of TorchEasyRec's feature generator (its documentation's formulas), applied to the
value before ``boundaries`` bucketize it or it enters the model as a number:

=================================================  =======================================
``method=log10,threshold=1e-10,default=-10``       ``log10(x)`` where ``x > threshold``,
                                                   else ``default``
``method=zscore,mean=0.0,standard_deviation=10``   ``(x - mean) / standard_deviation``
``method=minmax,min=2.1,max=2.2``                  ``(x - min) / (max - min)``
``method=expression,expr=log(x+3)``                the expression of ``x``
=================================================  =======================================

An expression is arithmetic on ``x`` and numbers (``+ - * / % ^``, ``**``, parentheses) and the
generator's one-argument functions (``sin cos tan asin acos atan sinh cosh tanh asinh acosh
atanh log2 log10 log ln exp sqrt sign abs rint floor ceil trunc round sigmoid isnan``), plus
``roundp(v, digits)``, ``mod(a, b)``, ``min``, ``max`` and ``sum`` of any number of
arguments, and the constants ``pi`` and ``e``. It is parsed once, at validation, into a tree of
numpy operations (nothing is evaluated as Python code); anything else (a conditional, another
name, ``rnd``) is refused by field. A value the transform cannot take (``log`` of a negative)
gives NaN, which the feature builder rejects (``non_finite``) for a numeric feature.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from odl.config.config_error import ConfigError

__all__ = ["RawNormalizer", "parse_normalizer"]

Array = np.ndarray
_Eval = Callable[[Array], Array]


def _round_away(v: Array) -> Array:
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


_ONE_ARG: dict[str, Callable[[Array], Array]] = {
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin, "acos": np.arccos,
    "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh,
    "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh, "log2": np.log2,
    "log10": np.log10, "log": np.log, "ln": np.log, "exp": np.exp, "sqrt": np.sqrt,
    "sign": np.sign, "abs": np.abs, "rint": np.rint, "floor": np.floor, "ceil": np.ceil,
    "trunc": np.trunc, "round": _round_away,
    "sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)),
    "isnan": lambda v: np.isnan(v).astype(np.float64),
}
_MANY_ARGS: dict[str, Callable[..., Array]] = {
    "min": lambda *a: np.minimum.reduce(np.broadcast_arrays(*a)),
    "max": lambda *a: np.maximum.reduce(np.broadcast_arrays(*a)),
    "sum": lambda *a: np.add.reduce(np.broadcast_arrays(*a)),
}
_TWO_ARGS: dict[str, Callable[[Array, Array], Array]] = {
    "mod": np.fmod,
    "roundp": lambda v, d: _round_away(v * np.power(10.0, d)) / np.power(10.0, d),
}
_CONSTANTS = {"pi": math.pi, "e": math.e}
_BINARY = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply,
           ast.Div: np.divide, ast.Pow: np.power, ast.Mod: np.fmod}


def _compile(node: ast.AST, text: str) -> _Eval:
    """A numpy closure of one node of a parsed expression; ValueError naming what is refused."""
    if isinstance(node, ast.Expression):
        return _compile(node.body, text)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not (
            isinstance(node.value, bool)):
        value = float(node.value)
        return lambda x: np.full_like(x, value)
    if isinstance(node, ast.Name):
        if node.id == "x":
            return lambda x: x
        if node.id in _CONSTANTS:
            value = _CONSTANTS[node.id]
            return lambda x: np.full_like(x, value)
        raise ValueError(f"unknown name {node.id!r} (the variable is x)")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _compile(node.operand, text)
        if isinstance(node.op, ast.USub):
            return lambda x: -inner(x)
        return inner
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        op = _BINARY[type(node.op)]
        left, right = _compile(node.left, text), _compile(node.right, text)
        return lambda x: op(left(x), right(x))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        name, args = node.func.id, [_compile(a, text) for a in node.args]
        if name in _ONE_ARG and len(args) == 1:
            fn1, a0 = _ONE_ARG[name], args[0]
            return lambda x: fn1(a0(x))
        if name in _TWO_ARGS and len(args) == 2:
            fn2, a0, a1 = _TWO_ARGS[name], args[0], args[1]
            return lambda x: fn2(a0(x), a1(x))
        if name in _MANY_ARGS and args:
            fnn = _MANY_ARGS[name]
            return lambda x: fnn(*(a(x) for a in args))
        raise ValueError(f"unknown function {name}() with {len(args)} argument(s)")
    raise ValueError(f"{type(node).__name__} is not supported (arithmetic on x, numbers and "
                     "the generator's functions only)")


@dataclass(frozen=True)
class RawNormalizer:
    """One parsed normalizer (module docstring).

    Attributes:
        text: the setting as written.
        method: ``"log10"``, ``"zscore"``, ``"minmax"`` or ``"expression"``.
        params: the method's numbers (``threshold``, ``default``, ``mean``, ...).
    """

    text: str
    method: str
    params: tuple[tuple[str, float], ...]
    expression: _Eval | None = None

    def apply(self, values: Array) -> Array:
        """The transformed values (float64; NaN where the transform is undefined)."""
        v = np.asarray(values, dtype=np.float64)
        p = dict(self.params)
        with np.errstate(all="ignore"):
            if self.method == "log10":
                return np.where(v > p["threshold"], np.log10(np.maximum(v, 1e-300)),
                                p["default"])
            if self.method == "zscore":
                return (v - p["mean"]) / p["standard_deviation"]
            if self.method == "minmax":
                return (v - p["min"]) / (p["max"] - p["min"])
            assert self.expression is not None
            return np.asarray(self.expression(v), dtype=np.float64)


_NEEDS = {"log10": ("threshold", "default"), "zscore": ("mean", "standard_deviation"),
          "minmax": ("min", "max")}
_DEFAULTS = {"log10": {"threshold": 1e-10, "default": -10.0}}


def parse_normalizer(text: str, where: str) -> RawNormalizer:
    """Parses a ``normalizer`` setting.

    Args:
        text: e.g. ``"method=zscore,mean=0.0,standard_deviation=10.0"``.
        where: the field's path, for errors.

    Raises:
        ConfigError: an unknown method, a missing or bad number, or an expression with
            anything but the supported arithmetic and functions.
    """
    head, _, rest = text.partition(",")
    key, _, method = head.partition("=")
    method = method.strip()
    if key.strip() != "method" or method not in ("log10", "zscore", "minmax", "expression"):
        raise ConfigError(where, f"{text!r}: starts with method=log10, zscore, minmax or "
                                 "expression")
    if method == "expression":
        name, _, expr = rest.partition("=")
        if name.strip() != "expr" or not expr.strip():
            raise ConfigError(where, f"{text!r}: method=expression needs expr=<expression of x>")
        if "?" in expr:
            raise ConfigError(where, f"expression {expr.strip()!r}: conditionals (a ? b : c) are "
                                     "not supported")
        try:
            tree = ast.parse(expr.strip().replace("^", "**"), mode="eval")
            compiled = _compile(tree, expr)
        except (SyntaxError, ValueError, RecursionError) as e:
            raise ConfigError(where, f"expression {expr.strip()!r}: {e}") from None
        with np.errstate(all="ignore"):
            compiled(np.zeros(1))  # fails here, not while training, on a shape error
        return RawNormalizer(text, method, (), compiled)
    params = dict(_DEFAULTS.get(method, {}))
    for item in filter(None, (s.strip() for s in rest.split(","))):
        name, _, value = item.partition("=")
        try:
            params[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(where, f"{text!r}: {name.strip()} must be a number") from None
    missing = [n for n in _NEEDS[method] if n not in params]
    if missing:
        raise ConfigError(where, f"{text!r}: method={method} needs {', '.join(missing)}")
    if not all(math.isfinite(params[n]) for n in _NEEDS[method]):
        raise ConfigError(where, f"{text!r}: its numbers must be finite")
    if method == "zscore" and params["standard_deviation"] == 0:
        raise ConfigError(where, f"{text!r}: standard_deviation must not be 0")
    if method == "minmax" and params["max"] <= params["min"]:
        raise ConfigError(where, f"{text!r}: max must be above min")
    return RawNormalizer(text, method, tuple(sorted((n, params[n]) for n in _NEEDS[method])))
