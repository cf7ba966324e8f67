"""Which partitions of a topic each rank of a job of several reads.

Of a topic's P partitions in ascending order, rank r of N reads the i-th for every
``i % N == r``; the assignment depends on the partition list alone, so every rank computes
the same one and together they read every partition exactly once. More ranks than
partitions is an error: a rank without input would hold the others' steps forever
(``odl.train.distributed``).
"""

from __future__ import annotations

from collections.abc import Sequence


def rank_partitions(partitions: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The partitions rank ``rank`` reads: the i-th (ascending) for ``i % world_size == rank``.

    Args:
        partitions: every partition of the topic.
        rank: this rank.
        world_size: ranks.

    Returns:
        This rank's partitions, ascending.

    Raises:
        ValueError: more ranks than partitions.
    """
    parts = sorted(int(p) for p in partitions)
    if world_size > len(parts):
        raise ValueError(f"{world_size} ranks but only {len(parts)} partitions: every rank "
                         "needs at least one (fewer ranks, or more partitions)")
    return [p for i, p in enumerate(parts) if i % world_size == rank]
