"""The scriptable modules a backbone is built into (``odl.models.backbone.backbone_graph``).

Every block's value lives in one flat list of tensors, the registers
(``odl.models.backbone.value_specs``): :class:`BackboneGraph` runs the input layers, then
each :class:`BlockNode` in topological order, each appending its output's leaves; a block
reads fixed register positions (:class:`ReadInput`). :class:`Recurrent` and :class:`Repeat`
are EasyRec's recurrent and repeat layers; :class:`BackboneDense` is a RankModel's dense
part over the graph.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

from typing import Optional

import torch
from torch import nn


class ReadInput(nn.Module):
    """One input of a block: the registers of a value, then its transforms."""

    index: list[int]

    def __init__(self, index: list[int], transform: nn.Module) -> None:
        super().__init__()
        self.index = [int(i) for i in index]
        self.transform = transform

    def forward(self, regs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The transformed input's leaves."""
        return self.transform([regs[i] for i in self.index])


class Chain(nn.Module):
    """Modules over leaves applied in order."""

    def __init__(self, steps: list[nn.Module]) -> None:
        super().__init__()
        self.steps = nn.ModuleList(steps)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The last step's leaves."""
        for step in self.steps:
            xs = step(xs)
        return xs


class BlockNode(nn.Module):
    """One block: its inputs read and merged, then its layers.

    A node only the training loss reads (``skip_in_eval``: an auxiliary loss and the blocks
    only it reads) is not run in evaluation: its ``leaves`` registers hold empty tensors
    there, which nothing reads.
    """

    __constants__ = ["skip_in_eval", "leaves"]

    def __init__(self, reads: list[nn.Module], merge: nn.Module, layer: nn.Module,
                 leaves: int = 1) -> None:
        super().__init__()
        self.reads = nn.ModuleList(reads)
        self.merge = merge
        self.layer = layer
        self.skip_in_eval = False
        self.leaves = int(leaves)

    def forward(self, regs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The block's output leaves."""
        if self.skip_in_eval and not self.training:
            empty = regs[0].new_empty(0)
            return [empty for _ in range(self.leaves)]
        parts: list[torch.Tensor] = []
        for read in self.reads:
            parts.extend(read(regs))
        return self.layer(self.merge(parts))


class GroupRead(nn.Module):
    """An input layer as the layer of a block a package call runs.

    It reads the leaves ``[pooled, dense]`` (registers 0 and 1).
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The input layer's output leaves."""
        return self.layer(xs[0], xs[1])


class Recurrent(nn.Module):
    """EasyRec's recurrent layer (module docstring)."""

    __constants__ = ["fixed", "items", "step_list"]

    def __init__(self, steps: list[nn.Module], fixed: int, items: int, step_list: bool) -> None:
        super().__init__()
        self.steps = nn.ModuleList(steps)
        self.fixed = int(fixed)
        self.items = int(items)
        self.step_list = bool(step_list)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The last step's output (with a fixed item: the other items after the last step)."""
        out = xs
        for step in self.steps:
            y = step(out)
            if self.fixed < 0:
                out = y
            else:
                new: list[torch.Tensor] = []
                j = 0
                for idx in range(self.items):
                    if idx == self.fixed:
                        new.append(out[idx])
                    else:
                        new.append(y[j] if self.step_list else y[0])
                        j += 1
                out = new
        if self.fixed >= 0:
            return out[: self.fixed] + out[self.fixed + 1 :]
        return out


class Repeat(nn.Module):
    """EasyRec's repeat layer (module docstring); ``dim`` < 0: the outputs as a list."""

    __constants__ = ["dim"]

    def __init__(self, copies: list[nn.Module], dim: int) -> None:
        super().__init__()
        self.copies = nn.ModuleList(copies)
        self.dim = int(dim)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The copies' outputs."""
        outs: list[torch.Tensor] = []
        for copy in self.copies:
            outs.extend(copy(xs))
        if self.dim >= 0:
            return [torch.cat(outs, dim=self.dim)]
        return outs


class BackboneGraph(nn.Module):
    """The blocks; scriptable.

    ``forward(pooled, dense)`` returns the registers: ``pooled`` and ``dense``, then every
    block's output leaves (the input layers', then the other blocks' in topological order,
    a package call's among them).

    Args:
        inputs: the input-layer blocks.
        nodes: the other blocks in topological order.
        aux_index: the registers of the auxiliary losses (``AuxiliaryLoss`` blocks).
    """

    aux_index: list[int]

    def __init__(self, inputs: list[nn.Module], nodes: list[nn.Module],
                 aux_index: Optional[list[int]] = None) -> None:
        super().__init__()
        # Registration order fixes the dense optimizer's parameter order in checkpoints.
        self.inputs = nn.ModuleList(inputs)
        self.nodes = nn.ModuleList(nodes)
        self.aux_index = [int(i) for i in (aux_index or [])]

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> list[torch.Tensor]:
        """The blocks' output leaves."""
        regs: list[torch.Tensor] = [pooled, dense]
        for group in self.inputs:
            regs.extend(group(pooled, dense))
        for node in self.nodes:
            regs.extend(node(regs))
        return regs

    def auxiliary_loss(self, regs: list[torch.Tensor]) -> torch.Tensor:
        """The auxiliary losses' sum in training (0-d); 0 in evaluation or without any."""
        aux = regs[0].new_zeros(())
        if self.training:
            for i in self.aux_index:
                aux = aux + regs[i]
        return aux


class GraphDense(nn.Module):
    """A model's dense part over a backbone graph; scriptable.

    ``forward(pooled, dense)`` gives the logits, ``logits_and_aux_loss(pooled, dense)`` the
    logits and the graph's auxiliary losses (``has_aux_loss``: the graph has some). A
    subclass computes its logits from the registers in :meth:`logits`.

    Args:
        graph: the blocks.
    """

    __constants__ = ["has_aux_loss"]

    def __init__(self, graph: BackboneGraph) -> None:
        super().__init__()
        self.graph = graph
        self.has_aux_loss = bool(graph.aux_index)

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """The logits."""
        return self.logits(self.graph(pooled, dense), pooled)

    def logits_and_aux_loss(self, pooled: torch.Tensor, dense: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and the sum of the auxiliary losses (0 in evaluation)."""
        regs = self.graph(pooled, dense)
        return self.logits(regs, pooled), self.graph.auxiliary_loss(regs)

    def logits(self, regs: list[torch.Tensor], pooled: torch.Tensor) -> torch.Tensor:
        """The logits from the registers."""
        raise NotImplementedError


class BackboneDense(GraphDense):
    """A RankModel's dense part: ``forward(pooled, dense) -> logits``; scriptable.

    Args:
        graph: the blocks.
        output_index: registers of the output's tensors (concatenated on the last axis).
        top: ``top_mlp`` (identity when unset).
        out: the Linear layer to ``num_class`` logits, or None.
        num_class: outputs.
        wide_start: the first pooled column of the wide lookups (they end the pooled group)
            when their sum joins the logit (RankModel's ``wide_to_logit``); -1: it does not.
    """

    __constants__ = ["has_aux_loss", "num_class", "wide_start"]
    output_index: list[int]

    def __init__(self, graph: BackboneGraph, output_index: list[int], top: nn.Module,
                 out: Optional[nn.Module], num_class: int, wide_start: int = -1) -> None:
        super().__init__(graph)
        self.top = top
        self.out = out
        self.output_index = [int(i) for i in output_index]
        self.num_class = max(int(num_class), 1)
        self.wide_start = int(wide_start)  # >= 0: the wide lookups' columns, summed in

    def logits(self, regs: list[torch.Tensor], pooled: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` (``[B, C]`` for C > 1)."""
        x = torch.cat([regs[i] for i in self.output_index], dim=-1)
        x = self.top(x)
        out = self.out
        if out is not None:
            x = out(x)
        if self.num_class > 1:
            return x
        logit = x.squeeze(1)
        if self.wide_start >= 0:  # the first-order path around top_mlp / the output layer
            logit = logit + pooled[:, self.wide_start :].sum(dim=1)
        return logit
