"""Applies a file stream's day/pass deltas onto a base (``odl-serve --delta_dir``).

Reads the layout the trainer writes under ``file_stream_input.model_save_path``
(:mod:`odl.train.pass_saves`)::

    <root>/YYYYMMDD/delta_<pass_id>/<version:020d>-<generation>.delta (+ .delta.done)
    <root>/YYYYMMDD/base/<unix-seconds>/    an export: the model at the end of that day

A base is the model at the end of its day, so the deltas that continue it are those of the
later days: ``catch_up`` applies every complete ``delta_<pass_id>`` of every day after the
base's day, in (day, pass id) order, each of its versions in file-name order, through the
same path as the delta topic (:class:`serving_plugin.delta_replayer.DeltaReplayer`'s
``handle``: decode and check, generation fence, assemble, apply all-or-nothing). A delta
directory is applied once; a polling thread (``start``) looks for new ones every
``poll_secs``. Days are directories named ``YYYYMMDD``; anything else in ``root`` is ignored.
A directory that is not complete yet (no ``.done`` marker) holds back the later ones. A delta
directory that appears for a day and pass before the last applied one is skipped: the
trainer writes them in order, and one rewritten by a trainer that retrained the pass after a
crash holds the rows serving already applied.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Optional

from odl.storage import file_store
from odl.storage.oss_store import StorageError
from odl.storage.storage_path import basename, dirname, join
from publisher.fs_sink import list_versions, read_chunks
from serving_plugin.delta_replayer import DeltaReplayer

logger = logging.getLogger(__name__)

_DAY = re.compile(r"^\d{8}$")
_DELTA = re.compile(r"^delta_(\d+)$")


def base_day_of(export_path: str) -> Optional[str]:
    """``YYYYMMDD`` of a day base export (``<root>/<day>/base[/<unix-seconds>]``), else None."""
    path = export_path.rstrip("/")
    if basename(dirname(path)) == "base":
        day = basename(dirname(dirname(path)))
    elif basename(path) == "base":
        day = basename(dirname(path))
    else:
        return None
    return day if _DAY.match(day) else None


class PassDeltaFollower:
    """Applies the deltas after a base, in order (module docstring).

    Args:
        replayer: applies one delta chunk (``handle``); its Kafka consumer is not started.
        root: the trainer's ``model_save_path``.
        after_day: apply the deltas of the days after this one (the base's day).
        poll_secs: seconds between two looks for new delta directories.
    """

    def __init__(self, replayer: DeltaReplayer, root: str, after_day: str,
                 poll_secs: float = 5.0) -> None:
        self.replayer = replayer
        self.root = root
        self.after_day = after_day
        self.poll_secs = float(poll_secs)
        self.last_applied: Optional[tuple[str, int]] = None
        self.deltas_applied = 0
        self.versions_applied = 0
        self.last_error: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def pending(self) -> list[tuple[str, int, str]]:
        """``(day, pass id, directory)`` of the delta directories not applied yet, in order."""
        out = []
        days = sorted(d for d in file_store.list_dir(self.root)[0]
                      if _DAY.match(d) and d > self.after_day)
        for day in days:
            for name in file_store.list_dir(join(self.root, day))[0]:
                m = _DELTA.match(name)
                if m:
                    out.append((day, int(m.group(1)), join(self.root, day, name)))
        out.sort()
        if self.last_applied is not None:
            out = [x for x in out if (x[0], x[1]) > self.last_applied]
        return out

    def catch_up(self) -> int:
        """Applies every pending delta directory; returns versions applied."""
        applied = 0
        try:
            pending = self.pending()
        except (OSError, StorageError) as exc:
            self.last_error = f"listing {self.root}: {exc}"
            logger.warning("%s", self.last_error)
            return 0
        for day, pass_id, directory in pending:
            try:
                files = list(list_versions(directory))
                if not files:  # not complete yet (OSS: the marker object comes last):
                    break      # the later ones wait for it, deltas apply in order
                for path in files:
                    for chunk in read_chunks(path):
                        if self.replayer.handle(chunk) is not None:
                            applied += 1
            except (OSError, StorageError, ValueError) as exc:
                self.last_error = f"{directory}: {exc}"
                logger.warning("delta %s not applied: %s", directory, exc)
                break
            self.last_applied = (day, pass_id)
            self.deltas_applied += 1
            logger.info("applied %s (model version %d)", directory,
                        self.replayer.model.state.version)
        self.versions_applied += applied
        return applied

    def start(self) -> None:
        """Applies what is there, then polls for new delta directories in a thread."""
        self.catch_up()
        self._thread = threading.Thread(target=self._run, name="odl-pass-deltas", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_secs):
            self.catch_up()

    def stop(self) -> None:
        """Stops the polling thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def status(self) -> dict[str, Any]:
        """``/status`` ``"pass_deltas"``."""
        last = self.last_applied
        return {"delta_dir": self.root, "after_day": self.after_day,
                "last_applied": f"{last[0]}/delta_{last[1]}" if last else None,
                "deltas_applied": self.deltas_applied,
                "versions_applied": self.versions_applied, "last_error": self.last_error}
