"""EasyRec's BST tower of MultiTowerBST (``multi_tower.bst_towers``): one transformer layer.

It runs over a behaviour sequence and the target item.

As EasyRec's ``easy_rec/python/model/multi_tower_bst.py`` over a sequence attention group
(``model_config.seq_att_groups``, read as a DIN tower reads it: the keys' lookups, then the
sequences' positions, then the first sequence's length), with ``S = seq_len`` and ``D`` the
keys' width (each position's items as wide)::

    tokens = [the first S - 1 positions (zeros past the group's), keys]          [B, S, D]
    head_h = softmax(Q_h K_h^T + mask) V_h     Q, K, V: Linear on the h-th slice of D
    att    = Linear(concat(head_1, ..., head_H))
    x      = LayerNorm(tokens + att)
    out    = LayerNorm(x + Linear(x)),  flattened to [B, S * D]

The ``H = multi_head_size`` heads take slices of ``ceil(D / H)`` columns (the last one what is
left); the scores are not scaled; the mask hides the positions at and past a record's length
(the keys' token is always visible) with EasyRec's ``-2**32 + 1``; the feed-forward part is
one Linear without an activation and the layer norms take EasyRec's epsilon 1e-6.

This module has no ``from __future__ import annotations``: TorchScript reads the class's
annotations as types.
"""

import math

import torch
from torch import nn

__all__ = ["BSTTower"]

# EasyRec's score of a hidden position and its layer norm's epsilon
MASKED_SCORE = -(2.0**32) + 1.0
LAYER_NORM_EPS = 1e-6


class _Head(nn.Module):
    """One attention head over a slice of the tokens' columns."""

    __constants__ = ["start", "width", "masked"]

    def __init__(self, start: int, width: int) -> None:
        super().__init__()
        self.start, self.width = int(start), int(width)
        self.masked = MASKED_SCORE
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)

    def forward(self, tokens: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """``[B, S, width]``: the slice's attention over the visible tokens."""
        part = tokens[:, :, self.start:self.start + self.width]
        scores = torch.matmul(self.query(part), self.key(part).transpose(1, 2))  # [B, S, S]
        scores = scores.masked_fill(~visible.unsqueeze(1), self.masked)
        return torch.matmul(torch.softmax(scores, dim=-1), self.value(part))


class BSTTower(nn.Module):
    """One BST tower (module docstring); scriptable.

    Args:
        width: ``D``, the keys' width (as wide as each position's items).
        positions: the group's sequence positions in the input.
        seq_len: ``S`` (``bst_towers[i].seq_len``), at least 2.
        heads: ``multi_head_size``, at least 1.

    Raises:
        ValueError: a setting out of range.
    """

    __constants__ = ["width", "positions", "seq_len", "kept"]

    def __init__(self, width: int, positions: int, seq_len: int, heads: int) -> None:
        super().__init__()
        if width < 1 or seq_len < 2 or heads < 1:
            raise ValueError(f"a BST tower needs a width, seq_len >= 2 and a head, got width "
                             f"{width}, seq_len {seq_len}, {heads} heads")
        self.width, self.positions, self.seq_len = int(width), int(positions), int(seq_len)
        self.kept = min(self.positions, self.seq_len - 1)
        part = int(math.ceil(width / heads))
        self.heads = nn.ModuleList(_Head(s, min(part, width - s)) for s in range(0, width, part))
        self.merge = nn.Linear(width, width)
        self.norm1 = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.feed_forward = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.out_width = self.seq_len * self.width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S * D]`` from ``x``: keys, positions, then the sequence's length last."""
        batch = x.shape[0]
        d = self.width
        keys = x[:, :d]
        hist = x[:, d:d + self.kept * d].reshape(batch, self.kept, d)
        if self.kept < self.seq_len - 1:
            hist = torch.cat([hist, hist.new_zeros(batch, self.seq_len - 1 - self.kept, d)],
                             dim=1)
        tokens = torch.cat([hist, keys.unsqueeze(1)], dim=1)  # [B, S, D]
        lengths = x[:, -1:]
        slots = torch.arange(self.seq_len, device=x.device, dtype=x.dtype).unsqueeze(0)
        visible = (slots < lengths) | (slots == self.seq_len - 1)  # [B, S]
        outs: list[torch.Tensor] = []
        for head in self.heads:
            outs.append(head(tokens, visible))
        att = self.merge(torch.cat(outs, dim=2))
        h = self.norm1(tokens + att)
        h = self.norm2(h + self.feed_forward(h))
        return h.reshape(batch, self.out_width)
