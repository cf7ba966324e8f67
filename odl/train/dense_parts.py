"""TorchEasyRec's ``part_optimizers``: the dense parameters split by name between optimizers.

``train_config.dense_optimizer.part_optimizers`` gives other optimizers for some dense
parameters: each entry takes the parameters whose names (odl's: ``dense.dnn.0.weight``, as
``TrainModule.dense_parameters()`` and the checkpoints name them) its ``regex_pattern``
matches in full (``re.fullmatch``, as TorchEasyRec), a parameter going to the first entry that
matches; the rest stay with ``dense_optimizer``. Each keeps its own schedule (an entry without
one follows ``dense_optimizer``'s from its own ``lr``). An entry matching no parameter is
logged as a warning (odl's names are not TorchEasyRec's module paths) and builds nothing.

:class:`PartitionedDenseOptimizer` steps them together as one optimizer: ``zero_grad``,
``step``, ``param_groups`` (every part's, for gradient clipping), ``set_rates`` and a
``state_dict`` keyed by part and parameter name, so a checkpoint restores into the same split;
a checkpoint of another split (or of one optimizer) leaves the dense optimizers' state fresh,
with a warning, and restores everything else.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch

from odl.train.optimizer_builder import DensePart, OptimizerSpec, make_dense_optimizer

logger = logging.getLogger(__name__)

__all__ = ["PartitionedDenseOptimizer", "build_dense_optimizer", "load_dense_optimizer_state"]

MAIN = "dense_optimizer"


class PartitionedDenseOptimizer:
    """The dense optimizer and its part optimizers, stepped as one (module docstring).

    Args:
        named_parameters: the dense parameters with their names.
        main: ``dense_optimizer``'s spec.
        parts: the part optimizers, in the config's order.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 main: OptimizerSpec, parts: list[DensePart]) -> None:
        taken: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in parts]
        rest: list[tuple[str, torch.nn.Parameter]] = []
        named = list(named_parameters)
        for name, p in named:
            for i, part in enumerate(parts):
                if re.fullmatch(part.pattern, name):
                    taken[i].append((name, p))
                    break
            else:
                rest.append((name, p))
        # (label, parameter names, optimizer, spec)
        self.parts: list[tuple[str, list[str], torch.optim.Optimizer, OptimizerSpec]] = []
        for part, params in zip(parts, taken, strict=True):
            where = part.spec.source.rsplit(".", 1)[0]
            if not params and any(re.fullmatch(part.pattern, n) for n, _ in named):
                logger.warning("%s.regex_pattern %r matches only dense parameters an earlier "
                               "entry takes; it trains nothing", where, part.pattern)
                continue
            if not params:
                logger.warning("%s.regex_pattern %r matches no dense parameter (their names: "
                               "%s); it trains nothing", where, part.pattern,
                               ", ".join(n for n, _ in named[:4]) + (", ..." if len(named) > 4
                                                                     else ""))
                continue
            logger.info("%s (%s) trains %d dense parameters: %s", where, part.spec.kind,
                        len(params), ", ".join(n for n, _ in params))
            self.parts.append((where, [n for n, _ in params],
                               make_dense_optimizer(part.spec, [p for _, p in params]),
                               part.spec))
        if rest:
            self.parts.insert(0, (MAIN, [n for n, _ in rest],
                                  make_dense_optimizer(main, [p for _, p in rest]), main))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every part's parameter groups."""
        return [g for _, _, opt, _ in self.parts for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears every part's gradients."""
        for _, _, opt, _ in self.parts:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Steps every part."""
        for _, _, opt, _ in self.parts:
            opt.step()

    def rates(self, step: int) -> tuple[float, ...]:
        """Each part's rate at ``step``, in order."""
        return tuple(spec.schedule(step) for _, _, _, spec in self.parts)

    def set_rates(self, step: int) -> None:
        """Sets each part's rate to its schedule's at ``step``."""
        for _, _, opt, spec in self.parts:
            rate = spec.schedule(step)
            for g in opt.param_groups:
                g["lr"] = rate

    def state_dict(self) -> dict[str, Any]:
        """``{"parts": [{"label", "params", "state"}]}``: each part's torch state."""
        return {"parts": [{"label": label, "params": list(names), "state": opt.state_dict()}
                          for label, names, opt, _ in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores each part's state when the checkpoint split the parameters alike.

        Args:
            state: :meth:`state_dict`'s form (another form leaves the state fresh).
        """
        saved = state.get("parts") if isinstance(state, dict) else None
        ours = [(label, list(names)) for label, names, _, _ in self.parts]
        if saved is None or [(s.get("label"), list(s.get("params", []))) for s in saved] != ours:
            logger.warning("the checkpoint's dense optimizer state is of another split of the "
                           "dense parameters (part_optimizers changed): the dense optimizers "
                           "start fresh; parameters, tables and positions are restored")
            return
        for (_, _, opt, _), s in zip(self.parts, saved, strict=True):
            opt.load_state_dict(s["state"])


def build_dense_optimizer(named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                          main: OptimizerSpec, parts: list[DensePart]) -> Any:
    """The dense parameters' optimizer: a ``torch.optim`` one, or a partitioned one with parts.

    Args:
        named_parameters: the dense parameters with their names.
        main: ``dense_optimizer``'s spec.
        parts: ``optimizer_builder.dense_part_specs(...)`` (``[]``: one optimizer).
    """
    if not parts:
        return make_dense_optimizer(main, [p for _, p in named_parameters])
    return PartitionedDenseOptimizer(named_parameters, main, parts)


def load_dense_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """Restores a checkpoint's dense optimizer state into ``optimizer``.

    A state of part optimizers restored into one optimizer (``part_optimizers`` removed from
    the config) leaves it fresh, with a warning; the partitioned optimizer handles the other
    mismatches itself.

    Args:
        optimizer: the module's dense optimizer.
        state: the checkpoint's ``dense_optimizer`` entry.
    """
    if not isinstance(optimizer, PartitionedDenseOptimizer) and "parts" in state:
        logger.warning("the checkpoint's dense optimizer state is of part optimizers, which "
                       "the config no longer sets: the dense optimizer starts fresh; "
                       "parameters, tables and positions are restored")
        return
    optimizer.load_state_dict(state)
