"""Optimizers and learning-rate schedules from either config form.

* EasyRec: ``train_config.optimizer_config`` with 1 entry (same kind for tables and dense
  parameters) or 2 entries (``[embeddings, dense]``); the schedule is inside the optimizer.
* TorchEasyRec: ``train_config.sparse_optimizer`` / ``dense_optimizer``, each with its own
  ``lr`` and a schedule beside it.
* Nothing configured: Adagrad lr 0.05 for tables, Adam lr 1e-3 for dense parameters.

Schedules (``LrSchedule.__call__(step)``):

* constant: ``lr``.
* EasyRec exponential decay: ``max(initial * factor ** p, min_lr)``,
  ``p = step / decay_steps`` (``floor``-ed when ``staircase``).
* TorchEasyRec exponential decay: ``max(lr * decay_rate ** p, min_lr)``, same ``p``.

Embedding tables are updated by fbgemm's fused kernel inside backward: ``sgd`` -> exact SGD,
``adagrad`` -> exact element-wise Adagrad (as EasyRec's TF Adagrad), ``rowwise_adagrad``
(TorchEasyRec's ``rowwise_adagrad_optimizer``) -> exact row-wise Adagrad (one accumulator per
row), ``adam`` -> fbgemm Adam, which exists only for CUDA tables (on CPU it is a
``ConfigError``). Table accumulators start at 0; ``initial_accumulator_value`` applies to
dense parameters only. A ``rowwise_adagrad`` dense optimizer is plain Adagrad.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torchrec.optim as trec_optim

from odl.config.config_error import ConfigError
from odl.config.optimizer_support import supported_sparse_optimizers
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

DEFAULT_SPARSE_LR = 0.05
# Element-wise Adagrad for tables by default: EasyRec's (TF) Adagrad is element-wise, and
# fbgemm's CPU backward for exact row-wise Adagrad is several times slower. Row-wise:
# TorchEasyRec's rowwise_adagrad_optimizer.
DEFAULT_SPARSE_KIND = "adagrad"
DEFAULT_DENSE_LR = 1e-3


@dataclass(frozen=True)
class LrSchedule:
    """Learning rate as a function of the global step.

    Attributes:
        base_lr: rate at step 0.
        decay_steps: steps per decay period (0: constant).
        decay_rate: multiplier per period.
        staircase: decay in whole periods.
        min_lr: lower bound.
    """

    base_lr: float
    decay_steps: int = 0
    decay_rate: float = 1.0
    staircase: bool = True
    min_lr: float = 0.0

    def __call__(self, step: int) -> float:
        """Rate to use for global step ``step``."""
        if self.decay_steps <= 0:
            return float(self.base_lr)
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return float(max(self.base_lr * self.decay_rate**p, self.min_lr))


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer choice.

    Attributes:
        kind: ``"sgd"``, ``"adagrad"``, ``"rowwise_adagrad"`` (tables only) or ``"adam"``.
        schedule: learning-rate schedule.
        params: extra settings (``initial_accumulator_value``, ``beta1``, ``beta2``).
        source: config path, for error messages.
    """

    kind: str
    schedule: LrSchedule
    params: dict[str, Any] = field(default_factory=dict)
    source: str = "train_config"


def _easyrec_schedule(lr: pipeline_pb2.LearningRate) -> LrSchedule:
    which = lr.WhichOneof("learning_rate")
    if which == "exponential_decay_learning_rate":
        e = lr.exponential_decay_learning_rate
        return LrSchedule(float(e.initial_learning_rate), int(e.decay_steps),
                          float(e.decay_factor), bool(e.staircase), float(e.min_learning_rate))
    if which == "constant_learning_rate":
        return LrSchedule(float(lr.constant_learning_rate.learning_rate))
    return LrSchedule(float(pipeline_pb2.ConstantLearningRate().learning_rate))


def _easyrec_spec(oc: pipeline_pb2.OptimizerConfig, path: str) -> OptimizerSpec:
    which = oc.WhichOneof("optimizer")
    if which is None:
        raise ConfigError(
            path, "no optimizer set (sgd_optimizer, adagrad_optimizer, adam_optimizer)")
    msg = getattr(oc, which)
    sched = _easyrec_schedule(msg.learning_rate)
    if which == "sgd_optimizer":
        return OptimizerSpec("sgd", sched, {}, path)
    if which == "adagrad_optimizer":
        return OptimizerSpec("adagrad", sched,
                             {"initial_accumulator_value": float(msg.initial_accumulator_value)},
                             path)
    return OptimizerSpec("adam", sched, {"beta1": float(msg.beta1), "beta2": float(msg.beta2)},
                         path)


def _tzrec_spec(
    msg: pipeline_pb2.SparseOptimizer | pipeline_pb2.DenseOptimizer, path: str
) -> OptimizerSpec:
    which = msg.WhichOneof("optimizer")
    if which is None:
        raise ConfigError(path, "no optimizer set")
    opt = getattr(msg, which)
    lr = float(opt.lr)
    if msg.WhichOneof("learning_rate") == "exponential_decay_learning_rate":
        e = msg.exponential_decay_learning_rate
        sched = LrSchedule(lr, int(e.decay_steps), float(e.decay_rate), bool(e.staircase),
                           float(e.min_learning_rate))
    else:
        sched = LrSchedule(lr)
    if which == "sgd_optimizer":
        return OptimizerSpec("sgd", sched, {}, path)
    if which == "rowwise_adagrad_optimizer":
        return OptimizerSpec("rowwise_adagrad", sched, {}, path)
    if which == "adagrad_optimizer":
        init = float(opt.initial_accumulator_value)
        return OptimizerSpec("adagrad", sched, {"initial_accumulator_value": init}, path)
    return OptimizerSpec("adam", sched, {"beta1": float(opt.beta1), "beta2": float(opt.beta2)},
                         path)


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
    if len(ocs) == 1:
        spec = _easyrec_spec(ocs[0], "train_config.optimizer_config[0]")
        return spec, spec
    if len(ocs) == 2:
        return (_easyrec_spec(ocs[0], "train_config.optimizer_config[0]"),
                _easyrec_spec(ocs[1], "train_config.optimizer_config[1]"))
    sparse = (_tzrec_spec(train_config.sparse_optimizer, "train_config.sparse_optimizer")
              if train_config.HasField("sparse_optimizer")
              else OptimizerSpec(DEFAULT_SPARSE_KIND, LrSchedule(DEFAULT_SPARSE_LR), {},
                                 "default"))
    dense = (_tzrec_spec(train_config.dense_optimizer, "train_config.dense_optimizer")
             if train_config.HasField("dense_optimizer")
             else OptimizerSpec("adam", LrSchedule(DEFAULT_DENSE_LR), {}, "default"))
    return sparse, dense


def sparse_optimizer_args(
    spec: OptimizerSpec, device_type: str
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Optimizer class and kwargs for ``apply_optimizer_in_backward`` on the tables.

    Args:
        spec: the sparse optimizer choice.
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        ``(optimizer class, kwargs)``; the class maps to an fbgemm fused optimizer.

    Raises:
        ConfigError: the kind has no fused kernel on this device (Adam on CPU).
    """
    lr = spec.schedule(0)
    if spec.kind not in supported_sparse_optimizers(device_type):
        raise ConfigError(
            spec.source,
            f"{spec.kind} for embedding tables is not supported on {device_type} (fbgemm's "
            "fused kernels there: "
            f"{', '.join(sorted(supported_sparse_optimizers(device_type)))}); use adagrad "
            "for the tables or train on CUDA")
    if spec.kind == "sgd":
        return torch.optim.SGD, {"lr": lr}
    if spec.kind == "rowwise_adagrad":
        return trec_optim.RowWiseAdagrad, {"lr": lr, "eps": 1e-8}
    if spec.kind == "adagrad":
        return torch.optim.Adagrad, {"lr": lr, "eps": 1e-8}
    # fbgemm's table kernel takes beta1/beta2, not torch's betas tuple
    return trec_optim.Adam, {"lr": lr, "eps": 1e-8, "beta1": spec.params.get("beta1", 0.9),
                             "beta2": spec.params.get("beta2", 0.999)}


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
    if spec.kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if spec.kind in ("adagrad", "rowwise_adagrad"):
        return torch.optim.Adagrad(
            params, lr=lr,
            initial_accumulator_value=spec.params.get("initial_accumulator_value", 0.0))
    return torch.optim.Adam(params, lr=lr, betas=(spec.params.get("beta1", 0.9),
                                                  spec.params.get("beta2", 0.999)))
