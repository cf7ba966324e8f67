"""Optimizers, learning-rate schedules and gradient clipping (odl.train.optimizer_builder)."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.cli import train_cli
from odl.config.config_error import ConfigError
from odl.config.optimizer_support import optimizer_choices, table_optimizer_plan
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2
from odl.train.optimizer_builder import (
    DecoupledAdamW,
    FtrlProximal,
    GradientClipping,
    gradient_clipping,
    make_dense_optimizer,
    optimizer_specs,
    sparse_optimizer_args,
)
from odl.train.rate_schedules import (
    CosineAnnealingSchedule,
    CosineDecaySchedule,
    CosineWarmRestartsSchedule,
    LrSchedule,
    PolynomialDecaySchedule,
)
from odl.train.train_module import TrainModule
from tests.harness import REPO

ONLINE = f"{REPO}/samples/deepfm_online.config"

MODEL = """
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "c1" }
  input_fields { input_name: "c2" }
  label_fields: "label"
}
feature_config {
  features { input_names: "x" feature_type: RawFeature }
  features { input_names: "c1" hash_bucket_size: 100 embedding_dim: 4 }
  features { input_names: "c2" hash_bucket_size: 100 embedding_dim: 4 }
}
model_config {
  model_class: "DeepFM"
  feature_groups { group_name: "wide" feature_names: ["c1", "c2"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["c1", "c2", "x"] wide_deep: DEEP }
  deepfm { dnn { hidden_units: [8] } }
}
"""


def train_config(text: str) -> pipeline_pb2.TrainConfig:
    return text_format.Parse(text, pipeline_pb2.TrainConfig())


def easyrec_lr(schedule: str) -> pipeline_pb2.TrainConfig:
    return train_config(
        f"optimizer_config {{ sgd_optimizer {{ learning_rate {{ {schedule} }} }} }}")


# --------------------------------------------------------------------------- schedules


def test_easyrec_cosine_decay_with_warmup_and_hold() -> None:
    tc = easyrec_lr("cosine_decay_learning_rate { learning_rate_base: 0.1 total_steps: 100 "
                    "warmup_learning_rate: 0.01 warmup_steps: 10 hold_base_rate_steps: 20 }")
    s = optimizer_specs(tc)[0].schedule
    assert isinstance(s, CosineDecaySchedule)
    assert s(0) == pytest.approx(0.01)
    assert s(5) == pytest.approx(0.01 + 0.09 * 5 / 10)
    assert s(10) == s(25) == s(30) == pytest.approx(0.1)
    for step in (31, 50, 65, 99, 100):
        want = 0.5 * 0.1 * (1 + math.cos(math.pi * (step - 30) / 70))
        assert s(step) == pytest.approx(want), step
    assert s(65) == pytest.approx(0.05)
    assert s(101) == 0.0


def test_easyrec_poly_decay() -> None:
    tc = easyrec_lr("poly_decay_learning_rate { learning_rate_base: 0.2 total_steps: 50 "
                    "power: 2 end_learning_rate: 0.02 }")
    s = optimizer_specs(tc)[0].schedule
    assert isinstance(s, PolynomialDecaySchedule)
    for step in (0, 10, 25, 49, 50, 500):
        want = (0.2 - 0.02) * (1 - min(step, 50) / 50) ** 2 + 0.02
        assert s(step) == pytest.approx(want), step
    assert s(25) == pytest.approx(0.18 * 0.25 + 0.02)


def test_easyrec_exponential_burnin() -> None:
    tc = easyrec_lr("exponential_decay_learning_rate { initial_learning_rate: 0.1 "
                    "decay_steps: 10 decay_factor: 0.5 burnin_learning_rate: 0.02 "
                    "burnin_steps: 8 min_learning_rate: 0.03 }")
    s = optimizer_specs(tc)[0].schedule
    # burn-in ramps 0.02 -> 0.1, floored at min_learning_rate; decay counts from its end
    assert [s(k) for k in (0, 4, 8, 17, 18, 28, 200)] == pytest.approx(
        [0.03, 0.06, 0.1, 0.1, 0.05, 0.03, 0.03])
    flat = easyrec_lr("exponential_decay_learning_rate { initial_learning_rate: 0.1 "
                      "decay_steps: 10 decay_factor: 0.5 burnin_steps: 5 }")
    assert optimizer_specs(flat)[0].schedule(3) == pytest.approx(0.1)  # burnin lr 0: hold
    assert optimizer_specs(flat)[0].schedule(15) == pytest.approx(0.05)


def test_tzrec_exponential_warmup_and_cosine_annealing() -> None:
    tc = train_config("""
      sparse_optimizer { sgd_optimizer { lr: 0.1 }
        exponential_decay_learning_rate { decay_size: 10 decay_factor: 0.5 warmup_size: 4
          warmup_learning_rate: 0.02 min_learning_rate: 0.05 } }
      dense_optimizer { sgd_optimizer { lr: 0.2 }
        cosine_annealing_learning_rate { T_max: 40 min_learning_rate: 0.01 warmup_size: 5 } }
    """)
    sparse, dense = optimizer_specs(tc)
    # warm-up not floored at min_learning_rate (TorchEasyRec)
    assert [sparse.schedule(k) for k in (0, 2, 4, 13, 14, 1000)] == pytest.approx(
        [0.02, 0.06, 0.1, 0.1, 0.05, 0.05])
    assert isinstance(dense.schedule, CosineAnnealingSchedule)
    assert dense.schedule(0) == 0.0 and dense.schedule(1) == pytest.approx(0.04)
    for step in (5, 15, 25, 45, 100):
        t = min(step - 5, 40)
        want = 0.01 + (0.2 - 0.01) * 0.5 * (1 + math.cos(math.pi * t / 40))
        assert dense.schedule(step) == pytest.approx(want), step
    assert dense.schedule(25) == pytest.approx(0.105)
    # TorchEasyRec's field names win over odl's older ones; decay_factor defaults to 0.95
    only_size = train_config("sparse_optimizer { sgd_optimizer { lr: 1.0 } "
                             "exponential_decay_learning_rate { decay_size: 1 decay_steps: 99 } }")
    assert optimizer_specs(only_size)[0].schedule(1) == pytest.approx(0.95)


def test_easyrec_manual_steps_switch_at_their_step_and_transformer() -> None:
    """EasyRec's manual stepping (object detection's): the rate of an entry from its step on;
    with warmup a ramp to the first entry's rate; the Transformer's noam schedule."""
    entries = "schedule { step: 4 learning_rate: 0.2 } schedule { step: 10 learning_rate: 0.05 }"
    s = optimizer_specs(easyrec_lr(
        f"manual_step_learning_rate {{ initial_learning_rate: 0.1 {entries} }}"))[0].schedule
    assert [s(k) for k in (0, 3, 4, 9, 10, 500)] == pytest.approx(
        [0.1, 0.1, 0.2, 0.2, 0.05, 0.05])
    ramp = optimizer_specs(easyrec_lr(
        f"manual_step_learning_rate {{ initial_learning_rate: 0.1 {entries} warmup: true }}"
    ))[0].schedule
    assert [ramp(k) for k in (0, 1, 2, 3, 4, 10)] == pytest.approx(
        [0.1, 0.125, 0.15, 0.175, 0.2, 0.05])
    noam = optimizer_specs(easyrec_lr(
        "transformer_learning_rate { learning_rate_base: 2.0 hidden_size: 64 "
        "warmup_steps: 100 step_scaling_rate: 0.5 }"))[0].schedule
    for step in (0, 50, 199, 200, 201, 5000):
        s_, w = step * 0.5 + 1, 100 * 0.5
        assert noam(step) == pytest.approx(2.0 / 8 * min(s_ * w ** -1.5, s_ ** -0.5)), step
    assert max(noam(k) for k in range(0, 400)) == pytest.approx(2.0 / 8 / math.sqrt(50),
                                                               rel=0.02)


def test_tzrec_manual_steps_switch_after_their_step_and_warm_restarts() -> None:
    """TorchEasyRec's ManualStepLR switches after a size's step (its bisect_left); cosine
    annealing with warm restarts restarts at lr each period, periods growing by T_mult."""
    tc = train_config("""
      sparse_optimizer { sgd_optimizer { lr: 0.1 }
        manual_step_learning_rate { schedule_sizes: [4, 10] learning_rates: [0.2, 0.05] } }
      dense_optimizer { sgd_optimizer { lr: 0.4 }
        cosine_annealing_warm_restarts_learning_rate { T_0: 4 T_mult: 2 min_learning_rate: 0.1
          warmup_size: 2 warmup_learning_rate: 0.0 } }
    """)
    sparse, dense = optimizer_specs(tc)
    assert [sparse.schedule(k) for k in (0, 4, 5, 10, 11)] == pytest.approx(
        [0.1, 0.1, 0.2, 0.2, 0.05])
    tc.sparse_optimizer.manual_step_learning_rate.warmup = True
    ramp = optimizer_specs(tc)[0].schedule
    assert [ramp(k) for k in (0, 2, 4, 5)] == pytest.approx([0.1, 0.15, 0.2, 0.2])

    def cosine(t: int, period: int) -> float:
        return 0.1 + 0.3 * 0.5 * (1 + math.cos(math.pi * t / period))

    # warm-up over 2 steps, then periods of 4, 8, 16 steps
    want = [0.0, 0.2] + [cosine(t, 4) for t in range(4)] + [cosine(t, 8) for t in range(8)] \
        + [cosine(t, 16) for t in range(16)] + [0.4]
    assert [dense.schedule(k) for k in range(len(want))] == pytest.approx(want)
    equal = CosineWarmRestartsSchedule(1.0, 5)
    assert [equal(k) for k in (0, 5, 10, 12)] == pytest.approx(
        [1.0, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi * 2 / 5))])


def test_schedule_dataclasses_at_chosen_steps() -> None:
    assert LrSchedule(0.1, 10, 0.5, warmup_steps=10, warmup_lr=0.0)(5) == pytest.approx(0.05)
    assert CosineDecaySchedule(1.0, 10)(5) == pytest.approx(0.5)
    assert PolynomialDecaySchedule(1.0, 10, 1.0)(3) == pytest.approx(0.7)
    assert CosineAnnealingSchedule(1.0, 10, 0.2)(10) == pytest.approx(0.2)


def test_train_module_applies_the_schedule_to_both_optimizers() -> None:
    c = text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig())
    text_format.Merge("""
      sparse_optimizer { sgd_optimizer { lr: 0.4 }
        cosine_annealing_learning_rate { T_max: 2 } }
      dense_optimizer { sgd_optimizer { lr: 0.2 momentum: 0 }
        cosine_annealing_learning_rate { T_max: 2 } }
    """, c.train_config)
    fb = FeatureBuilder(c)
    tm = TrainModule(c, fb, device="cpu")
    batch = fb.build(records(64, 1)).batch
    tm.train_step(batch)
    assert tm.current_learning_rates() == pytest.approx((0.2, 0.1))
    tm.train_step(batch)  # step 1 at half rates
    assert tm.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    assert tm.dense_optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    tables = {k: v.clone() for k, v in tm.embedding_tables().items()}
    dense = {k: v.clone() for k, v in tm.dense_parameters().items()}
    tm.train_step(batch)  # step 2: cosine at T_max -> rate 0, nothing moves
    assert all(torch.equal(v, tables[k]) for k, v in tm.embedding_tables().items())
    assert all(torch.equal(v, dense[k]) for k, v in tm.dense_parameters().items())


# --------------------------------------------------------------------------- FTRL


def ftrl_reference(w, grads, lr, power, init, l1, l2, shrink):
    """TF's ApplyFtrlV2, one coordinate at a time in float64."""
    w = [float(v) for v in w]
    n = [init] * len(w)
    z = [0.0] * len(w)
    for g_vec in grads:
        for i, g in enumerate(g_vec):
            g = float(g)
            g_s = g + 2 * shrink * w[i]
            n_new = n[i] + g * g
            z[i] += g_s - (n_new ** -power - n[i] ** -power) / lr * w[i]
            quad = n_new ** -power / lr + 2 * l2
            w[i] = (math.copysign(l1, z[i]) - z[i]) / quad if abs(z[i]) > l1 else 0.0
            n[i] = n_new
    return w


@pytest.mark.parametrize("power, l1, l2, shrink", [
    (-0.5, 0.0, 0.0, 0.0), (-0.5, 0.05, 0.1, 0.0), (-0.3, 0.02, 0.0, 0.05)])
def test_ftrl_matches_the_per_coordinate_reference(power, l1, l2, shrink) -> None:
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=6)
    grads = rng.normal(size=(7, 6))
    p = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    opt = FtrlProximal([p], lr=0.3, lr_power=power, initial_accumulator_value=0.1, l1=l1, l2=l2,
                       l2_shrinkage=shrink)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    want = ftrl_reference(w0, grads, 0.3, power, 0.1, l1, l2, shrink)
    np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-10, atol=1e-12)
    assert not np.allclose(want, w0)


def test_ftrl_l1_gives_exact_zeros() -> None:
    p = torch.nn.Parameter(torch.tensor([0.5, -2.0, 3.0]))
    opt = FtrlProximal([p], lr=0.1, l1=1.0)
    p.grad = torch.tensor([0.1, -0.2, 5.0])
    opt.step()
    assert p.detach().tolist()[:2] == [0.0, 0.0] and p.detach()[2] != 0


def test_ftrl_without_regularization_is_adagrad() -> None:
    """From the second update on (w0 = 0 makes the first one equal too)."""
    rng = np.random.default_rng(4)
    grads = torch.tensor(rng.normal(size=(5, 4)))
    a = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    fa = FtrlProximal([a], lr=0.1, initial_accumulator_value=0.1)
    fb = torch.optim.Adagrad([b], lr=0.1, initial_accumulator_value=0.1, eps=0.0)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        fa.step()
        fb.step()
    torch.testing.assert_close(a, b)


def test_easyrec_ftrl_and_adamw_build_dense_optimizers() -> None:
    tc = train_config("""
      optimizer_config { ftrl_optimizer { l1_reg: 10 learning_rate_power: -0.5
        learning_rate { constant_learning_rate { learning_rate: 0.0005 } } } }
      optimizer_config { adamw_optimizer { weight_decay: 0.01 } }
    """)
    sparse, dense = optimizer_specs(tc)
    assert (sparse.kind, dense.kind) == ("ftrl", "adamw")
    ftrl = make_dense_optimizer(sparse, [torch.nn.Parameter(torch.ones(2))])
    assert isinstance(ftrl, FtrlProximal) and ftrl.param_groups[0]["l1"] == 10
    p = torch.nn.Parameter(torch.ones(3))
    adamw = make_dense_optimizer(dense, [p])
    assert isinstance(adamw, DecoupledAdamW)
    p.grad = torch.zeros(3)
    adamw.step()  # zero gradient: only the decay, not scaled by the rate
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.99))
    mom = optimizer_specs(train_config(
        "optimizer_config { momentum_optimizer { momentum_optimizer_value: 0.8 } }"))[1]
    sgd = make_dense_optimizer(mom, [torch.nn.Parameter(torch.ones(1))])
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == pytest.approx(
        0.8)
    tz = optimizer_specs(train_config("dense_optimizer { sgd_optimizer { lr: 0.1 } } "
                                      "sparse_optimizer { sgd_optimizer { lr: 0.1 } }"))[1]
    opt = make_dense_optimizer(tz, [torch.nn.Parameter(torch.ones(1))])
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.9)  # TorchEasyRec's default


# --------------------------------------------------------------------------- clipping


def test_clipping_bounds_the_dense_gradient_norm() -> None:
    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3, 2))]
    opt = torch.optim.SGD(params, lr=0.1)
    params[0].grad = torch.full((5,), 3.0)
    params[1].grad = torch.full((3, 2), -4.0)
    before = math.sqrt(5 * 9 + 6 * 16)
    clip = gradient_clipping(train_config("gradient_clipping_by_norm: 2.0"))
    assert clip == GradientClipping("norm", 2.0)
    assert clip(opt) == pytest.approx(before)
    after = math.sqrt(sum(float((p.grad ** 2).sum()) for p in params))
    assert after == pytest.approx(2.0, rel=1e-5)
    # direction kept
    assert float(params[0].grad[0] / params[1].grad[0, 0]) == pytest.approx(-0.75)
    assert clip(opt) == pytest.approx(2.0, rel=1e-5)  # below the bound: unchanged
    assert after == pytest.approx(math.sqrt(sum(float((p.grad ** 2).sum()) for p in params)))
    value = gradient_clipping(train_config(
        'grad_clipping { clipping_type: "value" max_gradient: 0.5 }'))
    value(opt)
    assert float(max(p.grad.abs().max() for p in params)) == pytest.approx(0.5)
    assert gradient_clipping(train_config("")) is None


def test_train_module_clips_dense_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    c = text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig())
    text_format.Merge("gradient_clipping_by_norm: 0.001 optimizer_config { sgd_optimizer { "
                      "learning_rate { constant_learning_rate { learning_rate: 1.0 } } } }",
                      c.train_config)
    fb = FeatureBuilder(c)
    tm = TrainModule(c, fb, device="cpu")
    norms = []
    real_step = tm.dense_optimizer.step

    def step(*args, **kwargs):
        norms.append(math.sqrt(sum(float((p.grad ** 2).sum())
                                   for g in tm.dense_optimizer.param_groups for p in g["params"]
                                   if p.grad is not None)))
        return real_step(*args, **kwargs)

    monkeypatch.setattr(tm.dense_optimizer, "step", step)
    for seed in range(3):
        tm.train_step(fb.build(records(64, seed)).batch)
    assert len(norms) == 3 and max(norms) <= 0.001 * (1 + 1e-4)


# --------------------------------------------------------------------------- tables


def test_table_plans_per_device() -> None:
    ftrl = optimizer_choices(train_config(
        "optimizer_config { ftrl_optimizer { l1_reg: 10 } } optimizer_config { adam_optimizer {} }"
    ))[0]
    for device in ("cpu", "cuda"):  # FTRL as configured: row-sparse (test_table_optimizers)
        plan = table_optimizer_plan(ftrl, device)
        assert plan.row_sparse and plan.kernel == "sgd" and plan.note == ""
    mom = optimizer_choices(train_config("optimizer_config { momentum_optimizer {} }"))[0]
    assert table_optimizer_plan(mom, "cpu").row_sparse
    lamb = optimizer_choices(train_config("sparse_optimizer { lamb_optimizer { lr: 0.01 } }"))[0]
    assert table_optimizer_plan(lamb, "cuda").kernel == "lamb"
    assert table_optimizer_plan(lamb, "cpu").row_sparse  # fbgemm's rule, row-sparse
    adamw = optimizer_choices(train_config("optimizer_config { adamw_optimizer {} }"))[0]
    assert table_optimizer_plan(adamw, "cuda").row_sparse
    assert table_optimizer_plan(adamw, "cpu").row_sparse
    plain = optimizer_choices(train_config("optimizer_config { adagrad_optimizer {} }"))[0]
    assert table_optimizer_plan(plain, "cpu").note == ""


def test_ftrl_tables_on_cpu_train_row_sparse() -> None:
    c = text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig())
    text_format.Merge("""
      optimizer_config { ftrl_optimizer { l1_reg: 0.5
        learning_rate { constant_learning_rate { learning_rate: 0.05 } } } }
      optimizer_config { adam_optimizer { learning_rate { constant_learning_rate {
        learning_rate: 0.01 } } } }
    """, c.train_config)
    fb = FeatureBuilder(c)
    tm = TrainModule(c, fb, device="cpu")
    assert tm.row_sparse is not None
    before = {k: v.clone() for k, v in tm.embedding_tables().items()}
    losses = [tm.train_step(fb.build(records(128, 100 + k % 4)).batch).loss for k in range(24)]
    assert all(math.isfinite(x) for x in losses)
    assert any(not torch.equal(v, before[k]) for k, v in tm.embedding_tables().items())
    assert np.mean(losses[-4:]) < np.mean(losses[:4])
    # FTRL tables: an accumulator and a linear term per value
    states = tm.fused_optimizer.state_dict()["state"]
    assert states and all(len(s) == 2 for s in states.values())


def test_sparse_optimizer_args_for_row_sparse_kinds() -> None:
    ftrl = optimizer_specs(train_config("optimizer_config { ftrl_optimizer { learning_rate { "
                                        "constant_learning_rate { learning_rate: 0.3 } } } }"))[0]
    cls, kwargs = sparse_optimizer_args(ftrl, "cpu")  # the fused kernel's update a no-op
    assert cls is torch.optim.SGD and kwargs["lr"] == 0.0
    mom = optimizer_specs(train_config("optimizer_config { momentum_optimizer {} }"))[0]
    assert sparse_optimizer_args(mom, "cpu")[0] is torch.optim.SGD


# --------------------------------------------------------------------------- validation


def run_validate(model_dir: Path, doc: dict) -> tuple[int, str, str]:
    argv = ["--pipeline_config_path", ONLINE, "--device", "cpu", "--log_level", "CRITICAL",
            "--online", "--validate_only", "--model_dir", str(model_dir),
            "--edit_config_json", json.dumps(doc)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = train_cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_validate_only_reports_the_table_update(tmp_path: Path) -> None:
    rc, out, err = run_validate(tmp_path / "m", {
        "train_config.optimizer_config[0]": "ftrl_optimizer { l1_reg: 10 }"})
    assert rc == 0 and out.strip() == "config OK", (out, err)
    rc, out, err = run_validate(tmp_path / "m", {
        "train_config.optimizer_config[0]": "adagrad_optimizer {}"})
    assert rc == 0 and out.strip() == "config OK", (out, err)
    rc, out, err = run_validate(tmp_path / "m", {
        "train_config.optimizer_config[0]": "adamw_optimizer {}"})
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[-1] == "config OK"
    assert any(ln.startswith("note: train_config.optimizer_config[0].adamw_optimizer: ")
               and "lazy Adam" in ln for ln in lines)


@pytest.mark.parametrize("edit, field", [
    ("gradient_clipping_by_norm: -1", "train_config.gradient_clipping_by_norm"),
    ('grad_clipping { clipping_type: "nrom" }', "train_config.grad_clipping.clipping_type"),
    ("optimizer_config { ftrl_optimizer { learning_rate_power: 0.5 } }",
     "train_config.optimizer_config[0].ftrl_optimizer.learning_rate_power"),
    ("optimizer_config { sgd_optimizer { learning_rate { cosine_decay_learning_rate { "
     "total_steps: 10 warmup_steps: 10 } } } }",
     "train_config.optimizer_config[0].sgd_optimizer.learning_rate"
     ".cosine_decay_learning_rate.total_steps"),
    ("optimizer_config { sgd_optimizer { learning_rate { poly_decay_learning_rate { "
     "learning_rate_base: 0.1 total_steps: 10 } } } }",
     "train_config.optimizer_config[0].sgd_optimizer.learning_rate"
     ".poly_decay_learning_rate.power"),
    ("sparse_optimizer { sgd_optimizer { lr: 0.1 } cosine_annealing_learning_rate { "
     "T_max: 5 by_epoch: true } } dense_optimizer { sgd_optimizer { lr: 0.1 } }",
     "train_config.sparse_optimizer.cosine_annealing_learning_rate.by_epoch"),
    ("optimizer_config { sgd_optimizer { learning_rate { manual_step_learning_rate { "
     "schedule { step: 5 } schedule { step: 5 } } } } }",
     "train_config.optimizer_config[0].sgd_optimizer.learning_rate"
     ".manual_step_learning_rate.schedule[1].step"),
    ("optimizer_config { sgd_optimizer { learning_rate { manual_step_learning_rate { } } } }",
     "train_config.optimizer_config[0].sgd_optimizer.learning_rate"
     ".manual_step_learning_rate.schedule[0].step"),
    ("optimizer_config { sgd_optimizer { learning_rate { transformer_learning_rate { "
     "learning_rate_base: 1 warmup_steps: 10 } } } }",
     "train_config.optimizer_config[0].sgd_optimizer.learning_rate"
     ".transformer_learning_rate.hidden_size"),
    ("sparse_optimizer { sgd_optimizer { lr: 0.1 } manual_step_learning_rate { "
     "schedule_sizes: [5, 9] learning_rates: [0.1] } } "
     "dense_optimizer { sgd_optimizer { lr: 0.1 } }",
     "train_config.sparse_optimizer.manual_step_learning_rate.learning_rates"),
    ("sparse_optimizer { sgd_optimizer { lr: 0.1 } } dense_optimizer { sgd_optimizer { "
     "lr: 0.1 } cosine_annealing_warm_restarts_learning_rate { T_0: 0 } }",
     "train_config.dense_optimizer.cosine_annealing_warm_restarts_learning_rate.T_0"),
])
def test_validation_names_the_optimizer_field(edit: str, field: str) -> None:
    from odl.config.pipeline_config import load_pipeline_config

    config = load_pipeline_config(ONLINE)
    if "optimizer" in edit:
        config.train_config.ClearField("optimizer_config")
    text_format.Merge(edit, config.train_config)
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(config, online=True)
    assert info.value.field == field


# --------------------------------------------------------------------------- data


_W = np.random.default_rng(0).normal(0, 1.5, size=(2, 100))


def records(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 100, size=(n, 2))
    x = rng.normal(size=n)
    logit = _W[0, ids[:, 0]] + _W[1, ids[:, 1]] + x
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    return [f"{labels[i]},{x[i]:.4f},a{ids[i, 0]},b{ids[i, 1]}".encode() for i in range(n)]
