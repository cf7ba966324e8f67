"""DBMTL's ``bottom_uniter`` (``odl.models.uniter``) on EasyRec's own sample,
``tests/compat_configs/easyrec/dbmtl_uniter_on_movielens.config`` (image / general / other /
text groups, two text sequences, a 4-head transformer of width 512): the tokens EasyRec makes,
the padding masked, one set of outputs per record, and what the bottom cannot read refused
by field."""

from __future__ import annotations

import os

import pytest
import torch

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import check_pipeline_config
from odl.models.uniter import UniterBottom
from odl.train.startup_checks import check_start
from odl.train.train_module import TrainModule
from tests.test_config_compat import _HERE, _small_cpu_config, try_load

_SAMPLE = os.path.join(_HERE, "easyrec", "dbmtl_uniter_on_movielens.config")


def _sample():
    config = _small_cpu_config(try_load.load_one(_SAMPLE, "easyrec"))
    config.model_dir = "unused"
    return config


def _bottom(tm: TrainModule) -> UniterBottom:
    (bottom,) = [m for m in tm.model.dense.modules() if isinstance(m, UniterBottom)]
    return bottom


def test_the_tokens_are_easyrecs() -> None:
    """[CLS], one image token, seven general tokens, the two sequences' positions; four token
    types (image, general, title, genres); position tables for the image and each sequence,
    none for the general features; the [CLS] output then the other group's DNN."""
    config = _sample()
    tm = TrainModule(config, FeatureBuilder(config), device="cpu")
    bottom = _bottom(tm)
    settings = config.model_config.dbmtl.bottom_uniter
    hidden = settings.hidden_size
    assert bottom.fixed_tokens == 1 + 1 + 7
    assert bottom.sequence_positions == [16, 8]  # title, genres (their max_seq_len)
    assert tuple(bottom.token_types.shape) == (4, hidden)
    image, general, title, genres = bottom.modalities
    assert (image.token_type, general.token_type, title.token_type, genres.token_type) == (
        0, 1, 2, 3)
    assert general.position is None and image.position is not None
    assert tuple(title.position.shape) == (settings.max_position_embeddings, hidden)
    assert isinstance(image.project, torch.nn.Identity)  # 512 wide already
    assert len(bottom.layers) == settings.num_hidden_layers
    assert bottom.out_width == hidden + settings.other_feature_dnn.hidden_units[-1]


def test_padding_is_masked_and_records_do_not_mix() -> None:
    """A record's output does not change with what its padded positions hold (it does with
    its valid ones), nor with the other records of its batch (evaluation: no dropout)."""
    config = _sample()
    tm = TrainModule(config, FeatureBuilder(config), device="cpu")
    bottom = _bottom(tm).eval()
    torch.manual_seed(0)
    x = torch.randn(8, max(bottom.length_columns) + 1)  # (the lengths are its last columns)
    lengths = torch.tensor([1.0, 3.0, 2.0, 5.0, 1.0, 4.0, 2.0, 3.0])
    for col in bottom.length_columns:
        x[:, col] = lengths
    out = bottom(x)
    sequences = bottom.modalities[-len(bottom.length_columns):]
    padded, valid = x.clone(), x.clone()
    for seq, n in zip(sequences, bottom.sequence_positions, strict=True):
        for row in range(8):
            end = seq.start + int(lengths[row]) * seq.width
            padded[row, end:seq.start + n * seq.width] = 1e3
            valid[row, seq.start:end] += 1.0
    torch.testing.assert_close(bottom(padded), out)
    assert not torch.allclose(bottom(valid), out)
    torch.testing.assert_close(bottom(x[:3]), out[:3])


@pytest.mark.parametrize(("edit", "field", "message"), [
    (lambda c: c.model_config.dbmtl.bottom_uniter.__setattr__("num_attention_heads", 3),
     "model_config.dbmtl.bottom_uniter.num_attention_heads", "must divide hidden_size"),
    (lambda c: c.model_config.feature_groups[3].feature_names.append("user_id"),
     "model_config.feature_groups[3].feature_names", "as SequenceFeatures"),
    (lambda c: (c.model_config.feature_groups.pop(3),
                [g.__setattr__("group_name", g.group_name + "_x")
                 for g in c.model_config.feature_groups]),
     "model_config.feature_groups", "bottom_uniter reads the groups"),
    (lambda c: c.model_config.variational_dropout.SetInParent(),
     "model_config.variational_dropout", "not implemented"),
])
def test_what_the_bottom_cannot_read_is_refused_by_field(edit, field, message) -> None:
    config = _sample()
    edit(config)
    with pytest.raises(ConfigError, match=message) as err:
        check_pipeline_config(config, online=True)
        check_start(config, online=True, device="cpu")
    assert err.value.field == field
