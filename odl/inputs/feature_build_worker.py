"""Feature building in worker processes, off the train loop's GIL.

Parsing, hashing and bucketizing a batch is CPU work in Python and numpy that holds the GIL
for several milliseconds per batch. Done in the trainer's reader thread it competes with the
train step, whose Python code needs the GIL between operators. ``FeatureBuildWorkers`` runs
``FeatureBuilder.build_arrays`` in ``data_config.num_workers`` child processes instead; the
trainer's process only reads records from Kafka and wraps the returned arrays as tensors
(``FeatureBuilder.to_batch``, no copy).

Each worker is a child process of :mod:`odl.inputs.child_process` (signals ignored from its first
moment, a socketpair to the trainer) that imports numpy, pyarrow and protobuf only.

Wire layout, over one socketpair per worker (``odl.inputs.child_process`` framing):

* trainer -> worker, first: ``("init", <EasyRecConfig serialized bytes>, max_record_bytes)``
* worker -> trainer, then: ``("ready", pid)``, or ``("error", traceback text)`` and exit
* trainer -> worker: ``("build", values)`` with ``values`` a ``list[bytes]`` of records
* worker -> trainer: ``("ok", ArraysResult)`` or ``("error", traceback text)``
* the trainer shutting the socket down (or dying): the worker exits 0.

Batches go to the workers round-robin and come back in the same order. Workers ignore SIGINT
and SIGTERM from their first moment (a terminal's Ctrl-C or systemd's stop reaches the whole
process group, possibly while a worker is still importing); they exit when the trainer
closes their socket, including when the trainer dies.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Optional

from odl.features.feature_builder import ArraysResult
from odl.inputs.child_process import run_child, spawn_child
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

# Seconds a worker may take to import and build its FeatureBuilder.
_START_TIMEOUT_SECS = 120.0
# Batches each worker may hold (one being built, one waiting): keeps workers busy without
# reading far ahead of the trainer.
IN_FLIGHT_PER_WORKER = 2


class FeatureBuildError(RuntimeError):
    """A feature build worker failed, exited or could not start."""


class _Worker:
    def __init__(self, proc: subprocess.Popen, sock: socket.socket, conn: Connection) -> None:
        self.proc = proc
        self.sock = sock  # kept for shutdown(), which wakes a thread blocked on the socket
        self.conn = conn
        self.ready = False

    def exited(self) -> FeatureBuildError:
        """The error for this worker's socket failing (it died or was killed)."""
        return FeatureBuildError(
            f"feature build worker pid {self.proc.pid} exited (code {self.proc.poll()})")


class FeatureBuildWorkers:
    """A fixed set of feature-building worker processes used in order (round-robin).

    ``submit`` and ``collect`` are each called from one thread (they may be two different
    threads); results come back in submission order.

    Args:
        pipeline_config: the pipeline config (the workers build a ``FeatureBuilder`` from it).
        num_workers: processes to start (>= 1).
        max_record_bytes: passed to each worker's ``FeatureBuilder``.
    """

    def __init__(
        self,
        pipeline_config: pipeline_pb2.EasyRecConfig,
        num_workers: int,
        max_record_bytes: int = 1 << 20,
    ) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self._config_bytes = pipeline_config.SerializeToString()
        self._max_record_bytes = int(max_record_bytes)
        self.num_workers = int(num_workers)
        self._workers: list[_Worker] = []
        self._next_submit = 0
        self._next_collect = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def capacity(self) -> int:
        """Batches that may be submitted and not yet collected."""
        return self.num_workers * IN_FLIGHT_PER_WORKER

    def start(self) -> FeatureBuildWorkers:
        """Starts the processes (does not wait for them to be ready; the first use does).

        Returns:
            ``self``.
        """
        for _ in range(self.num_workers):
            proc, sock, conn = spawn_child("odl.inputs.feature_build_worker")
            worker = _Worker(proc, sock, conn)
            worker.conn.send(("init", self._config_bytes, self._max_record_bytes))
            self._workers.append(worker)
        logger.info("started %d feature build worker(s): pids %s", self.num_workers,
                    [w.proc.pid for w in self._workers])
        return self

    def _recv(self, worker: _Worker, stop: Optional[threading.Event],
              timeout: Optional[float] = None) -> Optional[tuple]:
        """Next message from ``worker``; None when ``stop`` is set first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:  # a dead worker's socket reads as EOF
                if worker.conn.poll(0.1):
                    return worker.conn.recv()
            except (EOFError, OSError) as exc:
                raise worker.exited() from exc
            if stop is not None and stop.is_set():
                return None
            if deadline is not None and time.monotonic() > deadline:
                raise FeatureBuildError(
                    f"feature build worker pid {worker.proc.pid} did not start "
                    f"within {timeout:.0f}s")

    def _ensure_ready(self, worker: _Worker, stop: Optional[threading.Event]) -> bool:
        if worker.ready:
            return True
        msg = self._recv(worker, stop, timeout=_START_TIMEOUT_SECS)
        if msg is None:
            return False
        if msg[0] != "ready":
            raise FeatureBuildError(f"feature build worker failed to start:\n{msg[1]}")
        worker.ready = True
        return True

    def submit(self, values: list[bytes]) -> None:
        """Sends one batch of records to the next worker.

        Raises:
            FeatureBuildError: the worker is gone.
        """
        worker = self._workers[self._next_submit % self.num_workers]
        self._next_submit += 1
        try:
            worker.conn.send(("build", values))
        except (OSError, ValueError) as exc:
            raise worker.exited() from exc

    def collect(self, stop: Optional[threading.Event] = None) -> Optional[ArraysResult]:
        """The result of the oldest submitted batch, waiting for it.

        Args:
            stop: returns None as soon as this is set.

        Returns:
            The build result, or None when stopped first.

        Raises:
            FeatureBuildError: the worker failed on the batch or exited.
        """
        worker = self._workers[self._next_collect % self.num_workers]
        if not self._ensure_ready(worker, stop):
            return None
        msg = self._recv(worker, stop)
        if msg is None:
            return None
        self._next_collect += 1
        if msg[0] != "ok":
            raise FeatureBuildError(f"feature build worker failed on a batch:\n{msg[1]}")
        return msg[1]

    def close(self, timeout: float = 5.0) -> None:
        """Closes the sockets (each worker exits on that) and waits for the processes.

        Safe to call while another thread is blocked in ``submit`` or ``collect``: shutting
        the sockets down wakes it with an error. Workers still running after ``timeout`` are
        killed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers:
            try:
                w.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for w in self._workers:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("feature build worker pid %d did not exit; killing", w.proc.pid)
                w.proc.kill()
                w.proc.wait(5.0)
            w.conn.close()
            w.sock.close()

    @property
    def pids(self) -> list[int]:
        """Worker process ids."""
        return [w.proc.pid for w in self._workers]


def _serve(conn: Connection) -> int:
    """The worker's loop: init, then build batches until the trainer closes the socket."""
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return 0
    try:
        from odl.features.feature_builder import FeatureBuilder

        config = pipeline_pb2.EasyRecConfig.FromString(msg[1])
        builder = FeatureBuilder(config, max_record_bytes=msg[2])
    except Exception:  # reported to the trainer, which fails with it
        conn.send(("error", traceback.format_exc()))
        return 1
    try:
        conn.send(("ready", os.getpid()))
        while True:
            msg = conn.recv()
            try:
                reply = ("ok", builder.build_arrays(msg[1]))
            except Exception:
                reply = ("error", traceback.format_exc())
            conn.send(reply)
    except (EOFError, OSError):
        return 0  # the trainer closed the socket, or died


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of a worker process (see :func:`odl.inputs.child_process.run_child`)."""
    return run_child(argv, "odl feature build worker (internal)", "odl-feature-worker", _serve,
                     level=logging.WARNING)
