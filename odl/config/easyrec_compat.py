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
  :func:`infer_model_class`.
"""

from __future__ import annotations

import logging
from typing import Any

from odl.config.config_error import ConfigError
from odl.config.feature_settings import (
    expand_config_names,
    expand_shared_names,
    raw_num_buckets_to_boundaries,
)
from odl.config.model_classes import (
    IMPLEMENTED_MODEL_CLASSES,
    MODEL_MESSAGES,
    classes_of_message,
    is_multi_task_model,
    multi_task_model_classes,
)
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

__all__ = [
    "EASYREC_NO_EFFECT_FIELDS",
    "EASYREC_NOT_IMPLEMENTED_FIELDS",
    "EASYREC_NOT_IMPLEMENTED_VALUES",
    "IMPLEMENTED_MODEL_CLASSES",
    "check_implemented",
    "infer_model_class",
    "normalize_config_forms",
    "not_implemented_field_message",
]

# Fields of Alibaba EasyRec's (and TorchEasyRec's) pipeline config that odl does not implement,
# keyed by the odl message that would hold them. A config using one is rejected with "... is an
# EasyRec field that odl does not implement yet" instead of "unknown field". A name leaves this
# table when odl implements the field (and pipeline.proto gains it).
EASYREC_NOT_IMPLEMENTED_FIELDS: dict[str, frozenset[str]] = {
    "EasyRecConfig": frozenset({
        "hive_train_input", "binary_train_input", "parquet_train_input", "odps_train_input",
        "oss_train_input", "fg_json_path",
    }),
    "KafkaServer": frozenset({"consumer", "sink"}),
    "DatasetConfig": frozenset({
        "label_sep", "label_dim", "extra_label_func", "shard",
        "file_shard", "selected_cols", "selected_col_types", "rtp_separator", "ignore_error",
        "sample_weight", "data_compression_type", "n_data_batch_tfrecord", "with_header",
        "feature_fields", "negative_sampler", "negative_sampler_v2", "hard_negative_sampler",
        "hard_negative_sampler_v2", "negative_sampler_in_memory", "drop_remainder",
        "fg_encoded", "fg_encoded_multival_sep",
    }),
    "DatasetConfig.Field": frozenset({
        "input_dim", "input_shape", "user_define_fn", "user_define_fn_path",
        "user_define_fn_res_type", "ignore_val",
    }),
    "FeatureConfigV2": frozenset({"embedding_on_cpu"}),
    "TzIdFeature": frozenset({"value_dim", "vocab_list", "vocab_dict", "vocab_file",
                              "default_value", "default_bucketize_value", "weighted",
                              "init_fn", "zch", "mc_modules",
                              "dynamicemb", "trainable", "data_type", "fg_value_type",
                              "constraints", "stub_type"}),
    "TzRawFeature": frozenset({"normalizer", "default_value", "init_fn",
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
        "seq_multi_sep",
        "lookup_max_sel_elem_num", "max_partitions", "initializer",
        "precision", "normalizer_fn",
        "sequence_length", "expression", "combo_input_seps",
        # TorchEasyRec's other per-kind feature messages.
        "combo_feature", "lookup_feature", "match_feature",
        "expr_feature", "overlap_feature", "tokenize_feature", "custom_feature",
        "sequence_id_feature", "sequence_raw_feature", "bool_mask_feature",
    }),
    "MultiTower": frozenset({"bst_towers"}),
    "SeqAttMap": frozenset({"aux_hist_seq"}),
    "SequenceCombiner": frozenset({"multi_head_attention"}),
    "TextCNN": frozenset({"mlp"}),
    "SeqAttGroupConfig": frozenset({"allow_key_transform", "transform_dnn"}),
    "FeatureGroupConfig": frozenset({"negative_sampler", "embedding_name_suffix"}),
    "EasyRecModel": frozenset({
        "model_name", "model_params", "dummy", "fm",
        "autoint", "dlrm", "cmbf", "uniter", "multi_tower_recall", "dssm", "mind",
        "dropoutnet", "metric_learning", "pdn", "dssm_senet", "dat", "esmm",
        "simple_multi_task", "ple", "rocket_launching", "kd",
        "restore_filters", "variational_dropout", "backbone",
        "label_name", "din", "bst", "dien", "masknet", "fibinet", "ppnet", "wukong",
        "rank_model", "dlrm_hstu",
    }),
    "Loss": frozenset({
        "loss_name", "softmax_loss", "circle_loss", "multi_simi_loss",
        "pairwise_hinge_loss", "listwise_rank_loss", "listwise_distill_loss",
    }),
    "DNN": frozenset({"use_final_bn", "final_activation", "use_final_bias", "use_bias"}),
    "TaskTower": frozenset({"use_sample_weight", "bias_tower",
                            "pareto_min_loss_weight", "sample_weight_name"}),
    "MMoE": frozenset({"experts"}),
    "DBMTL": frozenset({"bottom_cmbf", "bottom_uniter", "use_feature_bn", "use_feature_ln",
                        "sequence_dnn"}),
    "TrainConfig": frozenset({
        "sparse_accumulator_type",
        "force_restore_shape_compatible", "freeze_gradient",
        "save_checkpoints_epochs", "fine_tune_ckpt_param_map", "cudnn_allow_tf32",
        "cuda_matmul_allow_tf32",
        "global_embedding_constraints", "mixed_precision", "grad_scaler",
        "gradient_accumulation_steps",
    }),
    "IncrementSaveConfig": frozenset({"datahub"}),
    "IncrementSaveConfig.Kafka.Consumer": frozenset({"config_topic", "config_global", "timeout"}),
    "IncrementSaveConfig.File": frozenset({"relative", "mount_path"}),
    "OptimizerConfig": frozenset({
        "rms_prop_optimizer", "momentumw_optimizer", "adam_async_optimizer",
        "adam_asyncw_optimizer", "embedding_learning_rate_multiplier",
    }),
    "LearningRate": frozenset({"manual_step_learning_rate", "transformer_learning_rate"}),
    "SparseOptimizer": frozenset({
        "lars_sgd_optimizer", "partial_rowwise_adam_optimizer",
        "partial_rowwise_lamb_optimizer", "rowwise_adagrad_optimizer_with_decay",
        "adadelta_optimizer", "rmsprop_optimizer", "manual_step_learning_rate",
        "cosine_annealing_warm_restarts_learning_rate",
    }),
    "DenseOptimizer": frozenset({
        "adadelta_optimizer", "rmsprop_optimizer", "part_optimizers", "ema",
        "manual_step_learning_rate", "cosine_annealing_warm_restarts_learning_rate",
    }),
    # TorchEasyRec's per-kernel clipping of the table gradients (fbgemm's gradient_clipping)
    "TzrecSgdOptimizer": frozenset({"gradient_clipping", "max_gradient"}),
    "TzrecAdagradOptimizer": frozenset({"gradient_clipping", "max_gradient"}),
    "TzrecAdamOptimizer": frozenset({"weight_decay", "gradient_clipping", "max_gradient"}),
    "TzrecRowWiseAdagradOptimizer": frozenset({
        "weight_decay", "weight_decay_mode", "gradient_clipping", "max_gradient"}),
    "TzrecLambOptimizer": frozenset({"gradient_clipping", "max_gradient"}),
    "GradClipping": frozenset({"enable_global_grad_clip"}),
}

# Fields of EasyRec's / TorchEasyRec's pipeline config that change nothing in an odl run:
# accepted with one warning naming the field and why, and dropped. Keyed by the odl message
# that would hold them; each maps to (why it has no effect, values that WOULD change the
# trained model and are refused as not implemented, lower case, empty: none).
EASYREC_NO_EFFECT_FIELDS: dict[str, dict[str, tuple[str, frozenset[str]]]] = {
    "EasyRecConfig": {
        "export_config": ("odl-export has its own options (docs/serving.md)", frozenset()),
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
    },
    "TrainConfig": {
        "sync_replicas": ("one trainer process (no parameter-server replicas)", frozenset()),
        "startup_delay_steps": ("one trainer process", frozenset()),
        "train_distribute": ("one trainer process", frozenset()),
        "num_gpus_per_worker": ("the device is --device", frozenset()),
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
        "use_dense_ema": ("odl keeps no moving average of the weights",
                          frozenset({"true", "1", "t", "yes"})),
    },
    "SeqAttGroupConfig": {
        "tf_summary": ("no TensorFlow summaries; metrics go to /status and /metrics",
                       frozenset()),
        "allow_key_search": ("keys are looked up by feature name", frozenset()),
        "need_key_feature": ("a DIN tower's output holds the key's embedding",
                             frozenset({"false", "0", "f", "no"})),
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
    "EasyRecModel": frozenset({"rank_model", "dlrm_hstu", "wukong"}),
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
        "LookupFeature", "ExprFeature", "PassThroughFeature",
    }),
    "WideOrDeep": frozenset({"JAGGED_SEQUENCE"}),
    "DatasetConfig.InputType": frozenset({
        "CSVInputV2", "CSVInputEx", "OdpsInput", "OdpsInputV2", "OdpsInputV3", "DataHubInput",
        "RTPInput", "RTPInputV2", "OdpsRTPInput", "OdpsRTPInputV2", "TFRecordInput",
        "BatchTFRecordInput", "DummyInput", "HiveInput", "HiveRTPInput", "HiveParquetInput",
        "ParquetInputV2", "ParquetInputV3", "CriteoInput",
    }),
    "LossType": frozenset({
        "SOFTMAX_CROSS_ENTROPY",
        "CIRCLE_LOSS", "MULTI_SIMILARITY_LOSS", "SOFTMAX_CROSS_ENTROPY_WITH_NEGATIVE_MINING",
        "PAIRWISE_LOSS",
        "BINARY_CROSS_ENTROPY_LOSS",
        "ZILN_LOSS", "PAIRWISE_HINGE_LOSS", "LISTWISE_RANK_LOSS", "LISTWISE_DISTILL_LOSS",
        "KL_DIVERGENCE_LOSS",
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


def normalize_config_forms(config: pipeline_pb2.EasyRecConfig) -> None:
    """Rewrites EasyRec's and TorchEasyRec's other spellings of what odl implements, in place.

    * ``feature_type: TagFeature`` (tags split on ``separator``) becomes the multi-valued
      ``IdFeature`` it is, its weights (a second input, or ``kv_separator``) kept;
    * names ``c[1-3]`` of input fields (with ``data_config.auto_expand_input_fields``) and of
      feature groups become ``c1, c2, c3``, and a RawFeature's ``num_buckets`` over
      ``min_val`` / ``max_val`` becomes its boundaries
      (:mod:`odl.config.feature_settings`);
    * TorchEasyRec's ``deepfm { deep {} final {} }`` become ``dnn`` / ``final_dnn``; its
      ``*_mlp`` / ``mlp`` of MMoE, DBMTL and their task towers become EasyRec's ``*_dnn`` /
      ``dnn``;
    * TorchEasyRec's ``losses { binary_cross_entropy {} }`` (of the model or of a task tower)
      becomes ``loss_type: CLASSIFICATION``;
    * TorchEasyRec's ``train_config.num_epochs`` moves to ``data_config.num_epochs`` when that
      is unset;
    * TorchEasyRec's ``feature_configs { id_feature {} }`` / ``raw_feature {}`` become EasyRec's
      flat ``IdFeature`` / ``RawFeature`` (input column: the expression after ``:``, or the
      feature name), and ``feature_groups[].group_type`` becomes ``wide_deep``; such a config
      without ``data_config.input_fields`` gets them derived (:func:`_derive_input_fields`).

    Idempotent; the loader and the validator both call it.

    Args:
        config: a parsed config.

    Raises:
        ConfigError: a form that cannot be rewritten (both names given, tag weights).
    """
    ft = pipeline_pb2.FeatureConfig.FeatureType
    expand_config_names(config)
    expand_shared_names(config)
    torcheasyrec_features = _flatten_torcheasyrec_sequences(config)
    for path, fc in _feature_entries(config):
        torcheasyrec_features |= fc.HasField("id_feature") or fc.HasField("raw_feature")
        _flatten_torcheasyrec_feature(path, fc)
        raw_num_buckets_to_boundaries(fc)
        if fc.feature_type == ft.RawFeature and fc.hash_bucket_size:
            logger.warning("%s.hash_bucket_size has no effect on a RawFeature and is ignored "
                           "(as EasyRec does): a raw value is dense, bucketized by boundaries, "
                           "or projected by embedding_dim, never hashed", path)
            fc.ClearField("hash_bucket_size")
        if fc.feature_type != ft.TagFeature:
            continue
        fc.feature_type = ft.IdFeature
    if torcheasyrec_features and not config.data_config.input_fields:
        _derive_input_fields(config)
    mc = config.model_config
    for i, g in enumerate(mc.feature_groups):
        if g.HasField("group_type"):
            if g.HasField("wide_deep") and g.wide_deep != g.group_type:
                raise ConfigError(f"model_config.feature_groups[{i}].group_type",
                                  "give one of group_type (TorchEasyRec) and wide_deep (EasyRec)")
            g.wide_deep = g.group_type
            g.ClearField("group_type")
    _sequence_groups_to_attention(config)
    if mc.HasField("multi_tower_din"):  # TorchEasyRec's DIN, read through multi_tower
        src = pipeline_pb2.TzMultiTowerDIN()
        src.CopyFrom(mc.multi_tower_din)  # setting multi_tower clears it (oneof model)
        mc.multi_tower.towers.extend(src.towers)
        mc.multi_tower.din_towers.extend(src.din_towers)
        if src.HasField("final"):
            mc.multi_tower.final.CopyFrom(src.final)
        mc.multi_tower.l2_regularization = 0.0  # TorchEasyRec's models have none
        if not mc.model_class:
            mc.model_class = classes_of_message("multi_tower_din")[0]
    if mc.HasField("deepfm"):
        _rename(mc.deepfm, "model_config.deepfm", (("deep", "dnn"), ("final", "final_dnn")))
    if mc.HasField("multi_tower"):
        _rename(mc.multi_tower, "model_config.multi_tower", (("final", "final_dnn"),))
        for i, tower in enumerate(mc.multi_tower.towers):
            _rename(tower, f"model_config.multi_tower.towers[{i}]", (("mlp", "dnn"),))
    if mc.HasField("dcn_v2"):
        _rename(mc.dcn_v2, "model_config.dcn_v2", (("final", "final_dnn"),))
    if mc.HasField("mmoe"):
        _rename(mc.mmoe, "model_config.mmoe", (("expert_mlp", "expert_dnn"),))
    if mc.HasField("dbmtl"):
        _rename(mc.dbmtl, "model_config.dbmtl",
                (("bottom_mlp", "bottom_dnn"), ("expert_mlp", "expert_dnn")))
    losses = list(mc.losses)
    for field in ("mmoe", "dbmtl"):
        for i, task in enumerate(getattr(mc, field).task_towers):
            _rename(task, f"model_config.{field}.task_towers[{i}]",
                    (("mlp", "dnn"), ("relation_mlp", "relation_dnn")))
            losses += list(task.losses)
    for loss in losses:
        if loss.HasField("binary_cross_entropy"):
            loss.loss_type = pipeline_pb2.CLASSIFICATION
            loss.ClearField("binary_cross_entropy")
    tc = config.train_config
    if tc.HasField("num_epochs"):
        if not config.data_config.HasField("num_epochs"):
            config.data_config.num_epochs = tc.num_epochs
        tc.ClearField("num_epochs")


def _flatten_torcheasyrec_sequences(config: pipeline_pb2.EasyRecConfig) -> bool:
    """TorchEasyRec's ``sequence_feature {}`` entries into flat SequenceFeatures.

    Each ``id_feature`` inside becomes the SequenceFeature ``<sequence_name>__<feature_name>``
    reading the column of that name (items split on ``sequence_delim``, the first
    ``sequence_length`` kept), with the id feature's buckets, dim and embedding name.

    Returns:
        Whether there was one (the config is TorchEasyRec's form).
    """
    ft = pipeline_pb2.FeatureConfig.FeatureType
    found = False
    for container in (config.feature_configs, config.feature_config.features):
        if not any(fc.HasField("sequence_feature") for fc in container):
            continue
        found = True
        flat = []
        for fc in container:
            if not fc.HasField("sequence_feature"):
                flat.append(fc)
                continue
            seq = fc.sequence_feature
            for sub in seq.features:
                raw = sub.HasField("raw_feature")
                tz = sub.raw_feature if raw else sub.id_feature
                name = f"{seq.sequence_name}__{tz.feature_name}"
                out = pipeline_pb2.FeatureConfig(
                    feature_name=name, feature_type=ft.SequenceFeature,
                    separator=seq.sequence_delim, max_seq_len=seq.sequence_length,
                    sub_feature_type=ft.RawFeature if raw else ft.IdFeature)
                out.input_names.append(name)
                for field in ("hash_bucket_size", "num_buckets", "embedding_dim",
                              "embedding_name"):
                    if field in tz.DESCRIPTOR.fields_by_name and tz.HasField(field):
                        setattr(out, field, getattr(tz, field))
                if raw:
                    out.boundaries.extend(tz.boundaries)
                    if not tz.boundaries:  # dense positions: nothing is embedded
                        out.ClearField("embedding_dim")
                flat.append(out)
        del container[:]
        container.extend(flat)
    return found


def _sequence_groups_to_attention(config: pipeline_pb2.EasyRecConfig) -> None:
    """TorchEasyRec's sequence groups into EasyRec's sequence attention forms.

    A SEQUENCE feature group becomes a ``seq_att_groups`` entry (a DIN tower's input); a
    DEEP group's ``sequence_groups`` read by its ``sequence_encoders`` become the group's
    ``sequence_features``, one per encoder in encoder order (:func:`_encoders_to_attention`).
    In both, the group's SequenceFeatures are the sequence, its other features the query
    (key).

    Raises:
        ConfigError: TorchEasyRec's rules for sequence groups and encoders broken.
    """
    mc = config.model_config
    sequences = {fc.feature_name for _p, fc in _feature_entries(config)
                 if fc.feature_type == pipeline_pb2.FeatureConfig.SequenceFeature}
    keep = []
    for i, g in enumerate(mc.feature_groups):
        if g.sequence_groups or g.sequence_encoders:
            _encoders_to_attention(g, f"model_config.feature_groups[{i}]", sequences)
        if g.wide_deep != pipeline_pb2.SEQUENCE:
            keep.append(g)
            continue
        att = mc.seq_att_groups.add(group_name=g.group_name)
        att.seq_att_map.add(key=[f for f in g.feature_names if f not in sequences],
                            hist_seq=[f for f in g.feature_names if f in sequences])
    if len(keep) != len(mc.feature_groups):
        kept = [pipeline_pb2.FeatureGroupConfig.FromString(g.SerializeToString()) for g in keep]
        del mc.feature_groups[:]
        mc.feature_groups.extend(kept)


def _encoders_to_attention(group: pipeline_pb2.FeatureGroupConfig, where: str,
                           sequences: set[str]) -> None:
    """A DEEP group's ``sequence_groups`` / ``sequence_encoders`` into ``sequence_features``.

    TorchEasyRec's rules: both or neither are given; an encoder without ``input`` reads the
    only sequence group (which may be unnamed); every sequence group is read by an encoder.
    A DIN encoder becomes a target attention with ``attn_mlp``, a pooling encoder one with
    ``pooling``.
    """
    if group.wide_deep != pipeline_pb2.DEEP:
        raise ConfigError(f"{where}.sequence_groups",
                          "sequence_groups and sequence_encoders belong to a DEEP group")
    if not group.sequence_groups or not group.sequence_encoders:
        raise ConfigError(f"{where}.sequence_encoders",
                          "give both sequence_groups and sequence_encoders (an encoder reads "
                          "a sequence group)")
    named = {}
    for j, sg in enumerate(group.sequence_groups):
        name = sg.group_name or (group.group_name if len(group.sequence_groups) == 1 else "")
        if not name or name in named:
            raise ConfigError(f"{where}.sequence_groups[{j}].group_name",
                              "several sequence_groups need distinct names")
        hists = [f for f in sg.feature_names if f in sequences]
        if not hists:
            raise ConfigError(f"{where}.sequence_groups[{j}].feature_names",
                              f"sequence group {name!r} names no sequence feature")
        named[name] = ([f for f in sg.feature_names if f not in sequences], hists)
    read = set()
    for j, enc in enumerate(group.sequence_encoders):
        kind = enc.WhichOneof("seq_module")
        if kind is None:
            raise ConfigError(f"{where}.sequence_encoders[{j}]", "names no encoder")
        settings = getattr(enc, kind)
        name = settings.input or (next(iter(named)) if len(named) == 1 else "")
        if name not in named:
            raise ConfigError(f"{where}.sequence_encoders[{j}].{kind}.input",
                              f"must name one of the sequence_groups {sorted(named)}")
        keys, hists = named[name]
        # a group read by several encoders: one attention group each, named apart
        att = group.sequence_features.add(group_name=name if name not in read else
                                          f"{name}#{j}")
        read.add(name)
        att.seq_att_map.add(key=keys, hist_seq=hists)
        if kind == "din_encoder":
            if not settings.HasField("attn_mlp"):
                raise ConfigError(f"{where}.sequence_encoders[{j}].din_encoder.attn_mlp",
                                  "a DIN encoder needs its attn_mlp")
            att.attn_mlp.CopyFrom(settings.attn_mlp)
        else:
            if settings.pooling_type not in ("mean", "sum"):
                raise ConfigError(f"{where}.sequence_encoders[{j}].pooling_encoder.pooling_type",
                                  f"expected mean or sum, got {settings.pooling_type!r}")
            att.pooling = settings.pooling_type
    unread = [n for n in named if n not in read]
    if unread:
        raise ConfigError(f"{where}.sequence_encoders",
                          f"sequence groups {unread} are read by no encoder")
    group.ClearField("sequence_groups")
    group.ClearField("sequence_encoders")


def _derive_input_fields(config: pipeline_pb2.EasyRecConfig) -> None:
    """``data_config.input_fields`` of a TorchEasyRec config that names none.

    TorchEasyRec reads the columns from its table's schema; a stream's records need them
    named: the label fields (DOUBLE), then every feature's input columns in feature order
    (STRING for id features, DOUBLE for raw ones), each once. JSON records are read by these
    names; CSV records must have the columns in this order.
    """
    dc = config.data_config
    ft = pipeline_pb2.FeatureConfig.FeatureType
    types = pipeline_pb2.DatasetConfig
    columns: dict[str, int] = {name: types.DOUBLE for name in dc.label_fields}
    for _path, fc in _feature_entries(config):
        kind = (types.DOUBLE if fc.feature_type == ft.RawFeature and fc.raw_input_dim == 1
                else types.STRING)
        for name in fc.input_names:
            columns.setdefault(name, kind)
    for name, kind in columns.items():
        dc.input_fields.add(input_name=name, input_type=kind)
    logger.warning("data_config.input_fields is not given (TorchEasyRec takes the columns from "
                   "its table's schema): odl reads the columns %s (JSON records: by name; CSV: "
                   "in this order)", ", ".join(f"{n}:{types.FieldType.Name(k)}"
                                                for n, k in columns.items()))


def _rename(msg: Any, where: str, pairs: tuple[tuple[str, str], ...]) -> None:
    """Moves TorchEasyRec's ``alias`` fields of ``msg`` to EasyRec's ``name`` (one of the two)."""
    for alias, name in pairs:
        if msg.HasField(alias):
            if msg.HasField(name):
                raise ConfigError(f"{where}.{alias}",
                                  f"give one of {alias} (TorchEasyRec) and {name} (EasyRec)")
            getattr(msg, name).CopyFrom(getattr(msg, alias))
            msg.ClearField(alias)


_TZ_FIELDS = {"id_feature": ("feature_name", "hash_bucket_size", "num_buckets", "embedding_dim",
                              "embedding_name", "separator"),
              "raw_feature": ("feature_name", "embedding_dim", "embedding_name")}


def _flatten_torcheasyrec_feature(path: str, fc: pipeline_pb2.FeatureConfig) -> None:
    """``feature_configs { id_feature { ... } }`` / ``raw_feature`` into EasyRec's flat form.

    The input column is the expression's part after ``:`` (``"user:user_id"`` reads column
    ``user_id``), or the feature name.
    """
    kind = ("id_feature" if fc.HasField("id_feature") else
            "raw_feature" if fc.HasField("raw_feature") else None)
    if kind is None:
        return
    tz = getattr(fc, kind)
    flat = [f.name for f, _v in fc.ListFields() if f.name not in (kind,)]
    if flat:
        raise ConfigError(f"{path}.{kind}",
                          f"give the feature either as {kind} {{ }} (TorchEasyRec) or with "
                          f"EasyRec's fields, not both ({', '.join(flat)} set)")
    ft = pipeline_pb2.FeatureConfig.FeatureType
    fc.feature_type = ft.IdFeature if kind == "id_feature" else ft.RawFeature
    for name in _TZ_FIELDS[kind]:
        if tz.HasField(name):
            setattr(fc, name, getattr(tz, name))
    column = tz.expression.split(":", 1)[-1].strip() if tz.expression else tz.feature_name
    fc.input_names.append(column)
    if tz.expression:
        fc.fg_expression = tz.expression
    if kind == "id_feature" and tz.HasField("pooling"):
        fc.combiner = tz.pooling
    if kind == "raw_feature":
        fc.boundaries.extend(tz.boundaries)
        fc.raw_input_dim = max(int(tz.value_dim), 1)
        fc.separator = tz.separator
    fc.ClearField(kind)


def _feature_entries(config: pipeline_pb2.EasyRecConfig):
    """``(path, FeatureConfig)`` of both feature list forms, as written."""
    for i, fc in enumerate(config.feature_configs):
        yield f"feature_configs[{i}]", fc
    for i, fc in enumerate(config.feature_config.features):
        yield f"feature_config.features[{i}]", fc


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
