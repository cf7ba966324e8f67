"""Embedding tables saved as each rank's own parts, and put back together when read.

With several ranks every rank writes the rows it holds (its shards of the row-wise split
tables, the tables placed on it whole, and their optimizer state) into its own file of the
checkpoint directory, so no rank ever holds every table at a save. Layout of one part file,
``tables.rank-<r>-of-<N>.pt`` (``part_file_name``), a ``torch.save`` of::

    {"format": 1, "rank": r, "world_size": N,
     "pieces": [[kind, name, key, whole_size, [[offsets, tensor], ...]], ...],
     "dynamic_parts": {partition: state}}      (only with dynamic tables split by id)

* ``kind``: ``"model"`` (a table's weights; ``name`` its parameter name, ``key`` ``""``) or
  ``"sparse"`` (its fused optimizer's state; ``name`` the parameter, ``key`` the state's
  name, e.g. ``momentum1``);
* ``whole_size``: the whole tensor's size (a list of ints);
* ``offsets``: where this rank's block starts in each dimension, or None for a tensor that
  every rank holds whole and equal (written by every rank; any copy is the value);
* ``dynamic_parts``: the partitions of the dynamic tables' state this rank holds when their
  index is split by id (``odl.models.dynamic.partitions``); reading the checkpoint puts
  them into the state's ``dynamic_tables["parts"]`` (``merge_dynamic_parts``).

The checkpoint's ``model.pt`` then names its parts (``"table_parts": [file, ...]``, rank
order) and holds the rest of the state; ``assemble`` builds the whole tables from the parts,
so a checkpoint written by N ranks reads as one process's (and restores into any number of
ranks). ``TableBlocks`` hands out a table's row blocks one at a time instead, mapped, so an
export never holds more than one block. A tensor whose blocks do not add up to its whole
size (a part missing) is an error, never zeros.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from odl.checkpoint import checkpoint_chain

PART_FORMAT = 1
PART_PREFIX = "tables.rank-"

Pieces = dict[tuple[str, str, str], tuple[tuple[int, ...], list]]


def part_file_name(rank: int, world_size: int) -> str:
    """The part file of ``rank`` among ``world_size`` ranks."""
    return f"{PART_PREFIX}{rank}-of-{world_size}.pt"


def part_document(pieces: Pieces, rank: int, world_size: int,
                  dynamic_parts: Mapping[int, Any] | None = None) -> dict[str, Any]:
    """A rank's pieces as the part file's document (module docstring).

    Args:
        pieces: ``(kind, name, key) -> (whole size, [(offsets or None, CPU tensor)])``.
        rank: the writing rank.
        world_size: the number of ranks.
        dynamic_parts: partition -> state of the dynamic tables' partitions it holds, when
            their index is split by id.
    """
    doc = {"format": PART_FORMAT, "rank": int(rank), "world_size": int(world_size),
           "pieces": [[kind, name, key, [int(x) for x in size],
                       [[None if off is None else [int(o) for o in off], t]
                        for off, t in parts]]
                      for (kind, name, key), (size, parts) in sorted(pieces.items())]}
    if dynamic_parts:
        doc["dynamic_parts"] = dict(dynamic_parts)
    return doc


def merge_dynamic_parts(state: dict[str, Any], documents: Iterable[Mapping[str, Any]]) -> None:
    """Puts the parts' ``dynamic_parts`` into ``state["dynamic_tables"]["parts"]``.

    A state whose dynamic tables are not split over the parts is left as it is.

    Raises:
        ValueError: two parts hold the same partition.
    """
    dynamic = state.get("dynamic_tables")
    if not isinstance(dynamic, dict) or int(dynamic.get("partitions", 1)) == 1:
        return
    merged = dynamic.setdefault("parts", {})
    for doc in documents:
        for p, part in (doc.get("dynamic_parts") or {}).items():
            if int(p) in merged:
                raise ValueError(f"two table parts hold partition {p} of the dynamic tables")
            merged[int(p)] = part


def write_part(path: str, document: Mapping[str, Any]) -> None:
    """Writes a part document to ``path`` and fsyncs it (``save_durable``)."""
    save_durable(path, dict(document))


class _WriteErrors:
    """A file's ``write`` that keeps the ``OSError`` it raised (``save_durable``)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def save_durable(path: str, obj: Any) -> None:
    """``torch.save`` of ``obj`` to ``path``, fsynced.

    A write that fails (a full disk, an I/O error) raises its ``OSError``: torch's writer
    reports it only as a position mismatch of its archive ("unexpected pos").
    """
    with open(path, "wb") as f:
        writer = _WriteErrors(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())


def read_part(path: str, map_location: str = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Reads a part file.

    Args:
        path: the part file.
        map_location: device for the tensors.
        mmap: map the file instead of reading it (only the blocks used are read).

    Raises:
        ValueError: it is not a part file of a known format.
    """
    doc = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    if not isinstance(doc, dict) or doc.get("format") != PART_FORMAT:
        raise ValueError(f"{path} is not a table part file of format {PART_FORMAT}")
    return doc


def assemble(documents: Iterable[Mapping[str, Any]]
             ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The whole tables and their optimizer state from every rank's part.

    Args:
        documents: every rank's part document (``part_document`` / ``read_part``).

    Returns:
        ``(tables: name -> tensor, sparse optimizer state: name -> {key: tensor})``.

    Raises:
        ValueError: a tensor's blocks do not add up to its size, or sizes disagree.
    """
    whole: dict[tuple[str, str, str], torch.Tensor] = {}
    covered: dict[tuple[str, str, str], int] = {}
    for doc in documents:
        for kind, name, key, size, parts in doc["pieces"]:
            ident = (kind, name, key)
            size = tuple(size)
            for offsets, tensor in parts:
                if offsets is None:  # the same on every rank
                    if ident not in whole:
                        whole[ident] = tensor
                        covered[ident] = tensor.numel()
                    continue
                if ident not in whole:
                    whole[ident] = torch.empty(size, dtype=tensor.dtype)
                    covered[ident] = 0
                if tuple(whole[ident].shape) != size:
                    raise ValueError(f"{kind} {name} {key}: parts disagree on its size "
                                     f"({tuple(whole[ident].shape)} vs {size})")
                idx = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape, strict=True))
                whole[ident][idx] = tensor
                covered[ident] += tensor.numel()
    for ident, t in whole.items():
        if covered[ident] != t.numel():
            raise ValueError(f"{ident[0]} {ident[1]} {ident[2]}: the parts cover "
                             f"{covered[ident]} of its {t.numel()} values")
    model = {name: t for (kind, name, _), t in whole.items() if kind == "model"}
    sparse: dict[str, dict[str, torch.Tensor]] = {}
    for (kind, name, key), t in sorted(whole.items()):
        if kind == "sparse":
            sparse.setdefault(name, {})[key] = t
    return model, sparse


def load_blocks(documents: Iterable[Mapping[str, Any]],
                local: Mapping[tuple[str, str, str], list[tuple[tuple[int, ...], torch.Tensor]]]
                ) -> set[tuple[str, str, str]]:
    """Copies into each of this rank's shards the blocks of the parts that overlap it.

    For a restore into any number of ranks without putting the tables together: only the
    rows a rank holds are read (with ``read_part(mmap=True)``, only those pages).

    Args:
        documents: every rank's part document, read one at a time.
        local: ``(kind, name, key) -> [(offsets, shard tensor)]``, this rank's shards.

    Returns:
        Every ``(kind, name, key)`` the parts hold.

    Raises:
        ValueError: a shard is not covered exactly by the parts' blocks.
    """
    copied = {ident: [0] * len(shards) for ident, shards in local.items()}
    held: set[tuple[str, str, str]] = set()
    whole_seen: set[tuple[str, str, str]] = set()
    for doc in documents:
        for kind, name, key, _size, parts in doc["pieces"]:
            ident = (kind, name, key)
            held.add(ident)
            for offsets, block in parts:
                if offsets is None:  # the same on every rank: one copy is the value
                    if ident in whole_seen:
                        continue
                    whole_seen.add(ident)
                    offsets = [0] * block.dim()
                for k, (start, shard) in enumerate(local.get(ident, ())):
                    lo = [max(a, b) for a, b in zip(offsets, start, strict=True)]
                    hi = [min(a + n, b + m) for a, n, b, m in
                          zip(offsets, block.shape, start, shard.shape, strict=True)]
                    if any(low >= high for low, high in zip(lo, hi, strict=True)):
                        continue
                    src = block[tuple(slice(low - a, high - a)
                                      for low, high, a in zip(lo, hi, offsets, strict=True))]
                    shard[tuple(slice(low - b, high - b)
                                for low, high, b in zip(lo, hi, start, strict=True))].copy_(src)
                    copied[ident][k] += src.numel()
    for ident, shards in local.items():
        for (start, shard), n in zip(shards, copied[ident], strict=True):
            if n != shard.numel():
                raise ValueError(f"{ident[0]} {ident[1]} {ident[2]}: the parts cover {n} of "
                                 f"the {shard.numel()} values of the shard at {tuple(start)}")
    return held


class TableBlocks:
    """The row blocks of every table of a checkpoint state, one table at a time.

    From the mapped parts of a checkpoint of several ranks (``state["table_parts"]``), or the
    state's own (mapped) tables, each one block (``read_checkpoint(whole_tables=False)``).
    Only the blocks asked for are read from disk; ``take`` reads chosen rows of a table or
    of its optimizer state from whichever blocks hold them. An increment's changed rows
    (``state["table_rows"]``, ``odl.checkpoint.checkpoint_chain``) are read whole and
    replace the base's rows in every block and row handed out.

    Args:
        state: a checkpoint state.

    Raises:
        ValueError: a part is not a part file.
    """

    def __init__(self, state: Mapping[str, Any]) -> None:
        self._model = state.get("model", {})
        self._sparse = state.get("sparse_optimizer", {})
        self._pieces: dict[str, tuple[tuple[int, ...], list]] = {}
        self._state_pieces: dict[tuple[str, str], tuple[tuple[int, ...], list]] = {}
        for path in state.get("table_parts") or []:
            for kind, name, key, size, parts in read_part(path, mmap=True)["pieces"]:
                into = (self._pieces.setdefault(name, (tuple(size), [])) if kind == "model"
                        else self._state_pieces.setdefault((name, key), (tuple(size), [])))
                into[1].extend(parts)
        self._rows = checkpoint_chain.merged_rows(
            checkpoint_chain.read_rows(p) for p in state.get(checkpoint_chain.TABLE_ROWS_KEY)
            or [])

    def _changed(self, out: torch.Tensor, ident: tuple[str, str, str], rows: torch.Tensor
                 ) -> torch.Tensor:
        """``out`` (the base's values of whole-table ``rows``) with the increments' rows."""
        changed = self._rows.get(ident)
        if changed is None:
            return out
        _size, ids, values = changed
        if ids is None:
            return values.index_select(0, rows)
        if not ids.numel() or not rows.numel():
            return out
        at = torch.searchsorted(ids, rows).clamp_(max=ids.numel() - 1)
        found = ids[at] == rows
        if bool(found.any()):
            out = out.clone()
            out[found] = values[at[found]].to(out.dtype)
        return out

    def _changed_block(self, name: str, start: int, block: torch.Tensor) -> torch.Tensor:
        """A block of rows from ``start`` with the increments' rows of it."""
        changed = self._rows.get(("model", name, ""))
        if changed is None:
            return block
        _size, ids, values = changed
        if ids is None:
            return values[start:start + block.shape[0]]
        lo, hi = (int(x) for x in torch.searchsorted(
            ids, torch.tensor([start, start + block.shape[0]])))
        if hi == lo:
            return block
        block = block.clone()
        block.index_copy_(0, ids[lo:hi] - start, values[lo:hi].to(block.dtype))
        return block

    def __contains__(self, name: str) -> bool:
        return name in self._pieces or name in self._model

    def size(self, name: str) -> tuple[int, ...]:
        """The whole table's size."""
        if name in self._pieces:
            return self._pieces[name][0]
        return tuple(int(x) for x in self._model[name].shape)

    def blocks(self, name: str) -> list[tuple[int, torch.Tensor]]:
        """``[(first row, rows)]`` of a table by first row, whole columns, covering every row.

        Raises:
            ValueError: the blocks split the columns, overlap or leave rows out.
        """
        if name not in self._pieces:
            return [(0, self._changed_block(name, 0, self._model[name]))]
        size, parts = self._pieces[name]
        out: dict[int, torch.Tensor] = {}
        for offsets, tensor in parts:
            if offsets is None:  # whole and equal on every rank: any copy
                out.setdefault(0, tensor)
                continue
            if offsets[1] != 0 or tensor.shape[1] != size[1]:
                raise ValueError(f"{name}: a block of columns {offsets[1]}.. is not a block of "
                                 "whole rows")
            out[int(offsets[0])] = tensor
        at = 0
        for start, tensor in sorted(out.items()):
            if start != at:
                raise ValueError(f"{name}: its blocks cover rows up to {at}, the next starts "
                                 f"at {start}")
            at += int(tensor.shape[0])
        if at != size[0]:
            raise ValueError(f"{name}: its blocks cover {at} of its {size[0]} rows")
        return [(start, self._changed_block(name, start, t))
                for start, t in sorted(out.items(), key=lambda kv: kv[0])]

    def take(self, name: str, rows: torch.Tensor, key: str = "") -> torch.Tensor:
        """Rows ``rows`` (whole-table row numbers) of table ``name``, all its columns.

        Args:
            name: the table's parameter name.
            rows: ``int64`` row numbers.
            key: an optimizer state's name (``momentum1``, ...): its rows instead of the
                weights'.

        Raises:
            KeyError: the state has no such table or optimizer state.
            ValueError: the blocks do not cover the rows asked for.
        """
        rows = torch.as_tensor(rows, dtype=torch.int64)
        ident = ("sparse", name, key) if key else ("model", name, "")
        pieces = self._state_pieces.get((name, key)) if key else self._pieces.get(name)
        if pieces is None:
            whole = self._sparse[name][key] if key else self._model[name]
            return self._changed(torch.as_tensor(whole).index_select(0, rows), ident, rows)
        size, parts = pieces
        out = torch.empty((rows.shape[0], *size[1:]), dtype=parts[0][1].dtype)
        covered = 0
        for offsets, tensor in parts:
            if offsets is None:  # whole and equal on every rank: any copy
                return self._changed(tensor.index_select(0, rows), ident, rows)
            r0 = int(offsets[0])
            at = torch.nonzero((rows >= r0) & (rows < r0 + tensor.shape[0])).squeeze(1)
            if not at.numel():
                continue
            block = tensor.index_select(0, rows[at] - r0)
            into = out if tensor.dim() == 1 else out[:, offsets[1]:offsets[1] + tensor.shape[1]]
            into.index_copy_(0, at, block)
            covered += block.numel()
        if covered != out.numel():
            raise ValueError(f"{name} {key}: its blocks cover {covered} of the "
                             f"{out.numel()} values of the rows asked for")
        return self._changed(out, ident, rows)
