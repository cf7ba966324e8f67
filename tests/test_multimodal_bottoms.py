"""DBMTL's multimodal bottoms on EasyRec's own samples: ``bottom_uniter``
(``odl.models.uniter``; ``dbmtl_uniter_on_movielens``: image / general / other / text groups,
two text sequences, a 4-head transformer of width 512) and ``bottom_cmbf``
(``odl.models.cmbf``; ``dbmtl_cmbf_on_movielens``: an image of 8 patches, 9 general features,
two sequences, 3 cross-modal layers): the tokens EasyRec makes, the padding masked (in the
cross-modal attention too), one set of outputs per record, and what a bottom cannot read
refused by field."""

from __future__ import annotations

import os

import pytest
import torch

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.cmbf import CMBFBottom
from odl.models.model_registry import check_pipeline_config
from odl.models.uniter import UniterBottom
from odl.train.startup_checks import check_start
from odl.train.train_module import TrainModule
from tests.test_config_compat import _HERE, _small_cpu_config, try_load

_UNITER = os.path.join(_HERE, "easyrec", "dbmtl_uniter_on_movielens.config")
_CMBF = os.path.join(_HERE, "easyrec", "dbmtl_cmbf_on_movielens.config")


def _sample(path: str = _UNITER):
    config = _small_cpu_config(try_load.load_one(path, "easyrec"))
    config.model_dir = "unused"
    return config


def _bottom(tm: TrainModule) -> UniterBottom | CMBFBottom:
    (bottom,) = [m for m in tm.model.dense.modules()
                 if isinstance(m, (UniterBottom, CMBFBottom))]
    return bottom


def _sequences(bottom: UniterBottom | CMBFBottom) -> list:
    """The bottom's text sequences' modalities (its last ones)."""
    modalities = bottom.modalities if isinstance(bottom, UniterBottom) else bottom.text
    return list(modalities)[-len(bottom.length_columns):]


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


def test_cmbfs_towers_are_easyrecs() -> None:
    """The image as 8 patch tokens of 64 (its tower's width: no projection) through two
    layers; 9 general tokens (the projected RawFeature among them) and the two sequences
    (token types on) in a text tower of width 16; 3 cross-modal layers; the output: the image
    tokens' mean (2 x 32) and 9 + 2 merged text tokens (2 x 8 each)."""
    config = _sample(_CMBF)
    tm = TrainModule(config, FeatureBuilder(config), device="cpu")
    bottom = _bottom(tm)
    assert isinstance(bottom, CMBFBottom)
    assert (bottom.image.tokens, bottom.image.width) == (8, 64)
    assert isinstance(bottom.image.project, torch.nn.Identity)
    assert len(bottom.image_layers) == 2 and len(bottom.text_layers) == 2
    general, title, genres = bottom.text
    assert general.count == 9 and general.raw is not None and not general.post
    assert bottom.sequence_positions == [16, 8] and title.use_token_type
    assert (title.token_type, genres.token_type) == (0, 1)
    assert len(bottom.cross) == 3
    assert bottom.out_width == 2 * 32 + (9 + 2) * 2 * 8


@pytest.mark.parametrize("path", [_UNITER, _CMBF], ids=["uniter", "cmbf"])
def test_padding_is_masked_and_records_do_not_mix(path) -> None:
    """A record's output does not change with what its padded positions hold (it does with
    its valid ones), nor with the other records of its batch (evaluation: no dropout)."""
    config = _sample(path)
    tm = TrainModule(config, FeatureBuilder(config), device="cpu")
    bottom = _bottom(tm).eval()
    torch.manual_seed(0)
    x = torch.randn(8, max(bottom.length_columns) + 1)  # (the lengths are its last columns)
    lengths = torch.tensor([1.0, 3.0, 2.0, 5.0, 1.0, 4.0, 2.0, 3.0])
    for col in bottom.length_columns:
        x[:, col] = lengths
    out = bottom(x)
    sequences = _sequences(bottom)
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
    (lambda c: c.model_config.dbmtl.bottom_cmbf.SetInParent(),
     "model_config.dbmtl.bottom_uniter", "not both"),
])
def test_what_uniter_cannot_read_is_refused_by_field(edit, field, message) -> None:
    config = _sample()
    edit(config)
    with pytest.raises(ConfigError, match=message) as err:
        check_pipeline_config(config, online=True)
        check_start(config, online=True, device="cpu")
    assert err.value.field == field


@pytest.mark.parametrize(("edit", "field", "message"), [
    (lambda c: c.model_config.dbmtl.bottom_cmbf.__setattr__("multi_head_num", 3),
     "model_config.dbmtl.bottom_cmbf", "not a multiple of multi_head_num 3"),
    (lambda c: c.model_config.dbmtl.bottom_cmbf.__setattr__("image_feature_patch_num", 7),
     "model_config.dbmtl.bottom_cmbf", "does not divide the image feature's 512 values"),
    (lambda c: c.model_config.dbmtl.bottom_cmbf.__setattr__("text_head_size", 0),
     "model_config.dbmtl.bottom_cmbf.text_head_size", "must be set"),
    (lambda c: c.model_config.dbmtl.bottom_cmbf.__setattr__("max_position_embeddings", 8),
     "model_config.dbmtl.bottom_cmbf", "exceed bottom_cmbf.max_position_embeddings 8"),
])
def test_what_cmbf_cannot_read_is_refused_by_field(edit, field, message) -> None:
    config = _sample(_CMBF)
    edit(config)
    with pytest.raises(ConfigError, match=message) as err:
        check_pipeline_config(config, online=True)
        check_start(config, online=True, device="cpu")
    assert err.value.field == field
