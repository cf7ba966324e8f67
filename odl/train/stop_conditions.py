"""When the trainer stops, and why.

Every stop is clean: the train loop finishes its step, the trainer checkpoints and ``run``
returns. The first reason given wins and is reported as ``/status`` ``stop_reason``:

* a request: ``Trainer.request_stop`` from ``odl-train``'s SIGTERM / SIGINT handlers
  (``"SIGTERM received"``), from tests, or from the trainer itself on a failure;
* the stop signal file ``OSS_STOP_SIGNAL`` in ``model_dir`` (EasyRec's name), looked for every
  ``train_config.stop_signal_poll_secs`` when ``enable_oss_stop_signal`` is set; the file is
  removed once acted on, so the next start does not stop at once. On an ``oss://``
  model_dir a daemon thread looks for it (one HEAD request per poll), so a slow or
  unreachable OSS never holds up the train loop;
* ``train_config.dead_line`` passed (:func:`odl.config.field_formats.parse_dead_line`);
* ``train_config.num_steps`` reached;
* the end of offline input (the loop calls :meth:`StopConditions.request` with
  ``"end of input"``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from odl.config.field_formats import parse_dead_line
from odl.protos import pipeline_pb2
from odl.storage import file_store
from odl.storage.oss_store import StorageError
from odl.storage.storage_path import is_remote, join

logger = logging.getLogger(__name__)

__all__ = ["STOP_SIGNAL_FILE", "StopConditions"]

STOP_SIGNAL_FILE = "OSS_STOP_SIGNAL"


class StopConditions:
    """The stop request and the conditions the train loop checks before each step.

    Args:
        train_config: the pipeline's ``train_config``.
        model_dir: where the stop signal file appears.

    Attributes:
        event: set once a stop is requested (thread and signal safe); waits in the
            trainer (crash recovery's retries, opening the input) end on it.
        reason: why the trainer stops, None until then.
    """

    def __init__(self, train_config: pipeline_pb2.TrainConfig, model_dir: str) -> None:
        self.event = threading.Event()
        self.reason: Optional[str] = None
        self._signal_file_enabled = train_config.enable_oss_stop_signal
        self._signal_path = join(model_dir, STOP_SIGNAL_FILE)
        self._poll_secs = max(0.1, train_config.stop_signal_poll_secs)
        self._next_signal_check = 0.0
        self._dead_line = (parse_dead_line(train_config.dead_line)
                           if train_config.dead_line else None)
        self._num_steps = train_config.num_steps if train_config.HasField("num_steps") else None
        self._poller: Optional[threading.Thread] = None
        if self._signal_file_enabled and is_remote(model_dir):
            self._poller = threading.Thread(target=self._poll_remote_signal, daemon=True,
                                            name="odl-stop-signal")
            self._poller.start()

    def _signal_present(self) -> bool:
        try:
            return file_store.is_file(self._signal_path)
        except StorageError as exc:  # OSS down: training goes on, the next poll retries
            logger.warning("cannot look for %s: %s", self._signal_path, exc)
            return False

    def _poll_remote_signal(self) -> None:
        while not self.event.wait(self._poll_secs):
            if self._signal_present():
                self.request(f"{STOP_SIGNAL_FILE} found in model_dir")
                _consume_signal_file(self._signal_path)
                return

    @property
    def requested(self) -> bool:
        """Whether a stop was requested."""
        return self.event.is_set()

    def request(self, reason: str) -> None:
        """Asks the trainer to stop; the first reason is kept.

        Args:
            reason: why, as ``/status`` reports it.
        """
        if self.reason is None:
            self.reason = reason
            logger.info("stopping: %s", reason)
        self.event.set()

    def check(self, global_step: int) -> bool:
        """Checks the stop signal file (at most every poll interval), dead_line and num_steps.

        A condition that is met is requested as the stop reason.

        Args:
            global_step: the model's step.

        Returns:
            True when the trainer must stop now.
        """
        now = time.monotonic()
        if self._signal_file_enabled and self._poller is None and now >= self._next_signal_check:
            self._next_signal_check = now + self._poll_secs
            if self._signal_present():
                self.request(f"{STOP_SIGNAL_FILE} found in model_dir")
                _consume_signal_file(self._signal_path)
                return True
        if self._dead_line is not None and time.time() >= self._dead_line:
            self.request("dead_line reached")
            return True
        if self._num_steps is not None and global_step >= self._num_steps:
            self.request(f"num_steps {self._num_steps} reached")
            return True
        return False


def _consume_signal_file(path: str) -> None:
    """Removes the stop signal once acted on, so the next start does not stop at once."""
    try:
        file_store.remove(path)
        logger.info("removed %s after acting on it", path)
    except (OSError, StorageError) as exc:
        logger.warning("could not remove %s: %s", path, exc)
