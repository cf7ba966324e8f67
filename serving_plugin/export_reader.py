"""Finds, reads and verifies an export directory for serving.

Layout: ``odl.export.exporter`` (file names: ``odl.export.export_layout``). This module reads
files only and imports no trainer code.

``read_export(export_dir)`` takes the newest complete export (a ``<unix-seconds>/`` directory
with ``DONE``; or ``export_dir`` itself when it is one). An ``oss://`` export (and an
``oss://`` ``embeddings_dir``) is first downloaded into its local mirror
(``odl.storage.file_store.cache_dir_for``); only an export whose ``DONE`` object exists is
considered, and every shard is verified after the download. It then loads:

* ``serving_model.json`` -> the signature; its ``pooled_inputs`` -> the dense part's
  embedding inputs (``PooledGroup``s; an export without the key is read as DeepFM's two
  groups ``deep_lookups`` / ``wide_lookups``);
* ``pipeline.config`` -> the same ``FeatureBuilder`` as training (parsing, fnv1a64 hashing),
  so request records map to the same rows; the config's data and features are validated
  first (``odl.config.config_validation.validate_data_and_features``: the plan takes a
  validated config, and ``odl-export`` writes the config it was given), so an export whose
  features break a rule is refused by field;
* ``DENSE_UPDATE_VARIABLES`` / ``embed_name_to_ids.txt`` -> the id maps;
* ``embeddings/`` (or ``serving_model.json``'s ``embeddings_dir``) -> one float32
  ``[rows, dim]`` tensor per table; every shard must exist, have the manifest's shape, cover
  its table and (``verify``) match its sha256. The tables of one pooled input are
  consecutive row ranges of one storage tensor, so serving looks a group up in one call; a
  table belongs to the first pooled input that reads it. A dynamic table (``"keys":
  "raw_id"``) has ``rows`` = its capacity; its ``live`` exported rows fill the first rows of
  its range and its raw ids (``ids-*.npy``, verified like the values) build a
  ``RawIdIndex`` (``ExportContents.dynamic``); a growing one's ``max_rows`` (the most it may
  reach) is kept in ``ExportContents.max_rows``. With a disk tier
  (``serving_plugin.serving_tier``) a dynamic table that may hold more ids than the tier's
  ``ram_rows`` gets ``ram_rows`` rows plus staging rows instead, its parts fill RAM first
  and the rest go to disk (``ExportContents.tiers``); its part files are read through a
  memory map, a block at a time;
* ``dense_model.pt`` -> the TorchScript dense part (eval mode).

``read_kafka_txt`` reads ``kafka.txt``: the delta topic and the offset from which replay
continues the base.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from odl.checkpoint.file_digest import sha256_file
from odl.config.config_validation import validate_data_and_features
from odl.config.pipeline_config import load_pipeline_config
from odl.export.export_layout import (
    CONFIG_FILE,
    DONE_FILE,
    EXPORT_NAME,
    KAFKA_FILE,
    MANIFEST_FILE,
    SERVING_MODEL_FILE,
)
from odl.features.feature_builder import FeatureBuilder
from odl.features.raw_id_index import RawIdIndex
from odl.models.ctr_model import PooledGroup
from odl.protos import pipeline_pb2
from odl.storage import file_store
from odl.storage.oss_store import StorageError
from odl.storage.storage_path import is_remote, join
from publisher.id_maps import IdMaps, read_id_maps
from serving_plugin.serving_tier import (
    STAGING_START_ROWS,
    DiskTierSettings,
    TierDirectory,
    TierDirectoryError,
    TieredTable,
    tiered,
)

logger = logging.getLogger(__name__)


class ExportLoadError(RuntimeError):
    """An export directory is missing, incomplete or inconsistent."""


def find_latest_export(export_dir: str) -> str:
    """The export to serve: ``export_dir`` itself when it is one, else its newest child.

    Args:
        export_dir: an export (has ``DONE``) or a parent of ``<unix-seconds>`` exports, local
            or ``oss://`` (only exports whose ``DONE`` object exists are considered).

    Returns:
        The export directory (same kind of path as ``export_dir``).

    Raises:
        ExportLoadError: no complete export there, or OSS could not be read.
    """
    try:
        if file_store.is_file(join(export_dir, DONE_FILE)) and file_store.is_file(
                join(export_dir, SERVING_MODEL_FILE)):
            return export_dir
        dirs, files = file_store.list_dir(export_dir)
        if not dirs and not files:
            raise ExportLoadError(f"export dir {export_dir} does not exist")
        found = []
        for name in dirs:
            p = join(export_dir, name)
            if EXPORT_NAME.match(name) and file_store.is_file(join(p, DONE_FILE)):
                found.append((int(name), p))
    except StorageError as e:
        raise ExportLoadError(f"cannot list {export_dir}: {e}") from e
    if not found:
        raise ExportLoadError(f"no complete export (a <unix-seconds>/ dir with DONE) in "
                              f"{export_dir}")
    return max(found)[1]


@dataclass
class KafkaReplaySource:
    """The export's ``kafka.txt``.

    Attributes:
        server: bootstrap servers of the delta topic.
        topic: the delta topic ('' = nothing to replay).
        offset: offset from which replay continues the base.
    """

    server: str
    topic: str
    offset: int


def read_kafka_txt(export_path: str) -> KafkaReplaySource:
    """Reads ``kafka.txt`` (missing file: nothing to replay).

    Args:
        export_path: the export directory.

    Returns:
        The delta topic and replay start.
    """
    p = os.path.join(export_path, KAFKA_FILE)
    if not os.path.isfile(p):
        return KafkaReplaySource("", "", 0)
    with open(p, encoding="utf-8") as f:
        doc = json.load(f)
    return KafkaReplaySource(str(doc.get("server", "")), str(doc.get("topic", "")),
                             int(doc.get("consumer", {}).get("offset", 0)))


@dataclass
class ExportContents:
    """One export, read and verified.

    Attributes:
        path: the export directory on this machine (the local mirror of a remote one).
        origin: where the export was read from (``path``, or its ``oss://`` location).
        signature: the parsed ``serving_model.json``.
        config: the pipeline config.
        feature_builder: its feature builder (no event-time check: requests need none).
        id_maps: the dense-variable and table ids.
        tables: table name -> float32 ``[rows, dim]`` tensor.
        dense_module: the TorchScript dense part.
        pooled_inputs: the dense part's embedding inputs, in argument order.
        outputs: names of the dense part's outputs.
        dynamic: dynamic table name -> its raw id -> row index (rows of ``tables[name]``).
        max_rows: growing dynamic table -> the most rows it may reach (its manifest's
            ``max_rows``; ``serving_plugin.table_growth``).
        tiers: dynamic table on the disk tier -> its two tiers (not in ``dynamic`` or
            ``max_rows``; ``serving_plugin.serving_tier``).
        tier_dir: the disk tier's directory, owned while the export is served (None: no
            tier).
    """

    path: str
    origin: str
    signature: dict
    config: pipeline_pb2.EasyRecConfig
    feature_builder: FeatureBuilder
    id_maps: IdMaps
    tables: dict[str, torch.Tensor]
    dense_module: torch.jit.ScriptModule
    pooled_inputs: tuple[PooledGroup, ...]
    outputs: tuple[str, ...]
    dynamic: dict[str, RawIdIndex] = field(default_factory=dict)
    max_rows: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, TieredTable] = field(default_factory=dict)
    tier_dir: TierDirectory | None = None


def pooled_inputs_of(signature: dict) -> tuple[PooledGroup, ...]:
    """The pooled inputs a signature declares (see the module docstring).

    Args:
        signature: the parsed ``serving_model.json``.

    Returns:
        One group per dense-part embedding argument, in order.
    """
    if "pooled_inputs" in signature:
        groups = []
        for g in signature["pooled_inputs"]:
            lookups = tuple((str(f), str(t)) for f, t in g["lookups"])
            dims = [int(d) for d in g.get("dims", [g["dim"]] * len(lookups))]
            if len(dims) != len(lookups):
                raise ValueError(f"pooled input {g['name']!r}: {len(dims)} dims for "
                                 f"{len(lookups)} lookups")
            groups.append(PooledGroup.of(str(g["name"]), lookups, dims))
        return tuple(groups)
    return (
        PooledGroup("deep", tuple((str(f), str(t)) for f, t in signature["deep_lookups"]),
                    int(signature["deep_dim"])),
        PooledGroup("wide", tuple((str(f), str(t)) for f, t in signature["wide_lookups"]),
                    int(signature["wide_output_dim"])),
    )


def read_export(export_dir: str, verify: bool = True,
                disk_tier: DiskTierSettings | None = None) -> ExportContents:
    """Reads the newest complete export under ``export_dir`` (or ``export_dir`` itself).

    Args:
        export_dir: an export or a parent of exports.
        verify: check the embedding shards' sha256 against their manifest.
        disk_tier: serve large dynamic tables from RAM and disk (module docstring).

    Returns:
        The export's contents.

    Raises:
        ExportLoadError: missing, malformed or inconsistent files, or a config whose data or
            features break a validation rule.
    """
    origin = find_latest_export(export_dir)
    path = origin
    emb_dir = ""
    try:
        if is_remote(origin):
            t0 = time.monotonic()
            path = file_store.local_copy(origin)
            logger.info("downloaded export %s to %s in %.2fs", origin, path,
                        time.monotonic() - t0)
    except (StorageError, OSError) as e:
        raise ExportLoadError(f"cannot download export {origin}: {e}") from e
    try:
        with open(os.path.join(path, SERVING_MODEL_FILE), encoding="utf-8") as f:
            sig = json.load(f)
        config = load_pipeline_config(os.path.join(path, CONFIG_FILE))
        validate_data_and_features(config)  # the rules the feature plan relies on
        # requests need no event time and no sample weight (a column left unread)
        config.data_config.ClearField("sample_weight")
        fb = FeatureBuilder(config, check_event_time=False)
        id_maps = read_id_maps(path)
        groups = pooled_inputs_of(sig)
        labels = list(config.data_config.label_fields[:1]) or ["label"]
        outputs = tuple(str(o) for o in sig.get("outputs", labels))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportLoadError(f"cannot load export {path}: {e}") from e
    emb_dir = sig["embeddings_dir"]
    if is_remote(emb_dir):
        try:
            emb_dir = file_store.local_copy(emb_dir)
        except (StorageError, OSError) as e:
            raise ExportLoadError(f"cannot download embeddings {emb_dir}: {e}") from e
    elif not os.path.isabs(emb_dir):
        emb_dir = os.path.join(path, emb_dir)
    tier_dir = None
    if disk_tier is not None:
        try:
            tier_dir = TierDirectory(disk_tier.dir)
        except (TierDirectoryError, OSError) as e:
            raise ExportLoadError(str(e)) from e
    try:
        tables, dynamic, max_rows, tiers = _load_tables(emb_dir, verify, groups, disk_tier,
                                                        tier_dir)
        dense = torch.jit.load(os.path.join(path, sig["dense_model"]), map_location="cpu")
    except BaseException:
        if tier_dir is not None:
            tier_dir.close()
        raise
    dense.eval()
    return ExportContents(path, origin, sig, config, fb, id_maps, tables, dense, groups,
                          outputs, dynamic, max_rows, tiers, tier_dir)


def _load_tables(emb_dir: str, verify: bool, groups: tuple[PooledGroup, ...],
                 disk_tier: DiskTierSettings | None = None,
                 tier_dir: TierDirectory | None = None) -> tuple[
        dict[str, torch.Tensor], dict[str, RawIdIndex], dict[str, int],
        dict[str, TieredTable]]:
    """Loads the shards (module docstring).

    Returns:
        Table name -> float32 ``[rows, dim]`` tensor, dynamic table -> its id index,
        growing dynamic table -> the most rows it may reach, and dynamic table on the disk
        tier -> its tiers.
    """
    try:
        with open(os.path.join(emb_dir, MANIFEST_FILE), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ExportLoadError(f"cannot read the embeddings manifest in {emb_dir}: {e}") from e
    infos = manifest["tables"]
    # table -> (its pooled input, the columns that input reads of it): the tables one input
    # reads at one width share a storage (one embedding_bag per input and width)
    group_of: dict[str, tuple[int, int]] = {}
    for gi, g in enumerate(groups):
        for (_f, t), dim in zip(g.lookups, g.dims, strict=True):
            group_of.setdefault(t, (gi, dim))
    missing = set(group_of) - set(infos)
    if missing:
        raise ExportLoadError(f"embeddings manifest in {emb_dir} lacks tables {sorted(missing)}")
    for t, (gi, dim) in group_of.items():
        if int(infos[t]["dim"]) != dim:
            raise ExportLoadError(f"table {t} has dim {infos[t]['dim']}, its pooled input "
                                  f"{groups[gi].name!r} reads {dim}")
    # rows of each table's tensor: a tiered table's RAM rows and staging rows
    on_tier = {n for n, info in infos.items() if info.get("keys") == "raw_id" and tiered(
        disk_tier, int(info["rows"]), int(info.get("max_rows", 0)))}
    alloc = {n: (disk_tier.ram_rows + STAGING_START_ROWS if n in on_tier and disk_tier
                 else int(info["rows"])) for n, info in infos.items()}
    tables: dict[str, torch.Tensor] = {}
    for key in sorted(set(group_of.values()) | {(-1, -1)}):
        names = [n for n in infos if group_of.get(n, (-1, -1)) == key]
        if not names:
            continue
        dims = {int(infos[n]["dim"]) for n in names}
        if len(dims) != 1:  # only tables no input reads (key (-1, -1)) can differ
            raise ExportLoadError(f"tables {names} of one lookup group have dims {dims}")
        storage = torch.empty((sum(alloc[n] for n in names), dims.pop()), dtype=torch.float32)
        row = 0
        for n in names:
            rows = alloc[n]
            tables[n] = storage[row : row + rows]
            row += rows
    dynamic: dict[str, RawIdIndex] = {}
    tiers: dict[str, TieredTable] = {}
    max_rows = {name: int(info["max_rows"]) for name, info in infos.items()
                if info.get("keys") == "raw_id" and "max_rows" in info}
    for name, info in infos.items():
        rows, dim = int(info["rows"]), int(info["dim"])
        if info.get("dtype", "float32") != "float32":
            raise ExportLoadError(f"table {name}: dtype {info['dtype']} is not supported")
        w = tables[name]
        if name in on_tier:
            assert disk_tier is not None and tier_dir is not None
            most = max(rows, max_rows.pop(name, 0))
            tiers[name] = TieredTable(tier_dir.table_dir(name), dim, disk_tier, most)
            _load_tiered_parts(emb_dir, name, info, w, tiers[name], verify)
            continue
        if info.get("keys", "row") == "raw_id":
            dynamic[name] = RawIdIndex(rows)
            _load_dynamic_parts(emb_dir, name, info, w, dynamic[name], verify)
            continue
        covered = 0
        for part in info["parts"]:
            fp = os.path.join(emb_dir, name, part["file"])
            if not os.path.isfile(fp):
                raise ExportLoadError(f"table {name}: {fp} is missing")
            if verify and sha256_file(fp) != part["sha256"]:
                raise ExportLoadError(f"table {name}: {fp} does not match its sha256")
            arr = np.load(fp, allow_pickle=False)
            start, n = int(part["start_id"]), int(part["rows"])
            if arr.shape != (n, dim) or start < 0 or start + n > rows:
                raise ExportLoadError(f"table {name}: part {part['file']} has shape "
                                      f"{arr.shape}, manifest says {n}x{dim} at {start}")
            w[start : start + n] = torch.from_numpy(arr.astype(np.float32, copy=False))
            covered += n
        if covered != rows:
            raise ExportLoadError(f"table {name}: parts cover {covered} of {rows} rows")
    return tables, dynamic, max_rows, tiers


def _dynamic_parts(emb_dir: str, name: str, info: dict, dim: int,
                   verify: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A dynamic table's parts, verified: ``(values, raw ids)`` memory-mapped, one at a time."""
    for part in info["parts"]:
        fp = os.path.join(emb_dir, name, part["file"])
        ids_fp = os.path.join(emb_dir, name, str(part.get("ids_file", "")))
        for f, digest in ((fp, part["sha256"]), (ids_fp, part.get("ids_sha256"))):
            if not os.path.isfile(f):
                raise ExportLoadError(f"table {name}: {f} is missing")
            if verify and sha256_file(f) != digest:
                raise ExportLoadError(f"table {name}: {f} does not match its sha256")
        arr = np.load(fp, mmap_mode="r", allow_pickle=False)
        ids = np.load(ids_fp, allow_pickle=False)
        n = int(part["rows"])
        if (arr.shape != (n, dim) or ids.shape != (n,) or ids.dtype != np.int64
                or (n and int(ids.min()) < 0) or np.unique(ids).shape[0] != n):
            raise ExportLoadError(f"table {name}: part {part['file']} has values {arr.shape} "
                                  f"and ids {ids.shape} ({ids.dtype}), manifest says {n} "
                                  "unique non-negative ids")
        yield arr, ids


def _load_dynamic_parts(emb_dir: str, name: str, info: dict, w: torch.Tensor,
                        index: RawIdIndex, verify: bool) -> None:
    """Fills a dynamic table's first rows and its index from its parts (raw ids + values)."""
    w.zero_()
    live = int(info.get("live", 0))
    if live > w.shape[0]:
        raise ExportLoadError(f"table {name}: {live} live rows in a table of {w.shape[0]}")
    for arr, ids in _dynamic_parts(emb_dir, name, info, w.shape[1], verify):
        if ids.shape[0] > index.free or index.lookup(ids).max(initial=-1) >= 0:
            raise ExportLoadError(f"table {name}: parts hold more or repeated ids than fit")
        rows = index.insert(ids)
        w[torch.from_numpy(rows)] = torch.from_numpy(np.array(arr, dtype=np.float32))
    if index.live != live:
        raise ExportLoadError(f"table {name}: parts hold {index.live} ids, manifest says {live}")


# rows of a part copied at a time into a tiered table (bounds the load's extra memory)
_LOAD_BLOCK_ROWS = 1 << 20


def _load_tiered_parts(emb_dir: str, name: str, info: dict, w: torch.Tensor,
                       tier: TieredTable, verify: bool) -> None:
    """Fills a tiered table from its parts: RAM first, then disk (module docstring)."""
    w.zero_()
    live = int(info.get("live", 0))
    if live > tier.most_rows:
        raise ExportLoadError(f"table {name}: {live} live rows, the most it may hold "
                              f"{tier.most_rows}")
    for arr, ids in _dynamic_parts(emb_dir, name, info, w.shape[1], verify):
        if tier.holds(ids).any():
            raise ExportLoadError(f"table {name}: parts hold repeated ids")
        for at in range(0, ids.shape[0], _LOAD_BLOCK_ROWS):
            try:
                tier.load(w, ids[at : at + _LOAD_BLOCK_ROWS], arr[at : at + _LOAD_BLOCK_ROWS])
            except ValueError as e:
                raise ExportLoadError(f"table {name}: {e}") from e
    if tier.live != live:
        raise ExportLoadError(f"table {name}: parts hold {tier.live} ids, manifest says {live}")
