"""A process's memory as the kernel counts it (``/proc/<pid>/status``), for the benches.

``VmRSS`` is the resident set now, ``VmHWM`` its high-water mark since the process started
or since ``reset_peak`` (writing ``5`` to ``/proc/<pid>/clear_refs``). The kernel keeps no
high-water mark of anonymous memory alone: a bench that must leave mapped files out samples
``RssAnon`` itself.
"""

from __future__ import annotations


def status_kb(field: str, pid: int | str = "self") -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``...).

    Raises:
        KeyError: the field is not there.
    """
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int | str = "self") -> None:
    """Resets ``VmHWM`` of the process to its current RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
