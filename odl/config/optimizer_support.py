"""Which optimizer a config picks for the tables and the dense part, and where it runs.

Read from the config alone (no torch import), so validation can refuse a table optimizer
the resolved device cannot run before anything is built, and ``odl-train --validate_only``
can say where the tables' update differs from the configured one.
``odl.train.optimizer_builder`` builds the optimizers from the same choices and uses
:func:`table_optimizer_plan` for the same rule.

Table optimizers are fbgemm's fused kernels (updated inside backward) where fbgemm has one:
fbgemm-gpu-cpu implements ``exact_sgd``, ``exact_adagrad`` and ``exact_row_wise_adagrad`` on
CPU; its Adam, LAMB, LARS-SGD and partial row-wise Adam/LAMB are CUDA only (on CPU the kernel
constructor asserts ``Optimizer adam is not supported in CPU mode``); no fbgemm build has FTRL,
momentum SGD, RMSProp, Adadelta, DeepRec's Adagrad decay or decoupled (AdamW) decay for
tables. Those run *row-sparse* (``odl.train.row_sparse_tables``): the fused kernel runs as SGD
at rate 0 and, after backward, the configured update is applied to the rows the batch touched
(TF's sparse applies, ``odl.train.row_sparse_rules``; cost follows the batch). Per configured
kind:

======================  ===================================  =================================
configured kind         CPU                                  CUDA
======================  ===================================  =================================
sgd                     exact SGD (fused)                    exact SGD (fused)
adagrad                 exact element-wise Adagrad (fused)   exact element-wise Adagrad (fused)
rowwise_adagrad         exact row-wise Adagrad (fused)       exact row-wise Adagrad (fused)
ftrl                    FTRL-Proximal (row-sparse)           FTRL-Proximal (row-sparse)
momentum                TF momentum (row-sparse)             TF momentum (row-sparse)
adam (lazy_adam)        lazy Adam (row-sparse)               fbgemm Adam (fused, lazy)
adamw                   lazy Adam + decay (row-sparse)       lazy Adam + decay (row-sparse)
lamb                    fbgemm's LAMB (row-sparse)           fbgemm LAMB (fused)
momentumw               TF momentum + decay (row-sparse)     TF momentum + decay (row-sparse)
rmsprop                 TF / torch RMSProp (row-sparse)      TF / torch RMSProp (row-sparse)
adadelta                torch Adadelta (row-sparse)          torch Adadelta (row-sparse)
lars_sgd                fbgemm's LARS-SGD (row-sparse)       fbgemm's LARS-SGD (row-sparse)
partial_rowwise_adam    fbgemm's rule (row-sparse)           fbgemm's rule (row-sparse)
partial_rowwise_lamb    fbgemm's rule (row-sparse)           fbgemm's rule (row-sparse)
adagrad_decay           DeepRec's rule (row-sparse)          DeepRec's rule (row-sparse)
rowwise_adagrad_with_   fbgemm's rule (row-sparse)           exact row-wise Adagrad with its
decay                                                        decay (fused)
======================  ===================================  =================================

``rowwise_adagrad_with_decay`` is TorchEasyRec's ``rowwise_adagrad_optimizer`` with a
``weight_decay`` and a ``weight_decay_mode`` other than ``NONE``: fbgemm's CPU kernel takes
the decay's arguments and does not apply them, so on CPU its rule runs row-sparse.

EasyRec's ``adam_async_optimizer`` / ``adam_asyncw_optimizer`` (PAI-TF) are configured kinds
``adam`` / ``adamw``. The kinds fbgemm has fused on CUDA only as experimental kernels (LARS-SGD,
partial row-wise Adam / LAMB) run row-sparse on both devices: one rule, one state layout.

Adam on the tables is lazy (touched rows only, bias correction with the global step), as
TF's ``LazyAdamOptimizer`` and fbgemm's Adam; EasyRec's ``adam_optimizer`` (TF's
``AdamOptimizer``) also decays the moments of the untouched rows and moves them, which no
path here does (noted at start-up). Row-sparse LAMB is fbgemm's rule (each row's own trust
ratio), so CPU and CUDA tables follow one rule. Row-sparse kinds do not combine with in-batch
learning / per-record Adagrad (``IN_BATCH_TABLE_KINDS``).

TorchEasyRec's table ``gradient_clipping`` (:func:`table_gradient_bound`) clamps the same
gradient on every path: fbgemm's fused kernels clamp the gradient of their pooled output, and
the row-sparse kinds clamp the same gradient before summing it per row. In-batch learning,
whose shifted predictions follow unclamped steps, does not combine with it.
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

# Configured kind -> devices where it runs row-sparse (odl.train.row_sparse_tables): the
# fused kernel as SGD at rate 0, the update applied to the touched rows after backward.
ROW_SPARSE_DEVICES: dict[str, frozenset[str]] = {
    "adam": frozenset({"cpu"}),
    "adamw": frozenset({"cpu", "cuda"}),
    "ftrl": frozenset({"cpu", "cuda"}),
    "momentum": frozenset({"cpu", "cuda"}),
    "lamb": frozenset({"cpu"}),
    **{kind: frozenset({"cpu", "cuda"}) for kind in (
        "momentumw", "rmsprop", "adadelta", "lars_sgd", "partial_rowwise_adam",
        "partial_rowwise_lamb", "adagrad_decay")},
    "rowwise_adagrad_with_decay": frozenset({"cpu"}),
}
# Configured kinds whose fused kernel (where they have one) is another kind's.
_FUSED_KERNEL_OF = {"rowwise_adagrad_with_decay": "rowwise_adagrad"}

# Kind used for the tables / the dense part when nothing is configured
# (see odl.train.optimizer_builder).
DEFAULT_SPARSE_KIND = "adagrad"
DEFAULT_DENSE_KIND = "adam"

EASYREC_KINDS: dict[str, str] = {
    "sgd_optimizer": "sgd", "adagrad_optimizer": "adagrad", "adam_optimizer": "adam",
    "lazy_adam_optimizer": "adam", "momentum_optimizer": "momentum",
    "adamw_optimizer": "adamw", "ftrl_optimizer": "ftrl", "rms_prop_optimizer": "rmsprop",
    "momentumw_optimizer": "momentumw", "adam_async_optimizer": "adam",
    "adam_asyncw_optimizer": "adamw", "adagrad_decay_optimizer": "adagrad_decay",
}
TZREC_KINDS: dict[str, str] = {
    "sgd_optimizer": "sgd", "adagrad_optimizer": "adagrad", "adam_optimizer": "adam",
    "rowwise_adagrad_optimizer": "rowwise_adagrad", "lamb_optimizer": "lamb",
    "adamw_optimizer": "adamw", "lars_sgd_optimizer": "lars_sgd",
    "partial_rowwise_adam_optimizer": "partial_rowwise_adam",
    "partial_rowwise_lamb_optimizer": "partial_rowwise_lamb", "adadelta_optimizer": "adadelta",
    "rmsprop_optimizer": "rmsprop",
}


@dataclasses.dataclass(frozen=True)
class OptimizerChoice:
    """One configured optimizer.

    Attributes:
        kind: ``"sgd"``, ``"momentum"``, ``"adagrad"``, ``"rowwise_adagrad"``, ``"adam"``,
            ``"adamw"``, ``"ftrl"``, ``"lamb"``, ``"momentumw"``, ``"rmsprop"``,
            ``"adadelta"``, ``"lars_sgd"``, ``"partial_rowwise_adam"``,
            ``"partial_rowwise_lamb"``, ``"adagrad_decay"`` or ``"rowwise_adagrad_with_decay"``
            (``""``: none set).
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
            ``"rowwise_adagrad"``, ``"adam"`` or ``"lamb"``; ``"sgd"`` at rate 0 when
            ``row_sparse``).
        note: ``""`` when the configured optimizer runs as configured; else one sentence
            naming the field and what differs (logged as a warning at start-up and printed
            by ``--validate_only``).
        row_sparse: the configured update runs row-sparse (``odl.train.row_sparse_tables``).
    """

    configured: str
    kernel: str
    note: str = ""
    row_sparse: bool = False


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
    """The table update kind a configured kind runs as (device aside): the kind itself.

    Every configured kind runs as configured (fused or row-sparse) or is refused; kept for
    the callers that check a kind against ``IN_BATCH_TABLE_KINDS`` / ``PER_RECORD_TABLE_KINDS``.
    """
    return kind


def _decays(rowwise: Any) -> bool:
    """Whether a TorchEasyRec row-wise Adagrad message decays its rows.

    fbgemm reads the decay only with a mode other than NONE.
    """
    return rowwise.weight_decay > 0 and rowwise.weight_decay_mode != pipeline_pb2.NONE


def table_gradient_bound(choice: OptimizerChoice) -> float | None:
    """The bound of the tables' gradient clipping, None without one.

    TorchEasyRec's table optimizers write fbgemm's ``gradient_clipping`` / ``max_gradient``:
    each sample's pooled gradient of a feature is clamped to ``[-max_gradient,
    max_gradient]`` before the update (fbgemm's fused kernels on CPU and CUDA alike; the
    row-sparse kinds clamp the same gradient, ``odl.train.row_sparse_tables``).

    Args:
        choice: the tables' configured optimizer.
    """
    message = choice.message
    if choice.form != "tzrec" or message is None \
            or "gradient_clipping" not in message.DESCRIPTOR.fields_by_name \
            or not message.gradient_clipping:
        return None
    return float(message.max_gradient)


def table_gradient_multiplier(train_config: pipeline_pb2.TrainConfig) -> float:
    """EasyRec's ``embedding_learning_rate_multiplier`` (1.0 unwritten).

    EasyRec multiplies every embedding variable's gradient by it before the optimizer (TF's
    ``gradient_multipliers``), reading the first ``optimizer_config`` entry only; here each
    table lookup's pooled gradient is multiplied (``odl.train.table_gradient_scale``).
    """
    ocs = list(train_config.optimizer_config)
    if not ocs or not ocs[0].HasField("embedding_learning_rate_multiplier"):
        return 1.0
    return float(ocs[0].embedding_learning_rate_multiplier)


def dense_ema_configured(train_config: pipeline_pb2.TrainConfig) -> bool:
    """Whether ``train_config.dense_optimizer.ema`` (TorchEasyRec's dense EMA) is set."""
    return train_config.HasField("dense_optimizer") and train_config.dense_optimizer.HasField(
        "ema")


def dense_ema_used(config: pipeline_pb2.EasyRecConfig, where: str) -> bool:
    """Whether TorchEasyRec's dense EMA stands in for the parameters in ``where``.

    ``odl.train.dense_ema`` keeps the average (``train_config.dense_optimizer.ema``).

    Args:
        config: the pipeline config.
        where: ``"eval"`` (``eval_config``) or ``"export"`` (``export_config``).

    Returns:
        The section's ``use_dense_ema`` where written, else whether ``ema`` is configured.
    """
    configured = dense_ema_configured(config.train_config)
    section = config.eval_config if where == "eval" else config.export_config
    if section.HasField("use_dense_ema"):
        return bool(section.use_dense_ema) and configured
    return configured


def row_sparse_kind(kind: str, device_type: str) -> bool:
    """Whether tables of a configured kind run row-sparse on a device type."""
    return device_type in ROW_SPARSE_DEVICES.get(kind, frozenset())


def _refusal(choice: OptimizerChoice, device_type: str) -> str:
    supported = ", ".join(sorted(supported_sparse_optimizers(device_type)))
    if choice.form == "easyrec":
        use = ("give two optimizer_config entries, [tables, dense], with adagrad_optimizer "
               f"first (e.g. optimizer_config {{ adagrad_optimizer {{ ... }} }} "
               f"optimizer_config {{ {choice.field.rsplit('.', 1)[-1]} {{ ... }} }}) to keep "
               f"{choice.kind} for the dense parameters")
    else:
        use = ("use sparse_optimizer { adagrad_optimizer { lr: ... } } (or "
               "rowwise_adagrad_optimizer)")
    return (f"{choice.kind} for the embedding tables is not supported on {device_type} "
            f"(no fused kernel; fbgemm's kernels there: {supported}); {use}, or train on CUDA")


def table_optimizer_plan(choice: OptimizerChoice, device_type: str) -> TablePlan:
    """What the tables run for ``choice`` on ``device_type`` (see the module docstring).

    Args:
        choice: the tables' configured optimizer (``optimizer_choices(...)[0]``).
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        The plan; ``note`` says what differs from the configured optimizer.

    Raises:
        ConfigError: naming the optimizer field when nothing can run it on the device
            and saying which optimizer to use instead.
    """
    field = choice.field or "train_config.sparse_optimizer"
    note = ""
    if choice.form == "easyrec" and field.endswith((".adam_optimizer", ".adamw_optimizer")):
        note = (f"{field}: the tables run lazy Adam (the touched rows' moments only, as TF's "
                "LazyAdamOptimizer); TF's AdamOptimizer also decays the moments of the "
                "untouched rows and moves them")
    if row_sparse_kind(choice.kind, device_type):
        return TablePlan(choice.kind, "sgd", note, row_sparse=True)
    kernel = _FUSED_KERNEL_OF.get(choice.kind, table_kernel_kind(choice.kind))
    if kernel not in supported_sparse_optimizers(device_type):
        raise ConfigError(field, _refusal(choice, device_type))
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
        kind = TZREC_KINDS.get(which or "", "")
        if kind == "rowwise_adagrad" and _decays(msg.rowwise_adagrad_optimizer):
            kind = "rowwise_adagrad_with_decay"
        choice = OptimizerChoice(kind,
                                 f"train_config.{name}.{which}" if which
                                 else f"train_config.{name}",
                                 "tzrec", getattr(msg, which) if which else None)
        if name == "sparse_optimizer":
            sparse = choice
        else:
            dense = choice
    return sparse, dense
