"""A bursty user-item interaction stream with a known answer (``odl-datagen --bursty``).

Real recommendation streams are bursty: a user opens the app and emits many events within
seconds, new items and users appear all the time, popularity rises and fades. This stream
has those properties and labels from a hidden model with a user x item interaction, so the
best achievable AUC (the oracle's) is known.

Record layout (the order is part of the contract; ``BURSTY_COLUMNS``)::

    sample_id, event_time, label, user_id, item_id, category, device, hour      8 columns

* ``sample_id``: ``"b{seed}-{n}"``, ``n`` the 0-based record number;
* ``event_time``: unix seconds (ms precision), non-decreasing: simulated session time from
  ``start_time``, not the wall clock;
* ``label``: 0 or 1;
* ``user_id`` ``"u<k>"``, ``item_id`` ``"i<k>"``, ``category`` ``"c<k>"``, ``device``
  ``"d<k>"``, ``hour`` ``"h<hh>"`` (the event's UTC hour).

Encodings (``BurstyBatch.encode``): ``csv`` (the 8 values joined by ``","``) or ``json``
(one object with the 8 keys; ``label`` an int, ``event_time`` a number, the rest strings).

How it is made (``BurstySettings``; deterministic for a seed, whatever the chunk sizes):

* Sessions start as a Poisson process (``session_rate`` per simulated second). A session
  belongs to a new user with probability ``new_user_share``, else to an existing one drawn
  Zipf-like over the users (the oldest the most active). It has a geometric number of events
  (mean ``mean_session_events``) spaced by exponential gaps (mean ``mean_event_gap_s``), on
  one device (mostly the user's own).
* Items are born at ``new_items_per_s`` (after ``initial_items``); each event picks an item
  by a Zipf rank counted from the newest item born before it, so items are most popular
  when new and fade as newer ones appear; each item has a category.
* Hidden model: ``logit = b0 + user_bias + item_bias * (1 + drift(t)) + category_effect +
  interaction * <u_user, v_item> + session_effect + device_effect``, the user / item vectors
  ``latent_dim``-wide standard normals (scaled so the interaction's std is
  ``interaction_std``), the session effect one normal draw per session (``session_std``,
  what a per-sample learner can pick up within a burst), ``drift`` a per-item sinusoid
  (periods ``drift_period_s``). ``b0`` is calibrated at construction for ``target_ctr``. The
  label is Bernoulli(sigmoid(logit)); the batch keeps every record's true probability, and
  ``oracle_auc`` is the AUC of those against the labels over every record produced.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from odl.auc import HistogramAuc

logger = logging.getLogger(__name__)

BURSTY_COLUMNS: tuple[str, ...] = ("sample_id", "event_time", "label", "user_id", "item_id",
                                   "category", "device", "hour")
BURSTY_ID_FIELDS: tuple[str, ...] = ("user_id", "item_id", "category", "device", "hour")
NUM_DEVICES = 4
NUM_CATEGORIES = 40
DEFAULT_START_TIME = 1767225600.0  # 2026-01-01T00:00:00Z


@dataclass(frozen=True)
class BurstySettings:
    """The stream's knobs (module docstring); the defaults give an oracle AUC near 0.80.

    Attributes:
        session_rate: sessions starting per simulated second.
        mean_session_events: mean events per session (geometric).
        mean_event_gap_s: mean seconds between a session's events (exponential).
        new_user_share: share of sessions from a user never seen before.
        user_zipf: Zipf exponent of the existing users' activity.
        initial_items: items born before the stream starts.
        new_items_per_s: items born per simulated second.
        item_zipf: Zipf exponent of an item's popularity by its age rank.
        latent_dim: width of the user and item vectors.
        user_std: std of the user biases.
        item_std: std of the item biases.
        category_std: std of the category effects.
        interaction_std: std of the user x item term.
        session_std: std of the per-session effect.
        device_std: std of the device effects.
        drift_amplitude: relative amplitude of an item bias's drift.
        drift_period_s: range of the drift periods, seconds.
        target_ctr: the base click rate ``b0`` is calibrated for.
    """

    session_rate: float = 40.0
    mean_session_events: float = 12.0
    mean_event_gap_s: float = 2.0
    new_user_share: float = 0.2
    user_zipf: float = 1.1
    initial_items: int = 2000
    new_items_per_s: float = 2.0
    item_zipf: float = 1.05
    latent_dim: int = 8
    user_std: float = 0.7
    item_std: float = 0.8
    category_std: float = 0.3
    interaction_std: float = 1.0
    session_std: float = 0.8
    device_std: float = 0.2
    drift_amplitude: float = 0.5
    drift_period_s: tuple[float, float] = (600.0, 3600.0)
    target_ctr: float = 0.15


@dataclass
class BurstyBatch:
    """A chunk of records in event-time order.

    Attributes:
        sample_ids: ``"b{seed}-{n}"``.
        event_times: unix seconds, ms precision, float64 ``(b,)``.
        labels: 0/1, int8 ``(b,)``.
        users, items, categories, devices: int64 ``(b,)`` ids.
        probabilities: the hidden model's click probability, float64 ``(b,)``.
    """

    sample_ids: list[str]
    event_times: np.ndarray
    labels: np.ndarray
    users: np.ndarray
    items: np.ndarray
    categories: np.ndarray
    devices: np.ndarray
    probabilities: np.ndarray

    def __len__(self) -> int:
        return len(self.sample_ids)

    def hours(self) -> np.ndarray:
        """The events' UTC hours."""
        return ((self.event_times // 3600) % 24).astype(np.int64)

    def to_records(self) -> list[dict[str, Any]]:
        """The records as dicts (``BURSTY_COLUMNS`` keys)."""
        hours = self.hours()
        return [{"sample_id": sid, "event_time": float(t), "label": int(y),
                 "user_id": f"u{u}", "item_id": f"i{i}", "category": f"c{c}",
                 "device": f"d{d}", "hour": f"h{h:02d}"}
                for sid, t, y, u, i, c, d, h in zip(
                    self.sample_ids, self.event_times.tolist(), self.labels.tolist(),
                    self.users.tolist(), self.items.tolist(), self.categories.tolist(),
                    self.devices.tolist(), hours.tolist(), strict=True)]

    def encode(self, fmt: str = "csv") -> list[bytes]:
        """The records encoded (module docstring)."""
        if fmt == "json":
            return [json.dumps(r, separators=(",", ":")).encode() for r in self.to_records()]
        if fmt != "csv":
            raise ValueError(f"unknown format {fmt!r}")
        hours = self.hours()
        return [f"{sid},{t!r},{y},u{u},i{i},c{c},d{d},h{h:02d}".encode()
                for sid, t, y, u, i, c, d, h in zip(
                    self.sample_ids, self.event_times.tolist(), self.labels.tolist(),
                    self.users.tolist(), self.items.tolist(), self.categories.tolist(),
                    self.devices.tolist(), hours.tolist(), strict=True)]


def _zipf_ranks(u: np.ndarray, n: np.ndarray | int, exponent: float) -> np.ndarray:
    """Ranks in ``[0, n)`` of uniforms ``u``, P(r) ~ (r + 1) ** -exponent.

    The inverse CDF of the continuous density ``x ** -exponent`` on ``[1, n + 1)``.
    """
    n = np.asarray(n, dtype=np.float64)
    a = exponent
    if abs(a - 1.0) < 1e-9:
        x = np.exp(u * np.log(n + 1.0))
    else:
        hi = (n + 1.0) ** (1.0 - a)
        x = (1.0 + u * (hi - 1.0)) ** (1.0 / (1.0 - a))
    return np.clip(x.astype(np.int64) - 1, 0, np.maximum(n.astype(np.int64) - 1, 0))


_BLOCK = 1024  # ids whose parameters are drawn together, from the block's own generator


@dataclass
class _Population:
    """Growing per-id parameters, independent of when the population grew.

    Block ``k`` of ids is drawn from its own generator ``(key, k)``.
    """

    key: tuple[int, int]
    dim: int
    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    biases: np.ndarray = field(default_factory=lambda: np.zeros(0))
    extra: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))

    def ensure(self, n: int) -> None:
        """Draws the parameters of ids up to ``n - 1``."""
        have = self.biases.shape[0]
        if n <= have:
            return
        vs, bs, xs = [self.vectors] if have else [], [self.biases], [self.extra]
        for block in range(have // _BLOCK, -(-n // _BLOCK)):
            rng = np.random.default_rng([*self.key, block])
            vs.append(rng.standard_normal((_BLOCK, self.dim)))
            bs.append(rng.standard_normal(_BLOCK))
            xs.append(rng.random((_BLOCK, 3)))
        self.vectors = np.concatenate(vs)
        self.biases = np.concatenate(bs)
        self.extra = np.concatenate(xs)


class BurstyStream:
    """The bursty stream (module docstring).

    Args:
        seed: the seed.
        settings: the stream's knobs.
        start_time: the first session's unix time.
    """

    def __init__(self, seed: int = 0, settings: BurstySettings | None = None,
                 start_time: float = DEFAULT_START_TIME, _calibrate: bool = True) -> None:
        self.seed = int(seed)
        self.settings = settings or BurstySettings()
        self.start_time = float(start_time)
        s = self.settings
        self._sessions = np.random.default_rng([self.seed, 1])
        self._users = _Population((self.seed, 2), s.latent_dim)
        self._items = _Population((self.seed, 3), s.latent_dim)
        fixed = np.random.default_rng([self.seed, 4])
        self._category_effect = fixed.standard_normal(NUM_CATEGORIES) * s.category_std
        self._device_effect = fixed.standard_normal(NUM_DEVICES) * s.device_std
        self._scale = s.interaction_std / math.sqrt(s.latent_dim)
        self._num_users = 0
        self._frontier = self.start_time  # the next session's start
        self._pending: list[tuple[float, int, tuple]] = []  # (time, seq, event)
        self._seq = 0
        self._produced = 0
        self._positives = 0
        self._oracle = HistogramAuc(1_000_000)
        self.b0 = 0.0
        if _calibrate:
            self.b0 = self._calibrated_bias()

    # -- parameters -------------------------------------------------------------------------

    def _items_born(self, t: float) -> int:
        s = self.settings
        return s.initial_items + int(max(0.0, t - self.start_time) * s.new_items_per_s)

    def _calibrated_bias(self) -> float:
        """``b0`` giving ``target_ctr`` over a pilot stream of the same settings."""
        pilot = BurstyStream(self.seed + 7919, self.settings, self.start_time,
                             _calibrate=False)
        logits = []
        while sum(x.shape[0] for x in logits) < 60000:
            logits.append(pilot._next_events(4096)[-1])
        z = np.concatenate(logits)
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.mean(1 / (1 + np.exp(-(z + mid)))) < self.settings.target_ctr:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    # -- generation -------------------------------------------------------------------------

    def _start_session(self) -> None:
        s = self.settings
        rng = self._sessions
        t0 = self._frontier
        self._frontier += rng.exponential(1.0 / s.session_rate)
        if self._num_users == 0 or rng.random() < s.new_user_share:
            user = self._num_users
            self._num_users += 1
        else:
            user = int(_zipf_ranks(rng.random(1), self._num_users, s.user_zipf)[0])
        self._users.ensure(user + 1)
        n = int(rng.geometric(1.0 / s.mean_session_events))
        times = t0 + np.concatenate([[0.0], np.cumsum(rng.exponential(s.mean_event_gap_s,
                                                                      n - 1))])
        own_device = int(self._users.extra[user, 0] * NUM_DEVICES)
        device = own_device if rng.random() < 0.8 else int(rng.integers(NUM_DEVICES))
        session_effect = rng.standard_normal() * s.session_std
        picks = rng.random(n)  # the item's popularity rank among those born by then
        uniforms = rng.random(n)  # the label's draw
        for k in range(n):
            t = round(float(times[k]), 3)
            event = (user, float(picks[k]), device, session_effect, float(uniforms[k]))
            heapq.heappush(self._pending, (t, self._seq, event))
            self._seq += 1

    def _next_events(self, n: int) -> tuple:
        """The next ``n`` events in time order, with their logits (before ``b0``)."""
        per_session = max(1, int(self.settings.mean_session_events))
        while True:  # final: the events before the next session's start
            ready = sum(1 for t, _q, _e in self._pending if t < self._frontier)
            if ready >= n:
                break
            for _ in range((n - ready) // per_session + 1):
                self._start_session()
        events = [heapq.heappop(self._pending) for _ in range(n)]
        times = np.array([e[0] for e in events])
        users = np.array([e[2][0] for e in events], dtype=np.int64)
        picks = np.array([e[2][1] for e in events])
        devices = np.array([e[2][2] for e in events], dtype=np.int64)
        session = np.array([e[2][3] for e in events])
        uniforms = np.array([e[2][4] for e in events])
        s = self.settings
        born = np.array([self._items_born(t) for t in times.tolist()], dtype=np.int64)
        items = born - 1 - _zipf_ranks(picks, born, s.item_zipf)
        self._items.ensure(int(born.max()) + 1)
        categories = (self._items.extra[items, 0] * NUM_CATEGORIES).astype(np.int64)
        periods = s.drift_period_s[0] + self._items.extra[items, 1] * (
            s.drift_period_s[1] - s.drift_period_s[0])
        drift = s.drift_amplitude * np.sin(2 * np.pi * (times - self.start_time) / periods
                                           + 2 * np.pi * self._items.extra[items, 2])
        logits = (self._users.biases[users] * s.user_std
                  + self._items.biases[items] * s.item_std * (1 + drift)
                  + self._category_effect[categories]
                  + self._scale * np.einsum("bk,bk->b", self._users.vectors[users],
                                            self._items.vectors[items])
                  + session + self._device_effect[devices])
        return times, users, items, categories, devices, uniforms, logits

    def next_batch(self, n: int) -> BurstyBatch:
        """The next ``n`` records.

        Args:
            n: records wanted (> 0).

        Returns:
            The records, in event-time order after every earlier record.
        """
        times, users, items, categories, devices, uniforms, logits = self._next_events(n)
        probs = 1.0 / (1.0 + np.exp(-(logits + self.b0)))
        labels = (uniforms < probs).astype(np.int8)
        first = self._produced
        self._produced += n
        self._positives += int(labels.sum())
        self._oracle.add(labels > 0, probs)
        return BurstyBatch([f"b{self.seed}-{first + k}" for k in range(n)], times, labels,
                           users, items, categories, devices, probs)

    # -- figures ----------------------------------------------------------------------------

    @property
    def produced(self) -> int:
        """Records produced so far."""
        return self._produced

    def positive_rate(self) -> float:
        """Share of positive labels so far."""
        return self._positives / self._produced if self._produced else float("nan")

    def oracle_auc(self) -> float:
        """AUC of the true probabilities against the labels, over every record so far."""
        return self._oracle.auc()
