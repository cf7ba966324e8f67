"""Pipeline configs over the synthetic stream's schema, generated with chosen sizes.

``deepfm_config_text`` writes a DeepFM config; ``as_model_config_text`` turns it into the
other model classes over the same feature groups. ``bursty_config_text`` writes a DeepFM
config over the bursty stream's schema (``odl.datagen.bursty_stream``).

Tests use small tables for speed; ``bench/train_throughput.py`` uses the benchmark shape
(26 id features of dim 16, 13 dense, batch 1024). ``samples/deepfm_online.config`` is the
hand-written, commented counterpart for users.
"""

from __future__ import annotations

import re

from odl.datagen.behavior_history import HISTORY_FIELD, HISTORY_LENGTH, encode_with_history
from odl.datagen.bursty_stream import BURSTY_ID_FIELDS
from odl.datagen.conversion_labels import encode_with_conversions
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
    dnn {{ hidden_units: [{', '.join(str(h) for h in hidden_units)}] }}
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
    dnn {{ hidden_units: [{', '.join(str(h) for h in hidden_units)}] }}
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


_TOWER_BLOCKS = {
    "WideAndDeep": "wide_and_deep {{\n    {final}dnn {{ hidden_units: [{units}] }}\n"
                   "    wide_output_dim: 1\n  }}",
    "MultiTower": ('multi_tower {{\n'
                   '    towers {{ input: "deep" dnn {{ hidden_units: [{units}] }} }}\n'
                   '    towers {{ input: "wide" dnn {{ hidden_units: [8] }} }}\n'
                   "    final_dnn {{ hidden_units: [8] }}\n  }}"),
    "MultiTowerDIN": ('seq_att_groups {{ group_name: "din"\n'
                      '    seq_att_map {{ key: "C3" hist_seq: "hist_C3" }} }}\n'
                      '  multi_tower {{\n'
                      '    towers {{ input: "deep" dnn {{ hidden_units: [{units}] }} }}\n'
                      '    din_towers {{ input: "din" dnn {{ hidden_units: [8, 1] }} }}\n'
                      "    final_dnn {{ hidden_units: [8] }}\n  }}"),
    "DCN": ('dcn {{\n    deep_tower {{ input: "deep" dnn {{ hidden_units: [{units}] }} }}\n'
            '    cross_tower {{ input: "deep" cross_num: 2 }}\n'
            "    final_dnn {{ hidden_units: [8] }}\n  }}"),
    # TorchEasyRec's form (final, not final_dnn); it reads the first group: "deep" is put first
    "DCNV2": ("dcn_v2 {{\n    cross {{ cross_num: 2 low_rank: 8 }}\n"
              "    deep {{ hidden_units: [{units}] }}\n    final {{ hidden_units: [8] }}\n  }}"),
    "MaskNet": ("mask_net {{\n    mask_net_module {{\n      n_mask_blocks: 2\n"
                "      mask_block {{ reduction_ratio: 1 hidden_dim: 32 }}\n"
                "      top_mlp {{ hidden_units: [{units}] }}\n    }}\n  }}"),
}


_MULTI_TASK_BLOCKS = {
    "MMoE": ('mmoe {{\n    expert_dnn {{ hidden_units: [{units}] }}\n    num_expert: 3\n'
             '    task_towers {{ tower_name: "ctr" label_name: "label" '
             'dnn {{ hidden_units: [8] }} }}\n'
             '    task_towers {{ tower_name: "cvr" label_name: "buy" '
             'dnn {{ hidden_units: [8] }} }}\n  }}'),
    "DBMTL": ('dbmtl {{\n    bottom_dnn {{ hidden_units: [{units}] }}\n'
              '    task_towers {{ tower_name: "ctr" label_name: "label" '
              'dnn {{ hidden_units: [8] }} relation_dnn {{ hidden_units: [8] }} }}\n'
              '    task_towers {{ tower_name: "cvr" label_name: "buy" '
              'dnn {{ hidden_units: [8] }} relation_tower_names: "ctr" '
              'relation_dnn {{ hidden_units: [8] }} }}\n  }}'),
    "ESMM": ('esmm {{\n    groups {{ input: "all" dnn {{ hidden_units: [{units}] }} }}\n'
             '    cvr_tower {{ tower_name: "cvr" label_name: "buy" '
             'dnn {{ hidden_units: [8] }} }}\n'
             '    ctr_tower {{ tower_name: "ctr" label_name: "label" '
             'dnn {{ hidden_units: [8] }} }}\n  }}'),
    "PLE": ('ple {{\n    extraction_networks {{ network_name: "layer1" expert_num_per_task: 2 '
            'share_num: 1 task_expert_net {{ hidden_units: [{units}] }} '
            'share_expert_net {{ hidden_units: [{units}] }} }}\n'
            '    extraction_networks {{ network_name: "layer2" expert_num_per_task: 1 '
            'share_num: 1 task_expert_net {{ hidden_units: [8] }} '
            'share_expert_net {{ hidden_units: [8] }} }}\n'
            '    task_towers {{ tower_name: "ctr" label_name: "label" '
            'dnn {{ hidden_units: [8] }} }}\n'
            '    task_towers {{ tower_name: "cvr" label_name: "buy" '
            'dnn {{ hidden_units: [8] }} }}\n  }}'),
}
MULTI_TASK_MODELS = tuple(_MULTI_TASK_BLOCKS)


def records_for_model(model: str, stream: SyntheticCtrStream, batch: CtrBatch,
                      fmt: str = "csv") -> list[bytes]:
    """``batch``'s records with the columns ``as_model_config_text(text, model)`` reads.

    Args:
        model: the model class of the config.
        stream: the stream that made ``batch``.
        batch: the records.
        fmt: ``"csv"`` or ``"json"``.

    Returns:
        The encoded records: with ``buy`` for the multi-task models, ``hist_C3`` for
        MultiTowerDIN, the stream's 42 columns otherwise.
    """
    if model in MULTI_TASK_MODELS:
        return encode_with_conversions(batch, stream.seed, fmt)
    if model == "MultiTowerDIN":
        return encode_with_history(stream, batch, fmt)
    return batch.encode(fmt)


def as_model_config_text(text: str, model: str, final_dnn: bool = False) -> str:
    """A ``deepfm_config_text`` config as another model class over the same feature groups.

    WideAndDeep keeps the deep tower (with ``final_dnn``: a tower of 8 over [wide, deep]);
    MultiTower gets one tower per group ("deep", "wide"); DCN a deep tower and a cross
    network of 2 layers over "deep"; DCNV2 (TorchEasyRec's form) a v2 cross network of 2
    layers of rank 8 and the deep tower over "deep" (the "wide" group goes: DCNV2 reads the
    first group); MaskNet (TorchEasyRec's) two parallel mask blocks of 32 over "deep" and
    the DeepFM tower as its top MLP (the "wide" group goes); MultiTowerDIN the deep tower
    and a DIN tower (attention DNN [8, 1]) from C3
    over ``hist_C3``, a column added after the stream's 42 (``odl.datagen.behavior_history``).
    The tower models end in a ``final_dnn`` of 8. MMoE and
    DBMTL read the "deep" group (renamed "all"; the "wide" group goes) and train two tasks,
    "ctr" on ``label`` and "cvr" on ``buy``, a column added after the stream's 42
    (``odl.datagen.conversion_labels``): MMoE with 3 experts like the DeepFM tower, DBMTL
    with the DeepFM tower as its bottom and "cvr" related to "ctr", ESMM with the DeepFM tower
    as its group's DNN (outputs "cvr", "ctr", "ctcvr"), PLE with two extraction networks
    (2 task experts like the DeepFM tower and 1 shared, then 1 and 1 of 8 units). FM
    (EasyRec's) keeps the groups with the dense features moved from the deep group (FM's
    vectors) to the wide group (a first-order term each). DLRM (EasyRec's) reads a "dense"
    group (the dense features, through a bot_dnn of one layer as wide as the embeddings) and a
    "sparse" group (the id features), its top_dnn the DeepFM tower; WuKong (TorchEasyRec's)
    the same groups, its dense_mlp as DLRM's bot_dnn, one layer of 8 + 8 vectors (FM
    compressed to 8, an MLP of 32) and the DeepFM tower as its final MLP.

    Args:
        text: the DeepFM config text.
        model: ``"DeepFM"`` (unchanged), ``"WideAndDeep"``, ``"MultiTower"``, ``"DCN"``,
            ``"DCNV2"``, ``"MultiTowerDIN"``, ``"MMoE"``, ``"DBMTL"``, ``"ESMM"``, ``"PLE"``,
            ``"FM"``, ``"DLRM"``, ``"MaskNet"`` or ``"WuKong"``.
        final_dnn: WideAndDeep only: join wide and deep through ``final_dnn``.

    Returns:
        The config text.
    """
    if model == "DeepFM":
        return text
    m = re.search(r"deepfm \{\n    dnn \{ hidden_units: \[([^\]]*)\] \}.*?\n  \}", text, re.S)
    if m is None:
        raise ValueError("not a deepfm_config_text config")
    if model == "FM":
        text = text[:m.start()] + "fm { l2_regularization: 1e-5 }" + text[m.end():]
        dense = " ".join(f'feature_names: "{f}"' for f in DENSE_FIELDS)
        text = text.replace(f" {dense} wide_deep: DEEP", " wide_deep: DEEP")
        text = text.replace(" wide_deep: WIDE }", f" {dense} wide_deep: WIDE }}", 1)
        return text.replace('model_class: "DeepFM"', 'model_class: "FM"')
    if model in ("DLRM", "WuKong"):  # the dense features' MLP ends at the embedding dim
        dim = re.search(r"IdFeature embedding_dim: (\d+)", text)
        if dim is None:
            raise ValueError(f"{model} needs the id features' embedding_dim")
        block = (f"dlrm {{\n    bot_dnn {{ hidden_units: [{dim.group(1)}] }}\n"
                 f"    top_dnn {{ hidden_units: [{m.group(1)}] }}\n  }}" if model == "DLRM" else
                 f"wukong {{\n    dense_mlp {{ hidden_units: [{dim.group(1)}] }}\n"
                 "    wukong_layers { lcb_feature_num: 8 fmb_feature_num: 8 "
                 "compressed_feature_num: 8\n      feature_num_mlp { hidden_units: [32] } }\n"
                 f"    final {{ hidden_units: [{m.group(1)}] }}\n  }}")
        text = text[:m.start()] + block + text[m.end():]
        text = re.sub(r'  feature_groups \{ group_name: "wide" [^\n]*\n', "", text)
        dense = " ".join(f'feature_names: "{f}"' for f in DENSE_FIELDS)
        text = text.replace(f" {dense} wide_deep: DEEP", " wide_deep: DEEP").replace(
            '  feature_groups { group_name: "deep"',
            f'  feature_groups {{ group_name: "dense" {dense} wide_deep: DEEP }}\n'
            '  feature_groups { group_name: "sparse"')
        return text.replace('model_class: "DeepFM"', f'model_class: "{model}"')
    if model in _MULTI_TASK_BLOCKS:
        block = _MULTI_TASK_BLOCKS[model].format(units=m.group(1))
        text = text[:m.start()] + block + text[m.end():]
        text = re.sub(r'  feature_groups \{ group_name: "wide" [^\n]*\n', "", text)
        text = text.replace('group_name: "deep"', 'group_name: "all"')
        last = text.rindex("  input_fields {")
        end = text.index("\n", last) + 1
        text = (text[:end] + '  input_fields { input_name: "buy" input_type: INT32 }\n'
                + text[end:])
        text = text.replace('label_fields: "label"', 'label_fields: "label"\n  label_fields: "buy"')
        return text.replace('model_class: "DeepFM"', f'model_class: "{model}"')
    block = _TOWER_BLOCKS[model].format(
        units=m.group(1), final="final_dnn { hidden_units: [8] }\n    " if final_dnn else "")
    text = text[:m.start()] + block + text[m.end():]
    if model in ("DCNV2", "MaskNet"):  # they read one group: "deep"
        text = re.sub(r'  feature_groups \{ group_name: "wide" [^\n]*\n', "", text)
    if model == "MultiTowerDIN":  # the history column and its SequenceFeature
        c3 = re.search(r'feature_configs \{ input_names: "C3" feature_type: IdFeature '
                       r"embedding_dim: (\d+) hash_bucket_size: (\d+) \}", text)
        if c3 is None:
            raise ValueError("MultiTowerDIN needs C3 as an id feature")
        last = text.rindex("  input_fields {")
        end = text.index("\n", last) + 1
        text = (text[:end] + f'  input_fields {{ input_name: "{HISTORY_FIELD}" '
                "input_type: STRING }\n" + text[end:])
        text = text.replace(c3.group(0), c3.group(0) + "\n" + (
            f'feature_configs {{ input_names: "{HISTORY_FIELD}" feature_type: SequenceFeature '
            f'separator: "|" embedding_dim: {c3.group(1)} hash_bucket_size: {c3.group(2)} '
            f"max_seq_len: {HISTORY_LENGTH} }}"))
    return text.replace('model_class: "DeepFM"', f'model_class: "{model}"')

