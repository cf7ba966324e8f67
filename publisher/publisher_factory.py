"""Builds the delta publisher and its sink from a pipeline config.

``build_delta_sink`` turns ``train_config.incr_save_config`` into a ``KafkaSink`` (the
``kafka`` branch) or an ``FsSink`` (the ``fs`` branch; a relative ``incr_save_dir`` lies in
``model_dir``). ``build_publisher`` writes the id maps (``publisher.id_maps``) into
``model_dir``, registers a ``DeltaTracker`` as the train module's touched-rows hook and
starts an ``IncrementalPublisher``; ``build_rank_snapshotter`` gives a rank other than 0 of
a model trained by several ranks its share of the snapshots. ``published_table_dims`` and
``dense_variable_shapes`` say what of a train module is published; crash recovery uses them
to rebuild the same id maps.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from prometheus_client import CollectorRegistry

from odl.inputs.source_factory import online_input_name
from odl.storage.storage_path import basename, is_remote, join
from publisher.delta_sink import DeltaSink
from publisher.delta_tracker import DeltaTracker
from publisher.fs_sink import FsSink
from publisher.id_maps import build_id_maps, write_id_maps
from publisher.incremental_publisher import IncrementalPublisher
from publisher.kafka_sink import KafkaSink
from publisher.version_snapshot import ParameterSnapshotter, ParameterSource

logger = logging.getLogger(__name__)


def published_table_dims(module: Any) -> dict[str, tuple[int, int]]:
    """Table name -> ``(num_rows, published dim)``: the columns the model reads.

    A table is stored with a multiple of 4 columns; a wide table is read (and published) at
    ``wide_output_dim``, a deep one at its ``embedding_dim`` (``EmbeddingLayout.read_dims``).
    A growing dynamic table's rows are the most it may reach (``DynamicTableSpec.max_rows``),
    so the id maps stay those of the table whatever it grows to; a table with a disk tier's,
    the most ids it may hold in RAM and on disk (``most_ids``).

    Args:
        module: a ``TrainModule``.

    Returns:
        The table sizes as published.
    """
    layout = getattr(module.model, "layout", None)
    read = dict(layout.read_dims) if layout is not None else {}
    out = {}
    for name, (rows, columns) in module.table_shapes().items():
        dyn = module.dynamic_table(name) if hasattr(module, "dynamic_table") else None
        if dyn is not None:
            rows = max(rows, dyn.spec.most_ids)
        out[name] = (rows, int(read.get(name, columns)))
    return out


def dense_variable_shapes(module: ParameterSource) -> dict[str, tuple[int, ...]]:
    """Floating-point dense variables (parameters and buffers) -> shape.

    Args:
        module: the train module.

    Returns:
        The shapes of the variables that are published.
    """
    return {name: tuple(t.shape) for name, t in module.dense_parameters().items()
            if t.is_floating_point()}


def build_delta_sink(config: Any) -> DeltaSink:
    """The sink of ``train_config.incr_save_config`` (Kafka topic or directory).

    Args:
        config: the pipeline config (``EasyRecConfig``).

    Returns:
        A ``KafkaSink`` (its transactional producer not yet claimed) or an ``FsSink``.
    """
    isc = config.train_config.incr_save_config
    if isc.WhichOneof("incr_update") == "kafka":
        return KafkaSink(isc.kafka.server, isc.kafka.topic, dict(isc.kafka.kafka_config),
                         max_chunk_bytes=isc.max_chunk_bytes,
                         fence=isc.kafka.fence_producers)
    directory = isc.fs.incr_save_dir
    if not is_remote(directory) and not os.path.isabs(directory):
        directory = join(config.model_dir, directory)
    return FsSink(directory)


def build_publisher(
    config: Any,
    module: Any,
    generation: str,
    registry: Optional[CollectorRegistry] = None,
    start_step: int = 0,
    sink: Optional[DeltaSink] = None,
) -> IncrementalPublisher:
    """Builds the publisher of a pipeline config with ``train_config.incr_save_config``.

    Writes ``DENSE_UPDATE_VARIABLES`` and ``embed_name_to_ids.txt`` into ``model_dir``,
    registers the tracker as the module's touched-rows hook and starts the sender thread.

    Args:
        config: the pipeline config (``EasyRecConfig``).
        module: the ``TrainModule``.
        generation: the trainer generation id.
        registry: the trainer's Prometheus registry.
        start_step: the global step the trainer starts from.
        sink: the sink to publish through (default: ``build_delta_sink(config)``).

    Returns:
        The running publisher.
    """
    isc = config.train_config.incr_save_config
    id_maps = write_id_maps(config.model_dir, dense_variable_shapes(module),
                            published_table_dims(module))
    tracker = _touched_rows_tracker(module)
    if sink is None:
        sink = build_delta_sink(config)
    model_name = isc.model_name or basename(config.model_dir)
    value_type = "fp16" if isc.value_type == isc.FP16 else "fp32"
    pub = IncrementalPublisher(
        module, id_maps, tracker, sink, generation, model_name,
        sparse_save_steps=isc.sparse_save_steps,
        dense_save_steps=isc.dense_save_steps,
        sparse_save_secs=isc.sparse_save_secs,
        dense_save_secs=isc.dense_save_secs,
        value_type=value_type,
        max_chunk_bytes=isc.max_chunk_bytes,
        input_topic=online_input_name(config),
        registry=registry,
        start_step=start_step,
    )
    pub.start()
    logger.info("delta publisher: %s, sparse every %d steps / %ds, dense every %d steps / %ds, "
                "%s, %d tables, %d dense variables", sink.description, isc.sparse_save_steps,
                isc.sparse_save_secs, isc.dense_save_steps, isc.dense_save_secs, value_type,
                len(id_maps.tables), len(id_maps.dense))
    return pub


def build_rank_snapshotter(config: Any, module: Any) -> ParameterSnapshotter:
    """The snapshotter of a rank other than 0 (several ranks; ``odl.train.rank_publishing``).

    It tracks the rows this rank's batches touch (registered as the module's touched-rows
    hook) and takes part in rank 0's sparse snapshots; it writes nothing and sends nothing.

    Args:
        config: the pipeline config (``EasyRecConfig``).
        module: the ``TrainModule``.

    Returns:
        The snapshotter, with the same id maps rank 0's publisher writes.
    """
    id_maps = build_id_maps(dense_variable_shapes(module), published_table_dims(module))
    return ParameterSnapshotter(module, id_maps, _touched_rows_tracker(module),
                                online_input_name(config))


def _touched_rows_tracker(module: Any) -> DeltaTracker:
    """A ``DeltaTracker`` of the module's tables, registered as its touched-rows hook."""
    tracker = DeltaTracker(module.feature_tables(changing=True),
                           {name: rows for name, (rows, _) in module.table_shapes().items()})
    module.set_touched_rows_hook(tracker.record)
    if hasattr(module, "add_table_growth_hook"):
        module.add_table_growth_hook(  # the marks move with the rows (split by id)
            lambda shapes: tracker.grow({n: r for n, (r, _c) in shapes.items()},
                                        getattr(module.growth, "moves", None)))
    return tracker
