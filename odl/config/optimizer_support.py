"""Which optimizer a config picks for the tables and the dense part, and where it runs.

Read from the config alone (no torch import), so validation can refuse a table optimizer
the resolved device has no kernel for before anything is built. ``odl.train.optimizer_builder``
builds the optimizers from the same config forms and uses :func:`supported_sparse_optimizers`
for the same rule.

Table optimizers are fbgemm's fused kernels. fbgemm-gpu-cpu implements ``exact_sgd``,
``exact_adagrad`` and ``exact_row_wise_adagrad`` on CPU; its Adam is CUDA only (on CPU the
kernel constructor asserts ``Optimizer adam is not supported in CPU mode``).
"""

from __future__ import annotations

from dataclasses import dataclass

from odl.protos import pipeline_pb2

# Table optimizer kind -> devices whose fbgemm build has a fused kernel for it.
SPARSE_OPTIMIZER_DEVICES: dict[str, frozenset[str]] = {
    "sgd": frozenset({"cpu", "cuda"}),
    "adagrad": frozenset({"cpu", "cuda"}),
    "rowwise_adagrad": frozenset({"cpu", "cuda"}),
    "adam": frozenset({"cuda"}),
}

# Kind used for the tables / the dense part when nothing is configured
# (see odl.train.optimizer_builder).
DEFAULT_SPARSE_KIND = "adagrad"
DEFAULT_DENSE_KIND = "adam"

_EASYREC_KINDS = {"sgd_optimizer": "sgd", "adagrad_optimizer": "adagrad",
                  "adam_optimizer": "adam"}
_TZREC_KINDS = {"sgd_optimizer": "sgd", "adagrad_optimizer": "adagrad",
                "adam_optimizer": "adam", "rowwise_adagrad_optimizer": "rowwise_adagrad"}


@dataclass(frozen=True)
class OptimizerChoice:
    """One configured optimizer.

    Attributes:
        kind: ``"sgd"``, ``"adagrad"``, ``"rowwise_adagrad"`` or ``"adam"``.
        field: dotted path of the config field that chose it (``""`` for the default).
    """

    kind: str
    field: str


def supported_sparse_optimizers(device_type: str) -> frozenset[str]:
    """Table optimizer kinds with a fused kernel on a device type.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        The kinds (e.g. ``{"sgd", "adagrad", "rowwise_adagrad"}`` on CPU).
    """
    return frozenset(k for k, devices in SPARSE_OPTIMIZER_DEVICES.items()
                     if device_type in devices)


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
            kind = _EASYREC_KINDS.get(which or "", "")
            chosen.append(OptimizerChoice(kind, f"{field}.{which}" if which else field))
        return chosen[0], chosen[-1]
    sparse = OptimizerChoice(DEFAULT_SPARSE_KIND, "")
    dense = OptimizerChoice(DEFAULT_DENSE_KIND, "")
    if train_config.HasField("sparse_optimizer"):
        which = train_config.sparse_optimizer.WhichOneof("optimizer")
        sparse = OptimizerChoice(_TZREC_KINDS.get(which or "", ""),
                                 f"train_config.sparse_optimizer.{which}" if which
                                 else "train_config.sparse_optimizer")
    if train_config.HasField("dense_optimizer"):
        which = train_config.dense_optimizer.WhichOneof("optimizer")
        dense = OptimizerChoice(_TZREC_KINDS.get(which or "", ""),
                                f"train_config.dense_optimizer.{which}" if which
                                else "train_config.dense_optimizer")
    return sparse, dense
