"""Pipeline configs over the synthetic stream's schema, generated with chosen sizes.

``deepfm_config_text`` writes a DeepFM config; ``bursty_config_text`` writes a DeepFM config
over the bursty stream's schema (``odl.datagen.bursty_stream``). ``records_with_column``
encodes a batch with one of the columns other configs over the schema read (a conversion
label, a behavior history). The same config as another model class is the repository's
business (tests and benches: ``odl.harness.model_configs``), not the package's.

Tests use small tables for speed; ``bench/train_throughput.py`` uses the benchmark shape
(26 id features of dim 16, 13 dense, batch 1024). ``samples/deepfm_online.config`` is the
hand-written, commented counterpart for users.
"""

from __future__ import annotations

from odl.datagen.behavior_history import HISTORY_FIELD, encode_with_history
from odl.datagen.bursty_stream import BURSTY_ID_FIELDS
from odl.datagen.conversion_labels import CONVERSION_FIELD, encode_with_conversions
from odl.datagen.synthetic_ctr import DENSE_FIELDS, SPARSE_FIELDS, CtrBatch, SyntheticCtrStream


def deepfm_config_text(
    model_dir: str,
    server: str = "127.0.0.1:9092",
    topic: str = "odl_test",
    batch_size: int = 64,
    dim: int = 8,
    buckets: int = 2000,
    extra_train: str = "",
    kafka_extra: str = "",
    sparse_fields: tuple[str, ...] = SPARSE_FIELDS,
    hidden_units: tuple[int, ...] = (32, 16),
    save_checkpoints_steps: int = 50,
) -> str:
    """A DeepFM config (pipeline config text) on the datagen schema.

    Args:
        model_dir: model directory.
        server: Kafka bootstrap servers.
        topic: sample topic.
        batch_size: samples per step.
        dim: embedding dimension of every id feature.
        buckets: hash buckets per id feature.
        extra_train: extra text inside train_config.
        kafka_extra: extra text inside kafka_train_input.
        sparse_fields: id features to use.
        hidden_units: DNN layer sizes.
        save_checkpoints_steps: checkpoint interval.

    Returns:
        The config text.
    """
    fields = ['input_fields { input_name: "sample_id" input_type: STRING }',
              'input_fields { input_name: "event_time" input_type: DOUBLE }',
              'input_fields { input_name: "label" input_type: INT32 }']
    fields += [f'input_fields {{ input_name: "{f}" input_type: FLOAT default_val: "0" }}'
               for f in DENSE_FIELDS]
    fields += [f'input_fields {{ input_name: "{f}" input_type: STRING }}' for f in SPARSE_FIELDS]
    feats = [
        f'feature_configs {{ input_names: "{f}" feature_type: IdFeature embedding_dim: {dim} '
        f"hash_bucket_size: {buckets} }}"
        for f in sparse_fields
    ]
    feats += [
        f'feature_configs {{ input_names: "{f}" feature_type: RawFeature }}' for f in DENSE_FIELDS
    ]
    wide = " ".join(f'feature_names: "{f}"' for f in sparse_fields)
    deep = " ".join(f'feature_names: "{f}"' for f in sparse_fields + DENSE_FIELDS)
    nl = "\n  "
    return f"""
model_dir: "{model_dir}"
kafka_train_input {{
  server: "{server}"
  topic: "{topic}"
  group: "odl_test"
  {kafka_extra}
}}
data_config {{
  batch_size: {batch_size}
  {nl.join(fields)}
  label_fields: "label"
  input_type: KafkaInput
  sample_id_field: "sample_id"
  event_time_field: "event_time"
  batch_timeout_ms: 100
}}
{chr(10).join(feats)}
model_config {{
  model_class: "DeepFM"
  feature_groups {{ group_name: "wide" {wide} wide_deep: WIDE }}
  feature_groups {{ group_name: "deep" {deep} wide_deep: DEEP }}
  deepfm {{
    dnn {{ hidden_units: [{', '.join(str(h) for h in hidden_units)}] use_bn: false }}
    wide_output_dim: 1
  }}
}}
train_config {{
  optimizer_config {{ adagrad_optimizer {{
    learning_rate {{ constant_learning_rate {{ learning_rate: 0.05 }} }} }} }}
  optimizer_config {{ adam_optimizer {{
    learning_rate {{ constant_learning_rate {{ learning_rate: 0.001 }} }} }} }}
  save_checkpoints_steps: {save_checkpoints_steps}
  keep_checkpoint_max: 3
  log_step_count_steps: 20
  enable_oss_stop_signal: true
  stop_signal_poll_secs: 0.5
  {extra_train}
}}
"""


def bursty_config_text(
    model_dir: str,
    server: str = "127.0.0.1:9092",
    topic: str = "odl_bursty",
    batch_size: int = 256,
    dim: int = 16,
    buckets: int = 1 << 20,
    sparse_lr: float = 0.1,
    dense_lr: float = 0.001,
    hidden_units: tuple[int, ...] = (64, 32),
    extra_train: str = "",
) -> str:
    """A DeepFM config over the bursty stream's schema (``odl.datagen.bursty_stream``).

    Its five id features (user, item, category, device, hour) feed the wide part, FM (the
    user x item interaction) and the DNN.

    Args:
        model_dir: model directory.
        server: Kafka bootstrap servers.
        topic: sample topic.
        batch_size: samples per step.
        dim: embedding dimension.
        buckets: hash buckets per id feature.
        sparse_lr: Adagrad learning rate of the tables.
        dense_lr: Adam learning rate of the dense part.
        hidden_units: DNN layer sizes.
        extra_train: extra text inside train_config.

    Returns:
        The config text.
    """
    fields = "\n  ".join(
        ['input_fields { input_name: "sample_id" input_type: STRING }',
         'input_fields { input_name: "event_time" input_type: DOUBLE }',
         'input_fields { input_name: "label" input_type: INT32 }']
        + [f'input_fields {{ input_name: "{f}" input_type: STRING }}'
           for f in BURSTY_ID_FIELDS])
    feats = "\n".join(
        f'feature_configs {{ input_names: "{f}" feature_type: IdFeature embedding_dim: {dim} '
        f"hash_bucket_size: {min(buckets, 1024) if f in ('device', 'hour') else buckets} }}"
        for f in BURSTY_ID_FIELDS)
    names = " ".join(f'feature_names: "{f}"' for f in BURSTY_ID_FIELDS)
    return f"""
model_dir: "{model_dir}"
kafka_train_input {{ server: "{server}" topic: "{topic}" group: "odl_bursty" }}
data_config {{
  batch_size: {batch_size}
  {fields}
  label_fields: "label"
  sample_id_field: "sample_id"
  event_time_field: "event_time"
  batch_timeout_ms: 100
}}
{feats}
model_config {{
  model_class: "DeepFM"
  feature_groups {{ group_name: "wide" {names} wide_deep: WIDE }}
  feature_groups {{ group_name: "deep" {names} wide_deep: DEEP }}
  deepfm {{
    dnn {{ hidden_units: [{', '.join(str(h) for h in hidden_units)}] use_bn: false }}
    wide_output_dim: 1
  }}
}}
train_config {{
  optimizer_config {{ adagrad_optimizer {{
    learning_rate {{ constant_learning_rate {{ learning_rate: {sparse_lr} }} }} }} }}
  optimizer_config {{ adam_optimizer {{
    learning_rate {{ constant_learning_rate {{ learning_rate: {dense_lr} }} }} }} }}
  save_checkpoints_steps: 100000
  log_step_count_steps: 100
  {extra_train}
}}
"""


EXTRA_COLUMNS = ("", CONVERSION_FIELD, HISTORY_FIELD)


def records_with_column(column: str, stream: SyntheticCtrStream, batch: CtrBatch,
                        fmt: str = "csv") -> list[bytes]:
    """``batch``'s records with ``column`` after the stream's 42 columns.

    Args:
        column: ``""`` (the 42 columns only), ``"buy"`` (``odl.datagen.conversion_labels``,
            a second label) or ``"hist_C3"`` (``odl.datagen.behavior_history``).
        stream: the stream that made ``batch``.
        batch: the records.
        fmt: ``"csv"`` or ``"json"``.

    Returns:
        The encoded records.

    Raises:
        ValueError: another column.
    """
    if column == CONVERSION_FIELD:
        return encode_with_conversions(batch, stream.seed, fmt)
    if column == HISTORY_FIELD:
        return encode_with_history(stream, batch, fmt)
    if column:
        raise ValueError(f"no extra column {column!r}; one of {EXTRA_COLUMNS}")
    return batch.encode(fmt)
