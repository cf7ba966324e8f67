"""Which partitions of a topic (shards of a DataHub topic) each rank of a job of several reads.

Kafka (``rank_partitions``): of a topic's P partitions in ascending order, rank r of N reads
the i-th for every ``i % N == r``; the assignment depends on the partition list alone, so
every rank computes the same one and together they read every partition exactly once.

DataHub (``shard_rank``): shard ``s`` belongs to rank ``int(s) % N``. DataHub's shards come
and go (a split closes a shard and adds two, a merge closes two and adds one), so the rule
depends on the shard's id alone: every rank computes the same owner for every shard, at any
time, without telling the others, and a shard never changes owner while the job runs.

More ranks than partitions, or a rank that owns no shard at start, is an error: such a rank
would only ever pad the others' steps with empty batches (``odl.train.distributed``).
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


def shard_rank(shard_id: str | int, world_size: int) -> int:
    """The rank that reads DataHub shard ``shard_id``: ``int(shard_id) % world_size``.

    Args:
        shard_id: the shard's id (DataHub's are decimal strings).
        world_size: ranks.

    Returns:
        The owning rank.
    """
    return int(shard_id) % int(world_size)
