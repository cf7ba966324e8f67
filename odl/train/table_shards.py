"""A model's tables as this rank holds them: full copies, writable views, row writes.

A table of a ``DistributedModelParallel`` model is a plain tensor in one process and a
``ShardedTensor`` of this rank's shards with several ranks (``odl.train.distributed``). These
helpers read and write either form: :func:`to_full_cpu` copies a whole table, :func:`local_view`
is the writable table of one process, :class:`ShardRows` writes whole-table rows through to
the shards that hold them, :func:`local_shards` / :func:`shard_pieces` list a rank's shards
and :func:`copy_shards` fills each from a whole tensor; :func:`read_held_accumulators` and
:func:`write_held_rows` read and update the rows a rank holds (per-record Adagrad of
several ranks); :func:`init_local_shards` gives each shard its initial values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from odl.models.embedding_tables import init_embedding_weights, initial_rows

# the state-dict prefix of the tables (``EmbeddingBagCollection`` named ``ebc``)
EBC_PREFIX = "ebc.embedding_bags."

# table -> (weight, [optimizer state tensors]) as this rank holds them
TableShards = Callable[[str], tuple[Any, list[Any]]]


def to_full_cpu(t: Any) -> torch.Tensor:
    """A plain, full, detached CPU copy of a tensor, ShardedTensor or DTensor."""
    if hasattr(t, "local_shards") and hasattr(t, "metadata"):
        out = torch.empty(tuple(t.size()), dtype=t.dtype)
        for shard in t.local_shards():
            off = shard.metadata.shard_offsets
            sizes = shard.metadata.shard_sizes
            idx = tuple(slice(o, o + s) for o, s in zip(off, sizes, strict=True))
            out[idx] = shard.tensor.detach().cpu()
        return out
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def local_view(t: Any) -> torch.Tensor:
    """The writable full local tensor of a single-worker ShardedTensor / DTensor / tensor."""
    if hasattr(t, "local_shards") and hasattr(t, "metadata"):
        shards = t.local_shards()
        if len(shards) != 1 or tuple(shards[0].tensor.shape) != tuple(t.size()):
            raise RuntimeError("this needs a table whole in this process, and this rank "
                               "holds part of it (a model sharded over several ranks)")
        return shards[0].tensor
    if hasattr(t, "to_local"):
        return t.to_local()
    return t


class ShardRows:
    """A whole table as far as writing rows goes, written through to this rank's shards.

    Supports what copying recovered rows needs (``publisher.delta_recovery``) and resetting
    a dynamic table's evicted rows (``reset_embedding_rows``): ``shape``, ``device``,
    ``dtype``, ``rows[:, :dim]`` (the first ``dim`` columns), ``rows[ids] = values`` (``ids``
    whole-table row numbers, ``values`` ``[len(ids), dim]``), ``index_copy_`` and
    ``index_fill_`` of rows: each shard takes the rows and columns it holds.

    Args:
        shards: ``[(offsets, shard tensor)]`` of this rank.
        shape: the whole table's ``(rows, columns)``.
        columns: the columns written (the first ``columns``; None: all).
    """

    def __init__(self, shards: list[tuple[tuple[int, ...], torch.Tensor]],
                 shape: tuple[int, ...], columns: int | None = None) -> None:
        self._shards = shards
        self._whole = shape
        self._columns = shape[1] if columns is None else columns
        self.shape = (shape[0], self._columns)
        self.device = shards[0][1].device if shards else torch.device("cpu")
        self.dtype = shards[0][1].dtype if shards else torch.float32

    def __getitem__(self, key: Any) -> ShardRows:
        rows, cols = key
        if rows != slice(None) or cols.start not in (None, 0) or cols.step not in (None, 1):
            raise TypeError("ShardRows takes [:, :dim] only")
        return ShardRows(self._shards, self._whole, min(cols.stop, self._columns))

    def index_copy_(self, dim: int, ids: torch.Tensor, values: torch.Tensor) -> ShardRows:
        """``rows[ids] = values`` (``dim`` 0), as ``Tensor.index_copy_``."""
        if dim != 0:
            raise TypeError("ShardRows copies rows only")
        self[ids] = values
        return self

    def index_fill_(self, dim: int, ids: torch.Tensor, value: float) -> ShardRows:
        """``rows[ids] = value`` (``dim`` 0), as ``Tensor.index_fill_``."""
        return self.index_copy_(dim, ids, torch.full((ids.numel(), self.shape[1]), value))

    def __setitem__(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        for (row0, col0), shard in self._shards:
            mine = (ids >= row0) & (ids < row0 + shard.shape[0])
            hi = min(self._columns, col0 + shard.shape[1])
            if not bool(mine.any()) or hi <= col0:
                continue
            local = (ids[mine] - row0).to(shard.device)
            shard[local, :hi - col0] = values[mine.to(values.device)][:, col0:hi].to(
                device=shard.device, dtype=shard.dtype)


def copy_into(dst: torch.Tensor, src: torch.Tensor, name: str, src_name: str) -> None:
    """``dst[...] = src`` on ``dst``'s device and dtype; a shape that differs names both."""
    src = torch.as_tensor(src)
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch: {name} has shape {tuple(dst.shape)} but the source "
            f"{src_name} has shape {tuple(src.shape)}")
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def shard_pieces(t: Any) -> tuple[tuple[int, ...], list]:
    """``(whole size, [(offsets, CPU tensor)])`` of a ShardedTensor's local shards.

    On CPU a shard's tensor is a view of the rank's fused buffer, not a copy. A plain tensor
    (the same on every rank) is one piece with offsets None.
    """
    if hasattr(t, "local_shards") and hasattr(t, "metadata"):
        return tuple(t.size()), [(off, x.detach().cpu()) for off, x in local_shards(t)]
    t = torch.as_tensor(t)
    return tuple(t.shape), [(None, t.detach().cpu().clone())]


def local_shards(t: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``[(offsets, writable tensor)]`` of a ShardedTensor's local shards.

    A plain tensor is itself at offset 0.
    """
    if hasattr(t, "local_shards") and hasattr(t, "metadata"):
        return [(tuple(sh.metadata.shard_offsets), sh.tensor) for sh in t.local_shards()]
    return [(tuple(0 for _ in t.shape), t)]


@torch.no_grad()
def fill_states(fused_state: Mapping[str, Mapping[str, Any]], value: float) -> None:
    """Fills every table-optimizer state tensor this rank holds with ``value``.

    Args:
        fused_state: ``fused_optimizer.state_dict()["state"]`` (parameter -> name -> state).
        value: the start value (a fused Adagrad's ``initial_accumulator_value``).
    """
    for states in fused_state.values():
        for v in states.values():
            if isinstance(v, torch.Tensor) or hasattr(v, "local_shards"):
                for _offsets, shard in local_shards(v):
                    shard.fill_(value)


def copy_shards(dst: Any, whole: torch.Tensor, name: str, src_name: str = "") -> None:
    """Copies each local shard of ``dst`` from the rows and columns it covers in ``whole``.

    A plain ``dst`` is copied whole.
    """
    whole = torch.as_tensor(whole)
    src_name = src_name or name
    if not (hasattr(dst, "local_shards") and hasattr(dst, "metadata")):
        copy_into(dst, whole, name, src_name)
        return
    if tuple(dst.size()) != tuple(whole.shape):
        raise ValueError(f"shape mismatch: {name} has shape {tuple(dst.size())} but the "
                         f"source {src_name} has shape {tuple(whole.shape)}")
    for sh in dst.local_shards():
        idx = tuple(slice(o, o + n) for o, n in zip(sh.metadata.shard_offsets,
                                                    sh.metadata.shard_sizes, strict=True))
        sh.tensor.copy_(whole[idx].to(device=sh.tensor.device, dtype=sh.tensor.dtype))


def tensors_to_cpu(obj: Any) -> Any:
    """Tensors in nested dicts and lists -> detached CPU copies (the rest as is)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: tensors_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [tensors_to_cpu(v) for v in obj]
    return obj


@torch.no_grad()
def read_held_accumulators(table_shards: TableShards, width: int, tables: Sequence[str],
                           rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The table optimizer's accumulators of the (table, row)s this rank's shards hold.

    Args:
        table_shards: table -> its weight and optimizer state as this rank holds them
            (``TrainModule.table_shards``).
        width: the accumulator columns read (1 for row-wise Adagrad).
        tables: each row's table.
        rows: the rows.

    Returns:
        ``(values [U, width], held [U])``: 0 and False for the rows held elsewhere.
    """
    values = np.zeros((len(rows), width), dtype=np.float32)
    held = np.zeros(len(rows), dtype=bool)
    names = np.asarray(tables)
    for table in np.unique(names):
        at = np.flatnonzero(names == table)
        st = table_shards(str(table))[1]
        if not st:
            continue
        for (r0, *c), shard in local_shards(st[0]):
            want = rows[at]
            inside = (want >= r0) & (want < r0 + shard.shape[0])
            if not inside.any():
                continue
            got = shard.index_select(0, torch.from_numpy(want[inside] - r0).to(
                shard.device)).cpu().to(torch.float32).numpy()
            got = got if got.ndim > 1 else got[:, None]
            c0 = c[0] if c else 0
            k = max(0, min(got.shape[1], width - c0))  # the pass reads `width` columns
            values[at[inside], c0:c0 + k] = got[:, :k]
            held[at[inside]] = True
    return values, held

@torch.no_grad()
def write_held_rows(table_shards: TableShards, tables: Sequence[str], rows: np.ndarray,
                delta: np.ndarray, acc: np.ndarray) -> None:
    """Adds ``delta`` to the weights and sets the accumulators ``acc`` of rows held here.

    Only the requested (table, row)s this rank's shards hold are written; the others
    are skipped.
    """
    names = np.asarray(tables)
    for table in np.unique(names):
        at = np.flatnonzero(names == table)
        weight, st = table_shards(str(table))
        targets = [(weight, delta, False)] + ([(st[0], acc, True)] if st else [])
        for tensor, values, is_state in targets:
            for (r0, *c), shard in local_shards(tensor):
                want = rows[at]
                inside = (want >= r0) & (want < r0 + shard.shape[0])
                if not inside.any():
                    continue
                idx = torch.from_numpy(want[inside] - r0).to(shard.device)
                part = torch.from_numpy(values[at[inside]]).to(shard.device, shard.dtype)
                if shard.dim() == 1:  # row-wise accumulators
                    shard.index_copy_(0, idx, part[:, 0])
                    continue
                c0 = c[0] if c else 0
                k = max(0, min(shard.shape[1], part.shape[1] - c0))
                if is_state:
                    shard[:, :k].index_copy_(0, idx, part[:, c0:c0 + k])
                else:
                    shard[:, :k].index_add_(0, idx, part[:, c0:c0 + k])


@torch.no_grad()
def init_local_shards(dmp: Any, seed: int) -> None:
    """``init_embedding_weights`` for the shards this rank holds of ``dmp``'s tables.

    Each shard gets the values its rows and columns have in the whole table as one
    process initializes it, drawn for its rows alone (``initial_rows``): no rank holds
    more than its shards and one block of rows.
    """
    for name, t in dmp.state_dict().items():
        if not (name.startswith(EBC_PREFIX) and name.endswith(".weight")):
            continue
        table = name[len(EBC_PREFIX):-len(".weight")]
        if not hasattr(t, "local_shards"):
            init_embedding_weights({table: t}, seed)
            continue
        for sh in t.local_shards():
            (r0, c0), (n, m) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
            for first, values in initial_rows(table, seed, tuple(t.size()), r0,
                                              r0 + n):
                sh.tensor[first - r0 : first - r0 + values.shape[0]].copy_(
                    values[:, c0 : c0 + m].to(device=sh.tensor.device,
                                              dtype=sh.tensor.dtype))
