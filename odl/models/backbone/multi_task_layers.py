"""EasyRec's multi-task backbone layers: ``MMoE`` and ``AITMTower``.

``mmoe { num_task num_expert expert_mlp }``: with ``expert_mlp``, ``num_expert`` copies of
EasyRec's MLP (``odl.models.backbone.dense_layers``) over the input ``x`` (``[B, d]``) are
the experts ``e_k``, and the gates read ``x``; without it, the input is a list of the
``num_expert`` experts' outputs followed by the gates' input. Task ``t``'s input is
``sum_k softmax(G_t g)_k * e_k`` (``G_t`` a Dense layer with bias, Glorot-uniform, to
``num_expert``). Output: the list of the ``num_task`` task inputs (a MultiTaskModel's towers
read one each). ``num_expert: 0`` passes the input on, as EasyRec does.

``aitm { project_dim transfer_mlp stop_gradient }`` (AITM's information transfer): over the
list ``[own tower, earlier towers...]`` (``[B, d_i]`` each), the earlier ones detached
(``stop_gradient``, default true) and through ``transfer_mlp`` when set; per item ``i``
Dense layers (Glorot-uniform, bias) make ``q_i, k_i, v_i`` of ``project_dim`` (unset: the own
tower's width); the output is the own tower's attention row,
``sum_j softmax_j(q_0 . k_j / sqrt(dim)) v_j`` (EasyRec's Attention with ``scale_by_dim``),
``[B, dim]``. One tensor passes on as it is.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

from typing import Optional

import torch
from torch import nn

from odl.models.backbone.block_registry import BlockArgs, BuiltLayer, register_block
from odl.models.backbone.dense_layers import build_easyrec_mlp, keras_dense
from odl.models.backbone.layer_settings import params_message
from odl.models.backbone.value_specs import TensorSpec, flat_tensors, tensor
from odl.protos import pipeline_pb2


class MMoELayer(nn.Module):
    """MMoE (module docstring); ``experts`` None: the input holds the experts' outputs."""

    __constants__ = ["num_expert"]

    def __init__(self, experts: Optional[nn.ModuleList], gates: list[nn.Module],
                 num_expert: int) -> None:
        super().__init__()
        self.experts = experts
        self.gates = nn.ModuleList(gates)
        self.num_expert = int(num_expert)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tasks' inputs."""
        experts = self.experts
        if experts is not None:
            gate_input = xs[0]
            outs: list[torch.Tensor] = []
            for expert in experts:
                outs.append(expert(gate_input))
        else:
            gate_input = xs[self.num_expert]
            outs = xs[: self.num_expert]
        stacked = torch.stack(outs, dim=1)  # [B, experts, d]
        tasks: list[torch.Tensor] = []
        for gate in self.gates:
            weights = torch.softmax(gate(gate_input), dim=-1).unsqueeze(-1)
            tasks.append((stacked * weights).sum(dim=1))
        return tasks


def _build_mmoe(args: BlockArgs) -> BuiltLayer:
    p = params_message(args, pipeline_pb2.MMoELayer, "mmoe", required=True)
    num_task, num_expert = int(p.num_task), int(p.num_expert)
    if num_task < 1:
        raise args.refuse("needs num_task >= 1")
    if num_expert == 0:
        return BuiltLayer(_Identity(), args.spec)
    if p.HasField("expert_mlp"):
        if not isinstance(args.spec, TensorSpec) or len(args.spec.shape) != 1:
            raise args.refuse("with expert_mlp takes one [B, d] tensor")
        width = args.spec.shape[0]
        try:
            built = [build_easyrec_mlp(width, p.expert_mlp) for _ in range(num_expert)]
        except ValueError as e:
            raise args.refuse(str(e)) from e
        experts: Optional[nn.ModuleList] = nn.ModuleList(m for m, _w in built)
        out_width, gate_width = built[0][1], width
    else:
        items = flat_tensors(args.spec)
        if (not items or len(items) != num_expert + 1 or len(set(items[:num_expert])) != 1
                or any(len(t.shape) != 1 for t in items)):
            raise args.refuse(f"without expert_mlp takes the {num_expert} experts' [B, d] "
                              "outputs and the gates' input")
        experts = None
        out_width, gate_width = items[0].shape[0], items[num_expert].shape[0]
    gates = [keras_dense(gate_width, num_expert, True, "glorot_uniform")
             for _ in range(num_task)]
    return BuiltLayer(MMoELayer(experts, gates, num_expert), [tensor(out_width)] * num_task)


class _Identity(nn.Module):
    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return xs


class AITMLayer(nn.Module):
    """AITMTower over ``[own, earlier...]`` (module docstring)."""

    __constants__ = ["stop_gradient", "scale"]

    def __init__(self, transfer: Optional[nn.Module], queries: list[nn.Module],
                 keys: list[nn.Module], values: list[nn.Module], stop_gradient: bool,
                 dim: int) -> None:
        super().__init__()
        self.transfer = transfer
        self.queries = nn.ModuleList(queries)
        self.keys = nn.ModuleList(keys)
        self.values = nn.ModuleList(values)
        self.stop_gradient = bool(stop_gradient)
        self.scale = 1.0 / float(dim) ** 0.5

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[the own tower's attended vector]``."""
        items: list[torch.Tensor] = [xs[0]]
        transfer = self.transfer
        for x in xs[1:]:
            dep = x.detach() if self.stop_gradient else x
            if transfer is not None:
                dep = transfer(dep)
            items.append(dep)
        q: list[torch.Tensor] = []
        for i, layer in enumerate(self.queries):
            q.append(layer(items[i]))
        k: list[torch.Tensor] = []
        for i, layer in enumerate(self.keys):
            k.append(layer(items[i]))
        v: list[torch.Tensor] = []
        for i, layer in enumerate(self.values):
            v.append(layer(items[i]))
        keys = torch.stack(k, dim=1)  # [B, n, dim]
        scores = torch.einsum("bd,bnd->bn", q[0], keys) * self.scale
        weights = torch.softmax(scores, dim=1).unsqueeze(2)
        return [(weights * torch.stack(v, dim=1)).sum(dim=1)]


def _build_aitm(args: BlockArgs) -> BuiltLayer:
    p = params_message(args, pipeline_pb2.AITMTower, "aitm", required=True)
    if isinstance(args.spec, TensorSpec):
        return BuiltLayer(_Identity(), args.spec)
    items = flat_tensors(args.spec)
    if not items or any(len(t.shape) != 1 for t in items):
        raise args.refuse("takes [own tower, earlier towers...], [B, d] tensors")
    widths = [t.shape[0] for t in items]
    transfer = None
    if p.HasField("transfer_mlp"):
        if len(set(widths[1:])) > 1:
            raise args.refuse("transfer_mlp needs the earlier towers of one width")
        try:
            transfer, out = build_easyrec_mlp(widths[1] if len(widths) > 1 else widths[0],
                                              p.transfer_mlp)
        except ValueError as e:
            raise args.refuse(str(e)) from e
        widths = widths[:1] + [out] * (len(widths) - 1)
    dim = int(p.project_dim) or widths[0]
    make = [[keras_dense(w, dim, True, "glorot_uniform") for w in widths] for _ in range(3)]
    layer = AITMLayer(transfer, make[0], make[1], make[2], bool(p.stop_gradient), dim)
    return BuiltLayer(layer, tensor(dim))


register_block("MMoE", _build_mmoe)
register_block("AITMTower", _build_aitm)
