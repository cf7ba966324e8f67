"""Process-wide torch settings, the device a rank runs on, the CPUs spent on building batches.

:func:`quiet_library_noise` keeps torch's, TorchRec's and fbgemm's deprecation warnings and
chatter out of what a user reads (the CLIs' logging set-up calls it below DEBUG; the demos,
which build models in their own process, call it too).

The settings are those the odl daemons' command lines choose.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING

from odl.config.config_error import ConfigError

if TYPE_CHECKING:
    import torch

    from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


# loggers of libraries whose records below ERROR say nothing to an odl user
_LIBRARY_LOGGERS = ("torch.fx._symbolic_trace", "torchrec", "fbgemm_gpu", "torch.distributed")


def quiet_library_noise() -> None:
    """Silences torch's and TorchRec's warnings and their loggers below ERROR.

    Deprecation, future and user warnings (e.g. ShardedTensor's deprecation) in this
    process; torch's C++ log below ERROR here and in the processes it starts
    (``TORCH_CPP_LOG_LEVEL``).
    """
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for name in _LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def usable_cpus() -> int:
    """Number of CPUs this process may run on (its affinity mask on Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure_torch_threads(requested: int) -> int:
    """Sets torch's intra-op thread count.

    ``0`` (auto) takes ``OMP_NUM_THREADS`` when set, else half of the CPUs this process may
    use, at least one. The trainer's
    reader thread, librdkafka's threads and (on small machines) the broker and serving share
    the same cores; an OpenMP pool as wide as the machine then spins at every barrier while
    one of its threads waits for a core, which was measured here to slow training by an
    order of magnitude on 2 loaded cores. Leaving room keeps the step rate steady.

    Args:
        requested: thread count, or 0 for auto.

    Returns:
        The thread count in effect.
    """
    import torch

    if requested <= 0 and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        requested = int(os.environ["OMP_NUM_THREADS"])
    if requested <= 0:
        requested = max(1, usable_cpus() // 2)
    torch.set_num_threads(requested)
    logger.info("torch intra-op threads: %d", requested)
    return requested


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; anything else as given.

    A CUDA device without an index is the rank's own GPU under ``torchrun``
    (``cuda:<LOCAL_RANK>``), so the ranks of one host do not all share GPU 0.

    Raises:
        ConfigError: the device is a GPU this host does not have (more ranks than GPUs:
            TorchRec places local rank r's table shards on ``cuda:r``).
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = rank_device(torch.device(device), os.environ.get("LOCAL_RANK"))
    if chosen.type == "cuda" and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if (chosen.index or 0) >= gpus:
            # TorchRec places the table shards of local rank r on cuda:r: ranks cannot share
            raise ConfigError(
                "--nproc", f"this rank trains on {chosen}, but this host has {gpus} GPU(s): "
                           f"run at most one rank per GPU (--nproc / torchrun "
                           f"--nproc_per_node <= {gpus})")
    return chosen


def rank_device(device: torch.device, local_rank: str | None) -> torch.device:
    """``cuda`` without an index -> ``cuda:<local_rank>`` when a local rank is set."""
    import torch

    if device.type == "cuda" and device.index is None and local_rank:
        return torch.device("cuda", int(local_rank))
    return device


# data_config.num_workers when unset and training on CUDA: the step there is short and mostly
# Python, so building batches in the reader thread holds the GIL the step needs
# (docs/training.md, "Input threads and processes")
_CUDA_DEFAULT_WORKERS = 4


def effective_num_workers(data_config: pipeline_pb2.DatasetConfig, device_type: str) -> int:
    """Feature build worker processes to start.

    Args:
        data_config: the pipeline's ``data_config``.
        device_type: ``"cpu"`` or ``"cuda"``, the device the model trains on.

    Returns:
        ``num_workers`` when set; otherwise 0 on CPU and, on CUDA, 4 where the host has at
        least 8 CPUs this process may use (0 below that).
    """
    if data_config.HasField("num_workers"):
        return int(data_config.num_workers)
    if device_type != "cuda":
        return 0
    cpus = usable_cpus()
    workers = _CUDA_DEFAULT_WORKERS if cpus >= 2 * _CUDA_DEFAULT_WORKERS else 0
    logger.info("data_config.num_workers unset on CUDA: %d feature build worker(s) (%d CPUs)",
                workers, cpus)
    return workers
