"""EasyRec's contrastive-learning backbone layers: ``AuxiliaryLoss`` and ``SeqAugment``.

* ``AuxiliaryLoss`` (``st_params``: ``loss_type``, required; ``loss_weight`` 1.0;
  ``temperature`` 0.1) reads two tensors ``[B, d]`` (a block with
  ``merge_inputs_into_list``) and adds ``loss_weight`` times their loss to the model's
  loss in training, as EasyRec adds it to the loss dict: ``l2_loss`` (the batch mean of
  ``|x1 - x2|^2``), ``info_nce`` (``q p^T / temperature`` as logits, record ``i``'s
  positive the diagonal, softmax cross entropy, batch mean; the vectors are not
  normalized, as EasyRec's) or ``nce_loss`` (CL4SRec's: ``z = [z_1; z_2]``, similarities
  ``z z^T / temperature``; each of the ``2B`` rows' positive is its other view, the
  negatives every other row but itself; softmax cross entropy, mean). Its output is the
  loss, which only orders the DAG: a block reads it with ``ignore_input`` (the graph refuses
  anything else, ``odl.models.backbone.backbone_graph``). At prediction time the block and
  the blocks only it reads are not run.
* ``SeqAugment`` / ``SeqAugmentOps`` (``seq_aug { mask_rate 0.6, crop_rate 0.2,
  reorder_rate 0.6 }``) read ``[S, n, ...]`` (sequences ``[B, L, D]`` and lengths ``[B]``,
  an input layer's ``output_seq_and_normal_feature``) and give ``[S', n']``: per record
  one of the enabled augmentations, chosen uniformly (crop when ``crop_rate < 1``, mask
  when ``mask_rate > 0``, reorder when ``reorder_rate > 0``): *crop* keeps
  ``k = floor(n * crop_rate)`` consecutive items from a uniform start, moved to the front
  (``n' = k``, the rest zero); *mask* replaces ``floor(n * mask_rate)`` items drawn
  without replacement by a learned mask vector (``D``, Glorot-uniform); *reorder* shuffles
  ``floor(n * reorder_rate)`` consecutive items from a uniform start. ``SeqAugmentOps``
  (EasyRec's compiled kernel of the same augmentations) is the same layer here.

Deviation: the augmentations act in training only (EasyRec's layer also augments at
prediction time, which makes a prediction random; in EasyRec's samples it lies on a path
only the auxiliary loss reads).

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import math

import torch
from torch import nn
from torch.nn import functional

from odl.models.backbone.block_registry import BlockArgs, BuiltLayer, register_block
from odl.models.backbone.value_specs import TensorSpec, flat_tensors, tensor
from odl.protos import pipeline_pb2

LOSS_TYPES = ("l2_loss", "info_nce", "nce_loss")


class AuxiliaryLoss(nn.Module):
    """``loss_weight`` * a contrastive loss of two ``[B, d]`` tensors (module docstring).

    ``forward([x1, x2])`` returns ``[loss]``, a 0-d tensor.
    """

    __constants__ = ["loss_type", "weight", "temperature"]

    def __init__(self, loss_type: str, weight: float, temperature: float) -> None:
        super().__init__()
        self.loss_type = loss_type
        self.weight = float(weight)
        self.temperature = float(temperature)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[loss_weight * loss]``."""
        x1, x2 = xs[0], xs[1]
        if self.loss_type == "l2_loss":
            loss = (x1 - x2).square().sum(dim=-1).mean()
        elif self.loss_type == "info_nce":
            logits = x1 @ x2.t() / self.temperature
            loss = functional.cross_entropy(
                logits, torch.arange(x1.shape[0], device=x1.device))
        else:  # nce_loss
            b = x1.shape[0]
            z = torch.cat([x1, x2], dim=0)
            sim = z @ z.t() / self.temperature
            eye = torch.eye(2 * b, dtype=torch.bool, device=z.device)
            sim = sim.masked_fill(eye, float("-inf"))  # a row is never its own negative
            partner = torch.cat([torch.arange(b, 2 * b), torch.arange(0, b)]).to(z.device)
            loss = functional.cross_entropy(sim, partner)
        return [loss * self.weight]


def _build_auxiliary_loss(args: BlockArgs) -> BuiltLayer:
    st = args.st_params
    unknown = sorted(set(st) - {"loss_type", "loss_weight", "temperature"})
    if unknown:
        raise args.refuse(f"unknown st_params {unknown}")
    loss_type = st.get("loss_type")
    if loss_type not in LOSS_TYPES:
        raise args.refuse(f"st_params.loss_type must be one of {', '.join(LOSS_TYPES)}; "
                          f"got {loss_type!r}")
    weight = float(st.get("loss_weight", 1.0))
    temperature = float(st.get("temperature", 0.1))
    if not temperature > 0:
        raise args.refuse(f"st_params.temperature must be > 0, got {temperature}")
    items = flat_tensors(args.spec)
    if (items is None or len(items) != 2 or any(len(t.shape) != 1 for t in items)
            or items[0] != items[1]):
        raise args.refuse("needs a list of two tensors [B, d] of one width "
                          "(merge_inputs_into_list: true)")
    return BuiltLayer(AuxiliaryLoss(str(loss_type), weight, temperature), tensor())


def _uniform_start(lengths: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A uniform start in ``[0, n - k)`` per record (0 when that range is empty)."""
    room = (lengths - count).clamp(min=1)
    start = (torch.rand(lengths.shape, device=lengths.device) * room).long()
    return torch.minimum(start, room - 1)


class SeqAugment(nn.Module):
    """CL4SRec's crop / mask / reorder of a batch of sequences (module docstring).

    ``forward([S, n, ...])`` returns ``[S', n']``; in evaluation ``[S, n]``.

    Args:
        dim: ``D``.
        mask_rate: share of the items masked.
        crop_rate: share of the items a crop keeps.
        reorder_rate: share of the items reordered.
    """

    __constants__ = ["mask_rate", "crop_rate", "reorder_rate", "methods"]

    def __init__(self, dim: int, mask_rate: float, crop_rate: float,
                 reorder_rate: float) -> None:
        super().__init__()
        self.mask_rate = float(mask_rate)
        self.crop_rate = float(crop_rate)
        self.reorder_rate = float(reorder_rate)
        limit = math.sqrt(6.0 / (1 + dim))
        self.mask = nn.Parameter(torch.empty(int(dim)).uniform_(-limit, limit))
        # 0: crop, 1: mask, 2: reorder, in EasyRec's order of the enabled ones
        self.methods = ([0] if crop_rate < 1.0 else []) + ([1] if mask_rate > 0 else []) + (
            [2] if reorder_rate > 0 else [])

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[S', n']`` in training, ``[S, n]`` otherwise."""
        seq, n = xs[0], xs[1]
        if not self.training or len(self.methods) == 0:
            return [seq, n]
        b, positions = seq.shape[0], seq.shape[1]
        lengths = n.round().long().clamp(0, positions)
        pos = torch.arange(positions, device=seq.device).unsqueeze(0).expand(b, positions)
        choice = torch.randint(0, len(self.methods), [b], device=seq.device)
        out_seq = seq
        out_len = lengths
        for i, method in enumerate(self.methods):
            if method == 0:
                got, got_len = self._crop(seq, lengths, pos)
            elif method == 1:
                got, got_len = self._mask(seq, lengths, pos)
            else:
                got, got_len = self._reorder(seq, lengths, pos)
            chosen = choice == i
            out_seq = torch.where(chosen.view(b, 1, 1), got, out_seq)
            out_len = torch.where(chosen, got_len, out_len)
        return [out_seq, out_len.to(n.dtype)]

    def _crop(self, seq: torch.Tensor, lengths: torch.Tensor, pos: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        keep = torch.floor(lengths.to(torch.float32) * self.crop_rate).long()
        start = _uniform_start(lengths, keep)
        source = (start.unsqueeze(1) + pos).clamp(max=seq.shape[1] - 1)
        got = seq.gather(1, source.unsqueeze(2).expand(-1, -1, seq.shape[2]))
        return got * (pos < keep.unsqueeze(1)).unsqueeze(2).to(seq.dtype), keep

    def _mask(self, seq: torch.Tensor, lengths: torch.Tensor, pos: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        count = torch.floor(lengths.to(torch.float32) * self.mask_rate).long()
        draw = torch.rand(pos.shape, device=seq.device)
        draw = torch.where(pos < lengths.unsqueeze(1), draw, torch.full_like(draw, 2.0))
        rank = draw.argsort(dim=1).argsort(dim=1)  # the items first, in random order
        masked = (rank < count.unsqueeze(1)).unsqueeze(2)
        return torch.where(masked, self.mask.view(1, 1, -1).to(seq.dtype), seq), lengths

    def _reorder(self, seq: torch.Tensor, lengths: torch.Tensor, pos: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        count = torch.floor(lengths.to(torch.float32) * self.reorder_rate).long()
        start = _uniform_start(lengths, count).unsqueeze(1)
        inside = (pos >= start) & (pos < start + count.unsqueeze(1))
        # sort keys: a position outside keeps its own; inside, a uniform draw in the window
        draw = start.to(torch.float32) + torch.rand(pos.shape, device=seq.device) * (
            count.unsqueeze(1).to(torch.float32) * (1.0 - 1e-6))
        key = torch.where(inside, draw, pos.to(torch.float32))
        order = key.argsort(dim=1)
        return seq.gather(1, order.unsqueeze(2).expand(-1, -1, seq.shape[2])), lengths


def _build_seq_augment(args: BlockArgs) -> BuiltLayer:
    params = args.params
    if params is not None and not isinstance(params, pipeline_pb2.SequenceAugment):
        raise args.refuse("takes seq_aug { mask_rate crop_rate reorder_rate }")
    settings = params if params is not None else pipeline_pb2.SequenceAugment()
    for name in ("mask_rate", "crop_rate", "reorder_rate"):
        rate = getattr(settings, name)
        if not 0.0 <= rate <= 1.0:
            raise args.refuse(f"seq_aug.{name} must be in [0, 1], got {rate}")
    items = flat_tensors(args.spec)
    if (items is None or len(items) < 2 or len(items[0].shape) != 2
            or items[1] != TensorSpec(())):
        raise args.refuse("needs [sequences [B, L, D], lengths [B], ...] (an input layer "
                          "with output_seq_and_normal_feature)")
    positions, dim = items[0].shape
    module = SeqAugment(dim, settings.mask_rate, settings.crop_rate, settings.reorder_rate)
    return BuiltLayer(module, [tensor(positions, dim), tensor()])


register_block("AuxiliaryLoss", _build_auxiliary_loss)
register_block("SeqAugment", _build_seq_augment)
register_block("SeqAugmentOps", _build_seq_augment)
