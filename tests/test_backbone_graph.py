"""EasyRec's backbone DAG (``odl/models/backbone/``): the lambda subset, how blocks read,
merge and repeat their inputs, the input layers, and the refusals by field."""

from __future__ import annotations

import pytest
import torch
from google.protobuf import text_format

from odl.config.config_error import ConfigError
from odl.models.backbone.backbone_graph import GraphBuilder
from odl.models.backbone.input_functions import parse_lambda, parse_slice
from odl.models.backbone.input_layers import POOLED, RAW, FeatureSource, GroupInput
from odl.models.backbone.value_specs import tensor
from odl.protos import pipeline_pb2

# [concatenated [B, 12], [three [B, 4] vectors]]: an input layer's tensor and feature list
BOTH = [tensor(12), [tensor(4), tensor(4), tensor(4)]]


def _leaves(b: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    vectors = [torch.randn(b, 4) for _ in range(3)]
    return [torch.cat(vectors, dim=1)] + vectors


@pytest.mark.parametrize("text, expected", [
    ("lambda x: x[1]", lambda t: t[1:]),
    ("lambda x: x[0]", lambda t: [t[0]]),
    ("lambda x: x[1][0:2]", lambda t: t[1:3]),
    ("lambda x: [x[0]]", lambda t: [t[0]]),
    ("lambda x: [x[1][2], x[1][0]]", lambda t: [t[3], t[1]]),
    ("lambda x: tf.add_n(x[1])", lambda t: [t[1] + t[2] + t[3]]),
    ("lambda x: tf.stack(x[1], axis=1)", lambda t: [torch.stack(t[1:], dim=1)]),
    ("lambda x: tf.concat(x[1], axis=-1)", lambda t: [torch.cat(t[1:], dim=1)]),
    ("lambda x: tf.reduce_sum(x[0], axis=1, keepdims=True)",
     lambda t: [t[0].sum(dim=1, keepdim=True)]),
    ("lambda x: tf.reduce_mean(x[0], 1)", lambda t: [t[0].mean(dim=1)]),
    ("lambda x: tf.unstack(tf.reshape(x[0], [-1, 3, 4]), axis=1)", lambda t: t[1:]),
    ("lambda x: tf.expand_dims(tf.add_n(x[1]), axis=1)",
     lambda t: [(t[1] + t[2] + t[3]).unsqueeze(1)]),
    ("lambda x: [x[0], tf.add_n(x[1])]", lambda t: [t[0], t[1] + t[2] + t[3]]),
])
def test_a_lambda_of_the_subset_computes_what_tensorflow_would(text, expected) -> None:
    module, spec = parse_lambda(text, "f").build(BOTH)
    xs = _leaves()
    want = expected(xs)
    for out in (module(xs), torch.jit.script(module)(xs)):
        assert len(out) == len(want)
        for got, w in zip(out, want, strict=True):
            torch.testing.assert_close(got, w)
    # the spec says what comes out
    specs = spec if isinstance(spec, list) else [spec]
    flat = [s for item in specs for s in (item if isinstance(item, list) else [item])]
    assert [tuple(o.shape[1:]) for o in want] == [s.shape for s in flat]


def test_an_input_slice_is_easyrecs_lambda_x_x_slice() -> None:
    _m, spec = parse_slice("[1]", "s").build(BOTH)
    assert spec == BOTH[1]
    _m, spec = parse_slice(" [0] ", "s").build(BOTH)
    assert spec == tensor(12)


@pytest.mark.parametrize("text, words", [
    ("lambda x: __import__('os').system('true')", "not one of"),
    ("lambda x: x.shape", "not in the subset"),
    ("lambda x: y[0]", "unknown name"),
    ("lambda x, y: x", "one argument"),
    ("x[0]", "lambda"),
    ("lambda x: tf.reduce_sum(x[0], axis=0)", "batch axis"),
    ("lambda x: x[1][5]", "index 5"),
    ("lambda x: x[0][1]", "indexes a tensor"),
    ("lambda x: tf.reshape(x[0], [-1, 5])", "not 5"),
    ("lambda x: tf.add_n(x[0])", "needs a list of tensors"),
    ("lambda x: tf.reduce_sum(x, axis=1)", "needs a tensor"),
    ("lambda x: tf.stack(x[1])", "batch axis"),
    ("lambda x: tf.nn.relu(x[0])", "not one of"),
])
def test_anything_outside_the_subset_is_refused_without_running_it(text, words) -> None:
    with pytest.raises(ConfigError) as info:
        parse_lambda(text, "model_config.backbone.blocks[0].inputs[0].input_fn").build(BOTH)
    assert info.value.field == "model_config.backbone.blocks[0].inputs[0].input_fn"
    assert words in str(info.value)


# --- the graph over two hand-made groups -----------------------------------------------------

def _groups(name, settings, where) -> GroupInput:
    """Group "a": three pooled vectors of 4 (columns 0-11); "b": the raw value in column 0."""
    if name == "a":
        return GroupInput([FeatureSource(f"a{i}", POOLED, 4, start=4 * i) for i in range(3)],
                          settings, where, 12, 3)
    return GroupInput([FeatureSource("x", RAW, 1, columns=(0,))], settings, where, 12, 3)


def _backbone(text: str) -> pipeline_pb2.BackboneTower:
    return text_format.Parse(text, pipeline_pb2.BackboneTower())


def _build(text: str, num_class: int = 1):
    return GraphBuilder(_backbone(text), _groups, {"a", "b"}, num_class).build()


GRAPH = """
blocks { name: "feats" inputs { feature_group_name: "a" }
         input_layer { output_2d_tensor_and_feature_list: true } }
blocks { name: "s"
         inputs { block_name: "feats" input_slice: "[1]" input_fn: "lambda x: tf.add_n(x)" } }
blocks { name: "rec" inputs { block_name: "s" input_fn: "lambda x: [x, x]" }
         recurrent { num_steps: 3 fixed_input_index: 0 keras_layer { class_name: "Add" } } }
blocks { name: "pair" inputs { block_name: "s" } inputs { block_name: "rec" }
         merge_inputs_into_list: true keras_layer { class_name: "Add" } }
blocks { name: "mix" inputs { block_name: "feats" input_slice: "[0]" }
         inputs { feature_group_name: "b" } }
blocks { name: "rep" inputs { block_name: "s" }
         repeat { num_repeat: 2 output_concat_axis: -1
                  keras_layer { class_name: "Dropout" st_params { fields { key: "rate" value {
                      number_value: 0 } } } } } }
blocks { name: "lam" inputs { block_name: "rep" }
         lambda { expression: "lambda x: tf.reduce_sum(x, axis=1, keepdims=True)" } }
blocks { name: "unused" inputs { block_name: "s" } keras_layer { class_name: "MLP" mlp {
    hidden_units: [3] } } }
concat_blocks: ["pair", "mix", "lam"]
"""


def test_blocks_read_merge_recur_and_repeat_as_easyrec_does() -> None:
    """s = a0 + a1 + a2; the recurrent Add over [s, s] with s fixed makes 4s (s + s, then
    s + 2s, s + 3s); pair = s + 4s; mix = [a's concatenation, x]; rep = [s, s]; lam = the
    sum of rep's columns; the output is Linear(concat(pair, mix, lam)) (a block no output
    reads is not built)."""
    dense = _build(GRAPH)
    torch.manual_seed(1)
    pooled, raw = torch.randn(6, 12), torch.randn(6, 3)
    a = [pooled[:, 4 * i : 4 * i + 4] for i in range(3)]
    s = a[0] + a[1] + a[2]
    x = torch.cat([5 * s, pooled, raw[:, :1], 2 * s.sum(dim=1, keepdim=True)], dim=1)
    want = (x @ dense.out.weight.T + dense.out.bias).squeeze(1)
    dense.eval()
    torch.testing.assert_close(dense(pooled, raw), want)
    torch.testing.assert_close(torch.jit.script(dense)(pooled, raw), want)
    assert not any("unused" in n for n, _p in dense.named_parameters())
    assert sum(p.numel() for p in dense.parameters()) == 18 + 1


def test_without_concat_blocks_the_blocks_no_block_reads_are_the_output() -> None:
    dense = _build("""
blocks { name: "s" inputs { feature_group_name: "a" }
  lambda { expression: "lambda x: tf.reduce_sum(tf.reshape(x, [-1, 3, 4]), axis=1)" } }
blocks { name: "t" inputs { feature_group_name: "b" } }""")
    assert dense.out.in_features == 4 + 1


def test_an_output_as_wide_as_num_class_gets_no_output_layer() -> None:
    dense = _build("""
blocks { name: "s" inputs { feature_group_name: "a"
  input_fn: "lambda x: tf.reduce_sum(x, axis=1, keepdims=True)" } }""")
    assert dense.out is None
    pooled = torch.randn(4, 12)
    torch.testing.assert_close(dense(pooled, torch.zeros(4, 1)), pooled.sum(dim=1))
    assert _build("""blocks { name: "s" inputs { feature_group_name: "a" } }""",
                  num_class=3).out.out_features == 3


def test_a_top_mlp_runs_over_the_concatenated_output() -> None:
    dense = _build("""blocks { name: "s" inputs { feature_group_name: "a" } }
top_mlp { hidden_units: [7, 5] use_bn: false use_final_bn: false }""")
    assert dense.out.in_features == 5
    assert dense(torch.randn(3, 12), torch.randn(3, 1)).shape == (3,)


@pytest.mark.parametrize("text, field, words", [
    ("", "model_config.backbone.blocks", "at least one block"),
    ('blocks { name: "s" inputs { block_name: "t" } } blocks { name: "t" inputs { '
     'block_name: "s" } }',
     "model_config.backbone.blocks", "cycle"),
    ('blocks { name: "s" inputs { block_name: "nope" } }',
     "model_config.backbone.blocks[0].inputs[0].block_name", "neither a block"),
    ('blocks { name: "s" inputs { feature_group_name: "a" } } '
     'blocks { name: "s" inputs { feature_group_name: "b" } }',
     "model_config.backbone.blocks[1].name", "twice"),
    ('blocks { name: "s" inputs { feature_group_name: "a" } keras_layer { class_name: '
     '"Transformer" } }',
     "model_config.backbone.blocks[0].keras_layer.class_name", "not implemented"),
    ('blocks { name: "s" inputs { package_name: "p" } }',
     "model_config.backbone.blocks[0].inputs[0].package_name", "no package 'p'"),
    ('packages { name: "p" } blocks { name: "s" inputs { package_name: "p" } }',
     "model_config.backbone.packages[0].blocks", "no blocks"),
    ('blocks { name: "s" inputs { feature_group_name: "a" } } concat_blocks: "t"',
     "model_config.backbone.concat_blocks", "no block"),
    ('blocks { name: "s" inputs { feature_group_name: "a" input_fn: "lambda x: '
     'tf.stack([x, x], axis=1)" } }',
     "model_config.backbone.concat_blocks", "[B, 2, 12]"),
    ('blocks { name: "s" inputs { feature_group_name: "a" } input_layer { '
     'only_output_3d_tensor: true } }'
     'blocks { name: "t" inputs { feature_group_name: "b" } input_layer { '
     'do_batch_norm: true do_layer_norm: true } }',
     "model_config.backbone.blocks[1].input_layer", "both"),
    ('blocks { name: "s" inputs { feature_group_name: "a" input_fn: "lambda x: [x, x]" } '
     'recurrent { num_steps: 2 fixed_input_index: 0 keras_layer { class_name: "MLP" '
     'mlp { hidden_units: [3] } } } }',
     "model_config.backbone.blocks[0].recurrent.keras_layer", "takes one tensor"),
])
def test_a_backbone_odl_cannot_build_is_refused_by_field(text, field, words) -> None:
    with pytest.raises(ConfigError) as info:
        _build(text)
    assert info.value.field.startswith(field), info.value.field
    assert words in str(info.value)


# --- input layers -------------------------------------------------------------------------

def _layer(**settings) -> GroupInput:
    return GroupInput([FeatureSource("a0", POOLED, 4, start=0),
                       FeatureSource("x", RAW, 2, columns=(1, 0)),
                       FeatureSource("a1", POOLED, 4, start=4)],
                      pipeline_pb2.BackboneInputLayer(**settings), "w", 8, 2)


def test_an_input_layer_outputs_the_group_in_order_in_each_form() -> None:
    pooled, raw = torch.randn(5, 8), torch.randn(5, 2)
    vectors = [pooled[:, :4], raw[:, [1, 0]], pooled[:, 4:]]
    torch.testing.assert_close(_layer()(pooled, raw), [torch.cat(vectors, dim=1)])
    torch.testing.assert_close(_layer(only_output_feature_list=True)(pooled, raw), vectors)
    torch.testing.assert_close(
        _layer(output_2d_tensor_and_feature_list=True)(pooled, raw),
        [torch.cat(vectors, dim=1)] + vectors)
    same = GroupInput([FeatureSource(f"a{i}", POOLED, 4, start=4 * i) for i in range(2)],
                      pipeline_pb2.BackboneInputLayer(only_output_3d_tensor=True), "w", 8, 2)
    torch.testing.assert_close(same(pooled, raw), [pooled.reshape(5, 2, 4)])
    with pytest.raises(ConfigError, match="one width"):
        _layer(only_output_3d_tensor=True)


def test_batch_norm_normalizes_the_tensor_and_each_listed_feature_on_its_own() -> None:
    layer = _layer(do_batch_norm=True, output_2d_tensor_and_feature_list=True)
    layer.train()
    torch.manual_seed(2)
    pooled, raw = torch.randn(64, 8) * 3 + 1, torch.randn(64, 2) * 5 - 2
    out = layer(pooled, raw)
    for t in out:
        torch.testing.assert_close(t.mean(dim=0), torch.zeros(t.shape[1]), atol=1e-5, rtol=0)
    assert len(layer.norm_each) == 3
    assert len(_layer(do_batch_norm=True).norm_each) == 0  # a tensor only: one normalization


def test_feature_dropout_drops_whole_features_in_training_only() -> None:
    layer = _layer(feature_dropout_rate=0.5, only_output_feature_list=True)
    pooled, raw = torch.randn(4, 8) + 5, torch.randn(4, 2) + 5
    layer.eval()
    torch.testing.assert_close(layer(pooled, raw)[0], pooled[:, :4])
    layer.train()
    torch.manual_seed(3)
    seen = set()
    for _ in range(20):
        for got, want in zip(layer(pooled, raw), [pooled[:, :4], raw[:, [1, 0]], pooled[:, 4:]],
                             strict=True):
            dropped = bool((got == 0).all())
            assert dropped or torch.allclose(got, want * 2)
            seen.add(dropped)
    assert seen == {True, False}


def test_a_group_read_raw_hands_out_positions_lengths_and_targets() -> None:
    """Two sequences of 3 positions (2 and 1 columns per position) side by side per
    position, the first sequence's lengths, the group's other features concatenated."""
    from odl.models.backbone.input_layers import RawSequenceInput

    # pooled columns: targets 0-1; sequence a at 2 + 2p, sequence b at 8 + p
    idx = [c for p in range(3) for c in (2 + 2 * p, 3 + 2 * p, 8 + p)]
    targets = GroupInput([FeatureSource("t", POOLED, 2, start=0)],
                         pipeline_pb2.BackboneInputLayer(), "w", 11, 2)
    layer = RawSequenceInput(idx, 3, 3, 1, targets)
    pooled, dense = torch.randn(4, 11), torch.tensor([[0.0, 2.0]] * 4)
    seq, length, target = torch.jit.script(layer)(pooled, dense)
    for p in range(3):
        torch.testing.assert_close(seq[:, p], torch.stack(
            [pooled[:, 2 + 2 * p], pooled[:, 3 + 2 * p], pooled[:, 8 + p]], dim=1))
    torch.testing.assert_close(length, torch.full((4,), 2.0))
    torch.testing.assert_close(target, pooled[:, :2])
    assert layer.spec == [tensor(3, 3), tensor(), tensor(2)]
    assert RawSequenceInput(idx, 3, 3, 1, None).spec == [tensor(3, 3), tensor()]


def test_the_wide_lookups_join_the_logit_only_around_top_mlp_or_the_output_layer() -> None:
    """RankModel's wide_to_logit: with the wide lookups from column 8 on, a logit reached
    through the output layer gets their sum added; an output that is the logit itself
    (width num_class, no top_mlp) does not."""
    through = GraphBuilder(_backbone('blocks { name: "s" inputs { feature_group_name: "a" } }'),
                           _groups, {"a", "b"}, 1, wide_start=8).build()
    pooled, raw = torch.randn(4, 12), torch.randn(4, 3)
    want = (pooled @ through.out.weight.T + through.out.bias).squeeze(1) + pooled[:, 8:].sum(1)
    torch.testing.assert_close(through(pooled, raw), want)
    torch.testing.assert_close(torch.jit.script(through)(pooled, raw), want)
    direct = GraphBuilder(_backbone(
        'blocks { name: "s" inputs { feature_group_name: "a" '
        'input_fn: "lambda x: tf.reduce_sum(x, axis=1, keepdims=True)" } }'),
        _groups, {"a", "b"}, 1, wide_start=8).build()
    assert direct.out is None and direct.wide_start == -1
    torch.testing.assert_close(direct(pooled, raw), pooled.sum(dim=1))
