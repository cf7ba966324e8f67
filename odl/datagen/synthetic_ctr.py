"""A synthetic Criteo-like CTR stream whose labels come from a known, slowly drifting model.

Record layout (the order is part of the contract; ``ALL_COLUMNS``)::

    sample_id, event_time, label, I1..I13, C1..C26        42 columns

* ``sample_id``: ``"{run_id}-{n}"``; ``run_id`` is 8 hex chars derived from the seed and the
  start time, ``n`` the 0-based record number of this stream.
* ``event_time``: unix seconds, float rounded to milliseconds.
* ``label``: 0 or 1.
* ``I1..I13``: dense features, ``log1p`` of counts clipped to 53, rounded to 4 decimals
  (so in ``[0, 3.99]``).
* ``C1..C26``: categorical ids, 8 lowercase hex chars (like Criteo).

Wire encodings (``encode``/``decode``), UTF-8:

* ``csv``: the 42 values joined by ``","``, no header, no quoting (no value contains a comma),
  e.g. ``ab12cd34-0,1767225600.123,0,0.6931,...,0a1b2c3d,...``.
* ``json``: one object with the same 42 keys; ``label`` an int, ``event_time`` and ``I*``
  numbers, ``sample_id`` and ``C*`` strings.

How records are made (everything is a pure function of ``(seed, n, event_time)``: record
``n`` is the same whatever the chunk sizes, so two streams with the same seed and the same
event times are identical; a counter-based hash (splitmix64) replaces a sequential RNG):

* Field ``f`` draws a Zipf rank ``r`` (exponent 1.1-1.3, rank 0 the most frequent) over a
  vocabulary of ``vocab_f(n)`` ids; fields with at least 1000 ids grow by their initial size
  every ``vocab_doubling`` records, so new ids keep appearing. The hex id is a fixed hash of
  ``(seed, f, r)``.
* Dense ``I_j`` is ``log1p`` of a geometric count whose mean is a per-field mean times a
  per-record log-normal "activity" (so the dense features are correlated).
* The hidden model: ``logit = bias(t) + g_d * sum_j w_j(t) * (I_j - mean_j)
  + g_s * sum_f s_f(t) * effect_f(r_f) + g_p * sum_pairs s_p * effect_p(r_a, r_b)``, where
  ``effect`` is a deterministic standard normal of ``(seed, field, rank)`` (or of the rank
  pair) shrunk by ``1 / sqrt(1 + r / shrink_rank)`` (frequent ids carry most of the signal,
  as in real logs), ``t`` is seconds since ``start_time`` and the weights drift as small
  sinusoids with periods of 3-15 minutes. At construction the gains ``g_*`` are set so the
  three parts have standard deviations ``dense_std``, ``id_std`` and ``interaction_std`` (so
  the oracle AUC hardly depends on the seed: ~0.78 with the defaults), and the bias so the
  base CTR is ``target_ctr``. The label is Bernoulli(sigmoid(logit)); ``CtrBatch`` keeps the
  true probability of every record.
* The oracle AUC is the AUC of those true probabilities against the drawn labels over every
  record produced (``HistogramAuc``, quantised to 1e-6).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from odl.auc import HistogramAuc

logger = logging.getLogger(__name__)

DENSE_FIELDS: tuple[str, ...] = tuple(f"I{i}" for i in range(1, 14))
SPARSE_FIELDS: tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))
META_FIELDS: tuple[str, ...] = ("sample_id", "event_time", "label")
ALL_FIELDS: tuple[str, ...] = DENSE_FIELDS + SPARSE_FIELDS
ALL_COLUMNS: tuple[str, ...] = META_FIELDS + ALL_FIELDS
LABEL_FIELD = "label"
FORMATS = ("csv", "json")

# Initial vocabulary size and Zipf exponent per sparse field (fixed, not seed dependent).
VOCAB_SIZES: tuple[int, ...] = (
    1460, 580, 50000, 20000, 300, 24, 12000, 630, 3, 30000, 5000, 40000, 3200,
    27, 10000, 40000, 10, 4500, 2000, 4, 45000, 18, 15, 25000, 100, 20000,
)  # fmt: skip
ZIPF_EXPONENTS: tuple[float, ...] = tuple(1.1 + 0.05 * (i % 5) for i in range(26))
# Pairs of sparse fields (0-based) with an interaction effect.
INTERACTION_PAIRS: tuple[tuple[int, int], ...] = ((5, 13), (16, 24), (8, 22))
_DENSE_MAX_COUNT = 53
# The only values a dense feature takes: round(log1p(count), 4), and their CSV text.
_DENSE_VALUES = np.round(np.log1p(np.arange(_DENSE_MAX_COUNT + 1, dtype=np.float64)), 4)
_DENSE_TEXT = {v: repr(v) for v in _DENSE_VALUES.tolist()}
_JSON_TEMPLATE = (
    '{"sample_id":"%s","event_time":%s,"label":%s,'
    + ",".join(f'"{k}":%s' for k in DENSE_FIELDS)
    + ","
    + ",".join(f'"{k}":"%s"' for k in SPARSE_FIELDS)
    + "}"
)

_MASK64 = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15
_U_GOLD = np.uint64(_GOLD)
_U_M1 = np.uint64(0xBF58476D1CE4E5B9)
_U_M2 = np.uint64(0x94D049BB133111EB)
_U30, _U27, _U31, _U11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_NIBBLE_SHIFTS = np.arange(28, -1, -4, dtype=np.uint32)

# Salts naming the independent hash streams.
_S_RANK, _S_DENSE, _S_ACT, _S_LABEL, _S_ID, _S_EFF1, _S_EFF2, _S_PAIR1, _S_PAIR2, _S_RUN = range(
    1, 11
)


def _mix_int(*parts: int) -> int:
    """splitmix64 of a sequence of Python ints (for scalar keys)."""
    h = 0
    for p in parts:
        x = ((h ^ (p & _MASK64)) + _GOLD) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = x ^ (x >> 31)
    return h


def _mix(x: np.ndarray, key: int | np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 of ``x ^ key`` (uint64 arithmetic wraps; ``key`` broadcasts)."""
    x = (x ^ np.asarray(key, dtype=np.uint64)) + _U_GOLD
    x = (x ^ (x >> _U30)) * _U_M1
    x = (x ^ (x >> _U27)) * _U_M2
    return x ^ (x >> _U31)


def _uniform(h: np.ndarray) -> np.ndarray:
    """Maps hashes to uniforms in ``(0, 1)``."""
    return ((h >> _U11).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def _normal(values: np.ndarray, key1: int | np.ndarray, key2: int | np.ndarray) -> np.ndarray:
    """Deterministic standard normals of ``values`` (Box-Muller on two hashes)."""
    u1 = _uniform(_mix(values, key1))
    u2 = _uniform(_mix(values, key2))
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _hex_rows(values: np.ndarray) -> list[str]:
    """Formats a ``(b, k)`` uint32 array as ``b`` strings of comma separated 8-char hex ids."""
    b, k = values.shape
    nibbles = (values.astype(np.uint32)[..., None] >> _NIBBLE_SHIFTS) & np.uint32(0xF)
    chars = np.empty((b, k, 9), dtype=np.uint8)
    chars[..., :8] = _HEX[nibbles]
    chars[..., 8] = ord(",")
    text = chars.tobytes().decode("ascii")
    width = 9 * k
    return [text[i : i + width - 1] for i in range(0, b * width, width)]


@dataclass
class CtrBatch:
    """A columnar chunk of records.

    Attributes:
        indices: record numbers ``n``, shape ``(b,)`` uint64.
        sample_ids: ``"{run_id}-{n}"`` strings.
        event_times: unix seconds (ms precision), shape ``(b,)``.
        labels: 0/1, shape ``(b,)`` int8.
        dense: ``I1..I13``, shape ``(b, 13)`` float64 (rounded to 4 decimals).
        ranks: Zipf rank per sparse field (0 = most frequent), shape ``(b, 26)`` int64.
        id_values: the ids as numbers, shape ``(b, 26)`` uint32 (``ids`` is their hex).
        sparse_text: per record, ``C1..C26`` joined by ``","``.
        probabilities: the hidden model's true click probability, shape ``(b,)``.
    """

    indices: np.ndarray
    sample_ids: list[str]
    event_times: np.ndarray
    labels: np.ndarray
    dense: np.ndarray
    ranks: np.ndarray
    id_values: np.ndarray
    sparse_text: list[str]
    probabilities: np.ndarray

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def ids(self) -> np.ndarray:
        """Hex ids per sparse field, shape ``(b, 26)`` ``<U8``."""
        return np.array([row.split(",") for row in self.sparse_text], dtype="U8").reshape(
            len(self), len(SPARSE_FIELDS)
        )

    def to_records(self) -> list[dict[str, Any]]:
        """Returns one dict per record with the keys of ``ALL_COLUMNS``."""
        columns = [
            self.sample_ids,
            self.event_times.tolist(),
            self.labels.tolist(),
            *self.dense.T.tolist(),
        ]
        return [
            dict(zip(ALL_COLUMNS, (*row, *sparse.split(",")), strict=True))
            for row, sparse in zip(zip(*columns, strict=True), self.sparse_text, strict=True)
        ]

    def encode(self, fmt: str = "csv") -> list[bytes]:
        """Encodes every record of the batch (see the module docstring for the layouts)."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
        columns = [
            self.sample_ids,
            [repr(t) for t in self.event_times.tolist()],
            [str(x) for x in self.labels.tolist()],
            *([_DENSE_TEXT.get(x) or repr(x) for x in col] for col in self.dense.T.tolist()),
        ]
        if fmt == "json":
            # Same bytes as json.dumps(record, separators=(",", ":")): no value needs escaping.
            return [
                (_JSON_TEMPLATE % (*row, *sparse.split(","))).encode()
                for row, sparse in zip(zip(*columns, strict=True), self.sparse_text, strict=True)
            ]
        return [
            (",".join(row) + "," + sparse).encode()
            for row, sparse in zip(zip(*columns, strict=True), self.sparse_text, strict=True)
        ]


def encode(record: dict[str, Any], fmt: str = "csv") -> bytes:
    """Encodes one record dict as a message value.

    Args:
        record: a dict with the keys of ``ALL_COLUMNS``.
        fmt: ``"csv"`` or ``"json"``.

    Returns:
        The UTF-8 encoded message value.
    """
    if fmt == "csv":
        return ",".join(
            v if isinstance(v, str) else repr(v) for v in (record[c] for c in ALL_COLUMNS)
        ).encode()
    if fmt == "json":
        return json.dumps({c: record[c] for c in ALL_COLUMNS}, separators=(",", ":")).encode()
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def decode(payload: bytes, fmt: str = "csv") -> dict[str, Any]:
    """Decodes a message value written by ``encode`` back into a record dict.

    Args:
        payload: the message value.
        fmt: ``"csv"`` or ``"json"``.

    Returns:
        The record (label int, event_time and dense floats, ids and sample_id strings).
    """
    if fmt == "json":
        return json.loads(payload)
    if fmt != "csv":
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    parts = payload.decode().split(",")
    if len(parts) != len(ALL_COLUMNS):
        raise ValueError(f"expected {len(ALL_COLUMNS)} columns, got {len(parts)}")
    rec: dict[str, Any] = {"sample_id": parts[0], "event_time": float(parts[1])}
    rec["label"] = int(parts[2])
    for name, value in zip(DENSE_FIELDS, parts[3 : 3 + len(DENSE_FIELDS)], strict=True):
        rec[name] = float(value)
    rec.update(zip(SPARSE_FIELDS, parts[3 + len(DENSE_FIELDS) :], strict=True))
    return rec


class SyntheticCtrStream:
    """An endless synthetic CTR stream with a known answer (see the module docstring).

    Args:
        seed: selects the hidden model, the id hashes and the draws.
        start_time: unix seconds of record 0 (default: now); drift is relative to it.
        events_per_second: if set, record ``n`` gets the simulated event time
            ``start_time + n / events_per_second`` (reproducible); otherwise the wall clock
            at generation (or the ``now`` given to ``next_batch``).
        target_ctr: base click-through rate the bias is calibrated to.
        dense_std: standard deviation of the dense part of the logit.
        id_std: standard deviation of the per-id part of the logit.
        interaction_std: standard deviation of the pairwise interaction part of the logit.
        shrink_rank: effects of rank ``r`` are shrunk by ``1 / sqrt(1 + r / shrink_rank)``.
        drift: relative amplitude of the sinusoidal weight drift (0 disables drift).
        vocab_doubling: records after which a growing field has added its initial size.
    """

    def __init__(
        self,
        seed: int = 0,
        start_time: float | None = None,
        *,
        events_per_second: float | None = None,
        target_ctr: float = 0.25,
        dense_std: float = 0.6,
        id_std: float = 1.0,
        interaction_std: float = 0.3,
        shrink_rank: float = 200.0,
        drift: float = 0.2,
        vocab_doubling: float = 1_000_000.0,
    ) -> None:
        self.seed = int(seed)
        self.start_time = float(time.time() if start_time is None else start_time)
        self.events_per_second = events_per_second
        self.target_ctr = target_ctr
        self.shrink_rank = float(shrink_rank)
        self.vocab_doubling = float(vocab_doubling)
        self.run_id = f"{_mix_int(self.seed, _S_RUN, round(self.start_time * 1000)):016x}"[:8]
        self._n = 0
        self._positives = 0
        self._oracle = HistogramAuc()

        rng = np.random.default_rng([self.seed & _MASK64, 0x0D1])
        n_dense, n_sparse = len(DENSE_FIELDS), len(SPARSE_FIELDS)
        self._dense_means = rng.uniform(0.3, 12.0, n_dense)
        self._dense_w = rng.normal(0.0, 1.0, n_dense)
        self._field_s = rng.uniform(0.3, 1.0, n_sparse)
        self._pair_s = rng.uniform(0.5, 1.0, len(INTERACTION_PAIRS))
        self._periods_dense = rng.uniform(180.0, 900.0, n_dense)
        self._phases_dense = rng.uniform(0.0, 2 * np.pi, n_dense)
        self._periods_field = rng.uniform(180.0, 900.0, n_sparse)
        self._phases_field = rng.uniform(0.0, 2 * np.pi, n_sparse)
        self._bias_phase = float(rng.uniform(0.0, 2 * np.pi))
        self.drift = float(drift)
        self._vocab0 = np.asarray(VOCAB_SIZES, dtype=np.float64)
        self._growth = np.where(self._vocab0 >= 1000, self._vocab0 / self.vocab_doubling, 0.0)
        self._zipf_a = 1.0 - np.asarray(ZIPF_EXPONENTS)
        self._keys = {
            name: np.array([_mix_int(self.seed, salt, f) for f in range(n_sparse)], np.uint64)
            for name, salt in (("rank", _S_RANK), ("id", _S_ID), ("e1", _S_EFF1), ("e2", _S_EFF2))
        }
        self._dense_keys = np.array(
            [_mix_int(self.seed, _S_DENSE, j) for j in range(n_dense)], np.uint64
        )
        self._act_keys = (_mix_int(self.seed, _S_ACT, 1), _mix_int(self.seed, _S_ACT, 2))
        self._label_key = _mix_int(self.seed, _S_LABEL)
        self._pair_keys = [
            (_mix_int(self.seed, _S_PAIR1, p), _mix_int(self.seed, _S_PAIR2, p))
            for p in range(len(INTERACTION_PAIRS))
        ]
        self._part_std = (float(dense_std), float(id_std), float(interaction_std))
        self._dense_center = np.zeros(n_dense)
        self._gains = (1.0, 1.0, 1.0)
        self.bias = 0.0
        self._calibrate()
        logger.debug("stream seed=%d run_id=%s bias=%.4f", self.seed, self.run_id, self.bias)

    # ------------------------------------------------------------------ public API

    @property
    def produced(self) -> int:
        """Number of records generated so far."""
        return self._n

    def positive_rate(self) -> float:
        """Fraction of positive labels among the records generated so far."""
        return self._positives / self._n if self._n else float("nan")

    def oracle_auc(self) -> float:
        """AUC of the hidden model's true probabilities over every record generated."""
        return self._oracle.auc()

    def vocab_sizes(self, n: int | None = None) -> np.ndarray:
        """Vocabulary size of each sparse field at record ``n`` (default: the next one)."""
        n = self._n if n is None else n
        return np.floor(self._vocab0 + n * self._growth).astype(np.int64)

    def next_batch(self, n: int, now: float | None = None) -> CtrBatch:
        """Generates the next ``n`` records as columns.

        Args:
            n: number of records.
            now: event time for all of them (wall-clock mode only; default ``time.time()``).

        Returns:
            The batch; the stream's oracle statistics include it.
        """
        idx = np.arange(self._n, self._n + n, dtype=np.uint64)
        if self.events_per_second:
            times = self.start_time + idx.astype(np.float64) / self.events_per_second
        else:
            times = np.full(n, time.time() if now is None else float(now))
        times = np.round(times, 3)
        batch = self._generate(idx, times)
        self._n += n
        self._positives += int(batch.labels.sum())
        self._oracle.add(batch.labels, batch.probabilities)
        return batch

    def next_records(self, n: int, now: float | None = None) -> list[dict[str, Any]]:
        """Generates the next ``n`` records as dicts keyed by ``ALL_COLUMNS``."""
        return self.next_batch(n, now).to_records()

    # ------------------------------------------------------------------ internals

    def history(self, batch: CtrBatch, field: int = 2, length: int = 5) -> list[str]:
        """A behaviour sequence per record: ids of field ``field`` near the record's own.

        Record ``n`` gets ``n % (length + 1)`` ids, each the field's id of rank
        ``r + (hash(n, j) % 50)`` (``r`` the record's own rank), hex like the field's, joined
        by ``"|"``: a deterministic function of ``(seed, n)``, empty for some records.

        Args:
            batch: records of this stream.
            field: 0-based sparse field (2: C3).
            length: most ids per record.

        Returns:
            One ``"|"``-joined string per record.
        """
        n = batch.indices.astype(np.uint64)
        k = (batch.indices % np.uint64(length + 1)).astype(np.int64)
        j = np.arange(length, dtype=np.uint64)[None, :]
        step = (_mix(n[:, None] * np.uint64(length + 1) + j, self._keys["rank"][field])
                % np.uint64(50)).astype(np.int64)
        ranks = (batch.ranks[:, field][:, None] + step).astype(np.uint64)
        ids = (_mix(ranks, self._keys["id"][field]) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        rows = _hex_rows(ids)  # "h1,h2,...": one row per record
        return ["|".join(row.split(",")[:c]) for row, c in zip(rows, k.tolist(), strict=True)]

    def _features(
        self, idx: np.ndarray, positions: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Dense features ``(b, 13)`` and Zipf ranks ``(b, 26)`` of records ``idx``.

        ``positions`` (default ``idx``) are the record numbers that set the vocabulary sizes.
        """
        col = idx[:, None]
        pos = (idx if positions is None else positions).astype(np.float64)
        vocab = np.floor(self._vocab0[None, :] + pos[:, None] * self._growth)
        u = _uniform(_mix(col, self._keys["rank"][None, :]))
        a = self._zipf_a[None, :]
        x = (1.0 + u * ((vocab + 1.0) ** a - 1.0)) ** (1.0 / a)
        ranks = np.minimum(x.astype(np.int64) - 1, vocab.astype(np.int64) - 1)
        activity = np.exp(0.7 * _normal(col, *self._act_keys) - 0.245)
        mean = self._dense_means[None, :] * activity
        u = _uniform(_mix(col, self._dense_keys[None, :]))
        count = np.floor(np.log(u) / np.log(mean / (1.0 + mean)))
        dense = _DENSE_VALUES[np.minimum(count, _DENSE_MAX_COUNT).astype(np.int64)]
        return dense, ranks

    def _logit_parts(
        self, dense: np.ndarray, ranks: np.ndarray, t: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Bias drift, dense, per-id and interaction parts of the logit (unnormalised)."""
        two_pi = 2.0 * np.pi
        d = self.drift
        bias_drift = 0.5 * d * np.sin(two_pi * t / 600.0 + self._bias_phase)
        w = self._dense_w[None, :] * (
            1.0 + d * np.sin(two_pi * t[:, None] / self._periods_dense + self._phases_dense)
        )
        dense_part = (w * (dense - self._dense_center)).sum(axis=1)
        s = self._field_s[None, :] * (
            1.0 + d * np.sin(two_pi * t[:, None] / self._periods_field + self._phases_field)
        )
        shrink = 1.0 / np.sqrt(1.0 + ranks / self.shrink_rank)
        r64 = ranks.astype(np.uint64)
        eff = _normal(r64, self._keys["e1"][None, :], self._keys["e2"][None, :])
        sparse_part = (s * eff * shrink).sum(axis=1)
        pair_part = np.zeros(ranks.shape[0])
        for p, (fa, fb) in enumerate(INTERACTION_PAIRS):
            k1, k2 = self._pair_keys[p]
            pair = _mix(r64[:, fa], k1) ^ r64[:, fb]
            pair_part += self._pair_s[p] * _normal(pair, k1, k2)
        return bias_drift, dense_part, sparse_part, pair_part

    def _logits(self, dense: np.ndarray, ranks: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Hidden model logits at seconds-since-start ``t``."""
        bias_drift, dense_part, sparse_part, pair_part = self._logit_parts(dense, ranks, t)
        g_dense, g_sparse, g_pair = self._gains
        return (
            self.bias
            + bias_drift
            + g_dense * dense_part
            + g_sparse * sparse_part
            + (g_pair * pair_part)
        )

    def _generate(self, idx: np.ndarray, times: np.ndarray) -> CtrBatch:
        dense, ranks = self._features(idx)
        logits = self._logits(dense, ranks, times - self.start_time)
        probs = 1.0 / (1.0 + np.exp(-logits))
        labels = (_uniform(_mix(idx, self._label_key)) < probs).astype(np.int8)
        raw = _mix(ranks.astype(np.uint64), self._keys["id"][None, :])
        id_values = (raw & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        prefix = self.run_id + "-"
        sample_ids = [prefix + str(i) for i in idx.tolist()]
        return CtrBatch(
            idx, sample_ids, times, labels, dense, ranks, id_values, _hex_rows(id_values), probs
        )

    def _calibrate(self, samples: int = 20000) -> None:
        """Sets the part gains (fixed logit std per part) and the bias (base CTR).

        Normalising each part's standard deviation on a fixed sample keeps the oracle AUC
        nearly the same for every seed.
        """
        # Records of their own (far beyond any real stream), with the vocabulary of record 0.
        idx = np.arange(samples, dtype=np.uint64) + np.uint64(1 << 62)
        dense, ranks = self._features(idx, positions=np.zeros(samples))
        self._dense_center = dense.mean(axis=0)
        t0 = np.zeros(samples)
        _, dense_part, sparse_part, pair_part = self._logit_parts(dense, ranks, t0)
        self._gains = tuple(
            target / max(float(np.std(part)), 1e-9)
            for target, part in zip(
                self._part_std, (dense_part, sparse_part, pair_part), strict=True
            )
        )
        self.bias = 0.0
        base = self._logits(dense, ranks, t0)
        lo, hi = -10.0, 10.0
        for _ in range(50):
            mid = 0.5 * (lo + hi)
            mean_p = float(np.mean(1.0 / (1.0 + np.exp(-(base + mid)))))
            if mean_p < self.target_ctr:
                lo = mid
            else:
                hi = mid
        self.bias = 0.5 * (lo + hi)
