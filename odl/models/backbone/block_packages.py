"""EasyRec's block packages: sub-DAGs of a backbone's blocks that blocks call.

An input ``package_name: P`` of a block runs P's blocks anew and reads P's output: its
``output_blocks``' values as a list, else its ``concat_blocks``' merged, by default the
blocks no block of P reads (auxiliary losses aside). Every call of P shares P's layers (one
set of weights: the calls' nodes hold the same modules, so a parameter has one name, the
first call's); dropout and augmentation draw anew per call. Inside P a block may read P's
blocks, the backbone's blocks (which then run before the calling block), feature groups
(P's own input layers) and, with ``use_package_input``, the value the caller passed as
``package_input`` (a block of the caller's scope, or another package, called anew), after
``package_input_fn``. A call's ``reset_input`` replaces the settings of P's input layers for
that call and, as in EasyRec, for P's later calls in the build order; the reset layers keep
the first build's weights (sequence combiners, raw projections, normalizations), and a reset
that changes the normalization or the output form is refused (EasyRec's would build new
weights). A package calling itself, directly or through others, is refused.

:class:`PackageCalls` is the part of ``odl.models.backbone.backbone_graph.GraphBuilder``
that builds the calls; :class:`BlockScope` is where a block's input names resolve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from odl.config.config_error import ConfigError
from odl.models.backbone.graph_modules import BlockNode, Chain, GroupRead, ReadInput
from odl.models.backbone.input_functions import PickLeaves, parse_lambda
from odl.models.backbone.input_layers import GroupInput
from odl.models.backbone.value_specs import Spec, leaf_count
from odl.protos import pipeline_pb2

AUXILIARY_LOSS = "AuxiliaryLoss"


@dataclass
class GraphValue:
    """A computed value: its first register and spec."""

    start: int
    spec: Spec

    @property
    def index(self) -> list[int]:
        """The registers of its leaves."""
        return list(range(self.start, self.start + leaf_count(self.spec)))


@dataclass
class BlockScope:
    """Where a block's input names resolve: the backbone's blocks, or one package call's.

    Attributes:
        blocks: the blocks by name, with their index in the config.
        values: the values built so far in this scope, by block (or group) name.
        where: the config path holding ``blocks``.
        package: the package's name ("" for the backbone).
        package_input: what ``use_package_input`` reads in this call.
        settings: the input layers' settings in force (a ``reset_input``), or None.
    """

    blocks: dict[str, tuple[int, pipeline_pb2.BackboneBlock]]
    values: dict[str, GraphValue]
    where: str
    package: str = ""
    package_input: GraphValue | None = None
    settings: pipeline_pb2.BackboneInputLayer | None = None


def is_auxiliary_loss(b: pipeline_pb2.BackboneBlock) -> bool:
    """The block is an ``AuxiliaryLoss`` (its output is a loss, not a value to read)."""
    return b.WhichOneof("layer") == "keras_layer" and b.keras_layer.class_name == AUXILIARY_LOSS


class PackageCalls:
    """Builds package calls (module docstring).

    A mixin of ``GraphBuilder``, whose state and DAG methods it uses (``_packages``,
    ``_outer``, ``_reset``, ``_calling``, ``_shared_inputs``, ``_add``, ``_block``,
    ``_dependencies``, ...).
    """

    def _package_dependencies(self, scope: BlockScope, name: str, inp: Any, where: str
                              ) -> list[str]:
        """What a call of package ``name`` from ``scope`` runs after.

        In the backbone, the backbone blocks the package reads; in a package, its
        ``package_input`` block.
        """
        if name not in self._packages:
            raise ConfigError(where, f"no package {name!r}")
        out: list[str] = []
        if inp.package_input:
            q = inp.package_input
            if q in scope.blocks:
                out.append(q)
            elif q in self._packages:
                out += self._package_dependencies(scope, q, pipeline_pb2.BackboneInput(),
                                                  where.rsplit(".", 1)[0] + ".package_input")
            else:
                raise ConfigError(where.rsplit(".", 1)[0] + ".package_input",
                                  f"{q!r} is neither a block nor a package")
        if not scope.package:
            out += sorted(self._backbone_reads(name, []))
        return out

    def _backbone_reads(self, name: str, stack: list[str]) -> set[str]:
        """The backbone blocks package ``name``'s blocks (and the packages they call) read."""
        k, pkg = self._packages[name]
        if name in stack:
            raise ConfigError(f"{self.where}.packages[{k}]",
                              "packages call each other in a cycle: "
                              + " -> ".join(stack + [name]))
        own = {b.name for b in pkg.blocks}
        assert self._outer is not None
        out: set[str] = set()
        for b in pkg.blocks:
            for inp in b.inputs:
                kind = inp.WhichOneof("name")
                if kind in ("block_name", "feature_group_name"):
                    n = getattr(inp, kind)
                    if n not in own and n in self._outer.blocks:
                        out.add(n)
                elif kind == "package_name" and inp.package_name in self._packages:
                    out |= self._backbone_reads(inp.package_name, stack + [name])
                if inp.package_input:
                    q = inp.package_input
                    if q in self._packages:
                        out |= self._backbone_reads(q, stack + [name])
                    elif q not in own and q in self._outer.blocks:
                        out.add(q)
        return out

    def _call_package(self, caller: BlockScope, inp: Any, at: str) -> GraphValue:
        """One call of a package: its blocks' nodes appended; its output's value."""
        name = inp.package_name
        k, pkg = self._packages[name]
        where = f"{self.where}.packages[{k}]"
        if name in self._calling:
            raise ConfigError(f"{at}.package_name", "packages call each other in a cycle: "
                              + " -> ".join(self._calling + [name]))
        package_input = None
        if inp.package_input:
            q = inp.package_input
            if q in caller.blocks:
                package_input = caller.values[q]
            else:
                package_input = self._call_package(
                    caller, pipeline_pb2.BackboneInput(package_name=q), f"{at}.package_input")
            if inp.package_input_fn:
                fn, spec = parse_lambda(inp.package_input_fn, f"{at}.package_input_fn"
                                        ).build(package_input.spec)
                n = leaf_count(spec)
                package_input = self._add((BlockNode(
                    [ReadInput(package_input.index, Chain([fn]))], PickLeaves(list(range(n))),
                    Chain([]), n), spec))
        if inp.HasField("reset_input"):  # EasyRec keeps the reset for the later calls
            self._reset[name] = inp.reset_input
        blocks = self._index_blocks(pkg.blocks, where)
        if not blocks:
            raise ConfigError(f"{where}.blocks", f"package {name!r} has no blocks")
        scope = BlockScope(blocks, {}, where, name, package_input, self._reset.get(name))
        deps = {n: self._dependencies(scope, i, b) for n, (i, b) in blocks.items()}
        local = {n: [d for d in ds if d in blocks] for n, ds in deps.items()}
        order = self._topological(set(blocks), local, blocks, where)
        outputs, output_field = self._outputs(pkg, blocks, local, where)
        aux = [n for n, (_i, b) in blocks.items() if is_auxiliary_loss(b)]
        needed = self._needed(outputs + aux, local)
        self._calling.append(name)
        try:
            for n in order:
                if n in needed:
                    i, b = blocks[n]
                    scope.values[n] = self._add(self._block(scope, i, b), b)
        finally:
            self._calling.pop()
        where_out = f"{where}.{output_field}"
        values = [scope.values[n] for n in outputs]
        for n, v in zip(outputs, values, strict=True):
            self._check_not_aux(v, where_out, n)
        if len(values) == 1 and output_field == "concat_blocks":
            return values[0]
        specs = [v.spec for v in values]
        merge, spec = self.merge(output_field == "output_blocks", -1, specs, where_out)
        reads = [ReadInput(v.index, Chain([])) for v in values]
        return self._add((BlockNode(reads, Chain([merge]), Chain([]), leaf_count(spec)), spec))

    def _package_input_layer(self, scope: BlockScope, group: str,
                             b: pipeline_pb2.BackboneBlock | None, where: str
                             ) -> tuple[nn.Module, Spec]:
        """A package's input layer over ``group`` in this call, with its first build's weights.

        A ``reset_input`` in force replaces its settings.
        """
        if group not in self.groups:
            raise ConfigError(where, f"no feature group {group!r}")
        settings = scope.settings if scope.settings is not None else (
            b.input_layer if b is not None else pipeline_pb2.BackboneInputLayer())
        key = (scope.package, b.name if b is not None else group)
        wire = settings.SerializeToString(deterministic=True)
        first = self._shared_inputs.get(key)
        if first is None:
            layer = self.group_input(group, settings, where)
            self._shared_inputs[key] = (wire, layer)
        elif first[0] == wire:
            layer = first[1]
        else:
            layer = self._input_variant(first[1], self.group_input(group, settings, where),
                                        where)
        node = BlockNode([ReadInput([0, 1], Chain([]))], Chain([]), GroupRead(layer),
                         leaf_count(layer.spec))
        return node, layer.spec

    @staticmethod
    def _input_variant(first: nn.Module, variant: nn.Module, where: str) -> nn.Module:
        """``variant`` (other settings over the same group) with ``first``'s weights."""
        if not (isinstance(first, GroupInput) and isinstance(variant, GroupInput)):
            raise ConfigError(where, "a reset_input of a sequence input layer is not "
                                     "implemented")
        if first.norm != variant.norm or first.list_out != variant.list_out:
            raise ConfigError(where, "a reset_input that changes the input layer's "
                                     "normalization or output form is not implemented")
        variant.readers = first.readers
        variant.norm_all = first.norm_all
        variant.norm_each = first.norm_each
        return variant
