"""Which fields and values of EasyRec's and TorchEasyRec's pipeline configs odl accepts.

``protos/pipeline.proto`` keeps EasyRec's field names, so an EasyRec config parses as it is
for the subset odl implements. What odl does not implement is never silently ignored:

* fields that EasyRec or TorchEasyRec has and ``pipeline.proto`` lacks are listed in
  :data:`EASYREC_NOT_IMPLEMENTED_FIELDS`, so a config using one is refused with "... is an
  EasyRec field that odl does not implement yet" rather than "unknown field" (by the loader,
  :mod:`odl.config.pipeline_config`, and the editor, :mod:`odl.config.config_edit`);
* enum values odl's enums lack are listed in :data:`EASYREC_NOT_IMPLEMENTED_VALUES`, refused
  the same way;
* values that parse but that odl does not implement (a model class odl lacks,
  several label fields for a single-task model) are refused by :func:`check_implemented`;
* TorchEasyRec's way of naming the model by its message alone (``deepfm { ... }`` or
  ``wide_and_deep { ... }`` without ``model_class``) is accepted by
  :func:`infer_model_class`;
* one default differs from EasyRec's on purpose: a DNN normalizes its layers only where
  ``use_bn: true`` is written (TorchEasyRec's default; EasyRec's is true). An EasyRec config's
  DNNs that leave it unwritten are named in one warning by :func:`warn_unwritten_batch_norm`.

The other spellings of what odl implements (TorchEasyRec's feature and model forms,
EasyRec's ``TagFeature``) are rewritten by :mod:`odl.config.config_forms`.
"""

from __future__ import annotations

import logging

from odl.config.config_error import ConfigError
from odl.config.model_classes import (
    IMPLEMENTED_MODEL_CLASSES,
    MODEL_MESSAGES,
    is_multi_task_model,
    multi_task_model_classes,
)
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

__all__ = [
    "EASYREC_NO_EFFECT_FIELDS",
    "EASYREC_NOT_IMPLEMENTED_FIELDS",
    "EASYREC_NOT_IMPLEMENTED_VALUES",
    "check_implemented",
    "infer_model_class",
    "not_implemented_field_message",
    "unwritten_batch_norm_dnns",
    "warn_unwritten_batch_norm",
]

# Fields of Alibaba EasyRec's (and TorchEasyRec's) pipeline config that odl does not implement,
# keyed by the odl message that would hold them. A config using one is rejected with "... is an
# EasyRec field that odl does not implement yet" instead of "unknown field". A name leaves this
# table when odl implements the field (and pipeline.proto gains it). A model's settings
# message lists its own in its ``easyrec_fields_not_implemented`` option (added below).
EASYREC_NOT_IMPLEMENTED_FIELDS: dict[str, frozenset[str]] = {
    "EasyRecConfig": frozenset({
        "hive_train_input", "binary_train_input", "parquet_train_input", "odps_train_input",
        "oss_train_input",
    }),
    "KafkaServer": frozenset({"consumer", "sink"}),
    "DatasetConfig": frozenset({
        "extra_label_func",
        "selected_col_types", "ignore_error",
        "data_compression_type", "with_header",
        "feature_fields", "negative_sampler", "negative_sampler_v2", "hard_negative_sampler",
        "hard_negative_sampler_v2", "negative_sampler_in_memory", "drop_remainder",
        "fg_encoded", "fg_encoded_multival_sep",
        # TorchEasyRec's
        "sample_mask_prob", "negative_sample_mask_prob", "force_base_data_group",
        "sample_weight_fields", "sample_cost_field", "batch_cost_size", "input_fields_str",
    }),
    "DatasetConfig.Field": frozenset({
        "input_dim", "input_shape", "ignore_val",
    }),
    "TzIdFeature": frozenset({"value_dim", "vocab_list", "vocab_dict", "vocab_file",
                              "default_value", "default_bucketize_value",
                              "init_fn", "zch", "mc_modules",
                              "dynamicemb", "trainable", "data_type", "fg_value_type",
                              "constraints", "stub_type"}),
    "TzRawFeature": frozenset({"default_value", "init_fn",
                               "mlp", "autodis", "fg_value_type", "stub_type"}),
    "TzSequenceSubFeature": frozenset({"combo_feature", "lookup_feature", "match_feature",
                                       "expr_feature", "overlap_feature", "tokenize_feature",
                                       "custom_feature", "kv_dot_product"}),
    "TzSeqEncoderConfig": frozenset({"simple_attention", "multi_window_din_encoder",
                                     "self_attention_encoder"}),
    "TzDINEncoder": frozenset({"max_seq_length"}),
    "TzPoolingEncoder": frozenset({"max_seq_length"}),
    "TzSeqGroupConfig": frozenset({"embedding_name_suffix"}),
    "FeatureConfig": frozenset({
        "initializer",
        "precision", "normalizer_fn",

        # TorchEasyRec's other per-kind feature messages.
        "combo_feature", "lookup_feature", "match_feature",
        "expr_feature", "overlap_feature", "tokenize_feature", "custom_feature",
        "sequence_id_feature", "sequence_raw_feature", "bool_mask_feature",
    }),
    "SequenceCombiner": frozenset({"multi_head_attention"}),
    # the backbone layers odl does not implement (odl/models/backbone/ has the others)
    "KerasLayer": frozenset({
        "seq_aug", "overlap", "dot_product",
        "attention", "multi_head_attention", "transformer", "text_encoder", "gate",
    }),
    "FeatureGroupConfig": frozenset({"negative_sampler", "embedding_name_suffix"}),
    "EasyRecModel": frozenset({
        "dummy",
        "multi_tower_recall", "dssm", "mind",
        "dropoutnet", "metric_learning", "pdn", "dssm_senet", "dat",
        "restore_filters",
        "label_name", "din", "bst", "dien", "masknet", "fibinet", "ppnet",
        "rank_model", "dlrm_hstu",
    }),
    "Loss": frozenset({
        "softmax_loss", "circle_loss", "multi_simi_loss",
        "pairwise_hinge_loss", "listwise_rank_loss", "listwise_distill_loss",
    }),
    "DNN": frozenset({"use_final_bn", "final_activation", "use_final_bias", "use_bias"}),
    "KD": frozenset({
        "task_space_indicator_name", "task_space_indicator_value", "in_task_space_weight",
        "out_task_space_weight",
        "f1_reweighted_loss", "softmax_loss", "circle_loss", "multi_simi_loss",
        "binary_focal_loss", "pairwise_loss", "pairwise_focal_loss", "pairwise_logistic_loss",
        "jrc_loss", "pairwise_hinge_loss", "listwise_rank_loss", "listwise_distill_loss",
    }),
    "TaskTower": frozenset({"use_sample_weight", "bias_tower",
                            "pareto_min_loss_weight", "sample_weight_name"}),
    "TrainConfig": frozenset({
        "force_restore_shape_compatible",
        "fine_tune_ckpt_param_map", "cudnn_allow_tf32",
        "cuda_matmul_allow_tf32",
        "global_embedding_constraints", "mixed_precision", "grad_scaler",
        "gradient_accumulation_steps", "delta_embedding_dump_config",
    }),
    "IncrementSaveConfig": frozenset({"datahub"}),
    "IncrementSaveConfig.Kafka.Consumer": frozenset({"config_topic", "config_global", "timeout"}),
    "IncrementSaveConfig.File": frozenset({"relative", "mount_path"}),
    "SparseOptimizer": frozenset({"rowwise_adagrad_optimizer_with_decay"}),
    "GradClipping": frozenset({"enable_global_grad_clip"}),
}

def _message_options() -> dict[str, frozenset[str]]:
    """The ``easyrec_fields_not_implemented`` options of pipeline.proto's messages."""
    out: dict[str, frozenset[str]] = {}
    pending = list(pipeline_pb2.DESCRIPTOR.message_types_by_name.values())
    while pending:
        descriptor = pending.pop()
        pending.extend(descriptor.nested_types)
        names = descriptor.GetOptions().Extensions[pipeline_pb2.easyrec_fields_not_implemented]
        if names:
            out[descriptor.full_name.removeprefix("odl.protos.")] = frozenset(names)
    return out


for _message, _names in _message_options().items():
    EASYREC_NOT_IMPLEMENTED_FIELDS[_message] = (
        EASYREC_NOT_IMPLEMENTED_FIELDS.get(_message, frozenset()) | _names)

# Fields of EasyRec's / TorchEasyRec's pipeline config that change nothing in an odl run:
# accepted with one warning naming the field and why, and dropped. Keyed by the odl message
# that would hold them; each maps to (why it has no effect, values that WOULD change the
# trained model and are refused as not implemented, lower case, empty: none).
EASYREC_NO_EFFECT_FIELDS: dict[str, dict[str, tuple[str, frozenset[str]]]] = {
    "EasyRecConfig": {
        **{name: ("there is no separate evaluation run", frozenset()) for name in (
            "hive_eval_input", "binary_eval_input", "parquet_eval_input", "odps_eval_input",
            "oss_eval_input")},
    },
    "DatasetConfig": {
        "shuffle": ("a stream is trained in arrival order", frozenset()),
        "shuffle_buffer_size": ("a stream is trained in arrival order", frozenset()),
        "prefetch_size": ("the input process prefetches on its own", frozenset()),
        "num_parallel_calls": ("parsing runs in the input process (data_config.num_workers)",
                               frozenset()),
        "chief_redundant": ("one trainer process reads the whole stream", frozenset()),
        "pai_worker_queue": ("a PAI-only input setting", frozenset()),
        "pai_worker_slice_num": ("a PAI-only input setting", frozenset()),
        "eval_batch_size": ("there is no separate evaluation run", frozenset()),
        "dataset_type": ("the input section (kafka_train_input, datahub_train_input, "
                         "file_stream_input) says what is read", frozenset()),
        "fg_threads": ("features are built in the input process", frozenset()),
        "odps_data_quota_name": ("an ODPS table setting (the input section names what is "
                                 "read)", frozenset()),
        "shard": ("ranks split the topic's partitions among themselves", frozenset()),
        "file_shard": ("ranks split the topic's partitions among themselves", frozenset()),
        "n_data_batch_tfrecord": ("a setting of EasyRec's BatchTFRecordInput (samples per "
                                  "TFRecord); odl's inputs read one record per message or "
                                  "line", frozenset()),
        # TorchEasyRec's
        "pin_memory": ("batches are built in the input process and moved by the trainer",
                       frozenset()),
        "is_orderby_partition": ("an ODPS table setting (the input section names what is "
                                 "read)", frozenset()),
        "odps_data_compression": ("an ODPS table setting (the input section names what is "
                                  "read)", frozenset()),
        "in_order": ("a stream is trained in arrival order", frozenset()),
    },
    "FeatureConfig": {
        "max_partitions": ("a parameter-server variable partitioning; odl splits large "
                           "tables over the ranks by rows itself", frozenset()),
    },
    "FeatureConfigV2": {
        "embedding_on_cpu": ("tables live on the training device (--device)", frozenset()),
    },
    "TrainConfig": {
        "sync_replicas": ("one trainer process (no parameter-server replicas)", frozenset()),
        "sparse_accumulator_type": ("a parameter-server gradient accumulator; odl's ranks "
                                    "exchange gradients every step", frozenset()),
        "startup_delay_steps": ("one trainer process", frozenset()),
        "train_distribute": ("one trainer process", frozenset()),
        "num_gpus_per_worker": ("the device is --device", frozenset()),
        "save_checkpoints_epochs": ("checkpoints follow save_checkpoints_steps / "
                                    "save_checkpoints_secs, and the end of an offline run "
                                    "writes one", frozenset()),
        **{name: ("checkpoints follow save_checkpoints_steps / save_checkpoints_secs (a file "
                  "stream's passes: pass saves)", frozenset()) for name in (
            "save_checkpoints_timestamp_interval", "save_checkpoints_timestamps",
            "save_checkpoints_timestamp_quorum")},
        "save_summary_steps": ("metrics go to /status and /metrics", frozenset()),
        "summary_model_vars": ("metrics go to /status and /metrics", frozenset()),
        "use_tensorboard": ("metrics go to /status and /metrics", frozenset()),
        "tensorboard_summaries": ("metrics go to /status and /metrics", frozenset()),
        "is_profiling": ("no TensorFlow profiler", frozenset()),
        "protocol": ("no TensorFlow server", frozenset()),
        "inter_op_parallelism_threads": ("threads are --torch_threads", frozenset()),
        "intra_op_parallelism_threads": ("threads are --torch_threads", frozenset()),
        "tensor_fuse": ("a TensorFlow setting", frozenset()),
        "write_graph": ("no TensorFlow graph", frozenset()),
        "use_moving_average": ("odl keeps no moving average of the weights",
                               frozenset({"true", "1", "t", "yes"})),
        "moving_average_decay": ("odl keeps no moving average of the weights", frozenset()),
    },
    **{name: {"fused": ("a torch implementation choice with the same update", frozenset())}
       for name in ("TzrecDenseSgdOptimizer", "TzrecDenseAdagradOptimizer",
                    "TzrecDenseAdamOptimizer")},
    "OptimizerConfig": {
        "use_moving_average": ("odl keeps no moving average of the weights",
                               frozenset({"true", "1", "t", "yes"})),
        "moving_average_decay": ("odl keeps no moving average of the weights", frozenset()),
    },
    "IncrementSaveConfig": {
        "debug_save_update": ("a debugging dump of EasyRec's", frozenset()),
    },
    "ExportConfig": {name: ("odl-export and the publisher have their own options "
                            "(docs/serving.md)", frozenset()) for name in (
        # EasyRec's
        "batch_size", "exporter_type", "best_exporter_metric", "metric_bigger",
        "enable_early_stop", "early_stop_func", "early_stop_params", "max_check_steps",
        "multi_placeholder", "exports_to_keep", "multi_value_fields", "auto_multi_value",
        "placeholder_named_by_input", "filter_inputs", "export_features", "export_rtp_outputs",
        "asset_files",
        # TorchEasyRec's
        "metric_larger_is_better", "mixed_precision", "cudnn_allow_tf32",
        "cuda_matmul_allow_tf32")},
    "EvalConfig": {
        "eval_interval_secs": ("odl evaluates kafka_eval_input at every checkpoint",
                               frozenset()),
        "max_evals": ("odl evaluates at every checkpoint while it trains", frozenset()),
        "save_graph": ("no TensorFlow graph", frozenset()),
        "eval_online": ("the progressive metrics score every training batch before it is "
                        "trained on", frozenset()),
        # TorchEasyRec's EvalConfig
        "num_steps": ("odl scores the eval topic's new records at every checkpoint "
                      "(eval_config.num_examples bounds one evaluation)", frozenset()),
        "log_step_count_steps": ("each evaluation logs one line", frozenset()),
    },
    "SeqAttGroupConfig": {
        "tf_summary": ("no TensorFlow summaries; metrics go to /status and /metrics",
                       frozenset()),
        "allow_key_search": ("keys are looked up by feature name", frozenset()),
    },
    "TaskTower": {
        "train_metrics": ("odl reports progressive AUC and logloss per task (/status, "
                          "/metrics)", frozenset()),
    },
    "EvalMetrics": {name: ("odl reports AUC, logloss and (gauc) GAUC; other metrics are not "
                           "computed", frozenset())
                    for name in ("recall_at_topk", "mean_absolute_error", "mean_squared_error",
                                 "accuracy", "max_f1", "root_mean_squared_error",
                                 "session_auc", "recall", "precision", "precision_at_topk")},
    "MetricConfig": {name: ("odl reports progressive AUC, logloss and (grouped_auc) GAUC; "
                            "other metrics are not computed", frozenset())
                     for name in ("multiclass_auc", "recall_at_k", "mean_absolute_error",
                                  "mean_squared_error", "accuracy", "xauc", "grouped_xauc",
                                  "normalized_entropy")},
    "EasyRecModel": {
        "train_metrics": ("odl reports progressive AUC and logloss for every model",
                          frozenset()),
        "model_name": ("a name only: model_class says what is built", frozenset()),
    },
}


# Fields of the table above that only TorchEasyRec has (besides those of the Tz* messages,
# which are all TorchEasyRec's): reported as TorchEasyRec fields.
_TORCHEASYREC_ONLY_FIELDS: dict[str, frozenset[str]] = {
    "FeatureConfig": frozenset({
        "combo_feature", "lookup_feature", "match_feature", "expr_feature", "overlap_feature",
        "tokenize_feature", "custom_feature", "sequence_id_feature", "sequence_raw_feature",
        "bool_mask_feature"}),
    "FeatureGroupConfig": frozenset({"embedding_name_suffix"}),
    "EasyRecModel": frozenset({"rank_model", "dlrm_hstu"}),
    "TrainConfig": frozenset({"mixed_precision", "grad_scaler", "gradient_accumulation_steps",
                              "cudnn_allow_tf32", "cuda_matmul_allow_tf32",
                              "global_embedding_constraints"}),
}


def not_implemented_field_message(message: str, field: str) -> str:
    """The refusal of a field listed in :data:`EASYREC_NOT_IMPLEMENTED_FIELDS`.

    Names the project the field comes from: TorchEasyRec for its own messages (``Tz*``)
    and fields, EasyRec otherwise.

    Args:
        message: odl's message (short name) that would hold the field.
        field: the field's name.

    Returns:
        ``"<field> is a(n) <EasyRec|TorchEasyRec> field that odl does not implement yet"``.
    """
    if message.startswith("Tz") or field in _TORCHEASYREC_ONLY_FIELDS.get(message, ()):
        return f"{field} is a TorchEasyRec field that odl does not implement yet"
    return f"{field} is an EasyRec field that odl does not implement yet"


# Enum values of EasyRec that odl's enums lack, keyed by odl's enum (short name).
EASYREC_NOT_IMPLEMENTED_VALUES: dict[str, frozenset[str]] = {
    "FeatureConfig.FeatureType": frozenset({
        "PassThroughFeature",
    }),
    "WideOrDeep": frozenset({"JAGGED_SEQUENCE"}),
    "LossType": frozenset({
        "SOFTMAX_CROSS_ENTROPY",
        "CIRCLE_LOSS", "MULTI_SIMILARITY_LOSS", "SOFTMAX_CROSS_ENTROPY_WITH_NEGATIVE_MINING",
        "PAIRWISE_LOSS",
        "PAIRWISE_HINGE_LOSS", "LISTWISE_RANK_LOSS", "LISTWISE_DISTILL_LOSS",
    }),
}


def infer_model_class(config: pipeline_pb2.EasyRecConfig) -> None:
    """Sets ``model_config.model_class`` from the model's message when only that is given.

    TorchEasyRec names the model by its message alone (``deepfm { ... }``,
    ``wide_and_deep { ... }``); EasyRec by ``model_class``.

    Args:
        config: a parsed config, changed in place.
    """
    mc = config.model_config
    if not config.HasField("model_config") or mc.model_class:
        return
    for model_class, field in MODEL_MESSAGES.items():
        if mc.HasField(field):
            mc.model_class = model_class
            return


def check_implemented(config: pipeline_pb2.EasyRecConfig) -> None:
    """Rejects EasyRec values that parse but that odl does not implement.

    Args:
        config: a parsed config.

    Raises:
        ConfigError: e.g. a model_class odl lacks, or num_class < 1.

    """
    mc = config.model_config
    if mc.model_class and mc.model_class not in IMPLEMENTED_MODEL_CLASSES:
        raise ConfigError("model_config.model_class",
                          f"model class {mc.model_class!r} is an EasyRec value that odl does not "
                          f"implement yet (implemented: {', '.join(IMPLEMENTED_MODEL_CLASSES)})")
    if mc.num_class < 1:
        raise ConfigError("model_config.num_class",
                          "must be at least 1 (1: binary classification, C > 1: C classes)")
    dc = config.data_config
    if dc.fg_mode == pipeline_pb2.DatasetConfig.FG_BUCKETIZE:
        raise ConfigError("data_config.fg_mode",
                          "FG_BUCKETIZE is a TorchEasyRec value that odl does not implement: "
                          "odl reads raw column values and hashes / buckets them itself")
    if dc.fg_mode in (pipeline_pb2.DatasetConfig.FG_NORMAL, pipeline_pb2.DatasetConfig.FG_DAG):
        logger.warning("data_config.fg_mode %s: odl runs no feature generator; it reads each "
                       "id_feature / raw_feature from its expression's column, which is what "
                       "the generator makes of such a feature (other generator features are "
                       "refused by name)", pipeline_pb2.DatasetConfig.FgMode.Name(dc.fg_mode))
    if len(config.data_config.label_fields) > 1 and not is_multi_task_model(mc):
        raise ConfigError("data_config.label_fields",
                          "several label fields train a multi-task model "
                          f"({', '.join(multi_task_model_classes())}); "
                          f"{mc.model_class or 'this model'} trains on one label")


# DNN fields spelled as TorchEasyRec spells them: its MLP's use_bn defaults to false, as odl's
# DNN does, so leaving it unwritten builds the model TorchEasyRec builds.
_TORCHEASYREC_DNN_FIELDS = frozenset({
    "deep", "final", "mlp", "dense_mlp", "expert_mlp", "bottom_mlp", "relation_mlp",
    "gate_mlp", "top_mlp", "feature_num_mlp",
})
# Settings of TorchEasyRec's models (their DNNs default to no normalization there too); the
# other TorchEasyRec messages are named Tz*.
_TORCHEASYREC_MODEL_FIELDS = frozenset({"dcn_v2", "mask_net", "wukong"})


def unwritten_batch_norm_dnns(config: pipeline_pb2.EasyRecConfig) -> list[str]:
    """Paths of an EasyRec config's DNNs that do not write ``use_bn``.

    (Of a backbone's ``MLP``: ``use_bn`` where it has hidden layers, or ``use_final_bn``.)
    EasyRec's ``DNN`` (and ``MLP``) default to ``use_bn: true``; odl's, like TorchEasyRec's
    MLP, to false, because a layer normalized by each batch's statistics caps how far one
    id's weights can move the logit, which slows online learning (docs/config.md, "Batch
    normalization"). A config is in TorchEasyRec's form when it writes
    ``train_config.sparse_optimizer`` or ``dense_optimizer``: then nothing is listed. In
    EasyRec's form, TorchEasyRec's spellings (``deep``, ``final``, ``*mlp``) and models
    (DCNV2, MaskNet, WuKong, the DIN encoder) are not listed either.

    Args:
        config: a parsed config, before :func:`odl.config.config_forms.normalize_config_forms`
            renames TorchEasyRec's spellings.

    Returns:
        Dotted paths such as ``model_config.deepfm.final_dnn``, in field order.
    """
    tc = config.train_config
    if tc.HasField("sparse_optimizer") or tc.HasField("dense_optimizer"):
        return []
    found: list[str] = []

    def walk(message, path: str) -> None:
        for fd, value in message.ListFields():
            if (fd.message_type is None or fd.message_type.GetOptions().map_entry
                    or fd.message_type.name.startswith("Tz")
                    or fd.name in _TORCHEASYREC_MODEL_FIELDS):
                continue
            repeated = fd.is_repeated
            for i, item in enumerate(value if repeated else [value]):
                where = f"{path}.{fd.name}" + (f"[{i}]" if repeated else "")
                if fd.message_type.name == "MLP":  # the backbone's: two settings
                    units = len(item.hidden_units)
                    if ((units > 1 and not item.HasField("use_bn"))
                            or not item.HasField("use_final_bn")):
                        found.append(where)
                elif fd.message_type.name != "DNN":
                    walk(item, where)
                elif fd.name not in _TORCHEASYREC_DNN_FIELDS and not item.HasField("use_bn"):
                    found.append(where)

    walk(config.model_config, "model_config")
    return found


def warn_unwritten_batch_norm(config: pipeline_pb2.EasyRecConfig) -> None:
    """Logs one warning naming the DNNs of :func:`unwritten_batch_norm_dnns` (none: silent).

    Args:
        config: a parsed config, before its forms are normalized.
    """
    paths = unwritten_batch_norm_dnns(config)
    if not paths:
        return
    logger.warning(
        "%s: use_bn (an MLP's: or use_final_bn) is not written, so odl builds no batch "
        "normalization there; EasyRec's default is use_bn: true. Normalizing by each batch's "
        "statistics slows online learning "
        "(docs/config.md, \"Batch normalization\"); write use_bn: true for EasyRec's layers, "
        "use_bn: false to keep odl's and silence this", ", ".join(paths))
