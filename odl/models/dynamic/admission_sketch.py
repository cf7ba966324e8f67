"""The admission sketch of a dynamic table: show and click counts of ids without a row.

A count-min sketch (depth 4, ``width`` a power of two near the table's capacity, at most
2**20) never under-counts: an id seen ``filter_freq`` times is always admitted, and one seen
fewer times only when hash collisions inflate its estimate. Every counter is halved once
``10 x width`` sightings have been added, so old sightings fade. The engine's rules are in
:mod:`odl.models.dynamic`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from odl.features.raw_id_index import mix64

__all__ = ["CountMinSketch"]

_SKETCH_DEPTH = 4
_SKETCH_MAX_WIDTH = 1 << 20


class CountMinSketch:
    """Show and click counts of ids without a row (see the module docstring).

    Args:
        width: counters per row (rounded up to a power of two, at most 2**20).
        seed: hash seed.
        clicks: count clicks too (a score threshold needs them; a frequency one does not).
    """

    def __init__(self, width: int, seed: int, clicks: bool = True) -> None:
        w = 1024
        while w < width and w < _SKETCH_MAX_WIDTH:
            w *= 2
        self.width = w
        self._mask = np.uint64(w - 1)
        rng = np.random.default_rng(seed)
        self._salts = rng.integers(1, 1 << 62, size=_SKETCH_DEPTH, dtype=np.int64).astype(
            np.uint64)
        self.show = np.zeros((_SKETCH_DEPTH, w), dtype=np.float32)
        self.click = np.zeros((_SKETCH_DEPTH, w if clicks else 0), dtype=np.float32)
        self.added = 0.0

    def nbytes(self) -> int:
        """Bytes of the counters."""
        return self.show.nbytes + self.click.nbytes

    @property
    def salts(self) -> np.ndarray:
        """The per-row hash salts (two sketches count alike only with equal salts)."""
        return self._salts

    def add(self, ids: np.ndarray, shows: np.ndarray,
            clicks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Adds sightings of unique ``ids``; returns their estimated (show, click) totals."""
        uids = ids.astype(np.uint64)
        counts_clicks = self.click.shape[1] > 0
        est_s = np.full(ids.shape[0], np.inf, dtype=np.float64)
        est_c = np.full(ids.shape[0], np.inf if counts_clicks else 0.0, dtype=np.float64)
        for d in range(_SKETCH_DEPTH):
            col = (mix64(uids ^ self._salts[d]) & self._mask).astype(np.int64)
            np.add.at(self.show[d], col, shows.astype(np.float32))
            est_s = np.minimum(est_s, self.show[d, col])
            if counts_clicks:
                np.add.at(self.click[d], col, clicks.astype(np.float32))
                est_c = np.minimum(est_c, self.click[d, col])
        self.added += float(shows.sum())
        if self.added > 10.0 * self.width:
            self.show *= 0.5
            self.click *= 0.5
            self.added *= 0.5
        return est_s, est_c

    def state_dict(self) -> dict[str, Any]:
        """The counters."""
        return {"show": self.show.copy(), "click": self.click.copy(),
                "salts": self._salts.copy(), "added": self.added}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict``'s counters (same width)."""
        if (np.asarray(state["show"]).shape != self.show.shape
                or np.asarray(state["click"]).shape != self.click.shape):
            raise ValueError("saved sketch has another width")
        self.show = np.asarray(state["show"], dtype=np.float32).copy()
        self.click = np.asarray(state["click"], dtype=np.float32).copy()
        self._salts = np.asarray(state["salts"]).astype(np.uint64)
        self.added = float(state["added"])
