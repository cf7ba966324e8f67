"""Python helper processes that the trainer talks to over a socketpair.

Used by the feature build workers (``odl.inputs.feature_build_worker``) and the input
process (``odl.inputs.kafka_input_child``). A child is ``python -c <boot line>``: the boot
line sets SIGINT and SIGTERM to be ignored before any import (a terminal's Ctrl-C or
systemd's stop reaches the whole process group, possibly while the child is still importing;
the parent decides when its helpers end) and then runs ``<module>.main()`` with ``--fd N``,
the child's end of a socketpair it inherits. Children are started with ``subprocess``, not
``multiprocessing``, which would re-import the parent's ``__main__`` and with it torch.

Wire layout: ``multiprocessing.connection`` framing on the socket (a 4-byte big-endian
length, then a pickle); both ends are this package on one machine. What the messages are is
documented by each module using this one. A child sees EOF when the parent closes its end or
dies, and is expected to exit then.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Optional


def boot_line(module: str) -> str:
    """The ``python -c`` program of a child whose entry point is ``module.main``."""
    return (
        "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"from {module} import main; raise SystemExit(main())"
    )


def spawn_child(module: str) -> tuple[subprocess.Popen, socket.socket, Connection]:
    """Starts ``module.main`` in a child process connected by a socketpair.

    numpy / pyarrow in the child get one thread each (``OMP_NUM_THREADS``,
    ``OPENBLAS_NUM_THREADS`` unless set): the trainer owns the other cores.

    Args:
        module: the child's module, with a ``main(argv)`` that calls :func:`run_child`.

    Returns:
        ``(process, our socket, connection on a duplicate of it)``. Shutting the socket down
        wakes a thread blocked on the connection.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", boot_line(module), "--fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours, Connection(os.dup(ours.fileno()))


def run_child(argv: Optional[list[str]], description: str, tag: str,
              serve: Callable[[Connection], int], level: int = logging.INFO) -> int:
    """A child's ``main``: parses ``--fd``, sets up logging and serves the connection.

    Args:
        argv: command-line arguments (None: ``sys.argv[1:]``).
        description: for ``--help``.
        tag: log lines read ``<tag>[pid]``.
        serve: the child's loop; its return value is the exit code.
        level: the logging level until ``serve`` changes it.

    Returns:
        The exit code.
    """
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--fd", type=int, required=True, help="inherited socket fd")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {tag}[{os.getpid()}] %(name)s: %(message)s")
    conn = Connection(args.fd)
    try:
        return serve(conn)
    finally:
        conn.close()
