"""Process-wide torch settings chosen by the odl daemons' command lines, and the device."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


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
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return rank_device(torch.device(device), os.environ.get("LOCAL_RANK"))


def rank_device(device: torch.device, local_rank: str | None) -> torch.device:
    """``cuda`` without an index -> ``cuda:<local_rank>`` when a local rank is set."""
    import torch

    if device.type == "cuda" and device.index is None and local_rank:
        return torch.device("cuda", int(local_rank))
    return device
