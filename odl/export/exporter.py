r"""Exports a checkpoint as a self-contained serving base (``odl-export``).

On-disk layout of one export (``<export_dir>/<unix-seconds>/``; names in
``odl.export.export_layout``)::

    <export_dir>/
      <unix-seconds>/                 one export; the newest directory with DONE is served
        dense_model.pt                TorchScript (torch.jit.save) of the model's dense part:
                                      the training code itself (odl.export.dense_export)
        serving_model.json            what the export holds and how to feed dense_model.pt
                                      (below)
        DENSE_UPDATE_VARIABLES        JSON {"<dense var name>": {"id": int, "shape": [..]}}
        embed_name_to_ids.txt         "<table>\t<id>\t<num_rows>\t<dim>" per line (dim as
                                      published: wide_output_dim for wide tables)
        kafka.txt                     JSON {"storage": "kafka", "server": str, "topic": str,
                                            "consumer": {"offset": int}}: the delta topic and
                                      the offset from which replay continues this base
        pipeline.config               the effective pipeline config, secrets redacted,
                                      vocab_file entries written as vocab_list
        assets/<name>                 copies of --asset_files
        assets/fg.json                the features in fg.json form (odl.export.fg_json),
                                      unless --asset_files gives an fg.json
        embeddings/                   (here unless --oss_path was given)
          MANIFEST.json               {"format": 1, "tables": {"<table>": {
                                          "id": int, "rows": int, "dim": int,
                                          "dtype": "float32", "pooling": "sum"|"mean",
                                          "parts": [{"file": "part-00000.npy",
                                                     "start_id": 0, "rows": int,
                                                     "bytes": int, "sha256": hex}]}}}
          <table>/part-00000.npy      float32 [rows, dim] (numpy .npy); row i of the part is
                                      the vector of id start_id + i; only the columns the
                                      model reads (wide tables: wide_output_dim). One part
                                      per block of the checkpoint: the whole table, or each
                                      rank's rows of a table split by rows (part-00001, ...)
          <table>/ids-00000.npy       dynamic tables only: int64 [n] raw ids, id i's vector
                                      is row i of part-00000.npy (n live rows of the block;
                                      start_id counts the live rows of the parts before;
                                      the table entry adds "keys": "raw_id", "live": total,
                                      and the part "ids_file", "ids_sha256"; "rows" is the
                                      capacity; a growing table's "rows" are its rows in
                                      the checkpoint and "max_rows" the most it may reach)
        MANIFEST.json                 {"format": 1, "files": {relpath: {"bytes", "sha256"}}}
                                      over every file above except DONE
        DONE                          completion marker, written last

With ``--oss_path P`` the ``embeddings/`` tree is written to ``P/<unix-seconds>/embeddings/``
instead (a local path or ``oss://bucket/prefix``) and ``serving_model.json``'s
``embeddings_dir`` holds that absolute path; it is complete (its ``MANIFEST.json`` written
last) before the export's DONE is.

A local export is built in ``<export_dir>/.tmp-<unix-seconds>-<pid>/`` and renamed into place
after DONE (``odl.storage.atomic_directory``), so a reader never sees a partial export
under a numeric name. An ``oss://`` export_dir is built the same way in its local mirror
(``odl.storage.file_store.cache_dir_for``) and then uploaded with ``MANIFEST.json`` and
``DONE`` last: readers take only exports whose DONE object exists. The checkpoint may be on
OSS too (``odl.checkpoint.checkpoint_manager``), and so may ``--asset_files``.

``serving_model.json``::

    {"format": "odl.export/1", "model_class": str, "global_step": int, "generation": str,
     "checkpoint": abs path, "created": unix s, "dense_model": "dense_model.pt",
     "embeddings_dir": "embeddings" | abs path,
     "pooled_inputs": [{"name": str, "lookups": [[feature, table], ...], "dim": int,
                        "dims": [int, ...]}, ...],
     "outputs": [str, ...],
     "output_kinds": ["probability" | "value" | "class_probability", ...],   (per output:
                     sigmoid(logit), the logit of a regression output, or a num_class
                     model's class probability, the softmax over its outputs; a ZILN_LOSS
                     model's two: the probability of a positive value, the expected value)
     "dense_features": [str, ...], "sparse_features": [str, ...],
     "tables": {"<table>": {"rows": int, "dim": int, "pooling": "sum"|"mean",
                            "dynamic": bool}},
     "deep_dim": int, "wide_output_dim": int,
     "deep_lookups": [[feature, table], ...], "wide_lookups": [[feature, table], ...]}

``dense_model.pt``'s ``forward`` takes, all float32 for ``B`` samples, one tensor per entry of
``pooled_inputs`` in that order - ``[B, sum(dims)]``: per lookup, the feature's ids pooled in
the table (sum or mean as the table says), the table's first ``dims[i]`` columns (``dim``
is their common value, 0 when they differ) - then
the raw dense features ``[B, len(dense_features)]`` (``FeatureBuilder.dense_feature_names``
order); it returns the logits, ``[B]`` for one output (``[B, len(outputs)]`` for several);
the probability is ``sigmoid(logit)``. For DeepFM the inputs are ``deep [B, num_deep * dim]``,
``wide [B, num_wide * wide_output_dim]`` and ``dense``. Its parameters keep the trainer's names
(``dense.dnn.0.weight``, ``dense.wide_bias``, ...), the keys of ``DENSE_UPDATE_VARIABLES``, so
replayed dense variables are copied in by name. ``deep_dim`` ... ``wide_lookups`` repeat the
model's embedding layout (deep and wide lookups) for readers that know DeepFM.

A dynamic table (``odl.models.dynamic``) is exported as its live rows only, keyed by
raw id (rows below the table's ``base_threshold`` are left out); serving rebuilds its own id
index from them, so nothing depends on the trainer's row layout.

``kafka.txt``'s offset comes from the checkpoint's ``positions.json`` key
``"delta_topic_offset"`` (the publisher records there the delta-topic offset after the last
version published at or before the checkpoint's step); 0 when absent. The delta topic's
server and topic come from the CLI flags (``--delta_server`` / ``--delta_topic``) when given,
else ``positions.json`` keys ``"delta_server"`` / ``"delta_topic"``, else
``train_config.incr_save_config.kafka``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from odl.checkpoint.checkpoint_manager import read_checkpoint, resolve_checkpoint_path
from odl.checkpoint.file_digest import sha256_file
from odl.checkpoint.table_parts import TableBlocks
from odl.config.config_redaction import config_to_text
from odl.config.feature_settings import with_vocab_files_inlined
from odl.config.loss_settings import num_classes, regression_outputs
from odl.config.optimizer_support import dense_ema_used
from odl.export.dense_export import script_dense
from odl.export.embedding_files import write_embeddings
from odl.export.export_layout import (
    ASSETS_DIR,
    CONFIG_FILE,
    DENSE_MODEL_FILE,
    DONE_FILE,
    EMBEDDINGS_DIR,
    EXPORT_FORMAT,
    KAFKA_FILE,
    MANIFEST_FILE,
    SERVING_MODEL_FILE,
    temporary_export_name,
)
from odl.export.fg_json import FG_JSON_NAME, fg_json_of
from odl.features.feature_builder import FeatureBuilder
from odl.models.ctr_model import CtrModel
from odl.models.dynamic.growth import saved_capacities, sized_specs
from odl.models.dynamic.model_tables import DynamicTables
from odl.models.embedding_tables import WIDE_SUFFIX
from odl.models.model_registry import build_model
from odl.protos import pipeline_pb2
from odl.storage import file_store
from odl.storage.atomic_directory import (
    atomic_directory,
    write_durable,
    write_json_durable,
)
from odl.storage.oss_credentials import OssCredentialsError, oss_credentials
from odl.storage.oss_store import StorageError
from odl.storage.storage_path import (
    UnsupportedPathError,
    basename,
    check_supported,
    dirname,
    is_remote,
    join,
)
from odl.train.dense_ema import N_AVERAGED
from publisher.id_maps import (
    DENSE_UPDATE_VARIABLES,
    EMBED_NAME_TO_IDS,
    IdMaps,
    build_id_maps,
    read_id_maps,
    write_id_maps,
)

logger = logging.getLogger(__name__)

EBC_PREFIX = "ebc.embedding_bags."
DENSE_PREFIX = "dense."
DELTA_OFFSET_KEY = "delta_topic_offset"


class ExportError(RuntimeError):
    """The export could not be made (bad input or an unsupported destination)."""


@dataclass
class ExportResult:
    """What ``export_checkpoint`` wrote.

    Attributes:
        path: the export directory (``<export_dir>/<unix-seconds>``).
        embeddings_dir: where the embedding shards are.
        global_step: the checkpoint's step.
        delta_offset: the replay start offset written to ``kafka.txt``.
    """

    path: str
    embeddings_dir: str
    global_step: int
    delta_offset: int


# ----------------------------------------------------------------------------- helpers


def _get_message_field(msg: object, *names: str) -> Optional[object]:
    """Follows ``names`` through set message fields; None when a field is absent or unset."""
    cur = msg
    for name in names:
        desc = getattr(cur, "DESCRIPTOR", None)
        if desc is None or name not in desc.fields_by_name:
            return None
        fd = desc.fields_by_name[name]
        if fd.message_type is not None and not fd.is_repeated:
            if not cur.HasField(name):  # type: ignore[attr-defined]
                return None
        cur = getattr(cur, name)
    return cur


def _delta_topic_from_config(config: pipeline_pb2.EasyRecConfig) -> tuple[str, str]:
    """``(server, topic)`` of ``train_config.incr_save_config.kafka`` when present, else empty."""
    kafka = _get_message_field(config, "train_config", "incr_save_config", "kafka")
    if kafka is None:
        return "", ""
    return str(getattr(kafka, "server", "")), str(getattr(kafka, "topic", ""))


def _find_id_maps(dirs: Sequence[str]) -> Optional[tuple[str, IdMaps]]:
    """``(dir, maps)`` of the first of ``dirs`` holding both id-map files (the publisher's)."""
    for d in dirs:
        if d and file_store.is_file(join(d, DENSE_UPDATE_VARIABLES)) and file_store.is_file(
                join(d, EMBED_NAME_TO_IDS)):
            try:
                return d, read_id_maps(d)
            except (OSError, ValueError) as e:
                raise ExportError(f"id maps in {d} are malformed: {e}") from e
    return None


def _check_id_maps(maps: IdMaps, dense_shapes: Mapping[str, Sequence[int]],
                   table_shapes: Mapping[str, tuple[int, int]]) -> None:
    """Raises ``ExportError`` unless ``maps`` names exactly these variables and tables."""
    if set(maps.dense) != set(dense_shapes):
        raise ExportError(
            f"{DENSE_UPDATE_VARIABLES} names {sorted(maps.dense)}, the checkpoint's dense "
            f"variables are {sorted(dense_shapes)}")
    for name, shape in dense_shapes.items():
        if tuple(maps.dense[name].shape) != tuple(shape):
            raise ExportError(f"{DENSE_UPDATE_VARIABLES}: {name} has shape "
                              f"{list(maps.dense[name].shape)}, the checkpoint {list(shape)}")
    if set(maps.tables) != set(table_shapes):
        raise ExportError(f"{EMBED_NAME_TO_IDS} names {sorted(maps.tables)}, the checkpoint's "
                          f"tables are {sorted(table_shapes)}")
    for name, (rows, dim) in table_shapes.items():
        t = maps.tables[name]
        if (t.num_rows, t.dim) != (rows, dim):
            raise ExportError(f"{EMBED_NAME_TO_IDS}: table {name} is {t.num_rows}x{t.dim}, "
                              f"the checkpoint {rows}x{dim}")


def _dense_variable_shapes(model: CtrModel) -> dict[str, tuple[int, ...]]:
    """Published dense variables: floating ``dense.*`` parameters and buffers -> shape.

    Same names as ``TrainModule.dense_parameters()``; integer buffers (BatchNorm's
    ``num_batches_tracked``) are not published (the publisher's rule).

    Args:
        model: the model.

    Returns:
        Name -> shape.
    """
    out = {}
    named = list(model.dense.named_parameters()) + list(model.dense.named_buffers())
    for k, v in named:
        if v.is_floating_point():
            out[f"{DENSE_PREFIX}{k}"] = tuple(int(d) for d in v.shape)
    return out


def _used_columns(model: CtrModel) -> dict[str, int]:
    """Table -> columns the dense part reads (the widest pooled group looking it up)."""
    used: dict[str, int] = {}
    for group in model.pooled_layout:
        for (_f, t), dim in zip(group.lookups, group.dims, strict=True):
            used[t] = max(used.get(t, 0), dim)
    return used


def _new_export_name(export_dir: str, now: float) -> str:
    try:
        taken = set(file_store.list_dir(export_dir)[0])
    except StorageError as e:
        raise ExportError(f"cannot list {export_dir}: {e}") from e
    taken |= set(file_store.list_dir(file_store.cache_dir_for(export_dir))[0])
    ts = int(now)
    while str(ts) in taken:
        ts += 1
    return str(ts)


def _signature(config: pipeline_pb2.EasyRecConfig, model: CtrModel, fb: FeatureBuilder,
               global_step: int, generation: str,
               checkpoint: str, now: float, embeddings_ref: str,
               table_shapes: Mapping[str, tuple[int, int]],
               table_pooling: Mapping[str, str], dynamic: Collection[str]) -> dict:
    """The ``serving_model.json`` document (module docstring)."""
    layout = model.layout
    return {
        "format": EXPORT_FORMAT,
        "model_class": type(model).__name__,
        "global_step": global_step,
        "generation": generation,
        "checkpoint": checkpoint,
        "created": now,
        "dense_model": DENSE_MODEL_FILE,
        "embeddings_dir": embeddings_ref,
        "pooled_inputs": [{"name": g.name, "lookups": [[f, t] for f, t in g.lookups],
                           "dim": g.dim, "dims": list(g.dims)} for g in model.pooled_layout],
        "outputs": list(model.output_names),
        "output_kinds": (["class_probability"] * num_classes(config)
                         if num_classes(config) > 1 else
                         ["value" if r else "probability" for r in regression_outputs(config)]),
        "dense_features": fb.dense_feature_names,
        "sparse_features": fb.sparse_feature_names,
        "tables": {n: {"rows": r, "dim": d, "pooling": table_pooling[n],
                       "dynamic": n in dynamic}
                   for n, (r, d) in table_shapes.items()},
        "deep_dim": layout.deep_dim,
        "wide_output_dim": layout.wide_output_dim,
        "deep_lookups": [[f, t] for f, t in layout.deep_keys],
        "wide_lookups": [[f, t] for f, t in layout.wide_keys],
    }


# ----------------------------------------------------------------------------- export


def _served_dense_ema(config: pipeline_pb2.EasyRecConfig, state: dict) -> dict:
    """The checkpoint's dense EMA where the config serves it, else ``{}``.

    Names without ``dense.``; served per ``export_config.use_dense_ema``
    (``odl.train.dense_ema``); nothing averaged yet: ``{}`` (the parameters are served).
    """
    averages = state.get("dense_ema") if dense_ema_used(config, "export") else None
    if not averages or int(averages.get(N_AVERAGED, 0)) == 0:
        return {}  # nothing averaged yet: the parameters are served
    return {k[len(DENSE_PREFIX):]: v for k, v in averages.items() if k.startswith(DENSE_PREFIX)}


def export_checkpoint(
    config: pipeline_pb2.EasyRecConfig,
    checkpoint_path: str,
    export_dir: str,
    oss_path: str = "",
    asset_files: Sequence[str] = (),
    delta_server: str = "",
    delta_topic: str = "",
    now: Optional[float] = None,
    warn_without_topic: bool = True,
) -> ExportResult:
    """Writes one export of a checkpoint (layout: module docstring).

    Args:
        config: the pipeline config (its model must match the checkpoint).
        checkpoint_path: a ``model.ckpt-N`` directory, or a model_dir (its newest checkpoint),
            local or ``oss://``.
        export_dir: parent directory of the exports (local or ``oss://``).
        oss_path: where to write the embedding shards instead of inside the export (local
            path or ``oss://``).
        asset_files: files copied into ``assets/`` (local or ``oss://``).
        delta_server: delta topic bootstrap servers; overrides the checkpoint's and the
            config's.
        delta_topic: delta topic; likewise.
        now: the export time (unix seconds; default: now); names the directory.
        warn_without_topic: warn when no delta topic is known (off for a file stream's day
            bases, whose deltas serving reads from files).

    Returns:
        What was written.

    Raises:
        ExportError: unsupported destination, missing asset, or id maps that disagree with
            the checkpoint.
        odl.checkpoint.checkpoint_manager.CheckpointError: no usable checkpoint.
        odl.config.config_error.ConfigError: the config does not describe a model.
    """
    try:
        for path in (export_dir, oss_path, checkpoint_path, *asset_files):
            check_supported(path)
            if is_remote(path):
                oss_credentials()
        for a in asset_files:
            if not file_store.is_file(a):
                raise ExportError(f"asset file not found: {a}")
    except (UnsupportedPathError, OssCredentialsError) as e:
        raise ExportError(str(e)) from e
    t0 = time.monotonic()
    now = time.time() if now is None else now
    ckpt_dir = resolve_checkpoint_path(checkpoint_path)
    # mapped, not read: the tables are written block by block (a rank's part, or a whole
    # table of a one-process checkpoint), never all at once
    ckpt = read_checkpoint(ckpt_dir, whole_tables=False)
    state = ckpt.state["model"]

    fb = FeatureBuilder(config)
    model = build_model(config, fb)
    dense_state = {k[len(DENSE_PREFIX):]: v for k, v in state.items()
                   if k.startswith(DENSE_PREFIX)}
    dense_state.update(_served_dense_ema(config, ckpt.state))
    try:
        model.dense.load_state_dict(dense_state, strict=True)
    except RuntimeError as e:
        raise ExportError(f"checkpoint {ckpt_dir} does not match the config's model: {e}") from e
    used = _used_columns(model)
    pooling = {spec.name: spec.pooling for spec in fb.table_specs}
    live, on_disk = _live_dynamic_rows(fb, ckpt.state, ckpt_dir)
    try:
        blocks = TableBlocks(ckpt.state)
    except (OSError, ValueError) as e:
        raise ExportError(f"checkpoint {ckpt_dir}: its table parts are unreadable: {e}") from e
    table_pooling: dict[str, str] = {}
    table_shapes: dict[str, tuple[int, int]] = {}
    block_rows: dict[str, int] = {}  # rows of the checkpoint's table
    dynamic_rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # table -> live rows, ids
    most_rows = {s.name: s.dynamic.most_ids for s in fb.table_specs if s.dynamic is not None}
    for cfg in model.layout.configs:
        key = f"{EBC_PREFIX}{cfg.name}.weight"
        if key not in blocks:
            raise ExportError(f"checkpoint {ckpt_dir} has no table {cfg.name} ({key})")
        rows, stored = blocks.size(key)
        block_rows[cfg.name] = int(rows)
        base = cfg.name[: -len(WIDE_SUFFIX)] if cfg.name.endswith(WIDE_SUFFIX) else cfg.name
        # a growing dynamic table is exported at the most rows it may reach (its id maps')
        rows = max(int(rows), most_rows.get(base, 0))
        table_shapes[cfg.name] = (int(rows), int(min(used.get(cfg.name, stored), stored)))
        if base in live:
            dynamic_rows[cfg.name] = live[base]
        table_pooling[cfg.name] = pooling.get(base, "sum")

    def parts_of(name: str) -> Iterator[tuple[int, np.ndarray, Optional[np.ndarray]]]:
        """``(start, values, raw ids or None)`` of a table's parts, one block at a time."""
        cols = table_shapes[name][1]
        try:
            table_blocks = blocks.blocks(f"{EBC_PREFIX}{name}.weight")
        except ValueError as e:
            raise ExportError(f"checkpoint {ckpt_dir}: {e}") from e
        if name not in dynamic_rows:
            for start, t in table_blocks:
                yield start, t[:, :cols].to(torch.float32).numpy(), None
            return
        live_rows, ids = dynamic_rows[name]
        at = 0
        for start, t in table_blocks:  # the live rows of each block, with their raw ids
            inside = (live_rows >= start) & (live_rows < start + t.shape[0])
            last = start + t.shape[0] >= block_rows[name]
            if inside.any() or (at == 0 and last):  # an empty table: one empty part
                picked = torch.from_numpy(live_rows[inside] - start)
                yield at, t[picked][:, :cols].to(torch.float32).numpy(), ids[inside]
                at += int(inside.sum())
        base = name[: -len(WIDE_SUFFIX)] if name.endswith(WIDE_SUFFIX) else name
        disk = on_disk.get(base)
        if disk is not None:  # the rows on the disk tier: one more part
            first = int(disk["columns"][name])
            yield at, np.asarray(disk["values"])[:, first:first + cols], np.asarray(disk["ids"])

    dense_shapes = _dense_variable_shapes(model)

    # Id maps: the publisher's (checkpoint dir or model_dir) when present, else the same
    # assignment the publisher makes (sorted names).
    model_dir = dirname(ckpt_dir)
    found = _find_id_maps([ckpt_dir, model_dir, config.model_dir])
    if found:
        _check_id_maps(found[1], dense_shapes, table_shapes)
        id_src: Optional[str] = found[0]
        id_maps = found[1]
        logger.info("using the publisher's id maps from %s", id_src)
    else:
        id_src = None
        id_maps = build_id_maps(dense_shapes, table_shapes)

    source = ckpt.source or {}
    delta_offset = int(source.get(DELTA_OFFSET_KEY, 0) or 0)
    cfg_server, cfg_topic = _delta_topic_from_config(config)
    server = str(delta_server or source.get("delta_server") or cfg_server)
    topic = str(delta_topic or source.get("delta_topic") or cfg_topic)
    if not topic and warn_without_topic:
        logger.warning("no delta topic known (checkpoint, config or --delta_topic): "
                       "kafka.txt names none and serving will not replay")

    # a remote export_dir is built in its local mirror, then uploaded
    build_dir = file_store.cache_dir_for(export_dir)
    os.makedirs(build_dir, exist_ok=True)
    name = _new_export_name(export_dir, now)
    final = os.path.join(build_dir, name)
    tmp = os.path.join(build_dir, temporary_export_name(name, os.getpid()))
    emb_staging = os.path.join(build_dir, f".embeddings-{name}-{os.getpid()}")
    with atomic_directory(final, tmp):
        if oss_path and is_remote(oss_path):
            emb_ref = join(oss_path, name, EMBEDDINGS_DIR)
            shutil.rmtree(emb_staging, ignore_errors=True)
            write_embeddings(emb_staging, table_shapes, id_maps, table_pooling, parts_of,
                              block_rows)
            try:
                file_store.remove_tree(emb_ref)
                file_store.upload_tree(emb_staging, emb_ref, last=(MANIFEST_FILE,))
            except StorageError as e:
                raise StorageError(f"uploading embeddings to {emb_ref} failed: {e}",
                                   e.transient) from e
            finally:
                shutil.rmtree(emb_staging, ignore_errors=True)
        elif oss_path:
            emb_ref = os.path.abspath(os.path.join(oss_path, name, EMBEDDINGS_DIR))
            if os.path.exists(emb_ref):
                shutil.rmtree(emb_ref)
            write_embeddings(emb_ref, table_shapes, id_maps, table_pooling, parts_of,
                              block_rows)
        else:
            emb_ref = EMBEDDINGS_DIR
            write_embeddings(os.path.join(tmp, EMBEDDINGS_DIR), table_shapes, id_maps,
                              table_pooling, parts_of, block_rows)
        torch.jit.save(script_dense(model), os.path.join(tmp, DENSE_MODEL_FILE))
        ckpt_ref = ckpt_dir if is_remote(ckpt_dir) else os.path.abspath(ckpt_dir)
        write_json_durable(os.path.join(tmp, SERVING_MODEL_FILE), _signature(
            config, model, fb, ckpt.global_step, ckpt.manifest.get("generation", ""),
            ckpt_ref, now, emb_ref, table_shapes, table_pooling, set(dynamic_rows)))
        if id_src is not None:
            for fname in (DENSE_UPDATE_VARIABLES, EMBED_NAME_TO_IDS):
                write_durable(os.path.join(tmp, fname),
                              file_store.read_bytes(join(id_src, fname)))
        else:
            write_id_maps(tmp, dense_shapes, table_shapes)
        write_json_durable(os.path.join(tmp, KAFKA_FILE), {
            "storage": "kafka", "server": server, "topic": topic,
            "consumer": {"offset": delta_offset},
        })
        write_durable(os.path.join(tmp, CONFIG_FILE),
                      config_to_text(with_vocab_files_inlined(config)).encode())
        os.makedirs(os.path.join(tmp, ASSETS_DIR))
        for a in asset_files:
            write_durable(os.path.join(tmp, ASSETS_DIR, basename(a)), file_store.read_bytes(a))
        if FG_JSON_NAME not in {basename(a) for a in asset_files}:  # the given one wins
            write_json_durable(os.path.join(tmp, ASSETS_DIR, FG_JSON_NAME), fg_json_of(config))
        files = {}
        for root, _dirs, names in os.walk(tmp):
            for n in sorted(names):
                fp = os.path.join(root, n)
                rel = os.path.relpath(fp, tmp)
                files[rel] = {"bytes": os.path.getsize(fp), "sha256": sha256_file(fp)}
        write_json_durable(os.path.join(tmp, MANIFEST_FILE), {"format": 1, "files": files})
        write_durable(os.path.join(tmp, DONE_FILE), b"")
    path = final
    if is_remote(export_dir):
        path = join(export_dir, name)
        try:
            file_store.upload_tree(final, path, last=(MANIFEST_FILE, DONE_FILE))
        except StorageError as e:
            raise StorageError(f"uploading the export to {path} failed: {e} (nothing "
                               "committed: no DONE object)", e.transient) from e
        finally:
            shutil.rmtree(final, ignore_errors=True)  # the local build copy
    emb_dir = emb_ref if oss_path else join(path, EMBEDDINGS_DIR)
    logger.info("exported %s (step %d, %d tables, delta replay from offset %d) in %.2fs",
                path, ckpt.global_step, len(table_shapes), delta_offset, time.monotonic() - t0)
    return ExportResult(path, emb_dir, ckpt.global_step, delta_offset)


def _exported_disk_rows(disk: Mapping[str, Any], spec: Any) -> dict[str, Any]:
    """A table's rows on the disk tier that ``odl-export`` writes (``base_threshold``)."""
    if spec.base_threshold is None:
        return dict(disk)
    counters = np.asarray(disk["counters"])
    show, click = counters[:, 3], counters[:, 4]
    keep = spec.click_coeff * click + spec.nonclk_coeff * (show - click) >= spec.base_threshold
    return {**disk, "ids": np.asarray(disk["ids"])[keep],
            "values": np.asarray(disk["values"])[keep]}


def _live_dynamic_rows(fb: FeatureBuilder, state: Mapping, ckpt_dir: str
                       ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, Any]]:
    """Dynamic table -> ``(rows, raw ids)`` of its exported rows (live, >= base_threshold).

    Also dynamic table -> its rows on the disk tier (``DiskRows.state_dict``; tables with
    rows there only), exported whole.
    """
    specs = {s.name: s.dynamic for s in fb.table_specs if s.dynamic is not None}
    if not specs:
        return {}, {}
    saved = state.get("dynamic_tables")
    if saved is None:
        raise ExportError(f"checkpoint {ckpt_dir} has no dynamic-table state but the config "
                          f"has dynamic tables {sorted(specs)}")
    specs = sized_specs(specs, saved_capacities(saved))  # growing tables as they grew
    tables = DynamicTables(specs, {n: () for n in specs},
                           partitions=int(saved.get("partitions", 1)))
    on_disk = {name: _exported_disk_rows(t["tier"]["disk"], specs[name])
               for name, t in (saved.get("tables") or {}).items()
               if isinstance(t, Mapping) and t.get("tier") and len(t["tier"]["disk"]["ids"])}
    if on_disk:  # read here, not by the tables (they have no disk tier)
        saved = {**saved, "tables": {name: {**t, "tier": None} if name in on_disk else t
                                     for name, t in saved["tables"].items()}}
    tables.load_state_dict(saved)
    out = {}
    for name, table in tables.tables.items():
        rows = table.live_rows()
        rows = rows[table.exportable(rows)]
        out[name] = (rows, table.raw_ids(rows))
    return out, on_disk
