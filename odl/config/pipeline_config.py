"""Loading, editing, validating and saving the pipeline config (``EasyRecConfig``).

The config is protobuf text format with Alibaba EasyRec's field names (``protos/pipeline.proto``).
Every problem is reported as a :class:`ConfigError` naming the field by its dotted path, e.g.
``invalid config field 'train_config.num_steps': expected an integer, got "abc"``.

* :func:`load_pipeline_config` reads a file, applies ``--edit_config_json`` and ``--model_dir``
  and rejects EasyRec fields and values that odl does not implement (never silently ignored).
* :func:`apply_edit_config_json` implements EasyRec's ``--edit_config_json`` paths: dotted
  fields, ``[i]`` indexes, ``[a:b]`` slices and ``[field=value]`` selectors.
* :func:`validate_pipeline_config` checks the cross-field rules a trainer relies on, the
  size bounds of :mod:`odl.config.limits`, finite floats and local paths (the checks
  against the machine are :mod:`odl.train.startup_checks`).
* :func:`config_to_text` / :func:`save_pipeline_config` write a config with secrets masked.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Union

from google.protobuf import message_factory, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.kafka.client_settings import SECRET_SETTING_MARKERS
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

__all__ = [
    "ConfigError",
    "EASYREC_NOT_IMPLEMENTED_FIELDS",
    "EASYREC_NOT_IMPLEMENTED_VALUES",
    "REDACTED",
    "SECRET_FIELD_MARKERS",
    "SUPPORTED_ACTIVATIONS",
    "apply_edit_config_json",
    "check_local_paths",
    "config_to_text",
    "embedded_feature",
    "feature_configs",
    "load_pipeline_config",
    "parse_dead_line",
    "parse_offset_info",
    "path_scheme",
    "save_pipeline_config",
    "validate_pipeline_config",
]

FeatureConfig = pipeline_pb2.FeatureConfig
_FT = pipeline_pb2.FeatureConfig.FeatureType
_FIELD_TYPE = pipeline_pb2.DatasetConfig.FieldType

_PACKAGE_PREFIX = "odl.protos."

# Fields of Alibaba EasyRec's (and TorchEasyRec's) pipeline config that odl does not implement,
# keyed by the odl message that would hold them. A config using one is rejected with "... is an
# EasyRec field that odl does not implement yet" instead of "unknown field". Remove a name from
# here when it is implemented (e.g. incr_save_config once the publisher lands).
EASYREC_NOT_IMPLEMENTED_FIELDS: dict[str, frozenset[str]] = {
    "EasyRecConfig": frozenset({
        "eval_config", "export_config", "datahub_train_input", "datahub_eval_input",
        "hive_train_input", "hive_eval_input", "binary_train_input", "binary_eval_input",
        "parquet_train_input", "parquet_eval_input", "odps_train_input", "odps_eval_input",
        "oss_train_input", "oss_eval_input", "fg_json_path",
    }),
    "KafkaServer": frozenset({"consumer", "sink"}),
    "DatasetConfig": frozenset({
        "auto_expand_input_fields", "label_sep", "label_dim", "extra_label_func", "shuffle",
        "shuffle_buffer_size", "prefetch_size", "shard", "file_shard", "num_parallel_calls",
        "selected_cols", "selected_col_types", "rtp_separator", "ignore_error",
        "pai_worker_queue", "pai_worker_slice_num", "chief_redundant", "sample_weight",
        "data_compression_type", "n_data_batch_tfrecord", "with_header", "feature_fields",
        "negative_sampler", "negative_sampler_v2", "hard_negative_sampler",
        "hard_negative_sampler_v2", "negative_sampler_in_memory", "eval_batch_size",
        "drop_remainder", "fg_encoded", "fg_encoded_multival_sep",
        "dataset_type", "fg_mode", "fg_threads",
    }),
    "DatasetConfig.Field": frozenset({
        "input_dim", "input_shape", "user_define_fn", "user_define_fn_path",
        "user_define_fn_res_type", "ignore_val",
    }),
    "FeatureConfigV2": frozenset({"embedding_on_cpu"}),
    "FeatureConfig": frozenset({
        "kv_separator", "seq_multi_sep", "max_seq_len", "vocab_file", "vocab_list",
        "shared_names", "lookup_max_sel_elem_num", "max_partitions", "initializer",
        "precision", "min_val", "max_val", "normalizer_fn", "sequence_combiner",
        "sub_feature_type", "sequence_length", "expression", "ev_params", "combo_input_seps",
        # TorchEasyRec's per-kind feature messages.
        "id_feature", "raw_feature", "combo_feature", "lookup_feature", "match_feature",
        "expr_feature", "overlap_feature", "tokenize_feature", "custom_feature",
        "sequence_feature", "sequence_id_feature", "sequence_raw_feature", "bool_mask_feature",
    }),
    "FeatureGroupConfig": frozenset({"sequence_features", "negative_sampler", "group_type"}),
    "EasyRecModel": frozenset({
        "model_name", "model_params", "dummy", "wide_and_deep", "multi_tower", "fm", "dcn",
        "autoint", "dlrm", "cmbf", "uniter", "multi_tower_recall", "dssm", "mind",
        "dropoutnet", "metric_learning", "pdn", "dssm_senet", "dat", "mmoe", "esmm", "dbmtl",
        "simple_multi_task", "ple", "rocket_launching", "seq_att_groups", "ev_params", "kd",
        "restore_filters", "variational_dropout", "loss_weight_strategy", "backbone",
        "label_name", "din", "bst", "dien", "masknet", "fibinet", "ppnet", "wukong",
        "rank_model", "metrics", "train_metrics",
    }),
    "Loss": frozenset({
        "loss_name", "f1_reweighted_loss", "softmax_loss", "circle_loss", "multi_simi_loss",
        "binary_focal_loss", "pairwise_loss", "pairwise_focal_loss", "pairwise_logistic_loss",
        "jrc_loss", "pairwise_hinge_loss", "listwise_rank_loss", "listwise_distill_loss",
    }),
    "DNN": frozenset({"use_final_bn", "final_activation", "use_final_bias", "use_bias"}),
    "TrainConfig": frozenset({
        "gradient_clipping_by_norm", "sync_replicas", "sparse_accumulator_type",
        "startup_delay_steps", "save_summary_steps", "is_profiling",
        "force_restore_shape_compatible", "train_distribute", "num_gpus_per_worker",
        "summary_model_vars", "protocol", "inter_op_parallelism_threads",
        "intra_op_parallelism_threads", "tensor_fuse", "write_graph", "freeze_gradient",
        "num_epochs", "use_moving_average", "moving_average_decay",
        "save_checkpoints_epochs", "fine_tune_ckpt_param_map", "use_tensorboard",
        "tensorboard_summaries", "cudnn_allow_tf32", "cuda_matmul_allow_tf32",
        "global_embedding_constraints", "mixed_precision", "grad_scaler",
        "gradient_accumulation_steps",
    }),
    "IncrementSaveConfig": frozenset({"debug_save_update", "datahub"}),
    "IncrementSaveConfig.Kafka.Consumer": frozenset({"config_topic", "config_global", "timeout"}),
    "IncrementSaveConfig.File": frozenset({"relative", "mount_path"}),
    "OptimizerConfig": frozenset({
        "rms_prop_optimizer", "momentum_optimizer", "momentumw_optimizer", "adamw_optimizer",
        "adam_async_optimizer", "adam_asyncw_optimizer", "ftrl_optimizer",
        "lazy_adam_optimizer", "use_moving_average", "moving_average_decay",
        "embedding_learning_rate_multiplier",
    }),
    "LearningRate": frozenset({
        "manual_step_learning_rate", "cosine_decay_learning_rate", "poly_decay_learning_rate",
        "transformer_learning_rate",
    }),
    "ExponentialDecayLearningRate": frozenset({"burnin_learning_rate", "burnin_steps"}),
    "SparseOptimizer": frozenset({
        "lars_sgd_optimizer", "lamb_optimizer", "partial_rowwise_adam_optimizer",
        "partial_rowwise_lamb_optimizer", "rowwise_adagrad_optimizer_with_decay",
        "manual_step_learning_rate", "cosine_decay_learning_rate",
    }),
    "DenseOptimizer": frozenset({
        "adamw_optimizer", "manual_step_learning_rate", "cosine_decay_learning_rate",
    }),
}

# Enum values of EasyRec that odl's enums lack, keyed by odl's enum (short name).
EASYREC_NOT_IMPLEMENTED_VALUES: dict[str, frozenset[str]] = {
    "FeatureConfig.FeatureType": frozenset({
        "TagFeature", "LookupFeature", "SequenceFeature", "ExprFeature", "PassThroughFeature",
    }),
    "DatasetConfig.InputType": frozenset({
        "CSVInputV2", "CSVInputEx", "OdpsInput", "OdpsInputV2", "OdpsInputV3", "DataHubInput",
        "RTPInput", "RTPInputV2", "OdpsRTPInput", "OdpsRTPInputV2", "TFRecordInput",
        "BatchTFRecordInput", "DummyInput", "HiveInput", "HiveRTPInput", "HiveParquetInput",
        "ParquetInputV2", "ParquetInputV3", "CriteoInput",
    }),
    "LossType": frozenset({
        "L2_LOSS", "SIGMOID_L2_LOSS", "CROSS_ENTROPY_LOSS", "SOFTMAX_CROSS_ENTROPY",
        "CIRCLE_LOSS", "MULTI_SIMILARITY_LOSS", "SOFTMAX_CROSS_ENTROPY_WITH_NEGATIVE_MINING",
        "PAIR_WISE_LOSS", "PAIRWISE_LOSS", "PAIRWISE_FOCAL_LOSS", "PAIRWISE_LOGISTIC_LOSS",
        "JRC_LOSS", "F1_REWEIGHTED_LOSS", "BINARY_FOCAL_LOSS", "BINARY_CROSS_ENTROPY_LOSS",
        "ZILN_LOSS", "PAIRWISE_HINGE_LOSS", "LISTWISE_RANK_LOSS", "LISTWISE_DISTILL_LOSS",
        "KL_DIVERGENCE_LOSS",
    }),
}

# Model classes odl implements (EasyRecModel.model_class).
IMPLEMENTED_MODEL_CLASSES = ("DeepFM",)

# DNN.activation values the model builder accepts.
SUPPORTED_ACTIVATIONS = frozenset({"relu", "tf.nn.relu"})

# Secrets. A string field, or a value in a string map (kafka_config), is masked by
# config_to_text / save_pipeline_config when its field name or map key contains one of these
# markers (case-insensitive). Add markers here for new secret fields (DataHub akSecret and OSS
# access key secrets are already covered by "secret").
SECRET_FIELD_MARKERS: tuple[str, ...] = tuple(SECRET_SETTING_MARKERS) + (
    "aksecret", "access_key_secret", "accesskeysecret", "sasl_password",
    "jaas",  # Java clients' sasl.jaas.config embeds the password
)
REDACTED = "***"

_EMBEDDED_TYPES = (_FT.IdFeature, _FT.ComboFeature)
_NUMERIC_FIELD_TYPES = (
    _FIELD_TYPE.INT32, _FIELD_TYPE.INT64, _FIELD_TYPE.FLOAT, _FIELD_TYPE.DOUBLE, _FIELD_TYPE.BOOL,
)
_DEAD_LINE_FORMAT = "%Y%m%d %H:%M:%S"
_URL_SCHEME = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]*)://")


# --------------------------------------------------------------------------- loading


def load_pipeline_config(
    path: str,
    edit_config_json: Union[str, dict, None] = None,
    model_dir: str | None = None,
) -> pipeline_pb2.EasyRecConfig:
    """Read a pipeline config in protobuf text format.

    Steps: parse ``path``; apply ``edit_config_json`` (EasyRec's ``--edit_config_json``);
    override ``model_dir``; infer ``model_config.model_class`` ("DeepFM") when only the
    ``deepfm`` message is given (TorchEasyRec style); reject EasyRec values odl does not
    implement. Cross-field checks are :func:`validate_pipeline_config`'s job.

    Args:
        path: the config file.
        edit_config_json: JSON text or a dict of ``{"dotted.path": value}`` edits.
        model_dir: when given, replaces ``model_dir`` (like EasyRec's ``--model_dir``).

    Returns:
        The parsed config.

    Raises:
        ConfigError: the file is missing or unreadable, does not parse, uses a field odl does
            not know or implement, or an edit is invalid.

    """
    if not path:
        raise ConfigError("pipeline_config_path", "no pipeline config file given")
    if not os.path.isfile(path):
        raise ConfigError("pipeline_config_path", f"file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("pipeline_config_path", f"cannot read {path}: {e}") from None
    config = parse_pipeline_config_text(text, source=path)
    if edit_config_json is not None:
        apply_edit_config_json(config, edit_config_json)
    if model_dir:
        config.model_dir = model_dir
    _normalize(config)
    check_implemented(config)
    logger.debug("loaded pipeline config %s", path)
    return config


def parse_pipeline_config_text(text: str, source: str = "<text>") -> pipeline_pb2.EasyRecConfig:
    """Parse config text, turning protobuf's ParseError into a :class:`ConfigError`.

    Args:
        text: protobuf text format.
        source: name used in messages (the file path).

    Returns:
        The parsed config (not normalized, not validated).

    Raises:
        ConfigError: naming the field and the line:column of the problem.

    """
    config = pipeline_pb2.EasyRecConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as e:
        raise _parse_error_to_config_error(e, text, source) from None
    except RecursionError:
        raise ConfigError("pipeline_config_path",
                          f"{source} is nested too deeply to parse") from None
    return config


def _parse_error_to_config_error(
    err: text_format.ParseError, text: str, source: str
) -> ConfigError:
    line, col = err.GetLine(), err.GetColumn()
    raw = str(err)
    lines = text.split("\n")
    detail = re.sub(r"^\d+:\d+ : ", "", raw)
    if line and 0 < line <= len(lines):
        quoted = f"'{lines[line - 1]}': "
        if detail.startswith(quoted):  # protobuf echoes the line; it may hold a secret
            detail = detail[len(quoted):]
    detail = re.sub(r"^'.*?': ", "", detail)
    where = f"{source}:{line}:{col}" if line else source
    prefix, last_name = _locate_path(text, line, col) if line else ("", "")
    line_text = lines[line - 1] if line and 0 < line <= len(lines) else ""
    # protobuf echoes the offending token, which may be a secret value: not on such lines.
    sensitive = _may_hold_secret(_join(prefix, last_name), line_text)

    m = re.search(r'Message type "([\w.]+)" has no field named "(\w+)"', detail)
    if m:
        msg_name, field = _short(m.group(1)), m.group(2)
        path = _join(prefix, field)
        if field in EASYREC_NOT_IMPLEMENTED_FIELDS.get(msg_name, ()):
            return ConfigError(path, f"{field} is an EasyRec field that odl does not implement "
                                     f"yet (at {where})")
        hint = _suggest(field, _message_descriptor(msg_name))
        return ConfigError(path, f"unknown field {field!r} in {msg_name}{hint} (at {where})")

    m = re.search(r'multiple "(\w+)" fields|Field "(\w+)" is specified along with', detail)
    if m:
        last_name = m.group(1) or m.group(2)
    path = _join(prefix, last_name) or "<config>"
    m = re.search(r'Enum type "([\w.]+)" has no value named (\w+)', detail)
    if m:
        enum_name, value = _short(m.group(1)), m.group(2)
        if value in EASYREC_NOT_IMPLEMENTED_VALUES.get(enum_name, ()):
            return ConfigError(path, f"{value} is an EasyRec value that odl does not implement "
                                     f"yet (at {where})")
        allowed = _enum_names(enum_name)
        return ConfigError(path, f"unknown value {value!r}, expected one of {allowed} "
                                 f"(at {where})")
    m = re.match(r"Couldn't parse (integer|float|double|boolean|bool)\w*: (.*)$", detail)
    if m:
        kind = {"integer": "an integer", "boolean": "true or false", "bool": "true or false"}
        wanted = kind.get(m.group(1), "a number")
        got = m.group(2)
        if not got.startswith('"'):
            got = f'"{got}"'
        if sensitive:
            got = REDACTED
        return ConfigError(path, f"expected {wanted}, got {got} (at {where})")
    if sensitive:
        detail = _mask_values(detail)
    return ConfigError(path, f"{detail[:1].lower()}{detail[1:]} (at {where})")


def _may_hold_secret(path: str, text: str) -> bool:
    """Whether an error about ``path`` (or config ``text``) could echo a secret value."""
    return ("kafka_config" in path or _is_secret_name(path.rsplit(".", 1)[-1])
            or "kafka_config" in text or _is_secret_name(text))


def _mask_values(detail: str) -> str:
    """Cuts a parser message at its first quote: what follows echoes the input."""
    m = re.search(r"['\"]", detail)
    return detail if m is None else detail[:m.start()].rstrip() + " " + REDACTED


def _short(full_name: str) -> str:
    return full_name[len(_PACKAGE_PREFIX):] if full_name.startswith(_PACKAGE_PREFIX) else full_name


def _message_descriptor(short_name: str) -> Descriptor | None:
    desc: Any = pipeline_pb2.DESCRIPTOR
    parts = short_name.split(".")
    found = desc.message_types_by_name.get(parts[0])
    for part in parts[1:]:
        if found is None:
            return None
        found = found.nested_types_by_name.get(part)
    return found


def _enum_names(short_name: str) -> list[str]:
    parts = short_name.split(".")
    if len(parts) == 1:
        enum = pipeline_pb2.DESCRIPTOR.enum_types_by_name.get(parts[0])
    else:
        msg = _message_descriptor(".".join(parts[:-1]))
        enum = msg.enum_types_by_name.get(parts[-1]) if msg else None
    return [v.name for v in enum.values] if enum else []


def _suggest(name: str, desc: Descriptor | None) -> str:
    if desc is None:
        return ""
    close = difflib.get_close_matches(name, list(desc.fields_by_name), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _join(prefix: str, name: str) -> str:
    if not name:
        return prefix
    return f"{prefix}.{name}" if prefix else name


_TOKEN_RE = re.compile(
    r"""(?P<ws>\s+)|(?P<comment>\#[^\n]*)
      |(?P<str>"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?)
      |(?P<punct>[{}<>:\[\],;])
      |(?P<word>[^\s{}<>:\[\],;"'\#]+)""",
    re.X,
)


def _locate_path(text: str, line: int, col: int) -> tuple[str, str]:
    """Find the enclosing message path and the last field name before a text position.

    A small tokenizer over protobuf text format, used only to name the field in parse errors.

    Returns:
        ``(path of the enclosing message, e.g. "feature_configs[3]", last field name seen)``.

    """
    lines = text.split("\n")
    offset = sum(len(ln) + 1 for ln in lines[: line - 1]) + max(col - 1, 0)
    root: dict[str, Any] = {"desc": pipeline_pb2.EasyRecConfig.DESCRIPTOR, "path": "",
                            "counts": {}, "ret": "name"}
    stack = [root]
    state, last_name, list_depth = "name", "", 0

    def push(ret: str) -> None:
        frame = stack[-1]
        desc = frame["desc"]
        fd = desc.fields_by_name.get(last_name) if desc is not None else None
        seg = last_name
        if fd is not None and fd.is_repeated and not _is_map(fd):
            idx = frame["counts"].get(last_name, 0)
            frame["counts"][last_name] = idx + 1
            seg = f"{last_name}[{idx}]"
        sub = fd.message_type if fd is not None else None
        stack.append({"desc": sub, "path": _join(frame["path"], seg), "counts": {}, "ret": ret,
                      "name": last_name})

    for m in _TOKEN_RE.finditer(text):
        if m.start() >= offset:
            break
        kind, tok = m.lastgroup, m.group()
        if kind in ("ws", "comment"):
            continue
        if state == "name":
            if kind == "word":
                last_name, state = tok, "after_name"
            elif tok in "}>" and len(stack) > 1:
                frame = stack.pop()
                last_name, state = frame["name"], frame["ret"]
        elif state == "after_name":
            if tok == ":":
                state = "value"
            elif tok in "{<":
                push("name")
                state = "name"
            else:
                state = "name"
        elif state == "value":
            if tok in "{<":
                push("name")
                state = "name"
            elif tok == "[":
                state, list_depth = "list", 1
            else:
                state = "name"
        elif state == "list":
            if tok in "{<":
                push("list")
                state = "name"
            elif tok == "[":
                list_depth += 1
            elif tok == "]":
                list_depth -= 1
                if list_depth == 0:
                    state = "name"
    return stack[-1]["path"], last_name


def _normalize(config: pipeline_pb2.EasyRecConfig) -> None:
    mc = config.model_config
    if config.HasField("model_config") and not mc.model_class and mc.HasField("deepfm"):
        mc.model_class = "DeepFM"


def check_implemented(config: pipeline_pb2.EasyRecConfig) -> None:
    """Rejects EasyRec values that parse but that odl does not implement.

    Args:
        config: a parsed config.

    Raises:
        ConfigError: e.g. a model_class other than DeepFM, or num_class != 1.

    """
    mc = config.model_config
    if mc.model_class and mc.model_class not in IMPLEMENTED_MODEL_CLASSES:
        raise ConfigError("model_config.model_class",
                          f"model class {mc.model_class!r} is an EasyRec value that odl does not "
                          f"implement yet (implemented: {', '.join(IMPLEMENTED_MODEL_CLASSES)})")
    if mc.num_class != 1:
        raise ConfigError("model_config.num_class",
                          f"num_class {mc.num_class} is an EasyRec value that odl does not "
                          "implement yet (only 1: binary classification)")
    if len(config.data_config.label_fields) > 1:
        raise ConfigError("data_config.label_fields",
                          "several label fields (multi-task) is an EasyRec feature that odl does "
                          "not implement yet; give exactly one")


# --------------------------------------------------------------------------- edit_config_json


def apply_edit_config_json(
    config: Message, edits: Union[str, dict[str, Any]]
) -> None:
    """Apply EasyRec-style ``--edit_config_json`` edits in place.

    Keys are dotted paths into the config, values the new values::

        {"train_config.num_steps": 10}
        {"kafka_train_input.server": "h:9092"}
        {"feature_configs[0].boundaries": [1, 2, 3]}          # repeated: replaced
        {"model_config.feature_groups[1].feature_names": ["a", "b"]}
        {"train_config": {"num_steps": 10}}                    # nested: merged
        {"feature_configs[input_names[0]=C1].embedding_dim": 8}  # selector
        {"feature_configs[:3].embedding_dim": 8}               # slice
        {"data_config.input_fields[0].input_type": "STRING"}   # enum by name
        {"kafka_train_input.kafka_config": {"security.protocol": "SASL_SSL"}}  # map: updated

    Selectors ``[lhs OP value]`` (OP one of ``= != >= <= > <``) select every element whose
    ``lhs`` (a path relative to the element) compares true; ``feature_configs`` paths also
    reach ``feature_config.features`` when the config uses that form. A JSON ``null`` clears a
    field (or removes a map key). A message may also be given as protobuf text.

    Args:
        config: the config (any message; normally ``EasyRecConfig``).
        edits: JSON text or an already decoded dict.

    Raises:
        ConfigError: malformed JSON, unknown path, index out of range, or a value of the wrong
            type; ``field`` is the path as written in the edit.

    """
    if isinstance(edits, (str, bytes)):
        try:
            edits = json.loads(edits)
        except RecursionError:
            raise ConfigError("edit_config_json",
                              f"nested too deeply (at most {limits.MAX_EDIT_JSON_DEPTH} "
                              "levels)") from None
        except ValueError as e:
            raise ConfigError("edit_config_json", f"not valid JSON: {e}") from None
    if not isinstance(edits, dict):
        raise ConfigError("edit_config_json",
                          f"expected a JSON object of path: value, got {type(edits).__name__}")
    depth = _json_depth(edits)
    if depth > limits.MAX_EDIT_JSON_DEPTH:
        raise ConfigError("edit_config_json",
                          f"nested {depth} levels deep (at most {limits.MAX_EDIT_JSON_DEPTH})")
    try:
        for key, value in edits.items():
            _apply_edit(config, str(key), value, "")
    except RecursionError:
        raise ConfigError("edit_config_json", "nested too deeply") from None


def _json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0), computed without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            items = list(item.values())
        elif isinstance(item, list):
            items = item
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
        if deepest > limits.MAX_EDIT_JSON_DEPTH:
            return deepest
        stack.extend((sub, depth + 1) for sub in items)
    return deepest


def _apply_edit(msg: Message, key: str, value: Any, prefix: str) -> None:
    full = _join(prefix, key)
    segments = _split_path(key, full)
    if (segments and segments[0][0] == "feature_configs"
            and isinstance(msg, pipeline_pb2.EasyRecConfig)
            and not msg.feature_configs and msg.feature_config.features):
        segments = [("feature_config", []), ("features", segments[0][1]), *segments[1:]]
    for parent, fd, index in _resolve(msg, segments, full):
        _set_value(parent, fd, index, value, full)


def _split_path(key: str, full: str) -> list[tuple[str, list[str]]]:
    """Split ``a.b[0].c[x[1]=y]`` into ``[("a", []), ("b", ["0"]), ("c", ["x[1]=y"])]``."""
    segments: list[tuple[str, list[str]]] = []
    i, n = 0, len(key)
    while i < n:
        m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", key[i:])
        if not m:
            raise ConfigError(full, f"malformed path at {key[i:]!r}")
        name = m.group()
        i += len(name)
        selectors: list[str] = []
        while i < n and key[i] == "[":
            depth, j = 0, i
            while j < n:
                if key[j] == "[":
                    depth += 1
                elif key[j] == "]":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if j >= n:
                raise ConfigError(full, "unbalanced '[' in path")
            selectors.append(key[i + 1:j].strip())
            i = j + 1
        segments.append((name, selectors))
        if i < n:
            if key[i] != ".":
                raise ConfigError(full, f"malformed path at {key[i:]!r}")
            i += 1
            if i == n:
                raise ConfigError(full, "path ends with '.'")
    if not segments:
        raise ConfigError(full or "edit_config_json", "empty path")
    return segments


def _field(msg: Message, name: str, full: str) -> FieldDescriptor:
    desc = msg.DESCRIPTOR
    fd = desc.fields_by_name.get(name)
    if fd is not None:
        return fd
    short = _short(desc.full_name)
    if name in EASYREC_NOT_IMPLEMENTED_FIELDS.get(short, ()):
        raise ConfigError(full, f"{name} is an EasyRec field that odl does not implement yet")
    raise ConfigError(full, f"unknown field {name!r} in {short}{_suggest(name, desc)}")


def _resolve(
    msg: Message, segments: list[tuple[str, list[str]]], full: str
) -> list[tuple[Message, FieldDescriptor, int | None]]:
    current = [msg]
    for pos, (name, selectors) in enumerate(segments):
        last = pos == len(segments) - 1
        targets: list[tuple[Message, FieldDescriptor, int | None]] = []
        for parent in current:
            fd = _field(parent, name, full)
            if selectors:
                if not fd.is_repeated or _is_map(fd):
                    raise ConfigError(full, f"{name} is not a repeated field; it takes no [...]")
                if len(selectors) > 1:
                    raise ConfigError(full, f"{name}: only one [...] is supported")
                container = getattr(parent, name)
                for idx in _select(container, fd, selectors[0], full):
                    targets.append((parent, fd, idx))
            else:
                targets.append((parent, fd, None))
        if last:
            return targets
        nxt: list[Message] = []
        for parent, fd, idx in targets:
            if fd.cpp_type != FieldDescriptor.CPPTYPE_MESSAGE or _is_map(fd):
                raise ConfigError(full, f"{fd.name} is not a message; cannot go into it")
            if idx is None and fd.is_repeated:
                raise ConfigError(full, f"{fd.name} is repeated; select elements with [i], "
                                        f"[a:b] or [field=value]")
            nxt.append(getattr(parent, fd.name) if idx is None else getattr(parent, fd.name)[idx])
        current = nxt
    return []


_SELECTOR_OPS = (">=", "<=", "!=", "=", ">", "<")


def _select(container: Any, fd: FieldDescriptor, selector: str, full: str) -> list[int]:
    size = len(container)
    if re.fullmatch(r"-?\d+", selector):
        idx = int(selector)
        if idx < 0:
            idx += size
        if not 0 <= idx < size:
            raise ConfigError(full, f"index {selector} out of range ({fd.name} has {size} "
                                    f"element{'s' if size != 1 else ''})")
        return [idx]
    m = re.fullmatch(r"(-?\d*)\s*:\s*(-?\d*)", selector)
    if m:
        lo = int(m.group(1)) if m.group(1) else None
        hi = int(m.group(2)) if m.group(2) else None
        return list(range(size))[lo:hi]
    op_pos, op = _find_operator(selector)
    if op_pos < 0:
        raise ConfigError(full, f"bad selector [{selector}]: expected an index, a slice or "
                                f"field=value")
    if fd.cpp_type != FieldDescriptor.CPPTYPE_MESSAGE:
        raise ConfigError(full, f"selector [{selector}] needs a repeated message field")
    lhs = selector[:op_pos].strip()
    rhs = selector[op_pos + len(op):].strip()
    if len(rhs) >= 2 and rhs[0] == rhs[-1] and rhs[0] in "'\"":
        rhs = rhs[1:-1]
    lhs_segments = _split_path(lhs, full)
    chosen = []
    for i, element in enumerate(container):
        values = list(_read_values(element, lhs_segments, full))
        if any(_compare(v, op, rhs) for v in values):
            chosen.append(i)
    if not chosen:
        raise ConfigError(full, f"selector [{selector}] matched no element of {fd.name}")
    return chosen


def _find_operator(selector: str) -> tuple[int, str]:
    depth = 0
    for i, ch in enumerate(selector):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif depth == 0:
            for op in _SELECTOR_OPS:
                if selector.startswith(op, i):
                    return i, op
    return -1, ""


def _read_values(msg: Message, segments: list[tuple[str, list[str]]], full: str) -> Iterator[Any]:
    """Values at a relative path (for selectors); repeated fields yield every element."""
    name, selectors = segments[0]
    fd = _field(msg, name, full)
    value = getattr(msg, name)
    if isinstance(msg, FeatureConfig) and name == "feature_name" and not value \
            and msg.input_names:
        value = msg.input_names[0]  # the effective name, as feature_configs() reports it
    if fd.is_repeated and not _is_map(fd):
        items = list(value)
        if selectors:
            sel = selectors[0]
            if re.fullmatch(r"-?\d+", sel):
                idx = int(sel)
                items = [items[idx]] if -len(items) <= idx < len(items) else []
            else:
                items = [items[i] for i in _select(value, fd, sel, full)]
    else:
        items = [value]
    for item in items:
        if len(segments) > 1:
            if not isinstance(item, Message):
                raise ConfigError(full, f"{name} is not a message")
            yield from _read_values(item, segments[1:], full)
        elif fd.enum_type is not None:
            yield fd.enum_type.values_by_number[item].name if item in \
                fd.enum_type.values_by_number else item
        else:
            yield item


def _compare(value: Any, op: str, rhs: str) -> bool:
    if isinstance(value, bool):
        left: Any = value
        right: Any = rhs.lower() in ("true", "1")
    elif isinstance(value, (int, float)):
        try:
            left, right = float(value), float(rhs)
        except ValueError:
            return False
    else:
        left, right = str(value), rhs
    if op == "=":
        return left == right
    if op == "!=":
        return left != right
    try:
        return {">": left > right, "<": left < right, ">=": left >= right,
                "<=": left <= right}[op]
    except TypeError:
        return False


def _is_map(fd: FieldDescriptor) -> bool:
    return (fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE and fd.is_repeated
            and fd.message_type.GetOptions().map_entry)


def _set_value(parent: Message, fd: FieldDescriptor, index: int | None, value: Any,
               full: str) -> None:
    name = fd.name
    if _is_map(fd):
        if value is None:
            parent.ClearField(name)
            return
        if not isinstance(value, dict):
            raise ConfigError(full, "expected an object of key: value, got a "
                                    f"{type(value).__name__}")  # the value may be a secret
        mapping = getattr(parent, name)
        value_fd = fd.message_type.fields_by_name["value"]
        for k, v in value.items():
            if v is None:
                mapping.pop(str(k), None)
            elif value_fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                _merge_message(mapping[str(k)], v, f"{full}.{k}")
            else:
                mapping[str(k)] = _convert_scalar(value_fd, v, f"{full}.{k}", secret_ok=True)
        return
    is_msg = fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE
    if fd.is_repeated and index is None:
        if value is None:
            parent.ClearField(name)
            return
        items = value if isinstance(value, list) else [value]
        if is_msg:
            if not isinstance(value, list):
                raise ConfigError(full, f"expected a list of objects, got {_describe(value)}")
            cls = message_factory.GetMessageClass(fd.message_type)
            new_msgs = []
            for i, item in enumerate(items):
                sub = cls()
                _merge_message(sub, item, f"{full}[{i}]")
                new_msgs.append(sub)
            parent.ClearField(name)
            getattr(parent, name).extend(new_msgs)
        else:
            converted = [_convert_scalar(fd, v, f"{full}[{i}]") for i, v in enumerate(items)]
            parent.ClearField(name)
            getattr(parent, name).extend(converted)
        return
    if is_msg:
        target = getattr(parent, name) if index is None else getattr(parent, name)[index]
        if value is None:
            if index is not None:
                raise ConfigError(full, "null cannot remove one element; give the whole list")
            parent.ClearField(name)
            return
        _merge_message(target, value, full)
        return
    if value is None:
        if index is not None:
            raise ConfigError(full, "null cannot remove one element; give the whole list")
        parent.ClearField(name)
        return
    if isinstance(value, (list, dict)):
        raise ConfigError(full, f"expected a single value, got {_describe(value)}")
    converted = _convert_scalar(fd, value, full)
    if index is None:
        setattr(parent, name, converted)
    else:
        getattr(parent, name)[index] = converted


def _merge_message(target: Message, value: Any, full: str) -> None:
    if isinstance(value, dict):
        target.SetInParent()
        for k, v in value.items():
            _apply_edit(target, str(k), v, full)
    elif isinstance(value, str):
        replacement = type(target)()
        try:
            text_format.Parse(value, replacement)
        except text_format.ParseError as e:
            detail = _mask_values(str(e)) if _may_hold_secret(full, value) else str(e)
            raise ConfigError(full, f"cannot parse message text: {detail}") from None
        target.CopyFrom(replacement)
    else:
        raise ConfigError(full, f"expected an object, got {_describe(value)}")


_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


def _describe(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _convert_scalar(fd: FieldDescriptor, value: Any, full: str, secret_ok: bool = False) -> Any:
    ct = fd.cpp_type
    got = "a value" if secret_ok else _describe(value)
    if ct in _INT_RANGES:
        out: Any = None
        if isinstance(value, bool):
            out = None
        elif isinstance(value, int):
            out = value
        elif isinstance(value, float) and value.is_integer():
            out = int(value)
        elif isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+\s*", value):
            out = int(value)
        if out is None:
            raise ConfigError(full, f"expected an integer, got {got}")
        lo, hi = _INT_RANGES[ct]
        if not lo <= out <= hi:
            raise ConfigError(full, f"value out of range [{lo}, {hi}]: {out}")
        return out
    if ct in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(full, f"expected a number, got {got}")
    if ct == FieldDescriptor.CPPTYPE_BOOL:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ConfigError(full, f"expected true or false, got {got}")
    if ct == FieldDescriptor.CPPTYPE_ENUM:
        enum = fd.enum_type
        if isinstance(value, str) and value in enum.values_by_name:
            return enum.values_by_name[value].number
        if isinstance(value, int) and not isinstance(value, bool) and \
                value in enum.values_by_number:
            return value
        short = _short(enum.full_name)
        if isinstance(value, str) and value in EASYREC_NOT_IMPLEMENTED_VALUES.get(short, ()):
            raise ConfigError(full, f"{value} is an EasyRec value that odl does not implement yet")
        names = [v.name for v in enum.values]
        raise ConfigError(full, f"expected one of {names}, got {got}")
    if ct == FieldDescriptor.CPPTYPE_STRING:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(full, f"expected a string, got {got}")
    raise ConfigError(full, f"cannot set a field of this type to {got}")


# --------------------------------------------------------------------------- features


def feature_configs(config: pipeline_pb2.EasyRecConfig) -> list[FeatureConfig]:
    """Return the features of a config from whichever form it uses, with names filled in.

    Args:
        config: the config.

    Returns:
        Copies of the feature configs; ``feature_name`` defaults to ``input_names[0]``.

    Raises:
        ConfigError: both ``feature_configs`` and ``feature_config.features`` are used.

    """
    if config.feature_configs and config.feature_config.features:
        raise ConfigError("feature_config",
                          "give features either as top-level feature_configs or as "
                          "feature_config { features {...} }, not both")
    out = []
    for fc in list(config.feature_configs) or list(config.feature_config.features):
        copy = FeatureConfig()
        copy.CopyFrom(fc)
        if not copy.feature_name and copy.input_names:
            copy.feature_name = copy.input_names[0]
        out.append(copy)
    return out


def _feature_prefix(config: pipeline_pb2.EasyRecConfig) -> str:
    return "feature_configs" if config.feature_configs else "feature_config.features"


def embedded_feature(fc: FeatureConfig) -> bool:
    """Whether a feature is looked up in an embedding table (vs. a dense raw value).

    Args:
        fc: a feature config.

    Returns:
        True for IdFeature, ComboFeature and RawFeature with boundaries.

    """
    return fc.feature_type in _EMBEDDED_TYPES or (
        fc.feature_type == _FT.RawFeature and len(fc.boundaries) > 0)


# --------------------------------------------------------------------------- helpers


def parse_offset_info(
    text: str, field: str = "kafka_train_input.offset_info"
) -> tuple[str, Any] | None:
    """Parse a Kafka ``offset_info`` JSON string.

    Args:
        text: ``{"timestamp": <unix seconds>}`` or ``{"<partition>": <offset>, ...}``;
            empty means "not set".
        field: field path used in errors.

    Returns:
        ``("timestamp", seconds: float)``, ``("offsets", {partition: offset})`` or None.

    Raises:
        ConfigError: not JSON, or not one of the two forms.

    """
    if text is None or not text.strip():
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(field, f"not valid JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(field, 'expected {"timestamp": <unix seconds>} or '
                                 '{"<partition>": <offset>, ...}')
    if "timestamp" in data:
        ts = data["timestamp"]
        if len(data) != 1:
            raise ConfigError(field, '"timestamp" cannot be combined with partition offsets')
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) \
                or ts < 0:
            raise ConfigError(field, f"timestamp must be a non-negative number of unix seconds, "
                                     f"got {_describe(ts)}")
        if ts > 1e11:
            raise ConfigError(field, f"timestamp {ts} looks like milliseconds; give unix seconds")
        return ("timestamp", float(ts))
    offsets: dict[int, int] = {}
    for key, value in data.items():
        if not re.fullmatch(r"\d+", str(key)):
            raise ConfigError(field, f"key {key!r} is neither \"timestamp\" nor a partition "
                                     f"number")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(field, f"offset of partition {key} must be a non-negative "
                                     f"integer, got {_describe(value)}")
        offsets[int(key)] = value
    return ("offsets", offsets)


def parse_dead_line(text: str, field: str = "train_config.dead_line") -> float | None:
    """Parse ``train_config.dead_line``.

    Args:
        text: ``"%Y%m%d %H:%M:%S"`` in local time (EasyRec's form, e.g. ``20260508 23:59:59``)
            or unix seconds; empty means "not set".
        field: field path used in errors.

    Returns:
        Unix seconds, or None when empty.

    Raises:
        ConfigError: neither form.

    """
    if text is None or not text.strip():
        return None
    text = text.strip()
    try:
        return time.mktime(time.strptime(text, _DEAD_LINE_FORMAT))
    except (ValueError, OverflowError):
        pass
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(field, f"expected \"YYYYmmdd HH:MM:SS\" or unix seconds, got "
                                 f"{text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(field, f"expected non-negative unix seconds, got {text!r}")
    return value


# --------------------------------------------------------------------------- validation


def validate_pipeline_config(config: pipeline_pb2.EasyRecConfig, online: bool) -> None:
    """Check the cross-field rules the trainer relies on; raises on the first problem.

    Args:
        config: a loaded config.
        online: True for ``odl-train --online`` (Kafka input), False for file input.

    Raises:
        ConfigError: naming the offending field.

    """
    check_implemented(config)
    _check_finite(config, "")
    if not config.model_dir:
        raise ConfigError("model_dir", "required (set it in the config or pass --model_dir)")
    check_local_paths(config, online)
    if online:
        _validate_kafka(config)
    else:
        _validate_offline_input(config)
    fields = _validate_data_config(config)
    features = _validate_features(config, fields)
    _validate_model(config, features)
    _validate_train(config)


def _check_finite(msg: Message, prefix: str) -> None:
    """Refuses inf / nan in every float and double field (learning rates, weights, ...)."""
    for fd, value in msg.ListFields():
        path = _join(prefix, fd.name)
        if _is_map(fd):
            value_fd = fd.message_type.fields_by_name["value"]
            if value_fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                for key in value:
                    _check_finite(value[key], f"{path}.{key}")
        elif fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if fd.is_repeated:
                for i, sub in enumerate(value):
                    _check_finite(sub, f"{path}[{i}]")
            else:
                _check_finite(value, path)
        elif fd.cpp_type in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
            items = list(enumerate(value)) if fd.is_repeated else [(None, value)]
            for i, x in items:
                if not math.isfinite(x):
                    where = path if i is None else f"{path}[{i}]"
                    raise ConfigError(where, f"must be a finite number, got {x}")


def _validate_kafka(config: pipeline_pb2.EasyRecConfig) -> None:
    if not config.HasField("kafka_train_input"):
        raise ConfigError("kafka_train_input", "required for online training "
                                               "(kafka_train_input { server topic group })")
    k = config.kafka_train_input
    if not k.server.strip():
        raise ConfigError("kafka_train_input.server", "required: the bootstrap servers, "
                                                      "host:port[,host:port...]")
    for server in k.server.split(","):
        host, _, port = server.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("kafka_train_input.server",
                              f"expected host:port[,host:port...], got {server.strip()!r}")
    if not k.topic.strip():
        raise ConfigError("kafka_train_input.topic", "required: the topic to train on")
    if not k.group.strip():
        raise ConfigError("kafka_train_input.group", "must not be empty")
    starts = [name for name, used in (("offset", len(k.offset) > 0),
                                      ("offset_info", bool(k.offset_info.strip())),
                                      ("offset_time", k.offset_time != 0)) if used]
    if len(starts) > 1:
        raise ConfigError(f"kafka_train_input.{starts[1]}",
                          f"give only one start position; {' and '.join(starts)} are both set")
    if k.offset_time < 0:
        raise ConfigError("kafka_train_input.offset_time", "must be unix seconds >= 0")
    if k.offset_time > 1e11:
        raise ConfigError("kafka_train_input.offset_time",
                          f"{k.offset_time} looks like milliseconds; give unix seconds")
    parse_offset_info(k.offset_info)
    if k.offset and k.partitions and len(k.offset) > k.partitions:
        raise ConfigError("kafka_train_input.offset",
                          f"{len(k.offset)} offsets given for {k.partitions} partitions")
    if any(o < 0 for o in k.offset):
        raise ConfigError("kafka_train_input.offset", "offsets must be >= 0")
    dlq = config.data_config.dead_letter_topic
    if dlq and dlq.strip() != dlq:
        raise ConfigError("data_config.dead_letter_topic", f"{dlq!r} has surrounding spaces")
    if dlq and dlq == k.topic:
        raise ConfigError("data_config.dead_letter_topic",
                          "must differ from kafka_train_input.topic (rejected records would be "
                          "read again)")


def path_scheme(path: str) -> str | None:
    """The URL scheme of a path (``"oss"`` for ``oss://bucket/key``), None for a local path.

    Args:
        path: a path from the config.

    Returns:
        The scheme in lower case, or None.
    """
    m = _URL_SCHEME.match(path or "")
    return m.group(1).lower() if m else None


def check_local_paths(config: pipeline_pb2.EasyRecConfig, online: bool) -> None:
    """Refuses ``scheme://`` paths (``oss://``, ``hdfs://``, ``s3://``, ...): local paths only.

    Checked: ``model_dir``, ``train_input_path`` (offline), ``train_config.fine_tune_checkpoint``,
    ``train_config.fine_tune_ckpt_var_map`` and ``train_config.incr_save_config.fs
    .incr_save_dir``.

    Args:
        config: the config.
        online: the training mode (``train_input_path`` is read only offline).

    Raises:
        ConfigError: naming the first field holding a path with a scheme.

    """
    tc = config.train_config
    paths = [("model_dir", config.model_dir)]
    if not online:
        paths.append(("train_input_path", config.train_input_path))
    paths += [("train_config.fine_tune_checkpoint", tc.fine_tune_checkpoint),
              ("train_config.fine_tune_ckpt_var_map", tc.fine_tune_ckpt_var_map)]
    if tc.incr_save_config.WhichOneof("incr_update") == "fs":
        paths.append(("train_config.incr_save_config.fs.incr_save_dir",
                      tc.incr_save_config.fs.incr_save_dir))
    for field, path in paths:
        scheme = path_scheme(path)
        if scheme is not None:
            raise ConfigError(field, f"{scheme}:// paths are not implemented yet; give a local "
                                     "path")


def _validate_offline_input(config: pipeline_pb2.EasyRecConfig) -> None:
    path = config.train_input_path.strip()
    if not path:
        raise ConfigError("train_input_path", "required for offline training (a glob of CSV or "
                                              "Parquet files); use --online for Kafka input")


def _validate_data_config(config: pipeline_pb2.EasyRecConfig) -> dict[str, int]:
    dc = config.data_config
    if not config.HasField("data_config"):
        raise ConfigError("data_config", "required (input_fields, label_fields, batch_size)")
    if dc.batch_size <= 0:
        raise ConfigError("data_config.batch_size", "must be > 0")
    if dc.batch_size > limits.MAX_BATCH_SIZE:
        raise ConfigError("data_config.batch_size",
                          f"{dc.batch_size} is above the limit of {limits.MAX_BATCH_SIZE:,}")
    if dc.fetch_interval_ms > limits.MAX_FETCH_INTERVAL_MS:
        raise ConfigError("data_config.fetch_interval_ms",
                          f"{dc.fetch_interval_ms} is above librdkafka's limit of "
                          f"{limits.MAX_FETCH_INTERVAL_MS} (fetch.queue.backoff.ms)")
    if dc.num_workers > limits.MAX_NUM_WORKERS:
        raise ConfigError("data_config.num_workers",
                          f"{dc.num_workers} is above the limit of {limits.MAX_NUM_WORKERS}")
    if not dc.separator:
        raise ConfigError("data_config.separator", "must not be empty")
    if not dc.input_fields:
        raise ConfigError("data_config.input_fields", "required: the record columns in order")
    fields: dict[str, int] = {}
    for i, f in enumerate(dc.input_fields):
        where = f"data_config.input_fields[{i}]"
        if not f.input_name:
            raise ConfigError(f"{where}.input_name", "required")
        if f.input_name in fields:
            raise ConfigError(f"{where}.input_name",
                              f"duplicate input field {f.input_name!r} (also input_fields"
                              f"[{list(fields).index(f.input_name)}])")
        fields[f.input_name] = f.input_type
        if f.default_val and f.input_type in _NUMERIC_FIELD_TYPES:
            ok = (f.default_val.lower() in ("true", "false", "0", "1")
                  if f.input_type == _FIELD_TYPE.BOOL else _is_number(f.default_val))
            if not ok:
                raise ConfigError(f"{where}.default_val",
                                  f"{f.default_val!r} is not a valid "
                                  f"{_FIELD_TYPE.Name(f.input_type)}")
    if len(dc.label_fields) != 1:
        raise ConfigError("data_config.label_fields",
                          f"exactly one label field is supported, got {len(dc.label_fields)}")
    label = dc.label_fields[0]
    if label not in fields:
        raise ConfigError("data_config.label_fields", f"label {label!r} is not an input field")
    if fields[label] not in _NUMERIC_FIELD_TYPES:
        raise ConfigError("data_config.label_fields", f"label {label!r} must be a numeric field")
    if dc.sample_id_field and dc.sample_id_field not in fields:
        raise ConfigError("data_config.sample_id_field",
                          f"{dc.sample_id_field!r} is not an input field")
    if dc.event_time_field:
        if dc.event_time_field not in fields:
            raise ConfigError("data_config.event_time_field",
                              f"{dc.event_time_field!r} is not an input field")
        if fields[dc.event_time_field] not in _NUMERIC_FIELD_TYPES:
            raise ConfigError("data_config.event_time_field",
                              f"{dc.event_time_field!r} must be a numeric field (unix seconds)")
    return fields


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _validate_features(
    config: pipeline_pb2.EasyRecConfig, fields: dict[str, int]
) -> dict[str, FeatureConfig]:
    features = feature_configs(config)
    prefix = _feature_prefix(config)
    if not features:
        raise ConfigError(prefix, "no features configured")
    label = config.data_config.label_fields[0]
    by_name: dict[str, FeatureConfig] = {}
    tables: dict[str, tuple[int, int, int, str]] = {}
    for i, fc in enumerate(features):
        where = f"{prefix}[{i}]"
        kind = _FT.Name(fc.feature_type)
        if not fc.input_names:
            raise ConfigError(f"{where}.input_names", "required")
        if fc.feature_name in by_name:
            raise ConfigError(f"{where}.feature_name",
                              f"duplicate feature name {fc.feature_name!r}")
        by_name[fc.feature_name] = fc
        for j, name in enumerate(fc.input_names):
            if name not in fields:
                raise ConfigError(f"{where}.input_names[{j}]",
                                  f"{name!r} is not in data_config.input_fields")
            if name == label:
                raise ConfigError(f"{where}.input_names[{j}]",
                                  f"the label {name!r} cannot be a feature input")
        if fc.feature_type == _FT.ComboFeature:
            if len(fc.input_names) < 2:
                raise ConfigError(f"{where}.input_names", "a ComboFeature crosses 2 or more inputs")
        elif len(fc.input_names) != 1:
            raise ConfigError(f"{where}.input_names", f"a {kind} reads exactly one input")
        if fc.combiner not in ("sum", "mean"):
            raise ConfigError(f"{where}.combiner", f"expected sum or mean, got {fc.combiner!r}")
        if fc.feature_type in _EMBEDDED_TYPES:
            if fc.embedding_dim <= 0:
                raise ConfigError(f"{where}.embedding_dim", f"a {kind} needs embedding_dim > 0")
            if bool(fc.hash_bucket_size) == bool(fc.num_buckets):
                raise ConfigError(f"{where}.hash_bucket_size",
                                  f"a {kind} needs exactly one of hash_bucket_size / num_buckets")
            for size_field in ("hash_bucket_size", "num_buckets"):
                size = getattr(fc, size_field)
                if size > limits.MAX_TABLE_ROWS:
                    raise ConfigError(f"{where}.{size_field}",
                                      f"{size:,} rows is above the limit of "
                                      f"{limits.MAX_TABLE_ROWS:,} (2**31 - 1) rows per table")
            if fc.boundaries:
                raise ConfigError(f"{where}.boundaries", "only RawFeature takes boundaries")
        else:  # RawFeature
            if fields[fc.input_names[0]] not in _NUMERIC_FIELD_TYPES:
                raise ConfigError(f"{where}.input_names[0]",
                                  f"a RawFeature needs a numeric input field, "
                                  f"{fc.input_names[0]!r} is "
                                  f"{_FIELD_TYPE.Name(fields[fc.input_names[0]])}")
            if fc.hash_bucket_size or fc.num_buckets:
                raise ConfigError(f"{where}.hash_bucket_size",
                                  "a RawFeature takes boundaries, not hash_bucket_size / "
                                  "num_buckets")
            if fc.raw_input_dim != 1:
                raise ConfigError(f"{where}.raw_input_dim",
                                  "raw_input_dim > 1 is an EasyRec feature that odl does not "
                                  "implement yet")
            if fc.boundaries:
                if fc.embedding_dim <= 0:
                    raise ConfigError(f"{where}.embedding_dim",
                                      "a RawFeature with boundaries needs embedding_dim > 0")
                b = list(fc.boundaries)
                if any(not math.isfinite(x) for x in b) or any(
                        b[k] >= b[k + 1] for k in range(len(b) - 1)):
                    raise ConfigError(f"{where}.boundaries", "must be finite and strictly "
                                                             "ascending")
                if len(b) + 1 > limits.MAX_TABLE_ROWS:
                    raise ConfigError(f"{where}.boundaries", "too many boundaries")
            else:
                if fc.embedding_dim:
                    raise ConfigError(f"{where}.embedding_dim",
                                      "a RawFeature without boundaries is a dense input; an "
                                      "embedding_dim for it (EasyRec's projected raw feature) "
                                      "is not implemented by odl yet; add boundaries or remove "
                                      "embedding_dim")
                continue
        if fc.embedding_dim > limits.MAX_EMBEDDING_DIM:
            raise ConfigError(f"{where}.embedding_dim",
                              f"{fc.embedding_dim} is above the limit of "
                              f"{limits.MAX_EMBEDDING_DIM}")
        table = fc.embedding_name or fc.feature_name
        shape = (fc.embedding_dim, fc.hash_bucket_size, fc.num_buckets, kind)
        if fc.embedding_name and table in tables and tables[table] != shape:
            raise ConfigError(f"{where}.embedding_name",
                              f"features sharing embedding {table!r} must have the same "
                              "embedding_dim, bucket sizes and type")
        tables.setdefault(table, shape)
    return by_name


def _validate_model(
    config: pipeline_pb2.EasyRecConfig, features: dict[str, FeatureConfig]
) -> None:
    if not config.HasField("model_config"):
        raise ConfigError("model_config", "required")
    mc = config.model_config
    if not mc.model_class:
        raise ConfigError("model_config.model_class", 'required ("DeepFM")')
    if mc.embedding_regularization < 0:
        raise ConfigError("model_config.embedding_regularization", "must be >= 0")
    for i, loss in enumerate(mc.losses):
        if loss.weight <= 0:
            raise ConfigError(f"model_config.losses[{i}].weight", "must be > 0")
    if not mc.feature_groups:
        raise ConfigError("model_config.feature_groups", "required")
    groups: dict[str, int] = {}
    for i, g in enumerate(mc.feature_groups):
        where = f"model_config.feature_groups[{i}]"
        if not g.group_name:
            raise ConfigError(f"{where}.group_name", "required")
        if g.group_name in groups:
            raise ConfigError(f"{where}.group_name", f"duplicate group {g.group_name!r}")
        groups[g.group_name] = i
        if not g.feature_names:
            raise ConfigError(f"{where}.feature_names", "a group needs at least one feature")
        seen = set()
        for j, name in enumerate(g.feature_names):
            if name not in features:
                raise ConfigError(f"{where}.feature_names[{j}]", f"no feature named {name!r}")
            if name in seen:
                raise ConfigError(f"{where}.feature_names[{j}]", f"{name!r} listed twice")
            seen.add(name)
    # DeepFM (the only class check_implemented lets through).
    for required in ("wide", "deep"):
        if required not in groups:
            raise ConfigError("model_config.feature_groups",
                              f'DeepFM needs a feature group named "{required}"')
    if not mc.HasField("deepfm"):
        raise ConfigError("model_config.deepfm", "DeepFM needs deepfm { dnn { hidden_units } }")
    d = mc.deepfm
    _validate_dnn(d.dnn, "model_config.deepfm.dnn", required=True)
    if d.HasField("final_dnn"):
        _validate_dnn(d.final_dnn, "model_config.deepfm.final_dnn", required=True)
    if d.wide_output_dim <= 0:
        raise ConfigError("model_config.deepfm.wide_output_dim", "must be > 0")
    if d.wide_output_dim > limits.MAX_WIDE_OUTPUT_DIM:
        raise ConfigError("model_config.deepfm.wide_output_dim",
                          f"{d.wide_output_dim} is above the limit of "
                          f"{limits.MAX_WIDE_OUTPUT_DIM}")
    if not d.HasField("final_dnn") and d.wide_output_dim != mc.num_class:
        raise ConfigError("model_config.deepfm.wide_output_dim",
                          "without final_dnn the wide, FM and deep outputs are summed, so "
                          f"wide_output_dim must equal num_class ({mc.num_class})")
    for name in ("l2_regularization", "wide_regularization", "dense_regularization"):
        if getattr(d, name) < 0:
            raise ConfigError(f"model_config.deepfm.{name}", "must be >= 0")
    _check_deep_dims(config, features)
    fm_group = "fm" if "fm" in groups else "deep"
    gi = groups[fm_group]
    dims = {n: features[n].embedding_dim for n in mc.feature_groups[gi].feature_names
            if embedded_feature(features[n])}
    if not dims:
        raise ConfigError(f"model_config.feature_groups[{gi}].feature_names",
                          f'the "{fm_group}" group needs at least one embedded feature for FM')
    if len(set(dims.values())) > 1:
        shown = ", ".join(f"{n}={v}" for n, v in list(dims.items())[:6])
        raise ConfigError(f"model_config.feature_groups[{gi}].feature_names",
                          f'FM needs every embedded feature of the "{fm_group}" group to have '
                          f"the same embedding_dim; got {shown}"
                          f"{', ...' if len(dims) > 6 else ''}")


def _check_deep_dims(
    config: pipeline_pb2.EasyRecConfig, features: dict[str, FeatureConfig]
) -> None:
    """Refuses deep-table dims that are not multiples of 4 (fbgemm's kernels need them)."""
    align = limits.EMBEDDING_DIM_ALIGN
    index = {fc.feature_name: i for i, fc in enumerate(feature_configs(config))}
    prefix = _feature_prefix(config)
    for g in config.model_config.feature_groups:
        if g.wide_deep not in (pipeline_pb2.DEEP, pipeline_pb2.WIDE_AND_DEEP):
            continue
        for name in g.feature_names:
            fc = features[name]
            if embedded_feature(fc) and fc.embedding_dim % align:
                raise ConfigError(f"{prefix}[{index[name]}].embedding_dim",
                                  f"{fc.embedding_dim} is not a multiple of {align} (fbgemm's "
                                  "embedding kernels need one)")


def _validate_dnn(dnn: Any, where: str, required: bool) -> None:
    if required and not dnn.hidden_units:
        raise ConfigError(f"{where}.hidden_units", "required (e.g. [256, 128, 64])")
    if len(dnn.hidden_units) > limits.MAX_HIDDEN_LAYERS:
        raise ConfigError(f"{where}.hidden_units",
                          f"{len(dnn.hidden_units)} layers is above the limit of "
                          f"{limits.MAX_HIDDEN_LAYERS}")
    for i, units in enumerate(dnn.hidden_units):
        if units <= 0:
            raise ConfigError(f"{where}.hidden_units[{i}]", "must be > 0")
        if units > limits.MAX_HIDDEN_UNITS:
            raise ConfigError(f"{where}.hidden_units[{i}]",
                              f"{units:,} units is above the limit of "
                              f"{limits.MAX_HIDDEN_UNITS:,}")
    if dnn.dropout_ratio and len(dnn.dropout_ratio) != len(dnn.hidden_units):
        raise ConfigError(f"{where}.dropout_ratio",
                          "give one ratio per hidden layer (or none)")
    for i, r in enumerate(dnn.dropout_ratio):
        if not 0.0 <= r < 1.0:
            raise ConfigError(f"{where}.dropout_ratio[{i}]", "must be in [0, 1)")
    if dnn.activation not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"{where}.activation",
                          f"expected one of {sorted(SUPPORTED_ACTIVATIONS)}, got "
                          f"{dnn.activation!r}")


def _validate_train(config: pipeline_pb2.EasyRecConfig) -> None:
    tc = config.train_config
    where = "train_config"
    opts = list(tc.optimizer_config)
    tzrec = tc.HasField("sparse_optimizer") or tc.HasField("dense_optimizer")
    if opts and tzrec:
        raise ConfigError(f"{where}.optimizer_config",
                          "give either optimizer_config (EasyRec) or sparse_optimizer + "
                          "dense_optimizer (TorchEasyRec), not both")
    if opts:
        if len(opts) > 2:
            raise ConfigError(f"{where}.optimizer_config",
                              f"1 entry (all parameters) or 2 (embeddings, dense) are supported, "
                              f"got {len(opts)}")
        for i, opt in enumerate(opts):
            _validate_easyrec_optimizer(opt, f"{where}.optimizer_config[{i}]")
    elif tzrec:
        for name in ("sparse_optimizer", "dense_optimizer"):
            if not tc.HasField(name):
                raise ConfigError(f"{where}.{name}",
                                  "sparse_optimizer and dense_optimizer go together")
            _validate_tzrec_optimizer(getattr(tc, name), f"{where}.{name}")
    else:
        raise ConfigError(f"{where}.optimizer_config",
                          "no optimizer configured: set optimizer_config (EasyRec) or "
                          "sparse_optimizer + dense_optimizer (TorchEasyRec)")
    if tc.HasField("num_steps") and tc.num_steps == 0:
        raise ConfigError(f"{where}.num_steps", "must be > 0 (leave it unset to run until "
                                                "stopped)")
    if tc.log_step_count_steps <= 0:
        raise ConfigError(f"{where}.log_step_count_steps", "must be > 0")
    if tc.keep_checkpoint_max > 100000:
        raise ConfigError(f"{where}.keep_checkpoint_max", "unreasonably large (0 keeps all)")
    if not tc.stop_signal_poll_secs > 0 or not math.isfinite(tc.stop_signal_poll_secs):
        raise ConfigError(f"{where}.stop_signal_poll_secs", "must be > 0")
    if tc.metrics_window_samples <= 0:
        raise ConfigError(f"{where}.metrics_window_samples", "must be > 0")
    if tc.metrics_window_samples > limits.MAX_METRICS_WINDOW_SAMPLES:
        raise ConfigError(f"{where}.metrics_window_samples",
                          f"{tc.metrics_window_samples:,} is above the limit of "
                          f"{limits.MAX_METRICS_WINDOW_SAMPLES:,}")
    parse_dead_line(tc.dead_line)
    if tc.fine_tune_ckpt_var_map and not os.path.isfile(tc.fine_tune_ckpt_var_map):
        raise ConfigError(f"{where}.fine_tune_ckpt_var_map",
                          f"file not found: {tc.fine_tune_ckpt_var_map}")
    if tc.fine_tune_ckpt_var_map and not tc.fine_tune_checkpoint:
        raise ConfigError(f"{where}.fine_tune_ckpt_var_map",
                          "set fine_tune_checkpoint too (the map renames its parameters)")
    if tc.HasField("incr_save_config"):
        _validate_incr_save(tc.incr_save_config, f"{where}.incr_save_config")


# Largest delta chunk: the delta topic is created with max.message.bytes = 16 MiB.
MAX_DELTA_CHUNK_BYTES = 16 << 20
MIN_DELTA_CHUNK_BYTES = 4096


def _validate_incr_save(isc: Any, where: str) -> None:
    if not (isc.sparse_save_steps or isc.dense_save_steps or isc.sparse_save_secs
            or isc.dense_save_secs):
        raise ConfigError(f"{where}.sparse_save_steps",
                          "set at least one of sparse_save_steps, dense_save_steps, "
                          "sparse_save_secs, dense_save_secs (> 0)")
    kind = isc.WhichOneof("incr_update")
    if kind is None:
        raise ConfigError(f"{where}.kafka", "choose where versions go: kafka { server topic } "
                                            "or fs { incr_save_dir }")
    if kind == "kafka":
        if not isc.kafka.server:
            raise ConfigError(f"{where}.kafka.server", "required (host:port list)")
        if not isc.kafka.topic:
            raise ConfigError(f"{where}.kafka.topic", "required")
    elif not isc.fs.incr_save_dir:
        raise ConfigError(f"{where}.fs.incr_save_dir", "must not be empty")
    if not MIN_DELTA_CHUNK_BYTES <= isc.max_chunk_bytes <= MAX_DELTA_CHUNK_BYTES:
        raise ConfigError(f"{where}.max_chunk_bytes",
                          f"must be in [{MIN_DELTA_CHUNK_BYTES}, {MAX_DELTA_CHUNK_BYTES}]")


def _validate_easyrec_optimizer(opt: Any, where: str) -> None:
    kind = opt.WhichOneof("optimizer")
    if kind is None:
        raise ConfigError(where, "choose an optimizer (sgd_optimizer, adagrad_optimizer or "
                                 "adam_optimizer)")
    inner = getattr(opt, kind)
    lr_where = f"{where}.{kind}.learning_rate"
    lr = inner.learning_rate
    which = lr.WhichOneof("learning_rate")
    if which == "constant_learning_rate":
        if not lr.constant_learning_rate.learning_rate > 0:
            raise ConfigError(f"{lr_where}.constant_learning_rate.learning_rate", "must be > 0")
    elif which == "exponential_decay_learning_rate":
        e = lr.exponential_decay_learning_rate
        ew = f"{lr_where}.exponential_decay_learning_rate"
        if not e.initial_learning_rate > 0:
            raise ConfigError(f"{ew}.initial_learning_rate", "must be > 0")
        if e.decay_steps <= 0:
            raise ConfigError(f"{ew}.decay_steps", "must be > 0")
        if not 0 < e.decay_factor <= 1:
            raise ConfigError(f"{ew}.decay_factor", "must be in (0, 1]")
        if e.min_learning_rate < 0:
            raise ConfigError(f"{ew}.min_learning_rate", "must be >= 0")
    if kind == "adam_optimizer":
        _check_betas(inner, f"{where}.{kind}")
    if kind == "adagrad_optimizer" and inner.initial_accumulator_value < 0:
        raise ConfigError(f"{where}.{kind}.initial_accumulator_value", "must be >= 0")


def _validate_tzrec_optimizer(opt: Any, where: str) -> None:
    kind = opt.WhichOneof("optimizer")
    if kind is None:
        raise ConfigError(where, "choose an optimizer (e.g. adagrad_optimizer { lr: 0.05 })")
    inner = getattr(opt, kind)
    if not inner.lr > 0:
        raise ConfigError(f"{where}.{kind}.lr", "must be > 0")
    if kind == "adam_optimizer":
        _check_betas(inner, f"{where}.{kind}")
    if kind == "adagrad_optimizer" and inner.initial_accumulator_value < 0:
        raise ConfigError(f"{where}.{kind}.initial_accumulator_value", "must be >= 0")
    if opt.WhichOneof("learning_rate") == "exponential_decay_learning_rate":
        e = opt.exponential_decay_learning_rate
        ew = f"{where}.exponential_decay_learning_rate"
        if e.decay_steps <= 0:
            raise ConfigError(f"{ew}.decay_steps", "must be > 0")
        if not 0 < e.decay_rate <= 1:
            raise ConfigError(f"{ew}.decay_rate", "must be in (0, 1]")
        if e.min_learning_rate < 0:
            raise ConfigError(f"{ew}.min_learning_rate", "must be >= 0")


def _check_betas(inner: Any, where: str) -> None:
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(inner, name) < 1:
            raise ConfigError(f"{where}.{name}", "must be in [0, 1)")


# --------------------------------------------------------------------------- saving


def _is_secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in SECRET_FIELD_MARKERS)


def redact_config(config: Message) -> Message:
    """Return a copy of ``config`` with secret values replaced by ``***``.

    A string field whose name, or a string-map value whose key, contains one of
    ``SECRET_FIELD_MARKERS`` is masked (when non-empty), at any depth.

    Args:
        config: any config message.

    Returns:
        A redacted copy; ``config`` is not modified.

    """
    copy = type(config)()
    copy.CopyFrom(config)
    _redact_in_place(copy)
    return copy


def _redact_in_place(msg: Message) -> None:
    for fd, value in msg.ListFields():
        if _is_map(fd):
            value_fd = fd.message_type.fields_by_name["value"]
            if value_fd.cpp_type == FieldDescriptor.CPPTYPE_STRING:
                for key in list(value):
                    if _is_secret_name(str(key)) and value[key]:
                        value[key] = REDACTED
            elif value_fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                for key in list(value):
                    _redact_in_place(value[key])
        elif fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            for sub in (value if fd.is_repeated else [value]):
                _redact_in_place(sub)
        elif fd.cpp_type == FieldDescriptor.CPPTYPE_STRING and _is_secret_name(fd.name):
            if fd.is_repeated:
                for i in range(len(value)):
                    value[i] = REDACTED
            elif value:
                setattr(msg, fd.name, REDACTED)


def config_to_text(config: Message, redact: bool = True) -> str:
    """Render a config as protobuf text format.

    Args:
        config: the config.
        redact: mask secret values (see :func:`redact_config`).

    Returns:
        The text.

    """
    msg = redact_config(config) if redact else config
    return text_format.MessageToString(msg, as_utf8=True)


def save_pipeline_config(config: Message, path: str, redact: bool = True) -> None:
    """Write a config atomically (temp file in the same directory, then ``os.replace``).

    Args:
        config: the config.
        path: destination file; its directory is created if missing.
        redact: mask secret values (keep True for anything written to model_dir).

    """
    text = config_to_text(config, redact=redact)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pipeline.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
