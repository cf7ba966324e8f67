"""Learning-rate schedules of both config forms (``schedule(step)``, ``step`` = steps taken).

* constant: ``lr``.
* exponential decay (:class:`LrSchedule`), EasyRec: ``max(initial * factor ** p, min_lr)``,
  ``p = (step - burnin_steps) / decay_steps`` (``floor``-ed when ``staircase``); during the
  burn-in (``step < burnin_steps``) ``max(burnin + (initial - burnin) * step / burnin_steps,
  min_lr)``, or ``initial`` when ``burnin_learning_rate`` is 0. TorchEasyRec: the same with
  ``lr``, ``decay_size``, ``decay_factor``, ``warmup_size``, ``warmup_learning_rate``, except
  that the warm-up always ramps and is not floored at ``min_learning_rate``.
* EasyRec cosine decay (:class:`CosineDecaySchedule`) and polynomial decay
  (:class:`PolynomialDecaySchedule`), TorchEasyRec cosine annealing
  (:class:`CosineAnnealingSchedule`): the formulas in their docstrings, as in EasyRec's
  ``learning_schedules.py`` / TF's ``polynomial_decay`` and TorchEasyRec's
  ``lr_scheduler.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "CosineAnnealingSchedule",
    "CosineDecaySchedule",
    "LrSchedule",
    "PolynomialDecaySchedule",
    "Schedule",
]


def _warmup(step: int, steps: int, start: float, end: float) -> float:
    return start + (end - start) * step / steps


@dataclass(frozen=True)
class LrSchedule:
    """Exponential decay after an optional linear warm-up (constant when ``decay_steps`` is 0).

    Attributes:
        base_lr: rate at the end of the warm-up (step 0 without one).
        decay_steps: steps per decay period (0: no decay).
        decay_rate: multiplier per period.
        staircase: decay in whole periods.
        min_lr: lower bound.
        warmup_steps: warm-up length; the decay counts from its end.
        warmup_lr: rate at step 0 of the warm-up.
        floor_warmup: apply ``min_lr`` during the warm-up too (EasyRec's burn-in).
    """

    base_lr: float
    decay_steps: int = 0
    decay_rate: float = 1.0
    staircase: bool = True
    min_lr: float = 0.0
    warmup_steps: int = 0
    warmup_lr: float = 0.0
    floor_warmup: bool = False

    def __call__(self, step: int) -> float:
        """Rate to use for global step ``step``."""
        if step < self.warmup_steps:
            lr = _warmup(step, self.warmup_steps, self.warmup_lr, self.base_lr)
            return float(max(lr, self.min_lr) if self.floor_warmup else lr)
        if self.decay_steps <= 0:
            return float(self.base_lr)
        p = (step - self.warmup_steps) / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return float(max(self.base_lr * self.decay_rate**p, self.min_lr))


@dataclass(frozen=True)
class CosineDecaySchedule:
    """EasyRec's ``cosine_decay_learning_rate`` (``cosine_decay_with_warmup``).

    ``warmup_lr + (base_lr - warmup_lr) * step / warmup_steps`` while
    ``step < warmup_steps``; ``base_lr`` up to ``warmup_steps + hold_steps``; then
    ``0.5 * base_lr * (1 + cos(pi * (step - warmup - hold) / (total - warmup - hold)))``;
    0 after ``total_steps``.

    Attributes:
        base_lr: peak rate.
        total_steps: step at which the rate reaches 0.
        warmup_lr: rate at step 0.
        warmup_steps: warm-up length.
        hold_steps: steps at ``base_lr`` after the warm-up.
    """

    base_lr: float
    total_steps: int
    warmup_lr: float = 0.0
    warmup_steps: int = 0
    hold_steps: int = 0

    def __call__(self, step: int) -> float:
        """Rate to use for global step ``step``."""
        if step > self.total_steps:
            return 0.0
        if step < self.warmup_steps:
            return float(_warmup(step, self.warmup_steps, self.warmup_lr, self.base_lr))
        start = self.warmup_steps + self.hold_steps
        if step <= start:
            return float(self.base_lr)
        frac = (step - start) / (self.total_steps - start)
        return float(0.5 * self.base_lr * (1.0 + math.cos(math.pi * frac)))


@dataclass(frozen=True)
class PolynomialDecaySchedule:
    """EasyRec's ``poly_decay_learning_rate`` (TF ``polynomial_decay``, no cycling).

    ``(base_lr - end_lr) * (1 - min(step, total_steps) / total_steps) ** power + end_lr``.

    Attributes:
        base_lr: rate at step 0.
        total_steps: steps to reach ``end_lr``.
        power: exponent.
        end_lr: final rate.
    """

    base_lr: float
    total_steps: int
    power: float = 1.0
    end_lr: float = 0.0

    def __call__(self, step: int) -> float:
        """Rate to use for global step ``step``."""
        frac = min(step, self.total_steps) / self.total_steps
        return float((self.base_lr - self.end_lr) * (1.0 - frac) ** self.power + self.end_lr)


@dataclass(frozen=True)
class CosineAnnealingSchedule:
    """TorchEasyRec's ``cosine_annealing_learning_rate`` (``CosineAnnealingLR``).

    ``warmup_lr + (base_lr - warmup_lr) * step / warmup_steps`` while
    ``step < warmup_steps``; then ``min_lr + (base_lr - min_lr) * 0.5 * (1 + cos(pi * t /
    t_max))`` with ``t = min(step - warmup_steps, t_max)``.

    Attributes:
        base_lr: the optimizer's ``lr``.
        t_max: cosine length in steps.
        min_lr: final rate.
        warmup_lr: rate at step 0.
        warmup_steps: warm-up length.
    """

    base_lr: float
    t_max: int
    min_lr: float = 0.0
    warmup_lr: float = 0.0
    warmup_steps: int = 0

    def __call__(self, step: int) -> float:
        """Rate to use for global step ``step``."""
        if step < self.warmup_steps:
            return float(_warmup(step, self.warmup_steps, self.warmup_lr, self.base_lr))
        t = min(step - self.warmup_steps, self.t_max)
        scale = 0.5 * (1.0 + math.cos(math.pi * t / self.t_max))
        return float(self.min_lr + (self.base_lr - self.min_lr) * scale)


Schedule = LrSchedule | CosineDecaySchedule | PolynomialDecaySchedule | CosineAnnealingSchedule
