"""The exactly-once audit: every produced sample is reflected in the served model once.

A trainer run with ``--sample_ledger`` writes one ``<generation> <step> <sample_id>`` line
per trained sample (``odl.train.sample_ledger``). The model serving sees after a generation's
last complete version ``L`` holds the samples that generation trained at steps ``<= L``;
whatever it trained after ``L`` died with it (the next generation recovers to ``L`` and reads
those records again). So the records reflected are, over all generations, the ledger lines
with ``step <= L[generation]``, and every produced sample id must be among them exactly once.
``L`` comes from the delta topic (``odl.harness.delta_topic_audit.published_versions``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from odl.train.sample_ledger import read_ledger


def reflected_exactly_once(
    produced: Iterable[str],
    entries: Iterable[tuple[str, int, str]],
    last_complete: dict[str, int],
) -> tuple[list[str], list[str]]:
    """Audits a ledger against the versions serving applied.

    Args:
        produced: every sample id produced.
        entries: ``(generation, step, sample_id)`` ledger lines.
        last_complete: generation -> last complete version (``published_versions``).

    Returns:
        ``(lost ids, ids reflected more than once)``; both empty means exactly once.

    Raises:
        ValueError: the ledger names sample ids nobody produced.
    """
    counts = collections.Counter(
        sid for gen, step, sid in entries if step <= last_complete.get(gen, -1))
    produced = list(produced)
    unknown = set(counts) - set(produced)
    if unknown:
        raise ValueError(f"ledger has ids nobody produced: {sorted(unknown)[:5]}")
    lost = [sid for sid in produced if counts[sid] == 0]
    twice = [sid for sid, c in counts.items() if c > 1]
    return lost, twice


def ledger_sample_ids(path: str) -> list[str]:
    """The sample ids of a ``--sample_ledger`` file, in the order they were trained.

    Args:
        path: the ledger file.

    Returns:
        One id per complete ledger line (empty when the file does not exist).
    """
    return [sid for _, _, sid in read_ledger(path)]
