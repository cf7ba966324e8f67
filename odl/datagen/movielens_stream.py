"""MovieLens 100k as a time-ordered rating stream (``odl-datagen --movielens DIR``).

A real, public, time-ordered recommendation stream: 100,000 ratings (1-5) of 1,682 movies
by 943 users of the MovieLens web site, September 1997 to April 1998 (GroupLens Research,
F. M. Harper and J. A. Konstan, "The MovieLens Datasets: History and Context", ACM TiiS
2015). Users rate in bursts: most rate dozens of movies within minutes of signing up. The
data may not be redistributed, so it is not part of this repository: point ``--data`` at a
directory holding the archive's ``u.data``, ``u.user`` and ``u.item`` (``ml-100k.zip`` from
GroupLens, unpacked). ``bench/online_quality.py --stream movielens`` runs it through every
learner; ``samples/movielens_online.config`` trains on it.

The same reader takes GroupLens' later archives of one layout (``ml-latest-small``: 100,836
ratings, half stars from 0.5, of 9,742 movies by 610 users, 1996 to 2018; ``ml-latest``,
``ml-25m``): a directory holding ``ratings.csv`` and ``movies.csv`` instead. Those carry no
user demographics: ``age``, ``gender``, ``occupation`` and ``zip3`` are empty, and genres are
the genre names (``"gComedy|gDrama"``).

Record layout (``MOVIELENS_COLUMNS``; one CSV line per rating, in the order of the ratings'
timestamps, ties in the file's order)::

    sample_id, event_time, label, user_id, item_id, age, gender, occupation, zip3,
    genres, year, hour, weekday                                            13 columns

* ``sample_id``: ``"ml-{n}"``, ``n`` the 0-based position in the stream;
* ``event_time``: the rating's unix seconds moved by one constant so that the first rating
  is at ``start_time`` (default 2026-01-01T00:00:00Z; the gaps between ratings are kept:
  a trainer rejects event times before 2000 as ``bad_event_time``);
* ``label``: 1 when the rating is at least ``liked`` (default 4: "liked"), else 0;
* ``user_id`` ``"u<k>"``, ``item_id`` ``"i<k>"``: MovieLens' ids;
* ``age`` ``"a<decade>"`` (e.g. ``a2`` for 20-29), ``gender`` ``"M"``/``"F"``,
  ``occupation`` (u.user's word), ``zip3`` (the zip code's first 3 characters);
* ``genres``: the movie's genre flags as ``"g<k>"`` joined by ``"|"`` (``g0`` = unknown);
* ``year``: ``"y<yyyy>"`` of the movie's release date (``y0`` when missing);
* ``hour`` ``"h<hh>"`` and ``weekday`` ``"w<0-6>"`` (Monday 0) of the rating's original
  time, UTC.

Encodings (``MovieLensBatch.encode``): ``csv`` (the 13 values joined by ``","``) or ``json``
(one object with the 13 keys; ``label`` an int, ``event_time`` a number, the rest strings).

Ratings whose user or movie is missing from ``u.user`` / ``u.item`` are dropped (some
copies of the archive carry a few rows of a user 0) and counted in
``MovieLensStream.dropped``. There is no oracle: ``oracle_auc`` is None.

VW examples (``vw_examples``): namespaces ``u`` (user, age, gender, occupation, zip3),
``i`` (item, genres, year) and ``c`` (hour, weekday), so ``-q ui`` crosses user and movie
features as for the bursty stream.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np

MOVIELENS_COLUMNS: tuple[str, ...] = (
    "sample_id", "event_time", "label", "user_id", "item_id", "age", "gender", "occupation",
    "zip3", "genres", "year", "hour", "weekday")
START_TIME = 1767225600.0  # 2026-01-01T00:00:00Z
NO_USER = ("", "", "", "")  # ratings.csv archives: no demographics


@dataclass
class MovieLensBatch:
    """Consecutive records of the stream."""

    sample_ids: list[str]
    event_times: np.ndarray  # [n] unix seconds
    labels: np.ndarray  # [n] 0 / 1
    lines: list[str]  # the CSV records

    def encode(self, fmt: str = "csv") -> list[bytes]:
        """The records encoded (module docstring)."""
        if fmt == "csv":
            return [line.encode() for line in self.lines]
        if fmt != "json":
            raise ValueError(f"unknown format {fmt!r}")
        out = []
        for line in self.lines:
            rec: dict[str, object] = dict(zip(MOVIELENS_COLUMNS, line.split(","), strict=True))
            rec["label"] = int(rec["label"])  # type: ignore[arg-type]
            rec["event_time"] = float(rec["event_time"])  # type: ignore[arg-type]
            out.append(json.dumps(rec, separators=(",", ":")).encode())
        return out


class MovieLensStream:
    """The ratings as records (module docstring), their labels and VW's view of them.

    Args:
        data_dir: the unpacked ``ml-100k`` directory.
        records: the first this many ratings in time order (0: all).
        liked: the lowest rating labelled 1.
        start_time: the first record's event time (unix seconds).

    Raises:
        FileNotFoundError: a file is missing (the message says where to get it).
    """

    def __init__(self, data_dir: str, records: int = 0, liked: int = 4,
                 start_time: float = START_TIME) -> None:
        latest = all(os.path.exists(os.path.join(data_dir, name))
                     for name in ("ratings.csv", "movies.csv"))
        for name in () if latest else ("u.data", "u.user", "u.item"):
            if not os.path.exists(os.path.join(data_dir, name)):
                raise FileNotFoundError(
                    f"{os.path.join(data_dir, name)} is missing: the MovieLens stream needs "
                    "the unpacked MovieLens 100k directory (ml-100k.zip from GroupLens), or "
                    "one holding ratings.csv and movies.csv (ml-latest-small.zip)")
        if latest:
            users: dict[str, tuple[str, str, str, str]] = {}
            items = _read_movies_csv(os.path.join(data_dir, "movies.csv"))
            ratings, self.dropped = _read_ratings_csv(os.path.join(data_dir, "ratings.csv"),
                                                      items)
        else:
            users = _read_users(os.path.join(data_dir, "u.user"))
            items = _read_items(os.path.join(data_dir, "u.item"))
            ratings, self.dropped = _read_u_data(os.path.join(data_dir, "u.data"), users,
                                                 items)
        ratings.sort()
        if records:
            ratings = ratings[:records]
        self.lines: list[str] = []
        self.vw: list[str] = []  # VW examples, labels -1 / 1
        self.labels = np.empty(len(ratings), dtype=np.int64)
        self.event_times = np.empty(len(ratings), dtype=np.float64)
        shift = start_time - ratings[0][0] if ratings else 0.0
        for k, (ts, _n, uid, iid, rating) in enumerate(ratings):
            age, gender, occupation, zip3 = users.get(uid, NO_USER)
            genres, year = items[iid]
            when = datetime.fromtimestamp(ts, tz=timezone.utc)
            y = int(rating >= liked)
            self.labels[k] = y
            event_time = float(ts + shift)
            self.event_times[k] = event_time
            self.lines.append(f"ml-{k},{event_time!r},{y},u{uid},i{iid},{age},{gender},"
                              f"{occupation},{zip3},{genres},{year},h{when.hour:02d},"
                              f"w{when.weekday()}")
            who = f" {age} s{gender} o{occupation} z{zip3}" if uid in users else ""
            self.vw.append(f"{1 if y else -1} |u u{uid}{who} |i i{iid} "
                           f"{genres.replace('|', ' ')} {year} |c h{when.hour} "
                           f"w{when.weekday()}")
        self._next = 0

    def __len__(self) -> int:
        return len(self.lines)

    def values(self) -> list[bytes]:
        """Every record, CSV."""
        return [line.encode() for line in self.lines]

    def next_batch(self, n: int) -> MovieLensBatch:
        """The next ``n`` records (fewer at the end of the ratings, none after it)."""
        lo, hi = self._next, min(self._next + n, len(self.lines))
        self._next = hi
        return MovieLensBatch([f"ml-{k}" for k in range(lo, hi)], self.event_times[lo:hi],
                              self.labels[lo:hi], self.lines[lo:hi])

    def oracle_auc(self) -> None:
        """None: real data has no known answer."""
        return None

    def positive_rate(self) -> float:
        """The share of label 1 among the records handed out so far."""
        return float(self.labels[:self._next].mean()) if self._next else 0.0


def _read_users(path: str) -> dict[str, tuple[str, str, str, str]]:
    """u.user: id -> (age decade, gender, occupation, zip3)."""
    users = {}
    with open(path, encoding="latin-1") as f:
        for line in f:
            uid, age, gender, occupation, zipcode = line.rstrip("\n").split("|")
            users[uid] = (f"a{int(age) // 10}", gender, occupation, zipcode[:3] or "z")
    return users


def _read_items(path: str) -> dict[str, tuple[str, str]]:
    """u.item: id -> (genres joined by "|", release year); the last 19 fields are genre flags."""
    items = {}
    with open(path, encoding="latin-1") as f:
        for line in f:
            parts = line.rstrip("\n").split("|")
            genres = "|".join(f"g{k}" for k, v in enumerate(parts[-19:]) if v == "1") or "g0"
            date = parts[2]
            items[parts[0]] = (genres, f"y{date[-4:]}" if len(date) >= 4 else "y0")
    return items


def _read_u_data(path: str, users: dict, items: dict) -> tuple[list[tuple], int]:
    """u.data: (unix seconds, line, user, movie, rating) and how many rows were dropped."""
    ratings, dropped = [], 0
    with open(path, encoding="latin-1") as f:
        for n, line in enumerate(f):
            uid, iid, rating, ts = line.split()
            if uid not in users or iid not in items:
                dropped += 1
                continue
            ratings.append((int(ts), n, uid, iid, float(rating)))
    return ratings, dropped


def _read_ratings_csv(path: str, items: dict) -> tuple[list[tuple], int]:
    """ratings.csv (``userId,movieId,rating,timestamp`` and a header): as ``_read_u_data``."""
    ratings, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        next(f, None)
        for n, line in enumerate(f):
            uid, iid, rating, ts = line.strip().split(",")
            if iid not in items:
                dropped += 1
                continue
            ratings.append((int(ts), n, uid, iid, float(rating)))
    return ratings, dropped


def _read_movies_csv(path: str) -> dict[str, tuple[str, str]]:
    """movies.csv (``movieId,title,genres``, quoted where a title holds commas).

    Returns:
        id -> (genre names joined by "|", the title's "(yyyy)" year).
    """
    items = {}
    with open(path, encoding="utf-8", newline="") as f:
        rows = csv.reader(f)
        next(rows, None)
        for iid, title, genres in rows:
            names = [g for g in genres.split("|") if g and not g.startswith("(")]
            found = re.search(r"\((\d{4})\)\s*$", title)
            items[iid] = ("|".join(f"g{g.replace('-', '')}" for g in names) or "g0",
                          f"y{found.group(1)}" if found else "y0")
    return items
