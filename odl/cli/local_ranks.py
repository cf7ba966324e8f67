"""``odl-train --nproc N``: one model over N processes of this host, through ``torchrun``.

Runs ``python -m torch.distributed.run --standalone --nproc_per_node N --max-restarts R -m
odl.cli.train_cli <the same arguments>`` as a child in a session of its own and waits for
it; its exit code is the launcher's (0 once every rank stopped cleanly). SIGTERM and SIGINT
to the launcher are passed on as SIGTERM to the ranks themselves (``torchrun``'s children),
which stop together after the step, checkpoint and exit 0; ``torchrun`` is not signalled
(it would report its own signal as a failure). Several hosts, or other ``torchrun`` options:
run ``torchrun`` directly (docs/operations.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

import psutil

# the launcher's own flags, not passed on to the ranks
LAUNCH_FLAGS = ("--nproc", "--max_restarts")


def rank_arguments(argv: Sequence[str]) -> list[str]:
    """What every rank is started with: ``argv`` without the launcher's flags.

    Those are ``--nproc N`` or ``--nproc=N``, and the same for ``--max_restarts``.
    """
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCH_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def run_local_ranks(nproc: int, max_restarts: int, argv: Sequence[str]) -> int:
    """Runs ``odl-train`` with ``argv`` as ``nproc`` ranks under ``torchrun``; its exit code.

    Args:
        nproc: ranks on this host.
        max_restarts: ``torchrun``'s restarts of all ranks after one died.
        argv: the command line (the launcher's flags are left out).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), "--max-restarts", str(max_restarts),
           "-m", "odl.cli.train_cli", *rank_arguments(argv)]
    # torchrun gives each rank OMP_NUM_THREADS=1 when it is unset, with a banner saying so;
    # set here, the ranks get the same and the output stays the trainer's
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)

    def to_ranks(_signum: int, _frame: object) -> None:
        try:
            ranks = psutil.Process(proc.pid).children()
        except psutil.Error:
            return
        for rank in ranks:
            try:
                rank.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass

    previous = {sig: signal.signal(sig, to_ranks) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
