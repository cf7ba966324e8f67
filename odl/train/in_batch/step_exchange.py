"""What the ranks of one training step exchange for in-batch learning; one rank, with itself.

A step of several ranks trains every rank's records together (``TrainModule``'s step: the
update one process makes on the ranks' records in rank order). In-batch learning and
per-record Adagrad look at the whole step, so each rank gives its part (a dataclass of numpy
arrays, one entry per record, read or row: ``in_batch_learning.RecordReads``,
``in_batch_learning.RecordSlopes``, ``per_record_adagrad.RowGradientSums``) and every rank
receives every rank's parts, in rank order, and computes the same from them. A one-rank job
is the case of one part: the exchange is the identity and runs no collective.

The rows the step reads live where the table placement put them (``held_rows``): each rank
gives the values of the rows it holds, and :meth:`StepExchange.held_values` takes each row's
from the rank holding it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np

from odl.train.distributed import arrays_from_every_rank

Part = TypeVar("Part")


class StepExchange:
    """Every rank's part of one step, on every rank (a collective with several ranks).

    Args:
        rank: this process's rank.
        world_size: the ranks of the job (1: one process).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = int(rank)
        self.world_size = int(world_size)

    def every_rank(self, mine: Part) -> list[Part]:
        """Every rank's part, in rank order (``[mine]`` with one rank).

        Args:
            mine: this rank's part: a dataclass whose fields are numpy arrays, each with
                the same dtype and trailing shape on every rank (the first dimension may
                differ).

        Returns:
            One part per rank, of ``mine``'s type.
        """
        if self.world_size == 1:
            return [mine]
        arrays: dict[str, Any] = {f.name: getattr(mine, f.name) for f in fields(mine)}
        return [type(mine)(**part) for part in arrays_from_every_rank(arrays)]

    def held_values(self, values: np.ndarray, held: np.ndarray) -> np.ndarray:
        """Each row's values from the rank that holds it.

        Args:
            values: ``[U, ...]`` the values of the step's rows this rank holds (any where
                not held).
            held: ``[U]`` bool, this rank holds the row; every row is held by one rank.

        Returns:
            ``[U, ...]`` like ``values``: every row's values, 0 for a row no rank holds.
        """
        parts = self.every_rank(_HeldValues(values, held.astype(np.uint8)))
        if len(parts) == 1:  # one rank holds every row
            return values
        out = np.zeros_like(values)
        for part in parts:
            got = part.held.astype(bool)
            out[got] = part.values[got]
        return out


@dataclass(frozen=True)
class _HeldValues:
    """One rank's values of the rows it holds (``StepExchange.held_values``'s part)."""

    values: np.ndarray
    held: np.ndarray
