"""The tables' and the dense part's learning rates, following their schedules.

The tables' optimizer is fused into TorchRec's backward (fbgemm); the wide tables at
``wide_learning_rate_multiplier`` times the rate form a second fused group (a separate
kernel); under in-batch learning they always do, and their multiplier follows the wide
rate of :mod:`odl.train.in_batch.wide_rate`, pushed before the step's forward (where the
kernel takes its rate) when it changed. Tables that ``freeze_gradient`` froze
(:mod:`odl.train.frozen_parameters`) form a group of their own at rate 0, never pushed.
Before each step the rates of the step are pushed to both optimizers when they changed
(:mod:`odl.train.optimizer_builder` makes the schedules).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torchrec.optim as trec_optim
from torch import nn
from torch.optim import Optimizer
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from odl.models.embedding_tables import WIDE_SUFFIX
from odl.train.dense_parts import PartitionedDenseOptimizer
from odl.train.optimizer_builder import OptimizerSpec, sparse_optimizer_args

# The relative offset that keeps the wide tables' kernel apart at a multiplier of 1.
_APART = 1e-6


def _frozen_group(cls: type, kwargs: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The frozen tables' optimizer: the tables' own kind (the same state) at rate 0.

    Kept apart from the other tables' kernel whatever their rate (a schedule may start at
    0): an ``eps`` a hair apart, or SGD (stateless) with its gradient clamped to 0.
    """
    if "eps" in kwargs:
        return cls, {**kwargs, "lr": 0.0, "eps": kwargs["eps"] * (1 + _APART)}
    return trec_optim.SGD, {"lr": 0.0, "gradient_clipping": True, "max_gradient": 0.0}


class LearningRates:
    """The rates of a train module's two optimizers (module docstring).

    Args:
        sparse: the tables' optimizer and schedule.
        dense: the dense part's optimizer and schedule.
        wide_multiplier: the wide tables' rate over the other tables' (at the start).
        separate_wide: the wide tables get their own group whatever the multiplier (it
            changes while training: ``set_wide_multiplier``).
    """

    def __init__(self, sparse: OptimizerSpec, dense: OptimizerSpec,
                 wide_multiplier: float, separate_wide: bool = False) -> None:
        self._sparse = sparse
        self._dense = dense
        self._wide_multiplier = float(wide_multiplier)
        self._separate_wide = bool(separate_wide)
        self._current: tuple[float, float] | None = None
        self._parts: tuple[float, ...] = ()  # the dense part optimizers' rates last set
        self._groups: list[tuple[dict, bool]] | None = None
        self._frozen: frozenset[str] = frozenset()

    def fuse_table_optimizer(self, ebc: nn.Module, device_type: str,
                             frozen: Collection[str] = ()) -> None:
        """Fuses the tables' optimizer into the backward (module docstring).

        Args:
            ebc: the model's embedding bag collection.
            device_type: ``"cpu"`` or ``"cuda"``.
            frozen: tables ``freeze_gradient`` froze (``odl.train.frozen_parameters``):
                their own group at rate 0, never pushed.
        """
        cls, kwargs = sparse_optimizer_args(self._sparse, device_type)
        self._frozen = frozenset(frozen)
        named = [(n.split(".")[-2], p) for n, p in ebc.named_parameters()]
        held = [p for t, p in named if t in self._frozen]
        if held:
            frozen_cls, frozen_kwargs = _frozen_group(cls, kwargs)
            apply_optimizer_in_backward(frozen_cls, held, frozen_kwargs)
        named = [(t, p) for t, p in named if t not in self._frozen]
        wide = [p for t, p in named if t.endswith(WIDE_SUFFIX)]
        if (self._wide_multiplier != 1.0 or self._separate_wide) and wide:
            wide_ids = {id(p) for p in wide}
            rest = [p for _, p in named if id(p) not in wide_ids]
            if rest:
                apply_optimizer_in_backward(cls, rest, kwargs)
            # TorchRec puts tables of equal optimizer settings in one kernel: at a multiplier
            # of 1 the wide group's rate starts a hair apart so that it stays its own group
            # (the first ``set`` pushes the exact rate before any update)
            lr = kwargs["lr"] * self._wide_multiplier
            apply_optimizer_in_backward(
                cls, wide, {**kwargs, "lr": lr * (1 + _APART) if lr == kwargs["lr"] else lr})
        elif named:
            apply_optimizer_in_backward(cls, [p for _, p in named], kwargs)

    def at(self, step: int) -> tuple[float, float]:
        """``(tables, dense)`` rates of the step after ``step`` steps."""
        return self._sparse.schedule(step), self._dense.schedule(step)

    @property
    def tables(self) -> float:
        """The tables' rate last set (call :meth:`set` first)."""
        assert self._current is not None
        return self._current[0]

    def set(self, step: int, fused: Any, dense: Optimizer | PartitionedDenseOptimizer) -> None:
        """Pushes the rates of ``step`` to both optimizers when they changed.

        Args:
            step: the global step.
            fused: the fused table optimizer (``DistributedModelParallel.fused_optimizer``).
            dense: the dense optimizer.
        """
        rates = self.at(step)
        partitioned = isinstance(dense, PartitionedDenseOptimizer)
        parts = dense.rates(step) if partitioned else ()
        if (rates, parts) == (self._current, self._parts):
            return
        self._push(rates[0], fused)
        if partitioned:  # each part optimizer on its own schedule
            dense.set_rates(step)
        else:
            for g in dense.param_groups:
                g["lr"] = rates[1]
        self._current, self._parts = rates, parts

    def reset(self) -> None:
        """The step moved (a restore): the next :meth:`set` pushes the rates again."""
        self._current = None

    def set_wide_multiplier(self, multiplier: float, fused: Any) -> None:
        """Sets the wide tables' multiplier, pushed to their kernel at once when it changed.

        Args:
            multiplier: the wide tables' rate over the table rate.
            fused: the fused table optimizer.
        """
        if multiplier == self._wide_multiplier:
            return
        self._wide_multiplier = float(multiplier)
        if self._current is not None:  # (else the next ``set`` pushes it)
            self._push(self._current[0], fused)

    @property
    def wide_multiplier(self) -> float:
        """The wide tables' rate over the table rate."""
        return self._wide_multiplier

    def _push(self, rate: float, fused: Any) -> None:
        for g, wide in self.fused_groups(fused):
            g["lr"] = rate * (self._wide_multiplier if wide else 1.0)
        fused.step()  # fused optimizers only push the lr to the kernel here

    def fused_groups(self, fused: Any) -> list[tuple[dict, bool]]:
        """Each fused parameter group, and whether it is the wide tables' group.

        The frozen tables' group is not among them (it stays at rate 0).
        """
        if self._groups is None:
            groups: list[tuple[dict, bool]] = []
            pending: list[Any] = [fused]
            while pending:
                opt = pending.pop()
                if hasattr(opt, "optimizers"):  # a CombinedOptimizer: (name, optimizer) pairs
                    pending.extend(o for _, o in opt.optimizers)
                    continue
                tables = {n.split(".")[-2] for n in getattr(opt, "params", {})}
                if tables and tables <= self._frozen:  # (stays at rate 0)
                    continue
                wide = any(t.endswith(WIDE_SUFFIX) for t in tables)
                groups.extend((g, wide) for g in opt.param_groups)
            self._groups = groups
        return self._groups
