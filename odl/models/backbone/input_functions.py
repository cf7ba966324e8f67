"""The lambdas of a backbone config, read as data: a safe subset, never evaluated as Python.

EasyRec's backbone transforms values with Python lambdas it ``eval``s (``input_fn``,
``extra_input_fn``, a ``lambda`` layer's ``expression``, ``input_slice`` as
``lambda x: x<slice>``). odl parses them with :mod:`ast` and accepts this subset only::

    lambda x: <expr>
    <expr> :=  x
            |  <expr>[i]            |  <expr>[i:j]        (items of a list)
            |  [<expr>, ...]        |  (<expr>, ...)      (a list of values)
            |  tf.add_n(<expr>)                           (sum of a list of tensors)
            |  tf.stack(<expr>, axis=k)   |  tf.concat(<expr>, axis=k)
            |  tf.unstack(<expr>, axis=k) |  tf.reshape(<expr>, [-1, d, ...])
            |  tf.reduce_sum / reduce_mean / reduce_max(<expr>, axis=k, keepdims=b)
            |  tf.squeeze(<expr>, axis=k) |  tf.expand_dims(<expr>, axis=k)
            |  tf.identity(<expr>)

``axis`` counts the batch dimension (``axis=1`` is the first after it; negative counts from
the end; the batch axis itself is refused). Anything else is refused with the expression
and what odl reads, so no code from a config ever runs.

A parsed function is built against its input's spec (``odl.models.backbone.value_specs``)
into a scriptable module over the input's leaves; indexing and list building become leaf
positions (:class:`PickLeaves`), which cost nothing at run time.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import ast

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.models.backbone.value_specs import (
    Spec,
    TensorSpec,
    flat_tensors,
    is_list,
    item_offsets,
    leaf_count,
    tensor,
)

REDUCTIONS = {"reduce_sum": "sum", "reduce_mean": "mean", "reduce_max": "max"}
CALLS = ("add_n", "stack", "concat", "unstack", "reshape", "squeeze", "expand_dims",
         "identity", *REDUCTIONS)


class PickLeaves(nn.Module):
    """The leaves at ``index`` (a structural step: indexing, slicing, list building)."""

    index: list[int]

    def __init__(self, index: list[int]) -> None:
        super().__init__()
        self.index = [int(i) for i in index]

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[xs[i] for i in index]``."""
        return [xs[i] for i in self.index]


class TensorOp(nn.Module):
    """One tensor function over the leaves its ``source`` makes (module docstring's calls).

    Args:
        source: the module making the call's argument from the function's input.
        op: the call's name.
        dim: its axis (batch included).
        keepdim: ``keepdims`` of a reduction.
        shape: ``reshape``'s target, the batch dimension first (-1).
        count: ``unstack``'s number of outputs.
    """

    __constants__ = ["op", "dim", "keepdim", "count"]
    shape: list[int]

    def __init__(self, source: nn.Module, op: str, dim: int = 0, keepdim: bool = False,
                 shape: tuple[int, ...] = (), count: int = 0) -> None:
        super().__init__()
        self.source = source
        self.op = op
        self.dim = int(dim)
        self.keepdim = bool(keepdim)
        self.shape = [int(d) for d in shape]
        self.count = int(count)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The call's output leaves."""
        ys = self.source(xs)
        op = self.op
        if op == "add_n":
            out = ys[0]
            for y in ys[1:]:
                out = out + y
            return [out]
        if op == "stack":
            return [torch.stack(ys, dim=self.dim)]
        if op == "concat":
            return [torch.cat(ys, dim=self.dim)]
        x = ys[0]
        if op == "unstack":
            return list(torch.unbind(x, dim=self.dim))
        if op == "reshape":
            return [x.reshape([x.shape[0]] + self.shape[1:])]
        if op == "squeeze":
            return [x.squeeze(self.dim)]
        if op == "expand_dims":
            return [x.unsqueeze(self.dim)]
        if op == "sum":
            return [x.sum(dim=self.dim, keepdim=self.keepdim)]
        if op == "mean":
            return [x.mean(dim=self.dim, keepdim=self.keepdim)]
        if op == "max":
            return [x.amax(dim=self.dim, keepdim=self.keepdim)]
        return [x]  # identity


class ListOf(nn.Module):
    """A list of values each made by its own module (list building over tensor calls)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parts' leaves, in order."""
        out: list[torch.Tensor] = []
        for part in self.parts:
            out.extend(part(xs))
        return out


class Lambda:
    """A parsed lambda (:func:`parse_lambda`), built per input spec with :meth:`build`."""

    def __init__(self, text: str, where: str, body: ast.expr, arg: str) -> None:
        self.text = text
        self.where = where
        self._body = body
        self._arg = arg

    def build(self, spec: Spec) -> tuple[nn.Module, Spec]:
        """The module over ``spec``'s leaves and its output spec.

        Raises:
            ConfigError: the expression does not fit its input (an index past a list's end,
                a tensor call over a list, ...).
        """
        module, out = _Builder(self, spec).value(self._body)
        return module.finish(), out


def parse_lambda(text: str, where: str) -> Lambda:
    """Parses ``lambda x: ...`` (the module docstring's subset).

    Raises:
        ConfigError: not a one-argument lambda, or outside the subset.
    """
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ConfigError(where, f"{text!r} is not a Python lambda: {e.msg}") from e
    fn = tree.body
    if (not isinstance(fn, ast.Lambda) or len(fn.args.args) != 1 or fn.args.vararg
            or fn.args.kwarg or fn.args.kwonlyargs or fn.args.defaults):
        raise ConfigError(where, f"{text!r} must be a lambda of one argument (lambda x: ...)")
    return Lambda(text, where, fn.body, fn.args.args[0].arg)


def parse_slice(text: str, where: str) -> Lambda:
    """An ``input_slice`` such as ``[1]`` or ``[0:2]``: ``lambda x: x<slice>`` (EasyRec's)."""
    return parse_lambda("lambda x: x" + text.strip(), where)


class _Value:
    """A sub-expression while building: leaf positions of the input (structural) or a module."""

    def __init__(self, index: list[int] | None = None, module: nn.Module | None = None) -> None:
        self.index = index
        self.module = module

    def finish(self) -> nn.Module:
        return self.module if self.module is not None else PickLeaves(self.index or [])


class _Builder:
    def __init__(self, fn: Lambda, spec: Spec) -> None:
        self.fn = fn
        self.spec = spec

    def refuse(self, node: ast.AST, message: str) -> ConfigError:
        shown = ast.unparse(node) if isinstance(node, ast.AST) else str(node)
        return ConfigError(self.fn.where, f"{self.fn.text!r}: {message} (at {shown!r}); odl "
                                          "reads the lambda subset of docs/config.md")

    def value(self, node: ast.expr) -> tuple[_Value, Spec]:
        if isinstance(node, ast.Name):
            if node.id != self.fn._arg:
                raise self.refuse(node, f"unknown name {node.id!r}")
            return _Value(list(range(leaf_count(self.spec)))), self.spec
        if isinstance(node, ast.Subscript):
            return self.subscript(node)
        if isinstance(node, (ast.List, ast.Tuple)):
            parts = [self.value(e) for e in node.elts]
            specs = [s for _v, s in parts]
            if all(v.index is not None for v, _s in parts):
                return _Value([i for v, _s in parts for i in v.index]), specs
            return _Value(module=ListOf([v.finish() for v, _s in parts])), specs
        if isinstance(node, ast.Call):
            return self.call(node)
        raise self.refuse(node, "not in the subset")

    def subscript(self, node: ast.Subscript) -> tuple[_Value, Spec]:
        inner, spec = self.value(node.value)
        if not is_list(spec):
            raise self.refuse(node, f"indexes a tensor {spec}; odl indexes lists only")
        offsets = item_offsets(spec)
        n = len(spec)
        sl = node.slice
        if isinstance(sl, ast.Slice):
            if sl.step is not None:
                raise self.refuse(node, "a slice with a step")
            lo = self.integer(sl.lower) if sl.lower is not None else None
            hi = self.integer(sl.upper) if sl.upper is not None else None
            items = list(range(n))[lo:hi]
            out_spec: Spec = [spec[i] for i in items]
        else:
            i = self.integer(sl)
            if not -n <= i < n:
                raise self.refuse(node, f"index {i} of a list of {n}")
            items = [i % n]
            out_spec = spec[i % n]
        positions = [p for i in items for p in range(offsets[i], offsets[i + 1])]
        if inner.index is not None:
            return _Value([inner.index[p] for p in positions]), out_spec
        return _Value(module=_Then(inner.finish(), positions)), out_spec

    def integer(self, node: ast.expr) -> int:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.integer(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return int(node.value)
        raise self.refuse(node, "expected a whole number")

    def boolean(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, bool):
            return bool(node.value)
        raise self.refuse(node, "expected True or False")

    def call(self, node: ast.Call) -> tuple[_Value, Spec]:
        f = node.func
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                and f.value.id == "tf" and f.attr in CALLS):
            raise self.refuse(node, f"the call is not one of tf.{', tf.'.join(CALLS)}")
        name = f.attr
        if not node.args:
            raise self.refuse(node, "missing the argument")
        source, spec = self.value(node.args[0])
        kwargs = {k.arg: k.value for k in node.keywords}
        if len(node.args) > 2 or None in kwargs:
            raise self.refuse(node, "unexpected arguments")
        second = node.args[1] if len(node.args) == 2 else None
        keyword = "shape" if name == "reshape" else "axis"
        if second is not None:
            if keyword in kwargs:
                raise self.refuse(node, f"{keyword} given twice")
            kwargs[keyword] = second
        allowed = {"add_n": set(), "identity": set(), "reshape": {"shape"},
                   **{r: {"axis", "keepdims"} for r in REDUCTIONS}}.get(name, {"axis"})
        extra = set(kwargs) - allowed - {"name"}
        if extra:
            raise self.refuse(node, f"tf.{name} with {', '.join(sorted(extra))}")
        src = source.finish()
        if name in ("add_n", "stack", "concat"):
            items = flat_tensors(spec)
            if not items:
                raise self.refuse(node, f"tf.{name} needs a list of tensors, got {spec}")
            if name == "add_n":
                if len(set(items)) != 1:
                    raise self.refuse(node, "tf.add_n over tensors of different shapes")
                return _Value(module=TensorOp(src, "add_n")), items[0]
            rank = items[0].rank + (1 if name == "stack" else 0)
            dim = self.axis(node, kwargs.get("axis"), rank, default=0)
            if name == "stack":
                if len(set(items)) != 1:
                    raise self.refuse(node, "tf.stack over tensors of different shapes")
                shape = list(items[0].shape)
                shape.insert(dim - 1, len(items))
                return _Value(module=TensorOp(src, "stack", dim)), tensor(*shape)
            rest = {s.shape[: dim - 1] + s.shape[dim:] for s in items}
            if len(rest) != 1 or len({s.rank for s in items}) != 1:
                raise self.refuse(node, "tf.concat over tensors that differ off its axis")
            shape = list(items[0].shape)
            shape[dim - 1] = sum(s.shape[dim - 1] for s in items)
            return _Value(module=TensorOp(src, "concat", dim)), tensor(*shape)
        if not isinstance(spec, TensorSpec):
            raise self.refuse(node, f"tf.{name} needs a tensor, got a list")
        if name == "identity":
            return _Value(module=TensorOp(src, "identity")), spec
        if name == "reshape":
            return self.reshape(node, src, spec, kwargs.get("shape"))
        if name == "expand_dims":
            dim = self.axis(node, kwargs.get("axis"), spec.rank + 1)
            shape = list(spec.shape)
            shape.insert(dim - 1, 1)
            return _Value(module=TensorOp(src, "expand_dims", dim)), tensor(*shape)
        dim = self.axis(node, kwargs.get("axis"), spec.rank)
        shape = list(spec.shape)
        if name == "unstack":
            n = shape.pop(dim - 1)
            return (_Value(module=TensorOp(src, "unstack", dim, count=n)),
                    [tensor(*shape)] * n)
        if name == "squeeze":
            if shape[dim - 1] != 1:
                raise self.refuse(node, f"tf.squeeze of an axis of {shape[dim - 1]}")
            shape.pop(dim - 1)
            return _Value(module=TensorOp(src, "squeeze", dim)), tensor(*shape)
        keep = self.boolean(kwargs["keepdims"]) if "keepdims" in kwargs else False
        if keep:
            shape[dim - 1] = 1
        else:
            shape.pop(dim - 1)
        return _Value(module=TensorOp(src, REDUCTIONS[name], dim, keep)), tensor(*shape)

    def axis(self, node: ast.AST, value: ast.expr | None, rank: int, default: int | None = None
             ) -> int:
        if value is None:
            if default is None:
                raise self.refuse(node, "needs axis")
            raise self.refuse(node, "axis 0 is the batch axis: odl refuses it")
        a = self.integer(value)
        if not -rank <= a < rank:
            raise self.refuse(node, f"axis {a} of a tensor of {rank} dimensions")
        a %= rank
        if a == 0:
            raise self.refuse(node, "axis 0 is the batch axis: odl refuses it")
        return a

    def reshape(self, node: ast.AST, src: nn.Module, spec: TensorSpec,
                shape_node: ast.expr | None) -> tuple[_Value, Spec]:
        if not isinstance(shape_node, (ast.List, ast.Tuple)) or not shape_node.elts:
            raise self.refuse(node, "tf.reshape needs a shape list")
        dims = [self.integer(e) for e in shape_node.elts]
        if dims[0] != -1 or any(d <= 0 for d in dims[1:]):
            raise self.refuse(node, "tf.reshape's shape must be [-1, d1, ...] (the batch "
                                    "first, the other dimensions given)")
        size = 1
        for d in spec.shape:
            size *= d
        target = 1
        for d in dims[1:]:
            target *= d
        if size != target:
            raise self.refuse(node, f"tf.reshape of {spec} to {dims}: {size} values per "
                                    f"sample, not {target}")
        return _Value(module=TensorOp(src, "reshape", shape=tuple(dims))), tensor(*dims[1:])


class _Then(nn.Module):
    """A module's output leaves, then the leaves at ``index`` of them."""

    index: list[int]

    def __init__(self, inner: nn.Module, index: list[int]) -> None:
        super().__init__()
        self.inner = inner
        self.index = [int(i) for i in index]

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``inner(xs)`` picked at ``index``."""
        ys = self.inner(xs)
        return [ys[i] for i in self.index]
