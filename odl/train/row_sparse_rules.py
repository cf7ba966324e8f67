"""Update rules of the row-sparse table optimizers: TF's sparse applies on gathered rows.

Each rule updates the ``U`` rows a step touched, given their summed gradient ``g`` ``[U,
D]`` (duplicates summed, as TF's ``_apply_sparse_duplicate_indices``), their weights ``w``
and their optimizer state, all gathered from the table; :mod:`odl.train.row_sparse_tables`
gathers and scatters. ``t`` is the global step counting this one (1 at the first step).

* ``adam`` / ``lazy_adam`` (LazyAdam, as ``tf.contrib.opt.LazyAdamOptimizer`` and fbgemm's
  Adam): ``m = b1 * m + (1 - b1) * g``, ``v = b2 * v + (1 - b2) * g * g`` for the touched
  rows only; EasyRec form ``w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``
  (TF's epsilon-hat); TorchEasyRec form ``w -= lr * m_hat / (sqrt(v_hat) + eps)`` with
  ``m_hat = m / (1 - b1^t)``, ``v_hat = v / (1 - b2^t)`` (torch / fbgemm), its
  ``weight_decay`` as fbgemm's table Adam has it: ``w -= lr * (m_hat / (sqrt(v_hat) + eps) +
  weight_decay * w)``.
* ``adamw``: the decoupled decay of the touched rows first, EasyRec ``w -= weight_decay *
  w`` (``tf.contrib.opt.AdamWOptimizer``, as :class:`odl.train.optimizer_builder.
  DecoupledAdamW`), TorchEasyRec ``w -= lr * weight_decay * w`` (``torch.optim.AdamW``),
  then the Adam step of its form.
* ``ftrl``: TF's ``SparseApplyFtrlV2`` (``tf.train.FtrlOptimizer``), with ``p =
  learning_rate_power``: ``g_s = g + 2 * l2_shrinkage * w``, ``n' = n + g * g``, ``z += g_s -
  (n'^-p - n^-p) / lr * w``, ``w = (sign(z) * l1 - z) / (n'^-p / lr + 2 * l2)`` where ``|z| >
  l1``, else 0. The accumulator is stored as ``n - initial_accumulator_value`` so that a
  zeroed row (a dynamic table's evicted row, a fresh table) is a fresh accumulator.
* ``momentum``: TF's ``SparseApplyMomentum``: ``a = momentum * a + g``, ``w -= lr * a``.
* ``lamb`` (TorchEasyRec's ``lamb_optimizer``, as fbgemm's fused LAMB on CUDA): Adam's
  moments of the touched rows, ``r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w``, then
  each row ``w -= lr * (|w| / |r|) * r`` with its own trust ratio (the rows' L2 norms). A
  row whose ``r`` is zero does not move (fbgemm divides by zero there); a row of zeros stays
  zero, as under fbgemm.
* ``partial_rowwise_adam`` / ``partial_rowwise_lamb`` (TorchEasyRec, fbgemm's partial
  row-wise kernels): Adam's / LAMB's rule with one second moment per row, ``v = b2 * v + (1 -
  b2) * mean(g * g over the row)`` (state ``[rows, 1]``); Adam adds ``weight_decay * w`` to
  its step (``w -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w)``, fbgemm's form).
* ``lars_sgd`` (TorchEasyRec, fbgemm's LARS-SGD): each row's own rate ``lr * eta * |w| /
  (|g| + weight_decay * |w|)`` (``eta`` 0.001, fbgemm's default, which TorchEasyRec keeps),
  ``a = momentum * a + rate * (g + weight_decay * w)``, ``w -= a``. A row whose rate's
  denominator is zero does not move (fbgemm divides by zero there), nor does a row of zeros.
* ``rmsprop``: EasyRec form, TF's ``SparseApplyRMSProp`` (``tf.train.RMSPropOptimizer``, not
  centered): ``ms = decay * ms + (1 - decay) * g * g``, ``mom = momentum * mom + lr * g /
  sqrt(ms + epsilon)``, ``w -= mom``; TF starts ``ms`` at 1, stored here as ``ms - 1`` so that
  a zeroed row is a fresh one. TorchEasyRec form, ``torch.optim.RMSprop`` without momentum:
  ``g += weight_decay * w``, ``sq = alpha * sq + (1 - alpha) * g * g``, ``w -= lr * g /
  (sqrt(sq) + eps)``.
* ``adadelta`` (TorchEasyRec, ``torch.optim.Adadelta``): ``g += weight_decay * w``, ``sq = rho
  * sq + (1 - rho) * g * g``, ``d = sqrt(acc + eps) / sqrt(sq + eps) * g``, ``acc = rho * acc +
  (1 - rho) * d * d``, ``w -= lr * d``.
* ``momentumw`` (EasyRec, TF contrib's ``MomentumWOptimizer``): the touched rows' decoupled
  decay ``w -= weight_decay * w`` (not scaled by the rate), then TF's momentum step.
* ``rowwise_adagrad_with_decay`` (TorchEasyRec's ``rowwise_adagrad_optimizer`` with a
  ``weight_decay``; fbgemm's row-wise Adagrad rule, whose CPU kernel skips the decay): one
  accumulator per row (state ``[rows, 1]``), ``g' = g + weight_decay * w`` in mode L2 (else
  ``g``), ``a += mean(g' * g')`` over the row, ``m = lr / (sqrt(a) + eps)``, ``w = c * w - m *
  g`` with ``c = 1 - m * weight_decay`` (L2) or ``1 - lr * weight_decay`` (DECOUPLE).
* ``adagrad_decay`` (DeepRec's ``AdagradDecayOptimizer``, its ``SparseApplyAdagradDecay``):
  with ``p`` the row's count of decays (state ``[rows, 1]``), where ``t //
  accumulator_decay_step > p``: ``a = max(a * accumulator_decay_rate,
  initial_accumulator_value)``, ``p += 1``; then ``a += g * g``, ``w -= lr * g / sqrt(a)``. One
  decay per update: a row that missed periods catches up one per touch, as in DeepRec. The
  accumulator is stored as ``a - initial_accumulator_value`` (a zeroed row is a fresh one,
  its count 0 as DeepRec's new keys').
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from odl.config.optimizer_support import OptimizerChoice, table_optimizer_plan

if TYPE_CHECKING:
    from odl.train.optimizer_builder import OptimizerSpec

__all__ = ["ROW_SPARSE_STATE", "ROW_WISE_STATE", "RowSparseRule", "row_sparse_rule",
           "row_sparse_state_names"]

# kind -> names of its state tensors (each [rows, stored columns], or [rows, 1] for the names
# in ROW_WISE_STATE)
ROW_SPARSE_STATE: dict[str, tuple[str, ...]] = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
    "ftrl": ("accumulator", "linear"),
    "momentum": ("momentum_buffer",),
    "momentumw": ("momentum_buffer",),
    "lamb": ("exp_avg", "exp_avg_sq"),
    "partial_rowwise_adam": ("exp_avg", "exp_avg_sq_row"),
    "partial_rowwise_lamb": ("exp_avg", "exp_avg_sq_row"),
    "lars_sgd": ("momentum_buffer",),
    "rmsprop": ("mean_square", "momentum_buffer"),
    "adadelta": ("square_avg", "acc_delta"),
    "adagrad_decay": ("accumulator", "accumulator_decay_power"),
    "rowwise_adagrad_with_decay": ("momentum1_row",),
}
# TorchEasyRec's form where its state differs from EasyRec's (RMSprop without momentum)
_TORCH_FORM_STATE: dict[str, tuple[str, ...]] = {"rmsprop": ("square_avg",)}
# state kept as one value per row
ROW_WISE_STATE = frozenset({"exp_avg_sq_row", "accumulator_decay_power", "momentum1_row"})
# fbgemm's LARS-SGD trust coefficient (TorchEasyRec leaves it at fbgemm's default)
LARS_ETA = 1e-3

TF_EPSILON = 1e-8


@dataclass(frozen=True)
class RowSparseRule:
    """One row-sparse optimizer (module docstring).

    Attributes:
        kind: a key of ``ROW_SPARSE_STATE``.
        params: the optimizer's settings (``OptimizerSpec.params``).
        tf_form: EasyRec's (TF) form of Adam / AdamW / RMSProp; False: TorchEasyRec's
            (torch's, fbgemm's).
    """

    kind: str
    params: Mapping[str, Any] = field(default_factory=dict)
    tf_form: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROW_SPARSE_STATE:
            raise ValueError(f"no row-sparse rule for {self.kind!r}; "
                             f"known: {sorted(ROW_SPARSE_STATE)}")

    @property
    def state_names(self) -> tuple[str, ...]:
        """Names of the state tensors the rule keeps per table."""
        return row_sparse_state_names(self.kind, self.tf_form)

    def apply(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor], lr: float,
              t: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The touched rows' new weights and state.

        Args:
            w: the rows' weights ``[U, D]`` (not modified).
            g: their summed gradients ``[U, D]``.
            state: their state, one ``[U, D]`` (``[U, 1]`` row-wise) tensor per
                ``state_names`` (not modified).
            lr: the table's rate of this step.
            t: the global step counting this one (>= 1).

        Returns:
            ``(new weights, new state)``.
        """
        if self.kind == "ftrl":
            return self._ftrl(w, g, state, lr)
        if self.kind in ("momentum", "momentumw"):
            decay = float(self.params.get("weight_decay", 0.0)) if self.kind == "momentumw" else 0
            if decay:
                w = w * (1.0 - decay)
            a = state[0] * float(self.params.get("momentum", 0.9)) + g
            return w - lr * a, [a]
        if self.kind == "lamb":
            return self._lamb(w, g, state, lr, t)
        if self.kind in ("partial_rowwise_adam", "partial_rowwise_lamb"):
            return self._partial_rowwise(w, g, state, lr, t)
        if self.kind == "lars_sgd":
            return self._lars_sgd(w, g, state, lr)
        if self.kind == "rmsprop":
            return self._rmsprop(w, g, state, lr)
        if self.kind == "adadelta":
            return self._adadelta(w, g, state, lr)
        if self.kind == "adagrad_decay":
            return self._adagrad_decay(w, g, state, lr, t)
        if self.kind == "rowwise_adagrad_with_decay":
            return self._rowwise_adagrad_with_decay(w, g, state, lr)
        return self._adam(w, g, state, lr, t)

    def _rowwise_adagrad_with_decay(self, w: torch.Tensor, g: torch.Tensor,
                                    state: list[torch.Tensor],
                                    lr: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        p = self.params
        decay = float(p.get("weight_decay", 0.0))
        l2 = p.get("weight_decay_mode") == "L2"
        g_acc = g + decay * w if l2 else g
        a = state[0] + (g_acc * g_acc).mean(dim=1, keepdim=True)
        m = lr / (a.sqrt() + float(p.get("eps", TF_EPSILON)))
        c = 1.0 - m * decay if l2 else 1.0 - lr * decay
        return c * w - m * g, [a]

    def _adagrad_decay(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor],
                       lr: float, t: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        p = self.params
        init = float(p.get("initial_accumulator_value", 0.1))
        period = int(p.get("accumulator_decay_step", 100000))
        a, power = state[0] + init, state[1]
        due = power < float(t // period)
        a = torch.where(due, (a * float(p.get("accumulator_decay_rate", 0.9))).clamp_min(init), a)
        a = a + g * g
        return w - lr * g / a.sqrt(), [a - init, power + due.to(power.dtype)]

    def _partial_rowwise(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor],
                         lr: float, t: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        p = self.params
        b1, b2 = float(p.get("beta1", 0.9)), float(p.get("beta2", 0.999))
        eps = float(p.get("eps", TF_EPSILON))
        decay = float(p.get("weight_decay", 0.0))
        m = state[0] * b1 + g * (1.0 - b1)
        v = state[1] * b2 + (g * g).mean(dim=1, keepdim=True) * (1.0 - b2)
        r = (m / (1.0 - b1**t)) / ((v / (1.0 - b2**t)).sqrt() + eps)
        if decay:
            r = r + decay * w
        if self.kind == "partial_rowwise_adam":
            return w - lr * r, [m, v]
        return w - lr * _trust_ratio(w, r) * r, [m, v]

    def _lars_sgd(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor],
                  lr: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        p = self.params
        decay = float(p.get("weight_decay", 0.0))
        w_norm = w.norm(dim=1, keepdim=True)
        below = g.norm(dim=1, keepdim=True) + decay * w_norm
        rate = torch.where(below > 0, lr * LARS_ETA * w_norm / below.clamp_min(1e-38),
                           torch.zeros_like(below))
        a = state[0] * float(p.get("momentum", 0.9)) + rate * (g + decay * w)
        return w - a, [a]

    def _rmsprop(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor],
                 lr: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        p = self.params
        if self.tf_form:
            rho = float(p.get("decay", 0.9))
            ms = (state[0] + 1.0) * rho + g * g * (1.0 - rho)
            mom = state[1] * float(p.get("momentum", 0.9)) + lr * g / (
                ms + float(p.get("eps", 1.0))).sqrt()
            return w - mom, [ms - 1.0, mom]
        decay = float(p.get("weight_decay", 0.0))
        if decay:
            g = g + decay * w
        alpha = float(p.get("alpha", 0.99))
        sq = state[0] * alpha + g * g * (1.0 - alpha)
        return w - lr * g / (sq.sqrt() + float(p.get("eps", TF_EPSILON))), [sq]

    def _adadelta(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor],
                  lr: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        p = self.params
        rho, eps = float(p.get("rho", 0.95)), float(p.get("eps", 1e-6))
        decay = float(p.get("weight_decay", 0.0))
        if decay:
            g = g + decay * w
        sq = state[0] * rho + g * g * (1.0 - rho)
        d = (state[1] + eps).sqrt() / (sq + eps).sqrt() * g
        acc = state[1] * rho + d * d * (1.0 - rho)
        return w - lr * d, [sq, acc]

    def _lamb(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor], lr: float,
              t: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        p = self.params
        b1, b2 = float(p.get("beta1", 0.9)), float(p.get("beta2", 0.999))
        eps = float(p.get("eps", TF_EPSILON))
        m = state[0] * b1 + g * (1.0 - b1)
        v = state[1] * b2 + g * g * (1.0 - b2)
        r = (m / (1.0 - b1**t)) / ((v / (1.0 - b2**t)).sqrt() + eps)
        decay = float(p.get("weight_decay", 0.0))
        if decay:
            r = r + decay * w
        return w - lr * _trust_ratio(w, r) * r, [m, v]

    def _adam(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor], lr: float,
              t: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        p = self.params
        b1, b2 = float(p.get("beta1", 0.9)), float(p.get("beta2", 0.999))
        decay = float(p.get("weight_decay", 0.0))
        if self.kind == "adamw" and decay:
            w = w * (1.0 - (decay if self.tf_form else lr * decay))
            decay = 0.0
        m = state[0] * b1 + g * (1.0 - b1)
        v = state[1] * b2 + g * g * (1.0 - b2)
        if self.tf_form:
            step = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
            return w - step * m / (v.sqrt() + TF_EPSILON), [m, v]
        eps = float(p.get("eps", TF_EPSILON))
        r = (m / (1.0 - b1**t)) / ((v / (1.0 - b2**t)).sqrt() + eps)
        if decay:  # fbgemm's table Adam: the decay joins the step, scaled by the rate
            r = r + decay * w
        return w - lr * r, [m, v]

    def _ftrl(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor],
              lr: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if lr <= 0:  # FTRL divides by the rate: a rate of 0 leaves the rows as they are
            return w, state
        p = self.params
        power = float(p.get("lr_power", -0.5))
        init = float(p.get("initial_accumulator_value", 0.1))
        l1, l2 = float(p.get("l1", 0.0)), float(p.get("l2", 0.0))
        shrink = float(p.get("l2_shrinkage", 0.0))
        n = state[0] + init
        z = state[1]
        g_s = g + 2.0 * shrink * w if shrink else g
        n_new = n + g * g
        n_pow_new = n_new.pow(-power)
        z = z + g_s - (n_pow_new - n.pow(-power)) / lr * w
        quadratic = n_pow_new / lr + 2.0 * l2
        new_w = torch.where(z.abs() > l1, (torch.sign(z) * l1 - z) / quadratic,
                            torch.zeros_like(z))
        return new_w, [n_new - init, z]


def _trust_ratio(w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """LAMB's per-row ``|w| / |r|`` (0 where ``r`` is zero)."""
    w_norm = w.norm(dim=1, keepdim=True)
    r_norm = r.norm(dim=1, keepdim=True)
    return torch.where(r_norm > 0, w_norm / r_norm.clamp_min(1e-38), torch.zeros_like(r_norm))


def row_sparse_state_names(kind: str, tf_form: bool = True) -> tuple[str, ...]:
    """Names of the state tensors a row-sparse kind keeps per table, in its form.

    Args:
        kind: a key of ``ROW_SPARSE_STATE``.
        tf_form: EasyRec's form; False: TorchEasyRec's.

    Returns:
        The names (those in ``ROW_WISE_STATE`` are one value per row).
    """
    if not tf_form and kind in _TORCH_FORM_STATE:
        return _TORCH_FORM_STATE[kind]
    return ROW_SPARSE_STATE[kind]


def row_sparse_rule(spec: OptimizerSpec, device_type: str) -> RowSparseRule | None:
    """The row-sparse rule of the tables' optimizer on a device, None when it runs fused.

    Args:
        spec: the tables' optimizer (``optimizer_specs(...)[0]``).
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        The rule (EasyRec's form: TF's Adam; TorchEasyRec's: torch's), or None.
    """
    choice = spec.choice or OptimizerChoice(spec.kind, spec.source)
    if not table_optimizer_plan(choice, device_type).row_sparse:
        return None
    tf_form = choice.form != "tzrec"
    return RowSparseRule(spec.kind, dict(spec.params), tf_form)
