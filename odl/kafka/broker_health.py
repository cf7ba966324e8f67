"""Broker reachability and out-of-range positions, judged the same way by every Kafka client.

The trainer's Kafka source, the delta sink and serving's delta replayer each show whether
their broker is reachable (``broker_error`` in ``/status``, 503 from ``/healthz``) and each
must continue sensibly when a position is no longer in the log. The rules live here:

* **Unreachable.** librdkafka's ``error_cb`` reports ``_ALL_BROKERS_DOWN`` or ``_RESOLVE``
  (``OUTAGE_CODES``): every broker is down or its name does not resolve. A single request
  that fails with ``_TRANSPORT`` (or one of the outage codes; ``REQUEST_FAILURE_CODES``)
  means the same for the client that sent it. A lone ``_TRANSPORT`` in ``error_cb`` is not an
  outage: librdkafka reports one whenever a connection closes (an idle connection the broker
  dropped, a restart it recovers from), and a client idle for minutes would otherwise look
  unhealthy until its next request.
* **Reachable again** only after a request succeeded (a watermark query, an acknowledged
  delivery), never merely because no error came for a while.
* **Out of range.** A fetch at ``position`` reports ``OFFSET_OUT_OF_RANGE`` (consumers set
  ``auto.offset.reset=error`` so librdkafka never jumps by itself). Above the log end
  (``position > high``) the broker lost acknowledged messages (a restart of a broker that had
  not saved them, an unclean leader election): continue at the new end, never from the
  beginning, which would repeat everything. Otherwise retention deleted what was not read
  yet: continue at the log start. ``out_of_range_target`` returns which.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from confluent_kafka import KafkaError, KafkaException

logger = logging.getLogger(__name__)

# error_cb codes that mean every broker is unreachable
OUTAGE_CODES = frozenset({KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE})
# codes of a failed request (a message error, a delivery report) that mean the same
REQUEST_FAILURE_CODES = OUTAGE_CODES | {KafkaError._TRANSPORT}
# a fetch position that is not in the log
OUT_OF_RANGE_CODES = frozenset({KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET})


def error_text(exc: BaseException) -> str:
    """The message librdkafka gave a ``KafkaException`` (``str(exc)`` for anything else)."""
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return err.str() if isinstance(err, KafkaError) else str(exc)


class BrokerHealth:
    """Whether one client's broker is reachable, as that client last saw it.

    Args:
        what: the client, for log lines (e.g. ``"kafka input"``, ``"delta broker"``).

    Attributes:
        error: why the broker is unreachable, or None.
        since: when it became unreachable (unix seconds), or None.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.error: Optional[str] = None
        self.since: Optional[float] = None

    def on_client_error(self, err: KafkaError) -> bool:
        """Handles an ``error_cb`` report; True when it is an outage (see the module doc)."""
        if err.code() in OUTAGE_CODES:
            self.unreachable(err.str())
            return True
        if err.fatal():
            logger.error("%s: fatal client error: %s", self.what, err.str())
        else:
            logger.debug("%s: client error: %s", self.what, err.str())
        return False

    def on_request_error(self, err: KafkaError) -> bool:
        """Handles a failed request; True when it means the broker is unreachable."""
        if err.code() in REQUEST_FAILURE_CODES:
            self.unreachable(err.str())
            return True
        return False

    def unreachable(self, reason: str) -> None:
        """Records that the broker is unreachable (logged once per outage)."""
        if self.error is None:
            self.since = time.time()
            logger.warning("%s unavailable: %s (waiting for it; nothing is lost)", self.what,
                           reason)
        self.error = reason

    def reachable(self) -> None:
        """Records a successful request: the outage, if any, is over."""
        if self.error is not None:
            logger.info("%s available again after %.1fs", self.what,
                        time.time() - (self.since or time.time()))
        self.error = None
        self.since = None


class ReportsBrokerHealth:
    """Mixin for a client with a ``health`` (:class:`BrokerHealth`): its status attributes."""

    health: BrokerHealth

    @property
    def broker_error(self) -> Optional[str]:
        """Why the broker is unreachable, or None."""
        return self.health.error

    @property
    def broker_error_since(self) -> Optional[float]:
        """When ``broker_error`` was first set (unix seconds), or None."""
        return self.health.since


@dataclass(frozen=True)
class OutOfRangeTarget:
    """Where a reader whose position left the log continues.

    Attributes:
        offset: the offset to continue at.
        cause: ``"truncated"`` (the log ends before the position: acknowledged messages were
            lost; continue at the end) or ``"retention"`` (the log starts after the position:
            unread messages were deleted; continue at the start).
    """

    offset: int
    cause: str


def out_of_range_target(position: int, low: int, high: int) -> OutOfRangeTarget:
    """The offset to continue at when ``position`` is out of the log ``[low, high)``.

    Args:
        position: the reader's position (next offset to read).
        low: the log start (first offset kept).
        high: the log end (next offset to be written).

    Returns:
        The target and its cause (see the module docstring).
    """
    if position > high:
        return OutOfRangeTarget(int(high), "truncated")
    return OutOfRangeTarget(max(int(low), 0), "retention")
