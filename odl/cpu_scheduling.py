"""Keeping input work from preempting the train step: Linux's SCHED_BATCH class.

The train step on CPU is one long-running thread. Input work (Kafka client threads, the
reader and collector threads, feature build workers) sleeps and wakes up often: at every
fetch, every queue hand-off. Under the default policy a waking thread may preempt the train
step on its core even while another core is idle. A thread in the ``SCHED_BATCH`` class never
preempts a running thread on wake-up; it waits for a free core or the next scheduler tick.
Its CPU share and nice value are unchanged, so a thread that holds the GIL is not starved
(which a higher nice value risks: the train step would then wait for the GIL behind it).

Threads inherit the class of the thread that creates them, which is how librdkafka's own
threads get it (see :func:`call_in_batch_thread`). Elsewhere than Linux these are no-ops.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def make_thread_batch_scheduled() -> bool:
    """Puts the calling thread in the SCHED_BATCH class.

    Returns:
        Whether it worked (False on systems without SCHED_BATCH).
    """
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_BATCH, os.sched_param(0))
        return True
    except (AttributeError, OSError) as exc:
        logger.debug("SCHED_BATCH not available: %s", exc)
        return False


def call_in_batch_thread(fn: Callable[[], T]) -> T:
    """Calls ``fn`` in a short-lived SCHED_BATCH thread and returns its result.

    Threads that ``fn`` starts (e.g. librdkafka's, started when a client is created) inherit
    the class. Exceptions propagate to the caller.
    """
    out: dict[str, object] = {}

    def run() -> None:
        make_thread_batch_scheduled()
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised in the caller
            out["error"] = exc

    t = threading.Thread(target=run, name="batch-sched-call")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]
