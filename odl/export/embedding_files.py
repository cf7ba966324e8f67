"""The embeddings directory of an export: each table's parts, raw ids and the manifest.

The layout is written in ``odl.export.exporter``'s module docstring: one ``.npy`` per part
of each table, a dynamic table's raw ids beside its parts, ``MANIFEST.json`` written last.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Optional

import numpy as np

from odl.checkpoint.file_digest import sha256_file
from odl.export.export_layout import IDS_FILE, MANIFEST_FILE, SHARD_FILE
from odl.storage.atomic_directory import write_json_durable
from publisher.id_maps import IdMaps

__all__ = ["write_embeddings"]


def _save_npy(fp: str, arr: np.ndarray) -> None:
    with open(fp, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())


def write_embeddings(
    root: str,
    shapes: Mapping[str, tuple[int, int]],
    ids: IdMaps,
    pooling: Mapping[str, str],
    parts_of: Callable[[str], Iterable[tuple[int, np.ndarray, Optional[np.ndarray]]]],
    rows_now: Mapping[str, int],
) -> None:
    """Writes ``root/<table>/part-<k>.npy`` per part of each table, ``MANIFEST.json`` last.

    Args:
        root: the embeddings directory.
        shapes: table -> ``(rows, exported columns)``.
        ids: the id maps.
        pooling: table -> its pooling.
        parts_of: table -> its parts ``(start id, values, raw ids or None)``, one at a time
            (a dynamic table's: its live rows with their raw ids; ``start`` counts them).
        rows_now: table -> its rows in the checkpoint: a growing dynamic table's ``rows``
            (``shapes`` has the most it may reach, written as its ``max_rows``).
    """
    os.makedirs(root, exist_ok=True)
    manifest: dict = {"format": 1, "tables": {}}
    for name, (rows, dim) in shapes.items():
        tdir = os.path.join(root, name)
        os.makedirs(tdir, exist_ok=True)
        info: dict = {"id": int(ids.tables[name].id), "rows": int(rows), "dim": int(dim),
                      "dtype": "float32", "pooling": pooling[name], "parts": []}
        live = None
        for index, (start, values, raw) in enumerate(parts_of(name)):
            part = SHARD_FILE.format(index=index)
            fp = os.path.join(tdir, part)
            _save_npy(fp, np.ascontiguousarray(values, dtype=np.float32))
            entry = {"file": part, "start_id": int(start), "rows": int(values.shape[0]),
                     "bytes": os.path.getsize(fp), "sha256": sha256_file(fp)}
            if raw is not None:
                ids_file = IDS_FILE.format(index=index)
                ids_fp = os.path.join(tdir, ids_file)
                _save_npy(ids_fp, np.asarray(raw, dtype=np.int64))
                entry.update(ids_file=ids_file, ids_sha256=sha256_file(ids_fp))
                live = (live or 0) + int(values.shape[0])
            info["parts"].append(entry)
        if live is not None:
            most = int(ids.tables[name].num_rows)
            # at least its live ids (a disk tier's rows are more than the table's)
            info.update(keys="raw_id", live=live,
                        rows=min(most, max(live, int(rows_now.get(name, most)))))
            if info["rows"] < most:  # a growing table: serving grows it up to max_rows
                info["max_rows"] = most
        manifest["tables"][name] = info
    write_json_durable(os.path.join(root, MANIFEST_FILE), manifest)
