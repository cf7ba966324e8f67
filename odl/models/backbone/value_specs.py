"""What flows between a backbone's blocks: one tensor or a (nested) list of tensors.

EasyRec's blocks pass TensorFlow values that are a tensor, or a list / tuple of values (an
input layer's ``[tensor, feature list]``, a list of per-feature vectors). odl fixes their
structure when the model is built, so the scripted network only ever moves a flat
``List[Tensor]``:

* a :data:`Spec` describes a value: a :class:`TensorSpec` (the shape without the batch
  dimension) or a Python ``list`` of specs;
* at run time a value is the list of its leaves, the tensors in depth-first order
  (:func:`leaves`); a single tensor is a list of one.

Every backbone layer is an ``nn.Module`` whose ``forward(xs: List[Tensor]) -> List[Tensor]``
takes the leaves of its input spec and returns the leaves of its output spec; indexing,
slicing and list building (``x[1]``, ``[x, x]``) are resolved to leaf positions when the
model is built and cost nothing at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: its shape without the batch dimension (``(16,)`` is ``[B, 16]``)."""

    shape: tuple[int, ...]

    @property
    def rank(self) -> int:
        """Dimensions including the batch one (``[B, 16]``: 2)."""
        return len(self.shape) + 1

    def __str__(self) -> str:
        return "[B" + "".join(f", {d}" for d in self.shape) + "]"


Spec = Union[TensorSpec, list]  # a list holds Specs


def tensor(*shape: int) -> TensorSpec:
    """A tensor spec from its dimensions after the batch one."""
    return TensorSpec(tuple(int(d) for d in shape))


def is_list(spec: Spec) -> bool:
    """The value is a list (of tensors or lists)."""
    return isinstance(spec, list)


def leaves(spec: Spec) -> list[TensorSpec]:
    """The tensors of a value in depth-first order (its run-time representation)."""
    if isinstance(spec, TensorSpec):
        return [spec]
    return [leaf for item in spec for leaf in leaves(item)]


def leaf_count(spec: Spec) -> int:
    """Tensors in a value."""
    return len(leaves(spec))


def item_offsets(spec: list) -> list[int]:
    """A list value's first leaf of each item, then its leaf count.

    Item ``i``'s leaves are ``offsets[i]:offsets[i + 1]``.
    """
    out = [0]
    for item in spec:
        out.append(out[-1] + leaf_count(item))
    return out


def flat_tensors(spec: Spec) -> list[TensorSpec] | None:
    """A list of tensors' specs (not nested), or ``None`` when the value is not one."""
    if isinstance(spec, list) and all(isinstance(s, TensorSpec) for s in spec):
        return list(spec)
    return None


def describe(spec: Spec) -> str:
    """The spec as a user reads it in an error: ``[B, 16]`` or ``list of 3: [[B, 8], ...]``."""
    if isinstance(spec, TensorSpec):
        return str(spec)
    shown = ", ".join(describe(s) for s in spec[:4])
    more = ", ..." if len(spec) > 4 else ""
    return f"list of {len(spec)}: [{shown}{more}]"
