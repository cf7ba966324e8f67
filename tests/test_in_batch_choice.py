"""In-batch learning decided by the stream (``odl.train.in_batch.in_batch_choice``).

The contract: a config that does not write ``in_batch_learning`` starts measuring the
shift's gain (the shift and per-record Adagrad at every step, the wide tables at their
unadapted rate in the logit's space); after the run's first window, ``OFF_WINDOWS`` windows
in a row with a mean gain under ``OFF_BELOW`` turn it off (one step in ``PROBE_EVERY`` still
measuring), one of at least ``ON_ABOVE`` turns it on with its wide rate, and so do the
gains of an open window (after the run's first ``WARM_RECORDS`` records) that clear
``ON_ABOVE`` by ``EARLY_Z`` standard errors; a written ``true`` is on throughout, a written
``false`` or a config in-batch learning cannot train is off. Checkpoints carry the decision.
"""

from __future__ import annotations

import numpy as np
import pytest

from odl.config.in_batch_settings import IN_BATCH_AUTO, IN_BATCH_OFF, IN_BATCH_ON, in_batch_mode
from odl.datagen.datagen_config import bursty_config_text
from odl.train.in_batch import in_batch_choice
from odl.train.in_batch.in_batch_choice import (
    EARLY_MIN_GAINS,
    EARLY_Z,
    OFF_BELOW,
    OFF_WINDOWS,
    ON_ABOVE,
    PROBE_EVERY,
    WARM_RECORDS,
    WINDOW_MIN_STEPS,
    WINDOW_RECORDS,
    InBatchChoice,
)
from odl.train.in_batch.in_batch_learning import ShiftGain
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import load_config_text
from tests.test_in_batch_learning import ADAGRAD, _module, _records
from tests.test_wide_rate import FINAL_DNN

BATCH = 64


def _feed(choice: InBatchChoice, gain: ShiftGain, step_gain: float, steps: int,
          records: int = 512, spread: float = 0.0) -> list[str]:
    """``steps`` steps of ``records`` records each measuring ``step_gain`` where they
    shift (``spread`` added and taken off in turn); the phase after each."""
    phases = []
    for step in range(steps):
        shifted = choice.shifting(step)
        if shifted:  # (measured at once here; a module measures it with the next step)
            gain.observe(1.0, 1.0 - step_gain - (spread if gain.steps % 2 else -spread))
        choice.end_step(gain, records, shifted)
        phases.append(choice.phase)
    return phases


def _window_steps(records: int = 512) -> int:
    return max(-(-WINDOW_RECORDS // records), WINDOW_MIN_STEPS)


def test_the_first_window_decides_nothing_then_low_gains_turn_it_off():
    choice, gain = InBatchChoice(auto=True), ShiftGain()
    w = _window_steps()
    phases = _feed(choice, gain, OFF_BELOW / 2, w)
    assert set(phases) == {"measuring"} and choice.windows == 1
    phases = _feed(choice, gain, OFF_BELOW / 2, w * OFF_WINDOWS)
    assert phases[-1] == "off" and phases[:-1] == ["measuring"] * (w * OFF_WINDOWS - 1)
    assert choice.window_gain == pytest.approx(OFF_BELOW / 2) and choice.switches == 1
    # off: one step in PROBE_EVERY shifts, without per-record Adagrad or the wide rate
    assert [choice.shifting(s) for s in range(2 * PROBE_EVERY)] == [
        s % PROBE_EVERY == 0 for s in range(2 * PROBE_EVERY)]
    assert not choice.per_record and not choice.wide_engaged


def test_a_high_gain_turns_it_on_and_off_turns_on_again_when_probes_see_it():
    """Window by window: the gains spread too widely for a window to decide before its end."""
    choice, gain = InBatchChoice(auto=True), ShiftGain()
    w = _window_steps()
    _feed(choice, gain, ON_ABOVE * 2, w, spread=0.05)
    assert choice.phase == "measuring" and not choice.wide_engaged and choice.per_record
    assert choice.window_gain == pytest.approx(ON_ABOVE * 2)  # (the first decides nothing)
    _feed(choice, gain, ON_ABOVE * 2, w, spread=0.05)
    assert choice.phase == "on" and choice.wide_engaged
    _feed(choice, gain, (OFF_BELOW + ON_ABOVE) / 2, 3 * w)  # between: on stays on
    assert choice.phase == "on" and choice.switches == 1
    _feed(choice, gain, 0.0, w * (OFF_WINDOWS - 1))
    _feed(choice, gain, ON_ABOVE, w)  # low windows must come in a row
    _feed(choice, gain, 0.0, w * (OFF_WINDOWS - 1))
    assert choice.phase == "on"
    _feed(choice, gain, 0.0, w)
    assert choice.phase == "off"
    # off: the window fills from the probe steps only
    phases = _feed(choice, gain, ON_ABOVE * 2, PROBE_EVERY * w, spread=0.05)
    assert phases.index("on") == PROBE_EVERY * (w - 1) and phases[-1] == "on"


def test_a_clear_gain_turns_it_on_before_the_window_ends_even_the_first():
    """Gains that clear ON_ABOVE by EARLY_Z standard errors decide at once, from the run's
    WARM_RECORDS-th record on: a fresh model's high first gains count for nothing."""
    records = 512
    choice, gain = InBatchChoice(auto=True), ShiftGain()
    warm = WARM_RECORDS // records
    phases = _feed(choice, gain, 1.0, warm)  # a fresh model's gains: no decision
    phases += _feed(choice, gain, ON_ABOVE * 1.5, 2 * EARLY_MIN_GAINS, records, spread=1e-4)
    assert phases.index("on") == warm + EARLY_MIN_GAINS - 1
    assert choice.windows == 1 and choice.switches == 1 and choice.wide_engaged
    assert choice.window_gain > ON_ABOVE * 1.5  # the window closed there, the warm gains in
    # the same mean with a spread whose standard error is more than a third of the margin
    # over ON_ABOVE: the window's end decides
    choice, gain = InBatchChoice(auto=True), ShiftGain()
    margin = ON_ABOVE * 0.5
    spread = 2 * margin / EARLY_Z * np.sqrt(2 * _window_steps(records))
    phases = _feed(choice, gain, ON_ABOVE * 1.5, 2 * _window_steps(records), records,
                   spread=spread)
    assert phases.index("on") == 2 * _window_steps(records) - 1
    # a fresh model's high gains alone never turn it on early
    choice, gain = InBatchChoice(auto=True), ShiftGain()
    phases = _feed(choice, gain, 1.0, warm) + _feed(choice, gain, 0.0, _window_steps(records))
    assert "on" not in phases


def test_a_written_true_stays_on_whatever_the_gain():
    choice, gain = InBatchChoice(auto=False), ShiftGain()
    assert set(_feed(choice, gain, -0.5, 5 * _window_steps())) == {"on"}
    assert choice.windows == 0 and choice.status()["mode"] == "on"


def test_a_restored_choice_continues_as_the_uninterrupted_one():
    w = _window_steps()
    gains = np.random.default_rng(3).uniform(-0.002, 0.006, 6 * w)
    a, ga = InBatchChoice(auto=True), ShiftGain()
    cut = 2 * w + 5
    for g in gains[:cut]:
        _feed(a, ga, float(g), 1)
    b, gb = InBatchChoice(auto=True), ShiftGain()  # a restart: the gain measured anew
    b.load_state_dict(a.state_dict(), gb)
    for g in gains[cut:]:
        _feed(a, ga, float(g), 1)
        _feed(b, gb, float(g), 1)
        assert b.state_dict() == a.state_dict()
    assert a.windows >= 5


@pytest.mark.parametrize("extra,optimizer,mode", [
    ("", ADAGRAD, IN_BATCH_AUTO),
    ("in_batch_learning: true", ADAGRAD, IN_BATCH_ON),
    ("in_batch_learning: false", ADAGRAD, IN_BATCH_OFF),
    ("", "adam_optimizer", IN_BATCH_OFF),  # in-batch learning cannot train Adam tables
])
def test_the_mode_follows_what_the_config_writes_and_allows(tmp_path, extra, optimizer, mode):
    text = bursty_config_text(str(tmp_path / "m"), buckets=4096, extra_train=extra)
    config = load_config_text(text.replace(ADAGRAD, optimizer, 1))
    assert in_batch_mode(config) == mode
    tm, _ = _module(config)
    status = tm.in_batch_status()
    assert status["mode"] == mode
    if mode == IN_BATCH_OFF:
        assert tm.row_pair_learning is None
        assert ("why" in status) == (not extra)  # unwritten: what keeps it off
        if not extra:
            assert "Adam" in status["why"] or "adam" in status["why"]


def _noise_records(n: int, seed: int) -> list[bytes]:
    """Bursty records with labels drawn at random: the batch's earlier records teach its
    later ones nothing."""
    rng = np.random.default_rng(seed)
    out = []
    for r in _records(n, seed=seed):
        fields = r.split(b",")
        fields[2] = b"1" if rng.random() < 0.3 else b"0"
        out.append(b",".join(fields))
    return out


def _auto_config(tmp_path, name: str):
    text = bursty_config_text(str(tmp_path / name), batch_size=BATCH, sparse_lr=0.1,
                              buckets=4096)
    return load_config_text(text)


def test_measuring_puts_the_wide_rate_as_written_in_the_logits_space_then_on_adapts_it(
        tmp_path, monkeypatch):
    """Through a final DNN: while measuring the wide tables learn at the table rate over the
    logit's sensitivity to them (no multiplier written: level 1, not adapted); once on (here
    at the second window whatever the gain) at in-batch learning's adapted rate."""
    monkeypatch.setattr(in_batch_choice, "WINDOW_RECORDS", 4 * BATCH)
    monkeypatch.setattr(in_batch_choice, "WINDOW_MIN_STEPS", 4)
    monkeypatch.setattr(in_batch_choice, "ON_ABOVE", -1.0)
    monkeypatch.setattr(in_batch_choice, "OFF_BELOW", -2.0)
    monkeypatch.setattr(in_batch_choice, "EARLY_MIN_GAINS", 10**9)
    text = bursty_config_text(str(tmp_path / "a"), batch_size=BATCH, sparse_lr=0.1,
                              buckets=4096).replace("wide_output_dim: 1", FINAL_DNN)
    tm, fb = _module(load_config_text(text))
    records = _records(12 * BATCH)
    wide_lrs, expected = [], []
    for k in range(0, len(records), BATCH):
        measuring = tm.row_pair_learning.choice.measuring
        expected.append(tm.row_pair_learning.wide_multiplier())
        if measuring:
            assert expected[-1] == tm.wide_rate.at_level(1.0)
        tm.train_step(fb.build(records[k:k + BATCH]).batch)
        groups = tm.rates.fused_groups(tm.fused_optimizer)
        # the wide tables in a kernel of their own from the start (at a multiplier of 1
        # TorchRec would otherwise fuse them with the others), the others at the table rate
        assert sorted(wide for _, wide in groups) == [False, True]
        assert [g["lr"] for g, wide in groups if not wide] == [pytest.approx(0.1)]
        wide_lrs.append({g["lr"] for g, wide in groups if wide}.pop())
    choice = tm.row_pair_learning.choice
    assert choice.windows == 3 and choice.phase == "on", choice.status()
    assert choice.switches == 1
    assert tm.in_batch_gain.steps == 11  # every step shifted (the last one unmeasured yet)
    assert wide_lrs == [pytest.approx(0.1 * m, rel=1e-6) for m in expected]
    assert expected[0] == 1.0 and tm.wide_rate.sensitivity < 0.5
    assert min(expected[1:8]) > 2.0  # measuring: 1 / s, the table rate in the logit's space
    # on from the ninth step: the level (3, adapted) over the sensitivity, as true would
    assert min(expected[8:]) > 2 * max(expected[1:8])
    assert tm.row_pair_learning.wide_multiplier() == pytest.approx(tm.wide_rate.multiplier)


def test_a_stream_without_bursts_turns_it_off_and_off_steps_train_as_plain_ones(
        tmp_path, monkeypatch):
    """Labels at random: the gain falls under OFF_BELOW and in-batch learning goes off;
    from there a step that does not probe changes the tables
    exactly as a module with ``in_batch_learning: false`` from the same state."""
    monkeypatch.setattr(in_batch_choice, "WINDOW_RECORDS", 8 * BATCH)
    monkeypatch.setattr(in_batch_choice, "WINDOW_MIN_STEPS", 8)
    config = _auto_config(tmp_path, "a")
    tm, fb = _module(config)
    records = iter(_noise_records(200 * BATCH, seed=5))

    def batch():
        return fb.build([next(records) for _ in range(BATCH)]).batch

    while tm.row_pair_learning.choice.phase != "off":
        tm.train_step(batch())  # (StopIteration: never off)
    assert tm.row_pair_learning.choice.window_gain < OFF_BELOW
    while tm.global_step % PROBE_EVERY == 0:  # (a probe step next: step past it)
        tm.train_step(batch())
    plain_config = load_config_text(
        bursty_config_text(str(tmp_path / "p"), batch_size=BATCH, sparse_lr=0.1,
                           buckets=4096, extra_train="in_batch_learning: false"))
    plain, _ = _module(plain_config)
    plain.load_checkpoint_state(tm.state_dict_for_checkpoint())
    last = batch()
    a, b = tm.train_step(last), plain.train_step(last)
    np.testing.assert_array_equal(a.probs, b.probs)
    for name, t in tm.embedding_tables().items():
        np.testing.assert_array_equal(t.numpy(), plain.embedding_tables()[name].numpy(), name)


def test_a_restored_module_continues_its_window_and_decision(tmp_path, monkeypatch):
    """A restore brings the phase and the open window back: the restored run predicts as
    the uninterrupted one and takes the same decisions (its open window misses the gain of
    the step before the restart, which is measured when the next step runs)."""
    monkeypatch.setattr(in_batch_choice, "WINDOW_RECORDS", 6 * BATCH)
    monkeypatch.setattr(in_batch_choice, "WINDOW_MIN_STEPS", 6)
    monkeypatch.setattr(in_batch_choice, "ON_ABOVE", -1.0)  # on at the second window
    monkeypatch.setattr(in_batch_choice, "OFF_BELOW", -2.0)
    config = _auto_config(tmp_path, "a")
    records = _records(20 * BATCH, seed=4)
    a, fa = _module(config)
    for k in range(0, 8 * BATCH, BATCH):  # one window and two steps of the second
        a.train_step(fa.build(records[k:k + BATCH]).batch)
    b, fb = _module(config)
    b.load_checkpoint_state(a.state_dict_for_checkpoint())
    assert b.row_pair_learning.choice.state_dict() == a.row_pair_learning.choice.state_dict()
    for k in range(8 * BATCH, len(records), BATCH):
        np.testing.assert_array_equal(b.train_step(fb.build(records[k:k + BATCH]).batch).probs,
                                      a.train_step(fa.build(records[k:k + BATCH]).batch).probs)
        assert b.row_pair_learning.choice.phase == a.row_pair_learning.choice.phase
    assert a.row_pair_learning.choice.windows == b.row_pair_learning.choice.windows == 3
    assert a.row_pair_learning.choice.phase == "on"


def test_status_and_metrics_show_the_decision(tmp_path):
    config = _auto_config(tmp_path, "t")
    config.train_config.save_checkpoints_steps = 0
    csv_path = tmp_path / "train.csv"
    csv_path.write_bytes(b"\n".join(_records(5 * BATCH)) + b"\n")
    config.train_input_path = str(csv_path)
    trainer = Trainer(config, TrainerOptions(online=False, device="cpu", status_port=-1))
    assert trainer.run() == 0
    shown = trainer.status()["in_batch"]
    assert shown["mode"] == "auto" and shown["phase"] == "measuring", shown
    assert shown["wide_multiplier"] == 1.0 and shown["steps_measured"] == 4
    registry = trainer.metrics.registry
    assert registry.get_sample_value("odl_in_batch_active") == 1
    assert registry.get_sample_value("odl_wide_rate_multiplier") == 1.0
