"""The dense optimizers of TF's update rules that ``torch.optim`` lacks.

EasyRec's optimizers are TensorFlow's; where torch's namesake differs, odl's dense parameters
take TF's rule (``odl.train.optimizer_builder.make_dense_optimizer`` picks them):

* :class:`DecoupledAdamW` / :class:`DecoupledMomentumW`: TF contrib's decoupled weight decay
  (``p -= weight_decay * p``, not scaled by the learning rate) before an Adam / momentum step;
* :class:`TfRmsProp`: TF's RMSProp (the mean square starts at 1, epsilon under the root);
* :class:`FtrlProximal`: TF's FTRL-Proximal (ApplyFtrlV2);
* :class:`AdagradDecay`: DeepRec's AdagradDecay (ApplyAdagradDecay), an odl extension.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["AdagradDecay", "DecoupledAdamW", "DecoupledMomentumW", "FtrlProximal",
           "TfRmsProp"]


def _set_step_decay(groups: list[dict[str, Any]], weight_decay: float) -> None:
    """Gives every parameter group TF contrib's decoupled decay per step (unless it has one)."""
    for group in groups:
        group.setdefault("step_weight_decay", float(weight_decay))


def _decay_parameters(groups: list[dict[str, Any]]) -> None:
    """``p -= step_weight_decay * p`` for every parameter with a gradient.

    TF decays the variables it updates; the decay is not scaled by the learning rate.
    """
    for group in groups:
        decay = group["step_weight_decay"]
        if decay:
            for p in group["params"]:
                if p.grad is not None:
                    p.mul_(1.0 - decay)


class DecoupledAdamW(torch.optim.Adam):
    """EasyRec's (TF contrib) AdamW: ``p -= weight_decay * p``, then an Adam step.

    Unlike ``torch.optim.AdamW`` the decay is not multiplied by the learning rate. Only
    parameters with a gradient decay (TF decays the variables it updates).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: Adam's ``(beta1, beta2)``.
        weight_decay: decay per step.
        eps: Adam's epsilon.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 1e-6,
                 eps: float = 1e-8) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps)
        _set_step_decay(self.param_groups, weight_decay)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Decays every parameter that has a gradient, then takes an Adam step."""
        _decay_parameters(self.param_groups)
        return super().step(closure)


class DecoupledMomentumW(torch.optim.SGD):
    """EasyRec's (TF contrib) MomentumW: ``p -= weight_decay * p``, then TF's momentum step.

    TF's momentum (``accum = momentum * accum + g``, ``p -= lr * accum``) is torch's SGD with
    momentum and no dampening. The decay is not multiplied by the learning rate; only
    parameters with a gradient decay.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        momentum: momentum.
        weight_decay: decay per step.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.9,
                 weight_decay: float = 1e-6) -> None:
        super().__init__(params, lr=lr, momentum=momentum)
        _set_step_decay(self.param_groups, weight_decay)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Decays every parameter that has a gradient, then takes a momentum step."""
        _decay_parameters(self.param_groups)
        return super().step(closure)


class _PerParameterOptimizer(torch.optim.Optimizer):
    """An optimizer that updates every parameter with a gradient on its own (``_update``)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, self.state[p], group)
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any],
                group: dict[str, Any]) -> None:
        """Updates ``p`` in place from its gradient ``g``, its ``state`` and its group."""
        raise NotImplementedError


class TfRmsProp(_PerParameterOptimizer):
    """TF's ``RMSPropOptimizer`` (not centered), as EasyRec's ``rms_prop_optimizer``.

    Per coordinate::

        ms  = decay * ms + (1 - decay) * g * g        (ms starts at 1)
        mom = momentum * mom + lr * g / sqrt(ms + epsilon)
        p  -= mom

    ``torch.optim.RMSprop`` differs: its mean square starts at 0 and its epsilon is added
    outside the root.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (read from the group every step, so schedules apply).
        decay: decay of the mean square.
        momentum: momentum.
        eps: added to the mean square under the root.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, decay: float = 0.9,
                 momentum: float = 0.9, eps: float = 1.0) -> None:
        super().__init__(params, {"lr": lr, "decay": decay, "momentum": momentum, "eps": eps})

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any],
                group: dict[str, Any]) -> None:
        """One RMSProp update of ``p``."""
        if not state:
            state["mean_square"] = torch.ones_like(p)
            state["momentum_buffer"] = torch.zeros_like(p)
        ms, mom, rho = state["mean_square"], state["momentum_buffer"], group["decay"]
        ms.mul_(rho).addcmul_(g, g, value=1.0 - rho)
        mom.mul_(group["momentum"]).add_(group["lr"] * g / (ms + group["eps"]).sqrt())
        p.sub_(mom)


class FtrlProximal(_PerParameterOptimizer):
    """FTRL-Proximal as TF's ``FtrlOptimizer`` (the ApplyFtrlV2 update), per coordinate.

    With ``g`` the gradient, ``n`` the accumulator and ``z`` the linear term::

        g_s = g + 2 * l2_shrinkage * w
        n'  = n + g * g
        z  += g_s - (n' ** -lr_power - n ** -lr_power) / lr * w
        w   = (sign(z) * l1 - z) / (n' ** -lr_power / lr + 2 * l2)   if |z| > l1 else 0
        n   = n'

    Args:
        params: parameters or parameter groups.
        lr: learning rate (> 0; read from the group every step, so schedules apply).
        lr_power: power of the per-coordinate rate (<= 0).
        initial_accumulator_value: starting ``n`` (> 0).
        l1: L1 strength.
        l2: L2 strength.
        l2_shrinkage: L2 shrinkage strength.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, lr_power: float = -0.5,
                 initial_accumulator_value: float = 0.1, l1: float = 0.0, l2: float = 0.0,
                 l2_shrinkage: float = 0.0) -> None:
        defaults = {"lr": lr, "lr_power": lr_power,
                    "initial_accumulator_value": initial_accumulator_value, "l1": l1, "l2": l2,
                    "l2_shrinkage": l2_shrinkage}
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any],
                group: dict[str, Any]) -> None:
        """One FTRL update of ``p``."""
        lr, power = group["lr"], group["lr_power"]
        l1, l2, shrink = group["l1"], group["l2"], group["l2_shrinkage"]
        if not state:
            state["accumulator"] = torch.full_like(p, group["initial_accumulator_value"])
            state["linear"] = torch.zeros_like(p)
        n, z = state["accumulator"], state["linear"]
        g_s = g + 2.0 * shrink * p if shrink else g
        n_new = n + g * g
        n_pow_new = n_new.pow(-power)
        z.add_(g_s - (n_pow_new - n.pow(-power)) / lr * p)
        quadratic = n_pow_new / lr + 2.0 * l2
        w = (torch.sign(z) * l1 - z) / quadratic
        p.copy_(torch.where(z.abs() > l1, w, torch.zeros_like(w)))
        n.copy_(n_new)


class AdagradDecay(_PerParameterOptimizer):
    """DeepRec's ``AdagradDecayOptimizer`` on dense parameters (its ``ApplyAdagradDecay``).

    Per parameter, with ``t`` its update count (the global step of a run trained from the
    start) and ``p`` its count of decays::

        if t // accumulator_decay_step > p:
            a = max(a * accumulator_decay_rate, initial_accumulator_value); p += 1
        a += g * g
        w -= lr * g / sqrt(a)

    Args:
        params: parameters or parameter groups.
        lr: learning rate (read from the group every step, so schedules apply).
        initial_accumulator_value: starting ``a`` and the floor of a decay (> 0).
        accumulator_decay_step: updates per decay period (> 0).
        accumulator_decay_rate: factor of one decay, in (0, 1).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 initial_accumulator_value: float = 0.1, accumulator_decay_step: int = 100000,
                 accumulator_decay_rate: float = 0.9) -> None:
        defaults = {"lr": lr, "initial_accumulator_value": initial_accumulator_value,
                    "accumulator_decay_step": int(accumulator_decay_step),
                    "accumulator_decay_rate": accumulator_decay_rate}
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any],
                group: dict[str, Any]) -> None:
        """One AdagradDecay update of ``p``."""
        init = group["initial_accumulator_value"]
        if not state:
            state["accumulator"] = torch.full_like(p, init)
            state["step"] = torch.zeros((), dtype=torch.float64)
            state["decay_power"] = torch.zeros((), dtype=torch.float64)
        a = state["accumulator"]
        state["step"] += 1
        if int(state["step"]) // group["accumulator_decay_step"] > int(state["decay_power"]):
            a.mul_(group["accumulator_decay_rate"]).clamp_(min=init)
            state["decay_power"] += 1
        a.addcmul_(g, g)
        p.addcdiv_(g, a.sqrt(), value=-group["lr"])
