"""Bounds on the sizes a pipeline config may ask for.

:func:`odl.config.config_validation.validate_pipeline_config` refuses values outside these
bounds with a :class:`~odl.config.config_error.ConfigError` naming the field, so a config that
validates never fails at start-up for a size the libraries cannot handle. Whether the sizes
together fit the host is a separate check (:mod:`odl.train.memory_estimate`).

Bounds that come from a library:

* ``EMBEDDING_DIM_ALIGN``: fbgemm's table-batched embedding kernels (CPU and CUDA) accept
  only dimensions that are multiples of 4 (``embedding_dim must be a multiple of 4``): tables
  are stored padded to one (``odl.models.embedding_tables.storage_dim``).
* ``MAX_FETCH_INTERVAL_MS``: ``data_config.fetch_interval_ms`` becomes librdkafka's
  ``fetch.queue.backoff.ms``, whose range is 0..300000.
* ``MAX_BATCH_SIZE``: the consumer prefetches ``4 * batch_size`` records
  (librdkafka's ``queued.min.messages``, at most 10,000,000) when fetch pacing is off.

The others are odl's own choices, far above what a CTR model uses and low enough that a
typo (``1e9``) is caught as such rather than by an allocation failure.
"""

from __future__ import annotations

# Rows of one embedding table (hash_bucket_size, num_buckets, len(boundaries) + 1): a row
# index then also fits an int32, the narrower of the two index types fbgemm's kernels take.
MAX_TABLE_ROWS = 2**31 - 1
# train_config.wide_learning_rate_multiplier: a rate this many times the table rate at most.
MAX_WIDE_LR_MULTIPLIER = 1000.0
# EasyRec's optimizer_config.embedding_learning_rate_multiplier: the tables' gradients this
# many times larger at most (float32 gradients stay far from overflow).
MAX_TABLE_GRADIENT_MULTIPLIER = 1e6
# The largest train_config.per_record_adagrad_max_gain.
MAX_PER_RECORD_GAIN = 1000.0

# Embedding dimensions: at most MAX_EMBEDDING_DIM; stored padded to EMBEDDING_DIM_ALIGN.
EMBEDDING_DIM_ALIGN = 4
MAX_EMBEDDING_DIM = 4096

# DeepFM's wide part: wide_output_dim (stored rounded up to a multiple of 4).
MAX_WIDE_OUTPUT_DIM = 4096

# DNN towers (deepfm.dnn, deepfm.final_dnn): units per layer and number of layers.
MAX_HIDDEN_UNITS = 65536
MAX_HIDDEN_LAYERS = 64
# Positions of a SequenceFeature (one lookup each).
MAX_SEQUENCE_LENGTH = 1024
# Numbers in one RawFeature value (raw_input_dim / TorchEasyRec's value_dim).
MAX_RAW_INPUT_DIM = 4096
# Classes of a num_class model.
MAX_CLASSES = 4096
# Experts of an MMoE / DBMTL model.
MAX_EXPERTS = 256

# Samples per training step (data_config.batch_size).
MAX_BATCH_SIZE = 1 << 20

# data_config.fetch_interval_ms (librdkafka fetch.queue.backoff.ms range).
MAX_FETCH_INTERVAL_MS = 300000

# data_config.num_workers: feature build processes.
MAX_NUM_WORKERS = 256

# train_config.metrics_window_samples: the progressive metrics keep 3 float64 per sample.
MAX_METRICS_WINDOW_SAMPLES = 10_000_000

# Nesting depth of an --edit_config_json document.
MAX_EDIT_JSON_DEPTH = 64
# Tables of at least this many rows are split by rows over the ranks of a job; smaller ones
# are placed whole on one rank (odl.train.distributed.table_placement; the memory estimate
# of one rank, odl.train.memory_estimate, counts on it).
ROW_WISE_MIN_ROWS = 1 << 20
