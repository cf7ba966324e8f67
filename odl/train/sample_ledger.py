r"""The sample ledger (``odl-train --sample_ledger F``): one line per trained sample.

Layout, UTF-8 text, appended and flushed after every step (before the step can be
published, so a crash audit never misses a published sample)::

    <generation>\t<global_step>\t<sample_id>\n

``generation`` is the trainer run's id, ``global_step`` the step that trained the sample and
``sample_id`` the value of ``data_config.sample_id_field``, with a backslash, tab, CR and LF
written as ``\\``, ``\t``, ``\r``, ``\n`` (a sample id may hold any text). A line without
its trailing newline was cut by a kill: its step never finished and the line is ignored.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

_ESCAPES = {"t": "\t", "n": "\n", "r": "\r"}


def ledger_text(sample_id: str) -> str:
    """A sample id as written in the ledger (backslash, tab, CR and LF escaped)."""
    if not any(c in sample_id for c in "\\\t\n\r"):
        return sample_id
    return (sample_id.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
            .replace("\r", "\\r"))


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            out.append(_ESCAPES.get(text[i + 1], text[i + 1]))
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


class SampleLedger:
    """Appends trained samples to a ledger file.

    Args:
        path: the ledger file (appended to).
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8", buffering=1 << 16)

    def write_step(self, generation: str, step: int, sample_ids: Sequence[str]) -> None:
        """Appends one step's samples and flushes them."""
        self._file.write("".join(f"{generation}\t{step}\t{ledger_text(sid)}\n"
                                 for sid in sample_ids))
        self._file.flush()

    def close(self) -> None:
        """Closes the file."""
        self._file.close()


def read_ledger(path: str) -> list[tuple[str, int, str]]:
    """``(generation, step, sample_id)`` per complete line of a ledger (empty if missing).

    Args:
        path: the ledger file.

    Returns:
        The entries in file order.
    """
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n") or not line.strip():
                continue
            gen, step, sid = line[:-1].split("\t")
            out.append((gen, int(step), _unescape(sid)))
    return out
