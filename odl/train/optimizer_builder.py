"""Optimizers, their learning-rate schedules and gradient clipping from either config form.

* EasyRec: ``train_config.optimizer_config`` with 1 entry (same kind for tables and dense
  parameters) or 2 entries (``[embeddings, dense]``); the schedule is inside the optimizer.
* TorchEasyRec: ``train_config.sparse_optimizer`` / ``dense_optimizer``, each with its own
  ``lr`` and a schedule beside it.
* Nothing configured: Adagrad lr 0.05 for tables, Adam lr 1e-3 for dense parameters.

Schedules are :mod:`odl.train.rate_schedules`'s. The same schedule drives the dense optimizer
and the fused table optimizer: the train module sets both rates before every step.

Dense parameters (``torch.optim``): ``sgd`` -> SGD (TorchEasyRec: with its ``momentum``,
default 0.9, ``weight_decay``, ``dampening``, ``nesterov``), ``momentum`` -> SGD with momentum
(as TF's MomentumOptimizer), ``adagrad`` / ``rowwise_adagrad`` -> Adagrad, ``adam`` -> Adam,
``adamw`` -> EasyRec: :class:`DecoupledAdamW` (``var -= weight_decay * var`` per step, not
scaled by the rate, as EasyRec's TF AdamW), TorchEasyRec: ``torch.optim.AdamW``; ``ftrl`` ->
:class:`FtrlProximal` (TF's FTRL-Proximal update with l1, l2 and l2 shrinkage);
``momentumw`` -> :class:`DecoupledMomentumW` (TF contrib's MomentumW); ``adagrad_decay`` ->
:class:`AdagradDecay` (DeepRec's AdagradDecay); ``rmsprop`` -> EasyRec:
:class:`TfRmsProp` (TF's RMSProp: the mean square starts at 1, epsilon under the root),
TorchEasyRec: ``torch.optim.RMSprop``; ``adadelta`` -> ``torch.optim.Adadelta``. The
table-only kinds (``lamb``, ``lars_sgd``, ``partial_rowwise_adam`` / ``_lamb``) are refused
for the dense part.

Embedding tables (see :mod:`odl.config.optimizer_support` for what runs per kind and
device): fbgemm's fused kernel inside backward for ``sgd`` (exact SGD), ``adagrad`` (exact
element-wise Adagrad, as EasyRec's TF Adagrad), ``rowwise_adagrad`` (exact row-wise Adagrad),
``adam`` / ``lamb`` on CUDA (fbgemm Adam / LAMB); row-sparse (:mod:`odl.train.row_sparse_tables`,
the fused kernel at rate 0) for the other kinds, and ``adam`` and ``lamb`` on CPU. Fused
Adagrad table accumulators start at ``initial_accumulator_value`` as TF's do when the config
writes it, else at 0 (:func:`table_accumulator_start`; evicted rows of dynamic tables restart
there too); dense Adagrad and the row-sparse FTRL take the field's value, written or not.

Gradient clipping (EasyRec ``gradient_clipping_by_norm``, TorchEasyRec ``grad_clipping``)
applies to the dense gradients, between backward and the dense step. The tables' gradients
are clipped where TorchEasyRec's table optimizer writes fbgemm's ``gradient_clipping`` /
``max_gradient`` (``params["max_gradient"]``): the fused kernels take both and clamp the
gradient of their pooled output, the row-sparse tables clamp the same gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torchrec.optim as trec_optim
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

from odl.config.config_error import ConfigError
from odl.config.optimizer_support import (
    DEFAULT_DENSE_KIND,
    DEFAULT_SPARSE_KIND,
    TZREC_KINDS,
    OptimizerChoice,
    optimizer_choices,
    table_optimizer_plan,
)
from odl.protos import pipeline_pb2
from odl.train.dense_optimizers import (
    AdagradDecay,
    DecoupledAdamW,
    DecoupledMomentumW,
    FtrlProximal,
    TfRmsProp,
)
from odl.train.rate_schedules import (
    CosineAnnealingSchedule,
    CosineDecaySchedule,
    CosineWarmRestartsSchedule,
    LrSchedule,
    ManualStepSchedule,
    PolynomialDecaySchedule,
    Schedule,
    TransformerSchedule,
)

logger = logging.getLogger(__name__)

DEFAULT_SPARSE_LR = 0.05
DEFAULT_DENSE_LR = 1e-3
# eps of the fused Adagrad / Adam / LAMB table kernels.
TABLE_EPS = 1e-8

__all__ = [
    "DecoupledAdamW",
    "DecoupledMomentumW",
    "DensePart",
    "FtrlProximal",
    "GradientClipping",
    "OptimizerSpec",
    "dense_part_specs",
    "gradient_clipping",
    "make_dense_optimizer",
    "optimizer_specs",
    "sparse_optimizer_args",
    "table_accumulator_start",
    "TfRmsProp",
]
# kinds that only the embedding tables run
TABLE_ONLY_KINDS = ("lamb", "lars_sgd", "partial_rowwise_adam", "partial_rowwise_lamb")




@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer choice.

    Attributes:
        kind: an ``OptimizerChoice`` kind (``odl.config.optimizer_support``).
        schedule: learning-rate schedule.
        params: extra settings (``initial_accumulator_value``, ``beta1``, ``beta2``,
            ``momentum``, ``weight_decay``, ``eps``, FTRL's ``lr_power``, ``l1``, ``l2``,
            ``l2_shrinkage``, ...).
        source: config path, for error messages.
        choice: the config choice it was read from.
    """

    kind: str
    schedule: Schedule
    params: dict[str, Any] = field(default_factory=dict)
    source: str = "train_config"
    choice: OptimizerChoice | None = field(default=None, compare=False, repr=False)


def _easyrec_schedule(lr: pipeline_pb2.LearningRate) -> Schedule:
    which = lr.WhichOneof("learning_rate")
    if which == "exponential_decay_learning_rate":
        e = lr.exponential_decay_learning_rate
        burnin = int(e.burnin_steps)
        return LrSchedule(
            float(e.initial_learning_rate), int(e.decay_steps), float(e.decay_factor),
            bool(e.staircase), float(e.min_learning_rate), warmup_steps=burnin,
            warmup_lr=float(e.burnin_learning_rate or e.initial_learning_rate),
            floor_warmup=True)
    if which == "cosine_decay_learning_rate":
        c = lr.cosine_decay_learning_rate
        return CosineDecaySchedule(float(c.learning_rate_base), int(c.total_steps),
                                   float(c.warmup_learning_rate), int(c.warmup_steps),
                                   int(c.hold_base_rate_steps))
    if which == "poly_decay_learning_rate":
        p = lr.poly_decay_learning_rate
        return PolynomialDecaySchedule(float(p.learning_rate_base), int(p.total_steps),
                                       float(p.power), float(p.end_learning_rate))
    if which == "manual_step_learning_rate":
        m = lr.manual_step_learning_rate
        return ManualStepSchedule(float(m.initial_learning_rate),
                                  tuple(int(x.step) for x in m.schedule),
                                  tuple(float(x.learning_rate) for x in m.schedule),
                                  bool(m.warmup), at_boundary=True)
    if which == "transformer_learning_rate":
        t = lr.transformer_learning_rate
        return TransformerSchedule(float(t.learning_rate_base), int(t.hidden_size),
                                   int(t.warmup_steps), float(t.step_scaling_rate))
    if which == "constant_learning_rate":
        return LrSchedule(float(lr.constant_learning_rate.learning_rate))
    return LrSchedule(float(pipeline_pb2.ConstantLearningRate().learning_rate))


def _easyrec_params(kind: str, msg: Any) -> dict[str, Any]:
    if kind == "adagrad":
        return {"initial_accumulator_value": float(msg.initial_accumulator_value)}
    if kind == "momentum":
        return {"momentum": float(msg.momentum_optimizer_value)}
    if kind == "momentumw":
        return {"momentum": float(msg.momentum_optimizer_value),
                "weight_decay": float(msg.weight_decay)}
    if kind == "rmsprop":
        return {"momentum": float(msg.momentum_optimizer_value), "decay": float(msg.decay),
                "eps": float(msg.epsilon)}
    if kind in ("adam", "adamw"):
        out = {"beta1": float(msg.beta1), "beta2": float(msg.beta2)}
        if kind == "adamw":
            out.update(weight_decay=float(msg.weight_decay), decay_scaled_by_lr=False)
        return out
    if kind == "adagrad_decay":
        return {"initial_accumulator_value": float(msg.initial_accumulator_value),
                "accumulator_decay_step": int(msg.accumulator_decay_step),
                "accumulator_decay_rate": float(msg.accumulator_decay_rate)}
    if kind == "ftrl":
        return {"lr_power": float(msg.learning_rate_power),
                "initial_accumulator_value": float(msg.initial_accumulator_value),
                "l1": float(msg.l1_reg), "l2": float(msg.l2_reg),
                "l2_shrinkage": float(msg.l2_shrinkage_reg)}
    return {}


def _easyrec_spec(choice: OptimizerChoice) -> OptimizerSpec:
    if not choice.kind:
        raise ConfigError(choice.field, "no optimizer set (e.g. adagrad_optimizer, "
                                        "adam_optimizer, ftrl_optimizer)")
    msg = choice.message
    return OptimizerSpec(choice.kind, _easyrec_schedule(msg.learning_rate),
                         _easyrec_params(choice.kind, msg), choice.field, choice)


def _tzrec_schedule(msg: pipeline_pb2.SparseOptimizer | pipeline_pb2.DenseOptimizer,
                    lr: float) -> Schedule:
    which = msg.WhichOneof("learning_rate")
    if which == "exponential_decay_learning_rate":
        e = msg.exponential_decay_learning_rate
        decay = int(e.decay_size if e.HasField("decay_size") else e.decay_steps)
        if e.HasField("decay_factor") or not e.HasField("decay_rate"):
            factor = float(e.decay_factor)
        else:
            factor = float(e.decay_rate)
        return LrSchedule(lr, decay, factor, bool(e.staircase), float(e.min_learning_rate),
                          warmup_steps=int(e.warmup_size),
                          warmup_lr=float(e.warmup_learning_rate))
    if which == "cosine_annealing_learning_rate":
        c = msg.cosine_annealing_learning_rate
        return CosineAnnealingSchedule(lr, int(c.T_max), float(c.min_learning_rate),
                                       float(c.warmup_learning_rate), int(c.warmup_size))
    if which == "cosine_annealing_warm_restarts_learning_rate":
        c = msg.cosine_annealing_warm_restarts_learning_rate
        return CosineWarmRestartsSchedule(lr, int(c.T_0), int(c.T_mult),
                                          float(c.min_learning_rate),
                                          float(c.warmup_learning_rate), int(c.warmup_size))
    if which == "manual_step_learning_rate":
        m = msg.manual_step_learning_rate
        return ManualStepSchedule(lr, tuple(int(x) for x in m.schedule_sizes),
                                  tuple(float(x) for x in m.learning_rates), bool(m.warmup),
                                  at_boundary=False)
    return LrSchedule(lr)


def _tzrec_params(kind: str, opt: Any) -> dict[str, Any]:
    names = [n for n in ("momentum", "weight_decay", "dampening", "nesterov",
                         "initial_accumulator_value", "eps", "amsgrad", "beta1", "beta2",
                         "rho", "alpha")
             if n in opt.DESCRIPTOR.fields_by_name]
    out: dict[str, Any] = {n: getattr(opt, n) for n in names}
    for n in ("nesterov", "amsgrad"):
        if n in out:
            out[n] = bool(out[n])
    if kind == "rowwise_adagrad_with_decay":  # fbgemm's WeightDecayMode, by name
        out["weight_decay_mode"] = pipeline_pb2.TzrecWeightDecayMode.Name(opt.weight_decay_mode)
        out["eps"] = TABLE_EPS
    if kind == "adamw":
        out["decay_scaled_by_lr"] = True
    if "gradient_clipping" in opt.DESCRIPTOR.fields_by_name and opt.gradient_clipping:
        out["max_gradient"] = float(opt.max_gradient)  # fbgemm's table gradient clipping
    return out


def _tzrec_spec(choice: OptimizerChoice,
                msg: pipeline_pb2.SparseOptimizer | pipeline_pb2.DenseOptimizer) -> OptimizerSpec:
    if not choice.kind:
        raise ConfigError(choice.field, "no optimizer set")
    opt = choice.message
    return OptimizerSpec(choice.kind, _tzrec_schedule(msg, float(opt.lr)),
                         _tzrec_params(choice.kind, opt), choice.field, choice)


def optimizer_specs(train_config: pipeline_pb2.TrainConfig) -> tuple[OptimizerSpec, OptimizerSpec]:
    """Reads the ``(sparse, dense)`` optimizer choices from either config form.

    Args:
        train_config: the train config.

    Returns:
        ``(sparse_spec, dense_spec)``.

    Raises:
        ConfigError: both forms are used, or more than two ``optimizer_config`` entries.
    """
    ocs = list(train_config.optimizer_config)
    has_tz = train_config.HasField("sparse_optimizer") or train_config.HasField("dense_optimizer")
    if ocs and has_tz:
        raise ConfigError(
            "train_config.optimizer_config",
            "use either optimizer_config (EasyRec) or sparse_optimizer/dense_optimizer "
            "(TorchEasyRec), not both")
    if len(ocs) > 2:
        raise ConfigError("train_config.optimizer_config",
                          f"expected 1 or 2 entries ([embeddings, dense]), got {len(ocs)}")
    sparse_choice, dense_choice = optimizer_choices(train_config)
    if ocs:
        sparse = _easyrec_spec(sparse_choice)
        return sparse, (sparse if len(ocs) == 1 else _easyrec_spec(dense_choice))
    sparse = (_tzrec_spec(sparse_choice, train_config.sparse_optimizer)
              if train_config.HasField("sparse_optimizer")
              else OptimizerSpec(DEFAULT_SPARSE_KIND, LrSchedule(DEFAULT_SPARSE_LR), {},
                                 "default", sparse_choice))
    dense = (_tzrec_spec(dense_choice, train_config.dense_optimizer)
             if train_config.HasField("dense_optimizer")
             else OptimizerSpec(DEFAULT_DENSE_KIND, LrSchedule(DEFAULT_DENSE_LR), {},
                                "default", dense_choice))
    return sparse, dense


@dataclass(frozen=True)
class DensePart:
    """One of TorchEasyRec's ``dense_optimizer.part_optimizers``.

    Attributes:
        pattern: the regular expression matched in full against dense parameter names.
        spec: its optimizer and schedule (the schedule of ``dense_optimizer`` from its own
            ``lr`` when it sets none).
    """

    pattern: str
    spec: OptimizerSpec


def dense_part_specs(train_config: pipeline_pb2.TrainConfig) -> list[DensePart]:
    """TorchEasyRec's ``dense_optimizer.part_optimizers``, in order (``[]`` without).

    Args:
        train_config: the train config.

    Returns:
        One :class:`DensePart` per entry.
    """
    if not train_config.HasField("dense_optimizer"):
        return []
    dense = train_config.dense_optimizer
    out = []
    for i, part in enumerate(dense.part_optimizers):
        which = part.WhichOneof("optimizer") or ""
        field = f"train_config.dense_optimizer.part_optimizers[{i}].{which}"
        choice = OptimizerChoice(TZREC_KINDS.get(which, ""), field, "tzrec",
                                 getattr(part, which) if which else None)
        if not choice.kind:
            raise ConfigError(field, "no optimizer set")
        opt = choice.message
        own = part if part.WhichOneof("learning_rate") else dense
        out.append(DensePart(part.regex_pattern, OptimizerSpec(
            choice.kind, _tzrec_schedule(own, float(opt.lr)), _tzrec_params(choice.kind, opt),
            field, choice)))
    return out


# --------------------------------------------------------------------------- tables


def sparse_optimizer_args(
    spec: OptimizerSpec, device_type: str
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Optimizer class and kwargs for ``apply_optimizer_in_backward`` on the tables.

    Logs a warning when the tables' update differs from the configured optimizer
    (:func:`odl.config.optimizer_support.table_optimizer_plan`). A row-sparse kind gets
    exact SGD at rate 0 (``odl.train.row_sparse_tables`` makes the update).

    Args:
        spec: the sparse optimizer choice.
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        ``(optimizer class, kwargs)``; the class maps to an fbgemm fused optimizer.

    Raises:
        ConfigError: nothing runs the kind on this device.
    """
    choice = spec.choice or OptimizerChoice(spec.kind, spec.source)
    plan = table_optimizer_plan(choice, device_type)
    if plan.note:
        logger.warning("%s", plan.note)
    lr = 0.0 if plan.row_sparse else spec.schedule(0)
    bound = spec.params.get("max_gradient")
    # the fused kernel clamps its pooled output's gradient (the row-sparse tables clamp it
    # themselves; their kernel runs at rate 0)
    clip = ({"gradient_clipping": True, "max_gradient": float(bound)}
            if bound is not None and not plan.row_sparse else {})
    if plan.kernel == "sgd":
        # TorchRec's placeholder classes pass every kwarg to the kernel; torch's SGD takes
        # no clipping arguments
        return (trec_optim.SGD, {"lr": lr, **clip}) if clip else (torch.optim.SGD, {"lr": lr})
    if plan.kernel == "rowwise_adagrad":
        kwargs = {"lr": lr, "eps": TABLE_EPS, **clip}
        if spec.kind == "rowwise_adagrad_with_decay":  # fbgemm's decay, fused (CUDA)
            kwargs.update(weight_decay=spec.params["weight_decay"],
                          weight_decay_mode=WeightDecayMode[spec.params["weight_decay_mode"]])
        return trec_optim.RowWiseAdagrad, kwargs
    if plan.kernel == "adagrad":
        kwargs = {"lr": lr, "eps": TABLE_EPS, **clip}
        return (trec_optim.Adagrad if clip else torch.optim.Adagrad), kwargs
    # fbgemm's table kernels take beta1/beta2, not torch's betas tuple
    kwargs = {"lr": lr, "eps": TABLE_EPS, "beta1": spec.params.get("beta1", 0.9),
              "beta2": spec.params.get("beta2", 0.999)}
    kwargs["weight_decay"] = spec.params.get("weight_decay", 0.0)
    kwargs.update(clip)
    if plan.kernel == "lamb":
        return trec_optim.LAMB, kwargs
    return trec_optim.Adam, kwargs


def table_accumulator_start(spec: OptimizerSpec, device_type: str) -> float:
    """Where a fused Adagrad table's accumulators start.

    A config that writes ``initial_accumulator_value`` gets TF's Adagrad: every accumulator
    starts there, so a row's first steps are ``lr * g / sqrt(initial_accumulator_value +
    g**2)``. A config that does not write it gets 0, fbgemm's start, where a row's first step
    is ``lr * sign(g)``: EasyRec's implied 0.1 learns far slower online (docs/training.md,
    measured with ``bench/online_quality.py --table-init-acc``). The state is filled by
    :func:`odl.train.table_shards.fill_states`.

    Args:
        spec: the sparse optimizer choice.
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        The start value (0: not written, other kinds, and the row-sparse ones, which keep
        their own).
    """
    choice = spec.choice or OptimizerChoice(spec.kind, spec.source)
    plan = table_optimizer_plan(choice, device_type)
    if plan.row_sparse or plan.kernel not in ("adagrad", "rowwise_adagrad"):
        return 0.0
    message = choice.message
    if message is None or "initial_accumulator_value" not in message.DESCRIPTOR.fields_by_name \
            or not message.HasField("initial_accumulator_value"):
        return 0.0
    return float(message.initial_accumulator_value)


# --------------------------------------------------------------------------- dense


def make_dense_optimizer(
    spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """Builds the dense parameters' optimizer.

    Args:
        spec: the dense optimizer choice.
        params: the parameters.

    Returns:
        A ``torch.optim`` optimizer (its lr is set per step from ``spec.schedule``).
    """
    params = list(params)
    lr = spec.schedule(0)
    p = spec.params
    if spec.kind in ("sgd", "momentum"):
        return torch.optim.SGD(params, lr=lr, momentum=p.get("momentum", 0.0),
                               weight_decay=p.get("weight_decay", 0.0),
                               dampening=p.get("dampening", 0.0),
                               nesterov=p.get("nesterov", False))
    if spec.kind in ("adagrad", "rowwise_adagrad"):
        return torch.optim.Adagrad(
            params, lr=lr, initial_accumulator_value=p.get("initial_accumulator_value", 0.0),
            weight_decay=p.get("weight_decay", 0.0), eps=p.get("eps", 1e-10))
    if spec.kind == "ftrl":
        return FtrlProximal(params, lr=lr, lr_power=p["lr_power"],
                            initial_accumulator_value=p["initial_accumulator_value"],
                            l1=p["l1"], l2=p["l2"], l2_shrinkage=p["l2_shrinkage"])
    if spec.kind == "adagrad_decay":
        return AdagradDecay(params, lr=lr, initial_accumulator_value=p["initial_accumulator_value"],
                            accumulator_decay_step=p["accumulator_decay_step"],
                            accumulator_decay_rate=p["accumulator_decay_rate"])
    if spec.kind == "momentumw":
        return DecoupledMomentumW(params, lr=lr, momentum=p["momentum"],
                                  weight_decay=p["weight_decay"])
    if spec.kind == "rmsprop" and "decay" in p:  # EasyRec's (TF's) form
        return TfRmsProp(params, lr=lr, decay=p["decay"], momentum=p["momentum"], eps=p["eps"])
    if spec.kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=p.get("alpha", 0.99),
                                   eps=p.get("eps", 1e-8), weight_decay=p.get("weight_decay", 0.0))
    if spec.kind == "adadelta":
        return torch.optim.Adadelta(params, lr=lr, rho=p.get("rho", 0.95), eps=p.get("eps", 1e-6),
                                    weight_decay=p.get("weight_decay", 0.0))
    if spec.kind in TABLE_ONLY_KINDS:
        raise ConfigError(spec.source, f"{spec.kind} is a table optimizer (sparse_optimizer "
                                       "only, or the first of two optimizer_config entries)")
    betas = (p.get("beta1", 0.9), p.get("beta2", 0.999))
    if spec.kind == "adamw" and not p.get("decay_scaled_by_lr", True):
        return DecoupledAdamW(params, lr=lr, betas=betas, weight_decay=p["weight_decay"])
    # torch's fused kernel: one pass over every parameter instead of one per tensor (the
    # same update; 5x faster than the per-tensor loop for a small model's many small tensors)
    fused = bool(params) and all(q.is_floating_point() and q.device.type in ("cpu", "cuda")
                                 for q in params)
    if spec.kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas,
                                 weight_decay=p.get("weight_decay", 0.0),
                                 eps=p.get("eps", 1e-8), amsgrad=p.get("amsgrad", False),
                                 fused=fused or None)
    return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=p.get("weight_decay", 0.0),
                            eps=p.get("eps", 1e-8), amsgrad=p.get("amsgrad", False),
                            fused=fused or None)


# --------------------------------------------------------------------------- clipping


@dataclass(frozen=True)
class GradientClipping:
    """Clipping of the dense gradients before the dense step.

    Attributes:
        kind: ``"norm"`` (scale all gradients by ``min(1, max_value / global_norm)``) or
            ``"value"`` (clamp each value to ``[-max_value, max_value]``).
        max_value: the bound.
        norm_type: the norm of ``"norm"`` (2.0: L2; ``inf``: largest absolute value).
    """

    kind: str
    max_value: float
    norm_type: float = 2.0

    def __call__(self, optimizer: torch.optim.Optimizer) -> float | None:
        """Clips the gradients of the optimizer's parameters in place.

        Args:
            optimizer: the dense optimizer.

        Returns:
            The global gradient norm before clipping (``"norm"``), else None.
        """
        params = [q for g in optimizer.param_groups for q in g["params"] if q.grad is not None]
        if not params:
            return None
        if self.kind == "norm":
            return float(torch.nn.utils.clip_grad_norm_(params, self.max_value, self.norm_type))
        torch.nn.utils.clip_grad_value_(params, self.max_value)
        return None


def gradient_clipping(train_config: pipeline_pb2.TrainConfig) -> GradientClipping | None:
    """The dense gradient clipping a train config asks for, or None.

    Args:
        train_config: the train config.

    Returns:
        EasyRec's ``gradient_clipping_by_norm`` (> 0) as global L2-norm clipping, or
        TorchEasyRec's ``grad_clipping`` (``clipping_type`` ``"norm"`` / ``"value"``), else
        None.
    """
    if train_config.gradient_clipping_by_norm > 0:
        return GradientClipping("norm", float(train_config.gradient_clipping_by_norm))
    if train_config.HasField("grad_clipping"):
        gc = train_config.grad_clipping
        kind = gc.clipping_type.strip().lower()
        if kind in ("norm", "value"):
            return GradientClipping(kind, float(gc.max_gradient), float(gc.norm_type))
    return None
