"""The backbone's DAG of blocks as one scriptable dense module (EasyRec's ``Backbone``).

Built once per model from ``model_config.backbone`` (the contract of each block's parts is
EasyRec's, docs/config.md "backbone"):

* A block reads its ``inputs`` (feature groups, other blocks), each through its
  ``input_slice`` then its ``input_fn`` (``odl.models.backbone.input_functions``); an
  ``ignore_input`` input only orders the DAG. Several inputs are merged as EasyRec's
  ``merge_inputs`` does: into a list with ``merge_inputs_into_list``; else lists are joined,
  a tensor among lists joins as a list of one, and tensors are concatenated on
  ``input_concat_axis``. Then ``extra_input_fn``.
* Then its layer: an ``input_layer`` (``odl.models.backbone.input_layers``), a
  ``keras_layer`` by class name (``odl.models.backbone.block_registry``), a ``lambda``, a
  ``recurrent`` layer (``num_steps`` copies, each fed the previous one's output; with
  ``fixed_input_index``, the input is a list whose other items are replaced by each step's
  output and the fixed item is dropped at the end), a ``repeat`` layer (``num_repeat`` copies
  of the same input; their outputs as a list, or concatenated on ``output_concat_axis``), or
  ``layers`` in sequence; no layer passes the input on.
* An input's name is a block's when a block has it, else a feature group's; a group read
  this way is read by a default input layer (the concatenated tensor).
* The output: ``output_blocks``' outputs, or ``concat_blocks``' merged as inputs are (default:
  the blocks no block reads), concatenated, through ``top_mlp``; then a Linear layer to
  ``num_class`` logits unless the last dimension is ``num_class`` already (EasyRec's
  RankModel).

Blocks no output depends on are not built. At run time the blocks' values live in one flat
list of tensors (``odl.models.backbone.value_specs``): each block appends its output's
leaves, and each read is a fixed list of positions, so the DAG costs no bookkeeping (the
modules: ``odl.models.backbone.graph_modules``). :meth:`GraphBuilder.build_graph` gives the
graph and its output for a model to put its head on; :meth:`GraphBuilder.build` is
RankModel's.

Refused by field: ``packages`` and the inputs that name them, ``raw_input`` and
``embedding_layer`` blocks, a ``repeat`` layer's own ``input_slice`` / ``input_fn``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import struct_pb2
from torch import nn

from odl.config.config_error import ConfigError
from odl.models.backbone.block_registry import BlockArgs, block_builder, registered_blocks
from odl.models.backbone.dense_layers import build_easyrec_mlp, keras_dense
from odl.models.backbone.graph_modules import (
    BackboneDense,
    BackboneGraph,
    BlockNode,
    Chain,
    ReadInput,
    Recurrent,
    Repeat,
)
from odl.models.backbone.input_functions import PickLeaves, TensorOp, parse_lambda, parse_slice
from odl.models.backbone.input_layers import GroupInput
from odl.models.backbone.value_specs import (
    Spec,
    TensorSpec,
    describe,
    flat_tensors,
    is_list,
    leaf_count,
    tensor,
)
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    """``st_params`` as EasyRec reads them: whole numbers ``int``, lists, nested dicts."""
    def value(v: Any) -> Any:
        if isinstance(v, float):
            return int(v) if v == int(v) else v
        if isinstance(v, struct_pb2.ListValue):
            return [value(x) for x in v]
        if isinstance(v, struct_pb2.Struct):
            return {str(k): value(x) for k, x in v.items()}
        return v
    return {str(k): value(v) for k, v in struct.items()}


@dataclass
class _Value:
    """A computed value: its first register and spec."""

    start: int
    spec: Spec

    @property
    def index(self) -> list[int]:
        return list(range(self.start, self.start + leaf_count(self.spec)))


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
class GraphBuilder:
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
    _values: dict[str, _Value] = field(default_factory=dict)
    _registers: int = 0

    def build_graph(self) -> BuiltGraph:
        """The blocks and the output's registers.

        Raises:
            ConfigError: by field, for anything the module docstring refuses or a layer
                cannot take.
        """
        bb, where = self.backbone, self.where
        if bb.packages:
            raise ConfigError(f"{where}.packages", "block packages are not implemented")
        if not bb.blocks:
            raise ConfigError(f"{where}.blocks", "the backbone needs at least one block")
        blocks: dict[str, tuple[int, pipeline_pb2.BackboneBlock]] = {}
        for i, b in enumerate(bb.blocks):
            if not b.name:
                raise ConfigError(f"{where}.blocks[{i}].name", "every block needs a name")
            if b.name in blocks:
                raise ConfigError(f"{where}.blocks[{i}].name", f"block {b.name!r} is defined "
                                                               "twice")
            blocks[b.name] = (i, b)
        deps = {name: self._dependencies(i, b, blocks) for name, (i, b) in blocks.items()}
        everything = self._topological(set(blocks) | {d for ds in deps.values() for d in ds},
                                       deps, blocks)
        outputs, output_field = self._outputs(blocks, deps)
        needed = self._needed(outputs, deps)
        order = [n for n in everything if n in needed]
        inputs: list[GroupInput] = []
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
                self._values[name] = _Value(self._registers, layer.spec)
                self._registers += leaf_count(layer.spec)
        nodes: list[BlockNode] = []
        for name in order:
            if name in self._values:
                continue
            i, b = blocks[name]
            node, spec = self._block(i, b)
            nodes.append(node)
            self._values[name] = _Value(self._registers, spec)
            self._registers += leaf_count(spec)
        out_spec = self._merge_specs([self._values[n].spec for n in outputs], -1)
        index = [r for n in outputs for r in self._values[n].index]
        return BuiltGraph(BackboneGraph(inputs, nodes), index, out_spec,
                          f"{where}.{output_field}")

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

    def _dependencies(self, i: int, b: pipeline_pb2.BackboneBlock,
                      blocks: dict) -> list[str]:
        where = f"{self.where}.blocks[{i}]"
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
        out = []
        for j, inp in enumerate(b.inputs):
            kind = inp.WhichOneof("name")
            if kind in ("package_name", "use_package_input") or inp.package_input:
                raise ConfigError(f"{where}.inputs[{j}]", "block packages are not implemented")
            if inp.HasField("reset_input"):
                raise ConfigError(f"{where}.inputs[{j}].reset_input",
                                  "block packages are not implemented")
            if kind is None:
                raise ConfigError(f"{where}.inputs[{j}]", "names no feature group or block")
            name = getattr(inp, kind)
            if name == b.name:
                raise ConfigError(f"{where}.inputs[{j}]", "a block cannot read itself")
            if name not in blocks and not (kind == "feature_group_name"
                                           and name in self.groups):
                raise ConfigError(f"{where}.inputs[{j}].{kind}",
                                  f"{name!r} is neither a block nor a feature group")
            out.append(name)
        return out

    def _outputs(self, blocks: dict, deps: dict) -> tuple[list[str], str]:
        bb = self.backbone
        output_field = "output_blocks" if bb.output_blocks else "concat_blocks"
        names = list(bb.output_blocks or bb.concat_blocks)
        if not names:
            read = {d for ds in deps.values() for d in ds}
            names = [n for n in blocks if n not in read]
            logger.info("backbone: no concat_blocks or output_blocks; concatenating the "
                        "blocks no block reads: %s", ", ".join(names))
        for n in names:
            if n not in blocks:
                raise ConfigError(f"{self.where}.{output_field}", f"no block {n!r}")
        if not names:
            raise ConfigError(f"{self.where}.concat_blocks", "the backbone has no output")
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

    def _topological(self, needed: set[str], deps: dict, blocks: dict) -> list[str]:
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(n: str, path: list[str]) -> None:
            if state.get(n) == 2:
                return
            if state.get(n) == 1:
                cycle = " -> ".join(path[path.index(n):] + [n])
                raise ConfigError(f"{self.where}.blocks", f"the blocks form a cycle: {cycle}")
            state[n] = 1
            for d in deps.get(n, []):
                visit(d, path + [n])
            state[n] = 2
            order.append(n)

        for n in [b for b in blocks if b in needed] + sorted(needed - set(blocks)):
            visit(n, [])
        return order

    def _block(self, i: int, b: pipeline_pb2.BackboneBlock) -> tuple[BlockNode, Spec]:
        where = f"{self.where}.blocks[{i}]"
        reads: list[nn.Module] = []
        specs: list[Spec] = []
        for j, inp in enumerate(b.inputs):
            value = self._values[getattr(inp, inp.WhichOneof("name"))]
            if inp.ignore_input:
                continue
            steps: list[nn.Module] = []
            spec = value.spec
            if inp.input_slice:
                m, spec = parse_slice(inp.input_slice, f"{where}.inputs[{j}].input_slice"
                                      ).build(spec)
                steps.append(m)
            if inp.input_fn:
                m, spec = parse_lambda(inp.input_fn, f"{where}.inputs[{j}].input_fn"
                                       ).build(spec)
                steps.append(m)
            reads.append(ReadInput(value.index, Chain(steps)))
            specs.append(spec)
        if not specs:
            raise ConfigError(f"{where}.inputs", "every input is ignore_input")
        merge, spec = self._merge(b, specs, where)
        steps = [merge]
        if b.extra_input_fn:
            m, spec = parse_lambda(b.extra_input_fn, f"{where}.extra_input_fn").build(spec)
            steps.append(m)
        layers = list(b.layers)
        if layers and b.WhichOneof("layer") is not None:
            raise ConfigError(f"{where}.layers", "give layers or one layer, not both")
        if layers:
            for k, layer in enumerate(layers):
                m, spec = self._layer(layer, layer.WhichOneof("layer"), spec,
                                      f"{where}.layers[{k}]")
                steps.append(m)
        elif b.WhichOneof("layer") is not None:
            m, spec = self._layer(b, b.WhichOneof("layer"), spec, where)
            steps.append(m)
        return BlockNode(reads, PickLeaves(list(range(sum(map(leaf_count, specs))))),
                         Chain(steps)), spec

    def _merge(self, b: pipeline_pb2.BackboneBlock, specs: list[Spec], where: str
               ) -> tuple[nn.Module, Spec]:
        n = sum(map(leaf_count, specs))
        identity = PickLeaves(list(range(n)))
        if b.merge_inputs_into_list:
            return identity, list(specs)
        if len(specs) == 1:
            return identity, specs[0]
        if any(is_list(s) for s in specs):
            return identity, [x for s in specs for x in (s if is_list(s) else [s])]
        merged = self._merge_specs(specs, b.input_concat_axis, f"{where}.input_concat_axis")
        dim = self._concat_dim(specs, b.input_concat_axis, f"{where}.input_concat_axis")
        return TensorOp(identity, "concat", dim), merged

    def _concat_dim(self, specs: list[Spec], axis: int, where: str) -> int:
        rank = specs[0].rank
        if not -rank <= axis < rank or axis % rank == 0:
            raise ConfigError(where, f"axis {axis} of tensors of {rank} dimensions (the batch "
                                     "axis cannot be concatenated)")
        return axis % rank

    def _merge_specs(self, specs: list[Spec], axis: int, where: str = "") -> Spec:
        """EasyRec's merge_inputs on specs (output side: lists joined, tensors concatenated)."""
        if len(specs) == 1:
            return specs[0]
        if any(is_list(s) for s in specs):
            return [x for s in specs for x in (s if is_list(s) else [s])]
        where = where or f"{self.where}.concat_blocks"
        dim = self._concat_dim(specs, axis, where)
        shapes = {s.shape[: dim - 1] + s.shape[dim:] for s in specs}
        if len(shapes) != 1 or len({s.rank for s in specs}) != 1:
            raise ConfigError(where, "cannot concatenate "
                                     + ", ".join(describe(s) for s in specs))
        shape = list(specs[0].shape)
        shape[dim - 1] = sum(s.shape[dim - 1] for s in specs)
        return tensor(*shape)

    def _layer(self, holder: Any, kind: str, spec: Spec, where: str) -> tuple[nn.Module, Spec]:
        if kind == "lambda":
            return parse_lambda(getattr(holder, "lambda").expression,
                                f"{where}.lambda.expression").build(spec)
        if kind == "keras_layer":
            return self._keras(holder.keras_layer, spec, f"{where}.keras_layer")
        if kind == "recurrent":
            return self._recurrent(holder.recurrent, spec, f"{where}.recurrent")
        if kind == "repeat":
            return self._repeat(holder.repeat, spec, f"{where}.repeat")
        raise ConfigError(f"{where}.{kind}", f"a {kind} here is not implemented")

    def _keras(self, layer: pipeline_pb2.KerasLayer, spec: Spec, where: str
               ) -> tuple[nn.Module, Spec]:
        builder = block_builder(layer.class_name)
        if builder is None:
            raise ConfigError(f"{where}.class_name",
                              f"layer {layer.class_name!r} is not implemented (odl has: "
                              f"{', '.join(registered_blocks())})")
        which = layer.WhichOneof("params")
        params = getattr(layer, which) if which and which != "st_params" else None
        st = struct_to_dict(layer.st_params) if which == "st_params" else {}
        built = builder(BlockArgs(layer.class_name, params, spec, where, st))
        return built.module, built.spec

    def _recurrent(self, rec: pipeline_pb2.BackboneRecurrentLayer, spec: Spec, where: str
                   ) -> tuple[nn.Module, Spec]:
        if rec.num_steps < 1:
            raise ConfigError(f"{where}.num_steps", "must be >= 1")
        fixed = int(rec.fixed_input_index) if rec.HasField("fixed_input_index") else -1
        items = flat_tensors(spec) if fixed >= 0 else None
        if fixed >= 0 and (items is None or not fixed < len(items)):
            raise ConfigError(f"{where}.fixed_input_index",
                              f"needs a list of tensors with an item {fixed}; got "
                              f"{describe(spec)}")
        steps: list[nn.Module] = []
        step_list = False
        current = spec
        for k in range(int(rec.num_steps)):
            m, out = self._keras(rec.keras_layer, current, f"{where}.keras_layer")
            steps.append(m)
            if fixed < 0:
                current = out
                continue
            others = [s for idx, s in enumerate(items) if idx != fixed]
            step_list = is_list(out)
            got = flat_tensors(out) if step_list else [out] * len(others)
            if got != others:
                raise ConfigError(f"{where}.keras_layer",
                                  f"step {k}'s output {describe(out)} does not fit the items "
                                  f"it replaces ({describe(others)})")
        if fixed >= 0:
            rest = [s for idx, s in enumerate(items) if idx != fixed]
            current = rest[0] if len(rest) == 1 else rest
        return Recurrent(steps, fixed, len(items) if items else 0, step_list), current

    def _repeat(self, rep: pipeline_pb2.BackboneRepeatLayer, spec: Spec, where: str
                ) -> tuple[nn.Module, Spec]:
        for f in ("input_slice", "input_fn"):
            if getattr(rep, f):
                raise ConfigError(f"{where}.{f}", "a repeat layer's per-copy input is not "
                                                  "implemented")
        if rep.num_repeat < 1:
            raise ConfigError(f"{where}.num_repeat", "must be >= 1")
        copies, outs = [], []
        for _k in range(int(rep.num_repeat)):
            m, out = self._keras(rep.keras_layer, spec, f"{where}.keras_layer")
            copies.append(m)
            outs.append(out)
        if len(copies) == 1:
            return copies[0], outs[0]
        if not rep.HasField("output_concat_axis"):
            return Repeat(copies, -1), outs
        if not all(isinstance(o, TensorSpec) for o in outs):
            raise ConfigError(f"{where}.output_concat_axis", "concatenates tensors only")
        merged = self._merge_specs(outs, rep.output_concat_axis, f"{where}.output_concat_axis")
        return Repeat(copies, self._concat_dim(outs, rep.output_concat_axis, where)), merged
