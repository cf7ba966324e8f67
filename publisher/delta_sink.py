"""Where encoded delta versions go: the ``DeltaSink`` protocol.

Implemented by ``publisher.kafka_sink.KafkaSink`` (the delta topic) and
``publisher.fs_sink.FsSink`` (a directory of version files). The publisher's sender calls
``send`` and ``close`` and merges ``status()`` into the publisher's status; the trainer
reads ``topic`` / ``servers`` for the replay point it writes into every checkpoint,
``broker_error`` for its health, and crash recovery calls ``claim`` before reading the topic.

Contract of ``send``: it returns only when every chunk of the version is durably
published, in chunk order; otherwise it raises and the caller retries the newest state
(``DeltaSinkError``, or ``OSError`` for files). ``DeltaSinkFenced`` (a newer trainer owns
the topic) is final: the caller stops publishing. ``DeltaSinkUnsupported`` from ``claim``
means the destination cannot fence other writers as configured (a setup error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Protocol


class SentOffsets(NamedTuple):
    """Where a version's chunks landed in the delta topic.

    Attributes:
        first: offset of the first chunk (-1: the sink has no offsets).
        last: offset of the last chunk (-1: the sink has no offsets).
    """

    first: int
    last: int


NO_OFFSETS = SentOffsets(-1, -1)


class DeltaSinkError(RuntimeError):
    """A version could not be published (it may be partially written); retry the newest state."""


class DeltaSinkFenced(DeltaSinkError):
    """A newer trainer publishes to the delta topic: this one must stop publishing."""


class DeltaSinkUnsupported(DeltaSinkError):
    """The broker refuses the transactional producer that fencing needs."""


class DeltaSink(Protocol):
    """What callers use of a delta sink (see the module docstring)."""

    @property
    def description(self) -> str:
        """Human-readable destination, for logs and ``/status``."""

    @property
    def topic(self) -> Optional[str]:
        """The Kafka topic serving replays versions from, or None (a sink without a topic)."""

    @property
    def servers(self) -> str:
        """Bootstrap servers of ``topic`` (``""`` when there is no topic)."""

    @property
    def broker_error(self) -> Optional[str]:
        """Why the sink's broker is unreachable right now, or None."""

    def claim(self, timeout: float = 30.0) -> None:
        """Makes this trainer the destination's only writer (a no-op where nothing fences).

        Args:
            timeout: seconds to wait for the broker.
        """

    def send(self, version: int, generation: str, chunks: Sequence[bytes],
             timeout: float = 30.0) -> SentOffsets:
        """Publishes all chunks of one version, in order, and waits until they are durable.

        Args:
            version: the version (the trainer's global step).
            generation: the trainer generation id.
            chunks: serialized chunks in order.
            timeout: seconds to wait for acknowledgements.

        Returns:
            The topic offsets of the first and last chunk (``NO_OFFSETS`` for a sink
            without offsets).
        """

    def status(self) -> dict[str, Any]:
        """Sink-specific fields merged into the publisher's status (may be empty)."""

    def close(self, timeout: float = 5.0) -> None:
        """Flushes and releases what the sink holds (called once, when publishing ends)."""
