"""The wide tables' rate under in-batch learning (``odl.train.in_batch.wide_rate``).

The contract: the wide tables learn at ``level / s`` times the table rate, ``s`` the logit's
measured sensitivity to the wide part (1 for a wide part of width 1 added to the logit), as
the step before left it; every few steps probes on the step's own records move the level
toward a larger or smaller rate, never below the written multiplier, changing nothing else;
checkpoints carry it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.datagen_config import bursty_config_text
from odl.train.in_batch.wide_rate import LEVEL_RECORDS, LEVEL_STEP, PROBE_EVERY, QUANTUM
from odl.train.train_module import TrainModule
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import load_config_text
from tests.test_in_batch_learning import _module, _records

SPARSE_LR = 0.05
# EasyRec's structure: the wide part and FM read by the final DNN only (odl's defaults also
# add them to the logit, wide_to_logit and fm_to_logit)
FINAL_DNN = ("final_dnn { hidden_units: [16] }\n    wide_output_dim: 4\n    wide_to_logit: false"
             "\n    fm_to_logit: false")


def _config(tmp_path, extra: str = "", final_dnn: bool = True, batch: int = 64):
    text = bursty_config_text(str(tmp_path / "m"), batch_size=batch, sparse_lr=SPARSE_LR,
                              buckets=4096, extra_train="in_batch_learning: true " + extra)
    if final_dnn:
        assert "wide_output_dim: 1" in text
        text = text.replace("wide_output_dim: 1", FINAL_DNN)
    return load_config_text(text)


def _wide_sensitivity(tm: TrainModule, batch) -> float:
    """The mean over records and wide lookups of ``sum |dlogit / d wide pooled|``, by
    autograd on the model at its current state."""
    out = tm.dmp(batch.to(tm.device))
    grads = torch.autograd.grad(out.logits.sum(), out.pooled, allow_unused=True)
    norms = []
    for group, grad in zip(tm.model.pooled_layout, grads, strict=True):
        column = 0
        for (_feature, table), dim in zip(group.lookups, group.dims, strict=True):
            if table.endswith("_wide"):
                assert grad is not None
                norms.append(grad[:, column:column + dim].abs().sum(1).mean().item())
            column += dim
    assert norms
    return float(np.mean(norms))


def _wide_lr(tm: TrainModule) -> float:
    (lr,) = {g["lr"] for g, wide in tm.rates.fused_groups(tm.fused_optimizer) if wide}
    return lr


def test_the_wide_rate_is_the_level_over_the_logits_sensitivity(tmp_path):
    """Through a final DNN the logit reads the wide part weakly (s well below 1): the wide
    tables learn at level / s (1 / s rounded to 1/32 of an octave) from the next step, and
    the fused kernel runs at that rate: a wide row that no record read before moves by the
    rate in every column at its first Adagrad step."""
    tm, fb = _module(_config(tmp_path, "wide_learning_rate_multiplier: 2 "
                                       "wide_rate_adaptation: false per_record_adagrad: false"))
    records = _records(128)
    first, second = fb.build(records[:64]).batch, fb.build(records[64:]).batch
    expected = _wide_sensitivity(tm, first)
    tm.train_step(first)
    rate = tm.wide_rate
    assert rate.sensitivity == pytest.approx(expected, rel=1e-5)
    assert rate.sensitivity < 0.5  # the case the rate is for
    octaves = round(-math.log2(expected) * QUANTUM) / QUANTUM
    assert rate.multiplier == pytest.approx(2.0 * 2.0 ** octaves, rel=1e-6)
    assert _wide_lr(tm) == pytest.approx(SPARSE_LR * 2.0, rel=1e-6)  # step 1: the level
    before = {k: v.clone() for k, v in tm.embedding_tables().items()}
    seen = {f: set(first.sparse[f].values().tolist()) for f in first.sparse.keys()}
    tm.train_step(second)
    lr = _wide_lr(tm)
    assert lr == pytest.approx(SPARSE_LR * 2.0 * 2.0 ** octaves, rel=1e-6)
    checked = 0
    for feature in ("user_id", "item_id"):
        rows = sorted(set(second.sparse[feature].values().tolist()) - seen[feature])
        moved = (tm.embedding_tables()[f"{feature}_wide"][rows]
                 - before[f"{feature}_wide"][rows]).abs()
        big = moved[moved > 0.5 * lr]  # (columns whose gradient is not ~0 against eps)
        checked += big.numel()
        # (Adagrad's eps takes a relative eps / |S| off a column with a small gradient S)
        torch.testing.assert_close(big, torch.full_like(big, lr), rtol=5e-3, atol=0)
    assert checked > 40


def test_a_wide_part_added_to_the_logit_learns_at_the_written_multiplier(tmp_path):
    tm, fb = _module(_config(tmp_path, "wide_learning_rate_multiplier: 2.5 "
                                       "wide_rate_adaptation: false", final_dnn=False))
    records = _records(192)
    for k in range(0, 192, 64):
        tm.train_step(fb.build(records[k:k + 64]).batch)
    assert tm.wide_rate.sensitivity == pytest.approx(1.0, abs=1e-6)
    assert tm.wide_rate.multiplier == 2.5
    assert _wide_lr(tm) == pytest.approx(SPARSE_LR * 2.5, rel=1e-6)


def test_an_unwritten_multiplier_starts_at_the_default_level(tmp_path):
    tm, _ = _module(_config(tmp_path, final_dnn=False))
    assert tm.wide_rate.level == 3.0 and tm.wide_rate.adapt


def _own_bias_bursts(n: int, bias_scale: float, burst: int = 32, seed: int = 0) -> list[bytes]:
    """Bursty-schema records in bursts of one user each, labelled by the user's own bias
    (normal with sd ``bias_scale``; 0: every label a fair coin)."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        user = k // burst
        bias = bias_scale * np.random.default_rng(1000 + user).normal()
        label = int(rng.random() < 1.0 / (1.0 + math.exp(-bias)))
        out.append(f"s{k},{1767225600 + k},{label},u{user},i{rng.integers(50)},"
                   f"c{rng.integers(5)},d{rng.integers(4)},h{rng.integers(24):02d}".encode())
    return out


@pytest.mark.parametrize("bias_scale,rises", [(2.0, True), (0.0, False)])
def test_the_level_rises_where_a_larger_rate_predicts_better_and_stays_at_least_written(
        tmp_path, bias_scale, rises):
    """Where each burst's labels follow its user's own bias, learning the user's wide weight
    faster predicts the burst's later records better: the level rises at the probes. Where
    labels are coin flips a larger rate only adds noise: the level stays at the written
    multiplier, never below it."""
    start = 0.5
    tm, fb = _module(_config(tmp_path, f"wide_learning_rate_multiplier: {start}",
                             final_dnn=False, batch=128))
    records = _own_bias_bursts(64 * 128, bias_scale)
    levels = []
    for k in range(0, len(records), 128):
        tm.train_step(fb.build(records[k:k + 128]).batch)
        levels.append(tm.wide_rate.level)
    assert tm.wide_rate.probes == 64 // PROBE_EVERY
    assert min(levels) >= start
    move = LEVEL_STEP * PROBE_EVERY * 128 / LEVEL_RECORDS  # a probe's move at batch 128
    if rises:  # (16 probes; at most 16 moves up)
        assert levels[-1] >= start * math.exp(12 * move) * (1 - 1e-6), levels
    else:
        assert levels[-1] < start * math.exp(4 * move), levels


def test_the_probes_change_nothing_but_the_level(tmp_path):
    """With and without adaptation, from the same start: the same predictions and tables
    through the first probe's step (the probe's own step trains at the current rate)."""
    records = _records(PROBE_EVERY * 64, seed=4)
    runs = {}
    for adapt in (True, False):
        tm, fb = _module(_config(tmp_path / str(adapt),
                                 f"wide_rate_adaptation: {str(adapt).lower()}"))
        probs = [tm.train_step(fb.build(records[k:k + 64]).batch).probs
                 for k in range(0, len(records), 64)]
        runs[adapt] = (np.concatenate(probs), tm)
    assert runs[True][1].wide_rate.probes == 1 and runs[False][1].wide_rate.probes == 0
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    for name, t in runs[True][1].embedding_tables().items():
        torch.testing.assert_close(t, runs[False][1].embedding_tables()[name], rtol=0, atol=0)


def test_a_restored_module_continues_as_the_one_that_wrote_the_checkpoint(tmp_path):
    """Level, sensitivity and probe schedule come back: the restored module's next steps,
    a probe's among them, predict and move the level as the first module's do."""
    config = _config(tmp_path, "wide_learning_rate_multiplier: 0.5")
    records = _records(18 * 64, seed=6)
    a, fa = _module(config)
    for k in range(0, 13 * 64, 64):
        a.train_step(fa.build(records[k:k + 64]).batch)
    assert a.wide_rate.level != 0.5  # the probes moved it
    b, fb = _module(config)
    b.load_checkpoint_state(a.state_dict_for_checkpoint())
    assert b.wide_rate.state_dict() == a.wide_rate.state_dict()
    assert b.wide_rate.multiplier == a.wide_rate.multiplier
    for k in range(13 * 64, len(records), 64):  # a probe's step among them
        np.testing.assert_array_equal(b.train_step(fb.build(records[k:k + 64]).batch).probs,
                                      a.train_step(fa.build(records[k:k + 64]).batch).probs)
        assert b.wide_rate.level == a.wide_rate.level


def test_status_and_metrics_show_the_wide_rate_and_the_shifts_gain(tmp_path):
    text = bursty_config_text(str(tmp_path / "m"), batch_size=64, buckets=4096,
                              extra_train="in_batch_learning: true")
    config = parse_pipeline_config_text(text.replace("wide_output_dim: 1", FINAL_DNN))
    config.train_config.save_checkpoints_steps = 0
    csv_path = tmp_path / "train.csv"
    csv_path.write_bytes(b"\n".join(_records(640)) + b"\n")
    config.train_input_path = str(csv_path)
    trainer = Trainer(config, TrainerOptions(online=False, device="cpu", status_port=-1))
    assert trainer.run() == 0
    shown = trainer.status()["wide_rate"]
    rate = trainer.module.wide_rate
    assert shown["level"] == pytest.approx(rate.level, abs=1e-4)
    assert shown["multiplier"] == pytest.approx(rate.multiplier, abs=1e-4)
    assert shown["probes"] == 10 // PROBE_EVERY and shown["adapting"] is True
    assert 0 < shown["sensitivity"] < 1
    registry = trainer.metrics.registry
    assert registry.get_sample_value("odl_wide_rate_level") == pytest.approx(rate.level)
    assert registry.get_sample_value("odl_wide_rate_multiplier") == pytest.approx(
        rate.multiplier)
    gain = trainer.module.in_batch_gain
    assert trainer.status()["in_batch"] == {
        "mode": "on", "phase": "on", "window_gain": None, "windows": 0, "switches": 0,
        "loss_gain": round(gain.value, 6), "steps_measured": 9,  # the last step's: unmeasured
        "wide_multiplier": round(rate.multiplier, 4), "loss_slopes": "closed_form"}
    assert registry.get_sample_value("odl_in_batch_loss_gain") == pytest.approx(gain.value)
