"""Learning-rate schedules of both config forms (``schedule(step)``, ``step`` = steps taken).

* constant: ``lr``.
* exponential decay (:class:`LrSchedule`), EasyRec: ``max(initial * factor ** p, min_lr)``,
  ``p = (step - burnin_steps) / decay_steps`` (``floor``-ed when ``staircase``); during the
  burn-in (``step < burnin_steps``) ``max(burnin + (initial - burnin) * step / burnin_steps,
  min_lr)``, or ``initial`` when ``burnin_learning_rate`` is 0. TorchEasyRec: the same with
  ``lr``, ``decay_size``, ``decay_factor``, ``warmup_size``, ``warmup_learning_rate``, except
  that the warm-up always ramps and is not floored at ``min_learning_rate``.
* EasyRec cosine decay (:class:`CosineDecaySchedule`), polynomial decay
  (:class:`PolynomialDecaySchedule`) and Transformer schedule (:class:`TransformerSchedule`),
  manual steps of both forms (:class:`ManualStepSchedule`), TorchEasyRec cosine annealing
  (:class:`CosineAnnealingSchedule`) and with warm restarts
  (:class:`CosineWarmRestartsSchedule`): the formulas in their docstrings, as in EasyRec's
  ``learning_schedules.py`` / TF's ``polynomial_decay`` and TorchEasyRec's
  ``lr_scheduler.py``.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

__all__ = [
    "CosineAnnealingSchedule",
    "CosineDecaySchedule",
    "CosineWarmRestartsSchedule",
    "LrSchedule",
    "ManualStepSchedule",
    "PolynomialDecaySchedule",
    "Schedule",
    "TransformerSchedule",
]


def _warmup(step: int, steps: int, start: float, end: float) -> float:
    return start + (end - start) * step / steps


def _cosine(high: float, low: float, t: int, period: int) -> float:
    """``t`` steps into a cosine from ``high`` down to ``low`` over ``period`` steps."""
    return float(low + (high - low) * 0.5 * (1.0 + math.cos(math.pi * t / period)))


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
        return _cosine(self.base_lr, self.min_lr, min(step - self.warmup_steps, self.t_max),
                       self.t_max)


@dataclass(frozen=True)
class ManualStepSchedule:
    """Manual steps: EasyRec's ``manual_step_learning_rate``, TorchEasyRec's ``ManualStepLR``.

    ``k`` counts the boundaries passed: EasyRec's switch at their step (``boundary <= step``,
    object detection's ``manual_stepping``), TorchEasyRec's after it (``boundary < step``,
    its ``bisect_left``). ``rates[k - 1]`` once ``k > 0``; before, with ``warmup``,
    ``base_lr + (rates[0] - base_lr) * step / boundaries[0]``, else ``base_lr``.

    Attributes:
        base_lr: rate before the first boundary (EasyRec's ``initial_learning_rate``,
            TorchEasyRec's optimizer ``lr``).
        boundaries: increasing steps (> 0).
        rates: the rate after each boundary (as many).
        warmup: ramp to ``rates[0]`` over the first boundary's steps.
        at_boundary: switch at the boundary's step (EasyRec) rather than after it.
    """

    base_lr: float
    boundaries: tuple[int, ...]
    rates: tuple[float, ...]
    warmup: bool = False
    at_boundary: bool = True

    def __call__(self, step: int) -> float:
        """Rate to use for global step ``step``."""
        side = bisect.bisect_right if self.at_boundary else bisect.bisect_left
        k = side(self.boundaries, step)
        if k > 0:
            return float(self.rates[k - 1])
        if self.warmup:
            return float(_warmup(step, self.boundaries[0], self.base_lr, self.rates[0]))
        return float(self.base_lr)


@dataclass(frozen=True)
class TransformerSchedule:
    """EasyRec's ``transformer_learning_rate`` (its ``transformer_policy``, "noam").

    ``base_lr * hidden_size ** -0.5 * min((s + 1) * w ** -1.5, (s + 1) ** -0.5)`` with
    ``s = step * step_scaling_rate`` and ``w = warmup_steps * step_scaling_rate``: a linear
    rise to ``base_lr / sqrt(hidden_size * w)`` at the end of the warm-up, then the inverse
    square root of the step.

    Attributes:
        base_lr: multiplier (``learning_rate_base``).
        hidden_size: the model width.
        warmup_steps: steps of the rise.
        step_scaling_rate: scales the step and the warm-up.
    """

    base_lr: float
    hidden_size: int
    warmup_steps: int
    step_scaling_rate: float = 1.0

    def __call__(self, step: int) -> float:
        """Rate to use for global step ``step``."""
        s = step * self.step_scaling_rate + 1.0
        w = self.warmup_steps * self.step_scaling_rate
        return float(self.base_lr * self.hidden_size ** -0.5 * min(s * w ** -1.5, s ** -0.5))


@dataclass(frozen=True)
class CosineWarmRestartsSchedule:
    """TorchEasyRec's ``cosine_annealing_warm_restarts_learning_rate``.

    The warm-up as :class:`CosineAnnealingSchedule`'s; then, ``e = step - warmup_steps``
    steps in, period ``i`` (``t_0 * t_mult ** i`` steps long) holds ``e`` at ``t`` steps from
    its start, and the rate is ``min_lr + (base_lr - min_lr) * 0.5 * (1 + cos(pi * t /
    period))``: every period restarts at ``base_lr``. The period is found by whole-step
    arithmetic (TorchEasyRec takes a floating-point logarithm, which can place a period's
    first step at the end of the one before).

    Attributes:
        base_lr: the optimizer's ``lr``.
        t_0: first period in steps.
        t_mult: growth of the period per restart (1: equal periods).
        min_lr: lower bound.
        warmup_lr: rate at step 0.
        warmup_steps: warm-up length.
    """

    base_lr: float
    t_0: int
    t_mult: int = 1
    min_lr: float = 0.0
    warmup_lr: float = 0.0
    warmup_steps: int = 0

    def __call__(self, step: int) -> float:
        """Rate to use for global step ``step``."""
        if step < self.warmup_steps:
            return float(_warmup(step, self.warmup_steps, self.warmup_lr, self.base_lr))
        t, period = step - self.warmup_steps, self.t_0
        if self.t_mult == 1:
            t %= period
        else:
            while t >= period:
                t -= period
                period *= self.t_mult
        return _cosine(self.base_lr, self.min_lr, t, period)


Schedule = (LrSchedule | CosineDecaySchedule | PolynomialDecaySchedule | CosineAnnealingSchedule
            | ManualStepSchedule | TransformerSchedule | CosineWarmRestartsSchedule)
