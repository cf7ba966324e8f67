"""Embedding tables saved as each rank's own parts, and put back together when read.

With several ranks every rank writes the rows it holds (its shards of the row-wise split
tables, the tables placed on it whole, and their optimizer state) into its own file of the
checkpoint directory, so no rank ever holds every table at a save. Layout of one part file,
``tables.rank-<r>-of-<N>.pt`` (``part_file_name``), a ``torch.save`` of::

    {"format": 1, "rank": r, "world_size": N,
     "pieces": [[kind, name, key, whole_size, [[offsets, tensor], ...]], ...]}

* ``kind``: ``"model"`` (a table's weights; ``name`` its parameter name, ``key`` ``""``) or
  ``"sparse"`` (its fused optimizer's state; ``name`` the parameter, ``key`` the state's
  name, e.g. ``momentum1``);
* ``whole_size``: the whole tensor's size (a list of ints);
* ``offsets``: where this rank's block starts in each dimension, or None for a tensor that
  every rank holds whole and equal (written by every rank; any copy is the value).

The checkpoint's ``model.pt`` then names its parts (``"table_parts": [file, ...]``, rank
order) and holds the rest of the state; ``assemble`` builds the whole tables from the parts,
so a checkpoint written by N ranks reads as one process's (and restores into any number of
ranks, or exports). A tensor whose blocks do not add up to its whole size (a part missing)
is an error, never zeros.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

PART_FORMAT = 1
PART_PREFIX = "tables.rank-"

Pieces = dict[tuple[str, str, str], tuple[tuple[int, ...], list]]


def part_file_name(rank: int, world_size: int) -> str:
    """The part file of ``rank`` among ``world_size`` ranks."""
    return f"{PART_PREFIX}{rank}-of-{world_size}.pt"


def part_document(pieces: Pieces, rank: int, world_size: int) -> dict[str, Any]:
    """A rank's pieces as the part file's document (module docstring).

    Args:
        pieces: ``(kind, name, key) -> (whole size, [(offsets or None, CPU tensor)])``.
        rank: the writing rank.
        world_size: the number of ranks.
    """
    return {"format": PART_FORMAT, "rank": int(rank), "world_size": int(world_size),
            "pieces": [[kind, name, key, [int(x) for x in size],
                        [[None if off is None else [int(o) for o in off], t]
                         for off, t in parts]]
                       for (kind, name, key), (size, parts) in sorted(pieces.items())]}


def write_part(path: str, document: Mapping[str, Any]) -> None:
    """Writes a part document to ``path`` and fsyncs it."""
    with open(path, "wb") as f:
        torch.save(dict(document), f)
        f.flush()
        os.fsync(f.fileno())


def read_part(path: str, map_location: str = "cpu") -> dict[str, Any]:
    """Reads a part file.

    Raises:
        ValueError: it is not a part file of a known format.
    """
    doc = torch.load(path, map_location=map_location, weights_only=True)
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
