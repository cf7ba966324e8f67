"""One backbone block's merge and layer, as EasyRec's ``Backbone`` builds them.

:class:`LayerBuilder` turns what a block does with its inputs into modules over leaves
(``odl.models.backbone.value_specs``): merging its inputs (EasyRec's ``merge_inputs``: into
a list with ``merge_inputs_into_list``; else lists are joined, a tensor among lists joins as
a list of one, and tensors are concatenated on ``input_concat_axis``) and its layer: a
``lambda``, a ``keras_layer`` by class name (``odl.models.backbone.block_registry``), a
``recurrent`` layer (``num_steps`` copies, each fed the previous one's output; with
``fixed_input_index``, the input is a list whose other items are replaced by each step's
output and the fixed item is dropped at the end) or a ``repeat`` layer (``num_repeat``
copies of the same input; their outputs as a list, or concatenated on
``output_concat_axis``). The DAG around the blocks is ``odl.models.backbone.backbone_graph``.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2
from torch import nn

from odl.config.config_error import ConfigError
from odl.models.backbone.block_registry import BlockArgs, block_builder, registered_blocks
from odl.models.backbone.graph_modules import Recurrent, Repeat
from odl.models.backbone.input_functions import PickLeaves, TensorOp, parse_lambda
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


class LayerBuilder:
    """Builds a block's merge and layers from their config (module docstring)."""

    def merge(self, merge_into_list: bool, axis: int, specs: list[Spec], where: str
              ) -> tuple[nn.Module, Spec]:
        """Several inputs' leaves merged into one value.

        Raises:
            ConfigError: tensors that cannot be concatenated on ``axis``.
        """
        n = sum(map(leaf_count, specs))
        identity = PickLeaves(list(range(n)))
        if merge_into_list:
            return identity, list(specs)
        if len(specs) == 1:
            return identity, specs[0]
        if any(is_list(s) for s in specs):
            return identity, [x for s in specs for x in (s if is_list(s) else [s])]
        merged = self.merge_specs(specs, axis, where)
        return TensorOp(identity, "concat", self.concat_dim(specs, axis, where)), merged

    @staticmethod
    def concat_dim(specs: list[Spec], axis: int, where: str) -> int:
        """``axis`` as a non-negative dimension of tensors of ``specs[0]``'s rank.

        Raises:
            ConfigError: an axis out of range, or the batch axis.
        """
        rank = specs[0].rank
        if not -rank <= axis < rank or axis % rank == 0:
            raise ConfigError(where, f"axis {axis} of tensors of {rank} dimensions (the batch "
                                     "axis cannot be concatenated)")
        return axis % rank

    def merge_specs(self, specs: list[Spec], axis: int, where: str) -> Spec:
        """EasyRec's merge_inputs on specs (output side: lists joined, tensors concatenated).

        Raises:
            ConfigError: tensors that cannot be concatenated.
        """
        if len(specs) == 1:
            return specs[0]
        if any(is_list(s) for s in specs):
            return [x for s in specs for x in (s if is_list(s) else [s])]
        dim = self.concat_dim(specs, axis, where)
        shapes = {s.shape[: dim - 1] + s.shape[dim:] for s in specs}
        if len(shapes) != 1 or len({s.rank for s in specs}) != 1:
            raise ConfigError(where, "cannot concatenate "
                                     + ", ".join(describe(s) for s in specs))
        shape = list(specs[0].shape)
        shape[dim - 1] = sum(s.shape[dim - 1] for s in specs)
        return tensor(*shape)

    def layer(self, holder: Any, kind: str, spec: Spec, where: str) -> tuple[nn.Module, Spec]:
        """The layer ``kind`` of ``holder`` (a block or a ``layers`` entry) over ``spec``.

        Raises:
            ConfigError: by field, for a layer odl does not have or cannot build.
        """
        if kind == "lambda":
            return parse_lambda(getattr(holder, "lambda").expression,
                                f"{where}.lambda.expression").build(spec)
        if kind == "keras_layer":
            return self.keras(holder.keras_layer, spec, f"{where}.keras_layer")
        if kind == "recurrent":
            return self._recurrent(holder.recurrent, spec, f"{where}.recurrent")
        if kind == "repeat":
            return self._repeat(holder.repeat, spec, f"{where}.repeat")
        raise ConfigError(f"{where}.{kind}", f"a {kind} here is not implemented")

    def keras(self, layer: pipeline_pb2.KerasLayer, spec: Spec, where: str
              ) -> tuple[nn.Module, Spec]:
        """A ``keras_layer`` by its class name.

        Raises:
            ConfigError: an unknown class name, or the layer's own refusal.
        """
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
            m, out = self.keras(rec.keras_layer, current, f"{where}.keras_layer")
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
            m, out = self.keras(rep.keras_layer, spec, f"{where}.keras_layer")
            copies.append(m)
            outs.append(out)
        if len(copies) == 1:
            return copies[0], outs[0]
        if not rep.HasField("output_concat_axis"):
            return Repeat(copies, -1), outs
        if not all(isinstance(o, TensorSpec) for o in outs):
            raise ConfigError(f"{where}.output_concat_axis", "concatenates tensors only")
        merged = self.merge_specs(outs, rep.output_concat_axis, f"{where}.output_concat_axis")
        return Repeat(copies, self.concat_dim(outs, rep.output_concat_axis, where)), merged
