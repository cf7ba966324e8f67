"""Table optimizers: the row-sparse ones (odl.train.row_sparse_tables: Adam, AdamW, FTRL,
momentum, MomentumW, RMSProp, Adadelta, LAMB, LARS-SGD, partial row-wise Adam / LAMB) and
fbgemm's fused Adagrad with TF's ``initial_accumulator_value``.

Each update is checked step by step against a numpy port of TF's sparse applies (LAMB,
LARS-SGD and the partial row-wise kinds: fbgemm's CUDA kernels' formulas; TorchEasyRec's
RMSprop and Adadelta: torch's) on a real
``TrainModule``: the rows' summed gradients of a step come from a twin module whose tables
train with exact SGD at rate 1 (and whose dense part does not move), loaded with the
module's parameters before the step.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.config.config_error import ConfigError
from odl.config.optimizer_support import optimizer_choices, table_optimizer_plan
from odl.features.feature_builder import FeatureBuilder
from odl.protos import pipeline_pb2
from odl.train.train_module import TrainModule
from tests.test_optimizers import MODEL, records

LR = 0.05
SGD_TWIN = """
optimizer_config { sgd_optimizer { learning_rate { constant_learning_rate { learning_rate: 1 } } } }
optimizer_config { sgd_optimizer { learning_rate { constant_learning_rate { learning_rate: 0 } } } }
in_batch_learning: false
"""
DENSE = ("optimizer_config { adam_optimizer { learning_rate { constant_learning_rate { "
         "learning_rate: 0.01 } } } }")


# a multi-valued feature pooled by mean (its rows' gradients divided by the bag's length)
MEAN_MODEL = """
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "tags" }
  input_fields { input_name: "c1" }
  label_fields: "label"
}
feature_config {
  features { input_names: "x" feature_type: RawFeature }
  features { input_names: "tags" hash_bucket_size: 60 embedding_dim: 4 combiner: "mean" }
  features { input_names: "c1" hash_bucket_size: 100 embedding_dim: 4 }
}
model_config {
  model_class: "DeepFM"
  feature_groups { group_name: "wide" feature_names: ["tags", "c1"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["tags", "c1", "x"] wide_deep: DEEP }
  deepfm { dnn { hidden_units: [8] } }
}
"""


def mean_records(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tags = "|".join(f"t{t}" for t in rng.integers(0, 60, rng.integers(1, 5)))
        out.append(f"{int(rng.random() < 0.4)},{rng.normal():.3f},{tags},"
                   f"c{rng.integers(0, 100)}".encode())
    return out


def module(train: str, model: str = MODEL) -> tuple[TrainModule, FeatureBuilder]:
    c = text_format.Parse(model, pipeline_pb2.EasyRecConfig())
    text_format.Merge(train, c.train_config)
    fb = FeatureBuilder(c)
    return TrainModule(c, fb, device="cpu"), fb


def tables_config(opt: str, extra: str = "") -> str:
    """The train_config's optimizers; in-batch learning off (the updates are the formulas'
    batched steps; unwritten, in-batch learning would be the stream's to decide)."""
    rate = f"learning_rate {{ constant_learning_rate {{ learning_rate: {LR} }} }}"
    return f"optimizer_config {{ {opt} {{ {rate} {extra} }} }} {DENSE} in_batch_learning: false"


def touched(tm: TrainModule, batch) -> dict[str, np.ndarray]:
    """Table -> the rows the batch reads."""
    out: dict[str, list[np.ndarray]] = {}
    kjt = batch.sparse.to_dict()
    for feature, tables in tm.feature_tables().items():
        if feature in kjt:
            for t in tables:
                out.setdefault(t, []).append(kjt[feature].values().numpy())
    return {t: np.unique(np.concatenate(v)) for t, v in out.items()}


def row_gradients(tm: TrainModule, twin: TrainModule, batch) -> dict[str, np.ndarray]:
    """Each table's summed gradient of ``batch`` at ``tm``'s parameters (twin SGD at rate 1)."""
    with torch.no_grad():
        for name, t in twin.embedding_tables().items():
            t.copy_(tm.embedding_tables()[name])
        own = tm.dense_parameters()
        for name, t in twin.dense_parameters().items():
            t.copy_(own[name])
    before = {k: v.double().numpy().copy() for k, v in twin.embedding_tables().items()}
    twin.train_step(batch)
    return {k: before[k] - v.double().numpy() for k, v in twin.embedding_tables().items()}


def tf_adam(w, g, st, lr, t, b1=0.9, b2=0.999, eps=1e-8, decay=0.0):
    m, v = st
    w = w - decay * w
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
    return w - step * m / (np.sqrt(v) + eps), [m, v]


def tf_ftrl(w, g, st, lr, t, power=-0.5, l1=0.0, l2=0.0, shrink=0.0):
    n, z = st
    g_s = g + 2 * shrink * w
    n_new = n + g * g
    z = z + g_s - (n_new ** -power - n ** -power) / lr * w
    quad = n_new ** -power / lr + 2 * l2
    w = np.where(np.abs(z) > l1, (np.sign(z) * l1 - z) / quad, 0.0)
    return w, [n_new, z]


def tf_adagrad(w, g, st, lr, t):
    """TF's Adagrad (accumulators from ``initial_accumulator_value``), with fbgemm's eps."""
    acc = st[0] + g * g
    return w - lr * g / (np.sqrt(acc) + 1e-8), [acc]


def tf_momentum(w, g, st, lr, t, momentum=0.9):
    a = momentum * st[0] + g
    return w - lr * a, [a]


def tf_rmsprop(w, g, st, lr, t, rho=0.9, momentum=0.9, eps=1.0):
    """TF's SparseApplyRMSProp (its mean square starts at 1)."""
    ms = rho * st[0] + (1 - rho) * g * g
    mom = momentum * st[1] + lr * g / np.sqrt(ms + eps)
    return w - mom, [ms, mom]


def tf_momentumw(w, g, st, lr, t, momentum=0.9, decay=0.0):
    return tf_momentum(w - decay * w, g, st, lr, t, momentum=momentum)


def deeprec_adagrad_decay(w, g, st, lr, t, init=0.1, period=100000, rate=0.9):
    """DeepRec's SparseApplyAdagradDecay: one decay per update while the row's count of
    decays is behind ``t // period``, floored at the initial value."""
    a, power = st
    due = power < t // period
    a = np.where(due, np.maximum(a * rate, init), a) + g * g
    return w - lr * g / np.sqrt(a), [a, power + due]


CASES = {
    "adam": ("adam_optimizer", "", tf_adam, [0.0, 0.0]),
    "adam_async": ("adam_async_optimizer", "beta2: 0.99",
                   lambda *a: tf_adam(*a, b2=0.99), [0.0, 0.0]),
    "adam_asyncw": ("adam_asyncw_optimizer", "weight_decay: 0.02",
                    lambda *a: tf_adam(*a, decay=0.02), [0.0, 0.0]),
    "rms_prop": ("rms_prop_optimizer", "momentum_optimizer_value: 0.5 decay: 0.8 epsilon: 0.1",
                 lambda *a: tf_rmsprop(*a, rho=0.8, momentum=0.5, eps=0.1), [1.0, 0.0]),
    "rms_prop_default": ("rms_prop_optimizer", "", tf_rmsprop, [1.0, 0.0]),
    "momentumw": ("momentumw_optimizer", "weight_decay: 0.01 momentum_optimizer_value: 0.8",
                  lambda *a: tf_momentumw(*a, momentum=0.8, decay=0.01), [0.0]),
    "lazy_adam": ("lazy_adam_optimizer", "beta1: 0.8 beta2: 0.99",
                  lambda *a: tf_adam(*a, b1=0.8, b2=0.99), [0.0, 0.0]),
    "adamw": ("adamw_optimizer", "weight_decay: 0.01",
              lambda *a: tf_adam(*a, decay=0.01), [0.0, 0.0]),
    "ftrl": ("ftrl_optimizer", "l1_reg: 0.01 l2_reg: 0.1 l2_shrinkage_reg: 0.05",
             lambda *a: tf_ftrl(*a, l1=0.01, l2=0.1, shrink=0.05), [0.1, 0.0]),
    "ftrl_power": ("ftrl_optimizer", "learning_rate_power: -0.7 initial_accumulator_value: 0.5",
                   lambda *a: tf_ftrl(*a, power=-0.7), [0.5, 0.0]),
    "momentum": ("momentum_optimizer", "momentum_optimizer_value: 0.8",
                 lambda *a: tf_momentum(*a, momentum=0.8), [0.0]),
    # DeepRec's: a decay at every step (a row catches up one decay per touch) and every other
    "adagrad_decay": ("adagrad_decay_optimizer", "initial_accumulator_value: 0.2 "
                      "accumulator_decay_step: 1 accumulator_decay_rate: 0.5",
                      lambda *a: deeprec_adagrad_decay(*a, init=0.2, period=1, rate=0.5),
                      [0.2, 0.0]),
    "adagrad_decay_2": ("adagrad_decay_optimizer", "accumulator_decay_step: 2",
                        lambda *a: deeprec_adagrad_decay(*a, period=2), [0.1, 0.0]),
    # fused (fbgemm's kernel), the accumulators filled at the start
    "adagrad": ("adagrad_optimizer", "initial_accumulator_value: 0.3", tf_adagrad, [0.3]),
    # not written: 0 (EasyRec's implied 0.1 learns far slower online)
    "adagrad_default": ("adagrad_optimizer", "", tf_adagrad, [0.0]),
}
FUSED = {"adagrad", "adagrad_default"}


def fbgemm_lamb(w, g, st, lr, t, b1=0.9, b2=0.999, eps=1e-8, decay=0.0):
    """fbgemm's LAMB on one batch of rows (its CUDA kernel's formula, per row)."""
    m, v = st
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    r = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + decay * w
    ratio = np.linalg.norm(w, axis=1, keepdims=True) / np.linalg.norm(r, axis=1, keepdims=True)
    return w - lr * ratio * r, [m, v]


# TorchEasyRec's form: sparse_optimizer / dense_optimizer
LAMB_TRAIN = (f"sparse_optimizer {{ lamb_optimizer {{ lr: {LR} beta1: 0.8 beta2: 0.99 "
              "weight_decay: 0.01 } constant_learning_rate {} } "
              "dense_optimizer { adam_optimizer { lr: 0.01 } constant_learning_rate {} }")


def _check_steps(case: str, train: str, ref, init: list[float], mean: bool) -> None:  # noqa: ANN001
    """Four steps of ``train``'s tables against ``ref`` on the rows each step touched."""
    model = MEAN_MODEL if mean else MODEL
    tm, fb = module(train, model)
    twin, _ = module(SGD_TWIN, model)
    if case.removeprefix("mean_") in FUSED:
        assert tm.row_sparse is None and tm.table_state_start == pytest.approx(init[0])
    else:
        assert tm.row_sparse is not None
        assert any(tbe.mean for tbe in tm.row_sparse._tbes) == mean  # fbgemm's mean pooling
    w = {k: v.double().numpy().copy() for k, v in tm.embedding_tables().items()}
    state = {k: [np.full_like(v, s) for s in init] for k, v in w.items()}
    for step in range(4):
        batch = fb.build((mean_records if mean else records)(48, 7 + step)).batch
        grads = row_gradients(tm, twin, batch)
        rows = touched(tm, batch)
        tm.train_step(batch)
        follow_step(f"{case} step {step}", tm, ref, rows, grads, w, state, step + 1)


def follow_step(what: str, tm: TrainModule, ref, rows: dict, grads: dict, w: dict,  # noqa: ANN001
                state: dict, t: int) -> None:
    """``ref``'s step of the touched rows of ``w`` / ``state`` (table -> arrays) from their
    gradients ``grads``, checked against the module's tables after its step; the untouched
    rows stay. ``w`` then holds the module's float32 rows, where the next step starts."""
    for table, got in tm.embedding_tables().items():
        r = rows[table]
        new_w, new_st = ref(w[table][r], grads[table][r], [s[r] for s in state[table]], LR, t)
        w[table][r] = new_w
        for s, v in zip(state[table], new_st, strict=True):
            s[r] = v
        got = got.double().numpy()
        np.testing.assert_allclose(got[r], w[table][r], rtol=2e-4, atol=2e-6,
                                   err_msg=f"{what} table {table}")
        untouched = np.setdiff1d(np.arange(got.shape[0]), r)
        np.testing.assert_array_equal(got[untouched], w[table][untouched])
        w[table] = got.copy()


@pytest.mark.parametrize("case", sorted(CASES) + ["mean_adam", "mean_ftrl", "mean_adagrad"])
def test_updates_follow_tf_step_by_step(case: str) -> None:
    opt, extra, ref, init = CASES[case.removeprefix("mean_")]
    _check_steps(case, tables_config(opt, extra), ref, init, case.startswith("mean_"))


@pytest.mark.parametrize("mean", [False, True])
def test_lamb_follows_fbgemm_step_by_step(mean: bool) -> None:
    """TorchEasyRec's ``lamb_optimizer`` on CPU: fbgemm's CUDA LAMB rule, row by row."""
    _check_steps("lamb", LAMB_TRAIN,
                 lambda *a: fbgemm_lamb(*a, b1=0.8, b2=0.99, decay=0.01), [0.0, 0.0], mean)


def fbgemm_partial_rowwise(w, g, st, lr, t, b1=0.9, b2=0.999, eps=1e-8, decay=0.0,
                           lamb=False):
    """fbgemm's partial row-wise Adam / LAMB: the second moment is one value per row (kept
    here repeated over the row's columns)."""
    m, v = st
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * np.mean(g * g, axis=1, keepdims=True)
    r = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + decay * w
    if not lamb:
        return w - lr * r, [m, v]
    ratio = np.linalg.norm(w, axis=1, keepdims=True) / np.linalg.norm(r, axis=1, keepdims=True)
    return w - lr * ratio * r, [m, v]


def fbgemm_lars_sgd(w, g, st, lr, t, momentum=0.9, decay=0.0, eta=1e-3):
    w_norm = np.linalg.norm(w, axis=1, keepdims=True)
    rate = lr * eta * w_norm / (np.linalg.norm(g, axis=1, keepdims=True) + decay * w_norm)
    a = momentum * st[0] + rate * (g + decay * w)
    return w - a, [a]


def torch_rmsprop(w, g, st, lr, t, alpha=0.99, eps=1e-8, decay=0.0):
    g = g + decay * w
    sq = alpha * st[0] + (1 - alpha) * g * g
    return w - lr * g / (np.sqrt(sq) + eps), [sq]


def torch_adadelta(w, g, st, lr, t, rho=0.95, eps=1e-6, decay=0.0):
    g = g + decay * w
    sq = rho * st[0] + (1 - rho) * g * g
    d = np.sqrt(st[1] + eps) / np.sqrt(sq + eps) * g
    acc = rho * st[1] + (1 - rho) * d * d
    return w - lr * d, [sq, acc]


def fbgemm_adam(w, g, st, lr, t, b1=0.9, b2=0.999, eps=1e-8, decay=0.0):
    """fbgemm's table Adam (its CUDA kernel's formula): the decay inside the rate's step."""
    m, v = st
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    r = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + decay * w
    return w - lr * r, [m, v]


def fbgemm_rowwise_adagrad(w, g, st, lr, t, decay=0.0, mode="L2", eps=1e-8):
    """fbgemm's row-wise Adagrad with weight decay (its CUDA and CPU kernels' formula)."""
    g_acc = g + decay * w if mode == "L2" else g
    a = st[0] + np.mean(g_acc * g_acc, axis=1, keepdims=True)
    m = lr / (np.sqrt(a) + eps)
    c = 1 - m * decay if mode == "L2" else 1 - lr * decay
    return c * w - m * g, [a]


def tzrec_tables(opt: str, fields: str) -> str:
    return (f"sparse_optimizer {{ {opt} {{ lr: {LR} {fields} }} constant_learning_rate {{}} }} "
            "dense_optimizer { adam_optimizer { lr: 0.01 } constant_learning_rate {} }")


TZREC_CASES = {
    "rowwise_adagrad_l2": ("rowwise_adagrad_optimizer", "weight_decay: 0.05 weight_decay_mode: L2",
                           lambda *a: fbgemm_rowwise_adagrad(*a, decay=0.05), [0.0]),
    "rowwise_adagrad_decouple": (
        "rowwise_adagrad_optimizer", "weight_decay: 0.05 weight_decay_mode: DECOUPLE",
        lambda *a: fbgemm_rowwise_adagrad(*a, decay=0.05, mode="DECOUPLE"), [0.0]),
    "adam": ("adam_optimizer", "beta2: 0.99 weight_decay: 0.05",
             lambda *a: fbgemm_adam(*a, b2=0.99, decay=0.05), [0.0, 0.0]),
    "partial_rowwise_adam": (
        "partial_rowwise_adam_optimizer", "beta1: 0.8 beta2: 0.99 weight_decay: 0.01",
        lambda *a: fbgemm_partial_rowwise(*a, b1=0.8, b2=0.99, decay=0.01), [0.0, 0.0]),
    "partial_rowwise_lamb": (
        "partial_rowwise_lamb_optimizer", "beta1: 0.8 weight_decay: 0.01",
        lambda *a: fbgemm_partial_rowwise(*a, b1=0.8, decay=0.01, lamb=True), [0.0, 0.0]),
    "lars_sgd": ("lars_sgd_optimizer", "momentum: 0.5 weight_decay: 0.01",
                 lambda *a: fbgemm_lars_sgd(*a, momentum=0.5, decay=0.01), [0.0]),
    "rmsprop": ("rmsprop_optimizer", "alpha: 0.9 weight_decay: 0.01",
                lambda *a: torch_rmsprop(*a, alpha=0.9, decay=0.01), [0.0]),
    "adadelta": ("adadelta_optimizer", "rho: 0.9 eps: 1e-4",
                 lambda *a: torch_adadelta(*a, rho=0.9, eps=1e-4), [0.0, 0.0]),
}


@pytest.mark.parametrize("case", sorted(TZREC_CASES) + ["mean_partial_rowwise_lamb"])
def test_torcheasyrec_updates_follow_their_kernels_step_by_step(case: str) -> None:
    """TorchEasyRec's other table optimizers (fbgemm's experimental CUDA kernels, or kernels
    public fbgemm lacks, and its Adam with weight_decay, CUDA only in fbgemm) run row-sparse
    on CPU with their rules, row by row."""
    opt, fields, ref, init = TZREC_CASES[case.removeprefix("mean_")]
    _check_steps(case, tzrec_tables(opt, fields), ref, init, case.startswith("mean_"))


def test_dense_parameters_follow_tf_rmsprop_and_momentumw() -> None:
    """EasyRec's rms_prop / momentumw as the dense optimizer (one optimizer_config entry)."""
    from odl.train.optimizer_builder import (
        AdagradDecay,
        DecoupledMomentumW,
        TfRmsProp,
        make_dense_optimizer,
        optimizer_specs,
    )

    rate = "learning_rate { constant_learning_rate { learning_rate: 0.1 } }"
    rng = np.random.default_rng(3)
    for text, cls, ref, init in [
        (f"rms_prop_optimizer {{ {rate} decay: 0.8 momentum_optimizer_value: 0.5 "
         "epsilon: 0.01 }", TfRmsProp,
         lambda w, g, st: tf_rmsprop(w, g, st, 0.1, 0, rho=0.8, momentum=0.5, eps=0.01),
         [1.0, 0.0]),
        (f"momentumw_optimizer {{ {rate} weight_decay: 0.05 momentum_optimizer_value: 0.7 }}",
         DecoupledMomentumW,
         lambda w, g, st: tf_momentumw(w, g, st, 0.1, 0, momentum=0.7, decay=0.05), [0.0]),
        # DeepRec's ApplyAdagradDecay: the update count is the step (decays after 2 and 4)
        (f"adagrad_decay_optimizer {{ {rate} initial_accumulator_value: 0.3 "
         "accumulator_decay_step: 2 accumulator_decay_rate: 0.4 }", AdagradDecay,
         None, [0.3, 0.0]),
    ]:
        tc = text_format.Parse(f"optimizer_config {{ {text} }}", pipeline_pb2.TrainConfig())
        _sparse, dense = optimizer_specs(tc)
        p = torch.nn.Parameter(torch.tensor(rng.normal(size=(3, 2)), dtype=torch.float64))
        opt = make_dense_optimizer(dense, [p])
        assert type(opt) is cls
        w = p.detach().numpy().copy()
        st = [np.full_like(w, s) for s in init]
        for t in range(1, 6):
            g = rng.normal(size=w.shape)
            p.grad = torch.tensor(g)
            opt.step()
            w, st = (ref(w, g, st) if ref is not None else deeprec_adagrad_decay(
                w, g, st, 0.1, t, init=0.3, period=2, rate=0.4))
            np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-6)  # float32 settings


def test_torcheasyrec_dense_adadelta_and_rmsprop_are_torchs() -> None:
    from odl.train.optimizer_builder import make_dense_optimizer, optimizer_specs

    for text, cls, want in [
        ("adadelta_optimizer { lr: 0.5 rho: 0.8 eps: 1e-5 weight_decay: 0.01 }",
         torch.optim.Adadelta, {"lr": 0.5, "rho": 0.8, "eps": 1e-5, "weight_decay": 0.01}),
        ("rmsprop_optimizer { lr: 0.02 alpha: 0.9 eps: 1e-6 }", torch.optim.RMSprop,
         {"lr": 0.02, "alpha": 0.9, "eps": 1e-6, "weight_decay": 0.0}),
    ]:
        tc = text_format.Parse(
            f"sparse_optimizer {{ adagrad_optimizer {{ lr: 0.1 }} }} dense_optimizer {{ {text} }}",
            pipeline_pb2.TrainConfig())
        opt = make_dense_optimizer(optimizer_specs(tc)[1], [torch.nn.Parameter(torch.zeros(2))])
        assert type(opt) is cls
        for k, v in want.items():
            assert opt.param_groups[0][k] == pytest.approx(v), (text, k)


def test_table_only_kinds_are_refused_for_the_dense_part() -> None:
    from odl.train.optimizer_builder import make_dense_optimizer, optimizer_specs

    tc = text_format.Parse("optimizer_config { adam_optimizer {} }", pipeline_pb2.TrainConfig())
    spec = optimizer_specs(tc)[1]
    for kind in ("lamb", "lars_sgd", "partial_rowwise_adam"):
        spec = dataclasses.replace(spec, kind=kind)
        with pytest.raises(ConfigError, match="table optimizer"):
            make_dense_optimizer(spec, [torch.nn.Parameter(torch.zeros(2))])


def test_lamb_rows_of_zeros_and_zero_steps_stay() -> None:
    from odl.train.row_sparse_rules import RowSparseRule

    rule = RowSparseRule("lamb", {"weight_decay": 0.0}, tf_form=False)
    w = torch.tensor([[0.0, 0.0], [0.3, -0.4], [0.2, 0.1]])
    g = torch.tensor([[0.5, 0.1], [0.0, 0.0], [0.1, 0.1]])
    got, _state = rule.apply(w, g, [torch.zeros(3, 2), torch.zeros(3, 2)], 0.1, 1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:2], w[:2])  # |w| = 0: no step; r = 0: no step
    ref, _ = fbgemm_lamb(w[2:].double().numpy(), g[2:].double().numpy(),
                         [np.zeros((1, 2)), np.zeros((1, 2))], 0.1, 1)
    np.testing.assert_allclose(got[2:].numpy(), ref, rtol=1e-5)


def test_wide_tables_take_the_wide_rate() -> None:
    tm, fb = module(tables_config("momentum_optimizer", "momentum_optimizer_value: 0.5")
                    + " wide_learning_rate_multiplier: 3")
    twin, _ = module(SGD_TWIN)
    batch = fb.build(records(32, 3)).batch
    before = {k: v.double().numpy().copy() for k, v in tm.embedding_tables().items()}
    grads = row_gradients(tm, twin, batch)
    tm.train_step(batch)
    for table, got in tm.embedding_tables().items():
        lr = LR * (3 if table.endswith("_wide") else 1)
        np.testing.assert_allclose(got.double().numpy(), before[table] - lr * grads[table],
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("config, names", [
    (tables_config("ftrl_optimizer", "l1_reg: 0.01"), {"accumulator": 4, "linear": 4}),
    (tables_config("rms_prop_optimizer", ""), {"mean_square": 4, "momentum_buffer": 4}),
    (tzrec_tables("partial_rowwise_lamb_optimizer", ""), {"exp_avg": 4, "exp_avg_sq_row": 1}),
    # one entry for tables and dense part, as DeepRec jobs run it; restored inside a period
    (f"optimizer_config {{ adagrad_decay_optimizer {{ learning_rate {{ constant_learning_rate "
     f"{{ learning_rate: {LR} }} }} accumulator_decay_step: 2 accumulator_decay_rate: 0.5 }} }} "
     "in_batch_learning: false", {"accumulator": 4, "accumulator_decay_power": 1}),
], ids=["ftrl", "rms_prop", "partial_rowwise_lamb", "adagrad_decay"])
def test_checkpoint_round_trip_continues_as_uninterrupted(config: str, names: dict) -> None:
    """Restored after step 3, the module goes on as the uninterrupted one: tables, their
    optimizer state and the dense parameters (their optimizer's state restored too)."""
    tm, fb = module(config)
    batches = [fb.build(records(40, 20 + k)).batch for k in range(6)]
    for b in batches[:3]:
        tm.train_step(b)
    state = tm.state_dict_for_checkpoint()
    sparse = state["sparse_optimizer"]["ebc.embedding_bags.c1.weight"]
    assert {k: tuple(v.shape) for k, v in sparse.items()} == {
        f"c1.{n}": (100, width) for n, width in names.items()}
    assert all(float(v.abs().sum()) > 0 for v in sparse.values())
    restored, _ = module(config)
    restored.load_checkpoint_state(state)
    for b in batches[3:]:
        tm.train_step(b)
        restored.train_step(b)
    for name, t in tm.embedding_tables().items():
        torch.testing.assert_close(restored.embedding_tables()[name], t, rtol=0, atol=0)
    dense = restored.dense_parameters()
    for name, t in tm.dense_parameters().items():
        torch.testing.assert_close(dense[name], t, rtol=0, atol=0)
    a = tm.state_dict_for_checkpoint()["sparse_optimizer"]
    b = restored.state_dict_for_checkpoint()["sparse_optimizer"]
    for pname, states in a.items():
        for k, v in states.items():
            torch.testing.assert_close(b[pname][k], v, rtol=0, atol=0)


def test_adam_state_is_in_the_views_dynamic_resets_zero() -> None:
    tm, fb = module(tables_config("adam_optimizer"))
    tm.train_step(fb.build(records(40, 1)).batch)
    _tables, states = tm.row_state_views()
    st = states["ebc.embedding_bags.c1.weight"]
    assert len(st) == 2 and all(v.shape == (100, 4) for v in st)
    assert float(st[0].abs().sum()) > 0  # live: the views a dynamic reset zeroes
    _w, shard_state = tm.table_shards("c2")
    assert len(shard_state) == 2


def test_ftrl_zero_state_is_a_fresh_accumulator() -> None:
    from odl.train.row_sparse_rules import RowSparseRule

    rule = RowSparseRule("ftrl", {"initial_accumulator_value": 0.3})
    w = torch.tensor([[0.5, -0.2]])
    g = torch.tensor([[0.1, 0.4]])
    got, (n, z) = rule.apply(w, g, [torch.zeros(1, 2), torch.zeros(1, 2)], 0.1, 1)
    ref_w, (ref_n, ref_z) = tf_ftrl(w.double().numpy(), g.double().numpy(),
                                    [np.full((1, 2), 0.3), np.zeros((1, 2))], 0.1, 1)
    np.testing.assert_allclose(got.numpy(), ref_w, rtol=1e-6)
    np.testing.assert_allclose(n.numpy() + 0.3, ref_n, rtol=1e-6)
    np.testing.assert_allclose(z.numpy(), ref_z, rtol=1e-6)


def test_plans_run_row_sparse_where_fbgemm_has_no_kernel() -> None:
    def choice(text: str):
        return optimizer_choices(text_format.Parse(text, pipeline_pb2.TrainConfig()))[0]

    for kind in ("adam", "adamw", "ftrl", "momentum", "lazy_adam", "rms_prop", "momentumw",
                 "adam_async", "adam_asyncw"):
        plan = table_optimizer_plan(choice(f"optimizer_config {{ {kind}_optimizer {{}} }}"),
                                    "cpu")
        assert plan.row_sparse and plan.kernel == "sgd"
    for kind in ("lars_sgd", "partial_rowwise_adam", "partial_rowwise_lamb", "adadelta",
                 "rmsprop"):
        for device in ("cpu", "cuda"):
            plan = table_optimizer_plan(
                choice(f"sparse_optimizer {{ {kind}_optimizer {{ lr: 0.1 }} }}"), device)
            assert plan.row_sparse and plan.configured == kind
    assert "lazy Adam" in table_optimizer_plan(
        choice("optimizer_config { adam_optimizer {} }"), "cpu").note
    assert table_optimizer_plan(
        choice("optimizer_config { lazy_adam_optimizer {} }"), "cpu").note == ""
    cuda = table_optimizer_plan(choice("sparse_optimizer { adam_optimizer { lr: 0.1 } }"),
                                "cuda")
    assert not cuda.row_sparse and cuda.kernel == "adam"
    assert table_optimizer_plan(choice("optimizer_config { ftrl_optimizer {} }"),
                                "cuda").row_sparse
    for device in ("cpu", "cuda"):
        assert table_optimizer_plan(choice("optimizer_config { adagrad_decay_optimizer {} }"),
                                    device).row_sparse
    lamb = choice("sparse_optimizer { lamb_optimizer { lr: 0.1 } }")
    assert table_optimizer_plan(lamb, "cpu").row_sparse
    assert table_optimizer_plan(lamb, "cuda").kernel == "lamb"
    # TorchEasyRec's row-wise Adagrad decays only with a mode: then fbgemm's rule, row-sparse
    # where its CPU kernel skips the decay, fused on CUDA
    decayed = choice("sparse_optimizer { rowwise_adagrad_optimizer { lr: 0.1 weight_decay: "
                     "0.01 weight_decay_mode: DECOUPLE } }")
    assert decayed.kind == "rowwise_adagrad_with_decay"
    assert table_optimizer_plan(decayed, "cpu").row_sparse
    cuda = table_optimizer_plan(decayed, "cuda")
    assert not cuda.row_sparse and cuda.kernel == "rowwise_adagrad"
    for fields in ("weight_decay: 0.01", "weight_decay_mode: L2"):
        plain = choice(f"sparse_optimizer {{ rowwise_adagrad_optimizer {{ lr: 0.1 {fields} }} }}")
        assert plain.kind == "rowwise_adagrad"
        assert not table_optimizer_plan(plain, "cpu").row_sparse


@pytest.mark.parametrize("tables", [
    tables_config("ftrl_optimizer"),
    tzrec_tables("rowwise_adagrad_optimizer", "weight_decay: 0.01 weight_decay_mode: L2"),
], ids=["ftrl", "rowwise_adagrad_with_decay"])
@pytest.mark.parametrize("flags, field", [
    ("in_batch_learning: true", "train_config.in_batch_learning"),
    ("in_batch_learning: true per_record_adagrad: true", "train_config.per_record_adagrad"),
])
def test_in_batch_learning_is_refused_with_row_sparse_tables(tables: str, flags: str,
                                                             field: str) -> None:
    """Written, refused by field; unwritten, in-batch learning is off (not the stream's to
    decide): its shift follows fused SGD / Adagrad updates only."""
    from odl.config.in_batch_settings import IN_BATCH_OFF, in_batch_mode
    from odl.config.pipeline_config import load_pipeline_config
    from odl.models.model_registry import check_pipeline_config
    from tests.test_optimizers import ONLINE

    config = load_pipeline_config(ONLINE)
    config.train_config.ClearField("optimizer_config")
    text_format.Merge(tables.replace("in_batch_learning: false", ""), config.train_config)
    assert in_batch_mode(config) == IN_BATCH_OFF
    text_format.Merge(flags, config.train_config)
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(config, online=True)
    assert info.value.field == field


def _rank_tables(rank: int, world: int, model_dir: str, schedule: list, optimizer: str,
                 row_wise_min_rows: int) -> dict[str, np.ndarray]:
    """One rank's training with ``optimizer`` tables; the gathered tables on rank 0."""
    from odl.datagen.datagen_config import bursty_config_text
    from tests.harness import load_config_text

    text = bursty_config_text(model_dir, batch_size=256, buckets=4096)
    if optimizer.startswith("sparse_optimizer"):  # TorchEasyRec's form
        config = load_config_text(text)
        config.train_config.ClearField("optimizer_config")
        text_format.Merge(optimizer, config.train_config)
    else:
        config = load_config_text(text.replace("adagrad_optimizer", optimizer, 1))
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=row_wise_min_rows)
    assert tm.row_sparse is not None
    for step in schedule:
        tm.train_step(fb.build(step[rank]).batch if step[rank] else tm.empty_batch())
    state = tm.state_dict_for_checkpoint()
    out = {k: v.numpy() for k, v in state.get("model", {}).items()
           if k.startswith("ebc.embedding_bags.")}
    out.update({f"{p}/{k}": v.numpy() for p, st in state.get("sparse_optimizer", {}).items()
                for k, v in st.items()})
    return out


@pytest.mark.parametrize("optimizer", [
    "ftrl_optimizer",
    tzrec_tables("partial_rowwise_lamb_optimizer",
                 "weight_decay: 0.01 gradient_clipping: true max_gradient: 0.0002")],
    ids=["ftrl", "partial_rowwise_lamb_clipped"])
def test_two_ranks_train_row_sparse_tables_as_one_process(ranks, tmp_path,
                                                          optimizer: str) -> None:
    """Tables split by rows (4096-row id tables) and whole on one rank: each rank updates
    the rows it holds and keeps their state (partial row-wise LAMB: a second moment of one
    column per row; its gradients clipped, each rank clamping the lookups it serves); the
    gathered tables and state are one process's."""
    from odl.datagen.bursty_stream import BurstyStream
    batch, world = 256, 2
    records = BurstyStream(seed=5).next_batch(4 * batch).encode("csv")
    schedule = [[records[k + r * batch // world:k + (r + 1) * batch // world]
                 for r in range(world)] for k in range(0, len(records), batch)]
    one = _rank_tables(0, 1, str(tmp_path / "one"), [[sum(s, [])] for s in schedule],
                       optimizer, 2048)
    got = ranks.run(_rank_tables, world, str(tmp_path / "m"), schedule, optimizer, 2048,
                    timeout=600.0)  # a loaded machine
    assert set(got[0]) == set(one) and got[1] == {}
    assert any("/" in k for k in one)
    for name, t in one.items():
        np.testing.assert_allclose(got[0][name], t, atol=5e-5, rtol=0, err_msg=name)


DYNAMIC_MODEL = """
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "user" }
  input_fields { input_name: "item" input_type: INT64 }
  label_fields: "label"
}
feature_config {
  features { input_names: "x" feature_type: RawFeature }
  features { input_names: "user" embedding_dim: 4 combiner: "mean" zch { zch_size: 30 lru {} } }
  features { input_names: "item" num_buckets: 1 embedding_dim: 4
             ev_params { filter_freq: 1 max_capacity: 20 steps_to_live: 5 } }
}
model_config {
  model_class: "DeepFM"
  feature_groups { group_name: "wide" feature_names: ["user", "item"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["user", "item", "x"] wide_deep: DEEP }
  deepfm { dnn { hidden_units: [8] } wide_output_dim: 1 }
}
"""


def dynamic_records(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [f"{int(rng.random() < 0.3)},{rng.normal():.3f},u{rng.integers(0, 90)}|"
            f"u{rng.integers(0, 90)},{rng.integers(0, 70)}".encode() for _ in range(n)]


@pytest.mark.parametrize("opt", ["ftrl_optimizer", "adam_optimizer", "adagrad_optimizer",
                                 "rms_prop_optimizer", "adagrad_decay_optimizer"])
def test_dynamic_rows_evicted_get_a_fresh_optimizer_state(opt: str) -> None:
    fused = opt == "adagrad_optimizer"
    extra = {"adagrad_optimizer": "initial_accumulator_value: 0.2",
             "adagrad_decay_optimizer": "accumulator_decay_step: 2"}.get(opt, "")
    tm, fb = module(tables_config(opt, extra), DYNAMIC_MODEL)
    assert (tm.row_sparse is None) == fused and tm.dynamic
    start = 0.2 if fused else 0.0  # what a fresh state holds
    for k in range(8):  # more ids than rows: admissions evict
        out = tm.train_step(fb.build(dynamic_records(64, k)).batch)
        assert math.isfinite(out.loss)
    _tables, states = tm.row_state_views()
    for base, torch_tables in tm.dynamic_torch_tables.items():
        rows = np.array([0, 3, 5])
        held = {t: [v[rows].clone() for v in states[f"ebc.embedding_bags.{t}.weight"]]
                for t in torch_tables}
        assert any(not torch.all(v == start) for vs in held.values() for v in vs), base
        tm.reset_dynamic_rows({base: rows}, tm.global_step)
        for t in torch_tables:
            for v in states[f"ebc.embedding_bags.{t}.weight"]:
                assert torch.all(v[rows] == np.float32(start)), (base, t)  # a fresh state


@pytest.mark.parametrize("opt", ["ftrl_optimizer", "momentum_optimizer"])
def test_checkpoints_of_the_former_substitutes_restore(opt: str) -> None:
    """FTRL tables ran as Adagrad (``<t>.momentum1``), momentum tables as SGD (no state):
    their checkpoints restore, FTRL's weights a fixed point of its restored state."""
    config = tables_config(opt, "l1_reg: 0.01 l2_reg: 0.1" if opt == "ftrl_optimizer" else "")
    tm, fb = module(config)
    tm.train_step(fb.build(records(40, 2)).batch)
    state = tm.state_dict_for_checkpoint()
    state["sparse_optimizer"] = {
        p: ({f"{p.split('.')[-2]}.momentum1": torch.rand(100, 4)}
            if opt == "ftrl_optimizer" else {}) for p in state["sparse_optimizer"]}
    restored, _ = module(config)
    restored.load_checkpoint_state(state)
    rule = restored.row_sparse.rule
    _tables, states = restored.row_state_views()
    for name, w in restored.embedding_tables().items():
        st = states[f"ebc.embedding_bags.{name}.weight"]
        torch.testing.assert_close(w, state["model"][f"ebc.embedding_bags.{name}.weight"])
        if opt == "momentum_optimizer":
            assert float(st[0].abs().sum()) == 0.0
            continue
        same, _ = rule.apply(w.clone(), torch.zeros_like(w), [v.clone() for v in st], LR, 2)
        torch.testing.assert_close(same, w, rtol=1e-5, atol=1e-6)
    restored.train_step(fb.build(records(40, 3)).batch)


def test_fused_row_wise_accumulators_restore_into_row_wise_adagrad_with_decay() -> None:
    """A checkpoint of fused row-wise Adagrad tables (fbgemm's ``momentum1``, as a CUDA run
    of the decaying config writes it) restores into the CPU's row-sparse rule: each row's
    accumulator carried over."""
    plain, fb = module(tzrec_tables("rowwise_adagrad_optimizer", ""))
    assert plain.row_sparse is None
    for k in range(2):
        plain.train_step(fb.build(records(40, 40 + k)).batch)
    state = plain.state_dict_for_checkpoint()
    fused = {p: {k.rsplit(".", 1)[-1]: v for k, v in st.items()}
             for p, st in state["sparse_optimizer"].items()}
    assert all(set(st) == {"momentum1"} for st in fused.values())
    decayed, _ = module(tzrec_tables("rowwise_adagrad_optimizer",
                                     "weight_decay: 0.01 weight_decay_mode: L2"))
    decayed.load_checkpoint_state(state)
    _tables, states = decayed.row_state_views()
    for pname, st in fused.items():
        (row,) = states[pname]
        torch.testing.assert_close(row.reshape(-1), st["momentum1"].reshape(-1))
        assert float(row.abs().sum()) > 0


@pytest.mark.parametrize("train, field", [
    ("optimizer_config { rms_prop_optimizer { decay: 1.0 } }",
     "train_config.optimizer_config[0].rms_prop_optimizer.decay"),
    ("optimizer_config { rms_prop_optimizer { epsilon: 0 } }",
     "train_config.optimizer_config[0].rms_prop_optimizer.epsilon"),
    ("optimizer_config { momentumw_optimizer { weight_decay: 1.5 } }",
     "train_config.optimizer_config[0].momentumw_optimizer.weight_decay"),
    (tzrec_tables("adadelta_optimizer", "rho: 1.5"),
     "train_config.sparse_optimizer.adadelta_optimizer.rho"),
    (tzrec_tables("rmsprop_optimizer", "alpha: -0.1"),
     "train_config.sparse_optimizer.rmsprop_optimizer.alpha"),
    (tzrec_tables("lars_sgd_optimizer", "momentum: 1.0"),
     "train_config.sparse_optimizer.lars_sgd_optimizer.momentum"),
    ("optimizer_config { adagrad_decay_optimizer { accumulator_decay_rate: 1.0 } }",
     "train_config.optimizer_config[0].adagrad_decay_optimizer.accumulator_decay_rate"),
    ("optimizer_config { adagrad_decay_optimizer { accumulator_decay_step: 0 } }",
     "train_config.optimizer_config[0].adagrad_decay_optimizer.accumulator_decay_step"),
    ("optimizer_config { adagrad_decay_optimizer { initial_accumulator_value: 0 } }",
     "train_config.optimizer_config[0].adagrad_decay_optimizer.initial_accumulator_value"),
    (tzrec_tables("sgd_optimizer", "gradient_clipping: true max_gradient: 0"),
     "train_config.sparse_optimizer.sgd_optimizer.max_gradient"),
    ("sparse_optimizer { sgd_optimizer { lr: 0.1 } } dense_optimizer { rmsprop_optimizer { "
     "lr: 0.01 gradient_clipping: true } }",
     "train_config.dense_optimizer.rmsprop_optimizer.gradient_clipping"),
])
def test_optimizer_settings_out_of_range_are_refused_by_field(train: str, field: str) -> None:
    from odl.config.train_validation import validate_train_config

    config = text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig())
    text_format.Merge(train, config.train_config)
    with pytest.raises(ConfigError) as info:
        validate_train_config(config)
    assert info.value.field == field
