"""The tables' gradients before their update: TorchEasyRec's table ``gradient_clipping`` /
``max_gradient`` (fbgemm's: each sample's pooled gradient of a feature clamped) and EasyRec's
``embedding_learning_rate_multiplier`` (every table gradient multiplied), on the fused
kernels and the row-sparse tables alike.

Clipping:
the reference is built without the code under test: every record's own gradient comes from a
twin module (exact SGD at rate 1, unclipped) stepping on that record alone. In the batch of
``N`` records a record contributes ``1/N`` of it (the loss is the batch's mean), and with
one id per feature and a table per feature a row's gradient from a record is that record's
pooled gradient of the feature; so a row's clipped gradient is the sum over its records of
``clamp(g_b / N, -max_gradient, max_gradient)``.
"""

from __future__ import annotations

import numpy as np
import pytest

from odl.config.config_error import ConfigError
from odl.config.optimizer_support import table_optimizer_plan
from odl.train.train_module import TrainModule
from tests.test_table_optimizers import (
    LR,
    SGD_TWIN,
    fbgemm_adam,
    follow_step,
    module,
    records,
    row_gradients,
    tf_adagrad,
    torch_rmsprop,
    touched,
    tzrec_tables,
)

BOUND = 2e-3
N = 24


def _sgd(w, g, st, lr, t):  # noqa: ANN001, ANN202
    return w - lr * g, []


CLIPPED = {
    # fused on CPU: fbgemm's kernels clamp their pooled output's gradient
    "sgd": ("sgd_optimizer", "", _sgd, [], True),
    "adagrad": ("adagrad_optimizer", "initial_accumulator_value: 0.1", tf_adagrad, [0.1], True),
    # row-sparse on CPU: the captured gradient is clamped the same way
    "adam": ("adam_optimizer", "beta2: 0.99",
             lambda *a: fbgemm_adam(*a, b2=0.99), [0.0, 0.0], False),
    "rmsprop": ("rmsprop_optimizer", "alpha: 0.9",
                lambda *a: torch_rmsprop(*a, alpha=0.9), [0.0], False),
}


def _record_gradients(tm: TrainModule, twin: TrainModule, fb, recs: list[bytes]  # noqa: ANN001
                      ) -> list[dict[str, np.ndarray]]:
    """Each record's own unclipped table gradient at ``tm``'s parameters."""
    return [row_gradients(tm, twin, fb.build([rec]).batch) for rec in recs]


@pytest.mark.parametrize("case", sorted(CLIPPED))
def test_each_samples_pooled_gradient_is_clamped_before_the_update(case: str) -> None:
    opt, fields, ref, init, fused = CLIPPED[case]
    train = tzrec_tables(opt, f"{fields} gradient_clipping: true max_gradient: {BOUND}")
    tm, fb = module(train)
    twin, _ = module(SGD_TWIN)
    assert (tm.row_sparse is None) == fused
    w = {k: v.double().numpy().copy() for k, v in tm.embedding_tables().items()}
    state = {k: [np.full_like(v, s) for s in init] for k, v in w.items()}
    clamped = 0
    for step in range(3):
        recs = records(N, 11 + step)
        batch = fb.build(recs).batch
        per_record = _record_gradients(tm, twin, fb, recs)
        rows = touched(tm, batch)
        tm.train_step(batch)
        clipped = {}
        for table in w:
            shares = np.stack([g[table] for g in per_record]) / N
            clipped[table] = np.clip(shares, -BOUND, BOUND).sum(0)
            clamped += int((np.abs(shares) > BOUND * 1.01).sum())
        follow_step(f"{case} step {step}", tm, ref, rows, clipped, w, state, step + 1)
    assert clamped > 20  # the bound bites (else the test would not tell clipping apart)


def test_fused_kernels_take_the_bound_and_in_batch_learning_is_refused() -> None:
    """Both devices' fused kernels get fbgemm's arguments; in-batch learning, whose shifted
    predictions follow unclipped steps, is off unwritten and refused by field written."""
    from google.protobuf import text_format

    from odl.config.in_batch_settings import IN_BATCH_OFF, in_batch_mode
    from odl.config.train_validation import validate_train_config
    from odl.protos import pipeline_pb2
    from odl.train.optimizer_builder import optimizer_specs, sparse_optimizer_args
    from tests.test_optimizers import MODEL

    config = text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig())
    text_format.Merge(tzrec_tables("rowwise_adagrad_optimizer",
                                   "gradient_clipping: true max_gradient: 0.5"),
                      config.train_config)
    sparse, _ = optimizer_specs(config.train_config)
    for device in ("cpu", "cuda"):
        _, kwargs = sparse_optimizer_args(sparse, device)
        assert kwargs["gradient_clipping"] is True and kwargs["max_gradient"] == 0.5
        assert table_optimizer_plan(sparse.choice, device).kernel == "rowwise_adagrad"
    assert in_batch_mode(config) == IN_BATCH_OFF
    config.train_config.in_batch_learning = True
    with pytest.raises(ConfigError) as info:
        validate_train_config(config)
    assert info.value.field == \
        "train_config.sparse_optimizer.rowwise_adagrad_optimizer.gradient_clipping"


@pytest.mark.parametrize("case", ["adagrad", "adam", "sgd"])
def test_embedding_learning_rate_multiplier_scales_the_table_gradients(case: str) -> None:
    """EasyRec's multiplier: four steps of the tables equal their rule on the summed
    gradients times the multiplier (fused Adagrad and SGD, row-sparse Adam)."""
    from tests.test_table_optimizers import DENSE, FUSED, _check_steps, tf_adam

    m = 8.0
    refs = {"adagrad": (lambda w, g, st, lr, t: tf_adagrad(w, m * g, st, lr, t), [0.1]),
            "adam": (lambda w, g, st, lr, t: tf_adam(w, m * g, st, lr, t), [0.0, 0.0]),
            # (fused SGD keeps no state: the one carried here stays 0)
            "sgd": (lambda w, g, st, lr, t: (w - lr * m * g, st), [0.0])}
    ref, init = refs[case]
    acc = "initial_accumulator_value: 0.1" if case == "adagrad" else ""
    train = (f"optimizer_config {{ {case}_optimizer {{ learning_rate {{ constant_learning_rate "
             f"{{ learning_rate: {LR} }} }} {acc} }} embedding_learning_rate_multiplier: {m} }}"
             f" {DENSE} in_batch_learning: false")
    assert "adagrad" in FUSED  # (_check_steps reads the name as a fused kind's)
    _check_steps("adagrad" if case == "sgd" else case, train, ref, init, False)


@pytest.mark.parametrize("where, field", [
    ("first", None),
    ("first_zero", "train_config.optimizer_config[0].embedding_learning_rate_multiplier"),
    ("second", "train_config.optimizer_config[1].embedding_learning_rate_multiplier"),
    ("in_batch", "train_config.optimizer_config[0].embedding_learning_rate_multiplier"),
])
def test_multiplier_fields_are_checked(where: str, field: str | None) -> None:
    """Read from the first entry (> 0); on the second, where EasyRec would not read it, and
    with in-batch learning written true, refused by field; unwritten, in-batch learning is
    off with it."""
    from google.protobuf import text_format

    from odl.config.in_batch_settings import IN_BATCH_OFF, in_batch_mode
    from odl.config.train_validation import validate_train_config
    from odl.protos import pipeline_pb2
    from tests.test_optimizers import MODEL

    rate = "learning_rate { constant_learning_rate { learning_rate: 0.05 } }"
    value = "0" if where == "first_zero" else "10"
    first = f"embedding_learning_rate_multiplier: {value}" if where != "second" else ""
    second = "embedding_learning_rate_multiplier: 10" if where == "second" else ""
    config = text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig())
    text_format.Merge(f"optimizer_config {{ adagrad_optimizer {{ {rate} }} {first} }} "
                      f"optimizer_config {{ adam_optimizer {{ {rate} }} {second} }}"
                      + (" in_batch_learning: true" if where == "in_batch" else ""),
                      config.train_config)
    if field is None:
        validate_train_config(config)
        assert in_batch_mode(config) == IN_BATCH_OFF
        return
    with pytest.raises(ConfigError) as info:
        validate_train_config(config)
    assert info.value.field == field
