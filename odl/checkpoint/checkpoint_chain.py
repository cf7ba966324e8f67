"""Incremental checkpoints: what an increment holds, its chain, and how a chain is read.

Contract (enforced here and by ``odl.checkpoint.checkpoint_manager``):

* A **full** checkpoint is the layout of ``checkpoint_manager``'s docstring, unchanged
  (manifest ``"format": 1``). With ``train_config.full_checkpoint_every = 1`` every
  checkpoint is full.
* An **increment** ``model.ckpt-<step>`` has the same files but the tables: ``model.pt``
  holds the rest of the state (dense part, dense optimizer, step, the dynamic tables' state,
  pass saves) plus ``"table_rows": [file, ...]``, and each rank writes
  ``rows.rank-<r>-of-<N>.pt`` (:func:`rows_file_name`): the table rows changed since the
  **parent** (the checkpoint written, or restored, just before it), weights and
  table-optimizer state of those rows, a ``torch.save`` of::

      {"format": 1, "rank": r, "world_size": N,
       "rows": [[kind, name, key, whole_size, row_ids, values], ...],
       "dynamic_parts": {partition: state}}   (only with dynamic tables split by id over
                                               the ranks: its partitions, whole or changes)

  ``kind``/``name``/``key``/``whole_size`` as in ``odl.checkpoint.table_parts``;
  ``row_ids`` whole-table row numbers (``int64``), ``values`` those rows (all columns); a
  tensor that is not a table of rows has ``row_ids`` None and ``values`` whole. Its
  manifest says ``"format": 2`` and ``"increment": {"parent": name, "parent_manifest":
  sha256 of the parent's MANIFEST.json, "base": name of the full checkpoint, "depth": n}``
  (n: the increments since the base, this one included), and lists the row files.
  The dynamic tables' state in ``model.pt`` (one process, or every rank holding the whole
  index), or each rank's partitions in its row file (split by id over the ranks), is whole
  or their changes since the parent (``odl.models.dynamic.state_changes``: the changed
  rows' ids and counters, the moved part of the free-row stack); a reader applies every
  link's changes in order onto the base's state (of a partition: onto the state the link
  before left it).
* Every ``full_checkpoint_every``-th checkpoint is full (depth never reaches it); so is the
  first one after a start from nothing, a warm start, a restore that re-split dynamic
  tables or that crash recovery moved forward, one that replaces a checkpoint of the same
  step (a day's shrink), and the next one after a save that found its step's checkpoint
  there already. A failed checkpoint leaves its rows marked changed
  (``odl.train.checkpoint_rows``), so the next one writes them. A copy that must stand
  alone (a file stream's pass copy) is written full (``checkpoint_manager.write_full_copy``).
* **Reading** an increment (:func:`chain_of`) walks its parents down to the base: every
  link must be committed (DONE), match its manifest, and its MANIFEST.json must hash to the
  digest its child recorded; otherwise the increment is unusable and the error names the
  link. A restore from a model_dir falls back to the newest checkpoint whose whole chain is
  usable (as for a damaged newest checkpoint). ``read_checkpoint`` then returns the base's
  tables with every increment's rows applied in order, and the newest link's state,
  positions and manifest: every reader (restore into any number of ranks, export, warm
  start) sees one process's state, as from a full checkpoint.
* **Crashes**: an increment is written and committed like a full checkpoint (temporary
  directory, DONE last; on OSS the DONE object last), so a kill -9 during its write leaves
  the chain up to its parent usable.
* **Retention** (``keep_checkpoint_max``) keeps the newest N checkpoints and every link
  their chains need (a base and the increments between), so it may keep more than N.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from odl.checkpoint.checkpoint_layout import (
    DONE_FILE,
    MANIFEST_FILE,
    CheckpointError,
    checkpoint_step,
    local_checkpoint_copy,
    verify_checkpoint,
)
from odl.storage import file_store
from odl.storage.storage_path import basename, dirname, join

ROWS_FORMAT = 1
ROWS_PREFIX = "rows.rank-"
INCREMENT_FORMAT = 2
TABLE_ROWS_KEY = "table_rows"

# (kind, name, key) -> (whole size, row ids or None, values)
RowPieces = dict[tuple[str, str, str], tuple[tuple[int, ...], Optional[torch.Tensor],
                                             torch.Tensor]]


@dataclass(frozen=True)
class ChainLink:
    """A committed checkpoint as the parent of the next increment.

    Attributes:
        name: its directory name (``model.ckpt-<step>``).
        manifest_sha256: the SHA-256 of its MANIFEST.json.
        base: the name of the full checkpoint its chain starts at (its own when full).
        depth: increments since that base (0 for a full checkpoint).
    """

    name: str
    manifest_sha256: str
    base: str
    depth: int


def rows_file_name(rank: int, world_size: int) -> str:
    """The row file of ``rank`` among ``world_size`` ranks of an increment."""
    return f"{ROWS_PREFIX}{rank}-of-{world_size}.pt"


def link_from_manifest(name: str, manifest_bytes: bytes) -> ChainLink:
    """The chain link of checkpoint ``name`` from its MANIFEST.json's bytes."""
    manifest = json.loads(manifest_bytes)
    inc = manifest.get("increment")
    digest = hashlib.sha256(manifest_bytes).hexdigest()
    if not inc:
        return ChainLink(name, digest, name, 0)
    return ChainLink(name, digest, str(inc["base"]), int(inc["depth"]))


def increment_fields(parent: ChainLink) -> dict[str, Any]:
    """The manifest's ``"increment"`` object of an increment of ``parent``."""
    return {"parent": parent.name, "parent_manifest": parent.manifest_sha256,
            "base": parent.base, "depth": parent.depth + 1}


def rows_document(pieces: RowPieces, rank: int, world_size: int,
                  dynamic_parts: Mapping[int, Any] | None = None) -> dict[str, Any]:
    """A rank's changed rows as a row file's document (module docstring).

    Args:
        pieces: ``(kind, name, key) -> (whole size, row ids or None, values)``.
        rank: the writing rank.
        world_size: the number of ranks.
        dynamic_parts: partition -> state of the dynamic tables' partitions it holds, when
            their index is split by id.
    """
    doc: dict[str, Any] = {
        "format": ROWS_FORMAT, "rank": int(rank), "world_size": int(world_size),
        "rows": [[kind, name, key, [int(x) for x in size], ids, values]
                 for (kind, name, key), (size, ids, values) in sorted(pieces.items())]}
    if dynamic_parts:
        doc["dynamic_parts"] = dict(dynamic_parts)
    return doc


def is_rows_document(document: Mapping[str, Any]) -> bool:
    """Whether a rank's document is an increment's rows (else a full table part)."""
    return "rows" in document


def read_rows(path: str, map_location: str = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Reads a row file (``mmap``: mapped, its tensors read only where used).

    Raises:
        ValueError: it is not a row file of a known format.
    """
    doc = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    if not isinstance(doc, dict) or doc.get("format") != ROWS_FORMAT or "rows" not in doc:
        raise ValueError(f"{path} is not a table row file of format {ROWS_FORMAT}")
    return doc


def merged_rows(documents: Iterable[Mapping[str, Any]]) -> RowPieces:
    """Every increment's rows as one set, a later document's rows winning.

    Args:
        documents: row documents, oldest increment first (any rank order within one).

    Returns:
        ``(kind, name, key) -> (whole size, sorted unique row ids or None, values)``.
    """
    found: dict[tuple[str, str, str], list] = {}
    sizes: dict[tuple[str, str, str], tuple[int, ...]] = {}
    whole: dict[tuple[str, str, str], torch.Tensor] = {}
    for doc in documents:
        for kind, name, key, size, ids, values in doc["rows"]:
            ident = (kind, name, key)
            sizes[ident] = tuple(size)
            if ids is None:
                whole[ident] = values
                continue
            found.setdefault(ident, []).append((ids, values))
    out: RowPieces = {ident: (sizes[ident], None, t) for ident, t in whole.items()}
    for ident, pieces in found.items():
        ids = torch.cat([i for i, _v in pieces]).numpy()
        values = torch.cat([v for _i, v in pieces])
        # the last occurrence of each row wins: unique over the reversed order
        rev = ids[::-1]
        uniq, first = np.unique(rev, return_index=True)
        at = torch.from_numpy((len(ids) - 1 - first).astype(np.int64))
        out[ident] = (sizes[ident], torch.from_numpy(uniq.astype(np.int64)),
                      values.index_select(0, at))
    return out


def apply_rows(model: dict[str, torch.Tensor], sparse: dict[str, dict[str, torch.Tensor]],
               rows: RowPieces) -> None:
    """Writes merged increment rows into whole tables and their optimizer state, in place.

    Raises:
        ValueError: a table or state the rows name is missing, or its size differs.
    """
    for (kind, name, key), (size, ids, values) in rows.items():
        if kind == "model":
            target = model.get(name)
        else:
            target = sparse.get(name, {}).get(key)
        if target is None:
            raise ValueError(f"{kind} {name} {key}: the increment has rows of a tensor the "
                             "base checkpoint lacks")
        if tuple(target.shape) != size:
            raise ValueError(f"{kind} {name} {key}: the base holds {tuple(target.shape)}, "
                             f"the increment {size}")
        if ids is None:
            target.copy_(values)
        elif ids.numel():
            target.index_copy_(0, ids, values.to(target.dtype))


def apply_rows_to_shards(
        rows: RowPieces,
        local: Mapping[tuple[str, str, str], list[tuple[tuple[int, ...], torch.Tensor]]]
) -> None:
    """Writes merged increment rows into this rank's shards (whole-row blocks).

    Args:
        rows: ``merged_rows``'s result.
        local: ``(kind, name, key) -> [(offsets, shard tensor)]``, this rank's shards.
    """
    for ident, shards in local.items():
        if ident not in rows:
            continue
        _size, ids, values = rows[ident]
        for offsets, shard in shards:
            if ids is None:
                idx = tuple(slice(o, o + n) for o, n in zip(offsets, shard.shape, strict=True))
                shard.copy_(values[idx])
                continue
            r0 = int(offsets[0])
            inside = torch.nonzero((ids >= r0) & (ids < r0 + shard.shape[0])).squeeze(1)
            if not inside.numel():
                continue
            block = values.index_select(0, inside)
            if shard.dim() > 1:
                block = block[:, offsets[1]:offsets[1] + shard.shape[1]]
            shard.index_copy_(0, (ids[inside] - r0).to(shard.device),
                              block.to(shard.device, shard.dtype))


def manifest_of(path: str) -> tuple[dict[str, Any], bytes]:
    """The parsed MANIFEST.json of checkpoint ``path`` and its bytes.

    Raises:
        CheckpointError: it cannot be read.
    """
    try:
        raw = file_store.read_bytes(join(path, MANIFEST_FILE))
        return json.loads(raw), raw
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable manifest: {exc}") from exc


def chain_of(path: str, verify_links: bool = True) -> list[str]:
    """The checkpoints ``path`` is read from: its base, the increments between, itself.

    Args:
        path: a committed checkpoint (itself verified by the caller).
        verify_links: check every parent against its manifest too (files, sizes, digests).

    Returns:
        ``[base, ..., path]``; ``[path]`` for a full checkpoint.

    Raises:
        CheckpointError: a link is missing, uncommitted, damaged, or not the checkpoint
            its child names (message names it).
    """
    manifest, _raw = manifest_of(path)
    chain = [path]
    model_dir = dirname(path)
    seen = {basename(path)}
    while manifest.get("increment"):
        inc = manifest["increment"]
        parent = join(model_dir, str(inc["parent"]))
        child = chain[0]
        if checkpoint_step(parent) is None or inc["parent"] in seen:
            raise CheckpointError(f"increment {child} names an invalid parent "
                                  f"{inc['parent']!r}")
        seen.add(str(inc["parent"]))
        if not file_store.is_file(join(parent, DONE_FILE)):
            raise CheckpointError(f"increment {child} needs {parent}, which is missing or "
                                  "incomplete (no DONE)")
        if verify_links:
            reason = verify_checkpoint(parent)
            if reason:
                raise CheckpointError(f"increment {child} needs {parent}, which is not "
                                      f"usable: {reason}")
        manifest, raw = manifest_of(parent)
        if hashlib.sha256(raw).hexdigest() != inc["parent_manifest"]:
            raise CheckpointError(f"increment {child} names {parent} as its parent, but that "
                                  "checkpoint is another one (its manifest digest differs)")
        chain.insert(0, parent)
    return chain


def local_chain(chain: list[str]) -> list[str]:
    """The local directories of a chain's checkpoints (downloaded when remote)."""
    return [local_checkpoint_copy(p) for p in chain]


def row_files(local_dir: str, state: Mapping[str, Any]) -> list[str]:
    """The local paths of an increment state's row files."""
    return [os.path.join(local_dir, name) for name in state.get(TABLE_ROWS_KEY) or []]
