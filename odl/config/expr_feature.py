"""EasyRec's ``ExprFeature``: one number per record computed from numeric input columns.

``feature_type: ExprFeature`` with ``input_names`` (the columns, read as numbers) and
``expression``, e.g. ``"(age_level>=item_age_level) & (age_level<=(item_age_level+5))"``.
EasyRec's reading of an expression is kept exactly:

* it is cut into operands and the operators ``( ) > >= < <= == & |``; an operand is
  arithmetic on input names and numbers (``+ - * /``, as Python groups them);
* the operators are then applied **from left to right with no precedence** (``a > b & c``
  is ``(a > b) & c``); parentheses group;
* a comparison is 1 where it holds, else 0; ``&`` / ``|`` are the logical and / or of
  nonzero values (EasyRec's tensors are booleans there); the result is the feature's number
  (EasyRec's ``numeric_column`` casts it to float).

The expression is compiled once, at validation, into numpy operations over the columns
(nothing is evaluated as Python code); an operand that is not such arithmetic, an unknown
name or unbalanced parentheses are refused by field. A division by zero gives inf / NaN,
which the feature builder rejects (``non_finite``).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from odl.config.config_error import ConfigError

__all__ = ["ExprFunction", "compile_expression"]

Columns = Mapping[str, np.ndarray]
ExprFunction = Callable[[Columns], np.ndarray]

# EasyRec's operators between operands (expr_util.py), two-character ones first
_TWO_CHAR = (">=", "<=", "==")
_CUT_CHARS = set("+-*/()><=&|")
_OPERATORS = ("(", ")", ">=", "<=", "==", ">", "<", "&", "|")
_APPLY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    ">": lambda a, b: (a > b).astype(np.float64),
    ">=": lambda a, b: (a >= b).astype(np.float64),
    "<": lambda a, b: (a < b).astype(np.float64),
    "<=": lambda a, b: (a <= b).astype(np.float64),
    "==": lambda a, b: (a == b).astype(np.float64),
    "&": lambda a, b: ((a != 0) & (b != 0)).astype(np.float64),
    "|": lambda a, b: ((a != 0) | (b != 0)).astype(np.float64),
}
_ARITHMETIC = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply,
               ast.Div: np.divide}


def _tokens(text: str) -> list[str]:
    """EasyRec's cut of an expression: operands (arithmetic joined) and operators."""
    pieces: list[str] = []
    word, ops = "", ""
    for ch in text:
        if ch in _CUT_CHARS:
            if word:
                pieces.append(word.strip())
                word = ""
            ops += ch
        else:
            word += ch
            if ops:
                pieces.extend(_split_operators(ops))
                ops = ""
    if word:
        pieces.append(word.strip())
    if ops:
        pieces.extend(_split_operators(ops))
    out = [""]
    for p in pieces:  # arithmetic between operators joins into one operand
        if p in _OPERATORS:
            out.append(p)
        elif out[-1] not in _OPERATORS:
            out[-1] += p
        else:
            out.append(p)
    return [p for p in out if p]


def _split_operators(run: str) -> list[str]:
    out, i = [], 0
    while i < len(run):
        if run[i : i + 2] in _TWO_CHAR:
            out.append(run[i : i + 2])
            i += 2
        else:
            out.append(run[i])
            i += 1
    return out


def _operand(text: str, names: set[str], where: str) -> ExprFunction:
    """An operand's arithmetic as a numpy closure over the columns."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ConfigError(where, f"{text!r} is not arithmetic on input names and numbers") \
            from None

    def build(node: ast.AST) -> ExprFunction:
        if isinstance(node, ast.Expression):
            return build(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not (
                isinstance(node.value, bool)):
            value = float(node.value)
            return lambda cols: np.float64(value)
        if isinstance(node, ast.Name):
            if node.id not in names:
                raise ConfigError(where, f"{node.id!r} is not one of input_names "
                                         f"{sorted(names)}")
            name = node.id
            return lambda cols: cols[name]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = build(node.operand)
            if isinstance(node.op, ast.USub):
                return lambda cols: -inner(cols)
            return inner
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            op = _ARITHMETIC[type(node.op)]
            left, right = build(node.left), build(node.right)
            return lambda cols: op(left(cols), right(cols))
        raise ConfigError(where, f"{text!r}: only + - * / on input names and numbers")

    return build(tree)


def _apply(op: str, left: ExprFunction, right: ExprFunction) -> ExprFunction:
    fn = _APPLY[op]
    return lambda cols: fn(left(cols), right(cols))


def compile_expression(text: str, input_names: Sequence[str], where: str) -> ExprFunction:
    """An ExprFeature's expression as a function of its columns (module docstring).

    Args:
        text: the expression.
        input_names: the names it may read.
        where: the config field, for errors.

    Returns:
        ``f(columns) -> values``: ``columns`` maps each input name to its float64 values;
        the result is float64, broadcast to the records' count by the caller.

    Raises:
        ConfigError: an empty or malformed expression, or an unknown name.
    """
    names = set(input_names)
    tokens = _tokens(text)
    if not tokens:
        raise ConfigError(where, "an ExprFeature needs an expression")
    # EasyRec's evaluation (expr_util._expression_eval): one stack holding both pending
    # left operands and the operators before each "(", applied left to right
    stack: list[object] = []
    sign = ""
    operand: ExprFunction | None = None

    def solve(value: ExprFunction | None, op: str) -> ExprFunction | None:
        if not stack or value is None or not op:
            return value
        left = stack.pop()
        if not callable(left):
            raise ConfigError(where, f"{text!r}: an operator without a left operand")
        return _apply(op, left, value)

    try:
        for tok in tokens:
            if tok not in _OPERATORS:
                if operand is not None:
                    raise ConfigError(where, f"{text!r}: two operands without an operator")
                operand = _operand(tok, names, where)
            elif tok == "(":
                stack.append(sign)
                sign = ""
            else:
                result = solve(operand, sign)
                operand = None
                if tok == ")":
                    sign = stack.pop()  # type: ignore[assignment]
                    if not isinstance(sign, str):
                        raise ConfigError(where, f"{text!r}: unbalanced parentheses")
                    operand = solve(result, sign)
                    sign = ""
                else:
                    if result is None:
                        raise ConfigError(where, f"{text!r}: {tok} without a left operand")
                    sign = tok
                    stack.append(result)
        final = solve(operand, sign)
    except IndexError:
        raise ConfigError(where, f"{text!r}: unbalanced parentheses") from None
    if final is None or stack:
        raise ConfigError(where, f"{text!r}: incomplete expression")
    return final
