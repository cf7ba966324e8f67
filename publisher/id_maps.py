"""Id maps: the numeric ids that name dense variables and embedding tables on the wire.

Written by the trainer into ``model_dir`` at start (``write_id_maps``), copied into every
export, and read by serving, by the exporter and by the trainer's crash recovery
(``read_id_maps``). File layouts:

* ``DENSE_UPDATE_VARIABLES``: JSON ``{"<dense variable name>": {"id": int, "shape": [..]},
  ...}``, keys sorted, one-space indent; names are the checkpoint's parameter / buffer names
  (``dense.dnn.0.weight``). Only floating-point variables are listed and published.
* ``embed_name_to_ids.txt``: one ``<table name><TAB><id><TAB><num_rows><TAB><dim>`` line per
  embedding table, in id order; ``dim`` is the published width (``wide_output_dim`` for
  ``<table>_wide``).

Ids are assigned by sorted name, 0, 1, 2, ... separately for dense variables and tables
(``build_id_maps``), so the same model always gets the same ids. Each file is replaced
atomically (``odl.storage.atomic_directory.write_atomic``): a reader sees the old file or
the new one, never a part.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from odl.storage import file_store
from odl.storage.storage_path import join

DENSE_UPDATE_VARIABLES = "DENSE_UPDATE_VARIABLES"
EMBED_NAME_TO_IDS = "embed_name_to_ids.txt"


@dataclass(frozen=True)
class DenseVariableInfo:
    """A published dense variable.

    Attributes:
        id: its id on the wire.
        shape: its shape.
    """

    id: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TableInfo:
    """A published embedding table.

    Attributes:
        id: its id on the wire.
        num_rows: rows of the table.
        dim: published width (wide tables: wide_output_dim).
    """

    id: int
    num_rows: int
    dim: int


@dataclass
class IdMaps:
    """Name <-> id maps of dense variables and embedding tables.

    Attributes:
        dense: variable name -> info.
        tables: table name -> info.
    """

    dense: dict[str, DenseVariableInfo]
    tables: dict[str, TableInfo]

    def dense_names(self) -> dict[int, str]:
        """Variable id -> name."""
        return {v.id: k for k, v in self.dense.items()}

    def table_names(self) -> dict[int, str]:
        """Table id -> name."""
        return {v.id: k for k, v in self.tables.items()}


def build_id_maps(
    dense_shapes: Mapping[str, Sequence[int]],
    tables: Mapping[str, tuple[int, int]],
) -> IdMaps:
    """Assigns ids by sorted name.

    Args:
        dense_shapes: dense variable name -> shape.
        tables: table name -> ``(num_rows, published dim)``.

    Returns:
        The maps.
    """
    dense = {name: DenseVariableInfo(i, tuple(int(d) for d in dense_shapes[name]))
             for i, name in enumerate(sorted(dense_shapes))}
    tabs = {name: TableInfo(i, int(tables[name][0]), int(tables[name][1]))
            for i, name in enumerate(sorted(tables))}
    return IdMaps(dense, tabs)


def write_id_maps(
    model_dir: str,
    dense_shapes: Mapping[str, Sequence[int]],
    tables: Mapping[str, tuple[int, int]],
) -> IdMaps:
    """Assigns ids (``build_id_maps``) and writes both files into ``model_dir`` atomically.

    Args:
        model_dir: directory to write ``DENSE_UPDATE_VARIABLES`` and ``embed_name_to_ids.txt``
            (local or ``oss://``).
        dense_shapes: dense variable name -> shape.
        tables: table name -> ``(num_rows, published dim)``.

    Returns:
        The maps written.
    """
    maps = build_id_maps(dense_shapes, tables)
    doc = {name: {"id": info.id, "shape": list(info.shape)} for name, info in maps.dense.items()}
    file_store.write_bytes(join(model_dir, DENSE_UPDATE_VARIABLES),
                           (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
    lines = "".join(f"{name}\t{t.id}\t{t.num_rows}\t{t.dim}\n"
                    for name, t in sorted(maps.tables.items(), key=lambda kv: kv[1].id))
    file_store.write_bytes(join(model_dir, EMBED_NAME_TO_IDS), lines.encode())
    return maps


def read_id_maps(model_dir: str) -> IdMaps:
    """Reads the two id-map files of a model_dir or export dir.

    Args:
        model_dir: directory holding ``DENSE_UPDATE_VARIABLES`` and ``embed_name_to_ids.txt``.

    Returns:
        The maps.

    Raises:
        OSError: a file is missing.
        ValueError: a file is malformed.
    """
    doc = json.loads(file_store.read_text(join(model_dir, DENSE_UPDATE_VARIABLES)))
    if not isinstance(doc, dict):
        raise ValueError(f"{DENSE_UPDATE_VARIABLES}: expected a JSON object")
    dense = {}
    for name, info in doc.items():
        try:
            dense[name] = DenseVariableInfo(int(info["id"]), tuple(int(d) for d in info["shape"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{DENSE_UPDATE_VARIABLES}: bad entry {name!r}: {exc}") from None
    tables = {}
    path = join(model_dir, EMBED_NAME_TO_IDS)
    for lineno, line in enumerate(file_store.read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 4:
            raise ValueError(f"{path}:{lineno}: expected name<TAB>id<TAB>rows<TAB>dim")
        try:
            tables[parts[0]] = TableInfo(int(parts[1]), int(parts[2]), int(parts[3]))
        except ValueError:
            raise ValueError(f"{path}:{lineno}: bad number in {line!r}") from None
    return IdMaps(dense, tables)
