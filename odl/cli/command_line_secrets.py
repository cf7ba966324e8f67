"""Keeps secrets given on the command line out of ``ps`` and ``/proc/<pid>/cmdline``.

EasyRec's ``--oss_sk`` passes a secret as an argument, which every local user can read in
``ps`` output while the process runs. :func:`hide_secret_arguments` overwrites those bytes in
the process's own argument memory (Linux: the ``arg_start``..``arg_end`` range of
``/proc/self/stat``, written through ``/proc/self/mem``), so ``ps`` shows ``***`` from then on.
A secret is still visible during the interpreter's start-up (well under a second) and stays
in the shell history: the environment variables (``OSS_ACCESS_KEY_SECRET`` in an
``EnvironmentFile=``) are the way to pass it. Elsewhere, or where the kernel refuses the
write, the function logs one warning and returns False.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)


def _arg_range() -> tuple[int, int]:
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    # fields after the parenthesised command name; arg_start / arg_end are fields 48 / 49
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[45]), int(fields[46])


def hide_secret_arguments(secrets: Sequence[str]) -> bool:
    """Overwrites each occurrence of the secrets in this process's command line with ``*``.

    Args:
        secrets: values to hide (empty ones are skipped).

    Returns:
        True when every secret is hidden (or there was none).
    """
    wanted = [s.encode() for s in secrets if s]
    if not wanted:
        return True
    try:
        start, end = _arg_range()
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            args = bytearray(mem.read(end - start))
            for secret in wanted:
                i = args.find(secret)
                while i >= 0:
                    args[i:i + len(secret)] = b"*" * len(secret)
                    i = args.find(secret, i + len(secret))
            mem.seek(start)
            mem.write(bytes(args))
        return True
    except (OSError, ValueError, IndexError) as exc:
        logger.warning("could not hide a secret argument from ps (%s); pass it through the "
                       "environment instead", type(exc).__name__)
        return False
