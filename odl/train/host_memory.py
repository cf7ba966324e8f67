"""Host memory a new process can use: psutil's figure, capped by the cgroup limits.

:func:`available_host_memory` is ``psutil.virtual_memory().available``, lowered to the room
left under a cgroup memory limit of this process's cgroup or any of its parents: cgroup v2
``memory.max`` minus ``memory.current`` less reclaimable page cache (``inactive_file`` of
``memory.stat``), or cgroup v1 ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``
less ``total_inactive_file`` (v1's "no limit" is a number close to 2**63). The memory check
of a start (:func:`odl.train.memory_estimate.check_memory`) compares its estimate with it.

:func:`release_freed_memory` hands the memory a process freed back to the host after a large
transient copy (a checkpoint's state, a table growth's rebuild).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

__all__ = ["AvailableMemory", "available_host_memory", "release_freed_memory"]

_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a number close to 2**63


@dataclass(frozen=True)
class AvailableMemory:
    """Memory a new process can use.

    Attributes:
        bytes: available bytes.
        source: where the figure comes from (``"host"``, or the cgroup directory whose
            limit is the tighter one).
    """

    bytes: int
    source: str


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _stat_value(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_room(directory: str, v2: bool) -> int | None:
    """Bytes left under ``directory``'s memory limit, or None when it has none."""
    if v2:
        limit_text = _read(os.path.join(directory, "memory.max"))
        usage_text = _read(os.path.join(directory, "memory.current"))
        reclaimable = "inactive_file"
    else:
        limit_text = _read(os.path.join(directory, "memory.limit_in_bytes"))
        usage_text = _read(os.path.join(directory, "memory.usage_in_bytes"))
        reclaimable = "total_inactive_file"
    if limit_text is None or not limit_text.isdigit():
        return None  # "max", missing or unreadable: no limit here
    limit = int(limit_text)
    if limit >= _UNLIMITED:
        return None
    usage = int(usage_text) if usage_text and usage_text.isdigit() else 0
    usage -= _stat_value(_read(os.path.join(directory, "memory.stat")), reclaimable)
    return max(0, limit - max(0, usage))


def _cgroup_dirs(cgroup_root: str, proc_cgroup: str) -> list[tuple[str, bool]]:
    """This process's memory cgroup directories, innermost first, each with ``is_v2``."""
    text = _read(proc_cgroup) or ""
    found: list[tuple[str, bool]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hier, controllers, rel = parts
        if controllers == "":
            base, v2 = cgroup_root, True
        elif "memory" in controllers.split(","):
            base, v2 = os.path.join(cgroup_root, "memory"), False
        else:
            continue
        segments = [s for s in rel.split("/") if s and s not in (".", "..")]
        for depth in range(len(segments), -1, -1):
            found.append((os.path.join(base, *segments[:depth]), v2))
    if not found:  # no /proc/self/cgroup: a container's own root, if any
        found = [(cgroup_root, True), (os.path.join(cgroup_root, "memory"), False)]
    return found


def available_host_memory(
    cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
) -> AvailableMemory:
    """Host memory this process may still use: psutil's figure, capped by cgroup limits.

    Args:
        cgroup_root: where the cgroup file system is mounted.
        proc_cgroup: the process's cgroup membership file.

    Returns:
        The smaller of ``psutil.virtual_memory().available`` and the room left under the
        memory limit of this process's cgroup or any parent cgroup.
    """
    import psutil

    best = AvailableMemory(int(psutil.virtual_memory().available), "host")
    seen: set[str] = set()
    for directory, v2 in _cgroup_dirs(cgroup_root, proc_cgroup):
        if directory in seen:
            continue
        seen.add(directory)
        room = _cgroup_room(directory, v2)
        if room is not None and room < best.bytes:
            best = AvailableMemory(room, f"cgroup {directory}")
    return best


def release_freed_memory() -> bool:
    """Hands the memory this process freed back to the host (glibc's ``malloc_trim``).

    glibc keeps freed blocks smaller than its mmap threshold (which rises to 32 MiB as large
    blocks are freed) in its heaps, resident: a trainer that rebuilt its module or copied
    its state for a checkpoint stays at its peak without this (a trainer's module, freed,
    left 400-600 MB resident here; ``malloc_trim`` returned it).

    Returns:
        Whether memory was returned (False too where the C library has no ``malloc_trim``).
    """
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))
