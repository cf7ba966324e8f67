"""A datagen DeepFM config as another model class, for tests and benches.

``as_model_config_text`` turns ``odl.datagen.datagen_config.deepfm_config_text``'s config into
each model class over the same feature groups; ``records_for_model`` encodes the records
that config reads. This module names model classes, so it lives with the test harness
(outside the installed package), not in the generator users run.
"""

from __future__ import annotations

import re

from odl.datagen.behavior_history import HISTORY_FIELD, HISTORY_LENGTH
from odl.datagen.conversion_labels import CONVERSION_FIELD
from odl.datagen.datagen_config import records_with_column
from odl.datagen.synthetic_ctr import DENSE_FIELDS, CtrBatch, SyntheticCtrStream

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
    "MultiTowerBST": ('seq_att_groups {{ group_name: "bst"\n'
                      '    seq_att_map {{ key: "C3" hist_seq: "hist_C3" }} }}\n'
                      '  multi_tower {{\n'
                      '    towers {{ input: "deep" dnn {{ hidden_units: [{units}] }} }}\n'
                      '    bst_towers {{ input: "bst" seq_len: 6 multi_head_size: 4 }}\n'
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
    # EasyRec's backbone: the wide part's sum plus the deep tower's logit
    "RankModel": ("model_params {{ l2_regularization: 1e-5 }}\n  backbone {{\n"
                  '    blocks {{ name: "wide_part" inputs {{ feature_group_name: "wide" }}\n'
                  "      input_layer {{ only_output_feature_list: true wide_output_dim: 1 }} }}\n"
                  '    blocks {{ name: "deep_tower" inputs {{ feature_group_name: "deep" }}\n'
                  '      keras_layer {{ class_name: "MLP" mlp {{ hidden_units: [{units}] '
                  "use_bn: false use_final_bn: false }} }} }}\n"
                  '    blocks {{ name: "deep_logit" inputs {{ block_name: "deep_tower" }}\n'
                  '      keras_layer {{ class_name: "Dense" st_params {{ fields {{ key: "units" '
                  "value {{ number_value: 1 }} }} }} }} }}\n"
                  '    blocks {{ name: "logit" inputs {{ block_name: "wide_part" '
                  'input_fn: "lambda x: tf.add_n(x)" }}\n'
                  '      inputs {{ block_name: "deep_logit" }} merge_inputs_into_list: true\n'
                  '      keras_layer {{ class_name: "Add" }} }}\n'
                  '    concat_blocks: "logit"\n  }}'),
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
    # a DNN per task like the DeepFM tower (no bottom)
    "SimpleMultiTask": ('simple_multi_task {{\n'
                        '    task_towers {{ tower_name: "ctr" label_name: "label" '
                        'dnn {{ hidden_units: [{units}] }} }}\n'
                        '    task_towers {{ tower_name: "cvr" label_name: "buy" '
                        'dnn {{ hidden_units: [{units}] }} }}\n  }}'),
    # TorchEasyRec's form: PPNet's two layers like the DeepFM tower, gated by the "uia"
    # group (the "wide" group's ids, embedded)
    "PEPNet": ('pepnet {{\n    ppnet_hidden_units: [{units}]\n'
               '    task_towers {{ tower_name: "ctr" label_name: "label" '
               'mlp {{ hidden_units: [8] }} }}\n'
               '    task_towers {{ tower_name: "cvr" label_name: "buy" '
               'mlp {{ hidden_units: [8] }} }}\n  }}'),
    # EasyRec's backbone form: an MMoE block's task inputs, cvr related to ctr
    "MultiTaskModel": ('backbone {{\n'
                       '    blocks {{ name: "experts" inputs {{ feature_group_name: "all" }}\n'
                       '      keras_layer {{ class_name: "MMoE" mmoe {{ num_task: 2 '
                       "num_expert: 3\n        expert_mlp {{ hidden_units: [{units}] "
                       "use_bn: false use_final_bn: false }} }} }} }}\n  }}\n"
                       "  model_params {{\n"
                       '    task_towers {{ tower_name: "ctr" label_name: "label" '
                       "dnn {{ hidden_units: [8] }} }}\n"
                       '    task_towers {{ tower_name: "cvr" label_name: "buy" '
                       'dnn {{ hidden_units: [8] }} relation_tower_names: "ctr" '
                       "relation_dnn {{ hidden_units: [8] }} }}\n  }}"),
}
MULTI_TASK_MODELS = tuple(_MULTI_TASK_BLOCKS)


# the classes whose config reads the behaviour sequence hist_C3
_SEQUENCE_MODELS = ("MultiTowerDIN", "MultiTowerBST")


def extra_column_of(model: str) -> str:
    """The column ``as_model_config_text``'s config of ``model`` reads after the 42.

    Args:
        model: the model class.

    Returns:
        ``"buy"`` for the multi-task models, ``"hist_C3"`` for MultiTowerDIN and
        MultiTowerBST, else ``""``.
    """
    if model in MULTI_TASK_MODELS:
        return CONVERSION_FIELD
    return HISTORY_FIELD if model in _SEQUENCE_MODELS else ""


def records_for_model(model: str, stream: SyntheticCtrStream, batch: CtrBatch,
                      fmt: str = "csv") -> list[bytes]:
    """``batch``'s records with the columns ``as_model_config_text(text, model)`` reads.

    Args:
        model: the model class of the config.
        stream: the stream that made ``batch``.
        batch: the records.
        fmt: ``"csv"`` or ``"json"``.

    Returns:
        The encoded records (``odl.datagen.datagen_config.records_with_column``).
    """
    return records_with_column(extra_column_of(model), stream, batch, fmt)


# EasyRec's CMBF and UNITER over the "general" (ids) and "other" (dense values) groups: a
# text tower of one self-attention layer of 2 heads of 8 over the ids (no image, no cross-
# modal layer), or one BERT layer of width 32 (2 heads, feed-forward 64); final_dnn the DNN
_MULTIMODAL_LAYERS = {
    "CMBF": ("cmbf {{\n    config {{ multi_head_num: 2 text_multi_head_num: 2 text_head_size: 8"
             " image_head_size: 8 image_multi_head_num: 1 image_cross_head_size: 8"
             " text_cross_head_size: 8 text_self_attention_layer_num: 1"
             " text_seq_emb_dropout_prob: 0 }}\n"
             "    final_dnn {{ hidden_units: [{units}] }}\n  }}"),
    "Uniter": ("uniter {{\n    config {{ hidden_size: 32 num_attention_heads: 2"
               " num_hidden_layers: 1 intermediate_size: 64 hidden_dropout_prob: 0"
               " attention_probs_dropout_prob: 0 }}\n"
               "    final_dnn {{ hidden_units: [{units}] }}\n  }}"),
}


def _without_wide(text: str) -> str:
    """The "wide" group gone."""
    return re.sub(r'  feature_groups \{ group_name: "wide" [^\n]*\n', "", text)


def _one_group(text: str) -> str:
    """The "wide" group gone, the "deep" group renamed "all" (the models of one group)."""
    return _without_wide(text).replace('group_name: "deep"', 'group_name: "all"')


def _dense_apart(text: str, dense_group: str, other_group: str) -> str:
    """The "wide" group gone, the dense features moved from "deep" to their own group.

    The dense features' group is ``dense_group``; "deep" is renamed ``other_group``.
    """
    text = _without_wide(text)
    dense = " ".join(f'feature_names: "{f}"' for f in DENSE_FIELDS)
    return text.replace(f" {dense} wide_deep: DEEP", " wide_deep: DEEP").replace(
        '  feature_groups { group_name: "deep"',
        f'  feature_groups {{ group_name: "{dense_group}" {dense} wide_deep: DEEP }}\n'
        f'  feature_groups {{ group_name: "{other_group}"')


def as_model_config_text(text: str, model: str, final_dnn: bool = False) -> str:
    """A ``deepfm_config_text`` config as another model class over the same feature groups.

    WideAndDeep keeps the deep tower (with ``final_dnn``: a tower of 8 over [wide, deep]);
    MultiTower gets one tower per group ("deep", "wide"); DCN a deep tower and a cross
    network of 2 layers over "deep"; DCNV2 (TorchEasyRec's form) a v2 cross network of 2
    layers of rank 8 and the deep tower over "deep" (the "wide" group goes: DCNV2 reads the
    first group); MaskNet (TorchEasyRec's) two parallel mask blocks of 32 over "deep" and
    the DeepFM tower as its top MLP (the "wide" group goes); MultiTowerDIN the deep tower
    and a DIN tower (attention DNN [8, 1]) from C3
    over ``hist_C3``, a column added after the stream's 42 (``odl.datagen.behavior_history``);
    MultiTowerBST the deep tower and a BST tower (``seq_len`` 6, 4 heads) over the same;
    AutoInt (EasyRec's) two interacting layers of 2 heads of 16 over the "deep" group (renamed
    "all"; the "wide" group goes), its dense features projected to the ids' width;
    RocketLaunching the DeepFM tower as its booster and a light DNN [32, 8] over the same
    group.
    The tower models end in a ``final_dnn`` of 8. MMoE and
    DBMTL read the "deep" group (renamed "all"; the "wide" group goes) and train two tasks,
    "ctr" on ``label`` and "cvr" on ``buy``, a column added after the stream's 42
    (``odl.datagen.conversion_labels``): MMoE with 3 experts like the DeepFM tower, DBMTL
    with the DeepFM tower as its bottom and "cvr" related to "ctr", ESMM with the DeepFM tower
    as its group's DNN (outputs "cvr", "ctr", "ctcvr"), PLE with two extraction networks
    (2 task experts like the DeepFM tower and 1 shared, then 1 and 1 of 8 units),
    SimpleMultiTask a tower like the DeepFM tower per task, PEPNet (TorchEasyRec's) PPNet
    layers like the DeepFM tower per task gated by the "wide" group's ids (renamed "uia",
    embedded) and a tower of 8 per task,
    MultiTaskModel (EasyRec's backbone form) an MMoE block of 3 experts like the DeepFM tower
    feeding the two tasks, "cvr" related to "ctr". FM
    (EasyRec's) keeps the groups with the dense features moved from the deep group (FM's
    vectors) to the wide group (a first-order term each). DLRM (EasyRec's) reads a "dense"
    group (the dense features, through a bot_dnn of one layer as wide as the embeddings) and a
    "sparse" group (the id features), its top_dnn the DeepFM tower; WuKong (TorchEasyRec's)
    the same groups, its dense_mlp as DLRM's bot_dnn, one layer of 8 + 8 vectors (FM
    compressed to 8, an MLP of 32) and the DeepFM tower as its final MLP. RankModel
    (EasyRec's backbone) adds the "wide" group's first-order weights to a Dense logit over
    the DeepFM tower (an MLP without batch normalization) over "deep". CMBF and Uniter
    (EasyRec's) read the id features as their "general" group and the dense features as
    their "other" group (``_MULTIMODAL_LAYERS``), the DeepFM tower as ``final_dnn``.

    Args:
        text: the DeepFM config text.
        model: ``"DeepFM"`` (unchanged), ``"WideAndDeep"``, ``"MultiTower"``, ``"DCN"``,
            ``"DCNV2"``, ``"MultiTowerDIN"``, ``"MultiTowerBST"``, ``"MMoE"``, ``"DBMTL"``,
            ``"ESMM"``, ``"PLE"``, ``"FM"``, ``"DLRM"``, ``"MaskNet"``, ``"WuKong"``, ``"CMBF"``,
            ``"Uniter"``, ``"SimpleMultiTask"``, ``"PEPNet"``, ``"AutoInt"``,
            ``"RocketLaunching"``,
            ``"RankModel"`` or ``"MultiTaskModel"``.
        final_dnn: WideAndDeep only: join wide and deep through ``final_dnn``.

    Returns:
        The config text.
    """
    if model == "DeepFM":
        return text
    m = re.search(r"deepfm \{\n    dnn \{ hidden_units: \[([^\]]*)\](?: use_bn: false)? \}"
                  r".*?\n  \}", text, re.S)
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
        text = _dense_apart(text[:m.start()] + block + text[m.end():], "dense", "sparse")
        return text.replace('model_class: "DeepFM"', f'model_class: "{model}"')
    if model in _MULTIMODAL_LAYERS:  # ids as "general" tokens, the dense values as "other"
        text = _dense_apart(text[:m.start()] + _MULTIMODAL_LAYERS[model].format(
            units=m.group(1)) + text[m.end():], "other", "general")
        return text.replace('model_class: "DeepFM"', f'model_class: "{model}"')
    if model == "RocketLaunching":  # the booster like the DeepFM tower, a light DNN of 8
        text = (text[:m.start()] + "rocket_launching {\n    booster_dnn { hidden_units: ["
                + m.group(1) + "] }\n    light_dnn { hidden_units: [32, 8] }\n  }"
                + text[m.end():])
        text = _one_group(text)
        return text.replace('model_class: "DeepFM"', 'model_class: "RocketLaunching"')
    if model == "AutoInt":  # every feature a token: the dense values projected
        dim = re.search(r"IdFeature embedding_dim: (\d+)", text)
        if dim is None:
            raise ValueError("AutoInt needs the id features' embedding_dim")
        text = (text[:m.start()] + "autoint {\n    multi_head_num: 2 multi_head_size: 16 "
                "interacting_layer_num: 2\n  }" + text[m.end():])
        text = _one_group(text)
        text = text.replace("feature_type: RawFeature }",
                            f"feature_type: RawFeature embedding_dim: {dim.group(1)} }}")
        return text.replace('model_class: "DeepFM"', 'model_class: "AutoInt"')
    if model in _MULTI_TASK_BLOCKS:
        block = _MULTI_TASK_BLOCKS[model].format(units=m.group(1))
        text = text[:m.start()] + block + text[m.end():]
        if model == "PEPNet":  # "deep" as "all", the "wide" group's ids as "uia"
            text = re.sub(r'(feature_groups \{ group_name: )"wide"(.*?) wide_deep: WIDE \}',
                          r'\1"uia"\2 wide_deep: DEEP }', text)
            text = text.replace('group_name: "deep"', 'group_name: "all"')
        else:
            text = _one_group(text)
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
        text = _without_wide(text)
    if model in _SEQUENCE_MODELS:  # the history column and its SequenceFeature
        c3 = re.search(r'feature_configs \{ input_names: "C3" feature_type: IdFeature '
                       r"embedding_dim: (\d+) hash_bucket_size: (\d+) \}", text)
        if c3 is None:
            raise ValueError(f"{model} needs C3 as an id feature")
        last = text.rindex("  input_fields {")
        end = text.index("\n", last) + 1
        text = (text[:end] + f'  input_fields {{ input_name: "{HISTORY_FIELD}" '
                "input_type: STRING }\n" + text[end:])
        text = text.replace(c3.group(0), c3.group(0) + "\n" + (
            f'feature_configs {{ input_names: "{HISTORY_FIELD}" feature_type: SequenceFeature '
            f'separator: "|" embedding_dim: {c3.group(1)} hash_bucket_size: {c3.group(2)} '
            f"max_seq_len: {HISTORY_LENGTH} }}"))
    return text.replace('model_class: "DeepFM"', f'model_class: "{model}"')

