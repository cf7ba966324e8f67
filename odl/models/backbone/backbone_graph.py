"""The backbone's DAG of blocks as one scriptable dense module (EasyRec's ``Backbone``).

Built once per model from ``model_config.backbone`` (the contract of each block's parts is
EasyRec's, docs/config.md "backbone"):

* A block reads its ``inputs`` (feature groups, other blocks, package calls), each through
  its ``input_slice`` then its ``input_fn`` (``odl.models.backbone.input_functions``); an
  ``ignore_input`` input only orders the DAG. Several inputs are merged, then the block's
  layer runs (``odl.models.backbone.layer_builder``): an ``input_layer``
  (``odl.models.backbone.input_layers``), a ``keras_layer``, a ``lambda``, a ``recurrent``
  or ``repeat`` layer, or ``layers`` in sequence; no layer passes the input on.
* An input's name is a block's when a block has it, else a feature group's; a group read
  this way is read by a default input layer (the concatenated tensor).
* ``packages`` are sub-DAGs of blocks that a block's input calls by ``package_name``, every
  call with the package's weights (``odl.models.backbone.block_packages``).
* An ``AuxiliaryLoss`` block (``odl.models.backbone.contrastive_layers``) adds its loss to
  the training loss; it runs even when no output depends on it, other blocks may read it
  only with ``ignore_input``.
* The output: ``output_blocks``' outputs, or ``concat_blocks``' merged as inputs are (default:
  the blocks no block reads), concatenated, through ``top_mlp``; then a Linear layer to
  ``num_class`` logits unless the last dimension is ``num_class`` already (EasyRec's
  RankModel).

Other blocks no output depends on are not built; blocks only the auxiliary losses read
(through ``ignore_input`` or not) do not run at prediction time. At run time the blocks'
values live in one flat list of tensors, the registers (``odl.models.backbone.value_specs``):
``pooled`` and ``dense``, then each block's output's leaves, and each read is a fixed list of
positions, so the DAG costs no bookkeeping (the modules: ``odl.models.backbone.graph_modules``).
:meth:`GraphBuilder.build_graph` gives the graph and its output for a model to put its head
on; :meth:`GraphBuilder.build` is RankModel's.

Refused by field: ``raw_input`` and ``embedding_layer`` blocks, a ``repeat`` layer's own
``input_slice`` / ``input_fn``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from odl.config.config_error import ConfigError
from odl.models.backbone.block_packages import (
    AUXILIARY_LOSS,
    BlockScope,
    GraphValue,
    PackageCalls,
    is_auxiliary_loss,
)
from odl.models.backbone.dense_layers import build_easyrec_mlp, keras_dense
from odl.models.backbone.graph_modules import (
    BackboneDense,
    BackboneGraph,
    BlockNode,
    Chain,
    ReadInput,
)
from odl.models.backbone.input_functions import PickLeaves, parse_lambda, parse_slice
from odl.models.backbone.layer_builder import LayerBuilder
from odl.models.backbone.value_specs import (
    Spec,
    TensorSpec,
    describe,
    flat_tensors,
    leaf_count,
)
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

# registers 0 and 1 hold the graph's inputs, ``pooled`` and ``dense``
_FIRST_REGISTER = 2


@dataclass(frozen=True)
class BuiltGraph:
    """A built backbone: the graph, the output's registers and spec.

    Attributes:
        graph: the blocks.
        index: the output's registers (its leaves).
        spec: the output's spec (``concat_blocks`` / ``output_blocks`` merged).
        where: the config path of the output's blocks, for errors.
    """

    graph: BackboneGraph
    index: list[int]
    spec: Spec
    where: str

    def concatenated(self, backbone: pipeline_pb2.BackboneTower
                     ) -> tuple[list[int], nn.Module, int]:
        """The output's tensors concatenated, through ``top_mlp``.

        Returns:
            ``(registers, top module (identity without top_mlp), width)``.

        Raises:
            ConfigError: tensors that are not ``[B, d]``, a bad ``top_mlp``.
        """
        tensors = [self.spec] if isinstance(self.spec, TensorSpec) else flat_tensors(self.spec)
        if not tensors or any(len(t.shape) != 1 for t in tensors):
            raise ConfigError(self.where, f"the output must be [B, width] tensors, got "
                                          f"{describe(self.spec)}")
        width = sum(t.shape[-1] for t in tensors)
        top: nn.Module = nn.Identity()
        if backbone.HasField("top_mlp"):
            try:
                top, width = build_easyrec_mlp(width, backbone.top_mlp)
            except ValueError as e:
                raise ConfigError("model_config.backbone.top_mlp", str(e)) from e
        return self.index, top, width


@dataclass
class GraphBuilder(PackageCalls, LayerBuilder):
    """Builds :class:`BackboneDense` from a backbone config.

    Attributes:
        backbone: ``model_config.backbone``.
        group_input: ``(group name, InputLayer settings, config path) -> GroupInput``.
        groups: the feature group names.
        num_class: the model's outputs.
    """

    backbone: pipeline_pb2.BackboneTower
    group_input: Any
    groups: set[str]
    num_class: int
    where: str = "model_config.backbone"
    # RankModel's wide_to_logit: the first pooled column of the wide lookups (-1: off)
    wide_start: int = -1
    _registers: int = _FIRST_REGISTER
    _nodes: list[nn.Module] = field(default_factory=list)
    _ranges: list[tuple[int, int]] = field(default_factory=list)
    _outer: BlockScope | None = None
    _packages: dict[str, tuple[int, pipeline_pb2.BackboneBlockPackage]] = field(
        default_factory=dict)
    _calling: list[str] = field(default_factory=list)
    _reset: dict[str, pipeline_pb2.BackboneInputLayer] = field(default_factory=dict)
    # a package block's layers, shared by its calls: (input specs, merge, layers, spec)
    _shared: dict[tuple[str, str], tuple[list[Spec], nn.Module, nn.Module, Spec]] = field(
        default_factory=dict)
    # a package input layer's first build: (settings, module)
    _shared_inputs: dict[tuple[str, str], tuple[bytes, nn.Module]] = field(
        default_factory=dict)
    _aux: list[int] = field(default_factory=list)

    def build_graph(self) -> BuiltGraph:
        """The blocks and the output's registers.

        Raises:
            ConfigError: by field, for anything the module docstring refuses or a layer
                cannot take.
        """
        bb, where = self.backbone, self.where
        for k, pkg in enumerate(bb.packages):
            if not pkg.name:
                raise ConfigError(f"{where}.packages[{k}].name", "every package needs a name")
            if pkg.name in self._packages:
                raise ConfigError(f"{where}.packages[{k}].name",
                                  f"package {pkg.name!r} is defined twice")
            self._packages[pkg.name] = (k, pkg)
        if not bb.blocks:
            raise ConfigError(f"{where}.blocks", "the backbone needs at least one block")
        blocks = self._index_blocks(bb.blocks, where)
        scope = self._outer = BlockScope(blocks, {}, where)
        deps = {name: self._dependencies(scope, i, b) for name, (i, b) in blocks.items()}
        everything = self._topological(set(blocks) | {d for ds in deps.values() for d in ds},
                                       deps, blocks, where)
        outputs, output_field = self._outputs(bb, blocks, deps, where)
        aux = [n for n, (_i, b) in blocks.items() if is_auxiliary_loss(b)]
        needed = self._needed(outputs + aux, deps)
        order = [n for n in everything if n in needed]
        inputs: list[nn.Module] = []
        for name in order:  # input layers first: they read nothing
            i, b = blocks[name] if name in blocks else (-1, None)
            if b is None or b.WhichOneof("layer") == "input_layer":
                settings = (b.input_layer if b is not None
                            else pipeline_pb2.BackboneInputLayer())
                group = b.inputs[0].feature_group_name if b is not None else name
                layer = self.group_input(group, settings,
                                         f"{where}.blocks[{i}].input_layer" if b is not None
                                         else f"{where} (feature group {name!r})")
                inputs.append(layer)
                scope.values[name] = GraphValue(self._registers, layer.spec)
                self._registers += leaf_count(layer.spec)
        for name in order:
            if name not in scope.values:
                i, b = blocks[name]
                scope.values[name] = self._add(self._block(scope, i, b), b)
        where_out = f"{where}.{output_field}"
        for n in outputs:
            self._check_not_aux(scope.values[n], where_out, n)
        out_spec = self.merge_specs([scope.values[n].spec for n in outputs], -1, where_out)
        index = [r for n in outputs for r in scope.values[n].index]
        self._mark_training_only(index)
        return BuiltGraph(BackboneGraph(inputs, self._nodes, self._aux), index, out_spec,
                          where_out)

    def build(self) -> BackboneDense:
        """A RankModel's dense part.

        The graph, its output concatenated, ``top_mlp``, the Linear layer to ``num_class``
        logits; with ``wide_start`` set and one logit reached through ``top_mlp`` or that
        layer, the wide lookups' sum added to it.

        Raises:
            ConfigError: by field (:meth:`build_graph`'s, an output that cannot be
                concatenated).
        """
        built = self.build_graph()
        index, top, width = built.concatenated(self.backbone)
        c = max(int(self.num_class), 1)
        out = keras_dense(width, c, True, "glorot_uniform") if width != c else None
        around = c == 1 and (out is not None or self.backbone.HasField("top_mlp"))
        return BackboneDense(built.graph, index, top, out, c,
                             self.wide_start if around else -1)

    # ---- the DAG -------------------------------------------------------------------------

    def _index_blocks(self, blocks: Any, where: str
                      ) -> dict[str, tuple[int, pipeline_pb2.BackboneBlock]]:
        out: dict[str, tuple[int, pipeline_pb2.BackboneBlock]] = {}
        for i, b in enumerate(blocks):
            if not b.name:
                raise ConfigError(f"{where}.blocks[{i}].name", "every block needs a name")
            if b.name in out:
                raise ConfigError(f"{where}.blocks[{i}].name", f"block {b.name!r} is defined "
                                                               "twice")
            out[b.name] = (i, b)
        return out

    def _dependencies(self, scope: BlockScope, i: int, b: pipeline_pb2.BackboneBlock
                      ) -> list[str]:
        """The names of ``scope`` block ``b`` runs after, a package call's reads included."""
        where = f"{scope.where}.blocks[{i}]"
        layer = b.WhichOneof("layer")
        if layer in ("raw_input", "embedding_layer"):
            raise ConfigError(f"{where}.{layer}", f"{layer} blocks are not implemented")
        if not b.inputs:
            raise ConfigError(f"{where}.inputs", f"block {b.name!r} needs at least one input")
        if layer == "input_layer":
            if len(b.inputs) != 1 or b.inputs[0].WhichOneof("name") != "feature_group_name":
                raise ConfigError(f"{where}.inputs", "an input_layer block reads one "
                                                     "feature_group_name")
            group = b.inputs[0].feature_group_name
            if group not in self.groups:
                raise ConfigError(f"{where}.inputs[0].feature_group_name",
                                  f"no feature group {group!r}")
            return []
        out: list[str] = []
        for j, inp in enumerate(b.inputs):
            kind = inp.WhichOneof("name")
            at = f"{where}.inputs[{j}]"
            if kind != "package_name":
                for f in ("package_input", "package_input_fn", "reset_input"):
                    if inp.HasField(f):
                        raise ConfigError(f"{at}.{f}", "applies to a package_name input")
            if kind is None:
                raise ConfigError(at, "names no feature group, block or package")
            if kind == "use_package_input":
                if not scope.package:
                    raise ConfigError(f"{at}.use_package_input", "only a package's block "
                                                                 "reads the package's input")
                continue
            name = getattr(inp, kind)
            if kind == "package_name":
                out += self._package_dependencies(scope, name, inp, f"{at}.package_name")
                continue
            if name == b.name:
                raise ConfigError(at, "a block cannot read itself")
            if name in scope.blocks or (kind == "feature_group_name" and name in self.groups):
                out.append(name)
            elif not (scope.package and self._outer and name in self._outer.blocks):
                raise ConfigError(f"{at}.{kind}",
                                  f"{name!r} is neither a block nor a feature group")
        return out

    def _outputs(self, holder: Any, blocks: dict, deps: dict, where: str
                 ) -> tuple[list[str], str]:
        output_field = "output_blocks" if holder.output_blocks else "concat_blocks"
        names = list(holder.output_blocks or holder.concat_blocks)
        if not names:
            read = {d for ds in deps.values() for d in ds}
            names = [n for n, (_i, b) in blocks.items()
                     if n not in read and not is_auxiliary_loss(b)]
            logger.info("%s: no concat_blocks or output_blocks; concatenating the blocks no "
                        "block reads: %s", where, ", ".join(names))
        for n in names:
            if n not in blocks:
                raise ConfigError(f"{where}.{output_field}", f"no block {n!r}")
        if not names:
            raise ConfigError(f"{where}.concat_blocks", f"{where} has no output")
        return names, output_field

    @staticmethod
    def _needed(outputs: list[str], deps: dict) -> set[str]:
        needed: set[str] = set()
        stack = list(outputs)
        while stack:
            n = stack.pop()
            if n not in needed:
                needed.add(n)
                stack += deps.get(n, [])
        return needed

    def _topological(self, needed: set[str], deps: dict, blocks: dict, where: str
                     ) -> list[str]:
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(n: str, path: list[str]) -> None:
            if state.get(n) == 2:
                return
            if state.get(n) == 1:
                cycle = " -> ".join(path[path.index(n):] + [n])
                raise ConfigError(f"{where}.blocks", f"the blocks form a cycle: {cycle}")
            state[n] = 1
            for d in deps.get(n, []):
                if d in needed:
                    visit(d, path + [n])
            state[n] = 2
            order.append(n)

        for n in [b for b in blocks if b in needed] + sorted(needed - set(blocks)):
            visit(n, [])
        return order

    # ---- nodes ---------------------------------------------------------------------------

    def _add(self, built: tuple[nn.Module, Spec], b: pipeline_pb2.BackboneBlock | None = None
             ) -> GraphValue:
        """Appends a node; its value."""
        node, spec = built
        value = GraphValue(self._registers, spec)
        self._nodes.append(node)
        self._ranges.append((self._registers, leaf_count(spec)))
        self._registers += leaf_count(spec)
        if b is not None and is_auxiliary_loss(b):
            self._aux.append(value.start)
        return value

    def _mark_training_only(self, output_index: list[int]) -> None:
        """Nodes no output reads (through the nodes it reads) skip evaluation."""
        wanted = set(output_index)
        for node, (start, count) in zip(reversed(self._nodes), reversed(self._ranges),
                                        strict=True):
            if wanted.intersection(range(start, start + count)):
                for read in getattr(node, "reads", []):
                    wanted.update(read.index)
            else:
                node.skip_in_eval = True

    def _check_not_aux(self, value: GraphValue, where: str, name: str) -> None:
        if value.start in self._aux:
            raise ConfigError(where, f"{name!r} is an {AUXILIARY_LOSS} block: its output is "
                                     "its loss, read it with ignore_input")

    def _input_value(self, scope: BlockScope, inp: Any, at: str) -> GraphValue:
        """The value an input names in ``scope`` (a package call builds its nodes)."""
        kind = inp.WhichOneof("name")
        if kind == "use_package_input":
            if scope.package_input is None:
                raise ConfigError(f"{at}.use_package_input",
                                  f"package {scope.package!r} was called without a "
                                  "package_input")
            return scope.package_input
        if kind == "package_name":
            return self._call_package(scope, inp, at)
        name = getattr(inp, kind)
        if scope.package and name not in scope.blocks:
            if kind == "block_name":  # a backbone block
                assert self._outer is not None
                return self._outer.values[name]
            if name not in scope.values:  # a group: the package's own input layer
                scope.values[name] = self._add(self._package_input_layer(
                    scope, name, None, f"{at}.feature_group_name"))
        return scope.values[name]

    def _block(self, scope: BlockScope, i: int, b: pipeline_pb2.BackboneBlock
               ) -> tuple[nn.Module, Spec]:
        where = f"{scope.where}.blocks[{i}]"
        if scope.package and b.WhichOneof("layer") == "input_layer":
            return self._package_input_layer(scope, b.inputs[0].feature_group_name, b,
                                             f"{where}.input_layer")
        reads: list[nn.Module] = []
        specs: list[Spec] = []
        for j, inp in enumerate(b.inputs):
            at = f"{where}.inputs[{j}]"
            value = self._input_value(scope, inp, at)
            if inp.ignore_input:
                continue
            self._check_not_aux(value, at, getattr(inp, inp.WhichOneof("name")))
            steps: list[nn.Module] = []
            spec = value.spec
            if inp.input_slice:
                m, spec = parse_slice(inp.input_slice, f"{at}.input_slice").build(spec)
                steps.append(m)
            if inp.input_fn:
                m, spec = parse_lambda(inp.input_fn, f"{at}.input_fn").build(spec)
                steps.append(m)
            reads.append(ReadInput(value.index, Chain(steps)))
            specs.append(spec)
        if not specs:
            raise ConfigError(f"{where}.inputs", "every input is ignore_input")
        key = (scope.package, b.name)
        if scope.package and key in self._shared:
            in_specs, merge, layer, spec = self._shared[key]
            if in_specs != specs:
                raise ConfigError(f"{where}.inputs",
                                  f"package {scope.package!r} is called with inputs of other "
                                  f"shapes: {', '.join(map(describe, specs))} here, "
                                  f"{', '.join(map(describe, in_specs))} before")
        else:
            merge, layer, spec = self._layers(b, specs, where)
            if scope.package:
                self._shared[key] = (specs, merge, layer, spec)
        return BlockNode(reads, merge, layer, leaf_count(spec)), spec

    def _layers(self, b: pipeline_pb2.BackboneBlock, specs: list[Spec], where: str
                ) -> tuple[nn.Module, nn.Module, Spec]:
        """A block's merge of its inputs and its layers."""
        merge, spec = self.merge(b.merge_inputs_into_list, b.input_concat_axis, specs,
                                 f"{where}.input_concat_axis")
        steps = [merge]
        if b.extra_input_fn:
            m, spec = parse_lambda(b.extra_input_fn, f"{where}.extra_input_fn").build(spec)
            steps.append(m)
        layers = list(b.layers)
        if layers and b.WhichOneof("layer") is not None:
            raise ConfigError(f"{where}.layers", "give layers or one layer, not both")
        holders = [(layer, f"{where}.layers[{k}]") for k, layer in enumerate(layers)]
        if not layers and b.WhichOneof("layer") is not None:
            holders = [(b, where)]
        for holder, at in holders:
            kind = holder.WhichOneof("layer")
            inner = getattr(holder, kind) if kind else None
            if kind != "keras_layer":  # a recurrent or repeat layer's (None for others)
                inner = getattr(inner, "keras_layer", None)
            if (inner is not None and inner.class_name == AUXILIARY_LOSS
                    and not (holder is b and kind == "keras_layer")):
                raise ConfigError(f"{at}.{kind}", f"an {AUXILIARY_LOSS} is a block's one "
                                                  "keras_layer")
            m, spec = self.layer(holder, kind, spec, at)
            steps.append(m)
        n = sum(map(leaf_count, specs))
        return PickLeaves(list(range(n))), Chain(steps), spec

