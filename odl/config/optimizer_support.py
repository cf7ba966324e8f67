"""Which optimizer a config picks for the tables and the dense part, and where it runs.

Read from the config alone (no torch import), so validation can refuse a table optimizer
the resolved device has no kernel for before anything is built, and ``odl-train
--validate_only`` can say which substitute a start will use. ``odl.train.optimizer_builder``
builds the optimizers from the same choices and uses :func:`table_optimizer_plan` for the
same rule.

Table optimizers are fbgemm's fused kernels (updated inside backward). fbgemm-gpu-cpu
implements ``exact_sgd``, ``exact_adagrad`` and ``exact_row_wise_adagrad`` on CPU; its Adam,
LAMB, LARS-SGD and partial row-wise Adam/LAMB are CUDA only (on CPU the kernel constructor
asserts ``Optimizer adam is not supported in CPU mode``). No fbgemm build has FTRL or momentum
SGD for tables. Per configured kind, the tables get:

======================  ===================================  =================================
configured kind         CPU                                  CUDA
======================  ===================================  =================================
sgd                     exact SGD                            exact SGD
adagrad                 exact element-wise Adagrad           exact element-wise Adagrad
rowwise_adagrad         exact row-wise Adagrad               exact row-wise Adagrad
ftrl                    Adagrad at the FTRL rate (warning)   Adagrad at the FTRL rate (warning)
momentum                plain SGD at the same rate (warning) plain SGD at the same rate (warning)
adam (lazy_adam)        refused: use adagrad for the tables  fbgemm Adam
adamw                   refused: use adagrad for the tables  fbgemm Adam, no decay (warning)
lamb                    refused: use adagrad for the tables  fbgemm LAMB
======================  ===================================  =================================

Why these substitutes: FTRL-Proximal with ``learning_rate_power`` -0.5 and no l1/l2 makes the
same updates as Adagrad (McMahan et al. 2013), so Adagrad at the FTRL rate is FTRL minus its
regularization (the warning lists the settings not applied: l1/l2 sparsity is lost). TF's
momentum on a sparse (embedding) gradient moves a row by ``lr * grad`` on its first update,
the same as plain SGD; rows updated on many consecutive steps move up to ``1 / (1 - momentum)``
times further under momentum. Adam and LAMB have no close CPU substitute (their rates are
tuned for normalized steps), so they are refused with the exact optimizer to use instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from odl.config.config_error import ConfigError
from odl.protos import pipeline_pb2

# Table kernel kind -> devices whose fbgemm build has a fused kernel for it.
SPARSE_OPTIMIZER_DEVICES: dict[str, frozenset[str]] = {
    "sgd": frozenset({"cpu", "cuda"}),
    "adagrad": frozenset({"cpu", "cuda"}),
    "rowwise_adagrad": frozenset({"cpu", "cuda"}),
    "adam": frozenset({"cuda"}),
    "lamb": frozenset({"cuda"}),
}

# Table kernel kinds whose update in-batch learning follows (odl.train.in_batch.in_batch_learning).
IN_BATCH_TABLE_KINDS: tuple[str, ...] = ("sgd", "adagrad", "rowwise_adagrad")

# Table kernel kinds whose accumulator can count records one by one
# (odl.train.in_batch.per_record_adagrad).
PER_RECORD_TABLE_KINDS: tuple[str, ...] = ("adagrad", "rowwise_adagrad")

# Configured kind -> the table kernel that stands in for it (kinds without a kernel).
TABLE_SUBSTITUTES: dict[str, str] = {"ftrl": "adagrad", "momentum": "sgd", "adamw": "adam"}

# Kind used for the tables / the dense part when nothing is configured
# (see odl.train.optimizer_builder).
DEFAULT_SPARSE_KIND = "adagrad"
DEFAULT_DENSE_KIND = "adam"

EASYREC_KINDS: dict[str, str] = {
    "sgd_optimizer": "sgd", "adagrad_optimizer": "adagrad", "adam_optimizer": "adam",
    "lazy_adam_optimizer": "adam", "momentum_optimizer": "momentum",
    "adamw_optimizer": "adamw", "ftrl_optimizer": "ftrl",
}
TZREC_KINDS: dict[str, str] = {
    "sgd_optimizer": "sgd", "adagrad_optimizer": "adagrad", "adam_optimizer": "adam",
    "rowwise_adagrad_optimizer": "rowwise_adagrad", "lamb_optimizer": "lamb",
    "adamw_optimizer": "adamw",
}


@dataclasses.dataclass(frozen=True)
class OptimizerChoice:
    """One configured optimizer.

    Attributes:
        kind: ``"sgd"``, ``"momentum"``, ``"adagrad"``, ``"rowwise_adagrad"``, ``"adam"``,
            ``"adamw"``, ``"ftrl"`` or ``"lamb"`` (``""``: none set).
        field: dotted path of the config field that chose it (``""`` for the default).
        form: ``"easyrec"``, ``"tzrec"`` or ``"default"``.
        message: the optimizer's own message (e.g. the ``FtrlOptimizer``), None for the default.
    """

    kind: str
    field: str
    form: str = "default"
    message: Any = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """What the embedding tables run for a configured optimizer on a device.

    Attributes:
        configured: the configured kind.
        kernel: the fused kernel kind that runs (``"sgd"``, ``"adagrad"``,
            ``"rowwise_adagrad"``, ``"adam"`` or ``"lamb"``).
        note: ``""`` when the configured optimizer runs as configured; else one sentence
            naming the field and the substitution (logged as a warning at start-up and
            printed by ``--validate_only``).
    """

    configured: str
    kernel: str
    note: str = ""


def supported_sparse_optimizers(device_type: str) -> frozenset[str]:
    """Table kernel kinds with a fused kernel on a device type.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        The kinds (e.g. ``{"sgd", "adagrad", "rowwise_adagrad"}`` on CPU).
    """
    return frozenset(k for k, devices in SPARSE_OPTIMIZER_DEVICES.items()
                     if device_type in devices)


def table_kernel_kind(kind: str) -> str:
    """The table kernel kind a configured kind runs as (device aside)."""
    return TABLE_SUBSTITUTES.get(kind, kind)


def _fmt(value: float) -> str:
    return f"{value:g}"


def _ftrl_dropped(msg: Any) -> list[str]:
    dropped = [f"{name} {_fmt(getattr(msg, name))}"
               for name in ("l1_reg", "l2_reg", "l2_shrinkage_reg") if getattr(msg, name)]
    if msg.learning_rate_power != -0.5:
        dropped.append(f"learning_rate_power {_fmt(msg.learning_rate_power)} (Adagrad: -0.5)")
    return dropped


def _refusal(choice: OptimizerChoice, device_type: str) -> str:
    kernel = table_kernel_kind(choice.kind)
    supported = ", ".join(sorted(supported_sparse_optimizers(device_type)))
    if choice.form == "easyrec":
        use = ("give two optimizer_config entries, [tables, dense], with adagrad_optimizer "
               f"first (e.g. optimizer_config {{ adagrad_optimizer {{ ... }} }} "
               f"optimizer_config {{ {choice.field.rsplit('.', 1)[-1]} {{ ... }} }}) to keep "
               f"{choice.kind} for the dense parameters")
    else:
        use = ("use sparse_optimizer { adagrad_optimizer { lr: ... } } (or "
               "rowwise_adagrad_optimizer)")
    via = f" (it runs as fbgemm's {kernel})" if kernel != choice.kind else ""
    return (f"{choice.kind}{via} for the embedding tables is not supported on {device_type} "
            f"(no fused kernel; fbgemm's kernels there: {supported}); {use}, or train on CUDA")


def table_optimizer_plan(choice: OptimizerChoice, device_type: str) -> TablePlan:
    """What the tables run for ``choice`` on ``device_type`` (see the module docstring).

    Args:
        choice: the tables' configured optimizer (``optimizer_choices(...)[0]``).
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        The plan; ``note`` says what differs from the configured optimizer.

    Raises:
        ConfigError: naming the optimizer field when no kernel can run it on the device
            (Adam, AdamW, LAMB on CPU) and saying which optimizer to use instead.
    """
    kernel = table_kernel_kind(choice.kind)
    field = choice.field or "train_config.sparse_optimizer"
    if kernel not in supported_sparse_optimizers(device_type):
        raise ConfigError(field, _refusal(choice, device_type))
    msg = choice.message
    note = ""
    if choice.kind == "ftrl":
        dropped = _ftrl_dropped(msg) if msg is not None else []
        note = (f"{field}: fbgemm has no FTRL kernel for embedding tables; the tables use "
                "exact element-wise Adagrad at the FTRL learning rate (FTRL-Proximal without "
                "l1/l2 and with learning_rate_power -0.5 makes the same updates); table "
                "accumulators start at 0")
        if dropped:
            note += f"; not applied to the tables: {', '.join(dropped)}"
    elif choice.kind == "momentum":
        value = _fmt(msg.momentum_optimizer_value) if msg is not None else "0.9"
        note = (f"{field}: fbgemm has no momentum kernel for embedding tables; the tables use "
                f"plain SGD at the same learning rate (momentum {value} is not applied to "
                "the tables)")
    elif choice.kind == "adamw":
        decay = _fmt(msg.weight_decay) if msg is not None else "?"
        note = (f"{field}: the tables use fbgemm's Adam without weight decay (weight_decay "
                f"{decay} is not applied to the tables)")
    return TablePlan(choice.kind, kernel, note)


def optimizer_choices(
    train_config: pipeline_pb2.TrainConfig,
) -> tuple[OptimizerChoice, OptimizerChoice]:
    """The ``(tables, dense)`` optimizer kinds of a train config, from either config form.

    EasyRec's ``optimizer_config``: one entry for both, or ``[tables, dense]``. TorchEasyRec's
    ``sparse_optimizer`` / ``dense_optimizer``. Nothing configured: the defaults. Forms that
    validation refuses (both forms, more than two entries) are read as far as they go.

    Args:
        train_config: the train config.

    Returns:
        ``(sparse, dense)``.
    """
    ocs = list(train_config.optimizer_config)
    if ocs:
        chosen = []
        for i in range(min(len(ocs), 2)):
            which = ocs[i].WhichOneof("optimizer")
            field = f"train_config.optimizer_config[{i}]"
            kind = EASYREC_KINDS.get(which or "", "")
            chosen.append(OptimizerChoice(kind, f"{field}.{which}" if which else field,
                                          "easyrec", getattr(ocs[i], which) if which else None))
        return chosen[0], chosen[-1]
    sparse = OptimizerChoice(DEFAULT_SPARSE_KIND, "")
    dense = OptimizerChoice(DEFAULT_DENSE_KIND, "")
    for name in ("sparse_optimizer", "dense_optimizer"):
        if not train_config.HasField(name):
            continue
        msg = getattr(train_config, name)
        which = msg.WhichOneof("optimizer")
        choice = OptimizerChoice(TZREC_KINDS.get(which or "", ""),
                                 f"train_config.{name}.{which}" if which
                                 else f"train_config.{name}",
                                 "tzrec", getattr(msg, which) if which else None)
        if name == "sparse_optimizer":
            sparse = choice
        else:
            dense = choice
    return sparse, dense
