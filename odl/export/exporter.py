r"""Exports a checkpoint as a self-contained serving base (``odl-export``).

On-disk layout of one export (``<export_dir>/<unix-seconds>/``)::

    <export_dir>/
      <unix-seconds>/                 one export; the newest directory with DONE is served
        dense_model.pt                TorchScript (torch.jit.save) of ``ServingDense``: the
                                      model without its embedding tables, see below
        serving_model.json            how to feed dense_model.pt (SERVING_MODEL_FILE, below)
        DENSE_UPDATE_VARIABLES        JSON {"<dense var name>": {"id": int, "shape": [..]}}
        embed_name_to_ids.txt         "<table>\t<id>\t<num_rows>\t<dim>" per line (dim as
                                      published: wide_output_dim for wide tables)
        kafka.txt                     JSON {"storage": "kafka", "server": str, "topic": str,
                                            "consumer": {"offset": int}}: the delta topic and
                                      the offset from which replay continues this base
        pipeline.config               the effective pipeline config, secrets redacted
        assets/<name>                 copies of --asset_files (e.g. fg.json)
        embeddings/                   (here unless --oss_path was given)
          MANIFEST.json               {"format": 1, "tables": {"<table>": {
                                          "id": int, "rows": int, "dim": int,
                                          "dtype": "float32", "pooling": "sum"|"mean",
                                          "parts": [{"file": "part-00000.npy",
                                                     "start_id": 0, "rows": int,
                                                     "bytes": int, "sha256": hex}]}}}
          <table>/part-00000.npy      float32 [rows, dim] (numpy .npy); row i of the part is
                                      the vector of id start_id + i
        MANIFEST.json                 {"format": 1, "files": {relpath: {"bytes", "sha256"}}}
                                      over every file above except DONE
        DONE                          completion marker, written last

With ``--oss_path P`` the ``embeddings/`` tree is written to ``P/<unix-seconds>/embeddings/``
instead (a local path for now; ``oss://`` is not implemented) and ``serving_model.json``'s
``embeddings_dir`` holds that absolute path.

The export is first written to ``<export_dir>/.tmp-<unix-seconds>-<pid>/`` and renamed into
place after DONE, so a reader never sees a partial export under a numeric name.

``dense_model.pt`` (``ServingDense``) inputs, all float32, ``B`` samples::

    deep  [B, num_deep * dim]            pooled deep embeddings, deep lookups in the order of
                                         serving_model.json "deep_lookups" (sum or mean
                                         pooling as the table says)
    wide  [B, num_wide * wide_output_dim] pooled wide embeddings (first wide_output_dim
                                         columns of each wide table), "wide_lookups" order
    dense [B, num_dense]                 raw dense features, FeatureBuilder.dense_feature_names
                                         order (serving_model.json "dense_features")

and it returns logits ``[B]``; the probability is ``sigmoid(logit)``. Its parameters keep the
trainer's names (``dense.dnn.0.weight``, ``dense.wide_bias``, ...), the keys of
``DENSE_UPDATE_VARIABLES``, so replayed dense variables are copied in by name.

``kafka.txt``'s offset comes from the checkpoint's ``positions.json`` key
``"delta_topic_offset"`` (the publisher records there the delta-topic offset after the last
version published at or before the checkpoint's step); 0 when absent. The delta topic's
server and topic come from the CLI flags (``--delta_server`` / ``--delta_topic``) when given,
else ``positions.json`` keys ``"delta_server"`` / ``"delta_topic"``, else
``train_config.incr_save_config.kafka``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from odl.checkpoint.checkpoint_manager import read_checkpoint, resolve_checkpoint_path
from odl.checkpoint.file_digest import sha256_file
from odl.config.pipeline_config import config_to_text
from odl.features.feature_builder import FeatureBuilder
from odl.models.deepfm import DeepFM, DeepFMDense
from odl.models.embedding_tables import WIDE_SUFFIX
from odl.models.model_factory import build_model
from odl.protos import pipeline_pb2
from publisher.delta_codec import (
    DENSE_UPDATE_VARIABLES,
    EMBED_NAME_TO_IDS,
    IdMaps,
    build_id_maps,
    read_id_maps,
    write_id_maps,
)

logger = logging.getLogger(__name__)

EXPORT_FORMAT = "odl.export/1"
DENSE_MODEL_FILE = "dense_model.pt"
SERVING_MODEL_FILE = "serving_model.json"
KAFKA_FILE = "kafka.txt"
CONFIG_FILE = "pipeline.config"
MANIFEST_FILE = "MANIFEST.json"
DONE_FILE = "DONE"
EMBEDDINGS_DIR = "embeddings"
ASSETS_DIR = "assets"
EBC_PREFIX = "ebc.embedding_bags."
DENSE_PREFIX = "dense."
DELTA_OFFSET_KEY = "delta_topic_offset"


class ExportError(RuntimeError):
    """The export could not be made (bad input or an unsupported destination)."""


class _DenseParams(nn.Module):
    """``DeepFMDense``'s parameters under the same names; absent parts are ``None``."""

    def __init__(self, src: DeepFMDense) -> None:
        super().__init__()
        self.dnn = src.dnn
        self.wide_bias = src.wide_bias
        self.wide_dense = src.wide_dense
        if src.has_final:
            self.final_dnn = src.final_dnn
            self.final_out = src.final_out
            self.deep_out = None
        else:
            self.final_dnn = None
            self.final_out = None
            self.deep_out = src.deep_out


class ServingDense(nn.Module):
    """DeepFM's computation after the embedding lookup (scriptable; see the module docstring).

    Args:
        dense: the trained dense part (copied).
        num_deep: number of deep lookups.
        dim: deep embedding dim.
        num_wide: number of wide lookups.
        wide_output_dim: used columns of each wide table.
        deep_dense_idx: columns of the dense input fed to the deep part.
        wide_dense_idx: columns of the dense input fed to the wide linear term.
    """

    __constants__ = ["num_deep", "dim", "num_wide", "wide_output_dim", "all_deep_dense",
                     "has_deep_dense"]

    def __init__(
        self,
        dense: DeepFMDense,
        num_deep: int,
        dim: int,
        num_wide: int,
        wide_output_dim: int,
        deep_dense_idx: Sequence[int],
        wide_dense_idx: Sequence[int],
        num_dense: int,
    ) -> None:
        super().__init__()
        self.dense = _DenseParams(copy.deepcopy(dense))
        self.num_deep = int(num_deep)
        self.dim = int(dim)
        self.num_wide = int(num_wide)
        self.wide_output_dim = int(wide_output_dim)
        self.has_deep_dense = len(deep_dense_idx) > 0
        self.all_deep_dense = list(deep_dense_idx) == list(range(num_dense))
        self.register_buffer("deep_dense_idx", torch.tensor(list(deep_dense_idx),
                                                             dtype=torch.long))
        self.register_buffer("wide_dense_idx", torch.tensor(list(wide_dense_idx),
                                                             dtype=torch.long))

    def forward(self, deep: torch.Tensor, wide: torch.Tensor,
                dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` (same operations, in the same order, as ``DeepFM.forward``)."""
        d = self.dense
        b = dense.shape[0]
        w = d.wide_bias.expand(b, self.wide_output_dim)
        if self.num_wide > 0:
            w = w + wide.reshape(b, self.num_wide, self.wide_output_dim).sum(dim=1)
        wd = d.wide_dense
        if wd is not None:
            w = w + wd(dense.index_select(1, self.wide_dense_idx))
        parts: list[torch.Tensor] = []
        fm = torch.zeros(0)
        if self.num_deep > 0:
            v = deep.reshape(b, self.num_deep, self.dim)
            fm = 0.5 * (v.sum(dim=1).square() - v.square().sum(dim=1))
            parts.append(deep)
        if self.has_deep_dense:
            if self.all_deep_dense:
                parts.append(dense)
            else:
                parts.append(dense.index_select(1, self.deep_dense_idx))
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        h = d.dnn(x)
        final_dnn = d.final_dnn
        final_out = d.final_out
        if final_dnn is not None and final_out is not None:
            cat = [w]
            if self.num_deep > 0:
                cat.append(fm)
            cat.append(h)
            return final_out(final_dnn(torch.cat(cat, dim=1))).squeeze(1)
        deep_out = d.deep_out
        assert deep_out is not None
        logit = deep_out(h).squeeze(1) + w.sum(dim=1)
        if self.num_deep > 0:
            logit = logit + fm.sum(dim=1)
        return logit


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


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: str, obj: object) -> None:
    _write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def delta_topic_from_config(config: pipeline_pb2.EasyRecConfig) -> tuple[str, str]:
    """``(server, topic)`` of ``train_config.incr_save_config.kafka`` when present, else empty."""
    kafka = _get_message_field(config, "train_config", "incr_save_config", "kafka")
    if kafka is None:
        return "", ""
    return str(getattr(kafka, "server", "")), str(getattr(kafka, "topic", ""))


def _find_id_maps(dirs: Sequence[str]) -> Optional[tuple[str, IdMaps]]:
    """``(dir, maps)`` of the first of ``dirs`` holding both id-map files (the publisher's)."""
    for d in dirs:
        if d and os.path.isfile(os.path.join(d, DENSE_UPDATE_VARIABLES)) and os.path.isfile(
                os.path.join(d, EMBED_NAME_TO_IDS)):
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


def dense_variable_shapes(dense: DeepFMDense) -> dict[str, tuple[int, ...]]:
    """Published dense variables: floating ``dense.*`` parameters and buffers -> shape.

    Same names as ``TrainModule.dense_parameters()``; integer buffers (BatchNorm's
    ``num_batches_tracked``) are not published (the codec's rule).
    """
    out = {}
    named = list(dense.named_parameters()) + list(dense.named_buffers())
    for k, v in named:
        if v.is_floating_point():
            out[f"{DENSE_PREFIX}{k}"] = tuple(int(d) for d in v.shape)
    return out


def _new_export_name(export_dir: str, now: float) -> str:
    ts = int(now)
    while os.path.exists(os.path.join(export_dir, str(ts))):
        ts += 1
    return str(ts)


def _copy_file(src: str, dst: str) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------- export


def export_checkpoint(
    config: pipeline_pb2.EasyRecConfig,
    checkpoint_path: str,
    export_dir: str,
    oss_path: str = "",
    asset_files: Sequence[str] = (),
    delta_server: str = "",
    delta_topic: str = "",
    now: Optional[float] = None,
) -> ExportResult:
    """Writes one export of a checkpoint (layout: module docstring).

    Args:
        config: the pipeline config (its model must match the checkpoint).
        checkpoint_path: a ``model.ckpt-N`` directory, or a model_dir (its newest checkpoint).
        export_dir: parent directory of the exports.
        oss_path: where to write the embedding shards instead of inside the export (local
            path; ``oss://`` raises ``ExportError``).
        asset_files: files copied into ``assets/``.
        delta_server: delta topic bootstrap servers; overrides the checkpoint's and the
            config's.
        delta_topic: delta topic; likewise.
        now: the export time (unix seconds; default: now); names the directory.

    Returns:
        What was written.

    Raises:
        ExportError: unsupported destination, missing asset, or id maps that disagree with
            the checkpoint.
        odl.checkpoint.checkpoint_manager.CheckpointError: no usable checkpoint.
        odl.config.config_error.ConfigError: the config does not describe a model.
    """
    if oss_path.startswith("oss://"):
        raise ExportError("--oss_path oss://... is not implemented yet; give a local path")
    for a in asset_files:
        if not os.path.isfile(a):
            raise ExportError(f"asset file not found: {a}")
    t0 = time.monotonic()
    now = time.time() if now is None else now
    ckpt_dir = resolve_checkpoint_path(checkpoint_path)
    ckpt = read_checkpoint(ckpt_dir)
    state = ckpt.state["model"]

    fb = FeatureBuilder(config)
    model = build_model(config, fb)
    if not isinstance(model, DeepFM):
        raise ExportError(f"exporting {type(model).__name__} is not supported")
    dense_state = {k[len(DENSE_PREFIX):]: v for k, v in state.items()
                   if k.startswith(DENSE_PREFIX)}
    try:
        model.dense.load_state_dict(dense_state, strict=True)
    except RuntimeError as e:
        raise ExportError(f"checkpoint {ckpt_dir} does not match the config's model: {e}") from e
    layout = model.layout
    wdim = layout.wide_output_dim
    pooling = {spec.name: spec.pooling for spec in fb.table_specs}
    tables: dict[str, np.ndarray] = {}
    table_pooling: dict[str, str] = {}
    for cfg in layout.configs:
        key = f"{EBC_PREFIX}{cfg.name}.weight"
        if key not in state:
            raise ExportError(f"checkpoint {ckpt_dir} has no table {cfg.name} ({key})")
        w = state[key].detach().to(torch.float32).cpu().numpy()
        is_wide = cfg.name.endswith(WIDE_SUFFIX)
        if is_wide:
            w = w[:, :wdim]
        tables[cfg.name] = np.ascontiguousarray(w)
        base = cfg.name[: -len(WIDE_SUFFIX)] if is_wide else cfg.name
        table_pooling[cfg.name] = pooling.get(base, "sum")
    table_shapes = {n: (int(w.shape[0]), int(w.shape[1])) for n, w in tables.items()}
    dense_shapes = dense_variable_shapes(model.dense)

    # Id maps: the publisher's (checkpoint dir or model_dir) when present, else the same
    # assignment the publisher makes (sorted names).
    model_dir = os.path.dirname(os.path.normpath(ckpt_dir))
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
    cfg_server, cfg_topic = delta_topic_from_config(config)
    server = str(delta_server or source.get("delta_server") or cfg_server)
    topic = str(delta_topic or source.get("delta_topic") or cfg_topic)
    if not topic:
        logger.warning("no delta topic known (checkpoint, config or --delta_topic): "
                       "kafka.txt names none and serving will not replay")

    os.makedirs(export_dir, exist_ok=True)
    name = _new_export_name(export_dir, now)
    final = os.path.join(export_dir, name)
    tmp = os.path.join(export_dir, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        if oss_path:
            emb_abs = os.path.abspath(os.path.join(oss_path, name, EMBEDDINGS_DIR))
            if os.path.exists(emb_abs):
                shutil.rmtree(emb_abs)
            emb_write, emb_ref = emb_abs, emb_abs
        else:
            emb_write, emb_ref = os.path.join(tmp, EMBEDDINGS_DIR), EMBEDDINGS_DIR
        _write_embeddings(emb_write, tables, id_maps, table_pooling)

        sd = build_serving_dense_from(model, fb)
        scripted = torch.jit.script(sd)
        scripted.eval()
        torch.jit.save(scripted, os.path.join(tmp, DENSE_MODEL_FILE))

        signature = {
            "format": EXPORT_FORMAT,
            "model_class": "DeepFM",
            "global_step": ckpt.global_step,
            "generation": ckpt.manifest.get("generation", ""),
            "checkpoint": os.path.abspath(ckpt_dir),
            "created": now,
            "dense_model": DENSE_MODEL_FILE,
            "embeddings_dir": emb_ref,
            "deep_dim": layout.deep_dim,
            "wide_output_dim": wdim,
            "deep_lookups": [[f, t] for f, t in layout.deep_keys],
            "wide_lookups": [[f, t] for f, t in layout.wide_keys],
            "dense_features": fb.dense_feature_names,
            "sparse_features": fb.sparse_feature_names,
            "tables": {n: {"rows": r, "dim": d, "pooling": table_pooling[n]}
                       for n, (r, d) in table_shapes.items()},
        }
        _write_json(os.path.join(tmp, SERVING_MODEL_FILE), signature)
        if id_src is not None:
            for fname in (DENSE_UPDATE_VARIABLES, EMBED_NAME_TO_IDS):
                _copy_file(os.path.join(id_src, fname), os.path.join(tmp, fname))
        else:
            write_id_maps(tmp, dense_shapes, table_shapes)
        _write_json(os.path.join(tmp, KAFKA_FILE), {
            "storage": "kafka", "server": server, "topic": topic,
            "consumer": {"offset": delta_offset},
        })
        _write_bytes(os.path.join(tmp, CONFIG_FILE), config_to_text(config).encode())
        if asset_files:
            os.makedirs(os.path.join(tmp, ASSETS_DIR))
            for a in asset_files:
                _copy_file(a, os.path.join(tmp, ASSETS_DIR, os.path.basename(a)))
        files = {}
        for root, _dirs, names in os.walk(tmp):
            for n in sorted(names):
                fp = os.path.join(root, n)
                rel = os.path.relpath(fp, tmp)
                files[rel] = {"bytes": os.path.getsize(fp), "sha256": sha256_file(fp)}
        _write_json(os.path.join(tmp, MANIFEST_FILE), {"format": 1, "files": files})
        _write_bytes(os.path.join(tmp, DONE_FILE), b"")
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(export_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    emb_dir = emb_write if oss_path else os.path.join(final, EMBEDDINGS_DIR)
    logger.info("exported %s (step %d, %d tables, delta replay from offset %d) in %.2fs",
                final, ckpt.global_step, len(tables), delta_offset, time.monotonic() - t0)
    return ExportResult(final, emb_dir, ckpt.global_step, delta_offset)


def build_serving_dense_from(model: DeepFM, fb: FeatureBuilder) -> ServingDense:
    """The scriptable dense part of ``model`` (eval mode, parameters copied).

    Args:
        model: the DeepFM (its ``dense`` holds the trained values).
        fb: the feature builder it was built with (dense column count).

    Returns:
        The module; script it with ``torch.jit.script``.
    """
    layout = model.layout
    return ServingDense(
        model.dense,
        num_deep=len(layout.deep_keys),
        dim=layout.deep_dim,
        num_wide=len(layout.wide_keys),
        wide_output_dim=layout.wide_output_dim,
        deep_dense_idx=model._deep_dense_idx,  # noqa: SLF001 - DeepFM's column choice
        wide_dense_idx=model._wide_dense_idx,  # noqa: SLF001
        num_dense=len(fb.dense_feature_names),
    ).eval()


def _write_embeddings(
    root: str,
    tables: Mapping[str, np.ndarray],
    ids: IdMaps,
    pooling: Mapping[str, str],
) -> None:
    """Writes ``root/<table>/part-00000.npy`` per table and ``root/MANIFEST.json`` last."""
    os.makedirs(root, exist_ok=True)
    manifest: dict = {"format": 1, "tables": {}}
    for name, w in tables.items():
        tdir = os.path.join(root, name)
        os.makedirs(tdir, exist_ok=True)
        part = "part-00000.npy"
        fp = os.path.join(tdir, part)
        with open(fp, "wb") as f:
            np.save(f, w.astype(np.float32, copy=False))
            f.flush()
            os.fsync(f.fileno())
        manifest["tables"][name] = {
            "id": int(ids.tables[name].id),
            "rows": int(w.shape[0]),
            "dim": int(w.shape[1]),
            "dtype": "float32",
            "pooling": pooling[name],
            "parts": [{"file": part, "start_id": 0, "rows": int(w.shape[0]),
                       "bytes": os.path.getsize(fp), "sha256": sha256_file(fp)}],
        }
    _write_json(os.path.join(root, MANIFEST_FILE), manifest)
