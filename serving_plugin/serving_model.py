"""The serving model: an export's tables and dense part, updated by delta versions.

``ServingModel.load(path)`` reads one export (``serving_plugin.export_reader``) and serves it.

Prediction: per pooled input of the export (``serving_model.json``'s ``pooled_inputs``, the
training model's ``pooled_layout``), one ``torch.nn.functional.embedding_bag`` over the ids
of all its lookups (sum or mean pooling, as each table's combiner;
``serving_plugin.pooled_lookups``) gives
the ``[B, n_lookups * dim]`` tensor training feeds the dense part; ``dense_model.pt`` - the
training model's own dense module, scripted - maps those tensors and the raw dense features
to logits, then ``odl.models.ctr_model.predictions`` (a sigmoid, or the logit itself for a
regression output). There is no serving copy of the model's math.

Updates: ``apply_version`` checks a whole ``DeltaVersion`` first (known table and variable
ids, dims, shapes, row ids in range, room in dynamic tables; under the model lock too when a
table has a disk tier, whose check may grow its file) and only then copies it in under
the model lock, so a version is applied completely or not at all, and a prediction never sees
half a version. Dense variables are addressed by the names in ``DENSE_UPDATE_VARIABLES``,
which are the parameter names inside ``dense_model.pt``.

Dynamic tables (raw ids, ``odl.models.dynamic``): each has its own
``RawIdIndex`` over its rows (built from the export). A lookup maps the raw ids of the
lookups reading it through that index; an id without a row (never published, or deleted) is
dropped from its bag, exactly as the trainer drops an id it has not admitted, so it
contributes nothing (sum) and is not counted (mean). A version's deletes free rows first
(zeroed), then its rows are written, new ids taking free rows. A growing dynamic table gets
more rows first when a version's new ids need them (``serving_plugin.table_growth``).
With a disk tier (``ServingModel.load(..., disk_tier=...)``) the large dynamic tables keep a
bounded set of rows in RAM and the rest on disk; a batch's ids on disk are staged before its
lookups and versions write both tiers (``serving_plugin.serving_tier``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from odl.config.loss_settings import num_classes, regression_outputs, task_classes, ziln_settings
from odl.features.batch import Batch
from odl.features.rtp_layout import RtpLayout
from odl.models.ctr_model import predictions
from odl.models.subnormal_floats import flush_subnormal_floats
from odl.protos import pipeline_pb2
from odl.train.host_memory import release_freed_memory
from publisher.delta_format import DeltaVersion
from serving_plugin.export_reader import ExportContents, ExportLoadError, read_export
from serving_plugin.pooled_lookups import PooledInput
from serving_plugin.serving_tier import DiskTierSettings, RowLookup
from serving_plugin.table_growth import grown_index, grown_tables, rows_for

logger = logging.getLogger(__name__)


class DeltaApplyError(ValueError):
    """A version does not fit the model (unknown id, wrong shape, row out of range).

    Attributes:
        reason: short machine-friendly reason (metric label).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class AppliedState:
    """What the model currently holds.

    Attributes:
        version: version applied last (the base's global step before any).
        generation: its generation ('' for the base unless the checkpoint recorded one).
        versions_applied: versions applied since load.
        rows_applied: embedding rows applied since load.
        last_apply_time: unix time of the last apply (None before any).
        newest_event_time: newest sample event time (unix s) in an applied version (None =
            unknown).
        last_header: the last applied version's header.
        apply_seconds: total seconds spent applying versions.
    """

    version: int
    generation: str
    versions_applied: int = 0
    rows_applied: int = 0
    last_apply_time: Optional[float] = None
    newest_event_time: Optional[float] = None
    last_header: Any = None
    apply_seconds: float = 0.0


class ServingModel:
    """Tables + dense part of one export, with versioned updates (see the module docstring).

    Use ``ServingModel.load(path)``.

    Args:
        export: the export, read and verified.

    Raises:
        ExportLoadError: the id maps do not match the tables or the dense part, or the model
            has more than one output.
    """

    def __init__(self, export: ExportContents) -> None:
        # the trainer's dense weights reach the subnormal range; served at full speed only
        # with them flushed, as the trainer computes them (odl.models.subnormal_floats)
        flush_subnormal_floats()
        self.path = export.path
        self.origin = export.origin
        self.signature = export.signature
        self.feature_builder = export.feature_builder
        self.tables = export.tables
        self.dynamic = export.dynamic
        self.max_rows = dict(export.max_rows)  # growing dynamic tables (table_growth)
        self.tiers = export.tiers  # dynamic tables on the disk tier (serving_tier)
        self.tier_dir = export.tier_dir
        self.dense_module = export.dense_module
        self.id_maps = export.id_maps
        self.lock = threading.Lock()
        self.outputs = tuple(export.outputs)
        # per output: a regression answers its logit, the others sigmoid(logit)
        self.regression = regression_outputs(export.config)
        self.softmax = num_classes(export.config) > 1
        self.task_classes = task_classes(export.config)
        self.ziln = ziln_settings(export.config)
        dc = export.config.data_config
        self._labels = list(dc.label_fields)
        self._fields = [f.input_name for f in dc.input_fields]
        self._label_idx = sorted(self._fields.index(lf) for lf in self._labels)
        self._sep = dc.separator
        self._record_format = dc.record_format
        self._rtp = RtpLayout.of(dc)
        params = dict(self.dense_module.named_parameters())
        params.update(dict(self.dense_module.named_buffers()))
        self._dense_by_id: dict[int, tuple[str, torch.Tensor]] = {}
        for name, info in self.id_maps.dense.items():
            if name not in params:
                raise ExportLoadError(f"DENSE_UPDATE_VARIABLES names {name}, which the dense "
                                      "model does not have")
            if tuple(params[name].shape) != tuple(info.shape):
                raise ExportLoadError(f"{name}: shape {tuple(params[name].shape)} in the dense "
                                      f"model, {tuple(info.shape)} in DENSE_UPDATE_VARIABLES")
            self._dense_by_id[info.id] = (name, params[name])
        for name, info in self.id_maps.tables.items():
            if name not in self.tables:
                raise ExportLoadError(f"embed_name_to_ids.txt names table {name}, which the "
                                      "export does not have")
            t = self.tables[name]
            rows = self.max_rows.get(name, t.shape[0])  # a growing table: its most rows
            if name in self.tiers:  # RAM and staging rows; the ids it may hold
                rows = self.tiers[name].most_rows
            if (rows, t.shape[1]) != (info.num_rows, info.dim) or (
                    t.shape[0] > rows and name not in self.tiers):
                raise ExportLoadError(f"table {name}: {tuple(t.shape)} exported, "
                                      f"{info.num_rows}x{info.dim} in embed_name_to_ids.txt")
        keys = self.feature_builder.sparse_feature_names
        key_idx = {k: i for i, k in enumerate(keys)}
        pooling = {n: t["pooling"] for n, t in self.signature["tables"].items()}
        self._num_keys = len(keys)
        self._lookups = [([(key_idx[f], t, pooling[t]) for f, t in g.lookups], g.dims)
                         for g in export.pooled_inputs]
        # tiered table -> the keys of the batch that read it (staged before a forward)
        self._tier_keys = {name: sorted({k for lookups, _d in self._lookups
                                         for k, t, _p in lookups if t == name})
                           for name in self.tiers}
        self._link_tables()
        gen = str(self.signature.get("generation", ""))
        self.state = AppliedState(version=int(self.signature.get("global_step", 0)),
                                  generation=gen)

    def _link_tables(self) -> None:
        """The id maps' table ids and the lookup groups over ``tables`` (again after a growth)."""
        self._table_by_id: dict[int, tuple[str, torch.Tensor]] = {
            info.id: (name, self.tables[name]) for name, info in self.id_maps.tables.items()}
        rows_of: dict[str, RowLookup] = {**self.dynamic, **self.tiers}
        self._groups = [PooledInput.build(lookups, dims, self.tables, rows_of)
                        for lookups, dims in self._lookups]

    def _grow_for(self, version: DeltaVersion) -> None:
        """Grows the growing tables whose new ids in ``version`` need more rows (table_growth)."""
        grow: dict[str, int] = {}
        for tid, (ids, _vals) in version.sparse.items():
            entry = self._table_by_id.get(int(tid))
            if entry is None or entry[0] not in self.max_rows:
                continue
            name = entry[0]
            rows = rows_for(self.dynamic[name], np.asarray(ids, dtype=np.int64),
                            version.deletes.get(tid, np.empty(0, dtype=np.int64)),
                            self.max_rows[name])
            if rows > self.dynamic[name].capacity:
                grow[name] = rows
        if not grow:
            return
        with self.lock:
            self.tables = grown_tables(self.tables, grow)
            for name, rows in grow.items():
                self.dynamic[name] = grown_index(self.dynamic[name], rows)
            self._link_tables()
        logger.info("dynamic tables grew: %s", ", ".join(f"{n} to {r:,} rows"
                                                           for n, r in grow.items()))

    def _stage_disk_rows(self, values: torch.Tensor, counts: torch.Tensor,
                         starts: torch.Tensor) -> None:
        """Copies a batch's ids on disk into their tables' staging rows (serving_tier)."""
        v = values.numpy()
        cnt, st = counts.tolist(), starts.tolist()
        grow: dict[str, int] = {}
        for name, tier in self.tiers.items():
            keys = self._tier_keys[name]
            ids = np.concatenate([v[st[k] : st[k] + cnt[k]] for k in keys]) if keys else v[:0]
            need = tier.stage(ids)
            staging = self.tables[name].shape[0] - tier.ram_rows
            if need > staging:  # the staging rows double until the batch's rows fit
                while need > staging:
                    staging = 2 * max(1, staging)
                grow[name] = tier.ram_rows + staging
        if grow:
            self.tables = grown_tables(self.tables, grow)
            self._link_tables()
        for name, tier in self.tiers.items():
            tier.fill_staged(self.tables[name])

    def close(self) -> None:
        """Releases the disk tier's directory (the model serves no more)."""
        if self.tier_dir is not None:
            self.tier_dir.close()

    @classmethod
    def load(cls, export_dir: str, verify: bool = True,
             disk_tier: Optional[DiskTierSettings] = None) -> ServingModel:
        """Loads the newest complete export under ``export_dir`` (or ``export_dir`` itself).

        Args:
            export_dir: an export or a parent of exports.
            verify: check the embedding shards' sha256 against their manifest.
            disk_tier: serve the large dynamic tables from RAM and disk
                (``serving_plugin.serving_tier``).

        Returns:
            The model.

        Raises:
            ExportLoadError: missing or inconsistent files, or a tier directory in use.
        """
        t0 = time.monotonic()
        export = read_export(export_dir, verify=verify, disk_tier=disk_tier)
        try:
            model = cls(export)
        except BaseException:
            if export.tier_dir is not None:
                export.tier_dir.close()
            raise
        release_freed_memory()  # the load's temporary copies (part files, sorted ids)
        logger.info("loaded export %s (step %s, %d tables, %.1f MB) in %.2fs", export.origin,
                    export.signature.get("global_step"), len(export.tables),
                    sum(t.numel() * 4 for t in export.tables.values()) / 1e6,
                    time.monotonic() - t0)
        return model

    # -- prediction -------------------------------------------------------------------------

    def fill_labels(self, values: Sequence[bytes]) -> list[bytes]:
        """Adds dummy labels ("0") to records that lack them (requests need not carry labels).

        CSV: a record with as many fields fewer than ``input_fields`` as there are labels gets
        them inserted at the label columns; an empty label becomes "0". JSON: a missing/null
        label becomes 0. RTP: a request of the features column alone gets its label columns,
        an empty label column becomes "0". Anything else is passed through for the parser.
        """
        out = []
        fmt = self._record_format
        sep = self._sep
        n = len(self._fields)
        for v in values:
            s = v.lstrip()
            is_json = (fmt == pipeline_pb2.DatasetConfig.JSON or
                       (fmt == pipeline_pb2.DatasetConfig.AUTO and s[:1] == b"{"))
            if is_json:
                try:
                    obj = json.loads(v)
                except (ValueError, RecursionError):
                    out.append(v)
                    continue
                if isinstance(obj, dict) and any(obj.get(lf) is None for lf in self._labels):
                    for lf in self._labels:
                        if obj.get(lf) is None:
                            obj[lf] = 0
                    v = json.dumps(obj).encode("utf-8")
                out.append(v)
                continue
            if self._rtp is not None:  # EasyRec's RTP records (odl.features.rtp_layout)
                out.extend(self._rtp.with_labels([v]))
                continue
            try:
                text = v.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                out.append(v)
                continue
            parts = text.split(sep)
            if len(parts) == n - len(self._label_idx):
                for i in self._label_idx:  # ascending: each insert lands at its column
                    parts.insert(i, "0")
            elif len(parts) == n:
                for i in self._label_idx:
                    if parts[i] == "":
                        parts[i] = "0"
            out.append(sep.join(parts).encode("utf-8"))
        return out

    def build(self, values: Sequence[bytes]) -> tuple[Optional[Batch], list[tuple[int, str]]]:
        """Featurizes request records; returns the batch and the rejected ``(index, reason)``."""
        res = self.feature_builder.build(self.fill_labels(values))
        return res.batch, res.rejected

    @torch.no_grad()
    def predict_batch(self, batch: Batch) -> np.ndarray:
        """Probabilities of a batch built by this model's feature builder.

        Returns:
            float64 ``[B]`` (one output) or ``[B, outputs]`` (columns in ``outputs`` order).
        """
        return self.predict_versioned(batch)[0]

    @torch.no_grad()
    def predict_versioned(self, batch: Batch) -> tuple[np.ndarray, int, str]:
        """``(probabilities, version, generation)``: the version the prediction was made at."""
        with self.lock:
            logits = self._forward(batch)
            version, generation = self.state.version, self.state.generation
        return (predictions(logits, self.regression, self.softmax, self.task_classes,
                            self.ziln), version,
                generation)

    @torch.no_grad()
    def predict_values(self, values: Sequence[bytes]) -> tuple[np.ndarray,
                                                                 list[tuple[int, str]]]:
        """Probabilities of raw records (CSV / JSON as in the training stream).

        Returns:
            ``(probabilities of the accepted records in order, rejected (index, reason))``.
        """
        batch, rejected = self.build(values)
        if batch is None:
            return np.zeros(0, dtype=np.float64), rejected
        return self.predict_batch(batch), rejected

    def _forward(self, batch: Batch) -> torch.Tensor:
        kjt = batch.sparse
        b = batch.size
        values = kjt.values()
        lengths = kjt.lengths().to(torch.int64).view(self._num_keys, b)
        counts = lengths.sum(dim=1)
        starts = torch.cumsum(counts, 0) - counts
        weights = kjt.weights_or_none()  # weighted tags: per-value weights, tables sum-pooled
        if self.tiers:
            self._stage_disk_rows(values, counts, starts)
        pooled = [g.pooled(values, lengths, counts, starts, b, weights) for g in self._groups]
        return self.dense_module(*pooled, batch.dense)

    # -- updates ----------------------------------------------------------------------------

    def dynamic_status(self) -> dict[str, dict[str, int]]:
        """Dynamic table -> ``{"capacity", "live_rows"}`` and more.

        A growing table adds ``max_rows``; one on the disk tier has its tiers' figures
        (``TieredTable.status``).
        """
        out = {n: {"capacity": ix.capacity, "live_rows": ix.live,
                   **({"max_rows": self.max_rows[n]} if n in self.max_rows else {})}
               for n, ix in self.dynamic.items()}
        out.update({n: tier.status() for n, tier in self.tiers.items()})
        return out

    def _check_version(self, version: DeltaVersion) -> list[tuple[torch.Tensor, Any, Any]]:
        """Validates a whole version; returns the copy plan (nothing is modified).

        A dynamic table's entry is ``(table, ("raw", name, raw ids), values)``: its rows are
        found (and taken) when the version is applied.
        """
        plan: list[tuple[torch.Tensor, Any, Any]] = []
        for tid in version.deletes:
            entry = self._table_by_id.get(int(tid))
            if entry is None:
                raise DeltaApplyError("unknown_table_id", f"table id {tid}")
            if entry[0] not in self.dynamic and entry[0] not in self.tiers:
                raise DeltaApplyError("not_dynamic", f"deletes for fixed table {entry[0]}")
        for vid, arr in version.dense.items():
            entry = self._dense_by_id.get(int(vid))
            if entry is None:
                raise DeltaApplyError("unknown_dense_id", f"dense variable id {vid}")
            name, t = entry
            if tuple(arr.shape) != tuple(t.shape):
                raise DeltaApplyError("shape", f"{name}: version has {tuple(arr.shape)}, "
                                               f"model {tuple(t.shape)}")
            plan.append((t, None, torch.from_numpy(np.ascontiguousarray(arr, np.float32))))
        for tid, (ids, vals) in version.sparse.items():
            entry = self._table_by_id.get(int(tid))
            if entry is None:
                raise DeltaApplyError("unknown_table_id", f"table id {tid}")
            name, t = entry
            if vals.ndim != 2 or vals.shape[1] != t.shape[1] or vals.shape[0] != ids.shape[0]:
                raise DeltaApplyError("dim", f"table {name}: rows {tuple(vals.shape)}, table "
                                             f"dim {t.shape[1]}")
            index = self.dynamic.get(name)
            if index is not None or name in self.tiers:
                gone = version.deletes.get(tid, np.empty(0, dtype=np.int64))
                if index is None:
                    new, room = self.tiers[name].room_for(np.asarray(ids, dtype=np.int64),
                                                          np.asarray(gone, dtype=np.int64))
                else:
                    present = index.lookup(ids)
                    new = int(((present < 0) | np.isin(ids, gone)).sum())
                    room = index.free + int((index.lookup(gone) >= 0).sum())
                if new > room:
                    raise DeltaApplyError("capacity", f"table {name}: {new} new ids, "
                                                      f"{room} free rows")
                plan.append((t, ("raw", name, np.ascontiguousarray(ids, np.int64)),
                             torch.from_numpy(np.ascontiguousarray(vals, np.float32))))
                continue
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= t.shape[0]):
                raise DeltaApplyError("row_range", f"table {name}: ids outside "
                                                   f"[0, {t.shape[0]})")
            plan.append((t, torch.from_numpy(np.ascontiguousarray(ids, np.int64)),
                         torch.from_numpy(np.ascontiguousarray(vals, np.float32))))
        return plan

    @torch.no_grad()
    def apply_version(self, version: DeltaVersion) -> int:
        """Applies a complete version all-or-nothing.

        Args:
            version: an assembled version.

        Returns:
            Embedding rows applied.

        Raises:
            DeltaApplyError: the version does not fit the model (nothing was applied).
        """
        t0 = time.perf_counter()
        if self.max_rows:  # growing tables: rows for the version's new ids first
            self._grow_for(version)
        if self.tiers:  # a tier's check may grow its file, which its lookups read
            with self.lock:
                plan = self._check_version(version)
        else:
            plan = self._check_version(version)
        rows = 0
        names = self.id_maps.table_names()
        with self.lock:
            for tid, gone in version.deletes.items():
                name = names[int(tid)]
                if name in self.tiers:
                    self.tiers[name].delete(self.tables[name], gone)
                    continue
                freed = self.dynamic[name].remove_ids(gone)
                if freed.shape[0]:
                    self.tables[name].index_fill_(0, torch.from_numpy(freed), 0.0)
            for t, ids, vals in plan:
                if ids is None:
                    t.copy_(vals.to(t.dtype))
                    continue
                if isinstance(ids, tuple) and ids[1] in self.tiers:
                    self.tiers[ids[1]].write(t, ids[2], vals)
                    rows += int(ids[2].shape[0])
                    continue
                if isinstance(ids, tuple):
                    index = self.dynamic[ids[1]]
                    raw = ids[2]
                    slots = index.lookup(raw)
                    new = slots < 0
                    if new.any():
                        slots[new] = index.insert(raw[new])
                    ids = torch.from_numpy(slots)
                t.index_copy_(0, ids, vals)
                rows += int(ids.shape[0])
            h = version.header
            st = self.state
            st.version = int(h.version)
            st.generation = h.generation
            st.versions_applied += 1
            st.rows_applied += rows
            st.last_apply_time = time.time()
            if h.max_event_time_ms:
                ev = h.max_event_time_ms / 1000.0
                st.newest_event_time = ev if st.newest_event_time is None else max(
                    st.newest_event_time, ev)
            st.last_header = h
        self.state.apply_seconds += time.perf_counter() - t0
        return rows
