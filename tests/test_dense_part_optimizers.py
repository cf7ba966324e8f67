"""TorchEasyRec's ``dense_optimizer.part_optimizers`` (odl.train.dense_parts): the dense
parameters split by name between optimizers, each on its schedule, checkpointed by part."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from google.protobuf import text_format

from odl.config.config_error import ConfigError
from odl.config.train_validation import validate_train_config
from odl.protos import pipeline_pb2
from odl.train.dense_parts import PartitionedDenseOptimizer
from tests.test_optimizers import MODEL, records
from tests.test_table_optimizers import module

SPARSE = "sparse_optimizer { adagrad_optimizer { lr: 0.05 } constant_learning_rate {} } "
PLAIN = SPARSE + "dense_optimizer { adam_optimizer { lr: 0.01 } constant_learning_rate {} }"


def with_part(part: str) -> str:
    """PLAIN with one more entry in dense_optimizer."""
    return PLAIN[:-1] + part + " }"
# the first DNN layer by SGD at 0.1 (no momentum); the output layer by Adagrad on its own
# schedule; the rest stays with Adam
PARTS = SPARSE + r"""
dense_optimizer {
  adam_optimizer { lr: 0.01 } constant_learning_rate {}
  part_optimizers { sgd_optimizer { lr: 0.1 momentum: 0 } regex_pattern: "dense\.dnn\.0\..*" }
  part_optimizers { adagrad_optimizer { lr: 0.2 } regex_pattern: "dense\.deep_out\..*"
    manual_step_learning_rate { schedule_sizes: [1] learning_rates: [0.02] } }
  part_optimizers { sgd_optimizer { lr: 0.3 } regex_pattern: "dense\.dnn\.0\.weight" }
}
in_batch_learning: false
"""


def test_each_part_steps_its_parameters_with_its_rule() -> None:
    """One step from the same start: the parameters a part takes follow its rule on the same
    gradients, the others are exactly the one-optimizer module's."""
    tm, fb = module(PARTS)
    plain, _ = module(PLAIN + " in_batch_learning: false")
    opt = tm.dense_optimizer
    assert isinstance(opt, PartitionedDenseOptimizer)
    # the third pattern also matches dnn.0.weight, which the first entry took
    assert [(label.rsplit(".", 1)[-1], names) for label, names, _, _ in opt.parts] == [
        ("dense_optimizer", [n for n in tm.dense_parameters()
                             if not n.startswith(("dense.dnn.0.", "dense.deep_out."))]),
        ("part_optimizers[0]", ["dense.dnn.0.weight", "dense.dnn.0.bias"]),
        ("part_optimizers[1]", ["dense.deep_out.weight", "dense.deep_out.bias"])]
    before = {k: v.detach().clone() for k, v in tm.dense_parameters().items()}
    for name, t in plain.dense_parameters().items():
        assert torch.equal(t, before[name])
    batch = fb.build(records(64, 3)).batch
    tm.train_step(batch)
    plain.train_step(batch)
    grads = {f"dense.{n}": p.grad for n, p in plain._dense_module().named_parameters()}
    after, adam = tm.dense_parameters(), plain.dense_parameters()
    for name, t in after.items():
        if name.startswith("dense.dnn.0."):
            torch.testing.assert_close(t, before[name] - 0.1 * grads[name], rtol=1e-6,
                                       atol=1e-7)
        elif name.startswith("dense.deep_out."):  # Adagrad's first step: lr * g / |g|
            g = grads[name]
            torch.testing.assert_close(t, before[name] - 0.2 * g / (g.abs() + 1e-10),
                                       rtol=1e-6, atol=1e-7)
        else:
            torch.testing.assert_close(t, adam[name], rtol=0, atol=0)
    # the Adagrad part's own schedule: 0.2 up to step 1, then 0.02; the others constant
    assert opt.rates(0) == opt.rates(1) == pytest.approx((0.01, 0.1, 0.2))
    assert opt.rates(2) == pytest.approx((0.01, 0.1, 0.02))
    tm.train_step(batch)
    tm.train_step(batch)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 0.1, 0.02])


def test_checkpoint_restores_each_part_and_continues_as_uninterrupted() -> None:
    tm, fb = module(PARTS)
    batches = [fb.build(records(40, 30 + k)).batch for k in range(5)]
    for b in batches[:2]:
        tm.train_step(b)
    buf = io.BytesIO()
    torch.save(tm.state_dict_for_checkpoint(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert [p["label"].rsplit(".", 1)[-1] for p in state["dense_optimizer"]["parts"]] == [
        "dense_optimizer", "part_optimizers[0]", "part_optimizers[1]"]
    restored, _ = module(PARTS)
    restored.load_checkpoint_state(state)
    for b in batches[2:]:
        tm.train_step(b)
        restored.train_step(b)
    dense = restored.dense_parameters()
    for name, t in tm.dense_parameters().items():
        torch.testing.assert_close(dense[name], t, rtol=0, atol=0)


def test_another_split_restores_all_but_the_dense_optimizer_state(caplog) -> None:
    """A checkpoint of one optimizer into parts, and back: parameters restored, the dense
    optimizers' state fresh (said in the log)."""
    one, fb = module(PLAIN + " in_batch_learning: false")
    one.train_step(fb.build(records(40, 1)).batch)
    parts, _ = module(PARTS)
    with caplog.at_level(logging.WARNING, logger="odl.train.dense_parts"):
        parts.load_checkpoint_state(one.state_dict_for_checkpoint())
        one.load_checkpoint_state(parts.state_dict_for_checkpoint())
    assert sum("start" in r.getMessage() and "fresh" in r.getMessage()
               for r in caplog.records) == 2
    for name, t in one.dense_parameters().items():
        assert torch.equal(parts.dense_parameters()[name], t)
    parts.train_step(fb.build(records(40, 2)).batch)  # the fresh state steps


def test_a_pattern_that_matches_nothing_is_named(caplog) -> None:
    train = with_part('part_optimizers { sgd_optimizer { lr: 0.1 } regex_pattern: '
                      '"(.*)booster_mlp(.*)" }')
    with caplog.at_level(logging.WARNING, logger="odl.train.dense_parts"):
        tm, _ = module(train + " in_batch_learning: false")
    (msg,) = [r.getMessage() for r in caplog.records if "matches no dense" in r.getMessage()]
    assert "part_optimizers[0].regex_pattern '(.*)booster_mlp(.*)'" in msg
    assert "dense.wide_bias" in msg or "dense.dnn.0.weight" in msg
    assert [label for label, _, _, _ in tm.dense_optimizer.parts] == ["dense_optimizer"]


@pytest.mark.parametrize("part, field", [
    ("part_optimizers { sgd_optimizer { lr: 0.1 } }", "part_optimizers[0].regex_pattern"),
    ('part_optimizers { sgd_optimizer { lr: 0.1 } regex_pattern: "(" }',
     "part_optimizers[0].regex_pattern"),
    ('part_optimizers { regex_pattern: "x" }', "part_optimizers[0]"),
    ('part_optimizers { sgd_optimizer { lr: 0 } regex_pattern: "x" }',
     "part_optimizers[0].sgd_optimizer.lr"),
    ('part_optimizers { rmsprop_optimizer { lr: 0.1 gradient_clipping: true } '
     'regex_pattern: "x" }', "part_optimizers[0].rmsprop_optimizer.gradient_clipping"),
])
def test_part_optimizer_settings_are_refused_by_field(part: str, field: str) -> None:
    config = text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig())
    text_format.Merge(with_part(part), config.train_config)
    with pytest.raises(ConfigError) as info:
        validate_train_config(config)
    assert info.value.field == f"train_config.dense_optimizer.{field}"
