"""Who owns a delta topic: the newest trainer generation to publish on it.

Every trainer start has a new generation id (written into every chunk's header). Read in
topic order, the generation of the most recent FIRST appearance owns the topic; a generation
that appeared before it is superseded, and every later chunk of it is ignored. A restarted
trainer (kill -9, upgrade) therefore simply takes over, and a second trainer publishing the
same model into the same topic (a misconfigured copy, a zombie after a network partition)
is ignored from the moment the newer one starts publishing, by serving (``DeltaReplayer``)
and by crash recovery (``publisher.delta_recovery``) alike, so both reach the same state.

On Kafka the transactional producer (``publisher.kafka_sink``, ``fence_producers``) already
stops an older trainer at the broker; this rule is what holds for any sink and any broker.

The memory is bounded: at most ``max_superseded`` superseded generations are remembered
(oldest forgotten first); one is added per trainer start.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

FENCED_REASON = "fenced_generation"


class GenerationFence:
    """Applies the ownership rule to chunk headers in topic order.

    Args:
        owner: the generation that owns the topic at the read's start (e.g. the base
            export's or the restored checkpoint's), or None when unknown.
        max_superseded: superseded generations remembered.
    """

    def __init__(self, owner: Optional[str] = None, max_superseded: int = 1024) -> None:
        self.owner = owner or None
        self._superseded: OrderedDict[str, None] = OrderedDict()
        self._max = int(max_superseded)
        self.takeovers = 0

    def admit(self, generation: str) -> bool:
        """Whether a chunk of ``generation`` (the next in topic order) counts.

        Args:
            generation: the chunk's generation id.

        Returns:
            True for the owner's chunks and for a new generation's first chunk (which makes
            it the owner); False for a superseded generation's chunks.
        """
        if generation == self.owner:
            return True
        if generation in self._superseded:
            return False
        if self.owner is not None:
            self._superseded[self.owner] = None
            while len(self._superseded) > self._max:
                self._superseded.popitem(last=False)
            self.takeovers += 1
        self.owner = generation
        return True

    @property
    def superseded(self) -> list[str]:
        """Superseded generations remembered, oldest first."""
        return list(self._superseded)
